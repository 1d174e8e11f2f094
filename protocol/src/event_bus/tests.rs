//! Unit and property tests of the event-bus wire contract.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use proptest::prelude::*;

use super::bounds::{self, SessionBounds};
use super::client::{ClientEvent, ClientSession, WELCOME_TIMEOUT};
use super::credential::{
    Credential, Presented, REVOKED_RING, RevokedCredentials, TokenHash, authenticate, bearer_token,
};
use super::hello::{self, Coverage, Grant, parse_version_header};
use super::message::*;
use super::ndjson::LineDecoder;
use super::rendezvous;
use super::server::{
    HELLO_TIMEOUT, STREAM_OPEN_TIMEOUT, ServerConfig, ServerEvent, ServerSession, SubscribeError,
};
use super::transport::{
    AUTH_TIMEOUT, CONNECTION_LINGER, ConnectionTimers, FirstByte, classify_first_byte,
    plaintext_refusal,
};
use super::{Admission, BusPath, MAX_LINE_BYTES};
use crate::discovery::EventTopic;
use crate::ids::Namespace;
use crate::time::Tick;

// ---------- fixtures ----------

const HEARTBEAT: Duration = Duration::from_secs(10);
const IDLE: Duration = Duration::from_secs(30);

fn ns(name: &str) -> Namespace {
    Namespace::new(name)
}

fn broker_grant() -> Grant {
    Grant {
        id: ClientId::new("broker-a.dynamo"),
        role: Role::Broker,
        namespaces: [ns("dynamo"), ns("other")].into_iter().collect(),
        backends: BTreeSet::new(),
    }
}

fn listener_grant() -> Grant {
    Grant {
        id: ClientId::new("kv-listener-a"),
        role: Role::KvListener,
        namespaces: BTreeSet::new(),
        backends: ["vllm-1".to_owned(), "vllm-2".to_owned()]
            .into_iter()
            .collect(),
    }
}

fn broker_hello() -> Hello {
    Hello {
        role: Role::Broker,
        client_id: ClientId::new("broker-a.dynamo"),
        versions: vec![1],
        dynamo_namespaces: vec![ns("dynamo")],
        sources: vec![],
    }
}

fn listener_hello() -> Hello {
    Hello {
        role: Role::KvListener,
        client_id: ClientId::new("kv-listener-a"),
        versions: vec![1],
        dynamo_namespaces: vec![],
        sources: vec![AnnouncedSource {
            backend: "vllm-1".into(),
        }],
    }
}

fn zmq(namespace: &str, port: u16) -> StreamTarget {
    StreamTarget::ZmqTcp {
        target: ZmqTcpTarget {
            namespace: ns(namespace),
            host: "10.0.0.5".into(),
            port,
        },
        topic: EventTopic::KvMetrics,
    }
}

fn announced(backend: &str, last_event_id: Option<u64>) -> StreamTarget {
    StreamTarget::AnnouncedSource(AnnouncedSourceTarget {
        backend: backend.into(),
        last_event_id,
    })
}

fn config(max_streams: u32) -> ServerConfig {
    let bounds = SessionBounds::new(64 * 1024 * 1024, max_streams).unwrap();
    ServerConfig::new(HEARTBEAT, IDLE, bounds)
}

fn t(ms: u64) -> Tick {
    Tick::from_millis(ms)
}

fn server(grant: Grant, max_streams: u32) -> ServerSession {
    ServerSession::new(
        grant,
        1,
        SessionId::from_random(0xabc),
        config(max_streams),
        t(0),
    )
}

fn events(session: &mut ServerSession) -> Vec<ServerEvent> {
    std::iter::from_fn(|| session.poll_event()).collect()
}

fn client_events(session: &mut ClientSession) -> Vec<ClientEvent> {
    std::iter::from_fn(|| session.poll_event()).collect()
}

fn lines(bytes: &[u8]) -> Vec<Message> {
    bytes
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| Message::decode(l).unwrap())
        .collect()
}

/// A broker session that has been welcomed; transmit and events drained.
fn live_server(max_streams: u32) -> ServerSession {
    let mut s = server(broker_grant(), max_streams);
    s.handle_input(&Message::Hello(broker_hello()).encode(), t(1));
    assert!(s.welcome(t(1)));
    assert!(s.is_live());
    s.poll_transmit();
    events(&mut s);
    s
}

fn welcome() -> Welcome {
    Welcome {
        session_id: SessionId::from_random(7),
        version: 1,
        heartbeat_interval_ms: 10_000,
        idle_timeout_ms: 30_000,
        max_streams: 4,
        stream_buffer_bytes: 16 * 1024,
        max_line_bytes: MAX_LINE_BYTES as u64,
    }
}

fn live_client(hello: Hello) -> ClientSession {
    let mut c = ClientSession::new(hello, t(0)).unwrap();
    c.poll_transmit();
    c.handle_input(&Message::Welcome(welcome()).encode(), t(1));
    assert!(c.is_live());
    client_events(&mut c);
    c
}

// ---------- messages ----------

