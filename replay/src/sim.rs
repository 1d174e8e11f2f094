//! The fleet simulation: one policy over one trace, in simulated time.
//!
//! The fleet is built the way the daemon builds it: etcd-style discovery records (an instance and
//! a model card per worker, `kv_cache_block_size` = the block size, `total_kv_blocks` = the
//! capacity) go through the real [`DiscoveryReducer`], [`build_snapshot`] and
//! [`CandidateIndex::build`], so the pickers see the same candidates the shim would. Each worker
//! serves one rank of one model. Without prefill workers the `workers` decode workers form an
//! aggregated fleet (each prefills its own requests); with `prefill_workers` > 0 the fleet is
//! disaggregated: a request is prefilled on the pair's prefill worker, its KV moves to the decode
//! worker, which decodes (or, under conditional disaggregation, the decode worker prefills
//! locally when the picker's `bypasses` rule says so).
//!
//! Per request, in arrival order (arrival = `timestamp / speedup`):
//! 1. worker events due by then (prefill done, request finished) are applied, and every worker's
//!    periodic load sample (every `load_interval`, the state just before the tick) lands in the
//!    real [`LoadStore`];
//! 2. the picker decides as `ShimRouter::decide` does: samples answer the ledger's dispatches
//!    ([`answer_arrivals`]), the ledger expires, the load view reads the store against
//!    `max_staleness`; `kv` reads overlaps from the real [`KvIndex`] (`find_matches` over the
//!    prompt's blocks) and calls [`KvAwarePicker::pick_kv`] with a seeded softmax unit; `load` is
//!    [`LoadBasedPicker`]; `round_robin` is [`LoadBasedPicker`] on a source without load signals;
//! 3. the prefilling worker's LRU cache (the pair's prefill worker, else the decode worker)
//!    serves the prompt's cached prefix, stores the rest and evicts past capacity; the same
//!    Stored / Removed kv-events a worker would publish are applied to the index. In a pair, the
//!    decode worker's cache then receives the prompt too (its own prefix cache serves what it
//!    holds, the rest is transferred), with its own kv-events;
//! 4. the [`LatencyModel`] gives TTFT and end-to-end latency; the workers' active load (prefill
//!    tokens until prefill ends, on a prefill worker the prompt's blocks until then, on the decode
//!    worker blocks of prompt + output until the request finishes) changes, and the ledger entry
//!    ends when the request does.
//!
//! Caches (and the index) learn a request's blocks when it is dispatched, not when its prefill
//! ends: a burst of same-prefix requests hits a little more than on a real fleet. Everything is
//! deterministic: simulated time, the index hasher seeded, softmax units from a seeded counter.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::time::Duration;

use continuum_actors::picker::answer_arrivals;
use continuum_protocol::discovery::SourceEvent;
use continuum_protocol::discovery::reducer::DiscoveryReducer;
use continuum_protocol::discovery::snapshot::{SourceKind, build_snapshot};
use continuum_protocol::event_plane::ActiveLoad;
use continuum_protocol::ids::{DpRank, InstanceId, Namespace, PublisherId};
use continuum_protocol::kv::events::{
    KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData, ResidencyDomain,
    RouterEvent, StorageTier, StoredBlock,
};
use continuum_protocol::kv::hashing::{BlockSize, sequence_hashes};
use continuum_protocol::kv::mooncake::{BlockLru, splitmix64};
use continuum_protocol::kv::{ExternalBlockHash, KvEventResult, KvIndex, LocalBlockHash};
use continuum_protocol::load_store::{LoadSample, LoadStore};
use continuum_protocol::picker::candidates::{CandidateIndex, StoreView};
use continuum_protocol::picker::{
    BlockOverlaps, Candidate, CandidateRole, DenseRanks, DispatchId, DynamoWorkerPicker,
    KvAwarePicker, KvPickInput, KvPickOutcome, KvPickParams, KvSelectionResult, LoadBasedPicker,
    PickContext, PickOutcome, PickRequest, PickerState,
};
use continuum_protocol::time::{Tick, UnixMillis};

use super::latency::LatencyModel;
use super::trace::TraceRequest;

/// The model every simulated worker serves.
pub const MODEL: &str = "replay/model";
const NAMESPACE: &str = "replay";
/// Instance ids are `FIRST_ID + worker`.
const FIRST_ID: u64 = 0x7e91_a000;
/// Upper bound on simulated workers.
pub const MAX_WORKERS: u32 = 4096;

