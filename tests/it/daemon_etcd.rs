//! The whole daemon against a real etcd: Dynamo 1.6.1 records appear in the registry snapshot and
//! in `GET /admin/dynamo/workers`, deletes and an etcd restart are followed (with `first_seen`
//! preserved), `/ready` flips after the first pass, and a config reload replaces the watcher.
#![cfg(feature = "real-peers")]

use crate::support;

use std::time::Duration;

use continuum_actors::registry::RegistryReader;
use continuum_protocol::discovery::snapshot::DynamoSnapshot;
use continuum_router::config::Config;
use continuum_router::daemon::{Daemon, RunOptions};
use etcd_client::{Client, PutOptions};
use serde_json::Value;
use support::etcd::{CapturedKv, EtcdServer, captured_kvs};
use tokio::net::TcpListener;

const WAIT: Duration = Duration::from_secs(30);
const TOKEN: &str = "test-admin-token";

fn yaml(endpoint: &str, namespace: &str) -> String {
    format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\nadmin:\n  enabled: true\n  token: \"{TOKEN}\"\n\
         dynamo:\n  enabled: true\n  discovery:\n    etcd:\n      endpoints: [\"{endpoint}\"]\n      \
         namespace: \"{namespace}\"\n      watch_reconnect_backoff:\n        initial: \"100ms\"\n        \
         max: \"1s\"\n"
    )
}

async fn write_like_dynamo(client: &mut Client, kvs: &[CapturedKv]) {
    let lease = client.lease_grant(30, None).await.expect("lease").id();
    for kv in kvs {
        client
            .put(
                kv.key.clone(),
                kv.value.clone(),
                Some(PutOptions::new().with_lease(lease)),
            )
            .await
            .expect("put");
    }
}

async fn wait_for(registry: &RegistryReader, done: impl Fn(&DynamoSnapshot) -> bool) {
    let mut generations = registry.subscribe();
    tokio::time::timeout(WAIT, async {
        loop {
            if done(&registry.snapshot()) {
                return;
            }
            generations.changed().await.expect("registry alive");
        }
    })
    .await
    .expect("the snapshot reached the expected state in time");
}

async fn admin_get(daemon: &Daemon, path: &str) -> Value {
    let url = format!("http://{}{path}", daemon.local_addr());
    let client = reqwest::Client::new();
    let resp = client
        .get(url)
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("request");
    assert!(resp.status().is_success(), "{path}: {}", resp.status());
    resp.json().await.expect("json")
}

