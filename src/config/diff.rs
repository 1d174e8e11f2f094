//! Reload classification: what an old → new config change means for the running daemon.
//!
//! Startup and reload share one path (diff the previous config, act on the diff). Classes follow
//! the reference's reload rules:
//! - immediate: `dynamo.load.max_staleness`, `dynamo.load.tie_break_window`,
//!   `dynamo.load.peer_slots`, `dynamo.shim.*`, `dynamo.kv.*`, `api_keys`, `backends`, `admin`, `disaggregated_serving` — read on the next
//!   request or freshness check;
//! - restart subscriptions: `dynamo.load.transport`, `dynamo.load.direct_allow_cidrs`,
//!   `dynamo.kv.enabled` — only the load and KV subscription tasks restart, under the new dial
//!   policy (turning KV indexing on or off starts or stops the kv-events subscriptions);
//! - discovery: `dynamo.enabled` and the active source's `dynamo.discovery.*` settings — the
//!   watcher is replaced with a reason (see [`RestartReason`]) or stopped;
//! - event bus: `dynamo.event_bus.*` — the listener supervisor applies it;
//! - replica sync: `replica_sync.*` — only `root/replica_sync` restarts (the peers'
//!   contributions are withdrawn and learnt again from their next snapshots);
//! - needs restart: `server.*`, `telemetry.*` — reported, applied at the next process start;
//! - no effect: settings of an inactive source, or `kubernetes.model(s)` under source
//!   `kubernetes` (which reads models from worker cards).

use std::collections::BTreeSet;

use serde::Serialize;
use serde_json::Value;

use super::schema::{ComponentModel, Config, DiscoveryConfig, DiscoverySource};
use super::validate::normalize_endpoint;
use super::{PathSeg, format_path};

/// How one changed key takes effect.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReloadClass {
    Immediate,
    RestartSubscriptions,
    Discovery,
    EventBus,
    ReplicaSync,
    NeedsRestart,
    NoEffect,
}

/// The `reason` label of a discovery watcher replacement
/// (`continuum_dynamo_discovery_events_total{kind="restart"}` is incremented once per restart).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RestartReason {
    Enabled,
    Namespace,
    Connection,
    Backoff,
    Source,
    Namespaces,
    Other,
}

impl RestartReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Enabled => "enabled",
            Self::Namespace => "namespace",
            Self::Connection => "connection",
            Self::Backoff => "backoff",
            Self::Source => "source",
            Self::Namespaces => "namespaces",
            Self::Other => "other",
        }
    }
}

/// What the discovery supervisor must do.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DiscoveryAction {
    /// Discovery was disabled: stop the watcher (logged, not counted as a restart).
    Stop,
    /// Start (reason `enabled`) or replace the watcher.
    Restart {
        reason: RestartReason,
        /// Backoff-only change: keep serving the current snapshot until the replacement's first
        /// full resync instead of resetting the registry.
        keep_snapshot: bool,
        /// Reason `namespaces`: prune these namespaces' workers and publishers; kept
        /// namespaces stay routable while the replacement resyncs.
        removed_namespaces: Vec<String>,
        /// Reason `namespaces`: namespaces the replacement starts watching.
        added_namespaces: Vec<String>,
    },
}

/// One changed key (leaf, or a whole list whose length changed).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Change {
    pub path: String,
    pub class: ReloadClass,
}

/// The classified difference between two configs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ReloadPlan {
    /// Every changed key with its class, in document order.
    pub changes: Vec<Change>,
    /// `None` when the discovery watcher is untouched.
    pub discovery: Option<DiscoveryAction>,
    /// The dial policy changed: `dynamo.load.transport`, `dynamo.load.direct_allow_cidrs`, or
    /// whether kv-events are subscribed (`dynamo.kv.enabled`, or `dynamo.enabled` under it).
    pub restart_subscriptions: bool,
    /// The tokenizer-artifact loader's inputs changed (`dynamo.enabled`, `dynamo.kv.enabled`,
    /// `pinned_artifacts`, `allow_http_artifacts`, `allow_hf_artifacts`, `artifact_cache_dir`).
    pub kv_artifacts: bool,
    /// Something under `dynamo.event_bus` changed.
    pub event_bus: bool,
    /// Something under `replica_sync` changed.
    pub replica_sync: bool,
    /// Changed keys that apply only after a process restart (`server.*`, `telemetry.*`).
    pub needs_restart: Vec<String>,
}

impl ReloadPlan {
    pub fn is_empty(&self) -> bool {
        self.changes.is_empty()
    }

    /// Paths of changes in one class.
    pub fn paths(&self, class: ReloadClass) -> Vec<&str> {
        self.changes
            .iter()
            .filter(|change| change.class == class)
            .map(|change| change.path.as_str())
            .collect()
    }
}

