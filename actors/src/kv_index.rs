//! The shared bounded KV index fed by kv-events subscriptions.
//!
//! Every decision (decode bounds, identity gate, per-rank cursors, ceilings) is
//! `protocol::kv`'s; this handle owns the lock, the live-worker gate from registry generations
//! and the `continuum_dynamo_kv_events_total{result}` counts.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};

use continuum_protocol::discovery::snapshot::DynamoSnapshot;
use continuum_protocol::event_plane::LoadEventResult;
use continuum_protocol::ids::{DpRank, InstanceId};
use continuum_protocol::kv::KvEventResult as IndexResult;
use continuum_protocol::kv::LocalBlockHash;
use continuum_protocol::kv::events::decode_router_events;
use continuum_protocol::kv::index::{KvIndex, KvIndexStats, RankOverlap};

use crate::metrics::{KvEventResult, Metrics};

/// The process-wide KV index handle.
#[derive(Clone)]
pub struct DynamoKvIndex {
    index: Arc<Mutex<KvIndex>>,
    metrics: Option<Metrics>,
}

impl std::fmt::Debug for DynamoKvIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DynamoKvIndex").finish_non_exhaustive()
    }
}

impl DynamoKvIndex {
    pub fn new(metrics: Option<Metrics>) -> Self {
        // Keys the index's hash tables so fleet-authored hashes cannot aim at collisions.
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0x9e37_79b9_7f4a_7c15);
        Self {
            index: Arc::new(Mutex::new(KvIndex::new(seed))),
            metrics,
        }
    }

    fn lock(&self) -> MutexGuard<'_, KvIndex> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Decodes one envelope payload (a RouterEvent batch) and applies it.
    pub fn apply_payload(&self, payload: &[u8]) {
        match decode_router_events(payload) {
            Ok(events) => {
                let counts = self.lock().apply_batch(&events);
                if let Some(metrics) = &self.metrics {
                    for (result, n) in counts.iter() {
                        if n > 0 {
                            metrics.kv_events(metric_of(result), n);
                        }
                    }
                }
            }
            Err(error) => self.count(metric_of(error.result())),
        }
    }

    /// Counts an envelope-level drop.
    pub fn count_envelope(&self, result: LoadEventResult) {
        let mapped = match result {
            LoadEventResult::Applied => return,
            LoadEventResult::Malformed => KvEventResult::Malformed,
            LoadEventResult::UnknownVersion => KvEventResult::UnknownVersion,
            LoadEventResult::TopicMismatch => KvEventResult::TopicMismatch,
            LoadEventResult::Oversized => KvEventResult::Oversized,
            LoadEventResult::IdentityMismatch => KvEventResult::IdentityMismatch,
            LoadEventResult::OverCapacity => KvEventResult::OverCapacity,
            LoadEventResult::Duplicate => KvEventResult::Replay,
            LoadEventResult::TransportRefused => KvEventResult::TransportRefused,
        };
        self.count(mapped);
    }

    fn count(&self, result: KvEventResult) {
        if let Some(metrics) = &self.metrics {
            metrics.kv_event(result);
        }
    }

    /// The live-worker gate: only live workers and the dp ranks their cards declare.
    pub fn set_live(&self, snapshot: &DynamoSnapshot) {
        let mut live: BTreeMap<InstanceId, BTreeSet<DpRank>> = BTreeMap::new();
        for worker in snapshot.workers() {
            let start = worker.dp_start_rank.map(|r| r.0).unwrap_or(0);
            let size = worker.dp_size.unwrap_or(1).clamp(1, 4096);
            let ranks = (start..start.saturating_add(size)).map(DpRank).collect();
            live.insert(worker.key.instance_id, ranks);
        }
        self.lock().set_live_and_retain(live);
    }

    /// Per rank, how many leading `hashes` it holds (the picker's one read of the index): ranks
    /// without overlap are omitted, the list is sorted by (worker, dp_rank).
    pub fn find_matches(&self, hashes: &[LocalBlockHash]) -> Vec<RankOverlap> {
        if hashes.is_empty() {
            return Vec::new();
        }
        self.lock().find_matches(hashes)
    }

    /// Node, rank and ownership counts (walks the index: not for the request path).
    pub fn stats(&self) -> KvIndexStats {
        self.lock().stats()
    }
}

fn metric_of(result: IndexResult) -> KvEventResult {
    match result {
        IndexResult::Applied => KvEventResult::Applied,
        IndexResult::OtherTier => KvEventResult::OtherTier,
        IndexResult::CacheOwner => KvEventResult::CacheOwner,
        IndexResult::Malformed => KvEventResult::Malformed,
        IndexResult::Gap => KvEventResult::Gap,
        IndexResult::Replay => KvEventResult::Replay,
        IndexResult::IdentityMismatch => KvEventResult::IdentityMismatch,
        IndexResult::OverCapacity => KvEventResult::OverCapacity,
        IndexResult::Orphan => KvEventResult::Orphan,
    }
}
