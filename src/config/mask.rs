//! `config show`: the effective configuration (defaults filled in) as YAML, secrets masked.
//!
//! Masked: `admin.token`, `api_keys[].key`, `dynamo.discovery.etcd.auth.password`,
//! `dynamo.discovery.etcd.tls.client_key`, `dynamo.event_bus.tls.key` and
//! `dynamo.event_bus.brokers[].token_hash`. Certificate and CA paths stay readable so an
//! operator can check which files are in use.

use std::path::PathBuf;

use super::schema::Config;

/// What a masked secret reads as.
pub const MASK: &str = "********";

/// A copy of `config` with every secret replaced by [`MASK`] (unset secrets stay unset).
pub fn masked(config: &Config) -> Config {
    let mut out = config.clone();
    if let Some(token) = out.admin.token.as_mut() {
        *token = MASK.to_owned();
    }
    for api_key in &mut out.api_keys {
        api_key.key = MASK.to_owned();
    }
    let etcd = &mut out.dynamo.discovery.etcd;
    if let Some(auth) = etcd.auth.as_mut() {
        auth.password = MASK.to_owned();
    }
    if let Some(key) = etcd.tls.as_mut().and_then(|tls| tls.client_key.as_mut()) {
        *key = PathBuf::from(MASK);
    }
    let bus = &mut out.dynamo.event_bus;
    if let Some(key) = bus.tls.as_mut().and_then(|tls| tls.key.as_mut()) {
        *key = PathBuf::from(MASK);
    }
    for broker in &mut bus.brokers {
        if let Some(hash) = broker.token_hash.as_mut() {
            *hash = MASK.to_owned();
        }
    }
    out
}

/// The effective config as YAML with secrets masked.
pub fn show_effective(config: &Config) -> String {
    match serde_saphyr::to_string(&masked(config)) {
        Ok(yaml) => yaml,
        // Every field of Config serialises (no maps with non-string keys, no non-finite floats
        // after validation); report rather than panic if that ever changes.
        Err(error) => format!("# could not render the effective config: {error}\n"),
    }
}
