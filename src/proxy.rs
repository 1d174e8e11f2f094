//! The request path's transport: OpenAI-wire requests relayed to `type: openai` backends (Dynamo
//! direct-mode shim replicas among them). Which backends and which pins is `crate::route`'s
//! decision; this module selects the replicas of a scope, dispatches with the given headers and
//! relays. It never imports the front door or the route.
//!
//! | module | what it holds |
//! |---|---|
//! | [`body`] | bounded body reading, JSON validation, `nvext` pin stripping |
//! | [`headers`] | hop-by-hop and pin header hygiene, [`Dispatch`] (worker pins) |
//! | [`backends`] | the backend pool: selection, health-check tasks, circuit breakers |
//! | [`pool`] | the per-backend HTTP/1.1 connection pool of plain-`http` backends (the hot path) |
//! | [`upstream`] | the pooled hyper-util client (rustls TLS, ALPN h2; health checks) and backend URLs |
//! | [`relay`] | buffered and streamed (SSE) response relay |
//!
//! Flow per dispatch (after the front door read ≤ 8 MiB with [`body::read_bounded`] and the route
//! parsed the top level with [`body::parse`]): select replicas ([`Proxy::candidates`]: key policy,
//! health, breaker, round-robin) → [`Proxy::dispatch`] with the `Dispatch` headers, retrying only
//! connection failures on the next replica with the same headers → relay.
//!
//! Decisions worth knowing:
//! - Standard routing considers enabled, non-internal backends of role `unified` that list the
//!   model (or list none). A key whose `allowed_backends` excludes every such backend gets the
//!   same 404 `model_not_found` as an unknown model, so a key's policy never reveals what other
//!   keys can reach. Backends that serve the model but are all unhealthy or breaker-open: 503.
//! - New backends start healthy (they serve before their first probe completes); the breaker
//!   counts transport errors, timeouts, 502/503/504 and 500s without a JSON error body; not 4xx,
//!   429 or a request-level 500 refusal carrying the frontend's JSON error body (a stale pin).
//!   Retries happen only on connection failures (nothing was sent); a response-head timeout is a
//!   504 and another transport error a 502.
//! - The router's own `Authorization` is not forwarded when API keys are configured; with an
//!   open surface the client's header passes through. Client `x-dynamo-*`, the pin aliases and
//!   the rank aliases (`x-dp-rank`, `x-data-parallel-rank`, `x-prefill-dp-rank`) never leave.
//! - A stream that fails after its head ends with one SSE `data: {"error": ...}` event.

pub mod backends;
pub mod body;
pub mod headers;
pub mod limits;
pub mod metrics;
pub mod pool;
pub mod relay;
pub mod upstream;

use std::sync::Arc;

use arc_swap::ArcSwap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Response};
use bytes::Bytes;
use continuum_actors::metrics::Metrics;

use self::metrics::{DisaggregatedMetrics, RoutingPath};
use continuum_protocol::breaker::{BreakerConfig, ResponseVerdict, classify_response};
use tracing::warn;

pub use backends::{Backend, BackendPool, Clock, Scope, Selection};
pub use body::ParsedBody;
pub use headers::Dispatch;

use crate::config::schema::{
    BackendConfig, Config, DisaggregatedServingConfig, MidStreamFallbackConfig,
};
use crate::wire::error::ApiError;
use upstream::{Upstream, UpstreamError};

/// The OpenAI routes the proxy serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpenAiRoute {
    ChatCompletions,
    Completions,
    /// Native `POST /v1/responses` passthrough (`responses_api: native` backends): the shim path
    /// pins it by model alone, without KV rendering or `nvext.token_data`.
    Responses,
    /// `POST /v1/responses/compact`: passed through without pins.
    ResponsesCompact,
}

impl OpenAiRoute {
    pub fn path(self) -> &'static str {
        match self {
            OpenAiRoute::ChatCompletions => "/v1/chat/completions",
            OpenAiRoute::Completions => "/v1/completions",
            OpenAiRoute::Responses => "/v1/responses",
            OpenAiRoute::ResponsesCompact => "/v1/responses/compact",
        }
    }

    /// The `route` label of `continuum_http_requests_total`.
    pub fn metric(self) -> crate::http_metrics::HttpRoute {
        use crate::http_metrics::HttpRoute;
        match self {
            OpenAiRoute::ChatCompletions => HttpRoute::ChatCompletions,
            OpenAiRoute::Completions => HttpRoute::Completions,
            OpenAiRoute::Responses | OpenAiRoute::ResponsesCompact => HttpRoute::Responses,
        }
    }
}

