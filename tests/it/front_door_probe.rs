//! Raw-socket regressions of the protocol probe of issue #35, each on both of the front door's
//! HTTP/1.1 servers: its own for the hot routes (a connection's first plain hot request) and
//! hyper's (the same request after the connection was handed over, here by a `GET /health`).

use crate::support;

use std::net::SocketAddr;
use std::time::Duration;

use continuum_router::daemon::Daemon;
use support::upstream::FakeUpstream;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

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
    let mut request = format!(
        "POST {target} HTTP/1.1\r\n{fields}Content-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        CHAT.len()
    )
    .into_bytes();
    request.extend_from_slice(CHAT);
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
