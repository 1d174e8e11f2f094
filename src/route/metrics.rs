//! The Dynamo shim route's selection families: `continuum_dynamo_selection_total{role, reason}`
//! (one decode and one prefill reason per pick) and `continuum_dynamo_kv_selection_total{result}`
//! (what a KV-aware pick found). Counted by `route/dynamo.rs` once per routed request.

use continuum_actors::label_enum;
use continuum_actors::metrics::{Family, counter_vec};
pub use continuum_protocol::picker::{Phase as SelectionRole, SelectionReason};
use prometheus::{IntCounterVec, Registry};

label_enum! {
    /// `continuum_dynamo_kv_selection_total{result}`.
    KvSelectionResult {
        Overlap => "overlap",
        NoOverlap => "no_overlap",
        TokenizerUnavailable => "tokenizer_unavailable",
        PromptTooLarge => "prompt_too_large",
        RenderUnavailable => "render_unavailable",
        ArtifactUnpinned => "artifact_unpinned",
        Bypass => "bypass",
    }
}

/// The selection families, every label set at 0 from the start.
pub struct SelectionMetrics {
    selection: IntCounterVec,
    kv_selection: IntCounterVec,
}

impl Family for SelectionMetrics {
    fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let selection = counter_vec(
            registry,
            "continuum_dynamo_selection_total",
            "Worker selections by role and reason.",
            &["role", "reason"],
        )?;
        let kv_selection = counter_vec(
            registry,
            "continuum_dynamo_kv_selection_total",
            "KV-aware selections by result.",
            &["result"],
        )?;
        for role in SelectionRole::ALL {
            for reason in SelectionReason::ALL {
                selection.with_label_values(&[role.as_label(), reason.as_label()]);
            }
        }
        for result in KvSelectionResult::ALL {
            kv_selection.with_label_values(&[result.as_label()]);
        }
        Ok(Self {
            selection,
            kv_selection,
        })
    }
}

impl SelectionMetrics {
    pub fn selection(&self, role: SelectionRole, reason: SelectionReason) {
        self.selection
            .with_label_values(&[role.as_label(), reason.as_label()])
            .inc();
    }

    pub fn kv_selection(&self, result: KvSelectionResult) {
        self.kv_selection
            .with_label_values(&[result.as_label()])
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use continuum_actors::metrics::Metrics;

    use super::*;

    #[test]
    fn labels_are_the_seed_s_and_start_at_zero() {
        let results: BTreeSet<_> = KvSelectionResult::ALL
            .iter()
            .map(|r| r.as_label())
            .collect();
        assert_eq!(
            results,
            [
                "overlap",
                "no_overlap",
                "tokenizer_unavailable",
                "prompt_too_large",
                "render_unavailable",
                "artifact_unpinned",
                "bypass"
            ]
            .into_iter()
            .collect()
        );
        let metrics = Metrics::new("test").expect("metrics");
        let selection = metrics.register::<SelectionMetrics>().expect("registers");
        let v = |role, reason| {
            metrics.value(
                "continuum_dynamo_selection_total",
                &[("role", role), ("reason", reason)],
            )
        };
        assert_eq!(v("prefill", "no_prefill_pool"), Some(0.0));
        selection.selection(SelectionRole::Decode, SelectionReason::RoundRobinStale);
        selection.kv_selection(KvSelectionResult::Bypass);
        assert_eq!(v("decode", "round_robin_stale"), Some(1.0));
        assert_eq!(
            metrics.value(
                "continuum_dynamo_kv_selection_total",
                &[("result", "bypass")]
            ),
            Some(1.0)
        );
    }
}