/// A routing policy to replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Policy {
    Load,
    Kv,
    RoundRobin,
}

impl Policy {
    pub fn as_label(self) -> &'static str {
        match self {
            Policy::Load => "load",
            Policy::Kv => "kv",
            Policy::RoundRobin => "round_robin",
        }
    }
}

impl std::str::FromStr for Policy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "load" => Ok(Policy::Load),
            "kv" => Ok(Policy::Kv),
            "round_robin" => Ok(Policy::RoundRobin),
            other => Err(format!(
                "unknown policy `{other}` (expected load, kv or round_robin)"
            )),
        }
    }
}

/// The simulated fleet and its router.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Decode workers (aggregated when `prefill_workers` is 0).
    pub workers: u32,
    /// Prefill workers beside the decode workers (0: an aggregated fleet).
    pub prefill_workers: u32,
    /// Blocks each worker's prefix cache holds (its card's `total_kv_blocks`).
    pub capacity_blocks: u64,
    pub block_size: BlockSize,
    /// Arrival times are divided by this.
    pub speedup: f64,
    pub seed: u64,
    /// How often each worker publishes its load.
    pub load_interval: Duration,
    /// `dynamo.load.max_staleness`.
    pub max_staleness: Duration,
    /// `dynamo.kv` tunables of the `kv` policy.
    pub kv: KvPickParams,
    pub latency: LatencyModel,
    /// Time buckets of the over-time series.
    pub buckets: usize,
}

impl SimConfig {
    pub fn new(workers: u32, capacity_blocks: u64, block_size: BlockSize) -> Self {
        Self {
            workers,
            prefill_workers: 0,
            capacity_blocks,
            block_size,
            speedup: 1.0,
            seed: 0,
            load_interval: Duration::from_millis(50),
            max_staleness: Duration::from_secs(3),
            kv: KvPickParams::default(),
            latency: LatencyModel::default(),
            buckets: 60,
        }
    }
}

/// One policy's raw results.
#[derive(Clone, Debug, Default)]
pub struct PolicyRun {
    pub policy: Option<Policy>,
    pub requests: u64,
    pub unrouted: u64,
    pub input_tokens: u64,
    pub cached_tokens: u64,
    pub prompt_blocks: u64,
    pub hit_blocks: u64,
    /// Per request, microseconds (in trace order).
    pub ttft_us: Vec<u64>,
    pub e2e_us: Vec<u64>,
    /// Requests each worker took part in (prefilled or decoded), in candidate order.
    pub requests_per_worker: Vec<u64>,
    /// Prompt tokens moved from a prefill worker to its decode worker (pairs only).
    pub transferred_tokens: u64,
    /// Requests the decode worker prefilled itself under conditional disaggregation.
    pub bypasses: u64,
    /// `role/reason` of `continuum_dynamo_selection_total` → count.
    pub selections: BTreeMap<String, u64>,
    /// `continuum_dynamo_kv_selection_total{result}` → count (`kv` only).
    pub kv_results: BTreeMap<String, u64>,
    /// Kv-events the index did not apply (should be 0).
    pub events_not_applied: u64,
    /// Dispatches where the index's overlap for the chosen worker differed from its cache.
    pub index_disagreements: u64,
    /// Mean over arrivals (with any load) of max / mean active blocks across workers.
    pub load_imbalance: f64,
    /// Bucket start times, seconds of simulated time.
    pub bucket_starts_s: Vec<f64>,
    /// Per bucket, block hit rate (`None`: no request in it).
    pub hit_rate_series: Vec<Option<f64>>,
    /// Per worker, per bucket: mean active blocks seen at the bucket's arrivals.
    pub worker_load_series: Vec<Vec<Option<f64>>>,
}

