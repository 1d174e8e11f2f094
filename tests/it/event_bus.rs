//! The event-bus listener (`root/event_bus`) against a test broker built on the protocol's
//! agent-side state machine (`ClientSession`) speaking real TLS 1.3 and HTTP/2 (tokio-rustls +
//! hyper's client) over loopback: every refusal code of the contract, a welcomed session seen
//! through the `EventBus` API, a data stream relaying bytes both ways, reloads that revoke or
//! narrow a credential, and hostile lines that cost only their own session.
//!
//! The last test runs the whole daemon: `root/event_bus` under the root supervisor, a config
//! reload through the daemon's reload path, and an operator restart of the subtree.
//!
//! Certificates come from the openssl CLI (`support::bus_pki`), as in tests/it/proxy_tls.rs.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::support::bus_pki::{Pki, pki};
use crate::support::paused::settle;
use bytes::Bytes;
use continuum_actors::event_bus::{
    BusEntry, BusSettings, BusStream, BusStreamError, BusTls, EventBus, event_bus_spec,
};
use continuum_actors::metrics::Metrics;
use continuum_actors::supervisor::{SupervisorMsg, spawn_root};
use continuum_actors::tree::ActorTree;
use continuum_protocol::discovery::EventTopic;
use continuum_protocol::event_bus::credential::TokenHash;
use continuum_protocol::event_bus::message::{
    AnnouncedSource, ClientId, ErrorBody, ErrorCode, Hello, Role, StreamId, StreamTarget, Welcome,
    ZmqTcpTarget,
};
use continuum_protocol::event_bus::{
    ClientEvent, ClientSession, Grant, SESSION_HEADER, SESSION_PATH, SessionBounds, VERSION_HEADER,
};
use continuum_protocol::ids::Namespace;
use continuum_protocol::time::Tick;
use futures::{SinkExt as _, StreamExt as _};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt as _, Empty, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use ractor::ActorRef;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

pub(crate) const WAIT: Duration = Duration::from_secs(10);
pub(crate) const BROKERS: &[&str] = &[
    "broker-a.dynamo",
    "broker-b.dynamo",
    "broker-c.dynamo",
    "broker-d.dynamo",
    "broker-e.dynamo",
];
const LISTENER: &str = "kv-listener-a";

pub(crate) fn token(id: &str) -> String {
    format!("token-of-{id}")
}

// ---------------------------------------------------------------------------------------------
// The listener under test

pub(crate) fn entry(id: &str, role: Role, grants: &[&str]) -> BusEntry {
    let set = |items: &[&str]| items.iter().map(|s| s.to_string()).collect();
    BusEntry {
        grant: Grant {
            id: ClientId::new(id),
            role,
            namespaces: match role {
                Role::Broker => grants.iter().map(|n| Namespace::new(*n)).collect(),
                Role::KvListener => Default::default(),
            },
            backends: match role {
                Role::Broker => Default::default(),
                Role::KvListener => set(grants),
            },
        },
        token_hash: Some(TokenHash::of_token(token(id).as_bytes())),
    }
}

pub(crate) fn settings(pki: &Pki, max_sessions: u32) -> BusSettings {
    let mut entries: Vec<BusEntry> = BROKERS
        .iter()
        .map(|id| entry(id, Role::Broker, &["dynamo"]))
        .collect();
    entries.push(entry(LISTENER, Role::KvListener, &["vllm-1"]));
    BusSettings {
        enabled: true,
        listen: "127.0.0.1:0".parse().expect("addr"),
        tls: Some(BusTls {
            cert: pki.server.0.clone(),
            key: pki.server.1.clone(),
            client_ca: Some(pki.ca.clone()),
        }),
        entries,
        max_sessions,
        bounds: SessionBounds::new(64 * 1024 * 1024, 1024).expect("bounds"),
        heartbeat_interval: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(30),
        // Short, so the hello_timeout refusal is reached without a 10 s wait.
        hello_timeout: Duration::from_secs(1),
    }
}

pub(crate) struct Harness {
    pub(crate) bus: EventBus,
    pub(crate) metrics: Metrics,
    pub(crate) tree: ActorTree,
    pub(crate) addr: SocketAddr,
    pub(crate) pki: Pki,
    /// The test's own root supervisor (none when a daemon runs the bus).
    pub(crate) root: Option<ActorRef<SupervisorMsg>>,
}

impl Drop for Harness {
    fn drop(&mut self) {
        if let Some(root) = &self.root {
            root.stop(None);
        }
    }
}

pub(crate) async fn start(max_sessions: u32) -> Harness {
    let pki = pki();
    let metrics = Metrics::new("event-bus-test").expect("metrics");
    let bus = EventBus::new(settings(&pki, max_sessions), Some(&metrics));
    let tree = ActorTree::default();
    let (root, _task) = spawn_root(
        vec![event_bus_spec(bus.clone())],
        tree.clone(),
        Some(metrics.clone()),
    )
    .await
    .expect("root starts");
    let addr = poll("the listener binds", || bus.local_addr()).await;
    Harness {
        bus,
        metrics,
        tree,
        addr,
        pki,
        root: Some(root),
    }
}

/// Polls `probe` until it gives a value, at most [`WAIT`].
pub(crate) async fn poll<T>(what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + WAIT;
    let mut ticks = tokio::time::interval(Duration::from_millis(10));
    loop {
        if let Some(value) = probe() {
            return value;
        }
        assert!(Instant::now() < deadline, "{what} within {WAIT:?}");
        ticks.tick().await;
    }
}

impl Harness {
    pub(crate) fn refusals(&self, code: &str) -> f64 {
        self.metrics
            .value(
                "continuum_dynamo_event_bus_refusals_total",
                &[("code", code)],
            )
            .unwrap_or(0.0)
    }

    pub(crate) async fn wait_refusals(&self, code: &str, at_least: f64) {
        poll(&format!("{at_least} {code} refusals"), || {
            (self.refusals(code) >= at_least).then_some(())
        })
        .await;
    }

    pub(crate) async fn wait_sessions(&self, n: usize) {
        let mut view = self.bus.subscribe_sessions();
        tokio::time::timeout(WAIT, async {
            while view.borrow_and_update().sessions.len() != n {
                view.changed().await.expect("bus alive");
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{n} sessions within {WAIT:?}"));
    }
}

// ---------------------------------------------------------------------------------------------
// The test broker: real TLS + HTTP/2, the protocol's ClientSession

type Body = UnsyncBoxBody<Bytes, Infallible>;

#[derive(Clone, Copy)]
pub(crate) struct Client<'a> {
    tls13: bool,
    alpn: &'a [&'a [u8]],
    cert: Option<&'a (PathBuf, PathBuf)>,
}

pub(crate) const H2: Client<'static> = Client {
    tls13: true,
    alpn: &[b"h2"],
    cert: None,
};

