//! The arena's free slots, as a bitset with a next-fit cursor.
//!
//! Where a node lands decides how fast `find_matches` walks: a chain stored at consecutive arena
//! indices is read as a stream (the CPU loads the next node ahead), while every jump to another
//! index is a cache miss on the walk's critical path. A LIFO free list hands out whatever was
//! freed last, so after eviction churn a new chain was scattered over the slots of many older
//! chains (on the Mooncake replay, a jump every ~13 blocks). Here a new child takes the slot right
//! after its parent when that slot is free, and otherwise the next free slot at or after a
//! rotating cursor, which is the start of a free run more often than not: evicted chains free
//! runs of consecutive slots, and a new chain fills such a run in order.
//!
//! One bit per arena slot (128 KiB at the 2^20-node ceiling). Allocation is O(1) when the slot
//! after the parent is free; otherwise the scan moves the cursor forward, so a full cycle over
//! the bitset is spread over the allocations it serves.

use super::NodeIdx;

#[derive(Debug, Default)]
pub(super) struct FreeSet {
    /// Bit `i` set: arena slot `i` is free. Covers every slot of the arena.
    bits: Vec<u64>,
    count: usize,
    /// The word the next scan starts at.
    cursor: usize,
}

impl FreeSet {
    pub(super) fn len(&self) -> usize {
        self.count
    }

    /// Words allocated (for the memory estimate).
    pub(super) fn capacity_words(&self) -> usize {
        self.bits.capacity()
    }

    #[cfg(test)]
    pub(super) fn contains(&self, slot: NodeIdx) -> bool {
        let i = slot as usize;
        self.bits
            .get(i / 64)
            .is_some_and(|word| word & (1 << (i % 64)) != 0)
    }

    /// Marks a slot of the arena free.
    pub(super) fn insert(&mut self, slot: NodeIdx) {
        let i = slot as usize;
        if self.bits.len() <= i / 64 {
            self.bits.resize(i / 64 + 1, 0);
        }
        let bit = 1 << (i % 64);
        debug_assert_eq!(self.bits[i / 64] & bit, 0, "slot {slot} freed twice");
        self.bits[i / 64] |= bit;
        self.count += 1;
    }

    /// Takes `slot` if it is free.
    pub(super) fn take_exact(&mut self, slot: NodeIdx) -> bool {
        let i = slot as usize;
        match self.bits.get_mut(i / 64) {
            Some(word) if *word & (1 << (i % 64)) != 0 => {
                *word &= !(1 << (i % 64));
                self.count -= 1;
                true
            }
            _ => false,
        }
    }

    /// Takes the first free slot at or after the cursor (wrapping), if any is free.
    pub(super) fn take_next(&mut self) -> Option<NodeIdx> {
        if self.count == 0 {
            return None;
        }
        let words = self.bits.len();
        let mut w = self.cursor.min(words - 1);
        loop {
            let word = self.bits[w];
            if word != 0 {
                let bit = word.trailing_zeros();
                self.bits[w] &= !(1 << bit);
                self.count -= 1;
                self.cursor = w;
                // The arena holds at most 2^20 + 1 slots, far below u32::MAX.
                return Some((w * 64) as NodeIdx + bit);
            }
            w = (w + 1) % words;
        }
    }

    /// The free slots, ascending.
    pub(super) fn iter(&self) -> impl Iterator<Item = NodeIdx> + '_ {
        self.bits.iter().enumerate().flat_map(|(w, word)| {
            let mut rest = *word;
            std::iter::from_fn(move || {
                if rest == 0 {
                    return None;
                }
                let bit = rest.trailing_zeros();
                rest &= rest - 1;
                Some((w * 64) as NodeIdx + bit)
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    proptest! {
        /// Against a set: every slot handed out was free, and nothing free is lost.
        #[test]
        fn agrees_with_a_set(ops in proptest::collection::vec((0u8..3, 0u32..300), 1..400)) {
            let mut set = FreeSet::default();
            let mut model = BTreeSet::new();
            for (op, slot) in ops {
                match op {
                    0 => {
                        if model.insert(slot) {
                            set.insert(slot);
                        }
                    }
                    1 => prop_assert_eq!(set.take_exact(slot), model.remove(&slot)),
                    _ => match set.take_next() {
                        Some(got) => prop_assert!(model.remove(&got)),
                        None => prop_assert!(model.is_empty()),
                    },
                }
                prop_assert_eq!(set.len(), model.len());
                prop_assert_eq!(set.iter().collect::<Vec<_>>(), model.iter().copied().collect::<Vec<_>>());
                for s in 0..300 {
                    prop_assert_eq!(set.contains(s), model.contains(&s));
                }
            }
        }
    }

    #[test]
    fn next_fit_hands_out_a_run_in_order() {
        let mut set = FreeSet::default();
        for slot in [200, 10, 11, 12, 13, 5] {
            set.insert(slot);
        }
        assert_eq!(set.take_next(), Some(5));
        // The cursor stays in the word: the run after it comes next, in order.
        assert_eq!(set.take_next(), Some(10));
        assert!(set.take_exact(11));
        assert!(!set.take_exact(11));
        assert_eq!(set.take_next(), Some(12));
        assert_eq!(set.take_next(), Some(13));
        assert_eq!(set.take_next(), Some(200));
        assert_eq!(set.take_next(), None);
    }
}
