//! The demo composed in process, as `continuum-router demo` composes it: the simulated fleet of
//! `continuum-demo` in front of the daemon on the embedded demo config.
#![allow(dead_code)] // Each test module uses a different part of the harness.

use std::sync::Arc;
use std::time::Duration;

use continuum_demo::fleet::Fleet;
use continuum_demo::shim::{ServedRequest, ShimServer};
use continuum_demo::{DemoOptions, Simulation};
use continuum_router::config::Config;
use continuum_router::daemon::{Daemon, RunOptions};
use tokio::net::TcpListener;

/// A running demo: the simulation and the router in front of it.
pub struct Demo {
    daemon: Daemon,
    simulation: Simulation,
}

impl Demo {
    /// Starts the simulation, then the router on `listener`.
    pub async fn start(options: DemoOptions, listener: TcpListener) -> anyhow::Result<Demo> {
        Self::start_with(options, listener, |_| {}).await
    }

    /// [`Demo::start`] on the demo config as `edit` changes it.
    pub async fn start_with(
        options: DemoOptions,
        listener: TcpListener,
        edit: impl FnOnce(&mut Config),
    ) -> anyhow::Result<Demo> {
        let simulation = Simulation::start(options).await?;
        let mut config = Config::demo_with_frontends(&simulation.frontend_addrs())
            .map_err(anyhow::Error::msg)?;
        edit(&mut config);
        let daemon = Daemon::start_with_feed(
            RunOptions {
                config,
                config_path: None,
                demo: true,
            },
            listener,
            simulation.feed(),
        )
        .await?;
        Ok(Demo { daemon, simulation })
    }

    pub fn daemon(&self) -> &Daemon {
        &self.daemon
    }

    pub fn fleet(&self) -> &Arc<Fleet> {
        self.simulation.fleet()
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
        let all = self.fleet().workers().len();
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
        self.simulation.frontend(namespace)
    }

    /// Every request the simulated frontends answered.
    pub fn served(&self) -> Vec<ServedRequest> {
        self.simulation.served()
    }

    /// Stops the router (bounded), then the simulation.
    pub async fn shutdown(self) {
        self.daemon.shutdown().await;
        self.simulation.shutdown();
    }
}
