//! A real NVIDIA Dynamo 1.6.1 stack for end-to-end tests: etcd, the tiny offline model,
//! `dynamo.mocker` workers and a `dynamo.frontend --router-mode direct`, all child processes on
//! loopback with free ports and a namespace of their own.
//!
//! With [`Discovery::File`] there is no etcd at all: every process runs with
//! `--discovery-backend file` and `DYN_FILE_KV` pointing at a directory of the stack, and
//! readiness is read from that directory (polled every 100 ms; files carry no lease, so a worker
//! counts as registered once its instance and card are there and its component has one
//! `kv_metrics` channel file per running worker).
//!
//! Use it from a test crate with `mod support { pub mod etcd; pub mod dynamo; }`. It needs the
//! venv python that `scripts/setup-dynamo-venv.sh` prints, in `CONTINUUM_DYNAMO_PYTHON`, and the
//! `etcd` binary (see `support::etcd`). `kill` (procps) sends SIGTERM, since std has no signal
//! API and the workspace forbids `unsafe`.
//!
//! Readiness is event-driven: each worker counts as started once its instance, model card and
//! `kv_metrics` channel are in etcd (an etcd watch wakes the check, no sleeps), and the frontend
//! once `/v1/models` lists the model (polled every 100 ms, the only HTTP signal it offers).
//! Worker ids are learnt from etcd: lease id == instance id == worker id in Dynamo 1.6.1. Workers
//! of one component start one at a time so each child is matched to the id it registered.
//! Dropping the stack kills every process (SIGKILL); while a test is panicking the log directory
//! is kept and its path printed.
#![allow(dead_code)] // Each test crate uses a different part of the harness.

use std::collections::BTreeSet;
use std::fmt;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use continuum_protocol::discovery::file_store::{BUCKETS, TMP_PREFIX, decode_file_name};
use etcd_client::{Client, GetOptions, WatchOptions};
use tokio::process::{Child, Command};
use tokio::time::Instant;

use super::etcd::EtcdServer;

/// The model name every worker serves (the tiny model's `--model-name`).
pub const MODEL: &str = "tiny";
/// KV blocks each mocker declares (`--num-gpu-blocks-override`).
pub const TOTAL_KV_BLOCKS: u64 = 1024;
/// `--block-size` of each mocker.
pub const BLOCK_SIZE: u32 = 16;
/// The lease TTL Dynamo 1.6.1 workers grant themselves: a SIGKILLed worker's keys live this long.
pub const LEASE_TTL: Duration = Duration::from_secs(30);
/// The file store's TTL in Dynamo 1.6.1: a SIGKILLed worker's files stop being live this long
/// after its last touch.
pub const FILE_TTL: Duration = Duration::from_secs(10);
/// The environment variable naming the venv python with ai-dynamo.
pub const PYTHON_ENV: &str = "CONTINUUM_DYNAMO_PYTHON";

/// How long one process may take to register or serve (python imports on a busy 2-core box).
const START_TIMEOUT: Duration = Duration::from_secs(90);
/// How long a SIGTERMed process may take to exit before it is killed.
const EXIT_TIMEOUT: Duration = Duration::from_secs(20);
/// Default mocker arguments (fast, 1024 blocks of 16 tokens).
const MOCKER_ARGS: [&str; 6] = [
    "--speedup-ratio",
    "10",
    "--num-gpu-blocks-override",
    "1024",
    "--block-size",
    "16",
];

/// Which workers [`DynamoStack::start`] brings up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Topology {
    /// One prefill worker (component `prefill`) and one decode worker (component `backend`).
    Disagg,
    /// Two aggregated workers (component `backend`).
    Agg,
}

impl Topology {
    fn roles(self) -> &'static [WorkerRole] {
        match self {
            Topology::Disagg => &[WorkerRole::Prefill, WorkerRole::Decode],
            Topology::Agg => &[WorkerRole::Aggregated, WorkerRole::Aggregated],
        }
    }
}

/// The role a mocker is started with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum WorkerRole {
    Prefill,
    Decode,
    Aggregated,
}

impl WorkerRole {
    /// The Dynamo component the worker's endpoint lives in (`dyn://{ns}.{component}.generate`).
    pub fn component(self) -> &'static str {
        match self {
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode | WorkerRole::Aggregated => "backend",
        }
    }

    /// `--disaggregation-mode` of `dynamo.mocker`.
    fn mode(self) -> &'static str {
        match self {
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
            WorkerRole::Aggregated => "agg",
        }
    }

    /// The admin API spelling (`prefill`, `decode`, `aggregated`), as `Role::as_str`.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
            WorkerRole::Aggregated => "aggregated",
        }
    }
}

