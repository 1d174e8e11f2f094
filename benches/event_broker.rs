//! The REAL `continuum-event-broker` binary on loopback (not a test: `cargo bench --bench
//! event_broker`, figures in docs/performance.md, "Event broker"):
//!
//! 1. relayed kv_metrics frames/s: a publisher (a TCP server writing ZMTP-framed `kv_metrics`
//!    messages as fast as the reader takes them) read by the router's `BusStream` through the
//!    broker (publisher → broker → TLS 1.3 + HTTP/2 → listener), against the same bytes read
//!    directly over TCP (`transport: direct`);
//! 2. relayed kv-events bytes/s: the same with ZMTP-framed `kv-events` batches (64 stored blocks
//!    each, 3,879 bytes), the shape a busy worker publishes;
//! 3. the broker's resident memory (VmRSS) with 1,024 idle streams open.
//!
//! The router side is the real event-bus listener in-process; DynamoWorkerMetadata comes from the
//! tests' fake Kubernetes API. Needs the openssl CLI. Prints one line per figure. Every wait has a
//! deadline ([`STEP_TIMEOUT`]), and the idle streams open [`OPEN_CONCURRENCY`] at a time, so a
//! stuck step fails with its name instead of hanging the run.

#![allow(clippy::too_many_lines, reason = "test code is exempt")]

#[path = "../tests/it/support/bus_pki.rs"]
mod bus_pki;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use continuum_actors::event_bus::{BusEntry, BusSettings, BusTls, EventBus};
use continuum_actors::tree::ActorTree;
use continuum_protocol::discovery::EventTopic;
use continuum_protocol::event_bus::credential::TokenHash;
use continuum_protocol::event_bus::message::{ClientId, Role, ZmqTcpTarget};
use continuum_protocol::event_bus::{Grant, SessionBounds};
use continuum_protocol::event_plane::encode::{encode_frames, encode_kv_metrics};
use continuum_protocol::event_plane::{ActiveLoad, EventEnvelope};
use continuum_protocol::ids::{DpRank, InstanceId, Namespace, PublisherId};
use continuum_protocol::kv::events::{
    Bounded, KvCacheEvent, KvCacheEventData, KvCacheStoreData, RouterEvent, StorageTier,
    StoredBlock,
};
use continuum_protocol::kv::{ExternalBlockHash, LocalBlockHash, encode_router_events};
use continuum_protocol::time::UnixMillis;
use continuum_protocol::zmtp::publisher::encode_message;
use futures::StreamExt as _;
use serde_json::json;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

#[allow(unused_imports)]
#[path = "../tests/it/support/fake_kube.rs"]
mod fake_kube;

const TOKEN: &str = "bench-broker-token";
const NS: &str = "dynamo";
/// kv_metrics messages per throughput run (about 20 MB).
const METRICS_MESSAGES: usize = 100_000;
/// kv-events messages per throughput run (about 78 MB).
const EVENTS_MESSAGES: usize = 20_000;
/// Stored blocks per kv-events message.
const EVENTS_BLOCKS: u64 = 64;
/// Runs per figure (the median is printed).
const RUNS: usize = 5;
const IDLE_STREAMS: usize = 1024;
/// `max_session_buffer_bytes` of the listener: the default 64 MiB, or this environment
/// variable's value (to see how the per-stream window, buffer / streams / 4, bounds throughput).
const SESSION_BUFFER_ENV: &str = "EVENT_BROKER_BENCH_SESSION_BUFFER_BYTES";
/// Idle streams being opened at once.
const OPEN_CONCURRENCY: usize = 32;
/// The longest any one step (a run, a stream open, the broker's session) may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(60);

/// One ZMTP-framed kv_metrics message, as a publisher writes it.
fn metrics_message() -> Vec<u8> {
    let load = ActiveLoad {
        worker_id: InstanceId(0x1234_5678),
        dp_rank: DpRank(0),
        active_decode_blocks: Some(12),
        active_prefill_tokens: Some(345),
        kv_used_blocks: Some(67),
    };
    let mut out = Vec::new();
    encode_message(
        &encode_kv_metrics(PublisherId(0x1234_5678), 1, UnixMillis(1), &load),
        &mut out,
    );
    out
}

