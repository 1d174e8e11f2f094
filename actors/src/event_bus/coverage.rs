//! Broker coverage of what broker-transport subscriptions want: every running subscription
//! holds a [`CoverageInterest`] for its (family, namespace) and marks it pending while no live
//! broker session covers the namespace. A reporter task exports, 250 ms after the last change
//! (of an interest, of the configured namespaces or of the session table),
//! `continuum_dynamo_broker_namespace_sessions{namespace}` and
//! `continuum_dynamo_broker_pending_subscriptions{family, namespace}` for every configured
//! namespace ([`EventBus::set_coverage_namespaces`]; 0 when nothing covers or waits) and every
//! namespace a subscription wants, and
//! `continuum_dynamo_broker_subscriptions{family, broker}` (subscription streams each broker
//! session carries). Namespaces come from discovery (configured, at most 16), never from an
//! agent's hello; brokers are authenticated `brokers[].id` entries (at most 256).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::OnceLock;

use crate::lock::{Mutex, MutexGuard};
use std::time::Duration;

use continuum_protocol::discovery::EventTopic;
use continuum_protocol::event_bus::message::{ClientId, Role};
use continuum_protocol::ids::Namespace;
use tokio::sync::Notify;

use super::EventBus;

/// Changes are exported this long after the last one.
pub const COVERAGE_DEBOUNCE: Duration = Duration::from_millis(250);

type Key = (EventTopic, Namespace);

#[derive(Clone, Copy, Debug, Default)]
struct Wanted {
    subscriptions: usize,
    pending: usize,
}

/// The families a broker-transport subscription carries.
const FAMILIES: [EventTopic; 2] = [EventTopic::KvMetrics, EventTopic::KvEvents];

/// The wanted (family, namespace) pairs and the reporter's wake-up.
#[derive(Default)]
pub(crate) struct CoverageTable {
    wanted: Mutex<BTreeMap<Key, Wanted>>,
    /// The configured discovery namespaces (under `transport: broker`), exported even when no
    /// subscription wants them.
    configured: Mutex<Vec<Namespace>>,
    carried: Mutex<BTreeMap<(EventTopic, ClientId), usize>>,
    dirty: Notify,
    reporter: OnceLock<()>,
}

impl CoverageTable {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<Key, Wanted>> {
        self.wanted.lock()
    }

    pub(crate) fn changed(&self) {
        self.dirty.notify_one();
    }

    fn carried(&self) -> MutexGuard<'_, BTreeMap<(EventTopic, ClientId), usize>> {
        self.carried.lock()
    }
}

/// Held by a subscription `BusStream` (a zmq_tcp target): counts it for its broker.
pub(crate) struct CarriedGuard {
    bus: EventBus,
    key: (EventTopic, ClientId),
}

impl CarriedGuard {
    pub(crate) fn new(bus: &EventBus, topic: EventTopic, broker: ClientId) -> Self {
        let key = (topic, broker);
        bus.start_reporter();
        *bus.shared
            .coverage
            .carried()
            .entry(key.clone())
            .or_default() += 1;
        bus.shared.coverage.changed();
        Self {
            bus: bus.clone(),
            key,
        }
    }
}

impl Drop for CarriedGuard {
    fn drop(&mut self) {
        let table = &self.bus.shared.coverage;
        {
            let mut carried = table.carried();
            if let Some(n) = carried.get_mut(&self.key) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    carried.remove(&self.key);
                }
            }
        }
        table.changed();
    }
}

/// A broker-transport subscription's claim on its namespace's coverage; dropping it withdraws
/// the claim.
pub struct CoverageInterest {
    bus: EventBus,
    key: Key,
    pending: bool,
}

impl std::fmt::Debug for CoverageInterest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CoverageInterest")
            .field("key", &self.key)
            .field("pending", &self.pending)
            .finish()
    }
}

impl EventBus {
    /// Registers a broker-transport subscription of `topic` in `namespace` for the coverage
    /// gauges (starts the debounced reporter on first use, when metrics are on).
    pub fn interest(&self, topic: EventTopic, namespace: Namespace) -> CoverageInterest {
        let table = &self.shared.coverage;
        let key = (topic, namespace);
        table.lock().entry(key.clone()).or_default().subscriptions += 1;
        self.start_reporter();
        table.changed();
        CoverageInterest {
            bus: self.clone(),
            key,
            pending: false,
        }
    }
}

/// One namespace's broker coverage, as `GET /admin/dynamo/workers` shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NamespaceCoverage {
    /// The live, non-draining broker sessions covering the namespace (their `brokers[].id`).
    pub brokers: Vec<ClientId>,
    /// Broker-transport subscriptions in the namespace waiting for a covering session.
    pub pending_subscriptions: usize,
}

