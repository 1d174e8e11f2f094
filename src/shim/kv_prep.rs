//! The KV preparation hook: renders and tokenizes a request's prompt and hashes its blocks, so the
//! shim can read overlaps from the KV index before the KV-aware picker decides.
//!
//! The real implementation (pinned tokenizer artifacts, bounded chat-template rendering) plugs in
//! through [`KvPromptPrep`] with `ShimRouter::set_kv_prep`. Until one is installed every request
//! scores without a KV term (`tokenizer_unavailable`).

use std::sync::Arc;

use continuum_protocol::kv::LocalBlockHash;
use continuum_protocol::kv::hashing::BlockSize;
use continuum_protocol::picker::KvUnavailable;
use futures::future::BoxFuture;

/// The most distinct block sizes one model is hashed for (seed: "up to two valid
/// kv_cache_block_size values per model").
pub const MAX_BLOCK_SIZES_PER_MODEL: usize = 2;

/// What the hook is asked to prepare.
#[derive(Clone, Copy, Debug)]
pub struct KvPrepRequest<'a> {
    /// The Dynamo display name (client model id after `shim.model_map`): whose tokenizer.
    pub model: &'a str,
    /// The outbound request body (client pins already stripped).
    pub body: &'a serde_json::Value,
    /// The valid block sizes the model's workers declare (at most
    /// [`MAX_BLOCK_SIZES_PER_MODEL`], ascending): hash the prompt once per size.
    pub block_sizes: &'a [BlockSize],
}

/// A rendered, tokenized prompt and its LocalBlockHashes per block size (complete blocks only,
/// seeded per dynamo-wire §11.2 with the request's LoRA name and cache salt).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparedPrompt {
    pub tokens: Arc<[u32]>,
    pub hashes: Vec<(BlockSize, Vec<LocalBlockHash>)>,
}

/// Why a prompt could not be prepared; each maps to a `continuum_dynamo_kv_selection_total`
/// result and the pick falls back to load-based selection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KvPrepFailure {
    #[error("no tokenizer is loaded for the model, or its workers disagree on one")]
    TokenizerUnavailable,
    #[error("the rendered prompt exceeds the text or token cap")]
    PromptTooLarge,
    #[error("the chat template could not be rendered within its limits")]
    RenderUnavailable,
    #[error("the model's tokenizer or template is not in kv.pinned_artifacts")]
    ArtifactUnpinned,
}

impl From<KvPrepFailure> for KvUnavailable {
    fn from(failure: KvPrepFailure) -> Self {
        match failure {
            KvPrepFailure::TokenizerUnavailable => KvUnavailable::TokenizerUnavailable,
            KvPrepFailure::PromptTooLarge => KvUnavailable::PromptTooLarge,
            KvPrepFailure::RenderUnavailable => KvUnavailable::RenderUnavailable,
            KvPrepFailure::ArtifactUnpinned => KvUnavailable::ArtifactUnpinned,
        }
    }
}

/// Renders, tokenizes and hashes a request's prompt for the KV-aware picker. Implementations do
/// their CPU work off the async threads (the blocking pool) and bound it.
pub trait KvPromptPrep: Send + Sync {
    fn prepare<'a>(
        &'a self,
        request: KvPrepRequest<'a>,
    ) -> BoxFuture<'a, Result<PreparedPrompt, KvPrepFailure>>;
}