fn records(id: u64, worker_type: &str, cfg: &SimConfig) -> Vec<(String, Vec<u8>)> {
    let endpoint = serde_json::json!({"type": "Endpoint", "namespace": NAMESPACE,
        "component": "backend", "endpoint": "generate", "instance_id": id,
        "transport": {"tcp": "127.0.0.1:1/replay"}});
    let card = serde_json::json!({"type": "Model", "namespace": NAMESPACE,
        "component": "backend", "endpoint": "generate", "instance_id": id,
        "card_json": {"display_name": MODEL, "worker_type": worker_type,
        "kv_cache_block_size": cfg.block_size.get(), "runtime_config": {
        "total_kv_blocks": cfg.capacity_blocks, "max_num_batched_tokens": 8192,
        "data_parallel_start_rank": 0, "data_parallel_size": 1}}});
    [
        (
            format!("v1/instances/{NAMESPACE}/backend/generate/{id:x}"),
            endpoint,
        ),
        (format!("v1/mdc/{NAMESPACE}/backend/generate/{id:x}"), card),
    ]
    .into_iter()
    .map(|(key, value)| (key, value.to_string().into_bytes()))
    .collect()
}

/// The fleet's candidates, through discovery and the candidate index as the daemon builds them.
pub fn fleet_candidates(cfg: &SimConfig) -> anyhow::Result<Vec<Candidate>> {
    if cfg.workers == 0 || cfg.workers > MAX_WORKERS {
        anyhow::bail!("--workers must be 1..={MAX_WORKERS}");
    }
    if cfg.prefill_workers > MAX_WORKERS - cfg.workers {
        anyhow::bail!("--workers + --prefill-workers must be at most {MAX_WORKERS}");
    }
    let total = cfg.workers + cfg.prefill_workers;
    let namespace = Namespace::new(NAMESPACE);
    let mut reducer = DiscoveryReducer::new(namespace.clone());
    reducer.apply(SourceEvent::Init, UnixMillis(0));
    for w in 0..u64::from(total) {
        let worker_type = if w < u64::from(cfg.workers) {
            "decode"
        } else {
            "prefill"
        };
        for (key, value) in records(FIRST_ID + w, worker_type, cfg) {
            reducer.apply(SourceEvent::InitApply { key, value }, UnixMillis(0));
        }
    }
    reducer.apply(SourceEvent::InitDone, UnixMillis(0));
    let snapshot = build_snapshot(SourceKind::Etcd, &[namespace], &[reducer.view().as_ref()]);
    let candidates = CandidateIndex::build(&snapshot).for_model(MODEL).to_vec();
    if candidates.len() != total as usize {
        anyhow::bail!(
            "discovery built {} candidates for {total} workers",
            candidates.len()
        );
    }
    Ok(candidates)
}

#[derive(Debug)]
struct SimWorker {
    id: InstanceId,
    /// A decode or aggregated worker (not a prefill worker).
    decodes: bool,
    lru: BlockLru,
    event_id: u64,
    lane_free_us: u64,
    prefill_tokens: u64,
    active_blocks: u64,
    /// Index of the last load tick published.
    published_tick: Option<u64>,
    sequence: u64,
}

#[derive(Debug)]
enum WorkerEvent {
    PrefillDone {
        worker: usize,
        tokens: u64,
        /// Blocks a prefill worker held for the request until its KV left.
        blocks: u64,
    },
    Finished {
        worker: usize,
        blocks: u64,
        dispatch: Option<DispatchId>,
    },
}

struct Sim<'a> {
    cfg: &'a SimConfig,
    workers: Vec<SimWorker>,
    store: LoadStore,
    index: KvIndex,
    state: PickerState,
    /// (time µs, order) → index into `events`.
    due: BinaryHeap<Reverse<(u64, u64)>>,
    events: Vec<Option<WorkerEvent>>,
    interval_us: u64,
    draws: u64,
}

impl<'a> Sim<'a> {
    /// The fleet of `candidates`, idle, every worker live in the store and the index.
    fn new(cfg: &'a SimConfig, candidates: &[Candidate]) -> Self {
        let mut sim = Sim {
            cfg,
            workers: candidates
                .iter()
                .map(|c| SimWorker {
                    id: c.worker.instance_id,
                    decodes: c.role != CandidateRole::Prefill,
                    lru: BlockLru::new(usize::try_from(cfg.capacity_blocks).unwrap_or(usize::MAX)),
                    event_id: 0,
                    lane_free_us: 0,
                    prefill_tokens: 0,
                    active_blocks: 0,
                    published_tick: None,
                    sequence: 0,
                })
                .collect(),
            store: LoadStore::new(),
            index: KvIndex::new(splitmix64(cfg.seed)),
            state: PickerState::new(),
            due: BinaryHeap::new(),
            events: Vec::new(),
            interval_us: u64::try_from(cfg.load_interval.as_micros())
                .unwrap_or(u64::MAX)
                .max(1),
            draws: 0,
        };
        sim.store
            .set_live_and_retain(sim.workers.iter().map(|w| w.id));
        sim.index.set_live_and_retain(
            sim.workers
                .iter()
                .map(|w| (w.id, BTreeSet::from([DpRank(0)])))
                .collect(),
        );
        sim
    }