/// One ZMTP-framed kv-events message: a batch storing [`EVENTS_BLOCKS`] blocks.
fn events_message() -> Vec<u8> {
    let blocks = (0..EVENTS_BLOCKS)
        .map(|i| StoredBlock {
            block_hash: ExternalBlockHash(0x9e37_79b9_7f4a_7c15 ^ i),
            tokens_hash: LocalBlockHash(0x5851_f42d_4c95_7f2d ^ i),
            mm_extra_info: None,
        })
        .collect();
    let batch = [RouterEvent {
        worker_id: InstanceId(0x1234_5678),
        storage_tier: StorageTier::Device,
        residency_domain: None,
        event: KvCacheEvent {
            event_id: 1,
            data: KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: Some(ExternalBlockHash(7)),
                start_position: None,
                blocks: Bounded(blocks),
            }),
            dp_rank: DpRank(0),
        },
        session_id: None,
    }];
    let payload = encode_router_events(&batch);
    let frames = encode_frames(&EventEnvelope {
        publisher_id: PublisherId(0x1234_5679),
        sequence: 1,
        published_at: UnixMillis(1),
        topic: "kv-events",
        payload: &payload,
    });
    let mut out = Vec::new();
    encode_message(&frames, &mut out);
    out
}

/// A publisher on `0.0.0.0:port`: every connection gets `count` copies of `payload` (0: none,
/// the connection stays idle until the peer closes it).
async fn publisher(payload: Vec<u8>, count: usize) -> (u16, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("0.0.0.0:0")
        .await
        .expect("bind publisher");
    let port = listener.local_addr().expect("addr").port();
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut tcp, _)) = listener.accept().await else {
                return;
            };
            let payload = payload.clone();
            tokio::spawn(async move {
                let batch: Vec<u8> = payload.repeat(64);
                let mut left = count;
                while left >= 64 {
                    if tcp.write_all(&batch).await.is_err() {
                        return;
                    }
                    left -= 64;
                }
                for _ in 0..left {
                    if tcp.write_all(&payload).await.is_err() {
                        return;
                    }
                }
                // Hold the connection (idle streams) until the reader goes.
                let mut sink = [0u8; 256];
                while matches!(tcp.read(&mut sink).await, Ok(n) if n > 0) {}
            });
        }
    });
    (port, task)
}

fn target(host: &str, port: u16) -> ZmqTcpTarget {
    ZmqTcpTarget {
        namespace: Namespace::new(NS),
        host: host.into(),
        port,
    }
}

/// Host `i` of the idle-stream targets: 127.0.x.y (all loopback, one listener on 0.0.0.0).
fn idle_host(i: usize) -> String {
    format!("127.0.{}.{}", i / 250, i % 250 + 1)
}

/// DynamoWorkerMetadata advertising `targets` (host, port, topic; 256 channels per resource).
fn advertise(kube: &fake_kube::FakeKube, targets: &[(String, u16, &str)]) {
    for (chunk_index, chunk) in targets.chunks(256).enumerate() {
        let mut channels = serde_json::Map::new();
        for (i, (host, port, topic)) in chunk.iter().enumerate() {
            let publisher = 0x1000 + chunk_index * 256 + i;
            channels.insert(
                format!("namespace/{NS}/component/backend/endpoint/generate/topic/{topic}/{publisher:x}"),
                json!({"type": "EventChannel", "scope": {"kind": "endpoint", "endpoint":
                       {"namespace": NS, "component": "backend", "name": "generate"}},
                       "topic": topic, "instance_id": publisher,
                       "transport": {"kind": "Zmq", "config": {"endpoint": format!("tcp://{host}:{port}")}}}),
            );
        }
        kube.apply(
            fake_kube::Kind::Metadata,
            json!({"metadata": {"name": format!("worker-{chunk_index}"), "namespace": "dynamo"},
                   "spec": {"data": {"event_channels": channels}}}),
        );
    }
}

