//! `continuum-router demo`: a simulated Dynamo 1.6.1 fleet and the router, in one process.
//!
//! | module | what it holds |
//! |---|---|
//! | [`fleet`] | simulated workers: 1.6.1 registrations, booked load, ActiveLoad publishing |
//! | [`zmq_pub`] | a bounded ZMTP 3.x PUB socket over tokio (the workers' `kv_metrics` publisher) |
//! | [`shim`] | a simulated `dynamo.frontend --router-mode direct` per namespace |
//!
//! Nothing in the router is special-cased: the workers' records reach it through
//! `dynamo.discovery.source: simulated` (an in-memory feed of etcd-shaped records, then the
//! normal reducer and registry), their load through the normal subscription actors dialling the
//! `tcp://127.0.0.1:…` addresses the records advertise, and requests through the normal shim
//! path to the simulated frontends named in the embedded config (`src/config/demo.yaml`).

pub mod fleet;
pub mod shim;
pub mod zmq_pub;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tokio::net::TcpListener;
use tracing::{info, warn};

use crate::config::Config;
use crate::daemon::{Daemon, RunOptions};
use crate::telemetry;
use fleet::{Fleet, WorkerSpec};
use shim::{Pace, ServedRequest, ShimServer};

/// How the demo runs.
#[derive(Clone, Debug)]
pub struct DemoOptions {
    /// The fleet to simulate (namespaces must match the embedded config's shim pools).
    pub fleet: Vec<WorkerSpec>,
    /// How often every worker publishes its load.
    pub publish_interval: Duration,
    /// How long simulated prefills and tokens take.
    pub pace: Pace,
}

impl Default for DemoOptions {
    fn default() -> Self {
        Self {
            fleet: fleet::default_fleet(),
            publish_interval: Duration::from_millis(200),
            pace: Pace::default(),
        }
    }
}

/// A running demo: the fleet, its frontends and the router.
pub struct Demo {
    daemon: Daemon,
    fleet: Arc<Fleet>,
    frontends: BTreeMap<String, ShimServer>,
    config: Config,
    publish_interval: Duration,
}

impl std::fmt::Debug for Demo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Demo")
            .field("router", &self.daemon.local_addr())
            .finish_non_exhaustive()
    }
}

impl Demo {
    /// Starts the fleet, one simulated frontend per namespace (free loopback ports) and the
    /// router on `listener`, configured by the embedded demo config.
    pub async fn start(options: DemoOptions, listener: TcpListener) -> anyhow::Result<Demo> {
        let mut models: BTreeMap<String, String> = BTreeMap::new();
        for spec in &options.fleet {
            models
                .entry(spec.namespace.clone())
                .or_insert_with(|| spec.model.clone());
        }
        let mut listeners = BTreeMap::new();
        for namespace in models.keys() {
            let frontend = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
                .await
                .context("cannot bind a simulated frontend on loopback")?;
            listeners.insert(namespace.clone(), frontend);
        }
        let addrs: BTreeMap<String, SocketAddr> = listeners
            .iter()
            .map(|(ns, l)| Ok((ns.clone(), l.local_addr()?)))
            .collect::<std::io::Result<_>>()?;
        let fleet = Arc::new(
            Fleet::start(
                options.fleet,
                |ns| addrs.get(ns).map(ToString::to_string).unwrap_or_default(),
                options.publish_interval,
            )
            .await
            .context("cannot start the simulated fleet")?,
        );
        let mut frontends = BTreeMap::new();
        for (namespace, frontend) in listeners {
            let model = models.get(&namespace).cloned().unwrap_or_default();
            let server =
                ShimServer::start(frontend, &namespace, &model, fleet.clone(), options.pace)?;
            frontends.insert(namespace, server);
        }
        let config = demo_config(&addrs)?;
        let daemon = Daemon::start_with_feed(
            RunOptions {
                config: config.clone(),
                config_path: None,
                demo: true,
            },
            listener,
            fleet.feed(),
        )
        .await?;
        Ok(Demo {
            daemon,
            fleet,
            frontends,
            config,
            publish_interval: options.publish_interval,
        })
    }

    pub fn daemon(&self) -> &Daemon {
        &self.daemon
    }

    pub fn fleet(&self) -> &Arc<Fleet> {
        &self.fleet
    }

    /// The effective router config (frontend URLs filled in).
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The router's front door.
    pub fn url(&self) -> String {
        format!("http://{}", self.daemon.local_addr())
    }

    /// Waits (on registry generations) until the router has discovered every simulated worker;
    /// false when `limit` passed first.
    pub async fn wait_discovered(&self, limit: Duration) -> bool {
        let registry = self.daemon.registry();
        let mut generations = registry.subscribe();
        let all = self.fleet.workers().len();
        tokio::time::timeout(limit, async {
            while registry.snapshot().workers().len() < all {
                if generations.changed().await.is_err() {
                    return false;
                }
            }
            true
        })
        .await
        .unwrap_or(false)
    }

    /// The simulated frontend of a namespace.
    pub fn frontend(&self, namespace: &str) -> Option<&ShimServer> {
        self.frontends.get(namespace)
    }

