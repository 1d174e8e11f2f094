//! continuum-demo: the simulated Dynamo 1.6.1 fleet behind `continuum-router demo`. Not part of
//! the router library: the root crate's binary (and the tests) compose it with the daemon.
//!
//! | module | what it holds |
//! |---|---|
//! | [`fleet`] | simulated workers: 1.6.1 registrations, booked load, ActiveLoad publishing |
//! | [`zmq_pub`] | a bounded ZMTP 3.x PUB socket over tokio (the workers' `kv_metrics` publisher) |
//! | [`shim`] | a simulated `dynamo.frontend --router-mode direct` per namespace |
//!
//! Nothing in the router is special-cased: the workers' records reach it through
//! `dynamo.discovery.source: simulated` (the in-memory feed of etcd-shaped records of
//! [`Simulation::feed`], then the normal reducer and registry), their load through the normal
//! subscription actors dialling the `tcp://127.0.0.1:…` addresses the records advertise, and
//! requests through the normal shim path to the simulated frontends the router's embedded demo
//! config names ([`Simulation::frontend_addrs`] fills in their URLs).

// Test code is exempt from the 120-line limit; product code is linted in the non-test build.
#![cfg_attr(test, allow(clippy::too_many_lines, reason = "test code is exempt"))]

pub mod fleet;
pub mod shim;
pub mod zmq_pub;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use continuum_actors::memory_source::MemoryDiscovery;
use tokio::net::TcpListener;

use fleet::{Fleet, WorkerSpec};
use shim::{Pace, ServedRequest, ShimServer};

/// How the simulation runs.
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

/// A running simulation: the fleet and one simulated direct-mode frontend per namespace.
pub struct Simulation {
    fleet: Arc<Fleet>,
    frontends: BTreeMap<String, ShimServer>,
    publish_interval: Duration,
}

impl std::fmt::Debug for Simulation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Simulation")
            .field("frontends", &self.frontend_addrs())
            .finish_non_exhaustive()
    }
}

impl Simulation {
    /// Starts the fleet and one simulated frontend per namespace on free loopback ports.
    pub async fn start(options: DemoOptions) -> anyhow::Result<Simulation> {
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
        Ok(Simulation {
            fleet,
            frontends,
            publish_interval: options.publish_interval,
        })
    }

    pub fn fleet(&self) -> &Arc<Fleet> {
        &self.fleet
    }

    /// The in-memory discovery feed the router's `source: simulated` reads.
    pub fn feed(&self) -> MemoryDiscovery {
        self.fleet.feed()
    }

    /// The simulated frontend of a namespace.
    pub fn frontend(&self, namespace: &str) -> Option<&ShimServer> {
        self.frontends.get(namespace)
    }

    /// Each namespace's simulated frontend address.
    pub fn frontend_addrs(&self) -> BTreeMap<String, SocketAddr> {
        self.frontends
            .iter()
            .map(|(ns, f)| (ns.clone(), f.local_addr()))
            .collect()
    }

    /// Every request the simulated frontends answered, namespace by namespace.
    pub fn served(&self) -> Vec<ServedRequest> {
        self.frontends
            .values()
            .flat_map(|f| f.state().served())
            .collect()
    }

    /// What to print on startup: where to send requests (the router at `url`, admin `token`)
    /// and what is simulated.
    pub fn banner(&self, url: &str, token: Option<&str>) -> String {
        let token = token.unwrap_or("(admin disabled)");
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
             (RUST_LOG=info,continuum_router::route=debug logs every pick)\n\n",
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

    /// Stops the frontends, then the fleet.
    pub fn shutdown(self) {
        drop(self.frontends);
        drop(self.fleet);
    }
}
