//! The daemon's lifecycle: one code path for startup and reload (vector's config diff).
//!
//! `Daemon::start` turns a validated config into the supervision tree and the front door;
//! the control loop re-reads the config file when it changes (once it has been quiet for 250 ms),
//! on SIGHUP, or on `POST /admin/config/reload`; it refuses an invalid file, or one the reload
//! guard (`config::guard`) stops, with a logged, counted reason while the running config stays,
//! and applies the diff by reload class: immediate settings are swapped, discovery is replaced
//! live, settings that need a process restart are reported. Shutdown is bounded by 10 s.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use arc_swap::ArcSwap;
use continuum_actors::discovery::metrics::{DiscoveryEventKind, DiscoveryMetrics};
use continuum_actors::discovery::{DiscoveryActor, DiscoveryArgs, SourceSpec};
use continuum_actors::etcd_source::{EtcdAuth, EtcdSourceConfig, EtcdTls};
use continuum_actors::file_source::{FileSourceConfig, default_root as default_file_root};
use continuum_actors::kube_source::{KubeConnect, KubeSourceConfig, WatchTiming};
#[cfg(feature = "dynamo-kv")]
use continuum_actors::kv_artifacts::{ArtifactConfig, ArtifactRegistry};
use continuum_actors::kv_index::SharedKvIndex;
#[cfg(feature = "dynamo-kv")]
use continuum_actors::kv_index::kv_index_spec;
use continuum_actors::lifecycle::ActorKind;
use continuum_actors::load::SharedLoadStore;
use continuum_actors::load::SubscriptionTransport;
use continuum_actors::memory_source::MemoryDiscovery;
use continuum_actors::metrics::Metrics;

use self::metrics::{DaemonMetrics, ReloadRefusal};
use continuum_actors::picker::SharedPicker;
#[cfg(feature = "dynamo")]
use continuum_actors::picker::picker_spec;
use continuum_actors::registry::{
    RegistryConfig, RegistryInbox, RegistryMsg, RegistryParts, RegistryReader, registry_spec,
};
use continuum_actors::subscription::{DialPolicy, follower_spec};
use continuum_actors::supervisor::{ChildContext, ChildSpec, SupervisorMsg, spawn_root};
use continuum_actors::tree::ActorTree;
use continuum_protocol::backoff::{BackoffPolicy, Jitter};
use continuum_protocol::discovery::snapshot::SourceKind;
use continuum_protocol::ids::Namespace;
use continuum_protocol::kube::pods::{
    ComponentModel as PodComponentModel, ModelMapping, PodSourceConfig,
};
use ractor::{Actor, ActorRef};

use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tracing::{error, info, warn};

use crate::build_info::Features;
use crate::config::guard::GuardRefusal;
use crate::config::{
    self, Config, DiscoveryAction, DiscoverySource, LoadTransport, LoadedConfig, RestartReason,
};
use crate::front_door::{self, ApiKeySetting, AppState, ControlCommand, LiveSettings};
#[cfg(feature = "dynamo-kv")]
use crate::kv::ArtifactPromptPrep;
use crate::proxy::{Proxy, ProxyOptions};
use crate::readiness::Readiness;
use crate::route::Router;
use crate::route::dynamo::ShimRouter;
use crate::telemetry;

mod import;
pub mod metrics;
#[cfg(feature = "replica-sync")]
mod replica_sync;
mod sources;

pub use sources::{etcd_source_config, file_source_config, kube_source_config, pod_source_config};
use sources::{registry_config, required_sources, source_name};

/// The whole shutdown (drain HTTP, stop the tree) is bounded by this.
pub const SHUTDOWN_BOUND: Duration = Duration::from_secs(10);
/// A file-change burst is one reload once the file has been quiet this long.
const RELOAD_DEBOUNCE: Duration = Duration::from_millis(250);
/// A file that keeps changing is still read this often.
const RELOAD_DEBOUNCE_MAX: Duration = Duration::from_secs(5);
/// How long a live watcher replacement may take before the reload reports it.
const REPLACE_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug)]
pub struct RunOptions {
    pub config: Config,
    /// The file to watch and reload; `None` for the embedded demo.
    pub config_path: Option<PathBuf>,
    pub demo: bool,
}

/// Runs until SIGTERM or SIGINT, then shuts down within [`SHUTDOWN_BOUND`].
pub async fn run_until_signal(options: RunOptions) -> anyhow::Result<()> {
    let guard = telemetry::init(&(&options.config.telemetry).into())
        .context("cannot initialise telemetry")?;
    let addr = options.config.server.bind_address;
    let listener = crate::front_door::bind(addr, options.config.server.max_connections)
        .with_context(|| format!("cannot listen on {addr}"))?;
    let daemon = Daemon::start(options, listener).await?;
    let local = daemon.local_addr();
    info!(%local, "continuum-router is serving.");
    shutdown_signal().await;
    info!("Shutting down.");
    daemon.shutdown().await;
    if let Err(error) = guard.shutdown().await {
        warn!(%error, "Telemetry did not flush cleanly.");
    }
    Ok(())
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}

