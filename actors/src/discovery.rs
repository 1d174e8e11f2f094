//! DiscoveryActor: one per Dynamo namespace, folding a discovery source into the reducer.
//!
//! Role: owns the namespace's `DiscoveryReducer` (created once per incarnation and reused across
//! the source's reconnects, so `first_seen` survives resyncs) and the source task (etcd, Dynamo
//! file store, Kubernetes, in-memory feed) that produces `SourceEvent`s. Every event is folded by
//! `protocol`; when the materialised view changes outside a resync, the new view goes to the
//! RegistryActor.
//!
//! Parent: the discovery supervisor. Children: none (the source and its forwarder are tasks
//! spawned in `pre_start` and stopped in `post_stop`). Messages in: `Events` (batches from the
//! forwarder), `Connected` (the source's watch state). Out: `RegistryMsg::ViewChanged`, the
//! first-pass callback (readiness), discovery metrics. Restart: on failure, by its supervisor
//! with the default budget; the registry keeps the namespace's last view meanwhile.

pub mod metrics;

use std::sync::Arc;
use std::time::Duration;

use continuum_protocol::discovery::SourceEvent;
use continuum_protocol::discovery::reducer::DiscoveryReducer;
use continuum_protocol::ids::Namespace;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{Instrument, info, warn};

use self::metrics::{DiscoveryEventKind, DiscoveryMetrics};
use crate::clock::now_unix;
use crate::etcd_source::{EtcdSource, EtcdSourceConfig};
use crate::file_source::{FileSourceConfig, FileUpdate, run_file_source};
use crate::kube_source::{KubeSourceConfig, KubeUpdate, run_metadata_source, run_pod_source};
use crate::lifecycle::ActorSpan;
use crate::memory_source::{MemoryDiscovery, run_memory_source};
use crate::metrics::Metrics;
use crate::registry::RegistryInbox;
use continuum_protocol::discovery::view::NamespaceView;
use continuum_protocol::kube::metadata::MetadataConfig;
use continuum_protocol::kube::pod_view::pod_view;
use continuum_protocol::kube::pods::{PodMember, PodSourceConfig};

/// Events buffered between the source and the actor; a slow reducer back-pressures the watch.
pub const SOURCE_CHANNEL: usize = 1024;
/// Events folded per mailbox message.
pub const MAX_BATCH: usize = 256;
/// File-source updates buffered (each holds a whole scan's events).
pub const FILE_CHANNEL: usize = 16;
/// How long a stopping actor waits for its source task.
pub const SOURCE_STOP_GRACE: Duration = Duration::from_secs(5);

/// Called once per incarnation when the first full pass completed (readiness).
pub type FirstPass = Arc<dyn Fn(&Namespace) + Send + Sync>;

pub struct DiscoveryActor;

/// Where a namespace's records come from. Both speak the same `SourceEvent` vocabulary, so the
/// reducer (and everything after it) is shared.
#[derive(Clone, Debug)]
pub enum SourceSpec {
    Etcd(EtcdSourceConfig),
    /// Dynamo's file store (`--discovery-backend file`): directory scans, etcd-shaped records.
    File(FileSourceConfig),
    /// DynamoWorkerMetadata ⋈ EndpointSlice, fed as etcd-style records.
    KubeMetadata {
        kube: KubeSourceConfig,
        namespace: Namespace,
    },
    /// Operator-labelled Pods: member sets, no cards or publishers.
    KubePods {
        kube: KubeSourceConfig,
        pods: PodSourceConfig,
        namespace: Namespace,
    },
    /// Records held in process (`continuum-router demo`'s simulated fleet), etcd-shaped.
    Memory {
        feed: MemoryDiscovery,
        namespace: Namespace,
    },
}

impl SourceSpec {
    pub fn namespace(&self) -> &Namespace {
        match self {
            SourceSpec::Etcd(cfg) => &cfg.namespace,
            SourceSpec::File(cfg) => &cfg.namespace,
            SourceSpec::KubeMetadata { namespace, .. }
            | SourceSpec::KubePods { namespace, .. }
            | SourceSpec::Memory { namespace, .. } => namespace,
        }
    }
}

/// A running source: the etcd loop, or a task (Kubernetes watches, the in-memory feed).
enum RunningSource {
    Etcd(EtcdSource),
    Kube(JoinHandle<()>),
}