/// The exact lines docs/event-bus.md shows decode to the documented values.
#[test]
fn documented_lines_decode() {
    let cases: &[(&str, Message)] = &[
        (
            r#"{"type":"hello","role":"broker","client_id":"broker-a.dynamo","versions":[1],"dynamo_namespaces":["dynamo"]}"#,
            Message::Hello(broker_hello()),
        ),
        (
            r#"{"type":"hello","role":"kv_listener","client_id":"kv-listener-a","versions":[1],"sources":[{"backend":"vllm-1"}]}"#,
            Message::Hello(listener_hello()),
        ),
        (
            r#"{"type":"welcome","session_id":"sess-00000000000000000000000000000007","version":1,"heartbeat_interval_ms":10000,"idle_timeout_ms":30000,"max_streams":4,"stream_buffer_bytes":16384,"max_line_bytes":65536}"#,
            Message::Welcome(welcome()),
        ),
        (
            r#"{"type":"subscribe","stream_id":1,"target":{"kind":"zmq_tcp","namespace":"dynamo","host":"10.0.0.5","port":5557,"topic":"kv_metrics"}}"#,
            Message::Subscribe(Subscribe {
                stream_id: StreamId(1),
                target: zmq("dynamo", 5557),
            }),
        ),
        (
            r#"{"type":"subscribe","stream_id":2,"target":{"kind":"announced_source","backend":"vllm-1","last_event_id":42}}"#,
            Message::Subscribe(Subscribe {
                stream_id: StreamId(2),
                target: announced("vllm-1", Some(42)),
            }),
        ),
        (
            r#"{"type":"unsubscribe","stream_id":1}"#,
            Message::Unsubscribe {
                stream_id: StreamId(1),
            },
        ),
        (
            r#"{"type":"stream_closed","stream_id":1,"reason":"target_not_advertised","message":"no such publisher"}"#,
            Message::StreamClosed(StreamClosed {
                stream_id: StreamId(1),
                reason: StreamCloseReason::TargetNotAdvertised,
                message: Some("no such publisher".into()),
            }),
        ),
        (r#"{"type":"draining"}"#, Message::Draining),
        (
            r#"{"type":"heartbeat","seq":3}"#,
            Message::Heartbeat { seq: 3 },
        ),
        (
            r#"{"type":"heartbeat_ack","seq":3}"#,
            Message::HeartbeatAck { seq: 3 },
        ),
        (
            r#"{"type":"closed","code":"session_superseded"}"#,
            Message::Closed(Closed {
                code: ErrorCode::SessionSuperseded,
                message: None,
            }),
        ),
    ];
    for (line, expected) in cases {
        assert_eq!(
            &Message::decode(line.as_bytes()).unwrap(),
            expected,
            "{line}"
        );
        // Encoding is canonical: the documented line is what we send.
        let encoded = expected.encode();
        assert_eq!(&encoded[..encoded.len() - 1], line.as_bytes(), "{line}");
    }
}

#[test]
fn decoding_is_tolerant_outside_strict_inside() {
    // Unknown fields are ignored.
    let line = br#"{"type":"heartbeat","seq":1,"future":{"x":[1,2]}}"#;
    assert_eq!(
        Message::decode(line).unwrap(),
        Message::Heartbeat { seq: 1 }
    );
    // Unknown close reasons and codes are tolerated as `unknown`.
    let line = br#"{"type":"stream_closed","stream_id":4,"reason":"brand_new"}"#;
    let Message::StreamClosed(closed) = Message::decode(line).unwrap() else {
        panic!("not stream_closed")
    };
    assert_eq!(closed.reason, StreamCloseReason::Unknown);
    let line = br#"{"type":"closed","code":"brand_new"}"#;
    assert!(matches!(
        Message::decode(line).unwrap(),
        Message::Closed(Closed {
            code: ErrorCode::Unknown,
            ..
        })
    ));
    for bad in [
        &br#"{"type":"nope"}"#[..],
        br#"{"seq":1}"#,
        br#"{"type":"heartbeat"}"#,
        br#"{"type":"heartbeat","seq":-1}"#,
        br#"not json"#,
        br#"{"type":"unsubscribe","stream_id":0}"#,
        br#"{"type":"subscribe","stream_id":1,"target":{"kind":"zmq_tcp","namespace":"dynamo","host":"10.0.0.5","port":0,"topic":"kv_metrics"}}"#,
        br#"{"type":"subscribe","stream_id":1,"target":{"kind":"zmq_tcp","namespace":"dynamo","host":"a b","port":1,"topic":"kv_metrics"}}"#,
        br#"{"type":"subscribe","stream_id":1,"target":{"kind":"zmq_tcp","namespace":"dynamo","host":"h","port":1,"topic":"other"}}"#,
        br#"{"type":"subscribe","stream_id":1,"target":{"kind":"announced_source","backend":""}}"#,
        br#"{"type":"hello","role":"broker","client_id":"b","versions":[]}"#,
        br#"{"type":"hello","role":"admin","client_id":"b","versions":[1]}"#,
        br#"{"type":"welcome","session_id":"sess-XYZ","version":1,"heartbeat_interval_ms":1,"idle_timeout_ms":2,"max_streams":1,"stream_buffer_bytes":1,"max_line_bytes":1}"#,
    ] {
        assert!(Message::decode(bad).is_err(), "{}", String::from_utf8_lossy(bad));
    }
    let long = format!(
        r#"{{"type":"closed","code":"shutdown","message":"{}"}}"#,
        "x".repeat(MAX_TEXT_BYTES + 1)
    );
    assert!(matches!(
        Message::decode(long.as_bytes()),
        Err(DecodeError::Bounds(_))
    ));
    let many: Vec<String> = (0..=MAX_HELLO_NAMESPACES)
        .map(|i| format!("\"n{i}\""))
        .collect();
    let line = format!(
        r#"{{"type":"hello","role":"broker","client_id":"b","versions":[1],"dynamo_namespaces":[{}]}}"#,
        many.join(",")
    );
    assert!(matches!(
        Message::decode(line.as_bytes()),
        Err(DecodeError::Bounds(_))
    ));
}

#[test]
fn ids_parse_strictly() {
    let id = SessionId::from_random(0x0123_4567_89ab_cdef_0123_4567_89ab_cdef);
    assert_eq!(id.to_string(), "sess-0123456789abcdef0123456789abcdef");
    assert_eq!(SessionId::parse(&id.to_string()), Some(id));
    for bad in [
        "sess-0123",
        "sess-0123456789ABCDEF0123456789abcdef",
        "0123456789abcdef0123456789abcdef",
        "sess-0123456789abcdef0123456789abcdefa",
    ] {
        assert_eq!(SessionId::parse(bad), None, "{bad}");
    }
    assert_eq!(StreamId::parse_path_segment("1"), Some(StreamId(1)));
    assert_eq!(
        StreamId::parse_path_segment("18446744073709551615"),
        Some(StreamId(u64::MAX))
    );
    for bad in [
        "",
        "0",
        "01",
        "+1",
        "-1",
        "1a",
        "18446744073709551616",
        "1/2",
        " 1",
    ] {
        assert_eq!(StreamId::parse_path_segment(bad), None, "{bad:?}");
    }
    assert_eq!(BusPath::parse("/bus/v1/session"), Some(BusPath::Session));
    assert_eq!(
        BusPath::parse("/bus/v1/streams/9"),
        Some(BusPath::Stream(StreamId(9)))
    );
    assert_eq!(BusPath::parse("/bus/v1/streams/09"), None);
    assert!(BusPath::is_stream_prefix("/bus/v1/streams/09"));
    assert_eq!(BusPath::parse("/bus/v1/session/"), None);
    assert_eq!(BusPath::stream(StreamId(9)), "/bus/v1/streams/9");
}

#[test]
fn error_codes_have_the_documented_names_and_statuses() {
    let table: &[(ErrorCode, &str, Option<u16>)] = &[
        (ErrorCode::TlsRequired, "tls_required", Some(403)),
        (ErrorCode::HandshakeTimeout, "handshake_timeout", None),
        (ErrorCode::HandshakeFailed, "handshake_failed", None),
        (ErrorCode::ConnectionLimit, "connection_limit", None),
        (ErrorCode::AuthTimeout, "auth_timeout", None),
        (ErrorCode::Unauthenticated, "unauthenticated", Some(401)),
        (
            ErrorCode::CredentialRevoked,
            "credential_revoked",
            Some(401),
        ),
        (ErrorCode::Forbidden, "forbidden", Some(403)),
        (
            ErrorCode::UnsupportedProtocolVersion,
            "unsupported_protocol_version",
            Some(400),
        ),
        (ErrorCode::InvalidHello, "invalid_hello", Some(400)),
        (ErrorCode::HelloTimeout, "hello_timeout", Some(408)),
        (ErrorCode::TooManySessions, "too_many_sessions", Some(429)),
        (ErrorCode::UnknownStream, "unknown_stream", Some(404)),
        (ErrorCode::DuplicateStream, "duplicate_stream", Some(409)),
        (ErrorCode::SessionSuperseded, "session_superseded", None),
        (ErrorCode::IdleTimeout, "idle_timeout", None),
        (ErrorCode::ProtocolError, "protocol_error", Some(400)),
        (ErrorCode::PeerClosed, "peer_closed", None),
        (ErrorCode::Shutdown, "shutdown", Some(503)),
        (ErrorCode::NotFound, "not_found", Some(404)),
        (ErrorCode::MethodNotAllowed, "method_not_allowed", Some(405)),
        (ErrorCode::Unknown, "unknown", None),
    ];
    for (code, name, status) in table {
        assert_eq!(code.as_str(), *name);
        assert_eq!(serde_json::to_string(code).unwrap(), format!("\"{name}\""));
        assert_eq!(code.http_status(), *status, "{name}");
    }
    for reason in [
        StreamCloseReason::TargetNotAdvertised,
        StreamCloseReason::InvalidTarget,
        StreamCloseReason::Forbidden,
        StreamCloseReason::ConnectFailed,
        StreamCloseReason::PublisherClosed,
        StreamCloseReason::StreamFailed,
        StreamCloseReason::StreamLimit,
        StreamCloseReason::Draining,
        StreamCloseReason::Internal,
    ] {
        assert_eq!(
            serde_json::to_string(&reason).unwrap(),
            format!("\"{}\"", reason.as_str())
        );
    }
    let body = ErrorBody::new(ErrorCode::TooManySessions, "64 sessions are live");
    assert_eq!(
        body.encode(),
        br#"{"error":{"code":"too_many_sessions","message":"64 sessions are live"}}"#
    );
    assert_eq!(ErrorBody::decode(&body.encode()), Some(body));
    assert_eq!(ErrorBody::decode(b"<html>"), None);
}

// ---------- NDJSON framing ----------

#[test]
fn lines_split_across_chunks_and_crlf() {
    let mut decoder = LineDecoder::new(64);
    let mut out = Vec::new();
    for chunk in [&b"ab"[..], b"c\r\n\n", b"de", b"f\ng", b"h\n"] {
        decoder.decode_all(chunk, |line| out.push(line)).unwrap();
    }
    assert_eq!(out, vec![b"abc".to_vec(), b"def".to_vec(), b"gh".to_vec()]);
    assert_eq!(decoder.buffered(), 0);
}

#[test]
fn line_bound_is_enforced_before_buffering() {
    // Exactly at the limit (newline included) is fine.
    let mut decoder = LineDecoder::new(8);
    let mut out = Vec::new();
    decoder.decode_all(b"1234567\n", |l| out.push(l)).unwrap();
    assert_eq!(out, vec![b"1234567".to_vec()]);
    // A partial line that could not fit with its newline fails without being buffered.
    let mut decoder = LineDecoder::new(8);
    decoder.decode(b"1234").unwrap();
    assert_eq!(decoder.buffered(), 4);
    assert_eq!(
        decoder.decode(b"5678"),
        Err(DecodeError::LineTooLong { limit: 8 })
    );
    assert_eq!(decoder.buffered(), 0);
    // The framing is lost for good.
    assert!(decoder.decode(b"\n").is_err());
    // A complete over-long line in one chunk fails too.
    let mut decoder = LineDecoder::new(8);
    assert!(decoder.decode(b"12345678\n").is_err());
}

// ---------- hello ----------

#[test]
fn version_header_and_negotiation() {
    assert_eq!(parse_version_header(Some(b"1")).unwrap(), 1);
    assert_eq!(parse_version_header(Some(b"7")).unwrap(), 7);
    for bad in [
        None,
        Some(&b""[..]),
        Some(b"0"),
        Some(b"-1"),
        Some(b"1.0"),
        Some(b" 1"),
        Some(b"99999999999"),
    ] {
        assert_eq!(
            parse_version_header(bad).unwrap_err().code,
            ErrorCode::UnsupportedProtocolVersion,
            "{bad:?}"
        );
    }
    assert_eq!(hello::negotiate(&[1, 2, 3]), Some(1));
    assert_eq!(hello::negotiate(&[2]), None);
}

#[test]
fn broker_hello_validation() {
    let grant = broker_grant();
    let accepted = broker_hello().validate(&grant, 1).unwrap();
    assert_eq!(accepted.version, 1);
    assert_eq!(
        accepted.coverage,
        Coverage::Namespaces([ns("dynamo")].into_iter().collect())
    );

    let code =
        |hello: Hello, grant: &Grant, header: u32| hello.validate(grant, header).unwrap_err().code;
    let mut h = broker_hello();
    h.role = Role::KvListener;
    assert_eq!(code(h, &grant, 1), ErrorCode::Forbidden);
    let mut h = broker_hello();
    h.client_id = ClientId::new("broker-b.dynamo");
    assert_eq!(code(h, &grant, 1), ErrorCode::Forbidden);
    let mut h = broker_hello();
    h.dynamo_namespaces.push(ns("elsewhere"));
    assert_eq!(code(h, &grant, 1), ErrorCode::Forbidden);
    let mut h = broker_hello();
    h.dynamo_namespaces.clear();
    assert_eq!(code(h, &grant, 1), ErrorCode::InvalidHello);
    let mut h = broker_hello();
    h.dynamo_namespaces.push(ns("dynamo"));
    assert_eq!(code(h, &grant, 1), ErrorCode::InvalidHello);
    let mut h = broker_hello();
    h.sources.push(AnnouncedSource {
        backend: "vllm-1".into(),
    });
    assert_eq!(code(h, &grant, 1), ErrorCode::InvalidHello);
    // The header's version must be offered in the hello; a shared version must exist.
    assert_eq!(code(broker_hello(), &grant, 2), ErrorCode::InvalidHello);
    let mut h = broker_hello();
    h.versions = vec![2, 3];
    assert_eq!(code(h, &grant, 2), ErrorCode::UnsupportedProtocolVersion);

    // An empty allowlist permits any namespace.
    let mut open = grant.clone();
    open.namespaces.clear();
    let mut h = broker_hello();
    h.dynamo_namespaces.push(ns("elsewhere"));
    assert!(h.validate(&open, 1).is_ok());
}

#[test]
fn listener_hello_validation() {
    let grant = listener_grant();
    let accepted = listener_hello().validate(&grant, 1).unwrap();
    assert_eq!(
        accepted.coverage,
        Coverage::Backends(["vllm-1".to_owned()].into_iter().collect())
    );
    let code = |hello: Hello| hello.validate(&grant, 1).unwrap_err().code;
    let mut h = listener_hello();
    h.dynamo_namespaces.push(ns("dynamo"));
    assert_eq!(code(h), ErrorCode::Forbidden);
    let mut h = listener_hello();
    h.sources.clear();
    assert_eq!(code(h), ErrorCode::Forbidden);
    let mut h = listener_hello();
    h.sources.push(AnnouncedSource {
        backend: "vllm-9".into(),
    });
    assert_eq!(code(h), ErrorCode::Forbidden);
    let mut h = listener_hello();
    h.sources.push(AnnouncedSource {
        backend: "vllm-1".into(),
    });
    assert_eq!(code(h), ErrorCode::InvalidHello);
    // A broker hello presented with a kv_listener credential.
    let mut h = broker_hello();
    h.client_id = ClientId::new("kv-listener-a");
    assert_eq!(code(h), ErrorCode::Forbidden);
}

// ---------- rendezvous ----------

#[test]
fn rendezvous_matches_the_documented_vector() {
    let ZmqTcpTargetAndTopic(target, topic) = vector_target();
    let key = rendezvous::zmq_key(&target, topic);
    assert_eq!(
        hex(&key),
        "000664796e616d6f000831302e302e302e35000435353537000a6b765f6d657472696373"
    );
    // Computed independently: python3 hashlib.sha256(pack('>Q', len(k)) + k + id).
    assert_eq!(
        rendezvous::weight(&key, &ClientId::new("broker-a.dynamo")),
        0x885d_76dc_989d_e46f
    );
    assert_eq!(
        rendezvous::weight(&key, &ClientId::new("broker-b.dynamo")),
        0x099e_0ec5_1544_8016
    );
    let a = ClientId::new("broker-a.dynamo");
    let b = ClientId::new("broker-b.dynamo");
    assert_eq!(rendezvous::rank(&key, &[&b, &a]), vec![1, 0]);
    // pick skips ineligible sessions and falls to the next rank.
    let sessions = [(a.clone(), true), (b.clone(), true)];
    assert_eq!(
        rendezvous::pick(&key, &sessions, |s| &s.0, |s| s.1),
        Some(0)
    );
    let sessions = [(a, false), (b, true)];
    assert_eq!(
        rendezvous::pick(&key, &sessions, |s| &s.0, |s| s.1),
        Some(1)
    );
    assert_eq!(
        rendezvous::pick(&key, &sessions[..1], |s| &s.0, |s| s.1),
        None
    );
}

struct ZmqTcpTargetAndTopic(ZmqTcpTarget, EventTopic);

fn vector_target() -> ZmqTcpTargetAndTopic {
    ZmqTcpTargetAndTopic(
        ZmqTcpTarget {
            namespace: ns("dynamo"),
            host: "10.0.0.5".into(),
            port: 5557,
        },
        EventTopic::KvMetrics,
    )
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn rendezvous_spreads_keys_evenly() {
    let ids: Vec<ClientId> = (0..4)
        .map(|i| ClientId::new(format!("broker-{i}")))
        .collect();
    let refs: Vec<&ClientId> = ids.iter().collect();
    let mut counts = [0usize; 4];
    for port in 1..=4000u16 {
        let key = rendezvous::zmq_key(
            &ZmqTcpTarget {
                namespace: ns("dynamo"),
                host: "10.0.0.5".into(),
                port,
            },
            EventTopic::KvEvents,
        );
        counts[rendezvous::rank(&key, &refs)[0]] += 1;
    }
    // Expected 1000 each; binomial sd ~27, so 850..1150 fails only if the hash is biased.
    for count in counts {
        assert!((850..=1150).contains(&count), "{counts:?}");
    }
}

// ---------- bounds ----------

#[test]
fn byte_bounds_follow_the_reference() {
    let defaults = SessionBounds::new(64 * 1024 * 1024, 1024).unwrap();
    assert_eq!(defaults.stream_buffer_bytes, 16 * 1024);
    assert_eq!(defaults.stream_window(), 16 * 1024);
    assert_eq!(defaults.connection_window(), 64 * 1024 * 1024);
    assert_eq!(defaults.worst_case_bytes(), 64 * 1024 * 1024);
    let one = SessionBounds::new(64 * 1024 * 1024, 1).unwrap();
    assert_eq!(one.stream_buffer_bytes, 1024 * 1024);
    assert!(one.worst_case_bytes() <= one.max_session_buffer_bytes);
    // The floor: max_streams_per_session * 64 KiB.
    assert!(SessionBounds::new(1024 * 64 * 1024, 1024).is_ok());
    assert_eq!(
        SessionBounds::new(1024 * 64 * 1024 - 1, 1024),
        Err(bounds::BoundsError::BelowFloor {
            given: 1024 * 64 * 1024 - 1,
            floor: 1024 * 64 * 1024
        })
    );
    assert_eq!(
        SessionBounds::new(1 << 20, 0),
        Err(bounds::BoundsError::Streams)
    );
    assert_eq!(
        SessionBounds::new(u64::MAX, 65_537),
        Err(bounds::BoundsError::Streams)
    );
    assert_eq!(
        SessionBounds::new(1 << 31, 1),
        Err(bounds::BoundsError::AboveWindow { given: 1 << 31 })
    );
    assert_eq!(bounds::max_connections(64), 256);
    assert_eq!(bounds::max_connections(2), 16);
    // The pipe: payload plus overhead, an empty pipe always takes one frame.
    assert!(defaults.pipe_admits(0, 16 * 1024));
    assert!(!defaults.pipe_admits(1, 16 * 1024));
    assert!(defaults.pipe_admits(1000, 1000));
}

proptest! {
    #[test]
    fn accepted_bounds_never_exceed_the_session_budget(
        streams in 1u32..=65_536,
        budget in 0u64..=(1u64 << 31),
    ) {
        match SessionBounds::new(budget, streams) {
            Ok(b) => {
                prop_assert!((16 * 1024..=1024 * 1024).contains(&b.stream_buffer_bytes));
                prop_assert!(b.worst_case_bytes() <= b.max_session_buffer_bytes);
                prop_assert!(u64::from(b.connection_window()) == budget);
            }
            Err(_) => prop_assert!(
                budget < u64::from(streams) * 64 * 1024 || budget > bounds::MAX_HTTP2_WINDOW
            ),
        }
    }
}

// ---------- credentials ----------

const TOKEN: &[u8] = b"secret-token";
const TOKEN_HASH: &str = "sha256:930bbdc51b6aed5c2a5678fd6e28dee7a05e8a4b643cfc0b4427c3efb86c0d94";

fn credentials() -> Vec<Credential> {
    vec![
        Credential {
            id: ClientId::new("broker-a.dynamo"),
            token_hash: Some(TokenHash::parse(TOKEN_HASH).unwrap()),
        },
        Credential {
            id: ClientId::new("broker-b.dynamo"),
            token_hash: None,
        },
    ]
}

#[test]
fn token_hashes_parse_strictly() {
    assert_eq!(
        TokenHash::parse(TOKEN_HASH),
        Some(TokenHash::of_token(TOKEN))
    );
    for bad in [
        &TOKEN_HASH[..70],
        &TOKEN_HASH[7..],
        "sha256:930BBDC51B6AED5C2A5678FD6E28DEE7A05E8A4B643CFC0B4427C3EFB86C0D94",
        "sha512:930bbdc51b6aed5c2a5678fd6e28dee7a05e8a4b643cfc0b4427c3efb86c0d94",
    ] {
        assert_eq!(TokenHash::parse(bad), None, "{bad}");
    }
    assert_eq!(
        format!("{:?}", TokenHash::of_token(TOKEN)),
        "TokenHash(<redacted>)"
    );
    assert_eq!(bearer_token(b"Bearer abc"), Some(&b"abc"[..]));
    assert_eq!(bearer_token(b"bearer abc"), Some(&b"abc"[..]));
    for bad in [
        &b"Bearer "[..],
        b"Basic abc",
        b"Bearer a b",
        b"Bearerabc",
        b"",
    ] {
        assert_eq!(bearer_token(bad), None);
    }
}

#[test]
fn authentication_follows_the_token_vs_certificate_rule() {
    let creds = credentials();
    let revoked = RevokedCredentials::default();
    let sans = |names: &[&str]| names.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    let auth = |token: Option<&[u8]>, cert: &[String]| {
        authenticate(
            &creds,
            &revoked,
            Presented {
                token,
                cert_dns_sans: cert,
            },
        )
        .map(|id| id.as_str().to_owned())
    };
    assert_eq!(auth(Some(TOKEN), &[]), Ok("broker-a.dynamo".into()));
    assert_eq!(auth(Some(b"wrong"), &[]), Err(ErrorCode::Unauthenticated));
    assert_eq!(auth(None, &[]), Err(ErrorCode::Unauthenticated));
    assert_eq!(
        auth(None, &sans(&["broker-b.dynamo"])),
        Ok("broker-b.dynamo".into())
    );
    assert_eq!(
        auth(None, &sans(&["*.dynamo"])),
        Err(ErrorCode::Unauthenticated)
    );
    assert_eq!(
        auth(None, &sans(&["BROKER-B.dynamo"])),
        Err(ErrorCode::Unauthenticated)
    );
    assert_eq!(
        auth(None, &sans(&["broker-a.dynamo", "broker-b.dynamo"])),
        Err(ErrorCode::Forbidden)
    );
    // The token decides; a certificate naming another entry is forbidden.
    assert_eq!(
        auth(Some(TOKEN), &sans(&["broker-a.dynamo"])),
        Ok("broker-a.dynamo".into())
    );
    assert_eq!(
        auth(Some(TOKEN), &sans(&["unrelated.example"])),
        Ok("broker-a.dynamo".into())
    );
    assert_eq!(
        auth(Some(TOKEN), &sans(&["broker-b.dynamo"])),
        Err(ErrorCode::Forbidden)
    );
    assert_eq!(
        auth(Some(b"wrong"), &sans(&["broker-b.dynamo"])),
        Err(ErrorCode::Unauthenticated)
    );
}

#[test]
fn removed_credentials_are_revoked_in_a_bounded_ring() {
    let old = credentials();
    let new = vec![old[1].clone()];
    let mut revoked = RevokedCredentials::default();
    revoked.apply_reload(&old, &new);
    let auth = |revoked: &RevokedCredentials, token: Option<&[u8]>, cert: &[String]| {
        authenticate(
            &new,
            revoked,
            Presented {
                token,
                cert_dns_sans: cert,
            },
        )
        .map(|id| id.as_str().to_owned())
    };
    assert_eq!(
        auth(&revoked, Some(TOKEN), &[]),
        Err(ErrorCode::CredentialRevoked)
    );
    assert_eq!(
        auth(&revoked, None, &["broker-a.dynamo".to_owned()]),
        Err(ErrorCode::CredentialRevoked)
    );
    // Configured again: no longer revoked.
    revoked.apply_reload(&new, &old);
    assert_eq!(
        authenticate(
            &old,
            &revoked,
            Presented {
                token: Some(TOKEN),
                cert_dns_sans: &[]
            }
        )
        .map(|id| id.as_str().to_owned()),
        Ok("broker-a.dynamo".to_owned())
    );
    // A rotated token revokes the old token while the entry stays.
    let rotated = vec![Credential {
        id: ClientId::new("broker-a.dynamo"),
        token_hash: Some(TokenHash::of_token(b"new-token")),
    }];
    let mut revoked = RevokedCredentials::default();
    revoked.apply_reload(&old[..1], &rotated);
    assert_eq!(
        authenticate(
            &rotated,
            &revoked,
            Presented {
                token: Some(TOKEN),
                cert_dns_sans: &[]
            }
        ),
        Err(ErrorCode::CredentialRevoked)
    );
    // The ring holds at most 256.
    let mut revoked = RevokedCredentials::default();
    for i in 0..300 {
        revoked.revoke(Credential {
            id: ClientId::new(format!("b{i}")),
            token_hash: None,
        });
    }
    assert_eq!(revoked.len(), REVOKED_RING);
    let cert = |name: &str| vec![name.to_owned()];
    let none: Vec<Credential> = Vec::new();
    let check = |name: &str| {
        authenticate(
            &none,
            &revoked,
            Presented {
                token: None,
                cert_dns_sans: &cert(name),
            },
        )
    };
    assert_eq!(check("b0"), Err(ErrorCode::Unauthenticated));
    assert_eq!(check("b299"), Err(ErrorCode::CredentialRevoked));
}

// ---------- server session ----------

#[test]
fn server_welcomes_a_valid_hello() {
    let mut s = server(broker_grant(), 4);
    assert_eq!(s.poll_timeout(), Some(t(0).plus(HELLO_TIMEOUT)));
    // Split the hello across chunks.
    let hello = Message::Hello(broker_hello()).encode();
    s.handle_input(&hello[..5], t(1));
    assert!(!s.is_live());
    assert_eq!(s.poll_transmit(), None);
    s.handle_input(&hello[5..], t(2));
    let accepted = match events(&mut s).as_slice() {
        [ServerEvent::HelloAccepted(accepted)] => accepted.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(accepted.client_id.as_str(), "broker-a.dynamo");
    // Nothing is sent until admission decides.
    assert_eq!(s.poll_transmit(), None);
    assert!(!s.is_live());
    assert!(s.welcome(t(2)));
    assert!(!s.welcome(t(2)));
    let sent = lines(&s.poll_transmit().unwrap());
    let [Message::Welcome(w)] = sent.as_slice() else {
        panic!("{sent:?}")
    };
    assert_eq!(w.session_id, SessionId::from_random(0xabc));
    assert_eq!(w.version, 1);
    assert_eq!(w.max_streams, 4);
    assert_eq!(w.stream_buffer_bytes, 1024 * 1024);
    assert_eq!(w.heartbeat_interval_ms, 10_000);
    assert_eq!(w.idle_timeout_ms, 30_000);
}

#[test]
fn server_refuses_before_the_welcome() {
    let refused = |input: &[u8], grant: Grant| {
        let mut s = server(grant, 4);
        s.handle_input(input, t(1));
        assert_eq!(
            s.poll_transmit(),
            None,
            "nothing is sent before the welcome"
        );
        match events(&mut s).as_slice() {
            [ServerEvent::Refused(r)] => r.code,
            other => panic!("{other:?}"),
        }
    };
    let hello = Message::Hello(broker_hello()).encode();
    assert_eq!(refused(&hello, listener_grant()), ErrorCode::Forbidden);
    assert_eq!(
        refused(b"{\"type\":\"heartbeat\",\"seq\":1}\n", broker_grant()),
        ErrorCode::InvalidHello
    );
    assert_eq!(
        refused(b"garbage\n", broker_grant()),
        ErrorCode::InvalidHello
    );
    assert_eq!(
        refused(&vec![b'x'; MAX_LINE_BYTES], broker_grant()),
        ErrorCode::InvalidHello
    );

    let mut s = server(broker_grant(), 4);
    s.handle_timeout(t(9_999));
    assert!(events(&mut s).is_empty());
    s.handle_timeout(t(10_000));
    assert!(
        matches!(events(&mut s).as_slice(), [ServerEvent::Refused(r)] if r.code == ErrorCode::HelloTimeout)
    );
    assert_eq!(s.poll_timeout(), None);

    let mut s = server(broker_grant(), 4);
    s.handle_end_of_input();
    assert!(
        matches!(events(&mut s).as_slice(), [ServerEvent::Refused(r)] if r.code == ErrorCode::InvalidHello)
    );

    // A superseding session before the hello is a refusal with that code.
    let mut s = server(broker_grant(), 4);
    s.close(ErrorCode::TooManySessions, None);
    assert!(
        matches!(events(&mut s).as_slice(), [ServerEvent::Refused(r)] if r.code == ErrorCode::TooManySessions)
    );
}

#[test]
fn server_admits_only_commanded_streams_once() {
    let mut s = live_server(2);
    let me = ClientId::new("broker-a.dynamo");
    // Nothing commanded yet.
    assert_eq!(
        s.accept_stream(StreamId(1), &me, 1).unwrap_err().code,
        ErrorCode::UnknownStream
    );
    let a = s.subscribe(zmq("dynamo", 1), t(5)).unwrap();
    assert_eq!(a, StreamId(1));
    let sent = lines(&s.poll_transmit().unwrap());
    assert_eq!(
        sent,
        vec![Message::Subscribe(Subscribe {
            stream_id: a,
            target: zmq("dynamo", 1)
        })]
    );
    // Not covered, wrong role.
    assert_eq!(
        s.subscribe(zmq("other", 1), t(5)),
        Err(SubscribeError::NotCovered)
    );
    assert_eq!(
        s.subscribe(announced("vllm-1", None), t(5)),
        Err(SubscribeError::NotCovered)
    );
    let b = s.subscribe(zmq("dynamo", 2), t(5)).unwrap();
    s.poll_transmit();
    assert_eq!(
        s.subscribe(zmq("dynamo", 3), t(5)),
        Err(SubscribeError::TooManyStreams)
    );
    assert!(!s.can_place(&zmq("dynamo", 3)));

    let other = ClientId::new("broker-b.dynamo");
    assert_eq!(
        s.accept_stream(a, &other, 1).unwrap_err().code,
        ErrorCode::Forbidden
    );
    assert_eq!(
        s.accept_stream(a, &me, 2).unwrap_err().code,
        ErrorCode::UnsupportedProtocolVersion
    );
    s.accept_stream(a, &me, 1).unwrap();
    assert_eq!(events(&mut s), vec![ServerEvent::StreamOpened(a)]);
    assert_eq!(
        s.accept_stream(a, &me, 1).unwrap_err().code,
        ErrorCode::DuplicateStream
    );
    assert_eq!(
        s.accept_stream(StreamId(99), &me, 1).unwrap_err().code,
        ErrorCode::UnknownStream
    );

    // Unsubscribed before opening: the id is gone.
    assert!(s.unsubscribe(b));
    assert_eq!(
        lines(&s.poll_transmit().unwrap()),
        vec![Message::Unsubscribe { stream_id: b }]
    );
    assert_eq!(
        s.accept_stream(b, &me, 1).unwrap_err().code,
        ErrorCode::UnknownStream
    );
    assert!(!s.unsubscribe(b));

    // The stream ended: the slot is free, the id is never reused.
    assert!(s.stream_ended(a));
    assert!(!s.stream_ended(a));
    assert_eq!(s.stream_count(), 0);
    assert_eq!(s.subscribe(zmq("dynamo", 3), t(6)), Ok(StreamId(3)));
}

#[test]
fn server_unsubscribes_streams_not_opened_in_time() {
    let mut s = live_server(4);
    let a = s.subscribe(zmq("dynamo", 1), t(1_000)).unwrap();
    s.poll_transmit();
    let deadline = t(1_000).plus(STREAM_OPEN_TIMEOUT);
    // Keep the session from going idle meanwhile.
    for ms in (10_000..deadline.0.as_millis() as u64).step_by(10_000) {
        s.handle_input(&Message::HeartbeatAck { seq: 1 }.encode(), t(ms));
        s.handle_timeout(t(ms));
    }
    assert!(events(&mut s).is_empty());
    s.handle_input(&Message::HeartbeatAck { seq: 1 }.encode(), deadline);
    s.handle_timeout(deadline);
    assert_eq!(events(&mut s), vec![ServerEvent::StreamOpenTimedOut(a)]);
    assert!(lines(&s.poll_transmit().unwrap()).contains(&Message::Unsubscribe { stream_id: a }));
    let me = ClientId::new("broker-a.dynamo");
    assert_eq!(
        s.accept_stream(a, &me, 1).unwrap_err().code,
        ErrorCode::UnknownStream
    );
}

#[test]
fn server_heartbeats_and_idles_out() {
    let mut s = live_server(4);
    // Welcomed at t=1: first heartbeat at 10.001 s, idle deadline at 30.001 s.
    assert_eq!(s.poll_timeout(), Some(t(10_001)));
    s.handle_timeout(t(10_001));
    assert_eq!(
        lines(&s.poll_transmit().unwrap()),
        vec![Message::Heartbeat { seq: 1 }]
    );
    // The client's heartbeat is acked and refreshes the idle deadline.
    s.handle_input(&Message::Heartbeat { seq: 9 }.encode(), t(15_000));
    assert_eq!(
        lines(&s.poll_transmit().unwrap()),
        vec![Message::HeartbeatAck { seq: 9 }]
    );
    s.handle_timeout(t(44_999));
    assert!(s.is_live());
    s.handle_timeout(t(45_000));
    assert!(s.is_closed());
    let sent = lines(&s.poll_transmit().unwrap());
    assert_eq!(
        sent.last(),
        Some(&Message::Closed(Closed {
            code: ErrorCode::IdleTimeout,
            message: None
        }))
    );
    assert_eq!(
        events(&mut s).last(),
        Some(&ServerEvent::Closed(ErrorCode::IdleTimeout))
    );
}

#[test]
fn server_handles_stream_closed_draining_and_errors() {
    let mut s = live_server(4);
    let a = s.subscribe(zmq("dynamo", 1), t(2)).unwrap();
    let closed = Message::StreamClosed(StreamClosed {
        stream_id: a,
        reason: StreamCloseReason::TargetNotAdvertised,
        message: None,
    });
    s.handle_input(&closed.encode(), t(3));
    assert_eq!(
        events(&mut s),
        vec![ServerEvent::StreamClosed {
            stream_id: a,
            reason: StreamCloseReason::TargetNotAdvertised
        }]
    );
    // A late duplicate is no news.
    s.handle_input(&closed.encode(), t(3));
    assert!(events(&mut s).is_empty());

    // A broker's draining stops placement but keeps its streams.
    let b = s.subscribe(zmq("dynamo", 2), t(4)).unwrap();
    s.poll_transmit();
    s.handle_input(&Message::Draining.encode(), t(5));
    assert_eq!(events(&mut s), vec![ServerEvent::Draining]);
    assert_eq!(
        s.subscribe(zmq("dynamo", 3), t(5)),
        Err(SubscribeError::Draining)
    );
    assert_eq!(s.stream_count(), 1);
    assert_eq!(s.poll_transmit(), None);
    let _ = b;

    // A client sending router messages is a protocol error, closed with a line.
    s.handle_input(
        &Message::Subscribe(Subscribe {
            stream_id: StreamId(7),
            target: zmq("dynamo", 1),
        })
        .encode(),
        t(6),
    );
    assert!(s.is_closed());
    let sent = lines(&s.poll_transmit().unwrap());
    assert!(matches!(
        sent.as_slice(),
        [Message::Closed(Closed {
            code: ErrorCode::ProtocolError,
            ..
        })]
    ));
    assert_eq!(
        events(&mut s),
        vec![ServerEvent::Closed(ErrorCode::ProtocolError)]
    );
    // Closed is final.
    s.handle_input(&Message::Heartbeat { seq: 1 }.encode(), t(7));
    s.handle_timeout(t(1_000_000));
    assert_eq!(s.poll_transmit(), None);
    assert!(events(&mut s).is_empty());
}

#[test]
fn listener_draining_unsubscribes_every_stream() {
    let mut s = server(listener_grant(), 4);
    s.handle_input(&Message::Hello(listener_hello()).encode(), t(1));
    s.welcome(t(1));
    s.poll_transmit();
    events(&mut s);
    assert_eq!(
        s.subscribe(announced("vllm-2", None), t(2)),
        Err(SubscribeError::NotCovered)
    );
    let a = s.subscribe(announced("vllm-1", Some(41)), t(2)).unwrap();
    s.accept_stream(a, &ClientId::new("kv-listener-a"), 1)
        .unwrap();
    let b = s.subscribe(announced("vllm-1", None), t(2)).unwrap();
    s.poll_transmit();
    events(&mut s);
    s.handle_input(&Message::Draining.encode(), t(3));
    assert_eq!(
        events(&mut s),
        vec![
            ServerEvent::Draining,
            ServerEvent::StreamClosed {
                stream_id: a,
                reason: StreamCloseReason::Draining
            },
            ServerEvent::StreamClosed {
                stream_id: b,
                reason: StreamCloseReason::Draining
            },
        ]
    );
    assert_eq!(
        lines(&s.poll_transmit().unwrap()),
        vec![
            Message::Unsubscribe { stream_id: a },
            Message::Unsubscribe { stream_id: b }
        ]
    );
    assert_eq!(s.stream_count(), 0);
}

#[test]
fn server_close_sends_a_closed_line_once() {
    let mut s = live_server(4);
    s.close(
        ErrorCode::SessionSuperseded,
        Some("a newer session of broker-a.dynamo".into()),
    );
    s.close(ErrorCode::Shutdown, None);
    assert_eq!(
        lines(&s.poll_transmit().unwrap()),
        vec![Message::Closed(Closed {
            code: ErrorCode::SessionSuperseded,
            message: Some("a newer session of broker-a.dynamo".into()),
        })]
    );
    assert_eq!(
        events(&mut s),
        vec![ServerEvent::Closed(ErrorCode::SessionSuperseded)]
    );
    let mut s = live_server(4);
    s.handle_end_of_input();
    assert_eq!(
        events(&mut s),
        vec![ServerEvent::Closed(ErrorCode::PeerClosed)]
    );
    assert_eq!(s.poll_transmit(), None);
}

#[test]
fn server_refusal_after_validation_and_regrant() {
    // Admission said no: still a refusal, nothing transmitted.
    let mut s = server(broker_grant(), 4);
    s.handle_input(&Message::Hello(broker_hello()).encode(), t(1));
    assert!(matches!(
        events(&mut s).as_slice(),
        [ServerEvent::HelloAccepted(_)]
    ));
    s.close(
        ErrorCode::TooManySessions,
        Some("64 sessions are live".into()),
    );
    assert!(matches!(
        events(&mut s).as_slice(),
        [ServerEvent::Refused(r)] if r.code == ErrorCode::TooManySessions
    ));
    assert_eq!(s.poll_transmit(), None);
    assert!(!s.welcome(t(2)));

    // Reload keeps a session whose declared namespaces stay granted, closes one that lost them.
    let mut s = live_server(4);
    let mut wider = broker_grant();
    wider.namespaces.insert(ns("third"));
    assert!(s.regrant(wider));
    let mut any = broker_grant();
    any.namespaces.clear();
    assert!(s.regrant(any));
    let mut narrower = broker_grant();
    narrower.namespaces.remove(&ns("dynamo"));
    assert!(!s.regrant(narrower));
    assert_eq!(
        events(&mut s),
        vec![ServerEvent::Closed(ErrorCode::Forbidden)]
    );

    // A kv_listener whose role changed is closed too.
    let mut s = server(listener_grant(), 4);
    s.handle_input(&Message::Hello(listener_hello()).encode(), t(1));
    s.welcome(t(1));
    events(&mut s);
    let mut narrower = listener_grant();
    narrower.backends.remove("vllm-2");
    assert!(s.regrant(narrower.clone()));
    narrower.role = Role::Broker;
    assert!(!s.regrant(narrower));
}

#[test]
fn admission_limits_handshakes_sessions_and_supersedes() {
    let a = ClientId::new("broker-a.dynamo");
    let b = ClientId::new("broker-b.dynamo");
    let c = ClientId::new("broker-c.dynamo");
    let mut admission = Admission::new(2);
    admission.begin_handshake(&a).unwrap();
    assert_eq!(
        admission.begin_handshake(&a).unwrap_err().code,
        ErrorCode::TooManySessions
    );
    admission.begin_handshake(&b).unwrap();
    assert_eq!(admission.admit(&a, SessionId::from_random(1)), Ok(None));
    // The slot is free again once admitted.
    admission.begin_handshake(&a).unwrap();
    assert_eq!(admission.admit(&b, SessionId::from_random(2)), Ok(None));
    // A third entry finds max_sessions live sessions.
    admission.begin_handshake(&c).unwrap();
    assert_eq!(
        admission
            .admit(&c, SessionId::from_random(3))
            .unwrap_err()
            .code,
        ErrorCode::TooManySessions
    );
    admission.begin_handshake(&c).unwrap();
    admission.abandon_handshake(&c);
    // The same entry supersedes its own session even at the cap.
    assert_eq!(
        admission.admit(&a, SessionId::from_random(4)),
        Ok(Some(SessionId::from_random(1)))
    );
    assert_eq!(admission.live_count(), 2);
    // The superseded session's end does not remove its successor.
    admission.ended(&a, SessionId::from_random(1));
    assert_eq!(admission.live_session(&a), Some(SessionId::from_random(4)));
    admission.ended(&a, SessionId::from_random(4));
    assert_eq!(admission.live_count(), 1);
    admission.set_max_sessions(1);
    assert!(admission.admit(&c, SessionId::from_random(5)).is_err());
}

// ---------- connection rules ----------

#[test]
fn first_byte_decides_tls_or_refusal() {
    assert_eq!(classify_first_byte(0x16), FirstByte::Tls);
    for letter in [b'G', b'P', b'g', b'z'] {
        assert_eq!(classify_first_byte(letter), FirstByte::PlaintextLetter);
    }
    for other in [0x00, 0x15, 0x17, b'0', b' ', 0x80, 0xff] {
        assert_eq!(classify_first_byte(other), FirstByte::Other);
    }
    let response = plaintext_refusal();
    let text = String::from_utf8(response).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 403 Forbidden\r\n"), "{head}");
    assert!(
        head.contains(&format!("content-length: {}", body.len())),
        "{head}"
    );
    assert!(head.contains("connection: close"), "{head}");
    assert_eq!(
        ErrorBody::decode(body.as_bytes()).unwrap().error.code,
        ErrorCode::TlsRequired
    );
}

#[test]
fn connection_deadlines_follow_accepted_requests() {
    let mut timers = ConnectionTimers::new(t(1_000));
    // Only an accepted request clears auth_timeout (PINGs do not reach this type at all).
    assert_eq!(
        timers.deadline(),
        Some((t(1_000).plus(AUTH_TIMEOUT), ErrorCode::AuthTimeout))
    );
    assert_eq!(timers.expired(t(10_999)), None);
    assert_eq!(timers.expired(t(11_000)), Some(ErrorCode::AuthTimeout));
    // A refused request does not count; an accepted one does.
    timers.request_accepted();
    timers.request_accepted();
    assert_eq!(timers.deadline(), None);
    timers.request_ended(t(20_000));
    assert_eq!(timers.deadline(), None, "one request still runs");
    timers.request_ended(t(25_000));
    assert_eq!(
        timers.deadline(),
        Some((t(25_000).plus(CONNECTION_LINGER), ErrorCode::IdleTimeout))
    );
    // A new request cancels the linger.
    timers.request_accepted();
    assert_eq!(timers.expired(t(1_000_000)), None);
    timers.request_ended(t(60_000));
    assert_eq!(timers.expired(t(89_999)), None);
    assert_eq!(timers.expired(t(90_000)), Some(ErrorCode::IdleTimeout));
}

// ---------- client session ----------

#[test]
fn client_sends_hello_and_goes_live_on_welcome() {
    let mut c = ClientSession::new(broker_hello(), t(0)).unwrap();
    assert_eq!(
        lines(&c.poll_transmit().unwrap()),
        vec![Message::Hello(broker_hello())]
    );
    assert_eq!(c.poll_timeout(), Some(t(0).plus(WELCOME_TIMEOUT)));
    c.handle_input(&Message::Welcome(welcome()).encode(), t(5));
    assert_eq!(
        client_events(&mut c),
        vec![ClientEvent::Welcomed(welcome())]
    );
    assert_eq!(c.poll_timeout(), Some(t(10_005)));
    c.handle_timeout(t(10_005));
    assert_eq!(
        lines(&c.poll_transmit().unwrap()),
        vec![Message::Heartbeat { seq: 1 }]
    );
    c.handle_input(&Message::Heartbeat { seq: 4 }.encode(), t(10_006));
    assert_eq!(
        lines(&c.poll_transmit().unwrap()),
        vec![Message::HeartbeatAck { seq: 4 }]
    );
    c.handle_timeout(t(40_006));
    assert!(c.is_closed());
    assert_eq!(
        client_events(&mut c),
        vec![ClientEvent::Closed {
            code: ErrorCode::IdleTimeout,
            message: None
        }]
    );

    let mut bad = Hello {
        versions: vec![],
        ..broker_hello()
    };
    assert!(ClientSession::new(bad.clone(), t(0)).is_err());
    bad.versions = vec![1];
    assert!(ClientSession::new(bad, t(0)).is_ok());
}

#[test]
fn client_rejects_bad_welcomes_and_refusals() {
    let closed_code = |welcome: Welcome| {
        let mut c = ClientSession::new(broker_hello(), t(0)).unwrap();
        c.handle_input(&Message::Welcome(welcome).encode(), t(1));
        match client_events(&mut c).as_slice() {
            [ClientEvent::Closed { code, .. }] => *code,
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(
        closed_code(Welcome {
            version: 2,
            ..welcome()
        }),
        ErrorCode::ProtocolError
    );
    assert_eq!(
        closed_code(Welcome {
            idle_timeout_ms: 10_000,
            ..welcome()
        }),
        ErrorCode::ProtocolError
    );
    assert_eq!(
        closed_code(Welcome {
            max_streams: 0,
            ..welcome()
        }),
        ErrorCode::ProtocolError
    );
    assert_eq!(
        closed_code(Welcome {
            stream_buffer_bytes: 1,
            ..welcome()
        }),
        ErrorCode::ProtocolError
    );

    let mut c = ClientSession::new(broker_hello(), t(0)).unwrap();
    c.refused(
        429,
        &ErrorBody::new(ErrorCode::TooManySessions, "full").encode(),
    );
    assert_eq!(
        client_events(&mut c),
        vec![ClientEvent::Closed {
            code: ErrorCode::TooManySessions,
            message: Some("full".into())
        }]
    );
    let mut c = ClientSession::new(broker_hello(), t(0)).unwrap();
    c.refused(502, b"<html>bad gateway</html>");
    assert!(matches!(
        client_events(&mut c).as_slice(),
        [ClientEvent::Closed {
            code: ErrorCode::Unknown,
            ..
        }]
    ));
    let mut c = ClientSession::new(broker_hello(), t(0)).unwrap();
    c.handle_timeout(t(10_000));
    assert!(matches!(
        client_events(&mut c).as_slice(),
        [ClientEvent::Closed {
            code: ErrorCode::HelloTimeout,
            ..
        }]
    ));
}

#[test]
fn client_opens_only_fitting_commanded_streams() {
    let mut c = live_client(broker_hello());
    let subscribe = |id: u64, target: StreamTarget| {
        Message::Subscribe(Subscribe {
            stream_id: StreamId(id),
            target,
        })
        .encode()
    };
    c.handle_input(&subscribe(1, zmq("dynamo", 1)), t(2));
    assert_eq!(
        client_events(&mut c),
        vec![ClientEvent::OpenStream {
            stream_id: StreamId(1),
            target: zmq("dynamo", 1)
        }]
    );
    // Namespace not declared, wrong kind: refused with stream_closed, nothing opened.
    c.handle_input(&subscribe(2, zmq("other", 1)), t(2));
    c.handle_input(&subscribe(3, announced("vllm-1", None)), t(2));
    assert!(client_events(&mut c).is_empty());
    let sent = lines(&c.poll_transmit().unwrap());
    assert_eq!(
        sent,
        vec![
            Message::StreamClosed(StreamClosed {
                stream_id: StreamId(2),
                reason: StreamCloseReason::InvalidTarget,
                message: None
            }),
            Message::StreamClosed(StreamClosed {
                stream_id: StreamId(3),
                reason: StreamCloseReason::InvalidTarget,
                message: None
            }),
        ]
    );
    // The stream cap of the welcome (4).
    for id in 4..=6 {
        c.handle_input(&subscribe(id, zmq("dynamo", 1)), t(2));
    }
    c.handle_input(&subscribe(7, zmq("dynamo", 1)), t(2));
    assert_eq!(client_events(&mut c).len(), 3);
    assert!(matches!(
        lines(&c.poll_transmit().unwrap()).as_slice(),
        [Message::StreamClosed(StreamClosed {
            reason: StreamCloseReason::StreamLimit,
            ..
        })]
    ));
    // Unsubscribe closes; the relay's own end is reported.
    c.handle_input(
        &Message::Unsubscribe {
            stream_id: StreamId(1),
        }
        .encode(),
        t(3),
    );
    assert_eq!(
        client_events(&mut c),
        vec![ClientEvent::CloseStream(StreamId(1))]
    );
    assert!(c.stream_closed(StreamId(4), StreamCloseReason::PublisherClosed, None));
    assert!(!c.stream_closed(StreamId(4), StreamCloseReason::PublisherClosed, None));
    assert_eq!(
        c.open_streams().collect::<Vec<_>>(),
        vec![StreamId(5), StreamId(6)]
    );
    c.poll_transmit();
    // Draining: announced, later subscribes refused.
    c.drain();
    assert_eq!(lines(&c.poll_transmit().unwrap()), vec![Message::Draining]);
    c.handle_input(&subscribe(8, zmq("dynamo", 1)), t(4));
    assert!(matches!(
        lines(&c.poll_transmit().unwrap()).as_slice(),
        [Message::StreamClosed(StreamClosed {
            reason: StreamCloseReason::Draining,
            ..
        })]
    ));
    // A reused stream id is a protocol error.
    c.handle_input(&subscribe(5, zmq("dynamo", 1)), t(5));
    assert!(matches!(
        client_events(&mut c).as_slice(),
        [ClientEvent::Closed {
            code: ErrorCode::ProtocolError,
            ..
        }]
    ));
    assert_eq!(c.open_streams().count(), 0);
}

#[test]
fn listener_client_checks_announced_sources() {
    let mut c = live_client(listener_hello());
    let subscribe = |id: u64, target: StreamTarget| {
        Message::Subscribe(Subscribe {
            stream_id: StreamId(id),
            target,
        })
        .encode()
    };
    c.handle_input(&subscribe(1, announced("vllm-1", Some(7))), t(2));
    c.handle_input(&subscribe(2, announced("vllm-2", None)), t(2));
    c.handle_input(&subscribe(3, zmq("dynamo", 1)), t(2));
    assert_eq!(
        client_events(&mut c),
        vec![ClientEvent::OpenStream {
            stream_id: StreamId(1),
            target: announced("vllm-1", Some(7))
        }]
    );
    let reasons: Vec<StreamCloseReason> = lines(&c.poll_transmit().unwrap())
        .into_iter()
        .filter_map(|m| match m {
            Message::StreamClosed(c) => Some(c.reason),
            _ => None,
        })
        .collect();
    assert_eq!(
        reasons,
        vec![
            StreamCloseReason::TargetNotAdvertised,
            StreamCloseReason::InvalidTarget
        ]
    );
    c.handle_input(
        &Message::Closed(Closed {
            code: ErrorCode::Forbidden,
            message: None,
        })
        .encode(),
        t(3),
    );
    assert_eq!(
        client_events(&mut c),
        vec![ClientEvent::Closed {
            code: ErrorCode::Forbidden,
            message: None
        }]
    );
}

/// Both ends wired back to back: hello, welcome, subscribe, open, stream_closed, draining.
#[test]
fn both_ends_talk_to_each_other() {
    let mut s = server(broker_grant(), 8);
    let mut c = ClientSession::new(broker_hello(), t(0)).unwrap();
    let pump = |s: &mut ServerSession, c: &mut ClientSession, now: Tick| {
        for _ in 0..4 {
            if let Some(bytes) = c.poll_transmit() {
                s.handle_input(&bytes, now);
            }
            if let Some(bytes) = s.poll_transmit() {
                c.handle_input(&bytes, now);
            }
        }
    };
    pump(&mut s, &mut c, t(1));
    assert!(matches!(
        events(&mut s).as_slice(),
        [ServerEvent::HelloAccepted(_)]
    ));
    assert!(s.welcome(t(1)));
    pump(&mut s, &mut c, t(1));
    assert!(s.is_live() && c.is_live());
    let welcome = match client_events(&mut c).as_slice() {
        [ClientEvent::Welcomed(w)] => w.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(welcome.session_id, s.session_id());

    let id = s.subscribe(zmq("dynamo", 5557), t(2)).unwrap();
    pump(&mut s, &mut c, t(2));
    let opened = client_events(&mut c);
    assert_eq!(
        opened,
        vec![ClientEvent::OpenStream {
            stream_id: id,
            target: zmq("dynamo", 5557)
        }]
    );
    s.accept_stream(id, &ClientId::new("broker-a.dynamo"), welcome.version)
        .unwrap();
    c.stream_closed(id, StreamCloseReason::PublisherClosed, Some("EOF".into()));
    pump(&mut s, &mut c, t(3));
    assert_eq!(
        events(&mut s),
        vec![
            ServerEvent::StreamOpened(id),
            ServerEvent::StreamClosed {
                stream_id: id,
                reason: StreamCloseReason::PublisherClosed
            },
        ]
    );
    // Heartbeats both ways keep both alive past the idle timeout.
    for ms in (10_000..=100_000).step_by(5_000) {
        s.handle_timeout(t(ms));
        c.handle_timeout(t(ms));
        pump(&mut s, &mut c, t(ms));
    }
    assert!(s.is_live() && c.is_live());
    c.drain();
    pump(&mut s, &mut c, t(100_001));
    assert!(s.is_draining());
    s.close(ErrorCode::Shutdown, None);
    pump(&mut s, &mut c, t(100_002));
    assert!(matches!(
        client_events(&mut c).as_slice(),
        [ClientEvent::Closed {
            code: ErrorCode::Shutdown,
            ..
        }]
    ));
}

// ---------- property tests ----------

fn arb_target() -> impl Strategy<Value = StreamTarget> {
    // Mostly targets a welcomed session covers, so the live paths get exercised.
    prop_oneof![
        3 => (1u16..4).prop_map(|p| zmq("dynamo", p)),
        1 => (prop::sample::select(vec!["other", "x"]), 1u16..4).prop_map(|(n, p)| zmq(n, p)),
        3 => proptest::option::of(0u64..100).prop_map(|id| announced("vllm-1", id)),
        1 => proptest::option::of(0u64..100).prop_map(|id| announced("vllm-2", id)),
    ]
}

fn arb_code() -> impl Strategy<Value = ErrorCode> {
    prop::sample::select(vec![
        ErrorCode::SessionSuperseded,
        ErrorCode::Shutdown,
        ErrorCode::Forbidden,
        ErrorCode::IdleTimeout,
    ])
}

fn arb_stream_id() -> impl Strategy<Value = StreamId> {
    (0u64..8).prop_map(StreamId)
}

fn arb_stream_closed() -> impl Strategy<Value = Message> {
    (
        arb_stream_id(),
        prop::sample::select(vec![
            StreamCloseReason::PublisherClosed,
            StreamCloseReason::Draining,
        ]),
    )
        .prop_map(|(stream_id, reason)| {
            Message::StreamClosed(StreamClosed {
                stream_id,
                reason,
                message: None,
            })
        })
}

/// Every message kind, equally likely (round trips).
fn arb_message() -> impl Strategy<Value = Message> {
    prop_oneof![
        Just(Message::Hello(broker_hello())),
        Just(Message::Hello(listener_hello())),
        Just(Message::Welcome(welcome())),
        (arb_stream_id(), arb_target())
            .prop_map(|(stream_id, target)| Message::Subscribe(Subscribe { stream_id, target })),
        arb_stream_id().prop_map(|stream_id| Message::Unsubscribe { stream_id }),
        arb_stream_closed(),
        Just(Message::Draining),
        any::<u64>().prop_map(|seq| Message::Heartbeat { seq }),
        any::<u64>().prop_map(|seq| Message::HeartbeatAck { seq }),
        arb_code().prop_map(|code| Message::Closed(Closed {
            code,
            message: None
        })),
    ]
}

/// What a router might send: mostly legal traffic, now and then something that ends the
/// session (a closed line, a client-only message, garbage).
fn arb_router_line() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        12 => (arb_stream_id(), arb_target())
            .prop_map(|(stream_id, target)| Message::Subscribe(Subscribe { stream_id, target }).encode()),
        6 => arb_stream_id().prop_map(|stream_id| Message::Unsubscribe { stream_id }.encode()),
        3 => any::<u64>().prop_map(|seq| Message::Heartbeat { seq }.encode()),
        2 => any::<u64>().prop_map(|seq| Message::HeartbeatAck { seq }.encode()),
        1 => Just(Message::Welcome(welcome()).encode()),
        1 => arb_message().prop_map(|m| m.encode()),
        1 => prop::collection::vec(any::<u8>(), 0..40),
    ]
}

/// What a client might send after its hello, in the same spirit.
fn arb_client_line() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        6 => arb_stream_closed().prop_map(|m| m.encode()),
        3 => any::<u64>().prop_map(|seq| Message::Heartbeat { seq }.encode()),
        3 => any::<u64>().prop_map(|seq| Message::HeartbeatAck { seq }.encode()),
        1 => Just(Message::Draining.encode()),
        1 => arb_message().prop_map(|m| m.encode()),
        1 => prop::collection::vec(any::<u8>(), 0..40),
    ]
}

#[derive(Clone, Debug)]
enum ServerOp {
    Input(Vec<u8>),
    Subscribe(StreamTarget),
    Unsubscribe(u64),
    Accept {
        id: u64,
        own_credential: bool,
        version: u32,
    },
    Ended(u64),
    Advance(u64),
    EndOfInput,
    Close(ErrorCode),
}

fn arb_server_op() -> impl Strategy<Value = ServerOp> {
    prop_oneof![
        12 => arb_client_line().prop_map(ServerOp::Input),
        10 => arb_target().prop_map(ServerOp::Subscribe),
        4 => (0u64..8).prop_map(ServerOp::Unsubscribe),
        12 => (0u64..8, prop::bool::weighted(0.8), prop::sample::select(vec![1u32, 1, 1, 2]))
            .prop_map(|(id, own_credential, version)| ServerOp::Accept { id, own_credential, version }),
        4 => (0u64..8).prop_map(ServerOp::Ended),
        6 => (0u64..5_000).prop_map(ServerOp::Advance),
        1 => (5_000u64..40_000).prop_map(ServerOp::Advance),
        1 => Just(ServerOp::EndOfInput),
        1 => arb_code().prop_map(ServerOp::Close),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Arbitrary bytes in arbitrary chunks: framing never panics, never holds a partial line
    /// of `max_line_bytes` or more, and decoding a line never panics.
    #[test]
    fn decoder_survives_arbitrary_bytes(
        chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..300), 0..20),
        limit in 2usize..256,
    ) {
        let mut decoder = LineDecoder::new(limit);
        for chunk in &chunks {
            let mut rest = &chunk[..];
            while !rest.is_empty() {
                match decoder.decode(rest) {
                    Ok((consumed, line)) => {
                        prop_assert!(consumed > 0 && consumed <= rest.len());
                        rest = &rest[consumed..];
                        if let Some(line) = line {
                            prop_assert!(line.len() < limit);
                            let _ = Message::decode(&line);
                        }
                    }
                    Err(DecodeError::LineTooLong { .. }) => {
                        prop_assert_eq!(decoder.buffered(), 0);
                        break;
                    }
                    Err(other) => prop_assert!(false, "{other:?}"),
                }
                prop_assert!(decoder.buffered() < limit);
            }
        }
    }

    /// Arbitrary bytes (and JSON-ish text) never panic the message decoder.
    #[test]
    fn message_decoder_survives_arbitrary_input(
        bytes in prop::collection::vec(any::<u8>(), 0..512),
        text in r#"\{("type":"(hello|welcome|subscribe|stream_closed|closed)",?|"[a-z_]{1,12}":("[ -~]{0,8}"|[0-9]{1,22}|\[[0-9,"a-z]{0,12}\]|\{[ -~]{0,16}\}),?){0,8}\}"#,
    ) {
        let _ = Message::decode(&bytes);
        let _ = Message::decode(text.as_bytes());
        let _ = ErrorBody::decode(&bytes);
    }

    /// Every message survives encode → decode, and its line fits the bound.
    #[test]
    fn messages_round_trip(message in arb_message()) {
        let line = message.encode();
        prop_assert!(line.len() <= MAX_LINE_BYTES);
        prop_assert_eq!(*line.last().unwrap(), b'\n');
        match Message::decode(&line[..line.len() - 1]) {
            Ok(decoded) => prop_assert_eq!(decoded, message),
            // Only bounds (stream_id 0) can refuse an encodable message.
            Err(error) => prop_assert!(matches!(error, DecodeError::Bounds(_))),
        }
    }

    /// The router side under arbitrary interleavings: no panic, a data stream is admitted only
    /// for an ID this session commanded and has not yet admitted, unsubscribed, timed out or
    /// closed, only from its own credential and version; at most max_streams are held.
    #[test]
    fn server_never_admits_an_uncommanded_stream(
        listener in any::<bool>(),
        ops in prop::collection::vec(arb_server_op(), 0..60),
    ) {
        let (grant, hello) = if listener {
            (listener_grant(), listener_hello())
        } else {
            (broker_grant(), broker_hello())
        };
        let me = grant.id.clone();
        let mut s = server(grant, 3);
        // Most runs start welcomed so the live paths get most of the ops.
        if ops.len() % 4 != 0 {
            s.handle_input(&Message::Hello(hello).encode(), t(0));
            s.welcome(t(0));
        }
        let mut now = 0u64;
        // Model: commanded-but-unopened ids, and open ids.
        let mut commanded: BTreeSet<StreamId> = BTreeSet::new();
        let mut open: BTreeSet<StreamId> = BTreeSet::new();
        let mut issued: BTreeSet<StreamId> = BTreeSet::new();
        for op in ops {
            match op {
                ServerOp::Input(bytes) => s.handle_input(&bytes, t(now)),
                ServerOp::Subscribe(target) => {
                    if let Ok(id) = s.subscribe(target, t(now)) {
                        prop_assert!(issued.insert(id), "stream id reused");
                        commanded.insert(id);
                    }
                }
                ServerOp::Unsubscribe(id) => {
                    if s.unsubscribe(StreamId(id)) {
                        prop_assert!(commanded.remove(&StreamId(id)) | open.remove(&StreamId(id)));
                    }
                }
                ServerOp::Accept { id, own_credential, version } => {
                    let who = if own_credential { me.clone() } else { ClientId::new("intruder") };
                    let id = StreamId(id);
                    if s.accept_stream(id, &who, version).is_ok() {
                        prop_assert!(own_credential && version == 1);
                        prop_assert!(commanded.remove(&id), "admitted {id} not commanded");
                        open.insert(id);
                    }
                }
                ServerOp::Ended(id) => {
                    if s.stream_ended(StreamId(id)) {
                        prop_assert!(open.remove(&StreamId(id)));
                    }
                }
                ServerOp::Advance(ms) => {
                    now += ms;
                    s.handle_timeout(t(now));
                }
                ServerOp::EndOfInput => s.handle_end_of_input(),
                ServerOp::Close(code) => s.close(code, None),
            }
            while let Some(event) = s.poll_event() {
                match event {
                    ServerEvent::StreamClosed { stream_id, .. } => {
                        prop_assert!(commanded.remove(&stream_id) | open.remove(&stream_id));
                    }
                    ServerEvent::StreamOpenTimedOut(id) => prop_assert!(commanded.remove(&id)),
                    ServerEvent::StreamOpened(id) => prop_assert!(open.contains(&id)),
                    ServerEvent::Closed(_) | ServerEvent::Refused(_) => {
                        commanded.clear();
                        open.clear();
                    }
                    ServerEvent::HelloAccepted(_) => {
                        s.welcome(t(now));
                    }
                    ServerEvent::Draining => {}
                }
            }
            prop_assert_eq!(s.stream_count(), commanded.len() + open.len());
            prop_assert!(s.stream_count() <= 3);
            if let Some(bytes) = s.poll_transmit() {
                // Everything the router sends is a well-formed, bounded line.
                for line in bytes.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
                    prop_assert!(line.len() < MAX_LINE_BYTES);
                    prop_assert!(Message::decode(line).is_ok());
                }
            }
            if let Some(deadline) = s.poll_timeout() {
                prop_assert!(deadline.0.as_millis() > 0 || now == 0);
            }
        }
    }

    /// The agent side under arbitrary router messages: no panic, OpenStream only after the
    /// welcome, only for a subscribed id, never twice, and never beyond max_streams at once.
    #[test]
    fn client_never_opens_an_uncommanded_stream(
        listener in any::<bool>(),
        welcomed_first in prop::bool::weighted(0.8),
        lines_in in prop::collection::vec(arb_router_line(), 0..60),
        drain_at in 0usize..80,
        advances in prop::collection::vec(0u64..8_000, 0..60),
    ) {
        let hello = if listener { listener_hello() } else { broker_hello() };
        let mut c = ClientSession::new(hello, t(0)).unwrap();
        let mut now = 0;
        let mut subscribed: BTreeSet<StreamId> = BTreeSet::new();
        let mut opened: BTreeSet<StreamId> = BTreeSet::new();
        let mut open_now: BTreeMap<StreamId, ()> = BTreeMap::new();
        let mut welcomed = false;
        let mut lines_in = lines_in;
        if welcomed_first {
            lines_in.insert(0, Message::Welcome(welcome()).encode());
        }
        for (i, line) in lines_in.iter().enumerate() {
            if i == drain_at {
                c.drain();
            }
            // Only a subscribe decoded in this state can command a stream.
            if let Some(body) = line.strip_suffix(b"\n")
                && let Ok(Message::Subscribe(sub)) = Message::decode(body)
            {
                subscribed.insert(sub.stream_id);
            }
            c.handle_input(line, t(now));
            // Separate garbage from the next line so framing errors stay per line.
            c.handle_input(b"\n", t(now));
            now += advances.get(i).copied().unwrap_or(0);
            c.handle_timeout(t(now));
            while let Some(event) = c.poll_event() {
                match event {
                    ClientEvent::Welcomed(_) => welcomed = true,
                    ClientEvent::OpenStream { stream_id, .. } => {
                        prop_assert!(welcomed);
                        prop_assert!(subscribed.contains(&stream_id), "opened uncommanded {stream_id}");
                        prop_assert!(opened.insert(stream_id), "opened {stream_id} twice");
                        open_now.insert(stream_id, ());
                    }
                    ClientEvent::CloseStream(id) => prop_assert!(open_now.remove(&id).is_some()),
                    ClientEvent::Closed { .. } => open_now.clear(),
                }
            }
            prop_assert!(open_now.len() <= welcome().max_streams as usize);
            prop_assert_eq!(c.open_streams().count(), open_now.len());
            if let Some(bytes) = c.poll_transmit() {
                for line in bytes.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
                    prop_assert!(Message::decode(line).is_ok());
                }
            }
        }
    }
}

