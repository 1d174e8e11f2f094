//! Dynamo block hashing (dynamo-wire §11): XXH3-64 over little-endian u32 tokens of complete
//! blocks, seeded with 1337 plus the LoRA name and cache salt, and the chained SequenceHash.
//!
//! Implemented here on `xxhash-rust` rather than by depending on `dynamo-kv-hashing` 1.6.1: that
//! crate's surface is the 128-bit PositionalLineageHash, it drags in `dynamo-tokens` (dashmap,
//! uuid, bs58, bytemuck, derive_builder), and the three formulas below are a few lines each.
//! Equality with upstream is proven on every vector of `block_hash.json` and by a property test
//! against the crate's own `Request::block_hashes` (a dev-dependency only, so protocol's build
//! graph stays small).

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::{LocalBlockHash, SequenceHash};

/// Dynamo's base seed for block hashes and the sequence-hash chain.
pub const KV_HASH_SEED: u64 = 1337;
/// Block sizes the router hashes for (seed: `kv_cache_block_size` 16..=65536).
pub const MIN_BLOCK_SIZE: u32 = 16;
pub const MAX_BLOCK_SIZE: u32 = 65_536;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KvHashError {
    #[error("kv_cache_block_size {0} is outside {MIN_BLOCK_SIZE}..={MAX_BLOCK_SIZE}")]
    UnsupportedBlockSize(u32),
}

/// A validated `kv_cache_block_size`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockSize(u32);

impl BlockSize {
    pub fn new(tokens: u32) -> Result<Self, KvHashError> {
        if (MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&tokens) {
            Ok(Self(tokens))
        } else {
            Err(KvHashError::UnsupportedBlockSize(tokens))
        }
    }

    pub fn get(self) -> u32 {
        self.0
    }
}

/// The request's hash seed (wire §11.2). Empty strings count as absent.
pub fn salt_seed(lora_name: Option<&str>, cache_salt: Option<&str>) -> u64 {
    let mut seed = KV_HASH_SEED;
    if let Some(lora) = lora_name.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(lora.as_bytes(), 0));
    }
    if let Some(salt) = cache_salt.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(salt.as_bytes(), 1));
    }
    seed
}

/// LocalBlockHashes of the complete blocks of `tokens`; a trailing partial block is ignored.
pub fn local_block_hashes(tokens: &[u32], block_size: BlockSize, seed: u64) -> Vec<LocalBlockHash> {
    local_block_hashes_any(tokens, block_size.0 as usize, seed)
}

/// As [`local_block_hashes`] for any non-zero block size (upstream's own vectors use 4).
pub(crate) fn local_block_hashes_any(
    tokens: &[u32],
    block_size: usize,
    seed: u64,
) -> Vec<LocalBlockHash> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut bytes = Vec::with_capacity(block_size * 4);
    tokens
        .chunks_exact(block_size)
        .map(|block| {
            bytes.clear();
            for token in block {
                bytes.extend_from_slice(&token.to_le_bytes());
            }
            LocalBlockHash(xxh3_64_with_seed(&bytes, seed))
        })
        .collect()
}

/// `seq[i] = XXH3_64(u64_le(seq[i-1]) ‖ u64_le(local[i]), 1337)` (wire §11.3).
pub fn next_sequence_hash(previous: SequenceHash, local: LocalBlockHash) -> SequenceHash {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&previous.0.to_le_bytes());
    bytes[8..].copy_from_slice(&local.0.to_le_bytes());
    SequenceHash(xxh3_64_with_seed(&bytes, KV_HASH_SEED))
}

