//! The typed configuration tree: every section, key and default the daemon reads.
//!
//! Fields stay close to what the operator wrote (strings for endpoints and CIDRs) so that
//! validation can report each bad entry with its YAML path instead of failing the whole parse on
//! the first one; typed accessors (`normalized_endpoints`, `allow_cidrs`, `namespaces`) give the
//! daemon the parsed form once validation has passed.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use continuum_protocol::ids::Namespace;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The default Dynamo namespace (`DYN_NAMESPACE` upstream).
pub const DEFAULT_DYNAMO_NAMESPACE: &str = "dynamo";

/// A duration written as a humantime string ("500ms", "30s", "5m").
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct HumanDuration(pub Duration);

impl HumanDuration {
    pub const fn from_millis(ms: u64) -> Self {
        Self(Duration::from_millis(ms))
    }

    pub const fn from_secs(secs: u64) -> Self {
        Self(Duration::from_secs(secs))
    }

    pub const fn get(self) -> Duration {
        self.0
    }
}

impl fmt::Debug for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", humantime::format_duration(self.0))
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", humantime::format_duration(self.0))
    }
}

impl From<HumanDuration> for Duration {
    fn from(value: HumanDuration) -> Self {
        value.0
    }
}

impl Serialize for HumanDuration {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(&humantime::format_duration(self.0))
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = HumanDuration;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration string such as \"500ms\", \"30s\" or \"5m\"")
            }

            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<HumanDuration, E> {
                humantime::parse_duration(text.trim())
                    .map(HumanDuration)
                    .map_err(|error| E::custom(format!("invalid duration {text:?}: {error}")))
            }
        }
        deserializer.deserialize_str(Visitor)
    }
}

/// The whole daemon configuration (one YAML document).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Config {
    pub server: ServerConfig,
    pub admin: AdminConfig,
    pub api_keys: Vec<ApiKeyConfig>,
    pub backends: Vec<BackendConfig>,
    pub disaggregated_serving: DisaggregatedServingConfig,
    pub telemetry: TelemetryConfig,
    pub dynamo: DynamoConfig,
    pub rate_limits: super::rate_limits::RateLimitsConfig,
    pub admission: super::admission::AdmissionConfig,
    pub replica_sync: super::replica_sync::ReplicaSyncConfig,
}

impl Config {
    /// The configured backend with this name, if any.
    pub fn backend(&self, name: &str) -> Option<&BackendConfig> {
        self.backends.iter().find(|backend| backend.name == name)
    }
}

/// `server`: the OpenAI-compatible front door.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ServerConfig {
    /// TCP address the front door (and `/admin/*`, `/metrics`) listens on.
    pub bind_address: SocketAddr,
    /// An HTTP/1.1 request head must be whole within this time of its first byte (a new
    /// connection's first head: of the connection's start) or the connection is closed.
    pub header_read_timeout: HumanDuration,
    /// A request body must arrive whole within this time after its head (else 408).
    pub body_read_timeout: HumanDuration,
    /// A connection with no request in flight is closed after this long (HTTP/1.1 and h2c).
    pub idle_timeout: HumanDuration,
    /// A connection whose answer could not be written on for this long (the client stopped
    /// reading) is closed.
    pub send_timeout: HumanDuration,
    /// Client connections open at once; beyond it the oldest idle connection is closed to make
    /// room, or the new one is refused when every connection has a request in flight.
    pub max_connections: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            bind_address: SocketAddr::from(([127, 0, 0, 1], 8080)),
            header_read_timeout: HumanDuration::from_secs(10),
            body_read_timeout: HumanDuration::from_secs(60),
            idle_timeout: HumanDuration::from_secs(60),
            send_timeout: HumanDuration::from_secs(60),
            max_connections: 4096,
        }
    }
}

/// `admin`: the `/admin/*` API.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AdminConfig {
    /// Mounts `/admin/*` when true (a token is then required).
    pub enabled: bool,
    /// Bearer token for `/admin/*`. Masked in readbacks.
    pub token: Option<String>,
}

/// One `api_keys[]` entry: a client credential for the front door.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ApiKeyConfig {
    /// The bearer key clients send. Masked in readbacks.
    pub key: String,
    /// A human name for logs and metrics (never the key).
    pub name: String,
    /// Backends this key may reach; unset means every backend.
    #[serde(default)]
    pub allowed_backends: Option<Vec<String>>,
}

/// Wire type of a backend. Only OpenAI-compatible backends exist today.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendType {
    #[default]
    Openai,
}