/// Tuning that is not in the config file.
#[derive(Clone)]
pub struct ProxyOptions {
    pub breaker: BreakerConfig,
    /// Replicas tried for one request when connections fail (at least 1).
    pub max_attempts: usize,
    pub connect_timeout: Duration,
    /// How long to wait for an upstream response head.
    pub response_head_timeout: Duration,
    pub max_request_body_bytes: usize,
    pub clock: Clock,
}

impl Default for ProxyOptions {
    fn default() -> Self {
        Self {
            breaker: BreakerConfig::default(),
            max_attempts: 3,
            connect_timeout: Duration::from_secs(5),
            response_head_timeout: Duration::from_secs(600),
            max_request_body_bytes: body::MAX_REQUEST_BODY_BYTES,
            clock: Arc::new(continuum_actors::clock::now_tick),
        }
    }
}

/// A parsed client request, as the dispatch step sees it.
#[derive(Clone, Debug)]
pub struct ClientRequest {
    pub route: OpenAiRoute,
    pub body: ParsedBody,
    /// The client's headers (sanitised again at dispatch).
    pub headers: HeaderMap,
    /// The client sent `x-backend`: identities may be disclosed.
    pub disclose: bool,
    /// The router consumed the `Authorization` header as its own API key.
    pub authenticated: bool,
}

/// The proxy: a backend pool (which owns the upstream clients) and the reloadable routing switches
/// (`disaggregated_serving.enabled` and `fallback_to_unified`, which `crate::route` reads).
pub struct Proxy {
    pool: BackendPool,
    options: ProxyOptions,
    disaggregated: AtomicBool,
    fallback_to_unified: AtomicBool,
    /// `disaggregated_serving.mid_stream_fallback` (read by the route's mid-stream fallback).
    mid_stream: ArcSwap<MidStreamFallbackConfig>,
    metrics: Option<Metrics>,
    /// `disaggregated_{requests,errors}_total`, resolved once.
    disaggregated_metrics: Option<Arc<DisaggregatedMetrics>>,
    /// `rate_limits` (keys admitted by `crate::route`, backends here).
    limits: limits::RateLimiter,
}

impl Proxy {
    /// An empty proxy; call [`Proxy::reconfigure`] (inside a tokio runtime) to load backends.
    pub fn new(options: ProxyOptions, metrics: Option<Metrics>) -> Self {
        let upstream = Upstream::new(options.connect_timeout);
        Self {
            pool: BackendPool::new(upstream, options.clock.clone(), options.breaker),
            options,
            disaggregated: AtomicBool::new(false),
            fallback_to_unified: AtomicBool::new(true),
            mid_stream: ArcSwap::default(),
            limits: limits::RateLimiter::new(metrics.as_ref().map(|m| m.registry())),
            disaggregated_metrics: metrics.as_ref().and_then(Metrics::family),
            metrics,
        }
    }

    /// Applies the immediate-class settings: `backends` and `disaggregated_serving`. Unchanged
    /// backends keep their health, breaker and probe task.
    pub fn reconfigure(&self, config: &Config) {
        self.set_backends(&config.backends, &config.disaggregated_serving);
        self.limits.reconfigure(&config.rate_limits);
    }

    /// The rate limits (`rate_limits`), reloaded by [`Proxy::reconfigure`].
    pub fn limits(&self) -> &limits::RateLimiter {
        &self.limits
    }

    /// Now, on the proxy's clock.
    pub fn now(&self) -> continuum_protocol::time::Tick {
        self.pool.now()
    }

    pub fn set_backends(&self, backends: &[BackendConfig], disagg: &DisaggregatedServingConfig) {
        self.pool.reconfigure(backends);
        self.disaggregated.store(disagg.enabled, Ordering::Release);
        self.fallback_to_unified
            .store(disagg.fallback_to_unified, Ordering::Release);
        self.mid_stream
            .store(Arc::new(disagg.mid_stream_fallback.clone()));
    }

    /// `disaggregated_serving.mid_stream_fallback` in the current configuration.
    pub fn mid_stream_fallback(&self) -> Arc<MidStreamFallbackConfig> {
        self.mid_stream.load_full()
    }

    pub fn pool(&self) -> &BackendPool {
        &self.pool
    }

    /// Stops every health-check task.
    pub fn shutdown(&self) {
        self.pool.shutdown();
    }

    /// The tuning this proxy was built with.
    pub fn options(&self) -> &ProxyOptions {
        &self.options
    }

    /// The daemon's metrics, when registered.
    pub fn metrics(&self) -> Option<&Metrics> {
        self.metrics.as_ref()
    }

    /// The shim's families (`disaggregated_{requests,errors}_total`), when registered.
    pub fn disaggregated_metrics(&self) -> Option<&DisaggregatedMetrics> {
        self.disaggregated_metrics.as_deref()
    }

