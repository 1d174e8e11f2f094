//! Mid-stream fallback for `POST /v1/chat/completions` and `/v1/completions` streams (issue 31):
//! the IO around `continuum_protocol::ingress::continuation::ChatSplice`; the native
//! `/v1/responses` passthrough's is [`responses`].
//!
//! An armed stream relays whole SSE events only. When the upstream fails or closes before its
//! terminal event, stalls past `inactivity_timeout`, or sends an error chunk, the rest of the
//! answer is asked of a unified fallback target (the failed backend and the shim pool excluded;
//! workers are never re-selected) with the continuation body, and its chunks are rewritten into
//! the same client stream. A cut that cannot be continued (tool call, reasoning, text over the
//! cap, attempts or retry budget exhausted, no fallback, the fallback failing too) ends the stream
//! with one error event. Dropping the client body drops the upstream request.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use self::metrics::{MidStreamIngress, MidStreamMetrics, MidStreamReason, MidStreamResult};
use crate::proxy::metrics::RoutingPath;
use axum::body::Body;
use axum::http::Response;
use bytes::Bytes;
use continuum_protocol::ingress::continuation::{
    ChatSplice, CutReason, Refusal, Relayed, error_event,
};
use hyper::body::Frame;
use tokio::time::Instant;
use tracing::info;

pub mod metrics;
mod responses;

use super::usage::Handoffs;
use crate::config::schema::MidStreamFallbackConfig;
use crate::proxy::{ClientRequest, Dispatch, OpenAiRoute, ParsedBody, Proxy, Scope, ServedBy};
use stall::Stall;

mod stall;

/// The retry budget's sliding window.
pub const BUDGET_WINDOW: Duration = Duration::from_secs(10);

/// Largest upstream SSE event an armed stream holds while it waits for the event's end.
pub const MAX_EVENT_BYTES: usize = 4 * 1024 * 1024;

/// The retry budget: continuations over the streams armed in the last [`BUDGET_WINDOW`].
#[derive(Default)]
pub struct RetryBudget {
    budget: Mutex<Budget>,
}

impl RetryBudget {
    fn record_stream(&self) {
        self.lock().record(Instant::now(), false);
    }