impl EventBus {
    /// The configured namespaces the coverage gauges are exported for (0 when no broker covers
    /// them and no subscription waits); an empty list outside `transport: broker`.
    pub fn set_coverage_namespaces(&self, namespaces: Vec<Namespace>) {
        let table = &self.shared.coverage;
        {
            let mut configured = table.configured.lock();
            if *configured == namespaces {
                return;
            }
            *configured = namespaces;
        }
        self.start_reporter();
        table.changed();
    }

    /// `namespace`'s covering brokers and pending broker-transport subscriptions.
    pub fn namespace_coverage(&self, namespace: &Namespace) -> NamespaceCoverage {
        let pending_subscriptions = self
            .shared
            .coverage
            .lock()
            .iter()
            .filter(|((_, ns), _)| ns == namespace)
            .map(|(_, wanted)| wanted.pending)
            .sum();
        let mut brokers: Vec<ClientId> = self
            .lock()
            .sessions
            .values()
            .filter(|row| covering(row, namespace))
            .map(|row| row.client_id.clone())
            .collect();
        brokers.sort();
        brokers.dedup();
        NamespaceCoverage {
            brokers,
            pending_subscriptions,
        }
    }
}

/// A live, non-draining broker session covering `namespace`.
fn covering(row: &super::SessionRow, namespace: &Namespace) -> bool {
    row.role == Role::Broker && !row.draining && row.coverage.covers_namespace(namespace)
}

impl EventBus {
    /// Starts the debounced reporter once (only with metrics; needs a tokio runtime).
    pub(crate) fn start_reporter(&self) {
        if self.metrics().is_some() {
            self.shared.coverage.reporter.get_or_init(|| {
                tokio::spawn(report(self.clone()));
            });
        }
    }
}

impl CoverageInterest {
    pub fn set_pending(&mut self, pending: bool) {
        if self.pending == pending {
            return;
        }
        self.pending = pending;
        let table = &self.bus.shared.coverage;
        if let Some(wanted) = table.lock().get_mut(&self.key) {
            if pending {
                wanted.pending += 1;
            } else {
                wanted.pending = wanted.pending.saturating_sub(1);
            }
        }
        table.changed();
    }
}

impl Drop for CoverageInterest {
    fn drop(&mut self) {
        let table = &self.bus.shared.coverage;
        {
            let mut wanted = table.lock();
            if let Some(entry) = wanted.get_mut(&self.key) {
                entry.subscriptions = entry.subscriptions.saturating_sub(1);
                if self.pending {
                    entry.pending = entry.pending.saturating_sub(1);
                }
                if entry.subscriptions == 0 {
                    wanted.remove(&self.key);
                }
            }
        }
        table.changed();
    }
}

/// Exports the gauges 250 ms after each burst of changes, for as long as the process runs.
async fn report(bus: EventBus) {
    let mut exported: BTreeSet<Key> = BTreeSet::new();
    let mut exported_carried: BTreeSet<(EventTopic, ClientId)> = BTreeSet::new();
    loop {
        bus.shared.coverage.dirty.notified().await;
        tokio::time::sleep(COVERAGE_DEBOUNCE).await;
        let Some(metrics) = bus.metrics() else {
            return;
        };
        let mut wanted = bus.shared.coverage.lock().clone();
        // Every configured namespace is exported, wanted or not.
        let configured = bus.shared.coverage.configured.lock().clone();
        for namespace in configured {
            for family in FAMILIES {
                wanted.entry((family, namespace.clone())).or_default();
            }
        }
        let sessions: BTreeMap<&Namespace, usize> = {
            let state = bus.lock();
            wanted
                .keys()
                .map(|(_, namespace)| {
                    let n = state
                        .sessions
                        .values()
                        .filter(|row| covering(row, namespace))
                        .count();
                    (namespace, n)
                })
                .collect()
        };
        for ((topic, namespace), entry) in &wanted {
            let covering = sessions.get(namespace).copied().unwrap_or(0);
            metrics.set_coverage(topic.as_str(), namespace.as_str(), covering, entry.pending);
        }
        for (topic, namespace) in exported.difference(&wanted.keys().cloned().collect()) {
            let gone = !sessions.contains_key(namespace);
            metrics.remove_coverage(topic.as_str(), namespace.as_str(), gone);
        }
        exported = wanted.into_keys().collect();
        let carried = bus.shared.coverage.carried().clone();
        for ((topic, broker), n) in &carried {
            metrics.set_carried(topic.as_str(), broker.as_str(), *n);
        }
        for (topic, broker) in exported_carried.difference(&carried.keys().cloned().collect()) {
            metrics.remove_carried(topic.as_str(), broker.as_str());
        }
        exported_carried = carried.into_keys().collect();
    }
}
