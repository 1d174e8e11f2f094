//! One instance's unanswered legs, with running totals per rank, so a rank's backlog is read
//! in O(ranks of the instance) instead of by walking every leg held for it.
//!
//! A pick reads every candidate rank's backlog. While samples answer dispatches the legs are
//! few, but when a fleet's publishers fall silent (or lag) they pile up for
//! [`DISPATCH_MAX_AGE`] — thousands — and a pick that walked them cost O(legs): with prompts
//! large enough to spread the picks over every worker, 1,000 ranks took ~100 µs a pick.

use std::collections::VecDeque;

use super::{DISPATCH_MAX_AGE, DispatchId, Pending, RankBacklog, STALL_AFTER, Settled};
use crate::ids::DpRank;
use crate::time::Tick;

/// What the legs held for one rank add up to (exact: at most [`super::MAX_LEDGER_DISPATCHES`]
/// `u64`s fit a `u128`, saturated to `u64` on read as the per-leg sum saturates).
#[derive(Clone, Copy, Debug, Default)]
struct Totals {
    prefill_tokens: u128,
    decode_blocks: u128,
    legs: u32,
    /// Legs that may still mark a stall.
    may_stall: u32,
}

/// The legs of one instance in dispatch order, and their totals per rank.
#[derive(Debug, Default)]
pub(super) struct Pendings {
    legs: VecDeque<Pending>,
    /// Per rank holding legs (a worker has few ranks).
    totals: Vec<(DpRank, Totals)>,
    /// Every leg was recorded no earlier than the one before it: the front is the oldest and
    /// a rank's first stall-eligible leg its oldest, so the totals answer exactly. A caller
    /// whose clock stepped back falls back to walking the legs until the instance empties.
    ordered: bool,
}

impl Pendings {
    pub(super) fn push_back(&mut self, pending: Pending) {
        if self.legs.is_empty() {
            self.ordered = true;
        }
        self.ordered &= self.legs.back().is_none_or(|last| last.at <= pending.at);
        self.account(&pending, true);
        self.legs.push_back(pending);
    }

    pub(super) fn front(&self) -> Option<&Pending> {
        self.legs.front()
    }

    pub(super) fn pop_front(&mut self) -> Option<Pending> {
        let pending = self.legs.pop_front()?;
        self.account(&pending, false);
        Some(pending)
    }

    /// Removes the leg of dispatch `id`, if held; whether one was.
    pub(super) fn remove(&mut self, id: DispatchId) -> bool {
        // Expiry and the size bound forget the oldest dispatch, which sits at the front.
        let pos = if self.legs.front().is_some_and(|p| p.id == id) {
            Some(0)
        } else {
            self.legs.iter().position(|p| p.id == id)
        };
        let Some(pending) = pos.and_then(|pos| self.legs.remove(pos)) else {
            return false;
        };
        self.account(&pending, false);
        true
    }

    /// Dispatch `id`'s legs no longer mark a stall; whether one did.
    pub(super) fn clear_stall(&mut self, id: DispatchId) -> bool {
        let Self { legs, totals, .. } = self;
        let mut cleared = false;
        for pending in legs.iter_mut().filter(|p| p.id == id && p.may_stall) {
            pending.may_stall = false;
            cleared = true;
            if let Some((_, t)) = totals.iter_mut().find(|(r, _)| *r == pending.rank) {
                t.may_stall = t.may_stall.saturating_sub(1);
            }
        }
        cleared
    }

    pub(super) fn is_empty(&self) -> bool {
        self.legs.is_empty()
    }

    pub(super) fn len(&self) -> usize {
        self.legs.len()
    }

    /// Legs recorded for peer replicas.
    pub(super) fn peer_len(&self) -> usize {
        self.legs.iter().filter(|p| p.peer).count()
    }

    /// Every leg this router recorded itself (not a peer's), in order.
    pub(super) fn for_each_local(&self, mut f: impl FnMut(&Pending)) {
        self.legs.iter().filter(|p| !p.peer).for_each(&mut f);
    }

    /// What the legs add to `rank` at `now` (legs past [`DISPATCH_MAX_AGE`] count for nothing):
    /// from the totals while every leg still counts, else by walking them.
    pub(super) fn backlog(&self, rank: DpRank, now: Tick) -> RankBacklog {
        if !self.totals_answer(now) {
            return self.walk(rank, now);
        }
        self.totals
            .iter()
            .find(|(r, _)| *r == rank)
            .map(|&(_, t)| self.of(rank, t, now))
            .unwrap_or_default()
    }

    /// Every rank's totals, one call per rank holding legs: what its legs add while every one
    /// of them counts (no leg [`DISPATCH_MAX_AGE`] old), and from when it is stalled (its
    /// oldest stall-eligible leg's time plus [`STALL_AFTER`]; `None`: it holds none).
    pub(super) fn for_each_settled(&self, mut f: impl FnMut(DpRank, Settled)) {
        for &(rank, t) in &self.totals {
            let stall_from = if t.may_stall == 0 {
                None
            } else if self.ordered {
                // In time order: the rank's first stall-eligible leg is its oldest.
                self.legs
                    .iter()
                    .find(|p| p.rank == rank && p.may_stall)
                    .map(|p| p.at)
            } else {
                self.legs
                    .iter()
                    .filter(|p| p.rank == rank && p.may_stall)
                    .map(|p| p.at)
                    .min()
            };
            f(
                rank,
                Settled {
                    prefill_tokens: u64::try_from(t.prefill_tokens).unwrap_or(u64::MAX),
                    decode_blocks: u64::try_from(t.decode_blocks).unwrap_or(u64::MAX),
                    stalled_from: stall_from.map(|at| at.plus(STALL_AFTER)),
                },
            );
        }
    }

