//! The immutable fleet snapshot every reader shares (`Arc<DynamoSnapshot>`), built purely from
//! the per-namespace views, and the mixed-namespace detector run on each published change.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use serde::Serialize;

use super::records::{EventTopic, Role};
use super::view::{NamespaceView, Publisher, Worker};
use crate::ids::{InstanceId, Namespace, PublisherId, WorkerKey};

/// Which discovery source produced a snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SourceKind {
    Etcd,
    Kubernetes,
    KubernetesPods,
    /// `continuum-router demo`'s in-process fleet: etcd-shaped records, fed without etcd.
    Simulated,
    /// Dynamo's file store: the same records as etcd, read from a directory.
    File,
}

impl SourceKind {
    /// The config / admin spelling (`etcd`, `kubernetes`, `kubernetes_pods`, `simulated`, `file`).
    pub fn as_str(self) -> &'static str {
        match self {
            SourceKind::Etcd => "etcd",
            SourceKind::Kubernetes => "kubernetes",
            SourceKind::KubernetesPods => "kubernetes_pods",
            SourceKind::Simulated => "simulated",
            SourceKind::File => "file",
        }
    }

    /// What the source can tell: Pods carry no cards or event channels.
    pub fn signals(self) -> Signals {
        let full = !matches!(self, SourceKind::KubernetesPods);
        Signals {
            load: full,
            capacity: full,
        }
    }
}

/// `"signals"` of `GET /admin/dynamo/workers`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Signals {
    pub load: bool,
    pub capacity: bool,
}

/// The whole discovered fleet at one generation. Workers are sorted by [`WorkerKey`]
/// (namespace, then instance id) and publishers by (namespace, publisher id).
///
/// A snapshot is either built whole ([`build_snapshot`]) or patched from the previous one
/// ([`DynamoSnapshot::patch`]); a patched one carries what changed ([`FleetChanges`]) so
/// consumers (the picker's candidate index, the KV index's live gate, the subscription follower)
/// patch their own state instead of rebuilding it from 16,384 workers.
#[derive(Clone, Debug)]
pub struct DynamoSnapshot {
    source: SourceKind,
    namespaces: Vec<Namespace>,
    workers: Vec<Arc<Worker>>,
    publishers: Vec<Arc<Publisher>>,
    /// (namespace, model) → indexes into `workers`, ascending. Shared with the previous snapshot
    /// while no worker joined, left or changed its model.
    by_model: Arc<BTreeMap<(Namespace, String), Vec<usize>>>,
    /// (namespace, model) → its workers per role (the mixed-namespace check reads these).
    model_roles: Arc<BTreeMap<(Namespace, String), RoleCounts>>,
    /// Namespace → its workers per role (the `continuum_dynamo_workers` gauges).
    roles: Arc<BTreeMap<Namespace, RoleCounts>>,
    /// This snapshot's place in the registry's sequence (`0` for a snapshot built apart).
    seq: u64,
    changes: Arc<FleetChanges>,
}

/// Workers per role.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RoleCounts {
    pub prefill: usize,
    pub decode: usize,
    pub aggregated: usize,
    pub unknown: usize,
}

impl RoleCounts {
    pub fn get(&self, role: Role) -> usize {
        match role {
            Role::Prefill => self.prefill,
            Role::Decode => self.decode,
            Role::Aggregated => self.aggregated,
            Role::Unknown => self.unknown,
        }
    }

    fn slot(&mut self, role: Role) -> &mut usize {
        match role {
            Role::Prefill => &mut self.prefill,
            Role::Decode => &mut self.decode,
            Role::Aggregated => &mut self.aggregated,
            Role::Unknown => &mut self.unknown,
        }
    }

    pub fn total(&self) -> usize {
        self.prefill + self.decode + self.aggregated + self.unknown
    }

    /// Aggregated workers beside prefill or decode workers.
    pub fn mixed(&self) -> bool {
        self.aggregated > 0 && (self.prefill > 0 || self.decode > 0)
    }
}

/// What changed between two published snapshots: the workers that joined, changed (before,
/// after) or left, each sorted by key, and whether the publishers changed.
///
/// `since` names the snapshot (its [`DynamoSnapshot::seq`]) the changes lead from; `None` for a
/// snapshot built whole, which every consumer rebuilds from. A consumer that holds the state of
/// snapshot `s` patches when `since == Some(s)` and rebuilds otherwise (it missed a generation).
#[derive(Clone, Debug, Default)]
pub struct FleetChanges {
    pub since: Option<u64>,
    pub added: Vec<Arc<Worker>>,
    pub changed: Vec<(Arc<Worker>, Arc<Worker>)>,
    pub removed: Vec<Arc<Worker>>,
    pub publishers: bool,
}

