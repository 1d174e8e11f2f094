//! Load signals end to end inside the daemon: a worker and its kv_metrics channel registered in a
//! real etcd, a real libzmq publisher (pyzmq) sending ActiveLoad; the daemon's follower starts one
//! subscription, samples land in the load store and the per-worker gauges, foreign publisher ids
//! are counted, and a departed worker's sample and gauges are evicted. A publisher SIGKILLed while
//! its records stay in etcd (a killed worker within its lease) marks the worker unreachable.
//! A sequence gap drops the publisher's samples, and the sample that revealed it keeps its
//! gauges.
#![cfg(feature = "real-peers")]

use crate::support;

use std::time::Duration;

use continuum_protocol::ids::{DpRank, InstanceId, PublisherId};
use continuum_router::daemon::Daemon;
use serde_json::{Value, json};
use support::etcd::EtcdServer;
use support::zmq::{Publisher, make};

const WAIT: Duration = Duration::from_secs(30);
const NS: &str = "loadns";
const WORKER: InstanceId = InstanceId(0x6a6c_a22b_96b5_3116);
const PUBLISHER: PublisherId = PublisherId(0x0018_6c12_17a6_6976);

fn records(port: u16) -> Vec<(String, Value)> {
    support::etcd::decode_worker_records(NS, WORKER.0, PUBLISHER.0, port, 1024)
}

#[track_caller]
fn until<'a>(
    daemon: &'a Daemon,
    done: impl Fn(&Daemon) -> bool + 'a,
) -> impl std::future::Future<Output = ()> + 'a {
    let caller = std::panic::Location::caller();
    async move { until_at(daemon, done, caller).await }
}

