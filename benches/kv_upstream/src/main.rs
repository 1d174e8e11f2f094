//! Same-process comparison of continuum-protocol's bounded `KvIndex` with dynamo-kv-router
//! 1.6.1's `RadixTree` (the single-threaded backend of upstream's `KvIndexer`) on the Mooncake
//! reference workload of `benches/fixtures/mooncake/README.md`.
//!
//! The workload is generated once (16 workers, exact LRU of 16,384 blocks each, one Stored and
//! one Removed event per request, `find_matches` on every request's full sequence) into an op
//! list; then the same op list is replayed into each index, one after the other, timing only the
//! index calls (events are built before the clock starts; upstream's `find_matches` takes its
//! `Vec` by value, also built before). A counting global allocator reports each replay's peak
//! heap above the heap before it (the op list is already allocated then). Lookups are compared
//! between the two indexes on every 97th request. For ours it also counts the arena jumps
//! (`KvIndex::arena_jumps`, outside the clock) of every lookup matching at least 1,000 blocks.
//!
//! Last, the read path: the same lookups through a `RwLock` read guard (what
//! `SharedKvIndex::overlaps` does) and through an actor-style call (a task owning the index,
//! reached by an unbounded mpsc with a oneshot reply, which is what a ractor `call` is), each
//! timed from another task on a 2-thread tokio runtime.
//!
//! Run: `cargo run --release --manifest-path benches/kv_upstream/Cargo.toml [-- TRACE [LIMIT]]`.
//! `KV_WORKERS=N` replays the trace over N workers instead of 16 (request r → worker r mod N,
//! each with its own 16,384-block LRU): the scaling curve of docs/performance.md uses 16, 64
//! and 256.

#[path = "../../support/mooncake.rs"]
mod mooncake;

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use continuum_protocol::ids::{DpRank, InstanceId};
use continuum_protocol::kv::events as ours_ev;
use continuum_protocol::kv::{ExternalBlockHash, KvEventResult, KvIndex, LocalBlockHash};
use dynamo_kv_router::RadixTree;
use dynamo_kv_router::protocols as up;
use mooncake::{Lru, TraceRequest, WORKERS};

// ----- counting allocator ---------------------------------------------------------------------