/// How [`DynamoStack::stop_worker`] stops a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    /// Graceful: the worker deletes its keys and revokes its lease at once.
    Term,
    /// Abrupt: the keys stay until the lease expires (at most [`LEASE_TTL`]).
    Kill,
}

/// Where the stack's processes register (`--discovery-backend`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Discovery {
    /// A private etcd (the default).
    Etcd,
    /// Dynamo's file store in a directory of the stack; no etcd process is started.
    File,
}

impl Discovery {
    fn backend(self) -> &'static str {
        match self {
            Discovery::Etcd => "etcd",
            Discovery::File => "file",
        }
    }
}

/// Knobs for [`DynamoStack::start_with`].
#[derive(Clone, Debug)]
pub struct StackOptions {
    pub topology: Topology,
    /// The discovery backend of every process (default etcd).
    pub discovery: Discovery,
    /// Start `dynamo.frontend --router-mode direct` (default true).
    pub frontend: bool,
    /// Extra `dynamo.mocker` arguments (default: speedup 10, 1024 blocks of 16 tokens).
    pub mocker_args: Vec<String>,
}

impl StackOptions {
    pub fn new(topology: Topology) -> Self {
        Self {
            topology,
            discovery: Discovery::Etcd,
            frontend: true,
            mocker_args: MOCKER_ARGS.iter().map(|s| (*s).to_owned()).collect(),
        }
    }
}

/// One worker process and the id it registered.
pub struct DynamoWorker {
    pub role: WorkerRole,
    /// Decimal instance id (== its etcd lease id); hex is the key suffix.
    pub instance_id: u64,
    /// Its log file.
    pub log: PathBuf,
    child: Option<Child>,
}

impl DynamoWorker {
    /// Whether the process has not been stopped through the harness.
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }
}

impl fmt::Debug for DynamoWorker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DynamoWorker")
            .field("role", &self.role)
            .field("instance_id", &self.instance_id)
            .field("running", &self.is_running())
            .finish()
    }
}

/// A running stack. Dropping it kills every process.
pub struct DynamoStack {
    python: PathBuf,
    namespace: String,
    dir: Option<tempfile::TempDir>,
    model_dir: PathBuf,
    mocker_args: Vec<String>,
    workers: Vec<DynamoWorker>,
    frontend: Option<Child>,
    frontend_port: u16,
    /// Frontends added by [`DynamoStack::add_frontend`].
    extra_frontends: Vec<Child>,
    /// The file store root (`DYN_FILE_KV`) under [`Discovery::File`].
    file_root: Option<PathBuf>,
    etcd_client: Option<Client>,
    /// Last: dropped after the Dynamo processes are killed. `None` under [`Discovery::File`].
    etcd: Option<EtcdServer>,
}

impl DynamoStack {
    /// etcd, the tiny model, the topology's workers and a direct-mode frontend, all ready.
    pub async fn start(topology: Topology) -> Self {
        Self::start_with(StackOptions::new(topology)).await
    }

    pub async fn start_with(options: StackOptions) -> Self {
        // reqwest (the frontend readiness probe) needs the one process-wide rustls provider.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let python = python();
        let dir = tempfile::Builder::new()
            .prefix("dynamo-stack-")
            .tempdir()
            .expect("create a temporary directory for the stack");
        let (etcd, etcd_client, file_root) = match options.discovery {
            Discovery::Etcd => {
                let etcd = EtcdServer::start().await;
                let client = etcd.client().await;
                (Some(etcd), Some(client), None)
            }
            Discovery::File => (None, None, Some(dir.path().join("dynamo_store_kv"))),
        };
        let model_dir = dir.path().join("tiny-model");
        make_tiny_model(&python, &model_dir).await;
        let mut stack = Self {
            python,
            namespace: unique_namespace(),
            model_dir,
            mocker_args: options.mocker_args,
            workers: Vec::new(),
            frontend: None,
            frontend_port: free_port(),
            extra_frontends: Vec::new(),
            file_root,
            etcd_client,
            etcd,
            dir: Some(dir),
        };
        // One wave per position: workers of distinct components start together, workers of
        // one component one after another, so each new id belongs to exactly one child.
        let mut pending: Vec<WorkerRole> = options.topology.roles().to_vec();
        while !pending.is_empty() {
            let mut wave: Vec<WorkerRole> = Vec::new();
            pending.retain(|role| {
                if wave.iter().any(|r| r.component() == role.component()) {
                    true
                } else {
                    wave.push(*role);
                    false
                }
            });
            stack.start_workers(&wave).await;
        }
        if options.frontend {
            stack.start_frontend().await;
        }
        stack
    }