/// Classifies the change from `old` to `new`.
pub fn diff(old: &Config, new: &Config) -> ReloadPlan {
    let discovery = discovery_action(old, new);
    let (old_value, new_value) = match (serde_json::to_value(old), serde_json::to_value(new)) {
        (Ok(old_value), Ok(new_value)) => (old_value, new_value),
        // Config always serialises to JSON (string keys only); if that ever breaks, treat the
        // reload as needing a restart rather than silently applying nothing.
        _ => {
            return ReloadPlan {
                needs_restart: vec!["<root>".to_owned()],
                changes: vec![Change {
                    path: "<root>".to_owned(),
                    class: ReloadClass::NeedsRestart,
                }],
                ..ReloadPlan::default()
            };
        }
    };
    let mut paths = Vec::new();
    changed_paths(&old_value, &new_value, &mut Vec::new(), &mut paths);

    let mut plan = ReloadPlan {
        discovery,
        restart_subscriptions: kv_events(old) != kv_events(new),
        kv_artifacts: artifact_inputs(old) != artifact_inputs(new),
        ..ReloadPlan::default()
    };
    for path in paths {
        let class = classify(&path, old, new, plan.discovery.is_some());
        match class {
            ReloadClass::RestartSubscriptions => plan.restart_subscriptions = true,
            ReloadClass::EventBus => plan.event_bus = true,
            ReloadClass::ReplicaSync => plan.replica_sync = true,
            ReloadClass::NeedsRestart => plan.needs_restart.push(path.clone()),
            ReloadClass::Immediate | ReloadClass::Discovery | ReloadClass::NoEffect => {}
        }
        plan.changes.push(Change { path, class });
    }
    plan
}

/// Whether kv-events publishers are subscribed (part of the dial policy).
fn kv_events(config: &Config) -> bool {
    config.dynamo.enabled && config.dynamo.kv.enabled
}

/// What the tokenizer-artifact loader is configured from.
fn artifact_inputs(config: &Config) -> (bool, &[String], bool, bool, &std::path::Path) {
    let kv = &config.dynamo.kv;
    (
        kv_events(config),
        &kv.pinned_artifacts,
        kv.allow_http_artifacts,
        kv.allow_hf_artifacts,
        &kv.artifact_cache_dir,
    )
}

fn classify(path: &str, old: &Config, new: &Config, discovery_acts: bool) -> ReloadClass {
    let under = |prefix: &str| {
        path == prefix
            || path
                .strip_prefix(prefix)
                .is_some_and(|rest| rest.starts_with('.') || rest.starts_with('['))
    };
    if under("server") || under("telemetry") {
        return ReloadClass::NeedsRestart;
    }
    if under("dynamo.load.transport")
        || under("dynamo.load.direct_allow_cidrs")
        || under("dynamo.kv.enabled")
    {
        return ReloadClass::RestartSubscriptions;
    }
    if under("dynamo.event_bus") {
        return ReloadClass::EventBus;
    }
    if under("replica_sync") {
        return ReloadClass::ReplicaSync;
    }
    if under("dynamo.enabled") || under("dynamo.discovery") {
        let active = [old, new].iter().any(|config| {
            let discovery = &config.dynamo.discovery;
            let section = match discovery.source {
                DiscoverySource::Etcd | DiscoverySource::Simulated => "dynamo.discovery.etcd",
                DiscoverySource::Kubernetes | DiscoverySource::KubernetesPods => {
                    "dynamo.discovery.kubernetes"
                }
                DiscoverySource::File => "dynamo.discovery.file",
            };
            let model_key = under("dynamo.discovery.kubernetes.model")
                || under("dynamo.discovery.kubernetes.models");
            under("dynamo.enabled")
                || under("dynamo.discovery.source")
                || (under(section)
                    && !(model_key && discovery.source == DiscoverySource::Kubernetes))
        });
        return if discovery_acts && active {
            ReloadClass::Discovery
        } else {
            ReloadClass::NoEffect
        };
    }
    ReloadClass::Immediate
}

