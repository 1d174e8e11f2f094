//! `admission`: when every eligible worker of a model is over its busy threshold, requests wait in
//! a bounded per-model queue; with its validation rules. Off while no threshold is set.
//!
//! The rule itself is `continuum_protocol::admission`; the waiting is `crate::route::admission`.
//! The queue is per router replica (docs/runtime-semantics.md "Admission queue").

use std::collections::BTreeMap;
use std::time::Duration;

use continuum_protocol::admission::{BusyThreshold, DEFAULT_QUANTUM, Order};
use serde::{Deserialize, Serialize};

use super::schema::{Config, HumanDuration};
use super::{Diagnostic, Severity};

/// Default `admission.queue.max_depth`.
pub const DEFAULT_MAX_DEPTH: usize = 256;
/// Largest `admission.queue.max_depth` accepted.
pub const MAX_DEPTH: usize = 10_000;
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
    /// Priority classes per API key, aging, and fair turns between keys of a class.
    pub priority: PriorityConfig,
}

impl AdmissionConfig {
    /// Whether admission applies (a threshold is set).
    pub fn enabled(&self) -> bool {
        self.busy_threshold.threshold().is_set()
    }

    /// What a waiting request reads at every re-check.
    pub fn bounds(&self) -> Bounds {
        Bounds {
            max_depth: self.queue.max_depth,
            max_wait: self.queue.max_wait.get(),
            order: Order {
                aging: Some(self.priority.aging.get()).filter(|a| !a.is_zero()),
                quantum: self.priority.quantum_tokens,
            },
        }
    }

    /// The class of a request of the key `name` (`None`: unauthenticated), 0 served first:
    /// `asked` (the [`PRIORITY_HEADER`] value) when the key may select it
    /// (`priority.selectable`), else the key's class.
    pub fn class_of(&self, name: Option<&str>, asked: Option<&str>) -> u8 {
        let priority = &self.priority;
        let chosen = asked.and_then(Class::parse).filter(|class| {
            name.and_then(|n| priority.selectable.get(n))
                .is_some_and(|allowed| allowed.contains(class))
        });
        chosen
            .or_else(|| name.and_then(|n| priority.api_keys.get(n)).copied())
            .unwrap_or(priority.default)
            .rank()
    }
}

/// The queue's bounds and order, as configured now.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bounds {
    pub max_depth: usize,
    pub max_wait: Duration,
    pub order: Order,
}

/// A priority class.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Class {
    High,
    #[default]
    Normal,
    Low,
}

/// The request header a key listed in `admission.priority.selectable` may name its class with
/// (`proxy::headers::PRIORITY_REQUEST`, which is never forwarded).
pub const PRIORITY_HEADER: &str = "x-continuum-priority";

impl Class {
    /// A class by name (`high`, `normal`, `low`; ASCII case ignored).
    pub fn parse(text: &str) -> Option<Self> {
        let text = text.trim();
        [Class::High, Class::Normal, Class::Low]
            .into_iter()
            .find(|c| c.name().eq_ignore_ascii_case(text))
    }

    pub const fn name(self) -> &'static str {
        match self {
            Class::High => "high",
            Class::Normal => "normal",
            Class::Low => "low",
        }
    }

    /// The class of a queue rank ([`Class::rank`]); ranks past the last are `Low`.
    pub const fn of_rank(rank: u8) -> Self {
        match rank {
            0 => Class::High,
            1 => Class::Normal,
            _ => Class::Low,
        }
    }

    /// 0 (high) is served first.
    pub const fn rank(self) -> u8 {
        match self {
            Class::High => 0,
            Class::Normal => 1,
            Class::Low => 2,
        }
    }
}

/// `admission.priority`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PriorityConfig {
    /// Class by `api_keys[].name`.
    pub api_keys: BTreeMap<String, Class>,
    /// Class of keys not listed and of unauthenticated requests.
    pub default: Class,
    /// Classes a key may ask for per request with [`PRIORITY_HEADER`], by `api_keys[].name`.
    pub selectable: BTreeMap<String, Vec<Class>>,
    /// A waiting request rises one class per `aging` waited (`0s`: strict classes).
    pub aging: HumanDuration,
    /// Deficit round robin's credit per turn, in prompt tokens (the estimate).
    pub quantum_tokens: u64,
}

