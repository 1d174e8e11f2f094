//! The listener: TCP accept with the connection cap, first-byte peek, TLS 1.3 with ALPN h2
//! only (rustls, ring), hyper's HTTP/2 server with the exact windows of `SessionBounds`,
//! per-connection deadlines (`auth_timeout`, the 30 s linger), authentication, the pre-hello
//! session handshake and data-stream admission.
//!
//! Every refusal is counted in `continuum_dynamo_event_bus_refusals_total{code}`; requests get
//! the code's HTTP status and `{"error":{"code","message"}}`, connections are closed.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::lock::Mutex;
use std::time::Duration;

use bytes::Bytes;
use continuum_protocol::event_bus::bounds::{MAX_FRAME_BYTES, max_connections};
use continuum_protocol::event_bus::credential::{Presented, TokenHash, authenticate, bearer_token};
use continuum_protocol::event_bus::hello::{Refusal, parse_version_header};
use continuum_protocol::event_bus::message::{ClientId, ErrorBody, ErrorCode, SessionId};
use continuum_protocol::event_bus::server::ServerEvent;
use continuum_protocol::event_bus::transport::{
    ConnectionTimers, FirstByte, HANDSHAKE_TIMEOUT, KEEPALIVE_INTERVAL, STARTUP_RETRY,
    classify_first_byte, plaintext_refusal,
};
use continuum_protocol::event_bus::{
    ALPN_H2, BusPath, NDJSON_CONTENT_TYPE, SESSION_HEADER, ServerSession, VERSION_HEADER,
};
use futures::StreamExt as _;
use futures::channel::mpsc;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt as _, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use ractor::{Actor, ActorCell};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, oneshot};
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tracing::{Instrument as _, debug, error, info, warn};

use super::session::{BrokerSessionActor, CONTROL_QUEUE, SessionArgs, SessionMsg};
use super::settings::BusSettings;
use super::{AuthBy, EventBus};
use crate::clock::now_tick;
use crate::lifecycle::{ActorKind, ActorSpan};
use crate::tree::{ActorPath, ActorTree};

type ResponseBody = UnsyncBoxBody<Bytes, Infallible>;

/// How long the accept loop waits after a failed accept (out of descriptors and the like)
/// before the next one: no spinning on a full descriptor table, recovery at once after.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(100);
/// How long a refused plaintext client gets to read the 403 before the socket closes.
const PLAINTEXT_LINGER: Duration = Duration::from_secs(1);
/// How long a data-stream request waits for its session actor's answer.
const ACCEPT_ANSWER_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a connection closing for `auth_timeout` or the linger gets to finish its GOAWAY.
const GOAWAY_GRACE: Duration = Duration::from_secs(5);

/// What the listener needs to start session actors under the `BrokerSupervisor`.
#[derive(Clone)]
pub(crate) struct SessionSpawner {
    pub(crate) supervisor: ActorCell,
    pub(crate) tree: ActorTree,
    pub(crate) path: ActorPath,
    pub(crate) span: ActorSpan,
}

/// Binds and serves until aborted; a listener that cannot start logs and retries every 30 s.
pub(crate) async fn run(bus: EventBus, spawner: SessionSpawner) {
    loop {
        let settings = bus.settings();
        if !settings.enabled {
            bus.set_running(None);
            info!("The event bus listener is disabled (dynamo.event_bus.enabled: false).");
            return;
        }
        match start(&settings).await {
            Ok((listener, acceptor)) => {
                let addr = listener.local_addr().ok();
                bus.set_running(addr);
                info!(listen = ?addr, "Event bus listener started.");
                accept_loop(&bus, &spawner, &settings, listener, acceptor).await;
            }
            Err(error) => {
                bus.set_running(None);
                error!(%error, listen = %settings.listen, retry_s = STARTUP_RETRY.as_secs(), "event bus listener failed to start; retrying");
                tokio::time::sleep(STARTUP_RETRY).await;
            }
        }
    }
}

async fn start(settings: &BusSettings) -> Result<(TcpListener, TlsAcceptor), String> {
    let acceptor = tls_acceptor(settings)?;
    let listener = TcpListener::bind(settings.listen)
        .await
        .map_err(|e| format!("cannot bind {}: {e}", settings.listen))?;
    Ok((listener, acceptor))
}

