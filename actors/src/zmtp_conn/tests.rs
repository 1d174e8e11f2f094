//! Connection tests against scripted loopback peers (hostile and well-behaved). Real libzmq
//! publishers are exercised in the root package's `tests/it/zmq_subscription.rs` (`real-peers`).

use continuum_protocol::event_plane::decode_kv_metrics;
use continuum_protocol::zmtp::{Discard, GREETING};
use tokio::net::TcpListener;

use super::*;

/// A libzmq-like PUB greeting (3.1) and READY.
fn pub_handshake(socket_type: &[u8]) -> Vec<u8> {
    let mut out = GREETING.to_vec();
    out[11] = 1;
    let mut body = b"\x05READY\x0bSocket-Type".to_vec();
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type);
    out.push(0x04);
    out.push(body.len() as u8);
    out.extend(body);
    out
}

fn wire(frames: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, frame) in frames.iter().enumerate() {
        let more = u8::from(i + 1 < frames.len());
        if frame.len() > 255 {
            out.push(more | 0x02);
            out.extend_from_slice(&(frame.len() as u64).to_be_bytes());
        } else {
            out.push(more);
            out.push(frame.len() as u8);
        }
        out.extend_from_slice(frame);
    }
    out
}

const VECTOR_PUBLISHER: PublisherId = PublisherId(5249132588543811);

fn vector_frames() -> Vec<Vec<u8>> {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/vectors/active_load_frame.json"
    ))
    .unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json["zmq_multipart"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            let hex = f["hex"].as_str().unwrap();
            (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                .collect()
        })
        .collect()
}

fn config(port: u16, budget: Duration) -> ZmtpConnConfig {
    ZmtpConnConfig {
        connect_timeout: budget,
        ..ZmtpConnConfig::kv_metrics(VECTOR_PUBLISHER, format!("tcp://127.0.0.1:{port}"), None)
    }
}

/// A scripted peer: accepts one connection, reads our greeting, READY and subscription (as
/// far as it got them), and returns the stream for the test to drive.
async fn listener() -> (TcpListener, u16) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    (listener, port)
}

async fn read_exact(stream: &mut TcpStream, n: usize) -> Vec<u8> {
    let mut buf = vec![0; n];
    stream.read_exact(&mut buf).await.unwrap();
    buf
}

/// Accepts and completes the handshake as a PUB, returning the stream after the subscription.
async fn accept_as_pub(listener: &TcpListener) -> TcpStream {
    let (mut stream, _) = listener.accept().await.unwrap();
    assert_eq!(read_exact(&mut stream, 64).await, GREETING.to_vec());
    stream.write_all(&pub_handshake(b"PUB")).await.unwrap();
    let ready = read_exact(&mut stream, 27).await;
    assert_eq!(&ready[..8], b"\x04\x19\x05READY");
    assert_eq!(read_exact(&mut stream, 13).await, b"\x00\x0b\x01kv_metrics");
    stream
}

#[tokio::test]
async fn a_scripted_pub_peer_streams_messages_and_gets_pongs() {
    let (listener, port) = listener().await;
    let peer = tokio::spawn(async move {
        let mut stream = accept_as_pub(&listener).await;
        let frames = vector_frames();
        let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
        let mut bytes = wire(&refs);
        // A PING between messages, then the same message again.
        bytes.extend_from_slice(b"\x04\x09\x04PING\x00\x0aab");
        bytes.extend(wire(&refs));
        // A 100 KiB frame: skipped without buffering, counted as oversized.
        bytes.extend(wire(&[b"kv_metrics", &vec![0u8; 100 * 1024]]));
        stream.write_all(&bytes).await.unwrap();
        assert_eq!(read_exact(&mut stream, 9).await, b"\x04\x07\x04PONGab");
        stream
    });
    let (tx, mut rx) = mpsc::channel(4);
    let session =
        tokio::spawn(async move { run_session(&config(port, CONNECT_TIMEOUT), &tx).await });
    match rx.recv().await.unwrap() {
        ConnEvent::Connected { publisher_id, peer } => {
            assert_eq!(publisher_id, VECTOR_PUBLISHER);
            assert_eq!(peer.port(), port);
        }
        other => panic!("{other:?}"),
    }
    for _ in 0..2 {
        let ConnEvent::Delivery(delivery) = rx.recv().await.unwrap() else {
            panic!("expected a delivery")
        };
        let event = decode_kv_metrics(&delivery, VECTOR_PUBLISHER).unwrap();
        assert_eq!(event.load.kv_used_blocks, Some(42));
    }
    let ConnEvent::Delivery(Delivery::Discarded(Discard::FrameTooLarge { declared })) =
        rx.recv().await.unwrap()
    else {
        panic!("expected a discard")
    };
    assert_eq!(declared, 100 * 1024);
    // The peer closing ends the session with `Closed`.
    drop(peer.await.unwrap());
    assert!(matches!(session.await.unwrap(), Err(ZmtpConnError::Closed)));
}

