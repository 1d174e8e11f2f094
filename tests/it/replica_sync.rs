//! Router replicas sharing in-flight dispatches over a real `nats-server` (Debian's 2.9): three
//! REAL router processes (`CARGO_BIN_EXE_continuum-router`) in front of two workers registered in
//! a real etcd, their load from real libzmq publishers (pyzmq) and a fake shim upstream that
//! records each request's worker pin. A big request dispatched through one replica shifts its
//! peers' picks to the other worker; a SIGKILLed replica's contributions expire at its peers
//! while they keep routing; a restarted `nats-server` costs no request and sharing resumes.
//! The harness (`nats-server`, router processes) is `support::replicas`.
#![cfg(all(feature = "real-peers", feature = "replica-sync"))]

use crate::support;

use continuum_protocol::ids::{InstanceId, PublisherId};
use serde_json::Value;
use support::etcd::EtcdServer;
use support::replicas::{Nats, Replica, WAIT, sync_yaml};
use support::upstream::FakeUpstream;
use support::zmq::{Publisher, make};
use tokio::time::Instant;

const NS: &str = "syncns";
const WORKERS: [InstanceId; 2] = [InstanceId(0x51), InstanceId(0x52)];
const PUBLISHERS: [PublisherId; 2] = [PublisherId(0x61), PublisherId(0x62)];

/// Replica `name` in front of the shim and the etcd-registered workers; returns once it lists
/// both workers.
async fn spawn(name: &'static str, etcd: &EtcdServer, shim: &str, nats: &str) -> Replica {
    spawn_with(name, etcd, shim, nats, "").await
}

/// `nats_extra`: more keys under `replica_sync.nats` (a flow-map fragment).
async fn spawn_with(
    name: &'static str,
    etcd: &EtcdServer,
    shim: &str,
    nats: &str,
    nats_extra: &str,
) -> Replica {
    let body = format!(
        "disaggregated_serving: {{enabled: true, fallback_to_unified: false}}\n\
         backends:\n  - {{name: shim, type: openai, url: \"{shim}\", models: [tiny], health_check: {{enabled: false}}}}\n\
         dynamo:\n  enabled: true\n  discovery: {{etcd: {{endpoints: [\"{}\"], namespace: {NS}}}}}\n  \
         load: {{max_staleness: 300s}}\n  shim: {{backends: [shim]}}\n{}",
        etcd.endpoint(),
        sync_yaml(name, nats, nats_extra)
    );
    let replica = Replica::start(name, &body);
    replica
        .until(|v| v["workers"].as_array().is_some_and(|w| w.len() == 2))
        .await;
    replica
}

/// Two aggregated decode workers, each with its kv_metrics publisher.
async fn fleet(etcd: &EtcdServer, ports: [u16; 2]) {
    let mut client = etcd.client().await;
    for ((worker, publisher), port) in WORKERS.iter().zip(PUBLISHERS).zip(ports) {
        let records =
            crate::support::etcd::decode_worker_records(NS, worker.0, publisher.0, port, 100_000);
        for (key, value) in records {
            client.put(key, value.to_string(), None).await.expect("put");
        }
    }
}

/// The worker each recorded shim request was pinned to, in order.
fn pins(shim: &mut FakeUpstream) -> Vec<u64> {
    std::iter::from_fn(|| shim.try_request())
        .filter_map(|r| {
            r.headers
                .get("x-dynamo-worker-instance-id")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok())
        })
        .collect()
}

