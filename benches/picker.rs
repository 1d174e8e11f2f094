//! Decision latency of the `LoadBasedPicker` over 1,000 candidate ranks (goal: p99 ≤ 5 µs).
//!
//! Two fleets: 500 decode workers × 2 dp ranks (1,000 decode ranks, no prefill pool), and 250
//! decode + 250 prefill workers × 2 ranks (a prefill/decode pair over 500 + 500 ranks). Every
//! rank has a fresh sample, and the ledger keeps the last 64 dispatches unanswered, as between two
//! samples of a busy fleet. Each fleet runs against two `LoadView`s: a std `HashMap` keyed by
//! `WorkerKey` (what a straightforward load-store adapter costs) and a dense `Vec` (close to the
//! picker's own cost). Criterion reports the mean; the percentile pass after it times 20,000
//! single picks and prints p50 / p99 / max, then the floor the `LoadView` API sets (1,000
//! dynamic `sample` calls alone). `PICKER_BENCH=percentiles` skips criterion; `PICKER_VIEW=dense`
//! or `=hashmap` keeps one view (for `perf record`).
//!
//! The end-to-end pass then times `ShimRouter::decide_parsed` (what the request path calls) over
//! a real published snapshot of the same 1,000 decode ranks and the shared load store (config
//! load, eligibility, the load-store lock, arrivals, expiry, the pick and the ledger record),
//! with a short and a 6 kB chat body whose prompt-size estimate comes from the proxy's parse
//! (`proxy::body::parse`, timed on its own); `ShimRouter::decide` over the raw bytes (which
//! parses the body again for the estimate) for comparison; `decide_parsed` again with the
//! publishers silent (no sample after the pass's first, so its dispatches pile up in the ledger:
//! a pick must not cost more for them); and the round trip of a ractor
//! `call` to an idle actor, the floor a picker behind a mailbox would add to every decision.
//!
//! `PICKER_PEER_SLOTS=n` adds peer slots as replica 2 of `n` (with a window).
//! `PICKER_TIE_WINDOW=w` runs the store-slot passes with the replicas' tie-break at window w
//! (`dynamo.load.tie_break_window`; it takes the generic scoring pass plus one re-walk).
//!
//! `PICKER_ONLY=decide` runs only the end-to-end pass (`decide/…`, `proxy_parse/…` and the
//! mailbox round trip).
//! `PICKER_ONLY=scaling_N` runs only the store-slot pass at N ranks (`kv_scaling_N`: the same
//! with the `KvAwarePicker`; `idle_scaling_N`: every rank reporting no backlog), and `PICKER_PICKS=n` sets the number of timed picks: together they
//! make a short run for `valgrind --tool=callgrind --toggle-collect='*LoadBasedPicker*pick*'`
//! (`'*KvAwarePicker*pick*'`; instruction counts per pick, comparable whatever the machine's
//! load). Measuring, the timed picks follow a warm-up that fills the ledger's dispatch history
//! to its cap (a router's steady state; `PICKER_WARMUP=n` sets another).

use std::collections::{HashMap, VecDeque};
use std::hint::black_box;
use std::time::{Duration, Instant};

use continuum_protocol::ids::{DpRank, InstanceId, Namespace, WorkerKey};
use continuum_protocol::kv::hashing::BlockSize;
use continuum_protocol::kv::index::RankOverlap;
use continuum_protocol::picker::tie_break::Place;
use continuum_protocol::picker::{
    BlockOverlaps, Candidate, CandidateRole, DenseRanks, DynamoWorkerPicker, KvAwarePicker,
    KvPickInput, KvPickParams, LoadBasedPicker, LoadView, MAX_LEDGER_DISPATCHES, PickContext,
    PickOutcome, PickRequest, PickerState, SampleState, TieBreak,
};
use continuum_protocol::time::Tick;
use criterion::Criterion;

const MODEL: &str = "Qwen/Qwen3-32B";
const NAMESPACE: &str = "prod";
const FIRST_ID: u64 = 0x694d_7b2c_9a4e_0000;
/// Dispatches left unanswered at any time.
const OUTSTANDING: usize = 64;

struct Fleet {
    name: &'static str,
    candidates: Vec<Candidate>,
}

