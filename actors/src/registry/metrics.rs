//! The registry's family: `continuum_dynamo_workers{namespace, role}`, materialised workers in
//! the published fleet view. `namespace` is bounded by the configuration; a namespace that
//! leaves it has its series removed.

use continuum_protocol::ids::Namespace;
use prometheus::{IntGaugeVec, Registry};

use crate::label_enum;
use crate::metrics::{Family, gauge_value, gauge_vec};

label_enum! {
    /// The `role` of `continuum_dynamo_workers{namespace, role}`.
    WorkerRole {
        Prefill => "prefill",
        Decode => "decode",
        Aggregated => "aggregated",
        /// Visible to operators, never routed to.
        Unknown => "unknown",
    }
}

/// The registry's family. No series until the fleet is seen.
pub struct RegistryMetrics {
    workers: IntGaugeVec,
}

impl Family for RegistryMetrics {
    fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        Ok(Self {
            workers: gauge_vec(
                registry,
                "continuum_dynamo_workers",
                "Materialised workers in the published fleet view, by namespace and role.",
                &["namespace", "role"],
            )?,
        })
    }
}

impl RegistryMetrics {
    pub fn set_workers(&self, namespace: &Namespace, role: WorkerRole, count: u64) {
        self.workers
            .with_label_values(&[namespace.as_str(), role.as_label()])
            .set(gauge_value(count));
    }

    /// Removes a namespace's worker-count series (the namespace left the configuration).
    pub fn remove_namespace(&self, namespace: &Namespace) {
        for role in WorkerRole::ALL {
            // Absent series are fine: the namespace may never have had that role.
            let _ = self
                .workers
                .remove_label_values(&[namespace.as_str(), role.as_label()]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::testing::{check_closed, metrics};

    #[test]
    fn worker_counts_move_by_namespace_and_leave_with_it() {
        check_closed(WorkerRole::ALL, WorkerRole::as_label);
        let metrics = metrics();
        let registry = metrics.register::<RegistryMetrics>().expect("registers");
        assert!(!metrics.render().contains("continuum_dynamo_workers{"));
        registry.set_workers(&Namespace::new("dynamo"), WorkerRole::Decode, 2);
        let v = || {
            metrics.value(
                "continuum_dynamo_workers",
                &[("namespace", "dynamo"), ("role", "decode")],
            )
        };
        assert_eq!(v(), Some(2.0));
        registry.remove_namespace(&Namespace::new("dynamo"));
        assert_eq!(v(), None);
    }
}