impl FleetChanges {
    /// Whether these changes lead from the snapshot numbered `seq`.
    pub fn patches(&self, seq: u64) -> bool {
        self.since == Some(seq)
    }

    /// Workers that joined or left.
    pub fn membership_changed(&self) -> bool {
        !self.added.is_empty() || !self.removed.is_empty()
    }

    /// Every worker version involved: left and changed-before (old), joined and changed-after
    /// (new).
    pub fn touched(&self) -> impl Iterator<Item = &Arc<Worker>> {
        self.removed
            .iter()
            .chain(&self.added)
            .chain(self.changed.iter().flat_map(|(a, b)| [a, b]))
    }
}

/// One namespace's staged change, for [`DynamoSnapshot::patch`].
#[derive(Clone, Copy, Debug)]
pub struct NamespaceUpdate<'a> {
    /// The namespace's whole current view.
    pub view: &'a NamespaceView,
    /// The instance ids whose workers may differ from the snapshot's; `None`: any of them (a
    /// first view, a new reducer, a reset), so the namespace is compared whole.
    pub workers: Option<&'a BTreeSet<InstanceId>>,
    /// Whether the namespace's publishers may differ.
    pub publishers: bool,
}

/// Builds a snapshot from per-namespace views. Views of namespaces not listed in `namespaces`
/// are left out (that is how removing a namespace prunes its workers); if two views share a
/// namespace, the first wins.
pub fn build_snapshot(
    source: SourceKind,
    namespaces: &[Namespace],
    views: &[&NamespaceView],
) -> DynamoSnapshot {
    let mut chosen: BTreeMap<&Namespace, &NamespaceView> = BTreeMap::new();
    for view in views {
        if namespaces.contains(&view.namespace) {
            chosen.entry(&view.namespace).or_insert(view);
        }
    }
    // BTreeMap order over namespaces, then each view's BTreeMap order over ids, gives the
    // (namespace, id) sort without sorting.
    let workers: Vec<Arc<Worker>> = chosen
        .values()
        .flat_map(|v| v.workers.values().cloned())
        .collect();
    let publishers: Vec<Arc<Publisher>> = chosen
        .values()
        .flat_map(|v| v.publishers.values().cloned())
        .collect();
    let (model_roles, roles) = count_roles(&workers);
    DynamoSnapshot {
        source,
        namespaces: namespaces.to_vec(),
        by_model: Arc::new(group_by_model(&workers)),
        model_roles: Arc::new(model_roles),
        roles: Arc::new(roles),
        workers,
        publishers,
        seq: 0,
        changes: Arc::default(),
    }
}

/// (namespace, model) → indexes into `workers`.
fn group_by_model(workers: &[Arc<Worker>]) -> BTreeMap<(Namespace, String), Vec<usize>> {
    // Grouped under borrowed keys first: one (namespace, model) clone per pair, not per worker
    // (16,384 workers of one model were 32,768 string allocations per rebuild).
    let mut grouped: BTreeMap<(&Namespace, &str), Vec<usize>> = BTreeMap::new();
    for (i, w) in workers.iter().enumerate() {
        if let Some(model) = &w.model {
            grouped
                .entry((&w.key.namespace, model.as_str()))
                .or_default()
                .push(i);
        }
    }
    grouped
        .into_iter()
        .map(|((ns, model), idx)| ((ns.clone(), model.to_owned()), idx))
        .collect()
}

type ModelRoles = BTreeMap<(Namespace, String), RoleCounts>;

fn count_roles(workers: &[Arc<Worker>]) -> (ModelRoles, BTreeMap<Namespace, RoleCounts>) {
    let mut by_model: BTreeMap<(&Namespace, &str), RoleCounts> = BTreeMap::new();
    let mut by_ns: BTreeMap<&Namespace, RoleCounts> = BTreeMap::new();
    for w in workers {
        if let Some(model) = &w.model {
            *by_model
                .entry((&w.key.namespace, model.as_str()))
                .or_default()
                .slot(w.role) += 1;
        }
        *by_ns.entry(&w.key.namespace).or_default().slot(w.role) += 1;
    }
    (
        by_model
            .into_iter()
            .map(|((ns, m), c)| ((ns.clone(), m.to_owned()), c))
            .collect(),
        by_ns.into_iter().map(|(ns, c)| (ns.clone(), c)).collect(),
    )
}

