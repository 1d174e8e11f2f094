//! `dynamo.event_bus`: the listener, its bounds and the `brokers[]` grants.

use std::collections::BTreeSet;

use super::values::{is_broker_id, listeners_collide};

use super::*;

impl Validator {
    /// In this order (diagnostics keep document order): the listener, its bounds, the brokers.
    pub(super) fn event_bus(&mut self, config: &Config) {
        self.event_bus_listener(config);
        self.event_bus_bounds(&config.dynamo.event_bus);
        self.event_bus_brokers(config);
    }

    /// `transport: broker` needs the bus; an enabled bus needs Dynamo, its own port, TLS and
    /// brokers.
    fn event_bus_listener(&mut self, config: &Config) {
        let bus = &config.dynamo.event_bus;
        let base = "dynamo.event_bus";
        if config.dynamo.load.transport == LoadTransport::Broker && !bus.enabled {
            self.err(
                "dynamo.load.transport",
                "transport is broker but dynamo.event_bus.enabled is false: no broker could ever \
                 carry a load or KV subscription (the router never falls back to dialling \
                 publishers directly); enable dynamo.event_bus or use transport: direct",
            );
        }
        if bus.enabled {
            if !config.dynamo.enabled {
                self.warn(
                    format!("{base}.enabled"),
                    "the event bus listens but dynamo.enabled is false, so nothing subscribes",
                );
            }
            if listeners_collide(bus.listen, config.server.bind_address) {
                self.err(
                    format!("{base}.listen"),
                    format!(
                        "{} collides with server.bind_address {}",
                        bus.listen, config.server.bind_address
                    ),
                );
            }
            match &bus.tls {
                None => self.err(
                    format!("{base}.tls"),
                    "the event bus is TLS-only: tls.cert and tls.key are required when enabled",
                ),
                Some(tls) => {
                    if tls.cert.as_ref().is_none_or(|p| p.as_os_str().is_empty()) {
                        self.err(
                            format!("{base}.tls.cert"),
                            "tls.cert is required when enabled",
                        );
                    }
                    if tls.key.as_ref().is_none_or(|p| p.as_os_str().is_empty()) {
                        self.err(
                            format!("{base}.tls.key"),
                            "tls.key is required when enabled",
                        );
                    }
                }
            }
            if bus.brokers.is_empty() {
                self.warn(
                    format!("{base}.brokers"),
                    "no brokers are configured, so no client can authenticate",
                );
            }
        }
    }

    /// Sessions, streams, buffers, heartbeats and the number of brokers.
    fn event_bus_bounds(&mut self, bus: &EventBusConfig) {
        let base = "dynamo.event_bus";
        if bus.max_sessions == 0 || bus.max_sessions > MAX_EVENT_BUS_SESSIONS {
            self.err(
                format!("{base}.max_sessions"),
                format!("max_sessions must be in 1..={MAX_EVENT_BUS_SESSIONS}"),
            );
        }
        if bus.max_streams_per_session == 0 || bus.max_streams_per_session > MAX_STREAMS_PER_SESSION
        {
            self.err(
                format!("{base}.max_streams_per_session"),
                format!("max_streams_per_session must be in 1..={MAX_STREAMS_PER_SESSION}"),
            );
        }
        let floor = u64::from(bus.max_streams_per_session) * MIN_STREAM_BUFFER_BYTES;
        if bus.max_session_buffer_bytes < floor {
            self.err(
                format!("{base}.max_session_buffer_bytes"),
                format!(
                    "must be at least max_streams_per_session * 64 KiB = {floor} bytes \
                     (16 KiB per direction-reservation per stream)"
                ),
            );
        }
        if bus.max_session_buffer_bytes > continuum_protocol::event_bus::bounds::MAX_HTTP2_WINDOW {
            self.err(
                format!("{base}.max_session_buffer_bytes"),
                format!(
                    "must be at most {} bytes: it is the HTTP/2 connection window",
                    continuum_protocol::event_bus::bounds::MAX_HTTP2_WINDOW
                ),
            );
        }
        if bus.heartbeat_interval.get().is_zero() {
            self.err(
                format!("{base}.heartbeat_interval"),
                "must be greater than 0",
            );
        }
        if bus.idle_timeout <= bus.heartbeat_interval {
            self.err(
                format!("{base}.idle_timeout"),
                format!(
                    "idle_timeout ({}) must exceed heartbeat_interval ({}) or healthy \
                     sessions would be closed",
                    bus.idle_timeout, bus.heartbeat_interval
                ),
            );
        }
        if bus.brokers.len() > MAX_BROKERS {
            self.err(
                format!("{base}.brokers"),
                format!(
                    "{} entries given; at most {MAX_BROKERS} are accepted",
                    bus.brokers.len()
                ),
            );
        }
    }

