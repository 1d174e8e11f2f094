//! The `continuum-router` binary: parse the command line, then hand over to the library. The
//! `demo` subcommand composes the daemon with the simulated fleet of the `continuum-demo` crate,
//! and the `replay` subcommand calls the offline replay of the `continuum-replay` crate; the
//! library contains neither.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use continuum_router::config::{self, Config};
use continuum_router::daemon::{self, RunOptions};

/// With the `mimalloc` feature the binary allocates through mimalloc (see docs/performance.md,
/// "Proxy vs nginx", for what it measured).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser, Debug)]
#[command(
    name = "continuum-router",
    version = continuum_router::build_info::LONG_VERSION,
    about = "External router for NVIDIA Dynamo fleets"
)]
struct Cli {
    /// Config file to run with (same as `run --config FILE`).
    #[arg(long, global = false, value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the daemon with a config file.
    Run {
        /// YAML config file to run with (see docs/configuration.md; `${VAR}` references are
        /// read from the environment).
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
    },
    /// Inspect a config file.
    Config {
        #[command(subcommand)]
        action: ConfigAction,
    },
    /// Run the daemon on an embedded default: a simulated fleet on this machine.
    #[cfg(feature = "dynamo")]
    Demo {
        /// Address to serve on [default: 127.0.0.1:8080, from the embedded config].
        #[arg(long, value_name = "ADDR")]
        bind: Option<String>,
        /// How often each simulated worker publishes its load ("200ms", "1s").
        #[arg(long, default_value = "200ms", value_parser = humantime::parse_duration)]
        publish_interval: std::time::Duration,
    },
    /// Replay a trace offline through each routing policy and compare them.
    #[cfg(feature = "dynamo-kv")]
    Replay(Box<continuum_replay::ReplayArgs>),
}

#[derive(Subcommand, Debug)]
enum ConfigAction {
    /// Print every error and warning with its YAML path; exit 0 when valid, 1 otherwise.
    Validate {
        /// YAML config file to check.
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
    },
    /// Print the effective config (defaults filled in) with secrets masked.
    Show {
        /// YAML config file to show.
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
    },
    /// Print a commented starter config (secrets from ${ROUTER_ADMIN_TOKEN}, ${CLIENT_API_KEY}).
    Example,
}

fn main() -> ExitCode {
    // ring is the one process-wide rustls provider (no aws-lc is compiled in).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cli = Cli::parse();
    match (cli.command, cli.config) {
        (Some(Command::Config { action }), _) => config_command(action),
        (Some(Command::Run { config }), _) | (None, Some(config)) => run_file(config),
        #[cfg(feature = "dynamo")]
        (
            Some(Command::Demo {
                bind,
                publish_interval,
            }),
            _,
        ) => demo::run_demo(bind, publish_interval),
        #[cfg(feature = "dynamo-kv")]
        (Some(Command::Replay(args)), _) => match continuum_replay::run(&args) {
            Ok(summary) => {
                print!("{}", continuum_replay::report::table(&summary));
                ExitCode::SUCCESS
            }
            Err(error) => {
                eprintln!("continuum-router replay: {error:#}");
                ExitCode::FAILURE
            }
        },
        (None, None) => {
            eprintln!("continuum-router: give --config FILE, or try `continuum-router demo`");
            ExitCode::from(2)
        }
    }
}

fn config_command(action: ConfigAction) -> ExitCode {
    match action {
        ConfigAction::Validate { config } => {
            let (report, code) = config::report::validate_file(&config);
            print!("{report}");
            ExitCode::from(code.clamp(0, 255) as u8)
        }
        ConfigAction::Show { config } => match Config::load(&config) {
            Ok(loaded) => {
                print!("{}", config::show_effective(&loaded.config));
                ExitCode::SUCCESS
            }
            Err(error) => {
                eprintln!("{error}");
                ExitCode::FAILURE
            }
        },
        ConfigAction::Example => {
            print!("{}", config::example::EXAMPLE_YAML);
            ExitCode::SUCCESS
        }
    }
}