#[tokio::test]
async fn an_idle_connection_holds_2624_buffer_bytes() {
    let (listener, port) = listener().await;
    let peer = tokio::spawn(async move { accept_as_pub(&listener).await });
    let conn = ZmtpConn::connect(&config(port, CONNECT_TIMEOUT))
        .await
        .unwrap();
    let _stream = peer.await.unwrap();
    assert_eq!(conn.buffer_bytes(), IDLE_BUFFER_BYTES);
    assert_eq!(IDLE_BUFFER_BYTES, 2_624);
}

#[tokio::test]
async fn dropping_the_receiver_stops_the_session() {
    let (listener, port) = listener().await;
    let peer = tokio::spawn(async move { accept_as_pub(&listener).await });
    let mut conn = ZmtpConn::connect(&config(port, CONNECT_TIMEOUT))
        .await
        .unwrap();
    let _stream = peer.await.unwrap();
    let (tx, rx) = mpsc::channel(1);
    drop(rx);
    assert!(conn.run(&tx).await.is_ok());
}

/// Plays a PUB over one end of an in-memory stream (an event-bus stream stands in the same way)
/// up to the subscription; returns that end.
async fn duplex_pub(mut end: tokio::io::DuplexStream) -> tokio::io::DuplexStream {
    let mut buf = [0u8; 64 + 27 + 13];
    end.read_exact(&mut buf[..64]).await.unwrap();
    end.write_all(&pub_handshake(b"PUB")).await.unwrap();
    end.read_exact(&mut buf[64..]).await.unwrap();
    assert_eq!(&buf[64 + 27..], b"\x00\x0b\x01kv_metrics");
    end
}

/// A stream session that ends (its receiver stopped) closes the stream in order: our side ends
/// first, then it waits for the peer's end, at most `CLOSE_TIMEOUT` (seed: the broker connector's
/// 1 s close timeout).
#[tokio::test(start_paused = true)]
async fn a_stream_session_closes_in_order_within_the_close_timeout() {
    assert_eq!(CLOSE_TIMEOUT, Duration::from_secs(1));
    let peer_at = SocketAddr::from(([10, 0, 0, 7], 5557));
    for peer_answers in [false, true] {
        let (ours, theirs) = tokio::io::duplex(4096);
        let peer = tokio::spawn(async move {
            let mut theirs = duplex_pub(theirs).await;
            // Our END_STREAM reaches the peer before the stream is dropped.
            let mut rest = Vec::new();
            theirs.read_to_end(&mut rest).await.unwrap();
            if peer_answers {
                drop(theirs);
                None
            } else {
                Some(theirs)
            }
        });
        let (tx, mut rx) = mpsc::channel(4);
        let session = tokio::spawn(async move {
            let cfg = config(5557, CONNECT_TIMEOUT);
            run_session_over(ours, peer_at, &cfg, &tx).await
        });
        assert!(matches!(rx.recv().await, Some(ConnEvent::Connected { .. })));
        let stopped = Instant::now();
        drop(rx);
        assert!(session.await.unwrap().is_ok());
        let held = peer.await.unwrap();
        let waited = stopped.elapsed();
        if peer_answers {
            assert!(
                waited < CLOSE_TIMEOUT,
                "waited {waited:?} for a peer that ended"
            );
        } else {
            // The paused clock jumps to the timer (rounded up to its millisecond tick).
            assert!(
                waited >= CLOSE_TIMEOUT && waited < CLOSE_TIMEOUT + Duration::from_millis(2),
                "a silent peer is waited for 1 s, no more: {waited:?}"
            );
            drop(held);
        }
    }
}

