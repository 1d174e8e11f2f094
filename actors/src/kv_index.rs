//! KvIndexActor and the shared KV index it writes ([`SharedKvIndex`]).
//!
//! Role: the single writer of the bounded device-tier KV index. kv-events SubscriptionActors
//! decode their deliveries and hand each batch to the actor ([`SharedKvIndex::deliver`]); the
//! actor applies it through the subscription's own bounded `CursorTable` (4,096 (worker, dp_rank)
//! cursors: replays skipped, forward jumps clear the rank and count `gap`, new ranks past the
//! bound refused as `over_capacity`), feeds admitted `Stored` events to the hash-parity tracker,
//! follows registry generations for the live identity gate (`set_live_and_retain`: departed
//! workers and ranks lose blocks, cursors and pending parity predictions) and removes departed
//! models' parity series. A subscription reported disconnected or pending for
//! [`CLEAR_DOWN_AFTER`] loses the ranks it last fed, with a warning.
//!
//! Parent: root. Children: none. Messages in: [`KvIndexMsg`] (batches from subscriptions, their
//! connection state, registry generations, timers). Out: `continuum_dynamo_kv_events_total`,
//! `continuum_dynamo_kv_hash_parity_total`. Restart: transient. The index, the cursor tables and
//! the parity tracker live in [`SharedKvIndex`], outside the actor, so a restart (failure or
//! `POST /admin/subsystems/kv_index/restart`) loses nothing: the new incarnation re-attaches,
//! re-reads the registry and re-arms the clear timers of subscriptions that are down. Batches a
//! subscription delivers while no actor runs are refused and counted `over_capacity`; the next
//! batch of that rank then jumps its cursor, which clears and rebuilds the rank.
//!
//! Reads: the request path reads through [`SharedKvIndex::overlaps`] under a `RwLock` read guard
//! (no mailbox round trip): `find_matches` takes microseconds, a mailbox call would add a task
//! hop and serialise every reader behind the writer's queue (see docs/runtime-semantics.md for
//! the numbers).

pub mod metrics;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use continuum_protocol::discovery::snapshot::DynamoSnapshot;
use continuum_protocol::discovery::view::Worker;
use continuum_protocol::event_plane::LoadEventResult;
use continuum_protocol::ids::{DpRank, InstanceId, WorkerKey};
use continuum_protocol::kv::events::{
    KvCacheEventData, ResidencyDomain, RouterEvent, StorageTier, decode_router_events,
};
use continuum_protocol::kv::hashing::BlockSize;
use continuum_protocol::kv::index::{KvIndex, KvIndexStats, RankOverlap};
use continuum_protocol::kv::parity::{ParityOutcome, ParityStats, ParityTracker};
use continuum_protocol::kv::{CursorTable, KvEventCounts, KvEventResult, LocalBlockHash};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::task::JoinHandle;
use tracing::{debug, warn};

pub use self::metrics::{KvIndexMetrics, KvParityResult};
use crate::clock::now_tick;
use crate::lifecycle::ActorKind;
use crate::lock::{
    CLAIM_TIMEOUT, Claim, Exclusive, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard,
};
use crate::metrics::Metrics;
use crate::registry::RegistryReader;
use crate::supervisor::{ChildContext, ChildSpec};

/// A subscription disconnected or pending this long loses the ranks it fed.
pub const CLEAR_DOWN_AFTER: Duration = Duration::from_secs(60);
/// How often undecided parity predictions are aged.
pub const PARITY_EXPIRY_EVERY: Duration = Duration::from_secs(5);
/// How long a subscription waits for the actor to apply a batch before counting it refused.
pub const DELIVER_TIMEOUT: Duration = Duration::from_secs(5);
/// The actor's name under root.
pub const KV_INDEX_NAME: &str = "kv_index";

/// One kv-events subscription as the index knows it: its supervisor child name.
pub type SubscriptionName = Arc<str>;