/// TLS 1.3 only, ALPN h2 only, ring; client certificates optional, verified against
/// `tls.client_ca` when configured.
pub(crate) fn tls_acceptor(settings: &BusSettings) -> Result<TlsAcceptor, String> {
    let tls = settings
        .tls
        .as_ref()
        .ok_or("dynamo.event_bus.tls.cert and .key are required")?;
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&tls.cert)
        .map_err(|e| format!("cannot read {}: {e}", tls.cert.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("cannot parse {}: {e}", tls.cert.display()))?;
    if certs.is_empty() {
        return Err(format!("{} holds no certificate", tls.cert.display()));
    }
    let key = PrivateKeyDer::from_pem_file(&tls.key)
        .map_err(|e| format!("cannot read the key {}: {e}", tls.key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?;
    let builder = match &tls.client_ca {
        Some(path) => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in CertificateDer::pem_file_iter(path)
                .map_err(|e| format!("cannot read {}: {e}", path.display()))?
            {
                let cert = cert.map_err(|e| format!("cannot parse {}: {e}", path.display()))?;
                roots
                    .add(cert)
                    .map_err(|e| format!("bad CA in {}: {e}", path.display()))?;
            }
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                    .allow_unauthenticated()
                    .build()
                    .map_err(|e| e.to_string())?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(certs, key)
        .map_err(|e| format!("the certificate and key do not fit: {e}"))?;
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Counts live connections; the guard gives the slot back.
struct ConnectionSlot {
    count: Arc<AtomicU64>,
    bus: EventBus,
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::AcqRel);
        if let Some(metrics) = self.bus.metrics() {
            metrics.connection_closed();
        }
    }
}

async fn accept_loop(
    bus: &EventBus,
    spawner: &SessionSpawner,
    settings: &BusSettings,
    listener: TcpListener,
    acceptor: TlsAcceptor,
) {
    let count = Arc::new(AtomicU64::new(0));
    let mut connections = JoinSet::new();
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of descriptors and the like: back off briefly, keep the listener.
                warn!(%error, "Event bus accept failed.");
                tokio::time::sleep(ACCEPT_ERROR_BACKOFF).await;
                continue;
            }
        };
        while connections.try_join_next().is_some() {}
        // max_sessions may change on reload; the cap follows it.
        let limit = max_connections(bus.settings().max_sessions);
        if count.load(Ordering::Acquire) >= limit {
            debug!(%peer, limit, "Event bus connection refused: connection_limit.");
            refused(bus, ErrorCode::ConnectionLimit);
            drop(tcp);
            continue;
        }
        // Small frames (relayed ZMTP messages, WINDOW_UPDATEs, control lines) go out at once:
        // with Nagle's algorithm each waited for the peer's delayed ACK (~40 ms on Linux).
        if let Err(error) = tcp.set_nodelay(true) {
            debug!(%peer, %error, "Could not set TCP_NODELAY on an event bus connection.");
        }
        count.fetch_add(1, Ordering::AcqRel);
        if let Some(metrics) = bus.metrics() {
            metrics.connection_opened();
        }
        let slot = ConnectionSlot {
            count: count.clone(),
            bus: bus.clone(),
        };
        let conn = Connection {
            bus: bus.clone(),
            spawner: spawner.clone(),
            settings: settings.clone(),
            peer,
        };
        connections.spawn(
            conn.serve(tcp, acceptor.clone(), slot)
                .instrument(tracing::debug_span!("event_bus_connection", %peer)),
        );
    }
}

fn refused(bus: &EventBus, code: ErrorCode) {
    if let Some(metrics) = bus.metrics() {
        metrics.refused(code);
    }
}

/// The deadlines of one connection, shared with its requests.
struct Timers {
    timers: Mutex<ConnectionTimers>,
    changed: Notify,
}

impl Timers {
    fn lock(&self) -> crate::lock::MutexGuard<'_, ConnectionTimers> {
        self.timers.lock()
    }

    fn accepted(self: &Arc<Self>) -> AcceptedRequest {
        self.lock().request_accepted();
        self.changed.notify_one();
        AcceptedRequest {
            timers: self.clone(),
        }
    }
}