/// Reads exactly `bytes` bytes; the time it took.
async fn read_all(
    what: &str,
    mut reader: impl tokio::io::AsyncRead + Unpin,
    bytes: usize,
) -> Duration {
    let started = Instant::now();
    let read = async {
        let mut buf = vec![0u8; 64 * 1024];
        let mut got = 0;
        while got < bytes {
            let n = reader.read(&mut buf).await.expect("read");
            assert!(
                n > 0,
                "{what}: the stream ended after {got} of {bytes} bytes"
            );
            got += n;
        }
    };
    tokio::time::timeout(STEP_TIMEOUT, read)
        .await
        .unwrap_or_else(|_| panic!("{what}: {bytes} bytes not read within {STEP_TIMEOUT:?}"));
    started.elapsed()
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(run());
}

/// Median time of `RUNS` reads of `count` copies of `message` from `port`, directly over TCP and
/// through the broker; prints messages/s and bytes/s of both.
async fn throughput(
    bus: &EventBus,
    name: &str,
    topic: EventTopic,
    port: u16,
    message: &[u8],
    count: usize,
) {
    let bytes = count * message.len();
    let mut direct = Vec::new();
    let mut relayed = Vec::new();
    for run in 0..RUNS {
        let tcp = tokio::time::timeout(STEP_TIMEOUT, TcpStream::connect(("127.0.0.1", port)))
            .await
            .expect("direct connect in time")
            .expect("direct connect");
        direct.push(read_all(&format!("{name} direct run {run}"), tcp, bytes).await);
        let stream = tokio::time::timeout(
            STEP_TIMEOUT,
            bus.open_stream(target("127.0.0.1", port), topic),
        )
        .await
        .unwrap_or_else(|_| panic!("{name}: a stream through the broker within {STEP_TIMEOUT:?}"))
        .expect("a stream through the broker");
        relayed.push(read_all(&format!("{name} relayed run {run}"), stream, bytes).await);
    }
    let median = |times: &mut Vec<Duration>| {
        times.sort();
        times[times.len() / 2].as_secs_f64()
    };
    let (d, r) = (median(&mut direct), median(&mut relayed));
    println!(
        "event_broker/{name}  {count} messages of {} bytes ({:.1} MB) per run, median of {RUNS}",
        message.len(),
        bytes as f64 / 1e6
    );
    println!(
        "event_broker/{name}/direct_tcp      {:>10.0} msgs/s  {:>8.1} MB/s",
        count as f64 / d,
        bytes as f64 / d / 1e6
    );
    println!(
        "event_broker/{name}/through_broker  {:>10.0} msgs/s  {:>8.1} MB/s  ({:.2}x direct)",
        count as f64 / r,
        bytes as f64 / r / 1e6,
        d / r
    );
}