struct Counting;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// A global allocator is the only way to count every byte both crates allocate; it forwards to
// the system allocator unchanged.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = CURRENT.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                let now = CURRENT.fetch_add(new_size - layout.size(), Ordering::Relaxed)
                    + (new_size - layout.size());
                PEAK.fetch_max(now, Ordering::Relaxed);
            } else {
                CURRENT.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn reset_peak() -> usize {
    let now = CURRENT.load(Ordering::Relaxed);
    PEAK.store(now, Ordering::Relaxed);
    now
}

// ----- workload -------------------------------------------------------------------------------

const COMPARE_EVERY: usize = 97;

enum Op {
    Lookup(usize),
    Store {
        worker: u64,
        id: u64,
        parent: Option<u64>,
        blocks: Vec<(u64, u64)>,
    },
    Remove {
        worker: u64,
        id: u64,
        hashes: Vec<u64>,
    },
}

struct Workload {
    requests: Vec<Vec<u64>>,
    ops: Vec<Op>,
    lookup_blocks: u64,
    stored_blocks: u64,
    removed_blocks: u64,
}

fn load(path: &str, limit: usize, workers: u64) -> Option<Workload> {
    let text = mooncake::read_trace(std::path::Path::new(path))?;
    let mut requests = Vec::new();
    let mut ops = Vec::new();
    let mut lrus: Vec<Lru> = (0..workers).map(|_| mooncake::lru()).collect();
    let mut next_id = vec![0u64; workers as usize];
    let (mut lookup_blocks, mut stored_blocks, mut removed_blocks) = (0, 0, 0);
    for (r, line) in text.lines().take(limit).enumerate() {
        let TraceRequest { local, seq } = mooncake::expand(line)?;
        let n = local.len();
        lookup_blocks += n as u64;
        ops.push(Op::Lookup(r));
        let w = r as u64 % workers;
        let lru = &mut lrus[w as usize];
        let k = lru.prefix(&seq);
        if k < seq.len() {
            next_id[w as usize] += 1;
            stored_blocks += (seq.len() - k) as u64;
            ops.push(Op::Store {
                worker: w,
                id: next_id[w as usize],
                parent: k.checked_sub(1).map(|p| seq[p]),
                blocks: (k..seq.len()).map(|i| (seq[i], local[i].0)).collect(),
            });
        }
        for hash in seq.iter().rev() {
            lru.touch(*hash);
        }
        let evicted = lru.evict();
        if !evicted.is_empty() {
            next_id[w as usize] += 1;
            removed_blocks += evicted.len() as u64;
            ops.push(Op::Remove {
                worker: w,
                id: next_id[w as usize],
                hashes: evicted,
            });
        }
        requests.push(local.iter().map(|l| l.0).collect());
    }
    Some(Workload {
        requests,
        ops,
        lookup_blocks,
        stored_blocks,
        removed_blocks,
    })
}

// ----- the two indexes behind one interface ---------------------------------------------------

trait Index {
    const NAME: &'static str;
    type Event;
    type Query;
    fn event(op: &Op) -> Option<Self::Event>;
    fn query(hashes: &[u64]) -> Self::Query;
    fn apply(&mut self, event: Self::Event) -> bool;
    fn find(&self, query: Self::Query) -> Vec<(u64, u32)>;
    /// Arena jumps on the walk down these blocks (see `KvIndex::arena_jumps`); `None` where the
    /// index has no arena.
    fn jumps(&self, _hashes: &[u64]) -> Option<usize> {
        None
    }
}

struct Ours(KvIndex);

fn ours_event(worker: u64, id: u64, data: ours_ev::KvCacheEventData) -> ours_ev::RouterEvent {
    ours_ev::RouterEvent {
        worker_id: InstanceId(worker),
        storage_tier: ours_ev::StorageTier::Device,
        residency_domain: Some(ours_ev::ResidencyDomain::Worker),
        event: ours_ev::KvCacheEvent {
            event_id: id,
            data,
            dp_rank: DpRank(0),
        },
        session_id: None,
    }
}

impl Index for Ours {
    const NAME: &'static str = "continuum KvIndex (bounded)";
    type Event = ours_ev::RouterEvent;
    type Query = Vec<LocalBlockHash>;

    fn event(op: &Op) -> Option<Self::Event> {
        Some(match op {
            Op::Lookup(_) => return None,
            Op::Store {
                worker,
                id,
                parent,
                blocks,
            } => ours_event(
                *worker,
                *id,
                ours_ev::KvCacheEventData::Stored(ours_ev::KvCacheStoreData {
                    parent_hash: parent.map(ExternalBlockHash),
                    start_position: None,
                    blocks: blocks
                        .iter()
                        .map(|(b, t)| ours_ev::StoredBlock {
                            block_hash: ExternalBlockHash(*b),
                            tokens_hash: LocalBlockHash(*t),
                            mm_extra_info: None,
                        })
                        .collect::<Vec<_>>()
                        .into(),
                }),
            ),
            Op::Remove { worker, id, hashes } => ours_event(
                *worker,
                *id,
                ours_ev::KvCacheEventData::Removed(ours_ev::KvCacheRemoveData {
                    block_hashes: hashes
                        .iter()
                        .map(|h| ExternalBlockHash(*h))
                        .collect::<Vec<_>>()
                        .into(),
                }),
            ),
        })
    }

    fn query(hashes: &[u64]) -> Self::Query {
        hashes.iter().map(|h| LocalBlockHash(*h)).collect()
    }

    fn apply(&mut self, event: Self::Event) -> bool {
        self.0.apply(&event) == KvEventResult::Applied
    }

    fn find(&self, query: Self::Query) -> Vec<(u64, u32)> {
        self.0
            .find_matches(&query)
            .into_iter()
            .map(|m| (m.worker.0, m.blocks))
            .collect()
    }

    fn jumps(&self, hashes: &[u64]) -> Option<usize> {
        Some(self.0.arena_jumps(&Self::query(hashes)))
    }
}

struct Upstream(RadixTree);

fn up_event(worker: u64, id: u64, data: up::KvCacheEventData) -> up::RouterEvent {
    up::RouterEvent::new(
        worker,
        up::KvCacheEvent {
            event_id: id,
            data,
            dp_rank: 0,
        },
    )
}

impl Index for Upstream {
    const NAME: &'static str = "dynamo-kv-router 1.6.1 RadixTree";
    type Event = up::RouterEvent;
    type Query = Vec<up::LocalBlockHash>;

    fn event(op: &Op) -> Option<Self::Event> {
        Some(match op {
            Op::Lookup(_) => return None,
            Op::Store {
                worker,
                id,
                parent,
                blocks,
            } => up_event(
                *worker,
                *id,
                up::KvCacheEventData::Stored(up::KvCacheStoreData {
                    parent_hash: parent.map(up::ExternalSequenceBlockHash),
                    start_position: None,
                    blocks: blocks
                        .iter()
                        .map(|(b, t)| up::KvCacheStoredBlockData {
                            block_hash: up::ExternalSequenceBlockHash(*b),
                            tokens_hash: up::LocalBlockHash(*t),
                            mm_extra_info: None,
                        })
                        .collect(),
                }),
            ),
            Op::Remove { worker, id, hashes } => up_event(
                *worker,
                *id,
                up::KvCacheEventData::Removed(up::KvCacheRemoveData {
                    block_hashes: hashes
                        .iter()
                        .map(|h| up::ExternalSequenceBlockHash(*h))
                        .collect(),
                }),
            ),
        })
    }

    fn query(hashes: &[u64]) -> Self::Query {
        hashes.iter().map(|h| up::LocalBlockHash(*h)).collect()
    }

    fn apply(&mut self, event: Self::Event) -> bool {
        self.0.apply_event(event).is_ok()
    }

    fn find(&self, query: Self::Query) -> Vec<(u64, u32)> {
        let mut out: Vec<(u64, u32)> = self
            .0
            .find_matches(query, false)
            .scores
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .map(|(w, n)| (w.worker_id, n))
            .collect();
        out.sort_unstable();
        out
    }
}

// ----- replay ---------------------------------------------------------------------------------

struct Report {
    name: &'static str,
    lookups: Vec<Duration>,
    applies: Vec<Duration>,
    not_applied: u64,
    peak_heap: usize,
    sampled: Vec<Vec<(u64, u32)>>,
    /// Over the lookups matching at least [`LONG_MATCH`] blocks: (lookups, matched blocks,
    /// arena jumps), when the index reports jumps.
    long: Option<(usize, usize, usize)>,
    /// On-CPU time of the whole replay loop (index calls, and building each call's event or
    /// query outside the clock), where the kernel reports it (see [`on_cpu`]).
    on_cpu: Option<Duration>,
}

/// A lookup this long is a tail lookup (multi-turn conversations).
const LONG_MATCH: usize = 1_000;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn replay<I: Index>(mut index: I, w: &Workload) -> Report {
    let mut lookups = Vec::with_capacity(w.requests.len());
    let mut applies = Vec::with_capacity(w.ops.len());
    let mut sampled = Vec::new();
    let mut not_applied = 0;
    let mut long = None;
    let base = reset_peak();
    let cpu_start = on_cpu();
    for op in &w.ops {
        match op {
            Op::Lookup(r) => {
                let query = I::query(&w.requests[*r]);
                let t = Instant::now();
                let found = index.find(query);
                lookups.push(t.elapsed());
                let best = found.iter().map(|(_, n)| *n as usize).max().unwrap_or(0);
                if best >= LONG_MATCH
                    && let Some(j) = index.jumps(&w.requests[*r][..best])
                {
                    let (n, blocks, jumps) = long.get_or_insert((0, 0, 0));
                    *n += 1;
                    *blocks += best;
                    *jumps += j;
                }
                if r % COMPARE_EVERY == 0 {
                    sampled.push(found);
                }
            }
            op => {
                let Some(event) = I::event(op) else { continue };
                let t = Instant::now();
                let ok = index.apply(event);
                applies.push(t.elapsed());
                if !ok {
                    not_applied += 1;
                }
            }
        }
    }
    let cpu = on_cpu().zip(cpu_start).map(|(end, start)| end.saturating_sub(start));
    let peak_heap = PEAK.load(Ordering::Relaxed).saturating_sub(base);
    drop(index);
    lookups.sort_unstable();
    applies.sort_unstable();
    Report {
        name: I::NAME,
        lookups,
        applies,
        not_applied,
        peak_heap,
        sampled,
        long,
        on_cpu: cpu,
    }
}

/// Time this thread has spent on a CPU so far (Linux `/proc/thread-self/schedstat`), if the
/// kernel reports it: unlike the wall clock it leaves out the time the thread waited while
/// other processes ran, which on a shared machine is most of the wall clock's noise.
fn on_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns = stat.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(ns))
}

