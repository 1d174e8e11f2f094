//! The HTTP front door: health, readiness, metrics, the OpenAI-wire surface and the admin API.
//!
//! Handlers read immutable snapshots (`LiveSettings`, the fleet registry) through `ArcSwap`
//! and reach actors only through typed handles; they never see raw actor messages.
//!
//! The request path starts here: the global middleware strips pin headers, [`admit`]
//! authenticates and reads the bounded body, and `crate::route` takes it from there.

pub mod admin;
pub mod admin_config;
use crate::http_metrics::HttpRoute;
pub use crate::wire::error;
pub mod ingress;
pub mod serve;
pub mod strip;
pub mod ui;

use std::future::Future;
use std::sync::Arc;

use arc_swap::ArcSwap;
use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use continuum_actors::tree::ActorTree;
use serde_json::json;
use tokio::sync::{mpsc, oneshot};

use crate::build_info::Features;
use crate::proxy::OpenAiRoute;
use crate::proxy::body::read_bounded;
use crate::readiness::Readiness;
use crate::route::Caller;
use error::ApiError;

/// One API key and the backends it may use (empty = all).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiKeySetting {
    pub key: String,
    pub name: String,
    pub allowed_backends: Vec<String>,
}

/// Settings the front door reads per request; swapped whole on reload (immediate class).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LiveSettings {
    /// Bearer token for `/admin/*`; `None` disables the admin API.
    pub admin_token: Option<String>,
    /// Client keys; empty means the OpenAI surface is open.
    pub api_keys: Vec<ApiKeySetting>,
    /// Model ids served by configured, enabled, non-internal backends.
    pub models: Vec<String>,
    /// The same, per backend name: what a key limited by `allowed_backends` may list.
    pub backend_models: Vec<(String, Vec<String>)>,
}

/// Commands from the admin API to the daemon's control loop.
#[derive(Debug)]
pub enum ControlCommand {
    /// Re-read the config file now; answers with a summary or the refusal reason.
    Reload(oneshot::Sender<Result<String, String>>),
    /// `GET /admin/config`: the running config (the handler masks it).
    Config(oneshot::Sender<Box<crate::config::Config>>),
    /// `PUT`/`POST /admin/config`: validate, restore masked secrets, write the file, reload.
    Import(String, admin_config::ImportReply),
}

pub type MetricsRender = Arc<dyn Fn() -> String + Send + Sync>;
pub type JsonView = Arc<dyn Fn() -> serde_json::Value + Send + Sync>;
/// Fleet model ids reachable under a key's `allowed_backends` (empty = all).
pub type FleetModels = Arc<dyn Fn(&[String]) -> Vec<String> + Send + Sync>;

/// Everything handlers need, cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub live: Arc<ArcSwap<LiveSettings>>,
    pub readiness: Readiness,
    pub metrics: MetricsRender,
    pub tree: ActorTree,
    pub control: mpsc::Sender<ControlCommand>,
    /// `GET /admin/dynamo/workers`.
    pub dynamo_workers: JsonView,
    /// `GET /admin/fleet/summary` (the fleet page's counters and KV blocks per rank).
    pub fleet_summary: JsonView,
    /// Model ids the discovered fleet serves, merged into `GET /v1/models`; the argument is the
    /// key's `allowed_backends` (empty = all), which limits the list to namespaces whose shim
    /// replicas the key may use.
    pub fleet_models: FleetModels,
    /// The request path behind `POST /v1/chat/completions` and `POST /v1/completions`: the
    /// orchestrator over the proxy (`route::Router::new(proxy)`).
    pub route: Arc<crate::route::Router>,
}

/// The front door's listener: every accepted connection gets `TCP_NODELAY`. Without it a
/// streamed (SSE) response, written as several small chunks, waits for the client's delayed ACK
/// (Nagle): about 40 ms per exchange on Linux loopback.
pub fn listener(
    listener: tokio::net::TcpListener,
) -> impl axum::serve::Listener<Io = tokio::net::TcpStream, Addr = std::net::SocketAddr> {
    use axum::serve::ListenerExt;
    listener.tap_io(|tcp| configure_accepted(tcp))
}

/// Fewest and most connections the front door's accept queue holds ([`bind`]).
const MIN_BACKLOG: usize = 511;
const MAX_BACKLOG: usize = 65_535;

