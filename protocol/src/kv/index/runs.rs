//! Which arena slots continue a chain: bit `i` is set when node `i + 1` is a child of node `i`
//! with exactly the same owners (both bitsets, equal; or both sorted lists, with the same
//! slots).
//!
//! Down such a run a prefix walk learns nothing from the nodes themselves (nobody joins or
//! leaves), so `find_matches` only compares the request's hashes with the `tokens_hash` column
//! of the arena, two sequential `u64` streams, and reads neither nodes nor owners. The bit of
//! `i` depends only on nodes `i` and `i + 1`, so keeping it true is O(1) per change: recompute
//! the bits on both sides of a node whose owners changed, or that was created or freed.

use super::NodeIdx;

#[derive(Debug, Default)]
pub(super) struct Runs {
    bits: Vec<u64>,
}

impl Runs {
    /// Words allocated (for the memory estimate).
    pub(super) fn capacity_words(&self) -> usize {
        self.bits.capacity()
    }

    pub(super) fn get(&self, i: NodeIdx) -> bool {
        let i = i as usize;
        self.bits
            .get(i / 64)
            .is_some_and(|word| word & (1 << (i % 64)) != 0)
    }

    #[inline]
    pub(super) fn set(&mut self, i: NodeIdx, on: bool) {
        let i = i as usize;
        let bit = 1 << (i % 64);
        match self.bits.get_mut(i / 64) {
            Some(word) if on => *word |= bit,
            Some(word) => *word &= !bit,
            None if on => self.grow_to(i / 64)[i / 64] |= bit,
            // Bits past the end are already clear.
            None => {}
        }
    }

    /// Grows the bitset to hold word `word` (the arena grew); kept out of line so that
    /// [`Self::set`], called for every change to the tree, stays a few instructions.
    #[cold]
    #[inline(never)]
    fn grow_to(&mut self, word: usize) -> &mut [u64] {
        self.bits.resize(word + 1, 0);
        &mut self.bits
    }

    /// How many consecutive bits are set from bit `start` on, at most `limit`.
    #[inline]
    pub(super) fn ones_from(&self, start: NodeIdx, limit: usize) -> usize {
        let mut at = start as usize;
        let mut n = 0;
        while n < limit {
            let Some(word) = self.bits.get(at / 64) else {
                break;
            };
            let off = at % 64;
            let ones = (word >> off).trailing_ones() as usize;
            // `word >> off` has `off` zero bits shifted in at the top.
            let ones = ones.min(64 - off);
            n += ones;
            if off + ones < 64 {
                break;
            }
            at += ones;
        }
        n.min(limit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Against a `Vec<bool>`, across word boundaries.
        #[test]
        fn agrees_with_a_bool_vector(
            ops in proptest::collection::vec((0u32..300, any::<bool>()), 1..300),
            probes in proptest::collection::vec((0u32..320, 0usize..300), 1..30),
        ) {
            let mut runs = Runs::default();
            let mut model = vec![false; 320];
            for (i, on) in ops {
                runs.set(i, on);
                model[i as usize] = on;
            }
            for i in 0..320 {
                prop_assert_eq!(runs.get(i), model[i as usize]);
            }
            for (start, limit) in probes {
                let want = model[start as usize..].iter().take_while(|b| **b).count().min(limit);
                prop_assert_eq!(runs.ones_from(start, limit), want);
            }
        }
    }

    #[test]
    fn a_run_across_words() {
        let mut runs = Runs::default();
        for i in 60..200 {
            runs.set(i, true);
        }
        assert_eq!(runs.ones_from(60, usize::MAX), 140);
        assert_eq!(runs.ones_from(63, 10), 10);
        assert_eq!(runs.ones_from(64, usize::MAX), 136);
        assert_eq!(runs.ones_from(200, usize::MAX), 0);
        assert_eq!(runs.ones_from(5_000, usize::MAX), 0);
    }
}
