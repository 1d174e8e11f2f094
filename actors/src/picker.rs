//! PickerActor: owns the worker picker's lifecycle; [`SharedPicker`] is the state it maintains.
//!
//! Role: keeps the picker's inputs current between requests. On every registry generation it
//! publishes the `CandidateIndex` (one `Candidate` per dp rank, grouped by model, with each
//! model's dense layout the pickers scan) through its [`IndexWriter`], the index's one writer (a
//! request that races ahead derives its own and never stores it); on every load-store change it feeds sample arrivals
//! into the [`DispatchLedger`] (a sample answers the dispatches pinned to its worker before it
//! arrived) and re-resolves the layouts' load-store slots if a rank gained or lost its sample;
//! every [`EXPIRE_EVERY`] it drops dispatches older than `DISPATCH_MAX_AGE`; and it reports its
//! state to the admin view (`Status`).
//!
//! Which picker is installed, with what one config asks of it (KV parameters, tie-break, the
//! namespaces that may receive `nvext.token_data`), is one immutable snapshot ([`Installed`])
//! with one writer ([`PickerWriter`], not `Clone`, claimed from this handle's `Exclusive` slot):
//! the control loop publishes it at start and on every applied reload, never a request. Requests
//! read it without a lock. A dispatch ends through its [`InFlight`] guard, dropped with the
//! response.
//!
//! Parent: root. Children: none. Messages in: `GenerationChanged`, `SamplesArrived`, `Expire`
//! (from the watcher task it spawns in `pre_start` and aborts in `post_stop`), `Status` (query).
//! Out: the index, the ledger and the installed picker through [`SharedPicker`].
//!
//! Restart: transient. Every piece of state the routing needs (installed picker, candidate index,
//! ledger, round-robin cursors) lives in [`SharedPicker`], outside the actor, exactly as the
//! registry keeps its snapshot outside the `RegistryActor`: a restart loses nothing, requests keep
//! being decided while the actor is down, and the restarted actor catches up in `pre_start`
//! (rebuild for the current generation, feed arrivals, expire). Only the maintenance cadence
//! pauses; the request path expires and answers on its own meanwhile.
//!
//! Why the request path does not go through the mailbox: a decision over 1,000 ranks costs a few
//! microseconds under one short `Mutex` section, while a ractor `call` round trip (mailbox send,
//! task wake-up, reply port) costs more than the whole decision budget (see
//! docs/runtime-semantics.md, "Picker state"). The actor and the request path share the mutable
//! state (ledger, cursors) through the handle; neither holds the lock across an await.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::{ArcSwap, Guard};
use continuum_protocol::load_store::LoadStore;
use continuum_protocol::picker::dense::SLOT_CACHE_LAYOUTS;
use continuum_protocol::picker::ledger::DispatchId;
use continuum_protocol::picker::{DispatchLedger, DynamoWorkerPicker, PickerState};
use continuum_protocol::time::Tick;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use serde::Serialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::clock::now_tick;
use crate::lifecycle::ActorKind;
use crate::load::{LoadGuard, SharedLoadStore};
use crate::lock::{CLAIM_TIMEOUT, Exclusive, Mutex, MutexGuard};
use crate::registry::RegistryReader;
use crate::supervisor::{ChildContext, ChildSpec};

mod index;
mod installed;

pub use index::{IndexWriter, IndexedGeneration};
pub use installed::{InFlight, Installed, PickerConfig, PickerWriter};

/// How often the actor drops dispatches past `DISPATCH_MAX_AGE` (a pick also expires first, so
/// this only bounds how long an idle router holds aged entries).
pub const EXPIRE_EVERY: Duration = Duration::from_secs(1);

/// The picker's name in the supervision tree.
pub const PICKER_NAME: &str = "picker";