    /// Every request the simulated frontends answered, namespace by namespace.
    pub fn served(&self) -> Vec<ServedRequest> {
        self.frontends
            .values()
            .flat_map(|f| f.state().served())
            .collect()
    }

    /// What to print on startup: where to send requests and where to watch.
    pub fn banner(&self) -> String {
        let url = self.url();
        let token = self
            .config
            .admin
            .token
            .as_deref()
            .unwrap_or("(admin disabled)");
        let mut out = String::new();
        out.push_str("continuum-router demo: a simulated Dynamo 1.6.1 fleet and the router, in this process.\n\n");
        out.push_str(&format!("  Front door   {url}\n"));
        out.push_str(&format!(
            "  Try          curl -s {url}/v1/chat/completions -H 'content-type: application/json' \\\n\
             \x20                 -d '{{\"model\":\"demo-disagg\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hello!\"}}],\"max_tokens\":8}}'\n"
        ));
        out.push_str(
            "               (model demo-agg goes to the aggregated pool; add \"stream\":true for SSE)\n",
        );
        out.push_str(&format!("  Admin token  {token}\n"));
        out.push_str(&format!(
            "  Workers      curl -s -H 'authorization: Bearer {token}' {url}/admin/dynamo/workers\n"
        ));
        out.push_str(&format!(
            "  Metrics      curl -s {url}/metrics | grep continuum_dynamo_selection_total\n"
        ));
        out.push_str(&format!(
            "  Limits       answers are filler text of at most {} tokens (a larger max_tokens is \
             capped; finish_reason \"length\"); the embedded config cannot be reloaded\n",
            shim::MAX_TOKENS
        ));
        out.push_str(
            "  Logs         warnings only unless RUST_LOG is set \
             (RUST_LOG=info,continuum_router::shim=debug logs every pick)\n\n",
        );
        out.push_str(&format!(
            "  Simulated workers (each publishes kv_metrics over ZMQ every {}):\n",
            humantime::format_duration(self.publish_interval)
        ));
        for worker in self.fleet.workers() {
            out.push_str(&format!(
                "    {:<9} {:<10} worker_id {}  dp_size {}  model {}  kv_metrics tcp://{}\n",
                worker.spec.namespace,
                worker.worker_type().as_str(),
                worker.instance_id.0,
                worker.spec.data_parallel_size,
                worker.spec.model,
                worker.pub_addr(),
            ));
        }
        out.push_str("  Simulated direct-mode frontends:\n");
        for (namespace, frontend) in &self.frontends {
            out.push_str(&format!(
                "    {namespace:<9} http://{}\n",
                frontend.local_addr()
            ));
        }
        out
    }

    /// Stops the router (bounded), then the frontends and the fleet.
    pub async fn shutdown(self) {
        self.daemon.shutdown().await;
        drop(self.frontends);
        drop(self.fleet);
    }
}

/// The embedded demo config with each shim pool's backends pointed at its namespace's simulated
/// frontend.
pub fn demo_config(frontends: &BTreeMap<String, SocketAddr>) -> anyhow::Result<Config> {
    let mut config = Config::demo();
    let pools = config.dynamo.shim.pools.clone();
    for pool in pools {
        let addr = frontends
            .get(&pool.namespace)
            .with_context(|| format!("no simulated frontend for namespace {}", pool.namespace))?;
        for name in &pool.backends {
            let backend = config
                .backends
                .iter_mut()
                .find(|b| &b.name == name)
                .with_context(|| format!("the demo config has no backend {name}"))?;
            backend.url = format!("http://{addr}");
        }
    }
    Ok(config)
}

/// `continuum-router demo`: runs until SIGTERM or SIGINT.
pub async fn run_until_signal(
    bind: Option<SocketAddr>,
    options: DemoOptions,
) -> anyhow::Result<()> {
    let mut config = Config::demo();
    if let Some(bind) = bind {
        config.server.bind_address = bind;
    }
    // The embedded config logs warnings only; `RUST_LOG` asks for more (a bad filter is refused
    // by telemetry::init with the filter's own error).
    if let Some(filter) = std::env::var("RUST_LOG")
        .ok()
        .filter(|f| !f.trim().is_empty())
    {
        config.telemetry.log_level = filter;
    }
    let guard =
        telemetry::init(&(&config.telemetry).into()).context("cannot initialise telemetry")?;
    let addr = config.server.bind_address;
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr} (try --bind 127.0.0.1:0)"))?;
    let demo = Demo::start(options, listener).await?;
    if !demo.wait_discovered(Duration::from_secs(10)).await {
        warn!("The router has not discovered every simulated worker yet.");
    }
    info!(router = %demo.url(), "continuum-router demo is serving.");
    println!("{}", demo.banner());
    crate::daemon::shutdown_signal().await;
    info!("Shutting down the demo.");
    demo.shutdown().await;
    if let Err(error) = guard.shutdown().await {
        warn!(%error, "Telemetry did not flush cleanly.");
    }
    Ok(())
}