/// What every child spec reads: shared, cheap handles.
#[derive(Clone)]
struct Shared {
    config: Arc<ArcSwap<Config>>,
    registry: RegistryReader,
    mailbox: RegistryInbox,
    readiness: Readiness,
    metrics: Metrics,
    load: SharedLoadStore,
    /// The bounded KV index fed by kv-events subscriptions (`dynamo.kv.enabled`).
    kv: SharedKvIndex,
    /// Installed picker, candidate index and dispatch ledger, maintained by the PickerActor.
    picker: SharedPicker,
    /// The OpenAI-wire proxy; its backend set follows reloads (immediate class).
    proxy: Arc<Proxy>,
    /// The request path's orchestrator over `proxy` (the front door's `AppState::route`).
    route: Arc<Router>,
    /// The Dynamo step of the request path, handed to the daemon at construction (its picker and
    /// KV preparation hook plug in here).
    dynamo: Arc<ShimRouter>,
    /// Records `source: simulated` discovery reads (the demo's fleet; empty otherwise).
    #[cfg_attr(not(feature = "dynamo"), allow(dead_code))]
    simulated: MemoryDiscovery,
    /// Pinned tokenizer artifacts, started the first time `dynamo.kv.enabled` is on.
    artifacts: Arc<std::sync::Mutex<Option<KvArtifacts>>>,
    /// The event-bus listener's sessions and command API (`dynamo.event_bus`).
    event_bus: crate::event_bus::EventBus,
    /// The last applied SSE event id per pushed kv_cache_index source (outlives `root/kv_push`).
    #[cfg_attr(
        not(all(feature = "dynamo-kv", feature = "dynamo-event-bus")),
        allow(dead_code)
    )]
    kv_push: continuum_actors::kv_push::KvPushCursors,
    /// What `root/replica_sync` last reported (peers, connection), for the admin view.
    replica_sync: continuum_actors::replica_sync::ReplicaSyncView,
    /// `continuum_replica_sync_*`, registered once (at 0 while the sync is off).
    #[cfg_attr(not(feature = "replica-sync"), allow(dead_code))]
    replica_sync_metrics: continuum_actors::replica_sync::ReplicaSyncMetrics,
    /// The product features this daemon runs (the compiled ones, or fewer in a test); the
    /// composition points below start nothing of a missing one.
    features: Features,
}

/// The artifact loader and the task that feeds it registry generations.
#[cfg_attr(not(feature = "dynamo-kv"), allow(dead_code))]
struct KvArtifacts {
    #[cfg(feature = "dynamo-kv")]
    registry: ArtifactRegistry,
    follow: JoinHandle<()>,
}

/// Starts the artifact loader and installs the production prompt preparation when KV-aware
/// selection is on; applies `dynamo.kv`'s artifact keys to a running loader otherwise (turning
/// KV off unpins everything, which drops loaded tokenizers).
#[cfg(feature = "dynamo-kv")]
fn sync_kv_artifacts(shared: &Shared, config: &Config) {
    let enabled = config.dynamo.enabled && config.dynamo.kv.enabled;
    let kv = &config.dynamo.kv;
    let pins: &[String] = if enabled { &kv.pinned_artifacts } else { &[] };
    let artifact_config = ArtifactConfig::from_kv(
        kv.allow_http_artifacts,
        kv.allow_hf_artifacts,
        pins,
        kv.artifact_cache_dir.clone(),
    );
    let mut slot = shared.artifacts.lock().unwrap_or_else(|p| p.into_inner());
    match slot.as_ref() {
        Some(running) => running.registry.reconfigure(artifact_config),
        None if enabled => {
            let registry = ArtifactRegistry::new(artifact_config, Some(shared.metrics.clone()));
            let follow = registry.follow(shared.registry.clone());
            shared.dynamo.set_kv_prep(Arc::new(ArtifactPromptPrep::new(
                registry.clone(),
                Some(shared.metrics.clone()),
            )));
            *slot = Some(KvArtifacts { registry, follow });
        }
        None => {}
    }
}

/// Without `dynamo-kv` there is no artifact loader and no prompt preparation to install.
#[cfg(not(feature = "dynamo-kv"))]
fn sync_kv_artifacts(_shared: &Shared, _config: &Config) {}

/// A running daemon.
pub struct Daemon {
    local_addr: std::net::SocketAddr,
    shared: Shared,
    tree: ActorTree,
    root: ActorRef<SupervisorMsg>,
    root_task: JoinHandle<()>,
    server: JoinHandle<()>,
    stop_server: watch::Sender<bool>,
    control: JoinHandle<()>,
    control_tx: mpsc::Sender<ControlCommand>,
    /// The OTLP metrics push (`telemetry.otlp.metrics_interval`), if configured.
    metrics_push: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Daemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Daemon")
            .field("local_addr", &self.local_addr)
            .finish_non_exhaustive()
    }
}