async fn until_at(
    daemon: &Daemon,
    done: impl Fn(&Daemon) -> bool,
    caller: &std::panic::Location<'_>,
) {
    let mut changes = daemon.load_store().subscribe();
    let mut generations = daemon.registry().subscribe();
    tokio::time::timeout(WAIT, async {
        while !done(daemon) {
            tokio::select! {
                r = changes.changed() => r.expect("store alive"),
                r = generations.changed() => r.expect("registry alive"),
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("state expected at {caller} not reached in time"));
}

fn gauge(daemon: &Daemon, family: &str) -> Option<f64> {
    let worker = WORKER.hex();
    daemon.metrics().value(
        family,
        &[
            ("namespace", NS),
            ("worker", worker.as_str()),
            ("dp_rank", "0"),
        ],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn samples_flow_from_a_real_publisher_into_the_store_and_gauges() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let etcd = EtcdServer::start().await;
    let mut publisher = Publisher::spawn().await;
    let port = publisher.bind("xpub", 0).await;
    let mut client = etcd.client().await;
    for (key, value) in records(port) {
        client.put(key, value.to_string(), None).await.expect("put");
    }
    let yaml = format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\nadmin:\n  enabled: true\n  token: t\n\
         dynamo:\n  enabled: true\n  discovery:\n    etcd:\n      endpoints: [\"{}\"]\n      \
         namespace: \"{NS}\"\n  load:\n    max_staleness: \"5m\"\n    direct_allow_cidrs: [\"127.0.0.0/8\"]\n",
        etcd.endpoint()
    );
    let daemon = support::daemon::start(&yaml).await;

    // The follower subscribes: the XPUB socket reports the subscription (no slow-joiner race).
    let subs = publisher.await_subscriptions(1).await;
    assert_eq!(subs, vec![format!("01{}", hex(b"kv_metrics"))]);
    publisher.send(&[make(PUBLISHER, 1, WORKER, 7)]).await;
    // The gauge is written right after the store write that wakes us: wait for both.
    until(&daemon, |d| {
        d.load_store().latest(WORKER, DpRank(0)).is_some()
            && gauge(d, "continuum_dynamo_worker_kv_used_blocks").is_some()
    })
    .await;
    let sample = daemon
        .load_store()
        .latest(WORKER, DpRank(0))
        .expect("sample");
    assert_eq!(sample.load.kv_used_blocks, Some(7));
    assert_eq!(
        gauge(&daemon, "continuum_dynamo_worker_kv_used_blocks"),
        Some(7.0)
    );
    assert_eq!(
        gauge(&daemon, "continuum_dynamo_worker_active_decode_blocks"),
        None,
        "nil → no series"
    );

    let url = format!("http://{}/admin/dynamo/workers", daemon.local_addr());
    let view: Value = reqwest::Client::new()
        .get(&url)
        .bearer_auth("t")
        .send()
        .await
        .expect("admin")
        .json()
        .await
        .expect("json");
    let subs = view["subscriptions"].as_array().expect("subscriptions");
    assert_eq!(subs.len(), 1);
    assert_eq!(subs[0]["family"], "kv_metrics");
    assert_eq!(subs[0]["publisher_id"], PUBLISHER.0.to_string());
    assert_eq!(subs[0]["state"], "connected");
    assert_eq!(subs[0]["transport"], "direct");
    assert!(
        !view.to_string().contains(&format!(":{port}")),
        "no publisher address"
    );

    // A newer sample replaces it; a foreign publisher id is refused and counted.
    publisher
        .send(&[
            make(PublisherId(42), 2, WORKER, 99),
            make(PUBLISHER, 3, WORKER, 9),
        ])
        .await;
    until(&daemon, |d| {
        d.load_store()
            .latest(WORKER, DpRank(0))
            .is_some_and(|s| s.load.kv_used_blocks == Some(9))
    })
    .await;
    let mismatches = daemon
        .metrics()
        .value(
            "continuum_dynamo_load_events_total",
            &[("result", "identity_mismatch")],
        )
        .unwrap_or(0.0);
    assert!(mismatches >= 1.0, "foreign publisher counted");
    let connected = daemon.metrics().value(
        "continuum_dynamo_load_subscriptions",
        &[("state", "connected"), ("transport", "direct")],
    );
    assert_eq!(connected, Some(1.0));

    // The worker departs: its sample and gauge series go, and so does the subscription.
    client
        .delete(
            format!("v1/instances/{NS}/backend/generate/{:x}", WORKER.0),
            None,
        )
        .await
        .expect("delete");
    client
        .delete(
            format!(
                "v1/event_channels/namespace/{NS}/component/backend/endpoint/generate/topic/kv_metrics/{:x}",
                PUBLISHER.0
            ),
            None,
        )
        .await
        .expect("delete channel");
    until(&daemon, |d| {
        d.load_store().latest(WORKER, DpRank(0)).is_none()
            && d.load_store().subscriptions().is_empty()
            && gauge(d, "continuum_dynamo_worker_kv_used_blocks").is_none()
    })
    .await;
    assert_eq!(
        gauge(&daemon, "continuum_dynamo_worker_kv_used_blocks"),
        None
    );
    daemon.shutdown().await;
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A killed worker's records stay in etcd until its lease expires, but its publisher dies at
/// once: the subscription loses its session, the reconnect is refused, and the worker is marked
/// unreachable (admin view, gauge, counter) until a publisher answers on its endpoint again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_publisher_marks_its_worker_unreachable_until_it_answers_again() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let etcd = EtcdServer::start().await;
    let mut publisher = Publisher::spawn().await;
    let port = publisher.bind("xpub", 0).await;
    let mut client = etcd.client().await;
    for (key, value) in records(port) {
        client.put(key, value.to_string(), None).await.expect("put");
    }
    let yaml = format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\nadmin:\n  enabled: true\n  token: t\n\
         dynamo:\n  enabled: true\n  discovery:\n    etcd:\n      endpoints: [\"{}\"]\n      \
         namespace: \"{NS}\"\n  load:\n    max_staleness: \"5m\"\n    direct_allow_cidrs: [\"127.0.0.0/8\"]\n",
        etcd.endpoint()
    );
    let daemon = support::daemon::start(&yaml).await;
    publisher.await_subscriptions(1).await;
    publisher.send(&[make(PUBLISHER, 1, WORKER, 0)]).await;
    until(&daemon, |d| {
        d.load_store().latest(WORKER, DpRank(0)).is_some()
    })
    .await;
    let admin = |daemon: &Daemon| {
        let url = format!("http://{}/admin/dynamo/workers", daemon.local_addr());
        async move {
            let view: Value = reqwest::Client::new()
                .get(&url)
                .bearer_auth("t")
                .send()
                .await
                .expect("admin")
                .json()
                .await
                .expect("json");
            view["workers"][0].clone()
        }
    };
    assert_eq!(admin(&daemon).await["reachable"], true);

    publisher.kill().await;
    let killed = tokio::time::Instant::now();
    until(&daemon, |d| d.load_store().unreachable(WORKER).is_some()).await;
    println!("SIGKILL to unreachable mark: {:?}", killed.elapsed());
    let worker = admin(&daemon).await;
    assert_eq!(worker["reachable"], false, "{worker}");
    assert!(worker["unreachable_for_ms"].is_u64(), "{worker}");
    let metrics = daemon.metrics();
    assert_eq!(
        metrics.value("continuum_dynamo_unreachable_workers", &[]),
        Some(1.0)
    );
    assert_eq!(
        metrics.value("continuum_dynamo_workers_marked_unreachable_total", &[]),
        Some(1.0)
    );
    // Still registered: only the lease (or a SIGTERM) removes a worker from the view.
    assert_eq!(daemon.registry().snapshot().workers().len(), 1);

    // A publisher answers on the endpoint again (a restarted worker process): the next session
    // clears the mark.
    let mut again = Publisher::spawn().await;
    assert_eq!(again.bind("xpub", port).await, port);
    again.await_subscriptions(1).await;
    until(&daemon, |d| d.load_store().unreachable(WORKER).is_none()).await;
    assert_eq!(admin(&daemon).await["reachable"], true);
    assert_eq!(
        metrics.value("continuum_dynamo_unreachable_workers", &[]),
        Some(0.0)
    );
    daemon.shutdown().await;
}

/// seq 0..2, a gap (3 and 4 never sent), then seq 5: the store holds seq 5's sample and the
/// gauges equal it. Before the fix the gap's `clear_gauges` ran after `set_worker_load` for the
/// same key, deleting the series just set while `/admin/dynamo/workers` showed the sample.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sample_after_a_sequence_gap_keeps_its_gauges() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let etcd = EtcdServer::start().await;
    let mut publisher = Publisher::spawn().await;
    let port = publisher.bind("xpub", 0).await;
    let mut client = etcd.client().await;
    for (key, value) in records(port) {
        client.put(key, value.to_string(), None).await.expect("put");
    }
    let yaml = format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\n\
         dynamo:\n  enabled: true\n  discovery:\n    etcd:\n      endpoints: [\"{}\"]\n      \
         namespace: \"{NS}\"\n  load:\n    max_staleness: \"5m\"\n    direct_allow_cidrs: [\"127.0.0.0/8\"]\n",
        etcd.endpoint()
    );
    let daemon = support::daemon::start(&yaml).await;
    publisher.await_subscriptions(1).await;
    publisher
        .send(&[
            make(PUBLISHER, 0, WORKER, 1),
            make(PUBLISHER, 1, WORKER, 2),
            make(PUBLISHER, 2, WORKER, 3),
        ])
        .await;
    until(&daemon, |d| {
        gauge(d, "continuum_dynamo_worker_kv_used_blocks") == Some(3.0)
    })
    .await;
    let duplicates = |d: &Daemon| {
        d.metrics()
            .value(
                "continuum_dynamo_load_events_total",
                &[("result", "duplicate")],
            )
            .unwrap_or(0.0)
    };
    let before = duplicates(&daemon);
    // The gap, then seq 5 again: frames are handled in order, so once the duplicate is counted
    // the gap frame's gauges are settled.
    publisher
        .send(&[
            make(PUBLISHER, 5, WORKER, 11),
            make(PUBLISHER, 5, WORKER, 12),
        ])
        .await;
    until(&daemon, |d| {
        d.load_store()
            .latest(WORKER, DpRank(0))
            .is_some_and(|s| s.load.kv_used_blocks == Some(11))
            && duplicates(d) > before
    })
    .await;
    assert_eq!(
        gauge(&daemon, "continuum_dynamo_worker_kv_used_blocks"),
        Some(11.0),
        "the gauge equals the applied sample"
    );
    daemon.shutdown().await;
}

/// Writes `n` kv_metrics channels with publisher ids 1..=n (below the real one), scoped on a
/// component no worker serves, whose endpoints lie outside `direct_allow_cidrs` (so the
/// subscriptions admitted for them never open a socket).
async fn write_hostile_channels(client: &mut etcd_client::Client, n: u64) {
    let ids: Vec<u64> = (1..=n).collect();
    for chunk in ids.chunks(100) {
        let ops: Vec<etcd_client::TxnOp> = chunk
            .iter()
            .map(|id| {
                let value = json!({"type": "EventChannel", "scope": {"kind": "endpoint", "endpoint":
                    {"namespace": NS, "component": "ghost", "name": "generate"}},
                    "topic": "kv_metrics", "instance_id": id,
                    "transport": {"kind": "Zmq", "config": {"endpoint": "tcp://10.255.0.1:5555"}}});
                etcd_client::TxnOp::put(
                    format!(
                        "v1/event_channels/namespace/{NS}/component/ghost/endpoint/generate/topic/kv_metrics/{id:x}"
                    ),
                    value.to_string(),
                    None,
                )
            })
            .collect();
        client
            .txn(etcd_client::Txn::new().and_then(ops))
            .await
            .expect("txn");
    }
}

/// At the 1,024-subscription cap, 1,100 hostile channels with lower publisher ids never push the
/// registered worker's subscription out; the overflow is counted. A worker whose subscription
/// stops while it stays registered loses its sample and gauge series (it reads as stale, not as
/// a frozen sample).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_subscription_cap_live_workers_stay_subscribed_and_unsubscribed_ones_read_stale() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let etcd = EtcdServer::start().await;
    let mut publisher = Publisher::spawn().await;
    let port = publisher.bind("xpub", 0).await;
    let mut client = etcd.client().await;
    for (key, value) in records(port) {
        client.put(key, value.to_string(), None).await.expect("put");
    }
    let yaml = format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\nadmin:\n  enabled: true\n  token: t\n\
         dynamo:\n  enabled: true\n  discovery:\n    etcd:\n      endpoints: [\"{}\"]\n      \
         namespace: \"{NS}\"\n  load:\n    max_staleness: \"5m\"\n    direct_allow_cidrs: [\"127.0.0.0/8\"]\n",
        etcd.endpoint()
    );
    let daemon = support::daemon::start(&yaml).await;
    publisher.await_subscriptions(1).await;
    publisher.send(&[make(PUBLISHER, 1, WORKER, 7)]).await;
    until(&daemon, |d| {
        gauge(d, "continuum_dynamo_worker_kv_used_blocks") == Some(7.0)
    })
    .await;

    let hostile = 1_100u64;
    write_hostile_channels(&mut client, hostile).await;
    let over_capacity = |d: &Daemon| {
        d.metrics()
            .value(
                "continuum_dynamo_load_events_total",
                &[("result", "over_capacity")],
            )
            .unwrap_or(0.0)
    };
    let expected = (hostile + 1 - 1_024) as f64;
    until(&daemon, |d| {
        d.registry().snapshot().load_publisher_count() == hostile as usize + 1
            && over_capacity(d) == expected
    })
    .await;
    // Still subscribed and live: a new sample moves the gauge.
    let real = PUBLISHER.0.to_string();
    assert!(
        daemon
            .load_store()
            .subscriptions()
            .iter()
            .any(|s| s.publisher_id == real),
        "the registered worker's subscription was kept"
    );
    publisher.send(&[make(PUBLISHER, 2, WORKER, 8)]).await;
    until(&daemon, |d| {
        gauge(d, "continuum_dynamo_worker_kv_used_blocks") == Some(8.0)
    })
    .await;
    assert_eq!(
        over_capacity(&daemon),
        expected,
        "counted once per publisher left out"
    );

    // The worker's channel goes (its publisher moved away) while the worker stays registered:
    // no subscription, so no sample and no gauge series — it reads as stale.
    client
        .delete(
            format!(
                "v1/event_channels/namespace/{NS}/component/backend/endpoint/generate/topic/kv_metrics/{:x}",
                PUBLISHER.0
            ),
            None,
        )
        .await
        .expect("delete channel");
    until(&daemon, |d| {
        d.load_store().latest(WORKER, DpRank(0)).is_none()
            && gauge(d, "continuum_dynamo_worker_kv_used_blocks").is_none()
    })
    .await;
    assert_eq!(daemon.registry().snapshot().workers().len(), 1);
    assert!(
        !daemon
            .load_store()
            .subscriptions()
            .iter()
            .any(|s| s.publisher_id == real)
    );
    daemon.shutdown().await;
}
