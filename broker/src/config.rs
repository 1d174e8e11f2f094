//! The command line and the optional YAML file: both name the same settings; a flag (or its
//! environment variable) wins over the file. [`BrokerConfig::resolve`] checks everything before
//! the agent starts, so a bad setting is one clear error at startup, never a reconnect loop.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use clap::Parser;
use continuum_protocol::event_bus::message::{AnnouncedSource, ClientId, Hello, Role};
use continuum_protocol::ids::Namespace;
use continuum_protocol::ids::PublisherId;
use ipnet::IpNet;
use serde::Deserialize;

/// Longest accepted token file (a bearer token is far shorter; this only bounds the read).
pub const MAX_TOKEN_BYTES: u64 = 4096;
/// Longest accepted YAML file.
pub const MAX_CONFIG_BYTES: u64 = 1024 * 1024;
/// Default of `--max-streams`: streams relayed at once, whatever the router's welcome allows.
pub const DEFAULT_MAX_STREAMS: usize = 4096;
/// Default of `--listen` (`/health`, `/ready`, `/metrics`).
pub const DEFAULT_LISTEN: &str = "0.0.0.0:9464";
/// Where Kubernetes mounts the Pod's own namespace.
const SERVICE_ACCOUNT_NAMESPACE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

#[derive(Parser, Debug, Clone, Default)]
#[command(
    name = "continuum-event-broker",
    version = crate::VERSION,
    about = "In-cluster agent of the continuum-router event bus: dials out to the router's \
             listener over TLS 1.3 + HTTP/2 and relays the ZMQ publishers (kv_metrics, \
             kv-events) that DynamoWorkerMetadata in its Kubernetes namespace advertises.",
    after_help = "Every setting can also come from --config FILE (YAML, the same names with \
                  underscores: bus_url, client_id, token_file, client_cert, client_key, ca_file, \
                  server_name, dynamo_namespaces, kubernetes_namespace, kubernetes_api_url, \
                  listen, max_streams). See docs/event-bus.md, \"continuum-event-broker\"."
)]
pub struct Cli {
    /// YAML file with the settings below; flags and environment variables win over it.
    #[arg(long, value_name = "FILE", env = "CONTINUUM_BROKER_CONFIG")]
    pub config: Option<PathBuf>,
    /// The router's event-bus listener: https://HOST:PORT (dynamo.event_bus.listen).
    #[arg(long, value_name = "URL", env = "CONTINUUM_BROKER_BUS_URL")]
    pub bus_url: Option<String>,
    /// This broker's id: the router's dynamo.event_bus.brokers[].id.
    #[arg(long, value_name = "ID", env = "CONTINUUM_BROKER_CLIENT_ID")]
    pub client_id: Option<String>,
    /// File holding the bearer token (its sha256 is the entry's token_hash).
    #[arg(long, value_name = "FILE", env = "CONTINUUM_BROKER_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Client certificate (PEM) whose DNS SAN is the client id; needs --client-key.
    #[arg(long, value_name = "FILE", env = "CONTINUUM_BROKER_CLIENT_CERT")]
    pub client_cert: Option<PathBuf>,
    /// Private key (PEM) of --client-cert.
    #[arg(long, value_name = "FILE", env = "CONTINUUM_BROKER_CLIENT_KEY")]
    pub client_key: Option<PathBuf>,
    /// CA certificate(s) (PEM) that verify the listener's certificate.
    #[arg(long, value_name = "FILE", env = "CONTINUUM_BROKER_CA_FILE")]
    pub ca_file: Option<PathBuf>,
    /// TLS server name to verify [default: the host of --bus-url].
    #[arg(long, value_name = "NAME", env = "CONTINUUM_BROKER_SERVER_NAME")]
    pub server_name: Option<String>,
    /// Dynamo namespace(s) this broker reaches (repeat or comma-separate); the hello declares them.
    #[arg(
        long = "dynamo-namespace",
        value_name = "NS",
        value_delimiter = ',',
        env = "CONTINUUM_BROKER_DYNAMO_NAMESPACES"
    )]
    pub dynamo_namespaces: Vec<String>,
    /// Kubernetes namespace whose DynamoWorkerMetadata advertises the publishers [default: the
    /// Pod's own namespace].
    #[arg(long, value_name = "NS", env = "CONTINUUM_BROKER_KUBERNETES_NAMESPACE")]
    pub kubernetes_namespace: Option<String>,
    /// Plain API server URL without credentials (`kubectl proxy`) [default: the in-cluster
    /// service account, then KUBECONFIG].
    #[arg(long, value_name = "URL", env = "CONTINUUM_BROKER_KUBERNETES_API_URL")]
    pub kubernetes_api_url: Option<String>,
    /// Address of /health, /ready and /metrics [default: 0.0.0.0:9464].
    #[arg(long, value_name = "ADDR", env = "CONTINUUM_BROKER_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Streams relayed at once [default: 4096]; more subscribes are refused with stream_limit.
    #[arg(long, value_name = "N", env = "CONTINUUM_BROKER_MAX_STREAMS")]
    pub max_streams: Option<usize>,
}

