//! `replica_sync`: router replicas sharing their in-flight dispatches over NATS (the
//! `replica-sync` Cargo feature), with its validation rules. Off by default.
//!
//! What is shared and what stays per replica: docs/runtime-semantics.md, "Router replicas". The
//! merge is `continuum_protocol::replica_sync`; the actor `continuum_actors::replica_sync`.
//! Reload class: a change restarts `root/replica_sync` only (its peers' contributions are
//! withdrawn and learnt again from their next snapshots).

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::Diagnostic;
use super::schema::{Config, HumanDuration};

/// Default `replica_sync.subject_prefix`.
pub const DEFAULT_SUBJECT_PREFIX: &str = "continuum.replicas";
/// Default `replica_sync.publish_interval`.
pub const DEFAULT_PUBLISH_INTERVAL: Duration = Duration::from_millis(20);
/// Default `replica_sync.heartbeat_interval`.
pub const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);
/// Default `replica_sync.ttl`.
pub const DEFAULT_TTL: Duration = Duration::from_secs(3);
/// Default and largest `replica_sync.max_peers`.
pub const DEFAULT_MAX_PEERS: usize = 64;
pub const MAX_PEERS: usize = 1024;
/// Default and largest `replica_sync.max_entries_per_peer`.
pub const DEFAULT_MAX_ENTRIES: usize = 4096;
pub const MAX_ENTRIES: usize = 65_536;

/// `replica_sync`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ReplicaSyncConfig {
    pub enabled: bool,
    /// This replica's id among its peers; empty: `$POD_NAME`, else the host name.
    pub replica_id: String,
    /// Replicas with the same group share state: they publish and read
    /// `<subject_prefix>.<group>.inflight`.
    pub group: String,
    pub subject_prefix: String,
    /// Local changes are published at most this often.
    pub publish_interval: HumanDuration,
    /// An unchanged state is published again this often (keeps the peers' TTL alive).
    pub heartbeat_interval: HumanDuration,
    /// A peer silent this long is forgotten with its contributions.
    pub ttl: HumanDuration,
    pub max_peers: usize,
    pub max_entries_per_peer: usize,
    pub nats: NatsConfig,
}

impl Default for ReplicaSyncConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            replica_id: String::new(),
            group: "default".to_owned(),
            subject_prefix: DEFAULT_SUBJECT_PREFIX.to_owned(),
            publish_interval: HumanDuration(DEFAULT_PUBLISH_INTERVAL),
            heartbeat_interval: HumanDuration(DEFAULT_HEARTBEAT_INTERVAL),
            ttl: HumanDuration(DEFAULT_TTL),
            max_peers: DEFAULT_MAX_PEERS,
            max_entries_per_peer: DEFAULT_MAX_ENTRIES,
            nats: NatsConfig::default(),
        }
    }
}

impl ReplicaSyncConfig {
    /// The subject every replica of the group publishes on and reads.
    pub fn subject(&self) -> String {
        format!("{}.{}.inflight", self.subject_prefix, self.group)
    }

    /// `replica_id`, else `$POD_NAME`, else the host name, else `router`.
    pub fn resolved_replica_id(&self, env: impl Fn(&str) -> Option<String>) -> String {
        let pick = |s: Option<String>| s.map(|s| s.trim().to_owned()).filter(|s| !s.is_empty());
        pick(Some(self.replica_id.clone()))
            .or_else(|| pick(env("POD_NAME")))
            .or_else(|| pick(std::fs::read_to_string("/proc/sys/kernel/hostname").ok()))
            .or_else(|| pick(env("HOSTNAME")))
            .unwrap_or_else(|| "router".to_owned())
    }
}

/// `replica_sync.nats`: the connection. Secrets come from files only.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct NatsConfig {
    /// `nats://host:port` or `tls://host:port`; a comma-separated list for a cluster.
    pub url: String,
    pub connect_timeout: HumanDuration,
    /// Reconnect delays grow to this ceiling, with full jitter.
    pub reconnect_max_delay: HumanDuration,
    pub tls: Option<NatsTlsConfig>,
    /// A NATS `.creds` file (JWT + nkey seed).
    pub credentials_file: Option<PathBuf>,
    pub user: Option<String>,
    /// With `user`: the file holding the password.
    pub password_file: Option<PathBuf>,
    /// The file holding a token.
    pub token_file: Option<PathBuf>,
}

impl Default for NatsConfig {
    fn default() -> Self {
        Self {
            url: "nats://127.0.0.1:4222".to_owned(),
            connect_timeout: HumanDuration::from_secs(5),
            reconnect_max_delay: HumanDuration::from_secs(5),
            tls: None,
            credentials_file: None,
            user: None,
            password_file: None,
            token_file: None,
        }
    }
}

/// `replica_sync.nats.tls`: TLS is required once this is set.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct NatsTlsConfig {
    pub ca_file: Option<PathBuf>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