async fn run() {
    let session_buffer: u64 = std::env::var(SESSION_BUFFER_ENV)
        .ok()
        .map(|v| v.parse().expect("a byte count"))
        .unwrap_or(64 * 1024 * 1024);
    println!(
        "event_broker: max_session_buffer_bytes {session_buffer}, {IDLE_STREAMS} streams per session"
    );
    // The tests' PKI (a CA and the listener's certificate for localhost) from the openssl CLI.
    let pki = bus_pki::pki();
    let dir = pki._dir.path().to_path_buf();
    std::fs::write(dir.join("token"), TOKEN).expect("token");
    let settings = BusSettings {
        enabled: true,
        listen: "127.0.0.1:0".parse().expect("addr"),
        tls: Some(BusTls {
            cert: dir.join("server.pem"),
            key: dir.join("server.key"),
            client_ca: None,
        }),
        entries: vec![BusEntry {
            grant: Grant {
                id: ClientId::new("broker-a.dynamo"),
                role: Role::Broker,
                namespaces: [Namespace::new(NS)].into_iter().collect(),
                backends: Default::default(),
            },
            token_hash: Some(TokenHash::of_token(TOKEN.as_bytes())),
        }],
        max_sessions: 4,
        bounds: SessionBounds::new(session_buffer, IDLE_STREAMS as u32).expect("bounds"),
        heartbeat_interval: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(30),
        hello_timeout: BusSettings::HELLO_TIMEOUT,
    };
    let bus = EventBus::new(settings, None);
    let (root, _) = continuum_actors::supervisor::spawn_root(
        vec![continuum_actors::event_bus::event_bus_spec(bus.clone())],
        ActorTree::default(),
        None,
    )
    .await
    .expect("root");
    let mut ticks = tokio::time::interval(Duration::from_millis(5));
    let addr: SocketAddr = loop {
        if let Some(addr) = bus.local_addr() {
            break addr;
        }
        ticks.tick().await;
    };

    let (metrics_port, _metrics) = publisher(metrics_message(), METRICS_MESSAGES).await;
    let (events_port, _events) = publisher(events_message(), EVENTS_MESSAGES).await;
    let (idle_port, _idle) = publisher(Vec::new(), 0).await;
    let mut targets = vec![
        ("127.0.0.1".to_owned(), metrics_port, "kv_metrics"),
        ("127.0.0.1".to_owned(), events_port, "kv-events"),
    ];
    targets.extend((0..IDLE_STREAMS).map(|i| (idle_host(i), idle_port, "kv_metrics")));
    let kube = fake_kube::FakeKube::start().await;
    advertise(&kube, &targets);

    let mut broker = Command::new(env!("CARGO_BIN_EXE_continuum-event-broker"))
        .args(["--bus-url", &format!("https://{addr}")])
        .args([
            "--server-name",
            "localhost",
            "--client-id",
            "broker-a.dynamo",
        ])
        .arg("--token-file")
        .arg(dir.join("token"))
        .arg("--ca-file")
        .arg(dir.join("ca.pem"))
        .args(["--dynamo-namespace", NS, "--kubernetes-namespace", "dynamo"])
        .args([
            "--kubernetes-api-url",
            &kube.url(),
            "--listen",
            "127.0.0.1:0",
        ])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("the broker binary (cargo bench builds it)");
    let pid = broker.id();
    let deadline = Instant::now() + STEP_TIMEOUT;
    while bus.session_count() == 0 {
        assert!(
            Instant::now() < deadline,
            "the broker connects within {STEP_TIMEOUT:?}"
        );
        ticks.tick().await;
    }

    throughput(
        &bus,
        "kv_metrics",
        EventTopic::KvMetrics,
        metrics_port,
        &metrics_message(),
        METRICS_MESSAGES,
    )
    .await;
    throughput(
        &bus,
        "kv-events",
        EventTopic::KvEvents,
        events_port,
        &events_message(),
        EVENTS_MESSAGES,
    )
    .await;

    // The default bounds (64 MiB, 1,024 streams per session): the throughput runs' streams were
    // dropped long before (the session frees their slots in order), so all 1,024 slots are free.
    let idle_before = rss_kib(pid);
    let started = Instant::now();
    let open: Vec<_> = futures::stream::iter(0..IDLE_STREAMS)
        .map(|i| {
            let bus = bus.clone();
            async move {
                tokio::time::timeout(
                    STEP_TIMEOUT,
                    bus.open_stream(target(&idle_host(i), idle_port), EventTopic::KvMetrics),
                )
                .await
                .unwrap_or_else(|_| panic!("idle stream {i} not open within {STEP_TIMEOUT:?}"))
                .unwrap_or_else(|e| panic!("idle stream {i}: {e:?}"))
            }
        })
        .buffer_unordered(OPEN_CONCURRENCY)
        .collect()
        .await;
    // Each stream resolved once the broker had dialled its publisher and opened the data
    // stream: every relay is running now.
    let idle_after = rss_kib(pid);
    println!(
        "event_broker/rss  {} KiB before, {} KiB with {} idle streams ({:.1} MiB; opened in {:.1} s)",
        idle_before,
        idle_after,
        open.len(),
        idle_after as f64 / 1024.0,
        started.elapsed().as_secs_f64()
    );
    drop(open);
    let _ = broker.kill();
    let _ = broker.wait();
    root.stop(None);
}
