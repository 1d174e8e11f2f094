//! The candidate index of each registry generation, written by one [`IndexWriter`].
//!
//! The PickerActor's incarnation claims the writer (not `Clone`, from the picker's
//! `lock::Exclusive` slot, released with the incarnation's state) and publishes the index of every
//! generation the registry publishes. A request never stores an index: one that races ahead of the
//! actor (the registry published, the actor has not run yet) derives the new generation's index
//! for itself from the held one ([`derive`]: a patch, O(change), when the snapshot leads from the
//! held one) and drops it after its decision, so no decision reads an index older than the
//! snapshot it was published with and the published index has one writer.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use continuum_protocol::discovery::snapshot::DynamoSnapshot;
use continuum_protocol::picker::candidates::CandidateIndex;
use tracing::warn;

use super::SharedPicker;
use crate::lock::Claim;

/// The candidate index of one registry generation.
#[derive(Debug)]
pub struct IndexedGeneration {
    pub generation: u64,
    pub index: Arc<CandidateIndex>,
    /// The registry snapshot (`DynamoSnapshot::seq`) the index reflects; the next snapshot's
    /// change set patches it when it leads from this one.
    pub snapshot_seq: Option<u64>,
}

impl IndexedGeneration {
    /// The index before the first generation (`generation` unknown).
    pub(super) fn empty() -> Self {
        Self {
            generation: u64::MAX,
            index: Arc::new(CandidateIndex::default()),
            snapshot_seq: None,
        }
    }

    /// Whether this index already reflects `generation` or a later one (generations only grow;
    /// `u64::MAX` is "none yet").
    pub(super) fn covers(&self, generation: u64) -> bool {
        self.generation == generation
            || (self.generation != u64::MAX && self.generation > generation)
    }
}

/// The index of `generation` (whose fleet is `snapshot`), derived from `held`: patched with the
/// snapshot's change set when it leads from the snapshot `held` reflects, built whole otherwise.
pub(super) fn derive(
    held: &IndexedGeneration,
    generation: u64,
    snapshot: &DynamoSnapshot,
) -> IndexedGeneration {
    let index = match held.snapshot_seq {
        Some(seq) if snapshot.changes().patches(seq) => held.index.patch(snapshot),
        _ => CandidateIndex::build(snapshot),
    };
    IndexedGeneration {
        generation,
        index: Arc::new(index),
        snapshot_seq: Some(snapshot.seq()),
    }
}

/// The one writer of the published candidate index: not `Clone`; dropping it frees the slot.
pub struct IndexWriter {
    picker: SharedPicker,
    _claim: Claim<()>,
}

impl std::fmt::Debug for IndexWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IndexWriter").finish_non_exhaustive()
    }
}

impl IndexWriter {
    pub(super) fn new(picker: SharedPicker, claim: Claim<()>) -> Self {
        Self {
            picker,
            _claim: claim,
        }
    }

    /// Publishes the index of `generation` unless the held one already covers it (a writer that
    /// read an older generation never replaces a newer index).
    pub fn rebuild(&self, generation: u64, snapshot: &DynamoSnapshot) -> Arc<IndexedGeneration> {
        let inner = &self.picker.inner;
        let held = inner.index.load_full();
        if held.covers(generation) {
            return held;
        }
        let built = Arc::new(derive(&held, generation, snapshot));
        if built.index.refused_workers > 0 {
            warn!(
                workers = built.index.refused_workers,
                generation,
                "Workers whose cards declare an impossible dp rank range are never picked."
            );
        }
        inner.index.store(built.clone());
        inner.rebuilds.fetch_add(1, Ordering::Relaxed);
        built
    }
}
