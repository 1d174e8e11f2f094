//! The event-bus metric families (docs/event-bus.md, docs/observability.md). Every label set is
//! closed: roles, error codes, stream close reasons and directions are protocol enums, never a
//! session id, stream id, broker id or client string.

use continuum_protocol::event_bus::message::{ErrorCode, Role, StreamCloseReason};
use prometheus::{IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

/// Every error code, for pre-initialising the counters at 0.
const CODES: &[ErrorCode] = &[
    ErrorCode::TlsRequired,
    ErrorCode::HandshakeTimeout,
    ErrorCode::HandshakeFailed,
    ErrorCode::ConnectionLimit,
    ErrorCode::AuthTimeout,
    ErrorCode::Unauthenticated,
    ErrorCode::CredentialRevoked,
    ErrorCode::Forbidden,
    ErrorCode::UnsupportedProtocolVersion,
    ErrorCode::InvalidHello,
    ErrorCode::HelloTimeout,
    ErrorCode::TooManySessions,
    ErrorCode::UnknownStream,
    ErrorCode::DuplicateStream,
    ErrorCode::SessionSuperseded,
    ErrorCode::IdleTimeout,
    ErrorCode::ProtocolError,
    ErrorCode::PeerClosed,
    ErrorCode::Shutdown,
    ErrorCode::NotFound,
    ErrorCode::MethodNotAllowed,
];

const REASONS: &[StreamCloseReason] = &[
    StreamCloseReason::TargetNotAdvertised,
    StreamCloseReason::InvalidTarget,
    StreamCloseReason::Forbidden,
    StreamCloseReason::ConnectFailed,
    StreamCloseReason::PublisherClosed,
    StreamCloseReason::StreamFailed,
    StreamCloseReason::StreamLimit,
    StreamCloseReason::Draining,
    StreamCloseReason::Internal,
    StreamCloseReason::Unknown,
];

/// How a data stream ended, for `continuum_dynamo_event_bus_stream_closes_total{reason}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamEnd {
    /// The agent sent `stream_closed` with this reason.
    Agent(StreamCloseReason),
    /// The router unsubscribed (its consumer dropped the `BusStream`).
    Unsubscribed,
    /// The agent did not open the commanded stream in time.
    OpenTimeout,
}

impl StreamEnd {
    pub fn as_label(self) -> &'static str {
        match self {
            StreamEnd::Agent(reason) => reason.as_str(),
            StreamEnd::Unsubscribed => "unsubscribed",
            StreamEnd::OpenTimeout => "open_timeout",
        }
    }
}

/// Direction of relayed data-stream bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// From the agent (publisher bytes) into the router.
    ToRouter,
    /// From the router to the agent (and on to the publisher).
    ToClient,
}

impl Direction {
    pub fn as_label(self) -> &'static str {
        match self {
            Direction::ToRouter => "to_router",
            Direction::ToClient => "to_client",
        }
    }
}

/// Handles on the event-bus families (cheap to clone).
#[derive(Clone, Debug)]
pub struct EventBusMetrics {
    listener_up: IntGauge,
    connections: IntGauge,
    sessions: IntGaugeVec,
    streams: IntGaugeVec,
    refusals: IntCounterVec,
    sessions_closed: IntCounterVec,
    stream_closes: IntCounterVec,
    bytes: IntCounterVec,
    broker_namespace_sessions: IntGaugeVec,
    broker_pending_subscriptions: IntGaugeVec,
    broker_subscriptions: IntGaugeVec,
    kv_listener_sources: IntGaugeVec,
    kv_listener_sse: IntCounterVec,
}

/// `state` of `continuum_dynamo_kv_listener_sources`.
pub const KV_LISTENER_SOURCE_STATES: &[&str] = &["pending", "connecting", "connected", "backoff"];
/// `result` of `continuum_dynamo_kv_listener_sse_events_total`.
pub const KV_LISTENER_SSE_RESULTS: &[&str] = &["applied", "reset", "malformed", "oversized"];

