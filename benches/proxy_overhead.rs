//! Proxy overhead: latency (p50/p99) and throughput of client → router → loopback upstream versus
//! client → upstream directly. A load script (`harness = false`): it prints numbers, asserts none.
//!
//! `cargo bench --bench proxy_overhead [-- REQUESTS CONCURRENCY]`

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use axum::http::{Request, Response};
use bytes::Bytes;
use continuum_actors::tree::ActorTree;
use continuum_router::config::schema::{
    BackendConfig, BackendRole, BackendType, DisaggregatedServingConfig, HealthCheckConfig,
};
use continuum_router::front_door::{self, AppState, LiveSettings};
use continuum_router::proxy::{Proxy, ProxyOptions};
use continuum_router::readiness::Readiness;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

const REPLY: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hello there"},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15}}"#;
const REQUEST: &str = r#"{"model":"m","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Say hello in two words, please."}],"max_tokens":16}"#;

async fn upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service = service_fn(|req: Request<Incoming>| async move {
                    let _ = req.into_body().collect().await;
                    Ok::<_, std::convert::Infallible>(
                        Response::builder()
                            .header("content-type", "application/json")
                            .body(Full::new(Bytes::from_static(REPLY.as_bytes())))
                            .expect("response"),
                    )
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

async fn router(upstream: SocketAddr) -> SocketAddr {
    let proxy = Arc::new(Proxy::new(ProxyOptions::default(), None));
    proxy.set_backends(
        &[BackendConfig {
            name: "b1".into(),
            kind: BackendType::Openai,
            url: format!("http://{upstream}"),
            role: BackendRole::Unified,
            models: vec!["m".into()],
            internal: false,
            enabled: true,
            health_check: HealthCheckConfig {
                enabled: false,
                ..HealthCheckConfig::default()
            },
        }],
        &DisaggregatedServingConfig::default(),
    );
    // No admin route is exercised: the control receiver is not needed.
    let (control, _) = mpsc::channel(1);
    let state = AppState {
        live: Arc::new(ArcSwap::from_pointee(LiveSettings::default())),
        readiness: Readiness::new(),
        metrics: Arc::new(String::new),
        tree: ActorTree::default(),
        control,
        dynamo_workers: Arc::new(|| serde_json::json!({})),
        fleet_models: Arc::new(Vec::new),
        proxy,
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, front_door::router(state)).await;
    });
    addr
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

async fn one(client: &HttpClient, addr: SocketAddr) -> Duration {
    let req = Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(REQUEST.as_bytes())))
        .expect("request");
    let start = Instant::now();
    let resp = client.request(req).await.expect("response");
    assert!(resp.status().is_success(), "status {}", resp.status());
    let _ = resp.into_body().collect().await.expect("body");
    start.elapsed()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

async fn latency(client: &HttpClient, addr: SocketAddr, n: usize) -> (Duration, Duration) {
    for _ in 0..200 {
        one(client, addr).await;
    }
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        samples.push(one(client, addr).await);
    }
    samples.sort();
    (percentile(&samples, 0.50), percentile(&samples, 0.99))
}

async fn throughput(client: &HttpClient, addr: SocketAddr, n: usize, concurrency: usize) -> f64 {
    let start = Instant::now();
    let per = n / concurrency;
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move {
                for _ in 0..per {
                    one(&client, addr).await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("task");
    }
    (per * concurrency) as f64 / start.elapsed().as_secs_f64()
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let requests = args.first().copied().unwrap_or(5_000);
    let concurrency = args.get(1).copied().unwrap_or(16);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let up = upstream().await;
        let via = router(up).await;
        let client: HttpClient = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
        let (d50, d99) = latency(&client, up, requests).await;
        let (r50, r99) = latency(&client, via, requests).await;
        println!("latency direct  p50 {d50:?} p99 {d99:?}");
        println!("latency router  p50 {r50:?} p99 {r99:?}");
        println!(
            "added           p50 {:?} p99 {:?}",
            r50.saturating_sub(d50),
            r99.saturating_sub(d99)
        );
        let direct = throughput(&client, up, requests * 2, concurrency).await;
        let routed = throughput(&client, via, requests * 2, concurrency).await;
        println!(
            "throughput      direct {direct:.0} req/s, router {routed:.0} req/s, ratio {:.2} (concurrency {concurrency})",
            routed / direct
        );
    });
}
