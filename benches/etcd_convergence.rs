//! put→event latency of the etcd discovery source against a real etcd, resync time, and the
//! whole daemon's put→snapshot convergence (source → reducer → registry publish).
//!
//! `cargo bench --features real-peers --bench etcd_convergence` (needs `etcd` on PATH or
//! `ETCD_BIN`). Prints percentiles; a measurement script, not a criterion bench, because each
//! sample is one round trip through an external process.

#![allow(clippy::too_many_lines, reason = "test code is exempt")]

#[path = "../tests/it/support/etcd.rs"]
mod etcd_harness;

use std::time::{Duration, Instant};

use continuum_actors::etcd_source::{EtcdSource, EtcdSourceConfig};
use continuum_protocol::discovery::SourceEvent;
use continuum_protocol::ids::Namespace;
use etcd_harness::EtcdServer;
use futures::future::join_all;
use tokio::sync::mpsc;

const SEQUENTIAL_PUTS: usize = 1000;
const BURST_PUTS: usize = 1000;
const RESYNC_RECORDS: usize = 10_000;
/// About the size of a captured 1.6.1 model card.
const RECORD_BYTES: usize = 1700;

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(run());
}

async fn next(rx: &mut mpsc::Receiver<SourceEvent>) -> SourceEvent {
    tokio::time::timeout(Duration::from_secs(60), rx.recv())
        .await
        .expect("an event within a minute")
        .expect("the source is running")
}

async fn wait_for_done(rx: &mut mpsc::Receiver<SourceEvent>) -> usize {
    let mut records = 0;
    loop {
        match next(rx).await {
            SourceEvent::Init => records = 0,
            SourceEvent::InitApply { .. } => records += 1,
            SourceEvent::InitDone => return records,
            other => panic!("unexpected {other:?} during a resync"),
        }
    }
}

fn report(name: &str, mut samples: Vec<Duration>) {
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

async fn run() {
    let server = EtcdServer::start().await;
    let mut admin = server.client().await;
    let cfg = EtcdSourceConfig::new(vec![server.endpoint()], Namespace::new("bench"));
    let (tx, mut rx) = mpsc::channel(4096);
    let source = EtcdSource::spawn(cfg.clone(), tx).expect("valid config");
    assert_eq!(wait_for_done(&mut rx).await, 0);
    source
        .connected()
        .wait_for(|c| *c)
        .await
        .expect("connected");

    // 1. Sequential: issue a put, wait for its Apply.
    let value = vec![b'x'; 256];
    let mut put_to_event = Vec::with_capacity(SEQUENTIAL_PUTS);
    let mut ack_to_event = Vec::with_capacity(SEQUENTIAL_PUTS);
    for i in 0..SEQUENTIAL_PUTS {
        let key = format!("v1/instances/bench/backend/generate/{i:x}");
        let start = Instant::now();
        admin
            .put(key.clone(), value.clone(), None)
            .await
            .expect("put");
        let acked = Instant::now();
        match next(&mut rx).await {
            SourceEvent::Apply { key: got, .. } => assert_eq!(got, key),
            other => panic!("expected an Apply, got {other:?}"),
        }
        put_to_event.push(start.elapsed());
        ack_to_event.push(acked.elapsed());
    }
    report("sequential put->Apply (from issuing the put)", put_to_event);
    report("sequential put ack->Apply", ack_to_event);

    // 2. Burst: BURST_PUTS concurrent puts, time until every Apply arrived.
    let start = Instant::now();
    let puts = (0..BURST_PUTS).map(|i| {
        let mut client = admin.clone();
        let value = value.clone();
        async move {
            client
                .put(format!("v1/mdc/bench/backend/generate/{i:x}"), value, None)
                .await
                .expect("put")
        }
    });
    let writer = tokio::spawn(join_all(puts));
    for _ in 0..BURST_PUTS {
        assert!(matches!(next(&mut rx).await, SourceEvent::Apply { .. }));
    }
    let burst = start.elapsed();
    writer.await.expect("writer");
    println!(
        "burst: {BURST_PUTS} concurrent puts fully observed in {burst:?} ({:.0} events/s)",
        BURST_PUTS as f64 / burst.as_secs_f64()
    );
    source.stop().await;

    // 3. Resync: a fresh source reading RESYNC_RECORDS card-sized records.
    let card = vec![b'c'; RECORD_BYTES];
    for chunk in (0..RESYNC_RECORDS).collect::<Vec<_>>().chunks(200) {
        join_all(chunk.iter().map(|i| {
            let mut client = admin.clone();
            let card = card.clone();
            async move {
                client
                    .put(
                        format!("v1/event_channels/namespace/bench/r/{i:x}"),
                        card,
                        None,
                    )
                    .await
                    .expect("put")
            }
        }))
        .await;
    }
    let total = SEQUENTIAL_PUTS + BURST_PUTS + RESYNC_RECORDS;
    let mut samples = Vec::new();
    for _ in 0..5 {
        let (tx, mut rx) = mpsc::channel(4096);
        let start = Instant::now();
        let source = EtcdSource::spawn(cfg.clone(), tx).expect("valid config");
        assert_eq!(wait_for_done(&mut rx).await, total);
        samples.push(start.elapsed());
        source.stop().await;
    }
    report(
        &format!("resync of {total} records ({RESYNC_RECORDS} of {RECORD_BYTES} B) to InitDone"),
        samples,
    );

    // 4. The whole daemon: put an Endpoint record, wait until the published snapshot has it.
    let yaml = format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\ndynamo:\n  enabled: true\n  discovery:\n    \
         etcd:\n      endpoints: [\"{}\"]\n      namespace: \"snap\"\n",
        server.endpoint()
    );
    let config = continuum_router::config::Config::from_yaml_str(
        &yaml,
        &continuum_router::config::ProcessEnv,
    )
    .expect("config");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let daemon = continuum_router::daemon::Daemon::start(
        continuum_router::daemon::RunOptions {
            config,
            config_path: None,
            demo: false,
        },
        listener,
    )
    .await
    .expect("daemon");
    let registry = daemon.registry().clone();
    let mut generations = registry.subscribe();
    let mut put_to_snapshot = Vec::with_capacity(SEQUENTIAL_PUTS);
    for i in 0..SEQUENTIAL_PUTS as u64 {
        let id = 0x1000 + i;
        let record = format!(
            r#"{{"type":"Endpoint","namespace":"snap","component":"decode","endpoint":"generate","instance_id":{id},"transport":{{"tcp":"127.0.0.1:1/x"}}}}"#
        );
        let start = Instant::now();
        admin
            .put(
                format!("v1/instances/snap/decode/generate/{id:x}"),
                record,
                None,
            )
            .await
            .expect("put");
        while registry.snapshot().workers().len() as u64 != i + 1 {
            tokio::time::timeout(Duration::from_secs(60), generations.changed())
                .await
                .expect("a generation within a minute")
                .expect("registry alive");
        }
        put_to_snapshot.push(start.elapsed());
    }
    report(
        "daemon put->published snapshot (from issuing the put)",
        put_to_snapshot,
    );
    daemon.shutdown().await;
}