    /// Step 2: the picker decides as `ShimRouter::decide` does. Returns the outcome and the
    /// overlaps the kv policy read from the index (none for the other policies).
    fn pick(
        &mut self,
        picking: &Picking<'_>,
        request: &TraceRequest,
        now: Tick,
    ) -> (KvPickOutcome, Vec<BlockOverlaps>) {
        let isl = request.input_tokens;
        answer_arrivals(&mut self.state.ledger, &self.store);
        self.state.ledger.expire(now);
        let pick_request = PickRequest {
            model: MODEL,
            eligible_namespaces: &picking.namespaces,
            estimated_prompt_tokens: isl,
            load_signals: picking.policy != Policy::RoundRobin,
        };
        let mut overlaps = Vec::new();
        let unit = self.draw_unit();
        if picking.policy == Policy::Kv {
            overlaps.push(BlockOverlaps {
                block_size: self.cfg.block_size,
                ranks: self.index.find_matches(&request.blocks),
            });
        }
        let outcome = {
            let view = StoreView {
                store: &self.store,
                now,
                max_age: self.cfg.max_staleness,
            };
            let mut ctx = PickContext::new(
                &pick_request,
                picking.candidates,
                &view,
                &mut self.state,
                now,
            )
            .with_layout(&picking.layout);
            match picking.policy {
                Policy::Kv => {
                    let input = KvPickInput {
                        isl,
                        overlaps: &overlaps,
                        unit,
                    };
                    picking.kv_picker.pick_kv(&mut ctx, Ok(&input))
                }
                Policy::Load | Policy::RoundRobin => KvPickOutcome {
                    outcome: LoadBasedPicker.pick(&mut ctx),
                    kv: None,
                },
            }
        };
        (outcome, overlaps)
    }

    /// Steps 3 and 4 for a placed request: the caches serve and learn the prompt, the latency
    /// model times it, the workers' load changes until its events, and `run` counts it. Returns
    /// the blocks the prefilling worker's cache held.
    fn serve(
        &mut self,
        request: &TraceRequest,
        arrival: u64,
        placement: &Placement,
        overlaps: &[BlockOverlaps],
        policy: Policy,
        run: &mut PolicyRun,
    ) -> usize {
        let cfg = self.cfg;
        let bs = u64::from(cfg.block_size.get());
        let isl = request.input_tokens;
        let (decode, prefill) = (placement.decode, placement.prefill);
        // The prefilling worker: the pair's prefill worker, else the decode worker itself.
        let prefiller = prefill.unwrap_or(decode);
        let hit = self.serve_blocks(prefiller, &request.blocks, run);
        if policy == Policy::Kv {
            let predicted = overlaps
                .first()
                .map_or(0, |o| o.of(self.workers[prefiller].id, DpRank(0)));
            if predicted != hit as u64 {
                run.index_disagreements += 1;
            }
        }
        let cached_tokens = (hit as u64 * bs).min(isl);
        let uncached = isl - cached_tokens;
        let start = arrival.max(self.workers[prefiller].lane_free_us);
        let prefill_done = start.saturating_add(cfg.latency.prefill_us(uncached));
        let blocks = (isl + request.output_tokens).div_ceil(bs);
        let prompt_blocks = isl.div_ceil(bs);
        // A pair: the decode worker's own prefix cache serves what it holds, the rest of the
        // prompt's KV is transferred, and decoding starts when it has arrived.
        let first_token = match prefill {
            Some(_) => {
                let held = self.serve_blocks(decode, &request.blocks, run);
                let transferred = isl - (held as u64 * bs).min(isl);
                run.transferred_tokens += transferred;
                prefill_done.saturating_add(cfg.latency.transfer_us(transferred))
            }
            None => prefill_done,
        };
        let finish = first_token.saturating_add(cfg.latency.decode_us(request.output_tokens));
        let held_by_prefiller = if prefill.is_some() { prompt_blocks } else { 0 };
        {
            let w = &mut self.workers[prefiller];
            w.lane_free_us = prefill_done;
            w.prefill_tokens += uncached;
            w.active_blocks += held_by_prefiller;
        }
        self.workers[decode].active_blocks += blocks;
        self.schedule(
            prefill_done,
            WorkerEvent::PrefillDone {
                worker: prefiller,
                tokens: uncached,
                blocks: held_by_prefiller,
            },
        );
        self.schedule(
            finish,
            WorkerEvent::Finished {
                worker: decode,
                blocks,
                dispatch: placement.dispatch,
            },
        );

        run.requests += 1;
        run.requests_per_worker[decode] += 1;
        if let Some(p) = prefill {
            run.requests_per_worker[p] += 1;
        }
        run.input_tokens += isl;
        run.cached_tokens += cached_tokens;
        run.prompt_blocks += request.blocks.len() as u64;
        run.hit_blocks += hit as u64;
        run.ttft_us.push(first_token - arrival);
        run.e2e_us.push(finish - arrival);
        hit
    }

