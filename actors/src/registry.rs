//! RegistryActor: the single writer of the immutable fleet snapshot.
//!
//! Role: folds the per-namespace views that discovery actors send into one `DynamoSnapshot`
//! (`protocol::discovery::build_snapshot`) and publishes it through the lock-free store, swapping
//! before bumping the generation; an equal fleet is not republished. It also logs newly mixed
//! namespaces and keeps the `continuum_dynamo_workers` gauges.
//!
//! Parent: root. Children: none. Messages in: `Rebuild` (after a DiscoveryActor staged a view, or
//! the daemon staged a reconfiguration). Out: snapshots via [`DynamoRegistry`]. Restart: transient; the views and the snapshot live in [`DynamoRegistry`],
//! outside the actor, so a restart loses nothing and readers never stop reading.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};

use continuum_protocol::discovery::records::Role;
use continuum_protocol::discovery::snapshot::{
    DynamoSnapshot, SourceKind, build_snapshot, newly_mixed,
};
use continuum_protocol::discovery::view::NamespaceView;
use continuum_protocol::ids::Namespace;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::watch;
use tracing::{debug, warn};

use crate::metrics::{Metrics, WorkerRole};
use crate::store::SnapshotStore;

/// What the registry is configured to publish.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegistryConfig {
    pub enabled: bool,
    pub source: SourceKind,
    pub namespaces: Vec<Namespace>,
}

struct Held {
    config: RegistryConfig,
    views: BTreeMap<Namespace, Arc<NamespaceView>>,
    connected: BTreeMap<Namespace, bool>,
}

struct Shared {
    store: Arc<SnapshotStore<DynamoSnapshot>>,
    held: Mutex<Held>,
}

/// The registry as readers see it: cheap to clone, lock-free snapshot reads.
#[derive(Clone)]
pub struct DynamoRegistry {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for DynamoRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DynamoRegistry")
            .field("generation", &self.generation())
            .finish_non_exhaustive()
    }
}

impl DynamoRegistry {
    pub fn new(config: RegistryConfig) -> Self {
        let empty = DynamoSnapshot::empty(config.source, &config.namespaces);
        Self {
            shared: Arc::new(Shared {
                store: SnapshotStore::new(empty),
                held: Mutex::new(Held {
                    config,
                    views: BTreeMap::new(),
                    connected: BTreeMap::new(),
                }),
            }),
        }
    }

    fn held(&self) -> MutexGuard<'_, Held> {
        self.shared.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The current fleet, lock-free.
    pub fn snapshot(&self) -> Arc<DynamoSnapshot> {
        self.shared.store.snapshot()
    }

    /// The monotonic change generation.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.shared.store.subscribe()
    }

    pub fn generation(&self) -> u64 {
        self.shared.store.generation()
    }

    /// Whether discovery is enabled in the live config.
    pub fn is_enabled(&self) -> bool {
        self.held().config.enabled
    }

    pub fn config(&self) -> RegistryConfig {
        self.held().config.clone()
    }

    /// True when every configured namespace's source has its watches open.
    pub fn connected(&self) -> bool {
        let held = self.held();
        !held.config.namespaces.is_empty()
            && held
                .config
                .namespaces
                .iter()
                .all(|ns| held.connected.get(ns).copied().unwrap_or(false))
    }

    /// Stages a new configuration (startup and reload) for the next rebuild. `reset` drops every
    /// held view (source, namespace or connection change); otherwise only views of namespaces no
    /// longer configured are pruned. Returns the namespaces whose views were dropped.
    pub fn reconfigure(&self, config: RegistryConfig, reset: bool) -> Vec<Namespace> {
        let mut held = self.held();
        let keep: BTreeSet<&Namespace> = config.namespaces.iter().collect();
        let removed: Vec<Namespace> = held
            .views
            .keys()
            .filter(|ns| reset || !config.enabled || !keep.contains(ns))
            .cloned()
            .collect();
        for ns in &removed {
            held.views.remove(ns);
        }
        held.connected.retain(|ns, _| keep.contains(ns));
        held.config = config;
        removed
    }

    /// Stages a namespace's new view for the next rebuild. Discovery actors stage, then poke the
    /// registry actor with [`RegistryMsg::Rebuild`]; a poke lost while the registry restarts
    /// loses nothing, since the restarted actor rebuilds from the staged views.
    pub fn stage_view(&self, view: Arc<NamespaceView>) {
        let mut held = self.held();
        if held.config.namespaces.contains(view.namespace()) {
            held.views.insert(view.namespace().clone(), view);
        }
    }

    /// A discovery source reports its connection state (not part of the snapshot).
    pub fn set_connected(&self, namespace: &Namespace, connected: bool) {
        self.held().connected.insert(namespace.clone(), connected);
    }
}

