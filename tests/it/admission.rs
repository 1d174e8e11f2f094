//! `admission` end to end through the real `front_door::router` (oneshot), the Dynamo shim path
//! over an in-process registry of two decode workers (100 KV blocks each) and load samples
//! written into the shared store as the subscriptions write them (`support::busy_fleet`, which
//! the admission bench shares): a request waits while every
//! worker is over `busy_threshold.kv_usage` and goes once a fresh sample shows room; a full queue
//! and `max_wait` are 503 `fleet_busy` with `Retry-After` in each ingress's shape; a client that
//! goes away leaves the queue at once (counted); a reload changes the bounds and keeps the
//! waiting requests. Tests that dispatch run on the real clock (the fake shim answers over
//! loopback); the others on tokio's paused clock.

use std::sync::Arc;
use std::time::Duration;

use crate::support::busy_fleet::{BusyFleet, config_yaml};
use crate::support::paused::settle;
use crate::support::upstream::FakeUpstream;
use arc_swap::ArcSwap;
use axum::body::Body;
use axum::http::{Request, Response, StatusCode};
use continuum_actors::metrics::Metrics;
use continuum_actors::picker::SharedPicker;
use continuum_actors::tree::ActorTree;
use continuum_router::config::{Config, ProcessEnv};
use continuum_router::front_door::{self, AppState};
use continuum_router::proxy::{Proxy, ProxyOptions};
use continuum_router::readiness::Readiness;
use continuum_router::route::Router;
use continuum_router::route::dynamo::ShimRouter;
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tower::ServiceExt;

pub(crate) const NS: &str = "admns";
pub(crate) const MODEL: &str = "tiny";
const WORKERS: [u64; 2] = [0x51, 0x52];

/// The config: the fake upstream as the namespace's one shim replica, `admission` from
/// `admission` (YAML flow map), samples fresh for a minute (longer than any wait here).
pub(crate) fn config(shim: &str, admission: &str) -> Config {
    config_with(shim, admission, "")
}

/// [`config`] with `extra` top-level YAML.
fn config_with(shim: &str, admission: &str, extra: &str) -> Config {
    let yaml = format!("{}{extra}", config_yaml(NS, MODEL, shim, "60s", admission));
    Config::from_yaml_str_validated(&yaml, &ProcessEnv)
        .expect("test config")
        .config
}

pub(crate) struct Harness {
    pub(crate) state: AppState,
    proxy: Arc<Proxy>,
    route: Arc<Router>,
    config: Arc<ArcSwap<Config>>,
    fleet: BusyFleet,
    metrics: Metrics,
}

impl Harness {
    pub(crate) async fn new(config: Config) -> Self {
        let fleet = BusyFleet::start(NS, MODEL, &WORKERS).await;
        let metrics = Metrics::new("admission-test").expect("metrics");
        let shared = Arc::new(ArcSwap::from_pointee(config.clone()));
        let dynamo = ShimRouter::with_picker(
            shared.clone(),
            fleet.reader.clone(),
            fleet.load.clone(),
            SharedPicker::new(),
            Some(metrics.clone()),
        );
        let proxy = Arc::new(Proxy::new(ProxyOptions::default(), Some(metrics.clone())));
        proxy.reconfigure(&config);
        let route = Arc::new(Router::new(proxy.clone()));
        route.set_dynamo(Arc::new(dynamo));
        let (control, _rx) = mpsc::channel(1);
        let state = AppState {
            live: Arc::new(ArcSwap::from_pointee(
                continuum_router::daemon::live_settings(&config),
            )),
            readiness: Readiness::new(),
            metrics: Arc::new(String::new),
            tree: ActorTree::default(),
            control,
            dynamo_workers: Arc::new(|| json!({})),
            fleet_summary: Arc::new(|| json!({})),
            fleet_models: Arc::new(|_: &[String]| Vec::new()),
            route: route.clone(),
        };
        Harness {
            state,
            proxy,
            route,
            config: shared,
            fleet,
            metrics,
        }
    }

    /// Publishes one sample per worker: `blocks[i]` active decode blocks of 100.
    pub(crate) fn publish(&self, blocks: [u64; 2]) {
        self.fleet.publish(|i| blocks[i]);
    }

