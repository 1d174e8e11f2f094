//! The `kubernetes` metadata source: DynamoWorkerMetadata resources joined with EndpointSlice
//! readiness, turned into the etcd records an etcd fleet would hold, as incremental
//! [`SourceEvent`] diffs for the one etcd reducer that lives as long as the watcher.
//!
//! Rules (seed "Kubernetes metadata source", wire §13):
//! * a resource is *live* while a ready endpoint (`conditions.ready: true`) of a selected slice
//!   has `targetRef.name` equal to the resource name and, as in 1.6.1, a Pod uid equal to the
//!   resource's owner-reference uid (a new Pod incarnation does not inherit old metadata);
//! * container-mode resources (owner Pod name ≠ resource name) are refused once (`refused`);
//! * every endpoint and model-card record must carry `hash_pod_name(resource name)` in its key and
//!   its `instance_id`, or the whole resource is refused once (`mismatch`); event channels are
//!   exempt (their id is a publisher id);
//! * a non-object `spec` or `spec.data` (or member map) is counted once (`malformed`) and the last
//!   valid records of the same uid are kept;
//! * records map to `v1/instances/`, `v1/mdc/` and `v1/event_channels/` keys, filtered to the
//!   watched Dynamo namespaces (taken from the key path, never from a payload field);
//!   `event_sources` are not fed, matching the three buckets the router watches on etcd;
//! * one key may have several contributors (shared event channels): it leaves only with its
//!   last contributor, and a surviving contributor's value is re-put if the fed one departs;
//! * bounds: 16,384 resources, 16,384 slices and 256 MiB of held record bytes; a model card
//!   above 1 MiB is trimmed to its typed subset when classified.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use serde_json::{Map, Value};

use crate::discovery::SourceEvent;
use crate::ids::{InstanceId, Namespace};
use crate::kube::hash::hash_pod_name;
use crate::kube::objects::{DynamoWorkerMetadata, EndpointSlice};
use crate::kube::{MAX_HELD_OBJECTS, Signals};

/// Workers come with full cards and event channels: load and capacity signals are available.
pub const METADATA_SIGNALS: Signals = Signals {
    load: true,
    capacity: true,
};

/// Total bytes of records (keys + values) held across resources.
pub const MAX_HELD_BYTES: usize = 256 * 1024 * 1024;
/// A model record above this is trimmed to the card fields the router reads.
pub const MAX_CARD_BYTES: usize = 1024 * 1024;

/// What the metadata source needs from `dynamo.discovery.kubernetes`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetadataConfig {
    /// `dynamo_namespace`, or the `dynamo_namespaces` list.
    pub namespaces: Vec<Namespace>,
}

/// The `continuum_dynamo_discovery_events_total{kind}` a note counts under.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum NoteKind {
    Refused,
    Mismatch,
    Malformed,
}

impl NoteKind {
    pub fn as_str(self) -> &'static str {
        match self {
            NoteKind::Refused => "refused",
            NoteKind::Mismatch => "mismatch",
            NoteKind::Malformed => "malformed",
        }
    }
}

/// One count the shell must record (each is reported once per resource incarnation and kind).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetaNote {
    pub resource: String,
    pub kind: NoteKind,
    pub detail: String,
}

/// The result of one input: events for the reducer and notes to count and log.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Step {
    pub events: Vec<SourceEvent>,
    pub notes: Vec<MetaNote>,
}

/// Prefix of slice names in `overflow_noted` (resource uids never contain `/`).
const SLICE_MARK: &str = "slice/";

type Bytes = Arc<[u8]>;
type Records = BTreeMap<String, Bytes>;

#[derive(Clone, Debug)]
struct Held {
    uid: String,
    /// The owner Pod's uid, matched against `targetRef.uid` for liveness.
    owner_uid: Option<String>,
    /// Refused as a whole (container mode, id mismatch): contributes nothing.
    refused: bool,
    records: Records,
    bytes: usize,
    /// Kinds already counted for this uid.
    noted: BTreeSet<NoteKind>,
}

