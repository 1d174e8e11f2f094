//! The agent's long-running parts: the DynamoWorkerMetadata watch (the advertised set), the
//! probe/metrics server, and the session loop that redials the router with full-jitter
//! exponential backoff (500 ms → 30 s; the floor comes back after a session that lasted 30 s).

use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::Context as _;
use continuum_actors::kube_source::{
    KubeConnect, KubeSourceConfig, KubeUpdate, WatchTiming, WorkerMetadataChange,
    run_worker_metadata_source,
};
use continuum_protocol::backoff::{Backoff, BackoffPolicy, Jitter};
use continuum_protocol::event_bus::advertised::Advertised;
use tokio::sync::{mpsc, watch};
use tracing::{info, warn};

use crate::config::{BrokerConfig, KubeApi};
use crate::kv_listener::{Feed, Feeds};
use crate::metrics::{self, Metrics};
use crate::session::{self, Clock, SessionEnd};
use continuum_protocol::event_bus::message::Role;

/// From SIGTERM to exit, at most.
pub const SHUTDOWN_BUDGET: Duration = Duration::from_secs(10);
/// The redial schedule.
pub const REDIAL: BackoffPolicy = BackoffPolicy {
    initial: Duration::from_millis(500),
    max: Duration::from_secs(30),
    jitter: Jitter::Full,
};
/// A session at least this long restores the redial floor.
pub const REDIAL_RESET_AFTER: Duration = Duration::from_secs(30);

/// What every session shares.
pub struct Shared {
    pub config: Arc<BrokerConfig>,
    pub tls: Arc<rustls::ClientConfig>,
    pub token: Option<Arc<str>>,
    pub metrics: Metrics,
    pub advertised: Arc<RwLock<Advertised>>,
    pub ready: Arc<AtomicBool>,
    pub clock: Clock,
    /// kv_listener only: the announced sources' feeds (empty for a broker).
    pub feeds: Arc<Feeds>,
}

/// A running agent: its probe address, and the task that ends after shutdown.
pub struct Agent {
    pub probe_addr: SocketAddr,
    pub task: tokio::task::JoinHandle<()>,
}

/// Starts everything; the returned task ends once `shutdown` flips to `true` and the session
/// closed (or [`SHUTDOWN_BUDGET`] ran out).
pub async fn start(config: BrokerConfig, shutdown: watch::Receiver<bool>) -> anyhow::Result<Agent> {
    let tls = crate::tls::client_config(&config)?;
    let agent = match config.role {
        Role::KvListener => metrics::Agent::KvListener,
        _ => metrics::Agent::Broker,
    };
    let metrics = Metrics::for_agent(agent);
    let ready = Arc::new(AtomicBool::new(false));
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let probe_addr = listener.local_addr()?;
    let app = crate::http::router(metrics.clone(), ready.clone(), agent);
    let server = tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app).await {
            warn!(%error, "The probe server stopped.");
        }
    });
    let advertised = Arc::new(RwLock::new(Advertised::new(config.namespaces.clone())));
    let (synced_tx, synced) = watch::channel(false);
    let epoch = crate::kv_listener::draw_epoch();
    let feeds: Feeds = config
        .sources
        .iter()
        .map(|s| {
            let feed = Feed::new(s.backend.clone(), epoch, config.replay_events);
            (s.backend.clone(), Arc::new(feed))
        })
        .collect();
    // A broker watches DynamoWorkerMetadata; a kv-listener reads its sources.
    let background = match agent {
        metrics::Agent::Broker => vec![spawn_kube_watch(
            &config,
            advertised.clone(),
            metrics.clone(),
            synced_tx,
        )],
        metrics::Agent::KvListener => {
            synced_tx.send_replace(true);
            crate::kv_listener::spawn_sources(
                &config.sources,
                config.allow_cidrs.as_ref(),
                &feeds,
                metrics.clone(),
            )
        }
    };
    let shared = Shared {
        feeds: Arc::new(feeds),
        token: crate::session::token_of(&config),
        config: Arc::new(config),
        tls,
        metrics,
        advertised,
        ready,
        clock: Clock::new(),
    };
    info!(
        probe = %probe_addr,
        bus = %shared.config.bus.authority(),
        client_id = %shared.config.client_id.as_str(),
        epoch = format!("{epoch:06x}"),
        "{} started.",
        match agent {
            metrics::Agent::Broker => "continuum-event-broker",
            metrics::Agent::KvListener => "continuum-kv-listener",
        }
    );
    let task = tokio::spawn(async move {
        if wait_for_metadata(synced, shutdown.clone()).await {
            session_loop(&shared, shutdown).await;
        }
        for task in background {
            task.abort();
        }
        server.abort();
    });
    Ok(Agent { probe_addr, task })
}

