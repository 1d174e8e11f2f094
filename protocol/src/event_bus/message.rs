//! Control-channel messages: one JSON object per NDJSON line, tagged by `"type"`.
//!
//! Decoding is tolerant outside and strict inside: unknown fields are ignored, an unknown
//! `"type"` or a missing field is [`DecodeError::Malformed`], and every string and list is
//! checked against a compiled-in bound after parsing (the line itself was bounded by
//! [`super::ndjson::LineDecoder`] before it was buffered, so parsing allocates at most
//! [`super::MAX_LINE_BYTES`]-proportional memory).

use core::net::IpAddr;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use thiserror::Error;

use crate::discovery::EventTopic;
use crate::ids::Namespace;

/// Longest client id, namespace, backend name or host (a DNS name's limit).
pub const MAX_NAME_BYTES: usize = 253;
/// Most namespaces one broker hello may declare.
pub const MAX_HELLO_NAMESPACES: usize = 256;
/// Most sources one kv_listener hello may announce.
pub const MAX_HELLO_SOURCES: usize = 256;
/// Most protocol versions one hello may offer.
pub const MAX_HELLO_VERSIONS: usize = 16;
/// Longest free-text `message` field (diagnostics only; never parsed).
pub const MAX_TEXT_BYTES: usize = 512;

/// Which agent is on the other end of a session (`brokers[].role`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// continuum-event-broker: relays ZMQ publishers of its Dynamo namespaces.
    Broker,
    /// continuum-kv-listener: pushes the SSE KV-event streams of its announced backends.
    KvListener,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Broker => "broker",
            Role::KvListener => "kv_listener",
        }
    }
}

/// A client's identity: the `brokers[].id` it authenticates as (also its certificate DNS SAN).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ClientId(pub String);

impl ClientId {
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ClientId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// `sess-<32 lowercase hex>`: 128 random bits drawn by the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SessionId(u128);

impl SessionId {
    /// `random` must come from a CSPRNG: the id names the session on data-stream requests.
    pub fn from_random(random: u128) -> Self {
        Self(random)
    }

    /// Strict parse of `sess-<32 lowercase hex>`.
    pub fn parse(text: &str) -> Option<Self> {
        let hex = text.strip_prefix("sess-")?;
        if hex.len() != 32
            || !hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return None;
        }
        u128::from_str_radix(hex, 16).ok().map(Self)
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sess-{:032x}", self.0)
    }
}

impl Serialize for SessionId {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for SessionId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        SessionId::parse(&text)
            .ok_or_else(|| serde::de::Error::custom("session_id is sess-<32 hex>"))
    }
}

/// A data stream, numbered by the router from 1 upwards within one session and never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct StreamId(pub u64);

impl StreamId {
    /// Strict parse of the `{stream_id}` path segment: 1 to 20 ASCII digits, no sign, no
    /// leading zero, non-zero, fits in `u64`.
    pub fn parse_path_segment(segment: &str) -> Option<Self> {
        let bytes = segment.as_bytes();
        if bytes.is_empty()
            || bytes.len() > 20
            || bytes[0] == b'0'
            || !bytes.iter().all(u8::is_ascii_digit)
        {
            return None;
        }
        segment.parse().ok().map(Self)
    }
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A ZMQ publisher reachable from the broker: `tcp://host:port` in a Dynamo namespace.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ZmqTcpTarget {
    pub namespace: Namespace,
    /// An IP literal (IPv6 without brackets) or a DNS name.
    pub host: String,
    pub port: u16,
}

impl ZmqTcpTarget {
    pub fn check(&self) -> Result<(), DecodeError> {
        check_name("namespace", self.namespace.as_str())?;
        if !is_host(&self.host) {
            return Err(DecodeError::Bounds(
                "host is an IP literal or a DNS name of at most 253 bytes",
            ));
        }
        if self.port == 0 {
            return Err(DecodeError::Bounds("port must be in 1..=65535"));
        }
        Ok(())
    }
}

/// A kv_listener source: one backend's SSE KV-event stream, resumed after `last_event_id`
/// (the SSE `Last-Event-ID`; `None` starts from the listener's live edge).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct AnnouncedSourceTarget {
    pub backend: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_event_id: Option<u64>,
}

/// What a `subscribe` asks the client to relay, tagged by `"kind"`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum StreamTarget {
    /// Role broker: dial the publisher, relay raw ZMTP bytes both ways.
    ZmqTcp {
        #[serde(flatten)]
        target: ZmqTcpTarget,
        #[serde(with = "topic_text")]
        topic: EventTopic,
    },
    /// Role kv_listener: relay the announced backend's SSE bytes.
    AnnouncedSource(AnnouncedSourceTarget),
}