/// Held by an accepted request's response body: its end starts the linger.
struct AcceptedRequest {
    timers: Arc<Timers>,
}

impl Drop for AcceptedRequest {
    fn drop(&mut self) {
        self.timers.lock().request_ended(now_tick());
        self.timers.changed.notify_one();
    }
}

#[derive(Clone)]
struct Connection {
    bus: EventBus,
    spawner: SessionSpawner,
    settings: BusSettings,
    peer: SocketAddr,
}

enum Early {
    Closed,
    Refused(ErrorCode),
}

impl Connection {
    async fn serve(self, tcp: TcpStream, acceptor: TlsAcceptor, _slot: ConnectionSlot) {
        let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(tcp, acceptor)).await;
        let tls = match handshake {
            Ok(Ok(tls)) => tls,
            Ok(Err(Early::Closed)) => return,
            Ok(Err(Early::Refused(code))) => {
                debug!(peer = %self.peer, code = code.as_str(), "Event bus connection refused.");
                refused(&self.bus, code);
                return;
            }
            Err(_) => {
                refused(&self.bus, ErrorCode::HandshakeTimeout);
                return;
            }
        };
        let sans = client_dns_sans(&tls);
        let timers = Arc::new(Timers {
            timers: Mutex::new(ConnectionTimers::new(now_tick())),
            changed: Notify::new(),
        });
        let bounds = self.settings.bounds;
        let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
        builder
            .timer(TokioTimer::new())
            .initial_stream_window_size(bounds.stream_window())
            .initial_connection_window_size(bounds.connection_window())
            .adaptive_window(false)
            .max_frame_size(MAX_FRAME_BYTES)
            .max_send_buf_size(usize::try_from(bounds.stream_buffer_bytes).unwrap_or(usize::MAX))
            // The control channel and every stream of the session, plus one for a superseding
            // session request on the same connection.
            .max_concurrent_streams(bounds.max_streams_per_session.saturating_add(2))
            .keep_alive_interval(KEEPALIVE_INTERVAL)
            .keep_alive_timeout(KEEPALIVE_INTERVAL);
        let ctx = Arc::new(RequestCtx {
            conn: self.clone(),
            sans,
            timers: timers.clone(),
        });
        let service = hyper::service::service_fn(move |request| {
            let ctx = ctx.clone();
            async move { Ok::<_, Infallible>(ctx.handle(request).await) }
        });
        let conn = builder.serve_connection(TokioIo::new(tls), service);
        tokio::pin!(conn);
        loop {
            let deadline = timers.lock().deadline();
            let sleep = async {
                match deadline {
                    Some((at, _)) => {
                        tokio::time::sleep(at.0.saturating_sub(now_tick().0)).await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                result = conn.as_mut() => {
                    if let Err(error) = result {
                        debug!(peer = %self.peer, %error, "Event bus connection ended.");
                    }
                    return;
                }
                () = sleep => {
                    let expired = timers.lock().expired(now_tick());
                    if let Some(code) = expired {
                        if code == ErrorCode::AuthTimeout {
                            refused(&self.bus, code);
                        }
                        debug!(peer = %self.peer, code = code.as_str(), "Event bus connection closing.");
                        conn.as_mut().graceful_shutdown();
                        let _ = tokio::time::timeout(GOAWAY_GRACE, conn.as_mut()).await;
                        return;
                    }
                }
                () = timers.changed.notified() => {}
            }
        }
    }
}

/// First-byte peek, then the TLS handshake; the accepted connection must have chosen h2.
async fn handshake(
    mut tcp: TcpStream,
    acceptor: TlsAcceptor,
) -> Result<tokio_rustls::server::TlsStream<TcpStream>, Early> {
    let mut first = [0u8; 1];
    match tcp.peek(&mut first).await {
        Ok(0) | Err(_) => return Err(Early::Closed),
        Ok(_) => {}
    }
    match classify_first_byte(first[0]) {
        FirstByte::Tls => {}
        FirstByte::PlaintextLetter => {
            let _ = tcp.write_all(&plaintext_refusal()).await;
            let _ = tcp.shutdown().await;
            // Read what the client sent so closing does not reset the connection before it
            // read the 403 (bounded in time and bytes).
            let mut sink = [0u8; 4096];
            let _ = tokio::time::timeout(PLAINTEXT_LINGER, async {
                let mut total = 0usize;
                while total < 64 * 1024 {
                    match tcp.read(&mut sink).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => total += n,
                    }
                }
            })
            .await;
            return Err(Early::Refused(ErrorCode::TlsRequired));
        }
        FirstByte::Other => return Err(Early::Refused(ErrorCode::TlsRequired)),
    }
    let tls = acceptor
        .accept(tcp)
        .await
        .map_err(|_| Early::Refused(ErrorCode::HandshakeFailed))?;
    if tls.get_ref().1.alpn_protocol() != Some(ALPN_H2) {
        return Err(Early::Refused(ErrorCode::HandshakeFailed));
    }
    Ok(tls)
}