#[derive(Clone, Debug)]
enum PairOp {
    Subscribe(StreamTarget),
    Unsubscribe(usize),
    RelayEnded(usize),
    Drain,
    Advance(u64),
}

fn arb_pair_op() -> impl Strategy<Value = PairOp> {
    prop_oneof![
        6 => arb_target().prop_map(PairOp::Subscribe),
        2 => any::<usize>().prop_map(PairOp::Unsubscribe),
        2 => any::<usize>().prop_map(PairOp::RelayEnded),
        1 => Just(PairOp::Drain),
        3 => (0u64..9_000).prop_map(PairOp::Advance),
    ]
}

/// Delivers transmit bytes both ways until neither side has anything to say.
fn pump_pair(s: &mut ServerSession, c: &mut ClientSession, now: Tick) {
    loop {
        let up = c.poll_transmit();
        let down = s.poll_transmit();
        if up.is_none() && down.is_none() {
            return;
        }
        if let Some(bytes) = up {
            s.handle_input(&bytes, now);
        }
        if let Some(bytes) = down {
            c.handle_input(&bytes, now);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Both ends back to back under arbitrary commands, relay ends, drains and clock steps
    /// (below the idle timeout): the session stays up, every stream the agent opens is admitted
    /// by the router exactly once, and once the wire is quiet both ends agree on which streams
    /// exist.
    #[test]
    fn both_ends_agree_on_streams(
        listener in any::<bool>(),
        ops in prop::collection::vec(arb_pair_op(), 0..80),
    ) {
        let (grant, hello) = if listener {
            (listener_grant(), listener_hello())
        } else {
            (broker_grant(), broker_hello())
        };
        let me = grant.id.clone();
        let mut s = server(grant, 3);
        let mut c = ClientSession::new(hello, t(0)).unwrap();
        pump_pair(&mut s, &mut c, t(0));
        prop_assert!(s.welcome(t(0)));
        pump_pair(&mut s, &mut c, t(0));
        prop_assert!(s.is_live() && c.is_live());
        let mut now = 0u64;
        let mut admitted: BTreeSet<StreamId> = BTreeSet::new();
        for op in ops {
            match op {
                PairOp::Subscribe(target) => {
                    let _ = s.subscribe(target, t(now));
                }
                PairOp::Unsubscribe(i) => {
                    let open: Vec<StreamId> = c.open_streams().collect();
                    if !open.is_empty() {
                        s.unsubscribe(open[i % open.len()]);
                    }
                }
                PairOp::RelayEnded(i) => {
                    let open: Vec<StreamId> = c.open_streams().collect();
                    if !open.is_empty() {
                        let id = open[i % open.len()];
                        prop_assert!(c.stream_closed(id, StreamCloseReason::PublisherClosed, None));
                    }
                }
                PairOp::Drain => c.drain(),
                PairOp::Advance(ms) => {
                    now += ms;
                    s.handle_timeout(t(now));
                    c.handle_timeout(t(now));
                }
            }
            pump_pair(&mut s, &mut c, t(now));
            while let Some(event) = c.poll_event() {
                match event {
                    ClientEvent::OpenStream { stream_id, .. } => {
                        // Opened right after the subscribe arrived, so the router still
                        // holds it unless it already unsubscribed it in the same exchange.
                        let result = s.accept_stream(stream_id, &me, 1);
                        prop_assert!(admitted.insert(stream_id));
                        if let Err(refusal) = result {
                            prop_assert_eq!(refusal.code, ErrorCode::UnknownStream);
                        }
                    }
                    ClientEvent::CloseStream(id) => {
                        s.stream_ended(id);
                    }
                    ClientEvent::Welcomed(_) => {}
                    ClientEvent::Closed { code, .. } => prop_assert!(false, "client closed: {code}"),
                }
            }
            while let Some(event) = s.poll_event() {
                if let ServerEvent::Closed(code) = event {
                    prop_assert!(false, "router closed: {code}");
                }
            }
            prop_assert!(s.is_live() && c.is_live());
            prop_assert_eq!(s.stream_count(), c.open_streams().count());
        }
    }
}