fn print(r: &Report, w: &Workload) -> f64 {
    let lookup: Duration = r.lookups.iter().sum();
    let apply: Duration = r.applies.iter().sum();
    let total = (lookup + apply).as_secs_f64();
    let ops = w.lookup_blocks + w.stored_blocks + w.removed_blocks;
    let per_sec = (r.lookups.len() + r.applies.len()) as f64 / total;
    println!("{}", r.name);
    println!(
        "  time in index calls {:.3} s (lookups {:.3} s, applies {:.3} s)",
        total,
        lookup.as_secs_f64(),
        apply.as_secs_f64()
    );
    println!(
        "  {:.0} events+lookups/s, {:.2} M block-ops/s",
        per_sec,
        ops as f64 / total / 1e6
    );
    println!(
        "  find_matches p50 {:?} p99 {:?}; apply p50 {:?} p99 {:?}",
        percentile(&r.lookups, 0.5),
        percentile(&r.lookups, 0.99),
        percentile(&r.applies, 0.5),
        percentile(&r.applies, 0.99)
    );
    println!(
        "  peak heap above the driver's: {:.1} MiB; events not applied: {}",
        r.peak_heap as f64 / (1024.0 * 1024.0),
        r.not_applied
    );
    if let Some(cpu) = r.on_cpu {
        println!(
            "  replay loop on-CPU {:.3} s (index calls plus building their inputs; excludes time preempted)",
            cpu.as_secs_f64()
        );
    }
    if let Some((n, blocks, jumps)) = r.long {
        println!(
            "  lookups matching >= {LONG_MATCH} blocks: {n}, {:.1} arena jumps each (one per {:.0} blocks)",
            jumps as f64 / n.max(1) as f64,
            blocks as f64 / jumps.max(1) as f64
        );
    }
    per_sec
}

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args.next().unwrap_or_else(|| {
        format!(
            "{}/../fixtures/mooncake/{}",
            env!("CARGO_MANIFEST_DIR"),
            mooncake::CONVERSATION_TRACE
        )
    });
    let limit = args
        .next()
        .and_then(|l| l.parse().ok())
        .unwrap_or(usize::MAX);
    let workers = std::env::var("KV_WORKERS")
        .ok()
        .and_then(|w| w.parse().ok())
        .filter(|w| *w > 0)
        .unwrap_or(WORKERS);
    let Some(workload) = load(&path, limit, workers) else {
        eprintln!("kv_upstream: trace {path} not readable");
        std::process::exit(2);
    };
    println!(
        "Mooncake replay of {path}: {} requests, {workers} workers, {} ops; blocks: lookup {}, stored {}, removed {}",
        workload.requests.len(),
        workload.ops.len(),
        workload.lookup_blocks,
        workload.stored_blocks,
        workload.removed_blocks
    );
    let mut ours = KvIndex::new(0x5EED);
    ours.set_live_and_retain(
        (0..workers)
            .map(|w| (InstanceId(w), BTreeSet::from([DpRank(0)])))
            .collect(),
    );
    // Upstream first, then ours, then upstream again: the second upstream run is the one
    // compared, so neither side benefits from a cold or warm allocator alone.
    if std::env::var_os("KV_ONLY_OURS").is_some() {
        // For profiling our index alone.
        let a = replay(Ours(ours), &workload);
        print(&a, &workload);
        return;
    }
    let _warm = replay(Upstream(RadixTree::new()), &workload);
    let a = replay(Ours(ours), &workload);
    let b = replay(Upstream(RadixTree::new()), &workload);
    let ours_rate = print(&a, &workload);
    let up_rate = print(&b, &workload);
    let p50 = |r: &Report| percentile(&r.lookups, 0.5).as_secs_f64();
    let p99 = |r: &Report| percentile(&r.lookups, 0.99).as_secs_f64();
    println!(
        "ours/upstream: throughput {:.2}x, find_matches p50 {:.2}x faster, p99 {:.2}x faster, peak heap {:.2}x",
        ours_rate / up_rate,
        p50(&b) / p50(&a),
        p99(&b) / p99(&a),
        a.peak_heap as f64 / b.peak_heap.max(1) as f64
    );
    let agree = a
        .sampled
        .iter()
        .zip(&b.sampled)
        .filter(|(x, y)| x == y)
        .count();
    println!("agreement on sampled lookups: {agree}/{}", a.sampled.len());
    read_path(&workload, workers);
    if agree != a.sampled.len() {
        std::process::exit(1);
    }
}

