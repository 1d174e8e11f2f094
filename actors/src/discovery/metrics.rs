//! The discovery families: `continuum_dynamo_discovery_events_total{kind}` (records or resources
//! refused, watcher restarts) and `continuum_dynamo_discovery_connected`.

pub use continuum_protocol::discovery::DiscoveryEventKind;
use prometheus::{IntCounterVec, IntGauge, Registry};

use crate::metrics::{Family, counter_vec};

/// The discovery families. Every `kind` starts at 0.
pub struct DiscoveryMetrics {
    events: IntCounterVec,
    connected: IntGauge,
}

impl Family for DiscoveryMetrics {
    fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let events = counter_vec(
            registry,
            "continuum_dynamo_discovery_events_total",
            "Discovery records or resources refused, and watcher restarts, by kind.",
            &["kind"],
        )?;
        let connected = IntGauge::new(
            "continuum_dynamo_discovery_connected",
            "1 while the discovery source's watches are open, else 0.",
        )?;
        registry.register(Box::new(connected.clone()))?;
        connected.set(0);
        for kind in DiscoveryEventKind::ALL {
            events.with_label_values(&[kind.as_label()]);
        }
        Ok(Self { events, connected })
    }
}

impl DiscoveryMetrics {
    pub fn event(&self, kind: DiscoveryEventKind) {
        self.events(kind, 1);
    }

    pub fn events(&self, kind: DiscoveryEventKind, n: u64) {
        self.events.with_label_values(&[kind.as_label()]).inc_by(n);
    }

    pub fn set_connected(&self, connected: bool) {
        self.connected.set(i64::from(connected));
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::metrics::testing::{check_closed, metrics};

    #[test]
    fn kinds_are_closed_spelled_as_the_seed_and_start_at_zero() {
        check_closed(&DiscoveryEventKind::ALL, DiscoveryEventKind::as_label);
        let kinds: BTreeSet<_> = DiscoveryEventKind::ALL
            .iter()
            .map(|k| k.as_label())
            .collect();
        for kind in ["duplicate", "restart", "refused", "mismatch", "malformed"] {
            assert!(kinds.contains(kind), "{kind}");
        }
        let metrics = metrics();
        let discovery = metrics.register::<DiscoveryMetrics>().expect("registers");
        let text = metrics.render();
        assert!(text.contains(r#"continuum_dynamo_discovery_events_total{kind="duplicate"} 0"#));
        assert!(text.contains("continuum_dynamo_discovery_connected 0"));
        discovery.event(DiscoveryEventKind::Duplicate);
        discovery.events(DiscoveryEventKind::Duplicate, 2);
        discovery.set_connected(true);
        assert_eq!(
            metrics.value(
                "continuum_dynamo_discovery_events_total",
                &[("kind", "duplicate")]
            ),
            Some(3.0)
        );
        assert_eq!(
            metrics.value("continuum_dynamo_discovery_connected", &[]),
            Some(1.0)
        );
    }
}