/// The YAML file: the flags' settings, all optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    bus_url: Option<String>,
    client_id: Option<String>,
    token_file: Option<PathBuf>,
    client_cert: Option<PathBuf>,
    client_key: Option<PathBuf>,
    ca_file: Option<PathBuf>,
    server_name: Option<String>,
    dynamo_namespaces: Option<Vec<String>>,
    kubernetes_namespace: Option<String>,
    kubernetes_api_url: Option<String>,
    listen: Option<SocketAddr>,
    max_streams: Option<usize>,
}

/// The router's listener.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BusAddress {
    /// Host without IPv6 brackets.
    pub host: String,
    pub port: u16,
}

impl BusAddress {
    /// Parses `https://HOST:PORT` (a trailing `/` allowed; no path, user info or query).
    pub fn parse(url: &str) -> anyhow::Result<Self> {
        let rest = url
            .strip_prefix("https://")
            .with_context(|| format!("bus URL {url:?} must start with https://"))?;
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        if rest.contains(['/', '@', '?', '#']) {
            bail!("bus URL {url:?} must be https://HOST:PORT without a path");
        }
        let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
            let (host, tail) = v6
                .split_once(']')
                .with_context(|| format!("bus URL {url:?}: unclosed IPv6 literal"))?;
            (host, tail.strip_prefix(':'))
        } else {
            match rest.rsplit_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (rest, None),
            }
        };
        if host.is_empty() {
            bail!("bus URL {url:?} has no host");
        }
        let port = match port {
            Some(port) => port
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .with_context(|| format!("bus URL {url:?}: bad port"))?,
            None => 443,
        };
        Ok(Self {
            host: host.to_owned(),
            port,
        })
    }

    /// `host:port` for the URI authority and the resolver.
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// How the broker authenticates.
#[derive(Clone, Debug, Default)]
pub struct Credential {
    /// The bearer token (never logged).
    pub token: Option<String>,
    /// Client certificate and key files.
    pub client_cert: Option<(PathBuf, PathBuf)>,
}

/// Where the Kubernetes client connects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KubeApi {
    /// In-cluster service account, then KUBECONFIG.
    Infer,
    Url(String),
}

/// Everything the agent runs with, checked.
#[derive(Clone, Debug)]
pub struct BrokerConfig {
    pub bus: BusAddress,
    pub server_name: String,
    pub client_id: ClientId,
    pub credential: Credential,
    pub ca_file: PathBuf,
    pub namespaces: Vec<Namespace>,
    pub kubernetes_namespace: String,
    pub kubernetes_api: KubeApi,
    pub listen: SocketAddr,
    pub max_streams: usize,
    /// `broker`, or `kv_listener` (`continuum-kv-listener`).
    pub role: Role,
    /// kv_listener only: the sources it announces and where it reads their kv-events.
    pub sources: Vec<KvSource>,
    /// kv_listener only: batches each source's replay ring holds.
    pub replay_events: usize,
    /// kv_listener only: the addresses its sources may be dialled at (`--allow-cidr`, the rule
    /// of the router's `dynamo.load.direct_allow_cidrs`); `None` allows any address.
    pub allow_cidrs: Option<Vec<IpNet>>,
}

/// One source of a kv-listener: the backend name it announces, the kv-events publisher it reads
/// (Dynamo's event-plane ZMQ publisher, `tcp://host:port`) and that publisher's id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvSource {
    pub backend: String,
    pub publisher_id: PublisherId,
    pub endpoint: String,
}

