//! The OpenAI-wire proxy through the real `front_door::router` (oneshot, no router socket) against
//! loopback fake upstreams: relay, streaming, retries, breaker, health checks, pin hygiene, policy.

use crate::support::upstream;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use axum::body::Body;
use axum::http::{Request, Response, StatusCode};
use bytes::Bytes;
use continuum_actors::metrics::Metrics;
use continuum_actors::tree::ActorTree;
use continuum_protocol::breaker::{BreakerConfig, BreakerState};
use continuum_protocol::ids::{DpRank, InstanceId};
use continuum_protocol::time::Tick;
use continuum_router::config::schema::{
    BackendConfig, DisaggregatedServingConfig, HealthCheckConfig, HumanDuration,
};
use continuum_router::front_door::{self, ApiKeySetting, AppState, LiveSettings};
use continuum_router::proxy::metrics::RoutingPath;
use continuum_router::proxy::{ClientRequest, Dispatch, OpenAiRoute, Proxy, ProxyOptions, body};
use continuum_router::readiness::Readiness;
use continuum_router::route::Router;
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tower::ServiceExt;
use upstream::{FakeUpstream, Reply, closed_port};

fn backend(name: &str, url: &str, models: &[&str]) -> BackendConfig {
    upstream::backend_config(name, url, models)
}

struct Harness {
    state: AppState,
    proxy: Arc<Proxy>,
    clock: Arc<AtomicU64>,
    metrics: Metrics,
}

impl Harness {
    fn advance(&self, d: Duration) {
        self.clock.fetch_add(d.as_millis() as u64, Ordering::SeqCst);
    }

    async fn send(&self, req: Request<Body>) -> Response<Body> {
        front_door::router(self.state.clone())
            .oneshot(req)
            .await
            .expect("infallible")
    }
}

fn harness_with(
    backends: Vec<BackendConfig>,
    api_keys: Vec<ApiKeySetting>,
    disagg: bool,
    breaker: BreakerConfig,
) -> Harness {
    let clock = Arc::new(AtomicU64::new(0));
    let ticks = clock.clone();
    let options = ProxyOptions {
        breaker,
        clock: Arc::new(move || Tick::from_millis(ticks.load(Ordering::SeqCst))),
        ..ProxyOptions::default()
    };
    let metrics = Metrics::new("proxy-test").expect("metrics");
    let proxy = Arc::new(Proxy::new(options, Some(metrics.clone())));
    proxy.set_backends(
        &backends,
        &DisaggregatedServingConfig {
            enabled: disagg,
            fallback_to_unified: false,
            ..DisaggregatedServingConfig::default()
        },
    );
    let (control, _rx) = mpsc::channel(1);
    let state = AppState {
        live: Arc::new(ArcSwap::from_pointee(LiveSettings {
            api_keys,
            ..LiveSettings::default()
        })),
        readiness: Readiness::new(),
        metrics: Arc::new(String::new),
        tree: ActorTree::default(),
        control,
        dynamo_workers: Arc::new(|| json!({})),
        fleet_summary: Arc::new(|| json!({})),
        fleet_models: Arc::new(|_: &[String]| Vec::new()),
        route: Arc::new(
            Router::new(proxy.clone()).with_http_metrics(
                continuum_router::http_metrics::HttpMetrics::register(metrics.registry())
                    .expect("register the HTTP metrics"),
            ),
        ),
    };
    Harness {
        state,
        proxy,
        clock,
        metrics,
    }
}

fn harness(backends: Vec<BackendConfig>) -> Harness {
    harness_with(backends, vec![], false, BreakerConfig::default())
}

fn chat(body: Value) -> Request<Body> {
    Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .expect("request")
}

fn chat_body() -> Value {
    json!({"model": "m", "messages": [{"role": "user", "content": "hello"}]})
}

async fn json_of(resp: Response<Body>) -> Value {
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    serde_json::from_slice(&bytes).unwrap_or(Value::String(String::from_utf8_lossy(&bytes).into()))
}