fn run_file(path: PathBuf) -> ExitCode {
    let loaded = match Config::load(&path) {
        Ok(loaded) => loaded,
        Err(error) => {
            eprintln!("{error}");
            return ExitCode::FAILURE;
        }
    };
    for warning in &loaded.diagnostics {
        eprintln!("{warning}");
    }
    block_on(daemon::run_until_signal(RunOptions {
        config: loaded.config,
        config_path: Some(path),
        demo: false,
    }))
}

/// `continuum-router demo` (a `dynamo` build only: the simulated fleet is discovered through
/// the Dynamo path).
#[cfg(feature = "dynamo")]
mod demo {
    use std::net::SocketAddr;
    use std::process::ExitCode;
    use std::time::Duration;

    use anyhow::Context as _;
    use continuum_demo::{DemoOptions, Simulation};
    use continuum_router::config::Config;
    use continuum_router::daemon::{self, Daemon, RunOptions};
    use continuum_router::telemetry;
    use tracing::{info, warn};

    use super::block_on;

    pub(crate) fn run_demo(bind: Option<String>, publish_interval: Duration) -> ExitCode {
        let bind = match bind.map(|b| b.parse::<SocketAddr>().map_err(|e| (b, e))) {
            None => None,
            Some(Ok(addr)) => Some(addr),
            Some(Err((bind, error))) => {
                eprintln!("--bind {bind}: {error}");
                return ExitCode::from(2);
            }
        };
        let options = DemoOptions {
            publish_interval: publish_interval.max(Duration::from_millis(10)),
            ..DemoOptions::default()
        };
        block_on(demo_until_signal(bind, options))
    }

    /// `continuum-router demo`: the simulated fleet and the router on the embedded demo config (each
    /// shim pool pointed at its namespace's simulated frontend), until SIGTERM or SIGINT.
    async fn demo_until_signal(
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
        let listener = continuum_router::front_door::bind(addr, config.server.max_connections)
            .with_context(|| format!("cannot listen on {addr} (try --bind 127.0.0.1:0)"))?;
        let simulation = Simulation::start(options).await?;
        let router = Config::demo_with_frontends(&simulation.frontend_addrs())
            .map_err(anyhow::Error::msg)?;
        let token = router.admin.token.clone();
        let daemon = Daemon::start_with_feed(
            RunOptions {
                config: router,
                config_path: None,
                demo: true,
            },
            listener,
            simulation.feed(),
        )
        .await?;
        let url = format!("http://{}", daemon.local_addr());
        if !all_discovered(&daemon, simulation.fleet().workers().len()).await {
            warn!("The router has not discovered every simulated worker yet.");
        }
        info!(router = %url, "continuum-router demo is serving.");
        println!("{}", simulation.banner(&url, token.as_deref()));
        daemon::shutdown_signal().await;
        info!("Shutting down the demo.");
        daemon.shutdown().await;
        simulation.shutdown();
        if let Err(error) = guard.shutdown().await {
            warn!(%error, "Telemetry did not flush cleanly.");
        }
        Ok(())
    }

    /// Waits (on registry generations, at most 10 s) until the router has discovered `workers`
    /// simulated workers.
    async fn all_discovered(daemon: &Daemon, workers: usize) -> bool {
        let registry = daemon.registry();
        let mut generations = registry.subscribe();
        tokio::time::timeout(Duration::from_secs(10), async {
            while registry.snapshot().workers().len() < workers {
                if generations.changed().await.is_err() {
                    return false;
                }
            }
            true
        })
        .await
        .unwrap_or(false)
    }
}

fn block_on(work: impl std::future::Future<Output = anyhow::Result<()>>) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(error) => {
            eprintln!("cannot start the tokio runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(work) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("continuum-router: {error:#}");
            ExitCode::FAILURE
        }
    }
}
