//! The load store: the latest ActiveLoad sample per (worker, dp_rank), with receipt times.
//!
//! Rules (seed "Load signals"):
//! - keyed by (worker_id, dp_rank), at most [`LOAD_STORE_CAPACITY`] entries (`over_capacity`);
//! - only workers in the live registry snapshot are admitted (`identity_mismatch` otherwise);
//!   [`LoadStore::set_live_and_retain`] updates that gate and evicts departed workers;
//! - per key, a sample from the same publisher at or below the held sequence is a `duplicate`,
//!   while a sample from a different publisher (a restarted worker) replaces the held one
//!   regardless of sequence;
//! - [`LoadStore::fresh`] returns a sample only while its receipt age is within `max_age`;
//!   [`LoadStore::fresh_default`] uses the hot-reloadable `dynamo.load.max_staleness`;
//! - "missed messages": [`LoadStore::drop_publisher`] forgets every sample of a publisher, on
//!   every (re)connect and on every sequence gap ([`LoadStream`] applies both).
//!
//! [`LoadStore::last_arrival`] keeps, per live worker, when its latest sample was applied, even
//! after the sample itself is dropped: the dispatch ledger counts a pinned request as backlog
//! until the worker is heard from after it, and a sample that arrived and was then dropped (a
//! resubscription after a reload) still answered it. Without this an idle change-driven
//! publisher, which sends nothing new after a resubscription, kept its last dispatch as
//! phantom backlog for the ledger's full 30 s.
//!
//! The picker reads [`LoadStore::is_quiet`]: a worker whose last sample reported no backlog (or
//! that never published) counts as idle even without a fresh sample.
//!
//! Unreachable workers: a SIGKILLed worker stays in the registry until its lease expires (30 s in
//! Dynamo 1.6.1), but its `kv_metrics` publisher dies with it. When a subscription whose session
//! was established loses its connection and the next connection attempt fails, [`LoadStream`]
//! marks every worker that publisher has delivered samples for as unreachable
//! ([`LoadStore::unreachable`]); the shim's candidate filter then keeps them out while a reachable
//! rank can serve the phase. The mark clears on the publisher's next established session, on any
//! applied sample of the worker, and when the worker leaves the live set.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::Duration;

use thiserror::Error;

use crate::event_plane::{
    ActiveLoad, LoadEvent, LoadEventResult, SequenceCheck, StreamSequence, decode_kv_metrics,
};
use crate::id_hash::IdMap;
use crate::ids::{DpRank, InstanceId, PublisherId};
use crate::time::{Tick, UnixMillis};
use crate::zmtp::Delivery;

/// Most (worker, dp_rank) entries the store holds.
pub const LOAD_STORE_CAPACITY: usize = 65_536;
/// Most distinct workers one [`LoadStream`] remembers as served by its publisher (a real
/// publisher serves one worker; the bound only stops a hostile one from growing the set).
pub const MAX_WORKERS_PER_PUBLISHER: usize = 64;
/// Default `dynamo.load.max_staleness`.
pub const DEFAULT_MAX_STALENESS: Duration = Duration::from_secs(3);
/// Allowed range of `dynamo.load.max_staleness`.
pub const MIN_MAX_STALENESS: Duration = Duration::from_millis(100);
pub const MAX_MAX_STALENESS: Duration = Duration::from_secs(300);

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum LoadStoreError {
    #[error("max_staleness {0:?} is outside 100ms..=5m")]
    StalenessOutOfRange(Duration),
}

/// The store's key: one data-parallel rank of one worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkerRank {
    pub worker_id: InstanceId,
    pub dp_rank: DpRank,
}

impl WorkerRank {
    pub fn new(worker_id: InstanceId, dp_rank: DpRank) -> Self {
        Self { worker_id, dp_rank }
    }
}

/// One held sample and where it came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadSample {
    pub load: ActiveLoad,
    pub publisher_id: PublisherId,
    pub sequence: u64,
    pub published_at: UnixMillis,
    /// When the router received it; staleness is measured from here, never from the
    /// publisher's clock.
    pub received_at: Tick,
}

