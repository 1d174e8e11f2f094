//! kv_metrics messages relayed through one event-bus data stream vs direct TCP on loopback.
//!
//! Both groups move the same ZMTP-framed `kv_metrics` message (as a publisher writes it) from a
//! producer to a consumer, 1,000 messages per iteration, reported as messages per second:
//! - `direct_tcp`: a loopback `TcpStream` pair (what `transport: direct` reads);
//! - `bus_stream`: an agent's `POST /bus/v1/streams/{id}` request body (TLS 1.3 + HTTP/2, the
//!   listener's exact windows) read by the consumer's `BusStream` (what `transport: broker`
//!   reads). The goal (issue #12 item 8) is at least 0.7× direct.
//!
//! Needs the openssl CLI for the listener's certificate (as tests/event_bus.rs).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

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

const MESSAGES: usize = 1_000;
const TOKEN: &str = "bench-broker-token";

type Body = UnsyncBoxBody<Bytes, Infallible>;

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("the openssl CLI runs");
    assert!(out.status.success(), "openssl {args:?} failed");
}

fn pki(dir: &Path) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=bench-ca",
        ],
    );
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature\n\
         extendedKeyUsage=serverAuth\n",
    )
    .expect("ext");
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=server",
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.pem",
            "-days",
            "2",
            "-extfile",
            "server.ext",
        ],
    );
}

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
    _control: futures::channel::mpsc::Sender<Bytes>,
    _from_router: Incoming,
    _dir: tempfile::TempDir,
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
    let dir = tempfile::tempdir().expect("tempdir");
    pki(dir.path());
    let settings = BusSettings {
        enabled: true,
        listen: "127.0.0.1:0".parse().expect("addr"),
        tls: Some(BusTls {
            cert: dir.path().join("server.pem"),
            key: dir.path().join("server.key"),
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
    std::mem::forget(root);
    let mut ticks = tokio::time::interval(Duration::from_millis(5));
    let addr: SocketAddr = loop {
        if let Some(addr) = bus.local_addr() {
            break addr;
        }
        ticks.tick().await;
    };

    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(dir.path().join("ca.pem")).expect("ca") {
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
    let mut from_router = response.into_body();

    let target = ZmqTcpTarget {
        namespace: Namespace::new("dynamo"),
        host: "10.0.0.5".into(),
        port: 5557,
    };
    let opener = {
        let bus = bus.clone();
        tokio::spawn(async move { bus.open_stream(target, EventTopic::KvMetrics).await })
    };
    let mut session_id = None;
    let stream_id = loop {
        match session.poll_event() {
            Some(ClientEvent::Welcomed(welcome)) => session_id = Some(welcome.session_id),
            Some(ClientEvent::OpenStream { stream_id, .. }) => break stream_id,
            Some(other) => panic!("unexpected {other:?}"),
            None => {
                let frame = from_router.frame().await.expect("line").expect("frame");
                if let Ok(data) = frame.into_data() {
                    session.handle_input(&data, tick());
                }
            }
        }
    };
    let (to_router, data_body) = body_pipe();
    let session_id = session_id.expect("welcomed").to_string();
    let request = Request::post(format!("https://localhost/bus/v1/streams/{stream_id}"))
        .header("authorization", &bearer)
        .header(VERSION_HEADER, "1")
        .header(SESSION_HEADER, &session_id)
        .body(data_body)
        .expect("request");
    let response = send.send_request(request).await.expect("stream");
    assert_eq!(response.status(), 200);
    let consumer = opener.await.expect("task").expect("BusStream");
    BusPair {
        to_router,
        consumer,
        _control: control,
        _from_router: response.into_body(),
        _dir: dir,
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

criterion_group!(benches, relay);
criterion_main!(benches);
