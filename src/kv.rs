//! KV-aware selection in the daemon: the IO around `continuum_protocol::kv` (rendering prompts
//! on the blocking pool, with the chat template and tokenizer the fleet's cards name).
//!
//! | module | what it holds |
//! |---|---|
//! | [`template`] | [`ChatTemplate`]: HF chat templates on minijinja, no loader, bounded fuel |
//! | [`render`] | [`PromptRenderer`]: permits, deadline, tokenization, block hashes |
//! | [`hook`] | [`KvPromptPrep`]: the prompt preparation hook `route::dynamo` calls |
//! | [`prep`] | [`ArtifactPromptPrep`]: the production `KvPromptPrep` over pinned fleet artifacts |
//! | [`token_cache`] | [`PromptTokenizer`]: exact, bounded prefix cache so follow-up turns tokenize only what is new |

pub mod hook;
pub mod prep;
pub mod render;
pub mod template;
pub mod token_cache;

pub use hook::{KvPrepRequest, KvPromptPrep};
pub use prep::ArtifactPromptPrep;
pub use render::{PrepareError, PreparedPrompt, PromptRenderer, RenderPermits};
pub use template::{ChatTemplate, SpecialTokens, TemplateError};
pub use token_cache::{CacheLimits, CacheStats, PromptTokenizer};