impl LoadSample {
    pub fn from_event(event: LoadEvent, received_at: Tick) -> Self {
        Self {
            load: event.load,
            publisher_id: event.publisher_id,
            sequence: event.sequence,
            published_at: event.published_at,
            received_at,
        }
    }

    pub fn key(&self) -> WorkerRank {
        WorkerRank::new(self.load.worker_id, self.load.dp_rank)
    }

    /// Decode backlog in blocks: `active_decode_blocks`, falling back to `kv_used_blocks` when
    /// nil (as live dynamo.vllm workers and the mocker publish).
    pub fn decode_backlog(&self) -> Option<u64> {
        self.load.active_decode_blocks.or(self.load.kv_used_blocks)
    }

    /// Prefill backlog in tokens (nil from 1.4.2–1.6.1 worker publishers).
    pub fn prefill_backlog(&self) -> Option<u64> {
        self.load.active_prefill_tokens
    }

    /// The sample reported work in progress on either phase.
    pub fn has_backlog(&self) -> bool {
        self.decode_backlog().is_some_and(|b| b > 0)
            || self.prefill_backlog().is_some_and(|b| b > 0)
    }

    /// The sample reported no backlog: a worker that goes idle publishes this and falls silent.
    pub fn is_quiet(&self) -> bool {
        !self.has_backlog()
    }

    #[inline]
    pub fn age(&self, now: Tick) -> Duration {
        now.since(self.received_at)
    }
}

/// Why and since when a worker is marked unreachable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unreachable {
    /// The `kv_metrics` publisher whose connection was lost and refused.
    pub publisher_id: PublisherId,
    /// When the failed reconnect was seen.
    pub since: Tick,
}

/// Slot writes [`LoadStore::changed_since`] remembers: a reader further behind re-reads every
/// slot it needs.
pub use crate::change_log::CHANGE_LOG;
use crate::change_log::ChangeLog;

/// A fresh, process-unique [`LoadStore::slot_epoch`] value (a counter, not a clock).
fn next_slot_epoch() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Latest load sample per (worker, dp_rank).
#[derive(Debug)]
pub struct LoadStore {
    /// The slot of each held sample, hashed cheaply (see [`crate::id_hash`]); only live workers
    /// are admitted.
    samples: IdMap<WorkerRank, u32>,
    /// Held samples by slot. A key keeps its slot while its sample is held, so a picker resolves
    /// its candidates' slots once per [`Self::slot_epoch`] and then reads samples by index
    /// instead of hashing one key per rank per pick.
    slots: Vec<Option<LoadSample>>,
    /// Slots emptied by removals, reused first (so `slots` never outgrows the capacity).
    free_slots: Vec<u32>,
    /// Changes whenever a key gains or loses its slot; unique across stores.
    slot_epoch: u64,
    /// Slot writes (a sample stored, replaced or removed), naming the slot, for the last
    /// [`CHANGE_LOG`]: a picker's per-row sample mirror catches up on these slots alone.
    change_log: ChangeLog<u32>,
    /// When each live worker's last applied sample (any rank) arrived, kept even after the
    /// sample itself is dropped: a sample answers the picker's earlier dispatches when it
    /// arrives ([`LoadStore::last_arrival`]).
    arrivals: IdMap<InstanceId, Tick>,
    /// Live workers whose load publisher went away (bounded by the live set).
    unreachable: HashMap<InstanceId, Unreachable>,
    /// Which keys each publisher's samples occupy, so `drop_publisher` needs no scan.
    by_publisher: HashMap<PublisherId, HashSet<WorkerRank>>,
    live: HashSet<InstanceId>,
    capacity: usize,
    max_staleness: Duration,
}

impl Default for LoadStore {
    fn default() -> Self {
        Self::new()
    }
}

impl LoadStore {
    /// An empty store with no live workers (nothing is admitted until the first registry
    /// snapshot arrives through [`Self::set_live_and_retain`]).
    pub fn new() -> Self {
        Self::with_capacity(LOAD_STORE_CAPACITY)
    }