impl KvSource {
    /// Parses `BACKEND=PUBLISHER_ID@tcp://HOST:PORT` (the publisher id in decimal or `0x` hex).
    pub fn parse(spec: &str) -> anyhow::Result<Self> {
        let (backend, rest) = spec.split_once('=').with_context(|| {
            format!("source {spec:?} must be BACKEND=PUBLISHER_ID@tcp://HOST:PORT")
        })?;
        let (id, endpoint) = rest.split_once('@').with_context(|| {
            format!("source {spec:?} must be BACKEND=PUBLISHER_ID@tcp://HOST:PORT")
        })?;
        let publisher_id = match id.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16).ok(),
            None => id.parse::<u64>().ok(),
        }
        .with_context(|| format!("source {spec:?}: bad publisher id {id:?}"))?;
        if !endpoint.starts_with("tcp://")
            || continuum_actors::zmtp_conn::parse_endpoint(endpoint).is_none()
        {
            bail!("source {spec:?}: the endpoint must be tcp://HOST:PORT");
        }
        Ok(Self {
            backend: backend.to_owned(),
            publisher_id: PublisherId(publisher_id),
            endpoint: endpoint.to_owned(),
        })
    }
}

/// Default of `--replay-events`: batches each source's replay ring holds.
pub const DEFAULT_REPLAY_EVENTS: usize = 4096;
/// Default `--listen` of the kv-listener.
pub const DEFAULT_KV_LISTENER_LISTEN: &str = "0.0.0.0:9465";

#[derive(Parser, Debug, Clone, Default)]
#[command(
    name = "continuum-kv-listener",
    version = crate::VERSION,
    about = "In-cluster push agent of the continuum-router event bus (role kv_listener): reads \
             its backends' kv-events publishers, numbers the batches, and serves them as SSE on \
             the streams the router commands, resuming after last_event_id.",
    after_help = "Every setting can also come from --config FILE (YAML, the same names with \
                  underscores: bus_url, client_id, token_file, client_cert, client_key, ca_file, \
                  server_name, sources, allow_cidrs, listen, max_streams, replay_events). See \
                  docs/event-bus.md, \"continuum-kv-listener\"."
)]
pub struct KvListenerCli {
    /// YAML file with the settings below; flags and environment variables win over it.
    #[arg(long, value_name = "FILE", env = "CONTINUUM_KV_LISTENER_CONFIG")]
    pub config: Option<PathBuf>,
    /// The router's event-bus listener: https://HOST:PORT (dynamo.event_bus.listen).
    #[arg(long, value_name = "URL", env = "CONTINUUM_KV_LISTENER_BUS_URL")]
    pub bus_url: Option<String>,
    /// This listener's id: the router's dynamo.event_bus.brokers[].id (role kv_listener).
    #[arg(long, value_name = "ID", env = "CONTINUUM_KV_LISTENER_CLIENT_ID")]
    pub client_id: Option<String>,
    /// File holding the bearer token (its sha256 is the entry's token_hash).
    #[arg(long, value_name = "FILE", env = "CONTINUUM_KV_LISTENER_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Client certificate (PEM) whose DNS SAN is the client id; needs --client-key.
    #[arg(long, value_name = "FILE", env = "CONTINUUM_KV_LISTENER_CLIENT_CERT")]
    pub client_cert: Option<PathBuf>,
    /// Private key (PEM) of --client-cert.
    #[arg(long, value_name = "FILE", env = "CONTINUUM_KV_LISTENER_CLIENT_KEY")]
    pub client_key: Option<PathBuf>,
    /// CA certificate(s) (PEM) that verify the listener's certificate.
    #[arg(long, value_name = "FILE", env = "CONTINUUM_KV_LISTENER_CA_FILE")]
    pub ca_file: Option<PathBuf>,
    /// TLS server name to verify [default: the host of --bus-url].
    #[arg(long, value_name = "NAME", env = "CONTINUUM_KV_LISTENER_SERVER_NAME")]
    pub server_name: Option<String>,
    /// A source: BACKEND=PUBLISHER_ID@tcp://HOST:PORT (repeat; 1–256). The hello announces the
    /// backends; the agent reads that kv-events publisher.
    #[arg(
        long = "source",
        value_name = "SPEC",
        env = "CONTINUUM_KV_LISTENER_SOURCES",
        value_delimiter = ','
    )]
    pub sources: Vec<String>,
    /// The networks the sources' publishers may be dialled in (repeat or comma-separate; 1–64
    /// IPv4/IPv6 CIDRs, like the router's dynamo.load.direct_allow_cidrs): a host name is
    /// resolved once and only an allowed address is dialled [default: any address].
    #[arg(
        long = "allow-cidr",
        value_name = "CIDR",
        env = "CONTINUUM_KV_LISTENER_ALLOW_CIDRS",
        value_delimiter = ','
    )]
    pub allow_cidrs: Vec<String>,
    /// Address of /health, /ready and /metrics [default: 0.0.0.0:9465].
    #[arg(long, value_name = "ADDR", env = "CONTINUUM_KV_LISTENER_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Streams served at once [default: 4096]; more subscribes are refused with stream_limit.
    #[arg(long, value_name = "N", env = "CONTINUUM_KV_LISTENER_MAX_STREAMS")]
    pub max_streams: Option<usize>,
    /// Batches each source's replay ring holds [default: 4096; 16..=1048576].
    #[arg(long, value_name = "N", env = "CONTINUUM_KV_LISTENER_REPLAY_EVENTS")]
    pub replay_events: Option<usize>,
}