impl Daemon {
    /// Builds the supervision tree and serves the front door on `listener`.
    pub async fn start(options: RunOptions, listener: TcpListener) -> anyhow::Result<Daemon> {
        Self::start_with_feed(options, listener, MemoryDiscovery::new()).await
    }

    /// [`Daemon::start`] whose `source: simulated` discovery reads `feed` (the demo's fleet).
    pub async fn start_with_feed(
        options: RunOptions,
        listener: TcpListener,
        feed: MemoryDiscovery,
    ) -> anyhow::Result<Daemon> {
        Self::start_with_features(options, listener, feed, Features::COMPILED).await
    }

    /// [`Daemon::start_with_feed`] running only `features` (at most the compiled ones): what a
    /// build without the others does, shown without compiling one (tests/it/features.rs).
    pub async fn start_with_features(
        options: RunOptions,
        listener: TcpListener,
        feed: MemoryDiscovery,
        features: Features,
    ) -> anyhow::Result<Daemon> {
        let features = features.within_compiled();
        let config = options.config;
        let metrics = Metrics::new(&config.telemetry.service_name)
            .map_err(|e| anyhow::anyhow!("cannot build metrics: {e}"))?;
        metrics::register_all(&metrics)?;
        // Every handle starts from the empty config; startup is then the same
        // `apply(diff(empty, config))` as a reload (`apply(diff(old, new))`).
        let empty = Config::default();
        let registry = RegistryParts::new(registry_config(&empty));
        let readiness = Readiness::new();
        readiness.require_exactly(required_sources(&empty));
        let load = SharedLoadStore::new(Some(metrics.clone()));
        let shared_config = Arc::new(ArcSwap::from_pointee(empty.clone()));
        let kv = SharedKvIndex::new(Some(metrics.clone()));
        let picker = SharedPicker::new();
        let dynamo = Arc::new(
            ShimRouter::with_picker(
                shared_config.clone(),
                registry.reader.clone(),
                load.clone(),
                picker.clone(),
                Some(metrics.clone()),
            )
            .with_kv_index(kv.clone()),
        );
        let proxy = Arc::new(Proxy::new(ProxyOptions::default(), Some(metrics.clone())));
        let http = crate::http_metrics::HttpMetrics::register(metrics.registry())
            .map_err(|e| anyhow::anyhow!("cannot register the HTTP metrics: {e}"))?;
        let route = Arc::new(Router::new(proxy.clone()).with_http_metrics(http));
        let replica_sync_metrics =
            continuum_actors::replica_sync::ReplicaSyncMetrics::register(metrics.registry())
                .map_err(|e| anyhow::anyhow!("cannot register the replica-sync metrics: {e}"))?;
        // Without `dynamo` the request path has no Dynamo step: every request routes unified.
        if features.dynamo {
            route.set_dynamo(dynamo.clone());
        }
        // The listener starts from the empty config too; `apply` hands it the real settings before
        // the tree (and so root/event_bus) spawns.
        let event_bus = crate::event_bus::EventBus::new(
            crate::event_bus::settings(&empty.dynamo.event_bus),
            Some(&metrics),
        );
        let shared = Shared {
            config: shared_config,
            registry: registry.reader,
            mailbox: registry.inbox,
            proxy,
            route,
            dynamo,
            readiness,
            kv,
            artifacts: Arc::default(),
            picker,
            metrics,
            load,
            simulated: feed,
            event_bus,
            kv_push: Default::default(),
            replica_sync: Default::default(),
            replica_sync_metrics,
            features,
        };
        shared.proxy.reconfigure(&empty);
        let tree = ActorTree::default();
        let live = Arc::new(ArcSwap::from_pointee(live_settings(&empty)));
        let mut control = ControlLoop {
            shared: shared.clone(),
            tree: tree.clone(),
            live: live.clone(),
            path: options.config_path.clone(),
            current: empty,
            running: false,
        };
        // The tree is not running yet: its specs read the config this applies when they spawn.
        control.apply(config.clone(), "startup").await;
        control.running = true;
        let (root, root_task) = spawn_root(
            root_children(&shared, registry_spec(registry.writer)),
            tree.clone(),
            Some(shared.metrics.clone()),
        )
        .await
        .context("the supervision tree did not start")?;

        let (control_tx, control_rx) = mpsc::channel(8);
        let state = app_state(&shared, &tree, live.clone(), control_tx.clone());
        let local_addr = listener.local_addr()?;
        let (stop_server, mut stop_rx) = watch::channel(false);
        let app = front_door::router_for(state.clone(), features);
        let serve_options = front_door::serve::ServeOptions::from_config(&config.server);
        let server_metrics = shared.metrics.clone();
        let server = tokio::spawn(async move {
            let shutdown = async move {
                let _ = stop_rx.wait_for(|stop| *stop).await;
            };
            front_door::serve::serve(
                listener,
                app,
                Some(Arc::new(state)),
                serve_options,
                Some(&server_metrics),
                shutdown,
            )
            .await;
        });
        // Installed before the daemon answers anything: from here on SIGHUP and file changes
        // reload.
        let hangup = hangup_signal();
        let (file_tx, file_rx) = mpsc::channel::<()>(16);
        let watcher = options
            .config_path
            .as_deref()
            .and_then(|p| watch_file(p, file_tx));
        let control = tokio::spawn(control.run(control_rx, hangup, (watcher, file_rx)));
        Ok(Daemon {
            metrics_push: spawn_metrics_push(&config.telemetry, &shared.metrics)?,
            local_addr,
            shared,
            tree,
            root,
            root_task,
            server,
            stop_server,
            control,
            control_tx,
        })
    }

