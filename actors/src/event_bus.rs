//! The router's end of the event bus: the inbound HTTP/2-over-TLS listener that in-cluster
//! agents (continuum-event-broker, continuum-kv-listener) dial out to, one actor per welcomed
//! session, and the [`EventBus`] command API the subscriptions use to open data streams.
//!
//! The wire contract and every decision (hello validation, admission, credentials, byte bounds,
//! rendezvous placement, both session state machines) live in `continuum_protocol::event_bus`;
//! this module owns the sockets, timers and mailboxes. The prose contract is
//! `docs/event-bus.md`.
//!
//! ```text
//! root
//! └── event_bus                BrokerSupervisor: owns the listener task, links the sessions
//!     └── session:<sess-…>     BrokerSessionActor per welcomed session (ServerSession, streams,
//!                              heartbeats)
//! ```
//!
//! | module | what it holds |
//! |---|---|
//! | [`settings`] | `BusSettings`: what the listener runs with (built from `dynamo.event_bus`) |
//! | [`listener`] | TCP accept, first-byte peek, TLS 1.3 + ALPN h2, hyper's HTTP/2 server, authentication, the session handshake and data-stream admission |
//! | [`session`] | `BrokerSessionActor`: one welcomed session |
//! | [`supervisor`] | `BrokerSupervisor` and its `ChildSpec` under root |
//! | [`stream`] | `BusStream`: one data stream as `AsyncRead + AsyncWrite` |
//! | [`metrics`] | the `continuum_dynamo_event_bus_*` and `continuum_dynamo_broker_*` families |
//! | [`coverage`] | what broker-transport subscriptions want, and the debounced coverage gauges |
//!
//! `listener` and `supervisor` are compiled with the `event-bus-listener` feature only (the root
//! package's `dynamo-event-bus`); without it the [`EventBus`] still exists, covers nothing, and
//! broker-transport subscriptions wait in pending.
//!
//! [`EventBus`] is a cheap `Clone` handle over state that outlives restarts of the supervisor:
//! the session table (the only one; the session actors keep their rows current), the admission
//! table, the revocation ring and the current settings.

// Without the listener, the parts only it uses (auth kinds, the TLS server config, the running
// flag) are unused: allowed rather than gated item by item.
#![cfg_attr(not(feature = "event-bus-listener"), allow(dead_code))]

pub mod coverage;
#[cfg(feature = "event-bus-listener")]
pub mod listener;
pub mod metrics;
pub mod session;
pub mod settings;
pub mod stream;
#[cfg(feature = "event-bus-listener")]
pub mod supervisor;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::lock::{Mutex, MutexGuard};
use std::time::Duration;

use continuum_protocol::discovery::EventTopic;
use continuum_protocol::event_bus::credential::{Credential, RevokedCredentials, TokenHash};
use continuum_protocol::event_bus::message::{
    AnnouncedSourceTarget, ClientId, ErrorCode, Role, SessionId, StreamCloseReason, StreamTarget,
    ZmqTcpTarget,
};
use continuum_protocol::event_bus::{Admission, Coverage, rendezvous};
use continuum_protocol::ids::Namespace;
use ractor::ActorRef;
use thiserror::Error;
use tokio::sync::{oneshot, watch};
use tracing::info;

pub use self::coverage::{COVERAGE_DEBOUNCE, CoverageInterest, NamespaceCoverage};
pub use self::metrics::EventBusMetrics;
pub use self::session::SessionMsg;
pub use self::settings::{BusEntry, BusSettings, BusTls};
pub use self::stream::BusStream;
#[cfg(feature = "event-bus-listener")]
pub use self::supervisor::event_bus_spec;

/// How long `open_stream` waits for the agent to open the commanded data stream.
pub const OPEN_TIMEOUT: Duration = continuum_protocol::event_bus::server::STREAM_OPEN_TIMEOUT;

