//! The front door through `oneshot` (no socket): health, readiness, metrics, models, admin auth,
//! pin stripping, and an operator restart of one subsystem through the admin API. `/v1/models`
//! per API key also runs through a real daemon over a socket.

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use continuum_actors::lifecycle::ActorKind;
use continuum_actors::supervisor::{ChildContext, ChildSpec, spawn_root};
use continuum_actors::tree::ActorTree;
use continuum_router::front_door::{self, ApiKeySetting, AppState, ControlCommand, LiveSettings};
use continuum_router::proxy::{Proxy, ProxyOptions};
use continuum_router::readiness::Readiness;
use continuum_router::route::Router;
use http_body_util::BodyExt;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use serde_json::Value;
use tokio::sync::mpsc;
use tower::ServiceExt;

fn state_with(live: LiveSettings) -> (AppState, mpsc::Receiver<ControlCommand>) {
    let (control, rx) = mpsc::channel(4);
    let state = AppState {
        live: Arc::new(ArcSwap::from_pointee(live)),
        readiness: Readiness::new(),
        metrics: Arc::new(|| "# TYPE up gauge\nup 1\n".to_string()),
        tree: ActorTree::default(),
        control,
        dynamo_workers: Arc::new(|| serde_json::json!({"enabled": false})),
        fleet_summary: Arc::new(|| serde_json::json!({})),
        fleet_models: Arc::new(|_: &[String]| vec!["fleet-model".to_string()]),
        route: Arc::new(Router::new(Arc::new(Proxy::new(
            ProxyOptions::default(),
            None,
        )))),
    };
    (state, rx)
}

fn admin_live() -> LiveSettings {
    LiveSettings {
        admin_token: Some("s3cret".into()),
        ..LiveSettings::default()
    }
}

async fn send(state: &AppState, req: Request<Body>) -> (StatusCode, Value) {
    let resp = front_door::router(state.clone())
        .oneshot(req)
        .await
        .expect("infallible");
    let status = resp.status();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    let json = serde_json::from_slice(&bytes)
        .unwrap_or(Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, json)
}

fn get(uri: &str) -> Request<Body> {
    Request::get(uri).body(Body::empty()).expect("request")
}

#[tokio::test]
async fn health_and_readiness() {
    let (state, _rx) = state_with(LiveSettings::default());
    assert_eq!(send(&state, get("/health")).await.0, StatusCode::OK);
    state.readiness.require_exactly(["etcd:dynamo".to_string()]);
    let (status, body) = send(&state, get("/ready")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(body["pending_sources"][0], "etcd:dynamo");
    state.readiness.mark_ready("etcd:dynamo");
    assert_eq!(send(&state, get("/ready")).await.0, StatusCode::OK);
}

#[tokio::test]
async fn metrics_are_prometheus_text() {
    let (state, _rx) = state_with(LiveSettings::default());
    let resp = front_door::router(state)
        .oneshot(get("/metrics"))
        .await
        .expect("ok");
    assert_eq!(resp.status(), StatusCode::OK);
    let ct = resp.headers()["content-type"]
        .to_str()
        .expect("ascii")
        .to_string();
    assert!(ct.starts_with("text/plain; version=0.0.4"), "{ct}");
}

#[tokio::test]
async fn models_merge_backends_and_fleet_and_honour_api_keys() {
    let live = LiveSettings {
        api_keys: vec![ApiKeySetting {
            key: "k1".into(),
            name: "team".into(),
            allowed_backends: vec![],
        }],
        models: vec!["b-model".into()],
        ..LiveSettings::default()
    };
    let (state, _rx) = state_with(live);
    assert_eq!(
        send(&state, get("/v1/models")).await.0,
        StatusCode::UNAUTHORIZED
    );
    let req = Request::get("/v1/models")
        .header("authorization", "Bearer k1")
        .body(Body::empty())
        .expect("request");
    let (status, body) = send(&state, req).await;
    assert_eq!(status, StatusCode::OK);
    let ids: Vec<_> = body["data"]
        .as_array()
        .expect("list")
        .iter()
        .map(|m| m["id"].clone())
        .collect();
    assert_eq!(
        ids,
        vec![Value::from("b-model"), Value::from("fleet-model")]
    );
}

#[tokio::test]
async fn admin_routes_need_the_bearer_token() {
    let (state, _rx) = state_with(LiveSettings::default());
    assert_eq!(
        send(&state, get("/admin/subsystems")).await.0,
        StatusCode::FORBIDDEN
    );
    let (state, _rx) = state_with(admin_live());
    assert_eq!(
        send(&state, get("/admin/subsystems")).await.0,
        StatusCode::UNAUTHORIZED
    );
    let wrong = Request::get("/admin/subsystems")
        .header("authorization", "Bearer nope")
        .body(Body::empty())
        .expect("request");
    assert_eq!(send(&state, wrong).await.0, StatusCode::UNAUTHORIZED);
    let right = Request::get("/admin/dynamo/workers")
        .header("authorization", "Bearer s3cret")
        .body(Body::empty())
        .expect("request");
    let (status, body) = send(&state, right).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["enabled"], false);
}

