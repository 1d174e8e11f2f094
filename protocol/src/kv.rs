//! KV-overlap-aware routing, the pure parts: kv-events decoding, the bounded radix index, block
//! hashing and the upstream cost function (dynamo-wire §10–§12, seed "KV-overlap-aware prefill
//! selection").
//!
//! | module | what it holds |
//! |---|---|
//! | [`events`] | the kv-events payload (msgpack array of RouterEvent), decoded with bounds |
//! | [`index`] | [`KvIndex`]: arena radix tree keyed by `tokens_hash`, per-rank ownership |
//! | [`cursors`] | [`CursorTable`]: one subscription's bounded per-(worker, dp_rank) `event_id` cursors |
//! | [`parity`] | [`ParityTracker`]: do the router's predicted block hashes match what workers store? |
//! | [`hashing`] | XXH3-64 LocalBlockHash / SequenceHash (wire §11) |
//! | [`prompt`] | render bounds (fuel, caps, permits, deadline) and the per-block-size hash plan |
//! | [`cost`] | the per-candidate cost, softmax sampling and the zero-temperature argmin |
//! | [`mooncake`] | Mooncake trace `hash_ids` as blocks, and the exact LRU a simulated worker caches with |
//! | [`reference`] | a naive HashMap index with the same semantics, for differential tests |
//! | [`artifacts`] | tokenizer artifacts: card slots, ArtifactKey, URI rules, pinning, fleet agreement, loader bookkeeping |
//!
//! Nothing here reads a clock or draws a random number: the index hasher seed, the sampling unit
//! and the tie-break cursor arrive as arguments.

use std::fmt;

use serde::{Deserialize, Serialize};

pub mod artifacts;
use crate::event_plane::LoadEventResult;

pub mod cost;
pub mod cursors;
pub mod events;
pub mod hashing;
pub mod index;
pub mod mooncake;
pub mod parity;
pub mod prompt;
pub mod reference;

pub use cursors::{Admission, CursorTable, MAX_CURSORS_PER_SUBSCRIPTION};
pub use events::{KvEventsError, RouterEvent, decode_router_events, encode_router_events};
pub use index::{KvIndex, KvIndexLimits, KvIndexStats, RankOverlap};
pub use parity::{ParityDrops, ParityOutcome, ParityStats, ParityTracker};

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

/// The closed label set of `continuum_dynamo_kv_events_total{result}`: the one enum the index,
/// the envelope decoder and the metric share. Every RouterEvent the index sees gets exactly one;
/// a batch or delivery refused before decoding counts once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum KvEventResult {
    /// Applied to the device-tier index (including removes of unknown hashes, which upstream
    /// also skips silently).
    Applied,
    /// `event_id` at or below the rank's cursor (or a duplicate envelope): skipped.
    Replay,
    /// The event jumped past the rank's cursor: the rank's blocks were cleared, then the event
    /// was applied.
    Gap,
    /// A non-device storage tier: the cursor advanced, nothing was indexed.
    OtherTier,
    /// An undecodable batch, or an event that is invalid on its own (a store whose
    /// `parent_hash` is one of its own blocks, an unknown `residency_domain`).
    Malformed,
    /// An envelope of an unknown version (counted once per delivery).
    UnknownVersion,
    /// A delivery on another topic than `kv-events`.
    TopicMismatch,
    /// A frame over the ZMTP bound.
    Oversized,
    /// A worker that is not live, or a dp_rank its card does not declare.
    IdentityMismatch,
    /// A batch over 128 events / 8192 blocks, blocks refused at an index ceiling, an event for a
    /// new rank when the subscription's cursor table is full, or a batch the index actor could
    /// not take.
    OverCapacity,
    /// A connection the dial policy refused.
    TransportRefused,
    /// `residency_domain: "cache_owner"`: state-agent events a passive router ignores.
    CacheOwner,
    /// A store whose `parent_hash` the rank does not hold: dropped whole, as upstream does
    /// ("parent block not found").
    Orphan,
}

impl KvEventResult {
    pub const ALL: [KvEventResult; 13] = [
        KvEventResult::Applied,
        KvEventResult::Replay,
        KvEventResult::Gap,
        KvEventResult::OtherTier,
        KvEventResult::Malformed,
        KvEventResult::UnknownVersion,
        KvEventResult::TopicMismatch,
        KvEventResult::Oversized,
        KvEventResult::IdentityMismatch,
        KvEventResult::OverCapacity,
        KvEventResult::TransportRefused,
        KvEventResult::CacheOwner,
        KvEventResult::Orphan,
    ];

    /// The metric label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            KvEventResult::Applied => "applied",
            KvEventResult::Replay => "replay",
            KvEventResult::Gap => "gap",
            KvEventResult::OtherTier => "other_tier",
            KvEventResult::Malformed => "malformed",
            KvEventResult::UnknownVersion => "unknown_version",
            KvEventResult::TopicMismatch => "topic_mismatch",
            KvEventResult::Oversized => "oversized",
            KvEventResult::IdentityMismatch => "identity_mismatch",
            KvEventResult::OverCapacity => "over_capacity",
            KvEventResult::TransportRefused => "transport_refused",
            KvEventResult::CacheOwner => "cache_owner",
            KvEventResult::Orphan => "orphan",
        }
    }

    /// The Prometheus label value (same as [`KvEventResult::as_str`]).
    pub const fn as_label(self) -> &'static str {
        self.as_str()
    }

    /// How an envelope-level outcome of a kv-events delivery is counted; `None` for `Applied`
    /// (its events are counted one by one once the index has applied them).
    pub fn from_envelope(result: LoadEventResult) -> Option<Self> {
        Some(match result {
            LoadEventResult::Applied => return None,
            LoadEventResult::Malformed => KvEventResult::Malformed,
            LoadEventResult::UnknownVersion => KvEventResult::UnknownVersion,
            LoadEventResult::TopicMismatch => KvEventResult::TopicMismatch,
            LoadEventResult::Oversized => KvEventResult::Oversized,
            LoadEventResult::IdentityMismatch => KvEventResult::IdentityMismatch,
            LoadEventResult::OverCapacity => KvEventResult::OverCapacity,
            LoadEventResult::Duplicate => KvEventResult::Replay,
            LoadEventResult::TransportRefused => KvEventResult::TransportRefused,
        })
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

    pub fn add_n(&mut self, result: KvEventResult, n: u64) {
        self.0[result.position()] += n;
    }

    /// Adds another batch's counts.
    pub fn merge(&mut self, other: &KvEventCounts) {
        for (a, b) in self.0.iter_mut().zip(other.0.iter()) {
            *a += b;
        }
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
    fn envelope_results_map_into_the_kv_set() {
        for result in LoadEventResult::ALL {
            let mapped = KvEventResult::from_envelope(result);
            match result {
                LoadEventResult::Applied => assert_eq!(mapped, None),
                LoadEventResult::Duplicate => assert_eq!(mapped, Some(KvEventResult::Replay)),
                other => assert_eq!(mapped.map(|m| m.as_str()), Some(other.as_str())),
            }
        }
    }

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