struct Inner {
    /// Published by the one [`PickerWriter`]; read lock-free.
    installed: ArcSwap<Installed>,
    /// The writer's slot: at most one [`PickerWriter`] at a time.
    writer: Exclusive<()>,
    /// Published by the one [`IndexWriter`] (the PickerActor's incarnation); read lock-free.
    index: ArcSwap<IndexedGeneration>,
    /// The index writer's slot: at most one [`IndexWriter`] at a time.
    index_writer: Exclusive<()>,
    state: Mutex<PickerState>,
    /// Bumped after every maintenance pass of the actor (tests and the admin view wait on it).
    passes: watch::Sender<u64>,
    rebuilds: AtomicU64,
    /// Decisions that derived their own index because they ran ahead of the actor.
    derived: AtomicU64,
    expiries: AtomicU64,
    arrival_feeds: AtomicU64,
}

/// The picker state shared by the request path and the [`PickerActor`]: cheap to clone.
#[derive(Clone)]
pub struct SharedPicker {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for SharedPicker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedPicker")
            .field("picker", &self.picker().name())
            .field("generation", &self.index().generation)
            .finish_non_exhaustive()
    }
}

impl Default for SharedPicker {
    fn default() -> Self {
        Self::new()
    }
}

/// What `GET /admin/dynamo/workers` shows under `picker`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PickerStatus {
    /// The installed picker's name (`load_based`, `kv_aware`).
    pub name: &'static str,
    /// The registry generation the candidate index was built from (`null` before the first).
    pub index_generation: Option<u64>,
    pub candidate_ranks: usize,
    pub models: usize,
    /// Workers left out because their card declares an impossible dp rank range.
    pub refused_workers: usize,
    /// Dispatches the ledger remembers (answered ones linger until they age out).
    pub ledger_dispatches: usize,
    /// Dispatches still counting as some rank's backlog.
    pub unanswered_legs: usize,
    pub cursor_models: usize,
    pub index_rebuilds: u64,
    /// Decisions that ran ahead of the actor and derived the new generation's index themselves.
    pub index_derived_by_requests: u64,
    pub expiry_passes: u64,
    pub arrival_feeds: u64,
}

impl SharedPicker {
    /// The default `LoadBasedPicker`, an empty index (generation unknown) and an empty ledger.
    pub fn new() -> Self {
        Self {
            inner: Arc::new(Inner {
                installed: ArcSwap::from_pointee(Installed::default()),
                writer: Exclusive::new(()),
                index: ArcSwap::from_pointee(IndexedGeneration::empty()),
                index_writer: Exclusive::new(()),
                state: Mutex::new(PickerState::new()),
                passes: watch::channel(0).0,
                rebuilds: AtomicU64::new(0),
                derived: AtomicU64::new(0),
                expiries: AtomicU64::new(0),
                arrival_feeds: AtomicU64::new(0),
            }),
        }
    }

    /// The active picker (`registry.picker()` in the seed).
    pub fn picker(&self) -> Arc<dyn DynamoWorkerPicker> {
        self.inner.installed.load().picker.clone()
    }

    /// The installed picker and its config, as last published: one lock-free load.
    pub fn installed(&self) -> Guard<Arc<Installed>> {
        self.inner.installed.load()
    }

    fn store(&self, installed: Installed) {
        self.inner.installed.store(Arc::new(installed));
    }

    /// The writer of [`Installed`], if no one holds it now (`None`: another writer does).
    pub fn writer(&self) -> Option<PickerWriter> {
        let claim = self.inner.writer.try_claim()?;
        Some(PickerWriter::new(self.clone(), claim))
    }

    /// The guard of dispatch `id`, which ends it when dropped (with the response).
    pub fn in_flight(&self, id: DispatchId) -> InFlight {
        InFlight::new(self.clone(), id)
    }

    /// The index held now, lock-free (possibly of an older generation; see [`Self::index_for`]).
    pub fn index(&self) -> Arc<IndexedGeneration> {
        self.inner.index.load_full()
    }

