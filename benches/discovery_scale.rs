//! Discovery at scale (issue #16 item 5), against a real etcd: 16,384 workers' records (an
//! Endpoint instance and a model card of about a captured 1.6.1 card's size per worker, 32,768
//! keys) are written first; then
//!
//! 1. **full resync**: the daemon starts and reads them all; timed from `Daemon::start` until the
//!    registry publishes a snapshot holding all 16,384 workers (and their cards: each worker
//!    serves the model). Three daemon starts, each a full resync.
//! 2. **put → snapshot with 16,384 present**: an existing worker's model card is put again with a
//!    new `total_kv_blocks`, timed until the published snapshot shows the new capacity, PUTS times
//!    in sequence (16,384 is `MAX_RECORDS_PER_KEYSPACE`: a full fleet takes no new worker, so the
//!    puts update workers, as a card refresh or a restart with new settings does).
//!
//! Every worker publishes the same card (as the workers of one deployment do; the record around
//! it names the instance), so the router shares one card among them; `DISTINCT_CARDS=1` gives
//! every worker its own `total_kv_blocks`, so no two cards are alike and none is shared.
//!
//! `cargo bench --features real-peers --bench discovery_scale [-- WORKERS PUTS]` (defaults 16384,
//! 500; needs `etcd` on PATH or `ETCD_BIN`). A measurement script (`harness = false`): it prints
//! percentiles, asserts nothing about time. The goals: resync ≤ 200 ms, put → snapshot p99 ≤ 20 ms.

#![allow(clippy::too_many_lines, reason = "test code is exempt")]

#[path = "../tests/it/support/etcd.rs"]
mod etcd_harness;

use std::time::{Duration, Instant};

use continuum_router::config::{Config, ProcessEnv};
use continuum_router::daemon::{Daemon, RunOptions};
use etcd_harness::EtcdServer;
use futures::future::join_all;

/// The daemon as shipped: the binary allocates through mimalloc (the default `mimalloc`
/// feature), so the daemon measured here does too.
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const NAMESPACE: &str = "scale";
const MODEL: &str = "scale/model";

fn main() {
    let mut args = std::env::args().skip(1).filter(|a| !a.starts_with("--"));
    let workers: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(16_384);
    let puts: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(500);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(run(workers, puts));
}

fn report(name: &str, mut samples: Vec<Duration>) {
    if samples.len() <= 5 {
        // A handful: each in the order taken (a cold first start shows as such).
        println!("{name}: each {samples:?}");
    }
    samples.sort();
    let at = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize];
    println!(
        "{name}: n={} p50={:?} p90={:?} p99={:?} max={:?}",
        samples.len(),
        at(0.50),
        at(0.90),
        at(0.99),
        at(1.0)
    );
}

fn instance(id: u64) -> (String, String) {
    (
        format!("v1/instances/{NAMESPACE}/backend/generate/{id:x}"),
        format!(
            r#"{{"type":"Endpoint","namespace":"{NAMESPACE}","component":"backend","endpoint":"generate","instance_id":{id},"transport":{{"tcp":"10.0.{}.{}:9000/generate"}}}}"#,
            (id >> 8) & 0xff,
            id & 0xff
        ),
    )
}

/// A model card shaped like a captured Dynamo 1.6.1 card (about 1.7 kB with the artifact slots).
fn card(id: u64, total_kv_blocks: u64) -> (String, String) {
    let checked = |name: &str| {
        format!(
            r#"{{"path":"/models/scale/{name}","checksum":"blake3:{}","size":246992}}"#,
            "ab".repeat(32)
        )
    };
    (
        format!("v1/mdc/{NAMESPACE}/backend/generate/{id:x}"),
        format!(
            r#"{{"type":"Model","namespace":"{NAMESPACE}","component":"backend","endpoint":"generate","instance_id":{id},"card_json":{{"display_name":"{MODEL}","slug":"scale-model","model_info":{{"hf_config_json":{}}},"tokenizer":{{"hf_tokenizer_json":{}}},"prompt_formatter":{{"hf_tokenizer_config_json":{}}},"gen_config":{{"hf_generation_config_json":{}}},"architectural_max_context_length":4096,"context_length":0,"kv_cache_block_size":16,"migration_limit":0,"model_type":"Chat | Completions","model_input":"Tokens","worker_type":"decode","needs":[],"runtime_config":{{"context_length":0,"total_kv_blocks":{total_kv_blocks},"max_num_seqs":256,"max_num_batched_tokens":8192,"data_parallel_start_rank":0,"data_parallel_size":1,"enable_local_indexer":true,"kv_event_publishing_enabled":true,"enable_eagle":false}},"media_decoder":null,"media_fetcher":null}}}}"#,
            checked("config.json"),
            checked("tokenizer.json"),
            checked("tokenizer_config.json"),
            checked("generation_config.json"),
        ),
    )
}

async fn start_daemon(endpoint: &str) -> Daemon {
    let yaml = format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\ndynamo:\n  enabled: true\n  discovery:\n    \
         etcd:\n      endpoints: [\"{endpoint}\"]\n      namespace: \"{NAMESPACE}\"\n"
    );
    let config = Config::from_yaml_str(&yaml, &ProcessEnv).expect("config");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    Daemon::start(
        RunOptions {
            config,
            config_path: None,
            demo: false,
        },
        listener,
    )
    .await
    .expect("daemon")
}