impl StreamTarget {
    /// The role that can serve this target.
    pub fn role(&self) -> Role {
        match self {
            StreamTarget::ZmqTcp { .. } => Role::Broker,
            StreamTarget::AnnouncedSource(_) => Role::KvListener,
        }
    }

    pub fn check(&self) -> Result<(), DecodeError> {
        match self {
            StreamTarget::ZmqTcp { target, .. } => target.check(),
            StreamTarget::AnnouncedSource(source) => check_name("backend", &source.backend),
        }
    }
}

/// One source a kv_listener announces in its hello.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct AnnouncedSource {
    pub backend: String,
}

/// Client → router, the first line of the control channel.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    pub role: Role,
    pub client_id: ClientId,
    /// Protocol versions the client speaks; the router picks the highest it shares.
    pub versions: Vec<u32>,
    /// Role broker: the Dynamo namespaces whose publishers it can reach.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dynamo_namespaces: Vec<Namespace>,
    /// Role kv_listener: the backends whose KV events it can relay.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<AnnouncedSource>,
}

/// Router → client, the first line of the response body once the hello is accepted.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    pub session_id: SessionId,
    /// The negotiated protocol version; data streams must send it in `continuum-bus-version`.
    pub version: u32,
    pub heartbeat_interval_ms: u64,
    pub idle_timeout_ms: u64,
    /// Streams the router will command at once in this session.
    pub max_streams: u32,
    /// Per-direction buffer of one data stream (the HTTP/2 stream window).
    pub stream_buffer_bytes: u64,
    /// Longest control line either side may send, newline included.
    pub max_line_bytes: u64,
}

/// Router → client: open `POST /bus/v1/streams/{stream_id}` and relay `target`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Subscribe {
    pub stream_id: StreamId,
    pub target: StreamTarget,
}

/// Client → router: a commanded stream ended or could not be opened.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamClosed {
    pub stream_id: StreamId,
    pub reason: StreamCloseReason,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Router → client, the last line before the router ends the session.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Closed {
    pub code: ErrorCode,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Every control message of protocol version 1.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Message {
    Hello(Hello),
    Welcome(Welcome),
    Subscribe(Subscribe),
    Unsubscribe {
        stream_id: StreamId,
    },
    StreamClosed(StreamClosed),
    /// Client → router: the client is shutting down; place nothing new on it.
    Draining,
    /// Either direction; answered with `heartbeat_ack` carrying the same `seq`.
    Heartbeat {
        seq: u64,
    },
    HeartbeatAck {
        seq: u64,
    },
    Closed(Closed),
}

impl Message {
    /// The `"type"` tag, for logs and counters (a closed set).
    pub fn kind(&self) -> &'static str {
        match self {
            Message::Hello(_) => "hello",
            Message::Welcome(_) => "welcome",
            Message::Subscribe(_) => "subscribe",
            Message::Unsubscribe { .. } => "unsubscribe",
            Message::StreamClosed(_) => "stream_closed",
            Message::Draining => "draining",
            Message::Heartbeat { .. } => "heartbeat",
            Message::HeartbeatAck { .. } => "heartbeat_ack",
            Message::Closed(_) => "closed",
        }
    }

    /// One NDJSON line (JSON object + `\n`).
    pub fn encode(&self) -> Vec<u8> {
        let mut line = serde_json::to_vec(self)
            .expect("invariant: messages hold only strings, integers and lists");
        line.push(b'\n');
        line
    }

    /// Decodes one line (without its newline) and checks every bound.
    pub fn decode(line: &[u8]) -> Result<Message, DecodeError> {
        let message: Message = serde_json::from_slice(line).map_err(|_| DecodeError::Malformed)?;
        message.check()?;
        Ok(message)
    }

    /// Bounds on strings and lists that serde cannot express.
    pub fn check(&self) -> Result<(), DecodeError> {
        match self {
            Message::Hello(hello) => hello.check(),
            Message::Subscribe(subscribe) => {
                check_stream_id(subscribe.stream_id)?;
                subscribe.target.check()
            }
            Message::Unsubscribe { stream_id } => check_stream_id(*stream_id),
            Message::StreamClosed(closed) => {
                check_stream_id(closed.stream_id)?;
                check_text(closed.message.as_deref())
            }
            Message::Closed(closed) => check_text(closed.message.as_deref()),
            Message::Welcome(_)
            | Message::Draining
            | Message::Heartbeat { .. }
            | Message::HeartbeatAck { .. } => Ok(()),
        }
    }
}