/// The front door's listening socket, its accept queue sized for `max_connections` (within
/// 511–65,535; the kernel caps it at `net.core.somaxconn`).
///
/// Not `TcpListener::bind`: it listens with a queue of 128 (std's and mio's value), and a burst
/// of more new connections than the queue holds overflows it: the kernel drops their SYNs, and
/// each of those clients resends only after a second (then 3 s, 7 s). Measured
/// (docs/performance.md, "Many concurrent streams"): 2,000 streams opened at once took a second
/// longer than through nginx, which listens with 511.
pub fn bind(
    addr: std::net::SocketAddr,
    max_connections: usize,
) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As `TcpListener::bind` does: a restarted router rebinds at once.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    let backlog = max_connections.clamp(MIN_BACKLOG, MAX_BACKLOG);
    socket.listen(u32::try_from(backlog).unwrap_or(u32::MAX))
}

/// What every accepted client socket gets (both [`listener`] and [`serve::serve`]).
pub fn configure_accepted(tcp: &tokio::net::TcpStream) {
    if let Err(error) = tcp.set_nodelay(true) {
        tracing::debug!(%error, "Could not set TCP_NODELAY on a client connection.");
    }
}

/// The whole router, with the always-on pin-stripping middleware outermost, for the compiled
/// features.
pub fn router(state: AppState) -> Router {
    router_for(state, Features::COMPILED)
}

/// [`router`] for `features`: without `dynamo` the Dynamo routes (`/admin/dynamo/*`, the fleet
/// page and its summary) are not registered and answer 404 like any unknown path.
pub fn router_for(state: AppState, features: Features) -> Router {
    let admin = admin::routes(state.clone(), features.within_compiled());
    let router = Router::new()
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(ingress::anthropic_messages))
        .route("/anthropic/v1/messages", post(ingress::anthropic_messages))
        .route("/v1/responses", post(ingress::responses))
        .route("/v1/responses/compact", post(ingress::responses_compact))
        .merge(admin);
    let router = if features.within_compiled().dynamo {
        router.merge(ui::routes())
    } else {
        router
    };
    router
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            count_surface_routes,
        ))
        .layer(middleware::from_fn(strip::strip_client_pins))
        .with_state(state)
}

/// The hot routes the connection layer ([`serve::serve`]) dispatches itself, without axum's
/// router and its middleware stack: `POST /v1/chat/completions` and `POST /v1/completions` (a
/// path without its query). Any other method or path (a `GET` on these paths: 405) goes through
/// [`router`].
pub fn hot_route(method: &str, path: &str) -> Option<OpenAiRoute> {
    if method != "POST" {
        return None;
    }
    match path {
        "/v1/chat/completions" => Some(OpenAiRoute::ChatCompletions),
        "/v1/completions" => Some(OpenAiRoute::Completions),
        _ => None,
    }
}

/// The connection layer's handler: the hot routes ([`hot_route`]), served by [`serve_hot`].
impl serve::Handler for AppState {
    type Route = OpenAiRoute;

    fn route(&self, method: &str, path: &str) -> Option<OpenAiRoute> {
        hot_route(method, path)
    }

    fn max_body(&self) -> usize {
        self.route.max_request_body_bytes()
    }

    fn serve(
        &self,
        route: OpenAiRoute,
        headers: HeaderMap,
        body: Body,
    ) -> impl Future<Output = Response> + Send {
        serve_hot(self, route, headers, body)
    }
}

/// A hot route ([`hot_route`]) served directly: what [`router`] does for it, as plain calls, and
/// the one entrance to the OpenAI handler, whichever server took the request (the connection
/// layer's [`serve::Handler`], and the router's own routes for these paths). The pin headers are
/// stripped from the request and the answer (the global middleware [`strip::strip_client_pins`]),
/// the handler [`openai`] admits, routes and counts it (the surface-route middleware counts
/// nothing for these routes), and the client's headers are moved, not cloned as axum's
/// `HeaderMap` extractor does.
pub async fn serve_hot(
    state: &AppState,
    route: OpenAiRoute,
    mut headers: HeaderMap,
    body: Body,
) -> Response {
    strip::strip_request_pins(&mut headers);
    let mut response = openai(state, route, headers, body).await;
    crate::wire::pins::strip_pin_headers(response.headers_mut());
    response
}

/// The `continuum_http_requests_total` route of a matched path, for the routes that do not count
/// themselves: the OpenAI and ingress routes count in their handlers (with the time to response
/// headers), so they are `None` here. No matched path (the fallback's 404) is `Unmatched`.
pub fn surface_route(matched: Option<&str>) -> Option<HttpRoute> {
    let Some(path) = matched else {
        return Some(HttpRoute::Unmatched);
    };
    match path {
        "/health" => Some(HttpRoute::Health),
        "/ready" => Some(HttpRoute::Ready),
        "/metrics" => Some(HttpRoute::Metrics),
        "/v1/models" => Some(HttpRoute::Models),
        "/admin/dynamo/workers" => Some(HttpRoute::AdminDynamoWorkers),
        admin if admin.starts_with("/admin") => Some(HttpRoute::Admin),
        _ => None,
    }
}