/// DNS SANs of a verified client certificate (lowercase exact names; wildcards never match an
/// entry, see `credential::authenticate`).
fn client_dns_sans(tls: &tokio_rustls::server::TlsStream<TcpStream>) -> Vec<String> {
    let Some(cert) = tls.get_ref().1.peer_certificates().and_then(|c| c.first()) else {
        return Vec::new();
    };
    match webpki::EndEntityCert::try_from(cert) {
        Ok(cert) => cert.valid_dns_names().map(str::to_owned).collect(),
        Err(_) => Vec::new(),
    }
}

struct RequestCtx {
    conn: Connection,
    sans: Vec<String>,
    timers: Arc<Timers>,
}

/// Who a request authenticated as.
struct Authenticated {
    client_id: ClientId,
    grant: continuum_protocol::event_bus::Grant,
    auth: AuthBy,
}

impl RequestCtx {
    async fn handle(&self, request: Request<Incoming>) -> Response<ResponseBody> {
        match self.route(request).await {
            Ok(response) => response,
            Err(refusal) => {
                refused(&self.conn.bus, refusal.code);
                debug!(peer = %self.conn.peer, code = refusal.code.as_str(), message = %refusal.message, "Event bus request refused.");
                error_response(&refusal)
            }
        }
    }

    async fn route(&self, request: Request<Incoming>) -> Result<Response<ResponseBody>, Refusal> {
        let path = request.uri().path();
        let bus_path = BusPath::parse(path);
        if bus_path.is_none() && !BusPath::is_stream_prefix(path) {
            return Err(Refusal::new(ErrorCode::NotFound, "no such path"));
        }
        if request.method() != Method::POST {
            return Err(Refusal::new(
                ErrorCode::MethodNotAllowed,
                "the event bus accepts POST only",
            ));
        }
        let Some(bus_path) = bus_path else {
            return Err(Refusal::new(
                ErrorCode::UnknownStream,
                "malformed stream id",
            ));
        };
        let who = self.authenticate(&request)?;
        match bus_path {
            BusPath::Session => self.session(request, who).await,
            BusPath::Stream(stream_id) => self.stream(request, who, stream_id).await,
        }
    }