pub struct DiscoveryArgs {
    pub source: SourceSpec,
    pub registry_actor: RegistryInbox,
    pub metrics: Option<Metrics>,
    pub on_first_pass: FirstPass,
    pub span: ActorSpan,
}

pub enum DiscoveryMsg {
    /// Events from the source, in order.
    Events(Vec<SourceEvent>),
    /// A source-side refusal to count (`refused`, `mismatch`, `malformed`, `duplicate`).
    Counted(DiscoveryEventKind),
    /// The Pod source's full member set after a change.
    Members(Vec<PodMember>),
    /// The source's watches opened (true) or its pass ended (false).
    Connected(bool),
}

pub struct DiscoveryState {
    namespace: Namespace,
    reducer: DiscoveryReducer,
    registry_actor: RegistryInbox,
    metrics: Option<Arc<DiscoveryMetrics>>,
    on_first_pass: FirstPass,
    first_pass_done: bool,
    /// Whether this reducer's view was staged once (later views are staged with their changes).
    staged_once: bool,
    /// The `kubernetes_pods` source's current view (unused by record sources).
    pods_view: Arc<NamespaceView>,
    source: Option<RunningSource>,
    tasks: Vec<JoinHandle<()>>,
}

impl Actor for DiscoveryActor {
    type Msg = DiscoveryMsg;
    type State = DiscoveryState;
    type Arguments = DiscoveryArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: DiscoveryArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let namespace = args.source.namespace().clone();
        let span = args.span.span().clone();
        let (source, tasks) = match args.source {
            SourceSpec::Etcd(cfg) => {
                let (tx, rx) = mpsc::channel(SOURCE_CHANNEL);
                let source = EtcdSource::spawn(cfg, tx)?;
                let forwarder =
                    tokio::spawn(forward_events(rx, myself.clone()).instrument(span.clone()));
                let watcher = tokio::spawn(
                    forward_connected(source.connected(), myself.clone()).instrument(span),
                );
                (RunningSource::Etcd(source), vec![forwarder, watcher])
            }
            SourceSpec::File(cfg) => {
                let (tx, rx) = mpsc::channel(FILE_CHANNEL);
                let task = tokio::spawn(run_file_source(cfg, tx).instrument(span.clone()));
                let forwarder = tokio::spawn(forward_file(rx, myself.clone()).instrument(span));
                (RunningSource::Kube(task), vec![forwarder])
            }
            SourceSpec::KubeMetadata { kube, namespace } => {
                let (tx, rx) = mpsc::channel(SOURCE_CHANNEL);
                let metadata = MetadataConfig {
                    namespaces: vec![namespace],
                };
                let task =
                    tokio::spawn(run_metadata_source(kube, metadata, tx).instrument(span.clone()));
                let forwarder = tokio::spawn(
                    forward_kube(rx, myself.clone(), DiscoveryMsg::Events).instrument(span),
                );
                (RunningSource::Kube(task), vec![forwarder])
            }
            SourceSpec::KubePods { kube, pods, .. } => {
                let (tx, rx) = mpsc::channel(SOURCE_CHANNEL);
                let task = tokio::spawn(run_pod_source(kube, pods, tx).instrument(span.clone()));
                let forwarder = tokio::spawn(
                    forward_kube(rx, myself.clone(), DiscoveryMsg::Members).instrument(span),
                );
                (RunningSource::Kube(task), vec![forwarder])
            }
            SourceSpec::Memory { feed, namespace } => {
                let (tx, rx) = mpsc::channel(SOURCE_CHANNEL);
                let (connected_tx, connected_rx) = tokio::sync::watch::channel(false);
                let task = tokio::spawn(
                    run_memory_source(feed, namespace, tx, connected_tx).instrument(span.clone()),
                );
                let forwarder =
                    tokio::spawn(forward_events(rx, myself.clone()).instrument(span.clone()));
                let watcher =
                    tokio::spawn(forward_connected(connected_rx, myself.clone()).instrument(span));
                (RunningSource::Kube(task), vec![forwarder, watcher])
            }
        };
        Ok(DiscoveryState {
            reducer: DiscoveryReducer::new(namespace.clone()),
            pods_view: Arc::new(NamespaceView::new(namespace.clone())),
            namespace,
            registry_actor: args.registry_actor,
            metrics: args.metrics.as_ref().and_then(Metrics::family),
            on_first_pass: args.on_first_pass,
            first_pass_done: false,
            staged_once: false,
            source: Some(source),
            tasks,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        state.stop().await;
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            DiscoveryMsg::Events(events) => state.fold(events),
            DiscoveryMsg::Connected(connected) => state.set_connected(connected),
            DiscoveryMsg::Counted(kind) => state.count(kind),
            DiscoveryMsg::Members(members) => state.members(members),
        }
        Ok(())
    }
}