pub(crate) async fn tls_connect(
    h: &Harness,
    client: Client<'_>,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let versions: &[&'static rustls::SupportedProtocolVersion] = if client.tls13 {
        &[&rustls::version::TLS13]
    } else {
        &[&rustls::version::TLS12]
    };
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(&h.pki.ca).expect("ca") {
        roots.add(cert.expect("ca pem")).expect("ca cert");
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(versions)
        .expect("versions")
        .with_root_certificates(roots);
    let mut config = match client.cert {
        Some((cert, key)) => builder
            .with_client_auth_cert(
                CertificateDer::pem_file_iter(cert)
                    .expect("cert")
                    .collect::<Result<Vec<_>, _>>()
                    .expect("cert pem"),
                PrivateKeyDer::from_pem_file(key).expect("key"),
            )
            .expect("client cert"),
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = client.alpn.iter().map(|p| p.to_vec()).collect();
    let tcp = TcpStream::connect(h.addr).await?;
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost").expect("name"), tcp)
        .await?;
    // A server that refuses after the handshake closes; make that visible here.
    tls.flush().await?;
    Ok(tls)
}

pub(crate) struct Conn {
    pub(crate) send: hyper::client::conn::http2::SendRequest<Body>,
}

pub(crate) async fn h2(h: &Harness, client: Client<'_>) -> Conn {
    let tls = tls_connect(h, client).await.expect("TLS handshake");
    let (send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .expect("HTTP/2 handshake");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Conn { send }
}

/// A request body the test writes to as it goes.
pub(crate) fn body_pipe() -> (futures::channel::mpsc::Sender<Bytes>, Body) {
    let (tx, rx) = futures::channel::mpsc::channel::<Bytes>(16);
    let body = StreamBody::new(rx.map(|b| Ok::<_, Infallible>(Frame::data(b)))).boxed_unsync();
    (tx, body)
}

impl Conn {
    pub(crate) async fn post(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Body,
    ) -> Response<Incoming> {
        let mut request = Request::builder()
            .method(method)
            .uri(format!("https://localhost{path}"));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        self.send.ready().await.expect("connection ready");
        tokio::time::timeout(
            WAIT,
            self.send.send_request(request.body(body).expect("request")),
        )
        .await
        .expect("response in time")
        .expect("response")
    }

    /// A session request whose body starts with `first` (kept open).
    pub(crate) async fn session(
        &mut self,
        auth: Option<&str>,
        version: Option<&str>,
        first: Bytes,
    ) -> (Response<Incoming>, futures::channel::mpsc::Sender<Bytes>) {
        let (mut tx, body) = body_pipe();
        if !first.is_empty() {
            tx.send(first).await.expect("queue first bytes");
        }
        let bearer = auth.map(|token| format!("Bearer {token}"));
        let mut headers = vec![];
        if let Some(bearer) = &bearer {
            headers.push(("authorization", bearer.as_str()));
        }
        if let Some(version) = version {
            headers.push((VERSION_HEADER, version));
        }
        (self.post("POST", SESSION_PATH, &headers, body).await, tx)
    }
}

pub(crate) async fn refusal(response: Response<Incoming>) -> (u16, ErrorCode) {
    let status = response.status().as_u16();
    let body = tokio::time::timeout(WAIT, response.into_body().collect())
        .await
        .expect("error body in time")
        .expect("error body")
        .to_bytes();
    let decoded = ErrorBody::decode(&body).unwrap_or_else(|| panic!("error body: {body:?}"));
    (status, decoded.error.code)
}

pub(crate) fn tick() -> Tick {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    Tick(ORIGIN.get_or_init(Instant::now).elapsed())
}

pub(crate) fn broker_hello(id: &str, namespaces: &[&str]) -> Hello {
    Hello {
        role: Role::Broker,
        client_id: ClientId::new(id),
        versions: vec![1],
        dynamo_namespaces: namespaces.iter().map(|n| Namespace::new(*n)).collect(),
        sources: vec![],
    }
}

pub(crate) struct TestBroker {
    pub(crate) conn: Conn,
    pub(crate) session: ClientSession,
    pub(crate) lines: futures::channel::mpsc::Sender<Bytes>,
    pub(crate) body: Incoming,
    pub(crate) welcome: Welcome,
    pub(crate) token: Option<String>,
}

impl TestBroker {
    /// Connects as `id` with its token (and `cert` if given); `Err` carries the refusal.
    pub(crate) async fn connect(
        h: &Harness,
        hello: Hello,
        token: Option<String>,
        cert: Option<&(PathBuf, PathBuf)>,
    ) -> Result<TestBroker, (u16, ErrorCode)> {
        let mut conn = h2(h, Client { cert, ..H2 }).await;
        let mut session = ClientSession::new(hello, tick()).expect("valid hello");
        let first = Bytes::from(session.poll_transmit().expect("hello line"));
        let (response, lines) = conn.session(token.as_deref(), Some("1"), first).await;
        if response.status() != 200 {
            return Err(refusal(response).await);
        }
        let mut broker = TestBroker {
            conn,
            session,
            lines,
            body: response.into_body(),
            welcome: Welcome {
                session_id: continuum_protocol::event_bus::SessionId::from_random(0),
                version: 0,
                heartbeat_interval_ms: 0,
                idle_timeout_ms: 0,
                max_streams: 0,
                stream_buffer_bytes: 0,
                max_line_bytes: 0,
            },
            token,
        };
        match broker.next_event().await {
            ClientEvent::Welcomed(welcome) => broker.welcome = welcome,
            other => panic!("expected a welcome, got {other:?}"),
        }
        Ok(broker)
    }

    pub(crate) async fn as_broker(h: &Harness, id: &str) -> TestBroker {
        Self::connect(h, broker_hello(id, &["dynamo"]), Some(token(id)), None)
            .await
            .unwrap_or_else(|refusal| panic!("{id} welcomed, not {refusal:?}"))
    }

    /// The next event of the agent's state machine, reading the control response as needed.
    pub(crate) async fn next_event(&mut self) -> ClientEvent {
        loop {
            self.flush().await;
            if let Some(event) = self.session.poll_event() {
                return event;
            }
            match tokio::time::timeout(WAIT, self.body.frame())
                .await
                .expect("a control line in time")
            {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.session.handle_input(&data, tick());
                    }
                }
                Some(Err(_)) | None => self.session.handle_end_of_input(),
            }
        }
    }

    pub(crate) async fn flush(&mut self) {
        if let Some(bytes) = self.session.poll_transmit() {
            let _ = self.lines.send(Bytes::from(bytes)).await;
        }
    }

    /// Raw bytes on the control request body (hostile input).
    pub(crate) async fn send_raw(&mut self, bytes: Vec<u8>) {
        self.lines
            .send(Bytes::from(bytes))
            .await
            .expect("control body open");
    }

    /// Opens `POST /bus/v1/streams/{id}` of `session` (its own unless given).
    pub(crate) async fn open_data_stream(
        &mut self,
        stream_id: StreamId,
        session: Option<String>,
    ) -> Result<(futures::channel::mpsc::Sender<Bytes>, Incoming), (u16, ErrorCode)> {
        let (tx, body) = body_pipe();
        let session = session.unwrap_or_else(|| self.welcome.session_id.to_string());
        let bearer = self.token.as_ref().map(|t| format!("Bearer {t}"));
        let mut headers = vec![(SESSION_HEADER, session.as_str()), (VERSION_HEADER, "1")];
        if let Some(bearer) = &bearer {
            headers.push(("authorization", bearer.as_str()));
        }
        let response = self
            .conn
            .post(
                "POST",
                &format!("/bus/v1/streams/{stream_id}"),
                &headers,
                body,
            )
            .await;
        if response.status() != 200 {
            return Err(refusal(response).await);
        }
        Ok((tx, response.into_body()))
    }
}

pub(crate) async fn read_exactly(body: &mut Incoming, n: usize) -> Vec<u8> {
    let mut out = Vec::new();
    while out.len() < n {
        match tokio::time::timeout(WAIT, body.frame())
            .await
            .expect("data in time")
        {
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    out.extend_from_slice(&data);
                }
            }
            other => panic!("data stream ended early: {other:?}"),
        }
    }
    out
}

pub(crate) fn target() -> ZmqTcpTarget {
    ZmqTcpTarget {
        namespace: Namespace::new("dynamo"),
        host: "10.0.0.5".into(),
        port: 5557,
    }
}

// ---------------------------------------------------------------------------------------------
// Tests

