//! A real etcd for tests: a child process on free loopback ports with its own data directory.
//!
//! Use it from a test module as `crate::support::etcd` (or through `#[path]` from a bench).
//! It needs the `etcd` binary (Debian `etcd-server`; `ETCD_BIN` overrides the PATH lookup) and,
//! for [`EtcdServer::start_tls`], the `openssl` CLI to mint a throwaway CA at test time.
//!
//! Readiness is event-driven: a reader thread copies etcd's log to `etcd.log` in the data
//! directory and signals the "serving client traffic" line; `client.status()` then confirms. Nothing here sleeps. Dropping the server kills the process.
#![allow(dead_code)] // Each test crate uses a different part of the harness.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};

/// How long etcd may take to report readiness.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// Certificates minted for one TLS server.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub ca_cert: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

/// One running (or stopped, between `kill` and `restart`) etcd.
pub struct EtcdServer {
    child: Option<Child>,
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
    tls: Option<TlsFiles>,
    user: Option<(String, String)>,
}

impl EtcdServer {
    /// A plaintext single-member cluster on 127.0.0.1.
    pub async fn start() -> Self {
        Self::launch(false).await
    }

    /// A single-member cluster serving https with `--client-cert-auth`: clients must present a
    /// certificate signed by the test CA ([`EtcdServer::tls_files`]).
    pub async fn start_tls() -> Self {
        Self::launch(true).await
    }

    async fn launch(tls: bool) -> Self {
        let dir = tempfile::tempdir().expect("create a temporary directory for etcd");
        let tls = tls.then(|| mint_certificates(dir.path()));
        // Both listeners are bound at once so the two ports differ; etcd rebinds them
        // (Go sets SO_REUSEADDR), a small race with other processes that tests accept.
        let client = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
        let peer = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
        let client_port = client.local_addr().expect("local address").port();
        let peer_port = peer.local_addr().expect("local address").port();
        drop((client, peer));
        let mut server = Self {
            child: None,
            dir,
            client_port,
            peer_port,
            tls,
            user: None,
        };
        server.spawn_and_wait().await;
        server
    }