    /// A store with a smaller capacity (tests).
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            samples: IdMap::default(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            slot_epoch: next_slot_epoch(),
            change_log: ChangeLog::default(),
            arrivals: IdMap::default(),
            unreachable: HashMap::new(),
            by_publisher: HashMap::new(),
            live: HashSet::new(),
            capacity: capacity.min(LOAD_STORE_CAPACITY),
            max_staleness: DEFAULT_MAX_STALENESS,
        }
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn max_staleness(&self) -> Duration {
        self.max_staleness
    }

    /// Applies a reloaded `dynamo.load.max_staleness`, effective for the next read.
    pub fn set_max_staleness(&mut self, max_staleness: Duration) -> Result<(), LoadStoreError> {
        if !(MIN_MAX_STALENESS..=MAX_MAX_STALENESS).contains(&max_staleness) {
            return Err(LoadStoreError::StalenessOutOfRange(max_staleness));
        }
        self.max_staleness = max_staleness;
        Ok(())
    }

    pub fn is_live(&self, worker_id: InstanceId) -> bool {
        self.live.contains(&worker_id)
    }

    /// Admits or refuses one sample; returns `applied`, `identity_mismatch`, `duplicate` or
    /// `over_capacity`. An applied sample is proof of life: it clears the worker's unreachable
    /// mark.
    pub fn apply(&mut self, sample: LoadSample) -> LoadEventResult {
        let result = self.admit(sample);
        if result == LoadEventResult::Applied && !self.unreachable.is_empty() {
            self.unreachable.remove(&sample.load.worker_id);
        }
        result
    }

    fn admit(&mut self, sample: LoadSample) -> LoadEventResult {
        let key = sample.key();
        if !self.live.contains(&key.worker_id) {
            return LoadEventResult::IdentityMismatch;
        }
        let full = self.samples.len() >= self.capacity;
        let slot = self.samples.get(&key).copied();
        let held = slot
            .and_then(|slot| self.slots.get_mut(slot as usize))
            .and_then(Option::as_mut);
        match held {
            Some(held)
                if held.publisher_id == sample.publisher_id && sample.sequence <= held.sequence =>
            {
                LoadEventResult::Duplicate
            }
            Some(held) => {
                let previous = held.publisher_id;
                *held = sample;
                if let Some(slot) = slot {
                    self.note_change(slot);
                }
                if previous != sample.publisher_id {
                    self.unindex(previous, key);
                    self.index(sample.publisher_id, key);
                }
                self.arrived(key.worker_id, sample.received_at);
                LoadEventResult::Applied
            }
            None if full => LoadEventResult::OverCapacity,
            None => {
                let slot = self.take_slot(sample);
                self.samples.insert(key, slot);
                self.index(sample.publisher_id, key);
                self.arrived(key.worker_id, sample.received_at);
                LoadEventResult::Applied
            }
        }
    }

    /// Stores `sample` in a free slot (or a new one) and returns it.
    fn take_slot(&mut self, sample: LoadSample) -> u32 {
        self.slot_epoch = next_slot_epoch();
        if let Some(slot) = self.free_slots.pop()
            && let Some(entry) = self.slots.get_mut(slot as usize)
        {
            *entry = Some(sample);
            self.note_change(slot);
            return slot;
        }
        // At most `capacity` (≤ 65,536) keys are held, so the slot count fits u32.
        let slot = self.slots.len() as u32;
        self.slots.push(Some(sample));
        self.note_change(slot);
        slot
    }

    /// Logs a write to `slot` (bounded: the log keeps the last [`CHANGE_LOG`] writes).
    fn note_change(&mut self, slot: u32) {
        self.change_log.push(slot);
    }

    /// Slot writes so far (a sample stored, replaced or removed): a reader that saw this value
    /// has seen every slot's current sample while it is unchanged.
    #[inline]
    pub fn changes(&self) -> u64 {
        self.change_log.changes()
    }

