//! `replica_sync` → the `ReplicaSyncActor`'s settings (the `replica-sync` Cargo feature).

use continuum_actors::replica_sync::{NatsAuth, ReplicaSyncSettings};
use continuum_protocol::replica_sync::PeerLimits;

use crate::config::Config;

/// The actor's settings, `None` while the (effective) config has the sync off.
pub(super) fn settings(config: &Config) -> Option<ReplicaSyncSettings> {
    let rs = &config.replica_sync;
    if !rs.enabled || !config.dynamo.enabled {
        return None;
    }
    let nats = &rs.nats;
    let auth = if let Some(path) = &nats.credentials_file {
        NatsAuth::Credentials(path.clone())
    } else if let (Some(user), Some(password_file)) = (&nats.user, &nats.password_file) {
        NatsAuth::UserPassword {
            user: user.clone(),
            password_file: password_file.clone(),
        }
    } else if let Some(path) = &nats.token_file {
        NatsAuth::Token(path.clone())
    } else {
        NatsAuth::None
    };
    let tls = nats.tls.as_ref();
    Some(ReplicaSyncSettings {
        replica_id: rs.resolved_replica_id(|k| std::env::var(k).ok()),
        subject: rs.subject(),
        url: nats.url.clone(),
        connect_timeout: nats.connect_timeout.get(),
        reconnect_max_delay: nats.reconnect_max_delay.get(),
        tls_ca: tls.and_then(|t| t.ca_file.clone()),
        tls_client: tls.and_then(|t| t.cert_file.clone().zip(t.key_file.clone())),
        tls_required: tls.is_some() || nats.url.trim_start().starts_with("tls://"),
        auth,
        publish_interval: rs.publish_interval.get(),
        heartbeat_interval: rs.heartbeat_interval.get(),
        limits: PeerLimits {
            max_peers: rs.max_peers,
            max_entries_per_peer: rs.max_entries_per_peer,
            ttl: rs.ttl.get(),
        },
    })
}
