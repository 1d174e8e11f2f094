//! Mid-stream fallback for the native `POST /v1/responses` passthrough (issue 31): the IO around
//! `continuum_protocol::ingress::continuation::ResponsesSplice`.
//!
//! The same rules as the chat stream's ([`super::Armed`]): whole SSE events only, a cut is a
//! close before the terminal event, a stall past `inactivity_timeout` or an error event, and the
//! rest comes from the standard unified routing with the failed backend and the shim pool
//! excluded. The continuation goes out as a chat-completions request (Responses has no way to
//! continue a partial assistant turn) to a backend that serves the model over chat completions
//! (one that lists it in `responses_only_models` cannot), and its chunks are written into the
//! client's Responses stream by the splice. A cut that cannot be continued ends the stream with
//! one `response.failed` event.

use std::convert::Infallible;
use std::sync::Arc;

use super::metrics::{MidStreamIngress, MidStreamMetrics, MidStreamReason, MidStreamResult};
use crate::proxy::metrics::RoutingPath;
use axum::body::Body;
use axum::http::Response;
use bytes::Bytes;
use continuum_protocol::ingress::continuation::{CutReason, ResponsesSplice};
use http_body_util::BodyExt;
use tracing::info;

use super::{MAX_EVENT_BYTES, RetryBudget, refused};
use crate::config::schema::MidStreamFallbackConfig;
use crate::proxy::{ClientRequest, Dispatch, OpenAiRoute, ParsedBody, Proxy, Scope, ServedBy};
use crate::route::usage::Handoffs;

/// Arms a native Responses stream (the caller checked that mid-stream fallback is on and the
/// answer is a successful stream).
pub(super) fn arm(
    proxy: &Arc<Proxy>,
    budget: &Arc<RetryBudget>,
    request: ClientRequest,
    (allowed, excluded): (&[String], &[String]),
    config: Arc<MidStreamFallbackConfig>,
    resp: Response<Body>,
) -> Response<Body> {
    budget.record_stream();
    let mut excluded = excluded.to_vec();
    let served_by = resp.extensions().get::<ServedBy>().map(|s| s.0.clone());
    if let Some(name) = &served_by {
        excluded.push(name.to_string());
    }
    let handoffs = Handoffs::new(served_by);
    let (mut parts, body) = resp.into_parts();
    parts.extensions.insert(handoffs.clone());
    let state = Armed {
        splice: ResponsesSplice::new(config.max_buffered_bytes, MAX_EVENT_BYTES),
        upstream: Some(body),
        attempts_left: config.max_attempts,
        config,
        proxy: proxy.clone(),
        budget: budget.clone(),
        request,
        allowed: allowed.to_vec(),
        excluded,
        handoffs,
        span: tracing::Span::current(),
    };
    let stream = futures::stream::unfold(state, |mut state| async move {
        let bytes = state.next().await?;
        Some((Ok::<_, Infallible>(bytes), state))
    });
    Response::from_parts(parts, Body::from_stream(stream))
}

/// One armed Responses stream; dropping it drops the upstream body (and its request).
struct Armed {
    splice: ResponsesSplice,
    /// `None` once the stream ended.
    upstream: Option<Body>,
    attempts_left: u32,
    config: Arc<MidStreamFallbackConfig>,
    proxy: Arc<Proxy>,
    budget: Arc<RetryBudget>,
    request: ClientRequest,
    allowed: Vec<String>,
    excluded: Vec<String>,
    handoffs: Handoffs,
    span: tracing::Span,
}

impl Armed {
    /// The next bytes for the client, `None` at the end.
    async fn next(&mut self) -> Option<Bytes> {
        loop {
            let upstream = self.upstream.as_mut()?;
            let timeout = self.config.inactivity_timeout.get();
            let frame = tokio::time::timeout(timeout, upstream.frame()).await;
            let mut out = Vec::new();
            let cut = match frame {
                Ok(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    let fed = self.splice.feed(&data);
                    out = fed.out;
                    match fed.cut {
                        None if out.is_empty() => continue,
                        None => return Some(out.into()),
                        // The relay's own event for a failed upstream body is a closed stream.
                        Some(CutReason::ErrorEvent)
                            if self.splice.error_code() == Some("bad_gateway") =>
                        {
                            CutReason::Closed
                        }
                        Some(reason) => reason,
                    }
                }
                Ok(Some(Err(_))) => CutReason::Closed,
                Ok(None) => match self.splice.end(&mut out) {
                    None => {
                        self.upstream = None;
                        return (!out.is_empty()).then(|| out.into());
                    }
                    Some(reason) => reason,
                },
                Err(_) => CutReason::Stalled,
            };
            self.upstream = None;
            let (result, body) = self.continuation().await;
            self.observe(cut, result);
            match body {
                Some(body) => self.upstream = Some(body),
                None => {
                    let message = format!(
                        "the upstream stream was cut ({}) and could not be continued ({})",
                        cut.as_label(),
                        result.as_label()
                    );
                    out.extend(self.splice.failure_event(&message));
                }
            }
            if !out.is_empty() {
                return Some(out.into());
            }
        }
    }