/// Serving role of a backend in disaggregated serving.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendRole {
    #[default]
    Unified,
    Prefill,
    Decode,
}

/// One `backends[]` entry: an upstream OpenAI-wire server (a Dynamo shim replica, for example).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BackendConfig {
    pub name: String,
    #[serde(rename = "type", default)]
    pub kind: BackendType,
    /// Base URL, `http(s)://host[:port][/path]`.
    pub url: String,
    #[serde(default)]
    pub role: BackendRole,
    /// Model ids this backend serves (empty = any).
    #[serde(default)]
    pub models: Vec<String>,
    /// Internal backends are reachable only through routing features (never chosen directly).
    #[serde(default)]
    pub internal: bool,
    #[serde(default = "default_true")]
    pub enabled: bool,
    #[serde(default)]
    pub health_check: HealthCheckConfig,
    /// TLS settings of an `https://` backend.
    #[serde(default)]
    pub tls: BackendTlsConfig,
    /// System prompts put, in order, before every chat conversation sent to this backend (and
    /// before the prompt the KV-aware picker renders for it).
    #[serde(default)]
    pub global_prompts: Vec<String>,
    /// Merge every system message into one leading system message (chat templates that refuse
    /// a system message anywhere else, or more than one).
    #[serde(default)]
    pub requires_single_leading_system: bool,
    /// How `POST /v1/responses` reaches this backend: `converted` (default) to chat
    /// completions, or `native`: passed through to the backend's own `/v1/responses`.
    #[serde(default)]
    pub responses_api: ResponsesApi,
    /// Models this backend serves only through its own `/v1/responses`: an Anthropic Messages
    /// request for one is converted to a Responses request and passed through natively, pinned
    /// by model alone (seed "Native /v1/responses passthrough").
    #[serde(default)]
    pub responses_only_models: Vec<String>,
}

impl BackendConfig {
    /// The backend's prompt rewrites (`global_prompts`, `requires_single_leading_system`).
    pub fn prompt_rewrite(&self) -> continuum_protocol::ingress::prompts::PromptRewrite {
        continuum_protocol::ingress::prompts::PromptRewrite {
            global_prompts: self.global_prompts.clone(),
            requires_single_leading_system: self.requires_single_leading_system,
        }
    }
}

/// `backends[].responses_api`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResponsesApi {
    /// `/v1/responses` is converted to chat completions (the shim path, KV hashing, pins).
    #[default]
    Converted,
    /// The backend serves `/v1/responses` itself: bodies pass through, pinned by model alone.
    Native,
}

/// `backends[].tls`: trust for an `https://` backend beyond the built-in webpki roots.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct BackendTlsConfig {
    /// PEM file of extra CA certificates trusted for this backend (besides the webpki roots).
    pub ca_cert: Option<PathBuf>,
}

/// `backends[].health_check`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct HealthCheckConfig {
    pub enabled: bool,
    /// Path probed with GET, relative to the backend URL.
    pub path: String,
    pub interval: HumanDuration,
    pub timeout: HumanDuration,
    /// Consecutive failures before the backend is marked unhealthy.
    pub unhealthy_threshold: u32,
    /// Consecutive successes before an unhealthy backend is marked healthy again.
    pub healthy_threshold: u32,
}

impl Default for HealthCheckConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            path: "/health".to_owned(),
            interval: HumanDuration::from_secs(10),
            timeout: HumanDuration::from_secs(5),
            unhealthy_threshold: 3,
            healthy_threshold: 2,
        }
    }
}

/// `disaggregated_serving`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DisaggregatedServingConfig {
    pub enabled: bool,
    /// After a shim failure, retry once on a unified backend without worker pins.
    pub fallback_to_unified: bool,
    /// Continuing a stream cut after its first byte, on every ingress (issue 31).
    pub mid_stream_fallback: MidStreamFallbackConfig,
}

impl Default for DisaggregatedServingConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            fallback_to_unified: true,
            mid_stream_fallback: MidStreamFallbackConfig::default(),
        }
    }
}

/// `disaggregated_serving.mid_stream_fallback`: a stream (chat or text completions, Messages,
/// Responses) cut after the client received bytes is continued on a unified fallback target
/// (docs/runtime-semantics.md).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct MidStreamFallbackConfig {
    pub enabled: bool,
    /// Continuation attempts per request.
    pub max_attempts: u32,
    /// No upstream event for this long counts as a cut (a stalled engine).
    pub inactivity_timeout: HumanDuration,
    /// Continuations allowed as a fraction of the streamed requests of the last 10 s.
    pub budget_ratio: f64,
    /// Continuations per second always allowed on top of the ratio.
    pub budget_min_per_s: f64,
    /// Answer text kept per stream for a continuation; beyond it continuation is disarmed.
    pub max_buffered_bytes: usize,
}

