//! The KV index's families: `continuum_dynamo_kv_events_total{result}` (kv-events applied or
//! dropped; the one closed set the index, the envelope decoder and this metric share) and
//! `continuum_dynamo_kv_hash_parity_total{model, result}` (was a KV-aware pick's predicted block
//! hash stored by the worker?). `model` is a fleet model name, bounded by the fleet view; a
//! departed model's series are removed.

pub use continuum_protocol::kv::KvEventResult;
use prometheus::{IntCounterVec, Registry};

use crate::label_enum;
use crate::metrics::{Family, counter_vec};

label_enum! {
    /// `continuum_dynamo_kv_hash_parity_total{model, result}`: was a KV-aware pick's predicted
    /// block hash stored by the worker under the same `tokens_hash`?
    KvParityResult {
        Match => "match",
        Mismatch => "mismatch",
    }
}

/// The KV index's families. Every `result` of the events starts at 0.
pub struct KvIndexMetrics {
    events: IntCounterVec,
    hash_parity: IntCounterVec,
}

impl Family for KvIndexMetrics {
    fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let events = counter_vec(
            registry,
            "continuum_dynamo_kv_events_total",
            "kv-events applied or dropped, by result.",
            &["result"],
        )?;
        for result in KvEventResult::ALL {
            events.with_label_values(&[result.as_label()]);
        }
        let hash_parity = counter_vec(
            registry,
            "continuum_dynamo_kv_hash_parity_total",
            "KV-aware picks whose predicted block hashes the worker stored (match) or not, by model.",
            &["model", "result"],
        )?;
        Ok(Self {
            events,
            hash_parity,
        })
    }
}

impl KvIndexMetrics {
    pub fn kv_event(&self, result: KvEventResult) {
        self.kv_events(result, 1);
    }

    pub fn kv_events(&self, result: KvEventResult, count: u64) {
        self.events
            .with_label_values(&[result.as_label()])
            .inc_by(count);
    }

    /// `model` is a fleet model name (bounded by the fleet view); remove its series with
    /// [`KvIndexMetrics::remove_kv_hash_parity_model`] when it leaves.
    pub fn kv_hash_parity(&self, model: &str, result: KvParityResult) {
        self.hash_parity
            .with_label_values(&[model, result.as_label()])
            .inc();
    }

    /// Removes a departed model's parity series.
    pub fn remove_kv_hash_parity_model(&self, model: &str) {
        for result in KvParityResult::ALL {
            // A result that never happened has no series; nothing to remove then.
            let _ = self
                .hash_parity
                .remove_label_values(&[model, result.as_label()]);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::metrics::testing::{check_closed, metrics};

    /// The kv-events result labels are exactly those the metric had before the enums merged.
    #[test]
    fn kv_event_labels_are_unchanged_and_parity_series_leave_with_their_model() {
        check_closed(&KvEventResult::ALL, KvEventResult::as_label);
        check_closed(KvParityResult::ALL, KvParityResult::as_label);
        let labels: BTreeSet<&str> = KvEventResult::ALL.iter().map(|r| r.as_label()).collect();
        let expected: BTreeSet<&str> = [
            "applied",
            "replay",
            "gap",
            "other_tier",
            "malformed",
            "unknown_version",
            "topic_mismatch",
            "oversized",
            "identity_mismatch",
            "over_capacity",
            "transport_refused",
            "cache_owner",
            "orphan",
        ]
        .into_iter()
        .collect();
        assert_eq!(labels, expected);
        let metrics = metrics();
        let kv = metrics.register::<KvIndexMetrics>().expect("registers");
        assert!(
            metrics
                .render()
                .contains(r#"continuum_dynamo_kv_events_total{result="applied"} 0"#)
        );
        kv.kv_event(KvEventResult::Gap);
        assert_eq!(
            metrics.value("continuum_dynamo_kv_events_total", &[("result", "gap")]),
            Some(1.0)
        );
        kv.kv_hash_parity("m", KvParityResult::Match);
        kv.kv_hash_parity("m", KvParityResult::Mismatch);
        kv.kv_hash_parity("n", KvParityResult::Match);
        let v = |model: &str, result: &str| {
            metrics.value(
                "continuum_dynamo_kv_hash_parity_total",
                &[("model", model), ("result", result)],
            )
        };
        assert_eq!(v("m", "mismatch"), Some(1.0));
        kv.remove_kv_hash_parity_model("m");
        assert_eq!(v("m", "match"), None);
        assert_eq!(v("m", "mismatch"), None);
        assert_eq!(v("n", "match"), Some(1.0));
    }
}