async fn start(config_text: &str, dir: &tempfile::TempDir) -> Daemon {
    let path = dir.path().join("router.yaml");
    std::fs::write(&path, config_text).expect("write config");
    let config = Config::load(&path).expect("valid config").config;
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    Daemon::start(
        RunOptions {
            config,
            config_path: Some(path),
            demo: false,
        },
        listener,
    )
    .await
    .expect("daemon starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamo_records_become_the_fleet_view_and_follow_the_cluster() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut etcd = EtcdServer::start().await;
    let mut client = etcd.client().await;
    let kvs = captured_kvs("disagg-workers-only.raw.json");
    write_like_dynamo(&mut client, &kvs).await;

    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = start(&yaml(&etcd.endpoint(), "dyntest"), &dir).await;
    let registry = daemon.registry().clone();
    wait_for(&registry, |s| s.workers().len() == 2).await;
    let ready = reqwest::get(format!("http://{}/ready", daemon.local_addr()))
        .await
        .expect("ready");
    assert_eq!(ready.status(), 200);

    let view = admin_get(&daemon, "/admin/dynamo/workers").await;
    assert_eq!(view["enabled"], true);
    assert_eq!(view["source"], "etcd");
    assert_eq!(view["namespaces"], serde_json::json!(["dyntest"]));
    assert_eq!(view["connected"], true);
    let workers = view["workers"].as_array().expect("workers");
    let mut roles: Vec<&str> = workers
        .iter()
        .map(|w| w["role"].as_str().expect("role"))
        .collect();
    roles.sort();
    assert_eq!(roles, ["decode", "prefill"]);
    for w in workers {
        let hex = w["instance_id"].as_str().expect("hex id");
        let decimal: u64 = w["worker_id"]
            .as_str()
            .expect("decimal id")
            .parse()
            .expect("decimal");
        assert_eq!(format!("{decimal:x}"), hex);
        assert_eq!(w["model"], "tiny");
        assert!(w.get("transport").is_none(), "no internal addresses");
        assert!(w.get("card_json").is_none(), "no raw cards");
    }
    assert_eq!(view["load_publishers"], 2);
    let first_seen: Vec<Value> = workers.iter().map(|w| w["first_seen"].clone()).collect();
    let text = view.to_string();
    assert!(
        !text.contains("tcp://") && !text.contains("127.0.0.1:"),
        "addresses leaked: {text}"
    );

    // A restart of etcd ends the pass; the resync rebuilds the same fleet, first_seen kept.
    let generation = registry.generation();
    etcd.restart().await;
    // The source notices, backs off and resyncs: wait for the second completed pass, polling
    // on each registry change or every 200 ms (pass counts are not part of the snapshot).
    let resyncs = || {
        daemon
            .metrics()
            .value(
                "continuum_dynamo_discovery_events_total",
                &[("kind", "resync")],
            )
            .unwrap_or(0.0)
    };
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut generations = registry.subscribe();
    // The resync is handed over before the watches open, so `connected` follows it.
    while !(resyncs() >= 2.0 && registry.connected()) && tokio::time::Instant::now() < deadline {
        let _ = tokio::time::timeout(Duration::from_millis(200), generations.changed()).await;
    }
    let connected = resyncs() >= 2.0 && registry.connected();
    assert!(connected, "discovery reconnected after the etcd restart");
    let view = admin_get(&daemon, "/admin/dynamo/workers").await;
    let again: Vec<Value> = view["workers"]
        .as_array()
        .expect("workers")
        .iter()
        .map(|w| w["first_seen"].clone())
        .collect();
    assert_eq!(first_seen, again, "first_seen survives the resync");
    assert_eq!(
        registry.generation(),
        generation,
        "an idempotent resync does not bump"
    );

    // A delete (what SIGTERM does) removes the worker at once.
    let mut client = etcd.client().await;
    let prefill_key = kvs
        .iter()
        .find(|kv| kv.key.starts_with("v1/instances/dyntest/prefill/generate/"))
        .expect("prefill instance key")
        .key
        .clone();
    client.delete(prefill_key, None).await.expect("delete");
    wait_for(&registry, |s| s.workers().len() == 1).await;

    // Editing the file reloads it (the file is watched): the watcher is replaced and the
    // registry reset for the new namespace.
    std::fs::write(
        dir.path().join("router.yaml"),
        yaml(&etcd.endpoint(), "otherns"),
    )
    .expect("rewrite config");
    wait_for(&registry, |s| {
        s.workers().is_empty()
            && s.namespaces()
                .first()
                .is_some_and(|n| n.as_str() == "otherns")
    })
    .await;
    // The explicit reload (POST /admin/config/reload) finds nothing left to change.
    assert_eq!(
        daemon.reload().await.expect("reload accepted"),
        "no changes"
    );
    let metrics = reqwest::get(format!("http://{}/metrics", daemon.local_addr()))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    assert!(
        metrics.contains("continuum_dynamo_discovery_events_total{kind=\"restart\"} 1"),
        "restart counted"
    );

    // An invalid file is refused and the running config stays.
    std::fs::write(dir.path().join("router.yaml"), "dynamo:\n  enabeld: true\n").expect("rewrite");
    let refused = daemon.reload().await.expect_err("refused");
    assert!(refused.contains("enabeld"), "{refused}");
    assert_eq!(registry.snapshot().namespaces()[0].as_str(), "otherns");
    daemon.shutdown().await;
}

/// `GET /admin/dynamo/workers` on the daemon's own handler (the front door's tests use a stub):
/// with `dynamo.enabled: false` it answers 200 `{"enabled": false}` and nothing else, at startup
/// and after a reload that switches a running discovery off; switched on in between, the fleet
/// appears.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workers_view_is_enabled_false_whenever_discovery_is_off() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let etcd = EtcdServer::start().await;
    let mut client = etcd.client().await;
    write_like_dynamo(&mut client, &captured_kvs("disagg-workers-only.raw.json")).await;
    let on = yaml(&etcd.endpoint(), "dyntest");
    let off = on.replace("dynamo:\n  enabled: true", "dynamo:\n  enabled: false");
    assert_ne!(on, off);
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = start(&off, &dir).await;
    let disabled = serde_json::json!({"enabled": false});
    assert_eq!(admin_get(&daemon, "/admin/dynamo/workers").await, disabled);

    let path = dir.path().join("router.yaml");
    std::fs::write(&path, &on).expect("rewrite config");
    let _ = daemon.reload().await.expect("reload accepted");
    wait_for(daemon.registry(), |s| s.workers().len() == 2).await;
    let view = admin_get(&daemon, "/admin/dynamo/workers").await;
    assert_eq!(view["enabled"], true);
    assert_eq!(view["workers"].as_array().map(Vec::len), Some(2));

    std::fs::write(&path, &off).expect("rewrite config");
    let _ = daemon.reload().await.expect("reload accepted");
    let deadline = std::time::Instant::now() + WAIT;
    let mut ticks = tokio::time::interval(Duration::from_millis(20));
    loop {
        if admin_get(&daemon, "/admin/dynamo/workers").await == disabled {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "discovery switched off"
        );
        ticks.tick().await;
    }
    daemon.shutdown().await;
}

