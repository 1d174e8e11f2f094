//! One control session: `POST /bus/v1/session` on a fresh connection, driven by the protocol's
//! agent-side state machine ([`ClientSession`]); every decision about lines, timers, stream ids
//! and refusals is the state machine's. This shell moves bytes, spawns one relay task per
//! commanded stream (after the advertised-target check) and aborts it on `unsubscribe`.
//!
//! Shutdown: `draining` first, then a short grace so the router stops placing streams here,
//! then every relay ends with `stream_closed{reason: draining}` and the control request body is
//! closed; the whole path fits in [`crate::agent::SHUTDOWN_BUDGET`].

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use continuum_protocol::event_bus::message::{
    ErrorCode, Role, StreamCloseReason, StreamId, StreamTarget, Welcome,
};
use continuum_protocol::event_bus::{
    ClientEvent, ClientSession, MAX_LINE_BYTES, NDJSON_CONTENT_TYPE, SESSION_PATH, VERSION_HEADER,
};
use continuum_protocol::time::Tick;
use http_body_util::BodyExt as _;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::agent::Shared;
use crate::kv_listener::{ServeArgs, serve};
use crate::metrics::{CONNECT_FAILED, SESSION_CLOSED, UNSUBSCRIBED};
use crate::relay::{RelayArgs, RelayEnd, StreamOpener, channel_body, relay};
use crate::tls::{self, CONNECT_TIMEOUT};

/// The router's answer to the session request (its hello wait is 10 s).
pub const SESSION_RESPONSE_TIMEOUT: Duration = Duration::from_secs(15);
/// After `draining`, how long streams keep running before the broker ends them.
pub const DRAIN_GRACE: Duration = Duration::from_millis(500);
/// After the control body is closed, how long the broker waits for the router to end the session.
pub const CLOSE_WAIT: Duration = Duration::from_secs(2);
/// Control lines queued towards the router.
const CONTROL_QUEUE: usize = 64;

/// How a session ended.
#[derive(Debug)]
pub enum SessionEnd {
    /// No HTTP answer: TCP, TLS or HTTP/2 failed, or the answer was late.
    ConnectFailed(String),
    /// Refused or closed; `welcomed_for` is how long it was live (`None`: never welcomed).
    Closed {
        code: ErrorCode,
        message: Option<String>,
        welcomed_for: Option<Duration>,
    },
    /// Shut down after draining.
    Shutdown,
}

impl SessionEnd {
    /// The `code` label of `continuum_event_broker_sessions_closed_total`, if counted.
    pub fn code(&self) -> Option<&'static str> {
        match self {
            SessionEnd::ConnectFailed(_) => Some(CONNECT_FAILED),
            SessionEnd::Closed { code, .. } => Some(code.as_str()),
            SessionEnd::Shutdown => None,
        }
    }
}

/// The monotonic clock the state machine reads, as `Tick`s since the process began.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    origin: Instant,
}

impl Clock {
    pub fn new() -> Self {
        Self {
            origin: Instant::now(),
        }
    }

    pub fn now(&self) -> Tick {
        Tick(self.origin.elapsed())
    }