#[derive(Debug)]
struct Stream {
    cursors: CursorTable,
    /// Bumped on every state change, so a stale clear timer does nothing.
    epoch: u64,
    up: bool,
}

impl Stream {
    fn new() -> Self {
        Self {
            cursors: CursorTable::new(),
            epoch: 0,
            up: false,
        }
    }
}

/// Per-subscription cursors and which subscription last fed each rank.
#[derive(Debug, Default)]
struct Streams {
    by_name: HashMap<SubscriptionName, Stream>,
    owner: HashMap<(InstanceId, DpRank), SubscriptionName>,
}

struct Shared {
    index: RwLock<KvIndex>,
    streams: Mutex<Streams>,
    parity: Mutex<ParityTracker>,
    mailbox: ArcSwapOption<ActorRef<KvIndexMsg>>,
    metrics: Option<Arc<KvIndexMetrics>>,
    /// The one [`KvIndexWriter`] at a time (the running actor's).
    writer: Exclusive<()>,
}

/// The process-wide KV index as readers and feeders see it: cheap to clone; lock-guarded reads
/// for the request path; batches, subscription states and parity predictions go in, and only
/// the [`KvIndexActor`]'s [`KvIndexWriter`] changes the index, the cursors and the owners.
#[derive(Clone)]
pub struct SharedKvIndex {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for SharedKvIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedKvIndex").finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock()
}

/// The one writer of the KV index (not `Clone`): claimed by each [`KvIndexActor`] incarnation,
/// released when its state is dropped.
pub struct KvIndexWriter {
    kv: SharedKvIndex,
    _claim: Claim<()>,
}

impl std::fmt::Debug for KvIndexWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvIndexWriter").finish_non_exhaustive()
    }
}