impl DiscoveryState {
    fn fold(&mut self, events: Vec<SourceEvent>) {
        let mut changed = false;
        let mut completed_pass = false;
        let now = now_unix();
        for event in events {
            completed_pass |= matches!(event, SourceEvent::InitDone);
            changed |= self.reducer.apply(event, now);
        }
        if let Some(metrics) = &self.metrics {
            for (kind, n) in self.reducer.take_counts().iter() {
                metrics.events(kind, n);
            }
        } else {
            self.reducer.take_counts();
        }
        // A view mid-resync is staged, not published: readers see whole passes only. The
        // first view of this reducer goes whole (the registry may hold a previous incarnation's);
        // later ones with the ids that changed, so the registry patches O(change).
        if (changed || (completed_pass && !self.first_pass_done)) && !self.reducer.is_resyncing() {
            let changes = self.reducer.take_changes();
            let view = self.reducer.view().clone();
            if self.staged_once {
                self.registry_actor.stage_changes(view, changes);
            } else {
                self.staged_once = true;
                self.registry_actor.stage_view(view);
            }
        }
        if completed_pass && !self.first_pass_done {
            self.first_pass_done = true;
            info!(namespace = %self.namespace, workers = self.reducer.view().workers().len(), "First discovery pass complete.");
            (self.on_first_pass)(&self.namespace);
        }
    }

    /// Pods carry no records to reduce: the member set is the view.
    fn members(&mut self, members: Vec<PodMember>) {
        let previous = self.pods_view.clone();
        let next = pod_view(&self.namespace, &members, &previous, now_unix());
        if !previous.same_content(&next) || !self.first_pass_done {
            let next = Arc::new(next);
            self.pods_view = next.clone();
            self.registry_actor.stage_view(next);
        }
        if !self.first_pass_done {
            self.first_pass_done = true;
            info!(namespace = %self.namespace, workers = members.len(), "First Pod discovery pass complete.");
            (self.on_first_pass)(&self.namespace);
        }
    }

    fn count(&self, kind: DiscoveryEventKind) {
        if let Some(metrics) = &self.metrics {
            metrics.event(kind);
        }
    }

    fn set_connected(&mut self, connected: bool) {
        let all = self
            .registry_actor
            .set_connected(&self.namespace, connected);
        if let Some(metrics) = &self.metrics {
            metrics.set_connected(all);
        }
    }

    async fn stop(&mut self) {
        for task in self.tasks.drain(..) {
            task.abort();
        }
        let stopped = match self.source.take() {
            Some(source) => stop_source(source).await,
            None => true,
        };
        if !stopped {
            warn!(namespace = %self.namespace, "Discovery source did not stop within its grace period.");
        }
        let all = self.registry_actor.set_connected(&self.namespace, false);
        if let Some(metrics) = &self.metrics {
            metrics.set_connected(all);
        }
    }
}

/// Stops a source: an etcd source gets [`SOURCE_STOP_GRACE`] to end its pass loop and is
/// aborted after it; a Kubernetes watch task is aborted at once. Whether it stopped in time.
async fn stop_source(source: RunningSource) -> bool {
    match source {
        RunningSource::Etcd(source) => tokio::time::timeout(SOURCE_STOP_GRACE, source.stop())
            .await
            .is_ok(),
        RunningSource::Kube(task) => {
            task.abort();
            true
        }
    }
}

/// Drains the source channel into batches; ends when the source stops.
async fn forward_events(mut rx: mpsc::Receiver<SourceEvent>, actor: ActorRef<DiscoveryMsg>) {
    while let Some(first) = rx.recv().await {
        let mut batch = Vec::with_capacity(16);
        batch.push(first);
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(event) => batch.push(event),
                Err(_) => break,
            }
        }
        if actor.cast(DiscoveryMsg::Events(batch)).is_err() {
            return;
        }
    }
}

