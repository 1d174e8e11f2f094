//! `admission`: when every eligible worker of a model is over its busy threshold, requests wait in
//! a bounded per-model queue; with its validation rules. Off while no threshold is set.
//!
//! The rule itself is `continuum_protocol::admission`; the waiting is `crate::route::admission`.
//! The queue is per router replica (docs/runtime-semantics.md "Admission queue").

use std::time::Duration;

use continuum_protocol::admission::BusyThreshold;
use serde::{Deserialize, Serialize};

use super::schema::{Config, HumanDuration};
use super::{Diagnostic, Severity};

/// Default `admission.queue.max_depth`.
pub const DEFAULT_MAX_DEPTH: usize = 256;
/// Largest `admission.queue.max_depth` accepted.
pub const MAX_DEPTH: usize = 100_000;
/// Default `admission.queue.max_wait`.
pub const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(30);
/// Largest `admission.queue.max_wait` accepted.
pub const MAX_WAIT: Duration = Duration::from_secs(600);

/// `admission`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AdmissionConfig {
    /// When a worker rank counts as busy; admission applies only while one is set.
    pub busy_threshold: BusyThresholdConfig,
    pub queue: QueueConfig,
}

impl AdmissionConfig {
    /// Whether admission applies (a threshold is set).
    pub fn enabled(&self) -> bool {
        self.busy_threshold.threshold().is_set()
    }
}

/// `admission.busy_threshold`: a rank is busy when any set threshold is reached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BusyThresholdConfig {
    /// Fraction of `total_kv_blocks` held by the decode backlog (0 < x ≤ 1).
    pub kv_usage: Option<f64>,
    /// Prefill backlog in tokens (≥ 1).
    pub prefill_tokens: Option<u64>,
}

impl BusyThresholdConfig {
    /// The rule's threshold.
    pub fn threshold(&self) -> BusyThreshold {
        BusyThreshold {
            kv_usage: self.kv_usage,
            prefill_tokens: self.prefill_tokens,
        }
    }
}

/// `admission.queue`: per model.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct QueueConfig {
    /// Most requests waiting per model (0: refuse at once when busy).
    pub max_depth: usize,
    /// Longest a request waits before it is refused.
    pub max_wait: HumanDuration,
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            max_depth: DEFAULT_MAX_DEPTH,
            max_wait: HumanDuration::from_secs(DEFAULT_MAX_WAIT.as_secs()),
        }
    }
}

/// The `admission` rules: `kv_usage` within `(0, 1]`, `prefill_tokens` at least 1, `max_depth`
/// within `0..=MAX_DEPTH`, `max_wait` within `(0, MAX_WAIT]`; thresholds without
/// `disaggregated_serving.enabled` and `dynamo.enabled` never apply (warning).
pub fn validate(config: &Config) -> Vec<Diagnostic> {
    let admission = &config.admission;
    let mut out = Vec::new();
    if let Some(kv) = admission.busy_threshold.kv_usage
        && !(kv > 0.0 && kv <= 1.0)
    {
        out.push(Diagnostic::error(
            "admission.busy_threshold.kv_usage",
            "kv_usage must be a fraction above 0 and at most 1",
        ));
    }
    if admission.busy_threshold.prefill_tokens == Some(0) {
        out.push(Diagnostic::error(
            "admission.busy_threshold.prefill_tokens",
            "prefill_tokens must be at least 1",
        ));
    }
    if admission.queue.max_depth > MAX_DEPTH {
        out.push(Diagnostic::error(
            "admission.queue.max_depth",
            format!("max_depth must be at most {MAX_DEPTH}"),
        ));
    }
    let wait = admission.queue.max_wait.get();
    if wait.is_zero() || wait > MAX_WAIT {
        out.push(Diagnostic::error(
            "admission.queue.max_wait",
            format!(
                "max_wait must be above 0 and at most {}s",
                MAX_WAIT.as_secs()
            ),
        ));
    }
    if admission.enabled() && !(config.dynamo.enabled && config.disaggregated_serving.enabled) {
        out.push(Diagnostic::warning(
            "admission.busy_threshold",
            "busy thresholds read Dynamo load samples: they apply only with dynamo.enabled and disaggregated_serving.enabled",
        ));
    }
    out.sort_by_key(|d| d.severity == Severity::Warning);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paths(config: &Config) -> Vec<String> {
        validate(config).into_iter().map(|d| d.path).collect()
    }

    #[test]
    fn off_by_default_and_out_of_range_values_are_refused() {
        let mut c = Config::default();
        assert!(!c.admission.enabled());
        assert!(paths(&c).is_empty());
        c.admission.busy_threshold.kv_usage = Some(1.5);
        c.admission.busy_threshold.prefill_tokens = Some(0);
        c.admission.queue.max_depth = MAX_DEPTH + 1;
        c.admission.queue.max_wait = HumanDuration::from_secs(0);
        assert_eq!(
            paths(&c),
            [
                "admission.busy_threshold.kv_usage",
                "admission.busy_threshold.prefill_tokens",
                "admission.queue.max_depth",
                "admission.queue.max_wait",
                "admission.busy_threshold",
            ]
        );
        c.admission.busy_threshold.kv_usage = Some(f64::NAN);
        assert!(paths(&c).contains(&"admission.busy_threshold.kv_usage".to_owned()));
    }

    #[test]
    fn yaml_keys_parse_with_their_defaults() {
        let yaml = "admission: {busy_threshold: {kv_usage: 0.9}, queue: {max_wait: 5s}}";
        let c = Config::from_yaml_str(yaml, &crate::config::ProcessEnv)
            .expect("yaml")
            .admission;
        assert!(c.enabled());
        assert_eq!(c.queue.max_depth, DEFAULT_MAX_DEPTH);
        assert_eq!(c.queue.max_wait.get(), Duration::from_secs(5));
    }
}
