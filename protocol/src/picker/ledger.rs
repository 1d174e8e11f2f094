//! Unanswered dispatches: what the router pinned to a rank since its worker's last sample.
//!
//! Upstream publishers are change-driven and best-effort, so between two samples a burst of
//! requests would all see the same (stale) load and land on the same rank. Each pinned request
//! therefore adds its prompt tokens (prefill) or blocks (decode) to the chosen rank's backlog
//! until any sample from that worker arrives after the dispatch, for at most
//! [`DISPATCH_MAX_AGE`]. A rank that leaves a request of [`STALL_MIN_BLOCKS`] or more blocks
//! unanswered for [`STALL_AFTER`] may be stalled; the picker avoids it while another rank has a
//! cost. The decode half of a prefill+decode pair (it only receives the request after the prefill
//! finishes) and a request that has ended never mark a stall.
//!
//! Pure state: every method takes the caller's `now`, nothing reads a clock.

use std::collections::VecDeque;
use std::time::Duration;

use answer::AnsweredMark;
use pendings::Pendings;

use crate::ids::{DpRank, InstanceId, Namespace, WorkerKey};
use crate::time::Tick;

mod answer;
mod peers;
mod pendings;

pub use peers::LocalContribution;

/// A dispatch stops counting as backlog this long after it was pinned, answered or not.
pub const DISPATCH_MAX_AGE: Duration = Duration::from_secs(30);

/// An unanswered request this old may mean a stalled engine.
pub const STALL_AFTER: Duration = Duration::from_secs(5);

/// Requests smaller than this many blocks never mark a stall (a tiny request may legitimately
/// change nothing the worker publishes).
pub const STALL_MIN_BLOCKS: u64 = 2;

/// Dispatches held at most; the oldest are forgotten first.
pub const MAX_LEDGER_DISPATCHES: usize = 65_536;

/// Instances whose legs changed, remembered for readers catching up ([`DispatchLedger::changed_since`]).
pub use crate::change_log::CHANGE_LOG;
use crate::change_log::ChangeLog;

/// Slots of the counting filter that lets a pick skip the map lookup for the (usually many)
/// ranks without an unanswered dispatch.
const FILTER_SLOTS: usize = 1024;

#[inline]
fn filter_slot(instance: InstanceId) -> usize {
    // The top bits of a Fibonacci hash: < FILTER_SLOTS by construction.
    (instance.0.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - FILTER_SLOTS.trailing_zeros()))
        as usize
}

/// One pinned request, as the ledger knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DispatchId(pub u64);

/// One rank a dispatch was pinned to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DispatchLeg {
    pub worker: WorkerKey,
    pub rank: DpRank,
    /// Added to the rank's prefill backlog (the prompt tokens on a prefill leg, else 0).
    pub prefill_tokens: u64,
    /// Added to the rank's decode backlog (the prompt's blocks on a decode leg, else 0).
    pub decode_blocks: u64,
    /// The request's size in the rank's blocks, for the stall threshold.
    pub request_blocks: u64,
    /// The decode half of a prefill+decode pair: never marks a stall.
    pub stall_exempt: bool,
}

/// What the ledger adds to one rank at pick time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankBacklog {
    pub prefill_tokens: u64,
    pub decode_blocks: u64,
    /// The rank left a stall-eligible request unanswered for [`STALL_AFTER`].
    pub stalled: bool,
}

/// What the legs held for one rank add up to, once [`DispatchLedger::expire`] ran at the time
/// they are read at (so every held leg counts): the backlog at any such time, the stall read
/// against it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Settled {
    pub prefill_tokens: u64,
    pub decode_blocks: u64,
    /// From when the rank is stalled (its oldest stall-eligible leg plus [`STALL_AFTER`]).
    pub stalled_from: Option<Tick>,
}