    /// The continuation's body, or why there is none (the `result` label either way).
    async fn continuation(&mut self) -> (MidStreamResult, Option<Body>) {
        if let Some(refusal) = self.splice.refusal() {
            return (refused(refusal), None);
        }
        let Ok(outbound) = self.splice.continuation_body(&self.request.body.outbound) else {
            return (MidStreamResult::RefusedUnsupported, None);
        };
        let mut result = MidStreamResult::AttemptsExhausted;
        while self.attempts_left > 0 {
            if !self.budget.try_acquire(&self.config) {
                return (MidStreamResult::BudgetExhausted, None);
            }
            self.attempts_left -= 1;
            match self.dispatch(Bytes::from(outbound.clone())).await {
                Ok((body, served_by)) => {
                    self.handoffs.hand_off(self.splice.tokens_sent(), served_by);
                    self.splice.start_continuation();
                    return (MidStreamResult::Continued, Some(body));
                }
                Err(why) => result = why,
            }
        }
        (result, None)
    }

    /// Sends the chat-completions continuation to the unified candidates that serve the model
    /// over chat completions, minus the excluded ones; the head must arrive within the
    /// inactivity timeout.
    async fn dispatch(
        &mut self,
        outbound: Bytes,
    ) -> Result<(Body, Option<Arc<str>>), MidStreamResult> {
        let scope = Scope {
            allowed: &self.allowed,
            only: None,
        };
        let model = &self.request.body.model;
        let candidates: Vec<_> = self
            .proxy
            .candidates_for(OpenAiRoute::ChatCompletions, model, scope)
            .map_err(|_| MidStreamResult::NoFallback)?
            .into_iter()
            .filter(|b| !self.excluded.iter().any(|name| name == b.name()))
            .filter(|b| !b.config().responses_only_models.iter().any(|m| m == model))
            .collect();
        if candidates.is_empty() {
            return Err(MidStreamResult::NoFallback);
        }
        let continuation = ClientRequest {
            route: OpenAiRoute::ChatCompletions,
            body: ParsedBody {
                outbound,
                stream: true,
                ..self.request.body.clone()
            },
            ..self.request.clone()
        };
        let no_pins = Dispatch::none();
        let sent = self
            .proxy
            .dispatch(&continuation, &candidates, &no_pins, RoutingPath::Unified);
        match tokio::time::timeout(self.config.inactivity_timeout.get(), sent).await {
            Ok(Ok(resp)) if resp.status().is_success() => {
                let served_by = resp.extensions().get::<ServedBy>().map(|s| s.0.clone());
                if let Some(name) = &served_by {
                    self.excluded.push(name.to_string());
                }
                Ok((resp.into_body(), served_by))
            }
            Ok(Ok(_)) | Ok(Err(_)) | Err(_) => Err(MidStreamResult::FallbackFailed),
        }
    }

    /// The counter and the span event (never any prompt or answer text).
    fn observe(&self, cut: CutReason, result: MidStreamResult) {
        let resent = self.splice.tokens_sent();
        let reason = match cut {
            CutReason::Closed => MidStreamReason::Closed,
            CutReason::Stalled => MidStreamReason::Stalled,
            CutReason::ErrorEvent => MidStreamReason::ErrorEvent,
        };
        let ingress = MidStreamIngress::Responses;
        let _request = self.span.enter();
        info!(
            ingress = ingress.as_label(),
            reason = reason.as_label(),
            result = result.as_label(),
            tokens_resent = resent,
            "mid-stream fallback"
        );
        if let Some(metrics) = self
            .proxy
            .metrics()
            .and_then(|m| m.family::<MidStreamMetrics>())
        {
            metrics.fallback(ingress, reason, result, resent);
        }
    }
}