impl SharedKvIndex {
    pub fn new(metrics: Option<Metrics>) -> Self {
        // Keys the index's hash tables so fleet-authored hashes cannot aim at collisions.
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0x9e37_79b9_7f4a_7c15);
        Self::with_index(KvIndex::new(seed), metrics)
    }

    /// A handle over a given index (tests with small ceilings).
    pub fn with_index(index: KvIndex, metrics: Option<Metrics>) -> Self {
        Self {
            shared: Arc::new(Shared {
                index: RwLock::new(index),
                streams: Mutex::new(Streams::default()),
                parity: Mutex::new(ParityTracker::new()),
                mailbox: ArcSwapOption::empty(),
                metrics: metrics.as_ref().and_then(Metrics::family),
                writer: Exclusive::new(()),
            }),
        }
    }

    fn read(&self) -> RwLockReadGuard<'_, KvIndex> {
        self.shared.index.read()
    }

    /// The writer, waiting for a previous incarnation's to be dropped.
    async fn claim_writer(&self) -> Result<KvIndexWriter, crate::lock::ClaimTimeout> {
        let claim = self.shared.writer.claim(CLAIM_TIMEOUT).await?;
        Ok(KvIndexWriter {
            kv: self.clone(),
            _claim: claim,
        })
    }

    // ----- reads (request path) --------------------------------------------------------------

    /// Per rank, how many leading blocks of `hashes` (the request's LocalBlockHashes for one
    /// block size) it holds; ranks without overlap omitted, sorted by (worker, dp_rank).
    pub fn overlaps(&self, hashes: &[LocalBlockHash]) -> Vec<RankOverlap> {
        self.read().find_matches(hashes)
    }

    /// [`Self::overlaps`] for each block size under one read guard: a model whose workers use two
    /// `kv_cache_block_size` values hashes the prompt once per size; each answer comes back with
    /// its size so the picker applies it to the ranks of that size only (another size's ranks
    /// cannot hold these hashes except by coincidence).
    pub fn overlaps_by_block_size(
        &self,
        queries: &[(BlockSize, &[LocalBlockHash])],
    ) -> Vec<(BlockSize, Vec<RankOverlap>)> {
        let index = self.read();
        queries
            .iter()
            .map(|(size, q)| (*size, index.find_matches(q)))
            .collect()
    }

    /// Node, rank and ownership counts (walks the index: not for the request path).
    pub fn stats(&self) -> KvIndexStats {
        self.read().stats()
    }

    /// Blocks indexed per (worker, dp_rank), for the admin fleet summary: O(ranks).
    pub fn rank_blocks(&self) -> Vec<(InstanceId, DpRank, usize)> {
        self.read().rank_blocks()
    }

    // ----- hash parity -----------------------------------------------------------------------

    /// After a KV-aware pick of (worker, dp_rank) for `model`: the blocks the rank should now
    /// store, i.e. the request's LocalBlockHashes past the overlap the index reported for it.
    /// Cheap (one short mutex section); decided later by that rank's `Stored` events.
    pub fn record_prediction(
        &self,
        model: &str,
        worker: InstanceId,
        dp_rank: DpRank,
        new_blocks: &[LocalBlockHash],
    ) {
        lock(&self.shared.parity).record_prediction(model, worker, dp_rank, new_blocks, now_tick());
    }

    /// One model's hash parity (`None` before its first prediction).
    pub fn parity(&self, model: &str) -> Option<ParityStats> {
        lock(&self.shared.parity).stats(model)
    }

    /// Predictions not yet decided by a store (or expiry), across models.
    pub fn parity_pending(&self) -> usize {
        lock(&self.shared.parity).pending()
    }

    /// Every tracked model's hash parity.
    pub fn parity_all(&self) -> BTreeMap<String, ParityStats> {
        lock(&self.shared.parity)
            .all_stats()
            .map(|(m, s)| (m.to_string(), s))
            .collect()
    }

    // ----- writes (from subscriptions, through the actor) ------------------------------------

    /// Decodes one kv-events envelope payload and has the actor apply it under `subscription`'s
    /// cursors. Refused batches (undecodable, over the batch bounds, no actor running) are
    /// counted here.
    pub async fn deliver(&self, subscription: &SubscriptionName, payload: &[u8]) {
        let events = match decode_router_events(payload) {
            Ok(events) => events,
            Err(error) => {
                debug!(subscription = %subscription, %error, "Dropped a kv-events batch.");
                return self.count(error.result(), 1);
            }
        };
        self.deliver_events(subscription, events).await;
    }

    /// Has the actor apply an already decoded (and bounded) batch under `subscription`'s
    /// cursors: the kv_listener push path (`crate::kv_push`) decodes SSE JSON, not msgpack.
    pub async fn deliver_events(&self, subscription: &SubscriptionName, events: Vec<RouterEvent>) {
        let n = events.len() as u64;
        let Some(actor) = self.shared.mailbox.load_full() else {
            return self.count(KvEventResult::OverCapacity, n);
        };
        let msg = |reply| KvIndexMsg::ApplyBatch {
            subscription: subscription.clone(),
            events,
            reply,
        };
        if let Err(error) = actor.call(msg, Some(DELIVER_TIMEOUT)).await {
            warn!(subscription = %subscription, %error, events = n, "The KV index did not take a kv-events batch.");
            self.count(KvEventResult::OverCapacity, n);
        }
    }

    /// Counts an envelope-level drop of a kv-events delivery.
    pub fn count_envelope(&self, result: LoadEventResult) {
        if let Some(result) = KvEventResult::from_envelope(result) {
            self.count(result, 1);
        }
    }

    /// Counts a batch refused before decoding finished (`malformed`, `over_capacity`).
    pub fn count_refused(&self, result: KvEventResult) {
        self.count(result, 1);
    }

    fn count(&self, result: KvEventResult, n: u64) {
        if let Some(metrics) = &self.shared.metrics {
            metrics.kv_events(result, n);
        }
    }

    /// A subscription connected (`up`) or went down (pending, backoff, stopped). Down for
    /// [`CLEAR_DOWN_AFTER`] clears the ranks it fed.
    pub fn subscription_state(&self, subscription: &SubscriptionName, up: bool) {
        if let Some(actor) = self.shared.mailbox.load_full() {
            let _ = actor.cast(KvIndexMsg::SubscriptionState {
                subscription: subscription.clone(),
                up,
            });
        } else {
            // No actor runs: record the state (an input, like a batch) for the next
            // incarnation, which arms the timer as it starts.
            record_state(&self.shared, subscription, up);
        }
    }

    /// Has the actor apply the registry's current generation (the live-worker gate) now, and
    /// waits for it; the subscription follower calls this before it starts subscriptions for
    /// new workers, so their first batches pass the gate. Without a running actor this does
    /// nothing: the next incarnation reconciles as it starts.
    pub async fn reconcile(&self) {
        let Some(actor) = self.shared.mailbox.load_full() else {
            return;
        };
        if let Err(error) = actor
            .call(
                |reply| KvIndexMsg::Reconcile(Some(reply)),
                Some(DELIVER_TIMEOUT),
            )
            .await
        {
            warn!(%error, "The KV index did not apply the current fleet in time.");
        }
    }

    /// How many cursors `subscription` holds (tests, admin).
    pub fn cursors(&self, subscription: &str) -> usize {
        lock(&self.shared.streams)
            .by_name
            .get(subscription)
            .map_or(0, |s| s.cursors.len())
    }
}