impl Default for MidStreamFallbackConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            max_attempts: 1,
            inactivity_timeout: HumanDuration::from_secs(30),
            budget_ratio: 0.2,
            budget_min_per_s: 1.0,
            max_buffered_bytes: 1024 * 1024,
        }
    }
}

/// Log line format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// `telemetry`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TelemetryConfig {
    pub log_format: LogFormat,
    /// A `tracing_subscriber::EnvFilter` directive ("info", "continuum_router=debug,info").
    pub log_level: String,
    pub service_name: String,
    /// OTLP/gRPC trace export; unset disables it.
    pub otlp: Option<OtlpConfig>,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            log_format: LogFormat::Text,
            log_level: "info".to_owned(),
            service_name: "continuum-router".to_owned(),
            otlp: None,
        }
    }
}

/// `telemetry.otlp`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OtlpConfig {
    /// Collector address, `http(s)://host:port` (Jaeger's OTLP/gRPC port is 4317).
    pub endpoint: String,
    /// Also push the `/metrics` families to the same collector this often (unset: traces only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_interval: Option<HumanDuration>,
}

/// `dynamo`: discovery, load signals, shim routing, KV-aware selection and the event bus.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DynamoConfig {
    pub enabled: bool,
    pub discovery: DiscoveryConfig,
    pub load: LoadConfig,
    pub shim: ShimConfig,
    pub kv: KvConfig,
    pub event_bus: EventBusConfig,
}

/// Where workers register.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DiscoverySource {
    #[default]
    Etcd,
    Kubernetes,
    KubernetesPods,
    /// Dynamo's file store (`--discovery-backend file`, single node): the `file` section.
    File,
    /// etcd-shaped records held in process: only `continuum-router demo` feeds it (its simulated
    /// fleet); namespaces come from the `etcd` section, no etcd is dialled.
    Simulated,
}

impl DiscoverySource {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Etcd => "etcd",
            Self::Kubernetes => "kubernetes",
            Self::KubernetesPods => "kubernetes_pods",
            Self::File => "file",
            Self::Simulated => "simulated",
        }
    }

    pub fn is_kubernetes(self) -> bool {
        matches!(self, Self::Kubernetes | Self::KubernetesPods)
    }
}

/// `dynamo.discovery`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DiscoveryConfig {
    pub source: DiscoverySource,
    pub etcd: EtcdConfig,
    pub kubernetes: KubernetesConfig,
    pub file: FileStoreConfig,
}

impl DiscoveryConfig {
    /// The Dynamo namespaces the active source watches, in configured order (first = primary).
    pub fn namespace_names(&self) -> Vec<String> {
        let (scalar, list) = match self.source {
            DiscoverySource::Etcd | DiscoverySource::Simulated => {
                (&self.etcd.namespace, &self.etcd.namespaces)
            }
            DiscoverySource::Kubernetes | DiscoverySource::KubernetesPods => (
                &self.kubernetes.dynamo_namespace,
                &self.kubernetes.dynamo_namespaces,
            ),
            DiscoverySource::File => (&self.file.namespace, &self.file.namespaces),
        };
        if list.is_empty() {
            vec![scalar.clone()]
        } else {
            list.clone()
        }
    }

    /// [`Self::namespace_names`] as protocol newtypes.
    pub fn namespaces(&self) -> Vec<Namespace> {
        self.namespace_names()
            .into_iter()
            .map(Namespace::new)
            .collect()
    }

    /// The active source's reconnect backoff.
    pub fn watch_reconnect_backoff(&self) -> BackoffConfig {
        match self.source {
            DiscoverySource::Etcd | DiscoverySource::Simulated => self.etcd.watch_reconnect_backoff,
            DiscoverySource::Kubernetes | DiscoverySource::KubernetesPods => {
                self.kubernetes.watch_reconnect_backoff
            }
            // Scans never "reconnect": a failed scan is retried at the next rescan.
            DiscoverySource::File => BackoffConfig::default(),
        }
    }
}

/// `watch_reconnect_backoff`: full-jitter exponential backoff between discovery passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct BackoffConfig {
    pub initial: HumanDuration,
    pub max: HumanDuration,
}

