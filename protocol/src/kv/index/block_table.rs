//! One rank's engine block hash → node table: open addressing with linear probing.
//!
//! Applying events is bound by cache misses on this table (one random probe per stored or
//! removed block). A general-purpose map touches a control byte and then a bucket; here a probe
//! reads one 16-byte slot, the table stays at most 70 % full so a probe rarely crosses a cache
//! line, deletion shifts entries back instead of leaving tombstones (insert/remove churn never
//! lengthens probes), and [`BlockTable::warm`] lets a whole event's slots be loaded before they
//! are used, so their misses overlap instead of queueing one behind the other.

use super::{NodeIdx, ROOT, fold};

/// An empty slot holds this value: no engine hash ever maps to the root.
const EMPTY: NodeIdx = ROOT;
const MIN_SLOTS: usize = 16;
/// Slots per 64-byte cache line.
const LINE_SLOTS: usize = 4;
/// Keys whose home slots [`BlockTable::warm`] computes before it loads them.
const WARM_BATCH: usize = 64;

#[derive(Clone, Copy, Debug)]
struct Slot {
    key: u64,
    node: NodeIdx,
}

const VACANT: Slot = Slot {
    key: 0,
    node: EMPTY,
};

#[derive(Debug)]
pub(super) struct BlockTable {
    seed: u64,
    /// Empty, or a power of two long.
    slots: Vec<Slot>,
    len: usize,
}

