//! One rank's engine block hash → node table: bucketed open addressing, one cache line a
//! bucket.
//!
//! Applying events is bound by cache misses on this table (one random access per stored or
//! removed block). A general-purpose map touches a control byte and then a bucket; here a key's
//! home is one 64-byte aligned line of [`LINE_SLOTS`] slots (keys, nodes and the line's
//! overflow count side by side), the table stays at most 70 % full, so a key is almost always
//! in its home line: [`BlockTable::warm`] loads exactly that line for a whole event's keys at
//! once, so their misses overlap, and the operations that follow find it in cache. A key whose
//! home line is full goes to the next line with room; every line it passes counts it in its
//! `overflow`, so a search stops at the first line that holds the key or has no overflow, and a
//! removal just clears the slot and uncounts the lines passed (no tombstones, no shifting:
//! insert/remove churn never lengthens searches).

use super::{NodeIdx, ROOT, fold};

/// An empty slot holds this node: no engine hash ever maps to the root.
const EMPTY: NodeIdx = ROOT;
/// Slots per line (a line is one 64-byte cache line).
const LINE_SLOTS: usize = 4;
const MIN_LINES: usize = 4;
/// Keys whose home lines [`BlockTable::warm`] computes before it loads them.
const WARM_BATCH: usize = 64;

/// One bucket. Invariant: `overflow` is the number of keys stored past this line whose home
/// line is this one or one before it with every line in between full when they were placed
/// (exactly: the keys whose search from their home line passes this line).
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
struct Line {
    keys: [u64; LINE_SLOTS],
    nodes: [NodeIdx; LINE_SLOTS],
    overflow: u32,
}

const VACANT_LINE: Line = Line {
    keys: [0; LINE_SLOTS],
    nodes: [EMPTY; LINE_SLOTS],
    overflow: 0,
};

#[derive(Debug)]
pub(super) struct BlockTable {
    seed: u64,
    /// Empty, or a power of two lines long (at least [`MIN_LINES`]).
    lines: Vec<Line>,
    len: usize,
}