    fn authenticate(&self, request: &Request<Incoming>) -> Result<Authenticated, Refusal> {
        let token = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|value| bearer_token(value.as_bytes()));
        let state = self.conn.bus.lock();
        // The certificate was verified by the client_ca this listener started with: once a
        // reload replaced that CA, the connection's certificate identity no longer counts.
        let ca_current = state.settings.tls_client_ca() == self.conn.settings.tls_client_ca();
        let stale_cert = !ca_current && !self.sans.is_empty();
        let presented = Presented {
            token,
            cert_dns_sans: if ca_current { &self.sans } else { &[] },
        };
        let id = authenticate(&state.credentials, &state.revoked, presented).map_err(|code| {
            let code = match code {
                ErrorCode::Unauthenticated if stale_cert => ErrorCode::CredentialRevoked,
                code => code,
            };
            let message = match code {
                ErrorCode::CredentialRevoked if stale_cert => {
                    "the client CA that verified this connection was replaced by a reload"
                }
                ErrorCode::CredentialRevoked => "this credential was revoked by a reload",
                ErrorCode::Forbidden => "the certificate names another entry than the token",
                _ => "no valid bearer token or client certificate",
            };
            Refusal::new(code, message)
        })?;
        let entry = state
            .settings
            .entry(id)
            .ok_or_else(|| Refusal::new(ErrorCode::Unauthenticated, "unknown entry"))?;
        Ok(Authenticated {
            client_id: id.clone(),
            grant: entry.grant.clone(),
            auth: match token {
                Some(token) => AuthBy::Token(TokenHash::of_token(token)),
                None => AuthBy::Certificate,
            },
        })
    }

    /// `POST /bus/v1/session`: read the hello before answering, admit, welcome, hand the
    /// session to a new `BrokerSessionActor`.
    async fn session(
        &self,
        request: Request<Incoming>,
        who: Authenticated,
    ) -> Result<Response<ResponseBody>, Refusal> {
        let bus = &self.conn.bus;
        let version = parse_version_header(
            request
                .headers()
                .get(continuum_protocol::event_bus::VERSION_HEADER)
                .map(|v| v.as_bytes()),
        )?;
        bus.lock().admission.begin_handshake(&who.client_id)?;
        let mut pending = PendingHandshake {
            bus: bus.clone(),
            client_id: who.client_id.clone(),
            armed: true,
        };
        let settings = bus.settings();
        let session_id = random_session_id()?;
        let mut session = ServerSession::new(
            who.grant,
            version,
            session_id,
            settings.server_config(),
            now_tick(),
        );
        let mut body = request.into_body();
        let accepted = loop {
            if let Some(event) = session.poll_event() {
                match event {
                    ServerEvent::HelloAccepted(accepted) => break accepted,
                    ServerEvent::Refused(refusal) => return Err(refusal),
                    _ => continue,
                }
            }
            let wait = session.poll_timeout().map_or(settings.hello_timeout, |at| {
                at.0.saturating_sub(now_tick().0)
            });
            match tokio::time::timeout(wait, body.frame()).await {
                Err(_) => session.handle_timeout(now_tick()),
                Ok(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        session.handle_input(&data, now_tick());
                    }
                }
                Ok(Some(Err(_)) | None) => session.handle_end_of_input(),
            }
        };
        let superseded = {
            let mut state = bus.lock();
            pending.armed = false;
            state.admission.admit(&who.client_id, session_id)?
        };
        if !session.welcome(now_tick()) {
            bus.lock().admission.ended(&who.client_id, session_id);
            return Err(Refusal::new(ErrorCode::InvalidHello, "not welcomed"));
        }
        let (control, control_rx) = mpsc::channel(CONTROL_QUEUE);
        let spawner = &self.conn.spawner;
        let path = format!("{}/session:{session_id}", spawner.path);
        let span = ActorSpan::start(&path, ActorKind::BrokerSession, Some(&spawner.span));
        let args = SessionArgs {
            bus: bus.clone(),
            session,
            control,
            client_id: who.client_id.clone(),
            role: accepted.role,
            coverage: accepted.coverage,
            auth: who.auth,
            bounds: settings.bounds,
            tree: spawner.tree.clone(),
            path,
            parent: spawner.path.clone(),
            span,
        };
        let actor =
            match Actor::spawn_linked(None, BrokerSessionActor, args, spawner.supervisor.clone())
                .await
            {
                Ok((actor, _)) => actor,
                Err(error) => {
                    bus.lock().admission.ended(&who.client_id, session_id);
                    warn!(%error, "Could not start an event bus session actor.");
                    return Err(Refusal::new(
                        ErrorCode::Shutdown,
                        "the event bus is stopping",
                    ));
                }
            };
        if let Some(old) = superseded {
            let old_actor = bus.lock().sessions.get(&old).map(|row| row.actor.clone());
            if let Some(old_actor) = old_actor {
                let _ = old_actor.cast(SessionMsg::Close(
                    ErrorCode::SessionSuperseded,
                    Some("a newer session of this entry was welcomed".into()),
                ));
            }
        }
        tokio::spawn(forward_control(body, actor).in_current_span());
        let accepted_request = self.timers.accepted();
        Ok(Response::builder()
            .status(StatusCode::OK)
            .header(header::CONTENT_TYPE, NDJSON_CONTENT_TYPE)
            .body(pipe_body(control_rx, accepted_request))
            .unwrap_or_else(|_| Response::new(empty_body())))
    }

    /// `POST /bus/v1/streams/{id}`: the owning session admits it (or refuses with the
    /// contract's code); the body becomes the `BusStream`'s reads.
    async fn stream(
        &self,
        request: Request<Incoming>,
        who: Authenticated,
        stream_id: continuum_protocol::event_bus::StreamId,
    ) -> Result<Response<ResponseBody>, Refusal> {
        let unknown = || Refusal::new(ErrorCode::UnknownStream, "no such live session");
        let session_id = request
            .headers()
            .get(SESSION_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(SessionId::parse)
            .ok_or_else(unknown)?;
        // A missing or malformed version is refused by the session after the owner check, in
        // the contract's order (0 never matches a negotiated version).
        let version =
            parse_version_header(request.headers().get(VERSION_HEADER).map(|v| v.as_bytes()))
                .unwrap_or(0);
        let actor = self
            .conn
            .bus
            .lock()
            .sessions
            .get(&session_id)
            .map(|row| row.actor.clone())
            .ok_or_else(unknown)?;
        let (reply, answer) = oneshot::channel();
        actor
            .cast(SessionMsg::AcceptStream {
                stream_id,
                client_id: who.client_id,
                version,
                body: request.into_body(),
                reply,
            })
            .map_err(|_| unknown())?;
        let pipe = match tokio::time::timeout(ACCEPT_ANSWER_TIMEOUT, answer).await {
            Ok(Ok(result)) => result?,
            _ => return Err(unknown()),
        };
        let accepted_request = self.timers.accepted();
        Ok(Response::builder()
            .status(StatusCode::OK)
            .body(pipe_body(pipe, accepted_request))
            .unwrap_or_else(|_| Response::new(empty_body())))
    }
}