/// Runs a session against a peer that sends `bytes` after accepting (and then holds the socket).
async fn session_against(bytes: Vec<u8>, budget: Duration) -> ZmtpConnError {
    let (listener, port) = listener().await;
    let peer = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        stream.write_all(&bytes).await.unwrap();
        // Hold the connection open until the client gives up.
        let mut sink = Vec::new();
        let _ = stream.read_to_end(&mut sink).await;
    });
    let (tx, _rx) = mpsc::channel(4);
    let error = run_session(&config(port, budget), &tx).await.unwrap_err();
    peer.await.unwrap();
    error
}

#[tokio::test]
async fn a_declared_two_to_the_63_length_is_refused() {
    let mut bytes = pub_handshake(b"PUB");
    bytes.push(0x02);
    bytes.extend_from_slice(&(1u64 << 63).to_be_bytes());
    let error = session_against(bytes, CONNECT_TIMEOUT).await;
    assert!(
        matches!(error, ZmtpConnError::Protocol(ZmtpError::FrameTooLarge { declared, .. }) if declared == 1 << 63),
        "{error}"
    );
    assert_eq!(
        error.counted_result(),
        Some(LoadEventResult::TransportRefused)
    );
}

#[tokio::test]
async fn garbage_and_wrong_peers_are_refused() {
    let error = session_against(b"HTTP/1.1 200 OK\r\n\r\n".to_vec(), CONNECT_TIMEOUT).await;
    assert!(
        matches!(error, ZmtpConnError::Protocol(ZmtpError::BadSignature)),
        "{error}"
    );
    let error = session_against(pub_handshake(b"REP"), CONNECT_TIMEOUT).await;
    assert!(
        matches!(
            error,
            ZmtpConnError::Protocol(ZmtpError::WrongSocketType { .. })
        ),
        "{error}"
    );
    assert_eq!(
        error.counted_result(),
        Some(LoadEventResult::TransportRefused)
    );
}

#[tokio::test]
async fn a_stalled_greeting_runs_out_the_connect_budget() {
    // Half a greeting, then silence: the budget (shortened for the test) ends the attempt.
    let error = session_against(GREETING[..20].to_vec(), Duration::from_millis(200)).await;
    assert!(
        matches!(error, ZmtpConnError::HandshakeTimeout(_)),
        "{error}"
    );
    assert_eq!(
        error.counted_result(),
        Some(LoadEventResult::TransportRefused)
    );
}

#[tokio::test]
async fn the_dial_policy_allows_only_listed_networks() {
    let (listener, port) = listener().await;
    let refused = ZmtpConnConfig {
        allow_cidrs: Some(vec![
            "10.0.0.0/8".parse().unwrap(),
            "::1/128".parse().unwrap(),
        ]),
        ..config(port, CONNECT_TIMEOUT)
    };
    let error = ZmtpConn::connect(&refused).await.unwrap_err();
    assert!(matches!(error, ZmtpConnError::NotAllowed { .. }), "{error}");
    assert_eq!(
        error.counted_result(),
        Some(LoadEventResult::TransportRefused)
    );
    // A hostname is resolved once; only its allowed address is dialled.
    let allowed = ZmtpConnConfig {
        endpoint: format!("tcp://localhost:{port}"),
        allow_cidrs: Some(vec!["127.0.0.0/8".parse().unwrap()]),
        ..config(port, CONNECT_TIMEOUT)
    };
    let peer = tokio::spawn(async move { accept_as_pub(&listener).await });
    let conn = ZmtpConn::connect(&allowed).await.unwrap();
    assert_eq!(conn.peer().ip(), IpAddr::from([127, 0, 0, 1]));
    drop(peer.await.unwrap());
}

#[test]
fn endpoints_parse_and_the_policy_filters_addresses() {
    assert_eq!(
        parse_endpoint("tcp://10.0.0.7:41000"),
        Some(("10.0.0.7".into(), 41000))
    );
    assert_eq!(parse_endpoint("tcp://[::1]:5"), Some(("::1".into(), 5)));
    assert_eq!(
        parse_endpoint("worker-0.svc:7"),
        Some(("worker-0.svc".into(), 7))
    );
    assert_eq!(parse_endpoint("tcp://host"), None);
    assert_eq!(parse_endpoint("tcp://:5"), None);
    assert_eq!(parse_endpoint("tcp://h:99999"), None);
    assert_eq!(parse_endpoint("tcp://a/b:1"), None);
    let addresses: Vec<SocketAddr> = vec![
        "10.1.2.3:1".parse().unwrap(),
        "192.168.0.1:1".parse().unwrap(),
    ];
    let nets: Vec<IpNet> = vec!["192.168.0.0/16".parse().unwrap()];
    assert_eq!(
        allowed_addresses(&addresses, Some(&nets)),
        vec![addresses[1]]
    );
    assert_eq!(allowed_addresses(&addresses, None), addresses);
    assert!(allowed_addresses(&addresses, Some(&[])).is_empty());
}