/// A subject token: letters, digits, `-`, `_` (dots separate tokens in the prefix).
fn subject_tokens_ok(text: &str) -> bool {
    !text.is_empty()
        && text.split('.').all(|t| {
            !t.is_empty()
                && t.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

/// The `replica_sync` rules: subject tokens, intervals ordered
/// (`publish_interval` ≤ `heartbeat_interval` < `ttl`), bounds, one authentication method,
/// TLS files paired, a URL scheme NATS knows.
pub fn validate(config: &Config) -> Vec<Diagnostic> {
    let rs = &config.replica_sync;
    let mut out = Vec::new();
    let mut err = |path: &str, message: String| {
        out.push(Diagnostic::error(format!("replica_sync.{path}"), message));
    };
    if !subject_tokens_ok(&rs.subject_prefix) {
        err(
            "subject_prefix",
            "must be dot-separated tokens of letters, digits, `-` or `_`".into(),
        );
    }
    if !subject_tokens_ok(&rs.group) || rs.group.contains('.') {
        err(
            "group",
            "must be one token of letters, digits, `-` or `_`".into(),
        );
    }
    if rs.replica_id.len() > continuum_protocol::replica_sync::MAX_REPLICA_ID_BYTES {
        err("replica_id", "must be at most 253 bytes".into());
    }
    let (publish, beat, ttl) = (
        rs.publish_interval.get(),
        rs.heartbeat_interval.get(),
        rs.ttl.get(),
    );
    if publish < Duration::from_millis(1) || publish > Duration::from_secs(1) {
        err("publish_interval", "must be between 1ms and 1s".into());
    }
    if beat < publish || beat >= ttl {
        err(
            "heartbeat_interval",
            "must be at least publish_interval and below ttl".into(),
        );
    }
    if ttl < continuum_protocol::replica_sync::MIN_TTL || ttl > Duration::from_secs(60) {
        err("ttl", "must be between 100ms and 60s".into());
    }
    if !(1..=MAX_PEERS).contains(&rs.max_peers) {
        err("max_peers", format!("must be between 1 and {MAX_PEERS}"));
    }
    if !(1..=MAX_ENTRIES).contains(&rs.max_entries_per_peer) {
        err(
            "max_entries_per_peer",
            format!("must be between 1 and {MAX_ENTRIES}"),
        );
    }
    let nats = &rs.nats;
    let schemes_ok = nats.url.split(',').all(|u| {
        let u = u.trim();
        ["nats://", "tls://"]
            .iter()
            .any(|s| u.len() > s.len() && u.starts_with(s))
    });
    if !schemes_ok {
        err(
            "nats.url",
            "must be nats://host:port or tls://host:port (comma-separated)".into(),
        );
    }
    if nats.connect_timeout.get().is_zero() {
        err("nats.connect_timeout", "must be above 0".into());
    }
    if nats.reconnect_max_delay.get() < Duration::from_millis(100) {
        err("nats.reconnect_max_delay", "must be at least 100ms".into());
    }
    let methods = [
        nats.credentials_file.is_some(),
        nats.user.is_some(),
        nats.token_file.is_some(),
    ];
    if methods.iter().filter(|m| **m).count() > 1 {
        err(
            "nats",
            "set one of credentials_file, user (+ password_file) or token_file".into(),
        );
    }
    if nats.user.is_some() != nats.password_file.is_some() {
        err(
            "nats.password_file",
            "user and password_file go together".into(),
        );
    }
    if let Some(tls) = &nats.tls
        && tls.cert_file.is_some() != tls.key_file.is_some()
    {
        err(
            "nats.tls.key_file",
            "cert_file and key_file go together".into(),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paths(config: &Config) -> Vec<String> {
        validate(config).into_iter().map(|d| d.path).collect()
    }

    #[test]
    fn off_by_default_valid_and_bad_values_are_refused_with_their_paths() {
        let mut c = Config::default();
        assert!(!c.replica_sync.enabled);
        assert!(paths(&c).is_empty());
        assert_eq!(
            c.replica_sync.subject(),
            "continuum.replicas.default.inflight"
        );
        let rs = &mut c.replica_sync;
        rs.subject_prefix = "a..b".into();
        rs.group = "x.y".into();
        rs.publish_interval = HumanDuration::from_millis(0);
        rs.ttl = HumanDuration::from_millis(500);
        rs.max_peers = 0;
        rs.nats.url = "http://x".into();
        rs.nats.user = Some("u".into());
        rs.nats.token_file = Some("t".into());
        rs.nats.tls = Some(NatsTlsConfig {
            cert_file: Some("c".into()),
            ..NatsTlsConfig::default()
        });
        assert_eq!(
            paths(&c),
            [
                "replica_sync.subject_prefix",
                "replica_sync.group",
                "replica_sync.publish_interval",
                "replica_sync.heartbeat_interval",
                "replica_sync.max_peers",
                "replica_sync.nats.url",
                "replica_sync.nats",
                "replica_sync.nats.password_file",
                "replica_sync.nats.tls.key_file",
            ]
        );
    }

    #[test]
    fn yaml_keys_parse_and_the_replica_id_falls_back_to_the_pod_name() {
        let yaml =
            "replica_sync: {enabled: true, group: g1, ttl: 2s, nats: {url: 'nats://127.0.0.1:1'}}";
        let c = Config::from_yaml_str(yaml, &crate::config::ProcessEnv).expect("yaml");
        assert!(paths(&c).is_empty(), "{:?}", validate(&c));
        let rs = c.replica_sync;
        assert!(rs.enabled);
        assert_eq!(rs.ttl.get(), Duration::from_secs(2));
        assert_eq!(rs.subject(), "continuum.replicas.g1.inflight");
        let env = |k: &str| (k == "POD_NAME").then(|| "router-7".to_owned());
        assert_eq!(rs.resolved_replica_id(env), "router-7");
        let named = ReplicaSyncConfig {
            replica_id: "r1".into(),
            ..ReplicaSyncConfig::default()
        };
        assert_eq!(named.resolved_replica_id(env), "r1");
    }
}