impl Default for BackoffConfig {
    fn default() -> Self {
        Self {
            initial: HumanDuration::from_millis(500),
            max: HumanDuration::from_secs(30),
        }
    }
}

/// `dynamo.discovery.etcd`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EtcdConfig {
    /// `http(s)://host:port` or bare `host:port` (normalised to `http://`).
    pub endpoints: Vec<String>,
    /// The workers' `DYN_NAMESPACE`.
    pub namespace: String,
    /// Several namespaces instead of `namespace` (each needs a shim pool).
    pub namespaces: Vec<String>,
    pub tls: Option<EtcdTlsConfig>,
    pub auth: Option<EtcdAuthConfig>,
    pub watch_reconnect_backoff: BackoffConfig,
}

impl Default for EtcdConfig {
    fn default() -> Self {
        Self {
            endpoints: Vec::new(),
            namespace: DEFAULT_DYNAMO_NAMESPACE.to_owned(),
            namespaces: Vec::new(),
            tls: None,
            auth: None,
            watch_reconnect_backoff: BackoffConfig::default(),
        }
    }
}

impl EtcdConfig {
    /// Endpoints with bare `host:port` turned into `http://host:port`, as etcd-client wants them.
    pub fn normalized_endpoints(&self) -> Vec<String> {
        self.endpoints
            .iter()
            .map(|endpoint| crate::config::validate::normalize_endpoint(endpoint))
            .collect()
    }
}

/// `dynamo.discovery.file`: Dynamo's file store (dynamo-wire §16), read-only.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct FileStoreConfig {
    /// The store root the workers write (their `DYN_FILE_KV`); unset means Dynamo's default,
    /// `$DYN_FILE_KV` of the router's environment, else `$TMPDIR/dynamo_store_kv`.
    pub root: Option<PathBuf>,
    /// The workers' `DYN_NAMESPACE`.
    pub namespace: String,
    /// Several namespaces instead of `namespace` (each needs a shim pool).
    pub namespaces: Vec<String>,
    /// Time between full scans (inotify wakes a scan earlier on file changes).
    pub rescan_interval: HumanDuration,
    /// A file not touched for longer than this belongs to a dead worker (Dynamo 1.6.1: 10 s).
    pub ttl: HumanDuration,
}

impl Default for FileStoreConfig {
    fn default() -> Self {
        Self {
            root: None,
            namespace: DEFAULT_DYNAMO_NAMESPACE.to_owned(),
            namespaces: Vec::new(),
            rescan_interval: HumanDuration::from_secs(1),
            ttl: HumanDuration::from_secs(10),
        }
    }
}

/// `dynamo.discovery.etcd.tls`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EtcdTlsConfig {
    pub ca_cert: Option<PathBuf>,
    pub client_cert: Option<PathBuf>,
    /// Masked in readbacks.
    pub client_key: Option<PathBuf>,
    /// SNI / certificate name override.
    pub server_name: Option<String>,
}

/// `dynamo.discovery.etcd.auth`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EtcdAuthConfig {
    pub username: String,
    /// Masked in readbacks.
    pub password: String,
}

/// `dynamo.discovery.kubernetes` (sources `kubernetes` and `kubernetes_pods`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct KubernetesConfig {
    /// Kubernetes namespace of the fleet (a DNS-1123 label).
    pub namespace: String,
    /// The workers' `DYN_NAMESPACE` (`nvidia.com/dynamo-namespace` label value).
    pub dynamo_namespace: String,
    /// Several Dynamo namespaces instead of `dynamo_namespace`.
    pub dynamo_namespaces: Vec<String>,
    /// `kubernetes_pods` only: the served model name for every worker Pod.
    pub model: Option<String>,
    /// `kubernetes_pods` only: per-component model names.
    pub models: Vec<ComponentModel>,
    pub watch_reconnect_backoff: BackoffConfig,
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        Self {
            namespace: DEFAULT_DYNAMO_NAMESPACE.to_owned(),
            dynamo_namespace: DEFAULT_DYNAMO_NAMESPACE.to_owned(),
            dynamo_namespaces: Vec::new(),
            model: None,
            models: Vec::new(),
            watch_reconnect_backoff: BackoffConfig::default(),
        }
    }
}

/// One `dynamo.discovery.kubernetes.models[]` entry.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ComponentModel {
    /// Exact `nvidia.com/dynamo-component` label value.
    pub component: String,
    pub model: String,
    /// Required when several Dynamo namespaces are configured.
    #[serde(default)]
    pub dynamo_namespace: Option<String>,
}