type Query = (Vec<LocalBlockHash>, tokio::sync::oneshot::Sender<usize>);

/// Lookups through a read guard versus through an actor-style call, on the replayed index.
fn read_path(w: &Workload, workers: u64) {
    let mut index = KvIndex::new(0x5EED);
    index.set_live_and_retain(
        (0..workers)
            .map(|w| (InstanceId(w), BTreeSet::from([DpRank(0)])))
            .collect(),
    );
    for op in &w.ops {
        if let Some(event) = Ours::event(op) {
            index.apply(&event);
        }
    }
    let queries: Vec<Vec<LocalBlockHash>> = w
        .requests
        .iter()
        .step_by(3)
        .map(|r| Ours::query(r))
        .collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .expect("runtime");
    let shared = std::sync::Arc::new(std::sync::RwLock::new(index));
    let (guard, call) = runtime.block_on(async move {
        let reader = shared.clone();
        let qs = queries.clone();
        let guard = tokio::spawn(async move {
            let mut times = Vec::with_capacity(qs.len());
            for q in &qs {
                let t = Instant::now();
                let n = reader.read().expect("lock").find_matches(q).len();
                times.push(t.elapsed());
                std::hint::black_box(n);
            }
            times
        })
        .await
        .expect("reader");
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Query>();
        let owner = shared.clone();
        tokio::spawn(async move {
            while let Some((q, reply)) = rx.recv().await {
                let n = owner.read().expect("lock").find_matches(&q).len();
                let _ = reply.send(n);
            }
        });
        let call = tokio::spawn(async move {
            let mut times = Vec::with_capacity(queries.len());
            for q in queries {
                let t = Instant::now();
                let (reply, answer) = tokio::sync::oneshot::channel();
                let _ = tx.send((q, reply));
                std::hint::black_box(answer.await.expect("answer"));
                times.push(t.elapsed());
            }
            times
        })
        .await
        .expect("caller");
        (guard, call)
    });
    let mut guard = guard;
    let mut call = call;
    guard.sort_unstable();
    call.sort_unstable();
    println!(
        "read path on the replayed index ({} lookups): read guard p50 {:?} p99 {:?}; actor-style call p50 {:?} p99 {:?}",
        guard.len(),
        percentile(&guard, 0.5),
        percentile(&guard, 0.99),
        percentile(&call, 0.5),
        percentile(&call, 0.99)
    );
}
