//! Our discovery against real NVIDIA Dynamo 1.6.1 processes (etcd, `dynamo.mocker` workers, a
//! direct-mode `dynamo.frontend`): the daemon's snapshot and `GET /admin/dynamo/workers` list
//! exactly the workers that registered, with their ids, roles, model, block size and capacity;
//! a SIGTERMed worker leaves at once and a SIGKILLed one within its lease TTL.
//!
//! Needs `--features dynamo-e2e`, `CONTINUUM_DYNAMO_PYTHON` (from `scripts/setup-dynamo-venv.sh`)
//! and `etcd` on PATH (or `ETCD_BIN`).
#![cfg(feature = "dynamo-e2e")]

use crate::support;

use std::collections::BTreeSet;
use std::time::Duration;

use continuum_actors::registry::RegistryReader;
use continuum_protocol::discovery::records::{EventTopic, Role};
use continuum_protocol::discovery::snapshot::DynamoSnapshot;
use continuum_router::config::Config;
use continuum_router::daemon::{Daemon, RunOptions};
use serde_json::Value;
use support::dynamo::{
    BLOCK_SIZE, DynamoStack, LEASE_TTL, MODEL, Signal, TOTAL_KV_BLOCKS, Topology, WorkerRole,
};
use tokio::net::TcpListener;
use tokio::time::Instant;

const TOKEN: &str = "e2e-admin-token";
/// How long the registry may take to show a change the workers already wrote to etcd.
const SEEN: Duration = Duration::from_secs(20);
/// A SIGTERMed worker deletes its keys before it exits: anything near the lease TTL would mean
/// we only noticed the lease expiring.
const TERM_BOUND: Duration = Duration::from_secs(10);
/// etcd's lease expiry checks run on their own tick; allow a little past the TTL.
const KILL_BOUND: Duration = Duration::from_secs(LEASE_TTL.as_secs() + 3);

fn config_yaml(endpoint: &str, namespace: &str) -> String {
    format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\nadmin:\n  enabled: true\n  token: \"{TOKEN}\"\n\
         dynamo:\n  enabled: true\n  discovery:\n    source: etcd\n    etcd:\n      \
         endpoints: [\"{endpoint}\"]\n      namespace: \"{namespace}\"\n      \
         watch_reconnect_backoff:\n        initial: \"100ms\"\n        max: \"1s\"\n"
    )
}