#[tokio::test]
async fn a_welcomed_session_is_visible_and_a_stream_relays_both_ways() {
    let h = start(64).await;
    assert!(h.bus.is_running());
    assert_eq!(
        h.bus
            .open_stream(target(), EventTopic::KvMetrics)
            .await
            .err(),
        Some(BusStreamError::NoSession)
    );
    let mut a = TestBroker::as_broker(&h, "broker-a.dynamo").await;
    h.wait_sessions(1).await;
    assert_eq!(h.bus.session_count(), 1);
    assert!(h.bus.covers(&Namespace::new("dynamo")));
    assert!(!h.bus.covers(&Namespace::new("other")));
    assert_eq!(
        h.bus.covered_namespaces().into_iter().collect::<Vec<_>>(),
        vec![Namespace::new("dynamo")]
    );
    let row = format!("root/event_bus/session:{}", a.welcome.session_id);
    let status = h.tree.get(&row).unwrap_or_else(|| panic!("{row} listed"));
    assert_eq!(status.kind, "broker_session");
    assert_eq!(
        h.metrics
            .value("continuum_dynamo_event_bus_sessions", &[("role", "broker")]),
        Some(1.0)
    );
    let mut bad_port = target();
    bad_port.port = 0;
    assert!(matches!(
        h.bus.open_stream(bad_port, EventTopic::KvMetrics).await,
        Err(BusStreamError::InvalidTarget(_))
    ));

    // The consumer opens a stream; the broker is commanded and opens the data stream.
    let bus = h.bus.clone();
    let consumer =
        tokio::spawn(async move { bus.open_stream(target(), EventTopic::KvMetrics).await });
    let stream_id = match a.next_event().await {
        ClientEvent::OpenStream {
            stream_id,
            target: t,
        } => {
            assert_eq!(
                t,
                StreamTarget::ZmqTcp {
                    target: target(),
                    topic: EventTopic::KvMetrics
                }
            );
            stream_id
        }
        other => panic!("expected a subscribe, got {other:?}"),
    };
    let (mut to_router, mut from_router) = a
        .open_data_stream(stream_id, None)
        .await
        .expect("commanded stream accepted");
    let mut stream: BusStream = tokio::time::timeout(WAIT, consumer)
        .await
        .expect("open_stream resolves")
        .expect("task")
        .expect("a BusStream");

    // Publisher bytes reach the consumer; the consumer's bytes reach the publisher side.
    to_router
        .send(Bytes::from_static(b"from-publisher"))
        .await
        .expect("send");
    let mut got = [0u8; 14];
    tokio::time::timeout(WAIT, stream.read_exact(&mut got))
        .await
        .expect("read in time")
        .expect("read");
    assert_eq!(&got, b"from-publisher");
    stream.write_all(b"to-publisher").await.expect("write");
    assert_eq!(read_exactly(&mut from_router, 12).await, b"to-publisher");

    // The same stream again: 409; a stream never commanded: 404; another credential on this
    // session: 403.
    assert_eq!(
        a.open_data_stream(stream_id, None).await.err(),
        Some((409, ErrorCode::DuplicateStream))
    );
    assert_eq!(
        a.open_data_stream(StreamId(99), None).await.err(),
        Some((404, ErrorCode::UnknownStream))
    );
    let mut b = TestBroker::as_broker(&h, "broker-b.dynamo").await;
    assert_eq!(
        b.open_data_stream(stream_id, Some(a.welcome.session_id.to_string()))
            .await
            .err(),
        Some((403, ErrorCode::Forbidden))
    );
    assert_eq!(
        b.open_data_stream(StreamId(1), Some("sess-0123".into()))
            .await
            .err(),
        Some((404, ErrorCode::UnknownStream))
    );

    // Dropping the BusStream unsubscribes it.
    drop(stream);
    match a.next_event().await {
        ClientEvent::CloseStream(id) => assert_eq!(id, stream_id),
        other => panic!("expected an unsubscribe, got {other:?}"),
    }
    let relayed = |direction: &str| {
        h.metrics
            .value(
                "continuum_dynamo_event_bus_bytes_total",
                &[("direction", direction)],
            )
            .unwrap_or(0.0)
    };
    assert_eq!(relayed("to_router"), 14.0);
    assert_eq!(relayed("to_client"), 12.0);
    poll("the unsubscribe is counted", || {
        (h.metrics.value(
            "continuum_dynamo_event_bus_stream_closes_total",
            &[("reason", "unsubscribed")],
        ) == Some(1.0))
        .then_some(())
    })
    .await;
}

