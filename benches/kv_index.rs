//! KV index benchmark: replays the Mooncake conversation trace into `KvIndex` as the reference
//! workload in `benches/fixtures/mooncake/README.md` describes, and prints throughput, latency
//! percentiles, memory and agreement with a naive reference.
//!
//! Workload: all 12,031 requests in file order, one thread. Each `hash_id` is 32 blocks of 16
//! tokens (`n = min(32 × len(hash_ids), input_length / 16)`), `tokens_hash =
//! splitmix64(h × 32 + j)`, `block_hash` chained with Dynamo's sequence hash. 16 workers (dp_rank
//! 0), request r → worker r mod 16, each caching 16,384 blocks with exact LRU touched tail-first.
//! Per request: `find_matches` on the full sequence, one Stored event for the blocks the worker
//! lacked, one Removed event for what LRU evicted. Only time inside index calls is counted.
//!
//! `cargo bench --bench kv_index` runs the full trace (path from `KV_BENCH_TRACE`, plain or `.gz`;
//! default the in-repo `benches/fixtures/mooncake/conversation_trace.jsonl.gz`); without `--bench`
//! (as under `cargo test --benches`) it replays the first 300 requests as a smoke test.

#![allow(clippy::too_many_lines, reason = "test code is exempt")]

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

#[path = "support/mooncake.rs"]
mod mooncake;

use continuum_protocol::ids::{DpRank, InstanceId};
use continuum_protocol::kv::events::{
    KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData, ResidencyDomain,
    RouterEvent, StorageTier, StoredBlock,
};
use continuum_protocol::kv::{ExternalBlockHash, KvEventResult, KvIndex};
use mooncake::{Lru, TraceRequest, WORKERS};

const AGREEMENT_EVERY: usize = 97;

fn load(path: &str, limit: usize) -> Option<Vec<TraceRequest>> {
    let text = mooncake::read_trace(std::path::Path::new(path))?;
    text.lines().take(limit).map(mooncake::expand).collect()
}

