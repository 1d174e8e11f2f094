//! The ledger's backlogs laid onto a layout's rows, kept across picks.
//!
//! A pick on the store's path reads each rank's ledger backlog per layout row. Laying the
//! ledger onto rows per pick cost O(backlogged ranks): when publishers fall silent every rank
//! holds unanswered legs, and 1,000 ranks cost ~30 µs a pick. Instead each layout keeps its
//! rows' [`Settled`] totals and catches up from the ledger's change log
//! ([`DispatchLedger::changed_since`]): a pick re-lays only the instances whose legs changed
//! since the last one (recorded, answered, ended, withdrawn or expired). The totals are exact
//! at the pick's time because the pick expires the ledger at that time first
//! ([`DispatchLedger::expire`] drops every aged leg), and the stall is read against it.

use super::super::dense::DenseRanks;
use super::super::ledger::{DispatchLedger, RankBacklog, Settled};
use crate::ids::InstanceId;
use crate::time::Tick;

/// Layouts whose rows are kept at once (one per model picked recently, as the slot cache's).
const LAYOUTS: usize = super::super::dense::SLOT_CACHE_LAYOUTS;

/// The ledger's backlog per row of one layout: a row holds an entry while its (namespace,
/// instance, rank) holds legs.
#[derive(Debug)]
pub(in crate::picker) struct RowBacklogs {
    /// The layout ([`DenseRanks::id`]) and ledger ([`DispatchLedger::id`]) reflected, and the
    /// ledger's changes seen.
    layout: u64,
    ledger: u64,
    seen: u64,
    /// Per row: its entry plus one (0: no backlog).
    entry_of: Vec<u32>,
    entries: Vec<Settled>,
    /// Per entry, its row.
    rows: Vec<u32>,
    /// Per row: its decode backlog (0: none) and from when it is stalled (nanoseconds;
    /// `u64::MAX`: never), for passes reading every row ([`super::beside`]).
    decode: Vec<u64>,
    stall_from: Vec<u64>,
    /// The pick's time, which a row's stall is read against (and in nanoseconds).
    now: Tick,
    now_nanos: u64,
}

impl RowBacklogs {
    /// Holding nothing (a pick without ledgers).
    pub(in crate::picker) const EMPTY: RowBacklogs = RowBacklogs {
        layout: 0,
        ledger: 0,
        seen: 0,
        entry_of: Vec::new(),
        entries: Vec::new(),
        rows: Vec::new(),
        decode: Vec::new(),
        stall_from: Vec::new(),
        now: Tick::ZERO,
        now_nanos: 0,
    };

    /// The rows holding a backlog, each once, in no particular order.
    pub(in crate::picker) fn rows(&self) -> &[u32] {
        &self.rows
    }

    /// Per row its decode backlog and from when it is stalled (nanoseconds, `u64::MAX`:
    /// never), and the pick's time in nanoseconds: row `r` is stalled when
    /// `stall_from[r] <= now`.
    pub(in crate::picker) fn columns(&self) -> (&[u64], &[u64], u64) {
        (&self.decode, &self.stall_from, self.now_nanos)
    }

    #[inline(always)]
    pub(in crate::picker) fn get(&self, row: usize) -> RankBacklog {
        match self.entry_of.get(row) {
            Some(&e) if e > 0 => self
                .entries
                .get(e as usize - 1)
                .map(|s| s.at(self.now))
                .unwrap_or_default(),
            _ => RankBacklog::default(),
        }
    }

    /// Brings the rows up to date with `ledger` (expired at `now`): the changed instances
    /// re-laid, or every row when the log does not reach back (or too much changed).
    fn catch_up(&mut self, dense: &DenseRanks, ledger: &DispatchLedger, now: Tick) {
        self.now = now;
        self.now_nanos = nanos(now);
        let same = self.ledger == ledger.id() && self.entry_of.len() == dense.len();
        let behind = ledger.changes().wrapping_sub(self.seen);
        let relaid = same
            && behind <= (dense.len() / 8).max(16) as u64
            && match ledger.changed_since(self.seen) {
                Some(changed) => {
                    for instance in changed {
                        self.relay(dense, ledger, instance);
                    }
                    true
                }
                None => false,
            };
        if !relaid {
            self.refill(dense, ledger);
        }
        self.seen = ledger.changes();
    }