/// Adds (`up`) or removes one worker from the per-role counts, dropping emptied entries.
fn count_worker(
    model_roles: &mut ModelRoles,
    roles: &mut BTreeMap<Namespace, RoleCounts>,
    w: &Worker,
    up: bool,
) {
    fn step(slot: &mut usize, up: bool) {
        *slot = if up {
            slot.saturating_add(1)
        } else {
            slot.saturating_sub(1)
        };
    }
    if let Some(model) = &w.model {
        let key = (w.key.namespace.clone(), model.clone());
        let counts = model_roles.entry(key.clone()).or_default();
        step(counts.slot(w.role), up);
        if counts.total() == 0 {
            model_roles.remove(&key);
        }
    }
    let counts = roles.entry(w.key.namespace.clone()).or_default();
    step(counts.slot(w.role), up);
    if counts.total() == 0 {
        roles.remove(&w.key.namespace);
    }
}

impl DynamoSnapshot {
    /// The snapshot after `updates` and a change of configured `namespaces` (workers and
    /// publishers of namespaces no longer listed leave), with what changed; `None` when a reader
    /// would see no difference (the same rule as [`Self::same_fleet`]: a worker whose content is
    /// unchanged keeps its previous version, timestamps included).
    ///
    /// Cost: O(changes · log fleet) for the lookups and counts, plus one copy of the worker
    /// pointers (a memcpy-like pass, no allocation per worker); the model grouping is redone
    /// only when a worker joins, leaves or changes its model. Updates of namespaces not listed
    /// are ignored; if two share a namespace, the first wins.
    #[expect(clippy::too_many_lines, reason = "on tests/it/tidy/long_functions.txt")]
    pub fn patch(
        &self,
        namespaces: &[Namespace],
        updates: &[NamespaceUpdate<'_>],
    ) -> Option<DynamoSnapshot> {
        let mut chosen: BTreeMap<&Namespace, &NamespaceUpdate<'_>> = BTreeMap::new();
        for update in updates {
            if namespaces.contains(&update.view.namespace) {
                chosen.entry(&update.view.namespace).or_insert(update);
            }
        }
        let gone: Vec<&Namespace> = self
            .roles
            .keys()
            .chain(self.publishers.iter().map(|p| &p.namespace))
            .filter(|ns| !namespaces.contains(ns))
            .collect();

        // The keys that may have changed, with their next version.
        let mut edits: Vec<(WorkerKey, Option<Arc<Worker>>)> = Vec::new();
        for ns in &gone {
            for w in &self.workers[self.namespace_range(ns)] {
                edits.push((w.key.clone(), None));
            }
        }
        for (ns, update) in &chosen {
            let view = update.view;
            match update.workers {
                Some(ids) => {
                    for id in ids {
                        let key = WorkerKey {
                            namespace: (*ns).clone(),
                            instance_id: *id,
                        };
                        edits.push((key, view.workers.get(id).cloned()));
                    }
                }
                None => {
                    let held = &self.workers[self.namespace_range(ns)];
                    for w in held {
                        edits.push((w.key.clone(), view.workers.get(&w.key.instance_id).cloned()));
                    }
                    for (id, w) in &view.workers {
                        if held
                            .binary_search_by(|h| h.key.instance_id.cmp(id))
                            .is_err()
                        {
                            edits.push((w.key.clone(), Some(w.clone())));
                        }
                    }
                }
            }
        }
        edits.sort_by(|a, b| a.0.cmp(&b.0));
        edits.dedup_by(|a, b| a.0 == b.0);

        let mut changes = FleetChanges {
            since: Some(self.seq),
            ..FleetChanges::default()
        };
        let mut apply: Vec<(&WorkerKey, Option<Arc<Worker>>)> = Vec::new();
        for (key, next) in &edits {
            match (self.worker(key), next) {
                (None, None) => {}
                (Some(old), None) => {
                    changes.removed.push(old.clone());
                    apply.push((key, None));
                }
                (None, Some(new)) => {
                    changes.added.push(new.clone());
                    apply.push((key, Some(new.clone())));
                }
                (Some(old), Some(new)) if Arc::ptr_eq(old, new) => {}
                (Some(old), Some(new)) => {
                    if !old.same_content(new) {
                        changes.changed.push((old.clone(), new.clone()));
                        apply.push((key, Some(new.clone())));
                    } else if **old != **new {
                        // Same content, newer timestamps (the view changed the worker and back
                        // between two patches): no consumer has anything to redo, but readers see
                        // the view's `last_updated`, as a snapshot built whole shows it.
                        apply.push((key, Some(new.clone())));
                    }
                }
            }
        }

        let publishers = if gone.is_empty() && !chosen.values().any(|u| u.publishers) {
            None
        } else {
            let mut next: Vec<Arc<Publisher>> = self
                .publishers
                .iter()
                .filter(|p| {
                    namespaces.contains(&p.namespace)
                        && !chosen.get(&p.namespace).is_some_and(|u| u.publishers)
                })
                .cloned()
                .collect();
            next.extend(
                chosen
                    .values()
                    .filter(|u| u.publishers)
                    .flat_map(|u| u.view.publishers.values().cloned()),
            );
            next.sort_by(|a, b| {
                (&a.namespace, a.publisher_id).cmp(&(&b.namespace, b.publisher_id))
            });
            let same = next.len() == self.publishers.len()
                && next
                    .iter()
                    .zip(&self.publishers)
                    .all(|(a, b)| Arc::ptr_eq(a, b) || a == b);
            (!same).then_some(next)
        };
        changes.publishers = publishers.is_some();
        if apply.is_empty() && publishers.is_none() && namespaces == self.namespaces.as_slice() {
            return None;
        }

        let mut workers = Vec::with_capacity(self.workers.len() + changes.added.len());
        let mut from = 0;
        for (key, next) in apply {
            let at = from + self.workers[from..].partition_point(|w| w.key < *key);
            workers.extend_from_slice(&self.workers[from..at]);
            from = at;
            if self.workers.get(from).is_some_and(|w| w.key == *key) {
                from += 1;
            }
            workers.extend(next);
        }
        workers.extend_from_slice(&self.workers[from..]);

        let regroup =
            changes.membership_changed() || changes.changed.iter().any(|(a, b)| a.model != b.model);
        let by_model = if regroup {
            Arc::new(group_by_model(&workers))
        } else {
            self.by_model.clone()
        };
        let (model_roles, roles) =
            if changes.added.is_empty() && changes.removed.is_empty() && changes.changed.is_empty()
            {
                (self.model_roles.clone(), self.roles.clone())
            } else {
                let mut model_roles = (*self.model_roles).clone();
                let mut roles = (*self.roles).clone();
                for (w, up) in changes
                    .removed
                    .iter()
                    .map(|w| (w, false))
                    .chain(changes.changed.iter().map(|(a, _)| (a, false)))
                    .chain(changes.added.iter().map(|w| (w, true)))
                    .chain(changes.changed.iter().map(|(_, b)| (b, true)))
                {
                    count_worker(&mut model_roles, &mut roles, w, up);
                }
                (Arc::new(model_roles), Arc::new(roles))
            };
        Some(DynamoSnapshot {
            source: self.source,
            namespaces: namespaces.to_vec(),
            workers,
            publishers: publishers.unwrap_or_else(|| self.publishers.clone()),
            by_model,
            model_roles,
            roles,
            seq: self.seq.wrapping_add(1),
            changes: Arc::new(changes),
        })
    }

    /// The index range of `namespace`'s workers.
    fn namespace_range(&self, namespace: &Namespace) -> std::ops::Range<usize> {
        let start = self
            .workers
            .partition_point(|w| w.key.namespace < *namespace);
        let end = start + self.workers[start..].partition_point(|w| w.key.namespace == *namespace);
        start..end
    }

    /// This snapshot with no changes named (`since: None`): every consumer rebuilds from it.
    pub fn rebuilt(mut self) -> Self {
        self.changes = Arc::default();
        self
    }

    /// This snapshot numbered `seq` in the registry's sequence (a snapshot built whole).
    pub fn with_seq(mut self, seq: u64) -> Self {
        self.seq = seq;
        self
    }

    /// This snapshot's number in the registry's sequence.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// What changed since the snapshot numbered `changes().since` (nothing named, `since: None`,
    /// for a snapshot built whole).
    pub fn changes(&self) -> &FleetChanges {
        &self.changes
    }

    /// Workers per role of every namespace that has workers.
    pub fn role_counts(&self) -> &BTreeMap<Namespace, RoleCounts> {
        &self.roles
    }

    /// Workers per role of every (namespace, model) that has workers.
    pub fn model_role_counts(&self) -> &BTreeMap<(Namespace, String), RoleCounts> {
        &self.model_roles
    }

    /// A snapshot with no workers (before the first resync).
    pub fn empty(source: SourceKind, namespaces: &[Namespace]) -> Self {
        build_snapshot(source, namespaces, &[])
    }

    pub fn source(&self) -> SourceKind {
        self.source
    }

    pub fn signals(&self) -> Signals {
        self.source.signals()
    }

    /// Configured namespaces, in configuration order.
    pub fn namespaces(&self) -> &[Namespace] {
        &self.namespaces
    }

    /// The primary namespace (the first configured).
    pub fn namespace(&self) -> Option<&Namespace> {
        self.namespaces.first()
    }

    /// All workers, sorted by key.
    pub fn workers(&self) -> &[Arc<Worker>] {
        &self.workers
    }

    pub fn worker(&self, key: &WorkerKey) -> Option<&Arc<Worker>> {
        self.workers
            .binary_search_by(|w| w.key.cmp(key))
            .ok()
            .map(|i| &self.workers[i])
    }

    /// Workers of `namespace` whose card names `model`, sorted by instance id.
    pub fn workers_for_model<'a>(
        &'a self,
        namespace: &Namespace,
        model: &str,
    ) -> impl Iterator<Item = &'a Arc<Worker>> + 'a {
        self.by_model
            .get(&(namespace.clone(), model.to_owned()))
            .map(Vec::as_slice)
            .unwrap_or_default()
            .iter()
            .map(|i| &self.workers[*i])
    }

