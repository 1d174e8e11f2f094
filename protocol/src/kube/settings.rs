//! `dynamo.discovery.kubernetes` as the Kubernetes sources see it: validation rules and the
//! reload decision (seed "Kubernetes Pod source" → Reload, "Kubernetes metadata source" → Reload).
//!
//! Config parsing lives in the daemon; it maps its typed section onto [`KubeSettings`] and asks
//! here what a change means, so the supervisor's reaction is a pure, tested function.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::ids::Namespace;
use crate::kube::pods::{ModelMapping, PodSourceConfig};

/// Which Kubernetes source runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KubeSourceKind {
    /// `source: kubernetes_pods`.
    Pods,
    /// `source: kubernetes` (DynamoWorkerMetadata ⋈ EndpointSlice).
    Metadata,
}

/// `dynamo_namespace` or `dynamo_namespaces` (mutually exclusive in the YAML).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DynamoNamespaces {
    One(Namespace),
    Many(Vec<Namespace>),
}

impl DynamoNamespaces {
    pub fn as_slice(&self) -> &[Namespace] {
        match self {
            DynamoNamespaces::One(ns) => std::slice::from_ref(ns),
            DynamoNamespaces::Many(list) => list,
        }
    }
}

/// The settings a Kubernetes source depends on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubeSettings {
    pub source: KubeSourceKind,
    /// The fleet's Kubernetes namespace.
    pub namespace: String,
    pub dynamo_namespaces: DynamoNamespaces,
    /// `model` / `models`; required under `kubernetes_pods`, ignored (with a warning) otherwise.
    pub models: Option<ModelMapping>,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
}

impl KubeSettings {
    /// The Pod source's classification config, when this is `kubernetes_pods` with a model.
    pub fn pod_config(&self) -> Option<PodSourceConfig> {
        match (self.source, &self.models) {
            (KubeSourceKind::Pods, Some(models)) => Some(PodSourceConfig {
                namespaces: self.dynamo_namespaces.as_slice().to_vec(),
                models: models.clone(),
            }),
            _ => None,
        }
    }
}

/// One validation finding, with the YAML path it concerns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    pub path: &'static str,
    pub message: String,
    /// Warnings are logged; errors reject the config.
    pub warning: bool,
}

const MAX_NAMESPACES: usize = 16;
const MAX_MODELS: usize = 256;

/// RFC 1123 label: 1–63 of `[a-z0-9-]`, alphanumeric at both ends.
pub fn is_dns1123_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
}

/// A non-empty Kubernetes label value: 1–63 of `[A-Za-z0-9-_.]`, alphanumeric at both ends.
pub fn is_label_value(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
}

/// Every rule of the seed's validation paragraph for the Kubernetes sources.
pub fn validate(settings: &KubeSettings) -> Vec<Finding> {
    let mut out = Vec::new();
    let mut error = |path, message: String| {
        out.push(Finding {
            path,
            message,
            warning: false,
        })
    };
    if !is_dns1123_label(&settings.namespace) {
        error(
            "dynamo.discovery.kubernetes.namespace",
            format!("{:?} is not a DNS-1123 label", settings.namespace),
        );
    }
    let namespaces = settings.dynamo_namespaces.as_slice();
    match &settings.dynamo_namespaces {
        DynamoNamespaces::One(ns) if !is_label_value(ns.as_str()) => error(
            "dynamo.discovery.kubernetes.dynamo_namespace",
            format!("{:?} is not a non-empty label value", ns.as_str()),
        ),
        DynamoNamespaces::Many(list) => {
            let unique: BTreeSet<&Namespace> = list.iter().collect();
            if list.is_empty() || list.len() > MAX_NAMESPACES || unique.len() != list.len() {
                error(
                    "dynamo.discovery.kubernetes.dynamo_namespaces",
                    format!("needs 1 to {MAX_NAMESPACES} unique entries"),
                );
            }
            if let Some(bad) = list.iter().find(|ns| !is_label_value(ns.as_str())) {
                error(
                    "dynamo.discovery.kubernetes.dynamo_namespaces",
                    format!("{:?} is not a non-empty label value", bad.as_str()),
                );
            }
        }
        DynamoNamespaces::One(_) => {}
    }
    match (settings.source, &settings.models) {
        (KubeSourceKind::Metadata, Some(_)) => out.push(Finding {
            path: "dynamo.discovery.kubernetes.model",
            message: "ignored under source: kubernetes (models come from the workers' cards)"
                .into(),
            warning: true,
        }),
        (KubeSourceKind::Metadata, None) => {}
        (KubeSourceKind::Pods, None) => error(
            "dynamo.discovery.kubernetes.model",
            "source: kubernetes_pods needs exactly one of model or models".into(),
        ),
        (KubeSourceKind::Pods, Some(ModelMapping::Single(model))) => {
            if model.is_empty() || model.chars().any(char::is_whitespace) {
                error(
                    "dynamo.discovery.kubernetes.model",
                    format!("{model:?} must be non-empty without whitespace"),
                );
            }
        }
        (KubeSourceKind::Pods, Some(ModelMapping::PerComponent(entries))) => {
            let unique: BTreeSet<(&str, Option<&Namespace>)> = entries
                .iter()
                .map(|e| (e.component.as_str(), e.dynamo_namespace.as_ref()))
                .collect();
            if entries.is_empty() || entries.len() > MAX_MODELS || unique.len() != entries.len() {
                error(
                    "dynamo.discovery.kubernetes.models",
                    format!("needs 1 to {MAX_MODELS} unique component entries"),
                );
            }
            for e in entries {
                if e.component.is_empty()
                    || e.model.is_empty()
                    || e.model.contains(char::is_whitespace)
                {
                    error(
                        "dynamo.discovery.kubernetes.models",
                        format!(
                            "entry {:?} needs a component and a model without whitespace",
                            e.component
                        ),
                    );
                }
                match &e.dynamo_namespace {
                    None if namespaces.len() > 1 => error(
                        "dynamo.discovery.kubernetes.models",
                        format!(
                            "entry {:?} must set dynamo_namespace when several are watched",
                            e.component
                        ),
                    ),
                    Some(ns) if !namespaces.contains(ns) => error(
                        "dynamo.discovery.kubernetes.models",
                        format!(
                            "entry {:?} names an unwatched dynamo_namespace {ns}",
                            e.component
                        ),
                    ),
                    _ => {}
                }
            }
        }
    }
    out
}