impl Settled {
    /// The backlog at `now`.
    #[inline]
    pub fn at(&self, now: Tick) -> RankBacklog {
        RankBacklog {
            prefill_tokens: self.prefill_tokens,
            decode_blocks: self.decode_blocks,
            stalled: self.stalled_from.is_some_and(|from| now >= from),
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Pending {
    id: DispatchId,
    rank: DpRank,
    at: Tick,
    prefill_tokens: u64,
    decode_blocks: u64,
    /// Large enough and not exempt; cleared when the request ends.
    may_stall: bool,
    /// A peer replica's contribution ([`DispatchLedger::record_peer`]), not this router's.
    peer: bool,
}

/// Per-instance pendings, hashed cheaply (see [`crate::id_hash`]): SipHash would dominate a
/// 1,000-rank pick.
type IdMap<V> = crate::id_hash::IdMap<InstanceId, V>;

#[derive(Debug)]
struct NamespaceLedger {
    namespace: Namespace,
    workers: IdMap<Pendings>,
}

/// Where a dispatch's legs live, in dispatch order, for expiry and [`DispatchLedger::request_ended`].
#[derive(Debug)]
struct Dispatched {
    id: DispatchId,
    at: Tick,
    workers: Vec<WorkerKey>,
    /// Recorded by [`DispatchLedger::record_peer`].
    peer: bool,
}

/// The unanswered-dispatch ledger. See the module docs.
#[derive(Debug)]
pub struct DispatchLedger {
    /// Unique per ledger: what a reader of [`Self::changed_since`] caught up with.
    id: u64,
    /// Mutations of some instance's legs, naming the instance, for the last [`CHANGE_LOG`].
    change_log: ChangeLog<InstanceId>,
    /// The latest `at` recorded since `order` was last empty, and how far before the latest
    /// recorded so far a dispatch was recorded (a caller that read its clock before another
    /// took the lock): every held dispatch lies at most `backstep` before any recorded ahead
    /// of it, which bounds [`Self::expire`]'s search for aged dispatches.
    latest: Tick,
    backstep: Duration,
    /// What [`Self::answer_store`] last answered against (see there).
    answered: Option<AnsweredMark>,
    /// Instances to answer, reused across [`Self::answer_store`] calls.
    to_answer: Vec<InstanceId>,
    /// At most one per configured namespace (16); emptied namespaces are removed.
    namespaces: Vec<NamespaceLedger>,
    /// Dispatch order (ids increase), including dispatches already answered by a sample.
    order: VecDeque<Dispatched>,
    next_id: u64,
    /// Pending legs per instance-id slot (empty until the first dispatch): zero means no rank of
    /// any instance in that slot has one.
    filter: Vec<u32>,
    /// Pending legs across every namespace (the filter's total).
    legs: usize,
    /// This router's place among the live replicas ([`Self::set_place`]).
    place: crate::picker::tie_break::Place,
}

impl Default for DispatchLedger {
    fn default() -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Self {
            id: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            change_log: ChangeLog::default(),
            latest: Tick::ZERO,
            backstep: Duration::ZERO,
            answered: None,
            to_answer: Vec::new(),
            namespaces: Vec::new(),
            order: VecDeque::new(),
            next_id: 0,
            filter: Vec::new(),
            legs: 0,
            place: crate::picker::tie_break::Place::default(),
        }
    }
}

impl DispatchLedger {
    pub fn new() -> Self {
        Self::default()
    }

    /// Unique per ledger (a reader of [`Self::changed_since`] keys what it caught up with by it).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Mutations of some instance's legs so far (recorded, answered, ended, withdrawn, expired).
    pub fn changes(&self) -> u64 {
        self.change_log.changes()
    }

    /// The instances whose legs changed since [`Self::changes`] read `seen` (an instance once
    /// per change, in order), or `None` when the log no longer reaches back that far (or
    /// `seen` is ahead): the reader then re-reads every instance.
    pub fn changed_since(&self, seen: u64) -> Option<impl Iterator<Item = InstanceId> + '_> {
        self.change_log.since(seen, InstanceId(u64::MAX))
    }

    fn log(&mut self, instance: InstanceId) {
        self.change_log.push(instance);
    }

    /// True when no rank carries an unanswered dispatch.
    pub fn is_empty(&self) -> bool {
        self.namespaces.is_empty()
    }

    /// Dispatches remembered (answered ones linger until they age out).
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Records one pinned request's legs at `now`.
    pub fn record_dispatch(&mut self, legs: &[DispatchLeg], now: Tick) -> DispatchId {
        self.record(legs, now, false)
    }

    fn record(&mut self, legs: &[DispatchLeg], now: Tick, peer: bool) -> DispatchId {
        self.expire(now);
        while self.order.len() >= MAX_LEDGER_DISPATCHES {
            if let Some(oldest) = self.order.pop_front() {
                self.forget(&oldest);
            }
        }
        if self.order.is_empty() {
            (self.latest, self.backstep) = (now, Duration::ZERO);
        }
        self.backstep = self.backstep.max(self.latest.since(now));
        self.latest = self.latest.max(now);
        let id = DispatchId(self.next_id);
        self.next_id = self.next_id.wrapping_add(1);
        let mut workers = Vec::with_capacity(legs.len());
        for leg in legs {
            let pending = Pending {
                id,
                rank: leg.rank,
                at: now,
                prefill_tokens: leg.prefill_tokens,
                decode_blocks: leg.decode_blocks,
                may_stall: !peer && !leg.stall_exempt && leg.request_blocks >= STALL_MIN_BLOCKS,
                peer,
            };
            self.namespace_mut(&leg.worker.namespace)
                .workers
                .entry(leg.worker.instance_id)
                .or_default()
                .push_back(pending);
            if self.filter.is_empty() {
                self.filter = vec![0; FILTER_SLOTS];
            }
            let slot = &mut self.filter[filter_slot(leg.worker.instance_id)];
            *slot = slot.saturating_add(1);
            self.legs += 1;
            self.log(leg.worker.instance_id);
            workers.push(leg.worker.clone());
        }
        self.order.push_back(Dispatched {
            id,
            at: now,
            workers,
            peer,
        });
        id
    }

    /// The request ended (completed, refused by the frontend, failed or cancelled): it may never
    /// have reached the engine, so it no longer marks a stall. Its backlog stays until a sample
    /// answers it or it ages out.
    pub fn request_ended(&mut self, id: DispatchId) {
        let Ok(pos) = self.order.binary_search_by_key(&id, |d| d.id) else {
            return;
        };
        let Self {
            namespaces,
            order,
            change_log,
            ..
        } = self;
        for worker in &order[pos].workers {
            let pendings = namespaces
                .iter_mut()
                .find(|ns| ns.namespace == worker.namespace)
                .and_then(|ns| ns.workers.get_mut(&worker.instance_id));
            if let Some(pendings) = pendings
                && pendings.clear_stall(id)
            {
                change_log.push(worker.instance_id);
            }
        }
    }

    /// Forgets a dispatch that was never sent (no shim replica took it).
    pub fn withdraw(&mut self, id: DispatchId) {
        if let Ok(pos) = self.order.binary_search_by_key(&id, |d| d.id)
            && let Some(dispatched) = self.order.remove(pos)
        {
            self.forget(&dispatched);
        }
    }

    /// A sample from `worker` (any rank) was received at `at`: it answers every dispatch pinned
    /// to that worker before `at`. A dispatch at the same instant is kept, since the sample may
    /// predate it.
    pub fn sample_arrived(&mut self, worker: &WorkerKey, at: Tick) {
        let Some(ns_pos) = self
            .namespaces
            .iter()
            .position(|ns| ns.namespace == worker.namespace)
        else {
            return;
        };
        let ns = &mut self.namespaces[ns_pos];
        if let Some(pendings) = ns.workers.get_mut(&worker.instance_id) {
            // Pendings are in dispatch order, so the answered ones are a prefix.
            let held = pendings.len();
            while pendings.front().is_some_and(|p| p.at < at) {
                pendings.pop_front();
                unfilter(&mut self.filter, &mut self.legs, worker.instance_id);
            }
            if pendings.len() != held {
                self.change_log.push(worker.instance_id);
            }
            if pendings.is_empty() {
                ns.workers.remove(&worker.instance_id);
            }
        }
        if ns.workers.is_empty() {
            self.namespaces.swap_remove(ns_pos);
        }
    }

    /// Answers every worker's unanswered dispatches with the last sample received from it:
    /// `last_arrival(instance)` is that sample's receipt time, if any. Equivalent to
    /// [`Self::sample_arrived`] for each worker holding a dispatch, in one pass over the (few)
    /// workers with pending dispatches instead of one call per candidate rank. Instance ids are
    /// matched across namespaces, as the load store (keyed by instance id) reports them.
    pub fn answer_arrivals(&mut self, mut last_arrival: impl FnMut(InstanceId) -> Option<Tick>) {
        let Self {
            namespaces,
            filter,
            legs,
            change_log,
            ..
        } = self;
        for ns in namespaces.iter_mut() {
            ns.workers.retain(|&instance, pendings| {
                if let Some(at) = last_arrival(instance) {
                    let held = pendings.len();
                    while pendings.front().is_some_and(|p| p.at < at) {
                        pendings.pop_front();
                        unfilter(filter, legs, instance);
                    }
                    if pendings.len() != held {
                        change_log.push(instance);
                    }
                }
                !pendings.is_empty()
            });
        }
        namespaces.retain(|ns| !ns.workers.is_empty());
    }

    /// Every rank holding legs, per namespace and instance, as [`Settled`] totals: exact at a
    /// time `now` once [`Self::expire`] ran at `now`.
    pub fn for_each_settled(&self, mut f: impl FnMut(&Namespace, InstanceId, DpRank, Settled)) {
        for ns in &self.namespaces {
            for (&instance, pendings) in &ns.workers {
                pendings
                    .for_each_settled(|rank, settled| f(&ns.namespace, instance, rank, settled));
            }
        }
    }

    /// [`Self::for_each_settled`] for one instance (in every namespace holding legs for it).
    pub fn settled_of(&self, instance: InstanceId, mut f: impl FnMut(&Namespace, DpRank, Settled)) {
        for ns in &self.namespaces {
            if let Some(pendings) = ns.workers.get(&instance) {
                pendings.for_each_settled(|rank, settled| f(&ns.namespace, rank, settled));
            }
        }
    }

    /// Legs held (not yet answered, withdrawn or expired), in O(1): [`Self::unanswered`] counts
    /// the same by walking them.
    pub fn pending_legs(&self) -> usize {
        self.legs
    }

    /// Legs still counting as some rank's backlog (not yet answered, withdrawn or aged out).
    pub fn unanswered(&self) -> usize {
        self.namespaces
            .iter()
            .flat_map(|ns| ns.workers.values())
            .map(Pendings::len)
            .sum()
    }

    /// Drops every dispatch [`DISPATCH_MAX_AGE`] old at `now`: afterwards every held leg counts
    /// as backlog at `now` (what [`NamespaceBacklog::for_each_settled`] relies on). Dispatches
    /// are held in dispatch order, their times in order but for the largest step back a record
    /// made, so beside the aged front only the dispatches within that step of the age limit
    /// are looked at.
    pub fn expire(&mut self, now: Tick) {
        while let Some(oldest) = self.order.front() {
            if now.since(oldest.at) < DISPATCH_MAX_AGE {
                break;
            }
            if let Some(oldest) = self.order.pop_front() {
                self.forget(&oldest);
            }
        }
        if self.backstep.is_zero() {
            return;
        }
        // Recorded out of time order: an aged dispatch may sit behind a younger one, but no
        // further behind than the backstep allows.
        let mut ahead = Tick::ZERO;
        let mut i = 0;
        while let Some(d) = self.order.get(i) {
            ahead = ahead.max(d.at);
            if now.since(d.at) >= DISPATCH_MAX_AGE {
                if let Some(aged) = self.order.remove(i) {
                    self.forget(&aged);
                }
                continue;
            }
            // Everything behind was recorded at or after `ahead - backstep`: young.
            if now.since(ahead).saturating_add(self.backstep) < DISPATCH_MAX_AGE {
                break;
            }
            i += 1;
        }
    }

    /// What the ledger adds to `(worker, rank)` at `now`.
    pub fn backlog(&self, worker: &WorkerKey, rank: DpRank, now: Tick) -> RankBacklog {
        self.namespace(&worker.namespace)
            .map(|ns| ns.backlog(worker.instance_id, rank, now))
            .unwrap_or_default()
    }

    /// A per-namespace reader, resolved once per pick so the per-rank lookup hashes only the
    /// instance id.
    pub fn namespace(&self, namespace: &Namespace) -> Option<NamespaceBacklog<'_>> {
        self.namespaces
            .iter()
            .find(|ns| &ns.namespace == namespace)
            .map(|ns| NamespaceBacklog {
                workers: &ns.workers,
                filter: &self.filter,
            })
    }