impl Hello {
    /// Shape bounds (counts, name syntax); the grant checks live in [`Hello::validate`].
    pub fn check(&self) -> Result<(), DecodeError> {
        check_name("client_id", self.client_id.as_str())?;
        if self.versions.is_empty() || self.versions.len() > MAX_HELLO_VERSIONS {
            return Err(DecodeError::Bounds("versions holds 1..=16 entries"));
        }
        if self.dynamo_namespaces.len() > MAX_HELLO_NAMESPACES {
            return Err(DecodeError::Bounds(
                "dynamo_namespaces holds at most 256 entries",
            ));
        }
        if self.sources.len() > MAX_HELLO_SOURCES {
            return Err(DecodeError::Bounds("sources holds at most 256 entries"));
        }
        for namespace in &self.dynamo_namespaces {
            check_name("namespace", namespace.as_str())?;
        }
        for source in &self.sources {
            check_name("backend", &source.backend)?;
        }
        Ok(())
    }
}

/// Why a control line was not a message.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum DecodeError {
    #[error("control line is longer than {limit} bytes")]
    LineTooLong { limit: usize },
    #[error("control line is not a version 1 message")]
    Malformed,
    #[error("control message out of bounds: {0}")]
    Bounds(&'static str),
}

/// Every error code the listener and the session state machines use, with its HTTP status.
/// The same code travels in an HTTP error body, a `closed` line, or a log line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The first byte was not a TLS handshake (plaintext 403 when it was an ASCII letter).
    TlsRequired,
    /// The TLS handshake did not finish within 10 s.
    HandshakeTimeout,
    /// The TLS handshake failed (bad certificate, no h2 ALPN, not TLS 1.3).
    HandshakeFailed,
    /// More than `4 * max_sessions` (at least 16) TCP connections.
    ConnectionLimit,
    /// No 2xx session or stream request within 10 s of the handshake.
    AuthTimeout,
    /// No credential, or one that names no configured entry.
    Unauthenticated,
    /// The credential's entry was removed by a reload.
    CredentialRevoked,
    /// Authenticated, but the role, client id, namespace, backend or stream is not granted.
    Forbidden,
    /// `continuum-bus-version` missing, below 1, or no shared version in the hello.
    UnsupportedProtocolVersion,
    /// The first control line was not a well-formed hello.
    InvalidHello,
    /// No hello within 10 s.
    HelloTimeout,
    /// `max_sessions` welcomed sessions, or another pre-hello admission of the same credential.
    TooManySessions,
    /// A data stream for an ID not commanded (or no longer commanded) in the session.
    UnknownStream,
    /// A second data stream for an ID already open.
    DuplicateStream,
    /// A newer session of the same entry replaced this one.
    SessionSuperseded,
    /// Nothing was received for `idle_timeout`.
    IdleTimeout,
    /// A line that was malformed, too long or out of order after the welcome.
    ProtocolError,
    /// The peer ended the control channel.
    PeerClosed,
    /// The router is stopping or the listener was disabled by a reload.
    Shutdown,
    /// A path other than the session and stream paths.
    NotFound,
    /// A method other than POST on a bus path.
    MethodNotAllowed,
    /// A code this version does not know (tolerated when decoding a peer's `closed`).
    #[serde(other)]
    Unknown,
}

