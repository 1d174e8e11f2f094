//! `rate_limits` end to end through the real `front_door::router` (oneshot) on the proxy's
//! injected clock: a limited key gets 429 with `Retry-After` and the `RateLimit` fields in each
//! ingress's error shape; a reload keeps an unchanged key's buckets and resets a changed key's;
//! a backend at its limit is skipped while another can serve; completion tokens from `usage`
//! are debited; the refusals are counted by configured name.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::support::upstream::{FakeUpstream, Reply, completion};
use arc_swap::ArcSwap;
use axum::body::Body;
use axum::http::{Request, Response, StatusCode};
use continuum_actors::metrics::Metrics;
use continuum_actors::tree::ActorTree;
use continuum_protocol::time::Tick;
use continuum_router::config::Config;
use continuum_router::config::rate_limits::RateLimitConfig;
use continuum_router::config::schema::{ApiKeyConfig, BackendConfig};
use continuum_router::front_door::{self, AppState};
use continuum_router::proxy::{Proxy, ProxyOptions};
use continuum_router::readiness::Readiness;
use continuum_router::route::Router;
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tower::ServiceExt;

fn backend(name: &str, url: &str) -> BackendConfig {
    crate::support::upstream::backend_config(name, url, &["m"])
}

fn rpm(per_minute: u64, burst: u64) -> RateLimitConfig {
    RateLimitConfig {
        requests_per_minute: Some(per_minute),
        request_burst: Some(burst),
        ..RateLimitConfig::default()
    }
}

struct Harness {
    state: AppState,
    proxy: Arc<Proxy>,
    clock: Arc<AtomicU64>,
    metrics: Metrics,
}

impl Harness {
    /// On the injected clock (starts at zero, moved by [`Harness::advance`]).
    fn new(config: &Config) -> Self {
        let clock = Arc::new(AtomicU64::new(0));
        let ticks = clock.clone();
        let options = ProxyOptions {
            clock: Arc::new(move || Tick::from_millis(ticks.load(Ordering::SeqCst))),
            ..ProxyOptions::default()
        };
        Self::with_options(config, options, clock)
    }

    fn with_options(config: &Config, options: ProxyOptions, clock: Arc<AtomicU64>) -> Self {
        let metrics = Metrics::new("rate-limit-test").expect("metrics");
        let proxy = Arc::new(Proxy::new(options, Some(metrics.clone())));
        proxy.reconfigure(config);
        let (control, _rx) = mpsc::channel(1);
        let state = AppState {
            live: Arc::new(ArcSwap::from_pointee(
                continuum_router::daemon::live_settings(config),
            )),
            readiness: Readiness::new(),
            metrics: Arc::new(String::new),
            tree: ActorTree::default(),
            control,
            dynamo_workers: Arc::new(|| json!({})),
            fleet_summary: Arc::new(|| json!({})),
            fleet_models: Arc::new(|_: &[String]| Vec::new()),
            route: Arc::new(Router::new(proxy.clone())),
        };
        Harness {
            state,
            proxy,
            clock,
            metrics,
        }
    }

    fn reload(&self, config: &Config) {
        self.state
            .live
            .store(Arc::new(continuum_router::daemon::live_settings(config)));
        self.proxy.reconfigure(config);
    }

    fn advance(&self, d: Duration) {
        self.clock.fetch_add(d.as_millis() as u64, Ordering::SeqCst);
    }

    async fn post(&self, path: &str, key: &str, body: Value) -> Response<Body> {
        let req = Request::post(path)
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {key}"))
            .header("x-backend", "1")
            .body(Body::from(body.to_string()))
            .expect("request");
        front_door::router(self.state.clone())
            .oneshot(req)
            .await
            .expect("infallible")
    }

    async fn chat(&self, key: &str) -> Response<Body> {
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "hello"}]});
        self.post("/v1/chat/completions", key, body).await
    }
}

fn keyed(backends: Vec<BackendConfig>) -> Config {
    let mut config = Config {
        backends,
        ..Config::default()
    };
    for (key, name) in [("sk-a", "team-a"), ("sk-b", "team-b")] {
        config.api_keys.push(ApiKeyConfig {
            key: key.into(),
            name: name.into(),
            allowed_backends: None,
        });
    }
    config
}

async fn json_of(resp: Response<Body>) -> Value {
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    serde_json::from_slice(&bytes).expect("a JSON body")
}

fn header<'a>(resp: &'a Response<Body>, name: &str) -> &'a str {
    resp.headers()
        .get(name)
        .unwrap_or_else(|| panic!("{name} missing"))
        .to_str()
        .expect("ascii")
}