    /// The Dynamo namespace of this stack's endpoints (`dyn://{ns}.{component}.generate`).
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// etcd's client URL (`http://127.0.0.1:<port>`).
    pub fn etcd_endpoint(&self) -> String {
        self.etcd().endpoint()
    }

    pub fn etcd(&self) -> &EtcdServer {
        self.etcd
            .as_ref()
            .expect("this stack runs with the file discovery backend: there is no etcd")
    }

    /// Whether an etcd process belongs to this stack.
    pub fn has_etcd(&self) -> bool {
        self.etcd.is_some()
    }

    /// The file store root (`DYN_FILE_KV`) the processes share under [`Discovery::File`].
    pub fn file_root(&self) -> &Path {
        self.file_root
            .as_deref()
            .expect("this stack runs with the etcd discovery backend: there is no file store")
    }

    /// `http://127.0.0.1:<port>` of the direct-mode frontend.
    pub fn frontend_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.frontend_port)
    }

    /// The tiny model directory the workers were started with.
    pub fn model_dir(&self) -> &Path {
        &self.model_dir
    }

    /// Where each process's log goes.
    pub fn log_dir(&self) -> PathBuf {
        self.dir
            .as_ref()
            .map(|d| d.path().join("logs"))
            .unwrap_or_default()
    }

    /// Every worker started, running or stopped, in start order.
    pub fn workers(&self) -> &[DynamoWorker] {
        &self.workers
    }

    /// Ids of the running workers of `role`, in start order.
    pub fn worker_ids(&self, role: WorkerRole) -> Vec<u64> {
        self.workers
            .iter()
            .filter(|w| w.role == role && w.is_running())
            .map(|w| w.instance_id)
            .collect()
    }

    /// Starts one more worker of `role` and waits until it is registered; returns its id.
    pub async fn add_worker(&mut self, role: WorkerRole) -> u64 {
        self.start_workers(&[role]).await;
        self.workers
            .last()
            .expect("a worker was just added")
            .instance_id
    }

    /// Stops the first running worker of `role` and waits for the process to exit (a SIGTERMed
    /// worker that outlives [`EXIT_TIMEOUT`] is killed). Returns its instance id. The worker's
    /// etcd keys are gone at once after `Term`, within [`LEASE_TTL`] after `Kill`.
    pub async fn stop_worker(&mut self, role: WorkerRole, signal: Signal) -> u64 {
        let worker = self
            .workers
            .iter_mut()
            .find(|w| w.role == role && w.is_running())
            .unwrap_or_else(|| panic!("no running {role:?} worker to stop"));
        let mut child = worker.child.take().expect("running worker has a child");
        match signal {
            Signal::Kill => {
                child.kill().await.expect("SIGKILL the worker");
            }
            Signal::Term => {
                let pid = child.id().expect("a running worker has a pid");
                let status = Command::new("kill")
                    .args(["-TERM", &pid.to_string()])
                    .status()
                    .await
                    .expect("run `kill` (procps)");
                assert!(status.success(), "kill -TERM {pid} failed");
                if tokio::time::timeout(EXIT_TIMEOUT, child.wait())
                    .await
                    .is_err()
                {
                    child
                        .kill()
                        .await
                        .expect("SIGKILL a worker that ignored SIGTERM");
                }
            }
        }
        worker.instance_id
    }

    /// Spawns one worker per role (distinct components) and waits until each is registered.
    async fn start_workers(&mut self, roles: &[WorkerRole]) {
        let known: BTreeSet<u64> = self.workers.iter().map(|w| w.instance_id).collect();
        let mut spawned = Vec::new();
        for (i, role) in roles.iter().enumerate() {
            let name = format!("{}-{}", role.as_str(), self.workers.len() + i);
            let endpoint = format!("dyn://{}.{}.generate", self.namespace, role.component());
            let mut command = self.dynamo_command("dynamo.mocker");
            command
                .arg("--model-path")
                .arg(&self.model_dir)
                .args(["--model-name", MODEL, "--endpoint", &endpoint])
                .args(["--disaggregation-mode", role.mode()])
                .args([
                    "--discovery-backend",
                    self.backend(),
                    "--event-plane",
                    "zmq",
                ])
                .args(["--request-plane", "tcp"])
                .args(&self.mocker_args);
            let (child, log) = self.spawn(&name, command);
            spawned.push((*role, child, log));
        }
        let namespace = self.namespace.clone();
        let mut ids = Vec::new();
        for (role, child, log) in &mut spawned {
            let what = format!(
                "{} worker registered (log {})",
                role.as_str(),
                log.display()
            );
            let component = role.component();
            let id = match (&mut self.etcd_client, &self.file_root) {
                (Some(client), _) => {
                    wait_etcd(client, &what, std::slice::from_mut(child), |kvs| {
                        registered_worker(kvs, &namespace, component, &known)
                    })
                    .await
                }
                (None, Some(root)) => {
                    // Every running worker of the component plus this one owns a channel.
                    let channels = 1 + self
                        .workers
                        .iter()
                        .filter(|w| w.is_running() && w.role.component() == component)
                        .count();
                    wait_files(root, &what, std::slice::from_mut(child), |kvs| {
                        registered_file_worker(kvs, &namespace, component, &known, channels)
                    })
                    .await
                }
                (None, None) => unreachable!("a stack has etcd or a file store"),
            };
            ids.push(id);
        }
        for ((role, child, log), instance_id) in spawned.into_iter().zip(ids) {
            self.workers.push(DynamoWorker {
                role,
                instance_id,
                log,
                child: Some(child),
            });
        }
    }

    async fn start_frontend(&mut self) {
        let child = self
            .spawn_frontend("frontend", self.frontend_port, &["--router-mode", "direct"])
            .await;
        self.frontend = Some(child);
    }

    /// Starts one more `dynamo.frontend` over the stack's namespace with `args` (its router mode,
    /// `--migration-limit`, ...) and waits until it lists the model; returns its URL. Its log is
    /// `{name}.log` in [`DynamoStack::log_dir`].
    pub async fn add_frontend(&mut self, name: &str, args: &[&str]) -> String {
        let port = free_port();
        let child = self.spawn_frontend(name, port, args).await;
        self.extra_frontends.push(child);
        format!("http://127.0.0.1:{port}")
    }

    /// Spawns a frontend on `port` and waits until its `/v1/models` lists [`MODEL`].
    async fn spawn_frontend(&self, name: &str, port: u16, args: &[&str]) -> Child {
        let mut command = self.dynamo_command("dynamo.frontend");
        command
            .args(args)
            .args(["--http-host", "127.0.0.1"])
            .args(["--http-port", &port.to_string()])
            .args(["--namespace", &self.namespace])
            .args([
                "--discovery-backend",
                self.backend(),
                "--event-plane",
                "zmq",
            ])
            .args(["--request-plane", "tcp"]);
        let (mut child, log) = self.spawn(name, command);
        let url = format!("http://127.0.0.1:{port}/v1/models");
        let http = reqwest::Client::new();
        let deadline = Instant::now() + START_TIMEOUT;
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        loop {
            tick.tick().await;
            if models_listed(&http, &url).await {
                return child;
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "dynamo.frontend {name} exited ({status}) before serving:\n{}",
                    log_tail(&log)
                );
            }
            assert!(
                Instant::now() < deadline,
                "dynamo.frontend {name} did not list {MODEL} in time:\n{}",
                log_tail(&log)
            );
        }
    }

    /// `python -m <module>` with the loopback-only Dynamo environment.
    fn dynamo_command(&self, module: &str) -> Command {
        let mut command = Command::new(&self.python);
        command.args(["-m", module]);
        // Inherited DYN_* settings (a developer's shell) must not leak into the stack.
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("DYN_") {
                command.env_remove(key);
            }
        }
        command.env_remove("ETCD_ENDPOINTS");
        match (&self.etcd, &self.file_root) {
            (Some(etcd), _) => {
                command.env("ETCD_ENDPOINTS", etcd.endpoint());
            }
            (None, Some(root)) => {
                command.env("DYN_FILE_KV", root);
            }
            (None, None) => unreachable!("a stack has etcd or a file store"),
        }
        command
            .env("DYN_DISCOVERY_BACKEND", self.backend())
            .env("DYN_EVENT_PLANE", "zmq")
            .env("DYN_REQUEST_PLANE", "tcp")
            // Without these, Dynamo advertises the first non-loopback interface address.
            .env("DYN_TCP_RPC_HOST", "127.0.0.1")
            .env("DYN_TCP_RESPONSE_STREAM_HOST", "127.0.0.1")
            .env("DYN_EVENT_PLANE_HOST", "127.0.0.1")
            .env("DYN_SYSTEM_HOST", "127.0.0.1")
            .env("DYN_HTTP_RPC_HOST", "127.0.0.1")
            .env("DYN_SELF_HOST_METADATA", "0")
            .env("DYN_LOG", "info")
            .env("HF_HUB_OFFLINE", "1")
            .env("TRANSFORMERS_OFFLINE", "1")
            .env("NO_COLOR", "1");
        command
    }

    fn backend(&self) -> &'static str {
        if self.etcd.is_some() {
            Discovery::Etcd.backend()
        } else {
            Discovery::File.backend()
        }
    }

    fn spawn(&self, name: &str, mut command: Command) -> (Child, PathBuf) {
        let logs = self.log_dir();
        std::fs::create_dir_all(&logs).expect("create the log directory");
        let log = logs.join(format!("{name}.log"));
        let file = std::fs::File::create(&log).expect("create a log file");
        let err = file.try_clone().expect("clone the log file handle");
        let child = command
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(err)
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|error| panic!("spawn {name} with {:?}: {error}", self.python));
        (child, log)
    }
}

