//! Raw-socket regressions of the protocol probe of issue #35, each on both of the front door's
//! HTTP/1.1 servers: its own for the hot routes (a connection's first plain hot request) and
//! hyper's (the same request after the connection was handed over, here by a `GET /health`).

use crate::support;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use continuum_router::daemon::Daemon;
use support::upstream::{FakeUpstream, Reply};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

const CHAT: &[u8] = br#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#;

/// A daemon in-process in front of `up` (serving model `m`), with `server` (lines indented by
/// two spaces) under `server:`.
async fn daemon(up: &FakeUpstream, server: &str) -> Daemon {
    let yaml = format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\n{server}\
         backends:\n  - name: b1\n    url: \"{}\"\n    models: [m]\n    health_check:\n      \
         enabled: false\n",
        up.url()
    );
    support::daemon::start(&yaml).await
}

/// `POST target` with the chat body, `fields` (each ending in CRLF) and its length.
fn hot(target: &str, fields: &str) -> Vec<u8> {
    post(target, fields, CHAT)
}

/// `POST target` with `body`, `fields` (each ending in CRLF) and its length.
fn post(target: &str, fields: &str, body: &[u8]) -> Vec<u8> {
    let mut request = format!(
        "POST {target} HTTP/1.1\r\n{fields}Content-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body);
    request
}

/// A kept-alive `GET /health`: the request after it is hyper's.
const HEALTH: &[u8] = b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n";

/// One read from `stream` appended to `buf`; `false` at its end.
async fn fill(stream: &mut TcpStream, buf: &mut Vec<u8>) -> bool {
    let mut chunk = [0u8; 8192];
    let read = tokio::time::timeout(Duration::from_secs(30), stream.read(&mut chunk))
        .await
        .expect("an answer or the end within 30 s");
    match read {
        Ok(0) | Err(_) => false,
        Ok(n) => {
            buf.extend_from_slice(&chunk[..n]);
            true
        }
    }
}

/// One answer read from `stream` (`buf` keeps what follows it): its status line and head, and
/// its body (framed by `Content-Length`). `None` when the connection ends first.
async fn answer(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<(String, Vec<u8>)> {
    let end = loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break end + 4;
        }
        if !fill(stream, buf).await {
            return None;
        }
    };
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())?
        })
        .expect("a Content-Length answer");
    while buf.len() < end + length {
        if !fill(stream, buf).await {
            return None;
        }
    }
    let body = buf[end..end + length].to_vec();
    buf.drain(..end + length);
    Some((head, body))
}

/// The status lines of the answers to `requests` sent at once on one new connection, until the
/// connection ends or `n` came.
async fn statuses(addr: SocketAddr, requests: &[&[u8]], n: usize) -> Vec<String> {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(&requests.concat()).await.expect("send");
    let mut buf = Vec::new();
    let mut lines = Vec::new();
    while lines.len() < n
        && let Some((head, _)) = answer(&mut stream, &mut buf).await
    {
        lines.push(head.lines().next().unwrap_or_default().to_owned());
    }
    lines
}

/// `"`, `<` and `>` (bytes hyper's target parser refuses) in a hot request's query: 400 from
/// both servers. The front door's own server answered them 200.
#[tokio::test]
async fn query_bytes_hyper_refuses_are_a_400_on_both_servers() {
    let mut up = FakeUpstream::start().await;
    let daemon = daemon(&up, "").await;
    let addr = daemon.local_addr();
    for target in [
        "/v1/chat/completions?a=\"b\"",
        "/v1/chat/completions?<x>",
        "/v1/chat/completions?x>1",
    ] {
        let request = hot(target, "Host: r\r\n");
        let first = statuses(addr, &[&request], 1).await;
        assert_eq!(first, ["HTTP/1.1 400 Bad Request"], "{target}");
        let after = statuses(addr, &[HEALTH, &request], 2).await;
        assert_eq!(
            after,
            ["HTTP/1.1 200 OK", "HTTP/1.1 400 Bad Request"],
            "{target}"
        );
    }
    assert!(up.try_request().is_none(), "nothing was forwarded");
    daemon.shutdown().await;
}