    /// Each `brokers[]` entry: a unique id, a credential, and the grants of its role.
    fn event_bus_brokers(&mut self, config: &Config) {
        let bus = &config.dynamo.event_bus;
        let base = "dynamo.event_bus";
        let has_client_ca = bus.tls.as_ref().is_some_and(|tls| tls.client_ca.is_some());
        let mut ids = BTreeSet::new();
        for (i, broker) in bus.brokers.iter().enumerate() {
            let path = format!("{base}.brokers[{i}]");
            if !is_broker_id(&broker.id) {
                self.err(
                    format!("{path}.id"),
                    "id must be a lowercase DNS name (it is matched against client certificate \
                     DNS SANs; no wildcards)",
                );
            } else if !ids.insert(broker.id.as_str()) {
                self.err(
                    format!("{path}.id"),
                    format!("id {:?} is used twice", broker.id),
                );
            }
            match &broker.token_hash {
                Some(hash) if !is_prefixed_hex(hash, "sha256:") => self.err(
                    format!("{path}.token_hash"),
                    "token_hash is \"sha256:<64 lowercase hex>\" of the token \
                     (printf %s \"$TOKEN\" | sha256sum), never the token itself",
                ),
                None if !has_client_ca => self.err(
                    format!("{path}.token_hash"),
                    "entry has no credential: set token_hash or dynamo.event_bus.tls.client_ca",
                ),
                _ => {}
            }
            self.broker_grants(config, &path, broker);
        }
    }

    /// A broker is granted Dynamo namespaces, a kv_listener backends.
    fn broker_grants(&mut self, config: &Config, path: &str, broker: &BrokerConfig) {
        let namespaces = config.dynamo.discovery.namespace_names();
        match broker.role {
            BrokerRole::Broker => {
                if !broker.backends.is_empty() {
                    self.err(
                        format!("{path}.backends"),
                        "backends grants apply to role kv_listener; a broker is granted \
                             namespaces",
                    );
                }
                if broker.namespaces.is_empty() {
                    self.warn(
                        format!("{path}.namespaces"),
                        "empty namespaces allowlist: this broker may serve any Dynamo \
                             namespace",
                    );
                }
                for (j, namespace) in broker.namespaces.iter().enumerate() {
                    if let Err(message) = check_namespace(namespace) {
                        self.err(format!("{path}.namespaces[{j}]"), message);
                    } else if !namespaces.contains(namespace) {
                        self.warn(
                            format!("{path}.namespaces[{j}]"),
                            format!("{namespace:?} is not a configured Dynamo namespace"),
                        );
                    }
                }
            }
            BrokerRole::KvListener => {
                if !broker.namespaces.is_empty() {
                    self.err(
                        format!("{path}.namespaces"),
                        "role kv_listener is granted backends, not namespaces",
                    );
                }
                if broker.backends.is_empty() {
                    self.err(
                        format!("{path}.backends"),
                        "role kv_listener needs at least one granted backend",
                    );
                }
                for (j, backend) in broker.backends.iter().enumerate() {
                    if config.backend(backend).is_none() {
                        self.warn(
                            format!("{path}.backends[{j}]"),
                            format!("backend {backend:?} is not defined in backends[]"),
                        );
                    }
                }
            }
        }
    }
}