impl Drop for DynamoStack {
    fn drop(&mut self) {
        if let Some(mut child) = self.frontend.take() {
            let _ = child.start_kill();
        }
        for child in &mut self.extra_frontends {
            let _ = child.start_kill();
        }
        for worker in &mut self.workers {
            if let Some(mut child) = worker.child.take() {
                let _ = child.start_kill();
            }
        }
        if std::thread::panicking()
            && let Some(dir) = self.dir.take()
        {
            let kept = dir.keep();
            eprintln!("dynamo stack logs kept in {}", kept.join("logs").display());
        }
    }
}

/// The venv python from `CONTINUUM_DYNAMO_PYTHON`.
pub fn python() -> PathBuf {
    let python = std::env::var_os(PYTHON_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            panic!(
                "{PYTHON_ENV} is not set; run `export {PYTHON_ENV}=$(scripts/setup-dynamo-venv.sh)`"
            )
        });
    assert!(
        python.exists(),
        "{PYTHON_ENV}={} does not exist; run scripts/setup-dynamo-venv.sh",
        python.display()
    );
    python
}

/// Whether `GET url` (the frontend's `/v1/models`) lists [`MODEL`].
async fn models_listed(http: &reqwest::Client, url: &str) -> bool {
    let Ok(resp) = http.get(url).send().await else {
        return false;
    };
    let Ok(body) = resp.json::<serde_json::Value>().await else {
        return false;
    };
    body["data"]
        .as_array()
        .is_some_and(|models| models.iter().any(|m| m["id"] == MODEL))
}

