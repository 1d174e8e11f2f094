//! The immutable fleet snapshot every reader shares (`Arc<DynamoSnapshot>`), built purely from
//! the per-namespace views, and the mixed-namespace detector run on each published change.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Serialize;

use super::records::{EventTopic, Role};
use super::view::{NamespaceView, Publisher, Worker};
use crate::ids::{Namespace, PublisherId, WorkerKey};

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
#[derive(Clone, Debug)]
pub struct DynamoSnapshot {
    source: SourceKind,
    namespaces: Vec<Namespace>,
    workers: Vec<Arc<Worker>>,
    publishers: Vec<Arc<Publisher>>,
    /// (namespace, model) → indexes into `workers`, ascending.
    by_model: BTreeMap<(Namespace, String), Vec<usize>>,
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
    let by_model: BTreeMap<(Namespace, String), Vec<usize>> = grouped
        .into_iter()
        .map(|((ns, model), idx)| ((ns.clone(), model.to_owned()), idx))
        .collect();
    DynamoSnapshot {
        source,
        namespaces: namespaces.to_vec(),
        workers,
        publishers,
        by_model,
    }
}

impl DynamoSnapshot {
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
    let mut out = Vec::new();
    for ((namespace, model), idx) in &snapshot.by_model {
        let (mut prefill, mut decode, mut aggregated) = (0, 0, 0);
        for i in idx {
            match snapshot.workers[*i].role {
                Role::Prefill => prefill += 1,
                Role::Decode => decode += 1,
                Role::Aggregated => aggregated += 1,
                Role::Unknown => {}
            }
        }
        if aggregated > 0 && (prefill > 0 || decode > 0) {
            out.push(MixedModel {
                namespace: namespace.clone(),
                model: model.clone(),
                prefill,
                decode,
                aggregated,
            });
        }
    }
    out
}

/// Pairs mixed in `next` that were not mixed in `previous` (the warning is not repeated while a
/// namespace stays mixed).
pub fn newly_mixed(previous: &DynamoSnapshot, next: &DynamoSnapshot) -> MixedReport {
    let before: std::collections::BTreeSet<(Namespace, String)> = mixed_models(previous)
        .into_iter()
        .map(|m| (m.namespace, m.model))
        .collect();
    let mut report = MixedReport::default();
    for m in mixed_models(next) {
        if before.contains(&(m.namespace.clone(), m.model.clone())) {
            continue;
        }
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
}