/// A ready endpoint: target Pod name and uid.
type ReadyTarget = (String, Option<String>);

/// The metadata source's state for one watch lifetime. Feed the relist with [`Self::relist`],
/// then watch events; forward every [`Step::events`] to the reducer in order.
#[derive(Clone, Debug)]
pub struct MetadataState {
    config: MetadataConfig,
    max_objects: usize,
    max_bytes: usize,
    resources: BTreeMap<String, Held>,
    held_bytes: usize,
    slices: BTreeMap<String, Vec<ReadyTarget>>,
    /// Pod name → (uid → number of ready endpoints naming it).
    ready: BTreeMap<String, BTreeMap<Option<String>, usize>>,
    /// What each live resource currently contributes to the reducer.
    contributing: BTreeMap<String, Records>,
    /// Key → contributors' values.
    contributors: BTreeMap<String, BTreeMap<String, Bytes>>,
    /// Key → the value the reducer holds.
    fed: BTreeMap<String, Bytes>,
    /// Resource uids (and `slice/<name>`s) refused for overflow, so the count happens once.
    overflow_noted: BTreeSet<String>,
}

impl MetadataState {
    pub fn new(config: MetadataConfig) -> Self {
        Self::with_bounds(config, MAX_HELD_OBJECTS, MAX_HELD_BYTES)
    }

    /// Smaller bounds, for tests of the ceilings.
    pub fn with_bounds(config: MetadataConfig, max_objects: usize, max_bytes: usize) -> Self {
        Self {
            config,
            max_objects,
            max_bytes,
            resources: BTreeMap::new(),
            held_bytes: 0,
            slices: BTreeMap::new(),
            ready: BTreeMap::new(),
            contributing: BTreeMap::new(),
            contributors: BTreeMap::new(),
            fed: BTreeMap::new(),
            overflow_noted: BTreeSet::new(),
        }
    }

    pub fn config(&self) -> &MetadataConfig {
        &self.config
    }

    /// The records the reducer currently holds, as etcd would: key → value bytes.
    pub fn fed(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.fed.iter().map(|(k, v)| (k.as_str(), &**v))
    }

    pub fn resource_count(&self) -> usize {
        self.resources.len()
    }

    pub fn held_bytes(&self) -> usize {
        self.held_bytes
    }

    /// A full relist of both resource kinds: rebuilds everything and emits `Init`, one
    /// `InitApply` per fed record, `InitDone` (an etcd resync). Counts already made for an
    /// unchanged uid are not repeated.
    pub fn relist(&mut self, resources: &[DynamoWorkerMetadata], slices: &[EndpointSlice]) -> Step {
        let mut previous = std::mem::take(&mut self.resources);
        self.held_bytes = 0;
        self.slices.clear();
        self.ready.clear();
        self.contributing.clear();
        self.contributors.clear();
        self.fed.clear();
        let listed: BTreeSet<String> = resources
            .iter()
            .map(|r| r.metadata.uid.clone())
            .chain(
                slices
                    .iter()
                    .map(|s| format!("{SLICE_MARK}{}", s.metadata.name)),
            )
            .collect();
        self.overflow_noted.retain(|mark| listed.contains(mark));

        let mut notes = Vec::new();
        for slice in slices {
            self.store_slice(slice, &mut notes);
        }
        for resource in resources {
            let name = &resource.metadata.name;
            if let Some(held) = previous.remove(name)
                && held.uid == resource.metadata.uid
                && self.resources.len() < self.max_objects
            {
                // The same incarnation keeps its last valid records (a malformed relisted spec
                // must not erase them) and its counts (an unchanged refusal is not recounted).
                self.held_bytes += held.bytes;
                self.resources.insert(name.clone(), held);
            }
            self.store_resource(resource, &mut notes);
        }
        let names: Vec<String> = self.resources.keys().cloned().collect();
        for name in names {
            // Contributions are rebuilt silently; the resync below re-puts every fed record.
            self.refresh(&name, &mut Vec::new());
        }
        let mut events = Vec::with_capacity(self.fed.len() + 2);
        events.push(SourceEvent::Init);
        events.extend(self.fed.iter().map(|(k, v)| SourceEvent::InitApply {
            key: k.clone(),
            value: v.to_vec(),
        }));
        events.push(SourceEvent::InitDone);
        Step { events, notes }
    }