/// Forwards the file source's scans, refusals and root state to the actor.
async fn forward_file(mut rx: mpsc::Receiver<FileUpdate>, actor: ActorRef<DiscoveryMsg>) {
    while let Some(update) = rx.recv().await {
        let msg = match update {
            FileUpdate::Events(events) => DiscoveryMsg::Events(events),
            FileUpdate::Counted(kind) => DiscoveryMsg::Counted(kind),
            FileUpdate::Connected(connected) => DiscoveryMsg::Connected(connected),
        };
        if actor.cast(msg).is_err() {
            return;
        }
    }
}

async fn forward_connected(
    mut connected: tokio::sync::watch::Receiver<bool>,
    actor: ActorRef<DiscoveryMsg>,
) {
    loop {
        let now = *connected.borrow_and_update();
        if actor.cast(DiscoveryMsg::Connected(now)).is_err() {
            return;
        }
        if connected.changed().await.is_err() {
            return;
        }
    }
}

/// Forwards a Kubernetes source's updates (records or member sets, connection state, counted
/// refusals) to the actor; `data` turns a source's payload into its message.
async fn forward_kube<T>(
    mut rx: mpsc::Receiver<KubeUpdate<T>>,
    actor: ActorRef<DiscoveryMsg>,
    data: fn(T) -> DiscoveryMsg,
) {
    while let Some(update) = rx.recv().await {
        let msg = match update {
            KubeUpdate::Data(payload) => data(payload),
            KubeUpdate::Connected(connected) => DiscoveryMsg::Connected(connected),
            KubeUpdate::Counted { kind, object } => {
                let kind = counted_kind(kind);
                warn!(kind = kind.as_label(), %object, "Kubernetes discovery refused an object.");
                DiscoveryMsg::Counted(kind)
            }
        };
        if actor.cast(msg).is_err() {
            return;
        }
    }
}

fn counted_kind(kind: &str) -> DiscoveryEventKind {
    match kind {
        "refused" => DiscoveryEventKind::Refused,
        "mismatch" => DiscoveryEventKind::Mismatch,
        "duplicate" => DiscoveryEventKind::Duplicate,
        _ => DiscoveryEventKind::Malformed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sends on drop: tells the test the task was dropped (aborted or ended).
    struct Dropped(Option<tokio::sync::oneshot::Sender<()>>);

    impl Drop for Dropped {
        fn drop(&mut self) {
            if let Some(tx) = self.0.take() {
                let _ = tx.send(());
            }
        }
    }

    /// Spec "Reload class", *Startup and shutdown*: stopping a watcher waits up to a 5 s grace
    /// period, then aborts it. A source task that ignores its stop signal is still running at
    /// 4.9 s (tokio's paused clock), the stop gives up at 5 s, and the task is aborted.
    #[tokio::test(start_paused = true)]
    async fn a_source_that_ignores_stop_is_aborted_after_the_5_s_grace() {
        assert_eq!(SOURCE_STOP_GRACE, Duration::from_secs(5));
        let (stop, _ignored) = tokio::sync::oneshot::channel::<()>();
        let (dropped_tx, mut dropped) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let _guard = Dropped(Some(dropped_tx));
            std::future::pending::<()>().await;
        });
        let source = RunningSource::Etcd(EtcdSource::from_task(task, stop));
        let start = tokio::time::Instant::now();
        let stopping = tokio::spawn(stop_source(source));
        let settle = async || {
            for _ in 0..10 {
                tokio::task::yield_now().await;
            }
        };
        settle().await;
        tokio::time::advance(Duration::from_millis(4_900)).await;
        settle().await;
        assert!(!stopping.is_finished(), "still within the grace");
        assert!(dropped.try_recv().is_err(), "not aborted yet");
        let stopped = stopping.await.expect("stop_source");
        assert!(!stopped, "the grace ran out");
        assert_eq!(start.elapsed(), SOURCE_STOP_GRACE);
        tokio::time::timeout(Duration::from_secs(1), &mut dropped)
            .await
            .expect("the task is aborted after the grace")
            .expect("the guard reports its drop");
    }

    /// A source that honours its stop signal ends at once, well inside the grace.
    #[tokio::test(start_paused = true)]
    async fn a_source_that_stops_ends_without_waiting_for_the_grace() {
        let (stop, stopped_rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let _ = stopped_rx.await;
        });
        let start = tokio::time::Instant::now();
        assert!(stop_source(RunningSource::Etcd(EtcdSource::from_task(task, stop))).await);
        assert_eq!(start.elapsed(), Duration::ZERO);
    }
}