async fn start_daemon(stack: &DynamoStack, dir: &tempfile::TempDir) -> Daemon {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let path = dir.path().join("router.yaml");
    std::fs::write(
        &path,
        config_yaml(&stack.etcd_endpoint(), stack.namespace()),
    )
    .expect("write config");
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

/// Waits on registry generations (no polling) until `done` holds; returns the time it took.
async fn wait_for(
    registry: &RegistryReader,
    limit: Duration,
    what: &str,
    done: impl Fn(&DynamoSnapshot) -> bool,
) -> Duration {
    let start = Instant::now();
    let mut generations = registry.subscribe();
    let reached = tokio::time::timeout(limit, async {
        loop {
            if done(&registry.snapshot()) {
                return;
            }
            generations.changed().await.expect("registry alive");
        }
    })
    .await;
    assert!(
        reached.is_ok(),
        "{what} within {limit:?}; workers: {:#?}\npublishers: {:#?}",
        registry.snapshot().workers(),
        registry.snapshot().publishers()
    );
    start.elapsed()
}

async fn admin_workers(daemon: &Daemon) -> Value {
    let resp = reqwest::Client::new()
        .get(format!(
            "http://{}/admin/dynamo/workers",
            daemon.local_addr()
        ))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("request");
    assert!(resp.status().is_success(), "{}", resp.status());
    resp.json().await.expect("json")
}

fn role_of(role: WorkerRole) -> Role {
    match role {
        WorkerRole::Prefill => Role::Prefill,
        WorkerRole::Decode => Role::Decode,
        WorkerRole::Aggregated => Role::Aggregated,
    }
}

/// (decimal id, role) of the stack's running workers.
fn expected(stack: &DynamoStack) -> BTreeSet<(u64, &'static str)> {
    stack
        .workers()
        .iter()
        .filter(|w| w.is_running())
        .map(|w| (w.instance_id, w.role.as_str()))
        .collect()
}

fn seen(snapshot: &DynamoSnapshot) -> BTreeSet<(u64, &'static str)> {
    snapshot
        .workers()
        .iter()
        .map(|w| (w.instance_id().0, w.role.as_str()))
        .collect()
}

/// The snapshot and the admin view both show exactly the stack's workers, with the card fields
/// the mockers declared, one `kv_metrics` publisher per worker and `kv_events` publishers (one
/// per prefill or aggregated worker: decode mockers publish none).
async fn assert_fleet(stack: &DynamoStack, daemon: &Daemon, kv_events: usize) {
    let registry = daemon.registry();
    let want = expected(stack);
    let n = want.len();
    wait_for(
        registry,
        SEEN,
        "the registry lists the stack's workers",
        |s| {
            seen(s) == want
                && s.load_publisher_count() == n
                && s.kv_event_publisher_count() == kv_events
        },
    )
    .await;

    let snapshot = registry.snapshot();
    assert_eq!(seen(&snapshot), want, "exactly the registered workers");
    for worker in snapshot.workers() {
        let started = stack
            .workers()
            .iter()
            .find(|w| w.instance_id == worker.instance_id().0)
            .expect("a worker the stack started");
        assert_eq!(worker.role, role_of(started.role));
        assert_eq!(worker.namespace().as_str(), stack.namespace());
        assert_eq!(worker.component, started.role.component());
        assert_eq!(worker.endpoint, "generate");
        assert_eq!(worker.model.as_deref(), Some(MODEL));
        assert_eq!(worker.block_size, Some(BLOCK_SIZE));
        assert_eq!(worker.capacity.total_kv_blocks, Some(TOTAL_KV_BLOCKS));
        assert_eq!(worker.capacity.max_num_seqs, Some(256));
        assert_eq!(worker.capacity.max_num_batched_tokens, Some(8192));
        assert_eq!(worker.dp_size, Some(1));
        assert!(
            worker
                .transport()
                .is_some_and(|t| t.starts_with("127.0.0.1:")),
            "loopback request plane: {:?}",
            worker.transport()
        );
    }
    assert_eq!(
        snapshot
            .workers_for_model(&snapshot.workers()[0].key.namespace, MODEL)
            .count(),
        n
    );
    let kv_metrics: Vec<_> = snapshot
        .publishers()
        .iter()
        .filter(|p| p.topic == EventTopic::KvMetrics)
        .collect();
    assert_eq!(kv_metrics.len(), n, "one kv_metrics channel per worker");
    for p in &kv_metrics {
        assert_eq!(p.namespace.as_str(), stack.namespace());
        assert_eq!(
            p.address().host,
            "127.0.0.1",
            "publisher advertises loopback"
        );
    }

    let view = admin_workers(daemon).await;
    assert_eq!(view["enabled"], true);
    assert_eq!(view["source"], "etcd");
    assert_eq!(view["connected"], true);
    assert_eq!(view["namespaces"], serde_json::json!([stack.namespace()]));
    assert_eq!(view["load_publishers"], n);
    assert_eq!(view["kv_event_publishers"], kv_events);
    let workers = view["workers"].as_array().expect("workers");
    let listed: BTreeSet<(u64, &str)> = workers
        .iter()
        .map(|w| {
            let decimal: u64 = w["worker_id"]
                .as_str()
                .expect("decimal id string")
                .parse()
                .expect("decimal");
            assert_eq!(w["instance_id"], format!("{decimal:x}"), "hex id");
            assert_eq!(w["model"], MODEL);
            assert_eq!(w["namespace"], stack.namespace());
            (decimal, w["role"].as_str().expect("role"))
        })
        .collect();
    assert_eq!(
        listed, want,
        "admin view lists exactly the registered workers"
    );
    let text = view.to_string();
    assert!(
        !text.contains("tcp://") && !text.contains("127.0.0.1:"),
        "no internal addresses in the admin view: {text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_fleet_is_discovered_and_follows_sigterm_and_sigkill() {
    let started = Instant::now();
    let mut stack = DynamoStack::start(Topology::Disagg).await;
    eprintln!("disagg stack ready in {:?}", started.elapsed());
    assert_eq!(stack.worker_ids(WorkerRole::Prefill).len(), 1);
    assert_eq!(stack.worker_ids(WorkerRole::Decode).len(), 1);
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = start_daemon(&stack, &dir).await;
    assert_fleet(&stack, &daemon, 1).await;
    let registry = daemon.registry().clone();

    // The harness's frontend serves a request pinned to the discovered pair (decimal ids), the
    // exchange later shim-routing tests build on.
    let snapshot = registry.snapshot();
    let id_of = |role: Role| {
        snapshot
            .workers()
            .iter()
            .find(|w| w.role == role)
            .expect("worker of the role")
            .instance_id()
            .decimal()
    };
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", stack.frontend_url()))
        .header("x-dynamo-worker-instance-id", id_of(Role::Decode))
        .header("x-dynamo-prefill-instance-id", id_of(Role::Prefill))
        .json(&serde_json::json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello world"}],
            "max_tokens": 4,
        }))
        .send()
        .await
        .expect("frontend request");
    assert_eq!(
        resp.status(),
        200,
        "pinned request through the real frontend"
    );
    let body: Value = resp.json().await.expect("completion json");
    assert_eq!(body["object"], "chat.completion");

    // SIGTERM: the worker deletes its keys itself; the view drops it (and its publishers) at
    // once, and the other worker stays.
    let signalled = Instant::now();
    let prefill = stack.stop_worker(WorkerRole::Prefill, Signal::Term).await;
    let decode = stack.worker_ids(WorkerRole::Decode)[0];
    wait_for(
        &registry,
        TERM_BOUND,
        "the SIGTERMed prefill worker left",
        |s| {
            seen(s) == BTreeSet::from([(decode, "decode")])
                && s.load_publisher_count() == 1
                && s.kv_event_publisher_count() == 0
        },
    )
    .await;
    let term_gone = signalled.elapsed();
    eprintln!("SIGTERMed worker {prefill} left the view after {term_gone:?}");
    assert!(term_gone < TERM_BOUND);
    let view = admin_workers(&daemon).await;
    assert_eq!(view["workers"].as_array().expect("workers").len(), 1);
    assert_eq!(view["workers"][0]["worker_id"], decode.to_string());

    // SIGKILL: nothing cleans up but the lease, which expires within its TTL.
    let signalled = Instant::now();
    let killed = stack.stop_worker(WorkerRole::Decode, Signal::Kill).await;
    assert_eq!(killed, decode);
    wait_for(
        &registry,
        KILL_BOUND,
        "the SIGKILLed decode worker left",
        |s| s.workers().is_empty() && s.publishers().is_empty(),
    )
    .await;
    let kill_gone = signalled.elapsed();
    eprintln!("SIGKILLed worker {killed} left the view after {kill_gone:?}");
    assert!(kill_gone < KILL_BOUND);
    assert_eq!(
        admin_workers(&daemon).await["workers"],
        serde_json::json!([])
    );
    daemon.shutdown().await;
    eprintln!("disagg test took {:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregated_fleet_is_discovered_with_aggregated_roles() {
    let started = Instant::now();
    let stack = DynamoStack::start(Topology::Agg).await;
    eprintln!("agg stack ready in {:?}", started.elapsed());
    assert_eq!(stack.worker_ids(WorkerRole::Aggregated).len(), 2);
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = start_daemon(&stack, &dir).await;
    assert_fleet(&stack, &daemon, 2).await;
    let snapshot = daemon.registry().snapshot();
    assert!(
        snapshot
            .workers()
            .iter()
            .all(|w| w.role == Role::Aggregated)
    );
    // Aggregated mockers publish kv-events too, one channel each.
    assert_eq!(snapshot.kv_event_publisher_count(), 2);
    // The etcd source deliberately skips `v1/event_sources/` (a read-only role granting the
    // three documented prefixes must suffice), so no publisher is joined to a worker here: the
    // worker comes from each payload's `worker_id` once subscribed.
    assert!(snapshot.publishers().iter().all(|p| p.worker.is_none()));
    daemon.shutdown().await;
    eprintln!("agg test took {:?}", started.elapsed());
}