    /// A watch ADDED or MODIFIED of a DynamoWorkerMetadata.
    pub fn apply_resource(&mut self, resource: &DynamoWorkerMetadata) -> Step {
        let mut step = Step::default();
        self.store_resource(resource, &mut step.notes);
        self.refresh(&resource.metadata.name, &mut step.events);
        step
    }

    /// A watch DELETED of a DynamoWorkerMetadata.
    pub fn delete_resource(&mut self, name: &str) -> Step {
        let mut step = Step::default();
        if let Some(held) = self.resources.remove(name) {
            self.held_bytes -= held.bytes;
            self.overflow_noted.remove(&held.uid);
        }
        self.refresh(name, &mut step.events);
        step
    }

    /// A watch ADDED or MODIFIED of an EndpointSlice: only the endpoints it changes are toggled.
    pub fn apply_slice(&mut self, slice: &EndpointSlice) -> Step {
        let mut step = Step::default();
        let name = &slice.metadata.name;
        if !self.slices.contains_key(name) && self.slices.len() >= self.max_objects {
            self.store_slice(slice, &mut step.notes);
            return step;
        }
        let mut affected: BTreeSet<String> = self
            .slices
            .get(name)
            .map(|t| t.iter().map(|(n, _)| n.clone()).collect())
            .unwrap_or_default();
        self.unstore_slice(name);
        self.store_slice(slice, &mut step.notes);
        if let Some(targets) = self.slices.get(name) {
            affected.extend(targets.iter().map(|(n, _)| n.clone()));
        }
        for pod in affected {
            self.refresh(&pod, &mut step.events);
        }
        step
    }

    /// A watch DELETED of an EndpointSlice.
    pub fn delete_slice(&mut self, name: &str) -> Step {
        let mut step = Step::default();
        self.overflow_noted.remove(&format!("{SLICE_MARK}{name}"));
        let affected: BTreeSet<String> = self
            .slices
            .get(name)
            .map(|t| t.iter().map(|(n, _)| n.clone()).collect())
            .unwrap_or_default();
        self.unstore_slice(name);
        for pod in affected {
            self.refresh(&pod, &mut step.events);
        }
        step
    }

    fn store_slice(&mut self, slice: &EndpointSlice, notes: &mut Vec<MetaNote>) {
        let name = &slice.metadata.name;
        if !self.slices.contains_key(name) && self.slices.len() >= self.max_objects {
            if self.overflow_noted.insert(format!("{SLICE_MARK}{name}")) {
                notes.push(MetaNote {
                    resource: name.clone(),
                    kind: NoteKind::Malformed,
                    detail: "EndpointSlice ceiling reached".into(),
                });
            }
            return;
        }
        let targets: Vec<ReadyTarget> = slice
            .endpoints
            .iter()
            .filter(|e| e.conditions.ready == Some(true))
            .filter_map(|e| e.target_ref.as_ref())
            .filter(|t| t.kind.as_deref().is_none_or(|k| k == "Pod") && !t.name.is_empty())
            .map(|t| (t.name.clone(), t.uid.clone()))
            .collect();
        for (pod, uid) in &targets {
            *self
                .ready
                .entry(pod.clone())
                .or_default()
                .entry(uid.clone())
                .or_default() += 1;
        }
        self.slices.insert(name.clone(), targets);
    }