async fn make_tiny_model(python: &Path, out: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/make_tiny_model.py");
    let output = Command::new(python)
        .arg(&script)
        .arg(out)
        .output()
        .await
        .expect("run make_tiny_model.py");
    assert!(
        output.status.success(),
        "make_tiny_model.py failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// `e2e<pid>x<n>`: distinct per stack and per test process (letters and digits only, which
/// every Dynamo name accepts).
fn unique_namespace() -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    format!(
        "e2e{}x{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().expect("local address").port()
}

/// One etcd key with its value and lease.
struct Kv {
    key: String,
    value: Vec<u8>,
    lease: i64,
}

/// A worker of `component` not in `known` whose instance, model card and `kv_metrics` channel
/// are all in etcd.
fn registered_worker(
    kvs: &[Kv],
    namespace: &str,
    component: &str,
    known: &BTreeSet<u64>,
) -> Option<u64> {
    let instances = format!("v1/instances/{namespace}/{component}/generate/");
    let cards = format!("v1/mdc/{namespace}/{component}/generate/");
    let channels = format!(
        "v1/event_channels/namespace/{namespace}/component/{component}/endpoint/generate/topic/kv_metrics/"
    );
    kvs.iter()
        .filter(|kv| kv.key.starts_with(&instances))
        .filter_map(|kv| {
            let value: serde_json::Value = serde_json::from_slice(&kv.value).ok()?;
            value["instance_id"].as_u64()
        })
        .filter(|id| !known.contains(id))
        .find(|id| {
            let hex = format!("{id:x}");
            let card = kvs.iter().any(|kv| kv.key == format!("{cards}{hex}"));
            let channel = kvs
                .iter()
                .any(|kv| kv.key.starts_with(&channels) && u64::try_from(kv.lease) == Ok(*id));
            card && channel
        })
}

/// Like [`registered_worker`] for the file store, whose keys carry no lease: a new worker of
/// `component` with its instance and card, once the component has `channels` `kv_metrics`
/// channel files.
fn registered_file_worker(
    kvs: &[Kv],
    namespace: &str,
    component: &str,
    known: &BTreeSet<u64>,
    channels: usize,
) -> Option<u64> {
    let channel_prefix = format!(
        "v1/event_channels/namespace/{namespace}/component/{component}/endpoint/generate/topic/kv_metrics/"
    );
    let present = kvs
        .iter()
        .filter(|kv| kv.key.starts_with(&channel_prefix))
        .count();
    if present < channels {
        return None;
    }
    let instances = format!("v1/instances/{namespace}/{component}/generate/");
    let cards = format!("v1/mdc/{namespace}/{component}/generate/");
    kvs.iter()
        .filter(|kv| kv.key.starts_with(&instances))
        .filter_map(|kv| {
            let value: serde_json::Value = serde_json::from_slice(&kv.value).ok()?;
            value["instance_id"].as_u64()
        })
        .filter(|id| !known.contains(id))
        .find(|id| kvs.iter().any(|kv| kv.key == format!("{cards}{id:x}")))
}

/// The file store under `root` as keys and values (file names decoded, `.tmp_` files skipped;
/// lease 0: files have none).
fn read_file_store(root: &Path) -> Vec<Kv> {
    let mut out = Vec::new();
    for bucket in BUCKETS {
        let Ok(entries) = std::fs::read_dir(root.join(bucket)) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(TMP_PREFIX) {
                continue;
            }
            let Ok(relative) = decode_file_name(&name) else {
                continue;
            };
            let Ok(value) = std::fs::read(entry.path()) else {
                continue;
            };
            out.push(Kv {
                key: format!("{bucket}/{relative}"),
                value,
                lease: 0,
            });
        }
    }
    out
}

/// Re-reads the file store every 100 ms until `found` returns a value; fails early when one of
/// `children` exits.
async fn wait_files<T>(
    root: &Path,
    what: &str,
    children: &mut [Child],
    found: impl Fn(&[Kv]) -> Option<T>,
) -> T {
    let deadline = Instant::now() + START_TIMEOUT;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tick.tick().await;
        if let Some(value) = found(&read_file_store(root)) {
            return value;
        }
        for child in children.iter_mut() {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("a Dynamo process exited ({status}) while waiting for: {what}");
            }
        }
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
    }
}

