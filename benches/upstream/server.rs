//! The upstream of `scripts/bench-proxy-nginx.sh`: a plain hyper HTTP/1 keep-alive server on one
//! thread that answers every request with a fixed small chat completion (JSON), or, when the
//! request asks for `"stream":true` or the path ends in `/stream`, with 8 SSE chunks and
//! `data: [DONE]`. It stands in for an inference server whose own cost is negligible, so the bench
//! measures the proxies in front of it.
//!
//! Timed streams (the script's `streams` mode, issue #34): a streamed request carrying
//! `x-bench-sse: EVENTS,INTERVAL_MS` is answered with EVENTS `chat.completion.chunk` events, one
//! every INTERVAL_MS (the first at once), then `data: [DONE]`, as a token stream arrives from an
//! inference server. Each event carries the wall-clock time it was sent, in nanoseconds since the
//! Unix epoch, as its `system_fingerprint` (`"fp_<ns>"`), so that the client
//! (`benches/upstream/sse_client.rs`) measures each event's latency through the proxy. EVENTS is
//! at most 100,000 and INTERVAL_MS at most 60,000.
//!
//! `cargo build --release --example bench_upstream`, then
//! `target/release/examples/bench_upstream [ADDR]` (default `127.0.0.1:18080`); it prints
//! `listening on ADDR` once bound and serves until killed.

use std::convert::Infallible;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use http_body_util::{BodyExt, Either, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::time::Instant;

const REPLY: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hello there"},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15}}"#;
const SSE_EVENT: &str = "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n";
const SSE_EVENTS: usize = 8;
/// Request bodies beyond this are not read (the bench sends a few hundred bytes).
const MAX_BODY: usize = 64 * 1024;
/// The request header asking for a timed stream.
const TIMED: &str = "x-bench-sse";
const MAX_TIMED_EVENTS: u32 = 100_000;
const MAX_TIMED_INTERVAL_MS: u64 = 60_000;

type Frames = BoxStream<'static, Result<Frame<Bytes>, Infallible>>;
type Body = Either<Full<Bytes>, StreamBody<Frames>>;

/// `EVENTS,INTERVAL_MS` from the request's header, within the bounds.
fn timed(req: &Request<Incoming>) -> Option<(u32, Duration)> {
    let value = req.headers().get(TIMED)?.to_str().ok()?;
    let (events, interval) = value.split_once(',')?;
    let events: u32 = events.trim().parse().ok()?;
    let interval: u64 = interval.trim().parse().ok()?;
    (events <= MAX_TIMED_EVENTS && interval <= MAX_TIMED_INTERVAL_MS)
        .then(|| (events, Duration::from_millis(interval)))
}

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos()
}

/// Event `seq` of a timed stream, stamped now.
fn timed_event(seq: u32, last: bool) -> Bytes {
    let finish = if last { "\"stop\"" } else { "null" };
    Bytes::from(format!(
        "data: {{\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"created\":1764950000,\
         \"model\":\"m\",\"system_fingerprint\":\"fp_{}\",\"choices\":[{{\"index\":0,\"delta\":\
         {{\"content\":\" token{seq}\"}},\"logprobs\":null,\"finish_reason\":{finish}}}]}}\n\n",
        now_ns()
    ))
}

/// EVENTS events, one every `interval` from now, then `[DONE]`.
fn timed_frames(events: u32, interval: Duration) -> Frames {
    let start = Instant::now();
    futures::stream::unfold(0u32, move |seq| async move {
        if seq > events {
            return None;
        }
        if seq == events {
            return Some((
                Ok(Frame::data(Bytes::from_static(b"data: [DONE]\n\n"))),
                seq + 1,
            ));
        }
        tokio::time::sleep_until(start + interval * seq).await;
        Some((
            Ok(Frame::data(timed_event(seq, seq + 1 == events))),
            seq + 1,
        ))
    })
    .boxed()
}

async fn answer(req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let by_path = req.uri().path().ends_with("/stream");
    let timed = timed(&req);
    let body = http_body_util::Limited::new(req.into_body(), MAX_BODY)
        .collect()
        .await
        .map(|c| c.to_bytes());
    let by_body = body.is_ok_and(|b| b.windows(13).any(|w| w == br#""stream":true"#));
    let resp = if by_path || by_body {
        let frames = match timed {
            Some((events, interval)) => timed_frames(events, interval),
            None => futures::stream::iter(
                (0..SSE_EVENTS)
                    .map(|_| Ok(Frame::data(Bytes::from_static(SSE_EVENT.as_bytes()))))
                    .chain(std::iter::once(Ok(Frame::data(Bytes::from_static(
                        b"data: [DONE]\n\n",
                    ))))),
            )
            .boxed(),
        };
        Response::builder()
            .header("content-type", "text/event-stream")
            .body(Body::Right(StreamBody::new(frames)))
    } else {
        Response::builder()
            .header("content-type", "application/json")
            .body(Body::Left(Full::new(Bytes::from_static(REPLY.as_bytes()))))
    };
    Ok(resp.unwrap_or_else(|_| Response::new(Body::Left(Full::new(Bytes::new())))))
}

fn main() -> std::io::Result<()> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:18080".to_owned());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        // A queue for a burst of thousands of connections (`TcpListener::bind` listens with 128:
        // the SYNs beyond it are dropped and resent a second later): the router's own listener.
        let addr: std::net::SocketAddr = addr
            .parse()
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let listener = continuum_router::front_door::bind(addr, 4096)?;
        println!("listening on {}", listener.local_addr()?);
        loop {
            // A failed accept (the peer gave up, no descriptor left) loses that connection only.
            let Ok((stream, _)) = listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(1)).await;
                continue;
            };
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service_fn(answer))
                    .await;
            });
        }
    })
}