impl BlockTable {
    pub(super) fn new(seed: u64) -> Self {
        Self {
            seed,
            slots: Vec::new(),
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
        self.slots.len()
    }

    /// Bytes one slot takes.
    pub(super) const SLOT_BYTES: usize = std::mem::size_of::<Slot>();

    #[inline]
    fn home(&self, key: u64) -> usize {
        // The table is non-empty here; the top bits of the seeded fold are the best mixed.
        let bits = self.slots.len().trailing_zeros();
        (fold(key ^ self.seed, 0x9E37_79B9_7F4A_7C15) >> (64 - bits)) as usize
    }

    /// Loads the cache line of every key's home slot, and the next line where a probe from
    /// there may reach it, so that the misses of a whole event overlap; the operations that
    /// follow then find their slots in cache. Changes nothing.
    ///
    /// In batches of [`WARM_BATCH`] keys: first their home slots (arithmetic only), then the
    /// loads back to back, without a branch. The loop that issues the misses is then a few
    /// instructions per key, so the reorder window holds many more of them in flight than
    /// when each load waits behind its key's hashing.
    pub(super) fn warm(&self, mut keys: impl Iterator<Item = u64>) {
        if self.slots.is_empty() {
            return;
        }
        let mask = self.slots.len() - 1;
        // Where slot 0 sits in its cache line, in slots (the allocation is at least 16-byte
        // aligned, so a slot never straddles two lines; were it not, this only warms less).
        let first = (self.slots.as_ptr() as usize % 64) / std::mem::size_of::<Slot>();
        let mut homes = [0usize; WARM_BATCH];
        let mut acc = 0u64;
        loop {
            let mut n = 0;
            for (home, key) in homes.iter_mut().zip(keys.by_ref()) {
                *home = self.home(key);
                n += 1;
            }
            for home in &homes[..n] {
                // A probe from one of the line's last two slots runs into the next line often
                // enough to stall there otherwise; from the first two it rarely does (the
                // table is at most 70 % full), and the second load then reads the home line
                // again.
                let pos = (first + home) % LINE_SLOTS;
                let next = if pos >= LINE_SLOTS / 2 {
                    home + LINE_SLOTS - pos
                } else {
                    *home
                };
                acc ^= self.slots[*home].key ^ self.slots[next & mask].key;
            }
            if n < WARM_BATCH {
                break;
            }
        }
        std::hint::black_box(acc);
    }

    /// The slot holding `key`, probing linearly from its home slot.
    #[inline]
    fn find(&self, key: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        loop {
            let slot = self.slots[i];
            if slot.node == EMPTY {
                return None;
            }
            if slot.key == key {
                return Some(i);
            }
            i = (i + 1) & mask;
        }
    }

    #[inline]
    pub(super) fn get(&self, key: u64) -> Option<NodeIdx> {
        self.find(key).map(|i| self.slots[i].node)
    }

    /// Where `key` is: `Ok(slot)` holding it, or `Err(slot)` where inserting it belongs. Makes
    /// room first, so the answer stays valid for one [`Self::set`] or [`Self::fill`].
    pub(super) fn probe(&mut self, key: u64) -> Result<usize, usize> {
        if (self.len + 1) * 10 > self.slots.len() * 7 {
            self.grow();
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        loop {
            let slot = self.slots[i];
            if slot.node == EMPTY {
                return Err(i);
            }
            if slot.key == key {
                return Ok(i);
            }
            i = (i + 1) & mask;
        }
    }

    /// The node in a slot [`Self::probe`] found.
    pub(super) fn node_at(&self, at: usize) -> NodeIdx {
        self.slots[at].node
    }

    /// Replaces the node in a slot [`Self::probe`] found; returns the old one.
    pub(super) fn set(&mut self, at: usize, node: NodeIdx) -> NodeIdx {
        std::mem::replace(&mut self.slots[at].node, node)
    }

    /// Inserts `key` at the vacant slot [`Self::probe`] returned for it.
    pub(super) fn fill(&mut self, at: usize, key: u64, node: NodeIdx) {
        debug_assert_ne!(node, EMPTY);
        debug_assert_eq!(self.slots[at].node, EMPTY);
        self.slots[at] = Slot { key, node };
        self.len += 1;
    }

    pub(super) fn contains_key(&self, key: u64) -> bool {
        self.get(key).is_some()
    }

    /// Maps `key` to `node` (never the root) and returns the node it replaced.
    pub(super) fn insert(&mut self, key: u64, node: NodeIdx) -> Option<NodeIdx> {
        debug_assert_ne!(node, EMPTY);
        if (self.len + 1) * 10 > self.slots.len() * 7 {
            self.grow();
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        loop {
            let slot = &mut self.slots[i];
            if slot.node == EMPTY {
                *slot = Slot { key, node };
                self.len += 1;
                return None;
            }
            if slot.key == key {
                return Some(std::mem::replace(&mut slot.node, node));
            }
            i = (i + 1) & mask;
        }
    }

    pub(super) fn remove(&mut self, key: u64) -> Option<NodeIdx> {
        let i = self.find(key)?;
        let mask = self.slots.len() - 1;
        let removed = self.slots[i].node;
        // Backward-shift deletion: pull later entries of the run into the hole when their home
        // is not inside (hole, j], so every key stays reachable from its home.
        let mut hole = i;
        let mut j = (i + 1) & mask;
        loop {
            let slot = self.slots[j];
            if slot.node == EMPTY {
                break;
            }
            let home = self.home(slot.key);
            let stays = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !stays {
                self.slots[hole] = slot;
                hole = j;
            }
            j = (j + 1) & mask;
        }
        self.slots[hole] = VACANT;
        self.len -= 1;
        Some(removed)
    }

    fn grow(&mut self) {
        let new_len = (self.slots.len() * 2).max(MIN_SLOTS);
        let old = std::mem::replace(&mut self.slots, vec![VACANT; new_len]);
        self.len = 0;
        for slot in old {
            if slot.node != EMPTY {
                self.insert(slot.key, slot.node);
            }
        }
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (u64, NodeIdx)> + '_ {
        self.slots
            .iter()
            .filter(|s| s.node != EMPTY)
            .map(|s| (s.key, s.node))
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
        /// Against `HashMap` under insert/remove churn on a small key space (long runs,
        /// wrap-around and backward shifts all happen).
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