    /// Takes one continuation from the budget, or refuses.
    fn try_acquire(&self, config: &MidStreamFallbackConfig) -> bool {
        let mut budget = self.lock();
        let now = Instant::now();
        budget.expire(now);
        let (streams, continuations) = budget.counts();
        let allowed = config.budget_ratio * streams as f64
            + config.budget_min_per_s * BUDGET_WINDOW.as_secs_f64();
        if (continuations + 1) as f64 > allowed {
            return false;
        }
        budget.record(now, true);
        true
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Budget> {
        self.budget
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Streams and continuations of the last [`BUDGET_WINDOW`], one entry per second that had any.
#[derive(Default)]
struct Budget {
    /// (start of the second, streams, continuations), oldest first.
    seconds: VecDeque<(Instant, u64, u64)>,
}

impl Budget {
    fn expire(&mut self, now: Instant) {
        while let Some(&(at, _, _)) = self.seconds.front() {
            if now.duration_since(at) < BUDGET_WINDOW {
                break;
            }
            self.seconds.pop_front();
        }
    }

    fn record(&mut self, now: Instant, continuation: bool) {
        self.expire(now);
        let fresh = self
            .seconds
            .back()
            .is_none_or(|&(at, _, _)| now.duration_since(at) >= Duration::from_secs(1));
        if fresh {
            self.seconds.push_back((now, 0, 0));
        }
        if let Some(last) = self.seconds.back_mut() {
            if continuation {
                last.2 += 1;
            } else {
                last.1 += 1;
            }
        }
    }

    fn counts(&self) -> (u64, u64) {
        self.seconds
            .iter()
            .fold((0, 0), |(s, c), &(_, s1, c1)| (s + s1, c + c1))
    }
}

/// Arms a successful chat-completions, completions or native Responses stream when mid-stream
/// fallback is on; any other answer is returned as it is. `excluded` are backends a continuation never goes to (the shim pool).
pub fn arm(
    proxy: &Arc<Proxy>,
    budget: &Arc<RetryBudget>,
    request: ClientRequest,
    allowed: &[String],
    excluded: &[String],
    resp: Response<Body>,
) -> Response<Body> {
    let config = proxy.mid_stream_fallback();
    if !config.enabled || !request.body.stream || !resp.status().is_success() {
        return resp;
    }
    let (splice, ingress) = match request.route {
        OpenAiRoute::ChatCompletions => (
            ChatSplice::new(config.max_buffered_bytes, MAX_EVENT_BYTES),
            MidStreamIngress::ChatCompletions,
        ),
        OpenAiRoute::Completions => (
            ChatSplice::completions(config.max_buffered_bytes, MAX_EVENT_BYTES),
            MidStreamIngress::Completions,
        ),
        // The native Responses passthrough: another wire format, its own splice.
        OpenAiRoute::Responses => {
            let scope = (allowed, excluded);
            return responses::arm(proxy, budget, request, scope, config, resp);
        }
        OpenAiRoute::ResponsesCompact => return resp,
    };
    budget.record_stream();
    let mut excluded = excluded.to_vec();
    let served_by = resp.extensions().get::<ServedBy>().map(|s| s.0.clone());
    if let Some(name) = &served_by {
        excluded.push(name.to_string());
    }
    let handoffs = Handoffs::new(served_by);
    let (mut parts, body) = resp.into_parts();
    // The completion-token debit (`usage::debit_completion`) reads who served which part.
    parts.extensions.insert(handoffs.clone());
    let armed = Armed {
        splice,
        state: State::Relaying(body),
        stall: Stall::new(config.inactivity_timeout.get()),
        context: Some(Box::new(Context {
            ingress,
            attempts_left: config.max_attempts,
            config,
            proxy: proxy.clone(),
            budget: budget.clone(),
            request,
            allowed: allowed.to_vec(),
            excluded,
            handoffs,
            span: tracing::Span::current(),
        })),
    };
    Response::from_parts(parts, Body::new(armed))
}

/// The continuation's outcome: the context back, the `result` label, and the body and backend
/// of a continuation that started.
type Outcome = (
    Box<Context>,
    MidStreamResult,
    Option<(Body, Option<Arc<str>>)>,
);

/// One armed stream's state; dropping it drops the upstream body (and its request). A body of
/// its own (no stream adapters, no future per event): each poll reads the upstream frame and
/// hands over what the splice relays.
struct Armed {
    splice: ChatSplice,
    state: State,
    stall: Stall,
    /// What a continuation needs (`None` while the continuation's future holds it).
    context: Option<Box<Context>>,
}

enum State {
    /// Reading the upstream body (the original's or a continuation's).
    Relaying(Body),
    /// Asking a fallback for the rest; `out` is what goes to the client first.
    Continuing {
        cut: CutReason,
        out: Vec<u8>,
        next: Pin<Box<dyn Future<Output = Outcome> + Send>>,
    },
    Ended,
}

/// What only a continuation reads (boxed: the relay's hot state stays small).
struct Context {
    /// The `ingress` label: which OpenAI route the stream answers.
    ingress: MidStreamIngress,
    attempts_left: u32,
    config: Arc<MidStreamFallbackConfig>,
    proxy: Arc<Proxy>,
    budget: Arc<RetryBudget>,
    request: ClientRequest,
    allowed: Vec<String>,
    excluded: Vec<String>,
    /// The backends that served each part (shared with the completion-token debit).
    handoffs: Handoffs,
    /// The request's span: the fallback's event is recorded on it.
    span: tracing::Span,
}

impl hyper::body::Body for Armed {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        loop {
            let step = match &mut this.state {
                State::Ended => return Poll::Ready(None),
                State::Relaying(upstream) => match Pin::new(upstream).poll_frame(cx) {
                    Poll::Ready(frame) => this.upstream(frame),
                    Poll::Pending => match this.stall.poll(cx) {
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(()) => Step::Cut(CutReason::Stalled, Vec::new()),
                    },
                },
                State::Continuing { next, .. } => match next.as_mut().poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(outcome) => Step::Out(this.continued(outcome)),
                },
            };
            match step {
                Step::Again => {}
                Step::Out(out) if out.is_empty() => {}
                Step::Out(out) => return Poll::Ready(Some(Ok(Frame::data(out)))),
                Step::Cut(cut, out) => this.cut(cut, out),
            }
        }
    }

    /// True once ended, and already while the upstream says it ends with the frame just relayed
    /// and the splice saw an ordinary end (the server then ends the chunked body with that frame's
    /// write instead of polling once more).
    fn is_end_stream(&self) -> bool {
        match &self.state {
            State::Ended => true,
            State::Relaying(upstream) => upstream.is_end_stream() && self.splice.ends_here(),
            State::Continuing { .. } => false,
        }
    }
}

/// What one upstream frame (or the end of a continuation) leads to.
enum Step {
    /// Nothing for the client yet.
    Again,
    /// Bytes for the client (nothing when empty).
    Out(Bytes),
    /// The stream was cut after `out` was relayed.
    Cut(CutReason, Vec<u8>),
}

impl Armed {
    /// Reads one upstream frame, its error, or its end.
    fn upstream(&mut self, frame: Option<UpstreamFrame>) -> Step {
        self.stall.frame();
        let mut out = Vec::new();
        let cut = match frame {
            Some(Ok(frame)) => {
                let Ok(data) = frame.into_data() else {
                    return Step::Again;
                };
                let (relayed, cut) = self.splice.feed_frame(&data);
                let Some(reason) = cut else {
                    // Whole events relayed as they came leave as a slice of the frame (no copy).
                    return match relayed {
                        Relayed::Prefix(0) => Step::Again,
                        Relayed::Prefix(n) if n == data.len() => Step::Out(data),
                        Relayed::Prefix(n) => Step::Out(data.slice(..n)),
                        Relayed::Copied(bytes) => Step::Out(Bytes::from(bytes)),
                    };
                };
                out = match relayed {
                    Relayed::Prefix(n) => data[..n].to_vec(),
                    Relayed::Copied(bytes) => bytes,
                };
                // The relay's own event for a failed upstream body is a closed stream.
                if reason == CutReason::ErrorEvent
                    && self.splice.error_code() == Some("bad_gateway")
                {
                    CutReason::Closed
                } else {
                    reason
                }
            }
            Some(Err(_)) => CutReason::Closed,
            None => match self.splice.end(&mut out) {
                None => {
                    self.state = State::Ended;
                    return Step::Out(out.into());
                }
                Some(reason) => reason,
            },
        };
        Step::Cut(cut, out)
    }