/// What the discovery supervisor does about a changed `dynamo.discovery.kubernetes` section.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReloadAction {
    /// Nothing the running watcher depends on changed.
    Keep,
    /// Stop the watcher, empty the registry, start afresh (`reason`: `source`, `namespace`,
    /// `other`).
    Reset { reason: &'static str },
    /// Replace the watcher but keep the snapshot readable until its first resync
    /// (`reason="backoff"`).
    Restart { reason: &'static str },
    /// Prune only the removed namespaces' workers and publishers; kept graphs stay routable while
    /// the replacement watcher resyncs (`reason="namespaces"`).
    Prune { removed: Vec<Namespace> },
}

/// The models configured for one namespace (entries scoped to it, or unscoped ones).
fn models_for(models: &Option<ModelMapping>, ns: &Namespace) -> Option<Vec<(String, String)>> {
    match models.as_ref()? {
        ModelMapping::Single(m) => Some(vec![(String::new(), m.clone())]),
        ModelMapping::PerComponent(entries) => {
            let mut v: Vec<(String, String)> = entries
                .iter()
                .filter(|e| e.dynamo_namespace.as_ref().is_none_or(|n| n == ns))
                .map(|e| (e.component.clone(), e.model.clone()))
                .collect();
            v.sort();
            Some(v)
        }
    }
}

/// The seed's reload rules for the Kubernetes sources.
pub fn reload_action(old: &KubeSettings, new: &KubeSettings) -> ReloadAction {
    if old.source != new.source {
        return ReloadAction::Reset { reason: "source" };
    }
    if old.namespace != new.namespace {
        return ReloadAction::Reset {
            reason: "namespace",
        };
    }
    let pods = new.source == KubeSourceKind::Pods;
    let namespaces_changed = old.dynamo_namespaces != new.dynamo_namespaces;
    if namespaces_changed {
        let (DynamoNamespaces::Many(before), DynamoNamespaces::Many(after)) =
            (&old.dynamo_namespaces, &new.dynamo_namespaces)
        else {
            // Editing the scalar (or switching forms) is a namespace edit.
            return ReloadAction::Reset {
                reason: "namespace",
            };
        };
        let kept_models_same = after
            .iter()
            .filter(|ns| before.contains(ns))
            .all(|ns| !pods || models_for(&old.models, ns) == models_for(&new.models, ns));
        if !kept_models_same {
            return ReloadAction::Reset { reason: "other" };
        }
        let mut removed: Vec<Namespace> = before
            .iter()
            .filter(|ns| !after.contains(ns))
            .cloned()
            .collect();
        removed.sort();
        return ReloadAction::Prune { removed };
    }
    if pods && old.models != new.models {
        return ReloadAction::Reset { reason: "other" };
    }
    if old.backoff_initial != new.backoff_initial || old.backoff_max != new.backoff_max {
        return ReloadAction::Restart { reason: "backoff" };
    }
    ReloadAction::Keep
}

#[cfg(test)]
#[path = "settings_tests.rs"]
mod tests;
