//! `continuum-event-broker`: the in-cluster agent of the continuum-router event bus
//! (docs/event-bus.md, "continuum-event-broker").
//!
//! It dials **out** to the router's event-bus listener (TLS 1.3, ALPN h2, HTTP/2), says hello as
//! role `broker` with the Dynamo namespaces it reaches, keeps heartbeats, and for each
//! `subscribe` dials the ZMQ publisher, but only one that DynamoWorkerMetadata in its Kubernetes
//! namespace advertises (`target_not_advertised` otherwise), relaying raw ZMTP bytes both ways
//! over the commanded data stream. It redials the router with jittered backoff and drains on
//! SIGTERM.
//!
//! | module | what it holds |
//! |---|---|
//! | [`config`] | flags, the YAML file, [`config::BrokerConfig`] (checked at startup) |
//! | [`agent`] | the DynamoWorkerMetadata watch, the probe server, the redial loop |
//! | [`session`] | one control session on the protocol's `ClientSession` |
//! | [`relay`] | one data stream: publisher TCP ⇄ HTTP/2 stream |
//! | [`kv_listener`] | the kv_listener push role (`continuum-kv-listener`): source subscriptions, replay rings, SSE streams |
//! | [`tls`] | TLS 1.3 + ALPN h2 connector, HTTP/2 client settings |
//! | [`metrics`] | Prometheus families (closed label sets) |
//! | [`http`] | `/health`, `/ready`, `/metrics` |
//!
//! The same crate is `continuum-kv-listener` (role `kv_listener`, [`kv_listener_main`]): the
//! session, TLS, redial, drain and probe plumbing are shared; only what a subscribe serves
//! differs (a relayed publisher, or a source's numbered SSE events).
//!
//! The binaries are `src/bin/continuum-event-broker.rs` and `src/bin/continuum-kv-listener.rs`
//! of the root package, which call [`main`] and [`kv_listener_main`].

pub mod agent;
pub mod config;
pub mod http;
pub mod kv_listener;
pub mod metrics;
pub mod relay;
pub mod session;
pub mod tls;

use std::process::ExitCode;

use clap::Parser as _;
use tokio::sync::watch;
use tracing::{error, info, warn};

/// The crate version (`--version`, `continuum_event_broker_build_info`).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Parses the command line and runs the agent until SIGTERM or SIGINT.
pub fn main() -> ExitCode {
    let cli = config::Cli::parse();
    init_logs();
    start(config::BrokerConfig::resolve(cli))
}

/// `continuum-kv-listener`: parses its command line and runs the push agent until SIGTERM or
/// SIGINT.
pub fn kv_listener_main() -> ExitCode {
    let cli = config::KvListenerCli::parse();
    init_logs();
    start(config::BrokerConfig::resolve_kv_listener(cli))
}

fn init_logs() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

fn start(config: anyhow::Result<config::BrokerConfig>) -> ExitCode {
    let config = match config {
        Ok(config) => config,
        Err(error) => {
            error!("{error:#}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            error!(%error, "Cannot start the tokio runtime.");
            return ExitCode::FAILURE;
        }
    };
    let code = runtime.block_on(run(config));
    // Relays and watches still running are dropped here, not awaited.
    runtime.shutdown_timeout(std::time::Duration::from_millis(100));
    code
}

async fn run(config: config::BrokerConfig) -> ExitCode {
    let (shutdown_tx, shutdown) = watch::channel(false);
    let mut agent = match agent::start(config, shutdown).await {
        Ok(agent) => agent,
        Err(error) => {
            error!("{error:#}");
            return ExitCode::from(2);
        }
    };
    let signal = wait_for_signal();
    tokio::select! {
        () = signal => {}
        _ = &mut agent.task => {
            error!("The agent stopped on its own.");
            return ExitCode::FAILURE;
        }
    }
    info!("Shutting down: draining the event-bus session.");
    let _ = shutdown_tx.send(true);
    // Leave room under the 10 s budget for the runtime to wind down.
    let budget = agent::SHUTDOWN_BUDGET - std::time::Duration::from_secs(1);
    match tokio::time::timeout(budget, &mut agent.task).await {
        Ok(_) => ExitCode::SUCCESS,
        Err(_) => {
            warn!("The drain did not finish within its budget; exiting anyway.");
            agent.task.abort();
            ExitCode::SUCCESS
        }
    }
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        error!("Cannot install the signal handlers; running until killed.");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