    /// Every row afresh.
    fn refill(&mut self, dense: &DenseRanks, ledger: &DispatchLedger) {
        self.layout = dense.id();
        self.ledger = ledger.id();
        self.entry_of.clear();
        self.entry_of.resize(dense.len(), 0);
        self.entries.clear();
        self.rows.clear();
        self.decode.clear();
        self.decode.resize(dense.len(), 0);
        self.stall_from.clear();
        self.stall_from.resize(dense.len(), u64::MAX);
        ledger.for_each_settled(|ns, instance, rank, settled| {
            for row in dense.rows_of(instance) {
                if dense.rank[row] == rank && dense.namespace_of(row) == Some(ns) {
                    self.set(row, settled);
                }
            }
        });
    }

    /// The rows of `instance` afresh.
    fn relay(&mut self, dense: &DenseRanks, ledger: &DispatchLedger, instance: InstanceId) {
        for row in dense.rows_of(instance) {
            self.clear(row);
        }
        ledger.settled_of(instance, |ns, rank, settled| {
            for row in dense.rows_of(instance) {
                if dense.rank[row] == rank && dense.namespace_of(row) == Some(ns) {
                    self.set(row, settled);
                }
            }
        });
    }

    fn set(&mut self, row: usize, settled: Settled) {
        let Some(mark) = self.entry_of.get_mut(row) else {
            return;
        };
        if let (Some(d), Some(s)) = (self.decode.get_mut(row), self.stall_from.get_mut(row)) {
            *d = settled.decode_blocks;
            *s = settled.stalled_from.map_or(u64::MAX, nanos);
        }
        match self.entries.get_mut((*mark as usize).wrapping_sub(1)) {
            Some(entry) if *mark > 0 => *entry = settled,
            _ => {
                // At most one entry per row: fits u32 as the rows do.
                self.entries.push(settled);
                self.rows.push(row as u32);
                *mark = self.entries.len() as u32;
            }
        }
    }

    fn clear(&mut self, row: usize) {
        let Some(mark) = self.entry_of.get_mut(row) else {
            return;
        };
        let Some(e) = (*mark as usize).checked_sub(1) else {
            return;
        };
        *mark = 0;
        if let (Some(d), Some(s)) = (self.decode.get_mut(row), self.stall_from.get_mut(row)) {
            (*d, *s) = (0, u64::MAX);
        }
        if e >= self.entries.len() {
            return;
        }
        self.entries.swap_remove(e);
        self.rows.swap_remove(e);
        if let Some(&moved) = self.rows.get(e)
            && let Some(m) = self.entry_of.get_mut(moved as usize)
        {
            *m = e as u32 + 1;
        }
    }
}

/// A tick in nanoseconds, saturating (at 584 years).
fn nanos(t: Tick) -> u64 {
    u64::try_from(t.0.as_nanos()).unwrap_or(u64::MAX)
}

/// The [`RowBacklogs`] of the layouts picked recently.
#[derive(Debug, Default)]
pub(in crate::picker) struct RowBacklogCache {
    layouts: Vec<RowBacklogs>,
}

impl RowBacklogCache {
    /// `dense`'s rows with `ledger`'s backlogs, caught up; `ledger` must have been expired at
    /// `now` ([`DispatchLedger::expire`]).
    pub(in crate::picker) fn caught_up(
        &mut self,
        dense: &DenseRanks,
        ledger: &DispatchLedger,
        now: Tick,
    ) -> &RowBacklogs {
        let pos = match self.layouts.iter().position(|r| r.layout == dense.id()) {
            Some(pos) => pos,
            None => {
                if self.layouts.len() >= LAYOUTS {
                    self.layouts.remove(0);
                }
                let mut fresh = RowBacklogs::EMPTY;
                fresh.layout = dense.id();
                self.layouts.push(fresh);
                self.layouts.len() - 1
            }
        };
        let rows = &mut self.layouts[pos];
        rows.catch_up(dense, ledger, now);
        rows
    }
}

#[cfg(test)]
mod tests;
