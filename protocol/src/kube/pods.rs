//! The `kubernetes_pods` source's decisions: which operator-labelled Pods are workers, in which
//! role, serving which model, and the bounded set of Pods held between watch events.
//!
//! Pods carry no model cards or event channels, so members have no capacity and no load signal
//! (`signals: {load: false, capacity: false}`); the model comes from configuration.

use std::collections::{BTreeMap, BTreeSet};

use crate::ids::{InstanceId, Namespace, WorkerKey};
use crate::kube::hash::hash_pod_name;
use crate::kube::labels;
use crate::kube::objects::Pod;
use crate::kube::{MAX_HELD_OBJECTS, Signals};

/// Pods carry neither load publishers nor capacities.
pub const POD_SIGNALS: Signals = Signals {
    load: false,
    capacity: false,
};

/// A worker's role as the Pod labels state it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PodRole {
    Prefill,
    Decode,
    Aggregated,
}

impl PodRole {
    pub fn as_str(self) -> &'static str {
        match self {
            PodRole::Prefill => "prefill",
            PodRole::Decode => "decode",
            PodRole::Aggregated => "aggregated",
        }
    }
}

/// One `kubernetes.models` entry: Pods whose `nvidia.com/dynamo-component` equals `component`
/// (case-sensitive) serve `model`; `dynamo_namespace` narrows the entry when several are watched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ComponentModel {
    pub component: String,
    pub model: String,
    pub dynamo_namespace: Option<Namespace>,
}

/// `kubernetes.model` or `kubernetes.models` (validation guarantees exactly one).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelMapping {
    Single(String),
    PerComponent(Vec<ComponentModel>),
}

/// What the classification needs from `dynamo.discovery.kubernetes`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodSourceConfig {
    /// `dynamo_namespace`, or the `dynamo_namespaces` list.
    pub namespaces: Vec<Namespace>,
    pub models: ModelMapping,
}

/// A ready worker Pod the registry should hold.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PodMember {
    pub namespace: Namespace,
    pub instance_id: InstanceId,
    pub role: PodRole,
    pub model: String,
    pub component: Option<String>,
    pub pod_name: String,
}

impl PodMember {
    pub fn key(&self) -> WorkerKey {
        WorkerKey {
            namespace: self.namespace.clone(),
            instance_id: self.instance_id,
        }
    }
}

/// Why a Pod is not a member (not counted anywhere: these are ordinary fleet states).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SkipReason {
    /// The discovery labels are missing or the Dynamo namespace is not watched.
    NotSelected,
    /// `nvidia.com/dynamo-component-type` names no worker (frontend, planner, epp, default, …).
    NotWorker(String),
    /// Not Running + Ready=True, or being deleted.
    NotReady,
}

/// Why a Pod is refused (counted once as `continuum_dynamo_discovery_events_total{kind="refused"}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefuseReason {
    /// `nvidia.com/dynamo-kube-discovery-mode: container`: per-container ids are not supported.
    ContainerMode,
}

/// The verdict on one Pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PodClass {
    Member(PodMember),
    Skip(SkipReason),
    /// Ready, but its component is not listed in `models` (or it has none): held, not published.
    Held {
        component: Option<String>,
    },
    Refused(RefuseReason),
}

/// Classifies one Pod against the configuration. Pure: the same Pod always gets the same verdict.
pub fn classify_pod(pod: &Pod, config: &PodSourceConfig) -> PodClass {
    classify_pod_with(pod, config, hash_pod_name)
}