/// The kv-listener's YAML file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct KvListenerFile {
    bus_url: Option<String>,
    client_id: Option<String>,
    token_file: Option<PathBuf>,
    client_cert: Option<PathBuf>,
    client_key: Option<PathBuf>,
    ca_file: Option<PathBuf>,
    server_name: Option<String>,
    sources: Option<Vec<String>>,
    allow_cidrs: Option<Vec<String>>,
    listen: Option<SocketAddr>,
    max_streams: Option<usize>,
    replay_events: Option<usize>,
}

/// The settings both agents share, merged (flag over file).
struct Common {
    bus: BusAddress,
    server_name: String,
    client_id: String,
    credential: Credential,
    ca_file: PathBuf,
}

/// [`common`] over a flags struct and its file struct (both agents name the fields alike; the
/// flag wins).
macro_rules! common {
    ($cli:ident, $file:ident) => {
        common(
            $cli.bus_url.or($file.bus_url),
            $cli.client_id.or($file.client_id),
            $cli.token_file.or($file.token_file),
            $cli.client_cert.or($file.client_cert),
            $cli.client_key.or($file.client_key),
            $cli.ca_file.or($file.ca_file),
            $cli.server_name.or($file.server_name),
        )
    };
}

/// The health listener (or `default`) and the stream limit (or [`DEFAULT_MAX_STREAMS`]), checked.
fn listen_and_limit(
    listen: Option<SocketAddr>,
    default: &str,
    max_streams: Option<usize>,
) -> anyhow::Result<(SocketAddr, usize)> {
    let listen = match listen {
        Some(addr) => addr,
        None => default.parse().context("the default listen address")?,
    };
    let max_streams = max_streams.unwrap_or(DEFAULT_MAX_STREAMS);
    if !(1..=65_536).contains(&max_streams) {
        bail!("max_streams must be 1..=65536");
    }
    Ok((listen, max_streams))
}

#[allow(clippy::too_many_arguments)]
fn common(
    bus_url: Option<String>,
    client_id: Option<String>,
    token_file: Option<PathBuf>,
    client_cert: Option<PathBuf>,
    client_key: Option<PathBuf>,
    ca_file: Option<PathBuf>,
    server_name: Option<String>,
) -> anyhow::Result<Common> {
    let bus_url = bus_url.context("no bus URL: --bus-url or bus_url")?;
    let bus = BusAddress::parse(&bus_url)?;
    let client_id = client_id.context("no client id: --client-id or client_id")?;
    let token = match token_file {
        Some(path) => Some(read_token(&path)?),
        None => None,
    };
    let client_cert = match (client_cert, client_key) {
        (Some(cert), Some(key)) => Some((cert, key)),
        (None, None) => None,
        _ => bail!("a client certificate needs both --client-cert and --client-key"),
    };
    if token.is_none() && client_cert.is_none() {
        bail!("no credential: --token-file, or --client-cert with --client-key");
    }
    let ca_file =
        ca_file.context("no CA: --ca-file or ca_file (verifies the listener's certificate)")?;
    let server_name = server_name.unwrap_or_else(|| bus.host.clone());
    Ok(Common {
        bus,
        server_name,
        client_id,
        credential: Credential { token, client_cert },
        ca_file,
    })
}