impl ErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::TlsRequired => "tls_required",
            ErrorCode::HandshakeTimeout => "handshake_timeout",
            ErrorCode::HandshakeFailed => "handshake_failed",
            ErrorCode::ConnectionLimit => "connection_limit",
            ErrorCode::AuthTimeout => "auth_timeout",
            ErrorCode::Unauthenticated => "unauthenticated",
            ErrorCode::CredentialRevoked => "credential_revoked",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::UnsupportedProtocolVersion => "unsupported_protocol_version",
            ErrorCode::InvalidHello => "invalid_hello",
            ErrorCode::HelloTimeout => "hello_timeout",
            ErrorCode::TooManySessions => "too_many_sessions",
            ErrorCode::UnknownStream => "unknown_stream",
            ErrorCode::DuplicateStream => "duplicate_stream",
            ErrorCode::SessionSuperseded => "session_superseded",
            ErrorCode::IdleTimeout => "idle_timeout",
            ErrorCode::ProtocolError => "protocol_error",
            ErrorCode::PeerClosed => "peer_closed",
            ErrorCode::Shutdown => "shutdown",
            ErrorCode::NotFound => "not_found",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::Unknown => "unknown",
        }
    }

    /// The HTTP status when the code answers a request; `None` for codes that end a TCP/TLS
    /// connection without a response or end a welcomed session with a `closed` line.
    pub fn http_status(self) -> Option<u16> {
        Some(match self {
            ErrorCode::TlsRequired | ErrorCode::Forbidden => 403,
            ErrorCode::Unauthenticated | ErrorCode::CredentialRevoked => 401,
            ErrorCode::UnsupportedProtocolVersion
            | ErrorCode::InvalidHello
            | ErrorCode::ProtocolError => 400,
            ErrorCode::HelloTimeout => 408,
            ErrorCode::TooManySessions => 429,
            ErrorCode::UnknownStream | ErrorCode::NotFound => 404,
            ErrorCode::DuplicateStream => 409,
            ErrorCode::MethodNotAllowed => 405,
            ErrorCode::Shutdown => 503,
            ErrorCode::HandshakeTimeout
            | ErrorCode::HandshakeFailed
            | ErrorCode::ConnectionLimit
            | ErrorCode::AuthTimeout
            | ErrorCode::SessionSuperseded
            | ErrorCode::IdleTimeout
            | ErrorCode::PeerClosed
            | ErrorCode::Unknown => return None,
        })
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a client closed a commanded stream (`stream_closed.reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamCloseReason {
    /// The publisher or backend is not advertised in the client's cluster (DynamoWorkerMetadata
    /// or the announced sources).
    TargetNotAdvertised,
    /// The target's kind does not fit the client's role, or its namespace was not declared.
    InvalidTarget,
    /// The client is not allowed to reach the target.
    Forbidden,
    /// The client could not connect to the publisher or backend.
    ConnectFailed,
    /// The publisher or backend ended the connection.
    PublisherClosed,
    /// The data stream to the router could not be opened or broke.
    StreamFailed,
    /// The client already relays `max_streams` streams.
    StreamLimit,
    /// The client is draining and accepts no new streams.
    Draining,
    /// The relay stopped after a local error.
    Internal,
    /// A reason this version does not know.
    #[serde(other)]
    Unknown,
}

impl StreamCloseReason {
    pub fn as_str(self) -> &'static str {
        match self {
            StreamCloseReason::TargetNotAdvertised => "target_not_advertised",
            StreamCloseReason::InvalidTarget => "invalid_target",
            StreamCloseReason::Forbidden => "forbidden",
            StreamCloseReason::ConnectFailed => "connect_failed",
            StreamCloseReason::PublisherClosed => "publisher_closed",
            StreamCloseReason::StreamFailed => "stream_failed",
            StreamCloseReason::StreamLimit => "stream_limit",
            StreamCloseReason::Draining => "draining",
            StreamCloseReason::Internal => "internal",
            StreamCloseReason::Unknown => "unknown",
        }
    }
}

impl fmt::Display for StreamCloseReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The JSON body of every HTTP error response: `{"error":{"code":"…","message":"…"}}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    pub code: ErrorCode,
    #[serde(default)]
    pub message: String,
}

impl ErrorBody {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        let mut message: String = message.into();
        truncate_text(&mut message);
        Self {
            error: ErrorDetail { code, message },
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("invariant: an error body is a code and a string")
    }

    /// Decodes a refusal body of at most [`super::MAX_LINE_BYTES`] bytes; `None` when it is not
    /// one (the caller then knows only the HTTP status).
    pub fn decode(body: &[u8]) -> Option<Self> {
        if body.len() > super::MAX_LINE_BYTES {
            return None;
        }
        let mut body: ErrorBody = serde_json::from_slice(body).ok()?;
        truncate_text(&mut body.error.message);
        Some(body)
    }
}

/// Cuts a diagnostic text to [`MAX_TEXT_BYTES`] on a character boundary.
pub fn truncate_text(text: &mut String) {
    if text.len() > MAX_TEXT_BYTES {
        let mut end = MAX_TEXT_BYTES;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
}

fn check_stream_id(id: StreamId) -> Result<(), DecodeError> {
    if id.0 == 0 {
        return Err(DecodeError::Bounds("stream_id starts at 1"));
    }
    Ok(())
}

fn check_text(text: Option<&str>) -> Result<(), DecodeError> {
    match text {
        Some(text) if text.len() > MAX_TEXT_BYTES => {
            Err(DecodeError::Bounds("message holds at most 512 bytes"))
        }
        _ => Ok(()),
    }
}

/// Names (client ids, namespaces, backends): 1..=253 bytes, no whitespace, control
/// characters or `/`.
fn check_name(what: &'static str, name: &str) -> Result<(), DecodeError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_BYTES
        && !name
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == '/');
    if ok {
        Ok(())
    } else {
        Err(DecodeError::Bounds(match what {
            "client_id" => "client_id is 1..=253 bytes without whitespace or '/'",
            "namespace" => "namespace is 1..=253 bytes without whitespace or '/'",
            _ => "backend is 1..=253 bytes without whitespace or '/'",
        }))
    }
}

fn is_host(host: &str) -> bool {
    if host.parse::<IpAddr>().is_ok() {
        return true;
    }
    !host.is_empty()
        && host.len() <= MAX_NAME_BYTES
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

mod topic_text {
    use serde::{Deserialize, Deserializer, Serializer};

    use crate::discovery::EventTopic;

    pub fn serialize<S: Serializer>(topic: &EventTopic, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(topic.as_str())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<EventTopic, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        EventTopic::parse(&text)
            .ok_or_else(|| serde::de::Error::custom("topic is kv_metrics or kv-events"))
    }
}
