//! The broker's Prometheus families (served at `/metrics`). Every label set is closed: error
//! codes, stream close reasons and two directions; no stream id, session id, host or client
//! string is ever a label.

use continuum_protocol::event_bus::message::{ErrorCode, StreamCloseReason};
use prometheus::{Encoder as _, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder};

/// `code` of a session that never got an HTTP answer (TCP, TLS or HTTP/2 failed).
pub const CONNECT_FAILED: &str = "connect_failed";
/// `reason` of a stream the router unsubscribed.
pub const UNSUBSCRIBED: &str = "unsubscribed";
/// `reason` of streams cut because their session ended.
pub const SESSION_CLOSED: &str = "session_closed";

/// Every stream close reason of the contract.
pub const CLOSE_REASONS: &[StreamCloseReason] = &[
    StreamCloseReason::TargetNotAdvertised,
    StreamCloseReason::InvalidTarget,
    StreamCloseReason::Forbidden,
    StreamCloseReason::ConnectFailed,
    StreamCloseReason::PublisherClosed,
    StreamCloseReason::StreamFailed,
    StreamCloseReason::StreamLimit,
    StreamCloseReason::Draining,
    StreamCloseReason::Internal,
];

/// The error codes a session of this broker can end with (plus [`CONNECT_FAILED`]).
pub const SESSION_CODES: &[ErrorCode] = &[
    ErrorCode::Unauthenticated,
    ErrorCode::CredentialRevoked,
    ErrorCode::Forbidden,
    ErrorCode::UnsupportedProtocolVersion,
    ErrorCode::InvalidHello,
    ErrorCode::HelloTimeout,
    ErrorCode::TooManySessions,
    ErrorCode::SessionSuperseded,
    ErrorCode::IdleTimeout,
    ErrorCode::ProtocolError,
    ErrorCode::PeerClosed,
    ErrorCode::Shutdown,
    ErrorCode::NotFound,
    ErrorCode::MethodNotAllowed,
    ErrorCode::Unknown,
];

/// Which agent the families are for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Agent {
    /// `continuum-event-broker`: `continuum_event_broker_*`.
    Broker,
    /// `continuum-kv-listener`: `continuum_kv_listener_*`.
    KvListener,
}

impl Agent {
    pub fn prefix(self) -> &'static str {
        match self {
            Agent::Broker => "continuum_event_broker",
            Agent::KvListener => "continuum_kv_listener",
        }
    }
}

/// Cheap to clone: every family is an `Arc` inside.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    pub sessions: IntGauge,
    pub sessions_closed: IntCounterVec,
    pub streams: IntGauge,
    pub stream_closes: IntCounterVec,
    pub refusals: IntCounterVec,
    pub relayed_bytes: IntCounterVec,
    /// Broker only (unregistered for the kv-listener).
    pub advertised_targets: IntGauge,
    /// Broker only (unregistered for the kv-listener).
    pub kubernetes_connected: IntGauge,
    pub build_info: IntGaugeVec,
    /// kv-listener only (unregistered for the broker): batches read from the sources, by result.
    pub source_events: IntCounterVec,
    /// kv-listener only: sources whose kv-events subscription is connected.
    pub sources_connected: IntGauge,
    /// kv-listener only: how each served stream started, by `result`.
    pub stream_starts: IntCounterVec,
}

