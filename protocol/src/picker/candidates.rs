//! Picker inputs from the fleet snapshot and the load store, built once per generation.
//!
//! The picker compares ranks; the snapshot lists workers. [`CandidateIndex`] expands each routable
//! worker into one [`Candidate`] per declared dp rank, grouped by model with one shared `Arc<str>`
//! per model, in snapshot order (the order the round-robin cursors index). Workers of unknown role
//! or without a model are visible to operators but never candidates.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use super::dense::{DenseRanks, LoadSlots};
use super::{Candidate, CandidateRole, LoadView, SampleState, dp_ranks};
use crate::discovery::records::Role;
use crate::discovery::snapshot::DynamoSnapshot;
use crate::discovery::view::Worker;
use crate::ids::{DpRank, WorkerKey};
use crate::kv::hashing::BlockSize;
use crate::kv::prompt::MAX_BLOCK_SIZES;
use crate::load_store::{LoadSample, LoadStore};
use crate::time::Tick;

/// Candidates per Dynamo display name.
///
/// Each model's candidates and layout are shared (`Arc`) between indexes, so a patched index
/// ([`CandidateIndex::patch`]) rebuilds only the models a snapshot's changes touch.
#[derive(Clone, Debug, Default)]
pub struct CandidateIndex {
    by_model: BTreeMap<Arc<str>, Arc<Vec<Candidate>>>,
    /// Per model, the block sizes a KV-aware request is hashed for ([`hashed_block_sizes`]).
    block_sizes: BTreeMap<Arc<str>, Vec<BlockSize>>,
    /// Per model, the dense layout of its candidates the pickers scan.
    dense: BTreeMap<Arc<str>, Arc<DenseRanks>>,
    /// Workers left out because their card declared an impossible rank range.
    pub refused_workers: usize,
}

impl CandidateIndex {
    /// Expands every routable worker of `snapshot`.
    pub fn build(snapshot: &DynamoSnapshot) -> Self {
        let mut index = CandidateIndex::default();
        let mut lists: BTreeMap<Arc<str>, Vec<Candidate>> = BTreeMap::new();
        for worker in snapshot.workers() {
            let Some((role, model)) = routable(worker) else {
                continue;
            };
            let model: Arc<str> = match lists.get_key_value(model) {
                Some((shared, _)) => shared.clone(),
                None => Arc::from(model),
            };
            let list = lists.entry(model.clone()).or_default();
            if !expand(worker, role, &model, list) {
                index.refused_workers += 1;
            }
        }
        for (model, list) in lists {
            if !list.is_empty() {
                index.set_model(model, list);
            }
        }
        index
    }

    /// The index of `snapshot` from this index, built from the snapshot that
    /// `snapshot.changes()` lead from: only the models its changed workers serve (before or
    /// after) are expanded again, the others are shared. Equal to [`Self::build`]`(snapshot)`
    /// (a property test checks this); callers check `changes().patches(..)` first.
    pub fn patch(&self, snapshot: &DynamoSnapshot) -> Self {
        let changes = snapshot.changes();
        let mut next = self.clone();
        let mut touched: BTreeSet<&str> = BTreeSet::new();
        let before = changes
            .removed
            .iter()
            .chain(changes.changed.iter().map(|(a, _)| a));
        let after = changes
            .added
            .iter()
            .chain(changes.changed.iter().map(|(_, b)| b));
        for (worker, up) in before.map(|w| (w, false)).chain(after.map(|w| (w, true))) {
            let Some((_, model)) = routable(worker) else {
                continue;
            };
            touched.insert(model);
            if declared_ranks(worker).is_err() {
                next.refused_workers = if up {
                    next.refused_workers.saturating_add(1)
                } else {
                    next.refused_workers.saturating_sub(1)
                };
            }
        }
        for model in touched {
            let name: Arc<str> = match self.by_model.get_key_value(model) {
                Some((shared, _)) => shared.clone(),
                None => Arc::from(model),
            };
            let mut list = Vec::new();
            // Snapshot order: namespaces ascending, then instance ids.
            for (ns, _) in snapshot.models().filter(|(_, m)| *m == model) {
                for worker in snapshot.workers_for_model(ns, model) {
                    if let Some((role, _)) = routable(worker) {
                        expand(worker, role, &name, &mut list);
                    }
                }
            }
            next.by_model.remove(model);
            next.block_sizes.remove(model);
            next.dense.remove(model);
            if !list.is_empty() {
                next.set_model(name, list);
            }
        }
        next
    }