    pub fn local_addr(&self) -> std::net::SocketAddr {
        self.local_addr
    }

    pub fn registry(&self) -> &RegistryReader {
        &self.shared.registry
    }

    pub fn tree(&self) -> &ActorTree {
        &self.tree
    }

    pub fn readiness(&self) -> &Readiness {
        &self.shared.readiness
    }

    pub fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    /// The KV index kv-events subscriptions feed.
    pub fn kv_index(&self) -> &SharedKvIndex {
        &self.shared.kv
    }

    /// The Dynamo shim router (its picker and KV preparation hook plug in here).
    pub fn shim(&self) -> Option<Arc<ShimRouter>> {
        Some(self.shared.dynamo.clone())
    }

    /// The event bus command API (`continuum_router::event_bus`).
    pub fn event_bus(&self) -> &crate::event_bus::EventBus {
        &self.shared.event_bus
    }

    /// The latest load samples (`registry.load_store()` in the seed).
    pub fn load_store(&self) -> &SharedLoadStore {
        &self.shared.load
    }

    /// The picker state the PickerActor maintains (`registry.picker()`; `set_picker()` is
    /// [`ShimRouter::set_picker`], through the one writer).
    pub fn picker(&self) -> &SharedPicker {
        &self.shared.picker
    }

    /// Re-reads the config file now, as `POST /admin/config/reload` does.
    pub async fn reload(&self) -> Result<String, String> {
        let (tx, rx) = oneshot::channel();
        self.control_tx
            .send(ControlCommand::Reload(tx))
            .await
            .map_err(|_| "the control loop is not running".to_string())?;
        rx.await
            .map_err(|_| "the control loop dropped the request".to_string())?
    }

    /// Stops accepting, drains in-flight requests, stops the tree; bounded by 10 s.
    pub async fn shutdown(self) {
        self.shared.proxy.shutdown();
        if let Some(running) = self
            .shared
            .artifacts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            running.follow.abort();
        }
        let Daemon {
            root,
            root_task,
            server,
            stop_server,
            control,
            metrics_push,
            ..
        } = self;
        if let Some(push) = metrics_push {
            push.abort();
        }
        let work = async move {
            let _ = stop_server.send(true);
            let _ = server.await;
            control.abort();
            root.stop(Some("shutdown".into()));
            let _ = root_task.await;
        };
        if tokio::time::timeout(SHUTDOWN_BOUND, work).await.is_err() {
            warn!("Shutdown exceeded its 10 s bound; exiting anyway.");
        }
    }
}

/// The OTLP metrics push, when `telemetry.otlp.metrics_interval` is set (a restart-class key).
fn spawn_metrics_push(
    telemetry: &crate::config::TelemetryConfig,
    metrics: &Metrics,
) -> anyhow::Result<Option<JoinHandle<()>>> {
    let Some(otlp) = &telemetry.otlp else {
        return Ok(None);
    };
    let Some(interval) = otlp.metrics_interval else {
        return Ok(None);
    };
    let push = telemetry::metrics_push::spawn(
        &otlp.endpoint,
        interval.get(),
        metrics,
        &telemetry.service_name,
    )
    .context("cannot start the OTLP metrics push")?;
    Ok(Some(push))
}

