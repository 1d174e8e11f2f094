//! kv_metrics messages relayed through one event-bus data stream vs direct TCP on loopback.
//!
//! Both groups move the same ZMTP-framed `kv_metrics` message (as a publisher writes it) from a
//! producer to a consumer, 1,000 messages per iteration, reported as messages per second:
//! - `direct_tcp`: a loopback `TcpStream` pair (what `transport: direct` reads);
//! - `bus_stream`: an agent's `POST /bus/v1/streams/{id}` request body (TLS 1.3 + HTTP/2, the
//!   listener's exact windows) read by the consumer's `BusStream` (what `transport: broker`
//!   reads). The goal (issue #12 item 8) is at least 0.7× direct.
//!
//! Before the criterion groups, a summary measured outside criterion prints the figures
//! docs/performance.md ("Event bus") quotes:
//! - frames/s relayed vs direct (20 rounds of 1,000 frames each, the median round) and their ratio;
//! - added latency per frame: p50/p99 of one frame written by the producer until the consumer has
//!   read it, one frame at a time (bus minus direct);
//! - bytes of memory per idle stream at the default bounds (`max_session_buffer_bytes` 64 MiB,
//!   `max_streams_per_session` 1,024: 16 KiB per stream and direction): the growth of the
//!   process's resident set (`/proc/self/statm`) while 1,000 idle streams are opened, over
//!   1,000. The test agent runs in the same process, so its side of each stream (its HTTP/2
//!   client stream and request-body channel) is counted too, and RSS moves in pages: the figure
//!   bounds the router's share from above. The goal is at most the seed's 4 × 16 KiB
//!   reservation plus 4 KiB.
//!
//! Needs the openssl CLI for the listener's certificate (the tests' `tests/it/support/bus_pki.rs`).

#![allow(clippy::too_many_lines, reason = "test code is exempt")]

#[path = "../tests/it/support/bus_pki.rs"]
mod bus_pki;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use continuum_actors::event_bus::{BusEntry, BusSettings, BusStream, BusTls, EventBus};
use continuum_actors::tree::ActorTree;
use continuum_protocol::discovery::EventTopic;
use continuum_protocol::event_bus::credential::TokenHash;
use continuum_protocol::event_bus::message::{ClientId, Hello, Role, ZmqTcpTarget};
use continuum_protocol::event_bus::{
    ClientEvent, ClientSession, Grant, SESSION_HEADER, SESSION_PATH, SessionBounds, VERSION_HEADER,
};
use continuum_protocol::event_plane::ActiveLoad;
use continuum_protocol::event_plane::encode::encode_kv_metrics;
use continuum_protocol::ids::{DpRank, InstanceId, Namespace, PublisherId};
use continuum_protocol::time::{Tick, UnixMillis};
use continuum_protocol::zmtp::publisher::encode_message;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use futures::{SinkExt as _, StreamExt as _};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt as _, StreamBody};
use hyper::Request;
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

/// Resident set size of this process (`/proc/self/statm`), for the idle-stream memory figure.
fn rss_bytes() -> i64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: i64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

const MESSAGES: usize = 1_000;
/// Rounds of [`MESSAGES`] frames in the summary's throughput figure.
const ROUNDS: usize = 20;
/// Frames timed one at a time in the summary's latency figure.
const LATENCY_FRAMES: usize = 5_000;
/// Idle streams opened for the memory figure.
const IDLE_STREAMS: usize = 1_000;
const TOKEN: &str = "bench-broker-token";

type Body = UnsyncBoxBody<Bytes, Infallible>;

