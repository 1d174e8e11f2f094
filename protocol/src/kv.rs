//! KV-overlap-aware routing, the pure parts: kv-events decoding, the bounded radix index, block
//! hashing and the upstream cost function (dynamo-wire §10–§12, seed "KV-overlap-aware prefill
//! selection").
//!
//! | module | what it holds |
//! |---|---|
//! | [`events`] | the kv-events payload (msgpack array of RouterEvent), decoded with bounds |
//! | [`index`] | [`KvIndex`]: arena radix tree keyed by `tokens_hash`, per-rank ownership |
//! | [`hashing`] | XXH3-64 LocalBlockHash / SequenceHash (wire §11) |
//! | [`prompt`] | render bounds (fuel, caps, permits, deadline) and the per-block-size hash plan |
//! | [`cost`] | the per-candidate cost, softmax sampling and the zero-temperature argmin |
//! | [`reference`] | a naive HashMap index with the same semantics, for differential tests |
//!
//! Nothing here reads a clock or draws a random number: the index hasher seed, the sampling unit
//! and the tie-break cursor arrive as arguments.

use std::fmt;

use serde::{Deserialize, Serialize};

pub mod cost;
pub mod events;
pub mod hashing;
pub mod index;
pub mod prompt;
pub mod reference;

pub use events::{KvEventsError, RouterEvent, decode_router_events, encode_router_events};
pub use index::{KvIndex, KvIndexLimits, KvIndexStats, RankOverlap};

/// Dynamo's LocalBlockHash: XXH3-64 of one block's tokens (`tokens_hash` on the wire). The radix
/// index is keyed by it, and requests are matched by it.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct LocalBlockHash(pub u64);

/// The engine's own block hash (`block_hash`, `parent_hash`, `removed.block_hashes`): opaque,
/// engine-specific, only used to attach and remove nodes of one (worker, dp_rank).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct ExternalBlockHash(pub u64);

/// Dynamo's chained SequenceHash (wire §11.3), computed by the router from LocalBlockHashes.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct SequenceHash(pub u64);

/// The closed label set of `continuum_dynamo_kv_events_total{result}`. Every RouterEvent the
/// index sees gets exactly one; a batch refused before decoding counts once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum KvEventResult {
    /// Applied to the device-tier index (including removes of unknown hashes, which upstream
    /// also skips silently).
    Applied,
    /// A non-device storage tier: the cursor advanced, nothing was indexed.
    OtherTier,
    /// `residency_domain: "cache_owner"`: state-agent events a passive router ignores.
    CacheOwner,
    /// An undecodable batch, or an event that is invalid on its own (a store whose
    /// `parent_hash` is one of its own blocks, an unknown `residency_domain`).
    Malformed,
    /// The event jumped past the rank's cursor: the rank's blocks were cleared, then the event
    /// was applied.
    Gap,
    /// `event_id` at or below the rank's cursor: skipped.
    Replay,
    /// A worker that is not live, or a dp_rank its card does not declare.
    IdentityMismatch,
    /// A batch over 128 events / 8192 blocks, or blocks refused at an index ceiling.
    OverCapacity,
    /// A store whose `parent_hash` the rank does not hold: dropped whole, as upstream does
    /// ("parent block not found").
    Orphan,
}

impl KvEventResult {
    pub const ALL: [KvEventResult; 9] = [
        KvEventResult::Applied,
        KvEventResult::OtherTier,
        KvEventResult::CacheOwner,
        KvEventResult::Malformed,
        KvEventResult::Gap,
        KvEventResult::Replay,
        KvEventResult::IdentityMismatch,
        KvEventResult::OverCapacity,
        KvEventResult::Orphan,
    ];

    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            KvEventResult::Applied => "applied",
            KvEventResult::OtherTier => "other_tier",
            KvEventResult::CacheOwner => "cache_owner",
            KvEventResult::Malformed => "malformed",
            KvEventResult::Gap => "gap",
            KvEventResult::Replay => "replay",
            KvEventResult::IdentityMismatch => "identity_mismatch",
            KvEventResult::OverCapacity => "over_capacity",
            KvEventResult::Orphan => "orphan",
        }
    }

    fn position(self) -> usize {
        self as usize
    }
}

impl fmt::Display for KvEventResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Per-result counters, so an actor can add a batch's outcome to its metrics in one step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvEventCounts([u64; KvEventResult::ALL.len()]);

impl KvEventCounts {
    pub fn add(&mut self, result: KvEventResult) {
        self.0[result.position()] += 1;
    }

    pub fn get(&self, result: KvEventResult) -> u64 {
        self.0[result.position()]
    }

    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }

    /// Non-zero counters in label order.
    pub fn iter(&self) -> impl Iterator<Item = (KvEventResult, u64)> + '_ {
        KvEventResult::ALL
            .iter()
            .map(|r| (*r, self.get(*r)))
            .filter(|(_, n)| *n > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_labels_are_distinct_and_positions_match() {
        let labels: std::collections::BTreeSet<_> =
            KvEventResult::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(labels.len(), KvEventResult::ALL.len());
        for (i, r) in KvEventResult::ALL.iter().enumerate() {
            assert_eq!(r.position(), i);
        }
        let mut counts = KvEventCounts::default();
        counts.add(KvEventResult::Gap);
        counts.add(KvEventResult::Gap);
        counts.add(KvEventResult::Orphan);
        assert_eq!(counts.get(KvEventResult::Gap), 2);
        assert_eq!(counts.total(), 3);
        assert_eq!(
            counts.iter().collect::<Vec<_>>(),
            vec![(KvEventResult::Gap, 2), (KvEventResult::Orphan, 1)]
        );
    }
}