    fn namespace_mut(&mut self, namespace: &Namespace) -> &mut NamespaceLedger {
        let pos = match self
            .namespaces
            .iter()
            .position(|ns| &ns.namespace == namespace)
        {
            Some(pos) => pos,
            None => {
                self.namespaces.push(NamespaceLedger {
                    namespace: namespace.clone(),
                    workers: IdMap::default(),
                });
                self.namespaces.len() - 1
            }
        };
        &mut self.namespaces[pos]
    }

    /// Removes a dispatch's legs still held (a sample may have answered them already).
    fn forget(&mut self, dispatched: &Dispatched) {
        for worker in &dispatched.workers {
            let Some(ns_pos) = self
                .namespaces
                .iter()
                .position(|ns| ns.namespace == worker.namespace)
            else {
                continue;
            };
            let ns = &mut self.namespaces[ns_pos];
            if let Some(pendings) = ns.workers.get_mut(&worker.instance_id) {
                if pendings.remove(dispatched.id) {
                    unfilter(&mut self.filter, &mut self.legs, worker.instance_id);
                    self.change_log.push(worker.instance_id);
                }
                if pendings.is_empty() {
                    ns.workers.remove(&worker.instance_id);
                }
            }
            if ns.workers.is_empty() {
                self.namespaces.swap_remove(ns_pos);
            }
        }
    }
}

