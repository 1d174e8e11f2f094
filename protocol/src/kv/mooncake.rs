//! Mooncake traces as kv-cache blocks, and the exact LRU a simulated worker caches with: the
//! workload shared by the KV index benches and `continuum-router replay`.
//!
//! A Mooncake trace line names its prompt by `hash_ids`, one id per 512-token block: two requests
//! share a prefix exactly as far as their `hash_ids` agree. The index is keyed by
//! LocalBlockHashes of `block_size`-token blocks, so each id is expanded into 32 *units* of 16
//! tokens, `unit(h, j) = splitmix64(h × 32 + j)` for `j` in `0..32`, and only whole 16-token units
//! of `input_length` count (`units = min(32 × len(hash_ids), input_length / 16)`). A block of `bs`
//! tokens (a multiple of 16) is `bs / 16` consecutive units: at 16 its LocalBlockHash is the unit
//! itself (the benches' historical mapping), above 16 it is [`fold_units`] of its units; a trailing
//! partial block is dropped, as the router's hashing drops a partial block of tokens. Equal
//! `hash_ids` prefixes therefore give equal block prefixes at every block size, and the chained
//! [`sequence_hashes`] stand in for the engine's `block_hash`.
//!
//! Nothing here reads a clock or draws randomness.

use std::collections::{BTreeMap, HashMap};

use super::LocalBlockHash;
use super::hashing::{BlockSize, sequence_hashes};

/// Tokens per Mooncake `hash_id`.
pub const MOONCAKE_BLOCK_TOKENS: u64 = 512;
/// Tokens per unit a `hash_id` is expanded into.
pub const UNIT_TOKENS: u64 = 16;
/// Units per `hash_id`.
pub const UNITS_PER_HASH_ID: u64 = MOONCAKE_BLOCK_TOKENS / UNIT_TOKENS;

/// SplitMix64's finaliser: a fixed bijective mix of `x`.
pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The LocalBlockHash of a block made of several units: a chained mix of them, in order.
pub fn fold_units(units: &[u64]) -> u64 {
    units
        .iter()
        .fold(0x6d6f_6f6e_6361_6b65, |acc, unit| splitmix64(acc ^ unit))
}

/// Why a block size cannot carry Mooncake ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("block size {0} is not a multiple of {UNIT_TOKENS} tokens")]
pub struct NotAUnitMultiple(pub u32);

/// The LocalBlockHashes of a Mooncake request at `block_size` (see the module doc).
pub fn local_hashes(
    hash_ids: &[u64],
    input_length: u64,
    block_size: BlockSize,
) -> Result<Vec<LocalBlockHash>, NotAUnitMultiple> {
    let bs = u64::from(block_size.get());
    if bs % UNIT_TOKENS != 0 {
        return Err(NotAUnitMultiple(block_size.get()));
    }
    let per_block = (bs / UNIT_TOKENS) as usize;
    let units = (UNITS_PER_HASH_ID.saturating_mul(hash_ids.len() as u64))
        .min(input_length / UNIT_TOKENS) as usize;
    let unit = |i: usize| {
        let h = hash_ids[i / UNITS_PER_HASH_ID as usize];
        splitmix64(h.wrapping_mul(UNITS_PER_HASH_ID) + (i as u64 % UNITS_PER_HASH_ID))
    };
    let blocks = units / per_block;
    let mut scratch = Vec::with_capacity(per_block);
    Ok((0..blocks)
        .map(|b| {
            if per_block == 1 {
                return LocalBlockHash(unit(b));
            }
            scratch.clear();
            scratch.extend((b * per_block..(b + 1) * per_block).map(unit));
            LocalBlockHash(fold_units(&scratch))
        })
        .collect())
}

/// One request as blocks: its LocalBlockHashes and their chained sequence hashes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceBlocks {
    pub local: Vec<LocalBlockHash>,
    pub seq: Vec<u64>,
}

impl TraceBlocks {
    pub fn from_local(local: Vec<LocalBlockHash>) -> Self {
        let seq = sequence_hashes(&local).into_iter().map(|s| s.0).collect();
        Self { local, seq }
    }
}

/// Expands one Mooncake JSONL line at 16-token blocks; `None` when it lacks `hash_ids` or
/// `input_length`.
pub fn expand(line: &str) -> Option<TraceBlocks> {
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    let ids: Vec<u64> = v["hash_ids"]
        .as_array()?
        .iter()
        .filter_map(|x| x.as_u64())
        .collect();
    let isl = v["input_length"].as_u64()?;
    let bs = BlockSize::new(UNIT_TOKENS as u32).ok()?;
    let local = local_hashes(&ids, isl, bs).ok()?;
    Some(TraceBlocks::from_local(local))
}

/// Exact LRU over block hashes with a fixed capacity: most recent = highest stamp.
#[derive(Clone, Debug)]
pub struct BlockLru {
    capacity: usize,
    stamp: u64,
    by_hash: HashMap<u64, u64>,
    by_stamp: BTreeMap<u64, u64>,
}

impl BlockLru {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            stamp: 0,
            by_hash: HashMap::new(),
            by_stamp: BTreeMap::new(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    pub fn touch(&mut self, hash: u64) {
        if let Some(old) = self.by_hash.insert(hash, self.stamp) {
            self.by_stamp.remove(&old);
        }
        self.by_stamp.insert(self.stamp, hash);
        self.stamp += 1;
    }

    /// Evicts the least recent hashes past the capacity, oldest first.
    pub fn evict(&mut self) -> Vec<u64> {
        let mut out = Vec::new();
        while self.by_hash.len() > self.capacity {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn bs(n: u32) -> BlockSize {
        BlockSize::new(n).unwrap()
    }

    #[test]
    fn shared_ids_share_blocks_at_every_unit_multiple() {
        for size in [16, 32, 48, 512, 1024] {
            let a = local_hashes(&[7, 8, 9], 3 * 512, bs(size)).unwrap();
            let b = local_hashes(&[7, 8, 10], 3 * 512, bs(size)).unwrap();
            let per_id = 512.0 / f64::from(size);
            let shared = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
            assert_eq!(a.len(), (3 * 512 / size) as usize, "size {size}");
            assert_eq!(shared, (2.0 * per_id).floor() as usize, "size {size}");
        }
    }

    #[test]
    fn sixteen_token_blocks_are_the_units_and_input_length_caps_them() {
        let local = local_hashes(&[3, 4], 40 * 16 + 5, bs(16)).unwrap();
        assert_eq!(local.len(), 40);
        assert_eq!(local[0], LocalBlockHash(splitmix64(3 * 32)));
        assert_eq!(local[33], LocalBlockHash(splitmix64(4 * 32 + 1)));
        assert_eq!(local_hashes(&[1], 512, bs(24)), Err(NotAUnitMultiple(24)));
        let line = r#"{"timestamp": 0, "input_length": 100, "output_length": 1, "hash_ids": [3]}"#;
        assert_eq!(expand(line).unwrap().local, local[..6].to_vec());
    }

    #[test]
    fn lru_evicts_the_least_recent_past_capacity() {
        let mut lru = BlockLru::new(2);
        for h in [1, 2, 1, 3] {
            lru.touch(h);
        }
        assert_eq!(lru.evict(), vec![2]);
        assert_eq!(lru.prefix(&[1, 3, 2]), 2);
        assert_eq!(lru.len(), 2);
    }
}
