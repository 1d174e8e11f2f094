//! What sharing in-flight dispatches between router replicas (`replica_sync`) costs: the goals
//! are ≤ 1 µs per request on the request path and ≤ 1 Mbit/s per replica at 1,000 req/s.
//!
//! The request path itself does nothing for the sync (no channel, no counter): its cost is the
//! picker lock the sync task takes (one ledger sample per `publish_interval`, one merge per
//! peer message) and the extra backlogged rows a pick lays from peers' legs. Measured here, on
//! the 1,000-rank decode fleet of `benches/picker.rs (root package)`'s shape with `OUTSTANDING` legs of this
//! replica's own unanswered:
//!
//! - `sample`: `DispatchLedger::local_contributions` (what one publish tick holds the lock for);
//! - `encode` / `decode`: a snapshot's MessagePack bytes, and its size;
//! - `merge`: `PeerTable::offer` of a changed peer snapshot (the lock held per peer message);
//! - `pick`: a `LoadBasedPicker` pick with and without two peers' legs in the ledger;
//! - the amortised cost per request at 1,000 req/s with `publish_interval` 10 and 20 ms, 3 peers
//!   publishing at every tick (the worst case: every tick changes), and the bytes per second one
//!   replica publishes then.
//!
//! `REPLICA_BENCH_OUTSTANDING=n` sets the legs held (default 100: 1,000 req/s answered within
//! 100 ms). Plain timed loops (median of 2,001 runs each), no criterion.

use std::hint::black_box;
use std::time::{Duration, Instant};

use continuum_protocol::ids::{DpRank, InstanceId, Namespace, WorkerKey};
use continuum_protocol::picker::{
    Candidate, CandidateRole, DenseRanks, DispatchLeg, DynamoWorkerPicker, LoadBasedPicker,
    LoadView, PickContext, PickRequest, PickerState, SampleState,
};
use continuum_protocol::replica_sync::{Header, PeerLimits, PeerTable, Snapshot};
use continuum_protocol::time::Tick;

const MODEL: &str = "Qwen/Qwen3-32B";
const NAMESPACE: &str = "prod";
const FIRST_ID: u64 = 0x694d_7b2c_9a4e_0000;
const RANKS: u64 = 1_000;
const RUNS: usize = 2_001;

fn candidates() -> Vec<Candidate> {
    let model: std::sync::Arc<str> = MODEL.into();
    (0..RANKS / 2)
        .flat_map(|w| {
            let model = model.clone();
            (0..2).map(move |rank| Candidate {
                worker: key(w),
                role: CandidateRole::Decode,
                model: model.clone(),
                dp_rank: Some(DpRank(rank)),
                rank_declared: true,
                block_size: Some(16),
                total_kv_blocks: Some(16_384),
                max_num_batched_tokens: Some(8192),
            })
        })
        .collect()
}

fn key(w: u64) -> WorkerKey {
    WorkerKey {
        namespace: Namespace::new(NAMESPACE),
        instance_id: InstanceId(FIRST_ID + w),
    }
}

struct Load;

impl LoadView for Load {
    fn sample(&self, worker: &WorkerKey, rank: DpRank) -> SampleState {
        let mix = (worker.instance_id.0.wrapping_mul(2_654_435_761) ^ u64::from(rank.0)) % 4096;
        SampleState::Fresh {
            active_decode_blocks: Some(mix),
            active_prefill_tokens: Some(mix * 2),
            kv_used_blocks: Some(mix),
        }
    }
}

fn leg(i: u64) -> DispatchLeg {
    // Spread over the fleet as load-based picks spread requests.
    let w = i.wrapping_mul(7919) % (RANKS / 2);
    DispatchLeg {
        worker: key(w),
        rank: DpRank((i % 2) as u32),
        prefill_tokens: 1500,
        decode_blocks: 94,
        request_blocks: 94,
        stall_exempt: false,
    }
}

#[expect(
    clippy::disallowed_methods,
    reason = "a bench times itself; the protocol code it measures reads no clock"
)]
fn median(mut f: impl FnMut()) -> Duration {
    let mut times: Vec<Duration> = (0..RUNS)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .collect();
    times.sort_unstable();
    times[RUNS / 2]
}

fn header(replica: &str, seq: u64) -> Header<'_> {
    Header {
        replica,
        epoch: 1,
        seq,
        content_seq: seq,
        ttl: Duration::from_secs(3),
        sent_unix_ms: 0,
    }
}