    /// The writer of the published index, if no one holds it now (`None`: the running
    /// PickerActor does).
    pub fn index_writer(&self) -> Option<IndexWriter> {
        let claim = self.inner.index_writer.try_claim()?;
        Some(IndexWriter::new(self.clone(), claim))
    }

    /// The index of the registry's current generation: the one the actor published, or, for a
    /// request that races ahead of the actor, one derived for this decision alone (not
    /// published), so no decision ever reads an index older than the snapshot it was published
    /// with.
    pub fn index_for(&self, registry: &RegistryReader) -> Arc<IndexedGeneration> {
        let generation = registry.generation();
        let held = self.inner.index.load_full();
        if held.covers(generation) {
            return held;
        }
        self.inner.derived.fetch_add(1, Ordering::Relaxed);
        Arc::new(index::derive(&held, generation, &registry.snapshot()))
    }

    /// Runs `f` on the picker's mutable state (cursors, ledger, scratch) under its lock. The
    /// request path's whole decision is one such section; keep it free of IO and awaits.
    ///
    /// Lock order: the load store, then the picker's state. `held` proves the caller holds the
    /// load store's lock, so no section can take them the other way round. The methods below
    /// that lock the state alone run no caller code under it.
    pub fn with_state<R>(&self, held: &LoadGuard<'_>, f: impl FnOnce(&mut PickerState) -> R) -> R {
        let _ = held;
        f(&mut self.state())
    }

    fn state(&self) -> MutexGuard<'_, PickerState> {
        self.inner.state.lock()
    }

    /// Runs `f` on the dispatch ledger alone (the replica sync's sampling and merges). Keep it
    /// short and free of IO; the caller must not hold the load store's lock (lock order).
    pub fn with_ledger<R>(&self, f: impl FnOnce(&mut DispatchLedger) -> R) -> R {
        f(&mut self.state().ledger)
    }

    /// A dispatch ended (its response finished or failed): it no longer marks a stall.
    pub fn request_ended(&self, id: DispatchId) {
        self.state().ledger.request_ended(id);
    }

    /// A dispatch was never sent: forget it.
    pub fn withdraw(&self, id: DispatchId) {
        self.state().ledger.withdraw(id);
    }

    /// Samples that arrived answer the dispatches pinned to their workers before them, and the
    /// layouts' load-store slots are re-resolved if a rank gained or lost its sample, so the
    /// request path finds them current (for up to `SLOT_CACHE_LAYOUTS` models).
    pub fn feed_arrivals(&self, load: &SharedLoadStore) {
        let held = self.index();
        load.with(|store| {
            self.with_state(store, |s| {
                answer_arrivals(&mut s.ledger, store);
                if held.index.layouts().count() <= SLOT_CACHE_LAYOUTS {
                    for layout in held.index.layouts() {
                        s.slots.slots(layout, store);
                    }
                }
            });
        });
        self.inner.arrival_feeds.fetch_add(1, Ordering::Relaxed);
    }

    /// Drops dispatches older than `DISPATCH_MAX_AGE` (30 s).
    pub fn expire(&self, now: Tick) {
        self.state().ledger.expire(now);
        self.inner.expiries.fetch_add(1, Ordering::Relaxed);
    }

    /// A counter bumped after every maintenance pass of the actor.
    pub fn subscribe_passes(&self) -> watch::Receiver<u64> {
        self.inner.passes.subscribe()
    }

    fn pass_done(&self) {
        self.inner.passes.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// The admin view of the picker.
    pub fn status(&self) -> PickerStatus {
        let held = self.index();
        let (ledger_dispatches, unanswered_legs, cursor_models) = {
            let s = self.state();
            (s.ledger.len(), s.ledger.unanswered(), s.cursor_models())
        };
        PickerStatus {
            name: self.picker().name(),
            index_generation: (held.generation != u64::MAX).then_some(held.generation),
            candidate_ranks: held.index.len(),
            models: held.index.models().count(),
            refused_workers: held.index.refused_workers,
            ledger_dispatches,
            unanswered_legs,
            cursor_models,
            index_rebuilds: self.inner.rebuilds.load(Ordering::Relaxed),
            index_derived_by_requests: self.inner.derived.load(Ordering::Relaxed),
            expiry_passes: self.inner.expiries.load(Ordering::Relaxed),
            arrival_feeds: self.inner.arrival_feeds.load(Ordering::Relaxed),
        }
    }
}