/// The refusal's fields: one request per second, a burst of one, refused for one second.
fn assert_fields(resp: &Response<Body>) {
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(resp, "retry-after"), "1");
    assert_eq!(header(resp, "retry-after-ms"), "1000");
    assert_eq!(header(resp, "ratelimit-policy"), "\"rpm\";q=60;w=60");
    assert_eq!(header(resp, "ratelimit"), "\"rpm\";r=0;t=1");
}

#[tokio::test]
async fn a_limited_key_gets_429_with_the_fields_in_each_ingress_shape() {
    let up = FakeUpstream::start().await;
    let mut config = keyed(vec![backend("up", &up.url())]);
    config
        .rate_limits
        .api_keys
        .insert("team-a".into(), rpm(60, 1));
    let h = Harness::new(&config);
    assert_eq!(h.chat("sk-a").await.status(), StatusCode::OK);

    let refused = h.chat("sk-a").await;
    assert_fields(&refused);
    let body = json_of(refused).await;
    assert_eq!(body["error"]["code"], "rate_limit_exceeded");
    assert_eq!(body["error"]["type"], "requests");

    let anthropic = json!({"model": "m", "max_tokens": 8,
                           "messages": [{"role": "user", "content": "hi"}]});
    let refused = h.post("/v1/messages", "sk-a", anthropic).await;
    assert_fields(&refused);
    let body = json_of(refused).await;
    assert_eq!(body["type"], "error");
    assert_eq!(body["error"]["type"], "rate_limit_error");

    let responses = json!({"model": "m", "input": "hi"});
    let refused = h.post("/v1/responses", "sk-a", responses).await;
    assert_fields(&refused);
    let body = json_of(refused).await;
    assert_eq!(body["error"]["code"], "rate_limit_exceeded");
    assert_eq!(body["error"]["type"], "rate_limit_error");

    // Another key is not limited; after the refill interval the limited key passes again.
    assert_eq!(h.chat("sk-b").await.status(), StatusCode::OK);
    h.advance(Duration::from_millis(999));
    assert_eq!(h.chat("sk-a").await.status(), StatusCode::TOO_MANY_REQUESTS);
    h.advance(Duration::from_millis(1));
    assert_eq!(h.chat("sk-a").await.status(), StatusCode::OK);
    let rendered = h.metrics.render();
    assert!(
        rendered.contains(r#"continuum_rate_limited_total{name="team-a",scope="key"} 4"#),
        "{rendered}"
    );
    assert!(!rendered.contains("sk-a"), "a raw key in the metrics");
}

#[tokio::test]
async fn a_reload_keeps_unchanged_keys_and_resets_a_changed_key() {
    let up = FakeUpstream::start().await;
    let mut config = keyed(vec![backend("up", &up.url())]);
    config
        .rate_limits
        .api_keys
        .insert("team-a".into(), rpm(60, 1));
    config
        .rate_limits
        .api_keys
        .insert("team-b".into(), rpm(60, 1));
    let h = Harness::new(&config);
    for key in ["sk-a", "sk-b"] {
        assert_eq!(h.chat(key).await.status(), StatusCode::OK);
        assert_eq!(h.chat(key).await.status(), StatusCode::TOO_MANY_REQUESTS);
    }
    // An unrelated change (a new backend) and team-b's new limit: team-a stays empty.
    let mut reloaded = config.clone();
    reloaded.backends.push(backend("other", &up.url()));
    reloaded
        .rate_limits
        .api_keys
        .insert("team-b".into(), rpm(120, 1));
    h.reload(&reloaded);
    assert_eq!(h.chat("sk-a").await.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(h.chat("sk-b").await.status(), StatusCode::OK);
    // Removing a key's limit lifts it.
    reloaded.rate_limits.api_keys.remove("team-a");
    h.reload(&reloaded);
    assert_eq!(h.chat("sk-a").await.status(), StatusCode::OK);
}

#[tokio::test]
async fn a_backend_at_its_limit_is_skipped_while_another_can_serve() {
    let (mut a, mut b) = (FakeUpstream::start().await, FakeUpstream::start().await);
    let mut config = keyed(vec![backend("a", &a.url()), backend("b", &b.url())]);
    config.rate_limits.backends.insert("a".into(), rpm(60, 1));
    config.rate_limits.backends.insert("b".into(), rpm(60, 2));
    let h = Harness::new(&config);
    let mut served = Vec::new();
    for _ in 0..3 {
        let resp = h.chat("sk-a").await;
        assert_eq!(resp.status(), StatusCode::OK);
        served.push(header(&resp, "x-continuum-backend").to_owned());
    }
    served.sort();
    assert_eq!(served, ["a", "b", "b"]);
    assert!(a.try_request().is_some() && b.try_request().is_some());
    // Both at their limits: 429 for the backend scope, with the one that frees first.
    let refused = h.chat("sk-a").await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&refused, "retry-after"), "1");
    let rendered = h.metrics.render();
    assert!(
        rendered.contains(r#"continuum_rate_limited_total{name="a",scope="backend"} 1"#)
            || rendered.contains(r#"continuum_rate_limited_total{name="b",scope="backend"} 1"#),
        "{rendered}"
    );
    h.advance(Duration::from_secs(1));
    assert_eq!(h.chat("sk-a").await.status(), StatusCode::OK);
}

#[tokio::test]
async fn completion_tokens_from_usage_are_debited_after_the_answer() {
    let up = FakeUpstream::start().await;
    let mut config = keyed(vec![backend("up", &up.url())]);
    // 600 tokens per minute (10 per second), 100 at once.
    let tpm = RateLimitConfig {
        tokens_per_minute: Some(600),
        token_burst: Some(100),
        ..RateLimitConfig::default()
    };
    config.rate_limits.api_keys.insert("team-a".into(), tpm);
    let h = Harness::new(&config);
    let mut answer = completion("long");
    answer["usage"] = json!({"prompt_tokens": 3, "completion_tokens": 150, "total_tokens": 153});
    up.push(Reply::Json(StatusCode::OK, answer, vec![]));
    let resp = h.chat("sk-a").await;
    assert_eq!(resp.status(), StatusCode::OK);
    json_of(resp).await;
    // The prompt estimate (a few tokens) and 150 completion tokens: the bucket is in debt.
    let refused = h.chat("sk-a").await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(header(&refused, "ratelimit").starts_with("\"tpm\";r=0;t="));
    assert_eq!(json_of(refused).await["error"]["type"], "tokens");
    h.advance(Duration::from_secs(10));
    assert_eq!(h.chat("sk-a").await.status(), StatusCode::OK);
}

#[tokio::test]
async fn the_open_front_door_uses_the_unauthenticated_limit() {
    let up = FakeUpstream::start().await;
    let mut config = Config {
        backends: vec![backend("up", &up.url())],
        ..Config::default()
    };
    config.rate_limits.unauthenticated = Some(rpm(60, 1));
    let h = Harness::new(&config);
    assert_eq!(h.chat("anything").await.status(), StatusCode::OK);
    assert_fields(&h.chat("anything").await);
    let rendered = h.metrics.render();
    assert!(
        rendered.contains(r#"continuum_rate_limited_total{name="unauthenticated",scope="key"} 1"#),
        "{rendered}"
    );
}

/// The official SDKs get their typed `RateLimitError` and their built-in retry, honouring
/// `retry-after-ms`, succeeds once the bucket refills (`tests/fixtures/ingress/rate_limit_sdks.py`,
/// on the real clock: one request per second per key).
#[cfg(feature = "real-peers")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_sdks_get_typed_errors_and_their_retry_succeeds() {
    let mut up = FakeUpstream::start().await;
    let ok = json!({"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}});
    // openai: chat, retried chat, retried response; anthropic: message, retried message.
    for _ in 0..5 {
        up.push(Reply::Json(StatusCode::OK, ok.clone(), vec![]));
    }
    let mut config = Config {
        backends: vec![backend("up", &up.url())],
        ..Config::default()
    };
    for (key, name) in [("sk-openai", "openai"), ("sk-anthropic", "anthropic")] {
        config.api_keys.push(ApiKeyConfig {
            key: key.into(),
            name: name.into(),
            allowed_backends: None,
        });
        config.rate_limits.api_keys.insert(name.into(), rpm(60, 1));
    }
    let h = Harness::with_options(&config, ProxyOptions::default(), Arc::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let app = front_door::router(h.state.clone());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let python = std::env::var("CONTINUUM_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/ingress/rate_limit_sdks.py"
    );
    let run = tokio::process::Command::new(&python)
        .args([script, &base])
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the SDK script finishes within 120 s")
        .unwrap_or_else(|e| panic!("starting {python} (set CONTINUUM_PYTHON): {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.trim_end().ends_with("OK"),
        "the SDK script failed (needs anthropic + openai in {python}):\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Every refusal was seen by an SDK: two typed errors and at least one retried refusal for
    // openai (chat, Responses), one of each for anthropic; five answers reached the upstream.
    let rendered = h.metrics.render();
    let count = |name: &str| -> u64 {
        let series = format!("continuum_rate_limited_total{{name=\"{name}\",scope=\"key\"}} ");
        rendered
            .lines()
            .find_map(|l| l.strip_prefix(series.as_str()))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    assert!(count("openai") >= 4, "{rendered}");
    assert!(count("anthropic") >= 2, "{rendered}");
    for _ in 0..5 {
        tokio::time::timeout(Duration::from_secs(10), up.next_request())
            .await
            .expect("every admitted request reached the upstream");
    }
    assert!(
        up.try_request().is_none(),
        "a refused request reached the upstream"
    );
}
