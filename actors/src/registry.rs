//! RegistryActor: the single writer of the immutable fleet snapshot.
//!
//! Role: patches the published `DynamoSnapshot` with the per-namespace views (and the ids that
//! changed in them) that discovery actors stage (`DynamoSnapshot::patch`: O(change), the new
//! snapshot carries its `FleetChanges` for the consumers to patch their own state) and publishes
//! it through the lock-free store, swapping before bumping the generation; an unchanged fleet is
//! not republished. Staged views are dropped once applied, so the reducers that own them write
//! in place instead of copying a 16,384-worker view on every change. It also logs newly mixed
//! namespaces and keeps the `continuum_dynamo_workers` gauges.
//!
//! Handles ([`RegistryParts`]): the actor claims the one [`RegistryWriter`] (not `Clone`;
//! released when the incarnation's state is dropped, claimed again by the next one); discovery
//! actors and the daemon stage inputs through the [`RegistryInbox`]; readers hold a
//! [`RegistryReader`] (lock-free snapshot, generation watch).
//!
//! Parent: root. Children: none. Messages in: `Rebuild` (after a DiscoveryActor staged a view, or
//! the daemon staged a reconfiguration). Out: snapshots via [`RegistryReader`]. Restart:
//! transient; the staged views and the snapshot live in the shared state, outside the actor, so a
//! restart loses nothing and readers never stop reading.

pub mod metrics;

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use arc_swap::ArcSwapOption;
use continuum_protocol::discovery::records::Role;
use continuum_protocol::discovery::reducer::ViewChanges;
use continuum_protocol::discovery::snapshot::{
    DynamoSnapshot, NamespaceUpdate, SourceKind, newly_mixed,
};
use continuum_protocol::discovery::view::NamespaceView;
use continuum_protocol::ids::InstanceId;
use continuum_protocol::ids::Namespace;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::watch;
use tracing::{debug, warn};

use self::metrics::{RegistryMetrics, WorkerRole};
use crate::lifecycle::ActorKind;
use crate::lock::{CLAIM_TIMEOUT, Claim, Exclusive, Mutex, MutexGuard};
use crate::metrics::Metrics;
use crate::store::SnapshotStore;
use crate::supervisor::{ChildContext, ChildSpec};

/// What the registry is configured to publish.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegistryConfig {
    pub enabled: bool,
    pub source: SourceKind,
    pub namespaces: Vec<Namespace>,
}

struct Held {
    config: RegistryConfig,
    /// Views staged since the last publish, with what changed in them.
    pending: BTreeMap<Namespace, Pending>,
    connected: BTreeMap<Namespace, bool>,
}

/// A namespace's staged view, not yet applied to the snapshot.
struct Pending {
    view: Arc<NamespaceView>,
    /// The instance ids that changed since the snapshot; `None`: compare the whole namespace.
    workers: Option<BTreeSet<InstanceId>>,
    publishers: bool,
}

struct Shared {
    store: Arc<SnapshotStore<DynamoSnapshot>>,
    held: Mutex<Held>,
    /// The running registry actor, set by each incarnation (so senders never hold a stale ref).
    actor: ArcSwapOption<ActorRef<RegistryMsg>>,
}

impl Shared {
    fn held(&self) -> MutexGuard<'_, Held> {
        self.held.lock()
    }
}

/// The three handles of one registry: one writer, its inputs, its readers.
#[derive(Debug)]
pub struct RegistryParts {
    /// Claimed by the [`RegistryActor`] (one incarnation at a time): the only snapshot writer.
    pub writer: RegistryWriterSlot,
    /// Staged views, connection states and configuration; pokes the actor.
    pub inbox: RegistryInbox,
    /// Lock-free snapshot reads.
    pub reader: RegistryReader,
}

impl RegistryParts {
    pub fn new(config: RegistryConfig) -> Self {
        let empty = DynamoSnapshot::empty(config.source, &config.namespaces);
        let shared = Arc::new(Shared {
            store: SnapshotStore::new(empty),
            held: Mutex::new(Held {
                config,
                pending: BTreeMap::new(),
                connected: BTreeMap::new(),
            }),
            actor: ArcSwapOption::empty(),
        });
        Self {
            writer: RegistryWriterSlot(Exclusive::new(shared.clone())),
            inbox: RegistryInbox(shared.clone()),
            reader: RegistryReader { shared },
        }
    }
}

/// The registry as readers see it: cheap to clone, lock-free snapshot reads.
#[derive(Clone)]
pub struct RegistryReader {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for RegistryReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryReader")
            .field("generation", &self.generation())
            .finish_non_exhaustive()
    }
}

