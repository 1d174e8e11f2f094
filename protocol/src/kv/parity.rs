//! Hash parity: do the block hashes the router predicts for a request equal the `tokens_hash`
//! values the chosen worker then stores? (issue #7 item 6; beyond the seed.)
//!
//! KV-aware routing only works when the router's LocalBlockHash of a prompt block (wire §11.1:
//! XXH3-64 of the rendered prompt's token ids, seeded with 1337, LoRA name and cache salt) equals
//! the `tokens_hash` the worker's publisher puts on the `Stored` blocks of the same prompt. A
//! different tokenizer or chat template, another `kv_cache_block_size`, or a salt the engine
//! ignores (the 1.6.1 mocker ignores `cache_salt`, wire §10.4) makes every lookup miss silently.
//! `tokens_hash` is the field compared: `block_hash` is the engine's own hash (the mocker's
//! equals Dynamo's SequenceHash, vLLM's does not) and is never predicted.
//!
//! After a KV-aware pick the caller records the blocks it expects the rank to store: the request's
//! LocalBlockHashes past the overlap the index reported (the new part of the prefix). The
//! prediction is then decided by that rank's `Stored` events:
//! * **match** — a stored block's `tokens_hash` equals a predicted hash, and from there the stored
//!   blocks continue the prediction in order (as far as both go: stores may be split);
//! * **mismatch** — [`MISMATCH_AFTER_STORES`] stores on the rank without a match (other requests'
//!   stores arrive in between on a busy rank, hence the margin), or at least one store and then
//!   expiry after [`PREDICTION_TTL`];
//! * **expired** (neither) — no store at all on the rank within [`PREDICTION_TTL`].
//!
//! Bounded: at most [`MAX_PENDING_PREDICTIONS`] pending (and [`MAX_PENDING_PER_RANK`] per rank),
//! the oldest dropped and counted; [`MAX_PREDICTED_BLOCKS`] hashes kept per prediction;
//! [`MAX_TRACKED_MODELS`] models, each with a ring of its last [`RESULT_WINDOW`] results.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use super::LocalBlockHash;
use super::events::StoredBlock;
use crate::ids::{DpRank, InstanceId};
use crate::time::Tick;

/// Pending predictions across all ranks.
pub const MAX_PENDING_PREDICTIONS: usize = 4_096;
/// Pending predictions of one (worker, dp_rank).
pub const MAX_PENDING_PER_RANK: usize = 256;
/// Leading new-block hashes kept per prediction.
pub const MAX_PREDICTED_BLOCKS: usize = 64;
/// A prediction not decided by then is decided (mismatch if the rank stored anything) or dropped.
pub const PREDICTION_TTL: Duration = Duration::from_secs(60);
/// Stores on the rank without a match before a prediction counts as a mismatch.
pub const MISMATCH_AFTER_STORES: u32 = 32;
/// The per-model window behind `last_100_match_ratio` and the zero-parity warning.
pub const RESULT_WINDOW: usize = 100;
/// Models tracked at once (the fleet's models; more are refused).
pub const MAX_TRACKED_MODELS: usize = 1_024;
/// Model names longer than this are refused (fleet ids are far shorter).
pub const MAX_MODEL_NAME_BYTES: usize = 512;

/// One decided prediction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParityOutcome {
    pub model: Arc<str>,
    pub matched: bool,
    /// This result completed a full window of [`RESULT_WINDOW`] results with no match, the first
    /// time since the model's last match: the caller warns loudly, once.
    pub zero_parity: bool,
}

/// A model's parity as `GET /admin/dynamo/workers` shows it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParityStats {
    /// Predictions decided (match + mismatch) since the model appeared.
    pub checked: u64,
    pub matched: u64,
    /// Results in the window (≤ [`RESULT_WINDOW`]) and the matches among them.
    pub window: usize,
    pub window_matched: usize,
}

impl ParityStats {
    /// Matches over the last (up to 100) results; `None` before the first result.
    pub fn last_100_match_ratio(&self) -> Option<f64> {
        (self.window > 0).then(|| self.window_matched as f64 / self.window as f64)
    }
}