#[tokio::test]
async fn buffered_chat_and_completions_are_relayed_with_the_routing_path() {
    let mut up = FakeUpstream::start().await;
    let h = harness(vec![backend("b1", &up.url(), &["m"])]);

    let resp = h.send(chat(chat_body())).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["x-continuum-routing-path"], "unified");
    assert!(resp.headers().get("x-continuum-backend").is_none());
    assert!(resp.headers().get("content-length").is_some());
    assert_eq!(json_of(resp).await, upstream::completion("hi"));
    let seen = up.next_request().await;
    assert_eq!(seen.path, "/v1/chat/completions");
    assert_eq!(seen.json(), chat_body());

    let req = Request::post("/v1/completions")
        .body(Body::from(json!({"model": "m", "prompt": "p"}).to_string()))
        .expect("request");
    assert_eq!(h.send(req).await.status(), StatusCode::OK);
    let seen = up.next_request().await;
    assert_eq!(seen.path, "/v1/completions");
    assert_eq!(seen.json()["prompt"], "p");
}

#[tokio::test]
async fn upstream_errors_are_relayed_as_they_are() {
    let up = FakeUpstream::start().await;
    up.push(Reply::status(429));
    up.push(Reply::status(400));
    let h = harness(vec![backend("b1", &up.url(), &["m"])]);
    assert_eq!(
        h.send(chat(chat_body())).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    let resp = h.send(chat(chat_body())).await;
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    assert_eq!(json_of(resp).await["error"]["message"], "scripted");
}

#[tokio::test]
async fn streaming_is_relayed_chunk_by_chunk_as_it_arrives() {
    let mut up = FakeUpstream::start().await;
    let (tx, rx) = mpsc::unbounded_channel();
    up.push(Reply::Sse(rx));
    let h = harness(vec![backend("b1", &up.url(), &["m"])]);
    let mut body = chat_body();
    body["stream"] = json!(true);

    let resp = h.send(chat(body)).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    assert_eq!(resp.headers()["x-continuum-routing-path"], "unified");
    up.next_request().await;
    let mut body = resp.into_body();

    tx.send(Bytes::from_static(b"data: {\"n\":1}\n\n"))
        .expect("send 1");
    let first = body
        .frame()
        .await
        .expect("frame")
        .expect("ok")
        .into_data()
        .expect("data");
    assert_eq!(first, Bytes::from_static(b"data: {\"n\":1}\n\n"));
    // Chunk 2 is only produced after chunk 1 reached the client.
    tx.send(Bytes::from_static(b"data: [DONE]\n\n"))
        .expect("send 2");
    let second = body
        .frame()
        .await
        .expect("frame")
        .expect("ok")
        .into_data()
        .expect("data");
    assert_eq!(second, Bytes::from_static(b"data: [DONE]\n\n"));
    drop(tx);
    assert!(body.frame().await.is_none());
}

#[tokio::test]
async fn a_stream_cut_mid_way_ends_with_an_error_event() {
    let up = FakeUpstream::start().await;
    let (tx, rx) = mpsc::unbounded_channel();
    up.push(Reply::SseThenCut(rx));
    let h = harness(vec![backend("b1", &up.url(), &["m"])]);
    let mut body = chat_body();
    body["stream"] = json!(true);
    let resp = h.send(chat(body)).await;
    let mut body = resp.into_body();
    tx.send(Bytes::from_static(b"data: {\"n\":1}\n\n"))
        .expect("send");
    let first = body
        .frame()
        .await
        .expect("frame")
        .expect("ok")
        .into_data()
        .expect("data");
    assert_eq!(first, Bytes::from_static(b"data: {\"n\":1}\n\n"));
    drop(tx);
    let rest = body.collect().await.expect("body").to_bytes();
    let text = String::from_utf8_lossy(&rest);
    assert!(text.starts_with("data: {\"error\""), "{text}");
    assert!(text.contains("\"code\":\"bad_gateway\""), "{text}");
}

#[tokio::test]
async fn a_connection_drop_before_headers_is_a_502() {
    let up = FakeUpstream::start().await;
    up.push(Reply::DropBeforeHeaders);
    let h = harness(vec![backend("b1", &up.url(), &["m"])]);
    let resp = h.send(chat(chat_body())).await;
    assert_eq!(resp.status(), StatusCode::BAD_GATEWAY);
    assert_eq!(json_of(resp).await["error"]["code"], "bad_gateway");
}

#[tokio::test]
async fn connection_refused_retries_the_next_replica_with_the_same_pins() {
    let mut up = FakeUpstream::start().await;
    let dead = format!("http://{}", closed_port().await);
    let h = harness(vec![
        backend("dead", &dead, &["m"]),
        backend("live", &up.url(), &["m"]),
    ]);
    let pool = h.proxy.pool();
    let candidates = vec![
        pool.get("dead").expect("dead"),
        pool.get("live").expect("live"),
    ];
    let parsed = body::parse(Bytes::from(chat_body().to_string())).expect("parse");
    let request = ClientRequest {
        route: OpenAiRoute::ChatCompletions,
        body: parsed,
        headers: Default::default(),
        disclose: true,
        authenticated: false,
    };
    let dispatch = Dispatch::pins(
        InstanceId(0x1a2b_3c4d),
        Some(DpRank(0)),
        Some((InstanceId(42), Some(DpRank(1)))),
    );
    let resp = h
        .proxy
        .dispatch(&request, &candidates, &dispatch, RoutingPath::Disaggregated)
        .await
        .expect("the live replica answers");
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["x-continuum-backend"], "live");
    assert_eq!(resp.headers()["x-continuum-routing-path"], "disaggregated");
    let seen = up.next_request().await;
    assert_eq!(seen.headers["x-dynamo-worker-instance-id"], "439041101");
    assert_eq!(seen.headers["x-dynamo-dp-rank"], "0");
    assert_eq!(seen.headers["x-dynamo-prefill-instance-id"], "42");
    assert_eq!(seen.headers["x-dynamo-prefill-dp-rank"], "1");
    assert!(
        up.try_request().is_none(),
        "exactly one send reached the live replica"
    );

    // Through the router, every request succeeds whichever replica round-robin starts with.
    for _ in 0..4 {
        assert_eq!(h.send(chat(chat_body())).await.status(), StatusCode::OK);
        up.next_request().await;
    }
}

