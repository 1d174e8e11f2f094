//! The mid-stream fallback's families: `continuum_mid_stream_fallback_total{ingress, reason,
//! result}` (one per cut stream) and `continuum_mid_stream_fallback_tokens_resent_total`.

use continuum_actors::label_enum;
use continuum_actors::metrics::{Family, counter_vec};
use prometheus::{IntCounter, IntCounterVec, Registry};

label_enum! {
    /// `continuum_mid_stream_fallback_total{ingress}`.
    MidStreamIngress {
        ChatCompletions => "chat_completions",
        Completions => "completions",
        /// The native `/v1/responses` passthrough.
        Responses => "responses",
    }
}

label_enum! {
    /// `continuum_mid_stream_fallback_total{reason}`: why the stream counts as cut.
    MidStreamReason {
        /// The upstream failed or closed before its terminal event.
        Closed => "closed",
        /// No event within `inactivity_timeout`.
        Stalled => "stalled",
        /// An error chunk instead of content.
        ErrorEvent => "error_event",
    }
}

label_enum! {
    /// `continuum_mid_stream_fallback_total{result}`: what followed the cut.
    MidStreamResult {
        /// A fallback target answered; its stream continues the client's.
        Continued => "continued",
        /// Every attempt's fallback failed or stalled before its head.
        FallbackFailed => "fallback_failed",
        /// No unified candidate besides the excluded ones.
        NoFallback => "no_fallback",
        /// The retry budget refused.
        BudgetExhausted => "budget_exhausted",
        /// `max_attempts` continuations were already made.
        AttemptsExhausted => "attempts_exhausted",
        /// The cut fell inside a tool call.
        RefusedToolCall => "refused_tool_call",
        /// The cut fell inside a reasoning block.
        RefusedReasoning => "refused_reasoning",
        /// The answer text exceeded `max_buffered_bytes`.
        DisarmedOverCap => "disarmed_over_cap",
        /// Several choices, or a body the continuation cannot be built from.
        RefusedUnsupported => "refused_unsupported",
    }
}

/// The fallback's families, every `(ingress, reason, result)` at 0 from the start.
pub struct MidStreamMetrics {
    fallback: IntCounterVec,
    tokens_resent: IntCounter,
}

impl Family for MidStreamMetrics {
    fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let fallback = counter_vec(
            registry,
            "continuum_mid_stream_fallback_total",
            "Streams cut after their first byte, by ingress, reason and what followed.",
            &["ingress", "reason", "result"],
        )?;
        let tokens_resent = IntCounter::new(
            "continuum_mid_stream_fallback_tokens_resent_total",
            "Completion tokens sent again as the partial answer of a continuation request.",
        )?;
        registry.register(Box::new(tokens_resent.clone()))?;
        for ingress in MidStreamIngress::ALL {
            for reason in MidStreamReason::ALL {
                for result in MidStreamResult::ALL {
                    let labels = [ingress.as_label(), reason.as_label(), result.as_label()];
                    fallback.with_label_values(&labels);
                }
            }
        }
        Ok(Self {
            fallback,
            tokens_resent,
        })
    }
}

impl MidStreamMetrics {
    /// One mid-stream cut; a continued one also counts the tokens its continuation re-sent.
    pub fn fallback(
        &self,
        ingress: MidStreamIngress,
        reason: MidStreamReason,
        result: MidStreamResult,
        resent: u64,
    ) {
        let labels = [ingress.as_label(), reason.as_label(), result.as_label()];
        self.fallback.with_label_values(&labels).inc();
        if result == MidStreamResult::Continued {
            self.tokens_resent.inc_by(resent);
        }
    }
}

#[cfg(test)]
mod tests {
    use continuum_actors::metrics::Metrics;

    use super::*;

    #[test]
    fn every_cut_starts_at_zero_and_a_continuation_counts_its_tokens() {
        let metrics = Metrics::new("test").expect("metrics");
        let mid = metrics.register::<MidStreamMetrics>().expect("registers");
        assert!(metrics.render().contains(
            r#"continuum_mid_stream_fallback_total{ingress="responses",reason="stalled",result="no_fallback"} 0"#
        ));
        let (ingress, reason) = (MidStreamIngress::ChatCompletions, MidStreamReason::Closed);
        mid.fallback(ingress, reason, MidStreamResult::Continued, 7);
        mid.fallback(ingress, reason, MidStreamResult::NoFallback, 9);
        let labels = |result| {
            [
                ("ingress", "chat_completions"),
                ("reason", "closed"),
                ("result", result),
            ]
        };
        let v = |result| metrics.value("continuum_mid_stream_fallback_total", &labels(result));
        assert_eq!(v("continued"), Some(1.0));
        assert_eq!(v("no_fallback"), Some(1.0));
        assert_eq!(
            metrics.value("continuum_mid_stream_fallback_tokens_resent_total", &[]),
            Some(7.0)
        );
    }
}