#[test]
fn allowlists_parse_one_to_sixty_four_cidrs_of_either_family() {
    let list = |items: &[&str]| items.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let nets = parse_allow_cidrs(&list(&["10.0.0.0/8", " fd00::/8 "])).expect("valid");
    assert_eq!(nets.len(), 2);
    assert!(nets[1].contains(&"fd00::1".parse::<IpAddr>().unwrap()));
    assert!(parse_allow_cidrs(&[]).is_err(), "empty refuses everything");
    assert!(parse_allow_cidrs(&list(&["10.0.0.0/8", "not-a-cidr"])).is_err());
    assert!(parse_allow_cidrs(&list(&["10.0.0.0/33"])).is_err());
    let many: Vec<String> = (0..=MAX_ALLOW_CIDRS)
        .map(|i| format!("10.{i}.0.0/16"))
        .collect();
    assert!(parse_allow_cidrs(&many[..MAX_ALLOW_CIDRS]).is_ok());
    assert!(parse_allow_cidrs(&many).is_err());
}

#[tokio::test]
async fn bad_endpoints_and_refused_connections_are_typed_errors() {
    let bad = ZmtpConnConfig::kv_metrics(VECTOR_PUBLISHER, "udp-ish", None);
    assert!(matches!(
        ZmtpConn::connect(&bad).await,
        Err(ZmtpConnError::BadEndpoint(_))
    ));
    // A port with no listener.
    let (listener, port) = listener().await;
    drop(listener);
    let error = ZmtpConn::connect(&config(port, CONNECT_TIMEOUT))
        .await
        .unwrap_err();
    assert!(matches!(error, ZmtpConnError::Connect { .. }), "{error}");
    assert_eq!(error.counted_result(), None);
}

/// Only "nothing answers there" failures may mark a lost publisher's workers unreachable; policy
/// and protocol failures never do.
#[tokio::test]
async fn refusals_and_timeouts_read_as_unreachable_but_policy_failures_do_not() {
    // A port nobody listens on any more: connection refused.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    let config =
        ZmtpConnConfig::kv_metrics(PublisherId(1), format!("tcp://127.0.0.1:{port}"), None);
    let refused = ZmtpConn::connect(&config).await.unwrap_err();
    assert!(
        matches!(refused, ZmtpConnError::Connect { .. }),
        "{refused}"
    );
    assert!(refused.is_unreachable());
    // A peer that accepts and closes before the handshake.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let closer = tokio::spawn(async move {
        let (socket, _) = listener.accept().await.unwrap();
        drop(socket);
    });
    let config =
        ZmtpConnConfig::kv_metrics(PublisherId(1), format!("tcp://127.0.0.1:{port}"), None);
    let closed = ZmtpConn::connect(&config).await.unwrap_err();
    closer.await.unwrap();
    assert!(closed.is_unreachable(), "{closed}");
    assert!(ZmtpConnError::ConnectTimeout(CONNECT_TIMEOUT).is_unreachable());
    assert!(ZmtpConnError::HandshakeTimeout(CONNECT_TIMEOUT).is_unreachable());
    // Policy and protocol failures say nothing about the worker.
    let denied = ZmtpConnConfig::kv_metrics(
        PublisherId(1),
        "tcp://127.0.0.1:9",
        Some(vec!["10.0.0.0/8".parse().unwrap()]),
    );
    let error = ZmtpConn::connect(&denied).await.unwrap_err();
    assert!(matches!(error, ZmtpConnError::NotAllowed { .. }), "{error}");
    assert!(!error.is_unreachable());
    assert!(!ZmtpConnError::BadEndpoint("x".into()).is_unreachable());
    assert!(!ZmtpConnError::NoAddress { host: "h".into() }.is_unreachable());
}