fn event(worker: u64, id: u64, data: KvCacheEventData) -> RouterEvent {
    RouterEvent {
        worker_id: InstanceId(worker),
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

fn vm_hwm_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let path = std::env::var("KV_BENCH_TRACE").unwrap_or_else(|_| {
        format!(
            "{}/benches/fixtures/mooncake/{}",
            env!("CARGO_MANIFEST_DIR"),
            mooncake::CONVERSATION_TRACE
        )
    });
    let limit = if full { usize::MAX } else { 300 };
    let Some(requests) = load(&path, limit) else {
        println!("kv_index: trace {path} not readable; set KV_BENCH_TRACE. Skipped.");
        return;
    };
    let hwm_before = vm_hwm_kib();

    let mut index = KvIndex::new(0x5EED);
    index.set_live_and_retain(
        (0..WORKERS)
            .map(|w| (InstanceId(w), BTreeSet::from([DpRank(0)])))
            .collect(),
    );
    let mut lrus: Vec<Lru> = (0..WORKERS).map(|_| mooncake::lru()).collect();
    let mut next_id = vec![0u64; WORKERS as usize];
    let mut lookups = Vec::with_capacity(requests.len());
    let mut applies = Vec::with_capacity(requests.len() * 2);
    let (mut lookup_blocks, mut stored_blocks, mut removed_blocks) = (0u64, 0u64, 0u64);
    let mut not_applied = 0u64;
    let (mut checked, mut disagreements) = (0usize, 0usize);
    let mut peak_bytes = 0usize;
    let mut peak_nodes = 0usize;
    let mut overlap_blocks = 0u64;

    for (r, req) in requests.iter().enumerate() {
        let w = r as u64 % WORKERS;
        let t = Instant::now();
        let matches = index.find_matches(&req.local);
        lookups.push(t.elapsed());
        lookup_blocks += req.local.len() as u64;
        overlap_blocks += matches
            .iter()
            .map(|m| u64::from(m.blocks))
            .max()
            .unwrap_or(0);

        if r % AGREEMENT_EVERY == 0 {
            checked += 1;
            let expected: Vec<(u64, u32)> = lrus
                .iter()
                .enumerate()
                .map(|(i, lru)| (i as u64, lru.prefix(&req.seq) as u32))
                .filter(|(_, n)| *n > 0)
                .collect();
            let got: Vec<(u64, u32)> = matches.iter().map(|m| (m.worker.0, m.blocks)).collect();
            if expected != got {
                disagreements += 1;
            }
        }

        let lru = &mut lrus[w as usize];
        let k = lru.prefix(&req.seq);
        let mut batch = Vec::new();
        if k < req.seq.len() {
            let blocks: Vec<StoredBlock> = (k..req.seq.len())
                .map(|i| StoredBlock {
                    block_hash: ExternalBlockHash(req.seq[i]),
                    tokens_hash: req.local[i],
                    mm_extra_info: None,
                })
                .collect();
            stored_blocks += blocks.len() as u64;
            next_id[w as usize] += 1;
            batch.push(event(
                w,
                next_id[w as usize],
                KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: k.checked_sub(1).map(|p| ExternalBlockHash(req.seq[p])),
                    start_position: None,
                    blocks: blocks.into(),
                }),
            ));
        }
        for hash in req.seq.iter().rev() {
            lru.touch(*hash);
        }
        let evicted = lru.evict();
        if !evicted.is_empty() {
            removed_blocks += evicted.len() as u64;
            next_id[w as usize] += 1;
            batch.push(event(
                w,
                next_id[w as usize],
                KvCacheEventData::Removed(KvCacheRemoveData {
                    block_hashes: evicted
                        .into_iter()
                        .map(ExternalBlockHash)
                        .collect::<Vec<_>>()
                        .into(),
                }),
            ));
        }
        for e in &batch {
            let t = Instant::now();
            let result = index.apply(e);
            applies.push(t.elapsed());
            if result != KvEventResult::Applied {
                not_applied += 1;
            }
        }
        if r % 500 == 0 {
            let stats = index.stats();
            peak_bytes = peak_bytes.max(stats.approx_bytes);
            peak_nodes = peak_nodes.max(stats.nodes);
        }
    }
    let stats = index.stats();
    peak_bytes = peak_bytes.max(stats.approx_bytes);
    peak_nodes = peak_nodes.max(stats.nodes);
    let hwm_after = vm_hwm_kib();

    let lookup_time: Duration = lookups.iter().sum();
    let apply_time: Duration = applies.iter().sum();
    let total = (lookup_time + apply_time).as_secs_f64();
    lookups.sort_unstable();
    applies.sort_unstable();
    let ops = lookup_blocks + stored_blocks + removed_blocks;
    println!(
        "kv_index replay of {path} ({} requests, {WORKERS} workers)",
        requests.len()
    );
    println!(
        "  blocks: lookup {lookup_blocks}, stored {stored_blocks}, removed {removed_blocks}; events {}; not applied {not_applied}",
        applies.len()
    );
    println!(
        "  time inside index calls: {:.3} s (lookups {:.3} s, applies {:.3} s)",
        total,
        lookup_time.as_secs_f64(),
        apply_time.as_secs_f64()
    );
    println!(
        "  throughput: {:.2} M block-ops/s, {:.0} events+lookups/s",
        ops as f64 / total / 1e6,
        (lookups.len() + applies.len()) as f64 / total
    );
    println!(
        "  find_matches p50 {:?} p99 {:?} max {:?}",
        percentile(&lookups, 0.5),
        percentile(&lookups, 0.99),
        lookups.last().copied().unwrap_or_default()
    );
    println!(
        "  apply p50 {:?} p99 {:?} max {:?}",
        percentile(&applies, 0.5),
        percentile(&applies, 0.99),
        applies.last().copied().unwrap_or_default()
    );
    println!(
        "  index: final nodes {} ownerships {}; peak nodes {peak_nodes}, peak estimate {:.1} MiB",
        stats.nodes,
        stats.ownerships,
        peak_bytes as f64 / (1024.0 * 1024.0)
    );
    if let (Some(before), Some(after)) = (hwm_before, hwm_after) {
        println!(
            "  VmHWM {before} KiB before replay, {after} KiB after (+{} KiB, includes the driver's LRUs)",
            after.saturating_sub(before)
        );
    }
    println!(
        "  mean best overlap {:.1} blocks/request; agreement with LRU reference: {}/{} sampled lookups",
        overlap_blocks as f64 / requests.len().max(1) as f64,
        checked - disagreements,
        checked
    );
    assert_eq!(disagreements, 0, "index disagrees with the reference");
    assert_eq!(not_applied, 0, "every replayed event should apply");
}