/// The chained SequenceHashes of a request's LocalBlockHashes; `seq[0] = local[0]`.
pub fn sequence_hashes(local: &[LocalBlockHash]) -> Vec<SequenceHash> {
    let mut out = Vec::with_capacity(local.len());
    let mut previous: Option<SequenceHash> = None;
    for hash in local {
        let next = match previous {
            None => SequenceHash(hash.0),
            Some(prev) => next_sequence_hash(prev, *hash),
        };
        out.push(next);
        previous = Some(next);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize)]
    struct Vectors {
        vectors: Vec<Vector>,
    }

    #[derive(serde::Deserialize)]
    struct Vector {
        block_size: usize,
        cache_salt: Option<String>,
        lora_name: Option<String>,
        seed: String,
        tokens: Vec<u32>,
        local_block_hashes: Vec<String>,
        local_block_hashes_hex: Vec<String>,
        sequence_hashes: Vec<String>,
        sequence_hashes_hex: Vec<String>,
    }

    fn parse(decimal: &[String], hex: &[String]) -> Vec<u64> {
        let out: Vec<u64> = decimal.iter().map(|s| s.parse().unwrap()).collect();
        let from_hex: Vec<u64> = hex
            .iter()
            .map(|s| u64::from_str_radix(s, 16).unwrap())
            .collect();
        assert_eq!(out, from_hex, "decimal and hex forms of a vector disagree");
        out
    }

    #[test]
    fn every_block_hash_vector_matches_upstream() {
        let file: Vectors =
            serde_json::from_str(include_str!("../../tests/data/kv/block_hash.json")).unwrap();
        assert_eq!(file.vectors.len(), 8);
        for v in &file.vectors {
            let seed = salt_seed(v.lora_name.as_deref(), v.cache_salt.as_deref());
            assert_eq!(
                seed.to_string(),
                v.seed,
                "seed for {:?}/{:?}",
                v.lora_name,
                v.cache_salt
            );
            let local = local_block_hashes_any(&v.tokens, v.block_size, seed);
            let want_local = parse(&v.local_block_hashes, &v.local_block_hashes_hex);
            assert_eq!(local.iter().map(|h| h.0).collect::<Vec<_>>(), want_local);
            let seq = sequence_hashes(&local);
            let want_seq = parse(&v.sequence_hashes, &v.sequence_hashes_hex);
            assert_eq!(seq.iter().map(|h| h.0).collect::<Vec<_>>(), want_seq);
            if let Ok(size) = BlockSize::new(v.block_size as u32) {
                assert_eq!(local_block_hashes(&v.tokens, size, seed), local);
            }
        }
    }

    #[test]
    fn block_size_bounds() {
        assert_eq!(
            BlockSize::new(15),
            Err(KvHashError::UnsupportedBlockSize(15))
        );
        assert_eq!(BlockSize::new(16).map(BlockSize::get), Ok(16));
        assert_eq!(BlockSize::new(65_536).map(BlockSize::get), Ok(65_536));
        assert!(BlockSize::new(65_537).is_err());
        assert!(BlockSize::new(0).is_err());
    }

    #[test]
    fn partial_blocks_and_empty_input_hash_nothing() {
        let size = BlockSize::new(16).unwrap();
        assert!(local_block_hashes(&[1; 15], size, KV_HASH_SEED).is_empty());
        assert_eq!(local_block_hashes(&[1; 47], size, KV_HASH_SEED).len(), 2);
        assert!(sequence_hashes(&[]).is_empty());
        assert!(local_block_hashes_any(&[1, 2], 0, KV_HASH_SEED).is_empty());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        /// Differential against upstream `dynamo-kv-hashing` 1.6.1 `Request::block_hashes` (the
        /// crate the seed names): same LocalBlockHashes for any tokens, block size, LoRA name and
        /// cache salt, including empty strings and trailing partial blocks.
        #[test]
        fn local_block_hashes_equal_upstream_request_block_hashes(
            tokens in proptest::collection::vec(proptest::prelude::any::<u32>(), 0..300),
            block_size in proptest::sample::select(vec![1usize, 4, 16, 32, 64]),
            lora in proptest::option::of("[a-z\\-]{0,12}"),
            salt in proptest::option::of("[a-zA-Z0-9]{0,12}"),
        ) {
            let request = dynamo_kv_hashing::Request::builder()
                .tokens(tokens.clone())
                .lora_name(lora.clone())
                .salt(salt.clone())
                .build()
                .unwrap();
            let upstream = request.block_hashes(block_size as u32).unwrap();
            let ours = local_block_hashes_any(
                &tokens,
                block_size,
                salt_seed(lora.as_deref(), salt.as_deref()),
            );
            proptest::prop_assert_eq!(ours.iter().map(|h| h.0).collect::<Vec<_>>(), upstream);
            proptest::prop_assert_eq!(request.salt_hash().unwrap(), salt_seed(lora.as_deref(), salt.as_deref()));
        }
    }
}