    /// The slots written since [`Self::changes`] read `seen` (in write order, a slot once per
    /// write), or `None` when the log no longer reaches back that far (or `seen` is ahead):
    /// the reader then re-reads every slot it needs.
    pub fn changed_since(&self, seen: u64) -> Option<impl Iterator<Item = u32> + '_> {
        self.change_log.since(seen, u32::MAX)
    }

    /// Removes `key`'s sample and frees its slot.
    fn remove_sample(&mut self, key: &WorkerRank) -> Option<LoadSample> {
        let slot = self.samples.remove(key)?;
        self.slot_epoch = next_slot_epoch();
        let sample = self.slots.get_mut(slot as usize).and_then(Option::take);
        self.free_slots.push(slot);
        self.note_change(slot);
        sample
    }

    /// Changes whenever a key gains or loses its slot (never when a held sample is replaced);
    /// two stores never share a value. Slots resolved by [`Self::slot`] stay valid while it is
    /// unchanged.
    pub fn slot_epoch(&self) -> u64 {
        self.slot_epoch
    }

    /// The slot of `(worker_id, dp_rank)`'s held sample.
    pub fn slot(&self, worker_id: InstanceId, dp_rank: DpRank) -> Option<u32> {
        self.samples
            .get(&WorkerRank::new(worker_id, dp_rank))
            .copied()
    }

    /// The sample held in `slot` (`None` for a free or unknown slot).
    #[inline]
    pub fn at_slot(&self, slot: u32) -> Option<&LoadSample> {
        self.slots.get(slot as usize).and_then(Option::as_ref)
    }

    fn arrived(&mut self, worker_id: InstanceId, at: Tick) {
        let last = self.arrivals.entry(worker_id).or_insert(at);
        *last = (*last).max(at);
    }

    /// When the last sample from `worker_id` (any rank) was applied, even if the store has
    /// dropped it since (a missed change, a publisher restart): the picker's dispatch ledger
    /// reads it to answer dispatches pinned before it.
    pub fn last_arrival(&self, worker_id: InstanceId) -> Option<Tick> {
        self.arrivals.get(&worker_id).copied()
    }

    fn index(&mut self, publisher_id: PublisherId, key: WorkerRank) {
        self.by_publisher
            .entry(publisher_id)
            .or_default()
            .insert(key);
    }

    fn unindex(&mut self, publisher_id: PublisherId, key: WorkerRank) {
        if let Some(keys) = self.by_publisher.get_mut(&publisher_id) {
            keys.remove(&key);
            if keys.is_empty() {
                self.by_publisher.remove(&publisher_id);
            }
        }
    }

    /// The held sample, whatever its age.
    pub fn latest(&self, worker_id: InstanceId, dp_rank: DpRank) -> Option<&LoadSample> {
        self.slot(worker_id, dp_rank)
            .and_then(|slot| self.at_slot(slot))
    }

    /// The held sample while its receipt age is within `max_age`.
    pub fn fresh(
        &self,
        worker_id: InstanceId,
        dp_rank: DpRank,
        max_age: Duration,
        now: Tick,
    ) -> Option<&LoadSample> {
        self.latest(worker_id, dp_rank)
            .filter(|sample| sample.age(now) <= max_age)
    }

    /// [`Self::fresh`] with the configured `max_staleness`.
    pub fn fresh_default(
        &self,
        worker_id: InstanceId,
        dp_rank: DpRank,
        now: Tick,
    ) -> Option<&LoadSample> {
        self.fresh(worker_id, dp_rank, self.max_staleness, now)
    }

    /// Quiet: never published (or its samples were dropped), or the last sample, however old,
    /// reported no backlog.
    pub fn is_quiet(&self, worker_id: InstanceId, dp_rank: DpRank) -> bool {
        self.latest(worker_id, dp_rank)
            .is_none_or(LoadSample::is_quiet)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&WorkerRank, &LoadSample)> {
        self.samples
            .iter()
            .filter_map(|(key, &slot)| Some((key, self.at_slot(slot)?)))
    }

    /// Forgets every sample received from `publisher_id`; returns their keys, sorted (so the
    /// caller can remove gauge series).
    pub fn drop_publisher(&mut self, publisher_id: PublisherId) -> Vec<WorkerRank> {
        let mut dropped: Vec<WorkerRank> = self
            .by_publisher
            .remove(&publisher_id)
            .into_iter()
            .flatten()
            .collect();
        for key in &dropped {
            self.remove_sample(key);
        }
        dropped.sort_unstable();
        dropped
    }

    /// Marks the live workers among `workers` unreachable because `publisher_id`'s connection was
    /// lost and could not be re-established. Returns the newly marked workers, sorted; a worker
    /// already marked keeps its first mark.
    pub fn mark_unreachable(
        &mut self,
        publisher_id: PublisherId,
        workers: impl IntoIterator<Item = InstanceId>,
        now: Tick,
    ) -> Vec<InstanceId> {
        let mut marked = Vec::new();
        for worker in workers {
            if !self.live.contains(&worker) || self.unreachable.contains_key(&worker) {
                continue;
            }
            self.unreachable.insert(
                worker,
                Unreachable {
                    publisher_id,
                    since: now,
                },
            );
            marked.push(worker);
        }
        marked.sort_unstable();
        marked
    }

    /// Clears the marks `publisher_id` set (its session is established again). Returns the
    /// cleared workers, sorted.
    pub fn clear_unreachable(&mut self, publisher_id: PublisherId) -> Vec<InstanceId> {
        let mut cleared: Vec<InstanceId> = self
            .unreachable
            .iter()
            .filter(|(_, mark)| mark.publisher_id == publisher_id)
            .map(|(worker, _)| *worker)
            .collect();
        for worker in &cleared {
            self.unreachable.remove(worker);
        }
        cleared.sort_unstable();
        cleared
    }

    /// The worker's unreachable mark, if any.
    pub fn unreachable(&self, worker_id: InstanceId) -> Option<Unreachable> {
        self.unreachable.get(&worker_id).copied()
    }

    pub fn is_unreachable(&self, worker_id: InstanceId) -> bool {
        self.unreachable.contains_key(&worker_id)
    }

    /// How many live workers are marked unreachable (the picker's fast path skips the filter at 0).
    pub fn unreachable_count(&self) -> usize {
        self.unreachable.len()
    }

    /// Replaces the admission gate with the live registry snapshot and evicts every sample (and
    /// unreachable mark) of a worker that left it. Returns the evicted keys, sorted.
    pub fn set_live_and_retain(
        &mut self,
        live: impl IntoIterator<Item = InstanceId>,
    ) -> Vec<WorkerRank> {
        self.live = live.into_iter().collect();
        let live = &self.live;
        self.unreachable.retain(|worker, _| live.contains(worker));
        self.arrivals.retain(|worker, _| live.contains(worker));
        let mut evicted: Vec<WorkerRank> = self
            .samples
            .keys()
            .filter(|key| !self.live.contains(&key.worker_id))
            .copied()
            .collect();
        for key in &evicted {
            if let Some(sample) = self.remove_sample(key) {
                self.unindex(sample.publisher_id, *key);
            }
        }
        evicted.sort_unstable();
        evicted
    }
}