    /// Every (namespace, model) with at least one worker, sorted.
    pub fn models(&self) -> impl Iterator<Item = (&Namespace, &str)> {
        self.by_model.keys().map(|(ns, m)| (ns, m.as_str()))
    }

    /// All publishers, sorted by (namespace, publisher id).
    pub fn publishers(&self) -> &[Arc<Publisher>] {
        &self.publishers
    }

    pub fn publisher(&self, namespace: &Namespace, id: PublisherId) -> Option<&Arc<Publisher>> {
        self.publishers
            .binary_search_by(|p| (&p.namespace, p.publisher_id).cmp(&(namespace, id)))
            .ok()
            .map(|i| &self.publishers[i])
    }

    /// `load_publishers` of the admin API: `kv_metrics` channels.
    pub fn load_publisher_count(&self) -> usize {
        self.count_topic(EventTopic::KvMetrics)
    }

    /// `kv_event_publishers` of the admin API: `kv-events` channels.
    pub fn kv_event_publisher_count(&self) -> usize {
        self.count_topic(EventTopic::KvEvents)
    }

    fn count_topic(&self, topic: EventTopic) -> usize {
        self.publishers.iter().filter(|p| p.topic == topic).count()
    }

    /// Same workers (ignoring timestamps) and publishers: a rebuilt snapshot that would not
    /// change anything a reader sees.
    pub fn same_fleet(&self, other: &DynamoSnapshot) -> bool {
        self.source == other.source
            && self.namespaces == other.namespaces
            && self.publishers.len() == other.publishers.len()
            && self
                .publishers
                .iter()
                .zip(&other.publishers)
                .all(|(a, b)| Arc::ptr_eq(a, b) || a == b)
            && self.workers.len() == other.workers.len()
            && self
                .workers
                .iter()
                .zip(&other.workers)
                .all(|(a, b)| Arc::ptr_eq(a, b) || a.same_content(b))
    }
}