impl BrokerConfig {
    /// The kv-listener's settings: the file (if any) under the flags, checked.
    pub fn resolve_kv_listener(cli: KvListenerCli) -> anyhow::Result<Self> {
        let file = match &cli.config {
            Some(path) => {
                let text = read_bounded(path, MAX_CONFIG_BYTES, "config file")?;
                serde_saphyr::from_str::<KvListenerFile>(&text)
                    .with_context(|| format!("config file {}", path.display()))?
            }
            None => KvListenerFile::default(),
        };
        let Common {
            bus,
            server_name,
            client_id,
            credential,
            ca_file,
        } = common!(cli, file)?;
        let mut specs = cli.sources;
        if specs.is_empty() {
            specs = file.sources.unwrap_or_default();
        }
        if specs.is_empty() {
            bail!("no source: --source BACKEND=PUBLISHER_ID@tcp://HOST:PORT or sources");
        }
        let sources = specs
            .iter()
            .map(|spec| KvSource::parse(spec))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let mut backends = std::collections::BTreeSet::new();
        if let Some(twice) = sources
            .iter()
            .find(|s| !backends.insert(s.backend.as_str()))
        {
            bail!("source backend {:?} is given twice", twice.backend);
        }
        let (listen, max_streams) = listen_and_limit(
            cli.listen.or(file.listen),
            DEFAULT_KV_LISTENER_LISTEN,
            cli.max_streams.or(file.max_streams),
        )?;
        let replay_events = cli
            .replay_events
            .or(file.replay_events)
            .unwrap_or(DEFAULT_REPLAY_EVENTS);
        if !(16..=1_048_576).contains(&replay_events) {
            bail!("replay_events must be 16..=1048576");
        }
        let allow_cidrs = allow_cidrs(cli.allow_cidrs, file.allow_cidrs, &sources)?;
        let config = Self {
            bus,
            server_name,
            client_id: ClientId::new(client_id),
            credential,
            ca_file,
            namespaces: vec![],
            kubernetes_namespace: String::new(),
            kubernetes_api: KubeApi::Infer,
            listen,
            max_streams,
            role: Role::KvListener,
            sources,
            replay_events,
            allow_cidrs,
        };
        // The hello's own bounds (name syntax, 1..=256 distinct backends), checked now.
        config
            .hello()
            .check()
            .map_err(|e| anyhow::anyhow!("client id or sources: {e}"))?;
        Ok(config)
    }

    /// Merges the file (if any) under the flags and checks the result.
    pub fn resolve(cli: Cli) -> anyhow::Result<Self> {
        let file = match &cli.config {
            Some(path) => read_file_config(path)?,
            None => FileConfig::default(),
        };
        let Common {
            bus,
            server_name,
            client_id,
            credential,
            ca_file,
        } = common!(cli, file)?;
        let mut namespaces = cli.dynamo_namespaces;
        if namespaces.is_empty() {
            namespaces = file.dynamo_namespaces.unwrap_or_default();
        }
        if namespaces.is_empty() {
            bail!("no Dynamo namespace: --dynamo-namespace or dynamo_namespaces");
        }
        let namespaces: Vec<Namespace> = namespaces.iter().map(Namespace::new).collect();
        // The hello's own bounds (name syntax, 1..=256 distinct namespaces), checked now.
        Hello {
            role: Role::Broker,
            client_id: ClientId::new(client_id.clone()),
            versions: vec![1],
            dynamo_namespaces: namespaces.clone(),
            sources: vec![],
        }
        .check()
        .map_err(|e| anyhow::anyhow!("client id or Dynamo namespaces: {e}"))?;

        let kubernetes_namespace = match cli.kubernetes_namespace.or(file.kubernetes_namespace) {
            Some(ns) => ns,
            None => std::fs::read_to_string(SERVICE_ACCOUNT_NAMESPACE)
                .map(|s| s.trim().to_owned())
                .ok()
                .filter(|s| !s.is_empty())
                .context(
                    "no Kubernetes namespace: --kubernetes-namespace (outside a Pod there is no \
                     service-account namespace to default to)",
                )?,
        };
        let kubernetes_api = match cli.kubernetes_api_url.or(file.kubernetes_api_url) {
            Some(url) => KubeApi::Url(url),
            None => KubeApi::Infer,
        };
        let (listen, max_streams) = listen_and_limit(
            cli.listen.or(file.listen),
            DEFAULT_LISTEN,
            cli.max_streams.or(file.max_streams),
        )?;
        Ok(Self {
            bus,
            server_name,
            client_id: ClientId::new(client_id),
            credential,
            ca_file,
            namespaces,
            kubernetes_namespace,
            kubernetes_api,
            listen,
            max_streams,
            role: Role::Broker,
            sources: vec![],
            replay_events: 0,
            allow_cidrs: None,
        })
    }