/// The first dial waits for the first DynamoWorkerMetadata list: before it every subscribe
/// would be refused with `target_not_advertised`. `false` when shut down first.
async fn wait_for_metadata(
    mut synced: watch::Receiver<bool>,
    mut shutdown: watch::Receiver<bool>,
) -> bool {
    let mut warned = false;
    loop {
        if *synced.borrow_and_update() {
            return true;
        }
        tokio::select! {
            changed = synced.changed() => if changed.is_err() { return false },
            _ = shutdown.changed() => return false,
            () = tokio::time::sleep(Duration::from_secs(30)), if !warned => {
                warned = true;
                warn!("No DynamoWorkerMetadata list yet (check the Role and the Kubernetes namespace); not dialling the router until there is one.");
            }
        }
    }
}

async fn session_loop(shared: &Shared, mut shutdown: watch::Receiver<bool>) {
    let mut backoff = Backoff::new(REDIAL);
    loop {
        if *shutdown.borrow() {
            return;
        }
        let end = session::run_session(shared, &mut shutdown).await;
        session::log_end(&end);
        if let Some(code) = end.code() {
            shared.metrics.session_closed(code);
        }
        let lasted = match end {
            SessionEnd::Shutdown => return,
            SessionEnd::Closed {
                welcomed_for: Some(lasted),
                ..
            } => lasted,
            _ => Duration::ZERO,
        };
        let delay = backoff.session_ended(lasted, REDIAL_RESET_AFTER, unit());
        info!(
            delay_ms = delay.as_millis() as u64,
            "Redialling the router after backoff."
        );
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            _ = shutdown.changed() => return,
        }
    }
}

/// A uniform draw in `[0, 1)` from the TLS stack's CSPRNG (0.5 if it fails).
fn unit() -> f64 {
    let mut bytes = [0u8; 8];
    if rustls::crypto::ring::default_provider()
        .secure_random
        .fill(&mut bytes)
        .is_err()
    {
        return 0.5;
    }
    (u64::from_be_bytes(bytes) >> 11) as f64 / (1u64 << 53) as f64
}

fn spawn_kube_watch(
    config: &BrokerConfig,
    advertised: Arc<RwLock<Advertised>>,
    metrics: Metrics,
    synced: watch::Sender<bool>,
) -> tokio::task::JoinHandle<()> {
    let source = KubeSourceConfig {
        connect: match &config.kubernetes_api {
            KubeApi::Infer => KubeConnect::Infer,
            KubeApi::Url(url) => KubeConnect::Url(url.clone()),
        },
        namespace: config.kubernetes_namespace.clone(),
        backoff: KubeSourceConfig::DEFAULT_BACKOFF,
        timing: WatchTiming::default(),
    };
    let (tx, mut rx) = mpsc::channel(64);
    let watch = tokio::spawn(run_worker_metadata_source(source, tx));
    tokio::spawn(async move {
        let _watch = AbortOnDrop(watch);
        while let Some(update) = rx.recv().await {
            match update {
                KubeUpdate::Data(change) => {
                    let Ok(mut set) = advertised.write() else {
                        return;
                    };
                    let step = match change {
                        WorkerMetadataChange::Relisted(resources) => {
                            synced.send_replace(true);
                            set.relist(&resources)
                        }
                        WorkerMetadataChange::Applied(resource) => set.apply(&resource),
                        WorkerMetadataChange::Deleted(name) => {
                            set.delete(&name);
                            Default::default()
                        }
                    };
                    if step.ignored > 0 {
                        warn!(
                            ignored = step.ignored,
                            "Ignored DynamoWorkerMetadata event channels (malformed, unsupported or past a bound)."
                        );
                    }
                    metrics.advertised_targets.set(set.len() as i64);
                }
                KubeUpdate::Connected(up) => metrics.kubernetes_connected.set(i64::from(up)),
                KubeUpdate::Counted { .. } => {}
            }
        }
    })
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