#[tokio::test]
async fn the_breaker_opens_after_failures_and_recovers_after_a_probe() {
    let mut up = FakeUpstream::start().await;
    let h = harness_with(
        vec![backend("b1", &up.url(), &["m"])],
        vec![],
        false,
        BreakerConfig {
            failure_threshold: 2,
            cool_down: Duration::from_secs(10),
        },
    );
    // Gateway-class answers count (a 500 with a JSON error body is a request-level refusal).
    up.push(Reply::status(502));
    up.push(Reply::status(503));
    assert_eq!(
        h.send(chat(chat_body())).await.status(),
        StatusCode::BAD_GATEWAY
    );
    assert_eq!(
        h.send(chat(chat_body())).await.status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
    up.next_request().await;
    up.next_request().await;
    let b1 = h.proxy.pool().get("b1").expect("b1");
    assert!(matches!(b1.breaker_state(), BreakerState::Open { .. }));

    // Open: rejected without reaching the upstream.
    let resp = h.send(chat(chat_body())).await;
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(json_of(resp).await["error"]["code"], "unavailable");
    assert!(up.try_request().is_none());

    // A reload that keeps b1 unchanged keeps its open breaker.
    h.proxy.set_backends(
        &[
            backend("b1", &up.url(), &["m"]),
            backend("other", &up.url(), &["x"]),
        ],
        &DisaggregatedServingConfig::default(),
    );
    let b1 = h.proxy.pool().get("b1").expect("b1");
    assert!(matches!(b1.breaker_state(), BreakerState::Open { .. }));

    h.advance(Duration::from_secs(10));
    assert_eq!(h.send(chat(chat_body())).await.status(), StatusCode::OK);
    up.next_request().await;
    assert_eq!(
        b1.breaker_state(),
        BreakerState::Closed {
            consecutive_failures: 0
        }
    );
    assert_eq!(h.send(chat(chat_body())).await.status(), StatusCode::OK);
}

#[tokio::test]
async fn health_checks_mark_a_backend_down_and_up() {
    let mut up = FakeUpstream::start_with_health(StatusCode::SERVICE_UNAVAILABLE).await;
    let mut config = backend("b1", &up.url(), &["m"]);
    config.health_check = HealthCheckConfig {
        enabled: true,
        path: "/health".into(),
        interval: HumanDuration(Duration::from_millis(2)),
        timeout: HumanDuration(Duration::from_secs(5)),
        unhealthy_threshold: 2,
        healthy_threshold: 2,
    };
    let h = harness(vec![config]);
    let b1 = h.proxy.pool().get("b1").expect("b1");
    // The probe loop is sequential: probe n+1 is only sent after probe n's result was applied.
    for _ in 0..3 {
        assert_eq!(
            up.next_probe().await.answered,
            StatusCode::SERVICE_UNAVAILABLE
        );
    }
    assert!(!b1.is_healthy());
    let resp = h.send(chat(chat_body())).await;
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(up.try_request().is_none());

    up.set_health(StatusCode::OK);
    while up.next_probe().await.answered != StatusCode::OK {}
    up.next_probe().await;
    up.next_probe().await;
    assert!(b1.is_healthy());
    assert_eq!(h.send(chat(chat_body())).await.status(), StatusCode::OK);
    h.proxy.shutdown();
}

#[tokio::test]
async fn client_pins_never_reach_the_upstream_and_dynamo_headers_never_come_back() {
    let mut up = FakeUpstream::start().await;
    up.push(Reply::Json(
        StatusCode::OK,
        upstream::completion("ok"),
        vec![("x-dynamo-worker-instance-id", "7"), ("x-upstream", "kept")],
    ));
    let h = harness(vec![backend("b1", &up.url(), &["m"])]);
    let body = json!({
        "model": "m", "messages": [],
        "nvext": {"backend_instance_id": 1, "decode_worker_id": 2, "prefill_worker_id": 3,
                  "token_data": [1, 2, 3], "greed_sampling": true}
    });
    let req = Request::post("/v1/chat/completions")
        .header("x-dynamo-worker-instance-id", "1")
        .header("x-dynamo-prefill-instance-id", "2")
        .header("x-worker-instance-id", "3")
        .header("x-prefill-instance-id", "4")
        .header("x-dp-rank", "0")
        .header("x-dynamo-anything", "x")
        .header("connection", "close")
        .header("x-request-id", "r-1")
        .body(Body::from(body.to_string()))
        .expect("request");
    let resp = h.send(req).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(
        resp.headers()
            .keys()
            .all(|k| !k.as_str().starts_with("x-dynamo-"))
    );
    assert_eq!(resp.headers()["x-upstream"], "kept");

    let seen = up.next_request().await;
    for name in seen.headers.keys() {
        let name = name.as_str();
        assert!(
            !name.starts_with("x-dynamo-")
                && !["x-worker-instance-id", "x-prefill-instance-id", "x-dp-rank"].contains(&name),
            "{name} reached the upstream"
        );
    }
    assert_eq!(seen.headers["x-request-id"], "r-1");
    let forwarded = seen.json();
    assert_eq!(forwarded["model"], "m");
    assert_eq!(forwarded["nvext"], json!({"greed_sampling": true}));
}

#[tokio::test]
async fn the_backend_is_disclosed_only_when_asked_with_x_backend() {
    let mut up = FakeUpstream::start().await;
    let h = harness(vec![backend("b1", &up.url(), &["m"])]);
    let resp = h.send(chat(chat_body())).await;
    assert!(resp.headers().get("x-continuum-backend").is_none());
    let req = Request::post("/v1/chat/completions")
        .header("x-backend", "")
        .body(Body::from(chat_body().to_string()))
        .expect("request");
    let resp = h.send(req).await;
    assert_eq!(resp.headers()["x-continuum-backend"], "b1");
    up.next_request().await;
    assert!(up.next_request().await.headers.get("x-backend").is_none());
}

#[tokio::test]
async fn pinned_workers_are_disclosed_only_when_asked_with_x_backend() {
    let mut up = FakeUpstream::start().await;
    let h = harness(vec![backend("b1", &up.url(), &["m"])]);
    let candidates = vec![h.proxy.pool().get("b1").expect("b1")];
    let dispatch = Dispatch::pins(
        InstanceId(0x1a2b_3c4d),
        Some(DpRank(0)),
        Some((InstanceId(42), Some(DpRank(1)))),
    );
    let names = [
        "x-continuum-worker-instance-id",
        "x-continuum-dp-rank",
        "x-continuum-prefill-instance-id",
        "x-continuum-prefill-dp-rank",
    ];
    for disclose in [true, false] {
        let request = ClientRequest {
            route: OpenAiRoute::ChatCompletions,
            body: body::parse(Bytes::from(chat_body().to_string())).expect("parse"),
            headers: Default::default(),
            disclose,
            authenticated: false,
        };
        let resp = h
            .proxy
            .dispatch(&request, &candidates, &dispatch, RoutingPath::Disaggregated)
            .await
            .expect("the replica answers");
        up.next_request().await;
        let headers = resp.headers();
        assert!(headers.keys().all(|k| !k.as_str().starts_with("x-dynamo-")));
        if disclose {
            let seen: Vec<_> = names.iter().map(|n| headers[*n].clone()).collect();
            assert_eq!(seen, ["439041101", "0", "42", "1"]);
            assert_eq!(headers["x-continuum-backend"], "b1");
        } else {
            assert!(names.iter().all(|n| headers.get(*n).is_none()));
            assert!(headers.get("x-continuum-backend").is_none());
        }
    }
}

#[tokio::test]
async fn api_keys_reach_only_their_allowed_backends() {
    let mut one = FakeUpstream::start().await;
    let mut two = FakeUpstream::start().await;
    let key = |k: &str, allowed: &[&str]| ApiKeySetting {
        key: k.into(),
        name: k.into(),
        allowed_backends: allowed.iter().map(|s| s.to_string()).collect(),
    };
    let h = harness_with(
        vec![
            backend("b1", &one.url(), &["m"]),
            backend("b2", &two.url(), &["m", "n"]),
        ],
        vec![key("k1", &["b1"]), key("k2", &["b2"]), key("kall", &[])],
        false,
        BreakerConfig::default(),
    );
    let with_key = |k: &str, model: &str| {
        Request::post("/v1/chat/completions")
            .header("authorization", format!("Bearer {k}"))
            .body(Body::from(json!({"model": model}).to_string()))
            .expect("request")
    };
    for _ in 0..3 {
        assert_eq!(h.send(with_key("k1", "m")).await.status(), StatusCode::OK);
        let seen = one.next_request().await;
        assert!(
            seen.headers.get("authorization").is_none(),
            "the router key stays here"
        );
    }
    assert!(two.try_request().is_none());
    // b1 does not serve `n`, and k1 may not use b2: the model does not exist for k1.
    let resp = h.send(with_key("k1", "n")).await;
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    assert_eq!(json_of(resp).await["error"]["code"], "model_not_found");
    assert_eq!(h.send(with_key("k2", "n")).await.status(), StatusCode::OK);
    two.next_request().await;
    assert_eq!(h.send(with_key("kall", "n")).await.status(), StatusCode::OK);
    two.next_request().await;
    assert_eq!(
        h.send(with_key("nope", "m")).await.status(),
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        h.send(chat(chat_body())).await.status(),
        StatusCode::UNAUTHORIZED
    );
}

#[tokio::test]
async fn round_robin_spreads_across_replicas_and_skips_internal_and_disabled() {
    let mut one = FakeUpstream::start().await;
    let mut two = FakeUpstream::start().await;
    let mut hidden = FakeUpstream::start().await;
    let mut internal = backend("internal", &hidden.url(), &["m"]);
    internal.internal = true;
    let mut disabled = backend("disabled", &hidden.url(), &["m"]);
    disabled.enabled = false;
    let h = harness(vec![
        backend("b1", &one.url(), &["m"]),
        internal,
        disabled,
        backend("b2", &two.url(), &["m"]),
    ]);
    for _ in 0..4 {
        assert_eq!(h.send(chat(chat_body())).await.status(), StatusCode::OK);
    }
    for _ in 0..2 {
        one.next_request().await;
        two.next_request().await;
    }
    assert!(hidden.try_request().is_none());
}

#[tokio::test]
async fn bad_requests_are_refused_before_any_dispatch() {
    let mut up = FakeUpstream::start().await;
    let h = harness(vec![backend("b1", &up.url(), &["m"])]);

    let huge = vec![b' '; body::MAX_REQUEST_BODY_BYTES + 1];
    let resp = h
        .send(
            Request::post("/v1/chat/completions")
                .body(Body::from(huge))
                .expect("req"),
        )
        .await;
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(json_of(resp).await["error"]["code"], "payload_too_large");
    let resp = h
        .send(
            Request::post("/v1/chat/completions")
                .header("content-length", "999999999")
                .body(Body::empty())
                .expect("req"),
        )
        .await;
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);

    let resp = h
        .send(
            Request::post("/v1/chat/completions")
                .body(Body::from("{nope"))
                .expect("req"),
        )
        .await;
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    let err = json_of(resp).await;
    assert_eq!(err["error"]["code"], "invalid_request");
    assert_eq!(err["error"]["type"], "invalid_request");

    let resp = h.send(chat(json!({"messages": []}))).await;
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);

    let resp = h.send(chat(json!({"model": "unknown"}))).await;
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    assert_eq!(json_of(resp).await["error"]["code"], "model_not_found");
    assert!(up.try_request().is_none());
}