/// What one delivery did to the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamOutcome {
    /// The counted result (`continuum_dynamo_load_events_total{result}`).
    pub result: LoadEventResult,
    /// The key written, when `result` is `applied`.
    pub applied: Option<WorkerRank>,
    /// Sequence numbers missed before this message, when a gap was seen.
    pub gap: Option<u64>,
    /// Keys dropped because of the gap (their gauge series should go too).
    pub dropped: Vec<WorkerRank>,
}

/// The state of a subscription's link to its publisher, for the unreachable rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Link {
    /// No session was ever established: a failing dial says nothing about the worker (the
    /// router may simply be unable to reach the event plane).
    NeverUp,
    /// A session is established.
    Up,
    /// An established session ended; a failed reconnect now means the publisher is gone.
    Lost,
}

/// The `kv_metrics` pipeline of one subscription: decode, per-stream dedup, the missed-messages
/// rule, then the store. One per subscription; the transport task calls
/// [`LoadStream::on_connected`] after every handshake, [`LoadStream::on_session_lost`] when an
/// established session ends and [`LoadStream::on_connect_failed`] when an attempt fails to
/// establish one.
#[derive(Clone, Debug)]
pub struct LoadStream {
    publisher_id: PublisherId,
    sequence: StreamSequence,
    link: Link,
    /// Workers this publisher delivered applied samples for (at most
    /// [`MAX_WORKERS_PER_PUBLISHER`]); kept across sessions, since samples are dropped on every
    /// reconnect but the publisher still belongs to the same worker.
    workers: BTreeSet<InstanceId>,
}