    /// The stream was cut after `out` was relayed: the upstream is dropped and the continuation
    /// asked for (or refused at once).
    fn cut(&mut self, cut: CutReason, out: Vec<u8>) {
        let Some(mut context) = self.context.take() else {
            self.state = State::Ended;
            return;
        };
        let splice = &self.splice;
        let body = match splice.refusal() {
            Some(refusal) => Err(refused(refusal)),
            None => splice
                .continuation_body(&context.request.body.outbound)
                .map_err(|_| MidStreamResult::RefusedUnsupported),
        };
        let next = Box::pin(async move {
            let (result, continued) = match body {
                Ok(outbound) => context.attempts(outbound).await,
                Err(result) => (result, None),
            };
            (context, result, continued)
        });
        self.state = State::Continuing { cut, out, next };
    }

    /// The continuation decided: relays on from its body, or ends with the error event.
    fn continued(&mut self, (context, result, continued): Outcome) -> Bytes {
        let State::Continuing { cut, mut out, .. } =
            std::mem::replace(&mut self.state, State::Ended)
        else {
            return Bytes::new();
        };
        match continued {
            Some((body, served_by)) => {
                context
                    .handoffs
                    .hand_off(self.splice.tokens_sent(), served_by);
                self.splice.start_continuation();
                self.stall.restart();
                self.state = State::Relaying(body);
            }
            None => {
                let message = format!(
                    "the upstream stream was cut ({}) and could not be continued ({})",
                    cut.as_label(),
                    result.as_label()
                );
                out.extend(error_event(&message, "bad_gateway"));
            }
        }
        context.observe(&self.splice, cut, result);
        self.context = Some(context);
        out.into()
    }
}

/// One frame of the upstream body, or its error.
type UpstreamFrame = Result<Frame<Bytes>, axum::Error>;

impl Context {
    /// Up to `attempts_left` continuations within the budget: the first that starts, or why
    /// none did.
    async fn attempts(
        &mut self,
        outbound: Vec<u8>,
    ) -> (MidStreamResult, Option<(Body, Option<Arc<str>>)>) {
        let outbound = Bytes::from(outbound);
        let mut result = MidStreamResult::AttemptsExhausted;
        while self.attempts_left > 0 {
            if !self.budget.try_acquire(&self.config) {
                return (MidStreamResult::BudgetExhausted, None);
            }
            self.attempts_left -= 1;
            match self.dispatch(outbound.clone()).await {
                Ok(started) => return (MidStreamResult::Continued, Some(started)),
                Err(why) => result = why,
            }
        }
        (result, None)
    }