    fn unstore_slice(&mut self, name: &str) {
        let Some(targets) = self.slices.remove(name) else {
            return;
        };
        for (pod, uid) in targets {
            if let Some(uids) = self.ready.get_mut(&pod) {
                if let Some(n) = uids.get_mut(&uid) {
                    *n -= 1;
                    if *n == 0 {
                        uids.remove(&uid);
                    }
                }
                if uids.is_empty() {
                    self.ready.remove(&pod);
                }
            }
        }
    }

    fn note(&mut self, name: &str, kind: NoteKind, detail: String, notes: &mut Vec<MetaNote>) {
        if let Some(held) = self.resources.get_mut(name)
            && held.noted.insert(kind)
        {
            notes.push(MetaNote {
                resource: name.to_owned(),
                kind,
                detail,
            });
        }
    }

    /// Classifies and holds one resource (no events: [`Self::refresh`] decides those).
    fn store_resource(&mut self, resource: &DynamoWorkerMetadata, notes: &mut Vec<MetaNote>) {
        let meta = &resource.metadata;
        let name = meta.name.clone();
        if !self.resources.contains_key(&name) && self.resources.len() >= self.max_objects {
            if self.overflow_noted.insert(meta.uid.clone()) {
                notes.push(MetaNote {
                    resource: name,
                    kind: NoteKind::Malformed,
                    detail: "DynamoWorkerMetadata ceiling reached".into(),
                });
            }
            return;
        }
        let owner = meta.owner_references.iter().find(|o| o.kind == "Pod");
        let owner_uid = owner.map(|o| o.uid.clone()).filter(|u| !u.is_empty());
        // A new uid under the same name is a new incarnation: nothing of the old one carries over.
        let same_uid = self.resources.get(&name).is_some_and(|h| h.uid == meta.uid);
        if !same_uid {
            if let Some(old) = self.resources.remove(&name) {
                self.held_bytes -= old.bytes;
            }
            self.resources.insert(
                name.clone(),
                Held {
                    uid: meta.uid.clone(),
                    owner_uid: owner_uid.clone(),
                    refused: false,
                    records: Records::new(),
                    bytes: 0,
                    noted: BTreeSet::new(),
                },
            );
        }
        let verdict = match owner {
            Some(o) if o.name != name => Err((
                NoteKind::Refused,
                format!("container-mode resource owned by Pod {}", o.name),
            )),
            _ => self.records_of(&name, &resource.spec),
        };
        match verdict {
            Ok((records, bytes)) => {
                let old_bytes = self.resources.get(&name).map_or(0, |h| h.bytes);
                if self.held_bytes - old_bytes + bytes > self.max_bytes {
                    self.note(
                        &name,
                        NoteKind::Malformed,
                        format!("held record bytes would exceed {}", self.max_bytes),
                        notes,
                    );
                    return;
                }
                self.held_bytes = self.held_bytes - old_bytes + bytes;
                if let Some(held) = self.resources.get_mut(&name) {
                    held.owner_uid = owner_uid;
                    held.refused = false;
                    held.records = records;
                    held.bytes = bytes;
                    // A valid update ends earlier refusals: a later relapse counts again.
                    held.noted.clear();
                }
            }
            Err((NoteKind::Malformed, detail)) => {
                // Keep the last valid records of this uid, as upstream's daemon does.
                self.note(&name, NoteKind::Malformed, detail, notes);
            }
            Err((kind, detail)) => {
                self.note(&name, kind, detail, notes);
                if let Some(held) = self.resources.get_mut(&name) {
                    self.held_bytes -= held.bytes;
                    held.owner_uid = owner_uid;
                    held.refused = true;
                    held.records.clear();
                    held.bytes = 0;
                }
            }
        }
    }

    fn is_live(&self, name: &str) -> bool {
        let Some(held) = self.resources.get(name) else {
            return false;
        };
        if held.refused {
            return false;
        }
        let Some(uids) = self.ready.get(name) else {
            return false;
        };
        uids.keys().any(|uid| match (uid, &held.owner_uid) {
            (Some(target), Some(owner)) => target == owner,
            // 1.4/1.5 slices or owners without a uid: the name alone decides.
            _ => true,
        })
    }