fn fleet(name: &'static str, decode_workers: u64, prefill_workers: u64) -> Fleet {
    // One shared allocation per model, as a snapshot adapter would intern it.
    let model: std::sync::Arc<str> = MODEL.into();
    let mut candidates = Vec::new();
    for w in 0..decode_workers + prefill_workers {
        let role = if w < decode_workers {
            CandidateRole::Decode
        } else {
            CandidateRole::Prefill
        };
        for rank in 0..2 {
            candidates.push(Candidate {
                worker: WorkerKey {
                    namespace: Namespace::new(NAMESPACE),
                    instance_id: InstanceId(FIRST_ID + w),
                },
                role,
                model: model.clone(),
                dp_rank: Some(DpRank(rank)),
                rank_declared: true,
                block_size: Some(16),
                total_kv_blocks: Some(16_384),
                max_num_batched_tokens: Some(8192),
            });
        }
    }
    Fleet { name, candidates }
}

/// A deterministic spread of loads, so costs differ and a few tie.
fn sample_for(worker: u64, rank: u32) -> SampleState {
    let mix = (worker.wrapping_mul(2_654_435_761) ^ (u64::from(rank) * 40_503)) % 4096;
    SampleState::Fresh {
        active_decode_blocks: Some(mix),
        active_prefill_tokens: Some(mix * 2),
        kv_used_blocks: Some(mix),
    }
}

/// Samples per worker, ranks in a small vector: one std `HashMap` lookup per rank.
struct MapLoad(HashMap<WorkerKey, Vec<SampleState>>);

impl LoadView for MapLoad {
    fn sample(&self, worker: &WorkerKey, rank: DpRank) -> SampleState {
        self.0
            .get(worker)
            .and_then(|ranks| ranks.get(rank.0 as usize))
            .copied()
            .unwrap_or(SampleState::Never)
    }
}

struct DenseLoad(Vec<SampleState>);

impl LoadView for DenseLoad {
    fn sample(&self, worker: &WorkerKey, rank: DpRank) -> SampleState {
        let index = (worker.instance_id.0.wrapping_sub(FIRST_ID) * 2 + u64::from(rank.0)) as usize;
        self.0.get(index).copied().unwrap_or(SampleState::Never)
    }
}

fn map_load(fleet: &Fleet) -> MapLoad {
    let mut map: HashMap<WorkerKey, Vec<SampleState>> = HashMap::new();
    for c in &fleet.candidates {
        let sample = sample_for(c.worker.instance_id.0 - FIRST_ID, c.rank().0);
        map.entry(c.worker.clone()).or_default().push(sample);
    }
    MapLoad(map)
}

fn dense_load(fleet: &Fleet) -> DenseLoad {
    DenseLoad(
        fleet
            .candidates
            .iter()
            .map(|c| sample_for(c.worker.instance_id.0 - FIRST_ID, c.rank().0))
            .collect(),
    )
}

/// Picks in a loop, answering each dispatch `OUTSTANDING` picks later, 100 µs apart.
struct Driver<'a> {
    fleet: &'a Fleet,
    /// Built once, as the candidate index does per generation.
    layout: DenseRanks,
    load: &'a dyn LoadView,
    namespaces: Vec<Namespace>,
    state: PickerState,
    now: Tick,
    unanswered: VecDeque<WorkerKey>,
    /// Picks with the `KvAwarePicker` over these overlaps when set.
    kv: Option<Vec<BlockOverlaps>>,
}

impl<'a> Driver<'a> {
    fn new(fleet: &'a Fleet, load: &'a dyn LoadView) -> Self {
        Self {
            fleet,
            layout: DenseRanks::build(&fleet.candidates),
            load,
            namespaces: vec![Namespace::new(NAMESPACE)],
            state: PickerState::new(),
            now: Tick::ZERO,
            unanswered: VecDeque::new(),
            kv: None,
        }
    }

    fn pick(&mut self) -> PickOutcome {
        let req = PickRequest {
            model: MODEL,
            eligible_namespaces: &self.namespaces,
            estimated_prompt_tokens: 1500,
            load_signals: true,
        };
        let mut ctx = PickContext::new(
            &req,
            &self.fleet.candidates,
            self.load,
            &mut self.state,
            self.now,
        )
        .with_layout(&self.layout);
        match &self.kv {
            None => LoadBasedPicker.pick(&mut ctx),
            Some(overlaps) => {
                let input = KvPickInput {
                    isl: 1500,
                    overlaps,
                    unit: 0.0,
                };
                KvAwarePicker::new(KvPickParams::default())
                    .pick_kv(&mut ctx, Ok(&input))
                    .outcome
            }
        }
    }

    fn settle(&mut self, outcome: PickOutcome) {
        if let PickOutcome::Picked(pick) = outcome {
            self.unanswered.push_back(pick.decode.worker);
            if let Some(prefill) = pick.prefill {
                self.unanswered.push_back(prefill.worker);
            }
        }
        self.now = self.now.plus(Duration::from_micros(100));
        while self.unanswered.len() > OUTSTANDING {
            if let Some(worker) = self.unanswered.pop_front() {
                self.state.ledger.sample_arrived(&worker, self.now);
            }
        }
    }