/// Why [`EventBus::open_stream`] / [`EventBus::open_announced_stream`] gave no stream.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum BusStreamError {
    /// No live session covers the target's namespace (or announced the backend).
    #[error("no live event-bus session covers the target")]
    NoSession,
    /// Every covering session already carries `max_streams_per_session` streams.
    #[error("every covering event-bus session is at its stream cap")]
    TooManyStreams,
    /// The agent answered the subscribe with `stream_closed`.
    #[error("the agent refused the stream: {0}")]
    Refused(StreamCloseReason),
    /// The agent did not open the data stream within 30 s.
    #[error("the agent did not open the data stream in time")]
    OpenTimeout,
    /// The session ended before the data stream opened.
    #[error("the event-bus session closed before the stream opened")]
    SessionClosed,
    /// Every covering session is draining (or the listener is not running).
    #[error("every covering event-bus session is draining, or the listener is not running")]
    Busy,
    /// The target is not a valid wire target (name bounds, port 0, a topic the bus does not
    /// carry).
    #[error("invalid stream target: {0}")]
    InvalidTarget(String),
}

/// How a session's credential authenticated (decides what a reload revokes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AuthBy {
    Token(TokenHash),
    Certificate,
}

/// One welcomed session in the table.
#[derive(Clone, Debug)]
pub(crate) struct SessionRow {
    pub(crate) client_id: ClientId,
    pub(crate) role: Role,
    pub(crate) coverage: Coverage,
    pub(crate) auth: AuthBy,
    pub(crate) draining: bool,
    pub(crate) streams: usize,
    pub(crate) max_streams: usize,
    pub(crate) actor: ActorRef<SessionMsg>,
}

/// What [`EventBus::subscribe_sessions`] publishes: the live sessions, at every change.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SessionsView {
    /// Bumped at every change of the table.
    pub generation: u64,
    pub sessions: Vec<SessionInfo>,
}

/// One live session, as consumers see it (no secrets).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionInfo {
    pub session_id: SessionId,
    pub client_id: ClientId,
    pub role: Role,
    pub coverage: Coverage,
    pub draining: bool,
    pub streams: usize,
}

pub(crate) struct BusState {
    pub(crate) settings: Arc<BusSettings>,
    pub(crate) credentials: Vec<Credential>,
    pub(crate) revoked: RevokedCredentials,
    pub(crate) admission: Admission,
    pub(crate) sessions: BTreeMap<SessionId, SessionRow>,
    pub(crate) local_addr: Option<SocketAddr>,
}

pub(crate) struct BusShared {
    state: Mutex<BusState>,
    running: AtomicBool,
    sessions_tx: watch::Sender<SessionsView>,
    pub(crate) metrics: Option<EventBusMetrics>,
    pub(crate) coverage: coverage::CoverageTable,
}

/// The command API over the listener's sessions; clone it freely.
#[derive(Clone)]
pub struct EventBus {
    pub(crate) shared: Arc<BusShared>,
}

impl std::fmt::Debug for EventBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventBus")
            .field("sessions", &self.session_count())
            .field("running", &self.is_running())
            .finish_non_exhaustive()
    }
}