    /// The hello this agent sends.
    pub fn hello(&self) -> Hello {
        Hello {
            role: self.role,
            client_id: self.client_id.clone(),
            versions: vec![1],
            dynamo_namespaces: self.namespaces.clone(),
            sources: self
                .sources
                .iter()
                .map(|s| AnnouncedSource {
                    backend: s.backend.clone(),
                })
                .collect(),
        }
    }
}

/// The kv-listener's dial allowlist: the flag's list, else the file's, checked as the router
/// checks `dynamo.load.direct_allow_cidrs`. A source given as an IP address outside the list is
/// refused now (it could never be dialled); a host name is checked after it resolves.
fn allow_cidrs(
    flag: Vec<String>,
    file: Option<Vec<String>>,
    sources: &[KvSource],
) -> anyhow::Result<Option<Vec<IpNet>>> {
    let given = if flag.is_empty() { file } else { Some(flag) };
    let Some(given) = given else {
        return Ok(None);
    };
    let nets = continuum_actors::zmtp_conn::parse_allow_cidrs(&given)
        .map_err(|e| anyhow::anyhow!("allow_cidrs: {e}"))?;
    for source in sources {
        let Some((host, _)) = continuum_actors::zmtp_conn::parse_endpoint(&source.endpoint) else {
            continue;
        };
        if let Ok(ip) = host.parse::<std::net::IpAddr>()
            && !nets.iter().any(|net| net.contains(&ip))
        {
            bail!(
                "source {:?}: {ip} is outside allow_cidrs, so it could never be dialled",
                source.backend
            );
        }
    }
    Ok(Some(nets))
}

fn read_bounded(path: &Path, limit: u64, what: &str) -> anyhow::Result<String> {
    use std::io::Read as _;
    let file = std::fs::File::open(path)
        .with_context(|| format!("cannot open the {what} {}", path.display()))?;
    let mut text = String::new();
    file.take(limit + 1)
        .read_to_string(&mut text)
        .with_context(|| format!("cannot read the {what} {}", path.display()))?;
    if text.len() as u64 > limit {
        bail!("the {what} {} is over {limit} bytes", path.display());
    }
    Ok(text)
}

fn read_file_config(path: &Path) -> anyhow::Result<FileConfig> {
    let text = read_bounded(path, MAX_CONFIG_BYTES, "config file")?;
    serde_saphyr::from_str(&text).with_context(|| format!("config file {}", path.display()))
}