/// Counts every answer of the routes [`surface_route`] names (health, readiness, metrics,
/// models, admin, unmatched).
async fn count_surface_routes(
    State(state): State<AppState>,
    req: axum::extract::Request,
    next: middleware::Next,
) -> Response {
    let route = surface_route(
        req.extensions()
            .get::<axum::extract::MatchedPath>()
            .map(axum::extract::MatchedPath::as_str),
    );
    let response = next.run(req).await;
    if let Some(route) = route {
        state.route.count(route, response.status());
    }
    response
}

async fn health() -> impl IntoResponse {
    axum::Json(json!({"status": "ok"}))
}

async fn ready(State(state): State<AppState>) -> Response {
    if state.readiness.is_ready() {
        (StatusCode::OK, axum::Json(json!({"status": "ready"}))).into_response()
    } else {
        let pending = state.readiness.pending();
        (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "not_ready", "pending_sources": pending})),
        )
            .into_response()
    }
}

async fn metrics(State(state): State<AppState>) -> Response {
    let body = (state.metrics)();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

/// Checks the client's API key when keys are configured; returns the key's policy.
pub fn authenticate_client(
    live: &LiveSettings,
    headers: &HeaderMap,
) -> Result<Option<ApiKeySetting>, ApiError> {
    if live.api_keys.is_empty() {
        return Ok(None);
    }
    let presented = bearer(headers).ok_or(ApiError::Unauthenticated)?;
    live.api_keys
        .iter()
        .find(|k| constant_time_eq(k.key.as_bytes(), presented.as_bytes()))
        .cloned()
        .map(Some)
        .ok_or(ApiError::Unauthenticated)
}

async fn models(State(state): State<AppState>, headers: HeaderMap) -> Result<Response, ApiError> {
    let live = state.live.load();
    let key = authenticate_client(&live, &headers)?;
    // A key limited by `allowed_backends` lists only what it can reach.
    let allowed = key
        .as_ref()
        .map_or(&[][..], |k| k.allowed_backends.as_slice());
    let mut ids: Vec<String> = if allowed.is_empty() {
        live.models.clone()
    } else {
        live.backend_models
            .iter()
            .filter(|(backend, _)| allowed.contains(backend))
            .flat_map(|(_, models)| models.iter().cloned())
            .collect()
    };
    ids.extend((state.fleet_models)(allowed));
    ids.sort();
    ids.dedup();
    let data: Vec<_> = ids
        .into_iter()
        .map(|id| json!({"id": id, "object": "model", "owned_by": "continuum-router"}))
        .collect();
    Ok(axum::Json(json!({"object": "list", "data": data})).into_response())
}

// The OpenAI-wire routes: the front door admits the request (API key, bounded body) and hands
// it to `crate::route`, which routes and relays it.

async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    serve_hot(&state, OpenAiRoute::ChatCompletions, headers, body).await
}

async fn completions(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    serve_hot(&state, OpenAiRoute::Completions, headers, body).await
}

/// One OpenAI-wire request: [`admit`], then [`crate::route::Router::serve`]; counted in
/// `continuum_http_requests_total` whatever the answer.
async fn openai(state: &AppState, route: OpenAiRoute, headers: HeaderMap, body: Body) -> Response {
    let started = std::time::Instant::now();
    let response = match admit(state, &headers, body).await {
        Ok((caller, bytes)) => state.route.serve(route, headers, caller, bytes).await,
        Err(error) => error.into_response(),
    };
    state
        .route
        .observe(route.metric(), response.status(), started.elapsed());
    response
}