#[tokio::test]
async fn plaintext_tls12_and_http1_clients_are_refused_at_the_connection() {
    let h = start(64).await;
    // An ASCII letter first: a best-effort plaintext 403 with the tls_required body.
    let mut tcp = TcpStream::connect(h.addr).await.expect("connect");
    tcp.write_all(b"POST /bus/v1/session HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .expect("write");
    let mut answer = Vec::new();
    tokio::time::timeout(WAIT, tcp.read_to_end(&mut answer))
        .await
        .expect("answer in time")
        .expect("read");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    assert!(answer.contains("\"tls_required\""), "{answer}");
    // Any other non-TLS byte: closed without a word.
    let mut tcp = TcpStream::connect(h.addr).await.expect("connect");
    tcp.write_all(&[0x00, 0x01]).await.expect("write");
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(WAIT, tcp.read_to_end(&mut answer))
        .await
        .expect("closed in time");
    assert!(answer.is_empty());
    h.wait_refusals("tls_required", 2.0).await;

    // TLS 1.2 only, then HTTP/1.1-only ALPN: the handshake fails.
    let tls12 = Client { tls13: false, ..H2 };
    assert!(tls_connect(&h, tls12).await.is_err());
    h.wait_refusals("handshake_failed", 1.0).await;
    let http1 = Client {
        alpn: &[b"http/1.1"],
        ..H2
    };
    assert!(tls_connect(&h, http1).await.is_err());
    h.wait_refusals("handshake_failed", 2.0).await;
    // A proper client still gets in.
    TestBroker::as_broker(&h, "broker-a.dynamo").await;
}

#[tokio::test]
async fn request_refusals_carry_the_contract_status_and_code() {
    let h = start(64).await;
    let mut conn = h2(&h, H2).await;
    let empty = || Empty::<Bytes>::new().map_err(|e| match e {}).boxed_unsync();
    let a = token("broker-a.dynamo");
    let hello_a = || {
        let mut line = serde_json::to_vec(&continuum_protocol::event_bus::Message::Hello(
            broker_hello("broker-a.dynamo", &["dynamo"]),
        ))
        .expect("hello");
        line.push(b'\n');
        Bytes::from(line)
    };

    let cases: Vec<(Response<Incoming>, u16, ErrorCode)> = vec![
        (
            conn.post("GET", SESSION_PATH, &[], empty()).await,
            405,
            ErrorCode::MethodNotAllowed,
        ),
        (
            conn.post("POST", "/elsewhere", &[], empty()).await,
            404,
            ErrorCode::NotFound,
        ),
        (
            conn.post("POST", "/bus/v1/streams/007", &[], empty()).await,
            404,
            ErrorCode::UnknownStream,
        ),
        (
            conn.session(None, Some("1"), hello_a()).await.0,
            401,
            ErrorCode::Unauthenticated,
        ),
        (
            conn.session(Some("wrong-token"), Some("1"), hello_a())
                .await
                .0,
            401,
            ErrorCode::Unauthenticated,
        ),
        (
            conn.session(Some(&a), None, hello_a()).await.0,
            400,
            ErrorCode::UnsupportedProtocolVersion,
        ),
        (
            conn.session(Some(&a), Some("0"), hello_a()).await.0,
            400,
            ErrorCode::UnsupportedProtocolVersion,
        ),
        // Bytes before the hello.
        (
            conn.session(Some(&a), Some("1"), Bytes::from_static(b"garbage\n"))
                .await
                .0,
            400,
            ErrorCode::InvalidHello,
        ),
        // An unknown message type as the first line.
        (
            conn.session(
                Some(&a),
                Some("1"),
                Bytes::from_static(b"{\"type\":\"bogus\"}\n"),
            )
            .await
            .0,
            400,
            ErrorCode::InvalidHello,
        ),
        // An oversized first line (no newline within 64 KiB).
        (
            conn.session(Some(&a), Some("1"), Bytes::from(vec![b'{'; 70 * 1024]))
                .await
                .0,
            400,
            ErrorCode::InvalidHello,
        ),
    ];
    for (response, status, code) in cases {
        assert_eq!(refusal(response).await, (status, code));
    }
    // A hello for a namespace outside the allowlist, or naming another entry: forbidden.
    let refused = TestBroker::connect(
        &h,
        broker_hello("broker-a.dynamo", &["other"]),
        Some(a.clone()),
        None,
    )
    .await
    .err();
    assert_eq!(refused, Some((403, ErrorCode::Forbidden)));
    let refused = TestBroker::connect(
        &h,
        broker_hello("broker-b.dynamo", &["dynamo"]),
        Some(a.clone()),
        None,
    )
    .await
    .err();
    assert_eq!(refused, Some((403, ErrorCode::Forbidden)));
    // A kv_listener hello from a broker entry: forbidden.
    let listener_hello = Hello {
        role: Role::KvListener,
        client_id: ClientId::new("broker-a.dynamo"),
        versions: vec![1],
        dynamo_namespaces: vec![],
        sources: vec![AnnouncedSource {
            backend: "vllm-1".into(),
        }],
    };
    assert_eq!(
        TestBroker::connect(&h, listener_hello, Some(a.clone()), None)
            .await
            .err(),
        Some((403, ErrorCode::Forbidden))
    );
    // A client certificate naming broker-a authenticates without a token ...
    let by_cert = TestBroker::connect(
        &h,
        broker_hello("broker-a.dynamo", &["dynamo"]),
        None,
        Some(&h.pki.client_a),
    )
    .await
    .expect("certificate authenticates broker-a");
    drop(by_cert);
    // ... and with broker-b's token the token decides, but the certificate names another
    // entry: forbidden.
    assert_eq!(
        TestBroker::connect(
            &h,
            broker_hello("broker-b.dynamo", &["dynamo"]),
            Some(token("broker-b.dynamo")),
            Some(&h.pki.client_a),
        )
        .await
        .err(),
        Some((403, ErrorCode::Forbidden))
    );
    assert!(h.refusals("invalid_hello") >= 3.0);
    assert!(h.refusals("forbidden") >= 4.0);
}

#[tokio::test]
async fn a_stalled_pre_hello_client_holds_one_slot_until_hello_timeout() {
    let h = start(64).await;
    let a = token("broker-a.dynamo");
    let mut first = h2(&h, H2).await;
    let mut second = h2(&h, H2).await;
    // Two session requests of one credential that never send a hello: one holds the
    // pre-hello slot (and times out, 408), the other is refused at once (429).
    let (one, two) = tokio::join!(
        first.session(Some(&a), Some("1"), Bytes::new()),
        second.session(Some(&a), Some("1"), Bytes::new()),
    );
    let mut outcomes = vec![refusal(one.0).await, refusal(two.0).await];
    outcomes.sort_by_key(|(status, _)| *status);
    assert_eq!(
        outcomes,
        vec![
            (408, ErrorCode::HelloTimeout),
            (429, ErrorCode::TooManySessions)
        ]
    );
    // The slot is free again.
    TestBroker::as_broker(&h, "broker-a.dynamo").await;
}

#[tokio::test]
async fn connections_are_capped_at_four_times_max_sessions_and_sessions_at_max_sessions() {
    let h = start(4).await;
    // 16 connections (4 x 4) of real TLS 1.3 + HTTP/2 clients are held; the 17th is closed at
    // accept, before its TLS handshake.
    let mut held = Vec::new();
    for _ in 0..16 {
        held.push(h2(&h, H2).await);
    }
    poll("16 connections counted", || {
        (h.metrics
            .value("continuum_dynamo_event_bus_connections", &[])
            == Some(16.0))
        .then_some(())
    })
    .await;
    let extra = tokio::time::timeout(WAIT, tls_connect(&h, H2))
        .await
        .expect("refused in time");
    assert!(extra.is_err(), "the 17th connection is closed");
    h.wait_refusals("connection_limit", 1.0).await;
    assert_eq!(h.refusals("handshake_failed"), 0.0);
    drop(held);
    poll("the held connections are released", || {
        (h.metrics
            .value("continuum_dynamo_event_bus_connections", &[])
            == Some(0.0))
        .then_some(())
    })
    .await;

    // Four sessions are welcomed; a fifth entry is refused with 429.
    let mut live = Vec::new();
    for id in &BROKERS[..4] {
        live.push(TestBroker::as_broker(&h, id).await);
    }
    let refused = TestBroker::connect(
        &h,
        broker_hello(BROKERS[4], &["dynamo"]),
        Some(token(BROKERS[4])),
        None,
    )
    .await
    .err();
    assert_eq!(refused, Some((429, ErrorCode::TooManySessions)));
    // A newer session of a live entry supersedes it (and does not count against the cap).
    let mut old = live.remove(0);
    let _newer = TestBroker::as_broker(&h, BROKERS[0]).await;
    match old.next_event().await {
        ClientEvent::Closed { code, .. } => assert_eq!(code, ErrorCode::SessionSuperseded),
        other => panic!("expected session_superseded, got {other:?}"),
    }
    h.wait_sessions(4).await;
}

#[tokio::test]
async fn a_reload_revokes_removed_credentials_and_closes_narrowed_sessions() {
    let h = start(64).await;
    let mut a = TestBroker::as_broker(&h, "broker-a.dynamo").await;
    let mut b = TestBroker::as_broker(&h, "broker-b.dynamo").await;
    let _c = TestBroker::as_broker(&h, "broker-c.dynamo").await;
    h.wait_sessions(3).await;

    // Remove broker-a; narrow broker-b to another namespace.
    let mut next = settings(&h.pki, 64);
    next.entries
        .retain(|e| e.grant.id.as_str() != "broker-a.dynamo");
    for entry in &mut next.entries {
        if entry.grant.id.as_str() == "broker-b.dynamo" {
            entry.grant.namespaces = [Namespace::new("other")].into_iter().collect();
        }
    }
    let listen_restart = h.bus.reload(next);
    assert!(!listen_restart, "credentials reload in place");
    match a.next_event().await {
        ClientEvent::Closed { code, .. } => assert_eq!(code, ErrorCode::CredentialRevoked),
        other => panic!("expected credential_revoked, got {other:?}"),
    }
    match b.next_event().await {
        ClientEvent::Closed { code, .. } => assert_eq!(code, ErrorCode::Forbidden),
        other => panic!("expected forbidden, got {other:?}"),
    }
    // broker-c keeps running; broker-a's token is now refused as revoked.
    h.wait_sessions(1).await;
    assert!(h.bus.covers(&Namespace::new("dynamo")));
    let refused = TestBroker::connect(
        &h,
        broker_hello("broker-a.dynamo", &["dynamo"]),
        Some(token("broker-a.dynamo")),
        None,
    )
    .await
    .err();
    assert_eq!(refused, Some((401, ErrorCode::CredentialRevoked)));
}

#[tokio::test]
async fn a_reload_that_rotates_a_token_closes_exactly_that_session_with_credential_revoked() {
    let h = start(64).await;
    let _a = TestBroker::as_broker(&h, BROKERS[0]).await;
    let mut b = TestBroker::as_broker(&h, BROKERS[1]).await;
    let _c = TestBroker::as_broker(&h, BROKERS[2]).await;
    h.wait_sessions(3).await;

    // broker-b's entry stays, with a new token.
    let rotated = "rotated-token-of-broker-b";
    let mut next = settings(&h.pki, 64);
    for entry in &mut next.entries {
        if entry.grant.id.as_str() == BROKERS[1] {
            entry.token_hash = Some(TokenHash::of_token(rotated.as_bytes()));
        }
    }
    assert!(!h.bus.reload(next), "credentials reload in place");
    match b.next_event().await {
        ClientEvent::Closed { code, .. } => assert_eq!(code, ErrorCode::CredentialRevoked),
        other => panic!("expected credential_revoked, got {other:?}"),
    }
    // Exactly that session: the other two stay in the session table.
    h.wait_sessions(2).await;
    let view = h.bus.subscribe_sessions();
    let mut live: Vec<String> = view
        .borrow()
        .sessions
        .iter()
        .map(|s| s.client_id.to_string())
        .collect();
    live.sort();
    assert_eq!(live, vec![BROKERS[0].to_string(), BROKERS[2].to_string()]);
    assert_eq!(
        h.metrics.value(
            "continuum_dynamo_event_bus_sessions_closed_total",
            &[("code", "credential_revoked")]
        ),
        Some(1.0)
    );
    // The old token is refused as revoked; the new one is welcomed.
    let refused = TestBroker::connect(
        &h,
        broker_hello(BROKERS[1], &["dynamo"]),
        Some(token(BROKERS[1])),
        None,
    )
    .await
    .err();
    assert_eq!(refused, Some((401, ErrorCode::CredentialRevoked)));
    TestBroker::connect(
        &h,
        broker_hello(BROKERS[1], &["dynamo"]),
        Some(rotated.into()),
        None,
    )
    .await
    .expect("the rotated token is welcomed");
    h.wait_sessions(3).await;
}

/// Spec "What the listener enforces", *Certificate CA binding*: a certificate identity stays
/// bound to the `client_ca` that verified its TLS connection. A reload that replaces the CA
/// ends the certificate session at once (`credential_revoked`) and the connection's certificate
/// no longer authenticates a new request, even before the listener restarts; the restarted
/// listener refuses the old CA's certificate in the handshake and welcomes the new CA's.
#[tokio::test]
async fn certificate_identities_stay_bound_to_the_client_ca_that_verified_them() {
    let mut h = start(64).await;
    let hello = || broker_hello("broker-a.dynamo", &["dynamo"]);
    let mut a = TestBroker::connect(&h, hello(), None, Some(&h.pki.client_a))
        .await
        .expect("the first CA's certificate authenticates broker-a");
    let _b = TestBroker::as_broker(&h, "broker-b.dynamo").await;
    h.wait_sessions(2).await;

    // A second CA and a broker-a certificate it signed.
    let second = tempfile::tempdir().expect("tempdir");
    let second_ca = crate::support::bus_pki::ca(second.path(), "second-client-ca");
    let second_a = crate::support::bus_pki::leaf(
        second.path(),
        "client-a",
        "DNS:broker-a.dynamo",
        "clientAuth",
    );
    let mut next = settings(&h.pki, 64);
    next.tls.as_mut().expect("tls").client_ca = Some(second_ca);
    assert!(h.bus.reload(next), "a new client_ca restarts the listener");
    match a.next_event().await {
        ClientEvent::Closed { code, .. } => assert_eq!(code, ErrorCode::CredentialRevoked),
        other => panic!("expected credential_revoked, got {other:?}"),
    }
    // The token session keeps running.
    h.wait_sessions(1).await;
    // The old connection is still open, but its certificate was verified by the replaced CA.
    let mut session = ClientSession::new(hello(), tick()).expect("valid hello");
    let first = Bytes::from(session.poll_transmit().expect("hello line"));
    let (response, _lines) = a.conn.session(None, Some("1"), first).await;
    assert_eq!(refusal(response).await, (401, ErrorCode::CredentialRevoked));

    // The restarted listener verifies against the new CA only.
    h.tree
        .restart("root/event_bus", WAIT)
        .await
        .expect("restart");
    h.addr = poll("the listener binds again", || h.bus.local_addr()).await;
    let failed = h.refusals("handshake_failed");
    let old_cert = Client {
        cert: Some(&h.pki.client_a),
        ..H2
    };
    if let Ok(mut tls) = tls_connect(&h, old_cert).await {
        // TLS 1.3: the server checks the client certificate after the client finished.
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(WAIT, tls.read(&mut byte))
            .await
            .expect("closed in time");
        assert!(
            !matches!(read, Ok(n) if n > 0),
            "no byte after a refused certificate"
        );
    }
    h.wait_refusals("handshake_failed", failed + 1.0).await;
    TestBroker::connect(&h, hello(), None, Some(&second_a))
        .await
        .expect("the new CA's certificate authenticates broker-a");
}

/// Spec "What the listener enforces": a TLS handshake must complete within 10 s. A client that
/// sends the first handshake byte and stalls is still connected at 9 s (tokio's paused clock)
/// and refused as `handshake_timeout`, its connection closed, at 10 s.
#[tokio::test]
async fn a_stalled_tls_handshake_is_refused_at_10_s() {
    let h = start(64).await;
    let mut tcp = TcpStream::connect(h.addr).await.expect("connect");
    tcp.write_all(&[0x16]).await.expect("write");
    poll("the listener holds the connection", || {
        (h.metrics
            .value("continuum_dynamo_event_bus_connections", &[])
            == Some(1.0))
        .then_some(())
    })
    .await;
    tokio::time::pause();
    settle().await;
    tokio::time::advance(Duration::from_secs(9)).await;
    settle().await;
    assert_eq!(
        h.refusals("handshake_timeout"),
        0.0,
        "still handshaking at 9 s"
    );
    // To 10 s and a millisecond: the clock was paused off a millisecond boundary, and timer
    // deadlines round up to the next one.
    tokio::time::advance(Duration::from_millis(1_001)).await;
    settle().await;
    assert_eq!(h.refusals("handshake_timeout"), 1.0, "refused at 10 s");
    tokio::time::resume();
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(WAIT, tcp.read_to_end(&mut rest))
        .await
        .expect("the connection is closed");
    assert!(rest.is_empty());
    poll("the connection slot is given back", || {
        (h.metrics
            .value("continuum_dynamo_event_bus_connections", &[])
            == Some(0.0))
        .then_some(())
    })
    .await;
}

/// Spec "Hot reload": a listener that cannot start logs `event bus listener failed to start;
/// retrying` and retries every 30 s. Its port is taken at start; once it is free the listener
/// is still down at 29 s (tokio's paused clock) and bound at 30 s.
#[tokio::test(start_paused = true)]
async fn a_listener_that_cannot_bind_retries_every_30_s() {
    let logs = crate::support::logs::Logs::default();
    let _guard = logs.install();
    let pki = pki();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let mut wanted = settings(&pki, 4);
    wanted.listen = taken.local_addr().expect("addr");
    let metrics = Metrics::new("event-bus-retry-test").expect("metrics");
    let bus = EventBus::new(wanted.clone(), Some(&metrics));
    let (root, _task) = spawn_root(
        vec![event_bus_spec(bus.clone())],
        ActorTree::default(),
        Some(metrics.clone()),
    )
    .await
    .expect("root starts");
    let failed = "event bus listener failed to start; retrying";
    let mut yields = 0;
    while !logs.text().contains(failed) {
        assert!(yields < 10_000, "the first attempt fails: {}", logs.text());
        tokio::task::yield_now().await;
        yields += 1;
    }
    assert!(logs.text().contains("retry_s=30"), "{}", logs.text());
    assert!(!bus.is_running());
    drop(taken);
    tokio::time::advance(Duration::from_secs(29)).await;
    settle().await;
    assert!(!bus.is_running(), "no retry before 30 s");
    assert_eq!(logs.text().matches(failed).count(), 1);
    tokio::time::advance(Duration::from_secs(1)).await;
    settle().await;
    assert!(bus.is_running(), "bound on the retry at 30 s");
    assert_eq!(bus.local_addr(), Some(wanted.listen));
    assert_eq!(
        metrics.value("continuum_dynamo_event_bus_listener_up", &[]),
        Some(1.0)
    );
    root.stop(None);
}

/// A hand-driven HTTP/2 client over the listener's TLS: it answers nothing on its own (no PING
/// acks, no window updates), so every frame the listener sends is seen.
struct RawH2 {
    tls: tokio_rustls::client::TlsStream<TcpStream>,
    buf: Vec<u8>,
}

/// One HTTP/2 frame: type, flags, stream id, payload.
type RawFrame = (u8, u8, u32, Vec<u8>);

impl RawH2 {
    async fn connect(h: &Harness) -> RawH2 {
        let mut tls = tls_connect(h, H2).await.expect("TLS handshake");
        tls.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .expect("preface");
        let mut raw = RawH2 { tls, buf: vec![] };
        raw.send(0x4, 0, 0, &[]).await; // SETTINGS
        raw
    }

    async fn send(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
        let len = u32::try_from(payload.len()).expect("small frame");
        let mut frame = len.to_be_bytes()[1..].to_vec();
        frame.extend([kind, flags]);
        frame.extend(stream.to_be_bytes());
        frame.extend(payload);
        self.tls.write_all(&frame).await.expect("write frame");
        self.tls.flush().await.expect("flush");
    }

    /// A session request as a header block of literals (no indexing, no Huffman) and the
    /// hello line as its first DATA frame, the stream left open.
    async fn session(&mut self, bearer: &str, hello: &[u8]) {
        let mut block = Vec::new();
        for (name, value) in [
            (":method", "POST"),
            (":scheme", "https"),
            (":path", SESSION_PATH),
            (":authority", "localhost"),
            ("authorization", bearer),
            (VERSION_HEADER, "1"),
        ] {
            block.push(0x00);
            for text in [name, value] {
                block.push(
                    u8::try_from(text.len())
                        .ok()
                        .filter(|n| *n < 127)
                        .expect("short"),
                );
                block.extend(text.as_bytes());
            }
        }
        self.send(0x1, 0x4, 1, &block).await; // HEADERS, END_HEADERS
        self.send(0x0, 0, 1, hello).await; // DATA
    }

    fn parse(&mut self) -> Option<RawFrame> {
        let header = self.buf.get(..9)?;
        let len = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
        if self.buf.len() < 9 + len {
            return None;
        }
        let (kind, flags) = (header[3], header[4]);
        let stream = u32::from_be_bytes([header[5], header[6], header[7], header[8]]) & 0x7fff_ffff;
        let payload = self.buf[9..9 + len].to_vec();
        self.buf.drain(..9 + len);
        Some((kind, flags, stream, payload))
    }

    /// The next frame, waiting for it (real time).
    async fn next(&mut self) -> RawFrame {
        loop {
            if let Some(frame) = self.parse() {
                return frame;
            }
            let mut chunk = [0u8; 4096];
            let n = tokio::time::timeout(WAIT, self.tls.read(&mut chunk))
                .await
                .expect("a frame in time")
                .expect("read");
            assert!(n > 0, "the listener closed the connection");
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// Every frame already readable, without waiting (safe on the paused clock).
    fn ready(&mut self) -> Vec<RawFrame> {
        use futures::FutureExt as _;
        let mut chunk = [0u8; 4096];
        while let Some(Ok(n)) = self.tls.read(&mut chunk).now_or_never() {
            if n == 0 {
                break;
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
        std::iter::from_fn(|| self.parse()).collect()
    }
}

const PING: u8 = 0x6;

/// Spec "What the listener enforces": HTTP/2 keepalive PINGs run every 20 s. A welcomed session
/// whose client then goes quiet gets no PING by 19 s after its last frame (tokio's paused clock)
/// and one by 21 s.
#[tokio::test]
async fn the_listener_pings_a_quiet_connection_after_20_s() {
    let h = start(64).await;
    let mut raw = RawH2::connect(&h).await;
    let id = "broker-a.dynamo";
    let mut session = ClientSession::new(broker_hello(id, &["dynamo"]), tick()).expect("hello");
    let hello = session.poll_transmit().expect("hello line");
    raw.session(&format!("Bearer {}", token(id)), &hello).await;
    // Until the answer's head and first data (the welcome); the listener's SETTINGS acked.
    let (mut head, mut welcome) = (false, false);
    while !(head && welcome) {
        let (kind, flags, stream, payload) = raw.next().await;
        match kind {
            0x4 if flags & 0x1 == 0 => raw.send(0x4, 0x1, 0, &[]).await,
            // `:status: 200` is the static table's entry 8.
            0x1 if stream == 1 => {
                assert_eq!(payload.first(), Some(&0x88), "200: {payload:?}");
                head = true;
            }
            0x0 if stream == 1 => welcome = true,
            0x7 => panic!("GOAWAY: {payload:?}"),
            _ => {}
        }
    }
    h.wait_sessions(1).await;
    tokio::time::pause();
    settle().await;
    tokio::time::advance(Duration::from_secs(19)).await;
    settle().await;
    let early = raw.ready();
    assert!(
        early.iter().all(|f| f.0 != PING),
        "no PING within 19 s: {early:?}"
    );
    tokio::time::advance(Duration::from_secs(2)).await;
    settle().await;
    tokio::time::resume();
    loop {
        let (kind, flags, _, payload) = raw.next().await;
        if kind == PING {
            assert_eq!(flags & 0x1, 0, "a PING, not an ack");
            assert_eq!(payload.len(), 8);
            break;
        }
    }
    assert_eq!(h.bus.session_count(), 1, "the session is still up");
}

#[tokio::test]
async fn hostile_lines_after_the_welcome_cost_only_their_own_session() {
    let h = start(64).await;
    let mut a = TestBroker::as_broker(&h, "broker-a.dynamo").await;
    let mut b = TestBroker::as_broker(&h, "broker-b.dynamo").await;
    let mut c = TestBroker::as_broker(&h, "broker-c.dynamo").await;
    h.wait_sessions(3).await;
    // An over-long line (no newline within 64 KiB).
    a.send_raw(vec![b'x'; 70 * 1024]).await;
    match a.next_event().await {
        ClientEvent::Closed { code, .. } => assert_eq!(code, ErrorCode::ProtocolError),
        other => panic!("expected protocol_error, got {other:?}"),
    }
    // An unknown message type.
    b.send_raw(b"{\"type\":\"bogus\"}\n".to_vec()).await;
    match b.next_event().await {
        ClientEvent::Closed { code, .. } => assert_eq!(code, ErrorCode::ProtocolError),
        other => panic!("expected protocol_error, got {other:?}"),
    }
    h.wait_sessions(1).await;
    // broker-c still gets commanded and serves a stream.
    let bus = h.bus.clone();
    let consumer =
        tokio::spawn(async move { bus.open_stream(target(), EventTopic::KvEvents).await });
    let ClientEvent::OpenStream { stream_id, .. } = c.next_event().await else {
        panic!("broker-c is commanded");
    };
    let _data = c.open_data_stream(stream_id, None).await.expect("accepted");
    assert!(
        tokio::time::timeout(WAIT, consumer)
            .await
            .expect("in time")
            .expect("task")
            .is_ok()
    );
    assert_eq!(
        h.metrics.value(
            "continuum_dynamo_event_bus_sessions_closed_total",
            &[("code", "protocol_error")]
        ),
        Some(2.0)
    );
}

#[tokio::test]
async fn a_kv_listener_serves_announced_streams_and_a_refused_subscribe_is_reported() {
    let h = start(64).await;
    let hello = Hello {
        role: Role::KvListener,
        client_id: ClientId::new(LISTENER),
        versions: vec![1],
        dynamo_namespaces: vec![],
        sources: vec![AnnouncedSource {
            backend: "vllm-1".into(),
        }],
    };
    let mut listener = TestBroker::connect(&h, hello, Some(token(LISTENER)), None)
        .await
        .expect("kv_listener welcomed");
    assert_eq!(
        h.bus.open_announced_stream("vllm-2", None).await.err(),
        Some(BusStreamError::NoSession)
    );
    let bus = h.bus.clone();
    let consumer = tokio::spawn(async move { bus.open_announced_stream("vllm-1", Some(42)).await });
    let ClientEvent::OpenStream { stream_id, target } = listener.next_event().await else {
        panic!("the kv_listener is commanded");
    };
    match target {
        StreamTarget::AnnouncedSource(source) => {
            assert_eq!(source.backend, "vllm-1");
            assert_eq!(source.last_event_id, Some(42));
        }
        other => panic!("unexpected target {other:?}"),
    }
    // The agent cannot serve it: the consumer gets Refused(reason).
    listener.session.stream_closed(
        stream_id,
        continuum_protocol::event_bus::StreamCloseReason::ConnectFailed,
        None,
    );
    listener.flush().await;
    let result = tokio::time::timeout(WAIT, consumer)
        .await
        .expect("in time")
        .expect("task");
    assert_eq!(
        result.err(),
        Some(BusStreamError::Refused(
            continuum_protocol::event_bus::StreamCloseReason::ConnectFailed
        ))
    );

    // A stream it serves; then it drains: the router unsubscribes at once (consumers fail
    // over) and places nothing new there.
    let bus = h.bus.clone();
    let consumer = tokio::spawn(async move { bus.open_announced_stream("vllm-1", None).await });
    let ClientEvent::OpenStream { stream_id, .. } = listener.next_event().await else {
        panic!("the kv_listener is commanded again");
    };
    let (_to_router, _from_router) = listener
        .open_data_stream(stream_id, None)
        .await
        .expect("accepted");
    let mut stream = tokio::time::timeout(WAIT, consumer)
        .await
        .expect("in time")
        .expect("task")
        .expect("a BusStream");
    listener.session.drain();
    listener.flush().await;
    match listener.next_event().await {
        ClientEvent::CloseStream(id) => assert_eq!(id, stream_id),
        other => panic!("expected an unsubscribe, got {other:?}"),
    }
    let mut buf = [0u8; 8];
    let cut = tokio::time::timeout(WAIT, stream.read(&mut buf))
        .await
        .expect("the cut is seen in time");
    assert_eq!(
        cut.map_err(|e| e.kind()).err(),
        Some(std::io::ErrorKind::ConnectionAborted)
    );
    poll("the drain reaches the session table", || {
        let view = h.bus.subscribe_sessions();
        let draining = view.borrow().sessions.iter().all(|s| s.draining);
        draining.then_some(())
    })
    .await;
    assert_eq!(
        h.bus.open_announced_stream("vllm-1", None).await.err(),
        Some(BusStreamError::Busy)
    );
}

fn daemon_yaml(pki: &Pki, brokers: &[&str]) -> String {
    let mut yaml = format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\nadmin:\n  enabled: true\n  token: bus-admin-token-0123\n\
         backends:\n  - name: a\n    type: openai\n    url: \"http://127.0.0.1:9\"\n    \
         models: [m]\n    health_check: {{enabled: false}}\n\
         dynamo:\n  event_bus:\n    enabled: true\n    listen: \"127.0.0.2:0\"\n    tls:\n      \
         cert: {:?}\n      key: {:?}\n      client_ca: {:?}\n    brokers:\n",
        pki.server.0, pki.server.1, pki.ca
    );
    for id in brokers {
        let digest = sha256_hex(token(id).as_bytes());
        yaml.push_str(&format!(
            "      - id: {id}\n        token_hash: \"sha256:{digest}\"\n        namespaces: [dynamo]\n"
        ));
    }
    yaml
}

/// [`daemon_yaml`] with file discovery of namespace `dynamo` and `load.transport: broker`.
fn broker_transport_yaml(pki: &Pki, root: &Path) -> String {
    daemon_yaml(pki, &["broker-a.dynamo"]).replace(
        "dynamo:\n",
        &format!(
            "dynamo:\n  enabled: true\n  discovery:\n    source: file\n    file:\n      \
             root: {root:?}\n      namespace: dynamo\n      rescan_interval: 100ms\n      \
             ttl: 60s\n  load:\n    transport: broker\n"
        ),
    )
}

fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[tokio::test]
async fn the_daemon_runs_the_bus_under_root_and_reloads_it_in_place() {
    let pki = pki();
    let path = pki._dir.path().join("config.yaml");
    std::fs::write(
        &path,
        daemon_yaml(&pki, &["broker-a.dynamo", "broker-b.dynamo"]),
    )
    .expect("write config");
    let daemon = crate::support::daemon::start_file(&path).await;
    let row = daemon
        .tree()
        .get("root/event_bus")
        .expect("root/event_bus listed");
    assert_eq!(row.kind, "broker_supervisor");
    let bus = daemon.event_bus().clone();
    let addr = poll("the daemon's listener binds", || bus.local_addr()).await;
    let mut h = Harness {
        bus: bus.clone(),
        metrics: daemon.metrics().clone(),
        tree: daemon.tree().clone(),
        addr,
        pki,
        root: None,
    };
    let mut a = TestBroker::as_broker(&h, "broker-a.dynamo").await;
    let mut b = TestBroker::as_broker(&h, "broker-b.dynamo").await;
    h.wait_sessions(2).await;

    // The daemon's reload path: broker-a's entry is gone, broker-b keeps running.
    std::fs::write(&path, daemon_yaml(&h.pki, &["broker-b.dynamo"])).expect("rewrite config");
    let summary = daemon.reload().await.expect("reload applies");
    assert!(
        !summary.contains("event bus listener restarted"),
        "{summary}"
    );
    match a.next_event().await {
        ClientEvent::Closed { code, .. } => assert_eq!(code, ErrorCode::CredentialRevoked),
        other => panic!("expected credential_revoked, got {other:?}"),
    }
    h.wait_sessions(1).await;

    // An operator restart of root/event_bus ends the sessions with `shutdown` and binds anew.
    daemon
        .tree()
        .restart("root/event_bus", WAIT)
        .await
        .expect("restart");
    match b.next_event().await {
        ClientEvent::Closed { code, .. } => assert_eq!(code, ErrorCode::Shutdown),
        other => panic!("expected shutdown, got {other:?}"),
    }
    h.addr = poll("the listener binds again", || bus.local_addr()).await;
    TestBroker::as_broker(&h, "broker-b.dynamo").await;
    assert_eq!(
        daemon.tree().get("root/event_bus").expect("row").restarts,
        1
    );
}

impl TestBroker {
    /// Serves the next subscribe as continuum-event-broker does: dials the ZMQ publisher and
    /// relays bytes both ways between it and the data stream.
    pub(crate) async fn relay_next(&mut self) -> StreamId {
        let ClientEvent::OpenStream { stream_id, target } = self.next_event().await else {
            panic!("expected a subscribe");
        };
        let StreamTarget::ZmqTcp { target, .. } = target else {
            panic!("a broker gets zmq_tcp targets");
        };
        let tcp = TcpStream::connect((target.host.as_str(), target.port))
            .await
            .expect("dial the publisher");
        let (mut to_router, mut from_router) = self
            .open_data_stream(stream_id, None)
            .await
            .expect("commanded stream accepted");
        let (mut read, mut write) = tcp.into_split();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            while let Ok(n) = read.read(&mut buf).await {
                if n == 0
                    || to_router
                        .send(Bytes::copy_from_slice(&buf[..n]))
                        .await
                        .is_err()
                {
                    break;
                }
            }
        });
        tokio::spawn(async move {
            while let Some(Ok(frame)) = from_router.frame().await {
                if let Ok(data) = frame.into_data()
                    && write.write_all(&data).await.is_err()
                {
                    break;
                }
            }
        });
        stream_id
    }
}

#[tokio::test]
async fn a_broker_transport_subscription_is_pending_until_a_broker_covers_it_then_reads_through_the_bus()
 {
    use continuum_actors::kv_index::SharedKvIndex;
    use continuum_actors::load::SharedLoadStore;
    use continuum_actors::load::SubscriptionTransport;
    use continuum_actors::subscription::{DialPolicy, SubscriptionActor, SubscriptionArgs};
    use continuum_demo::zmq_pub::PubSocket;
    use continuum_protocol::event_plane::ActiveLoad;
    use continuum_protocol::event_plane::encode::encode_kv_metrics;
    use continuum_protocol::ids::{DpRank, InstanceId, PublisherId};
    use continuum_protocol::subscription_plan::SubscriptionTarget;
    use continuum_protocol::time::UnixMillis;

    let h = start(64).await;
    let socket = PubSocket::bind("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("bind publisher");
    let publisher = PublisherId(0x5eed);
    let store = SharedLoadStore::new(None);
    // The registry's live-worker gate (the follower sets it from the fleet snapshot).
    store.with(|s| s.set_live_and_retain([InstanceId(7)]));
    let target = SubscriptionTarget {
        topic: EventTopic::KvMetrics,
        namespace: Namespace::new("dynamo"),
        publisher_id: publisher,
        component: None,
        endpoint: format!("tcp://{}", socket.local_addr()),
    };
    let args = SubscriptionArgs {
        name: target.child_name(),
        target,
        policy: DialPolicy {
            transport: SubscriptionTransport::Broker,
            allow_cidrs: None,
            kv_events: false,
            bus: Some(h.bus.clone()),
        },
        store: store.clone(),
        kv: SharedKvIndex::new(None),
        metrics: None,
        span: tracing::Span::none(),
    };
    let (actor, _) = ractor::Actor::spawn(None, SubscriptionActor, args)
        .await
        .expect("subscription starts");
    let state = |store: &SharedLoadStore| {
        store
            .subscriptions()
            .first()
            .map(|s| (s.state, s.transport))
    };
    poll("the subscription is pending", || {
        (state(&store) == Some(("pending", "broker"))).then_some(())
    })
    .await;
    assert_eq!(socket.peer_count(), 0, "never dialled directly");
    let coverage = |h: &Harness| {
        (
            h.metrics.value(
                "continuum_dynamo_broker_pending_subscriptions",
                &[("family", "kv_metrics"), ("namespace", "dynamo")],
            ),
            h.metrics.value(
                "continuum_dynamo_broker_namespace_sessions",
                &[("namespace", "dynamo")],
            ),
        )
    };
    poll("the pending subscription is exported", || {
        (coverage(&h) == (Some(1.0), Some(0.0))).then_some(())
    })
    .await;

    // A broker covering the namespace connects: the subscription wakes and is relayed.
    let mut a = TestBroker::as_broker(&h, "broker-a.dynamo").await;
    a.relay_next().await;
    let mut subscribed = socket.subscribed();
    tokio::time::timeout(WAIT, subscribed.wait_for(|n| *n == 1))
        .await
        .expect("subscribed through the tunnel in time")
        .expect("publisher alive");
    let load = ActiveLoad {
        worker_id: InstanceId(7),
        dp_rank: DpRank(0),
        active_decode_blocks: Some(3),
        active_prefill_tokens: Some(11),
        kv_used_blocks: Some(5),
    };
    socket.send(&encode_kv_metrics(publisher, 0, UnixMillis(1), &load));
    let mut generations = store.subscribe();
    tokio::time::timeout(WAIT, async {
        while store.latest(InstanceId(7), DpRank(0)).is_none() {
            generations.changed().await.expect("store alive");
        }
    })
    .await
    .expect("the sample arrives through the bus");
    let sample = store.latest(InstanceId(7), DpRank(0)).expect("sample");
    assert_eq!(sample.load.active_prefill_tokens, Some(11));
    assert_eq!(state(&store), Some(("connected", "broker")));
    poll("the covered namespace is exported", || {
        (coverage(&h) == (Some(0.0), Some(1.0))).then_some(())
    })
    .await;
    let carried = |h: &Harness, broker: &str| {
        h.metrics.value(
            "continuum_dynamo_broker_subscriptions",
            &[("family", "kv_metrics"), ("broker", broker)],
        )
    };
    let broker_of =
        |store: &SharedLoadStore| store.subscriptions().first().and_then(|s| s.broker.clone());
    assert_eq!(broker_of(&store).as_deref(), Some("broker-a.dynamo"));
    poll("the carrying broker is exported", || {
        (carried(&h, "broker-a.dynamo") == Some(1.0)).then_some(())
    })
    .await;

    // A second broker covers the namespace too; the first one's session ends: the
    // subscription fails over to it.
    let mut b = TestBroker::as_broker(&h, "broker-b.dynamo").await;
    drop(a);
    b.relay_next().await;
    let mut sequence = 1;
    poll("a sample arrives through the second broker", || {
        let mut next = load;
        next.active_prefill_tokens = Some(12);
        socket.send(&encode_kv_metrics(
            publisher,
            sequence,
            UnixMillis(2),
            &next,
        ));
        sequence += 1;
        store
            .latest(InstanceId(7), DpRank(0))
            .filter(|s| s.load.active_prefill_tokens == Some(12))
            .map(|_| ())
    })
    .await;

    assert_eq!(broker_of(&store).as_deref(), Some("broker-b.dynamo"));
    poll("the carrying broker moves", || {
        (carried(&h, "broker-b.dynamo") == Some(1.0) && carried(&h, "broker-a.dynamo").is_none())
            .then_some(())
    })
    .await;

    // The last covering broker leaves: the subscription goes back to pending, never direct.
    drop(b);
    poll("pending again after the brokers left", || {
        (state(&store) == Some(("pending", "broker"))).then_some(())
    })
    .await;
    poll("pending again in the gauges", || {
        (coverage(&h) == (Some(1.0), Some(0.0))).then_some(())
    })
    .await;
    // The subscription stops: its series go.
    actor.stop(None);
    poll("the series are removed", || {
        (coverage(&h) == (None, None)).then_some(())
    })
    .await;
}

#[tokio::test]
async fn under_broker_transport_the_workers_view_shows_broker_coverage() {
    let pki = pki();
    let root = pki._dir.path().join("store");
    std::fs::create_dir_all(&root).expect("store dir");
    let path = pki._dir.path().join("config.yaml");
    std::fs::write(&path, broker_transport_yaml(&pki, &root)).expect("write config");
    let daemon = crate::support::daemon::start_file(&path).await;
    let bus = daemon.event_bus().clone();
    let addr = poll("the daemon's listener binds", || bus.local_addr()).await;
    let workers_url = format!("http://{}/admin/dynamo/workers", daemon.local_addr());
    let coverage = || async {
        let view: serde_json::Value = reqwest::Client::new()
            .get(&workers_url)
            .bearer_auth("bus-admin-token-0123")
            .send()
            .await
            .expect("workers view")
            .json()
            .await
            .expect("json");
        view["broker_coverage"].clone()
    };
    assert_eq!(
        coverage().await,
        serde_json::json!([{"namespace": "dynamo", "covered": false, "brokers": [],
            "pending_subscriptions": 0}])
    );
    // The gauges exist for the configured namespace although no subscription wants it yet.
    let metrics = daemon.metrics().clone();
    let gauges = |metrics: &Metrics| {
        (
            metrics.value(
                "continuum_dynamo_broker_namespace_sessions",
                &[("namespace", "dynamo")],
            ),
            metrics.value(
                "continuum_dynamo_broker_pending_subscriptions",
                &[("family", "kv_metrics"), ("namespace", "dynamo")],
            ),
            metrics.value(
                "continuum_dynamo_broker_pending_subscriptions",
                &[("family", "kv-events"), ("namespace", "dynamo")],
            ),
        )
    };
    poll("the configured namespace's gauges are exported", || {
        (gauges(&metrics) == (Some(0.0), Some(0.0), Some(0.0))).then_some(())
    })
    .await;
    let h = Harness {
        bus: bus.clone(),
        metrics: daemon.metrics().clone(),
        tree: daemon.tree().clone(),
        addr,
        pki,
        root: None,
    };
    let _a = TestBroker::as_broker(&h, "broker-a.dynamo").await;
    h.wait_sessions(1).await;
    assert_eq!(
        coverage().await,
        serde_json::json!([{"namespace": "dynamo", "covered": true,
            "brokers": ["broker-a.dynamo"], "pending_subscriptions": 0}])
    );
    poll("the covering session is exported", || {
        (gauges(&metrics) == (Some(1.0), Some(0.0), Some(0.0))).then_some(())
    })
    .await;
}

#[tokio::test]
async fn rendezvous_placement_is_the_same_on_two_routers() {
    // Two routers with the same two brokers connected: both command the stream for one target
    // on the same broker (docs/event-bus.md's test vector: broker-a outweighs broker-b).
    let first = start(64).await;
    let second = start(64).await;
    let mut on_first = Vec::new();
    let mut on_second = Vec::new();
    for id in ["broker-b.dynamo", "broker-a.dynamo"] {
        on_first.push(TestBroker::as_broker(&first, id).await);
        on_second.push(TestBroker::as_broker(&second, id).await);
    }
    for (h, brokers) in [(&first, &mut on_first), (&second, &mut on_second)] {
        let bus = h.bus.clone();
        let consumer =
            tokio::spawn(async move { bus.open_stream(target(), EventTopic::KvMetrics).await });
        // broker-a (index 1) is commanded.
        let ClientEvent::OpenStream { stream_id, .. } = brokers[1].next_event().await else {
            panic!("broker-a is commanded");
        };
        let _data = brokers[1]
            .open_data_stream(stream_id, None)
            .await
            .expect("accepted");
        let stream = tokio::time::timeout(WAIT, consumer)
            .await
            .expect("in time")
            .expect("task")
            .expect("a BusStream");
        assert_eq!(stream.broker().as_str(), "broker-a.dynamo");
        let view = h.bus.subscribe_sessions();
        let streams: Vec<(String, usize)> = view
            .borrow()
            .sessions
            .iter()
            .map(|s| (s.client_id.to_string(), s.streams))
            .collect();
        assert!(
            streams.contains(&("broker-b.dynamo".into(), 0)),
            "broker-b carries nothing: {streams:?}"
        );
    }
}