impl KvIndexWriter {
    fn shared(&self) -> &Shared {
        &self.kv.shared
    }

    fn write(&self) -> RwLockWriteGuard<'_, KvIndex> {
        self.shared().index.write()
    }

    /// The live-worker gate: only live workers and the dp ranks their cards declare. Departed
    /// ranks lose their blocks, every subscription's cursors for them and their pending parity
    /// predictions.
    fn set_live(&self, snapshot: &DynamoSnapshot) {
        let live = live_ranks(snapshot);
        let keep = |w: InstanceId, r: DpRank| live.get(&w).is_some_and(|s| s.contains(&r));
        {
            let mut streams = lock(&self.shared().streams);
            for stream in streams.by_name.values_mut() {
                stream.cursors.retain(keep);
            }
            streams.owner.retain(|(w, r), _| keep(*w, *r));
        }
        lock(&self.shared().parity).retain_ranks(keep);
        self.write().set_live_and_retain(live);
    }

    /// [`Self::set_live`] for the workers a patched snapshot's changes touch: O(change).
    fn patch_live(&self, snapshot: &DynamoSnapshot) {
        let touched = touched_live_ranks(snapshot);
        if touched.is_empty() {
            return;
        }
        let departed: BTreeSet<(InstanceId, DpRank)> =
            self.write().patch_live(touched).into_iter().collect();
        if departed.is_empty() {
            return;
        }
        let keep = |w: InstanceId, r: DpRank| !departed.contains(&(w, r));
        {
            let mut streams = lock(&self.shared().streams);
            for stream in streams.by_name.values_mut() {
                stream.cursors.retain(keep);
            }
            streams.owner.retain(|(w, r), _| keep(*w, *r));
        }
        lock(&self.shared().parity).retain_ranks(keep);
    }

    /// Keeps parity only for the fleet's models; removes departed models' series.
    fn retain_models(&self, snapshot: &DynamoSnapshot) {
        let models: BTreeSet<&str> = snapshot.models().map(|(_, m)| m).collect();
        let gone = lock(&self.shared().parity).retain_models(|m| models.contains(m));
        if let Some(metrics) = &self.shared().metrics {
            for model in gone {
                metrics.remove_kv_hash_parity_model(&model);
            }
        }
    }

    /// Applies one batch under a subscription's cursors (the actor's write path).
    fn apply_batch(
        &self,
        subscription: &SubscriptionName,
        events: &[RouterEvent],
    ) -> KvEventCounts {
        let mut counts = KvEventCounts::default();
        let mut outcomes = Vec::new();
        {
            let mut streams = lock(&self.shared().streams);
            let Streams { by_name, owner } = &mut *streams;
            let stream = by_name
                .entry(subscription.clone())
                .or_insert_with(Stream::new);
            let mut index = self.write();
            let mut parity = lock(&self.shared().parity);
            for event in events {
                let result = index.apply_from(&mut stream.cursors, event);
                counts.add(result);
                let rank = (event.worker_id, event.event.dp_rank);
                match result {
                    KvEventResult::IdentityMismatch
                    | KvEventResult::Replay
                    | KvEventResult::OverCapacity => continue,
                    _ => {
                        if owner.get(&rank) != Some(subscription) {
                            owner.insert(rank, subscription.clone());
                        }
                    }
                }
                let device = event.storage_tier == StorageTier::Device
                    && matches!(event.residency_domain, None | Some(ResidencyDomain::Worker));
                if let (true, KvEventResult::Applied | KvEventResult::Gap) = (device, result)
                    && let KvCacheEventData::Stored(store) = &event.event.data
                {
                    outcomes.extend(parity.on_stored(rank.0, rank.1, &store.blocks));
                }
            }
        }
        if let Some(metrics) = &self.shared().metrics {
            for (result, n) in counts.iter() {
                metrics.kv_events(result, n);
            }
        }
        self.report_parity(outcomes);
        counts
    }

    fn report_parity(&self, outcomes: Vec<ParityOutcome>) {
        for outcome in outcomes {
            if let Some(metrics) = &self.shared().metrics {
                let result = if outcome.matched {
                    KvParityResult::Match
                } else {
                    KvParityResult::Mismatch
                };
                metrics.kv_hash_parity(&outcome.model, result);
            }
            if outcome.zero_parity {
                warn!(
                    model = %outcome.model,
                    window = continuum_protocol::kv::parity::RESULT_WINDOW,
                    "None of the last 100 KV-aware picks for this model found its predicted block hashes in the worker's stored blocks: the router's tokenizer, chat template, block size or cache salt differs from the workers', so KV overlap credit is never earned."
                );
            }
        }
    }

    fn expire_parity(&self) {
        let outcomes = lock(&self.shared().parity).expire(now_tick());
        self.report_parity(outcomes);
    }

    /// Clears the ranks `subscription` fed if it is still down at `epoch`; returns (ranks,
    /// blocks) dropped.
    fn clear_if_down(&self, subscription: &SubscriptionName, epoch: u64) -> Option<(usize, usize)> {
        let ranks: Vec<(InstanceId, DpRank)> = {
            let mut streams = lock(&self.shared().streams);
            let stream = streams.by_name.get(subscription)?;
            if stream.up || stream.epoch != epoch {
                return None;
            }
            streams.by_name.remove(subscription);
            let ranks: Vec<_> = streams
                .owner
                .iter()
                .filter(|(_, s)| *s == subscription)
                .map(|(r, _)| *r)
                .collect();
            for rank in &ranks {
                streams.owner.remove(rank);
            }
            ranks
        };
        let blocks = self.write().clear_ranks(&ranks);
        lock(&self.shared().parity).retain_ranks(|w, r| !ranks.contains(&(w, r)));
        Some((ranks.len(), blocks))
    }

    /// Subscriptions currently down and their epochs (a new actor re-arms their timers).
    fn down_streams(&self) -> Vec<(SubscriptionName, u64)> {
        lock(&self.shared().streams)
            .by_name
            .iter()
            .filter(|(_, s)| !s.up)
            .map(|(n, s)| (n.clone(), s.epoch))
            .collect()
    }

    /// Records a state change; returns the epoch a clear timer must match when `up` is false.
    fn set_state(&self, subscription: &SubscriptionName, up: bool) -> u64 {
        record_state(self.shared(), subscription, up)
    }
}