/// Admission for the request path: the caller's API key (when keys are configured) and the body,
/// read within the bound (413 beyond it, 408 when it is late). Other ingress formats admit here,
/// convert the body to a chat body and call [`crate::route::Router::serve`].
pub async fn admit(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<(Caller, Bytes), ApiError> {
    let key = authenticate_client(&state.live.load(), headers)?;
    let bytes = read_bounded(headers, body, state.route.max_request_body_bytes()).await?;
    let caller = Caller {
        authenticated: key.is_some(),
        key: key.as_ref().map(|k| k.name.clone()),
        allowed_backends: key.map(|k| k.allowed_backends).unwrap_or_default(),
    };
    Ok((caller, bytes))
}

async fn not_found() -> ApiError {
    ApiError::NotFound("no such route".into())
}

/// The bearer token of a request, if any.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Compares secrets without an early exit on the first differing byte.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    use sha2::Digest;
    // Hash first so the comparison length never depends on the secret.
    let (ha, hb) = (sha2::Sha256::digest(a), sha2::Sha256::digest(b));
    ha.iter()
        .zip(hb.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arc_swap::ArcSwap;
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use axum::serve::Listener;
    use continuum_actors::tree::ActorTree;
    use tower::ServiceExt as _;

    use super::{AppState, LiveSettings};
    use crate::build_info::Features;
    use crate::proxy::{Proxy, ProxyOptions};
    use crate::readiness::Readiness;

    fn state() -> AppState {
        let (control, _) = tokio::sync::mpsc::channel(1);
        AppState {
            live: Arc::new(ArcSwap::from_pointee(LiveSettings {
                admin_token: Some("s3cret-admin-token".into()),
                ..LiveSettings::default()
            })),
            readiness: Readiness::new(),
            metrics: Arc::new(String::new),
            tree: ActorTree::default(),
            control,
            dynamo_workers: Arc::new(|| serde_json::json!({"enabled": false})),
            fleet_summary: Arc::new(|| serde_json::json!({})),
            fleet_models: Arc::new(|_: &[String]| Vec::new()),
            route: Arc::new(crate::route::Router::new(Arc::new(Proxy::new(
                ProxyOptions::default(),
                None,
            )))),
        }
    }

    async fn status(app: axum::Router, path: &str) -> StatusCode {
        let request = Request::get(path)
            .header("authorization", "Bearer s3cret-admin-token")
            .body(Body::empty())
            .expect("request");
        app.oneshot(request).await.expect("infallible").status()
    }

    const DYNAMO_ROUTES: [&str; 3] = ["/admin/dynamo/workers", "/admin/fleet/summary", "/admin/ui"];

    /// The Dynamo routes exist exactly when `dynamo` runs; the rest of the admin API stays.
    /// Under `cargo test --no-default-features` the compiled router is the slim one.
    #[tokio::test]
    async fn dynamo_routes_answer_404_without_the_dynamo_feature() {
        for path in DYNAMO_ROUTES {
            let slim = super::router_for(state(), Features::NONE);
            assert_eq!(status(slim, path).await, StatusCode::NOT_FOUND, "{path}");
            let compiled = status(super::router(state()), path).await;
            let expected = if Features::COMPILED.dynamo {
                StatusCode::OK
            } else {
                StatusCode::NOT_FOUND
            };
            assert_eq!(compiled, expected, "{path}");
        }
        let slim = super::router_for(state(), Features::NONE);
        assert_eq!(status(slim, "/admin/subsystems").await, StatusCode::OK);
    }

    #[tokio::test]
    async fn accepted_connections_have_nodelay() {
        let bound = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = bound.local_addr().expect("addr");
        let mut listener = super::listener(bound);
        let client = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (accepted, peer) = listener.accept().await;
        assert_eq!(peer, client.local_addr().expect("client addr"));
        assert!(accepted.nodelay().expect("nodelay"));
    }

    /// A burst of more new connections than `TcpListener::bind`'s queue of 128 all complete
    /// their handshake while nothing accepts: none waits for a resent SYN. (The kernel caps the
    /// queue at `net.core.somaxconn`: the burst is sized within it.)
    #[tokio::test]
    async fn the_accept_queue_holds_a_burst_beyond_128() {
        let somaxconn: usize = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(4096);
        let burst = somaxconn.min(400);
        if burst <= 129 {
            eprintln!("net.core.somaxconn is {somaxconn}: no burst beyond 128 fits; skipped");
            return;
        }
        let listener = super::bind("127.0.0.1:0".parse().expect("addr"), 4096).expect("bind");
        let addr = listener.local_addr().expect("addr");
        let connects: Vec<_> = (0..burst)
            .map(|_| tokio::spawn(tokio::net::TcpStream::connect(addr)))
            .collect();
        // Bounded only so that a dropped SYN (resent after 1 s, 3 s, …) fails the test instead
        // of hanging it; a queue that holds the burst completes every handshake at once.
        let all = async {
            let mut connected = 0;
            for connect in connects {
                connected += usize::from(matches!(connect.await, Ok(Ok(_))));
            }
            connected
        };
        let connected = tokio::time::timeout(std::time::Duration::from_secs(30), all).await;
        assert_eq!(connected.ok(), Some(burst), "handshakes done of {burst}");
        drop(listener);
    }
}
