//! The REAL `continuum-event-broker` binary as a child process (tests/it/dynamo_broker_tunnel.rs,
//! tests/it/dynamo_broker_e2e.rs): it dials a router's event-bus listener with a bearer token and
//! learns the advertised publishers from DynamoWorkerMetadata in the fake Kubernetes API. Its
//! stderr is echoed with the broker id as a prefix; its probe address (`/metrics`, `/health`,
//! `/ready`) is read from its start-up log line. Dropping it kills the process.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::process::{Child, Command};

use super::fake_kube::FakeKube;

/// How long the broker may take to log its probe address.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// What [`Broker::spawn`] starts the binary with.
pub struct BrokerArgs<'a> {
    /// `--client-id`: the router's `dynamo.event_bus.brokers[].id`.
    pub id: &'a str,
    /// The bearer token (the entry's `token_hash` is its sha256).
    pub token: &'a str,
    /// The router's event-bus listener.
    pub bus: SocketAddr,
    /// The CA that verifies the listener's certificate.
    pub ca: &'a Path,
    /// `--dynamo-namespace`.
    pub dynamo_namespace: &'a str,
    /// `--kubernetes-namespace`: where the DynamoWorkerMetadata are.
    pub kubernetes_namespace: &'a str,
    pub kube: &'a FakeKube,
}

pub struct Broker {
    pub child: Child,
    /// `/health`, `/ready` and `/metrics`.
    pub probe: SocketAddr,
    _token: tempfile::NamedTempFile,
}

impl Broker {
    pub async fn spawn(args: BrokerArgs<'_>) -> Broker {
        let token_file = tempfile::NamedTempFile::new().expect("token file");
        std::fs::write(token_file.path(), format!("{}\n", args.token)).expect("write token");
        let mut child = Command::new(env!("CARGO_BIN_EXE_continuum-event-broker"))
            .args(["--bus-url", &format!("https://{}", args.bus)])
            .args(["--client-id", args.id])
            .arg("--token-file")
            .arg(token_file.path())
            .arg("--ca-file")
            .arg(args.ca)
            .args(["--dynamo-namespace", args.dynamo_namespace])
            .args(["--kubernetes-namespace", args.kubernetes_namespace])
            .args(["--kubernetes-api-url", &args.kube.url()])
            .args(["--listen", "127.0.0.1:0"])
            .env("RUST_LOG", "info,continuum_event_broker=debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("the continuum-event-broker binary starts");
        let probe = probe_address(&mut child, args.id, START_TIMEOUT).await;
        Broker {
            child,
            probe,
            _token: token_file,
        }
    }

    /// `http://<probe>`: the base URL of `/metrics`, `/health` and `/ready`.
    pub fn probe_url(&self) -> String {
        format!("http://{}", self.probe)
    }

    pub async fn scrape(&self) -> String {
        reqwest::get(format!("{}/metrics", self.probe_url()))
            .await
            .expect("broker /metrics")
            .text()
            .await
            .expect("metrics text")
    }

    /// The value of one exposition line `series` (name and labels exactly as rendered).
    pub async fn value(&self, series: &str) -> f64 {
        let text = self.scrape().await;
        text.lines()
            .find_map(|line| {
                line.strip_prefix(series)
                    .and_then(|rest| rest.strip_prefix(' '))
                    .and_then(|v| v.trim().parse::<f64>().ok())
            })
            .unwrap_or_else(|| panic!("{series} in\n{text}"))
    }

    pub async fn kill(&mut self) {
        self.child.kill().await.expect("SIGKILL the broker");
    }
}

/// Echoes a spawned agent's stderr (tagged) and returns the probe address it logs at startup
/// (`probe=ADDR`), waiting at most `within`. Shared by the broker and kv-listener harnesses.
pub async fn probe_address(
    child: &mut Child,
    tag: &str,
    within: std::time::Duration,
) -> SocketAddr {
    let stderr = child.stderr.take().expect("stderr");
    let (probe_tx, probe_rx) = tokio::sync::oneshot::channel();
    let tag = tag.to_owned();
    tokio::spawn(async move {
        let mut lines = BufReader::new(stderr).lines();
        let mut probe_tx = Some(probe_tx);
        while let Ok(Some(line)) = lines.next_line().await {
            eprintln!("[{tag}] {line}");
            if let Some(rest) = line.split("probe=").nth(1)
                && let Some(addr) = rest
                    .split_whitespace()
                    .next()
                    .and_then(|a| a.parse::<SocketAddr>().ok())
                && let Some(tx) = probe_tx.take()
            {
                let _ = tx.send(addr);
            }
        }
    });
    tokio::time::timeout(within, probe_rx)
        .await
        .expect("the agent logs its probe address in time")
        .expect("the agent started")
}