/// How load and KV subscriptions reach publishers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadTransport {
    /// Dial publisher Pod IPs (router inside the cluster).
    #[default]
    Direct,
    /// Ride event-bus streams opened by in-cluster brokers.
    Broker,
}

/// `dynamo.load`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LoadConfig {
    /// Oldest ActiveLoad sample that still counts as fresh (100ms..=5m).
    pub max_staleness: HumanDuration,
    pub transport: LoadTransport,
    /// Networks direct mode may dial; unset allows any address.
    pub direct_allow_cidrs: Option<Vec<String>>,
    /// Ranks whose cost is within this many times the request's own weight of the lowest tie,
    /// and a draw seeded by the replica id picks among them (0 = off; 0..=16). Breaks the herd
    /// of several router replicas deciding on the same view.
    pub tie_break_window: f64,
    /// With `replica_sync` peers known and a tie-break window: replica i of N (ordered by
    /// replica id) takes the i-th lowest cost of the tie set instead of a draw, and counts the
    /// slots its peers take on the same view until a load sample answers them.
    pub peer_slots: bool,
}

/// Default `dynamo.load.tie_break_window`: off. 2.0 is the measured setting for several replicas
/// (docs/replay.md, "Breaking the herd"); off by default because with it on the picker takes its
/// generic pass (+0.3 µs at 16 ranks, +23 µs at 1,000: docs/performance.md, "Picker").
pub const DEFAULT_TIE_BREAK_WINDOW: f64 = 0.0;

impl Default for LoadConfig {
    fn default() -> Self {
        Self {
            max_staleness: HumanDuration::from_secs(3),
            transport: LoadTransport::Direct,
            direct_allow_cidrs: None,
            tie_break_window: DEFAULT_TIE_BREAK_WINDOW,
            peer_slots: false,
        }
    }
}

impl LoadConfig {
    /// The parsed allow-list (`None` = allow any). Entries that fail to parse are skipped;
    /// validation rejects them before a config reaches the daemon.
    pub fn allow_cidrs(&self) -> Option<Vec<ipnet::IpNet>> {
        self.direct_allow_cidrs.as_ref().map(|cidrs| {
            cidrs
                .iter()
                .filter_map(|cidr| cidr.trim().parse().ok())
                .collect()
        })
    }
}

/// `dynamo.shim`: the `dynamo.frontend --router-mode direct` replicas.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ShimConfig {
    /// `backends[].name` entries of the single namespace's shim replicas.
    pub backends: Vec<String>,
    /// One pool per namespace when several namespaces are watched.
    pub pools: Vec<ShimPool>,
    /// Client model id -> Dynamo display_name.
    pub model_map: BTreeMap<String, String>,
}

impl ShimConfig {
    /// The shim replicas for `namespace`: its pool, or `backends` when no pools are configured.
    pub fn backends_for(&self, namespace: &str) -> &[String] {
        if self.pools.is_empty() {
            return &self.backends;
        }
        self.pools
            .iter()
            .find(|pool| pool.namespace == namespace)
            .map(|pool| pool.backends.as_slice())
            .unwrap_or(&[])
    }
}

/// One `dynamo.shim.pools[]` entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShimPool {
    pub namespace: String,
    pub backends: Vec<String>,
}

/// `dynamo.kv`: KV-overlap-aware prefill selection.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct KvConfig {
    pub enabled: bool,
    /// Fetch http(s) tokenizer URLs named by worker cards.
    pub allow_http_artifacts: bool,
    /// Fetch hf:// tokenizer URLs from the Hugging Face Hub.
    pub allow_hf_artifacts: bool,
    /// `blake3:<64 lowercase hex>` checksums the router may load.
    pub pinned_artifacts: Vec<String>,
    pub artifact_cache_dir: PathBuf,
    pub overlap_score_credit: f64,
    pub prefill_load_scale: f64,
    /// 0 = deterministic lowest cost; above 0 = softmax sampling.
    pub router_temperature: f64,
    /// Attach rendered token ids as `nvext.token_data`.
    pub send_token_data: bool,
    pub conditional_disaggregation: ConditionalDisaggregationConfig,
    /// `dynamo.kv.kv_cache_index`: KV-event sources other than discovered publishers.
    pub kv_cache_index: KvCacheIndexConfig,
}

/// `dynamo.kv.kv_cache_index`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct KvCacheIndexConfig {
    /// Backends whose KV events a `continuum-kv-listener` pushes over the event bus.
    pub sources: Vec<KvCacheIndexSource>,
}