    fn reload(&self, config: &Config) {
        self.config.store(Arc::new(config.clone()));
        self.state
            .live
            .store(Arc::new(continuum_router::daemon::live_settings(config)));
        self.proxy.reconfigure(config);
    }

    fn depth(&self) -> usize {
        self.route.admission().depth(MODEL)
    }

    /// A request on `path` answered in a task (the caller may drop it, as a client going away).
    fn spawn(&self, path: &'static str, body: Value) -> JoinHandle<Response<Body>> {
        let router = front_door::router(self.state.clone());
        tokio::spawn(async move {
            let req = Request::post(path)
                .header("content-type", "application/json")
                .body(Body::from(body.to_string()))
                .expect("request");
            router.oneshot(req).await.expect("infallible")
        })
    }

    fn chat(&self) -> JoinHandle<Response<Body>> {
        let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hello"}]});
        self.spawn("/v1/chat/completions", body)
    }

    /// The value of the series `series` (its exact text before the value).
    pub(crate) fn metric(&self, series: &str) -> f64 {
        let rendered = self.metrics.render();
        rendered
            .lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .map_or(0.0, |v| v.trim().parse().expect("a number"))
    }
}

/// Yields until `ready` holds (bounded by a real-time timeout, never a sleep).
pub(crate) async fn until(what: &str, mut ready: impl FnMut() -> bool) {
    let wait = async {
        while !ready() {
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(20), wait)
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"));
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

pub(crate) const BUSY: [u64; 2] = [95, 90];

#[tokio::test]
async fn a_request_waits_while_every_worker_is_busy_and_goes_on_a_fresh_sample_with_room() {
    let mut shim = FakeUpstream::start().await;
    let h = Harness::new(config(&shim.url(), "{busy_threshold: {kv_usage: 0.9}}")).await;
    // Room on one worker: dispatched at once.
    h.publish([95, 10]);
    let resp = h.chat().await.expect("join");
    assert_eq!(resp.status(), StatusCode::OK);
    shim.next_request().await;

    h.publish(BUSY);
    let waiting = h.chat();
    until("the request to queue", || h.depth() == 1).await;
    settle().await;
    assert!(shim.try_request().is_none(), "dispatched while busy");
    assert!(!waiting.is_finished());
    assert_eq!(
        h.metric(r#"continuum_admission_queue_depth{model="tiny"}"#),
        1.0
    );
    // A sample that only confirms the load changes nothing.
    h.publish(BUSY);
    settle().await;
    assert_eq!(h.depth(), 1);
    h.publish([95, 40]);
    let resp = waiting.await.expect("join");
    assert_eq!(resp.status(), StatusCode::OK);
    let seen = shim.next_request().await;
    assert_eq!(seen.path, "/v1/chat/completions");
    assert_eq!(h.depth(), 0);
    assert_eq!(
        h.metric(r#"continuum_admission_queue_depth{model="tiny"}"#),
        0.0
    );
    assert_eq!(
        h.metric(r#"continuum_admission_wait_seconds_count{class="normal",outcome="dispatched"}"#),
        1.0
    );
}

#[tokio::test]
async fn without_a_threshold_a_busy_fleet_is_dispatched_at_once() {
    let mut shim = FakeUpstream::start().await;
    let h = Harness::new(config(&shim.url(), "{queue: {max_depth: 0}}")).await;
    h.publish([100, 100]);
    let resp = h.chat().await.expect("join");
    assert_eq!(resp.status(), StatusCode::OK);
    shim.next_request().await;
    assert_eq!(
        h.metric(r#"continuum_admission_shed_total{class="normal",reason="queue_full"}"#),
        0.0
    );
}

#[tokio::test(start_paused = true)]
async fn a_full_queue_is_503_fleet_busy_with_retry_after_in_each_ingress_shape() {
    let shim = FakeUpstream::start().await;
    let admission = "{busy_threshold: {kv_usage: 0.9}, queue: {max_depth: 1, max_wait: 20s}}";
    let h = Harness::new(config(&shim.url(), admission)).await;
    h.publish(BUSY);
    let first = h.chat();
    settle().await;
    assert_eq!(h.depth(), 1);

    let refused = h.chat().await.expect("join");
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(header(&refused, "retry-after"), "20");
    assert_eq!(header(&refused, "retry-after-ms"), "20000");
    let body = json_of(refused).await;
    assert_eq!(body["error"]["code"], "fleet_busy");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("queue is full")),
        "{body}"
    );

    let anthropic = json!({"model": MODEL, "max_tokens": 8,
                           "messages": [{"role": "user", "content": "hi"}]});
    let refused = h.spawn("/v1/messages", anthropic).await.expect("join");
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(header(&refused, "retry-after"), "20");
    let body = json_of(refused).await;
    assert_eq!(body["type"], "error");
    assert_eq!(body["error"]["type"], "overloaded_error");

    let responses = json!({"model": MODEL, "input": "hi"});
    let refused = h.spawn("/v1/responses", responses).await.expect("join");
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(header(&refused, "retry-after"), "20");
    let body = json_of(refused).await;
    assert_eq!(body["error"]["code"], "fleet_busy");
    assert_eq!(body["error"]["type"], "server_error");

    assert_eq!(
        h.metric(r#"continuum_admission_shed_total{class="normal",reason="queue_full"}"#),
        3.0
    );
    assert_eq!(h.depth(), 1, "refusals never touch the waiting request");
    first.abort();
    settle().await;
    assert_eq!(h.depth(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_request_that_waits_max_wait_is_503_fleet_busy() {
    let shim = FakeUpstream::start().await;
    let admission = "{busy_threshold: {kv_usage: 0.9}, queue: {max_wait: 5s}}";
    let h = Harness::new(config(&shim.url(), admission)).await;
    h.publish(BUSY);
    let start = tokio::time::Instant::now();
    let refused = h.chat().await.expect("join");
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_secs(5) && waited < Duration::from_secs(6),
        "{waited:?}"
    );
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(header(&refused, "retry-after"), "5");
    let body = json_of(refused).await;
    assert_eq!(body["error"]["code"], "fleet_busy");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("max_wait")),
        "{body}"
    );
    assert_eq!(h.depth(), 0);
    assert_eq!(
        h.metric(r#"continuum_admission_shed_total{class="normal",reason="max_wait"}"#),
        1.0
    );
    assert_eq!(
        h.metric(r#"continuum_admission_wait_seconds_count{class="normal",outcome="shed"}"#),
        1.0
    );
}

#[tokio::test(start_paused = true)]
async fn a_client_that_goes_away_leaves_the_queue_at_once() {
    let shim = FakeUpstream::start().await;
    let admission = "{busy_threshold: {kv_usage: 0.9}, queue: {max_depth: 2, max_wait: 60s}}";
    let h = Harness::new(config(&shim.url(), admission)).await;
    h.publish(BUSY);
    let head = h.chat();
    settle().await;
    let behind = h.chat();
    settle().await;
    assert_eq!(h.depth(), 2);
    // The head's client goes away: its place is freed at once, for a new arrival too.
    head.abort();
    settle().await;
    assert_eq!(h.depth(), 1);
    assert_eq!(h.metric("continuum_admission_abandoned_total"), 1.0);
    let third = h.chat();
    settle().await;
    assert_eq!(h.depth(), 2);
    behind.abort();
    third.abort();
    settle().await;
    assert_eq!(h.depth(), 0);
    assert_eq!(h.metric("continuum_admission_abandoned_total"), 3.0);
    assert_eq!(
        h.metric(r#"continuum_admission_queue_depth{model="tiny"}"#),
        0.0
    );
    assert_eq!(
        h.metric(r#"continuum_admission_shed_total{class="normal",reason="max_wait"}"#),
        0.0
    );
}

#[tokio::test]
async fn a_reload_changes_the_bounds_and_keeps_the_waiting_requests() {
    let mut shim = FakeUpstream::start().await;
    let at = |depth: usize| {
        format!(
            "{{busy_threshold: {{kv_usage: 0.9}}, queue: {{max_depth: {depth}, max_wait: 60s}}}}"
        )
    };
    let h = Harness::new(config(&shim.url(), &at(1))).await;
    h.publish(BUSY);
    let first = h.chat();
    until("the first request to queue", || h.depth() == 1).await;
    let refused = h.chat().await.expect("join");
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);

    h.reload(&config(&shim.url(), &at(3)));
    assert_eq!(h.depth(), 1, "the reload kept the waiting request");
    let second = h.chat();
    until("the second request to queue", || h.depth() == 2).await;
    settle().await;
    assert!(shim.try_request().is_none(), "dispatched while busy");

    // Room on both workers: both go, in arrival order.
    h.publish([10, 10]);
    assert_eq!(first.await.expect("join").status(), StatusCode::OK);
    assert_eq!(second.await.expect("join").status(), StatusCode::OK);
    shim.next_request().await;
    shim.next_request().await;
    assert_eq!(h.depth(), 0);
    assert_eq!(
        h.metric(r#"continuum_admission_wait_seconds_count{class="normal",outcome="dispatched"}"#),
        2.0
    );
}

/// Keys for the priority test: `ops` is high, the others the default (normal).
fn priority_config(shim: &str) -> Config {
    config_with(
        shim,
        "{busy_threshold: {kv_usage: 0.9}, queue: {max_wait: 60s}, \
         priority: {api_keys: {ops: high}, selectable: {steady: [high]}}}",
        "api_keys:\n  - {name: ops, key: sk-ops}\n  - {name: flood, key: sk-flood}\n  \
         - {name: steady, key: sk-steady}\n",
    )
}

impl Harness {
    /// A chat request of the key `sk-{key}`, asking for the class `asked` when given.
    fn chat_as(&self, key: &str, asked: Option<&'static str>) -> JoinHandle<Response<Body>> {
        let router = front_door::router(self.state.clone());
        let auth = format!("Bearer sk-{key}");
        tokio::spawn(async move {
            let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hello"}]});
            let req = Request::post("/v1/chat/completions")
                .header("content-type", "application/json")
                .header("x-continuum-priority", asked.unwrap_or("normal"))
                .header("authorization", auth)
                .body(Body::from(body.to_string()))
                .expect("request");
            router.oneshot(req).await.expect("infallible")
        })
    }
}

#[tokio::test]
async fn a_better_class_goes_first_a_selected_class_applies_and_keys_of_a_class_take_turns() {
    let mut shim = FakeUpstream::start().await;
    let h = Harness::new(priority_config(&shim.url())).await;
    h.publish(BUSY);
    let mut waiting = Vec::new();
    // `flood` asks for high but may not select it; `steady` may, and asks for its second request
    // only.
    let arrivals = [
        ("flood", Some("high")),
        ("flood", None),
        ("steady", None),
        ("flood", None),
        ("steady", Some("high")),
        ("ops", None),
    ];
    for (i, (key, asked)) in arrivals.into_iter().enumerate() {
        waiting.push((key, h.chat_as(key, asked)));
        until("the request to queue", || h.depth() == i + 1).await;
    }
    // One rank just under the threshold: each sample lets one request through (its dispatch
    // counts on the rank until the next sample answers it).
    let mut order = Vec::new();
    while !waiting.is_empty() {
        h.publish([89, 95]);
        let left = waiting.len();
        until("one dispatch", || h.depth() == left - 1).await;
        shim.next_request().await;
        until("the answer", || {
            waiting.iter().any(|(_, j)| j.is_finished())
        })
        .await;
        assert_eq!(h.depth(), left - 1, "one request per sample with room");
        let at = waiting
            .iter()
            .position(|(_, j)| j.is_finished())
            .expect("one answered");
        let (key, handle) = waiting.remove(at);
        assert_eq!(handle.await.expect("join").status(), StatusCode::OK);
        order.push(key);
    }
    // High first (steady's selected request, then ops: rotation order), then the normal keys
    // taking turns, each in its own arrival order.
    assert_eq!(
        order,
        ["steady", "ops", "flood", "steady", "flood", "flood"]
    );
    // The wait is counted by the request's class (`flood`'s unselectable ask stays normal).
    for (class, n) in [("high", 2.0), ("normal", 4.0), ("low", 0.0)] {
        assert_eq!(
            h.metric(&format!(
                r#"continuum_admission_wait_seconds_count{{class="{class}",outcome="dispatched"}}"#
            )),
            n,
            "{class}"
        );
    }
}
