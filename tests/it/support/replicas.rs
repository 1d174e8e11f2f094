//! Router replicas as REAL processes (`CARGO_BIN_EXE_continuum-router`) and the real
//! `nats-server` they share in-flight dispatches over (`replica_sync`): the harness of
//! `replica_sync` (pyzmq load) and `replica_sync_dynamo_e2e` (real Dynamo 1.6.1). Every process is
//! killed on drop; every wait is bounded by [`WAIT`]. `NATS_SERVER_BIN` names the server
//! (default: `nats-server` on PATH, else /usr/sbin).
#![allow(dead_code)] // Each test module uses a different part of the harness.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::time::Instant;

const BIN: &str = env!("CARGO_BIN_EXE_continuum-router");
/// Bound on every wait of the harness.
pub const WAIT: Duration = Duration::from_secs(30);
/// The admin token of every replica.
pub const TOKEN: &str = "admin-secret";

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// A `nats-server` on a loopback port; killed on drop.
pub struct Nats {
    child: Option<Child>,
    port: u16,
}

impl Nats {
    fn bin() -> String {
        std::env::var("NATS_SERVER_BIN").unwrap_or_else(|_| {
            for candidate in [
                "nats-server",
                "/usr/sbin/nats-server",
                "/usr/bin/nats-server",
            ] {
                if Command::new(candidate).arg("--version").output().is_ok() {
                    return candidate.to_owned();
                }
            }
            panic!("no nats-server (apt-get install -y nats-server, or set NATS_SERVER_BIN)")
        })
    }

    fn spawn(port: u16, extra: &[&str]) -> Child {
        Command::new(Self::bin())
            .args(["-a", "127.0.0.1", "-p", &port.to_string()])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nats-server")
    }

    pub async fn start() -> Self {
        Self::start_with(&[]).await
    }

    pub async fn start_with(extra: &[&str]) -> Self {
        let port = free_port();
        let nats = Self {
            child: Some(Self::spawn(port, extra)),
            port,
        };
        nats.wait_listening().await;
        nats
    }

    async fn wait_listening(&self) {
        let deadline = Instant::now() + WAIT;
        while tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .is_err()
        {
            assert!(Instant::now() < deadline, "nats-server did not listen");
            tokio::task::yield_now().await;
        }
    }

    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops the server and starts it again on the same port.
    pub async fn restart(&mut self) {
        self.stop();
        self.child = Some(Self::spawn(self.port, &[]));
        self.wait_listening().await;
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The `replica_sync:` block of replica `name` (fast cadence, 1 s TTL); `nats_extra`: more keys
/// under `replica_sync.nats` (a flow-map fragment such as `, token_file: "..."`).
pub fn sync_yaml(name: &str, nats: &str, nats_extra: &str) -> String {
    format!(
        "replica_sync:\n  enabled: true\n  replica_id: {name}\n  group: it\n  \
         publish_interval: 5ms\n  heartbeat_interval: 200ms\n  ttl: 1s\n  \
         nats: {{url: \"{nats}\", reconnect_max_delay: 500ms{nats_extra}}}\n"
    )
}

/// One router process; SIGKILLed on drop.
pub struct Replica {
    pub name: &'static str,
    pub addr: SocketAddr,
    child: Child,
    _dir: tempfile::TempDir,
}

impl Replica {
    /// Starts a router whose config is `server` and `admin` on a free loopback port followed by
    /// `body` (top-level YAML keys). Returns at once: wait on [`Replica::until`].
    pub fn start(name: &'static str, body: &str) -> Replica {
        let dir = tempfile::tempdir().expect("tempdir");
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        let config = dir.path().join("router.yaml");
        let yaml = format!(
            "server: {{bind_address: \"{addr}\"}}\nadmin: {{enabled: true, token: {TOKEN}}}\n{body}"
        );
        std::fs::write(&config, yaml).expect("write config");
        let child = Command::new(BIN)
            .arg("run")
            .arg("--config")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the router");
        Replica {
            name,
            addr,
            child,
            _dir: dir,
        }
    }

    /// `GET /admin/dynamo/workers`, or `None` while the replica does not answer.
    pub async fn workers_view(&self) -> Option<Value> {
        let resp = reqwest::Client::new()
            .get(format!("http://{}/admin/dynamo/workers", self.addr))
            .bearer_auth(TOKEN)
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .ok()?;
        resp.json().await.ok()
    }

    /// Waits (bounded by [`WAIT`]) until the admin view satisfies `done`.
    #[track_caller]
    pub fn until(&self, done: impl Fn(&Value) -> bool) -> impl std::future::Future<Output = Value> {
        let caller = std::panic::Location::caller();
        async move {
            let deadline = Instant::now() + WAIT;
            let mut last = Value::Null;
            loop {
                if let Some(view) = self.workers_view().await {
                    if done(&view) {
                        return view;
                    }
                    last = view;
                }
                assert!(
                    Instant::now() < deadline,
                    "{caller}: replica {} never reached the state; last view: {}",
                    self.name,
                    json!({"replica_sync": last["replica_sync"], "picker": last["picker"], "load": last["load"]})
                );
                tokio::task::yield_now().await;
            }
        }
    }

    /// The named peer as this replica's admin view shows it.
    pub fn peer<'a>(view: &'a Value, name: &str) -> Option<&'a Value> {
        view["replica_sync"]["peers"]
            .as_array()?
            .iter()
            .find(|p| p["replica"] == name)
    }

    /// The number of peers the admin view shows.
    pub fn peer_count(view: &Value) -> usize {
        view["replica_sync"]["peers"].as_array().map_or(0, Vec::len)
    }

    /// A chat completion of `words` words for model `tiny`; its status, 0 on a transport error.
    pub async fn chat(&self, words: usize) -> u16 {
        self.chat_json(&json!({"model": "tiny", "messages": [{"role": "user",
            "content": vec!["word"; words].join(" ")}]}))
            .await
    }

    /// A chat completion with this body; its status, 0 on a transport error.
    pub async fn chat_json(&self, body: &Value) -> u16 {
        reqwest::Client::new()
            .post(format!("http://{}/v1/chat/completions", self.addr))
            .timeout(WAIT)
            .json(body)
            .send()
            .await
            .map_or(0, |r| r.status().as_u16())
    }

    /// The value of an unlabelled metric family (NaN when absent).
    pub async fn metric(&self, family: &str) -> f64 {
        let text = reqwest::get(format!("http://{}/metrics", self.addr))
            .await
            .expect("metrics")
            .text()
            .await
            .expect("text");
        text.lines()
            .find(|l| l.starts_with(family) && l[family.len()..].starts_with(' '))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::NAN)
    }

    /// SIGKILL.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.kill();
    }
}