    /// Whether `disaggregated_serving.fallback_to_unified` is on in the current configuration.
    pub fn fallback_to_unified(&self) -> bool {
        self.fallback_to_unified.load(Ordering::Acquire)
    }

    /// Whether `POST /v1/responses` for `model` goes to a backend's own `/v1/responses`: some
    /// enabled backend the key may use that serves the model is `responses_api: native`.
    pub fn responses_native(&self, model: &str, allowed: &[String]) -> bool {
        self.any_serving(model, allowed, |b| {
            b.responses_api == crate::config::schema::ResponsesApi::Native
        })
    }

    /// Whether a backend the key may use that serves `model` lists it in
    /// `responses_only_models`: an Anthropic request for it goes through `/v1/responses`.
    pub fn responses_only(&self, model: &str, allowed: &[String]) -> bool {
        self.any_serving(model, allowed, |b| {
            b.responses_only_models.iter().any(|m| m == model)
        })
    }

    /// Whether the config of some backend the key may use that serves `model` satisfies `pred`.
    fn any_serving(
        &self,
        model: &str,
        allowed: &[String],
        pred: impl Fn(&crate::config::schema::BackendConfig) -> bool,
    ) -> bool {
        let scope = Scope {
            allowed,
            only: None,
        };
        match self.pool.select(model, scope) {
            Selection::Candidates(c) => c.iter().any(|b| pred(b.config())),
            _ => false,
        }
    }

    /// Whether `disaggregated_serving.enabled` is on in the current configuration.
    pub fn disaggregated_enabled(&self) -> bool {
        self.disaggregated.load(Ordering::Acquire)
    }

    /// Replicas for a model, or the client-facing error: 404 `model_not_found` when no backend
    /// the key may use serves it (a key's policy is not disclosed as a 403), 503 when all such
    /// backends are unhealthy or breaker-open.
    pub fn candidates(&self, model: &str, scope: Scope<'_>) -> Result<Vec<Arc<Backend>>, ApiError> {
        match self.pool.select(model, scope) {
            Selection::Candidates(c) => Ok(c),
            Selection::NoneServes => Err(ApiError::ModelNotFound(format!(
                "the model {model:?} does not exist or you do not have access to it"
            ))),
            Selection::NoneUsable => Err(ApiError::Unavailable(format!(
                "no healthy backend is available for the model {model:?}"
            ))),
        }
    }

    /// [`Proxy::candidates`] for a route: native `/v1/responses` goes only to
    /// `responses_api: native` backends.
    pub fn candidates_for(
        &self,
        route: OpenAiRoute,
        model: &str,
        scope: Scope<'_>,
    ) -> Result<Vec<Arc<Backend>>, ApiError> {
        let mut candidates = self.candidates(model, scope)?;
        if route == OpenAiRoute::Responses {
            candidates.retain(|b| {
                b.config().responses_api == crate::config::schema::ResponsesApi::Native
            });
            if candidates.is_empty() {
                return Err(ApiError::Unavailable(format!(
                    "no healthy backend serves /v1/responses natively for the model {model:?}"
                )));
            }
        }
        Ok(candidates)
    }

    /// Counts `disaggregated_requests_total{routing_path}` when disaggregated serving is on;
    /// call once per request.
    pub fn count_routing_path(&self, path: RoutingPath) {
        if self.disaggregated_enabled()
            && let Some(metrics) = &self.disaggregated_metrics
        {
            metrics.request(path);
        }
    }