/// Re-reads `v1/` on every etcd change until `found` returns a value; fails early when one of
/// `children` exits.
async fn wait_etcd<T>(
    client: &mut Client,
    what: &str,
    children: &mut [Child],
    found: impl Fn(&[Kv]) -> Option<T>,
) -> T {
    let deadline = Instant::now() + START_TIMEOUT;
    let prefix = || Some(GetOptions::new().with_prefix());
    let first = client.get("v1/", prefix()).await.expect("etcd get");
    let revision = first.header().map_or(0, |h| h.revision());
    let mut stream = client
        .watch(
            "v1/",
            Some(
                WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(revision + 1),
            ),
        )
        .await
        .expect("etcd watch");
    let mut response = first;
    loop {
        let kvs: Vec<Kv> = response
            .kvs()
            .iter()
            .map(|kv| Kv {
                key: String::from_utf8_lossy(kv.key()).into_owned(),
                value: kv.value().to_vec(),
                lease: kv.lease(),
            })
            .collect();
        if let Some(value) = found(&kvs) {
            return value;
        }
        // Wake on the next change, or after a second to notice a child that died quietly.
        let _ = tokio::time::timeout(Duration::from_secs(1), stream.message()).await;
        for child in children.iter_mut() {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("a Dynamo process exited ({status}) while waiting for: {what}");
            }
        }
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        response = client.get("v1/", prefix()).await.expect("etcd get");
    }
}

/// The last 40 lines of a log, for failure messages.
fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}