    /// The client URL (`http://` or `https://127.0.0.1:<port>`).
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    pub fn tls_files(&self) -> Option<&TlsFiles> {
        self.tls.as_ref()
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// An administrative client (with the test CA and client identity under TLS, and the
    /// credentials of [`EtcdServer::enable_auth`] once auth is on).
    pub async fn client(&self) -> Client {
        let mut options = self.connect_options();
        if let Some((user, password)) = &self.user {
            options = options.with_user(user.clone(), password.clone());
        }
        Client::connect([self.endpoint()], Some(options))
            .await
            .expect("connect to the test etcd")
    }

    /// A client authenticating as `user` (auth must be enabled).
    pub async fn client_as(&self, user: &str, password: &str) -> Client {
        let options = self.connect_options().with_user(user, password);
        Client::connect([self.endpoint()], Some(options))
            .await
            .expect("connect to the test etcd as a user")
    }

    fn connect_options(&self) -> ConnectOptions {
        let mut options = ConnectOptions::new().with_connect_timeout(Duration::from_secs(10));
        if let Some(tls) = &self.tls {
            let read = |p: &Path| std::fs::read(p).expect("read a test certificate");
            options = options.with_tls(
                TlsOptions::new()
                    .ca_certificate(Certificate::from_pem(read(&tls.ca_cert)))
                    .identity(Identity::from_pem(
                        read(&tls.client_cert),
                        read(&tls.client_key),
                    )),
            );
        }
        options
    }

    /// Turns on etcd authentication with a `root` user; later [`EtcdServer::client`] calls
    /// authenticate as root.
    pub async fn enable_auth(&mut self, root_password: &str) {
        let mut client = self.client().await;
        client.role_add("root").await.expect("add the root role");
        client
            .user_add("root", root_password, None)
            .await
            .expect("add the root user");
        client
            .user_grant_role("root", "root")
            .await
            .expect("grant root the root role");
        client.auth_enable().await.expect("enable auth");
        self.user = Some(("root".to_owned(), root_password.to_owned()));
    }

    /// Kills the process (SIGKILL) and waits for it; the data directory and ports are kept.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kill, then start again on the same data directory and ports.
    pub async fn restart(&mut self) {
        self.kill();
        self.spawn_and_wait().await;
    }

    async fn spawn_and_wait(&mut self) {
        let bin = std::env::var_os("ETCD_BIN").unwrap_or_else(|| "etcd".into());
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let client_url = format!("{scheme}://127.0.0.1:{}", self.client_port);
        let peer_url = format!("http://127.0.0.1:{}", self.peer_port);
        let mut command = Command::new(&bin);
        command
            .arg("--name=test")
            .arg(format!("--data-dir={}", self.data_dir().display()))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=test={peer_url}"))
            .arg("--logger=zap")
            .arg("--log-outputs=stderr")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some(tls) = &self.tls {
            command
                .arg(format!("--cert-file={}", tls.server_cert.display()))
                .arg(format!("--key-file={}", tls.server_key.display()))
                .arg(format!("--trusted-ca-file={}", tls.ca_cert.display()))
                .arg("--client-cert-auth");
        }
        let mut child = command.spawn().unwrap_or_else(|error| {
            panic!(
                "could not start {bin:?} ({error}); install it with \
                 `apt-get install -y etcd-server` or set ETCD_BIN"
            )
        });
        let stderr = child.stderr.take().expect("piped stderr");
        let log_path = self.dir.path().join("etcd.log");
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<()>();
        std::thread::spawn(move || copy_log(stderr, &log_path, ready_tx));
        self.child = Some(child);

        let ready = tokio::time::timeout(READY_TIMEOUT, ready_rx).await;
        assert!(
            matches!(ready, Ok(Ok(()))),
            "etcd did not become ready; see {}",
            self.dir.path().join("etcd.log").display()
        );
        let mut client = self.client().await;
        client
            .status()
            .await
            .expect("etcd answers status once it reports readiness");
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Copies etcd's log line by line and fires `ready` on the readiness line.
fn copy_log(
    stderr: std::process::ChildStderr,
    log_path: &Path,
    ready: tokio::sync::oneshot::Sender<()>,
) {
    let mut ready = Some(ready);
    let mut log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_path)
        .ok();
    for line in BufReader::new(stderr).lines() {
        let Ok(line) = line else { break };
        if let Some(log) = log.as_mut() {
            let _ = writeln!(log, "{line}");
        }
        // etcd 3.4's zap logger: "serving client traffic (in)securely"; capnslog and older
        // releases: "ready to serve client requests". Both follow joining the cluster.
        let ready_line = line.contains("serving client traffic")
            || line.contains("ready to serve client requests");
        if ready_line && let Some(ready) = ready.take() {
            let _ = ready.send(());
        }
    }
}

/// A throwaway CA, a server certificate for 127.0.0.1/localhost and a client certificate,
/// minted with the `openssl` CLI.
fn mint_certificates(dir: &Path) -> TlsFiles {
    let path = |name: &str| dir.join(name);
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("run openssl (apt-get install -y openssl)");
        assert!(
            out.status.success(),
            "openssl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let mut ca = vec!["req", "-x509"];
    ca.extend(ec);
    ca.extend([
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=continuum-test-ca",
    ]);
    openssl(&ca);
    std::fs::write(
        path("server.ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n\
         keyUsage=critical,digitalSignature,keyEncipherment\n\
         extendedKeyUsage=serverAuth,clientAuth\n",
    )
    .expect("write server.ext");
    std::fs::write(
        path("client.ext"),
        "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n",
    )
    .expect("write client.ext");
    for (name, cn) in [("server", "localhost"), ("client", "router")] {
        let key = format!("{name}.key");
        let csr = format!("{name}.csr");
        let pem = format!("{name}.pem");
        let ext = format!("{name}.ext");
        let subj = format!("/CN={cn}");
        let mut req = vec!["req"];
        req.extend(ec);
        req.extend(["-keyout", &key, "-out", &csr, "-subj", &subj]);
        openssl(&req);
        openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &pem,
            "-days",
            "2",
            "-extfile",
            &ext,
        ]);
    }
    TlsFiles {
        ca_cert: path("ca.pem"),
        server_cert: path("server.pem"),
        server_key: path("server.key"),
        client_cert: path("client.pem"),
        client_key: path("client.key"),
    }
}

/// One key as a real Dynamo 1.6.1 worker wrote it: raw key and value bytes and its lease.
#[derive(Clone, Debug)]
pub struct CapturedKv {
    pub key: String,
    pub value: Vec<u8>,
    /// The worker's lease id (== its instance id).
    pub lease: i64,
}

/// The keys of a captured etcd dump (`etcdctl get --prefix -w json` style, base64 fields).
pub fn captured_kvs(fixture: &str) -> Vec<CapturedKv> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/dynamo-1.6.1/etcd")
        .join(fixture);
    let text = std::fs::read_to_string(&path).expect("read the etcd fixture");
    let dump: serde_json::Value = serde_json::from_str(&text).expect("fixture is JSON");
    dump["kvs"]
        .as_array()
        .expect("fixture has kvs")
        .iter()
        .map(|kv| CapturedKv {
            key: String::from_utf8(base64(kv["key"].as_str().expect("key")))
                .expect("keys are UTF-8"),
            value: base64(kv["value"].as_str().expect("value")),
            lease: kv["lease"].as_i64().expect("lease fits i64"),
        })
        .collect()
}

/// Standard base64 with padding (the fixture's encoding); test input only.
fn base64(text: &str) -> Vec<u8> {
    let sextet = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        }
    };
    let bytes: Vec<u8> = text.bytes().filter(|&c| c != b'=').collect();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let mut acc = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            acc |= sextet(c) << (18 - 6 * i);
        }
        let n = chunk.len() - 1;
        out.extend_from_slice(&acc.to_be_bytes()[1..=n]);
    }
    out
}

