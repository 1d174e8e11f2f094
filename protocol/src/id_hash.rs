//! A cheap hasher for maps keyed by fleet integer ids (instance ids, dp ranks).
//!
//! Instance ids are lease ids or pod-name hashes, and every map keyed by them admits only live
//! workers of the registry snapshot (a fleet-bounded, operator-controlled set), so collision
//! resistance against a remote adversary buys nothing there, while SipHash would dominate a
//! 1,000-rank pick. One multiply-xorshift per integer spreads such ids well enough. Never use it
//! for keys a client or an unauthenticated peer chooses.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Fibonacci-hashing multiplier (2^64 / golden ratio).
const MIX: u64 = 0x9e37_79b9_7f4a_7c15;

/// See the module docs.
#[derive(Clone, Copy, Debug, Default)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(byte)).wrapping_mul(MIX);
        }
    }

    #[inline]
    fn write_u64(&mut self, value: u64) {
        let mixed = (self.0 ^ value).wrapping_mul(MIX);
        self.0 = mixed ^ (mixed >> 29);
    }

    #[inline]
    fn write_u32(&mut self, value: u32) {
        self.write_u64(u64::from(value));
    }
}

/// A `HashMap` hashed by [`IdHasher`].
pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::{BuildHasher, Hash};

    fn hash_of(value: impl Hash) -> u64 {
        BuildHasherDefault::<IdHasher>::default().hash_one(value)
    }

    #[test]
    fn nearby_ids_and_ranks_spread() {
        let mut seen = std::collections::HashSet::new();
        for id in 0u64..512 {
            for rank in 0u32..4 {
                seen.insert(hash_of((id, rank)) >> 54);
            }
        }
        // 2,048 keys into 1,024 top-bit buckets: a poor mix would collapse to a handful.
        assert!(seen.len() > 700, "{}", seen.len());
    }
}
