//! The Mooncake replay workload shared by the KV index benches (`benches/kv_index.rs` and the
//! standalone `benches/kv_upstream/`, which includes this file by path): trace lines expanded to
//! blocks, and the exact LRU each simulated worker caches with. Both live in
//! `continuum_protocol::kv::mooncake` (shared with `continuum-router replay`).
//!
//! Each `hash_id` is 32 blocks of 16 tokens (`n = min(32 × len(hash_ids), input_length / 16)`),
//! `tokens_hash = splitmix64(h × 32 + j)`, `block_hash` chained with Dynamo's sequence hash.

pub use continuum_protocol::kv::mooncake::{BlockLru as Lru, TraceBlocks as TraceRequest, expand};

pub const WORKERS: u64 = 16;
pub const LRU_BLOCKS: usize = 16_384;

/// A worker's cache at the benches' capacity.
pub fn lru() -> Lru {
    Lru::new(LRU_BLOCKS)
}