/// Pairs shown in one mixed-namespace warning; the rest are summarised.
pub const MAX_MIXED_SHOWN: usize = 8;

/// One model served in one namespace by aggregated workers beside prefill or decode workers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MixedModel {
    pub namespace: Namespace,
    pub model: String,
    pub prefill: usize,
    pub decode: usize,
    pub aggregated: usize,
}

/// The (namespace, model) pairs that newly became mixed: up to [`MAX_MIXED_SHOWN`] shown, the
/// rest summarised.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MixedReport {
    pub shown: Vec<MixedModel>,
    pub suppressed_pairs: usize,
    pub suppressed_prefill: usize,
    pub suppressed_decode: usize,
    pub suppressed_aggregated: usize,
}

impl MixedReport {
    pub fn is_empty(&self) -> bool {
        self.shown.is_empty() && self.suppressed_pairs == 0
    }
}

/// Every mixed (namespace, model) pair of a snapshot, sorted.
pub fn mixed_models(snapshot: &DynamoSnapshot) -> Vec<MixedModel> {
    snapshot
        .model_roles
        .iter()
        .filter(|(_, c)| c.mixed())
        .map(|((namespace, model), c)| mixed_model(namespace, model, c))
        .collect()
}

fn mixed_model(namespace: &Namespace, model: &str, c: &RoleCounts) -> MixedModel {
    MixedModel {
        namespace: namespace.clone(),
        model: model.to_owned(),
        prefill: c.prefill,
        decode: c.decode,
        aggregated: c.aggregated,
    }
}

