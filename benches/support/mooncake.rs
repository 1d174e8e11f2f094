//! The Mooncake replay workload shared by the KV index benches (`benches/kv_index.rs` and the
//! standalone `benches/kv_upstream/`, which includes this file by path): trace lines expanded to
//! blocks, and the exact LRU each simulated worker caches with.
//!
//! Each `hash_id` is 32 blocks of 16 tokens (`n = min(32 × len(hash_ids), input_length / 16)`),
//! `tokens_hash = splitmix64(h × 32 + j)`, `block_hash` chained with Dynamo's sequence hash.
//!
//! The trace lives in the repository, gzip-compressed: `benches/fixtures/mooncake/` (see its
//! README); [`read_trace`] reads a plain or a `.gz` JSONL file.

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::Path;

use continuum_protocol::kv::LocalBlockHash;
use continuum_protocol::kv::hashing::sequence_hashes;

pub const WORKERS: u64 = 16;
pub const LRU_BLOCKS: usize = 16_384;
pub const BLOCKS_PER_HASH_ID: u64 = 32;
pub const BLOCK_TOKENS: u64 = 16;

pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
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

/// One trace line as blocks: its LocalBlockHashes and their chained sequence hashes.
pub struct TraceRequest {
    pub local: Vec<LocalBlockHash>,
    pub seq: Vec<u64>,
}

/// Expands one JSONL trace line; `None` when it lacks `hash_ids` or `input_length`.
pub fn expand(line: &str) -> Option<TraceRequest> {
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    let ids: Vec<u64> = v["hash_ids"]
        .as_array()?
        .iter()
        .filter_map(|x| x.as_u64())
        .collect();
    let isl = v["input_length"].as_u64()?;
    let n = (BLOCKS_PER_HASH_ID * ids.len() as u64).min(isl / BLOCK_TOKENS);
    let local: Vec<LocalBlockHash> = (0..n)
        .map(|i| {
            let h = ids[(i / BLOCKS_PER_HASH_ID) as usize];
            LocalBlockHash(splitmix64(
                h.wrapping_mul(BLOCKS_PER_HASH_ID) + i % BLOCKS_PER_HASH_ID,
            ))
        })
        .collect();
    let seq = sequence_hashes(&local).into_iter().map(|s| s.0).collect();
    Some(TraceRequest { local, seq })
}

/// Exact LRU over block hashes: most recent = highest stamp.
#[derive(Default)]
pub struct Lru {
    stamp: u64,
    by_hash: HashMap<u64, u64>,
    by_stamp: BTreeMap<u64, u64>,
}

impl Lru {
    pub fn touch(&mut self, hash: u64) {
        if let Some(old) = self.by_hash.insert(hash, self.stamp) {
            self.by_stamp.remove(&old);
        }
        self.by_stamp.insert(self.stamp, hash);
        self.stamp += 1;
    }

    /// Evicts the least recent hashes past [`LRU_BLOCKS`], oldest first.
    pub fn evict(&mut self) -> Vec<u64> {
        let mut out = Vec::new();
        while self.by_hash.len() > LRU_BLOCKS {
            let Some((_, hash)) = self.by_stamp.pop_first() else {
                break;
            };
            self.by_hash.remove(&hash);
            out.push(hash);
        }
        out
    }

    /// How many leading hashes of `seq` are cached.
    pub fn prefix(&self, seq: &[u64]) -> usize {
        seq.iter()
            .take_while(|h| self.by_hash.contains_key(h))
            .count()
    }
}
