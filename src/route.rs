//! The request path's orchestrator: where a chat or completions request is routed.
//!
//! The front door authenticates the caller and reads the bounded body, then calls
//! [`Router::serve`], the one entry of the OpenAI chat-completions pipeline (other ingress
//! formats convert to a chat body and call it too). From there:
//!
//! 1. [`Router::serve`] validates the body (top-level scan, `nvext` pins stripped) into a
//!    [`ClientRequest`].
//! 2. **Dynamo pinning first**: with `disaggregated_serving.enabled` and a Dynamo router installed,
//!    [`dynamo::ShimRouter::decide_async`] returns a dispatch plan (shim pool, pins, path) or
//!    `None` (the Dynamo path does not apply).
//! 3. The plan is sent through the proxy to the shim pool; [`Router::settle`] applies the seed's
//!    failure semantics: success (or an ordinary 4xx on a stream) is relayed, a direct-mode
//!    prefill refusal (buffered, or in a stream's non-2xx head) is a 503 without retry, any other failure falls back to unified routing
//!    without pins (`fallback_to_unified`) or answers `disaggregated_decode_failed`.
//! 4. **Unified routing** otherwise: every enabled unified backend that serves the model.
//!
//! Retries of a connection failure on the next replica are the proxy's (same headers); workers are
//! never re-selected for a request. The transport (candidates, dispatch, headers, relay) is
//! `crate::proxy`'s; this module never touches a socket.

pub mod admission;
pub mod dynamo;
pub mod metrics;
pub mod mid_stream;
pub mod usage;

use std::sync::Arc;
use std::time::Duration;

use crate::proxy::metrics::{DisaggregatedPhase, RoutingPath};
use arc_swap::ArcSwapOption;
use axum::body::Body;
use axum::http::{HeaderMap, Response, StatusCode};
use axum::response::IntoResponse;
use bytes::Bytes;
use continuum_protocol::admission::{Fleet, Waiting};
use tracing::{debug, warn};

use crate::http_metrics::{HttpMetrics, HttpRoute};
use crate::proxy::headers::DISCLOSE_REQUEST;
use crate::proxy::{ClientRequest, Dispatch, OpenAiRoute, ParsedBody, Proxy, Scope, body};
use crate::wire::error::ApiError;
use dynamo::{ShimDecision, ShimRouter};

/// Who is calling, as the front door authenticated them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Caller {
    /// The router consumed the `Authorization` header as its own API key (it is not forwarded).
    pub authenticated: bool,
    /// The key's `allowed_backends` (empty = all).
    pub allowed_backends: Vec<String>,
    /// The key's configured name (`None`: no key, the front door is open); names its rate limits.
    pub key: Option<String>,
}

/// The orchestrator: the proxy (transport) and, when the daemon runs one, the Dynamo router.
pub struct Router {
    proxy: Arc<Proxy>,
    dynamo: ArcSwapOption<ShimRouter>,
    /// `continuum_http_*` (absent in tests that build a router without a registry).
    http: Option<HttpMetrics>,
    /// Mid-stream fallback's retry budget.
    budget: Arc<mid_stream::RetryBudget>,
    /// `admission`: the per-model wait queues.
    admission: admission::Admission,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router").finish_non_exhaustive()
    }
}

impl Router {
    /// A router over `proxy` with no Dynamo path (install one with [`Router::set_dynamo`]).
    pub fn new(proxy: Arc<Proxy>) -> Self {
        let admission = admission::Admission::new(proxy.metrics().map(|m| m.registry()));
        // The mid-stream families read 0 from the start, before a first cut registers them.
        if let Some(metrics) = proxy.metrics() {
            metrics.family::<mid_stream::metrics::MidStreamMetrics>();
        }
        Self {
            proxy,
            dynamo: ArcSwapOption::empty(),
            http: None,
            budget: Arc::default(),
            admission,
        }
    }

    /// Counts answered requests in `http` ([`Router::observe`]).
    pub fn with_http_metrics(mut self, http: HttpMetrics) -> Self {
        self.http = Some(http);
        self
    }

    /// The transport.
    pub fn proxy(&self) -> &Arc<Proxy> {
        &self.proxy
    }

    /// The Dynamo shim path, when installed.
    pub fn dynamo(&self) -> Option<Arc<ShimRouter>> {
        self.dynamo.load_full()
    }

    /// Installs the Dynamo shim path (tried first when disaggregated serving is on).
    pub fn set_dynamo(&self, dynamo: Arc<ShimRouter>) {
        self.dynamo.store(Some(dynamo));
    }