/// Where to reach the current registry actor: updated at every (re)spawn, so senders never
/// hold a stale `ActorRef` across a registry restart.
#[derive(Clone, Default)]
pub struct RegistryMailbox(Arc<arc_swap::ArcSwapOption<ActorRef<RegistryMsg>>>);

impl std::fmt::Debug for RegistryMailbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryMailbox").finish_non_exhaustive()
    }
}

impl RegistryMailbox {
    pub fn set(&self, actor: ActorRef<RegistryMsg>) {
        self.0.store(Some(Arc::new(actor)));
    }

    /// Best effort: a message sent while the registry restarts is dropped, which is safe
    /// because the restarted actor rebuilds from the staged state.
    pub fn cast(&self, msg: RegistryMsg) {
        if let Some(actor) = self.0.load_full() {
            let _ = actor.cast(msg);
        }
    }
}

pub struct RegistryActor;

pub struct RegistryArgs {
    pub registry: DynamoRegistry,
    pub metrics: Option<Metrics>,
}

pub enum RegistryMsg {
    /// Staged views or configuration changed: rebuild and publish if the fleet changed.
    Rebuild,
}

pub struct RegistryState {
    registry: DynamoRegistry,
    metrics: Option<Metrics>,
}

impl Actor for RegistryActor {
    type Msg = RegistryMsg;
    type State = RegistryState;
    type Arguments = RegistryArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: RegistryArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let mut state = RegistryState {
            registry: args.registry,
            metrics: args.metrics,
        };
        // A restarted registry catches up with whatever was staged while it was down.
        state.publish();
        Ok(state)
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            RegistryMsg::Rebuild => state.publish(),
        }
        Ok(())
    }
}

impl RegistryState {
    /// Rebuilds the snapshot from the held views and publishes it if the fleet changed.
    fn publish(&mut self) {
        let next = {
            let held = self.registry.held();
            let views: Vec<&NamespaceView> = held.views.values().map(|v| v.as_ref()).collect();
            build_snapshot(held.config.source, &held.config.namespaces, &views)
        };
        let previous = self.registry.snapshot();
        let report = newly_mixed(&previous, &next);
        let gauges = role_counts(&next);
        let gone: Vec<Namespace> = previous
            .namespaces()
            .iter()
            .filter(|ns| !next.namespaces().contains(ns))
            .cloned()
            .collect();
        let changed = self
            .registry
            .shared
            .store
            .publish_unless(next, |current, next| current.same_fleet(next));
        if !changed {
            return;
        }
        // Debug, not info: a fleet under churn (leases renewed, workers restarting) publishes on
        // every etcd change, which would drown the log; the admin API shows the current fleet.
        debug!(
            generation = self.registry.generation(),
            workers = gauges.values().sum::<u64>(),
            "Published a new fleet snapshot."
        );
        for mixed in &report.shown {
            warn!(
                namespace = %mixed.namespace,
                model = %mixed.model,
                prefill = mixed.prefill,
                decode = mixed.decode,
                aggregated = mixed.aggregated,
                "Namespace serves one model from aggregated workers beside a prefill/decode pool; \
                 Dynamo's direct-mode frontend cannot serve such a fleet consistently."
            );
        }
        if report.suppressed_pairs > 0 {
            warn!(
                shown = report.shown.len(),
                suppressed = report.suppressed_pairs,
                prefill = report.suppressed_prefill,
                decode = report.suppressed_decode,
                aggregated = report.suppressed_aggregated,
                "More namespaces started mixing aggregated and disaggregated workers."
            );
        }
        if let Some(metrics) = &self.metrics {
            for ns in &gone {
                metrics.remove_workers_namespace(ns);
            }
            for ((ns, role), count) in gauges {
                metrics.set_workers(&ns, role, count);
            }
        }
    }
}

/// Worker counts per (namespace, role) for every configured namespace, zeros included.
fn role_counts(snapshot: &DynamoSnapshot) -> BTreeMap<(Namespace, WorkerRole), u64> {
    let mut counts = BTreeMap::new();
    for ns in snapshot.namespaces() {
        for role in WorkerRole::ALL {
            counts.insert((ns.clone(), *role), 0);
        }
    }
    for worker in snapshot.workers() {
        let role = match worker.role {
            Role::Prefill => WorkerRole::Prefill,
            Role::Decode => WorkerRole::Decode,
            Role::Aggregated => WorkerRole::Aggregated,
            Role::Unknown => WorkerRole::Unknown,
        };
        *counts
            .entry((worker.key.namespace.clone(), role))
            .or_insert(0) += 1;
    }
    counts
}