fn read_token(path: &Path) -> anyhow::Result<String> {
    let token = read_bounded(path, MAX_TOKEN_BYTES, "token file")?;
    let token = token.trim();
    if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
        bail!(
            "the token file {} must hold one printable token",
            path.display()
        );
    }
    Ok(token.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_urls_parse_strictly() {
        let ok = |url: &str| BusAddress::parse(url).expect(url);
        assert_eq!(
            ok("https://router.example:7443"),
            BusAddress {
                host: "router.example".into(),
                port: 7443
            }
        );
        assert_eq!(ok("https://10.0.0.1:7443/").port, 7443);
        assert_eq!(ok("https://[::1]:7443").host, "::1");
        assert_eq!(ok("https://[::1]:7443").authority(), "[::1]:7443");
        assert_eq!(ok("https://router").port, 443);
        for bad in [
            "http://router:7443",
            "https://router:7443/bus",
            "https://user@router:7443",
            "https://:7443",
            "https://router:0",
            "https://router:99999",
            "https://[::1:7443",
        ] {
            assert!(BusAddress::parse(bad).is_err(), "{bad}");
        }
    }

    fn base(dir: &Path) -> Cli {
        let token = dir.join("token");
        std::fs::write(&token, "secret-token\n").expect("token");
        Cli {
            bus_url: Some("https://127.0.0.1:7443".into()),
            client_id: Some("broker-a.dynamo".into()),
            token_file: Some(token),
            ca_file: Some(dir.join("ca.pem")),
            dynamo_namespaces: vec!["dynamo".into()],
            kubernetes_namespace: Some("llm".into()),
            ..Cli::default()
        }
    }

    #[test]
    fn flags_win_over_the_file_and_every_gap_is_a_clear_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = BrokerConfig::resolve(base(dir.path())).expect("resolves");
        assert_eq!(cfg.credential.token.as_deref(), Some("secret-token"));
        assert_eq!(cfg.server_name, "127.0.0.1");
        assert_eq!(cfg.listen, DEFAULT_LISTEN.parse().unwrap());
        assert_eq!(cfg.max_streams, DEFAULT_MAX_STREAMS);

        let file = dir.path().join("broker.yaml");
        std::fs::write(
            &file,
            "bus_url: https://from-file:1\nclient_id: broker-b.dynamo\n\
             dynamo_namespaces: [a, b]\nlisten: 127.0.0.1:9000\nmax_streams: 8\n",
        )
        .expect("file");
        let mut cli = base(dir.path());
        cli.config = Some(file.clone());
        cli.dynamo_namespaces.clear();
        let cfg = BrokerConfig::resolve(cli).expect("resolves");
        assert_eq!(cfg.bus.port, 7443, "the flag wins");
        assert_eq!(cfg.client_id.as_str(), "broker-a.dynamo");
        assert_eq!(cfg.namespaces.len(), 2, "the file fills the gap");
        assert_eq!(cfg.max_streams, 8);

        std::fs::write(&file, "bus_urll: x\n").expect("file");
        let mut cli = base(dir.path());
        cli.config = Some(file);
        assert!(
            BrokerConfig::resolve(cli).is_err(),
            "unknown keys are refused"
        );

        let mut cli = base(dir.path());
        cli.token_file = None;
        let err = BrokerConfig::resolve(cli).unwrap_err().to_string();
        assert!(err.contains("no credential"), "{err}");
        let mut cli = base(dir.path());
        cli.client_cert = Some("c.pem".into());
        assert!(BrokerConfig::resolve(cli).is_err(), "a cert needs its key");
        let mut cli = base(dir.path());
        cli.dynamo_namespaces = vec!["has space".into()];
        assert!(BrokerConfig::resolve(cli).is_err());
        let mut cli = base(dir.path());
        cli.max_streams = Some(0);
        assert!(BrokerConfig::resolve(cli).is_err());
        let huge = dir.path().join("huge");
        std::fs::write(&huge, vec![b'a'; 5000]).expect("huge");
        let mut cli = base(dir.path());
        cli.token_file = Some(huge);
        assert!(
            BrokerConfig::resolve(cli).is_err(),
            "the token read is bounded"
        );
    }

    #[test]
    fn kv_listener_sources_parse_strictly_and_the_hello_announces_them() {
        let ok = KvSource::parse("vllm-1=0x1f@tcp://10.0.0.5:5557").expect("parses");
        assert_eq!(ok.backend, "vllm-1");
        assert_eq!(ok.publisher_id, PublisherId(31));
        assert_eq!(ok.endpoint, "tcp://10.0.0.5:5557");
        assert_eq!(
            KvSource::parse("b=42@tcp://[::1]:1")
                .expect("v6")
                .publisher_id,
            PublisherId(42)
        );
        for bad in [
            "vllm-1",
            "vllm-1=tcp://h:1",
            "vllm-1=x@tcp://h:1",
            "vllm-1=1@http://h:1",
            "vllm-1=1@tcp://h",
        ] {
            assert!(KvSource::parse(bad).is_err(), "{bad}");
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let cli = kv_cli(dir.path(), &["vllm-1=7@tcp://127.0.0.1:5557"]);
        let cfg = BrokerConfig::resolve_kv_listener(cli.clone()).expect("resolves");
        assert_eq!(cfg.role, Role::KvListener);
        assert_eq!(cfg.replay_events, DEFAULT_REPLAY_EVENTS);
        let hello = cfg.hello();
        assert_eq!(hello.sources.len(), 1);
        assert!(hello.dynamo_namespaces.is_empty());
        let mut no_source = cli.clone();
        no_source.sources.clear();
        assert!(BrokerConfig::resolve_kv_listener(no_source).is_err());
        let mut twice = cli.clone();
        twice.sources.push("vllm-1=8@tcp://127.0.0.1:5558".into());
        assert!(
            BrokerConfig::resolve_kv_listener(twice).is_err(),
            "a backend is announced once"
        );
        let mut tiny = cli;
        tiny.replay_events = Some(1);
        assert!(BrokerConfig::resolve_kv_listener(tiny).is_err());
    }

    /// A kv-listener command line with a token file in `dir` and `sources`.
    fn kv_cli(dir: &Path, sources: &[&str]) -> KvListenerCli {
        let token = dir.join("token");
        std::fs::write(&token, "secret-token\n").expect("token");
        KvListenerCli {
            bus_url: Some("https://127.0.0.1:7443".into()),
            client_id: Some("kv-listener-a".into()),
            token_file: Some(token),
            ca_file: Some(dir.join("ca.pem")),
            sources: sources.iter().map(|s| s.to_string()).collect(),
            ..KvListenerCli::default()
        }
    }

    /// `--allow-cidr`: the router's `direct_allow_cidrs` rule (1–64 CIDRs; unset allows any
    /// address), from the flag or the file; an IP source outside it is refused at startup.
    #[test]
    fn kv_listener_allow_cidrs_follow_the_routers_direct_allow_rule() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cli = kv_cli(
            dir.path(),
            &[
                "vllm-1=7@tcp://10.1.2.3:5557",
                "vllm-2=8@tcp://worker-0.dynamo.svc:5557",
            ],
        );
        let unset = BrokerConfig::resolve_kv_listener(cli.clone()).expect("resolves");
        assert_eq!(unset.allow_cidrs, None, "unset allows any address");
        let with = |cidrs: &[&str]| KvListenerCli {
            allow_cidrs: cidrs.iter().map(|c| c.to_string()).collect(),
            ..cli.clone()
        };
        let cfg =
            BrokerConfig::resolve_kv_listener(with(&["10.0.0.0/8", "fd00::/8"])).expect("resolves");
        assert_eq!(
            cfg.allow_cidrs,
            Some(vec![
                "10.0.0.0/8".parse().unwrap(),
                "fd00::/8".parse().unwrap()
            ])
        );
        let error = BrokerConfig::resolve_kv_listener(with(&["192.168.0.0/16"]))
            .expect_err("10.1.2.3 is outside")
            .to_string();
        assert!(
            error.contains("vllm-1") && error.contains("outside"),
            "{error}"
        );
        assert!(BrokerConfig::resolve_kv_listener(with(&["ten/8"])).is_err());
        let many: Vec<String> = (0..65).map(|i| format!("10.{i}.0.0/16")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        assert!(BrokerConfig::resolve_kv_listener(with(&many)).is_err());
        // The file's list, when no flag is given.
        let file = dir.path().join("kv.yaml");
        std::fs::write(&file, "allow_cidrs: [\"10.0.0.0/8\"]\n").expect("file");
        let from_file = KvListenerCli {
            config: Some(file.clone()),
            ..cli.clone()
        };
        assert_eq!(
            BrokerConfig::resolve_kv_listener(from_file)
                .expect("resolves")
                .allow_cidrs
                .map(|n| n.len()),
            Some(1)
        );
        std::fs::write(&file, "allow_cidrs: []\n").expect("file");
        let empty = KvListenerCli {
            config: Some(file),
            ..cli
        };
        assert!(
            BrokerConfig::resolve_kv_listener(empty).is_err(),
            "an empty list would refuse every source"
        );
    }
}