    /// Brings one resource's contribution to the reducer in line with its state.
    fn refresh(&mut self, name: &str, events: &mut Vec<SourceEvent>) {
        let desired = if self.is_live(name) {
            self.resources
                .get(name)
                .map(|h| h.records.clone())
                .unwrap_or_default()
        } else {
            Records::new()
        };
        let old = self.contributing.remove(name).unwrap_or_default();
        for key in old.keys() {
            if desired.contains_key(key) {
                continue;
            }
            let Some(values) = self.contributors.get_mut(key) else {
                continue;
            };
            values.remove(name);
            if values.is_empty() {
                self.contributors.remove(key);
                self.fed.remove(key);
                events.push(SourceEvent::Delete { key: key.clone() });
            } else if let Some(current) = self.fed.get(key)
                && !values.values().any(|v| v == current)
            {
                // The departing contributor's value was the fed one: re-put a survivor's.
                let survivor = values
                    .values()
                    .next()
                    .cloned()
                    .unwrap_or_else(|| current.clone());
                self.fed.insert(key.clone(), survivor.clone());
                events.push(SourceEvent::Apply {
                    key: key.clone(),
                    value: survivor.to_vec(),
                });
            }
        }
        for (key, value) in &desired {
            if old.get(key) == Some(value) {
                continue;
            }
            self.contributors
                .entry(key.clone())
                .or_default()
                .insert(name.to_owned(), value.clone());
            if self.fed.get(key) != Some(value) {
                self.fed.insert(key.clone(), value.clone());
                events.push(SourceEvent::Apply {
                    key: key.clone(),
                    value: value.to_vec(),
                });
            }
        }
        if !desired.is_empty() {
            self.contributing.insert(name.to_owned(), desired);
        }
    }

    /// The etcd records of one resource's `spec`, or why the resource is refused.
    fn records_of(&self, name: &str, spec: &Value) -> Result<(Records, usize), (NoteKind, String)> {
        let malformed = |what: &str| (NoteKind::Malformed, format!("{what} is not an object"));
        let spec = spec.as_object().ok_or_else(|| malformed("spec"))?;
        let data = spec
            .get("data")
            .and_then(Value::as_object)
            .ok_or_else(|| malformed("spec.data"))?;
        let member = |field: &str| -> Result<Option<&Map<String, Value>>, (NoteKind, String)> {
            match data.get(field) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Object(map)) => Ok(Some(map)),
                Some(_) => Err(malformed(&format!("spec.data.{field}"))),
            }
        };
        let endpoints = member("endpoints")?;
        let cards = member("model_cards")?;
        let channels = member("event_channels")?;

        let expected = hash_pod_name(name);
        let mut records = Records::new();
        let mut bytes = 0usize;
        let mut push = |records: &mut Records, key: String, value: Vec<u8>| {
            bytes = bytes.saturating_add(key.len() + value.len());
            records.insert(key, Arc::from(value));
        };
        for (bucket, map, segments) in [
            ("v1/instances/", endpoints, 4..=4),
            ("v1/mdc/", cards, 4..=5),
        ] {
            for (suffix, value) in map.into_iter().flatten() {
                check_instance(suffix, value, expected, segments.clone())?;
                if !self.watches_plain(suffix) {
                    continue;
                }
                let mut value = value.clone();
                let mut encoded = serde_json::to_vec(&value).unwrap_or_default();
                if bucket == "v1/mdc/" && encoded.len() > MAX_CARD_BYTES {
                    trim_card(&mut value);
                    encoded = serde_json::to_vec(&value).unwrap_or_default();
                }
                push(&mut records, format!("{bucket}{suffix}"), encoded);
            }
        }
        for (suffix, value) in channels.into_iter().flatten() {
            if !self.watches_scoped(suffix) {
                continue;
            }
            let mut value = value.clone();
            if let Some(obj) = value.as_object_mut()
                && obj.contains_key("scope")
            {
                // Legacy members Kubernetes writers add next to `scope` (wire §13.2); etcd
                // values do not carry them.
                obj.remove("namespace");
                obj.remove("component");
            }
            let encoded = serde_json::to_vec(&value).unwrap_or_default();
            push(&mut records, format!("v1/event_channels/{suffix}"), encoded);
        }
        Ok((records, bytes))
    }

    fn watches_plain(&self, suffix: &str) -> bool {
        let ns = suffix.split('/').next().unwrap_or_default();
        self.config.namespaces.iter().any(|n| n.as_str() == ns)
    }

    fn watches_scoped(&self, suffix: &str) -> bool {
        let mut parts = suffix.split('/');
        parts.next() == Some("namespace")
            && parts.next().is_some_and(|seg| {
                self.config
                    .namespaces
                    .iter()
                    .any(|n| encode_segment(n.as_str()) == seg)
            })
    }
}