impl RegistryReader {
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
        self.shared.held().config.enabled
    }

    pub fn config(&self) -> RegistryConfig {
        self.shared.held().config.clone()
    }

    /// True when every configured namespace's source has its watches open.
    pub fn connected(&self) -> bool {
        connected(&self.shared.held())
    }
}

fn connected(held: &Held) -> bool {
    !held.config.namespaces.is_empty()
        && held
            .config
            .namespaces
            .iter()
            .all(|ns| held.connected.get(ns).copied().unwrap_or(false))
}

/// The registry's inputs: discovery actors stage views and connection states, the daemon stages
/// configurations; each then pokes the registry actor, the one writer of the snapshot. A poke
/// sent while the registry restarts is dropped, which is safe because the restarted actor
/// rebuilds from the staged state.
#[derive(Clone)]
pub struct RegistryInbox(Arc<Shared>);

impl std::fmt::Debug for RegistryInbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryInbox").finish_non_exhaustive()
    }
}

impl RegistryInbox {
    /// Best effort: dropped while no registry actor runs (see above).
    pub fn cast(&self, msg: RegistryMsg) {
        if let Some(actor) = self.0.actor.load_full() {
            let _ = actor.cast(msg);
        }
    }

    /// Stages a new configuration (startup and reload) for the next rebuild. `reset` drops every
    /// held view (source, namespace or connection change); otherwise only views of namespaces no
    /// longer configured are pruned. Returns the namespaces whose views were dropped.
    pub fn reconfigure(&self, config: RegistryConfig, reset: bool) -> Vec<Namespace> {
        let snapshot = self.0.store.snapshot();
        let mut held = self.0.held();
        let keep: BTreeSet<&Namespace> = config.namespaces.iter().collect();
        let present: BTreeSet<&Namespace> = held
            .pending
            .keys()
            .chain(snapshot.role_counts().keys())
            .chain(snapshot.publishers().iter().map(|p| &p.namespace))
            .collect();
        let removed: Vec<Namespace> = present
            .into_iter()
            .filter(|ns| reset || !config.enabled || !keep.contains(ns))
            .cloned()
            .collect();
        for ns in &removed {
            if keep.contains(ns) {
                // Still configured: the next snapshot shows it empty until its source restages.
                held.pending.insert(
                    ns.clone(),
                    Pending {
                        view: Arc::new(NamespaceView::new(ns.clone())),
                        workers: None,
                        publishers: true,
                    },
                );
            } else {
                // No longer configured: the next snapshot drops it.
                held.pending.remove(ns);
            }
        }
        held.connected.retain(|ns, _| keep.contains(ns));
        held.config = config;
        removed
    }

    /// Stages a namespace's whole new view (compared with the snapshot's whole namespace) and
    /// pokes the registry actor to rebuild.
    pub fn stage_view(&self, view: Arc<NamespaceView>) {
        self.stage(view, None);
    }

    /// Stages a namespace's new view with what changed in it since the view staged before (a
    /// reducer's [`ViewChanges`]; the first view of a reducer goes through
    /// [`Self::stage_view`]) and pokes the registry actor.
    pub fn stage_changes(&self, view: Arc<NamespaceView>, changes: ViewChanges) {
        self.stage(view, Some(changes));
    }

    fn stage(&self, view: Arc<NamespaceView>, changes: Option<ViewChanges>) {
        {
            let mut held = self.0.held();
            if held.config.namespaces.contains(view.namespace()) {
                match held.pending.entry(view.namespace().clone()) {
                    Entry::Vacant(slot) => {
                        let (workers, publishers) = match changes {
                            Some(c) => (Some(c.workers), c.publishers),
                            None => (None, true),
                        };
                        slot.insert(Pending {
                            view,
                            workers,
                            publishers,
                        });
                    }
                    Entry::Occupied(mut slot) => {
                        let pending = slot.get_mut();
                        pending.view = view;
                        match (pending.workers.as_mut(), changes) {
                            (Some(ids), Some(c)) => {
                                ids.extend(c.workers);
                                pending.publishers |= c.publishers;
                            }
                            _ => {
                                pending.workers = None;
                                pending.publishers = true;
                            }
                        }
                    }
                }
            }
        }
        self.cast(RegistryMsg::Rebuild);
    }

    /// A discovery source reports its connection state (not part of the snapshot); returns
    /// whether every configured namespace is connected now.
    pub fn set_connected(&self, namespace: &Namespace, up: bool) -> bool {
        let mut held = self.0.held();
        held.connected.insert(namespace.clone(), up);
        connected(&held)
    }
}

/// Hands the registry's writer to one [`RegistryActor`] incarnation at a time.
#[derive(Clone, Debug)]
pub struct RegistryWriterSlot(Exclusive<Arc<Shared>>);