    /// Whether the totals are exact at `now`: the legs are in time order and the oldest still
    /// counts (so every one does).
    fn totals_answer(&self, now: Tick) -> bool {
        self.ordered
            && self
                .legs
                .front()
                .is_none_or(|p| now.since(p.at) < DISPATCH_MAX_AGE)
    }

    /// `rank`'s totals as a backlog: stalled when its oldest stall-eligible leg (the first in
    /// order; found only when it holds one) is [`STALL_AFTER`] old.
    fn of(&self, rank: DpRank, t: Totals, now: Tick) -> RankBacklog {
        let stalled = t.may_stall > 0
            && self
                .legs
                .iter()
                .find(|p| p.rank == rank && p.may_stall)
                .is_some_and(|p| now.since(p.at) >= STALL_AFTER);
        RankBacklog {
            prefill_tokens: u64::try_from(t.prefill_tokens).unwrap_or(u64::MAX),
            decode_blocks: u64::try_from(t.decode_blocks).unwrap_or(u64::MAX),
            stalled,
        }
    }

    /// The backlog of `rank` by walking every leg (the reference the totals shortcut).
    fn walk(&self, rank: DpRank, now: Tick) -> RankBacklog {
        let mut out = RankBacklog::default();
        for p in self.legs.iter().filter(|p| p.rank == rank) {
            let age = now.since(p.at);
            if age >= DISPATCH_MAX_AGE {
                continue;
            }
            out.prefill_tokens = out.prefill_tokens.saturating_add(p.prefill_tokens);
            out.decode_blocks = out.decode_blocks.saturating_add(p.decode_blocks);
            out.stalled |= p.may_stall && age >= STALL_AFTER;
        }
        out
    }

    /// Adds (or takes away) one leg from its rank's totals; a rank left with no leg is dropped.
    fn account(&mut self, p: &Pending, add: bool) {
        let pos = match self.totals.iter().position(|(r, _)| *r == p.rank) {
            Some(pos) => pos,
            None if add => {
                self.totals.push((p.rank, Totals::default()));
                self.totals.len() - 1
            }
            None => return,
        };
        let t = &mut self.totals[pos].1;
        let (tokens, blocks) = (u128::from(p.prefill_tokens), u128::from(p.decode_blocks));
        let stall = u32::from(p.may_stall);
        if add {
            t.prefill_tokens += tokens;
            t.decode_blocks += blocks;
            t.legs = t.legs.saturating_add(1);
            t.may_stall = t.may_stall.saturating_add(stall);
        } else {
            t.prefill_tokens = t.prefill_tokens.saturating_sub(tokens);
            t.decode_blocks = t.decode_blocks.saturating_sub(blocks);
            t.legs = t.legs.saturating_sub(1);
            t.may_stall = t.may_stall.saturating_sub(stall);
        }
        if t.legs == 0 {
            self.totals.swap_remove(pos);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::tests::{key, leg, s};
    use super::super::{DispatchLedger, RankBacklog};
    use crate::ids::DpRank;
    use crate::time::Tick;

    #[test]
    fn laying_the_ledger_onto_rows_visits_each_rank_once_however_many_legs() {
        // Publishers fell silent: thousands of legs pile up on one worker's two ranks. Rows are
        // laid from one total per rank, not by walking them.
        let w = key("ns", 1);
        let mut ledger = DispatchLedger::new();
        for i in 0..10_000u64 {
            let mut l = leg(w.clone(), 94, false);
            l.rank = DpRank((i % 2) as u32);
            ledger.record_dispatch(&[l], Tick(Duration::from_micros(i)));
        }
        let now = s(6);
        ledger.expire(now);
        let mut calls = Vec::new();
        ledger.for_each_settled(|_, instance, rank, settled| {
            calls.push((instance, rank, settled.at(now)))
        });
        calls.sort_by_key(|&(_, rank, _)| rank);
        let total = RankBacklog {
            prefill_tokens: 5_000 * 94 * 16,
            decode_blocks: 5_000 * 94,
            stalled: true,
        };
        assert_eq!(
            calls,
            [
                (w.instance_id, DpRank(0), total),
                (w.instance_id, DpRank(1), total)
            ]
        );
        let ns = ledger.namespace(&w.namespace).expect("pending");
        assert_eq!(ns.backlog(w.instance_id, DpRank(1), now), total);
    }

    #[test]
    fn legs_recorded_out_of_time_order_are_still_summed_exactly() {
        // A request that read the clock before another took the lock records an earlier tick
        // after it: the totals no longer know the oldest leg, so the legs are walked.
        let w = key("ns", 1);
        let mut ledger = DispatchLedger::new();
        ledger.record_dispatch(&[leg(w.clone(), 1, false)], s(10));
        ledger.record_dispatch(&[leg(w.clone(), 4, false)], s(3));
        let b = ledger.backlog(&w, DpRank(0), s(8));
        assert_eq!((b.decode_blocks, b.stalled), (5, true));
        // At 34 s the leg of 3 s has aged out though the front (10 s) has not.
        let b = ledger.backlog(&w, DpRank(0), s(34));
        assert_eq!((b.decode_blocks, b.stalled), (1, false));
        // Expiry drops the aged leg behind the younger front: what is laid onto rows is exact.
        ledger.expire(s(34));
        let mut laid = RankBacklog::default();
        ledger.for_each_settled(|_, _, _, settled| laid = settled.at(s(34)));
        assert_eq!((laid.decode_blocks, laid.stalled), (1, false));
        assert_eq!(ledger.unanswered(), 1);
    }
}