#[tokio::test]
async fn routing_path_is_counted_once_per_request_when_disaggregated_serving_is_on() {
    let up = FakeUpstream::start().await;
    let series = [("routing_path", "unified")];
    let on = harness_with(
        vec![backend("b1", &up.url(), &["m"])],
        vec![],
        true,
        BreakerConfig::default(),
    );
    assert_eq!(on.send(chat(chat_body())).await.status(), StatusCode::OK);
    assert_eq!(on.send(chat(chat_body())).await.status(), StatusCode::OK);
    assert_eq!(
        on.metrics.value("disaggregated_requests_total", &series),
        Some(2.0)
    );
    assert_eq!(
        on.metrics.value(
            "continuum_http_requests_total",
            &[("route", "chat_completions"), ("status_class", "2xx")]
        ),
        Some(2.0)
    );

    let off = harness(vec![backend("b1", &up.url(), &["m"])]);
    assert_eq!(off.send(chat(chat_body())).await.status(), StatusCode::OK);
    assert_eq!(
        off.metrics
            .value("disaggregated_requests_total", &series)
            .unwrap_or(0.0),
        0.0
    );
}

#[tokio::test]
async fn a_reload_that_moves_a_backend_starts_it_fresh_and_probes_the_new_url() {
    let mut sick = FakeUpstream::start_with_health(StatusCode::SERVICE_UNAVAILABLE).await;
    let mut fine = FakeUpstream::start().await;
    let probed = |url: &str| {
        let mut config = backend("b1", url, &["m"]);
        config.health_check = HealthCheckConfig {
            enabled: true,
            path: "/health".into(),
            interval: HumanDuration(Duration::from_millis(2)),
            timeout: HumanDuration(Duration::from_secs(5)),
            unhealthy_threshold: 1,
            healthy_threshold: 1,
        };
        config
    };
    let h = harness(vec![probed(&sick.url())]);
    sick.next_probe().await;
    sick.next_probe().await;
    assert!(!h.proxy.pool().get("b1").expect("b1").is_healthy());

    // Unchanged: the unhealthy state survives a reload.
    h.proxy.set_backends(
        &[probed(&sick.url())],
        &DisaggregatedServingConfig::default(),
    );
    assert!(!h.proxy.pool().get("b1").expect("b1").is_healthy());

    // Moved: fresh state, and the probe task follows the new URL.
    h.proxy.set_backends(
        &[probed(&fine.url())],
        &DisaggregatedServingConfig::default(),
    );
    assert!(h.proxy.pool().get("b1").expect("b1").is_healthy());
    assert_eq!(fine.next_probe().await.answered, StatusCode::OK);
    assert_eq!(h.send(chat(chat_body())).await.status(), StatusCode::OK);
    fine.next_request().await;
    h.proxy.shutdown();
}