/// One ZMTP-framed kv_metrics message, as a publisher writes it.
fn message() -> Vec<u8> {
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

struct BusPair {
    to_router: futures::channel::mpsc::Sender<Bytes>,
    consumer: BusStream,
    _from_router: Incoming,
    agent: Agent,
}

/// The test agent's welcomed session: opens more data streams on demand.
struct Agent {
    bus: EventBus,
    send: hyper::client::conn::http2::SendRequest<Body>,
    session: ClientSession,
    from_router: Incoming,
    session_id: String,
    _control: futures::channel::mpsc::Sender<Bytes>,
    _pki: bus_pki::Pki,
}

/// One data stream: the agent's request-body sender, its response body, the consumer's end.
type Stream = (futures::channel::mpsc::Sender<Bytes>, Incoming, BusStream);

impl Agent {
    /// Has the router command one more stream (publisher port `port`) and opens it.
    async fn open(&mut self, port: u16) -> Stream {
        let target = ZmqTcpTarget {
            namespace: Namespace::new("dynamo"),
            host: "10.0.0.5".into(),
            port,
        };
        let opener = {
            let bus = self.bus.clone();
            tokio::spawn(async move { bus.open_stream(target, EventTopic::KvMetrics).await })
        };
        let stream_id = loop {
            match self.session.poll_event() {
                Some(ClientEvent::OpenStream { stream_id, .. }) => break stream_id,
                Some(ClientEvent::Welcomed(welcome)) => {
                    self.session_id = welcome.session_id.to_string();
                }
                Some(other) => panic!("unexpected {other:?}"),
                None => {
                    let frame = self
                        .from_router
                        .frame()
                        .await
                        .expect("line")
                        .expect("frame");
                    if let Ok(data) = frame.into_data() {
                        self.session.handle_input(&data, tick());
                    }
                }
            }
        };
        let (to_router, data_body) = body_pipe();
        let request = Request::post(format!("https://localhost/bus/v1/streams/{stream_id}"))
            .header("authorization", format!("Bearer {TOKEN}"))
            .header(VERSION_HEADER, "1")
            .header(SESSION_HEADER, &self.session_id)
            .body(data_body)
            .expect("request");
        let response = self.send.send_request(request).await.expect("stream");
        assert_eq!(response.status(), 200);
        let consumer = opener.await.expect("task").expect("BusStream");
        (to_router, response.into_body(), consumer)
    }
}

fn tick() -> Tick {
    static ORIGIN: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    Tick(ORIGIN.get_or_init(std::time::Instant::now).elapsed())
}

fn body_pipe() -> (futures::channel::mpsc::Sender<Bytes>, Body) {
    let (tx, rx) = futures::channel::mpsc::channel::<Bytes>(64);
    let body = StreamBody::new(rx.map(|b| Ok::<_, Infallible>(Frame::data(b)))).boxed_unsync();
    (tx, body)
}

async fn bus_pair() -> BusPair {
    // The tests' PKI (a CA and the listener's certificate for localhost) from the openssl CLI.
    let pki = bus_pki::pki();
    let dir = pki._dir.path().to_path_buf();
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
                namespaces: [Namespace::new("dynamo")].into_iter().collect(),
                backends: Default::default(),
            },
            token_hash: Some(TokenHash::of_token(TOKEN.as_bytes())),
        }],
        max_sessions: 4,
        bounds: SessionBounds::new(64 * 1024 * 1024, 1024).expect("bounds"),
        // The agent here answers no heartbeats while it is measuring: timers long enough that
        // the session outlives the bench (byte bounds stay at their defaults).
        heartbeat_interval: Duration::from_secs(3_600),
        idle_timeout: Duration::from_secs(7_200),
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
    std::mem::forget(root);
    let mut ticks = tokio::time::interval(Duration::from_millis(5));
    let addr: SocketAddr = loop {
        if let Some(addr) = bus.local_addr() {
            break addr;
        }
        ticks.tick().await;
    };

    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(dir.join("ca.pem")).expect("ca") {
        roots.add(cert.expect("pem")).expect("ca");
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .expect("tls13")
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = TcpStream::connect(addr).await.expect("connect");
    // As an agent should: relayed frames are small.
    tcp.set_nodelay(true).expect("nodelay");
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost").expect("name"), tcp)
        .await
        .expect("tls");
    let (mut send, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .initial_stream_window_size(16 * 1024 * 1024)
        .initial_connection_window_size(64 * 1024 * 1024)
        .handshake::<_, Body>(TokioIo::new(tls))
        .await
        .expect("h2");
    tokio::spawn(conn);

    let hello = Hello {
        role: Role::Broker,
        client_id: ClientId::new("broker-a.dynamo"),
        versions: vec![1],
        dynamo_namespaces: vec![Namespace::new("dynamo")],
        sources: vec![],
    };
    let mut session = ClientSession::new(hello, tick()).expect("hello");
    let (mut control, body) = body_pipe();
    control
        .send(Bytes::from(session.poll_transmit().expect("hello line")))
        .await
        .expect("queue hello");
    let bearer = format!("Bearer {TOKEN}");
    let request = Request::post(format!("https://localhost{SESSION_PATH}"))
        .header("authorization", &bearer)
        .header(VERSION_HEADER, "1")
        .body(body)
        .expect("request");
    let response = send.send_request(request).await.expect("session");
    assert_eq!(response.status(), 200);

    let mut agent = Agent {
        bus,
        send,
        session,
        from_router: response.into_body(),
        session_id: String::new(),
        _control: control,
        _pki: pki,
    };
    let (to_router, from_router, consumer) = agent.open(5557).await;
    BusPair {
        to_router,
        consumer,
        _from_router: from_router,
        agent,
    }
}

async fn tcp_pair() -> (TcpStream, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
    let producer = client.expect("connect");
    producer.set_nodelay(true).expect("nodelay");
    (producer, accepted.expect("accept").0)
}

/// Frames per second of `ROUNDS` rounds of `MESSAGES` frames (the median round).
async fn frames_per_second<W, R>(mut write: W, mut read: R) -> f64
where
    W: AsyncFnMut(),
    R: AsyncFnMut(),
{
    let mut rates = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let start = Instant::now();
        tokio::join!(
            async {
                for _ in 0..MESSAGES {
                    write().await;
                }
            },
            read()
        );
        rates.push(MESSAGES as f64 / start.elapsed().as_secs_f64());
    }
    rates.sort_by(f64::total_cmp);
    rates[ROUNDS / 2]
}

