//! The event-bus tunnel end to end with the REAL `continuum-event-broker` binary: routers
//! (in-process daemons on file discovery) with `dynamo.load.transport: broker` and the event-bus
//! listener on, brokers started as child processes against the fake Kubernetes API
//! (DynamoWorkerMetadata advertising the publishers) and real libzmq (pyzmq XPUB) publishers.
//!
//! * direct and broker transport reach identical load-store and KV-index state from the same
//!   messages (late sequences, foreign publisher ids, removals, gaps), and the same event counts;
//! * SIGKILL of the broker leaves the subscriptions pending and selections `round_robin_stale`;
//!   a new broker restores `load` selections;
//! * a publisher missing from DynamoWorkerMetadata is refused with `target_not_advertised` while
//!   advertised ones connect;
//! * two brokers split the streams as rendezvous placement predicts, and a SIGKILL of one moves
//!   its streams to the other;
//! * SIGTERM drains: the broker sends `draining`, ends its streams and exits 0 within 10 s.
//!
//! Certificates come from the openssl CLI (`support::bus_pki`).
#![cfg(feature = "real-peers")]

use crate::support;

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use continuum_actors::load::metrics::LoadEventResult;
use continuum_protocol::discovery::EventTopic;
use continuum_protocol::discovery::file_store::{BUCKETS, encode_file_name};
use continuum_protocol::discovery::registration::{Registration, WorkerType};
use continuum_protocol::event_bus::message::{ClientId, ZmqTcpTarget};
use continuum_protocol::event_bus::rendezvous;
use continuum_protocol::event_plane::EventEnvelope;
use continuum_protocol::event_plane::encode::encode_frames;
use continuum_protocol::ids::{DpRank, InstanceId, Namespace, PublisherId};
use continuum_protocol::kv::events::{
    Bounded, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData, RouterEvent,
    StorageTier, StoredBlock,
};
use continuum_protocol::kv::{ExternalBlockHash, LocalBlockHash, encode_router_events};
use continuum_protocol::time::UnixMillis;
use continuum_router::daemon::Daemon;
use serde_json::{Value, json};
use support::broker::{Broker, BrokerArgs};
use support::bus_pki::{Pki, pki};
use support::fake_kube::{FakeKube, Kind};
use support::zmq::{Publisher, make};

pub(crate) const WAIT: Duration = Duration::from_secs(30);
/// The Dynamo namespace of the fleet.
pub(crate) const NS: &str = "tunnelns";
/// The Kubernetes namespace the brokers watch.
const KUBE_NS: &str = "dynamo";
const BROKER_A: &str = "broker-a.dynamo";
const BROKER_B: &str = "broker-b.dynamo";
const ADMIN: &str = "tunnel-admin-token-0123";

pub(crate) fn token(id: &str) -> String {
    format!("token-of-{id}")
}

pub(crate) fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The fleet: workers in a Dynamo file store, their publishers, their DynamoWorkerMetadata

pub(crate) struct Worker {
    pub(crate) registration: Registration,
    pub(crate) publisher: Publisher,
    pub(crate) port: u16,
    /// The kv-events publisher (the first test only).
    pub(crate) kv: Option<(Publisher, u16)>,
}

impl Worker {
    pub(crate) fn id(&self) -> InstanceId {
        self.registration.instance_id
    }

    fn publisher_id(&self) -> PublisherId {
        self.registration.kv_metrics.0
    }

    fn target(&self) -> ZmqTcpTarget {
        ZmqTcpTarget {
            namespace: Namespace::new(NS),
            host: "127.0.0.1".into(),
            port: self.port,
        }
    }
}