impl EventBus {
    /// A bus with `settings`; nothing listens until its [`event_bus_spec`] child runs.
    pub fn new(settings: BusSettings, metrics: Option<&crate::metrics::Metrics>) -> Self {
        let credentials = settings.credentials();
        let admission = Admission::new(settings.max_sessions);
        let (sessions_tx, _) = watch::channel(SessionsView::default());
        Self {
            shared: Arc::new(BusShared {
                state: Mutex::new(BusState {
                    settings: Arc::new(settings),
                    credentials,
                    revoked: RevokedCredentials::default(),
                    admission,
                    sessions: BTreeMap::new(),
                    local_addr: None,
                }),
                running: AtomicBool::new(false),
                sessions_tx,
                metrics: metrics
                    .and_then(crate::metrics::Metrics::family::<EventBusMetrics>)
                    .map(|m| (*m).clone()),
                coverage: coverage::CoverageTable::default(),
            }),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, BusState> {
        // A poisoned table only means a writer panicked mid-update; the rows stay usable.
        self.shared.state.lock()
    }

    pub(crate) fn metrics(&self) -> Option<&EventBusMetrics> {
        self.shared.metrics.as_ref()
    }

    /// The settings the listener runs with now.
    pub fn settings(&self) -> Arc<BusSettings> {
        self.lock().settings.clone()
    }

    /// Applies a reloaded `dynamo.event_bus` without touching discovery, the registry, the
    /// load store or the KV index. Credentials removed (or whose token changed) are revoked and
    /// their live sessions closed with `credential_revoked`; sessions whose role, namespaces or
    /// backends no longer fit their entry close with `forbidden`; every other session keeps
    /// running. Returns `true` when the listener itself must restart (enabled, listen address,
    /// TLS files or byte bounds changed): restart `root/event_bus`.
    pub fn reload(&self, settings: BusSettings) -> bool {
        let mut closing: Vec<(ActorRef<SessionMsg>, SessionMsg)> = Vec::new();
        let restart = {
            let mut state = self.lock();
            let restart = state.settings.listener_key() != settings.listener_key();
            let credentials = settings.credentials();
            let old = std::mem::replace(&mut state.credentials, credentials.clone());
            state.revoked.apply_reload(&old, &credentials);
            state.admission.set_max_sessions(settings.max_sessions);
            for row in state.sessions.values() {
                let entry = settings.entry(&row.client_id);
                let revoked = match (entry, row.auth) {
                    (None, _) => true,
                    (Some(entry), AuthBy::Token(hash)) => {
                        entry.token_hash.is_none_or(|stored| !stored.ct_eq(&hash))
                    }
                    // A certificate identity is bound to the CA that verified its connection:
                    // a client_ca removed or replaced ends it (the connection's CA is gone).
                    (Some(_), AuthBy::Certificate) => {
                        settings.tls_client_ca().is_none()
                            || settings.tls_client_ca() != state.settings.tls_client_ca()
                    }
                };
                let message = if revoked {
                    SessionMsg::Close(
                        ErrorCode::CredentialRevoked,
                        Some("a reload removed this credential".into()),
                    )
                } else if let Some(entry) = entry {
                    SessionMsg::Regrant(entry.grant.clone())
                } else {
                    continue;
                };
                closing.push((row.actor.clone(), message));
            }
            state.settings = Arc::new(settings);
            restart
        };
        for (actor, message) in closing {
            let _ = actor.cast(message);
        }
        info!(restart, "Event bus settings reloaded.");
        restart
    }

    /// Opens a data stream to the ZMQ publisher `target` through the highest-ranked live,
    /// non-draining broker session covering its namespace that is below its stream cap.
    pub async fn open_stream(
        &self,
        target: ZmqTcpTarget,
        topic: EventTopic,
    ) -> Result<BusStream, BusStreamError> {
        let target = StreamTarget::ZmqTcp { target, topic };
        target
            .check()
            .map_err(|e| BusStreamError::InvalidTarget(e.to_string()))?;
        let StreamTarget::ZmqTcp { target: zmq, topic } = &target else {
            return Err(BusStreamError::InvalidTarget("not a zmq_tcp target".into()));
        };
        let key = rendezvous::zmq_key(zmq, *topic);
        let actor = {
            let state = self.lock();
            let rows: Vec<&SessionRow> = state
                .sessions
                .values()
                .filter(|row| row.role == Role::Broker && row.coverage.covers(&target))
                .collect();
            choose(&rows, |eligible| {
                rendezvous::pick(&key, eligible, |row| &row.client_id, |_| true)
            })?
        };
        self.command_open(actor, target).await
    }

    /// Opens a data stream carrying `backend`'s SSE KV events through the least-loaded live,
    /// non-draining kv_listener session that announced it, resuming after `last_event_id`.
    pub async fn open_announced_stream(
        &self,
        backend: &str,
        last_event_id: Option<u64>,
    ) -> Result<BusStream, BusStreamError> {
        let target = StreamTarget::AnnouncedSource(AnnouncedSourceTarget {
            backend: backend.to_owned(),
            last_event_id,
        });
        target
            .check()
            .map_err(|e| BusStreamError::InvalidTarget(e.to_string()))?;
        let actor = {
            let state = self.lock();
            let rows: Vec<&SessionRow> = state
                .sessions
                .values()
                .filter(|row| row.role == Role::KvListener && row.coverage.covers(&target))
                .collect();
            choose(&rows, |eligible| {
                eligible
                    .iter()
                    .enumerate()
                    .min_by(|a, b| {
                        a.1.streams
                            .cmp(&b.1.streams)
                            .then_with(|| a.1.client_id.cmp(&b.1.client_id))
                    })
                    .map(|(i, _)| i)
            })?
        };
        self.command_open(actor, target).await
    }

    async fn command_open(
        &self,
        actor: ActorRef<SessionMsg>,
        target: StreamTarget,
    ) -> Result<BusStream, BusStreamError> {
        let (reply, answer) = oneshot::channel();
        actor
            .cast(SessionMsg::Open { target, reply })
            .map_err(|_| BusStreamError::SessionClosed)?;
        // The session itself unsubscribes a stream not opened within OPEN_TIMEOUT and answers
        // OpenTimeout; this bound only covers a session that never answers at all.
        match tokio::time::timeout(OPEN_TIMEOUT + Duration::from_secs(1), answer).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(BusStreamError::SessionClosed),
            Err(_) => Err(BusStreamError::OpenTimeout),
        }
    }

    /// Whether a live, non-draining broker session covers `namespace`.
    pub fn covers(&self, namespace: &Namespace) -> bool {
        self.lock().sessions.values().any(|row| {
            row.role == Role::Broker && !row.draining && row.coverage.covers_namespace(namespace)
        })
    }

    /// Live, non-draining broker sessions covering `namespace`.
    pub fn covering_sessions(&self, namespace: &Namespace) -> usize {
        self.lock()
            .sessions
            .values()
            .filter(|row| {
                row.role == Role::Broker
                    && !row.draining
                    && row.coverage.covers_namespace(namespace)
            })
            .count()
    }

    /// Namespaces some live, non-draining broker session covers.
    pub fn covered_namespaces(&self) -> BTreeSet<Namespace> {
        let state = self.lock();
        let mut out = BTreeSet::new();
        for row in state.sessions.values() {
            if let (Role::Broker, false, Coverage::Namespaces(set)) =
                (row.role, row.draining, &row.coverage)
            {
                out.extend(set.iter().cloned());
            }
        }
        out
    }

    /// Welcomed sessions now.
    pub fn session_count(&self) -> usize {
        self.lock().sessions.len()
    }

    /// A watch of the live sessions; it changes whenever a session is welcomed, ends, starts
    /// draining or its stream count changes. Waiters need no polling.
    pub fn subscribe_sessions(&self) -> watch::Receiver<SessionsView> {
        self.shared.sessions_tx.subscribe()
    }

    /// The address the listener is bound to, once it is.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.lock().local_addr
    }