/// The root's children, dependencies first, for the features the daemon runs. The one place the
/// product features decide what starts: the registry always (an empty fleet for the request
/// path), the rest only with its feature. Each `cfg` keeps a slim binary from linking what it
/// cannot start; each `if` lets a test run fewer features than are compiled.
#[cfg_attr(not(feature = "dynamo"), allow(unused_mut, unused_variables))]
fn root_children(shared: &Shared, registry: ChildSpec) -> Vec<ChildSpec> {
    let mut children = vec![registry];
    #[cfg(feature = "dynamo-kv")]
    if shared.features.dynamo_kv {
        children.push(kv_index_spec(shared.kv.clone(), shared.registry.clone()));
    }
    #[cfg(feature = "dynamo")]
    if shared.features.dynamo {
        children.push(picker_spec(
            shared.picker.clone(),
            shared.registry.clone(),
            shared.load.clone(),
        ));
        children.push(sources::discovery_spec(shared));
        children.push(sources::subscriptions_spec(shared));
    }
    // Peer router replicas' in-flight dispatches (`replica_sync`); idle while it is off.
    #[cfg(feature = "replica-sync")]
    if shared.features.dynamo {
        let config = shared.config.clone();
        children.push(continuum_actors::replica_sync::replica_sync_spec(
            shared.picker.clone(),
            Some(shared.replica_sync_metrics.clone()),
            shared.replica_sync.clone(),
            move || replica_sync::settings(&config.load()),
        ));
    }
    #[cfg(feature = "dynamo-event-bus")]
    if shared.features.dynamo_event_bus {
        children.push(crate::event_bus::event_bus_spec(shared.event_bus.clone()));
    }
    // kv_cache_index sources pushed by continuum-kv-listener agents over the event bus.
    #[cfg(all(feature = "dynamo-kv", feature = "dynamo-event-bus"))]
    if shared.features.dynamo_kv && shared.features.dynamo_event_bus {
        let config = shared.config.clone();
        children.push(continuum_actors::kv_push::kv_push_spec(
            shared.event_bus.clone(),
            shared.kv.clone(),
            shared.kv_push.clone(),
            move || kv_push_backends(&config.load()),
        ));
    }
    children
}

/// The pushed sources `root/kv_push` reads: none unless Dynamo and its KV index run.
#[cfg(all(feature = "dynamo-kv", feature = "dynamo-event-bus"))]
fn kv_push_backends(config: &Config) -> Vec<String> {
    if config.dynamo.enabled && config.dynamo.kv.enabled && config.dynamo.event_bus.enabled {
        config.dynamo.kv.kv_cache_index.event_bus_backends()
    } else {
        Vec::new()
    }
}

fn app_state(
    shared: &Shared,
    tree: &ActorTree,
    live: Arc<ArcSwap<LiveSettings>>,
    control: mpsc::Sender<ControlCommand>,
) -> AppState {
    let metrics = shared.metrics.clone();
    let registry = shared.registry.clone();
    let load = shared.load.clone();
    let kv = shared.kv.clone();
    let picker = shared.picker.clone();
    let summary_kv = shared.kv.clone();
    let summary_metrics = shared.metrics.clone();
    let models_registry = shared.registry.clone();
    let models_config = shared.config.clone();
    let (bus, bus_config) = (shared.event_bus.clone(), shared.config.clone());
    let (sync, summary_sync) = (shared.replica_sync.clone(), shared.replica_sync.clone());
    AppState {
        live,
        readiness: shared.readiness.clone(),
        metrics: Arc::new(move || metrics.render()),
        tree: tree.clone(),
        control,
        dynamo_workers: Arc::new(move || {
            let mut view = crate::dynamo_admin::workers_view(&registry, &load, &kv, Some(&picker));
            crate::event_bus::add_broker_coverage(&mut view, &bus, &bus_config.load());
            // Discovery off: the view stays `{"enabled": false}` (the documented shape).
            if let Some(fields) = view.as_object_mut()
                && fields.get("enabled") == Some(&serde_json::Value::Bool(true))
            {
                fields.insert("replica_sync".into(), serde_json::json!(*sync.get()));
            }
            view
        }),
        fleet_summary: Arc::new(move || {
            let mut summary = crate::dynamo_admin::fleet_summary(&summary_kv, &summary_metrics);
            if let Some(fields) = summary.as_object_mut() {
                fields.insert(
                    "replica_sync".into(),
                    serde_json::json!(*summary_sync.get()),
                );
            }
            summary
        }),
        route: shared.route.clone(),
        fleet_models: Arc::new(move |allowed: &[String]| {
            let snapshot = models_registry.snapshot();
            let config = models_config.load();
            let shim = &config.dynamo.shim;
            // A fleet model is reachable through its namespace's shim replicas.
            let reachable = |ns: &Namespace| {
                allowed.is_empty()
                    || shim
                        .backends_for(ns.as_str())
                        .iter()
                        .any(|b| allowed.contains(b))
            };
            let mut models: Vec<String> = snapshot
                .models()
                .filter(|(ns, _)| reachable(ns))
                .map(|(_, m)| m.to_string())
                .collect();
            models.sort();
            models.dedup();
            models
        }),
    }
}

/// The front door's per-request settings (the immediate reload class).
pub fn live_settings(config: &Config) -> LiveSettings {
    LiveSettings {
        admin_token: config
            .admin
            .enabled
            .then(|| config.admin.token.clone())
            .flatten(),
        api_keys: config
            .api_keys
            .iter()
            .map(|k| ApiKeySetting {
                key: k.key.clone(),
                name: k.name.clone(),
                allowed_backends: k.allowed_backends.clone().unwrap_or_default(),
            })
            .collect(),
        models: config
            .backends
            .iter()
            .filter(|b| b.enabled && !b.internal)
            .flat_map(|b| b.models.iter().cloned())
            .collect(),
        backend_models: config
            .backends
            .iter()
            .filter(|b| b.enabled && !b.internal)
            .map(|b| (b.name.clone(), b.models.clone()))
            .collect(),
    }
}

