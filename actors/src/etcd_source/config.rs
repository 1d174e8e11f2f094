//! Plain-data connection settings for the etcd source and their validation (seed "Configuration").

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use continuum_protocol::backoff::{BackoffPolicy, Jitter};
use continuum_protocol::ids::Namespace;

/// Most endpoints one source may list.
pub const MAX_ENDPOINTS: usize = 16;

/// Everything one etcd discovery source needs. The daemon maps its YAML onto this.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdSourceConfig {
    /// `http(s)://host:port` or bare `host:port` (normalised to `http://`).
    pub endpoints: Vec<String>,
    /// The Dynamo namespace (`DYN_NAMESPACE`) whose keys are watched.
    pub namespace: Namespace,
    pub tls: Option<EtcdTls>,
    pub auth: Option<EtcdAuth>,
    /// Reconnect schedule between passes (`watch_reconnect_backoff`); jitter is ignored.
    pub backoff: BackoffPolicy,
}

impl EtcdSourceConfig {
    /// `watch_reconnect_backoff` defaults: 500 ms doubling to 30 s, no jitter.
    pub const DEFAULT_BACKOFF: BackoffPolicy = BackoffPolicy {
        initial: Duration::from_millis(500),
        max: Duration::from_secs(30),
        jitter: Jitter::None,
    };

    /// A plaintext source with the default backoff.
    pub fn new(endpoints: Vec<String>, namespace: Namespace) -> Self {
        Self {
            endpoints,
            namespace,
            tls: None,
            auth: None,
            backoff: Self::DEFAULT_BACKOFF,
        }
    }

    /// Checks the seed's validation rules for the connection settings and returns the warnings
    /// an operator should see (the caller logs them).
    pub fn validate(&self) -> Result<Vec<EtcdConfigWarning>, EtcdConfigError> {
        let endpoints = self.normalized_endpoints()?;
        let https = endpoints
            .iter()
            .filter(|e| e.starts_with("https://"))
            .count();
        if https != 0 && https != endpoints.len() {
            return Err(EtcdConfigError::MixedSchemes);
        }
        let secure = https != 0;
        match (&self.tls, secure) {
            (Some(_), false) => return Err(EtcdConfigError::TlsWithHttp),
            // etcd-client is built without system trust roots, so https needs a pinned CA.
            (None, true) => return Err(EtcdConfigError::HttpsWithoutTls),
            _ => {}
        }
        if let Some(tls) = &self.tls {
            if tls.client_cert.is_some() != tls.client_key.is_some() {
                return Err(EtcdConfigError::HalfIdentity);
            }
            if tls.ca_cert.is_none() {
                return Err(EtcdConfigError::MissingCaCert);
            }
            if tls.server_name.as_deref() == Some("") {
                return Err(EtcdConfigError::EmptyServerName);
            }
        }
        validate_namespace(&self.namespace)?;
        if self.backoff.initial.is_zero() {
            return Err(EtcdConfigError::ZeroBackoff);
        }
        if self.backoff.max < self.backoff.initial {
            return Err(EtcdConfigError::BackoffMaxBelowInitial);
        }
        let mut warnings = Vec::new();
        if let Some(auth) = &self.auth {
            if auth.username.is_empty() {
                return Err(EtcdConfigError::EmptyUsername);
            }
            if !secure {
                warnings.push(EtcdConfigWarning::AuthOverPlaintext);
            }
        }
        Ok(warnings)
    }

    /// Why replacing a source running with `self` by one with `new` is needed, if it is
    /// (seed "Reload class"). Only `Backoff` lets the caller keep the current snapshot readable
    /// until the replacement's first resync completes.
    pub fn restart_reason(&self, new: &EtcdSourceConfig) -> Option<EtcdRestartReason> {
        if self.namespace != new.namespace {
            Some(EtcdRestartReason::Namespace)
        } else if self.endpoints != new.endpoints || self.tls != new.tls || self.auth != new.auth {
            Some(EtcdRestartReason::Connection)
        } else if self.backoff != new.backoff {
            Some(EtcdRestartReason::Backoff)
        } else {
            None
        }
    }

    /// The endpoints as URLs: bare `host:port` gains `http://`; anything else the seed forbids
    /// (credentials, paths, queries, fragments, other schemes) is refused.
    pub fn normalized_endpoints(&self) -> Result<Vec<String>, EtcdConfigError> {
        if self.endpoints.is_empty() {
            return Err(EtcdConfigError::NoEndpoints);
        }
        if self.endpoints.len() > MAX_ENDPOINTS {
            return Err(EtcdConfigError::TooManyEndpoints(self.endpoints.len()));
        }
        self.endpoints
            .iter()
            .map(|e| normalize_endpoint(e))
            .collect()
    }
}

/// Which setting forced a source replacement; its label is the `reason` the daemon logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EtcdRestartReason {
    Namespace,
    Connection,
    Backoff,
}

