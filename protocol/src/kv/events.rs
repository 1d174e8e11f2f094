//! The kv-events payload (dynamo-wire §10): the inner msgpack array of RouterEvent carried in an
//! event-plane envelope's `payload`. Decoding is tolerant outside (unknown members ignored,
//! `storage_tier` and `dp_rank` defaulted, any integer width) and strict inside (every sequence
//! length checked against its bound before anything is reserved for it).
//!
//! Encoding mirrors `rmp_serde::to_vec_named` over upstream's 1.6.1 types, member for member, so
//! a decoded captured payload re-encodes to the same bytes (the round-trip tests rely on it).

use serde::de::{self, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{ExternalBlockHash, KvEventResult, LocalBlockHash};
use crate::ids::{DpRank, InstanceId};

/// Upstream splits publisher batches at 128 events (wire §10.3).
pub const MAX_EVENTS_PER_BATCH: usize = 128;
/// ... and at 8192 blocks (stored blocks + removed hashes). A larger batch is refused whole.
pub const MAX_BLOCKS_PER_BATCH: usize = 8_192;
/// Multimodal objects per block and offsets per object: generous, only there so a hostile
/// declared length never reaches an allocator.
pub const MAX_MM_OBJECTS_PER_BLOCK: usize = 1_024;
pub const MAX_MM_OFFSETS_PER_OBJECT: usize = 1_024;

/// Marks a bound violation inside serde's error string, so it can be told apart from syntax.
const OVER_CAPACITY_MARK: &str = "continuum-kv-over-capacity";

#[derive(Debug, thiserror::Error)]
pub enum KvEventsError {
    #[error("kv-events payload is not a RouterEvent array: {0}")]
    Malformed(String),
    #[error(
        "kv-events batch exceeds {MAX_EVENTS_PER_BATCH} events or {MAX_BLOCKS_PER_BATCH} blocks"
    )]
    OverCapacity,
}

impl KvEventsError {
    /// How a refused batch is counted (once per batch).
    pub fn result(&self) -> KvEventResult {
        match self {
            KvEventsError::Malformed(_) => KvEventResult::Malformed,
            KvEventsError::OverCapacity => KvEventResult::OverCapacity,
        }
    }
}

/// One RouterEvent. `state_source` (cache-owner identity) is not kept: cache-owner events are
/// not indexed by a passive router.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouterEvent {
    pub worker_id: InstanceId,
    #[serde(default)]
    pub storage_tier: StorageTier,
    /// Absent on 1.4.x publishers (legacy = the worker domain).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub residency_domain: Option<ResidencyDomain>,
    pub event: KvCacheEvent,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StorageTier {
    #[default]
    Device,
    HostPinned,
    Disk,
    External,
    /// A tier this build does not know; counted as `other_tier`, like the known lower tiers.
    #[serde(other)]
    Unknown,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResidencyDomain {
    Worker,
    CacheOwner,
    /// Invalid upstream; counted as `malformed` by the index rather than failing the batch.
    #[serde(other)]
    Unknown,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCacheEvent {
    pub event_id: u64,
    pub data: KvCacheEventData,
    #[serde(default)]
    pub dp_rank: DpRank,
}

/// Externally tagged, snake_case: `{"stored": {...}}`, `{"removed": {...}}`, `"cleared"`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvCacheEventData {
    Stored(KvCacheStoreData),
    Removed(KvCacheRemoveData),
    Cleared,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCacheStoreData {
    pub parent_hash: Option<ExternalBlockHash>,
    #[serde(default)]
    pub start_position: Option<u32>,
    pub blocks: Bounded<StoredBlock, MAX_BLOCKS_PER_BATCH>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredBlock {
    pub block_hash: ExternalBlockHash,
    pub tokens_hash: LocalBlockHash,
    /// Not used for matching (the worker already folded it into `tokens_hash`); kept so
    /// payloads round-trip. Boxed to keep `StoredBlock` small.
    #[serde(default)]
    pub mm_extra_info: Option<Box<MmExtraInfo>>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MmExtraInfo {
    pub mm_objects: Bounded<MmObject, MAX_MM_OBJECTS_PER_BLOCK>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MmObject {
    pub mm_hash: u64,
    pub offsets: Bounded<(u64, u64), MAX_MM_OFFSETS_PER_OBJECT>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvCacheRemoveData {
    pub block_hashes: Bounded<ExternalBlockHash, MAX_BLOCKS_PER_BATCH>,
}

/// A `Vec` whose decoder refuses more than `N` elements before reserving anything for them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bounded<T, const N: usize>(pub Vec<T>);

impl<T, const N: usize> Bounded<T, N> {
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<T, const N: usize> std::ops::Deref for Bounded<T, N> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.0
    }
}

impl<T, const N: usize> From<Vec<T>> for Bounded<T, N> {
    fn from(v: Vec<T>) -> Self {
        Self(v)
    }
}

impl<T: Serialize, const N: usize> Serialize for Bounded<T, N> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de, T: Deserialize<'de>, const N: usize> Deserialize<'de> for Bounded<T, N> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T, const N: usize>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>, const N: usize> Visitor<'de> for V<T, N> {
            type Value = Bounded<T, N>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "an array of at most {N} elements")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let declared = seq.size_hint().unwrap_or(0);
                if declared > N {
                    return Err(de::Error::custom(OVER_CAPACITY_MARK));
                }
                let mut out = Vec::with_capacity(declared);
                while let Some(item) = seq.next_element()? {
                    if out.len() == N {
                        return Err(de::Error::custom(OVER_CAPACITY_MARK));
                    }
                    out.push(item);
                }
                Ok(Bounded(out))
            }
        }
        d.deserialize_seq(V::<T, N>(std::marker::PhantomData))
    }
}

impl KvCacheEventData {
    /// Blocks this event carries against the batch's block bound.
    pub fn block_count(&self) -> usize {
        match self {
            KvCacheEventData::Stored(s) => s.blocks.len(),
            KvCacheEventData::Removed(r) => r.block_hashes.len(),
            KvCacheEventData::Cleared => 0,
        }
    }
}

/// Decodes one kv-events payload. At most [`MAX_EVENTS_PER_BATCH`] events and
/// [`MAX_BLOCKS_PER_BATCH`] blocks; anything larger is refused whole with
/// [`KvEventsError::OverCapacity`], before the declared sizes are reserved.
pub fn decode_router_events(payload: &[u8]) -> Result<Vec<RouterEvent>, KvEventsError> {
    let batch: Bounded<RouterEvent, MAX_EVENTS_PER_BATCH> = rmp_serde::from_slice(payload)
        .map_err(|error| {
            let text = error.to_string();
            if text.contains(OVER_CAPACITY_MARK) {
                KvEventsError::OverCapacity
            } else {
                KvEventsError::Malformed(text)
            }
        })?;
    let blocks: usize = batch.iter().map(|e| e.event.data.block_count()).sum();
    if blocks > MAX_BLOCKS_PER_BATCH {
        return Err(KvEventsError::OverCapacity);
    }
    Ok(batch.0)
}

/// Encodes events exactly as upstream's publisher does (`rmp_serde::to_vec_named`).
pub fn encode_router_events(events: &[RouterEvent]) -> Vec<u8> {
    // Writing plain structs of integers and strings into a Vec cannot fail.
    rmp_serde::to_vec_named(events).expect("RouterEvent encodes infallibly into a Vec")
}

#[cfg(test)]
mod tests;
