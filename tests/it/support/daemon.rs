//! Starting the daemon in-process from YAML, and waiting on its registry, for black-box tests.
#![allow(dead_code)]

use std::time::Duration;

use continuum_actors::registry::RegistryReader;
use continuum_protocol::discovery::snapshot::DynamoSnapshot;
use continuum_router::config::{Config, ProcessEnv};
use continuum_router::daemon::{Daemon, RunOptions};
use tokio::net::TcpListener;

/// A daemon on a free loopback port, configured by `yaml` (no file to reload).
pub async fn start(yaml: &str) -> Daemon {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let config = Config::from_yaml_str(yaml, &ProcessEnv).expect("valid test config");
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    Daemon::start(
        RunOptions {
            config,
            config_path: None,
            demo: false,
        },
        listener,
    )
    .await
    .expect("daemon starts")
}

/// Waits on registry generations (never on time) until `done` holds.
pub async fn wait_for(
    registry: &RegistryReader,
    limit: Duration,
    what: &str,
    done: impl Fn(&DynamoSnapshot) -> bool,
) {
    let mut generations = registry.subscribe();
    tokio::time::timeout(limit, async {
        while !done(&registry.snapshot()) {
            generations.changed().await.expect("registry alive");
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what} within {limit:?}"));
}

/// Waits until the fleet holds at least `n` workers.
pub async fn wait_for_workers(daemon: &Daemon, n: usize) {
    wait_for(
        daemon.registry(),
        Duration::from_secs(30),
        "workers discovered",
        |s| s.workers().len() >= n,
    )
    .await;
}

/// A daemon configured from the YAML file at `path`, so `Daemon::reload` re-reads it.
pub async fn start_file(path: &std::path::Path) -> Daemon {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let config = Config::load(path).expect("valid test config").config;
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    Daemon::start(
        RunOptions {
            config,
            config_path: Some(path.to_owned()),
            demo: false,
        },
        listener,
    )
    .await
    .expect("daemon starts")
}