impl EtcdRestartReason {
    pub fn label(self) -> &'static str {
        match self {
            Self::Namespace => "namespace",
            Self::Connection => "connection",
            Self::Backoff => "backoff",
        }
    }
}

/// TLS material, read from disk at the start of every pass so rotated files are picked up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdTls {
    /// PEM bundle of the CA that signs etcd's server certificate (required).
    pub ca_cert: Option<PathBuf>,
    /// PEM client certificate for mutual TLS; set together with `client_key`.
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
    /// Name to verify the server certificate against, when it differs from the endpoint host.
    pub server_name: Option<String>,
}

/// etcd user credentials for the Authenticate RPC.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdAuth {
    pub username: String,
    pub password: String,
}

impl fmt::Debug for EtcdAuth {
    // The password never reaches a log line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdAuth")
            .field("username", &self.username)
            .field("password", &"***")
            .finish()
    }
}

/// A setting that is allowed but deserves an operator's attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EtcdConfigWarning {
    /// The Authenticate RPC and the session token travel in cleartext.
    AuthOverPlaintext,
}

impl fmt::Display for EtcdConfigWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::AuthOverPlaintext => f.write_str(
                "etcd auth over plaintext http: the password and session token travel in cleartext",
            ),
        }
    }
}

/// Why a connection setting is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EtcdConfigError {
    #[error("discovery.etcd.endpoints is empty")]
    NoEndpoints,
    #[error("discovery.etcd.endpoints lists {0} entries; at most {MAX_ENDPOINTS} are allowed")]
    TooManyEndpoints(usize),
    #[error("etcd endpoint {endpoint:?} is invalid: {reason}")]
    BadEndpoint {
        endpoint: String,
        reason: &'static str,
    },
    #[error("etcd endpoints mix http:// and https://")]
    MixedSchemes,
    #[error("an etcd tls block needs https:// endpoints")]
    TlsWithHttp,
    #[error("https:// etcd endpoints need a tls block with ca_cert")]
    HttpsWithoutTls,
    #[error("etcd tls.client_cert and tls.client_key must be set together")]
    HalfIdentity,
    #[error("etcd tls.ca_cert is required: no system trust roots are built in")]
    MissingCaCert,
    #[error("etcd tls.server_name is empty")]
    EmptyServerName,
    #[error("etcd auth.username is empty")]
    EmptyUsername,
    #[error("namespace {0:?} must be non-empty without '/', whitespace or control characters")]
    BadNamespace(String),
    #[error("watch_reconnect_backoff.initial must be above zero")]
    ZeroBackoff,
    #[error("watch_reconnect_backoff.max must be >= initial")]
    BackoffMaxBelowInitial,
}

fn validate_namespace(namespace: &Namespace) -> Result<(), EtcdConfigError> {
    let text = namespace.as_str();
    let bad = text.is_empty()
        || text
            .chars()
            .any(|c| c == '/' || c.is_whitespace() || c.is_control());
    if bad {
        return Err(EtcdConfigError::BadNamespace(text.to_owned()));
    }
    Ok(())
}