/// The etcd records Dynamo 1.6.1 writes for one aggregated decode worker of `namespace`
/// (`backend/generate`): its instance, its model card (`total_kv_blocks` of KV capacity, one
/// data-parallel rank) and its `kv_metrics` event channel on the ZMQ publisher `publisher` at
/// `zmq_port`, as `(key, value)` pairs to put.
pub fn decode_worker_records(
    namespace: &str,
    instance: u64,
    publisher: u64,
    zmq_port: u16,
    total_kv_blocks: u64,
) -> Vec<(String, serde_json::Value)> {
    use serde_json::json;
    let (ns, id) = (namespace, instance);
    vec![
        (
            format!("v1/instances/{ns}/backend/generate/{id:x}"),
            json!({"type": "Endpoint", "namespace": ns, "component": "backend", "endpoint": "generate",
                   "instance_id": id, "transport": {"tcp": "127.0.0.1:1/x/generate"}}),
        ),
        (
            format!("v1/mdc/{ns}/backend/generate/{id:x}"),
            json!({"type": "Model", "namespace": ns, "component": "backend", "endpoint": "generate",
                   "instance_id": id, "card_json": {"display_name": "tiny", "worker_type": "decode",
                   "kv_cache_block_size": 16, "runtime_config": {"total_kv_blocks": total_kv_blocks,
                   "max_num_batched_tokens": 8192, "data_parallel_size": 1}}}),
        ),
        (
            format!(
                "v1/event_channels/namespace/{ns}/component/backend/endpoint/generate/topic/kv_metrics/{publisher:x}"
            ),
            json!({"type": "EventChannel", "scope": {"kind": "endpoint", "endpoint":
                   {"namespace": ns, "component": "backend", "name": "generate"}},
                   "topic": "kv_metrics", "instance_id": publisher,
                   "transport": {"kind": "Zmq", "config": {"endpoint": format!("tcp://127.0.0.1:{zmq_port}")}}}),
        ),
    ]
}
