//! Proxy overhead: added latency (p50/p99), throughput ratio and the router's CPU time per request
//! for client → router → loopback upstream versus client → upstream directly, buffered and
//! streamed (SSE). A load script (`harness = false`): it prints numbers, asserts none.
//!
//! `cargo bench --bench proxy_overhead [-- REQUESTS CONCURRENCY ROUTER_WORKERS]`
//! (defaults 5000, 16, 2).
//!
//! # Method
//!
//! Three components run in one process, each on its own tokio runtime whose threads carry the
//! component's name: the load generator (`gen`, 1 worker), the upstream stand-in for a shim
//! replica (`upstream`, 1 worker; a plain hyper HTTP/1 server answering a fixed chat completion,
//! or 8 SSE events for `stream: true`) and the router front door (`router`, ROUTER_WORKERS
//! workers, the daemon's default on a 2-core box; one unified `openai` backend, no API keys,
//! the daemon's `Metrics` registered). The generator holds one hyper HTTP/1 keep-alive connection
//! per concurrent client and sends requests back to back on it, so its own cost is the same in
//! both runs.
//!
//! - Latency: one connection, 200 warm-up requests, then REQUESTS sequential requests, direct
//!   and routed; "added" is routed minus direct at the same percentile.
//! - Throughput: CONCURRENCY connections, 2 × REQUESTS requests per round, three rounds per
//!   side alternating direct and routed; each side reports its best round (most req/s, least CPU
//!   per request), which damps the noise of other processes on the same cores. The ratio is
//!   routed req/s over direct req/s.
//! - CPU per request: the on-CPU time of every thread of a component, read from
//!   `/proc/self/task/*/schedstat` (nanoseconds) before and after the throughput phase, divided by
//!   the requests served. On a saturated box where the generator, the upstream and the router
//!   share the same cores, throughput is CPU-bound and the ratio is roughly
//!   `(gen + upstream) / (gen + upstream + router)` per request: the router's µs/request is the
//!   honest measure of its cost, and the ratio line also prints that ceiling.
//!
//! - Parse: the request-body step alone (top-level scan, bytes forwarded) against a full
//!   `serde_json::Value` parse, for the small request and a 256-message one.
//!
//! - Rate limits: the admission steps one request takes through `proxy::limits` (the key's
//!   check, each candidate's `would_admit`, the chosen backend's debit, the completion-token
//!   question), with no limit configured and with key and backend limits that do not bind
//!   (goal: ≤ 1 µs per request). `PROXY_BENCH=rate_limits` runs only this pass.
//!
//! - Admission: the `admission` check one request on the Dynamo path takes when nothing is busy
//!   (`ShimRouter::fleet` over 16 decode workers with fresh samples, then the queue's arrival
//!   rule), with no threshold set, with every rank at 10 %, and with only the last rank below the
//!   threshold (the whole scan). `PROXY_BENCH=admission` runs only this pass.
//!
//! - Mid-stream fallback: the router's CPU per relayed SSE event for a 64-token chat stream
//!   (Dynamo-shaped chunks of ≈ 200 bytes, one per frame, then the final chunk and `[DONE]`)
//!   with `disaggregated_serving.mid_stream_fallback` off (today's relay) and on (every event
//!   read by the continuation splice), rounds alternating, best of [`MID_ROUNDS`] each; then the
//!   memory an armed stream holds. `PROXY_BENCH=mid_stream` runs only this pass;
//!   `PROXY_MID_PASS=off` (or `armed`) then measures only that side, to profile one at a time.
//!
//! The numbers are noisy when other processes use the same cores; compare CPU µs/request first.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use axum::http::{Request, Response};
use bytes::Bytes;
use continuum_actors::metrics::Metrics;
use continuum_actors::tree::ActorTree;
use continuum_router::config::schema::{
    BackendConfig, BackendRole, BackendType, DisaggregatedServingConfig, HealthCheckConfig,
};
use continuum_router::front_door::{self, AppState, LiveSettings};
use continuum_router::proxy::{Proxy, ProxyOptions};
use continuum_router::readiness::Readiness;
use continuum_router::route::Router;
use http_body_util::{BodyExt, Either, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;
use tokio::sync::mpsc;

const REPLY: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hello there"},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15}}"#;
const REQUEST: &str = r#"{"model":"m","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Say hello in two words, please."}],"max_tokens":16}"#;
const STREAM_REQUEST: &str = r#"{"model":"m","stream":true,"messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Say hello in two words, please."}],"max_tokens":16}"#;
const SSE_EVENT: &str = "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n";
const SSE_EVENTS: usize = 8;
/// The mid-stream pass's request: its `max_tokens` selects the long stream at the upstream.
const LONG_STREAM_REQUEST: &str = r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"Tell me a story about a router."}],"max_tokens":64}"#;
/// Content chunks of the long stream (plus the final chunk and `[DONE]`).
const LONG_EVENTS: usize = 64;
/// Throughput rounds per side in the mid-stream pass.
const MID_ROUNDS: usize = 5;