    /// The bound the front door reads request bodies within.
    pub fn max_request_body_bytes(&self) -> usize {
        self.proxy.options().max_request_body_bytes
    }

    /// Counts one answered request of the surface `route` (`continuum_http_requests_total` and
    /// its duration); an OpenAI route's label is `OpenAiRoute::metric`.
    pub fn observe(&self, route: HttpRoute, status: StatusCode, elapsed: Duration) {
        if let Some(http) = &self.http {
            http.request_timed(route, status.as_u16(), elapsed);
        }
    }

    /// Counts one answered request of a surface route that has no duration series (health,
    /// readiness, metrics, models, admin, unmatched).
    pub fn count(&self, route: HttpRoute, status: StatusCode) {
        if let Some(http) = &self.http {
            http.request(route, status.as_u16());
        }
    }

    /// The chat-completions (and completions) pipeline for one request the front door admitted:
    /// `headers` are the client's (pins already stripped), `body` the bounded body. Validates the
    /// body, routes (Dynamo pins first, then unified) and relays; always answers, errors as
    /// `ApiError` bodies.
    pub async fn serve(
        &self,
        route: OpenAiRoute,
        headers: HeaderMap,
        caller: Caller,
        body: Bytes,
    ) -> Response<Body> {
        let request = match parse(route, headers, &caller, body) {
            Ok(request) => request,
            Err(error) => return error.into_response(),
        };
        let key = caller.key.as_deref();
        let now = self.proxy.now();
        if let Err(limited) = self
            .proxy
            .limits()
            .admit_key(key, now, request.body.prompt_tokens)
        {
            return ApiError::RateLimited(Box::new(limited)).into_response();
        }
        match self.route(&request, &caller.allowed_backends, key).await {
            Ok(resp) => {
                let shim_pool = resp.extensions().get::<ShimPool>().map(|p| p.0.clone());
                let excluded = shim_pool.unwrap_or_default();
                let allowed = &caller.allowed_backends;
                let resp =
                    mid_stream::arm(&self.proxy, &self.budget, request, allowed, &excluded, resp);
                // Outside the continuation, so the merged usage of a continued stream is read.
                usage::debit_completion(&self.proxy, key, resp)
            }
            Err(error) => error.into_response(),
        }
    }

    /// Dynamo pinning first when it applies, else unified routing. `/v1/responses/compact` is
    /// never pinned; native `/v1/responses` is pinned by model alone (no KV rendering, no token
    /// data).
    async fn route(
        &self,
        request: &ClientRequest,
        allowed: &[String],
        key: Option<&str>,
    ) -> Result<Response<Body>, ApiError> {
        if self.proxy.disaggregated_enabled()
            && request.route != OpenAiRoute::ResponsesCompact
            && let Some(dynamo) = self.dynamo.load_full()
        {
            let tokens = request.body.prompt_tokens;
            // A shim replica at its rate limit is skipped like an unhealthy one.
            let usable = |name: &str| {
                self.proxy
                    .pool()
                    .get(name)
                    .is_some_and(|b| b.is_healthy() && b.config().enabled)
                    && self
                        .proxy
                        .limits()
                        .backend_would_admit(name, self.proxy.now(), tokens)
            };
            self.admit(&dynamo, request, (allowed, key), &usable)
                .await?;
            let plan = if request.route == OpenAiRoute::Responses {
                dynamo.decide_parsed(&request.body, allowed, usable)
            } else {
                dynamo
                    .decide_async_parsed(&request.body, allowed, usable)
                    .await
            };
            if let Some(plan) = plan {
                return self.pinned(&dynamo, request, allowed, plan).await;
            }
        }
        let scope = Scope {
            allowed,
            only: None,
        };
        let candidates = self
            .proxy
            .candidates_for(request.route, &request.body.model, scope)?;
        self.proxy.count_routing_path(RoutingPath::Unified);
        self.proxy
            .dispatch(
                request,
                &candidates,
                &Dispatch::none(),
                RoutingPath::Unified,
            )
            .await
    }