    pub fn instant(&self, tick: Tick) -> Instant {
        self.origin + tick.0
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

/// Runs one session to its end.
pub async fn run_session(shared: &Shared, shutdown: &mut watch::Receiver<bool>) -> SessionEnd {
    let config = &shared.config;
    let connected = tokio::time::timeout(CONNECT_TIMEOUT, tls::connect(config, shared.tls.clone()));
    let (send, driver) = tokio::select! {
        result = connected => match result {
            Ok(Ok(conn)) => conn,
            Ok(Err(error)) => return SessionEnd::ConnectFailed(format!("{error:#}")),
            Err(_) => return SessionEnd::ConnectFailed("connect timed out".into()),
        },
        _ = shutdown.changed() => return SessionEnd::Shutdown,
    };
    let _driver = AbortOnDrop(driver);
    let clock = shared.clock;
    let mut session = match ClientSession::new(config.hello(), clock.now()) {
        Ok(session) => session,
        Err(error) => {
            return SessionEnd::Closed {
                code: ErrorCode::InvalidHello,
                message: Some(error.to_string()),
                welcomed_for: None,
            };
        }
    };
    let (control, control_rx) = mpsc::channel::<Bytes>(CONTROL_QUEUE);
    if let Some(hello) = session.poll_transmit() {
        let _ = control.try_send(Bytes::from(hello));
    }
    let authority = config.bus.authority();
    let mut request = http::Request::builder()
        .method(http::Method::POST)
        .uri(format!("https://{authority}{SESSION_PATH}"))
        .header(VERSION_HEADER, "1")
        .header(http::header::CONTENT_TYPE, NDJSON_CONTENT_TYPE);
    if let Some(token) = &shared.token {
        request = request.header(http::header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let request = match request.body(channel_body(control_rx)) {
        Ok(request) => request,
        Err(error) => return SessionEnd::ConnectFailed(error.to_string()),
    };
    let mut sender = send.clone();
    let answered = tokio::time::timeout(SESSION_RESPONSE_TIMEOUT, sender.send_request(request));
    let response = tokio::select! {
        result = answered => match result {
            Ok(Ok(response)) => response,
            Ok(Err(error)) => return SessionEnd::ConnectFailed(format!("session request: {error}")),
            Err(_) => return SessionEnd::ConnectFailed("no answer to the session request".into()),
        },
        _ = shutdown.changed() => return SessionEnd::Shutdown,
    };
    if response.status() != http::StatusCode::OK {
        let status = response.status().as_u16();
        let limited = http_body_util::Limited::new(response.into_body(), MAX_LINE_BYTES);
        let body = match tokio::time::timeout(CLOSE_WAIT, limited.collect()).await {
            Ok(Ok(collected)) => collected.to_bytes(),
            _ => Bytes::new(),
        };
        session.refused(status, &body);
        return match session.poll_event() {
            Some(ClientEvent::Closed { code, message }) => SessionEnd::Closed {
                code,
                message,
                welcomed_for: None,
            },
            _ => SessionEnd::Closed {
                code: ErrorCode::Unknown,
                message: Some(format!("HTTP status {status}")),
                welcomed_for: None,
            },
        };
    }
    let mut live = Live {
        shared,
        session,
        control,
        send,
        authority,
        relays: HashMap::new(),
        welcome: None,
        welcomed_at: None,
        ended: None,
    };
    let end = live.drive(response.into_body(), shutdown).await;
    live.cut_relays(SESSION_CLOSED);
    shared.metrics.sessions.set(0);
    shared.ready.store(false, Ordering::Relaxed);
    end
}

struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

struct Live<'a> {
    shared: &'a Shared,
    session: ClientSession,
    control: mpsc::Sender<Bytes>,
    send: hyper::client::conn::http2::SendRequest<tls::Body>,
    authority: String,
    relays: HashMap<StreamId, JoinHandle<()>>,
    welcome: Option<Welcome>,
    welcomed_at: Option<Instant>,
    ended: Option<SessionEnd>,
}

impl Live<'_> {
    async fn drive(
        &mut self,
        mut body: hyper::body::Incoming,
        shutdown: &mut watch::Receiver<bool>,
    ) -> SessionEnd {
        let (done_tx, mut done_rx) = mpsc::unbounded_channel::<RelayEnd>();
        let clock = self.shared.clock;
        let mut drain_at: Option<Instant> = None;
        let mut body_open = true;
        loop {
            self.react(&done_tx);
            if !self.flush().await {
                self.session.handle_end_of_input();
                self.react(&done_tx);
            }
            if let Some(end) = self.ended.take() {
                return end;
            }
            let timer = self
                .session
                .poll_timeout()
                .map(|tick| clock.instant(tick))
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
            tokio::select! {
                frame = body.frame(), if body_open => match frame {
                    Some(Ok(frame)) => {
                        if let Ok(data) = frame.into_data() {
                            self.session.handle_input(&data, clock.now());
                        }
                    }
                    Some(Err(_)) | None => {
                        body_open = false;
                        self.session.handle_end_of_input();
                    }
                },
                () = tokio::time::sleep_until(timer) => self.session.handle_timeout(clock.now()),
                Some(end) = done_rx.recv() => self.relay_ended(end),
                changed = shutdown.changed(), if drain_at.is_none() => {
                    let _ = changed;
                    info!("Draining: no new streams; ending the relays shortly.");
                    self.session.drain();
                    drain_at = Some(Instant::now() + DRAIN_GRACE);
                }
                () = sleep_until_opt(drain_at) => {
                    return self.close_drained(&mut body).await;
                }
            }
        }
    }

    /// Acts on the state machine's events and counts its own refusals.
    fn react(&mut self, done: &mpsc::UnboundedSender<RelayEnd>) {
        while let Some(event) = self.session.poll_event() {
            match event {
                ClientEvent::Welcomed(welcome) => {
                    info!(
                        session = %welcome.session_id,
                        max_streams = welcome.max_streams,
                        stream_buffer_bytes = welcome.stream_buffer_bytes,
                        "Welcomed by the router's event-bus listener."
                    );
                    self.shared.metrics.sessions.set(1);
                    self.shared.ready.store(true, Ordering::Relaxed);
                    self.welcome = Some(welcome);
                    self.welcomed_at = Some(Instant::now());
                }
                ClientEvent::OpenStream { stream_id, target } => {
                    self.open(stream_id, target, done);
                }
                ClientEvent::CloseStream(stream_id) => {
                    if let Some(task) = self.relays.remove(&stream_id) {
                        task.abort();
                        self.shared.metrics.stream_closed(UNSUBSCRIBED);
                    }
                }
                ClientEvent::Closed { code, message } => {
                    self.ended = Some(SessionEnd::Closed {
                        code,
                        message,
                        welcomed_for: self.welcomed_at.map(|at| at.elapsed()),
                    });
                }
            }
        }
        for reason in self.session.take_refusals() {
            self.shared.metrics.refused(reason);
        }
    }

    fn open(
        &mut self,
        stream_id: StreamId,
        target: StreamTarget,
        done: &mpsc::UnboundedSender<RelayEnd>,
    ) {
        let shared = self.shared;
        let refuse = |session: &mut ClientSession, reason: StreamCloseReason, message: String| {
            debug!(stream = %stream_id, %reason, message, "Refused a subscribe.");
            if session.stream_closed(stream_id, reason, Some(message)) {
                shared.metrics.refused(reason);
            }
        };
        let Some(welcome) = &self.welcome else {
            return refuse(
                &mut self.session,
                StreamCloseReason::InvalidTarget,
                "a subscribe before the welcome".into(),
            );
        };
        if self.relays.len() >= shared.config.max_streams {
            return refuse(
                &mut self.session,
                StreamCloseReason::StreamLimit,
                format!(
                    "this agent serves at most {} streams",
                    shared.config.max_streams
                ),
            );
        }
        let (target, topic) = match (shared.config.role, target) {
            (Role::Broker, StreamTarget::ZmqTcp { target, topic }) => (target, topic),
            (Role::KvListener, StreamTarget::AnnouncedSource(source)) => {
                let Some(feed) = shared.feeds.get(&source.backend) else {
                    return refuse(
                        &mut self.session,
                        StreamCloseReason::TargetNotAdvertised,
                        "this kv-listener did not announce that backend".into(),
                    );
                };
                let args = ServeArgs {
                    opener: self.opener(welcome, stream_id),
                    feed: feed.clone(),
                    last_event_id: source.last_event_id,
                    metrics: shared.metrics.clone(),
                };
                let done = done.clone();
                let task = tokio::spawn(async move {
                    let end = serve(args).await;
                    let _ = done.send(end);
                });
                self.relays.insert(stream_id, task);
                return;
            }
            (Role::Broker, _) => {
                return refuse(
                    &mut self.session,
                    StreamCloseReason::InvalidTarget,
                    "a broker relays zmq_tcp targets only".into(),
                );
            }
            (_, _) => {
                return refuse(
                    &mut self.session,
                    StreamCloseReason::InvalidTarget,
                    "a kv-listener serves announced_source targets only".into(),
                );
            }
        };
        let advertised = shared
            .advertised
            .read()
            .is_ok_and(|a| a.allows(&target, topic));
        if !advertised {
            return refuse(
                &mut self.session,
                StreamCloseReason::TargetNotAdvertised,
                format!(
                    "no DynamoWorkerMetadata in Kubernetes namespace {} advertises this {} publisher",
                    shared.config.kubernetes_namespace,
                    topic.as_str()
                ),
            );
        }
        let args = RelayArgs {
            opener: self.opener(welcome, stream_id),
            target,
            stream_buffer_bytes: welcome.stream_buffer_bytes as usize,
            metrics: shared.metrics.clone(),
        };
        let done = done.clone();
        let task = tokio::spawn(async move {
            let end = relay(args).await;
            let _ = done.send(end);
        });
        self.relays.insert(stream_id, task);
    }

    /// What opens data stream `stream_id` on this session.
    fn opener(&self, welcome: &Welcome, stream_id: StreamId) -> StreamOpener {
        StreamOpener {
            send: self.send.clone(),
            authority: self.authority.clone(),
            token: self.shared.token.clone(),
            session_id: welcome.session_id.to_string(),
            version: welcome.version,
            stream_id,
        }
    }

    fn relay_ended(&mut self, end: RelayEnd) {
        if self.relays.remove(&end.stream_id).is_none() {
            return;
        }
        let RelayEnd {
            stream_id,
            started,
            reason,
            message,
        } = end;
        debug!(stream = %stream_id, %reason, ?message, "A relay ended.");
        if self.session.stream_closed(stream_id, reason, message) {
            if started {
                self.shared.metrics.stream_closed(reason.as_str());
            } else {
                self.shared.metrics.refused(reason);
            }
        }
    }

    /// Writes pending control lines; `false` when the router stopped reading them.
    async fn flush(&mut self) -> bool {
        let Some(bytes) = self.session.poll_transmit() else {
            return true;
        };
        let idle = self.welcome.as_ref().map_or(SESSION_RESPONSE_TIMEOUT, |w| {
            Duration::from_millis(w.idle_timeout_ms)
        });
        matches!(
            tokio::time::timeout(idle, self.control.send(Bytes::from(bytes))).await,
            Ok(Ok(()))
        )
    }

    /// After the drain grace: tell the router every relay ends with `draining`, close the
    /// control body, and wait briefly for the router to end the session; the relays are cut
    /// after that, so the router reads each `stream_closed` before it sees a data stream end.
    async fn close_drained(&mut self, body: &mut hyper::body::Incoming) -> SessionEnd {
        let streams: Vec<StreamId> = self.relays.keys().copied().collect();
        for stream_id in streams {
            if self.session.stream_closed(
                stream_id,
                StreamCloseReason::Draining,
                Some("the broker is shutting down".into()),
            ) {
                self.shared
                    .metrics
                    .stream_closed(StreamCloseReason::Draining.as_str());
            }
        }
        let _ = tokio::time::timeout(CLOSE_WAIT, self.flush()).await;
        // Ending the request body ends the session (the router sees peer_closed).
        let (closed, _) = mpsc::channel(1);
        drop(std::mem::replace(&mut self.control, closed));
        let _ = tokio::time::timeout(CLOSE_WAIT, async {
            while let Some(Ok(_)) = body.frame().await {}
        })
        .await;
        for (_, task) in self.relays.drain() {
            task.abort();
        }
        SessionEnd::Shutdown
    }

    fn cut_relays(&mut self, reason: &str) {
        for (_, task) in self.relays.drain() {
            task.abort();
            self.shared.metrics.stream_closed(reason);
        }
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Logs a session's end at the level it deserves.
pub fn log_end(end: &SessionEnd) {
    match end {
        SessionEnd::ConnectFailed(reason) => {
            warn!(reason, "Cannot reach the router's event-bus listener.");
        }
        SessionEnd::Closed {
            code,
            message,
            welcomed_for,
        } => match code {
            ErrorCode::Unauthenticated | ErrorCode::CredentialRevoked | ErrorCode::Forbidden => {
                tracing::error!(
                    code = code.as_str(),
                    ?message,
                    "The router refused this broker's credential or hello; retrying after backoff."
                );
            }
            _ => warn!(
                code = code.as_str(),
                ?message,
                ?welcomed_for,
                "Event-bus session ended."
            ),
        },
        SessionEnd::Shutdown => info!("Event-bus session closed for shutdown."),
    }
}

/// `Arc<str>` of the token for the relays.
pub fn token_of(config: &crate::config::BrokerConfig) -> Option<Arc<str>> {
    config.credential.token.as_deref().map(Arc::from)
}