pub(crate) async fn worker(index: u64) -> Worker {
    let mut publisher = Publisher::spawn().await;
    let port = publisher.bind("xpub", 0).await;
    let id = 0x7100_0000_0000 + index;
    Worker {
        registration: Registration {
            namespace: NS.into(),
            worker_type: WorkerType::Aggregated,
            instance_id: InstanceId(id),
            model: "tiny".into(),
            block_size: 16,
            total_kv_blocks: 1024,
            max_num_batched_tokens: 8192,
            data_parallel_size: 1,
            request_plane: "127.0.0.1:1".into(),
            kv_metrics: (
                PublisherId(id + 0x10_0000),
                format!("tcp://127.0.0.1:{port}"),
            ),
        },
        publisher,
        port,
        kv: None,
    }
}

/// The kv-events publisher id of a worker.
pub(crate) fn kv_publisher_id(w: &Worker) -> PublisherId {
    PublisherId(w.id().0 + 0x20_0000)
}

/// A second publisher for the worker's kv-events.
pub(crate) async fn with_kv_events(mut w: Worker) -> Worker {
    let mut publisher = Publisher::spawn().await;
    let port = publisher.bind("xpub", 0).await;
    w.kv = Some((publisher, port));
    w
}

/// The worker's kv-events EventChannel key and value, as 1.6.1 writes them.
fn kv_events_channel(w: &Worker) -> Option<(String, Value)> {
    let (_, port) = w.kv.as_ref()?;
    let comp = w.registration.worker_type.component();
    let publisher = kv_publisher_id(w);
    Some((
        format!(
            "v1/event_channels/namespace/{NS}/component/{comp}/endpoint/generate/topic/kv-events/{:x}",
            publisher.0
        ),
        json!({"type": "EventChannel", "scope": {"kind": "endpoint", "endpoint":
               {"namespace": NS, "component": comp, "name": "generate"}},
               "topic": "kv-events", "instance_id": publisher.0,
               "transport": {"kind": "Zmq", "config": {"endpoint": format!("tcp://127.0.0.1:{port}")}}}),
    ))
}

/// One kv-events message: `events` for the worker, rank 0.
pub(crate) fn kv_message(
    w: &Worker,
    sequence: u64,
    events: Vec<(u64, KvCacheEventData)>,
) -> [Vec<u8>; 4] {
    let batch: Vec<RouterEvent> = events
        .into_iter()
        .map(|(event_id, data)| RouterEvent {
            worker_id: w.id(),
            storage_tier: StorageTier::Device,
            residency_domain: None,
            event: KvCacheEvent {
                event_id,
                data,
                dp_rank: DpRank(0),
            },
            session_id: None,
        })
        .collect();
    let payload = encode_router_events(&batch);
    encode_frames(&EventEnvelope {
        publisher_id: kv_publisher_id(w),
        sequence,
        published_at: UnixMillis(1_796_028_060_991),
        topic: "kv-events",
        payload: &payload,
    })
}

pub(crate) fn stored(parent: Option<u64>, hashes: &[u64]) -> KvCacheEventData {
    KvCacheEventData::Stored(KvCacheStoreData {
        parent_hash: parent.map(ExternalBlockHash),
        start_position: None,
        blocks: Bounded(
            hashes
                .iter()
                .map(|h| StoredBlock {
                    block_hash: ExternalBlockHash(*h),
                    tokens_hash: LocalBlockHash(*h ^ 0x5a5a),
                    mm_extra_info: None,
                })
                .collect(),
        ),
    })
}

pub(crate) fn removed(hashes: &[u64]) -> KvCacheEventData {
    KvCacheEventData::Removed(KvCacheRemoveData {
        block_hashes: Bounded(hashes.iter().map(|h| ExternalBlockHash(*h)).collect()),
    })
}

/// Writes the worker's records into the file store both routers read.
pub(crate) fn register(root: &Path, worker: &Worker) {
    let mut records = worker.registration.records();
    if let Some((key, value)) = kv_events_channel(worker) {
        records.push((key, serde_json::to_vec(&value).expect("JSON")));
    }
    for (key, value) in records {
        let bucket = BUCKETS
            .iter()
            .find(|b| key.starts_with(&format!("{b}/")))
            .expect("key in a bucket");
        let dir = root.join(bucket);
        std::fs::create_dir_all(&dir).expect("bucket dir");
        std::fs::write(dir.join(encode_file_name(&key[bucket.len() + 1..])), value)
            .expect("write a record file");
    }
}