/// One `dynamo.kv.kv_cache_index.sources[]` entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCacheIndexSource {
    /// The backend name a kv_listener announces (and a `brokers[].backends` grant names).
    pub backend: String,
    pub transport: KvSourceTransport,
}

/// How a kv_cache_index source reaches the router.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvSourceTransport {
    /// SSE pushed by a `continuum-kv-listener` session (`open_announced_stream`).
    EventBus,
}

impl KvCacheIndexConfig {
    /// The backends of the `transport: event_bus` sources.
    pub fn event_bus_backends(&self) -> Vec<String> {
        self.sources
            .iter()
            .filter(|s| s.transport == KvSourceTransport::EventBus)
            .map(|s| s.backend.clone())
            .collect()
    }
}

impl Default for KvConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            allow_http_artifacts: true,
            allow_hf_artifacts: false,
            pinned_artifacts: Vec::new(),
            artifact_cache_dir: PathBuf::from("/var/cache/continuum-router/kv-artifacts"),
            overlap_score_credit: 1.0,
            prefill_load_scale: 1.0,
            router_temperature: 0.0,
            send_token_data: false,
            conditional_disaggregation: ConditionalDisaggregationConfig::default(),
            kv_cache_index: KvCacheIndexConfig::default(),
        }
    }
}

/// `dynamo.kv.conditional_disaggregation`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ConditionalDisaggregationConfig {
    pub enabled: bool,
    /// Fraction of total_kv_blocks (0..=1) a decode worker may hold and still prefill locally.
    pub decode_busy_threshold: Option<f64>,
}

/// `dynamo.event_bus`: the inbound HTTP/2-over-TLS listener for brokers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EventBusConfig {
    pub enabled: bool,
    pub listen: SocketAddr,
    pub tls: Option<EventBusTlsConfig>,
    pub brokers: Vec<BrokerConfig>,
    pub max_sessions: u32,
    pub max_streams_per_session: u32,
    pub max_session_buffer_bytes: u64,
    pub heartbeat_interval: HumanDuration,
    pub idle_timeout: HumanDuration,
}

impl Default for EventBusConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            listen: SocketAddr::from(([0, 0, 0, 0], 7443)),
            tls: None,
            brokers: Vec::new(),
            max_sessions: 64,
            max_streams_per_session: 1024,
            max_session_buffer_bytes: 64 * 1024 * 1024,
            heartbeat_interval: HumanDuration::from_secs(10),
            idle_timeout: HumanDuration::from_secs(30),
        }
    }
}

impl EventBusConfig {
    /// Per-direction buffer of one data stream: `max_session_buffer_bytes / (4 *
    /// max_streams_per_session)` clamped to 16 KiB..=1 MiB (16 KiB at defaults).
    pub fn stream_buffer_bytes(&self) -> u64 {
        continuum_protocol::event_bus::bounds::stream_buffer_bytes(
            self.max_session_buffer_bytes,
            self.max_streams_per_session,
        )
    }

    /// Concurrent TCP connections the listener accepts: `4 * max_sessions`, at least 16.
    pub fn max_connections(&self) -> u64 {
        continuum_protocol::event_bus::bounds::max_connections(self.max_sessions)
    }
}

/// `dynamo.event_bus.tls`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EventBusTlsConfig {
    pub cert: Option<PathBuf>,
    /// Masked in readbacks.
    pub key: Option<PathBuf>,
    /// CA for client-certificate authentication (DNS SAN = broker id).
    pub client_ca: Option<PathBuf>,
}

/// Role of an event-bus client.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BrokerRole {
    /// continuum-event-broker: relays ZMQ publishers of granted Dynamo namespaces.
    #[default]
    Broker,
    /// continuum-kv-listener: pushes KV events of granted backends.
    KvListener,
}

/// One `dynamo.event_bus.brokers[]` entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BrokerConfig {
    /// Client id; also the DNS SAN a client certificate must carry.
    pub id: String,
    #[serde(default)]
    pub role: BrokerRole,
    /// `sha256:<64 lowercase hex>` of the bearer token (never the token). Masked in readbacks.
    #[serde(default)]
    pub token_hash: Option<String>,
    /// role broker: Dynamo namespaces it may serve (empty = any, with a warning).
    #[serde(default)]
    pub namespaces: Vec<String>,
    /// role kv_listener: backends it may announce.
    #[serde(default)]
    pub backends: Vec<String>,
}

fn default_true() -> bool {
    true
}
