//! One kv-events subscription's `event_id` cursors, per (worker, dp_rank) (seed "Gaps, and why
//! there is no snapshot recovery"; "4096 (worker, dp_rank) cursors per subscription").
//!
//! `event_id` is monotonic per publisher, so cursors belong to the subscription (one publisher
//! incarnation), not to the index: a new publisher for the same worker restarts at 0 and must not
//! read as a replay of its predecessor. The table is bounded; past the bound, events for ranks it
//! does not know yet are refused (`over_capacity`) while known ranks keep flowing.

use std::collections::BTreeMap;

use crate::ids::{DpRank, InstanceId};

/// (worker, dp_rank) cursors one subscription may hold.
pub const MAX_CURSORS_PER_SUBSCRIPTION: usize = 4_096;

/// What the cursor says about one event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// The rank's first event on this subscription: the cursor starts here (the router may join
    /// mid-stream, so no gap is assumed).
    First,
    /// Exactly the next `event_id`.
    InOrder,
    /// A forward jump: `missed` events were lost; the rank must be cleared before applying.
    Gap { missed: u64 },
    /// At or below the cursor: skip.
    Replay,
    /// A new rank while the table is full: refuse.
    OverCapacity,
}

/// Bounded per-rank cursors of one subscription.
#[derive(Clone, Debug)]
pub struct CursorTable {
    cursors: BTreeMap<(InstanceId, DpRank), u64>,
    limit: usize,
}

impl Default for CursorTable {
    fn default() -> Self {
        Self::new()
    }
}

impl CursorTable {
    pub fn new() -> Self {
        Self::with_limit(MAX_CURSORS_PER_SUBSCRIPTION)
    }

    /// A table with a lower bound (tests, small deployments); clamped to the compiled bound.
    pub fn with_limit(limit: usize) -> Self {
        Self {
            cursors: BTreeMap::new(),
            limit: limit.min(MAX_CURSORS_PER_SUBSCRIPTION),
        }
    }

    /// Checks `event_id` against the rank's cursor and advances it unless the event is a replay
    /// or refused.
    pub fn admit(&mut self, worker: InstanceId, dp_rank: DpRank, event_id: u64) -> Admission {
        let key = (worker, dp_rank);
        let full = self.cursors.len() >= self.limit;
        match self.cursors.get_mut(&key) {
            Some(cursor) if event_id <= *cursor => Admission::Replay,
            Some(cursor) => {
                let missed = event_id - *cursor - 1;
                *cursor = event_id;
                if missed == 0 {
                    Admission::InOrder
                } else {
                    Admission::Gap { missed }
                }
            }
            None if full => Admission::OverCapacity,
            None => {
                self.cursors.insert(key, event_id);
                Admission::First
            }
        }
    }

    /// The ranks this subscription has seen.
    pub fn ranks(&self) -> impl Iterator<Item = (InstanceId, DpRank)> + '_ {
        self.cursors.keys().copied()
    }

    pub fn len(&self) -> usize {
        self.cursors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.cursors.is_empty()
    }

    /// Keeps only ranks `keep` admits (ranks and workers that departed lose their cursors).
    pub fn retain(&mut self, mut keep: impl FnMut(InstanceId, DpRank) -> bool) {
        self.cursors.retain(|(w, r), _| keep(*w, *r));
    }

    /// Forgets one rank's cursor.
    pub fn forget(&mut self, worker: InstanceId, dp_rank: DpRank) {
        self.cursors.remove(&(worker, dp_rank));
    }

    pub fn clear(&mut self) {
        self.cursors.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: InstanceId = InstanceId(7);
    const R: DpRank = DpRank(0);

    #[test]
    fn first_in_order_replay_gap() {
        let mut t = CursorTable::new();
        assert_eq!(t.admit(W, R, 10), Admission::First);
        assert_eq!(t.admit(W, R, 11), Admission::InOrder);
        assert_eq!(t.admit(W, R, 11), Admission::Replay);
        assert_eq!(t.admit(W, R, 3), Admission::Replay);
        assert_eq!(t.admit(W, R, 15), Admission::Gap { missed: 3 });
        assert_eq!(t.admit(W, R, 16), Admission::InOrder);
        // Another rank of the same worker has its own cursor.
        assert_eq!(t.admit(W, DpRank(1), 0), Admission::First);
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn full_table_refuses_new_ranks_only() {
        let mut t = CursorTable::with_limit(2);
        assert_eq!(t.admit(InstanceId(1), R, 0), Admission::First);
        assert_eq!(t.admit(InstanceId(2), R, 0), Admission::First);
        assert_eq!(t.admit(InstanceId(3), R, 0), Admission::OverCapacity);
        assert_eq!(t.admit(InstanceId(1), R, 1), Admission::InOrder);
        t.retain(|w, _| w != InstanceId(2));
        assert_eq!(t.admit(InstanceId(3), R, 5), Admission::First);
        assert_eq!(
            CursorTable::with_limit(1 << 20).limit,
            MAX_CURSORS_PER_SUBSCRIPTION
        );
    }

    #[test]
    fn the_compiled_bound_is_4096() {
        let mut t = CursorTable::new();
        for w in 0..MAX_CURSORS_PER_SUBSCRIPTION as u64 {
            assert_eq!(t.admit(InstanceId(w), R, 0), Admission::First);
        }
        assert_eq!(t.admit(InstanceId(u64::MAX), R, 0), Admission::OverCapacity);
        t.forget(InstanceId(0), R);
        assert_eq!(t.admit(InstanceId(u64::MAX), R, 0), Admission::First);
    }
}