/// Owns the running config; the only place reloads happen.
struct ControlLoop {
    shared: Shared,
    tree: ActorTree,
    live: Arc<ArcSwap<LiveSettings>>,
    path: Option<PathBuf>,
    current: Config,
    /// False while `Daemon::start` applies the first config: the tree is not spawned yet, so
    /// its subtrees need no replacement (they spawn from the config being applied).
    running: bool,
}

impl ControlLoop {
    async fn run(
        mut self,
        mut commands: mpsc::Receiver<ControlCommand>,
        mut hangup: mpsc::Receiver<()>,
        (_watcher, mut file_rx): (Option<notify::RecommendedWatcher>, mpsc::Receiver<()>),
    ) {
        loop {
            tokio::select! {
                command = commands.recv() => match command {
                    Some(ControlCommand::Reload(reply)) => {
                        let outcome = self.reload("admin API").await;
                        let _ = reply.send(outcome);
                    }
                    Some(ControlCommand::Config(reply)) => {
                        let _ = reply.send(self.running());
                    }
                    Some(ControlCommand::Import(text, reply)) => {
                        let outcome = self.import(text).await;
                        let _ = reply.send(outcome);
                    }
                    None => return,
                },
                Some(()) = file_rx.recv() => {
                    // Editors write in several steps: reload once the file has been quiet.
                    settle(&mut file_rx, RELOAD_DEBOUNCE, RELOAD_DEBOUNCE_MAX).await;
                    let _ = self.reload("file watch").await;
                }
                Some(()) = hangup.recv() => {
                    info!("SIGHUP: reloading the config file.");
                    let _ = self.reload("SIGHUP").await;
                }
            }
        }
    }

    /// Re-reads the file and applies it, unless it is invalid or the reload guard refuses it;
    /// a refusal is logged (with `trigger`), counted, and returned (the API answers 409).
    async fn reload(&mut self, trigger: &'static str) -> Result<String, String> {
        let Some(path) = self.path.clone() else {
            return Err("the demo runs on an embedded config; there is no file to reload".into());
        };
        let (loaded, text) = match Config::load_with_text(&path) {
            Ok(loaded) => loaded,
            Err(error) => {
                if let Some(daemon) = self.shared.metrics.family::<DaemonMetrics>() {
                    daemon.config_reload_refused(ReloadRefusal::Invalid);
                }
                warn!(%error, trigger, path = %path.display(), "Refused the new config; the running config stays.");
                return Err(error.to_string());
            }
        };
        let explicit = config::guard::Explicit::of(&text);
        if let Err(refusal) = config::guard::check_reload(&self.current, &loaded.config, explicit) {
            let reason = match refusal {
                GuardRefusal::RemovesAllBackends => ReloadRefusal::RemovesAllBackends,
                GuardRefusal::DisablesAdmin => ReloadRefusal::DisablesAdmin,
            };
            if let Some(daemon) = self.shared.metrics.family::<DaemonMetrics>() {
                daemon.config_reload_refused(reason);
            }
            warn!(
                reason = reason.as_label(),
                trigger,
                path = %path.display(),
                "Refused the new config: {}; the running config stays.",
                refusal.explain()
            );
            return Err(refusal.explain().to_string());
        }
        Ok(self.apply_loaded(loaded).await)
    }

    async fn apply_loaded(&mut self, loaded: LoadedConfig) -> String {
        config::log_diagnostics(&loaded.diagnostics);
        self.apply(loaded.config, "reload").await
    }