/// p50 and p99 of `LATENCY_FRAMES` single frames, each written then read before the next.
async fn frame_latency<W, R>(mut write: W, mut read: R) -> (Duration, Duration)
where
    W: AsyncFnMut(),
    R: AsyncFnMut(),
{
    let mut samples = Vec::with_capacity(LATENCY_FRAMES);
    for _ in 0..LATENCY_FRAMES {
        let start = Instant::now();
        tokio::join!(write(), read());
        samples.push(start.elapsed());
    }
    samples.sort();
    (
        samples[LATENCY_FRAMES / 2],
        samples[LATENCY_FRAMES * 99 / 100],
    )
}

/// The figures docs/performance.md quotes, measured outside criterion and printed once.
fn summary(_c: &mut Criterion) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let message = message();
    let chunk = Bytes::from(message.clone());
    rt.block_on(async {
        let (producer, consumer) = tcp_pair().await;
        let (producer, consumer) = (
            tokio::sync::Mutex::new(producer),
            tokio::sync::Mutex::new(consumer),
        );
        let mut sink = vec![0u8; message.len() * MESSAGES];
        let sink = tokio::sync::Mutex::new(&mut sink);
        let mut one = vec![0u8; message.len()];
        let one = tokio::sync::Mutex::new(&mut one);
        let mut direct_write = async || {
            producer
                .lock()
                .await
                .write_all(&message)
                .await
                .expect("write");
        };
        let direct = frames_per_second(&mut direct_write, async || {
            let mut sink = sink.lock().await;
            consumer
                .lock()
                .await
                .read_exact(&mut sink[..])
                .await
                .expect("read");
        })
        .await;
        let direct_latency = frame_latency(&mut direct_write, async || {
            let mut one = one.lock().await;
            consumer
                .lock()
                .await
                .read_exact(&mut one[..])
                .await
                .expect("read");
        })
        .await;

        let pair = bus_pair().await;
        let BusPair {
            to_router,
            consumer,
            _from_router,
            mut agent,
        } = pair;
        let (to_router, consumer) = (
            tokio::sync::Mutex::new(to_router),
            tokio::sync::Mutex::new(consumer),
        );
        let mut bus_write = async || {
            to_router
                .lock()
                .await
                .send(chunk.clone())
                .await
                .expect("send");
        };
        let relayed = frames_per_second(&mut bus_write, async || {
            let mut sink = sink.lock().await;
            consumer
                .lock()
                .await
                .read_exact(&mut sink[..])
                .await
                .expect("read");
        })
        .await;
        let bus_latency = frame_latency(&mut bus_write, async || {
            let mut one = one.lock().await;
            consumer
                .lock()
                .await
                .read_exact(&mut one[..])
                .await
                .expect("read");
        })
        .await;

        // Idle streams: commanded, opened by the agent, never written to.
        let settle = async || {
            for _ in 0..20 {
                tokio::task::yield_now().await;
            }
            // A measurement pause, not synchronisation: let the allocator return freed pages
            // before reading the resident set.
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        settle().await;
        let before = rss_bytes();
        let mut idle = Vec::with_capacity(IDLE_STREAMS);
        for port in 0..IDLE_STREAMS {
            idle.push(agent.open(10_000 + port as u16).await);
        }
        settle().await;
        let after = rss_bytes();
        let per_stream = (after - before) as f64 / IDLE_STREAMS as f64;
        drop(idle);

        let us = |d: Duration| d.as_secs_f64() * 1e6;
        println!(
            "event_bus_relay summary: kv_metrics frames/s direct {direct:.0}, relayed {relayed:.0} \
             ({:.2}x direct, goal >= 0.7x; {} B frames, median of {ROUNDS} rounds of {MESSAGES})",
            relayed / direct,
            message.len()
        );
        println!(
            "event_bus_relay summary: per-frame latency direct p50 {:.1} us p99 {:.1} us, relayed \
             p50 {:.1} us p99 {:.1} us, added p50 {:.1} us p99 {:.1} us ({LATENCY_FRAMES} frames)",
            us(direct_latency.0),
            us(direct_latency.1),
            us(bus_latency.0),
            us(bus_latency.1),
            us(bus_latency.0) - us(direct_latency.0),
            us(bus_latency.1) - us(direct_latency.1),
        );
        println!(
            "event_bus_relay summary: {per_stream:.0} B of resident memory per idle stream, router and agent \
             together ({IDLE_STREAMS} streams; goal <= {} B = 4 x 16 KiB + 4 KiB)",
            4 * 16 * 1024 + 4 * 1024
        );
    });
}