    fn step(&mut self) {
        let outcome = self.pick();
        self.settle(black_box(outcome));
    }
}

/// Picks before the timed ones. Measuring, the ledger's dispatch history is first filled to its
/// cap ([`MAX_LEDGER_DISPATCHES`]): until then each dispatch remembered takes memory the process
/// never touched (a page fault every ~85 picks, +3–5 µs each, which set the p99 of earlier
/// runs), while a router that has served that many requests reuses it. Under `cargo test`, a
/// few.
fn warm_up(picks: usize) -> usize {
    let measuring = std::env::args().any(|a| a == "--bench");
    std::env::var("PICKER_WARMUP")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if measuring {
            MAX_LEDGER_DISPATCHES + 1_000
        } else {
            1_000.min(picks)
        })
}

fn percentiles(fleet: &Fleet, view: &str, load: &dyn LoadView, picks: usize) {
    let mut driver = Driver::new(fleet, load);
    for _ in 0..warm_up(picks) {
        driver.step();
    }
    let mut nanos = Vec::with_capacity(picks);
    for _ in 0..picks {
        let start = Instant::now();
        let outcome = driver.pick();
        let elapsed = start.elapsed();
        driver.settle(black_box(outcome));
        nanos.push(elapsed.as_nanos() as u64);
    }
    nanos.sort_unstable();
    let at = |q: f64| nanos[((nanos.len() - 1) as f64 * q) as usize];
    println!(
        "pick/{}/{view}: n={} p50={:.2}µs p99={:.2}µs max={:.2}µs (ledger {} dispatches)",
        fleet.name,
        nanos.len(),
        at(0.50) as f64 / 1e3,
        at(0.99) as f64 / 1e3,
        at(1.0) as f64 / 1e3,
        driver.state.ledger.len(),
    );
}

/// The floor the `LoadView` API sets: one dynamic `sample` call per candidate and nothing else.
fn view_floor(fleet: &Fleet, view: &str, load: &dyn LoadView, rounds: usize) {
    // Opaque to the optimiser, so the calls stay dynamic as in the picker.
    let load: &dyn LoadView = black_box(load);
    let mut nanos = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let start = Instant::now();
        let mut sum = 0u64;
        for c in black_box(&fleet.candidates) {
            if let SampleState::Fresh {
                kv_used_blocks: Some(v),
                ..
            } = load.sample(&c.worker, c.rank())
            {
                sum = sum.wrapping_add(v);
            }
        }
        black_box(sum);
        nanos.push(start.elapsed().as_nanos() as u64);
    }
    nanos.sort_unstable();
    println!(
        "view_floor/{}/{view}: p50={:.2}µs ({} sample calls)",
        fleet.name,
        nanos[nanos.len() / 2] as f64 / 1e3,
        fleet.candidates.len(),
    );
}

/// Overlaps at block size 16 for one rank in eight (1–40 blocks), sorted by (worker, rank) as
/// `KvIndex::find_matches` lists them.
fn overlaps_for(fleet: &Fleet) -> Vec<BlockOverlaps> {
    let mut ranks: Vec<RankOverlap> = fleet
        .candidates
        .iter()
        .enumerate()
        .filter(|(i, _)| i % 8 == 0)
        .map(|(i, c)| RankOverlap {
            worker: c.worker.instance_id,
            dp_rank: c.rank(),
            blocks: (i % 40) as u32 + 1,
        })
        .collect();
    ranks.sort();
    vec![BlockOverlaps {
        block_size: BlockSize::new(16).expect("valid"),
        ranks,
    }]
}