/// The long stream's frames, one SSE event each, shaped like Dynamo 1.6.1's chunks.
fn long_stream() -> &'static [Bytes] {
    static FRAMES: std::sync::OnceLock<Vec<Bytes>> = std::sync::OnceLock::new();
    FRAMES.get_or_init(|| {
        let id = "chatcmpl-bee766b5-87ba-4cb1-994e-349ca7ec0da5";
        let chunk = |delta: &str, finish: &str| {
            Bytes::from(format!(
                "data: {{\"id\":\"{id}\",\"choices\":[{{\"index\":0,\"delta\":{delta},\"finish_reason\":{finish},\"logprobs\":null}}],\"created\":1796450204,\"model\":\"tiny\",\"object\":\"chat.completion.chunk\"}}\n\n"
            ))
        };
        let words = [" sp", " mp", " router", "ed", " the", " cache", " é", " block"];
        let mut frames = vec![chunk(r#"{"content":" Once","role":"assistant"}"#, "null")];
        frames.extend((1..LONG_EVENTS).map(|i| {
            chunk(&format!(r#"{{"content":"{}"}}"#, words[i % words.len()]), "null")
        }));
        frames.push(chunk("{}", r#""length""#));
        frames.push(Bytes::from_static(b"data: [DONE]\n\n"));
        frames
    })
}

type UpstreamBody = Either<
    Full<Bytes>,
    StreamBody<futures::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, Infallible>>>>,
>;

fn runtime(name: &str, workers: usize) -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .thread_name(name)
        .enable_all()
        .build()
        .expect("runtime")
}

async fn upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let service = service_fn(|req: Request<Incoming>| async move {
                    let body = req.into_body().collect().await.map(|c| c.to_bytes());
                    let stream = body
                        .as_ref()
                        .is_ok_and(|b| b.windows(13).any(|w| w == br#""stream":true"#));
                    let long = stream
                        && body
                            .as_ref()
                            .is_ok_and(|b| b.windows(15).any(|w| w == br#""max_tokens":64"#));
                    let resp = if long {
                        let frames: Vec<_> = long_stream()
                            .iter()
                            .map(|b| Ok(Frame::data(b.clone())))
                            .collect();
                        Response::builder()
                            .header("content-type", "text/event-stream")
                            .body(UpstreamBody::Right(StreamBody::new(futures::stream::iter(
                                frames,
                            ))))
                    } else if stream {
                        let frames: Vec<_> = (0..SSE_EVENTS)
                            .map(|_| Ok(Frame::data(Bytes::from_static(SSE_EVENT.as_bytes()))))
                            .chain(std::iter::once(Ok(Frame::data(Bytes::from_static(
                                b"data: [DONE]\n\n",
                            )))))
                            .collect();
                        Response::builder()
                            .header("content-type", "text/event-stream")
                            .body(UpstreamBody::Right(StreamBody::new(futures::stream::iter(
                                frames,
                            ))))
                    } else {
                        Response::builder()
                            .header("content-type", "application/json")
                            .body(UpstreamBody::Left(Full::new(Bytes::from_static(
                                REPLY.as_bytes(),
                            ))))
                    };
                    Ok::<_, Infallible>(resp.expect("response"))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

async fn router(upstream: SocketAddr, disaggregated: DisaggregatedServingConfig) -> SocketAddr {
    let metrics = Metrics::new("proxy-overhead").expect("metrics");
    let proxy = Arc::new(Proxy::new(ProxyOptions::default(), Some(metrics.clone())));
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
            tls: Default::default(),
            global_prompts: Vec::new(),
            requires_single_leading_system: false,
            responses_api: Default::default(),
            responses_only_models: Vec::new(),
        }],
        &disaggregated,
    );
    // No admin route is exercised: the control receiver is not needed.
    let (control, _) = mpsc::channel(1);
    let state = AppState {
        live: Arc::new(ArcSwap::from_pointee(LiveSettings::default())),
        readiness: Readiness::new(),
        metrics: Arc::new(move || metrics.render()),
        tree: ActorTree::default(),
        control,
        dynamo_workers: Arc::new(|| serde_json::json!({})),
        fleet_summary: Arc::new(|| serde_json::json!({})),
        fleet_models: Arc::new(|_: &[String]| Vec::new()),
        route: Arc::new(Router::new(proxy)),
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(front_door::listener(listener), front_door::router(state)).await;
    });
    addr
}

/// One keep-alive HTTP/1 client connection of the load generator.
struct Conn {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    addr: SocketAddr,
}

impl Conn {
    async fn open(addr: SocketAddr) -> Self {
        let stream = TcpStream::connect(addr).await.expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .expect("handshake");
        tokio::spawn(conn);
        Self { sender, addr }
    }

    async fn one(&mut self, body: &'static str) -> Duration {
        let req = Request::post("/v1/chat/completions")
            .header("host", self.addr.to_string())
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .expect("request");
        let start = Instant::now();
        self.sender.ready().await.expect("ready");
        let resp = self.sender.send_request(req).await.expect("response");
        assert!(resp.status().is_success(), "status {}", resp.status());
        let bytes = resp.into_body().collect().await.expect("body").to_bytes();
        assert!(!bytes.is_empty(), "empty body");
        start.elapsed()
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

async fn latency(addr: SocketAddr, body: &'static str, n: usize) -> (Duration, Duration) {
    let mut conn = Conn::open(addr).await;
    for _ in 0..200 {
        conn.one(body).await;
    }
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        samples.push(conn.one(body).await);
    }
    samples.sort();
    (percentile(&samples, 0.50), percentile(&samples, 0.99))
}

async fn throughput(addr: SocketAddr, body: &'static str, n: usize, concurrency: usize) -> usize {
    let per = n / concurrency;
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            tokio::spawn(async move {
                let mut conn = Conn::open(addr).await;
                for _ in 0..per {
                    conn.one(body).await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("task");
    }
    per * concurrency
}

/// On-CPU nanoseconds of this process's threads, summed per thread name.
fn cpu_by_thread_name() -> HashMap<String, u64> {
    let mut out = HashMap::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for task in tasks.flatten() {
        let path = task.path();
        let name = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
        let ns = std::fs::read_to_string(path.join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0);
        *out.entry(name.trim().to_owned()).or_default() += ns;
    }
    out
}

fn cpu_delta(before: &HashMap<String, u64>, after: &HashMap<String, u64>, name: &str) -> u64 {
    after.get(name).copied().unwrap_or(0) - before.get(name).copied().unwrap_or(0)
}

/// Requests per second and µs of CPU per request for gen, upstream and router.
struct Run {
    rps: f64,
    gen_us: f64,
    upstream_us: f64,
    router_us: f64,
}

impl Run {
    /// A side that was not measured.
    fn idle() -> Run {
        Run {
            rps: 0.0,
            gen_us: 0.0,
            upstream_us: 0.0,
            router_us: 0.0,
        }
    }

    fn best(self, other: Run) -> Run {
        Run {
            rps: self.rps.max(other.rps),
            gen_us: self.gen_us.min(other.gen_us),
            upstream_us: self.upstream_us.min(other.upstream_us),
            router_us: self.router_us.min(other.router_us),
        }
    }
}

/// Throughput rounds per side.
const ROUNDS: usize = 3;

fn measure(
    gen_rt: &Runtime,
    addr: SocketAddr,
    body: &'static str,
    n: usize,
    concurrency: usize,
) -> Run {
    let before = cpu_by_thread_name();
    let start = Instant::now();
    let done = gen_rt.block_on(throughput(addr, body, n, concurrency));
    let elapsed = start.elapsed();
    let after = cpu_by_thread_name();
    let per = |name| cpu_delta(&before, &after, name) as f64 / 1_000.0 / done as f64;
    Run {
        rps: done as f64 / elapsed.as_secs_f64(),
        gen_us: per("gen"),
        upstream_us: per("upstream"),
        router_us: per("router"),
    }
}

fn scenario(
    label: &str,
    gen_rt: &Runtime,
    (up, via): (SocketAddr, SocketAddr),
    body: &'static str,
    requests: usize,
    concurrency: usize,
) {
    let (d50, d99) = gen_rt.block_on(latency(up, body, requests));
    let (r50, r99) = gen_rt.block_on(latency(via, body, requests));
    println!("[{label}] latency direct  p50 {d50:?} p99 {d99:?}");
    println!("[{label}] latency router  p50 {r50:?} p99 {r99:?}");
    println!(
        "[{label}] added           p50 {:?} p99 {:?}",
        r50.saturating_sub(d50),
        r99.saturating_sub(d99)
    );
    // Rounds alternate direct and routed so drift in the box's load hits both; each side keeps
    // its best round (most req/s, least CPU per request).
    let mut direct = measure(gen_rt, up, body, requests * 2, concurrency);
    let mut routed = measure(gen_rt, via, body, requests * 2, concurrency);
    for _ in 1..ROUNDS {
        direct = direct.best(measure(gen_rt, up, body, requests * 2, concurrency));
        routed = routed.best(measure(gen_rt, via, body, requests * 2, concurrency));
    }
    let ceiling = (routed.gen_us + routed.upstream_us)
        / (routed.gen_us + routed.upstream_us + routed.router_us);
    println!(
        "[{label}] throughput      direct {:.0} req/s, router {:.0} req/s, ratio {:.2} (concurrency {concurrency}; CPU-bound ceiling {ceiling:.2})",
        direct.rps,
        routed.rps,
        routed.rps / direct.rps
    );
    println!(
        "[{label}] CPU µs/request  direct: gen {:.1} upstream {:.1} | routed: gen {:.1} upstream {:.1} router {:.1}",
        direct.gen_us, direct.upstream_us, routed.gen_us, routed.upstream_us, routed.router_us
    );
}

/// The request-body step alone: the proxy's parse (top level only, bytes forwarded) against a
/// full `serde_json::Value` parse (what it replaced), for a small and a 256-message body.
fn parse_cost() {
    let big = {
        let message = r#"{"role":"user","content":"Summarise the following paragraph in one line, keeping every number exact: 3.14, 2.71, 1.41."}"#;
        let messages = vec![message; 256].join(",");
        format!(r#"{{"model":"m","messages":[{messages}],"max_tokens":16}}"#)
    };
    for (label, body) in [("small", REQUEST.to_owned()), ("256 messages", big)] {
        let bytes = Bytes::from(body);
        let rounds = 2_000;
        let start = Instant::now();
        for _ in 0..rounds {
            let parsed = continuum_router::proxy::body::parse(bytes.clone()).expect("parse");
            std::hint::black_box(parsed);
        }
        let fast = start.elapsed() / rounds;
        let start = Instant::now();
        for _ in 0..rounds {
            let value: serde_json::Value = serde_json::from_slice(&bytes).expect("json");
            std::hint::black_box(value);
        }
        let dom = start.elapsed() / rounds;
        println!(
            "[parse] {label} ({} bytes): proxy parse {fast:?}, Value parse {dom:?}",
            bytes.len()
        );
    }
}

/// The rate-limit admission steps of one request with two candidate backends.
fn rate_limit_cost() {
    use continuum_router::config::Config;
    use continuum_router::config::rate_limits::RateLimitConfig;
    let unbound = RateLimitConfig {
        requests_per_minute: Some(1_000_000_000),
        tokens_per_minute: Some(1_000_000_000_000),
        ..RateLimitConfig::default()
    };
    let mut limited = Config::default();
    limited.rate_limits.api_keys.insert("team".into(), unbound);
    for name in ["a", "b"] {
        limited.rate_limits.backends.insert(name.into(), unbound);
    }
    for (label, config) in [
        ("no limits", Config::default()),
        ("limits not binding", limited),
    ] {
        let limits = continuum_router::proxy::limits::RateLimiter::new(None);
        limits.reconfigure(&config.rate_limits);
        let rounds: u32 = 200_000;
        let start = Instant::now();
        for i in 0..rounds {
            let now = continuum_protocol::time::Tick(Duration::from_micros(u64::from(i)));
            let admitted = limits.admit_key(Some("team"), now, 20).is_ok()
                && limits.backend_would_admit("a", now, 20)
                && limits.backend_would_admit("b", now, 20)
                && limits.admit_backend("a", now, 20).is_ok();
            std::hint::black_box(admitted && limits.counts_tokens(Some("team"), Some("a")));
        }
        println!(
            "[rate limits] {label}: {:?} per request (admission steps, 2 candidates)",
            start.elapsed() / rounds
        );
    }
}

#[path = "../tests/it/support/busy_fleet.rs"]
mod busy_fleet;

/// The `admission` check of one request when nothing is busy (see the module doc).
mod admission_bench {
    use std::sync::Arc;
    use std::time::Instant;

    use arc_swap::ArcSwap;
    use continuum_actors::picker::SharedPicker;
    use continuum_protocol::admission::{Fleet, Waiting};
    use continuum_router::config::{Config, ProcessEnv};
    use continuum_router::route::admission::Admission;
    use continuum_router::route::dynamo::ShimRouter;
    use futures::FutureExt;

    use super::busy_fleet::{BusyFleet, config_yaml};

    const NS: &str = "bench";

    /// A label, the `admission` YAML, and each worker's used blocks.
    type Case = (&'static str, &'static str, fn(usize) -> u64);
    const WORKERS: usize = 16;
    const FIRST: u64 = 0x100;

    fn config(threshold: &str) -> Config {
        let yaml = config_yaml(NS, "m", "http://127.0.0.1:1", "300s", threshold);
        Config::from_yaml_str(&yaml, &ProcessEnv).expect("bench config")
    }

    pub fn run() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let ids: Vec<u64> = (0..WORKERS as u64).map(|w| FIRST + w).collect();
            let fleet = BusyFleet::start(NS, "m", &ids).await;
            let shared = Arc::new(ArcSwap::from_pointee(config("{}")));
            let dynamo = ShimRouter::with_picker(
                shared.clone(),
                fleet.reader.clone(),
                fleet.load.clone(),
                SharedPicker::new(),
                None,
            );
            let admission = Admission::new(None);
            let cases: [Case; 3] = [
                ("no threshold", "{}", |_| 10),
                (
                    "every rank at 10 %",
                    "{busy_threshold: {kv_usage: 0.9}}",
                    |_| 10,
                ),
                (
                    "only the last rank with room",
                    "{busy_threshold: {kv_usage: 0.9}}",
                    |w| {
                        if w + 1 == WORKERS { 10 } else { 95 }
                    },
                ),
            ];
            for (label, threshold, used) in cases {
                shared.store(Arc::new(config(threshold)));
                fleet.publish(used);
                let usable = |_: &str| true;
                let rounds: u32 = 200_000;
                let start = Instant::now();
                for _ in 0..rounds {
                    let Some((model, first)) = dynamo.fleet("m", &[], usable) else {
                        continue;
                    };
                    assert_ne!(first, Fleet::Busy);
                    let admitted = admission
                        .admit(
                            &model,
                            first,
                            Waiting::anonymous(),
                            || dynamo.admission_bounds(),
                            || first,
                            dynamo.load_changes(),
                        )
                        .now_or_never();
                    std::hint::black_box(admitted);
                }
                let per = start.elapsed() / rounds;
                println!("[admission] {label}: {per:?} per request (16 decode workers)");
            }
        });
    }
}

/// The router's CPU per relayed event with mid-stream fallback off and on (see the module doc).
fn mid_stream_pass(
    gen_rt: &Runtime,
    router_rt: &Runtime,
    up: SocketAddr,
    requests: usize,
    concurrency: usize,
) {
    use continuum_router::config::schema::MidStreamFallbackConfig;
    let plain = router_rt.block_on(router(up, DisaggregatedServingConfig::default()));
    let armed_config = DisaggregatedServingConfig {
        mid_stream_fallback: MidStreamFallbackConfig {
            enabled: true,
            ..MidStreamFallbackConfig::default()
        },
        ..DisaggregatedServingConfig::default()
    };
    let armed = router_rt.block_on(router(up, armed_config));
    let n = requests.max(concurrency);
    // `PROXY_MID_PASS=off` or `=armed` measures that side only (to profile one side at a time;
    // the other side's figures then read 0).
    let pass = std::env::var("PROXY_MID_PASS").unwrap_or_default();
    let (run_off, run_on) = (pass != "armed", pass != "off");
    let side_of = |run: bool, addr, n| {
        if run {
            measure(gen_rt, addr, LONG_STREAM_REQUEST, n, concurrency)
        } else {
            Run::idle()
        }
    };
    // Warm-up: connections, allocator, both paths.
    side_of(run_off, plain, n / 4);
    side_of(run_on, armed, n / 4);
    let side = |run, addr| side_of(run, addr, n);
    let mut off = side(run_off, plain);
    let mut on = side(run_on, armed);
    for _ in 1..MID_ROUNDS {
        off = off.best(side(run_off, plain));
        on = on.best(side(run_on, armed));
    }
    let events = (LONG_EVENTS + 2) as f64;
    println!(
        "[mid-stream] router CPU per stream: off {:.1} µs, armed {:.1} µs ({} events per stream, {n} streams x {MID_ROUNDS} rounds, concurrency {concurrency})",
        off.router_us,
        on.router_us,
        LONG_EVENTS + 2
    );
    println!(
        "[mid-stream] router CPU per relayed event: off {:.3} µs, armed {:.3} µs, armed / off {:.3}",
        off.router_us / events,
        on.router_us / events,
        on.router_us / off.router_us
    );
    println!(
        "[mid-stream] throughput off {:.0} streams/s, armed {:.0} streams/s",
        off.rps, on.rps
    );
    let text: usize = long_stream()
        .iter()
        .filter_map(|b| {
            let s = std::str::from_utf8(b).ok()?;
            let at = s.find(r#""content":""#)? + 11;
            s[at..].find('"')
        })
        .sum();
    // The shape is one content chunk's data line (without `data: ` and the blank line); the
    // final chunk's two foretold shapes are the final chunk's (its finish reason's string
    // emptied) and that with an empty `content` member.
    let shape = long_stream()[1].len() - "data: \n\n".len();
    let last = long_stream()[LONG_EVENTS].len() - "data: \n\n".len() - "length".len();
    let last_emptied = last + r#""content":"""#.len();
    println!(
        "[mid-stream] memory per armed stream: splice state {} B + the stream's shape {shape} B + the final chunk's shapes {last} + {last_emptied} B + inactivity timer {} B + the answer text kept ({text} B for this stream; at most max_buffered_bytes) + at most one partial event",
        std::mem::size_of::<continuum_protocol::ingress::continuation::ChatSplice>(),
        std::mem::size_of::<tokio::time::Sleep>()
    );
}

fn main() {
    parse_cost();
    rate_limit_cost();
    if std::env::var("PROXY_BENCH").is_ok_and(|v| v == "rate_limits") {
        return;
    }
    admission_bench::run();
    if std::env::var("PROXY_BENCH").is_ok_and(|v| v == "admission") {
        return;
    }
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let requests = args.first().copied().unwrap_or(5_000);
    let concurrency = args.get(1).copied().unwrap_or(16).max(1);
    let router_workers = args.get(2).copied().unwrap_or(2).max(1);
    let upstream_rt = runtime("upstream", 1);
    let router_rt = runtime("router", router_workers);
    let gen_rt = runtime("gen", 1);
    let up = upstream_rt.block_on(async { upstream().await });
    if std::env::var("PROXY_BENCH").is_ok_and(|v| v == "mid_stream") {
        mid_stream_pass(&gen_rt, &router_rt, up, requests, concurrency);
        return;
    }
    let via =
        router_rt.block_on(async move { router(up, DisaggregatedServingConfig::default()).await });
    scenario(
        "buffered",
        &gen_rt,
        (up, via),
        REQUEST,
        requests,
        concurrency,
    );
    scenario(
        "streamed",
        &gen_rt,
        (up, via),
        STREAM_REQUEST,
        requests,
        concurrency,
    );
}