    /// `admission`: waits while every eligible worker of the model is busy, in the place of the
    /// caller's key (its class, its turn by prompt size), or refuses `fleet_busy` (see
    /// [`admission`]).
    async fn admit(
        &self,
        dynamo: &ShimRouter,
        request: &ClientRequest,
        (allowed, key): (&[String], Option<&str>),
        usable: &impl Fn(&str) -> bool,
    ) -> Result<(), ApiError> {
        let model = &request.body.model;
        let Some((name, first)) = dynamo.fleet(model, allowed, usable) else {
            return Ok(());
        };
        let fleet = || {
            dynamo
                .fleet(model, allowed, usable)
                .map_or(Fleet::Unknown, |(_, fleet)| fleet)
        };
        let asked = request
            .headers
            .get(crate::proxy::headers::PRIORITY_REQUEST)
            .and_then(|v| v.to_str().ok());
        let who = Waiting {
            class: dynamo.admission_class(key, asked),
            key: key.unwrap_or_default().to_owned(),
            cost: request.body.prompt_tokens.max(1),
        };
        let config = || dynamo.admission_bounds();
        self.admission
            .admit(&name, first, who, config, fleet, dynamo.load_changes())
            .await
            .map_err(|busy| ApiError::FleetBusy(Box::new(busy)))
    }

    /// The admission queues (depth per model).
    pub fn admission(&self) -> &admission::Admission {
        &self.admission
    }

    /// Sends the request to the plan's shim pool with its pins, settles the answer, and ends the
    /// plan's ledger entry with the response body (or at once on an error).
    async fn pinned(
        &self,
        dynamo: &Arc<ShimRouter>,
        request: &ClientRequest,
        allowed: &[String],
        mut plan: ShimDecision,
    ) -> Result<Response<Body>, ApiError> {
        // The ledger entry ends when this guard drops: with the response body, on an error, or
        // when the request is cancelled while it waits for the shim.
        let guard = plan
            .dispatch_id
            .map(|id| dynamo.picker_state().in_flight(id));
        let scope = Scope {
            allowed,
            only: Some(&plan.pool),
        };
        let candidates = self
            .proxy
            .candidates_for(request.route, &request.body.model, scope)?;
        self.proxy.count_routing_path(plan.path);
        // The shim copy may carry the rendered tokens; `request` (used by any fallback) keeps the
        // client's body, which never carries `nvext.token_data`.
        let shim_request = plan.body.take().map(|outbound| ClientRequest {
            body: ParsedBody {
                outbound,
                ..request.body.clone()
            },
            ..request.clone()
        });
        let outcome = self
            .proxy
            .dispatch(
                shim_request.as_ref().unwrap_or(request),
                &candidates,
                &plan.dispatch,
                plan.path,
            )
            .await;
        let settled = self.settle(request, allowed, &plan.pool, outcome).await;
        let shim_pool = ShimPool(plan.pool.clone());
        let settled = settled.map(|mut resp| {
            resp.extensions_mut().insert(shim_pool);
            resp
        });
        settled.map(|resp| match guard {
            Some(guard) => resp.map(|body| {
                Body::from_stream(futures::StreamExt::map(
                    body.into_data_stream(),
                    move |chunk| {
                        let _ = &guard;
                        chunk
                    },
                ))
            }),
            None => resp,
        })
    }

    /// The shim's answer under the seed's failure semantics. A success (or, on a stream, an
    /// ordinary 4xx) is relayed. A direct-mode refusal for lack of a prefill id, in a buffered
    /// answer or a stream's non-2xx head, is a 503 without retry. Any other failure counts `disaggregated_errors_total{phase="decode"}` and
    /// falls back to unified routing without pins when `fallback_to_unified`, else answers
    /// `disaggregated_decode_failed`. Workers are never re-selected for the request.
    async fn settle(
        &self,
        request: &ClientRequest,
        allowed: &[String],
        shim_pool: &[String],
        outcome: Result<Response<Body>, ApiError>,
    ) -> Result<Response<Body>, ApiError> {
        let failure = match outcome {
            Ok(resp) if resp.status().is_success() => return Ok(resp),
            Ok(resp) if request.body.stream && !falls_back_on_stream(resp.status()) => {
                return Ok(resp);
            }
            Ok(resp) => {
                // A buffered answer, or a stream's non-2xx head (nothing was relayed yet): its
                // error body tells the direct-mode refusal from any other failure.
                let status = resp.status();
                if is_prefill_id_refusal(&error_body(resp.into_body()).await) {
                    if let Some(metrics) = self.proxy.disaggregated_metrics() {
                        metrics.error(DisaggregatedPhase::Orchestration);
                    }
                    return Err(ApiError::PrefillDecodeUnavailable(
                        "the direct-mode frontend refused the worker pair: prefill worker id required"
                            .into(),
                    ));
                }
                format!("shim answered {status}")
            }
            Err(error) => error.to_string(),
        };
        if let Some(metrics) = self.proxy.disaggregated_metrics() {
            metrics.error(DisaggregatedPhase::Decode);
        }
        if !self.proxy.fallback_to_unified() {
            return Err(ApiError::DisaggregatedDecodeFailed(format!(
                "the Dynamo shim failed ({failure}) and fallback_to_unified is off"
            )));
        }
        warn!(reason = %failure, "Dynamo shim failed; falling back to unified routing without pins.");
        self.unified_fallback(request, allowed, shim_pool, &failure)
            .await
    }