#[tokio::test]
async fn admin_reload_is_forwarded_and_refusals_are_409() {
    let (state, mut rx) = state_with(admin_live());
    tokio::spawn(async move {
        let mut n = 0;
        while let Some(ControlCommand::Reload(reply)) = rx.recv().await {
            n += 1;
            let _ = reply.send(if n == 1 {
                Ok("no changes".into())
            } else {
                Err("bad yaml".into())
            });
        }
    });
    let post = || {
        Request::post("/admin/config/reload")
            .header("authorization", "Bearer s3cret")
            .body(Body::empty())
            .expect("request")
    };
    assert_eq!(send(&state, post()).await.0, StatusCode::OK);
    let (status, body) = send(&state, post()).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(
        body["error"]["message"]
            .as_str()
            .expect("msg")
            .contains("bad yaml")
    );
}

struct Idle;
impl Actor for Idle {
    type Msg = ();
    type State = ();
    type Arguments = mpsc::UnboundedSender<String>;
    async fn pre_start(
        &self,
        myself: ActorRef<()>,
        started: Self::Arguments,
    ) -> Result<(), ActorProcessingErr> {
        let _ = started.send(myself.get_id().to_string());
        Ok(())
    }
}

#[tokio::test]
async fn admin_restart_restarts_one_subsystem_and_lists_the_tree() {
    let (mut state, _rx) = state_with(admin_live());
    let (tx, mut started) = mpsc::unbounded_channel();
    let child = |name: &str| {
        let tx = tx.clone();
        ChildSpec::new(name, ActorKind::Registry, move |ctx: ChildContext| {
            let tx = tx.clone();
            async move {
                Ok(Actor::spawn_linked(None, Idle, tx, ctx.supervisor)
                    .await?
                    .0
                    .get_cell())
            }
        })
    };
    let tree = ActorTree::default();
    let (root, handle) = spawn_root(
        vec![
            child("registry"),
            ChildSpec::supervisor(
                "discovery",
                ActorKind::DiscoverySupervisor,
                vec![child("etcd:dynamo")],
            ),
        ],
        tree.clone(),
        None,
    )
    .await
    .expect("root");
    state.tree = tree.clone();
    for _ in 0..2 {
        started.recv().await.expect("started");
    }
    let auth = |r: axum::http::request::Builder| r.header("authorization", "Bearer s3cret");
    let (status, body) = send(
        &state,
        auth(Request::get("/admin/subsystems"))
            .body(Body::empty())
            .expect("req"),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let ids: Vec<_> = body["subsystems"]
        .as_array()
        .expect("rows")
        .iter()
        .map(|r| r["id"].clone())
        .collect();
    assert_eq!(ids.len(), 4);

    let req = auth(Request::post(
        "/admin/subsystems/root/discovery/etcd:dynamo/restart",
    ))
    .body(Body::empty())
    .expect("req");
    let (status, body) = send(&state, req).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["subsystem"]["restarts"], 1);
    tokio::time::timeout(Duration::from_secs(10), started.recv())
        .await
        .expect("restarted")
        .expect("alive");
    assert_eq!(tree.get("root/registry").expect("row").restarts, 0);

    let req = auth(Request::post("/admin/subsystems/root/nothing/restart"))
        .body(Body::empty())
        .expect("req");
    assert_eq!(send(&state, req).await.0, StatusCode::NOT_FOUND);
    root.stop(None);
    handle.await.expect("stopped");
}

