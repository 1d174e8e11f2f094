//! The router's event bus (`dynamo.event_bus`): what the listener runs with, built from the
//! validated config. The listener, `BrokerSupervisor`, `BrokerSessionActor`, the [`EventBus`]
//! command API and [`BusStream`] live in `continuum_actors::event_bus`; the wire contract in
//! `continuum_protocol::event_bus` (docs/event-bus.md).

use std::collections::BTreeSet;

/// The listener's subtree (`root/event_bus`): compiled with `dynamo-event-bus` only.
#[cfg(feature = "dynamo-event-bus")]
pub use continuum_actors::event_bus::event_bus_spec;
use continuum_actors::event_bus::{BusEntry, BusTls};
pub use continuum_actors::event_bus::{
    BusSettings, BusStream, BusStreamError, EventBus, SessionInfo, SessionsView,
};
use continuum_protocol::event_bus::credential::TokenHash;
use continuum_protocol::event_bus::message::{ClientId, Role};
use continuum_protocol::event_bus::{Grant, SessionBounds};
use continuum_protocol::ids::Namespace;
use tracing::error;

use crate::config::{BrokerRole, Config, EventBusConfig, LoadTransport};

/// The listener settings for `config` (validated: token hashes parse, bounds hold). A
/// configuration whose byte bounds are rejected (validation refuses it first) yields a
/// disabled listener rather than a guessed one.
pub fn settings(config: &EventBusConfig) -> BusSettings {
    let bounds = SessionBounds::new(
        config.max_session_buffer_bytes,
        config.max_streams_per_session,
    );
    let enabled = config.enabled && bounds.is_ok();
    let bounds = bounds.unwrap_or_else(|error| {
        error!(%error, "dynamo.event_bus byte bounds are rejected; the listener stays off.");
        SessionBounds {
            max_session_buffer_bytes: 64 * 1024 * 1024,
            max_streams_per_session: 1024,
            stream_buffer_bytes: 16 * 1024,
        }
    });
    BusSettings {
        enabled,
        listen: config.listen,
        tls: config.tls.as_ref().and_then(|tls| {
            Some(BusTls {
                cert: tls.cert.clone()?,
                key: tls.key.clone()?,
                client_ca: tls.client_ca.clone(),
            })
        }),
        entries: config
            .brokers
            .iter()
            .map(|broker| BusEntry {
                grant: Grant {
                    id: ClientId::new(broker.id.clone()),
                    role: match broker.role {
                        BrokerRole::Broker => Role::Broker,
                        BrokerRole::KvListener => Role::KvListener,
                    },
                    namespaces: broker
                        .namespaces
                        .iter()
                        .map(|ns| Namespace::new(ns.clone()))
                        .collect::<BTreeSet<_>>(),
                    backends: broker.backends.iter().cloned().collect(),
                },
                token_hash: broker.token_hash.as_deref().and_then(TokenHash::parse),
            })
            .collect(),
        max_sessions: config.max_sessions,
        bounds,
        heartbeat_interval: config.heartbeat_interval.get(),
        idle_timeout: config.idle_timeout.get(),
        hello_timeout: BusSettings::HELLO_TIMEOUT,
    }
}

/// The namespaces the broker coverage gauges are exported for: every configured discovery
/// namespace under `dynamo.enabled` and `dynamo.load.transport: broker`, none otherwise.
pub fn coverage_namespaces(config: &Config) -> Vec<Namespace> {
    if config.dynamo.enabled && config.dynamo.load.transport == LoadTransport::Broker {
        config.dynamo.discovery.namespaces()
    } else {
        Vec::new()
    }
}

/// Under `dynamo.load.transport: broker`, adds `broker_coverage` to a `GET /admin/dynamo/workers`
/// body: for every configured namespace, whether a live, non-draining broker session covers it
/// (`covered`), those sessions' ids (`brokers`), and how many broker-transport subscriptions wait
/// there for one (`pending_subscriptions`). Uncovered namespaces are where subscriptions stay
/// pending and workers read as stale.
pub fn add_broker_coverage(view: &mut serde_json::Value, bus: &EventBus, config: &Config) {
    if config.dynamo.load.transport != LoadTransport::Broker {
        return;
    }
    let Some(fields) = view.as_object_mut() else {
        return;
    };
    let namespaces: Vec<String> = fields
        .get("namespaces")
        .and_then(|v| v.as_array())
        .map(|list| {
            list.iter()
                .filter_map(|n| n.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    let coverage: Vec<serde_json::Value> = namespaces
        .into_iter()
        .map(|namespace| {
            let seen = bus.namespace_coverage(&Namespace::new(namespace.clone()));
            let brokers: Vec<&str> = seen.brokers.iter().map(ClientId::as_str).collect();
            serde_json::json!({
                "namespace": namespace,
                "covered": !brokers.is_empty(),
                "brokers": brokers,
                "pending_subscriptions": seen.pending_subscriptions,
            })
        })
        .collect();
    fields.insert("broker_coverage".into(), serde_json::Value::from(coverage));
}
