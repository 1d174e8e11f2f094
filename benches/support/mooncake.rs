//! The Mooncake replay workload shared by the KV index benches (`benches/kv_index.rs` and the
//! standalone `benches/kv_upstream/`, which includes this file by path): trace lines expanded to
//! blocks, and the exact LRU each simulated worker caches with. Both live in
//! `continuum_protocol::kv::mooncake` (shared with `continuum-router replay`).
//!
//! Each `hash_id` is 32 blocks of 16 tokens (`n = min(32 × len(hash_ids), input_length / 16)`),
//! `tokens_hash = splitmix64(h × 32 + j)`, `block_hash` chained with Dynamo's sequence hash.
//!
//! The trace lives in the repository, gzip-compressed: `benches/fixtures/mooncake/` (see its
//! README); [`read_trace`] reads a plain or a `.gz` JSONL file.

use std::io::Read;
use std::path::Path;

pub use continuum_protocol::kv::mooncake::{BlockLru as Lru, TraceBlocks as TraceRequest, expand};

pub const WORKERS: u64 = 16;
pub const LRU_BLOCKS: usize = 16_384;

/// A worker's cache at the benches' capacity.
pub fn lru() -> Lru {
    Lru::new(LRU_BLOCKS)
}

/// The conversation trace's file name under `benches/fixtures/mooncake/`.
pub const CONVERSATION_TRACE: &str = "conversation_trace.jsonl.gz";

/// The whole text of a JSONL trace, gunzipped when the name ends in `.gz`; `None` when the file
/// cannot be read or decoded.
pub fn read_trace(path: &Path) -> Option<String> {
    let bytes = std::fs::read(path).ok()?;
    if path.extension().is_some_and(|e| e == "gz") {
        let mut text = String::new();
        flate2::read::GzDecoder::new(bytes.as_slice())
            .read_to_string(&mut text)
            .ok()?;
        Some(text)
    } else {
        String::from_utf8(bytes).ok()
    }
}