/// The worker's DynamoWorkerMetadata (the operator writes one per worker Pod): its event channel.
pub(crate) fn advertise(kube: &FakeKube, worker: &Worker) {
    let (key, value) = worker.registration.kv_metrics_channel_record();
    let suffix = key
        .strip_prefix("v1/event_channels/")
        .expect("channel key")
        .to_owned();
    let value: Value = serde_json::from_slice(&value).expect("channel JSON");
    let mut channels = serde_json::Map::new();
    channels.insert(suffix, value);
    if let Some((key, value)) = kv_events_channel(worker) {
        let suffix = key.strip_prefix("v1/event_channels/").expect("channel key");
        channels.insert(suffix.to_owned(), value);
    }
    let name = format!("worker-{:x}", worker.id().0);
    kube.apply(
        Kind::Metadata,
        json!({
            "metadata": {"name": name, "namespace": KUBE_NS},
            "spec": {"data": {"event_channels": channels}}
        }),
    );
}

// ---------------------------------------------------------------------------------------------
// Routers

pub(crate) fn router_yaml(root: &Path, bus: Option<(&Pki, &[&str])>) -> String {
    router_yaml_kv(root, bus, false)
}

pub(crate) fn router_yaml_kv(root: &Path, bus: Option<(&Pki, &[&str])>, kv: bool) -> String {
    let mut yaml = format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\nadmin:\n  enabled: true\n  token: {ADMIN}\n\
         disaggregated_serving:\n  enabled: true\n\
         backends:\n  - name: shim\n    type: openai\n    url: \"http://127.0.0.1:9\"\n    \
         models: [tiny]\n    health_check: {{enabled: false}}\n\
         dynamo:\n  enabled: true\n  discovery:\n    source: file\n    file:\n      \
         root: {root:?}\n      namespace: {NS}\n      rescan_interval: 100ms\n      ttl: 600s\n  \
         shim:\n    backends: [shim]\n  kv:\n    enabled: {kv}\n"
    );
    match bus {
        None => yaml.push_str(
            "  load:\n    transport: direct\n    max_staleness: 2s\n    \
             direct_allow_cidrs: [\"127.0.0.0/8\"]\n",
        ),
        Some((pki, brokers)) => {
            yaml.push_str(&format!(
                "  load:\n    transport: broker\n    max_staleness: 2s\n  event_bus:\n    \
                 enabled: true\n    listen: \"127.0.0.1:0\"\n    tls:\n      cert: {:?}\n      \
                 key: {:?}\n    brokers:\n",
                pki.server.0, pki.server.1
            ));
            for id in brokers {
                let digest = sha256_hex(token(id).as_bytes());
                yaml.push_str(&format!(
                    "      - id: {id}\n        token_hash: \"sha256:{digest}\"\n        \
                     namespaces: [{NS}]\n"
                ));
            }
        }
    }
    yaml
}

pub(crate) async fn poll<T>(what: &str, probe: impl AsyncFnMut() -> Option<T>) -> T {
    poll_for(WAIT, what, probe).await
}

pub(crate) async fn poll_for<T>(
    limit: Duration,
    what: &str,
    mut probe: impl AsyncFnMut() -> Option<T>,
) -> T {
    let deadline = Instant::now() + limit;
    let mut ticks = tokio::time::interval(Duration::from_millis(50));
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        assert!(Instant::now() < deadline, "{what} within {limit:?}");
        ticks.tick().await;
    }
}

pub(crate) fn bus_addr(daemon: &Daemon) -> Option<SocketAddr> {
    daemon.event_bus().local_addr()
}