impl LoadStream {
    /// A stream for the discovered publisher `publisher_id` (the EventChannel instance id).
    pub fn new(publisher_id: PublisherId) -> Self {
        Self {
            publisher_id,
            sequence: StreamSequence::new(),
            link: Link::NeverUp,
            workers: BTreeSet::new(),
        }
    }

    pub fn link(&self) -> Link {
        self.link
    }

    /// The workers this publisher is known to serve (from applied samples).
    pub fn workers(&self) -> impl Iterator<Item = InstanceId> + '_ {
        self.workers.iter().copied()
    }

    /// An established session ended (the publisher closed or reset the connection).
    pub fn on_session_lost(&mut self) {
        if self.link == Link::Up {
            self.link = Link::Lost;
        }
    }

    /// A connection attempt failed before a session was established. After a lost session the
    /// publisher is gone (a killed worker's port refuses, a hung host times out): mark the workers
    /// it served unreachable. Returns the newly marked workers, sorted.
    pub fn on_connect_failed(&mut self, store: &mut LoadStore, now: Tick) -> Vec<InstanceId> {
        if self.link != Link::Lost {
            return Vec::new();
        }
        store.mark_unreachable(self.publisher_id, self.workers.iter().copied(), now)
    }

    pub fn publisher_id(&self) -> PublisherId {
        self.publisher_id
    }

    pub fn highest_applied(&self) -> Option<u64> {
        self.sequence.highest_applied()
    }

    /// A new TCP stream: forget its sequence and drop the publisher's samples, since changes may
    /// have been missed while disconnected. Returns the dropped keys.
    /// The publisher answers again, so the marks it caused are cleared.
    pub fn on_connected(&mut self, store: &mut LoadStore) -> Vec<WorkerRank> {
        self.sequence.reset();
        self.link = Link::Up;
        if store.unreachable_count() > 0 {
            store.clear_unreachable(self.publisher_id);
        }
        store.drop_publisher(self.publisher_id)
    }

    /// Runs one transport delivery through decoding, dedup and the store.
    pub fn on_delivery(
        &mut self,
        delivery: &Delivery,
        store: &mut LoadStore,
        now: Tick,
    ) -> StreamOutcome {
        let mut outcome = StreamOutcome {
            result: LoadEventResult::Applied,
            applied: None,
            gap: None,
            dropped: Vec::new(),
        };
        let event = match decode_kv_metrics(delivery, self.publisher_id) {
            Ok(event) => event,
            Err(error) => {
                outcome.result = error.result();
                return outcome;
            }
        };
        match self.sequence.check(event.sequence) {
            SequenceCheck::Duplicate => {
                outcome.result = LoadEventResult::Duplicate;
                return outcome;
            }
            SequenceCheck::Gap { missed } => {
                outcome.gap = Some(missed);
                outcome.dropped = store.drop_publisher(self.publisher_id);
            }
            SequenceCheck::First | SequenceCheck::Next => {}
        }
        let sample = LoadSample::from_event(event, now);
        outcome.result = store.apply(sample);
        if outcome.result == LoadEventResult::Applied {
            self.sequence.record_applied(event.sequence);
            outcome.applied = Some(sample.key());
            if self.workers.len() < MAX_WORKERS_PER_PUBLISHER {
                self.workers.insert(sample.load.worker_id);
            }
        }
        outcome
    }
}

#[cfg(test)]
mod tests;
