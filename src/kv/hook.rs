//! The KV preparation hook: renders and tokenizes a request's prompt and hashes its blocks, so
//! `route::dynamo` can read overlaps from the KV index before the KV-aware picker decides.
//!
//! The real implementation (`super::ArtifactPromptPrep`, with `dynamo-kv`: pinned tokenizer artifacts, bounded
//! chat-template rendering) plugs in through [`KvPromptPrep`] with `ShimRouter::set_kv_prep`.
//! Until one is installed every request scores without a KV term (`tokenizer_unavailable`). The
//! trait lives here, below `route`, so the implementation never imports the request path.

use continuum_protocol::kv::hashing::BlockSize;
use continuum_protocol::picker::KvUnavailable;
use futures::future::BoxFuture;

/// What the hook is asked to prepare.
#[derive(Clone, Copy, Debug)]
pub struct KvPrepRequest<'a> {
    /// The Dynamo display name (client model id after `shim.model_map`): whose tokenizer.
    pub model: &'a str,
    /// The outbound request body (client pins already stripped).
    pub body: &'a serde_json::Value,
    /// The valid block sizes the model's workers declare (at most
    /// [`continuum_protocol::kv::prompt::MAX_BLOCK_SIZES`], ascending): hash the prompt once per size.
    pub block_sizes: &'a [BlockSize],
}

// Why a prompt could not be prepared is the picker's `KvUnavailable` (each value is a
// `continuum_dynamo_kv_selection_total` result, and the pick falls back to load-based
// selection). The prepared prompt is `continuum_protocol::kv::prompt::PreparedPrompt`, below
// the renderer, so the hook and `route::dynamo` above it compile without `dynamo-kv`.
pub use continuum_protocol::kv::prompt::PreparedPrompt;

/// Renders, tokenizes and hashes a request's prompt for the KV-aware picker. Implementations do
/// their CPU work off the async threads (the blocking pool) and bound it.
pub trait KvPromptPrep: Send + Sync {
    fn prepare<'a>(
        &'a self,
        request: KvPrepRequest<'a>,
    ) -> BoxFuture<'a, Result<PreparedPrompt, KvUnavailable>>;
}