fn normalize_endpoint(endpoint: &str) -> Result<String, EtcdConfigError> {
    let bad = |reason| EtcdConfigError::BadEndpoint {
        endpoint: endpoint.to_owned(),
        reason,
    };
    let (scheme, authority) = match endpoint.split_once("://") {
        Some((scheme, rest)) => (scheme, rest),
        None => ("http", endpoint),
    };
    if scheme != "http" && scheme != "https" {
        return Err(bad("the scheme must be http or https"));
    }
    if authority.contains('@') {
        return Err(bad("credentials must not be embedded; use the auth block"));
    }
    if authority.contains(['/', '?', '#']) {
        return Err(bad("paths, queries and fragments are not allowed"));
    }
    if authority
        .chars()
        .any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(bad("whitespace is not allowed"));
    }
    let Some((host, port)) = authority.rsplit_once(':') else {
        return Err(bad("expected host:port"));
    };
    let host_ok = if let Some(inner) = host.strip_prefix('[') {
        inner.strip_suffix(']').is_some_and(|ip| !ip.is_empty())
    } else {
        !host.is_empty() && !host.contains([':', '[', ']'])
    };
    if !host_ok {
        return Err(bad("expected host:port (IPv6 as [::1]:2379)"));
    }
    if !matches!(port.parse::<u16>(), Ok(p) if p != 0) {
        return Err(bad("the port must be 1..=65535"));
    }
    Ok(format!("{scheme}://{authority}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(endpoints: &[&str]) -> EtcdSourceConfig {
        EtcdSourceConfig::new(
            endpoints.iter().map(|e| (*e).to_owned()).collect(),
            Namespace::new("dynamo"),
        )
    }

    fn tls() -> EtcdTls {
        EtcdTls {
            ca_cert: Some("/etc/etcd/ca.pem".into()),
            client_cert: None,
            client_key: None,
            server_name: None,
        }
    }

    #[test]
    fn endpoints_normalise_and_refuse_what_the_seed_forbids() {
        let ok = cfg(&["127.0.0.1:2379", "http://etcd-0:2379", "[::1]:2379"]);
        assert_eq!(
            ok.normalized_endpoints().unwrap(),
            [
                "http://127.0.0.1:2379",
                "http://etcd-0:2379",
                "http://[::1]:2379"
            ]
        );
        for bad in [
            "http://user:pass@etcd:2379",
            "http://user@etcd:2379",
            "http://etcd:2379/",
            "http://etcd:2379?",
            "http://etcd:2379#",
            "http://etcd:2379/v3",
            "grpc://etcd:2379",
            "etcd",
            "http://etcd:0",
            "http://etcd:99999",
            "::1:2379",
            "http://:2379",
            "http://et cd:2379",
        ] {
            assert!(
                matches!(
                    cfg(&[bad]).validate(),
                    Err(EtcdConfigError::BadEndpoint { .. })
                ),
                "{bad} should be refused"
            );
        }
        assert_eq!(cfg(&[]).validate(), Err(EtcdConfigError::NoEndpoints));
        let many: Vec<String> = (0..17).map(|i| format!("etcd-{i}:2379")).collect();
        let too_many = EtcdSourceConfig::new(many, Namespace::new("dynamo"));
        assert_eq!(
            too_many.validate(),
            Err(EtcdConfigError::TooManyEndpoints(17))
        );
    }

    #[test]
    fn schemes_and_tls_must_agree() {
        assert_eq!(
            cfg(&["http://a:1", "https://b:1"]).validate(),
            Err(EtcdConfigError::MixedSchemes)
        );
        let mut c = cfg(&["http://a:1"]);
        c.tls = Some(tls());
        assert_eq!(c.validate(), Err(EtcdConfigError::TlsWithHttp));
        let c = cfg(&["https://a:1"]);
        assert_eq!(c.validate(), Err(EtcdConfigError::HttpsWithoutTls));
        let mut c = cfg(&["https://a:1"]);
        c.tls = Some(EtcdTls {
            client_cert: Some("/c.pem".into()),
            ..tls()
        });
        assert_eq!(c.validate(), Err(EtcdConfigError::HalfIdentity));
        c.tls = Some(EtcdTls {
            ca_cert: None,
            ..tls()
        });
        assert_eq!(c.validate(), Err(EtcdConfigError::MissingCaCert));
        c.tls = Some(tls());
        assert_eq!(c.validate(), Ok(vec![]));
    }

    #[test]
    fn auth_over_plaintext_is_a_warning_and_the_password_is_masked() {
        let auth = EtcdAuth {
            username: "router".into(),
            password: "hunter2".into(),
        };
        assert!(!format!("{auth:?}").contains("hunter2"));
        let mut c = cfg(&["http://a:1"]);
        c.auth = Some(auth.clone());
        assert_eq!(c.validate(), Ok(vec![EtcdConfigWarning::AuthOverPlaintext]));
        let mut c = cfg(&["https://a:1"]);
        c.tls = Some(tls());
        c.auth = Some(auth);
        assert_eq!(c.validate(), Ok(vec![]));
    }

    #[test]
    fn restart_reasons_follow_the_reload_class() {
        let old = cfg(&["a:1"]);
        assert_eq!(old.restart_reason(&old.clone()), None);
        let mut new = old.clone();
        new.backoff.max = Duration::from_secs(60);
        assert_eq!(old.restart_reason(&new), Some(EtcdRestartReason::Backoff));
        new.auth = Some(EtcdAuth {
            username: "u".into(),
            password: "p".into(),
        });
        assert_eq!(
            old.restart_reason(&new),
            Some(EtcdRestartReason::Connection)
        );
        new.namespace = Namespace::new("other");
        assert_eq!(old.restart_reason(&new), Some(EtcdRestartReason::Namespace));
        assert_eq!(EtcdRestartReason::Connection.label(), "connection");
    }

    #[test]
    fn namespace_and_backoff_are_checked() {
        for bad in ["", "a/b", "a b", "a\u{7}"] {
            let mut c = cfg(&["a:1"]);
            c.namespace = Namespace::new(bad);
            assert!(matches!(
                c.validate(),
                Err(EtcdConfigError::BadNamespace(_))
            ));
        }
        let mut c = cfg(&["a:1"]);
        c.backoff.initial = Duration::ZERO;
        assert_eq!(c.validate(), Err(EtcdConfigError::ZeroBackoff));
        c.backoff.initial = Duration::from_secs(60);
        assert_eq!(c.validate(), Err(EtcdConfigError::BackoffMaxBelowInitial));
    }
}