#[tokio::test]
async fn streaming_through_a_real_listener_arrives_chunk_by_chunk() {
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    let mut up = FakeUpstream::start().await;
    let (tx, rx) = mpsc::unbounded_channel();
    up.push(Reply::Sse(rx));
    let h = harness(vec![backend("b1", &up.url(), &["m"])]);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let app = front_door::router(h.state.clone());
    let server = tokio::spawn(async move {
        let _ = axum::serve(front_door::listener(listener), app).await;
    });

    let client: Client<_, http_body_util::Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let mut body = chat_body();
    body["stream"] = json!(true);
    let req = Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(Bytes::from(body.to_string())))
        .expect("request");
    let resp = client.request(req).await.expect("response head");
    assert_eq!(resp.status(), StatusCode::OK);
    up.next_request().await;
    let mut body = resp.into_body();
    for chunk in [
        "data: {\"n\":1}\n\n",
        "data: {\"n\":2}\n\n",
        "data: [DONE]\n\n",
    ] {
        tx.send(Bytes::from(chunk)).expect("send");
        let got = body
            .frame()
            .await
            .expect("frame")
            .expect("ok")
            .into_data()
            .expect("data");
        assert_eq!(got, Bytes::from(chunk));
    }
    drop(tx);
    assert!(body.frame().await.is_none());
    server.abort();
}