fn main() {
    let outstanding: u64 = std::env::var("REPLICA_BENCH_OUTSTANDING")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let now = Tick(Duration::from_secs(1));
    let mut state = PickerState::new();
    for i in 0..outstanding {
        state.ledger.record_dispatch(&[leg(i)], now);
    }
    let (local, _) = state.ledger.local_contributions(now, 4096);
    let sample = median(|| {
        black_box(state.ledger.local_contributions(now, 4096));
    });
    let snap = Snapshot::from_local(header("router-0", 1), &local);
    let bytes = snap.encode();
    let encode = median(|| {
        black_box(Snapshot::from_local(header("router-0", 1), &local).encode());
    });
    let decode = median(|| {
        black_box(Snapshot::decode(&bytes).ok());
    });

    // A changed snapshot from a peer, alternating two contents so every offer replaces.
    let limits = PeerLimits {
        max_peers: 64,
        max_entries_per_peer: 4096,
        ttl: Duration::from_secs(3),
    };
    let mut table = PeerTable::new("me", limits);
    let mut seq = 0;
    let merge = median(|| {
        seq += 1;
        let mut s = snap.clone();
        s.replica = "peer-1".into();
        s.seq = seq;
        s.content_seq = seq;
        black_box(table.offer(&s, now, &mut state.ledger));
    });
    let clone = median(|| {
        black_box(snap.clone());
    });
    let merge = merge.saturating_sub(clone);

    // Picks without, then with, two peers' legs.
    let fleet = candidates();
    let layout = DenseRanks::build(&fleet);
    let namespaces = vec![Namespace::new(NAMESPACE)];
    let pick_with = |state: &mut PickerState| {
        let req = PickRequest {
            model: MODEL,
            eligible_namespaces: &namespaces,
            estimated_prompt_tokens: 1500,
            load_signals: true,
        };
        let mut ctx = PickContext::new(&req, &fleet, &Load, state, now).with_layout(&layout);
        black_box(LoadBasedPicker.pick(&mut ctx));
    };
    let mut alone = PickerState::new();
    for i in 0..outstanding {
        alone.ledger.record_dispatch(&[leg(i)], now);
    }
    // The pick records its own dispatch: withdraw nothing, the ledger grows by RUNS legs alike.
    let pick_alone = median(|| pick_with(&mut alone));
    let mut shared = PickerState::new();
    for i in 0..outstanding {
        shared.ledger.record_dispatch(&[leg(i)], now);
    }
    let mut peers = PeerTable::new("me", limits);
    for p in 0..2 {
        let mut s = snap.clone();
        s.replica = format!("peer-{p}");
        peers.offer(&s, now, &mut shared.ledger);
    }
    let pick_shared = median(|| pick_with(&mut shared));

    let peers_n = 3.0;
    let req_per_s = 1_000.0;
    let at = |interval_ms: f64| {
        let ticks_per_s = 1_000.0 / interval_ms;
        let lock_ns = (ticks_per_s * sample.as_nanos() as f64
            + ticks_per_s * peers_n * merge.as_nanos() as f64)
            / req_per_s;
        let mbit = bytes.len() as f64 * ticks_per_s * 8.0 / 1e6;
        (lock_ns, mbit)
    };
    let pick_delta = pick_shared.as_nanos() as f64 - pick_alone.as_nanos() as f64;
    println!("replica_sync bench: {RANKS} decode ranks, {outstanding} own legs outstanding");
    println!("  entries (backlogged ranks)   {}", local.len());
    println!("  sample (lock held per tick)  {sample:?}");
    println!("  snapshot bytes               {}", bytes.len());
    println!("  encode                       {encode:?}");
    println!("  decode                       {decode:?}");
    println!("  merge (lock held per msg)    {merge:?}");
    println!(
        "  pick alone / with 2 peers    {pick_alone:?} / {pick_shared:?} (Δ {pick_delta:.0} ns)"
    );
    for interval in [10.0, 20.0] {
        let (lock_ns, mbit) = at(interval);
        println!(
            "  publish_interval {interval} ms at 1,000 req/s, every tick changed, 3 peers: sync lock time {lock_ns:.0} ns per request, {mbit:.3} Mbit/s published (payload)"
        );
    }
}