/// Records a subscription's connection state; returns the epoch a clear timer must match.
fn record_state(shared: &Shared, subscription: &SubscriptionName, up: bool) -> u64 {
    let mut streams = lock(&shared.streams);
    let stream = streams
        .by_name
        .entry(subscription.clone())
        .or_insert_with(Stream::new);
    stream.up = up;
    stream.epoch += 1;
    stream.epoch
}

fn live_ranks(snapshot: &DynamoSnapshot) -> BTreeMap<InstanceId, BTreeSet<DpRank>> {
    let mut live: BTreeMap<InstanceId, BTreeSet<DpRank>> = BTreeMap::new();
    for worker in snapshot.workers() {
        live.insert(worker.key.instance_id, declared_ranks(worker));
    }
    live
}

fn declared_ranks(worker: &Worker) -> BTreeSet<DpRank> {
    let start = worker.dp_start_rank.map(|r| r.0).unwrap_or(0);
    let size = worker.dp_size.unwrap_or(1).clamp(1, 4096);
    (start..start.saturating_add(size)).map(DpRank).collect()
}

/// The live ranks of the instance ids a patched snapshot's changes touch, as [`live_ranks`]
/// computes them over the whole snapshot (keyed by instance id alone: the last namespace in
/// snapshot order wins); an empty set for an id no worker holds any more.
fn touched_live_ranks(snapshot: &DynamoSnapshot) -> BTreeMap<InstanceId, BTreeSet<DpRank>> {
    let ids: BTreeSet<InstanceId> = snapshot
        .changes()
        .touched()
        .map(|w| w.key.instance_id)
        .collect();
    ids.into_iter()
        .map(|id| {
            let last = snapshot.role_counts().keys().rev().find_map(|ns| {
                snapshot.worker(&WorkerKey {
                    namespace: ns.clone(),
                    instance_id: id,
                })
            });
            (id, last.map(|w| declared_ranks(w)).unwrap_or_default())
        })
        .collect()
}