    /// The one path for startup (`current` is the empty config) and reload: applies a validated
    /// config by reload class, as `config::diff(current, new)` says. The daemon runs the
    /// effective config (`config::features::effective`: the sections of a missing feature
    /// switched off); `current` keeps the config as written, for the readback.
    async fn apply(&mut self, written: Config, what: &'static str) -> String {
        let features = self.shared.features;
        if !self.running {
            // At startup; a reload logs the same warnings with its validation diagnostics.
            for inactive in config::features::inactive(&written, features) {
                warn!(path = %inactive.path, "{}.", inactive.message);
            }
        }
        let new = config::features::effective(&written, features);
        let plan = config::diff(&config::features::effective(&self.current, features), &new);
        if plan.is_empty() {
            self.current = written;
            return "no changes".into();
        }
        // Immediate class: the next request sees it.
        self.shared.config.store(Arc::new(new.clone()));
        // What the config asks of the pickers, published once with the picker it installs.
        self.shared.dynamo.reconfigure(&new);
        self.live.store(Arc::new(live_settings(&new)));
        self.shared.proxy.reconfigure(&new);
        if plan.kv_artifacts {
            sync_kv_artifacts(&self.shared, &new);
        }
        if let Err(error) = self
            .shared
            .load
            .set_max_staleness(new.dynamo.load.max_staleness.get())
        {
            warn!(%error, "Keeping the previous load.max_staleness.");
        }
        let mut summary = vec![format!("{} changed keys", plan.changes.len())];
        match &plan.discovery {
            Some(DiscoveryAction::Stop) => {
                info!("Dynamo discovery stopped.");
                self.shared.mailbox.reconfigure(registry_config(&new), true);
                self.shared.readiness.require_exactly(Vec::new());
                self.replace_discovery().await;
                summary.push("discovery stopped".into());
            }
            Some(DiscoveryAction::Restart {
                reason,
                keep_snapshot,
                added_namespaces,
                ..
            }) => {
                if self.running {
                    info!(reason = reason.as_str(), "Replacing the discovery watcher.");
                    if let Some(discovery) = self.shared.metrics.family::<DiscoveryMetrics>() {
                        discovery.event(DiscoveryEventKind::Restart);
                    }
                }
                // A backoff-only change keeps the snapshot until the replacement's first
                // resync; a namespaces change prunes only removed namespaces.
                let reset = !*keep_snapshot && *reason != RestartReason::Namespaces;
                self.shared
                    .mailbox
                    .reconfigure(registry_config(&new), reset);
                let newly_required: Vec<String> = if reset {
                    required_sources(&new)
                } else {
                    added_namespaces
                        .iter()
                        .map(|ns| {
                            source_name(new.dynamo.discovery.source, &Namespace::new(ns.clone()))
                        })
                        .collect()
                };
                let mut required = self.shared.readiness.pending();
                required.extend(newly_required);
                required.retain(|s| required_sources(&new).contains(s));
                self.shared.readiness.require_exactly(required);
                self.replace_discovery().await;
                summary.push(format!("discovery replaced ({})", reason.as_str()));
            }
            None => {
                // No watcher change: the registry's configuration can still differ where it
                // does not matter to a watcher (a disabled source's namespaces); keep it true.
                self.shared
                    .mailbox
                    .reconfigure(registry_config(&new), false);
            }
        }
        self.shared.mailbox.cast(RegistryMsg::Rebuild);
        // `restart_subscriptions` covers the dial policy and turning KV indexing on or off (the
        // kv-events subscriptions start or stop).
        if plan.restart_subscriptions && self.running && features.dynamo {
            // Only the subscriptions restart; discovery, the load store and the KV index stay.
            if let Err(error) = self
                .tree
                .restart("root/subscriptions", REPLACE_TIMEOUT)
                .await
            {
                error!(%error, "Could not restart the load subscriptions.");
            }
            summary.push("load subscriptions restarted under the new dial policy".into());
        }
        // Sessions are regranted or closed in place; a new listen address, TLS files, `enabled`
        // or byte bounds restart only root/event_bus (at startup the tree spawns it afterwards).
        self.shared
            .event_bus
            .set_coverage_namespaces(crate::event_bus::coverage_namespaces(&new));
        let bus = crate::event_bus::settings(&new.dynamo.event_bus);
        if plan.event_bus
            && self.shared.event_bus.reload(bus)
            && self.running
            && features.dynamo_event_bus
        {
            if let Err(error) = self.tree.restart("root/event_bus", REPLACE_TIMEOUT).await {
                error!(%error, "Could not restart the event bus listener.");
            }
            summary.push("event bus listener restarted".into());
        }
        #[cfg(all(feature = "dynamo-kv", feature = "dynamo-event-bus"))]
        if self.restart_kv_push(&new).await {
            summary.push("kv_listener sources restarted".into());
        }
        if plan.replica_sync && self.restart_replica_sync().await {
            summary.push("replica sync restarted".into());
        }
        if !plan.needs_restart.is_empty() && self.running {
            warn!(keys = ?plan.needs_restart, "These settings take effect after a process restart.");
            summary.push(format!("needs restart: {}", plan.needs_restart.join(", ")));
        }
        self.current = written;
        let summary = summary.join("; ");
        info!(%summary, what, "Configuration applied.");
        summary
    }

    /// The pushed kv_cache_index sources changed: only they restart (their resume cursors and
    /// the KV index stay); whether they did.
    #[cfg(all(feature = "dynamo-kv", feature = "dynamo-event-bus"))]
    async fn restart_kv_push(&self, new: &Config) -> bool {
        let features = self.shared.features;
        if !(self.running && features.dynamo_kv && features.dynamo_event_bus)
            || kv_push_backends(&config::features::effective(&self.current, features))
                == kv_push_backends(new)
        {
            return false;
        }
        if let Err(error) = self.tree.restart("root/kv_push", REPLACE_TIMEOUT).await {
            error!(%error, "Could not restart the kv_listener sources.");
        }
        true
    }

    /// A `replica_sync` change restarts only `root/replica_sync` (peers' contributions are learnt
    /// again from their next snapshots); whether it did.
    async fn restart_replica_sync(&self) -> bool {
        if !self.running || !self.shared.features.dynamo || !cfg!(feature = "replica-sync") {
            return false;
        }
        if let Err(error) = self
            .tree
            .restart("root/replica_sync", REPLACE_TIMEOUT)
            .await
        {
            error!(%error, "Could not restart the replica sync.");
        }
        true
    }