/// Waits (at most a minute) until the published snapshot satisfies `done`.
async fn until(daemon: &Daemon, done: impl Fn(&Daemon) -> bool) {
    let mut generations = daemon.registry().subscribe();
    while !done(daemon) {
        tokio::time::timeout(Duration::from_secs(60), generations.changed())
            .await
            .expect("a generation within a minute")
            .expect("registry alive");
    }
}

fn workers_serving(daemon: &Daemon) -> usize {
    let snapshot = daemon.registry().snapshot();
    snapshot
        .workers()
        .iter()
        .filter(|w| w.model.as_deref() == Some(MODEL))
        .count()
}

async fn run(workers: u64, puts: u64) {
    let server = EtcdServer::start().await;
    let admin = server.client().await;
    let started = Instant::now();
    let distinct = std::env::var_os("DISTINCT_CARDS").is_some_and(|v| v == "1");
    let records: Vec<(String, String)> = (0..workers)
        .flat_map(|id| {
            let blocks = if distinct { 1_000_000 + id } else { 16_384 };
            [instance(0x10_0000 + id), card(0x10_0000 + id, blocks)]
        })
        .collect();
    let bytes: usize = records.iter().map(|(k, v)| k.len() + v.len()).sum();
    for chunk in records.chunks(256) {
        join_all(chunk.iter().map(|(key, value)| {
            let mut client = admin.clone();
            async move {
                client
                    .put(key.as_str(), value.as_str(), None)
                    .await
                    .expect("put")
            }
        }))
        .await;
    }
    println!(
        "wrote {} records ({:.1} MB) for {workers} workers in {:?}",
        records.len(),
        bytes as f64 / 1e6,
        started.elapsed()
    );

    // 0. The floor: etcd alone serving the same keys in pages, what any resync pays before the
    //    router does anything; 2,048 keys is the source's page size, the others say what
    //    another page size would buy, and serializable pages after the first (at the first
    //    page's revision) what skipping etcd's read-index round trip would.
    for (page_size, serializable) in [(512i64, false), (2048, false), (2048, true), (8192, false)] {
        let mut floor = Vec::new();
        for _ in 0..3 {
            let start = Instant::now();
            let mut kv = admin
                .kv_client()
                .max_decoding_message_size(64 * 1024 * 1024);
            let mut revision = None;
            for prefix in ["v1/instances/", "v1/mdc/"] {
                let end = format!("{}0", &prefix[..prefix.len() - 1]);
                let mut from = prefix.to_owned();
                loop {
                    let mut options = etcd_client::GetOptions::new()
                        .with_range(end.as_str())
                        .with_limit(page_size);
                    if let Some(at) = revision {
                        options = options.with_revision(at);
                        if serializable {
                            options = options.with_serializable();
                        }
                    }
                    let page = kv.get(from.as_str(), Some(options)).await.expect("range");
                    revision = revision.or(page.header().map(|h| h.revision()));
                    let Some(last) = page.kvs().last() else { break };
                    from = format!("{}\0", last.key_str().expect("utf-8 key"));
                    if !page.more() {
                        break;
                    }
                }
            }
            floor.push(start.elapsed());
        }
        report(
            &format!(
                "etcd alone: paged range read of the {} records, {page_size}-key pages{}",
                records.len(),
                if serializable {
                    ", serializable after the first"
                } else {
                    ""
                }
            ),
            floor,
        );
    }

    // 1. Full resync into a published snapshot, three daemon starts.
    let expected = workers as usize;
    let mut resync = Vec::new();
    for _ in 0..3 {
        let start = Instant::now();
        let daemon = start_daemon(&server.endpoint()).await;
        until(&daemon, |d| workers_serving(d) == expected).await;
        resync.push(start.elapsed());
        daemon.shutdown().await;
    }
    report(
        &format!(
            "full resync of {workers} workers ({} records) -> published snapshot",
            records.len()
        ),
        resync,
    );

    // 2. put -> published snapshot with every worker present.
    let daemon = start_daemon(&server.endpoint()).await;
    until(&daemon, |d| workers_serving(d) == expected).await;
    let mut admin = admin;
    let mut put_to_snapshot = Vec::with_capacity(puts as usize);
    // The same interval split at etcd's acknowledgement: etcd's own commit (an fsync per put)
    // and what the router adds after it (watch delivery, reduce, snapshot, publish).
    let mut put_acked = Vec::with_capacity(puts as usize);
    let mut acked_to_snapshot = Vec::with_capacity(puts as usize);
    for i in 0..puts {
        // Spread over the fleet; every put carries a capacity no card had before.
        let id = 0x10_0000 + (i * 7919) % workers;
        let blocks = 20_000 + i;
        let (key, value) = card(id, blocks);
        let start = Instant::now();
        admin.put(key, value, None).await.expect("put");
        let acked = Instant::now();
        until(&daemon, |d| {
            d.registry()
                .snapshot()
                .workers()
                .iter()
                .any(|w| w.key.instance_id.0 == id && w.capacity.total_kv_blocks == Some(blocks))
        })
        .await;
        put_to_snapshot.push(start.elapsed());
        put_acked.push(acked - start);
        acked_to_snapshot.push(acked.elapsed());
    }
    report(
        &format!("put -> published snapshot with {workers} workers present"),
        put_to_snapshot,
    );
    report("  of which etcd's put (until acknowledged)", put_acked);
    report(
        "  of which acknowledged put -> published snapshot",
        acked_to_snapshot,
    );
    daemon.shutdown().await;
}