    /// Sends `request` to the first admitted candidate with `dispatch`'s headers. Only connection
    /// failures move on to the next candidate (nothing was sent), with the same headers: workers
    /// are never re-selected here. Transport errors, timeouts and gateway-class answers count
    /// against the breaker (`continuum_protocol::breaker::classify_response`).
    pub async fn dispatch(
        &self,
        request: &ClientRequest,
        candidates: &[Arc<Backend>],
        dispatch: &Dispatch,
        path: RoutingPath,
    ) -> Result<Response<Body>, ApiError> {
        let outbound_headers =
            headers::Outbound::new(&request.headers, dispatch, request.authenticated);
        let mut last_error = None;
        let tokens = request.body.prompt_tokens;
        let open: Vec<&Arc<Backend>> = candidates
            .iter()
            .filter(|b| {
                self.limits
                    .backend_would_admit(b.name(), self.pool.now(), tokens)
            })
            .collect();
        let attempts = open.len().min(self.options.max_attempts.max(1));
        let mut limited = None;
        for backend in open.into_iter().take(attempts) {
            if !backend.admit(self.pool.now()).is_admitted() {
                continue;
            }
            if let Err(refusal) = self
                .limits
                .admit_backend(backend.name(), self.pool.now(), tokens)
            {
                limited = Some(refusal);
                continue;
            }
            let Ok(target) = backend.target() else {
                continue;
            };
            let uri = target
                .uri(request.route.path())
                .map_err(|e| ApiError::Internal(e.to_string()))?;
            // The backend's `global_prompts` / `requires_single_leading_system`, identically
            // to what KV rendering applied (`route::dynamo::first_replica_rewrite`).
            let config = backend.config();
            let outbound = if request.route == OpenAiRoute::ChatCompletions
                && (!config.global_prompts.is_empty() || config.requires_single_leading_system)
            {
                config
                    .prompt_rewrite()
                    .apply_bytes(&request.body.outbound)
                    .map(Bytes::from)
                    .unwrap_or_else(|| request.body.outbound.clone())
            } else {
                request.body.outbound.clone()
            };
            let sent = backend
                .send(
                    uri,
                    &outbound_headers,
                    outbound,
                    self.options.response_head_timeout,
                )
                .await;
            match sent {
                Ok(resp) => {
                    match classify_response(resp.status().as_u16(), frontend_error_body(&resp)) {
                        ResponseVerdict::Failing => backend.record_failure(self.pool.now()),
                        ResponseVerdict::Serving => backend.record_success(),
                    }
                    let relayed = if request.body.stream {
                        let idle_polls = resp.body().relay_idle_polls();
                        Ok(relay::streamed(resp, backend.name(), idle_polls))
                    } else {
                        relay::buffered(resp, backend.name()).await
                    };
                    return relayed.map(|resp| decorate(resp, request, backend, dispatch, path));
                }
                Err(error) if error.is_connect() => {
                    backend.record_failure(self.pool.now());
                    warn!(backend = %backend.name(), %error, "Could not connect to a backend; trying the next replica.");
                    last_error = Some(error);
                }
                Err(error) => {
                    backend.record_failure(self.pool.now());
                    warn!(backend = %backend.name(), %error, "A backend failed before answering.");
                    return Err(match error {
                        UpstreamError::Timeout(_) => ApiError::GatewayTimeout(error.to_string()),
                        _ => ApiError::BadGateway(error.to_string()),
                    });
                }
            }
        }
        if last_error.is_none()
            && let Some(limited) = limited.or_else(|| self.all_limited(candidates, tokens))
        {
            self.limits.count(&limited);
            return Err(ApiError::RateLimited(Box::new(limited)));
        }
        Err(match last_error {
            Some(error) => {
                ApiError::BadGateway(format!("no backend replica was reachable: {error}"))
            }
            None => ApiError::Unavailable("no backend replica admitted the request".into()),
        })
    }
}

impl Proxy {
    /// When every candidate is at its backend limit: the refusal of the one that frees soonest.
    fn all_limited(&self, candidates: &[Arc<Backend>], tokens: u64) -> Option<limits::Limited> {
        let now = self.pool.now();
        if candidates.is_empty()
            || candidates
                .iter()
                .any(|b| self.limits.backend_would_admit(b.name(), now, tokens))
        {
            return None;
        }
        candidates
            .iter()
            .filter_map(|b| self.limits.backend_refusal(b.name(), now, tokens))
            .min_by_key(|l| l.refusal.retry_after)
    }
}

/// Whether an upstream answer carries the frontend's own JSON error body (`content-type:
/// application/json`, as Dynamo 1.6.1's `{"message", "type", "code"}` refusals do).
fn frontend_error_body<B>(resp: &Response<B>) -> bool {
    resp.headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"))
}

/// The backend that answered: a response extension, for a mid-stream continuation to exclude and
/// the completion-token debit to charge.
#[derive(Clone, Debug)]
pub struct ServedBy(pub Arc<str>);

/// Routing headers on every relayed response; identities only when asked with `x-backend`.
fn decorate(
    mut resp: Response<Body>,
    request: &ClientRequest,
    backend: &Backend,
    dispatch: &Dispatch,
    path: RoutingPath,
) -> Response<Body> {
    resp.extensions_mut()
        .insert(ServedBy(Arc::from(backend.name())));
    let headers = resp.headers_mut();
    headers.insert(
        headers::ROUTING_PATH,
        HeaderValue::from_static(path.as_label()),
    );
    if request.disclose {
        if let Ok(name) = HeaderValue::from_str(backend.name()) {
            headers.insert(headers::BACKEND_RESPONSE, name);
        }
        for (name, value) in dispatch.disclosed() {
            headers.insert(name.clone(), value.clone());
        }
    }
    resp
}