/// [`classify_pod`] with the id derivation as an argument, so tests can force id collisions.
pub fn classify_pod_with(
    pod: &Pod,
    config: &PodSourceConfig,
    id_of: fn(&str) -> InstanceId,
) -> PodClass {
    let meta = &pod.metadata;
    if meta
        .annotations
        .get(labels::DISCOVERY_MODE_ANNOTATION)
        .map(String::as_str)
        == Some("container")
    {
        return PodClass::Refused(RefuseReason::ContainerMode);
    }
    let label = |k: &str| meta.labels.get(k).map(String::as_str);
    if label(labels::DISCOVERY_BACKEND) != Some("kubernetes")
        || label(labels::DISCOVERY_ENABLED) != Some("true")
    {
        return PodClass::Skip(SkipReason::NotSelected);
    }
    // The namespace always comes from the label, never from anything the worker wrote.
    let Some(namespace) = label(labels::DYNAMO_NAMESPACE)
        .and_then(|ns| config.namespaces.iter().find(|n| n.as_str() == ns))
    else {
        return PodClass::Skip(SkipReason::NotSelected);
    };
    let component_type = label(labels::COMPONENT_TYPE).unwrap_or_default();
    let role = match component_type {
        "prefill" => PodRole::Prefill,
        "decode" => PodRole::Decode,
        "worker" => match label(labels::SUB_COMPONENT_TYPE) {
            Some("prefill") => PodRole::Prefill,
            Some("decode") => PodRole::Decode,
            _ => PodRole::Aggregated,
        },
        other => return PodClass::Skip(SkipReason::NotWorker(other.to_owned())),
    };
    if !pod.is_ready() {
        return PodClass::Skip(SkipReason::NotReady);
    }
    let component = label(labels::COMPONENT).map(str::to_owned);
    let model = match &config.models {
        ModelMapping::Single(model) => model.clone(),
        ModelMapping::PerComponent(entries) => {
            let hit = component.as_deref().and_then(|c| {
                entries.iter().find(|e| {
                    e.component == c && e.dynamo_namespace.as_ref().is_none_or(|ns| ns == namespace)
                })
            });
            match hit {
                Some(entry) => entry.model.clone(),
                None => return PodClass::Held { component },
            }
        }
    };
    PodClass::Member(PodMember {
        namespace: namespace.clone(),
        instance_id: id_of(&meta.name),
        role,
        model,
        component,
        pod_name: meta.name.clone(),
    })
}

/// Something the shell should log or count after a [`PodSet`] change, once per Pod incarnation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PodNote {
    /// Count `kind="refused"`.
    Refused { pod: String, reason: RefuseReason },
    /// Count `kind="duplicate"`: this ready Pod's id collides with another ready Pod's.
    Duplicate { pod: String, key: WorkerKey },
    /// The 16,384-Pod ceiling was hit; the Pod is not held. Count `kind="malformed"`.
    Overflow { pod: String },
    /// Log once at debug: ready but unlisted in `models`.
    Held {
        pod: String,
        component: Option<String>,
    },
}

#[derive(Clone, Debug)]
struct HeldPod {
    uid: String,
    class: PodClass,
}

/// The Pods of one watch session, bounded, with duplicate detection. Feed it the relist and then
/// every watch event; read [`PodSet::members`] after each change.
#[derive(Clone, Debug)]
pub struct PodSet {
    config: PodSourceConfig,
    max_pods: usize,
    id_of: fn(&str) -> InstanceId,
    pods: BTreeMap<String, HeldPod>,
    duplicates: BTreeSet<String>,
    /// Pod incarnations (uid) whose refusal, overflow or held state was already reported.
    noted: BTreeSet<(String, &'static str)>,
}

impl PodSet {
    pub fn new(config: PodSourceConfig) -> Self {
        Self::with_capacity(config, MAX_HELD_OBJECTS)
    }

    /// A smaller ceiling, for tests of the bound.
    pub fn with_capacity(config: PodSourceConfig, max_pods: usize) -> Self {
        Self {
            config,
            max_pods,
            id_of: hash_pod_name,
            pods: BTreeMap::new(),
            duplicates: BTreeSet::new(),
            noted: BTreeSet::new(),
        }
    }

    /// Replaces the id derivation (tests forcing collisions; production keeps `hash_pod_name`).
    pub fn with_id_fn(mut self, id_of: fn(&str) -> InstanceId) -> Self {
        self.id_of = id_of;
        self
    }

    pub fn config(&self) -> &PodSourceConfig {
        &self.config
    }

    pub fn len(&self) -> usize {
        self.pods.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }

