//! Picker inputs from the fleet snapshot and the load store, built once per generation.
//!
//! The picker compares ranks; the snapshot lists workers. [`CandidateIndex`] expands each routable
//! worker into one [`Candidate`] per declared dp rank, grouped by model with one shared `Arc<str>`
//! per model, in snapshot order (the order the round-robin cursors index). Workers of unknown role
//! or without a model are visible to operators but never candidates.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use super::dense::{DenseRanks, LoadSlots};
use super::{Candidate, CandidateRole, LoadView, SampleState, dp_ranks};
use crate::discovery::records::Role;
use crate::discovery::snapshot::DynamoSnapshot;
use crate::ids::{DpRank, WorkerKey};
use crate::kv::hashing::BlockSize;
use crate::kv::prompt::MAX_BLOCK_SIZES;
use crate::load_store::{LoadSample, LoadStore};
use crate::time::Tick;

/// Candidates per Dynamo display name.
#[derive(Clone, Debug, Default)]
pub struct CandidateIndex {
    by_model: BTreeMap<Arc<str>, Vec<Candidate>>,
    /// Per model, the block sizes a KV-aware request is hashed for ([`hashed_block_sizes`]).
    block_sizes: BTreeMap<Arc<str>, Vec<BlockSize>>,
    /// Per model, the dense layout of its candidates the pickers scan.
    dense: BTreeMap<Arc<str>, DenseRanks>,
    /// Workers left out because their card declared an impossible rank range.
    pub refused_workers: usize,
}

impl CandidateIndex {
    /// Expands every routable worker of `snapshot`.
    pub fn build(snapshot: &DynamoSnapshot) -> Self {
        let mut index = CandidateIndex::default();
        for worker in snapshot.workers() {
            let role = match worker.role {
                Role::Prefill => CandidateRole::Prefill,
                Role::Decode => CandidateRole::Decode,
                Role::Aggregated => CandidateRole::Aggregated,
                Role::Unknown => continue,
            };
            let Some(model) = worker.model.as_deref() else {
                continue;
            };
            let start = worker.dp_start_rank.map(|r| r.0).unwrap_or(0);
            let Ok(ranks) = dp_ranks(start, worker.dp_size) else {
                index.refused_workers += 1;
                continue;
            };
            let model: Arc<str> = match index.by_model.get_key_value(model) {
                Some((shared, _)) => shared.clone(),
                None => Arc::from(model),
            };
            let list = index.by_model.entry(model.clone()).or_default();
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
        }
        index.block_sizes = index
            .by_model
            .iter()
            .map(|(model, list)| (model.clone(), hashed_block_sizes(list)))
            .collect();
        index.dense = index
            .by_model
            .iter()
            .map(|(model, list)| (model.clone(), DenseRanks::build(list)))
            .collect();
        index
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
        self.by_model.get(model).map(Vec::as_slice).unwrap_or(&[])
    }

    /// The dense layout of [`Self::for_model`]'s candidates (built with the index).
    pub fn layout_for(&self, model: &str) -> Option<&DenseRanks> {
        self.dense.get(model)
    }

    /// Every model's dense layout.
    pub fn layouts(&self) -> impl Iterator<Item = &DenseRanks> {
        self.dense.values()
    }

    /// Candidate ranks across every model.
    pub fn len(&self) -> usize {
        self.by_model.values().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.by_model.is_empty()
    }

    /// Every model with at least one candidate.
    pub fn models(&self) -> impl Iterator<Item = &str> {
        self.by_model.keys().map(|m| m.as_ref())
    }
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
}