#[derive(Debug, Default)]
struct ModelParity {
    stats: ParityStats,
    ring: VecDeque<bool>,
    warned: bool,
}

impl ModelParity {
    fn push(&mut self, matched: bool) -> bool {
        self.stats.checked += 1;
        if self.ring.len() == RESULT_WINDOW && self.ring.pop_front() == Some(true) {
            self.stats.window_matched -= 1;
        }
        self.ring.push_back(matched);
        if matched {
            self.stats.matched += 1;
            self.stats.window_matched += 1;
            self.warned = false;
        }
        self.stats.window = self.ring.len();
        let zero = self.ring.len() == RESULT_WINDOW && self.stats.window_matched == 0;
        if zero && !self.warned {
            self.warned = true;
            return true;
        }
        false
    }
}

#[derive(Debug)]
struct Prediction {
    model: Arc<str>,
    rank: (InstanceId, DpRank),
    hashes: Vec<LocalBlockHash>,
    at: Tick,
    stores_seen: u32,
}

/// Counters of predictions that were never decided.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParityDrops {
    /// Dropped at a bound (oldest first) or refused (unknown-model bound, long name).
    pub dropped: u64,
    /// No store on the rank within [`PREDICTION_TTL`].
    pub expired: u64,
}

/// The pure parity tracker; the KV index actor owns one and feeds it `Stored` events.
#[derive(Debug, Default)]
pub struct ParityTracker {
    next: u64,
    pending: BTreeMap<u64, Prediction>,
    by_rank: BTreeMap<(InstanceId, DpRank), BTreeSet<u64>>,
    models: BTreeMap<Arc<str>, ModelParity>,
    drops: ParityDrops,
}

impl ParityTracker {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records that `model`'s request was sent to (worker, dp_rank), which should now store
    /// `new_blocks` (the request's LocalBlockHashes past the overlap the index reported). Returns
    /// false when nothing was recorded (no new blocks, a bound refused it).
    pub fn record_prediction(
        &mut self,
        model: &str,
        worker: InstanceId,
        dp_rank: DpRank,
        new_blocks: &[LocalBlockHash],
        now: Tick,
    ) -> bool {
        if new_blocks.is_empty() {
            return false;
        }
        let Some(model) = self.model_key(model) else {
            self.drops.dropped += 1;
            return false;
        };
        let rank = (worker, dp_rank);
        if self.by_rank.get(&rank).map_or(0, BTreeSet::len) >= MAX_PENDING_PER_RANK {
            let oldest = self.by_rank.get(&rank).and_then(|s| s.first().copied());
            if let Some(id) = oldest {
                self.remove(id);
                self.drops.dropped += 1;
            }
        }
        if self.pending.len() >= MAX_PENDING_PREDICTIONS
            && let Some(id) = self.pending.keys().next().copied()
        {
            self.remove(id);
            self.drops.dropped += 1;
        }
        let id = self.next;
        self.next += 1;
        let keep = new_blocks.len().min(MAX_PREDICTED_BLOCKS);
        self.pending.insert(
            id,
            Prediction {
                model,
                rank,
                hashes: new_blocks[..keep].to_vec(),
                at: now,
                stores_seen: 0,
            },
        );
        self.by_rank.entry(rank).or_default().insert(id);
        true
    }

    fn model_key(&mut self, model: &str) -> Option<Arc<str>> {
        if let Some((key, _)) = self.models.get_key_value(model) {
            return Some(key.clone());
        }
        if model.len() > MAX_MODEL_NAME_BYTES || self.models.len() >= MAX_TRACKED_MODELS {
            return None;
        }
        let key: Arc<str> = Arc::from(model);
        self.models.insert(key.clone(), ModelParity::default());
        Some(key)
    }

    fn remove(&mut self, id: u64) -> Option<Prediction> {
        let p = self.pending.remove(&id)?;
        if let Some(set) = self.by_rank.get_mut(&p.rank) {
            set.remove(&id);
            if set.is_empty() {
                self.by_rank.remove(&p.rank);
            }
        }
        Some(p)
    }