/// No `Host`, two, or an invalid one (RFC 9112 §3.2): 400 from both servers, nothing forwarded.
/// Both answered 200 and forwarded the request.
#[tokio::test]
async fn a_missing_repeated_or_invalid_host_is_a_400_on_both_servers() {
    let mut up = FakeUpstream::start().await;
    let daemon = daemon(&up, "").await;
    let addr = daemon.local_addr();
    for fields in ["", "Host: r\r\nHost: r\r\n", "Host: a b/c\r\n"] {
        let request = hot("/v1/chat/completions", fields);
        let first = statuses(addr, &[&request], 1).await;
        assert_eq!(first, ["HTTP/1.1 400 Bad Request"], "{fields:?}");
        let after = statuses(addr, &[HEALTH, &request], 2).await;
        assert_eq!(
            after,
            ["HTTP/1.1 200 OK", "HTTP/1.1 400 Bad Request"],
            "{fields:?}"
        );
    }
    let no_host = statuses(addr, &[b"GET /health HTTP/1.1\r\n\r\n"], 1).await;
    assert_eq!(no_host, ["HTTP/1.1 400 Bad Request"]);
    assert!(up.try_request().is_none(), "nothing was forwarded");
    // HTTP/1.0 needs none.
    let old = statuses(addr, &[b"GET /health HTTP/1.0\r\n\r\n"], 1).await;
    assert_eq!(old, ["HTTP/1.0 200 OK"]);
    daemon.shutdown().await;
}

/// h2c's connection preface and an empty SETTINGS frame.
const H2_START: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";

/// After a request served on a connection, h2c's preface is not taken as a new connection's: the
/// connection stays HTTP/1.1 (hyper's HTTP/1.1 server refuses the preface and closes it). It was
/// answered in HTTP/2 (SETTINGS, WINDOW_UPDATE, GOAWAY). A new connection's preface is still h2c.
#[tokio::test]
async fn a_served_connection_never_switches_to_http2() {
    let up = FakeUpstream::start().await;
    let daemon = daemon(&up, "").await;
    let addr = daemon.local_addr();
    for first in [hot("/v1/chat/completions", "Host: r\r\n"), HEALTH.to_vec()] {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream
            .write_all(&[&first, H2_START].concat())
            .await
            .expect("send");
        let mut buf = Vec::new();
        let (head, _) = answer(&mut stream, &mut buf).await.expect("the answer");
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        while fill(&mut stream, &mut buf).await {}
        assert!(
            buf.is_empty() || buf.starts_with(b"HTTP/1.1 4"),
            "only HTTP/1.1 after an HTTP/1.1 answer: {buf:?}"
        );
    }
    let mut fresh = TcpStream::connect(addr).await.expect("connect");
    fresh.write_all(H2_START).await.expect("send");
    let mut buf = Vec::new();
    while buf.len() < 9 {
        assert!(fill(&mut fresh, &mut buf).await, "h2c's SETTINGS");
    }
    assert_eq!(
        buf[3], 4,
        "a new connection's preface is answered with SETTINGS: {buf:?}"
    );
    drop(fresh);
    daemon.shutdown().await;
}

/// Sends half a request head on a new connection and waits until the router closes it.
async fn stall_until_closed(addr: SocketAddr) {
    let mut stalled = TcpStream::connect(addr).await.expect("connect");
    stalled
        .write_all(b"GET /health HTTP/1.1\r\nHost: r")
        .await
        .expect("half a head");
    let mut rest = Vec::new();
    while fill(&mut stalled, &mut rest).await {}
    assert!(rest.is_empty(), "closed without an answer");
}

/// Whether the router closed `stream` (its end, or a reset, is there to read).
fn is_closed(stream: &TcpStream) -> bool {
    match stream.try_read(&mut [0u8; 1]) {
        Ok(0) => true,
        Ok(_) => panic!("unexpected bytes"),
        Err(error) => error.kind() != std::io::ErrorKind::WouldBlock,
    }
}