/// The production read path: a `LoadStore` holding a fresh sample per rank, read through
/// `StoreView` (samples mirrored per layout row) with the layout built once. Run at 10 / 100 /
/// 1,000 / 10,000 decode ranks for the scaling curve, with the `LoadBasedPicker` (`kv` false)
/// and the `KvAwarePicker` (an aggregated-style formula pass over every rank with one rank in
/// eight holding part of the prompt). `idle`: every rank reports no backlog (a quiet fleet:
/// the ranks without a pending dispatch all tie, and the cursor rotates among them).
fn store_percentiles(ranks: u64, picks: usize, kv: bool, idle: bool) {
    use continuum_protocol::event_plane::ActiveLoad;
    use continuum_protocol::ids::PublisherId;
    use continuum_protocol::load_store::{LoadSample, LoadStore};
    use continuum_protocol::picker::candidates::StoreView;
    use continuum_protocol::time::UnixMillis;

    let workers = ranks / 2;
    let fleet = fleet("store", workers, 0);
    let mut store = LoadStore::new();
    store.set_live_and_retain((0..workers).map(|w| InstanceId(FIRST_ID + w)));
    for c in &fleet.candidates {
        let w = c.worker.instance_id.0 - FIRST_ID;
        let SampleState::Fresh {
            active_decode_blocks,
            active_prefill_tokens,
            kv_used_blocks,
        } = sample_for(w, c.rank().0)
        else {
            continue;
        };
        let (active_decode_blocks, active_prefill_tokens, kv_used_blocks) = if idle {
            (Some(0), Some(0), Some(0))
        } else {
            (active_decode_blocks, active_prefill_tokens, kv_used_blocks)
        };
        store.apply(LoadSample {
            load: ActiveLoad {
                worker_id: c.worker.instance_id,
                dp_rank: c.rank(),
                active_decode_blocks,
                active_prefill_tokens,
                kv_used_blocks,
            },
            publisher_id: PublisherId(c.worker.instance_id.0),
            sequence: 1,
            published_at: UnixMillis(0),
            received_at: Tick::ZERO,
        });
    }
    let view = StoreView {
        store: &store,
        now: Tick::ZERO,
        max_age: Duration::from_secs(3),
    };
    let mut driver = Driver::new(&fleet, &view);
    if kv {
        driver.kv = Some(overlaps_for(&fleet));
    }
    let tie = tie_window();
    let peers = peer_slots();
    driver.state.tie.set(TieBreak {
        window: tie,
        seed: TieBreak::seed_of("bench-replica"),
        peer_slots: peers > 1,
    });
    if peers > 1 {
        // Replica 2 of `peers` (not the first, so the slot is not simply the lowest).
        driver.state.ledger.set_place(Place::new(1, peers));
    }
    for _ in 0..warm_up(picks) {
        driver.step();
    }
    let mut nanos = Vec::with_capacity(picks);
    for _ in 0..picks {
        let start = Instant::now();
        let outcome = driver.pick();
        let elapsed = start.elapsed();
        driver.settle(black_box(outcome));
        nanos.push(elapsed.as_nanos() as u64);
    }
    nanos.sort_unstable();
    let at = |q: f64| nanos[((nanos.len() - 1) as f64 * q) as usize];
    let picker = match (kv, idle) {
        (true, _) => "kv_aware",
        (false, false) => "store_slots",
        (false, true) => "store_slots_idle",
    };
    let picker = match (tie > 0.0, peers > 1) {
        (true, true) => format!("{picker}+tie_break_{tie}+peer_slots_{peers}"),
        (true, false) => format!("{picker}+tie_break_{tie}"),
        _ => picker.to_owned(),
    };
    println!(
        "scaling/decode_{ranks}_ranks/{picker}: n={} p50={:.2}µs p99={:.2}µs max={:.2}µs ns_per_rank_p50={:.2} (slot resolutions {})",
        nanos.len(),
        at(0.50) as f64 / 1e3,
        at(0.99) as f64 / 1e3,
        at(1.0) as f64 / 1e3,
        at(0.50) as f64 / ranks as f64,
        driver.state.slots.resolutions(),
    );
}

/// `PICKER_PEER_SLOTS=n` (with `PICKER_TIE_WINDOW`): the tie-break takes replica 2 of `n`'s slot
/// (`dynamo.load.peer_slots` with `n` replicas known) and records its peers' slots (default 1:
/// alone, no slots).
fn peer_slots() -> usize {
    std::env::var("PICKER_PEER_SLOTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
}

/// `PICKER_TIE_WINDOW=w`: the store-slot passes pick with `dynamo.load.tie_break_window` w
/// (default 0: off, the fast paths).
fn tie_window() -> f64 {
    std::env::var("PICKER_TIE_WINDOW")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|w: &f64| w.is_finite() && *w >= 0.0)
        .unwrap_or(0.0)
}