    /// Publishes `worker`'s load as of the last tick at or before `t_us` (the state before any
    /// change at `t_us`), if that tick was not published yet.
    fn flush(&mut self, worker: usize, t_us: u64) {
        let tick = t_us / self.interval_us;
        let w = &mut self.workers[worker];
        if w.published_tick.is_some_and(|p| p >= tick) {
            return;
        }
        w.published_tick = Some(tick);
        w.sequence += 1;
        let at_us = tick * self.interval_us;
        self.store.apply(LoadSample {
            load: ActiveLoad {
                worker_id: w.id,
                dp_rank: DpRank(0),
                active_decode_blocks: Some(w.active_blocks),
                active_prefill_tokens: Some(w.prefill_tokens),
                kv_used_blocks: Some(w.active_blocks),
            },
            publisher_id: PublisherId(w.id.0),
            sequence: w.sequence,
            published_at: UnixMillis(at_us / 1000),
            received_at: Tick(Duration::from_micros(at_us)),
        });
    }

    fn schedule(&mut self, at_us: u64, event: WorkerEvent) {
        let order = self.events.len() as u64;
        self.events.push(Some(event));
        self.due.push(Reverse((at_us, order)));
    }

    /// Applies worker events due at or before `t_us`, in time order.
    fn advance(&mut self, t_us: u64) {
        while let Some(Reverse((at, order))) = self.due.peek().copied() {
            if at > t_us {
                break;
            }
            self.due.pop();
            let Some(event) = self.events.get_mut(order as usize).and_then(Option::take) else {
                continue;
            };
            match event {
                WorkerEvent::PrefillDone {
                    worker,
                    tokens,
                    blocks,
                } => {
                    self.flush(worker, at);
                    let w = &mut self.workers[worker];
                    w.prefill_tokens = w.prefill_tokens.saturating_sub(tokens);
                    w.active_blocks = w.active_blocks.saturating_sub(blocks);
                }
                WorkerEvent::Finished {
                    worker,
                    blocks,
                    dispatch,
                } => {
                    self.flush(worker, at);
                    let w = &mut self.workers[worker];
                    w.active_blocks = w.active_blocks.saturating_sub(blocks);
                    if let Some(id) = dispatch {
                        self.state.ledger.request_ended(id);
                    }
                }
            }
        }
        for worker in 0..self.workers.len() {
            self.flush(worker, t_us);
        }
    }