fn relay(c: &mut Criterion) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let message = message();
    let total = message.len() * MESSAGES;
    let mut group = c.benchmark_group("event_bus_relay");
    group.throughput(Throughput::Elements(MESSAGES as u64));

    let (mut producer, mut consumer) = rt.block_on(tcp_pair());
    let mut sink = vec![0u8; total];
    group.bench_function("direct_tcp", |b| {
        b.iter(|| {
            rt.block_on(async {
                let write = async {
                    for _ in 0..MESSAGES {
                        producer.write_all(&message).await.expect("write");
                    }
                };
                let read = consumer.read_exact(&mut sink);
                let (_, read) = tokio::join!(write, read);
                read.expect("read");
            })
        })
    });

    let mut pair = rt.block_on(bus_pair());
    let chunk = Bytes::from(message.clone());
    group.bench_function("bus_stream", |b| {
        b.iter(|| {
            rt.block_on(async {
                let to_router = &mut pair.to_router;
                let write = async {
                    for _ in 0..MESSAGES {
                        to_router.send(chunk.clone()).await.expect("send");
                    }
                };
                let read = pair.consumer.read_exact(&mut sink);
                let (_, read) = tokio::join!(write, read);
                read.expect("read");
            })
        })
    });
    group.finish();
}

criterion_group!(benches, summary, relay);
criterion_main!(benches);
