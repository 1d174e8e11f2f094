//! A naive reference for [`super::KvIndex`]: per rank, a HashMap from engine hash to the full
//! `tokens_hash` path from the root, and `find_matches` by checking each request prefix against
//! every rank's set of paths. Same gate, cursor and event semantics, no ceilings, no tree. Slow
//! and obviously right; differential tests and the bench's agreement check compare against it.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use super::events::{KvCacheEventData, ResidencyDomain, RouterEvent, StorageTier};
use super::index::{OwnershipPaths, RankOverlap};
use super::{ExternalBlockHash, KvEventResult, LocalBlockHash};
use crate::ids::{DpRank, InstanceId};

#[derive(Debug, Default)]
struct RefRank {
    cursor: Option<u64>,
    blocks: HashMap<ExternalBlockHash, Vec<LocalBlockHash>>,
}

#[derive(Debug, Default)]
pub struct ReferenceIndex {
    live: BTreeMap<InstanceId, BTreeSet<DpRank>>,
    ranks: BTreeMap<(InstanceId, DpRank), RefRank>,
}

impl ReferenceIndex {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn set_live_and_retain(&mut self, live: BTreeMap<InstanceId, BTreeSet<DpRank>>) {
        self.ranks
            .retain(|(w, r), _| live.get(w).is_some_and(|ranks| ranks.contains(r)));
        self.live = live;
    }

    pub fn clear_ranks(&mut self, ranks: &[(InstanceId, DpRank)]) {
        for key in ranks {
            self.ranks.remove(key);
        }
    }

    pub fn apply(&mut self, event: &RouterEvent) -> KvEventResult {
        let key = (event.worker_id, event.event.dp_rank);
        if !self
            .live
            .get(&key.0)
            .is_some_and(|ranks| ranks.contains(&key.1))
        {
            return KvEventResult::IdentityMismatch;
        }
        let rank = self.ranks.entry(key).or_default();
        let id = event.event.event_id;
        let gap = match rank.cursor {
            Some(cursor) if id <= cursor => return KvEventResult::Replay,
            Some(cursor) => id > cursor + 1,
            None => false,
        };
        rank.cursor = Some(id);
        if gap {
            rank.blocks.clear();
        }
        let result = match (event.residency_domain, event.storage_tier) {
            (Some(ResidencyDomain::Unknown), _) => KvEventResult::Malformed,
            (Some(ResidencyDomain::CacheOwner), _) => KvEventResult::CacheOwner,
            (_, tier) if tier != StorageTier::Device => KvEventResult::OtherTier,
            _ => match &event.event.data {
                KvCacheEventData::Stored(store) => {
                    if store
                        .parent_hash
                        .is_some_and(|p| store.blocks.iter().any(|b| b.block_hash == p))
                    {
                        KvEventResult::Malformed
                    } else {
                        let parent = match store.parent_hash {
                            None => Some(Vec::new()),
                            Some(p) => rank.blocks.get(&p).cloned(),
                        };
                        match parent {
                            None => KvEventResult::Orphan,
                            Some(mut path) => {
                                for block in store.blocks.iter() {
                                    path.push(block.tokens_hash);
                                    rank.blocks.insert(block.block_hash, path.clone());
                                }
                                KvEventResult::Applied
                            }
                        }
                    }
                }
                KvCacheEventData::Removed(remove) => {
                    for hash in remove.block_hashes.iter() {
                        rank.blocks.remove(hash);
                    }
                    KvEventResult::Applied
                }
                KvCacheEventData::Cleared => {
                    rank.blocks.clear();
                    KvEventResult::Applied
                }
            },
        };
        if gap { KvEventResult::Gap } else { result }
    }

    pub fn find_matches(&self, hashes: &[LocalBlockHash]) -> Vec<RankOverlap> {
        let mut out = Vec::new();
        for ((worker, dp_rank), rank) in &self.ranks {
            let held: HashSet<&[LocalBlockHash]> =
                rank.blocks.values().map(|p| p.as_slice()).collect();
            let blocks = (1..=hashes.len())
                .take_while(|n| held.contains(&hashes[..*n]))
                .count();
            if blocks > 0 {
                out.push(RankOverlap {
                    worker: *worker,
                    dp_rank: *dp_rank,
                    blocks: blocks as u32,
                });
            }
        }
        out
    }

    pub fn ownership_paths(&self) -> OwnershipPaths {
        self.ranks
            .iter()
            .filter(|(_, r)| !r.blocks.is_empty())
            .map(|(key, r)| {
                (
                    *key,
                    r.blocks.iter().map(|(h, p)| (*h, p.clone())).collect(),
                )
            })
            .collect()
    }
}