/// (state, transport, broker) of each subscription, by publisher id.
fn subscriptions(daemon: &Daemon) -> Vec<(String, &'static str, Option<String>)> {
    let mut subs: Vec<_> = daemon
        .load_store()
        .subscriptions()
        .into_iter()
        .map(|s| (s.publisher_id, s.state, s.broker))
        .collect();
    subs.sort();
    subs
}

fn all_connected(daemon: &Daemon, n: usize) -> bool {
    let subs = subscriptions(daemon);
    subs.len() == n && subs.iter().all(|(_, state, _)| *state == "connected")
}

/// Decode selections by `reason`, summed over roles.
fn selections(daemon: &Daemon, reason: &str) -> f64 {
    ["decode", "prefill", "aggregated"]
        .iter()
        .filter_map(|role| {
            daemon.metrics().value(
                "continuum_dynamo_selection_total",
                &[("role", role), ("reason", reason)],
            )
        })
        .sum()
}

/// Makes one Dynamo decision and returns which selection reasons it counted.
fn decide(daemon: &Daemon) -> Vec<&'static str> {
    let reasons = ["load", "round_robin_stale", "round_robin"];
    let before: Vec<f64> = reasons.iter().map(|r| selections(daemon, r)).collect();
    let shim = daemon.shim().expect("the shim path is installed");
    let body = br#"{"model":"tiny","messages":[{"role":"user","content":"hi"}]}"#;
    let decision = shim.decide("tiny", body, &["shim".to_owned()], |_| true);
    assert!(decision.is_some(), "a Dynamo decision");
    reasons
        .iter()
        .zip(before)
        .filter(|(r, b)| selections(daemon, r) > *b)
        .map(|(r, _)| *r)
        .collect()
}

/// One fresh kv_metrics sample from every worker.
async fn send_fresh(workers: &mut [Worker], sequence: &mut u64) {
    for w in workers.iter_mut() {
        let (p, id) = (w.publisher_id(), w.id());
        w.publisher.send(&[make(p, *sequence, id, 5)]).await;
    }
    *sequence += 1;
}

// ---------------------------------------------------------------------------------------------
// The broker binary