pub struct KvIndexActor;

pub struct KvIndexArgs {
    pub kv: SharedKvIndex,
    pub registry: RegistryReader,
}

pub enum KvIndexMsg {
    /// Apply a decoded batch under the subscription's cursors; replies with its counts.
    ApplyBatch {
        subscription: SubscriptionName,
        events: Vec<RouterEvent>,
        reply: RpcReplyPort<KvEventCounts>,
    },
    /// A subscription connected or went down.
    SubscriptionState {
        subscription: SubscriptionName,
        up: bool,
    },
    /// The clear timer of a subscription that went down at `epoch`.
    ClearIfDown {
        subscription: SubscriptionName,
        epoch: u64,
    },
    /// The registry published a new generation (from the watcher), or the follower asks for the
    /// current one to be applied before it starts subscriptions (replies when done).
    Reconcile(Option<RpcReplyPort<()>>),
    /// Age undecided parity predictions.
    ExpireParity,
}

pub struct KvIndexState {
    kv: KvIndexWriter,
    registry: RegistryReader,
    /// The registry snapshot (its `seq`) the live gate reflects, so the next one is patched.
    applied: Option<u64>,
    watcher: JoinHandle<()>,
    expiry: JoinHandle<()>,
}

impl Actor for KvIndexActor {
    type Msg = KvIndexMsg;
    type State = KvIndexState;
    type Arguments = KvIndexArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<KvIndexMsg>,
        args: KvIndexArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let writer = args.kv.claim_writer().await?;
        let mut generations = args.registry.subscribe();
        let me = myself.clone();
        let watcher = tokio::spawn(async move {
            loop {
                generations.borrow_and_update();
                if me.cast(KvIndexMsg::Reconcile(None)).is_err() {
                    return;
                }
                if generations.changed().await.is_err() {
                    return;
                }
            }
        });
        let expiry = myself.send_interval(PARITY_EXPIRY_EVERY, || KvIndexMsg::ExpireParity);
        // Re-attach: subscriptions that are down keep their deadline from now.
        for (subscription, epoch) in writer.down_streams() {
            arm_clear(&myself, subscription, epoch);
        }
        args.kv.shared.mailbox.store(Some(Arc::new(myself)));
        Ok(KvIndexState {
            kv: writer,
            registry: args.registry,
            applied: None,
            watcher,
            expiry,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<KvIndexMsg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        state.kv.shared().mailbox.store(None);
        state.watcher.abort();
        state.expiry.abort();
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<KvIndexMsg>,
        msg: KvIndexMsg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            KvIndexMsg::ApplyBatch {
                subscription,
                events,
                reply,
            } => {
                let _ = reply.send(state.kv.apply_batch(&subscription, &events));
            }
            KvIndexMsg::SubscriptionState { subscription, up } => {
                state.subscription_state(&myself, subscription, up)
            }
            KvIndexMsg::ClearIfDown {
                subscription,
                epoch,
            } => state.clear_if_down(&subscription, epoch),
            KvIndexMsg::Reconcile(reply) => {
                state.reconcile();
                if let Some(reply) = reply {
                    let _ = reply.send(());
                }
            }
            KvIndexMsg::ExpireParity => state.kv.expire_parity(),
        }
        Ok(())
    }
}

