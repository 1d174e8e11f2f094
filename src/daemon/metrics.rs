//! The daemon's own families: `continuum_config_reload_refusals_total{reason}` and
//! `continuum_router_build_info{version, features}`; and [`register_all`], which registers every
//! family of the process at startup (the composition root is the one place that knows them all).

use continuum_actors::label_enum;
use continuum_actors::metrics::{Family, Metrics, MetricsError, counter_vec, gauge_vec};
use prometheus::{IntCounterVec, IntGaugeVec, Registry};

label_enum! {
    /// The `reason` of `continuum_config_reload_refusals_total{reason}`: why a config reload
    /// (file watch, SIGHUP or `POST /admin/config/reload`) kept the running config.
    ReloadRefusal {
        /// The file could not be read, parsed or validated.
        Invalid => "invalid",
        /// It would remove every backend without writing `backends: []`.
        RemovesAllBackends => "removes_all_backends",
        /// It would disable the admin API (or drop its token) without `admin.enabled: false`.
        DisablesAdmin => "disables_admin",
    }
}

/// The daemon's families.
pub struct DaemonMetrics {
    reload_refusals: IntCounterVec,
    build_info: IntGaugeVec,
}

impl Family for DaemonMetrics {
    fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let reload_refusals = counter_vec(
            registry,
            "continuum_config_reload_refusals_total",
            "Config reloads refused (the running config stays), by reason.",
            &["reason"],
        )?;
        for reason in ReloadRefusal::ALL {
            reload_refusals.with_label_values(&[reason.as_label()]);
        }
        let build_info = gauge_vec(
            registry,
            "continuum_router_build_info",
            "Always 1: the running binary's version and compiled Cargo features.",
            &["version", "features"],
        )?;
        Ok(Self {
            reload_refusals,
            build_info,
        })
    }
}

impl DaemonMetrics {
    pub fn config_reload_refused(&self, reason: ReloadRefusal) {
        self.reload_refusals
            .with_label_values(&[reason.as_label()])
            .inc();
    }

    /// Sets `continuum_router_build_info{version, features} 1` (the only series of the family).
    /// Both values are compile-time constants of the binary, never input.
    pub fn set_build_info(&self, version: &'static str, features: &'static str) {
        self.build_info.reset();
        self.build_info
            .with_label_values(&[version, features])
            .set(1);
    }
}

/// Registers every family of the process (the actors' and the router's), closed-set series at
/// 0, so the first scrape shows them whichever subsystems the configuration starts; sets
/// `continuum_router_build_info` to this binary's.
pub fn register_all(metrics: &Metrics) -> Result<(), MetricsError> {
    continuum_actors::register_metric_families(metrics)?;
    metrics
        .register::<DaemonMetrics>()?
        .set_build_info(crate::build_info::VERSION, crate::build_info::FEATURES);
    metrics.register::<crate::route::metrics::SelectionMetrics>()?;
    metrics.register::<crate::route::mid_stream::metrics::MidStreamMetrics>()?;
    metrics.register::<crate::proxy::metrics::DisaggregatedMetrics>()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_is_registered_at_startup() {
        let metrics = Metrics::new("test").expect("metrics");
        register_all(&metrics).expect("registers once");
        register_all(&metrics).expect("and again: the families are shared");
        let daemon = metrics.family::<DaemonMetrics>().expect("registered");
        assert!(metrics.render().contains(&format!(
            r#"continuum_router_build_info{{features="{}",version="{}"}} 1"#,
            crate::build_info::FEATURES,
            crate::build_info::VERSION
        )));
        daemon.set_build_info("9.9.9", "real-peers");
        daemon.set_build_info("1.2.3", "none");
        daemon.config_reload_refused(ReloadRefusal::Invalid);
        let text = metrics.render();
        assert!(text.contains(r#"continuum_router_build_info{features="none",version="1.2.3"} 1"#));
        assert!(!text.contains("9.9.9"), "one build_info series only");
        for family in [
            "continuum_dynamo_discovery_events_total",
            "continuum_dynamo_discovery_connected",
            "continuum_dynamo_load_events_total",
            "continuum_dynamo_load_subscriptions",
            "continuum_dynamo_selection_total",
            "continuum_dynamo_kv_subscriptions",
            "continuum_dynamo_kv_events_total",
            "continuum_dynamo_kv_selection_total",
            "continuum_dynamo_kv_artifacts_total",
            "continuum_dynamo_unreachable_workers",
            "continuum_dynamo_workers_marked_unreachable_total",
            "continuum_dynamo_event_bus_listener_up",
            "disaggregated_requests_total",
            "disaggregated_errors_total",
            "continuum_mid_stream_fallback_total",
            "continuum_mid_stream_fallback_tokens_resent_total",
            "continuum_actor_restarts_total",
            "continuum_config_reload_refusals_total",
            "continuum_actor_restart_budget_exhausted_total",
            "continuum_router_build_info",
        ] {
            assert!(text.contains(&format!("# TYPE {family} ")), "{family}");
        }
        assert_eq!(
            metrics.value(
                "continuum_config_reload_refusals_total",
                &[("reason", "invalid")]
            ),
            Some(1.0)
        );
        // Families whose labels are fleet-bound have no series until the fleet is seen.
        assert!(!text.contains("continuum_dynamo_worker_kv_used_blocks{"));
        assert!(!text.contains("continuum_dynamo_workers{"));
    }
}