    /// Sends the continuation to the unified candidates minus the excluded ones; the head must
    /// arrive within the inactivity timeout. Returns the body and the backend that serves it.
    async fn dispatch(
        &mut self,
        outbound: Bytes,
    ) -> Result<(Body, Option<Arc<str>>), MidStreamResult> {
        let scope = Scope {
            allowed: &self.allowed,
            only: None,
        };
        let request = &self.request;
        let candidates: Vec<_> = self
            .proxy
            .candidates_for(request.route, &request.body.model, scope)
            .map_err(|_| MidStreamResult::NoFallback)?
            .into_iter()
            .filter(|b| !self.excluded.iter().any(|name| name == b.name()))
            .collect();
        if candidates.is_empty() {
            return Err(MidStreamResult::NoFallback);
        }
        let continuation = ClientRequest {
            body: ParsedBody {
                outbound,
                ..request.body.clone()
            },
            ..request.clone()
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
    fn observe(&self, splice: &ChatSplice, cut: CutReason, result: MidStreamResult) {
        let resent = splice.tokens_sent();
        let reason = match cut {
            CutReason::Closed => MidStreamReason::Closed,
            CutReason::Stalled => MidStreamReason::Stalled,
            CutReason::ErrorEvent => MidStreamReason::ErrorEvent,
        };
        let _request = self.span.enter();
        info!(
            ingress = self.ingress.as_label(),
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
            metrics.fallback(self.ingress, reason, result, resent);
        }
    }
}

/// The `result` label of a refused continuation.
fn refused(refusal: Refusal) -> MidStreamResult {
    match refusal {
        Refusal::ToolCall => MidStreamResult::RefusedToolCall,
        Refusal::Reasoning => MidStreamResult::RefusedReasoning,
        Refusal::OverCap => MidStreamResult::DisarmedOverCap,
        Refusal::Unsupported => MidStreamResult::RefusedUnsupported,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The budget allows `ratio` × streams + `min_per_s` × window continuations over the last
    /// window, and forgets what left it (paused clock).
    #[tokio::test(start_paused = true)]
    async fn the_retry_budget_slides_over_its_window() {
        let budget = RetryBudget::default();
        let config = MidStreamFallbackConfig {
            budget_ratio: 0.5,
            budget_min_per_s: 0.0,
            ..MidStreamFallbackConfig::default()
        };
        for _ in 0..4 {
            budget.record_stream();
        }
        assert!(budget.try_acquire(&config));
        assert!(budget.try_acquire(&config));
        assert!(!budget.try_acquire(&config), "2 of 4 streams is the ratio");
        tokio::time::advance(BUDGET_WINDOW).await;
        assert!(
            !budget.try_acquire(&config),
            "no streams left in the window"
        );
        let floor = MidStreamFallbackConfig {
            budget_min_per_s: 0.1,
            ..config
        };
        assert!(budget.try_acquire(&floor), "the floor allows one per 10 s");
        assert!(!budget.try_acquire(&floor));
    }
}
