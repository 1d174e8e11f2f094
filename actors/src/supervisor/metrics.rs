//! The supervisors' families: `continuum_actor_restarts_total{actor}` and
//! `continuum_actor_restart_budget_exhausted_total{actor}`, by the closed set of actor kinds.

use prometheus::{IntCounterVec, Registry};

use crate::lifecycle::ActorKind;
use crate::metrics::{Family, counter_vec};

/// The supervisors' families, every actor kind at 0 from the start.
pub struct SupervisorMetrics {
    restarts: IntCounterVec,
    budget_exhausted: IntCounterVec,
}

impl Family for SupervisorMetrics {
    fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let restarts = counter_vec(
            registry,
            "continuum_actor_restarts_total",
            "Supervisor restarts of a failed actor, by actor kind.",
            &["actor"],
        )?;
        let budget_exhausted = counter_vec(
            registry,
            "continuum_actor_restart_budget_exhausted_total",
            "Supervisors that spent a child's restart budget and escalated, by actor kind.",
            &["actor"],
        )?;
        for kind in ActorKind::ALL {
            restarts.with_label_values(&[kind.as_label()]);
            budget_exhausted.with_label_values(&[kind.as_label()]);
        }
        Ok(Self {
            restarts,
            budget_exhausted,
        })
    }
}

impl SupervisorMetrics {
    pub fn actor_restart(&self, kind: ActorKind) {
        self.restarts.with_label_values(&[kind.as_label()]).inc();
    }

    /// A supervisor spent `kind`'s restart budget and escalated (or gave up starting it).
    pub fn restart_budget_exhausted(&self, kind: ActorKind) {
        self.budget_exhausted
            .with_label_values(&[kind.as_label()])
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::testing::{check_closed, metrics};

    #[test]
    fn kinds_are_closed_start_at_zero_and_count() {
        check_closed(ActorKind::ALL, ActorKind::as_label);
        let metrics = metrics();
        let supervisors = metrics.register::<SupervisorMetrics>().expect("registers");
        assert!(
            metrics
                .render()
                .contains(r#"continuum_actor_restarts_total{actor="subscription"} 0"#)
        );
        supervisors.actor_restart(ActorKind::Discovery);
        supervisors.restart_budget_exhausted(ActorKind::Discovery);
        for family in [
            "continuum_actor_restarts_total",
            "continuum_actor_restart_budget_exhausted_total",
        ] {
            assert_eq!(
                metrics.value(family, &[("actor", "discovery")]),
                Some(1.0),
                "{family}"
            );
        }
    }
}