    async fn replace_discovery(&self) {
        if !self.running || !self.shared.features.dynamo {
            return;
        }
        if let Err(error) = self.tree.restart("root/discovery", REPLACE_TIMEOUT).await {
            error!(%error, "Could not replace the discovery watcher.");
        }
    }
}

/// Waits until `events` has been quiet for `quiet` (each new event restarts the wait), at most
/// `max` in all, so a file written in several steps is read once, when complete; a file that
/// keeps changing is still read every `max`.
async fn settle(events: &mut mpsc::Receiver<()>, quiet: Duration, max: Duration) {
    let deadline = tokio::time::Instant::now() + max;
    loop {
        let wait = (tokio::time::Instant::now() + quiet).min(deadline);
        tokio::select! {
            event = events.recv() => {
                if event.is_none() || tokio::time::Instant::now() >= deadline {
                    return;
                }
            }
            () = tokio::time::sleep_until(wait) => return,
        }
    }
}

/// SIGHUP as a stream of reload requests. Installing the handler replaces the default action
/// (terminate), so a SIGHUP never kills the daemon.
fn hangup_signal() -> mpsc::Receiver<()> {
    let (tx, rx) = mpsc::channel(1);
    #[cfg(unix)]
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(mut signal) => {
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        received = signal.recv() => {
                            if received.is_none() {
                                return;
                            }
                            // One pending reload covers any number of signals.
                            let _ = tx.try_send(());
                        }
                        // The control loop ended (shutdown): stop listening.
                        () = tx.closed() => return,
                    }
                }
            });
        }
        Err(error) => {
            drop(tx);
            warn!(%error, "Cannot handle SIGHUP; use POST /admin/config/reload.");
        }
    }
    #[cfg(not(unix))]
    drop(tx);
    rx
}

/// Watches the config file's directory (editors replace files) and pokes on changes to it.
fn watch_file(path: &Path, tx: mpsc::Sender<()>) -> Option<notify::RecommendedWatcher> {
    use notify::Watcher as _;
    let file_name = path.file_name()?.to_os_string();
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .to_path_buf();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        // Reading the file (as every reload does) is an access event: only changes count, or
        // each reload would schedule the next.
        if let Ok(event) = event
            && !matches!(event.kind, notify::EventKind::Access(_))
            && event
                .paths
                .iter()
                .any(|p| p.file_name() == Some(&file_name))
        {
            let _ = tx.try_send(());
        }
    })
    .map_err(|error| warn!(%error, "Cannot watch the config file; use POST /admin/config/reload."))
    .ok()?;
    watcher
        .watch(&dir, notify::RecursiveMode::NonRecursive)
        .map_err(
            |error| warn!(%error, "Cannot watch the config file; use POST /admin/config/reload."),
        )
        .ok()?;
    Some(watcher)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file written in steps 200 ms apart is read once, 250 ms after the last step (the
    /// previous fixed 250 ms wait after the first event read it after the second step, half
    /// written). The clock is paused: time moves only when every task waits.
    #[tokio::test(start_paused = true)]
    async fn reload_waits_until_the_file_has_been_quiet() {
        let (tx, mut rx) = mpsc::channel(16);
        let start = tokio::time::Instant::now();
        let writer = tokio::spawn(async move {
            for _ in 0..4 {
                tx.send(()).await.expect("open");
                tokio::time::advance(Duration::from_millis(200)).await;
            }
            tx
        });
        rx.recv().await.expect("first event");
        settle(&mut rx, RELOAD_DEBOUNCE, RELOAD_DEBOUNCE_MAX).await;
        let settled = start.elapsed();
        let _tx = writer.await.expect("writer");
        // Events at 0, 200, 400, 600 ms: quiet from 600 ms on, so settled at 850 ms.
        assert!(settled >= Duration::from_millis(850), "{settled:?}");
        assert!(settled < RELOAD_DEBOUNCE_MAX, "{settled:?}");
        assert!(rx.try_recv().is_err(), "every event of the burst consumed");
    }

    /// A file that never stops changing is still read after the bound.
    #[tokio::test(start_paused = true)]
    async fn reload_of_a_file_that_keeps_changing_is_bounded() {
        let (tx, mut rx) = mpsc::channel(16);
        let start = tokio::time::Instant::now();
        let writer = tokio::spawn(async move {
            loop {
                if tx.send(()).await.is_err() {
                    return;
                }
                tokio::time::advance(Duration::from_millis(100)).await;
            }
        });
        rx.recv().await.expect("first event");
        settle(&mut rx, RELOAD_DEBOUNCE, RELOAD_DEBOUNCE_MAX).await;
        let settled = start.elapsed();
        writer.abort();
        assert!(settled >= RELOAD_DEBOUNCE_MAX, "{settled:?}");
        assert!(
            settled < RELOAD_DEBOUNCE_MAX + Duration::from_millis(300),
            "{settled:?}"
        );
    }
}