    /// Unified routing without pins after a shim failure, skipping the shim replicas.
    async fn unified_fallback(
        &self,
        request: &ClientRequest,
        allowed: &[String],
        shim_pool: &[String],
        failure: &str,
    ) -> Result<Response<Body>, ApiError> {
        let scope = Scope {
            allowed,
            only: None,
        };
        // Shim replicas are direct-mode frontends: without pins they cannot serve the request.
        let candidates: Vec<_> = self
            .proxy
            .candidates_for(request.route, &request.body.model, scope)?
            .into_iter()
            .filter(|b| !shim_pool.iter().any(|name| name == b.name()))
            .collect();
        if candidates.is_empty() {
            return Err(ApiError::DisaggregatedDecodeFailed(format!(
                "the Dynamo shim failed ({failure}) and no unified backend serves the model"
            )));
        }
        self.proxy
            .dispatch(
                request,
                &candidates,
                &Dispatch::none(),
                RoutingPath::Unified,
            )
            .await
    }
}

/// The shim replicas a pinned request went to (a response extension): a mid-stream
/// continuation never goes to them (direct-mode frontends cannot serve without pins).
#[derive(Clone, Debug)]
struct ShimPool(Vec<String>);

/// Validates the bounded body (`model` required; a repeated `model`/`stream`/`nvext` key or
/// nesting deeper than 128 is a 400) and strips its pins (the only case that re-encodes it).
fn parse(
    route: OpenAiRoute,
    headers: HeaderMap,
    caller: &Caller,
    body: Bytes,
) -> Result<ClientRequest, ApiError> {
    let parsed = body::parse(body)?;
    if parsed.stripped > 0 {
        debug!(
            stripped = parsed.stripped,
            "Stripped client nvext worker pins."
        );
    }
    Ok(ClientRequest {
        route,
        disclose: headers.contains_key(DISCLOSE_REQUEST),
        authenticated: caller.authenticated,
        headers,
        body: parsed,
    })
}

/// What a direct-mode frontend says when a disaggregated request lacks a prefill pin
/// (`DIRECT_MODE_PREFILL_ID_ERROR`). Dynamo 1.6.1 logs it and answers a generic 500, which then
/// takes the decode-failure arm; a release that puts it in the body gets the 503.
pub const DIRECT_MODE_PREFILL_ID_ERROR: &str = "Prefill worker ID required in Direct routing mode";

/// Whether a shim answer's (error) body is the direct-mode prefill refusal.
pub fn is_prefill_id_refusal(body: &[u8]) -> bool {
    body.windows(DIRECT_MODE_PREFILL_ID_ERROR.len())
        .any(|w| w == DIRECT_MODE_PREFILL_ID_ERROR.as_bytes())
}

/// Most bytes of a failed shim answer read to look for the direct-mode refusal.
const MAX_ERROR_BODY_BYTES: usize = 64 * 1024;

/// How long a failed shim answer's body may take to arrive whole.
const ERROR_BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// A failed answer's body, bounded in size and time; empty when it is longer, late or broken.
async fn error_body(body: Body) -> Bytes {
    let collect = crate::proxy::relay::collect_bounded(body, MAX_ERROR_BODY_BYTES);
    match tokio::time::timeout(ERROR_BODY_TIMEOUT, collect).await {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(_)) | Err(_) => Bytes::new(),
    }
}

/// On a stream, only these heads (and transport failures) fall back; other 4xx are relayed.
pub fn falls_back_on_stream(status: StatusCode) -> bool {
    status.is_server_error()
        || status == StatusCode::TOO_MANY_REQUESTS
        || status == StatusCode::REQUEST_TIMEOUT
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_refusal_is_recognised_in_a_body() {
        let body =
            br#"{"message":"Prefill worker ID required in Direct routing mode but none found"}"#;
        assert!(is_prefill_id_refusal(body));
        assert!(!is_prefill_id_refusal(
            br#"{"message":"Failed to generate completions"}"#
        ));
    }

    #[test]
    fn streams_fall_back_only_on_5xx_429_408() {
        for code in [500, 502, 503, 429, 408] {
            assert!(falls_back_on_stream(
                StatusCode::from_u16(code).expect("code")
            ));
        }
        for code in [400, 401, 404, 422] {
            assert!(!falls_back_on_stream(
                StatusCode::from_u16(code).expect("code")
            ));
        }
    }
}