/// The real broker `id` for the fleet's namespace, watching the fake API's `dynamo` namespace.
pub(crate) async fn spawn_broker(id: &str, bus: SocketAddr, pki: &Pki, kube: &FakeKube) -> Broker {
    Broker::spawn(BrokerArgs {
        id,
        token: &token(id),
        bus,
        ca: &pki.ca,
        dynamo_namespace: NS,
        kubernetes_namespace: KUBE_NS,
        kube,
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// Tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_and_broker_transport_reach_the_same_load_and_kv_index_state() {
    let pki = pki();
    let store = tempfile::tempdir().expect("store");
    let kube = FakeKube::start().await;
    let mut workers = Vec::new();
    for i in 0..3 {
        let w = with_kv_events(worker(i).await).await;
        register(store.path(), &w);
        advertise(&kube, &w);
        workers.push(w);
    }
    let direct = support::daemon::start(&router_yaml_kv(store.path(), None, true)).await;
    let tunnel = support::daemon::start(&router_yaml_kv(
        store.path(),
        Some((&pki, &[BROKER_A])),
        true,
    ))
    .await;
    let bus = poll("the bus listens", async || bus_addr(&tunnel)).await;
    let broker = spawn_broker(BROKER_A, bus, &pki, &kube).await;

    // Each publisher sees two subscribers: the direct router and the broker's relay.
    for w in &mut workers {
        assert_eq!(w.publisher.await_subscriptions(2).await.len(), 2);
        let (kv, _) = w.kv.as_mut().expect("kv publisher");
        assert_eq!(kv.await_subscriptions(2).await.len(), 2);
    }
    poll("both routers connected", async || {
        (all_connected(&direct, 6) && all_connected(&tunnel, 6)).then_some(())
    })
    .await;

    // kv-events: stores, a removal, a repeated event id, a gap (event ids 4..8 missing), and the
    // stores after it; the same bytes to both routers.
    for w in &mut workers {
        let messages = [
            kv_message(w, 0, vec![(1, stored(None, &[11, 12, 13]))]),
            kv_message(w, 1, vec![(2, stored(Some(13), &[14, 15]))]),
            kv_message(w, 2, vec![(3, removed(&[15]))]),
            kv_message(w, 3, vec![(3, removed(&[14]))]),
            kv_message(w, 4, vec![(9, stored(None, &[21, 22]))]),
            kv_message(w, 5, vec![(10, stored(Some(22), &[23]))]),
        ];
        let (kv, _) = w.kv.as_mut().expect("kv publisher");
        kv.send(&messages).await;
    }
    let kv_counts = |d: &Daemon| -> Vec<(&'static str, f64)> {
        continuum_actors::kv_index::metrics::KvEventResult::ALL
            .iter()
            .map(|r| {
                let v = d
                    .metrics()
                    .value(
                        "continuum_dynamo_kv_events_total",
                        &[("result", r.as_label())],
                    )
                    .unwrap_or(0.0);
                (r.as_label(), v)
            })
            .collect()
    };
    let kv_total = |d: &Daemon| kv_counts(d).iter().map(|(_, v)| v).sum::<f64>();
    poll("both routers counted every kv-event", async || {
        (kv_total(&direct) >= 18.0 && kv_total(&tunnel) == kv_total(&direct)).then_some(())
    })
    .await;
    let mut direct_blocks = direct.kv_index().rank_blocks();
    let mut tunnel_blocks = tunnel.kv_index().rank_blocks();
    direct_blocks.sort();
    tunnel_blocks.sort();
    assert_eq!(direct_blocks, tunnel_blocks, "the same KV index");
    assert_eq!(kv_counts(&direct), kv_counts(&tunnel));
    assert!(
        !tunnel_blocks.is_empty(),
        "blocks indexed through the tunnel"
    );
    assert!(
        subscriptions(&tunnel)
            .iter()
            .all(|(_, _, b)| b.as_deref() == Some(BROKER_A)),
        "{:?}",
        subscriptions(&tunnel)
    );

    // The same messages to both: samples, a foreign publisher id, a late sequence, a gap, and
    // the samples after it.
    for (i, w) in workers.iter_mut().enumerate() {
        let (p, id, base) = (w.publisher_id(), w.id(), 10 * i as u64);
        w.publisher
            .send(&[
                make(p, 1, id, base + 1),
                make(PublisherId(0xf0e1), 2, id, 999),
                make(p, 2, id, base + 2),
                make(p, 3, id, base + 3),
                make(p, 2, id, 777),
                make(p, 9, id, base + 9),
                make(p, 10, id, base + 10),
            ])
            .await;
    }
    let last = |d: &Daemon, w: &Worker| {
        d.load_store()
            .latest(w.id(), DpRank(0))
            .is_some_and(|s| s.sequence == 10)
    };
    poll("both routers saw every message", async || {
        workers
            .iter()
            .all(|w| last(&direct, w) && last(&tunnel, w))
            .then_some(())
    })
    .await;
    for w in &workers {
        let a = direct
            .load_store()
            .latest(w.id(), DpRank(0))
            .expect("sample");
        let b = tunnel
            .load_store()
            .latest(w.id(), DpRank(0))
            .expect("sample");
        assert_eq!(
            (a.load, a.publisher_id, a.sequence, a.published_at),
            (b.load, b.publisher_id, b.sequence, b.published_at),
        );
        assert_eq!(a.load.kv_used_blocks, Some(10 * (w.id().0 & 0xff) + 10));
    }
    let counts = |d: &Daemon| -> Vec<(&'static str, f64)> {
        LoadEventResult::ALL
            .iter()
            .map(|r| {
                let v = d
                    .metrics()
                    .value(
                        "continuum_dynamo_load_events_total",
                        &[("result", r.as_label())],
                    )
                    .unwrap_or(0.0);
                (r.as_label(), v)
            })
            .collect()
    };
    assert_eq!(counts(&direct), counts(&tunnel));
    let mismatches = counts(&tunnel)
        .into_iter()
        .find(|(r, _)| *r == "identity_mismatch")
        .map(|(_, v)| v);
    assert_eq!(mismatches, Some(3.0), "one foreign publisher id per worker");

    // The broker counted the relayed bytes.
    assert!(
        broker
            .value("continuum_event_broker_relayed_bytes_total{direction=\"to_router\"}")
            .await
            > 0.0
    );
    // Six relays: kv_metrics and kv-events of each worker.
    assert_eq!(broker.value("continuum_event_broker_streams").await, 6.0);
    assert_eq!(broker.value("continuum_event_broker_sessions").await, 1.0);
    direct.shutdown().await;
    tunnel.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_broker_leaves_subscriptions_pending_and_a_new_one_restores_load_selection() {
    let pki = pki();
    let store = tempfile::tempdir().expect("store");
    let kube = FakeKube::start().await;
    let mut workers = Vec::new();
    for i in 0..2 {
        let w = worker(10 + i).await;
        register(store.path(), &w);
        advertise(&kube, &w);
        workers.push(w);
    }
    let tunnel =
        support::daemon::start(&router_yaml(store.path(), Some((&pki, &[BROKER_A])))).await;
    let bus = poll("the bus listens", async || bus_addr(&tunnel)).await;
    let mut broker = spawn_broker(BROKER_A, bus, &pki, &kube).await;

    // Fresh samples through the tunnel: selections are load-based.
    let mut sequence = 1;
    poll("load selections through the broker", async || {
        send_fresh(&mut workers, &mut sequence).await;
        (decide(&tunnel) == ["load"]).then_some(())
    })
    .await;

    // SIGKILL: the session ends, the subscriptions go pending (never direct), samples age out
    // and the decode pick falls back to round-robin over stale load.
    broker.kill().await;
    poll("pending after the broker died", async || {
        let subs = subscriptions(&tunnel);
        (subs.len() == 2 && subs.iter().all(|(_, state, _)| *state == "pending")).then_some(())
    })
    .await;
    poll("round_robin_stale selections", async || {
        (decide(&tunnel) == ["round_robin_stale"]).then_some(())
    })
    .await;

    // A new broker: the subscriptions reconnect through it and load selection is back.
    let _broker = spawn_broker(BROKER_A, bus, &pki, &kube).await;
    poll("connected again", async || {
        all_connected(&tunnel, 2).then_some(())
    })
    .await;
    poll("load selections again", async || {
        send_fresh(&mut workers, &mut sequence).await;
        (decide(&tunnel) == ["load"]).then_some(())
    })
    .await;
    tunnel.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unadvertised_publisher_is_refused_while_advertised_ones_connect() {
    let pki = pki();
    let store = tempfile::tempdir().expect("store");
    let kube = FakeKube::start().await;
    let advertised = worker(20).await;
    let hidden = worker(21).await;
    register(store.path(), &advertised);
    register(store.path(), &hidden);
    advertise(&kube, &advertised);
    let tunnel =
        support::daemon::start(&router_yaml(store.path(), Some((&pki, &[BROKER_A])))).await;
    let bus = poll("the bus listens", async || bus_addr(&tunnel)).await;
    let broker = spawn_broker(BROKER_A, bus, &pki, &kube).await;

    let state_of = |w: &Worker| {
        subscriptions(&tunnel)
            .into_iter()
            .find(|(p, _, _)| *p == w.publisher_id().0.to_string())
            .map(|(_, s, _)| s)
    };
    poll("the advertised publisher connects", async || {
        (state_of(&advertised) == Some("connected")).then_some(())
    })
    .await;
    let refused = "continuum_event_broker_refusals_total{reason=\"target_not_advertised\"}";
    poll("the broker refuses the unadvertised one", async || {
        (broker.value(refused).await >= 1.0).then_some(())
    })
    .await;
    poll("the router saw target_not_advertised", async || {
        tunnel
            .metrics()
            .value(
                "continuum_dynamo_event_bus_stream_closes_total",
                &[("reason", "target_not_advertised")],
            )
            .filter(|v| *v >= 1.0)
    })
    .await;
    assert_ne!(state_of(&hidden), Some("connected"));
    assert_eq!(broker.value("continuum_event_broker_streams").await, 1.0);
    // The probes the manifests use are the binary's real paths.
    for path in ["/health", "/ready"] {
        let response = reqwest::get(format!("http://{}{path}", broker.probe))
            .await
            .expect("probe");
        assert_eq!(response.status().as_u16(), 200, "{path}");
    }

    // Advertising it (the operator writes its metadata) lets the next attempt through (after
    // the subscription's backoff, which refusals raised towards its 30 s ceiling).
    advertise(&kube, &hidden);
    poll_for(
        Duration::from_secs(60),
        "the newly advertised publisher connects",
        async || (state_of(&hidden) == Some("connected")).then_some(()),
    )
    .await;
    tunnel.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_brokers_split_streams_by_rendezvous_and_one_takes_over_after_a_sigkill() {
    let pki = pki();
    let store = tempfile::tempdir().expect("store");
    let kube = FakeKube::start().await;
    let mut workers = Vec::new();
    for i in 0..6 {
        let w = worker(30 + i).await;
        advertise(&kube, &w);
        workers.push(w);
    }
    let tunnel = support::daemon::start(&router_yaml(
        store.path(),
        Some((&pki, &[BROKER_A, BROKER_B])),
    ))
    .await;
    let bus = poll("the bus listens", async || bus_addr(&tunnel)).await;
    let mut a = spawn_broker(BROKER_A, bus, &pki, &kube).await;
    let b = spawn_broker(BROKER_B, bus, &pki, &kube).await;
    poll("both sessions live", async || {
        (tunnel.event_bus().session_count() == 2).then_some(())
    })
    .await;
    // The workers register once both brokers are live, so every stream is placed with both
    // sessions to choose from.
    for w in &workers {
        register(store.path(), w);
    }
    poll("all connected", async || {
        all_connected(&tunnel, 6).then_some(())
    })
    .await;

    // Rendezvous: each stream is on the broker with the higher weight for its target.
    let expected = |w: &Worker| {
        let key = rendezvous::zmq_key(&w.target(), EventTopic::KvMetrics);
        let (wa, wb) = (
            rendezvous::weight(&key, &ClientId::new(BROKER_A)),
            rendezvous::weight(&key, &ClientId::new(BROKER_B)),
        );
        if wa >= wb { BROKER_A } else { BROKER_B }
    };
    let placed = |w: &Worker| {
        subscriptions(&tunnel)
            .into_iter()
            .find(|(p, _, _)| *p == w.publisher_id().0.to_string())
            .and_then(|(_, _, b)| b)
    };
    let mut on_b = 0;
    for w in &workers {
        assert_eq!(
            placed(w).as_deref(),
            Some(expected(w)),
            "rendezvous placement"
        );
        on_b += usize::from(expected(w) == BROKER_B);
    }
    assert_eq!(
        a.value("continuum_event_broker_streams").await,
        (6 - on_b) as f64
    );
    assert_eq!(b.value("continuum_event_broker_streams").await, on_b as f64);

    // Failover: SIGKILL A; every stream ends up on B.
    a.kill().await;
    poll("every subscription on B", async || {
        let subs = subscriptions(&tunnel);
        (subs.len() == 6
            && subs
                .iter()
                .all(|(_, s, b)| *s == "connected" && b.as_deref() == Some(BROKER_B)))
        .then_some(())
    })
    .await;
    assert_eq!(b.value("continuum_event_broker_streams").await, 6.0);
    tunnel.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_and_exits_cleanly_within_ten_seconds() {
    let pki = pki();
    let store = tempfile::tempdir().expect("store");
    let kube = FakeKube::start().await;
    let w = worker(40).await;
    register(store.path(), &w);
    advertise(&kube, &w);
    let tunnel =
        support::daemon::start(&router_yaml(store.path(), Some((&pki, &[BROKER_A])))).await;
    let bus = poll("the bus listens", async || bus_addr(&tunnel)).await;
    let mut broker = spawn_broker(BROKER_A, bus, &pki, &kube).await;
    poll("connected", async || {
        all_connected(&tunnel, 1).then_some(())
    })
    .await;

    let pid = broker.child.id().expect("pid").to_string();
    let started = Instant::now();
    let status = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill -TERM");
    assert!(status.success());
    let exit = tokio::time::timeout(Duration::from_secs(10), broker.child.wait())
        .await
        .expect("the broker exits within 10 s of SIGTERM")
        .expect("exit status");
    assert!(exit.success(), "clean exit: {exit:?}");
    let _ = started;
    poll("the router saw the stream end with draining", async || {
        tunnel
            .metrics()
            .value(
                "continuum_dynamo_event_bus_stream_closes_total",
                &[("reason", "draining")],
            )
            .filter(|v| *v >= 1.0)
    })
    .await;
    poll("pending after the drain", async || {
        let subs = subscriptions(&tunnel);
        (subs.len() == 1 && subs[0].1 == "pending").then_some(())
    })
    .await;
    tunnel.shutdown().await;
}

/// Issue #13: "a router that is restarted is redialed by every broker within its backoff
/// ceiling". Two brokers hold sessions; the router stops, both brokers lose their sessions and
/// back off; a new router on the same listener port is redialled by both within the 30 s
/// ceiling (plus slack for the connect and the hello).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_router_is_redialled_by_every_broker_within_the_backoff_ceiling() {
    let pki = pki();
    let store = tempfile::tempdir().expect("store");
    let kube = FakeKube::start().await;
    let w = worker(50).await;
    register(store.path(), &w);
    advertise(&kube, &w);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let yaml = router_yaml(store.path(), Some((&pki, &[BROKER_A, BROKER_B]))).replace(
        "listen: \"127.0.0.1:0\"",
        &format!("listen: \"127.0.0.1:{port}\""),
    );
    let first = support::daemon::start(&yaml).await;
    let bus = poll("the bus listens", async || bus_addr(&first)).await;
    assert_eq!(bus.port(), port);
    let brokers = [
        spawn_broker(BROKER_A, bus, &pki, &kube).await,
        spawn_broker(BROKER_B, bus, &pki, &kube).await,
    ];
    poll("both brokers are welcomed", async || {
        (first.event_bus().session_count() == 2).then_some(())
    })
    .await;
    first.shutdown().await;
    for broker in &brokers {
        poll("the broker lost its session", async || {
            (broker.value("continuum_event_broker_sessions").await == 0.0).then_some(())
        })
        .await;
    }
    let second = support::daemon::start(&yaml).await;
    let back = poll("the new router listens", async || bus_addr(&second)).await;
    assert_eq!(back.port(), port, "the same listener port");
    let ceiling = crate::dynamo_broker_tunnel::REDIAL_CEILING + Duration::from_secs(5);
    poll_for(
        ceiling,
        "every broker redialled the restarted router",
        async || (second.event_bus().session_count() == 2).then_some(()),
    )
    .await;
    for broker in &brokers {
        assert_eq!(broker.value("continuum_event_broker_sessions").await, 1.0);
    }
    second.shutdown().await;
}

/// The brokers' redial ceiling (`continuum_event_broker::agent::REDIAL.max`).
pub(crate) const REDIAL_CEILING: Duration = continuum_event_broker::agent::REDIAL.max;
