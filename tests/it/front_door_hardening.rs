//! The front door under hostile clients, over real sockets: stalled connections under a 1,024
//! file-descriptor limit (the daemon binary under `prlimit`), the header-read, body-read and idle
//! timeouts, a long SSE stream that outlives them, h2c, and the memory a pinned body costs; the
//! front door's own HTTP/1.1 server for the hot routes: pipelining, trickled heads, the forms it
//! hands to hyper, and draining at shutdown.

use crate::support;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use support::paused::settle;
use support::upstream::{FakeUpstream, Reply};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

const BIN: &str = env!("CARGO_BIN_EXE_continuum-router");

/// A free loopback port (bound then released; the daemon binds it next).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// The daemon binary on `addr` with `server_extra` under `server:`, optionally under
/// `prlimit --nofile=N`. Killed on drop.
struct Router {
    child: Child,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Router {
    async fn spawn(server_extra: &str, nofile: Option<u32>) -> Router {
        let dir = tempfile::tempdir().expect("tempdir");
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        let config = dir.path().join("router.yaml");
        std::fs::write(
            &config,
            format!("server:\n  bind_address: \"{addr}\"\n{server_extra}"),
        )
        .expect("write config");
        let mut command = match nofile {
            Some(n) => {
                let mut c = Command::new("prlimit");
                c.arg(format!("--nofile={n}")).arg("--").arg(BIN);
                c
            }
            None => Command::new(BIN),
        };
        let child = command
            .arg("run")
            .arg("--config")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the router");
        let router = Router {
            child,
            addr,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok((status, _)) = get(addr, "/health").await
                && status.contains("200")
            {
                break;
            }
            assert!(Instant::now() < deadline, "the router did not start");
            tokio::task::yield_now().await;
        }
        router
    }

    /// A field of `/proc/<pid>/status` in kB (`VmRSS`, `VmHWM`).
    fn status_kb(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("the router is running");
        status
            .lines()
            .find(|l| l.starts_with(field))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .expect("a status field")
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One request on its own connection; the status line and the whole response.
async fn exchange(addr: SocketAddr, request: &[u8]) -> std::io::Result<(String, Vec<u8>)> {
    let mut stream = TcpStream::connect(addr).await?;
    stream.write_all(request).await?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await?;
    let status =
        String::from_utf8_lossy(response.split(|b| *b == b'\r').next().unwrap_or(&[])).into_owned();
    Ok((status, response))
}

async fn get(addr: SocketAddr, path: &str) -> std::io::Result<(String, Vec<u8>)> {
    let request = format!("GET {path} HTTP/1.1\r\nHost: router\r\nConnection: close\r\n\r\n");
    tokio::time::timeout(Duration::from_secs(10), exchange(addr, request.as_bytes()))
        .await
        .map_err(|_| std::io::Error::other("no answer within 10 s"))?
}

fn post(path: &str, body: &[u8]) -> Vec<u8> {
    let mut request = format!(
        "POST {path} HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n\
         Connection: close\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body);
    request
}

/// A metric sample's value from `/metrics`.
fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Waits until the server closes `stream` (EOF or reset), reading whatever it sends first.
async fn closed_by_server(mut stream: TcpStream) {
    let mut sink = [0u8; 1024];
    loop {
        match stream.read(&mut sink).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

/// Lets this test process hold `n` sockets (its own soft limit may be 1,024).
fn raise_own_nofile(n: u64) {
    let soft = continuum_router::front_door::serve::soft_nofile_limit();
    if soft.is_some_and(|soft| soft >= n) {
        return;
    }
    let status = Command::new("prlimit")
        .arg("--pid")
        .arg(std::process::id().to_string())
        .arg(format!("--nofile={n}:"))
        .status()
        .expect("run prlimit");
    assert!(
        status.success(),
        "cannot raise this test's open-file limit to {n}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_connections_under_an_fd_limit_neither_starve_health_nor_stay_open() {
    const STALLED: usize = 1_100;
    raise_own_nofile(4_096);
    let router = Router::spawn(
        // Long enough that all 1,100 are open before the first times out, so the cap is reached.
        "  header_read_timeout: 10s\n  idle_timeout: 10s\n  max_connections: 4096\n",
        Some(1_024),
    )
    .await;

    // 1,100 connections that send half a request head and stop.
    let mut stalled = Vec::with_capacity(STALLED);
    for _ in 0..STALLED {
        let mut stream = TcpStream::connect(router.addr).await.expect("connect");
        stream
            .write_all(b"GET /health HTTP/1.1\r\nHost: router\r\n")
            .await
            .expect("write half a head");
        stalled.push(stream);
    }

    let started = Instant::now();
    let (status, _) = get(router.addr, "/health").await.expect("/health answers");
    let latency = started.elapsed();
    println!("/health with {STALLED} stalled connections open: {latency:?}");
    assert!(status.contains("200"), "{status}");
    assert!(latency < Duration::from_secs(1), "/health took {latency:?}");

    // Every stalled connection is closed: the oldest at the cap, the rest by the header timeout.
    let started = Instant::now();
    tokio::time::timeout(
        Duration::from_secs(60),
        futures::future::join_all(stalled.into_iter().map(closed_by_server)),
    )
    .await
    .expect("every stalled connection is closed by the router");
    println!(
        "all {STALLED} stalled connections closed after {:?}",
        started.elapsed()
    );

    let (_, metrics) = get(router.addr, "/metrics").await.expect("/metrics");
    let metrics = String::from_utf8_lossy(&metrics);
    let evicted = sample(
        &metrics,
        "continuum_http_connections_shed_total{reason=\"evicted_idle\"}",
    )
    .expect("the shed counter is exported");
    let limit = sample(&metrics, "continuum_http_connections_limit").expect("the limit gauge");
    println!("connection cap {limit}, evicted at the cap: {evicted}");
    assert_eq!(limit, 480.0, "the cap follows the 1,024 fd limit");
    assert!(
        evicted > 0.0,
        "the cap was reached and idle connections evicted"
    );
}

/// A daemon in-process with 1 s timeouts in front of a fake upstream serving model `m`.
async fn short_timeouts(up: &FakeUpstream) -> continuum_router::daemon::Daemon {
    let yaml = format!(
        "server:\n  header_read_timeout: 1s\n  body_read_timeout: 1s\n  idle_timeout: 1s\n\
         backends:\n  - name: b1\n    url: \"{}\"\n    models: [m]\n    health_check:\n      \
         enabled: false\n",
        up.url()
    );
    support::daemon::start(&yaml).await
}

/// The same with 60 s timeouts: nothing a test waits for is cut by them.
async fn long_timeouts(up: &FakeUpstream) -> continuum_router::daemon::Daemon {
    let yaml = format!(
        "server:\n  header_read_timeout: 60s\n  idle_timeout: 60s\n\
         backends:\n  - name: b1\n    url: \"{}\"\n    models: [m]\n    health_check:\n      \
         enabled: false\n",
        up.url()
    );
    support::daemon::start(&yaml).await
}

#[tokio::test]
async fn silent_stalled_and_slow_body_clients_are_cut_by_the_timeouts() {
    let up = FakeUpstream::start().await;
    let daemon = short_timeouts(&up).await;
    let addr = daemon.local_addr();

    // Connected, nothing sent: the idle timeout closes it.
    let silent = TcpStream::connect(addr).await.expect("connect");
    // Half a head: the header-read timeout closes it.
    let mut half_head = TcpStream::connect(addr).await.expect("connect");
    half_head
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r")
        .await
        .expect("write");
    // A whole head, then 10 of 1,000 body bytes: 408.
    let mut request = post("/v1/chat/completions", &[b' '; 1_000]);
    request.truncate(request.len() - 990);
    let slow_body = exchange(addr, &request);

    let (status, _) = tokio::time::timeout(Duration::from_secs(30), slow_body)
        .await
        .expect("the slow body is answered")
        .expect("exchange");
    assert!(status.contains("408"), "{status}");
    tokio::time::timeout(Duration::from_secs(30), async {
        closed_by_server(silent).await;
        closed_by_server(half_head).await;
    })
    .await
    .expect("silent and half-head connections are closed");
    daemon.shutdown().await;
}

/// A streamed chat request sent with `request` (`post` or `post_kept`), answered by `up` with an
/// SSE stream whose first event has arrived: the client's socket, the stream's sender and what
/// was read so far.
async fn first_event(
    addr: SocketAddr,
    up: &mut FakeUpstream,
    request: fn(&str, &[u8]) -> Vec<u8>,
) -> (TcpStream, mpsc::UnboundedSender<Bytes>, Vec<u8>) {
    let (tx, rx) = mpsc::unbounded_channel();
    up.push(Reply::Sse(rx));
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let body = br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    stream
        .write_all(&request("/v1/chat/completions", body))
        .await
        .expect("send");
    up.next_request().await;
    tx.send(Bytes::from_static(b"data: {\"n\":1}\n\n"))
        .expect("send 1");
    let seen = read_until(&mut stream, "\"n\":1").await;
    (stream, tx, seen)
}

/// Reads `stream` until what came contains `needle`; what came.
async fn read_until(stream: &mut TcpStream, needle: &str) -> Vec<u8> {
    let mut seen = Vec::new();
    let mut chunk = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains(needle) {
        let n = stream.read(&mut chunk).await.expect("read");
        assert!(n > 0, "the stream ended before {needle}");
        seen.extend_from_slice(&chunk[..n]);
    }
    seen
}

/// `POST path` with `body` as one chunk of a chunked body (a form the front door's own server
/// leaves to hyper).
fn post_chunked(path: &str, body: &[u8], close: bool) -> Vec<u8> {
    let mut request = format!(
        "POST {path} HTTP/1.1\r\nHost: router\r\nTransfer-Encoding: chunked\r\n{}\r\n{:x}\r\n",
        if close { "Connection: close\r\n" } else { "" },
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body);
    request.extend_from_slice(b"\r\n0\r\n\r\n");
    request
}

#[tokio::test]
async fn an_sse_stream_outlives_the_idle_and_body_timeouts() {
    let mut up = FakeUpstream::start().await;
    let daemon = short_timeouts(&up).await;
    let addr = daemon.local_addr();
    let (mut stream, tx, mut seen) = first_event(addr, &mut up, post).await;

    // A connection opened now, idle, is closed once idle_timeout (= body_read_timeout) passed:
    // the stream has been open longer than both by then.
    let witness = TcpStream::connect(addr).await.expect("connect");
    tokio::time::timeout(Duration::from_secs(30), closed_by_server(witness))
        .await
        .expect("the idle witness is closed");

    tx.send(Bytes::from_static(b"data: [DONE]\n\n"))
        .expect("send 2");
    drop(tx);
    tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut seen))
        .await
        .expect("the stream ends")
        .expect("read");
    let text = String::from_utf8_lossy(&seen);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("data: [DONE]"), "{text}");
    assert!(
        text.ends_with("0\r\n\r\n"),
        "a complete chunked body: {text}"
    );
    daemon.shutdown().await;
}

#[tokio::test]
async fn h2c_and_keep_alive_still_work() {
    let up = FakeUpstream::start().await;
    let daemon = short_timeouts(&up).await;
    let url = format!("http://{}/health", daemon.local_addr());
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .expect("client");
    let resp = h2.get(&url).send().await.expect("h2c");
    assert_eq!(resp.version(), reqwest::Version::HTTP_2);
    assert_eq!(resp.status(), 200);
    let h1 = reqwest::Client::new();
    for _ in 0..3 {
        let resp = h1.get(&url).send().await.expect("http/1.1");
        assert_eq!(resp.version(), reqwest::Version::HTTP_11);
        assert_eq!(resp.status(), 200);
    }
    daemon.shutdown().await;
}

/// A 7.7 MB chat body of small JSON values (a DOM of it is ~40x larger), with or without a pin.
fn big_body(pinned: bool) -> Vec<u8> {
    let mut body =
        br#"{"model":"no-such-model","messages":[{"role":"user","content":"hi"}],"x":["#.to_vec();
    body.extend_from_slice(&b"1,".repeat(3_850_000));
    body.extend_from_slice(b"1],\"nvext\":{");
    if pinned {
        body.extend_from_slice(b"\"backend_instance_id\":1,");
    }
    body.extend_from_slice(b"\"greed_sampling\":true}}");
    body
}

/// Peak RSS growth (kB) of a fresh router while 8 such bodies arrive at once.
async fn peak_growth(pinned: bool) -> (u64, u64) {
    let router = Router::spawn("", None).await;
    let base = router.status_kb("VmRSS");
    let request = post("/v1/chat/completions", &big_body(pinned));
    let answers = futures::future::join_all((0..8).map(|_| exchange(router.addr, &request))).await;
    for answer in answers {
        let (status, _) = answer.expect("answered");
        // Parsed (the pin removed) and then refused: no backend serves the model.
        assert!(status.contains("404"), "{status}");
    }
    (base, router.status_kb("VmHWM"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_body_costs_at_most_twice_an_unpinned_one() {
    let (base, unpinned) = peak_growth(false).await;
    println!("8 x 7.7 MB unpinned: VmRSS {base} kB before, VmHWM {unpinned} kB");
    let (pbase, pinned) = peak_growth(true).await;
    println!("8 x 7.7 MB pinned:   VmRSS {pbase} kB before, VmHWM {pinned} kB");
    let growth = |base: u64, peak: u64| peak.saturating_sub(base);
    assert!(
        growth(pbase, pinned) <= 2 * growth(base, unpinned).max(1),
        "pinned peak growth {} kB vs unpinned {} kB",
        growth(pbase, pinned),
        growth(base, unpinned)
    );
}

#[tokio::test]
async fn invalid_utf8_in_a_skipped_value_is_refused_and_never_forwarded() {
    let mut up = FakeUpstream::start().await;
    let daemon = short_timeouts(&up).await;
    let addr = daemon.local_addr();
    let mut bad = br#"{"model":"m","messages":[{"role":"user","content":""#.to_vec();
    bad.extend_from_slice(b"\xff\xfe\xc0\x80");
    bad.extend_from_slice(br#""}]}"#);
    let lone = br#"{"model":"m","messages":[{"role":"user","content":"\ud800"}]}"#;
    for body in [&bad[..], &lone[..]] {
        let (status, response) = exchange(addr, &post("/v1/chat/completions", body))
            .await
            .expect("exchange");
        let text = String::from_utf8_lossy(&response);
        assert!(status.contains("400"), "{text}");
        assert!(text.contains("\"invalid_request\""), "{text}");
    }
    // The next request the upstream sees is this valid one: the refused ones never left.
    let good = br#"{"model":"m","messages":[{"role":"user","content":"ok"}]}"#;
    let (status, _) = exchange(addr, &post("/v1/chat/completions", good))
        .await
        .expect("exchange");
    assert!(status.contains("200"), "{status}");
    assert_eq!(up.next_request().await.body, Bytes::from_static(good));
    daemon.shutdown().await;
}

#[tokio::test]
async fn at_the_cap_idle_connections_are_evicted_and_new_ones_refused_when_all_are_busy() {
    let mut up = FakeUpstream::start().await;
    let yaml = format!(
        "server:\n  max_connections: 1\nbackends:\n  - name: b1\n    url: \"{}\"\n    \
         models: [m]\n    health_check:\n      enabled: false\n",
        up.url()
    );
    let daemon = support::daemon::start(&yaml).await;
    let addr = daemon.local_addr();
    let shed = |reason: &str| {
        daemon
            .metrics()
            .value(
                "continuum_http_connections_shed_total",
                &[("reason", reason)],
            )
            .unwrap_or(0.0)
    };

    // An idle connection holds the one slot; a new client takes it over.
    let idle = TcpStream::connect(addr).await.expect("connect");
    let (status, _) = get(addr, "/health").await.expect("/health");
    assert!(status.contains("200"), "{status}");
    tokio::time::timeout(Duration::from_secs(30), closed_by_server(idle))
        .await
        .expect("the idle connection was evicted");
    assert!(shed("evicted_idle") >= 1.0);

    // A streaming request holds the slot: a new connection is refused unserved.
    let (tx, rx) = mpsc::unbounded_channel();
    up.push(Reply::Sse(rx));
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let body = br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    stream
        .write_all(&post("/v1/chat/completions", body))
        .await
        .expect("send");
    up.next_request().await;
    let mut refused = TcpStream::connect(addr).await.expect("connect");
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(30), refused.read_to_end(&mut buf))
        .await
        .expect("the refused connection is closed");
    assert!(read.is_err() || buf.is_empty(), "refused without an answer");
    assert_eq!(shed("refused"), 1.0);

    tx.send(Bytes::from_static(b"data: [DONE]\n\n"))
        .expect("send");
    drop(tx);
    let mut seen = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut seen))
        .await
        .expect("the stream ends")
        .expect("read");
    assert!(String::from_utf8_lossy(&seen).contains("data: [DONE]"));
    daemon.shutdown().await;
}

/// `POST path` with a body, keeping the connection.
fn post_kept(path: &str, body: &[u8]) -> Vec<u8> {
    let mut request = format!(
        "POST {path} HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body);
    request
}

/// Reads `stream` to its end (within 30 s); the answers' status lines, in order.
async fn statuses(stream: &mut TcpStream) -> (Vec<String>, String) {
    let mut seen = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut seen))
        .await
        .expect("the connection ends")
        .expect("read");
    let text = String::from_utf8_lossy(&seen).into_owned();
    // An answer's status line follows the previous answer's body directly.
    let lines = text
        .match_indices("HTTP/1.")
        .filter_map(|(at, _)| text[at..].split("\r\n").next())
        .map(str::to_owned)
        .collect();
    (lines, text)
}

const CHAT: &[u8] = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;

/// The front door's own HTTP/1.1 server serves plain hot-route requests and hands a connection
/// to hyper at its first other request: pipelined requests of both kinds on one connection are
/// all answered, in order, and the hot ones after the hand-over still reach the upstream.
#[tokio::test]
async fn pipelined_hot_and_other_requests_are_answered_in_order_on_one_connection() {
    let mut up = FakeUpstream::start().await;
    let daemon = short_timeouts(&up).await;
    let mut stream = TcpStream::connect(daemon.local_addr())
        .await
        .expect("connect");
    let mut requests = post_kept("/v1/chat/completions", CHAT);
    requests.extend(post_kept(
        "/v1/completions?trace=1",
        br#"{"model":"m","prompt":"p"}"#,
    ));
    requests.extend(b"GET /v1/models HTTP/1.1\r\nHost: router\r\n\r\n");
    requests.extend(post_kept("/v1/chat/completions", CHAT));
    requests.extend(post("/v1/chat/completions", b"not json"));
    stream.write_all(&requests).await.expect("send");
    let (lines, text) = statuses(&mut stream).await;
    assert_eq!(
        lines,
        [
            "HTTP/1.1 200 OK",
            "HTTP/1.1 200 OK",
            "HTTP/1.1 200 OK",
            "HTTP/1.1 200 OK",
            "HTTP/1.1 400 Bad Request"
        ],
        "{text}"
    );
    assert!(
        text.contains("\"object\":\"list\""),
        "the models list: {text}"
    );
    assert!(text.to_ascii_lowercase().contains("\r\ndate: "), "{text}");
    let paths: Vec<String> = [
        up.next_request().await,
        up.next_request().await,
        up.next_request().await,
    ]
    .into_iter()
    .map(|r| r.path)
    .collect();
    assert_eq!(
        paths,
        [
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/chat/completions"
        ]
    );
    assert!(up.try_request().is_none());
    daemon.shutdown().await;
}

/// A hot request's head and body trickling in a few bytes at a time is served (the head is
/// parsed only once whole), and its answer's length frames it on a kept connection.
#[tokio::test]
async fn a_trickled_hot_request_is_served_and_the_connection_kept() {
    let mut up = FakeUpstream::start().await;
    let daemon = short_timeouts(&up).await;
    let mut stream = TcpStream::connect(daemon.local_addr())
        .await
        .expect("connect");
    stream.set_nodelay(true).expect("nodelay");
    for piece in post_kept("/v1/chat/completions", CHAT).chunks(7) {
        stream.write_all(piece).await.expect("send");
        // Each piece its own segment, and the router a chance to read it alone.
        tokio::task::yield_now().await;
    }
    assert_eq!(up.next_request().await.body, Bytes::from_static(CHAT));
    // The first answer, read by its length; then the kept connection serves a second request.
    let mut seen = Vec::new();
    let mut chunk = [0u8; 4096];
    let (head_end, length) = loop {
        let n = tokio::time::timeout(Duration::from_secs(30), stream.read(&mut chunk))
            .await
            .expect("an answer")
            .expect("read");
        assert!(
            n > 0,
            "the connection closed: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&seen).to_ascii_lowercase();
        if let Some(end) = text.find("\r\n\r\n") {
            let length = text[..end]
                .lines()
                .find_map(|l| l.strip_prefix("content-length: "))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .expect("a content-length");
            break (end + 4, length);
        }
    };
    while seen.len() < head_end + length {
        let n = stream.read(&mut chunk).await.expect("read");
        assert!(n > 0, "the body was cut");
        seen.extend_from_slice(&chunk[..n]);
    }
    assert!(seen.starts_with(b"HTTP/1.1 200 OK\r\n"));
    assert_eq!(
        seen.len(),
        head_end + length,
        "nothing beyond the answer's length"
    );
    serde_json::from_slice::<serde_json::Value>(&seen[head_end..]).expect("a JSON answer");
    stream
        .write_all(&post("/v1/chat/completions", CHAT))
        .await
        .expect("send again");
    let (lines, text) = statuses(&mut stream).await;
    assert_eq!(lines, ["HTTP/1.1 200 OK"], "{text}");
    assert!(
        text.to_ascii_lowercase().contains("connection: close"),
        "{text}"
    );
    daemon.shutdown().await;
}

/// What the front door's own server leaves to hyper is answered as hyper always did: a chunked
/// body, `Expect: 100-continue`, HTTP/1.0, an oversized declared length (413).
#[tokio::test]
async fn hot_requests_in_forms_left_to_hyper_are_still_answered() {
    let mut up = FakeUpstream::start().await;
    let daemon = short_timeouts(&up).await;
    let addr = daemon.local_addr();

    let chunked = post_chunked("/v1/chat/completions", CHAT, true);
    let (status, _) = exchange(addr, &chunked).await.expect("chunked");
    assert!(status.contains("200"), "{status}");
    assert_eq!(up.next_request().await.body, Bytes::from_static(CHAT));

    let mut expect = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nExpect: 100-continue\r\n\
         Connection: close\r\nContent-Length: {}\r\n\r\n",
        CHAT.len()
    )
    .into_bytes();
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(&expect).await.expect("head");
    let mut interim = [0u8; 25];
    tokio::time::timeout(Duration::from_secs(30), stream.read_exact(&mut interim))
        .await
        .expect("100 Continue")
        .expect("read");
    assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");
    expect.clear();
    stream.write_all(CHAT).await.expect("body");
    let (lines, _) = statuses(&mut stream).await;
    assert_eq!(lines, ["HTTP/1.1 200 OK"]);
    assert_eq!(up.next_request().await.body, Bytes::from_static(CHAT));

    let mut old = format!(
        "POST /v1/chat/completions HTTP/1.0\r\nContent-Length: {}\r\n\r\n",
        CHAT.len()
    )
    .into_bytes();
    old.extend(CHAT);
    let (status, _) = exchange(addr, &old).await.expect("HTTP/1.0");
    assert!(status.contains("200"), "{status}");
    assert_eq!(up.next_request().await.body, Bytes::from_static(CHAT));

    let oversized = b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\n\
        Content-Length: 999999999\r\n\r\n";
    let (status, _) = exchange(addr, oversized).await.expect("oversized");
    assert!(status.contains("413"), "{status}");
    assert!(up.try_request().is_none());
    daemon.shutdown().await;
}

/// Shutdown closes a connection waiting for a request at once, and lets a streamed answer in
/// flight finish (its last chunk included) before closing that connection, kept alive or not.
#[tokio::test]
async fn shutdown_closes_waiting_connections_and_lets_a_stream_finish() {
    let mut up = FakeUpstream::start().await;
    let daemon = long_timeouts(&up).await;
    let addr = daemon.local_addr();
    let (mut stream, tx, mut seen) = first_event(addr, &mut up, post_kept).await;
    let waiting = TcpStream::connect(addr).await.expect("connect");
    let mut half_head = TcpStream::connect(addr).await.expect("connect");
    half_head
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r")
        .await
        .expect("write");
    // The router has taken all three before it stops accepting.
    let deadline = Instant::now() + Duration::from_secs(30);
    while daemon.metrics().value("continuum_http_connections", &[]) != Some(3.0) {
        assert!(
            Instant::now() < deadline,
            "the router did not take the connections"
        );
        tokio::task::yield_now().await;
    }

    let shutdown = tokio::spawn(daemon.shutdown());
    tokio::time::timeout(Duration::from_secs(5), async {
        closed_by_server(waiting).await;
        closed_by_server(half_head).await;
    })
    .await
    .expect("connections waiting for a request are closed at shutdown");
    assert!(!shutdown.is_finished(), "shutdown waits for the stream");

    tx.send(Bytes::from_static(b"data: [DONE]\n\n"))
        .expect("send 2");
    drop(tx);
    tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut seen))
        .await
        .expect("the stream ends and the connection closes")
        .expect("read");
    let text = String::from_utf8_lossy(&seen);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(
        text.ends_with("data: [DONE]\n\n\r\n0\r\n\r\n"),
        "a complete chunked body: {text}"
    );
    tokio::time::timeout(Duration::from_secs(30), shutdown)
        .await
        .expect("shutdown ends once the stream did")
        .expect("shutdown task");
}

/// The daemon's whole shutdown is bounded by 10 s (`daemon::SHUTDOWN_BOUND`; the spec's
/// discovery shutdown of at most 10 s sits inside it). A streamed answer whose upstream never
/// ends holds the drain: on tokio's paused clock shutdown is still waiting at 9.9 s and has
/// returned at 10 s.
#[tokio::test]
async fn shutdown_held_by_a_stream_that_never_ends_returns_at_the_10_s_bound() {
    assert_eq!(
        continuum_router::daemon::SHUTDOWN_BOUND,
        Duration::from_secs(10)
    );
    let mut up = FakeUpstream::start().await;
    let daemon = long_timeouts(&up).await;
    let addr = daemon.local_addr();
    // The upstream's sender stays alive: the stream never ends.
    let (_stream, _upstream, _) = first_event(addr, &mut up, post_kept).await;
    tokio::time::pause();
    let shutdown = tokio::spawn(daemon.shutdown());
    settle().await;
    tokio::time::advance(Duration::from_millis(9_900)).await;
    settle().await;
    assert!(!shutdown.is_finished(), "the drain waits for the stream");
    // To 10 s and a millisecond: the clock was paused off a millisecond boundary, and timer
    // deadlines round up to the next one.
    tokio::time::advance(Duration::from_millis(101)).await;
    settle().await;
    assert!(shutdown.is_finished(), "shutdown returns at its 10 s bound");
    tokio::time::resume();
    shutdown.await.expect("shutdown task");
}

/// A client that leaves before its answer is whole takes the upstream request with it: the
/// router drops the upstream exchange (the fake upstream's stream loses its reader), whether the
/// answer was still being prepared (buffered) or streaming, and whether the front door's own
/// server or hyper's (a chunked request body) served the request.
#[tokio::test]
async fn a_client_that_leaves_cancels_its_upstream_request() {
    let mut up = FakeUpstream::start().await;
    let daemon = long_timeouts(&up).await;
    let addr = daemon.local_addr();
    let buffered = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    let streamed = br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let chunked = post_chunked("/v1/chat/completions", streamed, false);
    for (case, request, first_event) in [
        (
            "buffered, own server",
            post_kept("/v1/chat/completions", buffered),
            false,
        ),
        (
            "streamed, own server",
            post_kept("/v1/chat/completions", streamed),
            true,
        ),
        ("streamed, hyper", chunked, true),
    ] {
        let (tx, rx) = mpsc::unbounded_channel();
        up.push(Reply::Sse(rx));
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream.write_all(&request).await.expect("send");
        up.next_request().await;
        if first_event {
            tx.send(Bytes::from_static(b"data: {\"n\":1}\n\n"))
                .expect("send 1");
            read_until(&mut stream, "\"n\":1").await;
        }
        drop(stream);
        tokio::time::timeout(Duration::from_secs(10), tx.closed())
            .await
            .unwrap_or_else(|_| panic!("{case}: the upstream request outlived its client"));
    }
    daemon.shutdown().await;
}