fn arm_clear(myself: &ActorRef<KvIndexMsg>, subscription: SubscriptionName, epoch: u64) {
    myself.send_after(CLEAR_DOWN_AFTER, move || KvIndexMsg::ClearIfDown {
        subscription,
        epoch,
    });
}

impl KvIndexState {
    fn subscription_state(
        &mut self,
        myself: &ActorRef<KvIndexMsg>,
        subscription: SubscriptionName,
        up: bool,
    ) {
        let epoch = self.kv.set_state(&subscription, up);
        if !up {
            arm_clear(myself, subscription, epoch);
        }
    }

    fn clear_if_down(&mut self, subscription: &SubscriptionName, epoch: u64) {
        if let Some((ranks, blocks)) = self.kv.clear_if_down(subscription, epoch) {
            warn!(
                subscription = %subscription,
                ranks,
                blocks,
                down_secs = CLEAR_DOWN_AFTER.as_secs(),
                "A kv-events subscription was down too long; cleared the KV ranks it fed."
            );
        }
    }

    /// Applies the registry's current snapshot: patched from its change set when it follows the
    /// one applied last (O(change)), rebuilt otherwise.
    fn reconcile(&mut self) {
        let snapshot = self.registry.snapshot();
        let changes = snapshot.changes();
        match self.applied {
            Some(seq) if seq == snapshot.seq() && changes.since.is_some() => return,
            Some(seq) if changes.patches(seq) => {
                self.kv.patch_live(&snapshot);
                let models_changed = changes.membership_changed()
                    || changes.changed.iter().any(|(a, b)| a.model != b.model);
                if models_changed {
                    self.kv.retain_models(&snapshot);
                }
            }
            _ => {
                self.kv.set_live(&snapshot);
                self.kv.retain_models(&snapshot);
            }
        }
        self.applied = Some(snapshot.seq());
    }
}

/// The actor's child spec under root.
pub fn kv_index_spec(kv: SharedKvIndex, registry: RegistryReader) -> ChildSpec {
    ChildSpec::new(
        KV_INDEX_NAME,
        ActorKind::KvIndex,
        move |ctx: ChildContext| {
            let args = KvIndexArgs {
                kv: kv.clone(),
                registry: registry.clone(),
            };
            async move {
                let (actor, _) =
                    Actor::spawn_linked(None, KvIndexActor, args, ctx.supervisor).await?;
                Ok(actor.get_cell())
            }
        },
    )
}

#[cfg(test)]
mod tests;