/// The ledger side of "a sample answers earlier dispatches": each worker with an unanswered
/// dispatch is answered by the last sample the store received from it (visiting only the
/// workers written to or dispatched to since the last call: `DispatchLedger::answer_store`).
pub fn answer_arrivals(ledger: &mut DispatchLedger, store: &LoadStore) {
    ledger.answer_store(store);
}

pub struct PickerActor;

pub struct PickerArgs {
    pub picker: SharedPicker,
    pub registry: RegistryReader,
    pub load: SharedLoadStore,
}

pub enum PickerMsg {
    /// The registry published a new generation.
    GenerationChanged,
    /// The load store completed an update.
    SamplesArrived,
    /// The expiry period elapsed.
    Expire,
    /// The admin view.
    Status(RpcReplyPort<PickerStatus>),
}

pub struct PickerActorState {
    args: PickerArgs,
    /// This incarnation's claim on the published index (released with the state).
    index: IndexWriter,
    watcher: JoinHandle<()>,
}

impl Actor for PickerActor {
    type Msg = PickerMsg;
    type State = PickerActorState;
    type Arguments = PickerArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<PickerMsg>,
        args: PickerArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let claim = args.picker.inner.index_writer.claim(CLAIM_TIMEOUT).await?;
        let state = PickerActorState {
            index: IndexWriter::new(args.picker.clone(), claim),
            watcher: spawn_watcher(myself, &args),
            args,
        };
        // A restarted picker catches up with whatever happened while it was down.
        state.rebuild();
        state.feed_arrivals();
        state.expire();
        Ok(state)
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<PickerMsg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        state.watcher.abort();
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<PickerMsg>,
        msg: PickerMsg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            PickerMsg::GenerationChanged => state.rebuild(),
            PickerMsg::SamplesArrived => state.feed_arrivals(),
            PickerMsg::Expire => state.expire(),
            PickerMsg::Status(reply) => {
                let _ = reply.send(state.args.picker.status());
            }
        }
        Ok(())
    }
}

/// Casts one message per registry generation, per completed load-store update (coalesced by the
/// watch channels) and per expiry period; ends when the actor is gone.
fn spawn_watcher(myself: ActorRef<PickerMsg>, args: &PickerArgs) -> JoinHandle<()> {
    let mut generations = args.registry.subscribe();
    let mut changes = args.load.subscribe();
    tokio::spawn(async move {
        let mut expiry = tokio::time::interval(EXPIRE_EVERY);
        expiry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let msg = tokio::select! {
                changed = generations.changed() => match changed {
                    Ok(()) => PickerMsg::GenerationChanged,
                    Err(_) => return,
                },
                changed = changes.changed() => match changed {
                    Ok(()) => PickerMsg::SamplesArrived,
                    Err(_) => return,
                },
                _ = expiry.tick() => PickerMsg::Expire,
            };
            if myself.cast(msg).is_err() {
                return;
            }
        }
    })
}

impl PickerActorState {
    fn rebuild(&self) {
        let registry = &self.args.registry;
        let generation = registry.generation();
        self.index.rebuild(generation, &registry.snapshot());
        self.args.picker.pass_done();
    }

    fn feed_arrivals(&self) {
        self.args.picker.feed_arrivals(&self.args.load);
        self.args.picker.pass_done();
    }

    fn expire(&self) {
        self.args.picker.expire(now_tick());
        self.args.picker.pass_done();
    }
}