/// Checks an endpoint or model-card record's key id and value id against the resource's.
fn check_instance(
    suffix: &str,
    value: &Value,
    expected: InstanceId,
    segments: std::ops::RangeInclusive<usize>,
) -> Result<(), (NoteKind, String)> {
    let parts: Vec<&str> = suffix.split('/').collect();
    let key_id = if segments.contains(&parts.len()) {
        parts.get(3).and_then(|h| InstanceId::from_hex(h))
    } else {
        None
    };
    if key_id != Some(expected) {
        return Err((
            NoteKind::Mismatch,
            format!("key {suffix} does not carry instance id {expected}"),
        ));
    }
    let value_id = value.get("instance_id").and_then(Value::as_u64);
    if value_id != Some(expected.0) {
        return Err((
            NoteKind::Mismatch,
            format!(
                "record {suffix} has instance_id {value_id:?}, expected {}",
                expected.0
            ),
        ));
    }
    Ok(())
}

/// Upstream's event-segment encoding (wire §4.4): ASCII alphanumerics, `-` and `_` stay.
fn encode_segment(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    for b in raw.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The card members the router reads (wire §7): names, block size, role, LoRA, capacity and DP
/// layout. Artifacts, templates and user data are what make cards large, and are dropped.
const CARD_FIELDS: &[&str] = &[
    "display_name",
    "name",
    "slug",
    "context_length",
    "kv_cache_block_size",
    "migration_limit",
    "model_type",
    "model_input",
    "worker_type",
    "needs",
    "lora",
    "aliases",
    "router_config",
];
const RUNTIME_FIELDS: &[&str] = &[
    "context_length",
    "total_kv_blocks",
    "max_num_seqs",
    "max_num_batched_tokens",
    "data_parallel_start_rank",
    "data_parallel_size",
    "enable_local_indexer",
    "kv_event_publishing_enabled",
    "kv_event_source_mode",
    "kv_state_endpoint",
    "enable_eagle",
    "taints",
];

fn subset(obj: &Map<String, Value>, fields: &[&str]) -> Map<String, Value> {
    fields
        .iter()
        .filter_map(|f| obj.get(*f).map(|v| ((*f).to_owned(), v.clone())))
        .collect()
}

/// Trims a Model record's `card_json` (an object, or a string holding one) to its typed subset.
fn trim_card(record: &mut Value) {
    let Some(card) = record.get_mut("card_json") else {
        return;
    };
    let parsed = match &*card {
        Value::String(text) => serde_json::from_str::<Value>(text).ok(),
        other => Some(other.clone()),
    };
    let Some(Value::Object(full)) = parsed else {
        return;
    };
    let mut small = subset(&full, CARD_FIELDS);
    if let Some(Value::Object(rt)) = full.get("runtime_config") {
        small.insert(
            "runtime_config".into(),
            Value::Object(subset(rt, RUNTIME_FIELDS)),
        );
    }
    *card = Value::Object(small);
}

#[cfg(test)]
#[path = "metadata_tests.rs"]
mod tests;