fn main() {
    let fleets = [
        fleet("decode_1000_ranks", 500, 0),
        fleet("pair_500_500_ranks", 250, 250),
    ];
    let measuring = std::env::args().any(|a| a == "--bench");
    // PICKER_BENCH=percentiles skips criterion (for `perf stat` over the percentile pass alone).
    let criterion_too = std::env::var("PICKER_BENCH").map_or(true, |v| v != "percentiles");
    let mut criterion = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    for fleet in fleets.iter().filter(|_| criterion_too) {
        let map = map_load(fleet);
        let dense = dense_load(fleet);
        let views: [(&str, &dyn LoadView); 2] = [("hashmap_view", &map), ("dense_view", &dense)];
        for (view, load) in views {
            let mut driver = Driver::new(fleet, load);
            criterion.bench_function(&format!("pick/{}/{view}", fleet.name), |b| {
                b.iter(|| driver.step())
            });
        }
    }
    criterion.final_summary();
    // Under `cargo test` (no --bench) a short pass only checks the harness runs.
    let picks = std::env::var("PICKER_PICKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if measuring { 20_000 } else { 50 });
    let only = std::env::var("PICKER_ONLY").unwrap_or_default();
    if only == "decide" {
        e2e::run(picks);
        return;
    }
    if let Some(ranks) = only.strip_prefix("scaling_").and_then(|v| v.parse().ok()) {
        store_percentiles(ranks, picks, false, false);
        return;
    }
    if let Some(ranks) = only
        .strip_prefix("idle_scaling_")
        .and_then(|v| v.parse().ok())
    {
        store_percentiles(ranks, picks, false, true);
        return;
    }
    if let Some(ranks) = only
        .strip_prefix("kv_scaling_")
        .and_then(|v| v.parse().ok())
    {
        store_percentiles(ranks, picks, true, false);
        return;
    }
    // PICKER_VIEW=dense or =hashmap narrows the percentile pass to one view (for profiling).
    let view = std::env::var("PICKER_VIEW").unwrap_or_default();
    for fleet in &fleets {
        if view != "dense" {
            percentiles(fleet, "hashmap_view", &map_load(fleet), picks);
        }
        if view != "hashmap" {
            percentiles(fleet, "dense_view", &dense_load(fleet), picks);
        }
    }
    for kv in [false, true] {
        for ranks in [10, 100, 1_000, 10_000] {
            store_percentiles(ranks, picks, kv, false);
        }
    }
    store_percentiles(1_000, picks, false, true);
    let floor = &fleets[0];
    if view != "dense" {
        view_floor(floor, "hashmap_view", &map_load(floor), picks);
    }
    if view != "hashmap" {
        view_floor(floor, "dense_view", &dense_load(floor), picks);
    }
    // PICKER_E2E=0 skips the end-to-end pass.
    if std::env::var("PICKER_E2E").map_or(true, |v| v != "0") {
        e2e::run(picks);
    }
}

// ---- End to end: ShimRouter::decide over a published snapshot and the shared load store ---------

/// Everything `ShimRouter::decide` reads, built once: a registry snapshot of 500 decode workers ×
/// 2 dp ranks published by a real `RegistryActor`, a load store holding a fresh sample per rank,
/// and a router over a `SharedPicker` (no `PickerActor`: the request path maintains the index and
/// the ledger itself, as it does when it races ahead of the actor).
mod e2e {
    use std::collections::{HashMap, VecDeque};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use arc_swap::ArcSwap;
    use continuum_actors::clock::now_tick;
    use continuum_actors::load::SharedLoadStore;
    use continuum_actors::picker::{SharedPicker, answer_arrivals};
    use continuum_actors::registry::{
        RegistryActor, RegistryArgs, RegistryConfig, RegistryMsg, RegistryParts, RegistryReader,
    };
    use continuum_protocol::discovery::SourceEvent;
    use continuum_protocol::discovery::reducer::DiscoveryReducer;
    use continuum_protocol::discovery::snapshot::SourceKind;
    use continuum_protocol::event_plane::ActiveLoad;
    use continuum_protocol::ids::{DpRank, InstanceId, Namespace, PublisherId, WorkerKey};
    use continuum_protocol::load_store::{LoadSample, LoadStore, WorkerRank};
    use continuum_protocol::picker::candidates::{CandidateIndex, sample_state};
    use continuum_protocol::picker::{
        DynamoWorkerPicker, LoadBasedPicker, LoadView, PickContext, PickOutcome, PickRequest,
        PickerState, SampleState,
    };
    use continuum_protocol::time::UnixMillis;
    use continuum_router::config::{Config, ProcessEnv};
    use continuum_router::route::dynamo::ShimRouter;
    use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, call_t};

    use super::{FIRST_ID, MODEL, NAMESPACE, OUTSTANDING, black_box};

    const WORKERS: u64 = 500;

    fn records(id: u64) -> Vec<(String, Vec<u8>)> {
        let endpoint = serde_json::json!({"type": "Endpoint", "namespace": NAMESPACE,
            "component": "backend", "endpoint": "generate", "instance_id": id,
            "transport": {"tcp": "127.0.0.1:1/x"}});
        let card = serde_json::json!({"type": "Model", "namespace": NAMESPACE,
            "component": "backend", "endpoint": "generate", "instance_id": id,
            "card_json": {"display_name": MODEL, "worker_type": "decode",
            "kv_cache_block_size": 16, "runtime_config": {"total_kv_blocks": 16384,
            "max_num_batched_tokens": 8192, "data_parallel_start_rank": 0,
            "data_parallel_size": 2}}});
        vec![
            (
                format!("v1/instances/{NAMESPACE}/backend/generate/{id:x}"),
                serde_json::to_vec(&endpoint).expect("json"),
            ),
            (
                format!("v1/mdc/{NAMESPACE}/backend/generate/{id:x}"),
                serde_json::to_vec(&card).expect("json"),
            ),
        ]
    }

    fn sample(worker: u64, rank: u32, sequence: u64) -> LoadSample {
        let mix = (worker.wrapping_mul(2_654_435_761) ^ (u64::from(rank) * 40_503)) % 4096;
        LoadSample {
            load: ActiveLoad {
                worker_id: InstanceId(FIRST_ID + worker),
                dp_rank: DpRank(rank),
                active_decode_blocks: Some(mix),
                active_prefill_tokens: None,
                kv_used_blocks: Some(mix),
            },
            publisher_id: PublisherId(FIRST_ID + worker),
            sequence,
            published_at: UnixMillis(0),
            received_at: now_tick(),
        }
    }

    /// (Re)publishes a fresh sample for every rank (outside the timed region).
    fn refresh(load: &SharedLoadStore, sequence: u64) {
        load.with(|store| {
            for w in 0..WORKERS {
                for rank in 0..2 {
                    store.apply(sample(w, rank, sequence));
                }
            }
        });
    }

    async fn fixture() -> (
        ShimRouter,
        SharedLoadStore,
        RegistryReader,
        ActorRef<RegistryMsg>,
    ) {
        let yaml = format!(
            "server:\n  bind_address: \"127.0.0.1:0\"\n\
             disaggregated_serving:\n  enabled: true\n\
             backends:\n  - name: shim\n    type: openai\n    url: \"http://127.0.0.1:1\"\n    \
             models: [{MODEL}]\n    health_check:\n      enabled: false\n\
             dynamo:\n  enabled: true\n  discovery:\n    etcd:\n      endpoints: [\"http://127.0.0.1:1\"]\n      \
             namespace: {NAMESPACE}\n  shim:\n    backends: [shim]\n"
        );
        let config = Config::from_yaml_str(&yaml, &ProcessEnv).expect("bench config");
        let namespace = Namespace::new(NAMESPACE);
        let parts = RegistryParts::new(RegistryConfig {
            enabled: true,
            source: SourceKind::Etcd,
            namespaces: vec![namespace.clone()],
        });
        let registry = parts.reader.clone();
        let (registry_actor, _) = Actor::spawn(
            None,
            RegistryActor,
            RegistryArgs {
                writer: parts.writer,
                metrics: None,
            },
        )
        .await
        .expect("registry");
        let mut reducer = DiscoveryReducer::new(namespace);
        reducer.apply(SourceEvent::Init, UnixMillis(0));
        for w in 0..WORKERS {
            for (key, value) in records(FIRST_ID + w) {
                reducer.apply(SourceEvent::InitApply { key, value }, UnixMillis(0));
            }
        }
        reducer.apply(SourceEvent::InitDone, UnixMillis(0));
        parts.inbox.stage_view(reducer.view().clone());
        registry
            .subscribe()
            .wait_for(|g| *g >= 1)
            .await
            .expect("published");
        assert_eq!(registry.snapshot().workers().len() as u64, WORKERS);
        let load = SharedLoadStore::new(None);
        load.with(|store| {
            store.set_live_and_retain((0..WORKERS).map(|w| InstanceId(FIRST_ID + w)))
        });
        refresh(&load, 1);
        let router = ShimRouter::with_picker(
            Arc::new(ArcSwap::from_pointee(config)),
            registry.clone(),
            load.clone(),
            SharedPicker::new(),
            None,
        );
        (router, load, registry, registry_actor)
    }

    /// `ShimRouter::decide`'s load view, over any map of samples.
    struct View<'a, F: Fn(InstanceId, DpRank) -> Option<&'a LoadSample>> {
        latest: F,
        now: continuum_protocol::time::Tick,
    }

    impl<'a, F: Fn(InstanceId, DpRank) -> Option<&'a LoadSample>> LoadView for View<'a, F> {
        fn sample(&self, worker: &WorkerKey, rank: DpRank) -> SampleState {
            sample_state(
                (self.latest)(worker.instance_id, rank),
                self.now,
                Duration::from_secs(3),
            )
        }
    }

    /// The decision's critical section before and after this change, over the same fleet and
    /// the same sample feed: before, a std (SipHash) map of samples keyed by (worker, rank) and
    /// one `sample_arrived` per candidate rank; after, the id-hashed `LoadStore` and one pass over
    /// the workers holding dispatches. Both then expire and pick.
    fn sections(registry: &RegistryReader, picks: usize) {
        let index = CandidateIndex::build(&registry.snapshot());
        let candidates = index.for_model(MODEL);
        let namespaces = [Namespace::new(NAMESPACE)];
        let request = PickRequest {
            model: MODEL,
            eligible_namespaces: &namespaces,
            estimated_prompt_tokens: 1500,
            load_signals: true,
        };
        let mut store = LoadStore::new();
        store.set_live_and_retain((0..WORKERS).map(|w| InstanceId(FIRST_ID + w)));
        let mut legacy: HashMap<WorkerRank, LoadSample> = HashMap::new();
        let put = |store: &mut LoadStore, legacy: &mut HashMap<_, _>, s: LoadSample| {
            store.apply(s);
            legacy.insert(s.key(), s);
        };
        for w in 0..WORKERS {
            for rank in 0..2 {
                put(&mut store, &mut legacy, sample(w, rank, 1));
            }
        }
        let (mut old_state, mut new_state) = (PickerState::new(), PickerState::new());
        let (mut old_nanos, mut new_nanos) = (Vec::new(), Vec::new());
        let (mut old_unanswered, mut new_unanswered) = (VecDeque::new(), VecDeque::new());
        let mut sequence = 2;
        for i in 0..picks + 1000 {
            let now = now_tick();
            let start = Instant::now();
            for c in candidates {
                if let Some(s) = legacy.get(&WorkerRank::new(c.worker.instance_id, c.rank())) {
                    old_state.ledger.sample_arrived(&c.worker, s.received_at);
                }
            }
            old_state.ledger.expire(now);
            let view = View {
                latest: |w, r| legacy.get(&WorkerRank::new(w, r)),
                now,
            };
            let old = LoadBasedPicker.pick(&mut PickContext::new(
                &request,
                candidates,
                &view,
                &mut old_state,
                now,
            ));
            let old_elapsed = start.elapsed();

            let start = Instant::now();
            answer_arrivals(&mut new_state.ledger, &store);
            new_state.ledger.expire(now);
            let view = View {
                latest: |w, r| store.latest(w, r),
                now,
            };
            let new = LoadBasedPicker.pick(&mut PickContext::new(
                &request,
                candidates,
                &view,
                &mut new_state,
                now,
            ));
            let new_elapsed = start.elapsed();

            for (outcome, queue) in [(old, &mut old_unanswered), (new, &mut new_unanswered)] {
                if let PickOutcome::Picked(pick) = black_box(outcome) {
                    queue.push_back(pick.decode.worker.instance_id.0 - FIRST_ID);
                }
            }
            // Answer each dispatch OUTSTANDING picks later (the two queues see the same picks
            // as long as the two paths agree).
            for queue in [&mut old_unanswered, &mut new_unanswered] {
                if queue.len() > OUTSTANDING
                    && let Some(w) = queue.pop_front()
                {
                    put(&mut store, &mut legacy, sample(w, 0, sequence));
                    sequence += 1;
                }
            }
            if i >= 1000 {
                old_nanos.push(old_elapsed.as_nanos() as u64);
                new_nanos.push(new_elapsed.as_nanos() as u64);
            }
        }
        report(
            "section/decode_1000_ranks/before_siphash_per_candidate_arrivals",
            old_nanos,
        );
        report(
            "section/decode_1000_ranks/after_idhash_pending_arrivals",
            new_nanos,
        );
    }

    fn body(chars: usize) -> Vec<u8> {
        let words = "lorem ipsum dolor sit amet ".repeat(chars / 27 + 1);
        serde_json::to_vec(&serde_json::json!({"model": MODEL, "messages": [
            {"role": "user", "content": &words[..chars]}]}))
        .expect("json")
    }

    fn report(name: &str, mut nanos: Vec<u64>) {
        nanos.sort_unstable();
        let at = |q: f64| nanos[((nanos.len() - 1) as f64 * q) as usize];
        println!(
            "{name}: n={} p50={:.2}µs p99={:.2}µs max={:.2}µs",
            nanos.len(),
            at(0.50) as f64 / 1e3,
            at(0.99) as f64 / 1e3,
            at(1.0) as f64 / 1e3,
        );
    }

    /// A trivial actor: the floor a mailbox round trip sets, whatever the handler does.
    struct Echo;

    impl Actor for Echo {
        type Msg = RpcReplyPort<u64>;
        type State = ();
        type Arguments = ();

        async fn pre_start(
            &self,
            _myself: ActorRef<Self::Msg>,
            _args: (),
        ) -> Result<(), ActorProcessingErr> {
            Ok(())
        }

        async fn handle(
            &self,
            _myself: ActorRef<Self::Msg>,
            reply: Self::Msg,
            _state: &mut (),
        ) -> Result<(), ActorProcessingErr> {
            let _ = reply.send(1);
            Ok(())
        }
    }

    /// `ShimRouter::decide` percentiles (config load, eligibility, index check, prompt estimate,
    /// the load-store lock, arrivals, expiry, the pick and the ledger record), then the round trip
    /// of a ractor `call` for comparison.
    pub fn run(picks: usize) {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async move {
            let (router, load, registry, registry_actor) = fixture().await;
            sections(&registry, picks);
            // One sequence for every pass: a sample numbered below the store's last is a
            // duplicate, which answers nothing (the passes after the first once restarted it,
            // so their dispatches piled up unanswered).
            let mut sequence = 2;
            for (label, chars) in [("short_body", 64usize), ("6kB_body", 6000)] {
                let body = body(chars);
                // The proxy's one parse of the body (validation, pins, the prompt estimate).
                let bytes = bytes::Bytes::from(body.clone());
                let mut nanos = Vec::with_capacity(picks);
                for _ in 0..picks {
                    let start = Instant::now();
                    let parsed = continuum_router::proxy::body::parse(bytes.clone());
                    nanos.push(start.elapsed().as_nanos() as u64);
                    black_box(parsed).expect("valid");
                }
                report(&format!("proxy_parse/{label}"), nanos);
                let parsed = continuum_router::proxy::body::parse(bytes).expect("valid");
                let passes = [
                    "parsed",
                    "raw_body_estimate_parses",
                    "parsed_publishers_silent",
                ];
                for how in passes {
                    let (raw, silent) = (how == passes[1], how == passes[2]);
                    let mut nanos = Vec::with_capacity(picks);
                    let mut unanswered = std::collections::VecDeque::new();
                    for i in 0..picks + 1000 {
                        // Silent publishers: one fresh sample per rank at the start, then
                        // none, so every dispatch of the pass stays in the ledger.
                        if i % 2000 == 0 && (i == 0 || !silent) {
                            refresh(&load, sequence);
                            sequence += 1;
                        }
                        let start = Instant::now();
                        let decision = if raw {
                            router.decide(MODEL, &body, &[], |_| true)
                        } else {
                            router.decide_parsed(&parsed, &[], |_| true)
                        };
                        let elapsed = start.elapsed();
                        let decision = black_box(decision).expect("a pick");
                        // Answer the dispatch OUTSTANDING picks later with a fresh sample of the
                        // chosen worker, as a busy fleet's publishers would.
                        let decode: u64 = decision.dispatch.headers["x-dynamo-worker-instance-id"]
                            .to_str()
                            .ok()
                            .and_then(|v| v.parse().ok())
                            .expect("a decimal pin");
                        unanswered.push_back(decode);
                        if unanswered.len() > OUTSTANDING
                            && !silent
                            && let Some(worker) = unanswered.pop_front()
                        {
                            let w = worker - FIRST_ID;
                            load.with(|store| store.apply(sample(w, 0, sequence)));
                            sequence += 1;
                        }
                        if i >= 1000 {
                            nanos.push(elapsed.as_nanos() as u64);
                        }
                    }
                    report(&format!("decide/decode_1000_ranks/{label}/{how}"), nanos);
                }
            }
            let (echo, _) = Actor::spawn(None, Echo, ()).await.expect("echo");
            let mut nanos = Vec::with_capacity(picks);
            for _ in 0..picks {
                let start = Instant::now();
                let one: u64 = call_t!(echo, |port| port, 1_000).expect("echo answers");
                nanos.push(start.elapsed().as_nanos() as u64);
                black_box(one);
            }
            report("mailbox_round_trip/ractor_call", nanos);
            echo.stop(None);
            registry_actor.stop(None);
            black_box(Duration::ZERO);
        });
    }
}
