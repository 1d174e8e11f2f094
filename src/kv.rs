//! KV-aware selection in the daemon: the IO around `continuum_protocol::kv` (rendering prompts
//! on the blocking pool, with the chat template and tokenizer the fleet's cards name).
//!
//! | module | what it holds |
//! |---|---|
//! | [`template`] | [`ChatTemplate`]: HF chat templates on minijinja, no loader, bounded fuel |
//! | [`render`] | [`PromptRenderer`]: permits, deadline, tokenization, block hashes |
//! | [`hook`] | [`KvPromptPrep`]: the prompt preparation hook `route::dynamo` calls |
//! | [`prep`] | [`ArtifactPromptPrep`]: the production `KvPromptPrep` over pinned fleet artifacts |

pub mod hook;
pub mod prep;
pub mod render;
pub mod template;

pub use hook::{KvPrepRequest, KvPromptPrep};
pub use prep::ArtifactPromptPrep;
pub use render::{PrepareError, PreparedPrompt, PromptRenderer, RenderPermits};
pub use template::{ChatTemplate, SpecialTokens, TemplateError};