/// With `header_read_timeout` 1 s and `idle_timeout` 5 s, on both servers: a kept-alive
/// connection still serves after 2 s of quiet (it was closed `header_read_timeout` after each
/// answer: the 10 s closes of the soak); a head stalled on it is closed `header_read_timeout`
/// after its first byte; a quiet one is closed in the end. Each stalled new connection measures
/// `header_read_timeout` (a new connection's first head is timed from its start), so no test
/// reads a clock.
#[tokio::test]
async fn kept_alive_connections_wait_idle_timeout_and_stalled_heads_header_read_timeout() {
    let up = FakeUpstream::start().await;
    let daemon = daemon(&up, "  header_read_timeout: 1s\n  idle_timeout: 5s\n").await;
    let addr = daemon.local_addr();
    let request = hot("/v1/chat/completions", "Host: r\r\n");
    let mut fast = TcpStream::connect(addr).await.expect("connect");
    let mut hyper = TcpStream::connect(addr).await.expect("connect");
    let mut buf = Vec::new();
    for _ in 0..2 {
        fast.write_all(&request).await.expect("send");
        let (head, _) = answer(&mut fast, &mut buf).await.expect("served");
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        hyper.write_all(HEALTH).await.expect("send");
        let (head, _) = answer(&mut hyper, &mut buf).await.expect("served");
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        // Two header-read timeouts in a row: 2 s of quiet on both.
        stall_until_closed(addr).await;
        stall_until_closed(addr).await;
    }
    // A head started on each and stalled: closed 1 s after its first byte, before a stalled
    // head started 1 s after it (the idle timeout would close them 5 s after their answers).
    fast.write_all(&request[..20]).await.expect("half a head");
    hyper.write_all(&HEALTH[..20]).await.expect("half a head");
    stall_until_closed(addr).await;
    stall_until_closed(addr).await;
    assert!(is_closed(&fast) && is_closed(&hyper));

    // A quiet kept-alive connection is closed in the end (by the idle timeout).
    let mut quiet = TcpStream::connect(addr).await.expect("connect");
    quiet.write_all(&request).await.expect("send");
    answer(&mut quiet, &mut buf).await.expect("served");
    while fill(&mut quiet, &mut buf).await {}
    assert!(buf.is_empty());
    daemon.shutdown().await;
}

/// A client that never reads its streamed answer: once no byte could be written for
/// `send_timeout`, the router closes the connection and drops its upstream request (the fake
/// upstream's stream ends), on both servers. The connection stayed open and busy for ever (the
/// idle timer never fires while a request is in flight), pinning the buffered answer.
#[tokio::test]
async fn a_client_that_never_reads_is_closed_after_send_timeout() {
    let mut up = FakeUpstream::start().await;
    let daemon = daemon(&up, "  send_timeout: 1s\n  idle_timeout: 2s\n").await;
    let addr = daemon.local_addr();
    let body = br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let request = post("/v1/chat/completions", "Host: r\r\n", body);
    // One 64 KiB event, sent (shared, not copied) until every buffer on the way is full.
    let event = Bytes::from(format!("data: {}\n\n", "x".repeat(64 * 1024)));
    for before in [&b""[..], HEALTH] {
        let (tx, rx) = mpsc::unbounded_channel();
        up.push(Reply::Sse(rx));
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .set_recv_buffer_size(4096)
            .expect("a small receive buffer");
        let mut stream = socket.connect(addr).await.expect("connect");
        stream
            .write_all(&[before, &request].concat())
            .await
            .expect("send");
        up.next_request().await;
        for _ in 0..2048 {
            tx.send(event.clone()).expect("the stream is open");
        }
        tokio::time::timeout(Duration::from_secs(30), tx.closed())
            .await
            .expect("the router gave the stream up");
        drop(stream);
    }
    daemon.shutdown().await;
}

/// Request header names with `_` never reach the backend, from either server: a backend that
/// maps `_` to `-` would read `Transfer_Encoding` and `Content_Length` as framing. They were
/// forwarded beside the router's own framing.
#[tokio::test]
async fn header_names_with_underscores_are_not_forwarded_from_either_server() {
    let mut up = FakeUpstream::start().await;
    let daemon = daemon(&up, "").await;
    let addr = daemon.local_addr();
    let request = hot(
        "/v1/chat/completions",
        "Host: r\r\nTransfer_Encoding: chunked\r\nContent_Length: 0\r\nX_Custom: 1\r\nX-Kept: 1\r\n",
    );
    for before in [&b""[..], HEALTH] {
        let n = if before.is_empty() { 1 } else { 2 };
        let answers = statuses(addr, &[before, &request], n).await;
        assert_eq!(answers.last().map(String::as_str), Some("HTTP/1.1 200 OK"));
        let seen = up.next_request().await;
        assert_eq!(seen.body, CHAT);
        assert_eq!(seen.headers["x-kept"], "1");
        let names: Vec<_> = seen.headers.keys().map(|k| k.as_str()).collect();
        assert!(names.iter().all(|n| !n.contains('_')), "{names:?}");
    }
    daemon.shutdown().await;
}