    /// Whether the listener is bound and accepting.
    pub fn is_running(&self) -> bool {
        self.shared.running.load(Ordering::Acquire)
    }

    pub(crate) fn set_running(&self, addr: Option<SocketAddr>) {
        self.lock().local_addr = addr;
        self.shared.running.store(addr.is_some(), Ordering::Release);
        if let Some(metrics) = self.metrics() {
            metrics.set_listener_up(addr.is_some());
        }
    }

    /// Republishes the session view and the session/stream gauges after a table change.
    pub(crate) fn publish(&self, state: &BusState) {
        if let Some(metrics) = self.metrics() {
            for role in [Role::Broker, Role::KvListener] {
                let rows = state.sessions.values().filter(|r| r.role == role);
                let (sessions, streams) =
                    rows.fold((0usize, 0usize), |(n, s), r| (n + 1, s + r.streams));
                metrics.set_sessions(role, sessions, streams);
            }
        }
        let sessions = state
            .sessions
            .iter()
            .map(|(id, row)| SessionInfo {
                session_id: *id,
                client_id: row.client_id.clone(),
                role: row.role,
                coverage: row.coverage.clone(),
                draining: row.draining,
                streams: row.streams,
            })
            .collect();
        self.shared.sessions_tx.send_modify(|view| {
            view.generation += 1;
            view.sessions = sessions;
        });
        self.shared.coverage.changed();
    }
}

/// Picks among the covering `rows`: `NoSession` when none covers, `Busy` when all drain,
/// `TooManyStreams` when all are full, else `pick` over the eligible ones.
fn choose(
    rows: &[&SessionRow],
    pick: impl Fn(&[&SessionRow]) -> Option<usize>,
) -> Result<ActorRef<SessionMsg>, BusStreamError> {
    if rows.is_empty() {
        return Err(BusStreamError::NoSession);
    }
    let live: Vec<&SessionRow> = rows.iter().copied().filter(|r| !r.draining).collect();
    if live.is_empty() {
        return Err(BusStreamError::Busy);
    }
    let eligible: Vec<&SessionRow> = live
        .iter()
        .copied()
        .filter(|r| r.streams < r.max_streams)
        .collect();
    if eligible.is_empty() {
        return Err(BusStreamError::TooManyStreams);
    }
    let index = pick(&eligible).ok_or(BusStreamError::NoSession)?;
    Ok(eligible[index].actor.clone())
}