/// The picker's child spec under root.
pub fn picker_spec(
    picker: SharedPicker,
    registry: RegistryReader,
    load: SharedLoadStore,
) -> ChildSpec {
    ChildSpec::new(PICKER_NAME, ActorKind::Picker, move |ctx: ChildContext| {
        let args = PickerArgs {
            picker: picker.clone(),
            registry: registry.clone(),
            load: load.clone(),
        };
        async move {
            let (actor, _) = Actor::spawn_linked(None, PickerActor, args, ctx.supervisor).await?;
            Ok(actor.get_cell())
        }
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use continuum_protocol::event_plane::ActiveLoad;
    use continuum_protocol::ids::{DpRank, InstanceId, Namespace, PublisherId, WorkerKey};
    use continuum_protocol::load_store::LoadSample;
    use continuum_protocol::picker::DispatchLeg;
    use continuum_protocol::time::UnixMillis;

    use super::*;

    /// xorshift64*: deterministic draws for the differential test.
    struct Draw(u64);

    impl Draw {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
        }
    }

    /// The request path before the PickerActor: every candidate rank's held sample answered its
    /// worker's dispatches, one `sample_arrived` per rank.
    fn answer_per_candidate(
        ledger: &mut DispatchLedger,
        store: &LoadStore,
        ranks: &[(WorkerKey, DpRank)],
    ) {
        for (worker, rank) in ranks {
            if let Some(sample) = store.latest(worker.instance_id, *rank) {
                ledger.sample_arrived(worker, sample.received_at);
            }
        }
    }

    #[test]
    fn answering_pending_workers_matches_the_per_candidate_pass() {
        // Equal instance ids in two namespaces; two ranks each; every rank is a candidate and no
        // sample is dropped (the two passes differ only for dropped samples, by design).
        let mut ranks = Vec::new();
        for ns in ["a", "b"] {
            for id in 1..=4 {
                for rank in 0..2 {
                    let worker = WorkerKey {
                        namespace: Namespace::new(ns),
                        instance_id: InstanceId(id),
                    };
                    ranks.push((worker, DpRank(rank)));
                }
            }
        }
        for seed in 1..300u64 {
            let mut draw = Draw(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
            let mut store = LoadStore::new();
            store.set_live_and_retain((1..=4).map(InstanceId));
            let (mut old, mut new) = (DispatchLedger::new(), DispatchLedger::new());
            let mut now = Tick::ZERO;
            let mut sequence = 0;
            for _ in 0..60 {
                now = now.plus(Duration::from_millis(draw.below(3000)));
                let (worker, rank) = ranks[draw.below(ranks.len() as u64) as usize].clone();
                match draw.below(3) {
                    0 => {
                        sequence += 1;
                        let sample = LoadSample {
                            load: ActiveLoad {
                                worker_id: worker.instance_id,
                                dp_rank: rank,
                                active_decode_blocks: Some(draw.below(50)),
                                active_prefill_tokens: None,
                                kv_used_blocks: None,
                            },
                            publisher_id: PublisherId(worker.instance_id.0),
                            sequence,
                            published_at: UnixMillis(0),
                            received_at: now,
                        };
                        store.apply(sample);
                    }
                    _ => {
                        let leg = DispatchLeg {
                            worker,
                            rank,
                            prefill_tokens: draw.below(100),
                            decode_blocks: draw.below(8),
                            request_blocks: draw.below(8),
                            stall_exempt: draw.below(2) == 0,
                        };
                        old.record_dispatch(std::slice::from_ref(&leg), now);
                        new.record_dispatch(std::slice::from_ref(&leg), now);
                    }
                }
                // A pick: both passes run, then every rank's backlog must agree.
                answer_per_candidate(&mut old, &store, &ranks);
                answer_arrivals(&mut new, &store);
                for (worker, rank) in &ranks {
                    assert_eq!(
                        old.backlog(worker, *rank, now),
                        new.backlog(worker, *rank, now),
                        "seed {seed}: {worker:?} rank {rank:?} at {now:?}"
                    );
                }
                assert_eq!(old.unanswered(), new.unanswered(), "seed {seed}");
            }
        }
    }
}