/// `result` of `continuum_kv_listener_source_events_total`.
/// `transport_refused` counts ended subscriptions, not batches: a dial `--allow-cidr` refused, a
/// ZMTP violation, or a stalled handshake (the router's `transport_refused`).
pub const SOURCE_EVENT_RESULTS: &[&str] = &[
    "accepted",
    "malformed",
    "oversized",
    "over_capacity",
    "transport_refused",
];
/// `result` of `continuum_kv_listener_stream_starts_total`: exact resume, no `last_event_id`,
/// or the reset reason.
pub const STREAM_START_RESULTS: &[&str] = &["exact", "fresh", "evicted", "unknown_epoch"];

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Metrics {
    /// The broker's families (`continuum_event_broker_*`).
    pub fn new() -> Self {
        Self::for_agent(Agent::Broker)
    }

    /// The families of one agent: the shared session and stream families under its prefix, and
    /// its own.
    #[expect(clippy::too_many_lines, reason = "on tests/it/tidy/long_functions.txt")]
    pub fn for_agent(agent: Agent) -> Self {
        let registry = Registry::new();
        let broker = agent == Agent::Broker;
        let prefix = agent.prefix();
        let gauge_if = |register: bool, name: &str, help: &str| {
            let g = IntGauge::new(format!("{prefix}_{name}"), help).expect("valid gauge");
            if register {
                registry.register(Box::new(g.clone())).expect("register");
            }
            g
        };
        let gauge = |name: &str, help: &str| gauge_if(true, name, help);
        let counter_if = |register: bool, name: &str, help: &str, label: &str| {
            let c = IntCounterVec::new(Opts::new(format!("{prefix}_{name}"), help), &[label])
                .expect("valid counter");
            if register {
                registry.register(Box::new(c.clone())).expect("register");
            }
            c
        };
        let counter = |name: &str, help: &str, label: &str| counter_if(true, name, help, label);
        let sessions = gauge(
            "sessions",
            "Welcomed control sessions to the router's event-bus listener (0 or 1).",
        );
        let sessions_closed = counter(
            "sessions_closed_total",
            "Control sessions that ended or were refused, by error code (connect_failed: no HTTP answer).",
            "code",
        );
        let streams = gauge("streams", "Data streams relaying a publisher now.");
        let stream_closes = counter(
            "stream_closes_total",
            "Relays that ended after they started, by reason (plus unsubscribed, session_closed).",
            "reason",
        );
        let refusals = counter(
            "refusals_total",
            "Subscribes answered with stream_closed before any byte was relayed, by reason.",
            "reason",
        );
        let relayed_bytes = counter(
            "relayed_bytes_total",
            "Bytes relayed between publishers and the router, by direction (to_router, to_publisher).",
            "direction",
        );
        let advertised_targets = gauge_if(
            broker,
            "advertised_targets",
            "Distinct publisher targets DynamoWorkerMetadata advertises (the dialable set).",
        );
        let kubernetes_connected = gauge_if(
            broker,
            "kubernetes_connected",
            "1 while the DynamoWorkerMetadata watch is listed and open.",
        );
        let build_info = IntGaugeVec::new(
            Opts::new(
                format!("{prefix}_build_info"),
                "Always 1; the version is the label.",
            ),
            &["version"],
        )
        .expect("valid gauge");
        registry
            .register(Box::new(build_info.clone()))
            .expect("register");
        build_info.with_label_values(&[crate::VERSION]).set(1);
        for code in SESSION_CODES {
            sessions_closed.with_label_values(&[code.as_str()]);
        }
        sessions_closed.with_label_values(&[CONNECT_FAILED]);
        for reason in CLOSE_REASONS {
            stream_closes.with_label_values(&[reason.as_str()]);
            refusals.with_label_values(&[reason.as_str()]);
        }
        stream_closes.with_label_values(&[UNSUBSCRIBED]);
        stream_closes.with_label_values(&[SESSION_CLOSED]);
        for direction in ["to_router", "to_publisher"] {
            if broker || direction == "to_router" {
                relayed_bytes.with_label_values(&[direction]);
            }
        }
        let source_events = counter_if(
            !broker,
            "source_events_total",
            "kv-events batches read from the sources, by result (accepted, malformed, oversized, over_capacity); transport_refused counts subscriptions ended by the dial allowlist or a protocol violation.",
            "result",
        );
        let sources_connected = gauge_if(
            !broker,
            "sources_connected",
            "Sources whose kv-events subscription is connected.",
        );
        let stream_starts = counter_if(
            !broker,
            "stream_starts_total",
            "Served streams by how they started: exact (resumed after last_event_id), fresh (no last_event_id), or the reset reason (evicted, unknown_epoch).",
            "result",
        );
        if !broker {
            for result in SOURCE_EVENT_RESULTS {
                source_events.with_label_values(&[result]);
            }
            for result in STREAM_START_RESULTS {
                stream_starts.with_label_values(&[result]);
            }
        }
        Self {
            registry,
            sessions,
            sessions_closed,
            streams,
            stream_closes,
            refusals,
            relayed_bytes,
            advertised_targets,
            kubernetes_connected,
            build_info,
            source_events,
            sources_connected,
            stream_starts,
        }
    }

    pub fn session_closed(&self, code: &str) {
        self.sessions_closed.with_label_values(&[code]).inc();
    }

    pub fn refused(&self, reason: StreamCloseReason) {
        self.refusals.with_label_values(&[reason.as_str()]).inc();
    }

    pub fn stream_closed(&self, reason: &str) {
        self.stream_closes.with_label_values(&[reason]).inc();
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_is_exported_with_its_closed_label_set_at_zero() {
        let m = Metrics::new();
        let text = m.render();
        for needle in [
            "continuum_event_broker_sessions 0",
            "continuum_event_broker_sessions_closed_total{code=\"connect_failed\"} 0",
            "continuum_event_broker_refusals_total{reason=\"target_not_advertised\"} 0",
            "continuum_event_broker_stream_closes_total{reason=\"unsubscribed\"} 0",
            "continuum_event_broker_relayed_bytes_total{direction=\"to_router\"} 0",
            "continuum_event_broker_advertised_targets 0",
            "continuum_event_broker_kubernetes_connected 0",
            "continuum_event_broker_build_info{version=",
        ] {
            assert!(text.contains(needle), "{needle} in\n{text}");
        }
    }
}