    fn set_model(&mut self, model: Arc<str>, list: Vec<Candidate>) {
        self.block_sizes
            .insert(model.clone(), hashed_block_sizes(&list));
        self.dense
            .insert(model.clone(), Arc::new(DenseRanks::build(&list)));
        self.by_model.insert(model, Arc::new(list));
    }

    /// The block sizes `model`'s prompts are hashed for (computed once per generation).
    pub fn block_sizes(&self, model: &str) -> &[BlockSize] {
        self.block_sizes
            .get(model)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// The candidates serving `model` (a Dynamo display name), in snapshot order.
    pub fn for_model(&self, model: &str) -> &[Candidate] {
        self.by_model
            .get(model)
            .map(|l| l.as_slice())
            .unwrap_or(&[])
    }

    /// The dense layout of [`Self::for_model`]'s candidates (built with the index).
    pub fn layout_for(&self, model: &str) -> Option<&DenseRanks> {
        self.dense.get(model).map(|d| d.as_ref())
    }

    /// Every model's dense layout.
    pub fn layouts(&self) -> impl Iterator<Item = &DenseRanks> {
        self.dense.values().map(|d| d.as_ref())
    }

    /// Candidate ranks across every model.
    pub fn len(&self) -> usize {
        self.by_model.values().map(|l| l.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.by_model.is_empty()
    }

    /// Every model with at least one candidate.
    pub fn models(&self) -> impl Iterator<Item = &str> {
        self.by_model.keys().map(|m| m.as_ref())
    }
}

/// A worker's candidate role and model, unless it is never a candidate (unknown role, no model).
fn routable(worker: &Worker) -> Option<(CandidateRole, &str)> {
    let role = match worker.role {
        Role::Prefill => CandidateRole::Prefill,
        Role::Decode => CandidateRole::Decode,
        Role::Aggregated => CandidateRole::Aggregated,
        Role::Unknown => return None,
    };
    Some((role, worker.model.as_deref()?))
}

fn declared_ranks(
    worker: &Worker,
) -> Result<impl Iterator<Item = (Option<DpRank>, bool)>, super::PickerError> {
    let start = worker.dp_start_rank.map(|r| r.0).unwrap_or(0);
    dp_ranks(start, worker.dp_size)
}

/// Appends one candidate per declared rank of `worker`; false when its rank range is impossible
/// (the worker is refused).
fn expand(
    worker: &Worker,
    role: CandidateRole,
    model: &Arc<str>,
    list: &mut Vec<Candidate>,
) -> bool {
    let Ok(ranks) = declared_ranks(worker) else {
        return false;
    };
    for (dp_rank, rank_declared) in ranks {
        list.push(Candidate {
            worker: worker.key.clone(),
            role,
            model: model.clone(),
            dp_rank,
            rank_declared,
            block_size: worker.block_size,
            total_kv_blocks: worker.capacity.total_kv_blocks,
            max_num_batched_tokens: worker.capacity.max_num_batched_tokens,
        });
    }
    true
}

/// The load store as the pickers read it: each rank's latest sample, fresh while younger than
/// `max_age`. Borrows the store under the one lock a decision takes (the shim) or the
/// simulation's own store (replay): no per-rank locking or cloning.
pub struct StoreView<'a> {
    pub store: &'a LoadStore,
    pub now: Tick,
    pub max_age: Duration,
}

impl LoadView for StoreView<'_> {
    fn sample(&self, worker: &WorkerKey, rank: DpRank) -> SampleState {
        sample_state(
            self.store.latest(worker.instance_id, rank),
            self.now,
            self.max_age,
        )
    }

    fn slots(&self) -> Option<LoadSlots<'_>> {
        Some(LoadSlots {
            store: self.store,
            now: self.now,
            max_age: self.max_age,
        })
    }
}

