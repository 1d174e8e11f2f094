//! The arena's free slots, as a bitset with a next-fit cursor.
//!
//! Where a node lands decides how fast `find_matches` walks: a chain stored at consecutive arena
//! indices is read as a stream (the CPU loads the next node ahead), while every jump to another
//! index is a cache miss on the walk's critical path. A LIFO free list hands out whatever was
//! freed last, so after eviction churn a new chain was scattered over the slots of many older
//! chains (on the Mooncake replay, a jump every ~13 blocks). Here a new child takes the slot right
//! after its parent when that slot is free; otherwise [`FreeSet::take_run`] finds, from a
//! rotating cursor, the first free run long enough for the rest of the store being applied
//! (next-fit alone, [`FreeSet::take_next`], handed a long store whatever short runs eviction had
//! left: a jump every ~69 blocks of a long match; see `Tree::create` for the fallbacks).
//!
//! One bit per arena slot (128 KiB at the 2^20-node ceiling). Allocation is O(1) when the slot
//! after the parent is free; a run search reads a bounded number of words and moves the cursor
//! past them when it fails, so repeated searches sweep the bitset instead of rereading it.

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

    /// Takes the first slot of the first run of at least `want` consecutive free slots that
    /// starts at or after the cursor's word (wrapping; a run does not wrap), reading at most
    /// `budget` words (deducted from it). When there is none, takes nothing, moves the cursor
    /// past the words read and returns the longest run seen (start, length), if any.
    pub(super) fn take_run(
        &mut self,
        want: usize,
        budget: &mut usize,
    ) -> Result<NodeIdx, Option<(NodeIdx, usize)>> {
        let words = self.bits.len();
        if self.count == 0 || words == 0 {
            return Err(None);
        }
        let start = self.cursor.min(words - 1);
        let scan = (*budget).min(words);
        let mut best: Option<(usize, usize)> = None;
        let mut run_start = 0usize;
        let mut run_len = 0usize;
        for step in 0..scan {
            let w = (start + step) % words;
            if w == 0 {
                run_len = 0;
            }
            let word = self.bits[w];
            let mut pos = 0usize;
            while pos < 64 {
                let rest = word >> pos;
                if rest == 0 {
                    run_len = 0;
                    break;
                }
                let zeros = rest.trailing_zeros() as usize;
                if zeros > 0 {
                    run_len = 0;
                    pos += zeros;
                }
                let ones = (word >> pos).trailing_ones() as usize;
                if run_len == 0 {
                    run_start = w * 64 + pos;
                }
                run_len += ones;
                pos += ones;
                if run_len >= want {
                    *budget -= step + 1;
                    let slot = run_start as NodeIdx;
                    let taken = self.take_exact(slot);
                    debug_assert!(taken);
                    self.cursor = run_start / 64;
                    return Ok(slot);
                }
                if best.is_none_or(|(_, len)| run_len > len) {
                    best = Some((run_start, run_len));
                }
            }
        }
        *budget -= scan;
        self.cursor = (start + scan) % words;
        Err(best.map(|(s, len)| (s as NodeIdx, len)))
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

    proptest! {
        /// `take_run` takes the start of a free run at least `want` long, or nothing; it reads
        /// no more words than its budget.
        #[test]
        fn take_run_finds_a_long_enough_run(
            free in proptest::collection::btree_set(0u32..400, 0..300),
            cursor in 0usize..8,
            want in 1usize..40,
            budget in 0usize..10,
        ) {
            let mut set = FreeSet::default();
            for slot in &free {
                set.insert(*slot);
            }
            set.cursor = cursor;
            let words = set.bits.len();
            let start = cursor.min(words.saturating_sub(1));
            let mut left = budget;
            let before: Vec<NodeIdx> = set.iter().collect();
            match set.take_run(want, &mut left) {
                Ok(slot) => {
                    prop_assert!((slot..slot + want as u32).all(|s| free.contains(&s)));
                    prop_assert!(!set.contains(slot));
                    prop_assert_eq!(set.len(), free.len() - 1);
                }
                Err(best) => {
                    prop_assert_eq!(set.iter().collect::<Vec<_>>(), before);
                    if let Some((slot, len)) = best {
                        prop_assert!(len < want);
                        prop_assert!((slot..slot + len as u32).all(|s| free.contains(&s)));
                    }
                    // With the whole set in the budget: no long enough run from the cursor's word
                    // on, nor one before it (the scan wraps to word 0 and stops there).
                    if budget >= words {
                        let first = (start * 64) as u32;
                        let long = free.iter().any(|s| {
                            let end = *s + want as u32;
                            (*s >= first || end <= first)
                                && (*s..end).all(|x| free.contains(&x))
                        });
                        prop_assert!(!long);
                    }
                }
            }
            prop_assert!(left <= budget);
            prop_assert!(budget - left <= words);
        }
    }

    #[test]
    fn take_run_skips_short_runs_and_falls_back_to_the_longest() {
        let mut set = FreeSet::default();
        for slot in [3, 5, 6, 70, 71, 72, 73, 74, 100, 101, 102] {
            set.insert(slot);
        }
        let mut budget = 100;
        assert_eq!(set.take_run(4, &mut budget), Ok(70));
        assert_eq!(budget, 98);
        // From the cursor's word on (70 is taken), then wrapping to word 0.
        assert_eq!(set.take_run(5, &mut budget), Err(Some((71, 4))));
        assert_eq!(set.len(), 10);
        // An exhausted budget reads nothing.
        let mut none = 0;
        assert_eq!(set.take_run(1, &mut none), Err(None));
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