    /// A relist: everything held is replaced by `pods`.
    pub fn replace_all<'a>(&mut self, pods: impl IntoIterator<Item = &'a Pod>) -> Vec<PodNote> {
        self.pods.clear();
        let mut notes = Vec::new();
        let mut live_uids = BTreeSet::new();
        for pod in pods {
            live_uids.insert(pod.metadata.uid.clone());
            self.insert(pod, &mut notes);
        }
        // Forget notes of incarnations that are gone so a returning Pod is reported afresh.
        self.noted.retain(|(uid, _)| live_uids.contains(uid));
        self.duplicates.clear();
        self.refresh_duplicates(&mut notes);
        notes
    }

    /// A watch ADDED or MODIFIED.
    pub fn apply(&mut self, pod: &Pod) -> Vec<PodNote> {
        let mut notes = Vec::new();
        self.insert(pod, &mut notes);
        self.refresh_duplicates(&mut notes);
        notes
    }

    /// A watch DELETED.
    pub fn delete(&mut self, name: &str) -> Vec<PodNote> {
        let mut notes = Vec::new();
        if let Some(old) = self.pods.remove(name) {
            self.noted.retain(|(uid, _)| *uid != old.uid);
        }
        self.refresh_duplicates(&mut notes);
        notes
    }

    fn insert(&mut self, pod: &Pod, notes: &mut Vec<PodNote>) {
        let name = &pod.metadata.name;
        let uid = &pod.metadata.uid;
        if !self.pods.contains_key(name) && self.pods.len() >= self.max_pods {
            if self.noted.insert((uid.clone(), "overflow")) {
                notes.push(PodNote::Overflow { pod: name.clone() });
            }
            return;
        }
        let class = classify_pod_with(pod, &self.config, self.id_of);
        match &class {
            PodClass::Refused(reason) => {
                if self.noted.insert((uid.clone(), "refused")) {
                    notes.push(PodNote::Refused {
                        pod: name.clone(),
                        reason: *reason,
                    });
                }
            }
            PodClass::Held { component } => {
                if self.noted.insert((uid.clone(), "held")) {
                    notes.push(PodNote::Held {
                        pod: name.clone(),
                        component: component.clone(),
                    });
                }
            }
            PodClass::Member(_) | PodClass::Skip(_) => {}
        }
        if let Some(old) = self.pods.get(name)
            && old.uid != *uid
        {
            // A new incarnation under the same name (StatefulSet): its states are new too.
            let old_uid = old.uid.clone();
            self.noted.retain(|(u, _)| *u != old_uid);
        }
        self.pods.insert(
            name.clone(),
            HeldPod {
                uid: uid.clone(),
                class,
            },
        );
    }

    fn refresh_duplicates(&mut self, notes: &mut Vec<PodNote>) {
        let mut by_key: BTreeMap<WorkerKey, Vec<&str>> = BTreeMap::new();
        for (name, held) in &self.pods {
            if let PodClass::Member(m) = &held.class {
                by_key.entry(m.key()).or_default().push(name);
            }
        }
        let mut now = BTreeSet::new();
        for (key, names) in by_key {
            if names.len() > 1 {
                for name in names {
                    if !self.duplicates.contains(name) {
                        notes.push(PodNote::Duplicate {
                            pod: name.to_owned(),
                            key: key.clone(),
                        });
                    }
                    now.insert(name.to_owned());
                }
            }
        }
        self.duplicates = now;
    }

    /// The ready, unambiguous workers, ordered by (namespace, instance id).
    pub fn members(&self) -> Vec<PodMember> {
        let mut out: Vec<PodMember> = self
            .pods
            .iter()
            .filter(|(name, _)| !self.duplicates.contains(*name))
            .filter_map(|(_, held)| match &held.class {
                PodClass::Member(m) => Some(m.clone()),
                _ => None,
            })
            .collect();
        out.sort_by(|a, b| {
            a.key()
                .cmp(&b.key())
                .then_with(|| a.pod_name.cmp(&b.pod_name))
        });
        out
    }

    /// The current verdict on a held Pod.
    pub fn class_of(&self, name: &str) -> Option<&PodClass> {
        self.pods.get(name).map(|h| &h.class)
    }
}

#[cfg(test)]
#[path = "pods_tests.rs"]
mod tests;