fn legs(view: &Value) -> u64 {
    view["replica_sync"]["peer_legs"].as_u64().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_in_flight_dispatches_survive_a_killed_peer_and_a_restarted_nats() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let etcd = EtcdServer::start().await;
    let mut nats = Nats::start().await;
    let mut shim = FakeUpstream::start().await;
    let mut publishers = [Publisher::spawn().await, Publisher::spawn().await];
    let mut ports = [0u16; 2];
    for (p, port) in publishers.iter_mut().zip(ports.iter_mut()) {
        *port = p.bind("xpub", 0).await;
    }
    fleet(&etcd, ports).await;
    let mut replicas = Vec::new();
    for name in ["a", "b", "c"] {
        replicas.push(spawn(name, &etcd, &shim.url(), &nats.url()).await);
    }
    // One sample per worker, equal and idle; no other sample follows, so nothing answers the
    // dispatches below (they count for the ledger's 30 s).
    for (i, p) in publishers.iter_mut().enumerate() {
        p.await_subscriptions(3).await;
        p.send(&[make(PUBLISHERS[i], 1, WORKERS[i], 0)]).await;
    }
    for r in &replicas {
        r.until(|v| {
            v["load"].as_array().is_some_and(|l| l.len() == 2)
                && v["replica_sync"]["connected"] == true
                && v["replica_sync"]["peers"]
                    .as_array()
                    .is_some_and(|p| p.len() == 2)
        })
        .await;
    }

    // A big request through `a`: its worker carries ~250 blocks in a's ledger, and in its peers'.
    assert_eq!(replicas[0].chat(4000).await, 200);
    let first = pins(&mut shim);
    assert_eq!(first.len(), 1, "{first:?}");
    let busy = first[0];
    for r in &replicas[1..] {
        r.until(|v| Replica::peer(v, "a").is_some_and(|p| p["entries"] == 1) && legs(v) == 1)
            .await;
    }
    // Small requests through `b` and `c` all avoid it; alone, each would alternate.
    for r in &replicas[1..] {
        for _ in 0..3 {
            assert_eq!(r.chat(1).await, 200);
        }
    }
    let shifted = pins(&mut shim);
    assert_eq!(shifted.len(), 6);
    assert!(
        shifted.iter().all(|&w| w != busy),
        "peers' picks avoid a's busy worker {busy}: {shifted:?}"
    );

    // SIGKILL `a`: its peers keep routing and withdraw its contributions within its TTL.
    replicas[0].kill();
    for r in &replicas[1..] {
        assert_eq!(r.chat(1).await, 200);
        let view = r.until(|v| Replica::peer(v, "a").is_none()).await;
        assert!(
            view["replica_sync"]["peers"]
                .as_array()
                .is_some_and(|p| p.len() == 1),
            "{view}"
        );
        assert!(
            r.metric("continuum_replica_sync_contributions_expired_total")
                .await
                >= 1.0
        );
    }

    // Restart nats-server: requests route on local state meanwhile; sharing resumes after.
    nats.stop();
    for r in &replicas[1..] {
        r.until(|v| v["replica_sync"]["connected"] == false).await;
        for _ in 0..2 {
            assert_eq!(r.chat(1).await, 200, "no request to a live replica fails");
        }
    }
    nats.restart().await;
    for r in &replicas[1..] {
        r.until(|v| v["replica_sync"]["connected"] == true).await;
    }
    // b hears c again (re-admitted if c expired at b meanwhile); c's next change reaches b.
    replicas[1]
        .until(|v| Replica::peer(v, "c").is_some_and(|p| p["last_seen_ms"].as_u64() < Some(300)))
        .await;
    let applied = "continuum_replica_sync_contributions_applied_total";
    let before = replicas[1].metric(applied).await;
    assert_eq!(replicas[2].chat(4000).await, 200);
    let deadline = Instant::now() + WAIT;
    while replicas[1].metric(applied).await <= before {
        assert!(
            Instant::now() < deadline,
            "c's change never reached b after the restart"
        );
        tokio::task::yield_now().await;
    }
    for r in &replicas[1..] {
        assert!(r.metric("continuum_replica_sync_bytes_sent_total").await > 0.0);
        assert!(
            r.metric("continuum_replica_sync_contributions_applied_total")
                .await
                >= 2.0
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_protected_nats_admits_the_right_token_only() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let etcd = EtcdServer::start().await;
    fleet(&etcd, [1, 2]).await;
    let nats = Nats::start_with(&["--auth", "s3cret-token"]).await;
    let shim = FakeUpstream::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).expect("write token");
        path.display().to_string()
    };
    let good = write("good", "s3cret-token\n");
    let bad = write("bad", "wrong\n");
    let extra = |path: &str| format!(", token_file: \"{path}\"");
    let a = spawn_with("a", &etcd, &shim.url(), &nats.url(), &extra(&good)).await;
    let b = spawn_with("b", &etcd, &shim.url(), &nats.url(), &extra(&good)).await;
    let intruder = spawn_with("x", &etcd, &shim.url(), &nats.url(), &extra(&bad)).await;
    for r in [&a, &b] {
        let view = r
            .until(|v| {
                v["replica_sync"]["connected"] == true
                    && v["replica_sync"]["peers"]
                        .as_array()
                        .is_some_and(|p| p.len() == 1)
            })
            .await;
        assert!(Replica::peer(&view, "x").is_none(), "{view}");
    }
    // The intruder never connects, so it hears no peer; it still routes on local state.
    let view = intruder.workers_view().await.expect("admin view");
    assert_eq!(view["replica_sync"]["connected"], false, "{view}");
    assert!(
        view["replica_sync"]["peers"]
            .as_array()
            .is_some_and(|p| p.is_empty())
    );
}
