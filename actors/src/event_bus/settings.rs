//! What the listener runs with: `dynamo.event_bus`, already validated and parsed (the root crate
//! builds it from its config).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use continuum_protocol::event_bus::credential::{Credential, TokenHash};
use continuum_protocol::event_bus::message::ClientId;
use continuum_protocol::event_bus::server::{HELLO_TIMEOUT, ServerConfig};
use continuum_protocol::event_bus::{Grant, SessionBounds};

/// `dynamo.event_bus.tls`: PEM files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BusTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Client certificates chaining here authenticate as the entry their DNS SAN names.
    pub client_ca: Option<PathBuf>,
}

/// One `brokers[]` entry: what it grants and its token hash (if it authenticates by token).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BusEntry {
    pub grant: Grant,
    pub token_hash: Option<TokenHash>,
}

/// The listener's settings.
#[derive(Clone, Debug, PartialEq)]
pub struct BusSettings {
    pub enabled: bool,
    pub listen: SocketAddr,
    pub tls: Option<BusTls>,
    pub entries: Vec<BusEntry>,
    pub max_sessions: u32,
    pub bounds: SessionBounds,
    pub heartbeat_interval: Duration,
    pub idle_timeout: Duration,
    /// How long a session request may wait for its hello (10 s; not a config key — tests
    /// shorten it to reach `hello_timeout` without waiting 10 s).
    pub hello_timeout: Duration,
}

/// The settings whose change needs a new listener (a restart of `root/event_bus`).
#[derive(Clone, Debug, PartialEq)]
pub struct ListenerKey {
    enabled: bool,
    listen: SocketAddr,
    tls: Option<BusTls>,
    bounds: SessionBounds,
}

impl BusSettings {
    pub(crate) fn listener_key(&self) -> ListenerKey {
        ListenerKey {
            enabled: self.enabled,
            listen: self.listen,
            tls: self.tls.clone(),
            bounds: self.bounds,
        }
    }

    /// The default hello timeout.
    pub const HELLO_TIMEOUT: Duration = HELLO_TIMEOUT;

    pub(crate) fn credentials(&self) -> Vec<Credential> {
        self.entries
            .iter()
            .map(|entry| Credential {
                id: entry.grant.id.clone(),
                token_hash: entry.token_hash,
            })
            .collect()
    }

    pub(crate) fn entry(&self, id: &ClientId) -> Option<&BusEntry> {
        self.entries.iter().find(|entry| entry.grant.id == *id)
    }

    pub(crate) fn tls_client_ca(&self) -> Option<&Path> {
        self.tls.as_ref().and_then(|tls| tls.client_ca.as_deref())
    }

    pub(crate) fn server_config(&self) -> ServerConfig {
        let mut config = ServerConfig::new(self.heartbeat_interval, self.idle_timeout, self.bounds);
        config.hello_timeout = self.hello_timeout;
        config
    }
}