    /// A seeded unit in `[0, 1)` for softmax sampling.
    fn draw_unit(&mut self) -> f64 {
        self.draws += 1;
        let bits = splitmix64(self.cfg.seed ^ splitmix64(self.draws));
        (bits >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Serves `blocks` on `worker`'s cache: returns the cached prefix (blocks) and applies the
    /// worker's kv-events to the index.
    fn serve_blocks(
        &mut self,
        worker: usize,
        local: &[LocalBlockHash],
        run: &mut PolicyRun,
    ) -> usize {
        let seq: Vec<u64> = sequence_hashes(local).into_iter().map(|s| s.0).collect();
        let w = &mut self.workers[worker];
        let hit = w.lru.prefix(&seq);
        let mut batch = Vec::new();
        if hit < seq.len() {
            let blocks: Vec<StoredBlock> = (hit..seq.len())
                .map(|i| StoredBlock {
                    block_hash: ExternalBlockHash(seq[i]),
                    tokens_hash: local[i],
                    mm_extra_info: None,
                })
                .collect();
            w.event_id += 1;
            batch.push(router_event(
                w.id,
                w.event_id,
                KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: hit.checked_sub(1).map(|p| ExternalBlockHash(seq[p])),
                    start_position: None,
                    blocks: blocks.into(),
                }),
            ));
        }
        // Tail first, so the prefix is the most recent and evicted last.
        for hash in seq.iter().rev() {
            w.lru.touch(*hash);
        }
        let evicted = w.lru.evict();
        if !evicted.is_empty() {
            w.event_id += 1;
            batch.push(router_event(
                w.id,
                w.event_id,
                KvCacheEventData::Removed(KvCacheRemoveData {
                    block_hashes: evicted
                        .into_iter()
                        .map(ExternalBlockHash)
                        .collect::<Vec<_>>()
                        .into(),
                }),
            ));
        }
        for event in &batch {
            if self.index.apply(event) != KvEventResult::Applied {
                run.events_not_applied += 1;
            }
        }
        hit
    }
}

fn router_event(worker: InstanceId, id: u64, data: KvCacheEventData) -> RouterEvent {
    RouterEvent {
        worker_id: worker,
        storage_tier: StorageTier::Device,
        residency_domain: Some(ResidencyDomain::Worker),
        event: KvCacheEvent {
            event_id: id,
            data,
            dp_rank: DpRank(0),
        },
        session_id: None,
    }
}

fn arrival_us(request: &TraceRequest, speedup: f64) -> u64 {
    let us = request.timestamp_ms * 1000.0 / speedup;
    if us.is_finite() && us > 0.0 {
        us.min(u64::MAX as f64 / 2.0) as u64
    } else {
        0
    }
}

/// Replays `trace` (sorted by timestamp) under `policy`; `progress` is called with the requests
/// done so far every few hundred requests.
pub fn simulate(
    trace: &[TraceRequest],
    policy: Policy,
    cfg: &SimConfig,
    candidates: &[Candidate],
    progress: &mut dyn FnMut(u64),
) -> PolicyRun {
    let mut sim = Sim::new(cfg, candidates);
    let picking = Picking {
        policy,
        candidates,
        layout: DenseRanks::build(candidates),
        kv_picker: KvAwarePicker::new(cfg.kv),
        namespaces: [Namespace::new(NAMESPACE)],
    };
    let mut series = Series::new(cfg, trace, candidates);
    let mut run = PolicyRun {
        policy: Some(policy),
        requests_per_worker: vec![0; candidates.len()],
        bucket_starts_s: series.starts_s(),
        ..PolicyRun::default()
    };
    for (i, request) in trace.iter().enumerate() {
        if i % 256 == 0 {
            progress(i as u64);
        }
        let arrival = arrival_us(request, cfg.speedup);
        sim.advance(arrival);
        let bucket = series.bucket_of(arrival);
        series.sample_load(&sim.workers, bucket);
        let now = Tick(Duration::from_micros(arrival));
        let (outcome, overlaps) = sim.pick(&picking, request, now);
        let Some(placement) = Placement::of(outcome, candidates, &mut run) else {
            continue;
        };
        let hit = sim.serve(request, arrival, &placement, &overlaps, policy, &mut run);
        series.hits[bucket].0 += hit as u64;
        series.hits[bucket].1 += request.blocks.len() as u64;
    }
    progress(trace.len() as u64);
    series.finish(&mut run);
    run
}

/// What a policy picks with: the fleet's candidates, their dense rank layout, the pickers.
struct Picking<'a> {
    policy: Policy,
    candidates: &'a [Candidate],
    layout: DenseRanks,
    kv_picker: KvAwarePicker,
    namespaces: [Namespace; 1],
}

/// Where a pick placed a request, as indices into the simulated workers.
struct Placement {
    decode: usize,
    /// The pair's prefill worker (disaggregated fleets only).
    prefill: Option<usize>,
    dispatch: Option<DispatchId>,
}