fn unfilter(filter: &mut [u32], legs: &mut usize, instance: InstanceId) {
    if let Some(slot) = filter.get_mut(filter_slot(instance)) {
        *slot = slot.saturating_sub(1);
    }
    *legs = legs.saturating_sub(1);
}

/// The ledger of one namespace, borrowed for one pick.
#[derive(Clone, Copy)]
pub struct NamespaceBacklog<'a> {
    workers: &'a IdMap<Pendings>,
    filter: &'a [u32],
}

impl std::fmt::Debug for NamespaceBacklog<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NamespaceBacklog")
            .field("workers", &self.workers.len())
            .finish()
    }
}

impl NamespaceBacklog<'_> {
    /// What the ledger adds to `(instance, rank)` at `now`. Dispatches past
    /// [`DISPATCH_MAX_AGE`] count for nothing even before [`DispatchLedger::expire`] drops them.
    #[inline]
    pub fn backlog(&self, instance: InstanceId, rank: DpRank, now: Tick) -> RankBacklog {
        // Most ranks have nothing pending: the filter answers without a map lookup or a call.
        if self
            .filter
            .get(filter_slot(instance))
            .is_none_or(|&n| n == 0)
        {
            return RankBacklog::default();
        }
        self.lookup(instance, rank, now)
    }

    #[inline(never)]
    fn lookup(&self, instance: InstanceId, rank: DpRank, now: Tick) -> RankBacklog {
        self.workers
            .get(&instance)
            .map(|pendings| pendings.backlog(rank, now))
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn key(ns: &str, id: u64) -> WorkerKey {
        WorkerKey {
            namespace: Namespace::new(ns),
            instance_id: InstanceId(id),
        }
    }

    pub(super) fn leg(worker: WorkerKey, blocks: u64, exempt: bool) -> DispatchLeg {
        DispatchLeg {
            worker,
            rank: DpRank(0),
            prefill_tokens: blocks * 16,
            decode_blocks: blocks,
            request_blocks: blocks,
            stall_exempt: exempt,
        }
    }

    pub(super) const fn s(secs: u64) -> Tick {
        Tick(Duration::from_secs(secs))
    }

    #[test]
    fn backlog_accumulates_per_rank_until_a_later_sample() {
        let w = key("ns", 1);
        let mut ledger = DispatchLedger::new();
        ledger.record_dispatch(&[leg(w.clone(), 3, false)], s(1));
        ledger.record_dispatch(&[leg(w.clone(), 2, false)], s(2));
        let other_rank = ledger.backlog(&w, DpRank(1), s(2));
        assert_eq!(other_rank, RankBacklog::default());
        let b = ledger.backlog(&w, DpRank(0), s(2));
        assert_eq!((b.prefill_tokens, b.decode_blocks), (80, 5));

        // A sample received at t=2 predates (or races) the t=2 dispatch: only t=1 is answered.
        ledger.sample_arrived(&w, s(2));
        assert_eq!(ledger.backlog(&w, DpRank(0), s(2)).decode_blocks, 2);
        ledger.sample_arrived(&w, s(3));
        assert_eq!(ledger.backlog(&w, DpRank(0), s(3)), RankBacklog::default());
        assert!(ledger.is_empty());
    }

    #[test]
    fn dispatches_age_out_after_thirty_seconds() {
        let w = key("ns", 1);
        let mut ledger = DispatchLedger::new();
        ledger.record_dispatch(&[leg(w.clone(), 4, false)], s(10));
        assert_eq!(ledger.backlog(&w, DpRank(0), s(39)).decode_blocks, 4);
        assert_eq!(ledger.backlog(&w, DpRank(0), s(40)).decode_blocks, 0);
        ledger.expire(s(40));
        assert_eq!(ledger.len(), 0);
        assert!(ledger.is_empty());
    }

    #[test]
    fn stall_needs_two_blocks_five_seconds_and_no_exemption() {
        let w = key("ns", 1);
        let small = key("ns", 2);
        let paired = key("ns", 3);
        let mut ledger = DispatchLedger::new();
        ledger.record_dispatch(&[leg(w.clone(), 2, false)], s(0));
        ledger.record_dispatch(&[leg(small.clone(), 1, false)], s(0));
        ledger.record_dispatch(&[leg(paired.clone(), 9, true)], s(0));
        assert!(!ledger.backlog(&w, DpRank(0), s(4)).stalled);
        assert!(ledger.backlog(&w, DpRank(0), s(5)).stalled);
        assert!(!ledger.backlog(&small, DpRank(0), s(5)).stalled);
        assert!(!ledger.backlog(&paired, DpRank(0), s(5)).stalled);
    }

    #[test]
    fn an_ended_request_keeps_its_backlog_but_marks_no_stall() {
        let w = key("ns", 1);
        let mut ledger = DispatchLedger::new();
        let id = ledger.record_dispatch(&[leg(w.clone(), 5, false)], s(0));
        ledger.request_ended(id);
        let b = ledger.backlog(&w, DpRank(0), s(6));
        assert_eq!((b.decode_blocks, b.stalled), (5, false));
    }

    #[test]
    fn a_withdrawn_dispatch_leaves_nothing() {
        let w = key("ns", 1);
        let mut ledger = DispatchLedger::new();
        let id = ledger.record_dispatch(&[leg(w.clone(), 5, false)], s(0));
        ledger.withdraw(id);
        assert_eq!(ledger.backlog(&w, DpRank(0), s(1)), RankBacklog::default());
        assert_eq!(ledger.len(), 0);
        assert!(ledger.is_empty());
    }

    #[test]
    fn namespaces_keep_equal_instance_ids_apart() {
        let a = key("a", 7);
        let b = key("b", 7);
        let mut ledger = DispatchLedger::new();
        ledger.record_dispatch(&[leg(a.clone(), 3, false)], s(0));
        assert_eq!(ledger.backlog(&b, DpRank(0), s(0)), RankBacklog::default());
        ledger.sample_arrived(&b, s(1));
        assert_eq!(ledger.backlog(&a, DpRank(0), s(1)).decode_blocks, 3);
    }

    #[test]
    fn the_lookup_filter_empties_with_the_ledger() {
        let (a, b) = (key("ns", 1), key("other", 2));
        let mut ledger = DispatchLedger::new();
        let first =
            ledger.record_dispatch(&[leg(a.clone(), 2, false), leg(b.clone(), 2, true)], s(0));
        let second = ledger.record_dispatch(&[leg(a.clone(), 3, false)], s(1));
        ledger.record_dispatch(&[leg(b.clone(), 4, false)], s(2));
        assert!(ledger.filter.iter().any(|&n| n > 0));
        ledger.withdraw(second);
        ledger.request_ended(first);
        ledger.sample_arrived(&a, s(5));
        assert_eq!(ledger.backlog(&b, DpRank(0), s(5)).decode_blocks, 6);
        ledger.expire(s(31));
        assert_eq!(ledger.backlog(&b, DpRank(0), s(31)).decode_blocks, 4);
        ledger.sample_arrived(&b, s(32));
        assert!(ledger.is_empty());
        assert!(ledger.filter.iter().all(|&n| n == 0));
    }

    #[test]
    fn the_ledger_is_bounded() {
        let w = key("ns", 1);
        let mut ledger = DispatchLedger::new();
        for _ in 0..MAX_LEDGER_DISPATCHES + 10 {
            ledger.record_dispatch(&[leg(w.clone(), 1, false)], s(0));
        }
        assert_eq!(ledger.len(), MAX_LEDGER_DISPATCHES);
        assert_eq!(
            ledger.backlog(&w, DpRank(0), s(0)).decode_blocks,
            MAX_LEDGER_DISPATCHES as u64
        );
    }

    #[derive(Clone, Debug)]
    enum Op {
        Record {
            worker: usize,
            rank: u32,
            blocks: u64,
            exempt: bool,
            advance_ms: u64,
        },
        Sample {
            worker: usize,
            advance_ms: u64,
        },
        /// The load store reports instance `id`'s last arrival (any namespace).
        Arrived {
            id: u64,
            advance_ms: u64,
        },
        End {
            nth: usize,
        },
        Withdraw {
            nth: usize,
        },
    }

    fn arb_op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            4 => (0usize..4, 0u32..2, 0u64..4, any::<bool>(), 0u64..9000).prop_map(
                |(worker, rank, blocks, exempt, advance_ms)| Op::Record {
                    worker, rank, blocks, exempt, advance_ms
                }
            ),
            2 => (0usize..4, 0u64..9000).prop_map(|(worker, advance_ms)| Op::Sample { worker, advance_ms }),
            1 => (1u64..4, 0u64..9000).prop_map(|(id, advance_ms)| Op::Arrived { id, advance_ms }),
            1 => (0usize..16).prop_map(|nth| Op::End { nth }),
            1 => (0usize..16).prop_map(|nth| Op::Withdraw { nth }),
        ]
    }

    /// The naive reference: every leg in a list, answered legs removed, age checked on read.
    struct Naive {
        legs: Vec<(DispatchId, WorkerKey, DpRank, Tick, u64, bool)>,
    }

    impl Naive {
        fn backlog(&self, worker: &WorkerKey, rank: DpRank, now: Tick) -> RankBacklog {
            let mut out = RankBacklog::default();
            for (_, w, r, at, blocks, may_stall) in &self.legs {
                if w != worker || *r != rank || now.since(*at) >= DISPATCH_MAX_AGE {
                    continue;
                }
                out.prefill_tokens += blocks * 16;
                out.decode_blocks += blocks;
                out.stalled |= *may_stall && now.since(*at) >= STALL_AFTER;
            }
            out
        }
    }

    proptest::proptest! {
        #[test]
        fn the_ledger_matches_a_naive_reference(ops in proptest::collection::vec(arb_op(), 1..60)) {
            // Two namespaces share instance ids 1 and 2.
            let workers = [key("a", 1), key("a", 2), key("b", 1), key("b", 2)];
            let mut ledger = DispatchLedger::new();
            let mut naive = Naive { legs: Vec::new() };
            let mut ids = Vec::new();
            let mut now = Tick::ZERO;
            for op in ops {
                match op {
                    Op::Record { worker, rank, blocks, exempt, advance_ms } => {
                        now = now.plus(Duration::from_millis(advance_ms));
                        let mut l = leg(workers[worker].clone(), blocks, exempt);
                        l.rank = DpRank(rank);
                        let id = ledger.record_dispatch(std::slice::from_ref(&l), now);
                        ids.push(id);
                        let may_stall = !exempt && blocks >= STALL_MIN_BLOCKS;
                        naive.legs.push((id, l.worker, l.rank, now, blocks, may_stall));
                    }
                    Op::Sample { worker, advance_ms } => {
                        now = now.plus(Duration::from_millis(advance_ms));
                        ledger.sample_arrived(&workers[worker], now);
                        naive.legs.retain(|(_, w, _, at, _, _)| w != &workers[worker] || *at >= now);
                    }
                    Op::Arrived { id, advance_ms } => {
                        now = now.plus(Duration::from_millis(advance_ms));
                        let at = now;
                        ledger.answer_arrivals(|instance| (instance.0 == id).then_some(at));
                        naive.legs.retain(|(_, w, _, t, _, _)| w.instance_id.0 != id || *t >= at);
                    }
                    Op::End { nth } => {
                        if let Some(&id) = ids.get(nth % ids.len().max(1)) {
                            ledger.request_ended(id);
                            for l in naive.legs.iter_mut().filter(|l| l.0 == id) {
                                l.5 = false;
                            }
                        }
                    }
                    Op::Withdraw { nth } => {
                        if let Some(&id) = ids.get(nth % ids.len().max(1)) {
                            ledger.withdraw(id);
                            naive.legs.retain(|l| l.0 != id);
                        }
                    }
                }
                // Aged legs may linger until the next expiry; live ones are all held.
                let live_legs = naive
                    .legs
                    .iter()
                    .filter(|l| now.since(l.3) < DISPATCH_MAX_AGE)
                    .count();
                proptest::prop_assert_eq!(ledger.pending_legs(), ledger.unanswered());
                proptest::prop_assert!(ledger.unanswered() <= naive.legs.len());
                proptest::prop_assert!(ledger.unanswered() >= live_legs);
                for w in &workers {
                    for rank in [DpRank(0), DpRank(1)] {
                        let want = naive.backlog(w, rank, now);
                        proptest::prop_assert_eq!(
                            ledger.backlog(w, rank, now),
                            want,
                            "{:?} rank {:?} at {:?}", w, rank, now
                        );
                    }
                }
                // What a pick lays onto rows: once expired at the pick's time, the settled
                // totals are every rank's backlog, and no aged leg is held.
                ledger.expire(now);
                proptest::prop_assert_eq!(ledger.unanswered(), live_legs);
                let mut laid = std::collections::HashMap::new();
                ledger.for_each_settled(|ns, instance, rank, settled| {
                    let was = laid.insert((ns.clone(), instance, rank), settled.at(now));
                    assert!(was.is_none(), "one call per rank");
                });
                for w in &workers {
                    for rank in [DpRank(0), DpRank(1)] {
                        let want = naive.backlog(w, rank, now);
                        let got = laid.get(&(w.namespace.clone(), w.instance_id, rank)).copied().unwrap_or_default();
                        proptest::prop_assert_eq!(got, want);
                        proptest::prop_assert_eq!(ledger.backlog(w, rank, now), want);
                    }
                }
            }
            ledger.expire(now.plus(DISPATCH_MAX_AGE));
            proptest::prop_assert!(ledger.is_empty());
            proptest::prop_assert!(ledger.filter.iter().all(|&n| n == 0));
        }
    }
}