fn changed_paths(old: &Value, new: &Value, path: &mut Vec<PathSeg>, out: &mut Vec<String>) {
    match (old, new) {
        (Value::Object(a), Value::Object(b)) => {
            let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for key in keys {
                path.push(PathSeg::Key(key.clone()));
                match (a.get(key), b.get(key)) {
                    (Some(x), Some(y)) => changed_paths(x, y, path, out),
                    _ => out.push(format_path(path)),
                }
                path.pop();
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (index, (x, y)) in a.iter().zip(b).enumerate() {
                path.push(PathSeg::Index(index));
                changed_paths(x, y, path, out);
                path.pop();
            }
        }
        _ => {
            if old != new {
                out.push(format_path(path));
            }
        }
    }
}

fn discovery_action(old: &Config, new: &Config) -> Option<DiscoveryAction> {
    match (old.dynamo.enabled, new.dynamo.enabled) {
        (false, false) => None,
        (true, false) => Some(DiscoveryAction::Stop),
        (false, true) => Some(restart(RestartReason::Enabled)),
        (true, true) => watcher_change(&old.dynamo.discovery, &new.dynamo.discovery),
    }
}

fn restart(reason: RestartReason) -> DiscoveryAction {
    DiscoveryAction::Restart {
        reason,
        keep_snapshot: false,
        removed_namespaces: Vec::new(),
        added_namespaces: Vec::new(),
    }
}

fn watcher_change(old: &DiscoveryConfig, new: &DiscoveryConfig) -> Option<DiscoveryAction> {
    if old.source != new.source {
        return Some(restart(RestartReason::Source));
    }
    let source = new.source;
    if source.is_kubernetes() && old.kubernetes.namespace != new.kubernetes.namespace {
        return Some(restart(RestartReason::Namespace));
    }
    let old_ns = old.namespace_names();
    let new_ns = new.namespace_names();
    let old_set: BTreeSet<&String> = old_ns.iter().collect();
    let new_set: BTreeSet<&String> = new_ns.iter().collect();
    let kept: BTreeSet<&String> = old_set.intersection(&new_set).copied().collect();
    if old_set != new_set && kept.is_empty() {
        return Some(restart(RestartReason::Namespace));
    }
    if source == DiscoverySource::Etcd && etcd_connection_changed(old, new) {
        return Some(restart(RestartReason::Connection));
    }
    if source == DiscoverySource::File && old.file.root != new.file.root {
        return Some(restart(RestartReason::Connection));
    }
    let models_changed = |only: Option<&BTreeSet<&String>>| {
        source == DiscoverySource::KubernetesPods
            && (old.kubernetes.model != new.kubernetes.model
                || scoped_models(&old.kubernetes.models, only)
                    != scoped_models(&new.kubernetes.models, only))
    };
    if old_set != new_set {
        if models_changed(Some(&kept)) {
            return Some(restart(RestartReason::Other));
        }
        return Some(DiscoveryAction::Restart {
            reason: RestartReason::Namespaces,
            keep_snapshot: false,
            removed_namespaces: old_ns
                .iter()
                .filter(|ns| !new_set.contains(ns))
                .cloned()
                .collect(),
            added_namespaces: new_ns
                .iter()
                .filter(|ns| !old_set.contains(ns))
                .cloned()
                .collect(),
        });
    }
    if old_ns != new_ns || models_changed(None) {
        // Same set in a new order changes the primary namespace.
        return Some(restart(RestartReason::Other));
    }
    if source == DiscoverySource::File
        && (old.file.ttl != new.file.ttl || old.file.rescan_interval != new.file.rescan_interval)
    {
        // The replacement rescans at once: keep serving the current snapshot until then.
        return Some(DiscoveryAction::Restart {
            reason: RestartReason::Other,
            keep_snapshot: true,
            removed_namespaces: Vec::new(),
            added_namespaces: Vec::new(),
        });
    }
    if old.watch_reconnect_backoff() != new.watch_reconnect_backoff() {
        return Some(DiscoveryAction::Restart {
            reason: RestartReason::Backoff,
            keep_snapshot: true,
            removed_namespaces: Vec::new(),
            added_namespaces: Vec::new(),
        });
    }
    None
}

fn etcd_connection_changed(old: &DiscoveryConfig, new: &DiscoveryConfig) -> bool {
    let endpoints = |config: &DiscoveryConfig| -> Vec<String> {
        config
            .etcd
            .endpoints
            .iter()
            .map(|endpoint| normalize_endpoint(endpoint))
            .collect()
    };
    endpoints(old) != endpoints(new)
        || old.etcd.tls != new.etcd.tls
        || old.etcd.auth != new.etcd.auth
}

/// The models entries that apply to `only` (entries without a namespace apply everywhere),
/// sorted so that reordering the list is not a change.
fn scoped_models<'a>(
    models: &'a [ComponentModel],
    only: Option<&BTreeSet<&String>>,
) -> Vec<&'a ComponentModel> {
    let mut out: Vec<&ComponentModel> = models
        .iter()
        .filter(|entry| match (only, &entry.dynamo_namespace) {
            (Some(kept), Some(ns)) => kept.contains(ns),
            _ => true,
        })
        .collect();
    out.sort();
    out
}

#[cfg(test)]
mod tests;
