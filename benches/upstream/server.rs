//! The upstream of `scripts/bench-proxy-nginx.sh`: a plain hyper HTTP/1 keep-alive server on one
//! thread that answers every request with a fixed small chat completion (JSON), or, when the
//! request asks for `"stream":true` or the path ends in `/stream`, with 8 SSE chunks and
//! `data: [DONE]`. It stands in for an inference server whose own cost is negligible, so the bench
//! measures the proxies in front of it.
//!
//! `cargo build --release --example bench_upstream`, then
//! `target/release/examples/bench_upstream [ADDR]` (default `127.0.0.1:18080`); it prints
//! `listening on ADDR` once bound and serves until killed.

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::{BodyExt, Either, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

const REPLY: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hello there"},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15}}"#;
const SSE_EVENT: &str = "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n";
const SSE_EVENTS: usize = 8;
/// Request bodies beyond this are not read (the bench sends a few hundred bytes).
const MAX_BODY: usize = 64 * 1024;

type Body = Either<
    Full<Bytes>,
    StreamBody<futures::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, Infallible>>>>,
>;

async fn answer(req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let by_path = req.uri().path().ends_with("/stream");
    let body = http_body_util::Limited::new(req.into_body(), MAX_BODY)
        .collect()
        .await
        .map(|c| c.to_bytes());
    let by_body = body.is_ok_and(|b| b.windows(13).any(|w| w == br#""stream":true"#));
    let resp = if by_path || by_body {
        let frames: Vec<_> = (0..SSE_EVENTS)
            .map(|_| Ok(Frame::data(Bytes::from_static(SSE_EVENT.as_bytes()))))
            .chain(std::iter::once(Ok(Frame::data(Bytes::from_static(
                b"data: [DONE]\n\n",
            )))))
            .collect();
        Response::builder()
            .header("content-type", "text/event-stream")
            .body(Body::Right(StreamBody::new(futures::stream::iter(frames))))
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
        let listener = TcpListener::bind(&addr).await?;
        println!("listening on {}", listener.local_addr()?);
        loop {
            let (stream, _) = listener.accept().await?;
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service_fn(answer))
                    .await;
            });
        }
    })
}
