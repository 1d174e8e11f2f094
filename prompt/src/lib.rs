//! continuum-prompt: prompt rendering for KV-aware selection, the CPU work between a request body
//! and the block hashes the KV index is asked about. The daemon (`continuum_router::kv`, which
//! re-exports this crate) runs it on the blocking pool for the shim's pinned-artifact path;
//! `continuum-replay` renders request-log traces with it, so both hash prompts alike.
//!
//! | module | what it holds |
//! |---|---|
//! | [`template`] | [`ChatTemplate`]: HF chat templates on minijinja, no loader, bounded fuel; which are message-local (each message's text depends on it alone) |
//! | [`render`] | [`PromptRenderer`]: permits, deadline, tokenization, block hashes; a follow-up through a message-local template renders only its new messages |
//! | [`token_cache`] | [`PromptTokenizer`]: exact, bounded prefix cache so follow-up turns tokenize and hash only what is new |
//!
//! The bounds (fuel, sizes, permits, deadline) are `continuum_protocol::kv::prompt`'s; this crate
//! does the IO around them.

// Test code is exempt from the 120-line limit; product code is linted in the non-test build.
#![cfg_attr(test, allow(clippy::too_many_lines, reason = "test code is exempt"))]

pub mod render;
pub mod template;
pub mod token_cache;

pub use continuum_protocol::kv::prompt::PreparedPrompt;
pub use render::{ConversationStats, PrepareError, PromptRenderer, RenderPermits};
pub use template::{ChatTemplate, SpecialTokens, TemplateError};
pub use token_cache::{BlockHashes, CacheLimits, CacheStats, PromptTokenizer, Tokenized};