/// Pairs mixed in `next` that were not mixed in `previous` (the warning is not repeated while a
/// namespace stays mixed). When `next` was patched from `previous`, only the pairs its changes
/// touch are looked at.
pub fn newly_mixed(previous: &DynamoSnapshot, next: &DynamoSnapshot) -> MixedReport {
    let was_mixed =
        |key: &(Namespace, String)| previous.model_roles.get(key).is_some_and(RoleCounts::mixed);
    let candidates: Vec<(&(Namespace, String), &RoleCounts)> = if next.changes.patches(previous.seq)
    {
        let touched: BTreeSet<(Namespace, String)> = next
            .changes
            .touched()
            .filter_map(|w| Some((w.key.namespace.clone(), w.model.clone()?)))
            .collect();
        touched
            .iter()
            .filter_map(|key| next.model_roles.get_key_value(key))
            .collect()
    } else {
        next.model_roles.iter().collect()
    };
    let mut report = MixedReport::default();
    for (key, counts) in candidates {
        if !counts.mixed() || was_mixed(key) {
            continue;
        }
        let m = mixed_model(&key.0, &key.1, counts);
        if report.shown.len() < MAX_MIXED_SHOWN {
            report.shown.push(m);
        } else {
            report.suppressed_pairs += 1;
            report.suppressed_prefill += m.prefill;
            report.suppressed_decode += m.decode;
            report.suppressed_aggregated += m.aggregated;
        }
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::records::TcpAddress;
    use crate::ids::InstanceId;
    use crate::time::UnixMillis;

    fn worker(ns: &str, id: u64, role: Role, model: &str) -> Worker {
        let mut w = Worker::new(
            WorkerKey {
                namespace: Namespace::new(ns),
                instance_id: InstanceId(id),
            },
            "backend",
            role,
            UnixMillis(0),
        );
        w.model = Some(model.to_owned());
        w
    }

    fn view(ns: &str, workers: Vec<Worker>) -> NamespaceView {
        NamespaceView::from_parts(Namespace::new(ns), workers, [])
    }

    #[test]
    fn snapshot_sorts_by_key_and_prunes_unlisted_namespaces() {
        let b = view("b", vec![worker("b", 1, Role::Decode, "m")]);
        let a = view(
            "a",
            vec![
                worker("a", 9, Role::Decode, "m"),
                worker("a", 2, Role::Prefill, "m"),
            ],
        );
        let ns = [Namespace::new("a"), Namespace::new("b")];
        let snap = build_snapshot(SourceKind::Etcd, &ns, &[&b, &a]);
        let keys: Vec<_> = snap
            .workers()
            .iter()
            .map(|w| (w.key.namespace.as_str(), w.key.instance_id.0))
            .collect();
        assert_eq!(keys, vec![("a", 2), ("a", 9), ("b", 1)]);
        let pruned = build_snapshot(SourceKind::Etcd, &ns[..1], &[&b, &a]);
        assert_eq!(pruned.workers().len(), 2);
        let key = WorkerKey {
            namespace: Namespace::new("b"),
            instance_id: InstanceId(1),
        };
        assert!(snap.worker(&key).is_some());
        assert!(pruned.worker(&key).is_none());
        let for_model: Vec<_> = snap
            .workers_for_model(&Namespace::new("a"), "m")
            .map(|w| w.key.instance_id.0)
            .collect();
        assert_eq!(for_model, vec![2, 9]);
    }

    #[test]
    fn publisher_counts_follow_topics() {
        let ns = Namespace::new("a");
        let addr = TcpAddress {
            host: "h".into(),
            port: 1,
        };
        let v = NamespaceView::from_parts(
            ns.clone(),
            [],
            [
                Publisher::new(
                    ns.clone(),
                    EventTopic::KvMetrics,
                    PublisherId(1),
                    addr.clone(),
                ),
                Publisher::new(
                    ns.clone(),
                    EventTopic::KvEvents,
                    PublisherId(2),
                    addr.clone(),
                ),
                Publisher::new(ns.clone(), EventTopic::KvMetrics, PublisherId(3), addr),
            ],
        );
        let snap = build_snapshot(SourceKind::Etcd, std::slice::from_ref(&ns), &[&v]);
        assert_eq!(snap.load_publisher_count(), 2);
        assert_eq!(snap.kv_event_publisher_count(), 1);
        assert!(snap.publisher(&ns, PublisherId(3)).is_some());
        assert!(snap.publisher(&ns, PublisherId(4)).is_none());
    }

    #[test]
    fn mixed_namespaces_are_reported_once_and_capped() {
        let ns = [Namespace::new("a")];
        let before = build_snapshot(
            SourceKind::Etcd,
            &ns,
            &[&view(
                "a",
                vec![
                    worker("a", 1, Role::Prefill, "m0"),
                    worker("a", 2, Role::Aggregated, "m0"),
                ],
            )],
        );
        let mut workers = vec![
            worker("a", 1, Role::Prefill, "m0"),
            worker("a", 2, Role::Aggregated, "m0"),
        ];
        for i in 0..10u64 {
            workers.push(worker("a", 100 + i, Role::Decode, &format!("n{i}")));
            workers.push(worker("a", 200 + i, Role::Aggregated, &format!("n{i}")));
        }
        workers.push(worker("a", 300, Role::Aggregated, "pure"));
        let after = build_snapshot(SourceKind::Etcd, &ns, &[&view("a", workers)]);
        let report = newly_mixed(&before, &after);
        assert_eq!(report.shown.len(), MAX_MIXED_SHOWN);
        assert_eq!(report.shown[0].model, "n0");
        assert_eq!(report.shown[0].decode, 1);
        assert_eq!(report.shown[0].aggregated, 1);
        assert_eq!(report.suppressed_pairs, 2);
        assert_eq!(report.suppressed_decode, 2);
        assert_eq!(report.suppressed_aggregated, 2);
        assert!(newly_mixed(&after, &after).is_empty());
    }

    /// Everything a reader can see of two snapshots is the same (worker versions by pointer or
    /// equal value, timestamps included).
    fn assert_same(patched: &DynamoSnapshot, rebuilt: &DynamoSnapshot) {
        assert_eq!(patched.namespaces(), rebuilt.namespaces());
        assert_eq!(patched.workers().len(), rebuilt.workers().len());
        for (a, b) in patched.workers().iter().zip(rebuilt.workers()) {
            assert!(
                Arc::ptr_eq(a, b) || **a == **b,
                "{:?} vs {:?}",
                a.key,
                b.key
            );
        }
        assert_eq!(patched.publishers(), rebuilt.publishers());
        assert_eq!(patched.by_model, rebuilt.by_model);
        assert_eq!(patched.model_roles, rebuilt.model_roles);
        assert_eq!(patched.roles, rebuilt.roles);
        assert_eq!(mixed_models(patched), mixed_models(rebuilt));
    }

    mod patching {
        use super::*;
        use proptest::prelude::*;

        const ROLES: [Role; 4] = [Role::Prefill, Role::Decode, Role::Aggregated, Role::Unknown];

        /// One step: (operation, namespace, instance id, model/role/capacity seed).
        type Step = (u8, u8, u8, u8);

        fn steps() -> impl Strategy<Value = Vec<Vec<Step>>> {
            prop::collection::vec(
                prop::collection::vec((0u8..10, 0u8..3, 0u8..12, any::<u8>()), 0..6),
                1..24,
            )
        }

        fn make(ns: &str, id: u64, seed: u8, now: u64) -> Arc<Worker> {
            let mut w = worker(
                ns,
                id,
                ROLES[usize::from(seed % 4)],
                &format!("m{}", seed / 4 % 3),
            );
            if seed >= 240 {
                w.model = None;
            }
            w.capacity.total_kv_blocks = Some(u64::from(seed % 5));
            w.first_seen = UnixMillis(now);
            w.last_updated = UnixMillis(now);
            Arc::new(w)
        }

        fn publisher(ns: &str, id: u8, seed: u8) -> Arc<Publisher> {
            let topic = if seed.is_multiple_of(2) {
                EventTopic::KvMetrics
            } else {
                EventTopic::KvEvents
            };
            let addr = TcpAddress {
                host: "h".into(),
                port: u16::from(seed),
            };
            Arc::new(Publisher::new(
                Namespace::new(ns),
                topic,
                PublisherId(u64::from(id)),
                addr,
            ))
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(256))]

            /// A snapshot patched step by step with the changed ids (sometimes whole
            /// namespaces, sometimes a namespace dropped from or added to the configuration)
            /// equals one built whole from the same views, and its change set leads from the
            /// previous snapshot's workers to its own.
            #[test]
            fn a_patched_snapshot_equals_a_rebuilt_one(batches in steps()) {
                let names = ["a", "b", "c"];
                let mut views: Vec<NamespaceView> =
                    names.iter().map(|n| NamespaceView::new(Namespace::new(*n))).collect();
                let mut configured: Vec<Namespace> =
                    names[..2].iter().map(|n| Namespace::new(*n)).collect();
                let mut snap = build_snapshot(SourceKind::Etcd, &configured, &[]).with_seq(7);
                for (t, batch) in batches.iter().enumerate() {
                    let now = t as u64 + 1;
                    let mut touched: Vec<(BTreeSet<InstanceId>, bool, bool)> =
                        vec![(BTreeSet::new(), false, false); names.len()];
                    for &(op, ns, id, seed) in batch {
                        let n = usize::from(ns);
                        let view = &mut views[n];
                        let iid = InstanceId(u64::from(id));
                        match op {
                            0..=3 => {
                                // As the reducer does: an unchanged worker keeps its version.
                                let next = make(names[n], iid.0, seed, now);
                                if !view.workers.get(&iid).is_some_and(|w| w.same_content(&next)) {
                                    view.workers.insert(iid, next);
                                }
                                touched[n].0.insert(iid);
                            }
                            4..=5 => {
                                view.workers.remove(&iid);
                                touched[n].0.insert(iid);
                            }
                            6 => {
                                view.publishers.insert(
                                    PublisherId(u64::from(id)),
                                    publisher(names[n], id, seed),
                                );
                                touched[n].1 = true;
                            }
                            7 => {
                                view.publishers.remove(&PublisherId(u64::from(id)));
                                touched[n].1 = true;
                            }
                            8 => touched[n].2 = true, // staged whole
                            _ => {
                                // Toggle the namespace in the configuration.
                                let name = Namespace::new(names[n]);
                                if let Some(at) = configured.iter().position(|c| *c == name) {
                                    configured.remove(at);
                                } else {
                                    configured.push(name);
                                }
                            }
                        }
                    }
                    let updates: Vec<NamespaceUpdate<'_>> = views
                        .iter()
                        .zip(&touched)
                        .filter(|(v, (ids, p, whole))| {
                            // A namespace re-added to the configuration is staged whole, as its
                            // new source's first view is.
                            *whole || !ids.is_empty() || *p
                                || !snap.namespaces().contains(&v.namespace)
                        })
                        .map(|(view, (ids, publishers, whole))| NamespaceUpdate {
                            view,
                            workers: (!*whole && snap.namespaces().contains(&view.namespace))
                                .then_some(ids),
                            publishers: *publishers || *whole
                                || !snap.namespaces().contains(&view.namespace),
                        })
                        .collect();
                    let refs: Vec<&NamespaceView> = views.iter().collect();
                    let rebuilt = build_snapshot(SourceKind::Etcd, &configured, &refs);
                    match snap.patch(&configured, &updates) {
                        None => {
                            prop_assert!(snap.same_fleet(&rebuilt));
                            assert_same(&snap, &rebuilt);
                        }
                        Some(next) => {
                            assert_same(&next, &rebuilt);
                            let changes = next.changes();
                            prop_assert!(changes.patches(snap.seq()));
                            prop_assert_eq!(next.seq(), snap.seq() + 1);
                            // The change set leads from the old workers to the new ones.
                            let mut keys: BTreeMap<WorkerKey, Arc<Worker>> = snap
                                .workers()
                                .iter()
                                .map(|w| (w.key.clone(), w.clone()))
                                .collect();
                            for w in &changes.removed {
                                prop_assert!(keys.remove(&w.key).is_some());
                            }
                            for (old, new) in &changes.changed {
                                let held = keys.insert(new.key.clone(), new.clone());
                                prop_assert!(held.is_some_and(|h| Arc::ptr_eq(&h, old)));
                            }
                            for w in &changes.added {
                                prop_assert!(keys.insert(w.key.clone(), w.clone()).is_none());
                            }
                            let expected: Vec<&WorkerKey> =
                                next.workers().iter().map(|w| &w.key).collect();
                            prop_assert_eq!(keys.keys().collect::<Vec<_>>(), expected);
                            prop_assert_eq!(
                                changes.publishers,
                                snap.publishers() != next.publishers()
                            );
                            // Mixed pairs found from the changes alone are the full comparison's.
                            let full = newly_mixed(&snap.clone().rebuilt(), &next.clone().rebuilt());
                            prop_assert_eq!(newly_mixed(&snap, &next), full);
                            snap = next;
                        }
                    }
                }
            }
        }
    }
}
