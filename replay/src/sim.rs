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
//!
//! [`LoadStore`]: continuum_protocol::load_store::LoadStore
//! [`KvIndex`]: continuum_protocol::kv::KvIndex
//! [`answer_arrivals`]: continuum_actors::picker::answer_arrivals
//! [`LoadBasedPicker`]: continuum_protocol::picker::LoadBasedPicker

use std::collections::BTreeMap;
use std::time::Duration;

use continuum_protocol::discovery::SourceEvent;
use continuum_protocol::discovery::reducer::DiscoveryReducer;
use continuum_protocol::discovery::snapshot::{SourceKind, build_snapshot};
use continuum_protocol::ids::{InstanceId, Namespace};
use continuum_protocol::kv::hashing::BlockSize;
use continuum_protocol::picker::candidates::CandidateIndex;
use continuum_protocol::picker::{
    Candidate, DenseRanks, DispatchId, KvAwarePicker, KvPickOutcome, KvPickParams,
    KvSelectionResult, PickOutcome,
};
use continuum_protocol::time::{Tick, UnixMillis};

use super::latency::LatencyModel;
use super::trace::TraceRequest;

pub mod replicas;
mod series;
mod workers;

pub use replicas::{Replicas, Spread};
use series::Series;
use workers::Sim;

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
    /// The router replicas the trace is spread over.
    pub replicas: Replicas,
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
            replicas: Replicas::default(),
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
    /// Prefill lane time used, µs (the latency model's only queue).
    pub prefill_busy_us: u64,
    /// `prefill_busy_us` / (prefilling workers × the trace's span): the fleet's utilisation.
    pub utilisation: f64,
    /// Mean over the same arrivals of std / mean active blocks across decode workers (0 = even).
    pub load_cv: f64,
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
        let r = &cfg.replicas;
        let replica = r.spread.replica_of(i as u64, r.count, cfg.seed);
        let (outcome, overlaps) = sim.pick(&picking, replica, request, now);
        let Some(placement) = Placement::of(outcome, replica, candidates, &mut run) else {
            continue;
        };
        let hit = sim.serve(request, arrival, &placement, &overlaps, policy, &mut run);
        series.hits[bucket].0 += hit as u64;
        series.hits[bucket].1 += request.blocks.len() as u64;
    }
    progress(trace.len() as u64);
    // Prefill lanes: the prefill workers of a disaggregated fleet, else every worker.
    let prefilling = match cfg.prefill_workers {
        0 => cfg.workers,
        p => p,
    };
    series.finish(&mut run, prefilling as usize);
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
    /// The router replica that picked it.
    replica: usize,
}

impl Placement {
    /// The placement `outcome` picked, counting its selection reasons, kv result and bypass into
    /// `run`; `None` (counted unrouted) when nothing was picked or the pick names a worker
    /// outside the fleet.
    fn of(
        outcome: KvPickOutcome,
        replica: usize,
        candidates: &[Candidate],
        run: &mut PolicyRun,
    ) -> Option<Self> {
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
            replica,
        })
    }
}

fn sim_index(candidates: &[Candidate], id: InstanceId) -> Option<usize> {
    candidates.iter().position(|c| c.worker.instance_id == id)
}
