//! The direct-mode shim's families: `disaggregated_requests_total{routing_path}` (counted by the
//! proxy once per request while disaggregated serving is on) and
//! `disaggregated_errors_total{phase}` (counted by the route when a phase fails).

use continuum_actors::label_enum;
use continuum_actors::metrics::{Family, counter_vec};
use prometheus::{IntCounterVec, Registry};

label_enum! {
    /// `disaggregated_requests_total{routing_path}`.
    RoutingPath {
        /// A prefill and a decode worker were pinned.
        Disaggregated => "disaggregated",
        /// Only a decode (or aggregated) worker was pinned.
        Aggregated => "aggregated",
        /// Conditional bypass or unified fallback: no prefill hop.
        Unified => "unified",
    }
}

label_enum! {
    /// `disaggregated_errors_total{phase}`.
    DisaggregatedPhase {
        /// Selection or a direct-mode refusal before any worker ran.
        Orchestration => "orchestration",
        Prefill => "prefill",
        Decode => "decode",
    }
}

/// The shim's two families, every label at 0 from the start.
pub struct DisaggregatedMetrics {
    requests: IntCounterVec,
    errors: IntCounterVec,
}

impl Family for DisaggregatedMetrics {
    fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let requests = counter_vec(
            registry,
            "disaggregated_requests_total",
            "Requests routed through the direct-mode shim, by routing path.",
            &["routing_path"],
        )?;
        let errors = counter_vec(
            registry,
            "disaggregated_errors_total",
            "Disaggregated routing failures by phase.",
            &["phase"],
        )?;
        for path in RoutingPath::ALL {
            requests.with_label_values(&[path.as_label()]);
        }
        for phase in DisaggregatedPhase::ALL {
            errors.with_label_values(&[phase.as_label()]);
        }
        Ok(Self { requests, errors })
    }
}

impl DisaggregatedMetrics {
    pub fn request(&self, path: RoutingPath) {
        self.requests.with_label_values(&[path.as_label()]).inc();
    }

    pub fn error(&self, phase: DisaggregatedPhase) {
        self.errors.with_label_values(&[phase.as_label()]).inc();
    }
}

#[cfg(test)]
mod tests {
    use continuum_actors::metrics::Metrics;

    use super::*;

    #[test]
    fn both_families_start_at_zero_and_count() {
        let metrics = Metrics::new("test").expect("metrics");
        let shim = metrics
            .register::<DisaggregatedMetrics>()
            .expect("registers");
        let text = metrics.render();
        assert!(text.contains(r#"disaggregated_requests_total{routing_path="unified"} 0"#));
        assert!(text.contains(r#"disaggregated_errors_total{phase="prefill"} 0"#));
        shim.request(RoutingPath::Disaggregated);
        shim.error(DisaggregatedPhase::Orchestration);
        assert_eq!(
            metrics.value(
                "disaggregated_requests_total",
                &[("routing_path", "disaggregated")]
            ),
            Some(1.0)
        );
        assert_eq!(
            metrics.value("disaggregated_errors_total", &[("phase", "orchestration")]),
            Some(1.0)
        );
    }
}