/// Writes `n` generate endpoints with ids 1..=n and no model card under a component that sorts
/// before every real one: junk keys that fill an instances range get in key order first.
async fn write_orphan_endpoints(client: &mut Client, namespace: &str, n: u64) {
    let ids: Vec<u64> = (1..=n).collect();
    for chunk in ids.chunks(100) {
        let ops: Vec<etcd_client::TxnOp> = chunk
            .iter()
            .map(|id| {
                let value = serde_json::json!({
                    "type": "Endpoint", "namespace": namespace, "component": "aaa",
                    "endpoint": "generate", "instance_id": id,
                    "transport": {"tcp": format!("10.9.0.1:31000/{id:x}/{namespace}/aaa/generate")}
                });
                etcd_client::TxnOp::put(
                    format!("v1/instances/{namespace}/aaa/generate/{id:x}"),
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resync_flooded_with_20000_low_id_orphan_endpoints_keeps_the_real_workers_routable() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut etcd = EtcdServer::start().await;
    let mut client = etcd.client().await;
    let kvs = captured_kvs("disagg-workers-only.raw.json");
    write_like_dynamo(&mut client, &kvs).await;

    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = start(&yaml(&etcd.endpoint(), "dyntest"), &dir).await;
    let registry = daemon.registry().clone();
    let routable = |s: &DynamoSnapshot| {
        s.workers_for_model(&continuum_protocol::ids::Namespace::new("dyntest"), "tiny")
            .filter(|w| w.role != continuum_protocol::discovery::Role::Unknown)
            .count()
    };
    wait_for(&registry, |s| routable(s) == 2).await;
    let real: Vec<String> = registry
        .snapshot()
        .workers()
        .iter()
        .map(|w| w.key.instance_id.hex())
        .collect();

    // The flood arrives live: past the cap it is refused and the real workers stay.
    write_orphan_endpoints(&mut client, "dyntest", 20_000).await;
    let over_capacity = || {
        daemon
            .metrics()
            .value(
                "continuum_dynamo_discovery_events_total",
                &[("kind", "over_capacity")],
            )
            .unwrap_or(0.0)
    };
    let live_refused = (20_000 + 2 - 16_384) as f64;
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut generations = registry.subscribe();
    while over_capacity() < live_refused && tokio::time::Instant::now() < deadline {
        let _ = tokio::time::timeout(Duration::from_millis(200), generations.changed()).await;
    }
    assert_eq!(
        over_capacity(),
        live_refused,
        "the live flood is refused past the cap"
    );
    assert_eq!(routable(&registry.snapshot()), 2);

    // A forced resync (etcd restarts; the source reconnects and range-gets everything again).
    let resyncs = || {
        daemon
            .metrics()
            .value(
                "continuum_dynamo_discovery_events_total",
                &[("kind", "resync")],
            )
            .unwrap_or(0.0)
    };
    drop(client);
    etcd.restart().await;
    let deadline = tokio::time::Instant::now() + WAIT;
    while !(resyncs() >= 2.0 && registry.connected()) && tokio::time::Instant::now() < deadline {
        let _ = tokio::time::timeout(Duration::from_millis(200), generations.changed()).await;
    }
    assert!(resyncs() >= 2.0 && registry.connected(), "resynced");
    assert_eq!(
        over_capacity(),
        2.0 * live_refused,
        "the resync leaves out (and counts) as many records as the cap demands"
    );

    let snapshot = registry.snapshot();
    assert_eq!(routable(&snapshot), 2, "the real workers stay routable");
    let view = admin_get(&daemon, "/admin/dynamo/workers").await;
    let listed: Vec<&str> = view["workers"]
        .as_array()
        .expect("workers")
        .iter()
        .filter(|w| w["model"] == "tiny")
        .filter_map(|w| w["instance_id"].as_str())
        .collect();
    for id in &real {
        assert!(
            listed.contains(&id.as_str()),
            "worker {id} listed after the resync"
        );
    }
    daemon.shutdown().await;
}