/// The one writer of the fleet snapshot (not `Clone`; owned by the running [`RegistryActor`]).
#[derive(Debug)]
pub struct RegistryWriter(Claim<Arc<Shared>>);

impl RegistryWriter {
    fn shared(&self) -> &Shared {
        &self.0
    }
}

pub struct RegistryActor;

pub struct RegistryArgs {
    pub writer: RegistryWriterSlot,
    pub metrics: Option<Metrics>,
}

pub enum RegistryMsg {
    /// Staged views or configuration changed: rebuild and publish if the fleet changed.
    Rebuild,
}

pub struct RegistryState {
    writer: RegistryWriter,
    metrics: Option<Arc<RegistryMetrics>>,
}

impl Actor for RegistryActor {
    type Msg = RegistryMsg;
    type State = RegistryState;
    type Arguments = RegistryArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: RegistryArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let writer = RegistryWriter(args.writer.0.claim(CLAIM_TIMEOUT).await?);
        writer.shared().actor.store(Some(Arc::new(myself)));
        let mut state = RegistryState {
            writer,
            metrics: args.metrics.as_ref().and_then(Metrics::family),
        };
        // A restarted registry catches up with whatever was staged while it was down.
        state.publish();
        Ok(state)
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        state.writer.shared().actor.store(None);
        Ok(())
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
    /// Patches the snapshot with the staged views and publishes it if the fleet changed.
    fn publish(&mut self) {
        let shared = self.writer.shared();
        let previous = shared.store.snapshot();
        let next = {
            let mut held = shared.held();
            let next = next_snapshot(&previous, &held);
            // Applied: dropping the views lets their reducers write in place again.
            held.pending.clear();
            next
        };
        let Some(next) = next else { return };
        let report = newly_mixed(&previous, &next);
        let gauges = role_counts(&next);
        let gone: Vec<Namespace> = previous
            .namespaces()
            .iter()
            .filter(|ns| !next.namespaces().contains(ns))
            .cloned()
            .collect();
        // `next_snapshot` already left out unchanged fleets.
        shared.store.publish_unless(next, |_, _| false);
        // Debug, not info: a fleet under churn (leases renewed, workers restarting) publishes on
        // every etcd change, which would drown the log; the admin API shows the current fleet.
        debug!(
            generation = shared.store.generation(),
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
                metrics.remove_namespace(ns);
            }
            for ((ns, role), count) in gauges {
                metrics.set_workers(&ns, role, count);
            }
        }
    }
}

/// The snapshot after the staged views, or `None` when nothing a reader sees changed.
fn next_snapshot(previous: &DynamoSnapshot, held: &Held) -> Option<DynamoSnapshot> {
    let updates: Vec<NamespaceUpdate<'_>> = held
        .pending
        .values()
        .map(|p| NamespaceUpdate {
            view: &p.view,
            workers: p.workers.as_ref(),
            publishers: p.publishers,
        })
        .collect();
    let namespaces = &held.config.namespaces;
    if previous.source() == held.config.source {
        return previous.patch(namespaces, &updates);
    }
    // A new source resets every view (`reconfigure`): built whole, consumers rebuild too.
    let next_seq = previous.seq().wrapping_add(1);
    let empty = DynamoSnapshot::empty(held.config.source, namespaces);
    let next = empty.patch(namespaces, &updates).unwrap_or(empty);
    Some(next.rebuilt().with_seq(next_seq))
}

/// Worker counts per (namespace, role) for every configured namespace, zeros included.
fn role_counts(snapshot: &DynamoSnapshot) -> BTreeMap<(Namespace, WorkerRole), u64> {
    let mut counts = BTreeMap::new();
    for ns in snapshot.namespaces() {
        let per_role = snapshot.role_counts().get(ns).copied().unwrap_or_default();
        for role in WorkerRole::ALL {
            let count = per_role.get(match role {
                WorkerRole::Prefill => Role::Prefill,
                WorkerRole::Decode => Role::Decode,
                WorkerRole::Aggregated => Role::Aggregated,
                WorkerRole::Unknown => Role::Unknown,
            });
            counts.insert((ns.clone(), *role), count as u64);
        }
    }
    counts
}

/// The registry actor's child spec under root: every incarnation claims the one writer.
pub fn registry_spec(writer: RegistryWriterSlot) -> ChildSpec {
    ChildSpec::new("registry", ActorKind::Registry, move |ctx: ChildContext| {
        let args = RegistryArgs {
            writer: writer.clone(),
            metrics: ctx.metrics.clone(),
        };
        async move {
            let (actor, _) = Actor::spawn_linked(None, RegistryActor, args, ctx.supervisor).await?;
            Ok(actor.get_cell())
        }
    })
}