/// How the picker reads one rank's last sample: fresh while younger than `max_age`.
#[inline]
pub fn sample_state(sample: Option<&LoadSample>, now: Tick, max_age: Duration) -> SampleState {
    match sample {
        None => SampleState::Never,
        Some(s) => SampleState::from_last(
            s.age(now) <= max_age,
            s.load.active_decode_blocks,
            s.load.active_prefill_tokens,
            s.load.kv_used_blocks,
        ),
    }
}

/// The distinct valid block sizes of a model's candidates, ascending, at most
/// [`MAX_BLOCK_SIZES`] (further sizes are not hashed: their ranks score without overlap).
pub fn hashed_block_sizes(candidates: &[Candidate]) -> Vec<BlockSize> {
    let mut sizes: Vec<BlockSize> = candidates
        .iter()
        .filter_map(|c| c.block_size.and_then(|b| BlockSize::new(b).ok()))
        .collect();
    sizes.sort_unstable();
    sizes.dedup();
    sizes.truncate(MAX_BLOCK_SIZES);
    sizes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::SourceEvent;
    use crate::discovery::reducer::DiscoveryReducer;
    use crate::discovery::snapshot::{SourceKind, build_snapshot};
    use crate::ids::{DpRank, Namespace};
    use crate::time::UnixMillis;

    fn worker(
        id: u64,
        component: &str,
        worker_type: &str,
        model: &str,
        dp: Option<(u32, u32)>,
    ) -> Vec<(String, Vec<u8>)> {
        let mut runtime =
            serde_json::json!({"total_kv_blocks": 1024, "max_num_batched_tokens": 8192});
        if let Some((start, size)) = dp {
            runtime["data_parallel_start_rank"] = start.into();
            runtime["data_parallel_size"] = size.into();
        }
        let endpoint = serde_json::json!({"type": "Endpoint", "namespace": "ns", "component": component,
            "endpoint": "generate", "instance_id": id, "transport": {"tcp": "127.0.0.1:1/x"}});
        let card = serde_json::json!({"type": "Model", "namespace": "ns", "component": component,
            "endpoint": "generate", "instance_id": id, "card_json": {"display_name": model,
            "worker_type": worker_type, "kv_cache_block_size": 16, "runtime_config": runtime}});
        vec![
            (
                format!("v1/instances/ns/{component}/generate/{id:x}"),
                serde_json::to_vec(&endpoint).expect("json"),
            ),
            (
                format!("v1/mdc/ns/{component}/generate/{id:x}"),
                serde_json::to_vec(&card).expect("json"),
            ),
        ]
    }

    fn snapshot(records: Vec<(String, Vec<u8>)>) -> DynamoSnapshot {
        let ns = Namespace::new("ns");
        let mut reducer = DiscoveryReducer::new(ns.clone());
        reducer.apply(SourceEvent::Init, UnixMillis(0));
        for (key, value) in records {
            reducer.apply(SourceEvent::InitApply { key, value }, UnixMillis(0));
        }
        reducer.apply(SourceEvent::InitDone, UnixMillis(0));
        build_snapshot(SourceKind::Etcd, &[ns], &[reducer.view().as_ref()])
    }

    #[test]
    fn one_candidate_per_declared_rank_grouped_by_model_with_a_shared_name() {
        let mut records = worker(1, "prefill", "prefill", "m", None);
        records.extend(worker(2, "backend", "decode", "m", Some((2, 3))));
        records.extend(worker(3, "backend", "decode", "other", Some((0, 0))));
        let index = CandidateIndex::build(&snapshot(records));
        let m = index.for_model("m");
        assert_eq!(m.len(), 4);
        assert_eq!(
            (m[0].role, m[0].dp_rank, m[0].rank_declared),
            (CandidateRole::Prefill, None, false)
        );
        let ranks: Vec<_> = m[1..].iter().map(|c| c.dp_rank).collect();
        assert_eq!(
            ranks,
            vec![Some(DpRank(2)), Some(DpRank(3)), Some(DpRank(4))]
        );
        assert!(Arc::ptr_eq(&m[0].model, &m[3].model));
        let other = index.for_model("other");
        assert_eq!(
            (other.len(), other[0].dp_rank, other[0].rank_declared),
            (1, Some(DpRank(0)), true)
        );
        assert!(index.for_model("none").is_empty());
        assert_eq!(m[1].total_kv_blocks, Some(1024));
    }

    #[test]
    fn unknown_roles_and_impossible_rank_ranges_are_never_candidates() {
        let mut records = worker(1, "backend", "encode", "m", None);
        records.extend(worker(2, "backend", "decode", "m", Some((u32::MAX, 2))));
        let index = CandidateIndex::build(&snapshot(records));
        assert!(index.for_model("m").is_empty());
        assert_eq!(index.refused_workers, 1);
    }

    mod patching {
        use super::*;
        use crate::discovery::snapshot::NamespaceUpdate;
        use proptest::prelude::*;

        const TYPES: [&str; 4] = ["prefill", "decode", "encode", "aggregated"];
        const DPS: [Option<(u32, u32)>; 4] =
            [None, Some((0, 2)), Some((u32::MAX, 2)), Some((3, 1))];

        fn same(a: &CandidateIndex, b: &CandidateIndex) {
            assert_eq!(
                a.models().collect::<Vec<_>>(),
                b.models().collect::<Vec<_>>()
            );
            for model in a.models() {
                assert_eq!(a.for_model(model), b.for_model(model), "{model}");
                assert_eq!(a.block_sizes(model), b.block_sizes(model));
                // Equal apart from the layout's id (unique per build: the slot cache's key).
                let shown = |i: &CandidateIndex| {
                    let text = format!("{:?}", i.layout_for(model));
                    let at = text.find(", models").unwrap_or(0);
                    text[at..].to_owned()
                };
                assert_eq!(shown(a), shown(b));
            }
            assert_eq!(a.refused_workers, b.refused_workers);
            assert_eq!(a.len(), b.len());
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(128))]

            /// Records put and deleted at random through the reducer; each batch's changes
            /// patch the snapshot and then the index, which equal the ones built whole.
            #[test]
            fn a_patched_index_equals_a_rebuilt_one(
                batches in prop::collection::vec(
                    prop::collection::vec((0u8..4, 0u64..8, 0usize..4, 0usize..2, 0usize..4), 1..5),
                    1..16,
                ),
            ) {
                let ns = Namespace::new("ns");
                let namespaces = [ns.clone()];
                let mut reducer = DiscoveryReducer::new(ns.clone());
                let mut snap = build_snapshot(SourceKind::Etcd, &namespaces, &[]).with_seq(1);
                let mut index = CandidateIndex::build(&snap);
                for (t, batch) in batches.into_iter().enumerate() {
                    let now = UnixMillis(t as u64);
                    for (op, id, kind, model, dp) in batch {
                        let component = if kind == 0 { "prefill" } else { "backend" };
                        let records = worker(id, component, TYPES[kind], ["m", "n"][model], DPS[dp]);
                        match op {
                            0 | 1 => {
                                for (key, value) in records {
                                    reducer.apply(SourceEvent::Apply { key, value }, now);
                                }
                            }
                            2 => {
                                // The card alone: the worker stays, with another card.
                                let (key, value) = records[1].clone();
                                reducer.apply(SourceEvent::Apply { key, value }, now);
                            }
                            _ => {
                                for (key, _) in records {
                                    reducer.apply(SourceEvent::Delete { key }, now);
                                }
                            }
                        }
                    }
                    let changes = reducer.take_changes();
                    let update = NamespaceUpdate {
                        view: reducer.view(),
                        workers: Some(&changes.workers),
                        publishers: changes.publishers,
                    };
                    let rebuilt = build_snapshot(SourceKind::Etcd, &namespaces, &[reducer.view()]);
                    let Some(next) = snap.patch(&namespaces, &[update]) else {
                        prop_assert!(snap.same_fleet(&rebuilt));
                        continue;
                    };
                    prop_assert!(next.same_fleet(&rebuilt));
                    prop_assert!(next.changes().patches(snap.seq()));
                    let patched = index.patch(&next);
                    same(&patched, &CandidateIndex::build(&next));
                    snap = next;
                    index = patched;
                }
            }
        }
    }
}