impl BlockTable {
    pub(super) fn new(seed: u64) -> Self {
        Self {
            seed,
            lines: Vec::new(),
            len: 0,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Slots allocated (for the memory estimate).
    pub(super) fn capacity(&self) -> usize {
        self.lines.len() * LINE_SLOTS
    }

    /// Bytes one slot takes (a line's bytes over its slots).
    pub(super) const SLOT_BYTES: usize = std::mem::size_of::<Line>() / LINE_SLOTS;

    /// The key's home line. The table is non-empty here; the top bits of the seeded fold are
    /// the best mixed.
    #[inline]
    fn home(&self, key: u64) -> usize {
        let bits = self.lines.len().trailing_zeros();
        (fold(key ^ self.seed, 0x9E37_79B9_7F4A_7C15) >> (64 - bits)) as usize
    }

    /// Loads every key's home line so that the misses of a whole event overlap; the operations
    /// that follow then find their lines in cache. Changes nothing.
    ///
    /// In batches of [`WARM_BATCH`] keys: first their home lines (arithmetic only), then the
    /// loads back to back. The loop that issues the misses is then a few instructions per key,
    /// so the reorder window holds many more of them in flight than when each load waits behind
    /// its key's hashing.
    pub(super) fn warm(&self, mut keys: impl Iterator<Item = u64>) {
        if self.lines.is_empty() {
            return;
        }
        let mut homes = [0usize; WARM_BATCH];
        let mut acc = 0u64;
        loop {
            let mut n = 0;
            for (home, key) in homes.iter_mut().zip(keys.by_ref()) {
                *home = self.home(key);
                n += 1;
            }
            for home in &homes[..n] {
                acc ^= self.lines[*home].keys[0];
            }
            if n < WARM_BATCH {
                break;
            }
        }
        std::hint::black_box(acc);
    }

    /// The slot holding `key` (line × [`LINE_SLOTS`] + index), searching from its home line
    /// while the lines passed have overflow, and at most once around the table (overflow
    /// counts can, in principle, be non-zero on every line at once).
    #[inline]
    fn find(&self, key: u64) -> Option<usize> {
        if self.lines.is_empty() {
            return None;
        }
        let mask = self.lines.len() - 1;
        let mut l = self.home(key);
        for _ in 0..self.lines.len() {
            let line = &self.lines[l];
            for i in 0..LINE_SLOTS {
                if line.keys[i] == key && line.nodes[i] != EMPTY {
                    return Some(l * LINE_SLOTS + i);
                }
            }
            if line.overflow == 0 {
                return None;
            }
            l = (l + 1) & mask;
        }
        None
    }

    /// The first empty slot at or after `key`'s home line (the table is below 100 % full).
    #[inline]
    fn vacancy(&self, key: u64) -> usize {
        let mask = self.lines.len() - 1;
        let mut l = self.home(key);
        loop {
            if let Some(i) = self.lines[l].nodes.iter().position(|n| *n == EMPTY) {
                return l * LINE_SLOTS + i;
            }
            l = (l + 1) & mask;
        }
    }

    /// Adds `delta` to the overflow count of every line from `key`'s home line up to (not
    /// including) the line of slot `at`: the lines a search for `key` passes.
    fn count_passed(&mut self, key: u64, at: usize, delta: i32) {
        let mask = self.lines.len() - 1;
        let target = at / LINE_SLOTS;
        let mut l = self.home(key);
        while l != target {
            let o = &mut self.lines[l].overflow;
            *o = o.wrapping_add_signed(delta);
            l = (l + 1) & mask;
        }
    }

    #[inline]
    pub(super) fn get(&self, key: u64) -> Option<NodeIdx> {
        self.find(key).map(|at| self.node_at(at))
    }

    /// Where `key` is: `Ok(slot)` holding it, or `Err(slot)` where inserting it belongs. Makes
    /// room first, so the answer stays valid for one [`Self::set`] or [`Self::fill`].
    pub(super) fn probe(&mut self, key: u64) -> Result<usize, usize> {
        if (self.len + 1) * 10 > self.capacity() * 7 {
            self.grow();
        }
        match self.find(key) {
            Some(at) => Ok(at),
            None => Err(self.vacancy(key)),
        }
    }

    /// The node in a slot [`Self::probe`] found.
    pub(super) fn node_at(&self, at: usize) -> NodeIdx {
        self.lines[at / LINE_SLOTS].nodes[at % LINE_SLOTS]
    }

    /// Replaces the node in a slot [`Self::probe`] found; returns the old one.
    pub(super) fn set(&mut self, at: usize, node: NodeIdx) -> NodeIdx {
        std::mem::replace(
            &mut self.lines[at / LINE_SLOTS].nodes[at % LINE_SLOTS],
            node,
        )
    }

    /// Inserts `key` at the vacant slot [`Self::probe`] returned for it.
    pub(super) fn fill(&mut self, at: usize, key: u64, node: NodeIdx) {
        debug_assert_ne!(node, EMPTY);
        debug_assert_eq!(self.node_at(at), EMPTY);
        let line = &mut self.lines[at / LINE_SLOTS];
        line.keys[at % LINE_SLOTS] = key;
        line.nodes[at % LINE_SLOTS] = node;
        self.len += 1;
        self.count_passed(key, at, 1);
    }

    pub(super) fn contains_key(&self, key: u64) -> bool {
        self.get(key).is_some()
    }

    /// Maps `key` to `node` (never the root) and returns the node it replaced.
    #[cfg(test)]
    pub(super) fn insert(&mut self, key: u64, node: NodeIdx) -> Option<NodeIdx> {
        match self.probe(key) {
            Ok(at) => Some(self.set(at, node)),
            Err(at) => {
                self.fill(at, key, node);
                None
            }
        }
    }

    pub(super) fn remove(&mut self, key: u64) -> Option<NodeIdx> {
        let at = self.find(key)?;
        let removed = std::mem::replace(
            &mut self.lines[at / LINE_SLOTS].nodes[at % LINE_SLOTS],
            EMPTY,
        );
        self.len -= 1;
        self.count_passed(key, at, -1);
        Some(removed)
    }

    fn grow(&mut self) {
        let new_lines = (self.lines.len() * 2).max(MIN_LINES);
        let old = std::mem::replace(&mut self.lines, vec![VACANT_LINE; new_lines]);
        self.len = 0;
        for line in &old {
            for i in 0..LINE_SLOTS {
                if line.nodes[i] != EMPTY {
                    let at = self.vacancy(line.keys[i]);
                    self.fill(at, line.keys[i], line.nodes[i]);
                }
            }
        }
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (u64, NodeIdx)> + '_ {
        self.lines.iter().flat_map(|line| {
            line.keys
                .iter()
                .zip(&line.nodes)
                .filter(|(_, n)| **n != EMPTY)
                .map(|(k, n)| (*k, *n))
        })
    }

    pub(super) fn values(&self) -> impl Iterator<Item = NodeIdx> + '_ {
        self.iter().map(|(_, node)| node)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    proptest! {
        /// Against `HashMap` under insert/remove churn on a small key space (full lines,
        /// overflow past them and wrap-around all happen); the overflow counts stay exact.
        #[test]
        fn agrees_with_a_hash_map(
            seed in any::<u64>(),
            ops in proptest::collection::vec((any::<bool>(), 0u64..64, 1u32..5), 1..400),
        ) {
            let mut table = BlockTable::new(seed);
            let mut model: HashMap<u64, NodeIdx> = HashMap::new();
            for (insert, key, node) in ops {
                if insert && node % 2 == 0 {
                    let old = match table.probe(key) {
                        Ok(at) => {
                            prop_assert_eq!(table.node_at(at), model[&key]);
                            Some(table.set(at, node))
                        }
                        Err(at) => {
                            table.fill(at, key, node);
                            None
                        }
                    };
                    prop_assert_eq!(old, model.insert(key, node));
                } else if insert {
                    prop_assert_eq!(table.insert(key, node), model.insert(key, node));
                } else {
                    prop_assert_eq!(table.remove(key), model.remove(&key));
                }
                prop_assert_eq!(table.len(), model.len());
                prop_assert_eq!(table.overflow_counts(), table.recount_overflow());
                for k in 0..64 {
                    prop_assert_eq!(table.get(k), model.get(&k).copied());
                }
            }
            let mut got: Vec<_> = table.iter().collect();
            got.sort_unstable();
            let mut want: Vec<_> = model.into_iter().collect();
            want.sort_unstable();
            prop_assert_eq!(got, want);
        }
    }

    impl BlockTable {
        fn overflow_counts(&self) -> Vec<u32> {
            self.lines.iter().map(|l| l.overflow).collect()
        }

        /// Each line's overflow from scratch: the keys whose search from home passes it.
        fn recount_overflow(&self) -> Vec<u32> {
            let mut counts = vec![0u32; self.lines.len()];
            let mask = self.lines.len().saturating_sub(1);
            for (l, line) in self.lines.iter().enumerate() {
                for i in 0..LINE_SLOTS {
                    if line.nodes[i] == EMPTY {
                        continue;
                    }
                    let mut at = self.home(line.keys[i]);
                    while at != l {
                        counts[at] += 1;
                        at = (at + 1) & mask;
                    }
                }
            }
            counts
        }
    }

    #[test]
    fn a_line_is_one_aligned_cache_line() {
        assert_eq!(std::mem::size_of::<Line>(), 64);
        assert_eq!(std::mem::align_of::<Line>(), 64);
        assert_eq!(BlockTable::SLOT_BYTES, 16);
    }

    #[test]
    fn stays_at_most_seventy_percent_full() {
        let mut table = BlockTable::new(7);
        for key in 0..10_000u64 {
            table.insert(key.wrapping_mul(0x9E37_79B9), 1);
            assert!(table.len() * 10 <= table.capacity() * 7);
        }
        assert_eq!(table.len(), 10_000);
        table.warm(0..100);
    }
}
