//! KV-aware selection in the daemon: the IO around `continuum_protocol::kv` (rendering prompts
//! on the blocking pool, with the chat template and tokenizer the fleet's cards name).
//!
//! | module | what it holds |
//! |---|---|
//! | [`hook`] | [`KvPromptPrep`]: the prompt preparation hook `route::dynamo` calls |
//! | [`prep`] | [`ArtifactPromptPrep`]: the production `KvPromptPrep` over pinned fleet artifacts |
//! | `template`, `render`, `token_cache` | re-exported from the `continuum-prompt` crate (prompt/): [`ChatTemplate`], [`PromptRenderer`], [`PromptTokenizer`] |
//!
//! Only [`hook`] is compiled without the `dynamo-kv` Cargo feature: the rest (and the
//! continuum-prompt crate with its tokenizers and minijinja dependencies) is not, and no
//! implementation of the hook is installed.

pub mod hook;
#[cfg(feature = "dynamo-kv")]
pub mod prep;
#[cfg(feature = "dynamo-kv")]
pub use continuum_prompt::{render, template, token_cache};

pub use hook::{KvPrepRequest, KvPromptPrep, PreparedPrompt};
#[cfg(feature = "dynamo-kv")]
pub use prep::ArtifactPromptPrep;
#[cfg(feature = "dynamo-kv")]
pub use render::{PrepareError, PromptRenderer, RenderPermits};
#[cfg(feature = "dynamo-kv")]
pub use template::{ChatTemplate, SpecialTokens, TemplateError};
#[cfg(feature = "dynamo-kv")]
pub use token_cache::{CacheLimits, CacheStats, PromptTokenizer};