impl Default for PriorityConfig {
    fn default() -> Self {
        Self {
            api_keys: BTreeMap::new(),
            default: Class::Normal,
            selectable: BTreeMap::new(),
            aging: HumanDuration::from_secs(DEFAULT_AGING.as_secs()),
            quantum_tokens: DEFAULT_QUANTUM,
        }
    }
}

/// Default `admission.priority.aging`.
pub const DEFAULT_AGING: Duration = Duration::from_secs(10);
/// Largest `admission.priority.quantum_tokens` accepted.
pub const MAX_QUANTUM: u64 = 1_000_000_000;

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
    priority(config, &mut out);
    if admission.enabled() && !(config.dynamo.enabled && config.disaggregated_serving.enabled) {
        out.push(Diagnostic::warning(
            "admission.busy_threshold",
            "busy thresholds read Dynamo load samples: they apply only with dynamo.enabled and disaggregated_serving.enabled",
        ));
    }
    out.sort_by_key(|d| d.severity == Severity::Warning);
    out
}

/// `admission.priority`: named keys exist, `quantum_tokens` within bounds.
fn priority(config: &Config, out: &mut Vec<Diagnostic>) {
    let priority = &config.admission.priority;
    let named = priority
        .api_keys
        .keys()
        .map(|n| ("api_keys", n))
        .chain(priority.selectable.keys().map(|n| ("selectable", n)));
    for (map, name) in named {
        if !config.api_keys.iter().any(|k| &k.name == name) {
            out.push(Diagnostic::error(
                format!("admission.priority.{map}.{name}"),
                format!("no api_keys[] entry is named {name:?}"),
            ));
        }
    }
    if !(1..=MAX_QUANTUM).contains(&priority.quantum_tokens) {
        out.push(Diagnostic::error(
            "admission.priority.quantum_tokens",
            format!("quantum_tokens must be between 1 and {MAX_QUANTUM}"),
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paths(config: &Config) -> Vec<String> {
        validate(config).into_iter().map(|d| d.path).collect()
    }

    #[test]
    fn a_class_and_its_rank_agree() {
        for class in [Class::High, Class::Normal, Class::Low] {
            assert_eq!(Class::of_rank(class.rank()), class);
        }
        assert_eq!(Class::of_rank(u8::MAX), Class::Low);
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
        c.admission
            .priority
            .api_keys
            .insert("ghost".into(), Class::High);
        c.admission.priority.quantum_tokens = 0;
        let all = paths(&c);
        for path in [
            "admission.priority.api_keys.ghost",
            "admission.priority.quantum_tokens",
        ] {
            assert!(all.contains(&path.to_owned()), "{all:?}");
        }
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
        assert_eq!(c.bounds().order.aging, Some(DEFAULT_AGING));
        let yaml = "admission: {priority: {api_keys: {a: high}, default: low, aging: 0s}}";
        let c = Config::from_yaml_str(yaml, &crate::config::ProcessEnv)
            .expect("yaml")
            .admission;
        assert_eq!(c.class_of(Some("a"), None), 0);
        assert_eq!(c.class_of(Some("b"), None), 2);
        assert_eq!(c.class_of(None, None), 2);
        assert_eq!(c.bounds().order.aging, None, "0s: strict classes");
        // Only a key allowed to select a class gets it by header.
        let yaml = "admission: {priority: {api_keys: {a: low}, selectable: {a: [normal, high]}}}";
        let c = Config::from_yaml_str(yaml, &crate::config::ProcessEnv).expect("yaml");
        assert!(
            validate(&c)
                .iter()
                .any(|d| d.path == "admission.priority.selectable.a")
        );
        let c = c.admission;
        assert_eq!(c.class_of(Some("a"), Some("HIGH")), 0);
        assert_eq!(c.class_of(Some("a"), Some("normal")), 1);
        assert_eq!(c.class_of(Some("a"), Some("bogus")), 2);
        assert_eq!(c.class_of(Some("b"), Some("high")), 1);
        assert_eq!(c.class_of(None, Some("high")), 1);
    }
}