impl crate::metrics::Family for EventBusMetrics {
    /// Registers every family in `registry`, closed-set series at 0.
    #[expect(clippy::too_many_lines, reason = "on tests/it/tidy/long_functions.txt")]
    fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let gauge = |name: &str, help: &str| -> Result<IntGauge, prometheus::Error> {
            let gauge = IntGauge::new(name, help)?;
            registry.register(Box::new(gauge.clone()))?;
            Ok(gauge)
        };
        let gauge_vec =
            |name: &str, help: &str, label: &str| -> Result<IntGaugeVec, prometheus::Error> {
                let vec = IntGaugeVec::new(Opts::new(name, help), &[label])?;
                registry.register(Box::new(vec.clone()))?;
                Ok(vec)
            };
        let counter_vec =
            |name: &str, help: &str, label: &str| -> Result<IntCounterVec, prometheus::Error> {
                let vec = IntCounterVec::new(Opts::new(name, help), &[label])?;
                registry.register(Box::new(vec.clone()))?;
                Ok(vec)
            };
        let metrics = Self {
            listener_up: gauge(
                "continuum_dynamo_event_bus_listener_up",
                "1 while the event-bus listener is bound and accepting, else 0.",
            )?,
            connections: gauge(
                "continuum_dynamo_event_bus_connections",
                "TCP connections the event-bus listener holds now.",
            )?,
            sessions: gauge_vec(
                "continuum_dynamo_event_bus_sessions",
                "Welcomed event-bus sessions, by role.",
                "role",
            )?,
            streams: gauge_vec(
                "continuum_dynamo_event_bus_streams",
                "Event-bus data streams commanded or open, by session role.",
                "role",
            )?,
            refusals: counter_vec(
                "continuum_dynamo_event_bus_refusals_total",
                "Event-bus connections and requests refused, by error code.",
                "code",
            )?,
            sessions_closed: counter_vec(
                "continuum_dynamo_event_bus_sessions_closed_total",
                "Welcomed event-bus sessions that ended, by error code.",
                "code",
            )?,
            stream_closes: counter_vec(
                "continuum_dynamo_event_bus_stream_closes_total",
                "Event-bus data streams that ended or were refused, by reason.",
                "reason",
            )?,
            bytes: counter_vec(
                "continuum_dynamo_event_bus_bytes_total",
                "Data-stream bytes relayed through the event bus, by direction.",
                "direction",
            )?,
            broker_namespace_sessions: gauge_vec(
                "continuum_dynamo_broker_namespace_sessions",
                "Live, non-draining broker sessions covering a namespace that broker-transport \
                 subscriptions want (250 ms debounced).",
                "namespace",
            )?,
            broker_pending_subscriptions: {
                let vec = IntGaugeVec::new(
                    Opts::new(
                        "continuum_dynamo_broker_pending_subscriptions",
                        "Broker-transport subscriptions pending (no covering broker session), \
                         by family and namespace (250 ms debounced).",
                    ),
                    &["family", "namespace"],
                )?;
                registry.register(Box::new(vec.clone()))?;
                vec
            },
            broker_subscriptions: {
                let vec = IntGaugeVec::new(
                    Opts::new(
                        "continuum_dynamo_broker_subscriptions",
                        "Subscription streams (kv_metrics, kv-events) each broker session \
                         carries, by family and broker id (250 ms debounced).",
                    ),
                    &["family", "broker"],
                )?;
                registry.register(Box::new(vec.clone()))?;
                vec
            },
            kv_listener_sources: gauge_vec(
                "continuum_dynamo_kv_listener_sources",
                "kv_cache_index sources with transport event_bus, by state (pending: no \
                 kv_listener session announces the backend).",
                "state",
            )?,
            kv_listener_sse: counter_vec(
                "continuum_dynamo_kv_listener_sse_events_total",
                "SSE events read from kv_listener streams, by result (applied: handed to the KV \
                 index; reset: the agent could not resume exactly; malformed, oversized: refused).",
                "result",
            )?,
        };
        for state in KV_LISTENER_SOURCE_STATES {
            metrics
                .kv_listener_sources
                .with_label_values(&[state])
                .set(0);
        }
        for result in KV_LISTENER_SSE_RESULTS {
            metrics.kv_listener_sse.with_label_values(&[result]);
        }
        for role in [Role::Broker, Role::KvListener] {
            metrics.sessions.with_label_values(&[role.as_str()]).set(0);
            metrics.streams.with_label_values(&[role.as_str()]).set(0);
        }
        for code in CODES {
            metrics.refusals.with_label_values(&[code.as_str()]);
            metrics.sessions_closed.with_label_values(&[code.as_str()]);
        }
        for reason in REASONS {
            metrics.stream_closes.with_label_values(&[reason.as_str()]);
        }
        for end in [StreamEnd::Unsubscribed, StreamEnd::OpenTimeout] {
            metrics.stream_closes.with_label_values(&[end.as_label()]);
        }
        for direction in [Direction::ToRouter, Direction::ToClient] {
            metrics.bytes.with_label_values(&[direction.as_label()]);
        }
        Ok(metrics)
    }
}