impl Placement {
    /// The placement `outcome` picked, counting its selection reasons, kv result and bypass into
    /// `run`; `None` (counted unrouted) when nothing was picked or the pick names a worker
    /// outside the fleet.
    fn of(outcome: KvPickOutcome, candidates: &[Candidate], run: &mut PolicyRun) -> Option<Self> {
        let pick = match outcome.outcome {
            PickOutcome::Picked(pick) => pick,
            PickOutcome::NoCandidates(_) => {
                run.unrouted += 1;
                return None;
            }
        };
        for (role, reason) in pick.reasons.labels() {
            *run.selections
                .entry(format!("{role}/{reason}"))
                .or_default() += 1;
        }
        if let Some(result) = outcome.kv {
            *run.kv_results
                .entry(result.as_label().to_owned())
                .or_default() += 1;
        }
        let worker_of = |id: InstanceId| sim_index(candidates, id);
        let Some(decode) = worker_of(pick.decode.worker.instance_id) else {
            run.unrouted += 1;
            return None;
        };
        let prefill = match &pick.prefill {
            Some(p) => match worker_of(p.worker.instance_id) {
                Some(p) => Some(p),
                None => {
                    run.unrouted += 1;
                    return None;
                }
            },
            None => None,
        };
        if outcome.kv == Some(KvSelectionResult::Bypass) {
            run.bypasses += 1;
        }
        Some(Self {
            decode,
            prefill,
            dispatch: pick.dispatch,
        })
    }
}

/// The run's time series: arrivals fall into `cfg.buckets` equal buckets of the trace's span;
/// per bucket, the block hit rate and each worker's mean active blocks; over all arrivals, the
/// decode workers' load imbalance.
struct Series {
    buckets: usize,
    span_us: u64,
    decoders: usize,
    /// Per bucket: (hit blocks, prompt blocks).
    hits: Vec<(u64, u64)>,
    /// Per worker, per bucket: (sum of active blocks, arrivals seen).
    load: Vec<Vec<(u64, u64)>>,
    imbalance_sum: f64,
    imbalance_n: u64,
}

impl Series {
    fn new(cfg: &SimConfig, trace: &[TraceRequest], candidates: &[Candidate]) -> Self {
        let buckets = cfg.buckets.max(1);
        Self {
            buckets,
            span_us: trace
                .last()
                .map_or(0, |r| arrival_us(r, cfg.speedup))
                .max(1),
            decoders: candidates
                .iter()
                .filter(|c| c.role != CandidateRole::Prefill)
                .count()
                .max(1),
            hits: vec![(0, 0); buckets],
            load: vec![vec![(0, 0); buckets]; candidates.len()],
            imbalance_sum: 0.0,
            imbalance_n: 0,
        }
    }

    /// Bucket start times, seconds.
    fn starts_s(&self) -> Vec<f64> {
        (0..self.buckets)
            .map(|b| (b as f64 * self.span_us as f64 / self.buckets as f64) / 1e6)
            .collect()
    }

    fn bucket_of(&self, t: u64) -> usize {
        ((t as u128 * self.buckets as u128 / (self.span_us as u128 + 1)) as usize)
            .min(self.buckets - 1)
    }

    /// The workers' active blocks as an arrival in `bucket` sees them.
    fn sample_load(&mut self, workers: &[SimWorker], bucket: usize) {
        let mut max_load = 0u64;
        let mut total_load = 0u64;
        for (w, worker) in workers.iter().enumerate() {
            let slot = &mut self.load[w][bucket];
            slot.0 += worker.active_blocks;
            slot.1 += 1;
            if worker.decodes {
                max_load = max_load.max(worker.active_blocks);
                total_load += worker.active_blocks;
            }
        }
        if total_load > 0 {
            self.imbalance_sum += max_load as f64 * self.decoders as f64 / total_load as f64;
            self.imbalance_n += 1;
        }
    }

    fn finish(self, run: &mut PolicyRun) {
        run.load_imbalance = if self.imbalance_n == 0 {
            1.0
        } else {
            self.imbalance_sum / self.imbalance_n as f64
        };
        run.hit_rate_series = self
            .hits
            .iter()
            .map(|(hit, total)| (*total > 0).then(|| *hit as f64 / *total as f64))
            .collect();
        run.worker_load_series = self
            .load
            .iter()
            .map(|per_bucket| {
                per_bucket
                    .iter()
                    .map(|(sum, n)| (*n > 0).then(|| *sum as f64 / *n as f64))
                    .collect()
            })
            .collect();
    }
}

fn sim_index(candidates: &[Candidate], id: InstanceId) -> Option<usize> {
    candidates.iter().position(|c| c.worker.instance_id == id)
}
