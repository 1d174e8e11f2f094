//! The shared load store and the subscription status table.
//!
//! Subscriptions write samples through `protocol::load_store` rules; pickers read fresh samples
//! per request. Critical sections are a few map operations and never span an await.

pub mod metrics;

use std::collections::BTreeMap;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Duration;

use continuum_protocol::ids::{DpRank, InstanceId, PublisherId};
use continuum_protocol::load_store::{LoadSample, LoadStore, LoadStoreError, Unreachable};
use continuum_protocol::time::Tick;
use serde::Serialize;

pub use self::metrics::{LoadMetrics, SubscriptionState, SubscriptionTransport};
use crate::lock::{Mutex, MutexGuard};
use crate::metrics::Metrics;

/// One row of `subscriptions` in `GET /admin/dynamo/workers` (no addresses).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SubscriptionStatus {
    pub family: &'static str,
    pub publisher_id: String,
    pub namespace: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub component: Option<String>,
    pub state: &'static str,
    pub transport: &'static str,
    /// Transport broker: the `brokers[].id` whose session carries the connected stream.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub broker: Option<String>,
    #[serde(skip)]
    pub state_kind: SubscriptionState,
    #[serde(skip)]
    pub transport_kind: SubscriptionTransport,
}

struct Inner {
    store: Mutex<LoadStore>,
    /// Bumped after writes, so waiters (tests, later the picker's caches) wake without polling.
    changes: tokio::sync::watch::Sender<u64>,
    subscriptions: Mutex<BTreeMap<String, SubscriptionStatus>>,
    metrics: Option<Arc<LoadMetrics>>,
}

/// The load store's lock, held. The lock order is "load store, then picker state": the picker's
/// state can only be locked by presenting this guard (`SharedPicker::with_state`), so a section
/// that holds the picker's lock cannot have been entered before the load store's.
pub struct LoadGuard<'a>(MutexGuard<'a, LoadStore>);

impl Deref for LoadGuard<'_> {
    type Target = LoadStore;

    fn deref(&self) -> &LoadStore {
        &self.0
    }
}

impl DerefMut for LoadGuard<'_> {
    fn deref_mut(&mut self) -> &mut LoadStore {
        &mut self.0
    }
}

/// The process-wide load store handle (`registry.load_store()` in the seed).
#[derive(Clone)]
pub struct SharedLoadStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for SharedLoadStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedLoadStore").finish_non_exhaustive()
    }
}

impl SharedLoadStore {
    pub fn new(metrics: Option<Metrics>) -> Self {
        Self {
            inner: Arc::new(Inner {
                store: Mutex::new(LoadStore::new()),
                changes: tokio::sync::watch::channel(0).0,
                subscriptions: Mutex::new(BTreeMap::new()),
                metrics: metrics.as_ref().and_then(Metrics::family),
            }),
        }
    }

    fn store(&self) -> MutexGuard<'_, LoadStore> {
        self.inner.store.lock()
    }

    fn subs(&self) -> MutexGuard<'_, BTreeMap<String, SubscriptionStatus>> {
        self.inner.subscriptions.lock()
    }

    /// Runs `f` on the store under its lock (writers: subscriptions and the follower; the
    /// request path, which also takes the picker's state through the guard). Writers call
    /// [`SharedLoadStore::notify`] once their whole update (store and gauges) is done.
    pub fn with<R>(&self, f: impl FnOnce(&mut LoadGuard<'_>) -> R) -> R {
        f(&mut LoadGuard(self.store()))
    }

    /// Bumps the change counter: an update is complete and visible.
    pub fn notify(&self) {
        self.inner.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// A counter bumped after every completed update.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.inner.changes.subscribe()
    }

    /// The sample of (worker, rank) while younger than `dynamo.load.max_staleness`.
    pub fn fresh_default(&self, worker: InstanceId, rank: DpRank, now: Tick) -> Option<LoadSample> {
        self.store().fresh_default(worker, rank, now).cloned()
    }

    /// The last sample of (worker, rank), whatever its age.
    pub fn latest(&self, worker: InstanceId, rank: DpRank) -> Option<LoadSample> {
        self.store().latest(worker, rank).cloned()
    }

    /// The worker's unreachable mark (its load publisher was lost and refuses reconnects).
    pub fn unreachable(&self, worker: InstanceId) -> Option<Unreachable> {
        self.store().unreachable(worker)
    }

    /// Hot-reloads `dynamo.load.max_staleness`.
    pub fn set_max_staleness(&self, max: Duration) -> Result<(), LoadStoreError> {
        self.store().set_max_staleness(max)
    }

    pub fn len(&self) -> usize {
        self.store().len()
    }

    pub fn is_empty(&self) -> bool {
        self.store().is_empty()
    }

    /// Drops every sample a publisher contributed.
    pub fn drop_publisher(&self, publisher: PublisherId) {
        self.store().drop_publisher(publisher);
    }

    /// Records a subscription's state and refreshes the `{state, transport}` gauges.
    pub fn set_status(&self, name: &str, status: SubscriptionStatus) {
        {
            let mut subs = self.subs();
            subs.insert(name.to_string(), status);
            self.publish_gauges(&subs);
        }
        self.notify();
    }

    /// Forgets a stopped subscription.
    pub fn remove_status(&self, name: &str) {
        {
            let mut subs = self.subs();
            subs.remove(name);
            self.publish_gauges(&subs);
        }
        self.notify();
    }

    /// Every running subscription, ordered by name.
    pub fn subscriptions(&self) -> Vec<SubscriptionStatus> {
        self.subs().values().cloned().collect()
    }

    fn publish_gauges(&self, subs: &BTreeMap<String, SubscriptionStatus>) {
        let Some(metrics) = &self.inner.metrics else {
            return;
        };
        for state in SubscriptionState::ALL {
            for transport in SubscriptionTransport::ALL {
                let count = |family: &str| {
                    subs.values()
                        .filter(|s| {
                            s.family == family
                                && s.state_kind == *state
                                && s.transport_kind == *transport
                        })
                        .count() as u64
                };
                metrics.set_load_subscriptions(*state, *transport, count("kv_metrics"));
                metrics.set_kv_subscriptions(*state, *transport, count("kv-events"));
            }
        }
    }
}