impl EventBusMetrics {
    pub fn set_listener_up(&self, up: bool) {
        self.listener_up.set(i64::from(up));
    }

    pub fn connection_opened(&self) {
        self.connections.inc();
    }

    pub fn connection_closed(&self) {
        self.connections.dec();
    }

    pub fn set_sessions(&self, role: Role, sessions: usize, streams: usize) {
        let clamp = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.sessions
            .with_label_values(&[role.as_str()])
            .set(clamp(sessions));
        self.streams
            .with_label_values(&[role.as_str()])
            .set(clamp(streams));
    }

    pub fn refused(&self, code: ErrorCode) {
        self.refusals.with_label_values(&[code.as_str()]).inc();
    }

    pub fn session_closed(&self, code: ErrorCode) {
        self.sessions_closed
            .with_label_values(&[code.as_str()])
            .inc();
    }

    pub fn stream_closed(&self, end: StreamEnd) {
        self.stream_closes
            .with_label_values(&[end.as_label()])
            .inc();
    }

    /// Sets the coverage gauges of one wanted (family, namespace).
    pub fn set_coverage(&self, family: &str, namespace: &str, sessions: usize, pending: usize) {
        let clamp = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.broker_namespace_sessions
            .with_label_values(&[namespace])
            .set(clamp(sessions));
        self.broker_pending_subscriptions
            .with_label_values(&[family, namespace])
            .set(clamp(pending));
    }

    /// Removes the series of a (family, namespace) no subscription wants any more.
    pub fn remove_coverage(&self, family: &str, namespace: &str, namespace_gone: bool) {
        let _ = self
            .broker_pending_subscriptions
            .remove_label_values(&[family, namespace]);
        if namespace_gone {
            let _ = self
                .broker_namespace_sessions
                .remove_label_values(&[namespace]);
        }
    }

    /// Sets `continuum_dynamo_broker_subscriptions{family, broker}`.
    pub fn set_carried(&self, family: &str, broker: &str, streams: usize) {
        self.broker_subscriptions
            .with_label_values(&[family, broker])
            .set(i64::try_from(streams).unwrap_or(i64::MAX));
    }

    pub fn remove_carried(&self, family: &str, broker: &str) {
        let _ = self
            .broker_subscriptions
            .remove_label_values(&[family, broker]);
    }

    pub fn relayed(&self, direction: Direction, bytes: usize) {
        self.bytes
            .with_label_values(&[direction.as_label()])
            .inc_by(bytes as u64);
    }
}

impl EventBusMetrics {
    /// A kv_cache_index source left `from` (if any) for `to` (labels of
    /// [`KV_LISTENER_SOURCE_STATES`]).
    pub fn kv_listener_source_state(&self, from: Option<&str>, to: Option<&str>) {
        if let Some(from) = from {
            self.kv_listener_sources.with_label_values(&[from]).dec();
        }
        if let Some(to) = to {
            self.kv_listener_sources.with_label_values(&[to]).inc();
        }
    }

    /// One SSE event read from a kv_listener stream (labels of [`KV_LISTENER_SSE_RESULTS`]).
    pub fn kv_listener_sse(&self, result: &str) {
        self.kv_listener_sse.with_label_values(&[result]).inc();
    }
}