/// The hot routes through a real daemon's socket, where the connection layer dispatches them
/// without axum's router (`front_door::serve_hot`), over the backend's pooled HTTP/1.1
/// connections: the same admission (401 without the key), pin hygiene both ways, disclosure,
/// routing-path header, SSE relay and `continuum_http_requests_total` counts as through the
/// router; a `GET` on the same path still goes through the router (405).
#[tokio::test]
async fn the_hot_routes_over_a_daemon_socket_behave_as_through_the_router() {
    let mut up = FakeUpstream::start().await;
    let yaml = format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\n\
         api_keys:\n  - {{key: key-1, name: one}}\n\
         backends:\n  - {{name: b1, type: openai, url: \"{}\", models: [m], \
         health_check: {{enabled: false}}}}\n",
        up.url()
    );
    let daemon = crate::support::daemon::start(&yaml).await;
    let base = format!("http://{}", daemon.local_addr());
    let client = reqwest::Client::new();

    let refused = client
        .post(format!("{base}/v1/chat/completions"))
        .json(&chat_body())
        .send()
        .await
        .expect("answer");
    assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);

    for _ in 0..3 {
        up.push(Reply::Json(
            StatusCode::OK,
            upstream::completion("ok"),
            vec![("x-dynamo-worker-instance-id", "7"), ("x-upstream", "kept")],
        ));
    }
    for path in [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/chat/completions",
    ] {
        let resp = client
            .post(format!("{base}{path}"))
            .bearer_auth("key-1")
            .header("x-dynamo-worker-instance-id", "1")
            .header("x-worker-instance-id", "3")
            .header("x-dp-rank", "0")
            .header("x-backend", "")
            .header("x-request-id", "r-1")
            .json(&chat_body())
            .send()
            .await
            .expect("answer");
        assert_eq!(resp.status(), StatusCode::OK, "{path}");
        let headers = resp.headers().clone();
        assert!(headers.keys().all(|k| !k.as_str().starts_with("x-dynamo-")));
        assert_eq!(headers["x-upstream"], "kept");
        assert_eq!(headers["x-continuum-backend"], "b1");
        assert_eq!(headers["x-continuum-routing-path"], "unified");
        let body: Value = resp.json().await.expect("json");
        assert_eq!(body, upstream::completion("ok"));
        let seen = up.next_request().await;
        assert_eq!(seen.path, path);
        for name in seen.headers.keys() {
            let name = name.as_str();
            assert!(
                !name.starts_with("x-dynamo-")
                    && ![
                        "x-worker-instance-id",
                        "x-dp-rank",
                        "x-backend",
                        "authorization"
                    ]
                    .contains(&name),
                "{name} reached the upstream"
            );
        }
        assert_eq!(seen.headers["x-request-id"], "r-1");
        assert_eq!(seen.headers["host"], up.addr.to_string().as_str());
    }

    let (tx, rx) = mpsc::unbounded_channel();
    up.push(Reply::Sse(rx));
    let mut stream_body = chat_body();
    stream_body["stream"] = json!(true);
    let resp = client
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth("key-1")
        .json(&stream_body)
        .send()
        .await
        .expect("answer");
    assert_eq!(resp.status(), StatusCode::OK);
    for chunk in ["data: {\"n\":1}\n\n", "data: [DONE]\n\n"] {
        tx.send(Bytes::from(chunk)).expect("send");
    }
    drop(tx);
    assert_eq!(
        resp.text().await.expect("stream"),
        "data: {\"n\":1}\n\ndata: [DONE]\n\n"
    );

    let wrong_method = client
        .get(format!("{base}/v1/chat/completions"))
        .send()
        .await
        .expect("answer");
    assert_eq!(wrong_method.status(), StatusCode::METHOD_NOT_ALLOWED);

    let metrics = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    let count = |series: &str| {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(series))
            .map(|v| v.trim().parse::<f64>().expect("a number"))
    };
    let requests = |route: &str, class: &str| {
        count(&format!(
            "continuum_http_requests_total{{route=\"{route}\",status_class=\"{class}\"}}"
        ))
    };
    assert_eq!(requests("chat_completions", "2xx"), Some(3.0), "{metrics}");
    assert_eq!(requests("chat_completions", "4xx"), Some(1.0), "{metrics}");
    assert_eq!(requests("completions", "2xx"), Some(1.0), "{metrics}");
    assert_eq!(
        count("continuum_http_request_duration_seconds_count{route=\"chat_completions\"}"),
        Some(4.0),
        "{metrics}"
    );
    daemon.shutdown().await;
}
