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

/// For a config imported from a masked readback (Admin import, edited `config show` output):
/// every secret still equal to [`MASK`] takes the live config's value, so a round trip does
/// not overwrite secrets with asterisks. API keys are matched by `name`, brokers by `id`.
///
/// A masked etcd password is reused even when the endpoints changed; the reference documents
/// this, and operators should only point such an import at a trusted cluster over TLS.
pub fn restore_masked(imported: &mut Config, live: &Config) {
    if imported.admin.token.as_deref() == Some(MASK) {
        imported.admin.token.clone_from(&live.admin.token);
    }
    for api_key in &mut imported.api_keys {
        if api_key.key == MASK
            && let Some(old) = live.api_keys.iter().find(|old| old.name == api_key.name)
        {
            api_key.key.clone_from(&old.key);
        }
    }
    let live_etcd = &live.dynamo.discovery.etcd;
    let etcd = &mut imported.dynamo.discovery.etcd;
    if let (Some(auth), Some(live_auth)) = (etcd.auth.as_mut(), live_etcd.auth.as_ref())
        && auth.password == MASK
    {
        auth.password.clone_from(&live_auth.password);
    }
    if let Some(tls) = etcd.tls.as_mut()
        && tls.client_key.as_deref() == Some(std::path::Path::new(MASK))
    {
        tls.client_key = live_etcd
            .tls
            .as_ref()
            .and_then(|tls| tls.client_key.clone());
    }
    let live_bus = &live.dynamo.event_bus;
    let bus = &mut imported.dynamo.event_bus;
    if let Some(tls) = bus.tls.as_mut()
        && tls.key.as_deref() == Some(std::path::Path::new(MASK))
    {
        tls.key = live_bus.tls.as_ref().and_then(|tls| tls.key.clone());
    }
    for broker in &mut bus.brokers {
        if broker.token_hash.as_deref() == Some(MASK) {
            broker.token_hash = live_bus
                .brokers
                .iter()
                .find(|old| old.id == broker.id)
                .and_then(|old| old.token_hash.clone());
        }
    }
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