/// Gives the pre-hello admission slot back unless the session was admitted.
struct PendingHandshake {
    bus: EventBus,
    client_id: ClientId,
    armed: bool,
}

impl Drop for PendingHandshake {
    fn drop(&mut self) {
        if self.armed {
            self.bus.lock().admission.abandon_handshake(&self.client_id);
        }
    }
}

/// Feeds the control request body to the session actor, one acknowledged chunk at a time, so
/// HTTP/2 flow control holds back an agent that sends faster than its session handles.
async fn forward_control(mut body: Incoming, actor: ractor::ActorRef<SessionMsg>) {
    loop {
        match body.frame().await {
            Some(Ok(frame)) => {
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                let (ack, done) = oneshot::channel();
                if actor.cast(SessionMsg::Input(data, ack)).is_err() || done.await.is_err() {
                    return;
                }
            }
            Some(Err(_)) | None => {
                let _ = actor.cast(SessionMsg::InputEnded);
                return;
            }
        }
    }
}

fn random_session_id() -> Result<SessionId, Refusal> {
    let mut bytes = [0u8; 16];
    rustls::crypto::ring::default_provider()
        .secure_random
        .fill(&mut bytes)
        .map_err(|_| Refusal::new(ErrorCode::Shutdown, "no randomness for a session id"))?;
    Ok(SessionId::from_random(u128::from_be_bytes(bytes)))
}

fn pipe_body(pipe: mpsc::Receiver<Bytes>, accepted: AcceptedRequest) -> ResponseBody {
    let stream = pipe.map(move |bytes| {
        // The request counts as running until its response body is dropped.
        let _running = &accepted;
        Ok::<_, Infallible>(Frame::data(bytes))
    });
    StreamBody::new(stream).boxed_unsync()
}

fn empty_body() -> ResponseBody {
    Full::new(Bytes::new()).boxed_unsync()
}

fn error_response(refusal: &Refusal) -> Response<ResponseBody> {
    let status = refusal
        .code
        .http_status()
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::BAD_REQUEST);
    let body = ErrorBody::new(refusal.code, refusal.message.clone()).encode();
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)).boxed_unsync())
        .unwrap_or_else(|_| Response::new(empty_body()))
}