#[tokio::test]
async fn client_pin_headers_never_reach_a_handler() {
    use axum::routing::get as route_get;
    let app = axum::Router::new()
        .route(
            "/echo",
            route_get(|headers: axum::http::HeaderMap| async move {
                headers
                    .keys()
                    .map(|k| k.as_str().to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            }),
        )
        .layer(axum::middleware::from_fn(
            front_door::strip::strip_client_pins,
        ));
    let req = Request::get("/echo")
        .header("x-dynamo-worker-instance-id", "7")
        .header("x-worker-instance-id", "7")
        .header("x-prefill-instance-id", "8")
        .header("x-backend", "")
        .body(Body::empty())
        .expect("req");
    let resp = app.oneshot(req).await.expect("ok");
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(std::str::from_utf8(&body).expect("utf8"), "x-backend");
}

/// `GET /v1/models` lists only what the key's `allowed_backends` can reach (before the fix a
/// limited key saw every backend's models).
#[tokio::test]
async fn models_follow_the_keys_allowed_backends_over_a_socket() {
    let yaml = "server:\n  bind_address: \"127.0.0.1:0\"\n\
        api_keys:\n  - {key: key-all-backends, name: all}\n  \
        - {key: key-only-a, name: only-a, allowed_backends: [a]}\n\
        backends:\n  - {name: a, type: openai, url: \"http://127.0.0.1:9\", models: [model-a], \
        health_check: {enabled: false}}\n  \
        - {name: b, type: openai, url: \"http://127.0.0.1:9\", models: [model-b], \
        health_check: {enabled: false}}\n";
    let daemon = support::daemon::start(yaml).await;
    let client = reqwest::Client::new();
    let list = |key: &'static str| {
        let req = client
            .get(format!("http://{}/v1/models", daemon.local_addr()))
            .bearer_auth(key);
        async move {
            let body: Value = req
                .send()
                .await
                .expect("models")
                .json()
                .await
                .expect("json");
            body["data"]
                .as_array()
                .expect("list")
                .iter()
                .map(|m| m["id"].as_str().expect("id").to_owned())
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(list("key-all-backends").await, ["model-a", "model-b"]);
    assert_eq!(list("key-only-a").await, ["model-a"]);
    daemon.shutdown().await;
}

/// Every answer counts once in `continuum_http_requests_total` under its matched route: the
/// surface routes through the front door's middleware, the OpenAI routes in their handlers
/// (with a duration), a path no route matches as `unmatched`.
#[tokio::test]
async fn every_answer_is_counted_once_under_its_route() {
    use continuum_router::http_metrics::{HttpMetrics, HttpRoute};
    use prometheus::{Encoder, Registry, TextEncoder};

    let registry = Registry::new();
    let http = HttpMetrics::register(&registry).expect("register");
    let (mut state, _rx) = state_with(LiveSettings::default());
    state.route = Arc::new(
        Router::new(Arc::new(Proxy::new(ProxyOptions::default(), None))).with_http_metrics(http),
    );
    assert_eq!(send(&state, get("/health")).await.0, StatusCode::OK);
    assert_eq!(send(&state, get("/health")).await.0, StatusCode::OK);
    assert_eq!(send(&state, get("/metrics")).await.0, StatusCode::OK);
    assert_eq!(send(&state, get("/nowhere")).await.0, StatusCode::NOT_FOUND);
    // Without an admin token the admin API is closed (403), and counted so.
    assert_eq!(
        send(&state, get("/admin/subsystems")).await.0,
        StatusCode::FORBIDDEN
    );
    let chat = Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Body::from(r#"{"model":"nobody-serves-it","messages":[]}"#))
        .expect("request");
    assert_eq!(send(&state, chat).await.0, StatusCode::NOT_FOUND);

    let mut text = Vec::new();
    TextEncoder::new()
        .encode(&registry.gather(), &mut text)
        .expect("encode");
    let text = String::from_utf8(text).expect("utf-8");
    let count = |route: HttpRoute, class: &str| {
        let series = format!(
            "continuum_http_requests_total{{route=\"{}\",status_class=\"{class}\"}} ",
            route.as_label()
        );
        text.lines()
            .find_map(|l| l.strip_prefix(series.as_str()))
            .map(|v| v.parse::<f64>().expect("a number"))
    };
    assert_eq!(count(HttpRoute::Health, "2xx"), Some(2.0));
    assert_eq!(count(HttpRoute::Metrics, "2xx"), Some(1.0));
    assert_eq!(count(HttpRoute::Unmatched, "4xx"), Some(1.0));
    assert_eq!(count(HttpRoute::Admin, "4xx"), Some(1.0));
    assert_eq!(
        count(HttpRoute::ChatCompletions, "4xx"),
        Some(1.0),
        "{text}"
    );
    assert!(
        text.contains(
            r#"continuum_http_request_duration_seconds_count{route="chat_completions"} 1"#
        ),
        "the OpenAI route counts its duration once"
    );
}