    fn decide(&mut self, p: &Prediction, matched: bool, out: &mut Vec<ParityOutcome>) {
        if let Some(model) = self.models.get_mut(&p.model) {
            let zero_parity = model.push(matched);
            out.push(ParityOutcome {
                model: p.model.clone(),
                matched,
                zero_parity,
            });
        }
    }

    /// One device-tier `Stored` event of (worker, dp_rank) that the index admitted (call with
    /// the stored blocks in order). Decides the rank's predictions it matches, and those that have
    /// now waited through [`MISMATCH_AFTER_STORES`] stores.
    pub fn on_stored(
        &mut self,
        worker: InstanceId,
        dp_rank: DpRank,
        blocks: &[StoredBlock],
    ) -> Vec<ParityOutcome> {
        let mut out = Vec::new();
        let Some(ids) = self.by_rank.get(&(worker, dp_rank)) else {
            return out;
        };
        if blocks.is_empty() {
            return out;
        }
        let ids: Vec<u64> = ids.iter().copied().collect();
        let mut position: HashMap<LocalBlockHash, usize> = HashMap::with_capacity(blocks.len());
        for (i, b) in blocks.iter().enumerate() {
            position.entry(b.tokens_hash).or_insert(i);
        }
        for id in ids {
            let Some(p) = self.pending.get_mut(&id) else {
                continue;
            };
            let matched = p.hashes.iter().enumerate().find_map(|(j, h)| {
                let i = *position.get(h)?;
                Some(
                    blocks[i..]
                        .iter()
                        .zip(&p.hashes[j..])
                        .all(|(b, h)| b.tokens_hash == *h),
                )
            });
            p.stores_seen = p.stores_seen.saturating_add(1);
            let decided = match matched {
                Some(true) => Some(true),
                _ if p.stores_seen >= MISMATCH_AFTER_STORES => Some(false),
                _ => None,
            };
            if let Some(matched) = decided
                && let Some(p) = self.remove(id)
            {
                self.decide(&p, matched, &mut out);
            }
        }
        out
    }

    /// Decides or drops predictions older than [`PREDICTION_TTL`].
    pub fn expire(&mut self, now: Tick) -> Vec<ParityOutcome> {
        let mut out = Vec::new();
        let old: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| now.since(p.at) >= PREDICTION_TTL)
            .map(|(id, _)| *id)
            .collect();
        for id in old {
            if let Some(p) = self.remove(id) {
                if p.stores_seen > 0 {
                    self.decide(&p, false, &mut out);
                } else {
                    self.drops.expired += 1;
                }
            }
        }
        out
    }

    /// Forgets the ranks `keep` rejects (departed workers and ranks): their predictions are
    /// dropped uncounted, since no store will ever decide them.
    pub fn retain_ranks(&mut self, mut keep: impl FnMut(InstanceId, DpRank) -> bool) {
        let gone: Vec<u64> = self
            .by_rank
            .iter()
            .filter(|((w, r), _)| !keep(*w, *r))
            .flat_map(|(_, ids)| ids.iter().copied())
            .collect();
        for id in gone {
            self.remove(id);
        }
    }

    /// Keeps only models `keep` admits (the fleet's); returns the names removed, whose metric
    /// series the caller removes.
    pub fn retain_models(&mut self, mut keep: impl FnMut(&str) -> bool) -> Vec<Arc<str>> {
        let gone: Vec<Arc<str>> = self.models.keys().filter(|m| !keep(m)).cloned().collect();
        if gone.is_empty() {
            return gone;
        }
        for m in &gone {
            self.models.remove(m);
        }
        let orphans: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| !self.models.contains_key(&p.model))
            .map(|(id, _)| *id)
            .collect();
        for id in orphans {
            self.remove(id);
        }
        gone
    }

    /// One model's parity; `None` if it never had a prediction.
    pub fn stats(&self, model: &str) -> Option<ParityStats> {
        self.models.get(model).map(|m| m.stats)
    }

    /// Every tracked model's parity, by name.
    pub fn all_stats(&self) -> impl Iterator<Item = (&str, ParityStats)> + '_ {
        self.models.iter().map(|(m, p)| (&**m, p.stats))
    }

    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    pub fn drops(&self) -> ParityDrops {
        self.drops
    }
}

#[cfg(test)]
mod tests;
