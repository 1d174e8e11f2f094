//! The dense per-generation layout the pickers scan: one struct-of-arrays row per candidate rank
//! (capacity, role, (model, namespace) group, instance and rank), built once per registry
//! generation with the [`CandidateIndex`](super::candidates::CandidateIndex), never per request.
//!
//! A pick reads, per rank, a 4-byte group id, a 1-byte role, the capacity it needs and the rank's
//! sample by its load-store slot ([`LoadSlots`]): no 112-byte [`Candidate`], no namespace or model
//! string, no hash of a `WorkerKey`. The slots themselves are resolved once per
//! [`LoadStore::slot_epoch`](crate::load_store::LoadStore::slot_epoch) (a key gained or lost its
//! sample) and kept in the [`PickerState`](super::PickerState)'s [`SlotCache`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{Candidate, CandidateRole, SampleState};
use crate::ids::{DpRank, InstanceId, Namespace};
use crate::load_store::LoadStore;
use crate::time::Tick;

/// A rank whose sample the load store does not hold.
pub const NO_SLOT: u32 = u32::MAX;

/// A group that does not serve the request (wrong model or namespace not eligible).
pub(super) const NOT_ELIGIBLE: u16 = u16::MAX;

fn next_layout_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The candidates of one generation as struct-of-arrays, in candidate order (the order the
/// round-robin cursors index). Capacities use 0 for "not declared" (a zero capacity scores as
/// undeclared anyway). A clone keeps the id: it lays out the same candidates.
#[derive(Clone, Debug)]
pub struct DenseRanks {
    /// Unique per build: the key of the [`SlotCache`].
    id: u64,
    models: Vec<Arc<str>>,
    namespaces: Vec<Namespace>,
    /// Distinct (model, namespace) pairs, as indices into `models` and `namespaces`.
    groups: Vec<(u32, u32)>,
    pub(super) group: Vec<u32>,
    pub(super) role: Vec<CandidateRole>,
    pub(super) instance: Vec<InstanceId>,
    pub(super) rank: Vec<DpRank>,
    pub(super) block_size: Vec<u32>,
    pub(super) total_kv_blocks: Vec<u64>,
    pub(super) max_num_batched_tokens: Vec<u64>,
    /// Every row as `(instance, row)`, sorted: the rows of one instance, found by binary search
    /// when the ledger's few pending dispatches are laid onto rows.
    by_instance: Vec<(InstanceId, u32)>,
}

impl Default for DenseRanks {
    fn default() -> Self {
        Self::build(&[])
    }
}

impl DenseRanks {
    /// The layout of `candidates` (O(n), once per generation).
    pub fn build(candidates: &[Candidate]) -> Self {
        let mut dense = DenseRanks {
            id: next_layout_id(),
            models: Vec::new(),
            namespaces: Vec::new(),
            groups: Vec::new(),
            group: Vec::with_capacity(candidates.len()),
            role: Vec::with_capacity(candidates.len()),
            instance: Vec::with_capacity(candidates.len()),
            rank: Vec::with_capacity(candidates.len()),
            block_size: Vec::with_capacity(candidates.len()),
            total_kv_blocks: Vec::with_capacity(candidates.len()),
            max_num_batched_tokens: Vec::with_capacity(candidates.len()),
            by_instance: Vec::with_capacity(candidates.len()),
        };
        dense.fill(candidates);
        dense
    }

    /// Refills `self` for `candidates`, reusing its buffers (a layout built per pick, for a
    /// caller that has none).
    pub(super) fn rebuild(&mut self, candidates: &[Candidate]) {
        self.id = next_layout_id();
        self.models.clear();
        self.namespaces.clear();
        self.groups.clear();
        self.group.clear();
        self.role.clear();
        self.instance.clear();
        self.rank.clear();
        self.block_size.clear();
        self.total_kv_blocks.clear();
        self.max_num_batched_tokens.clear();
        self.by_instance.clear();
        self.fill(candidates);
    }

    fn fill(&mut self, candidates: &[Candidate]) {
        // Candidates come grouped by model and namespace: the previous group is tried first.
        let mut last: Option<(u32, &Candidate)> = None;
        for c in candidates {
            let group = match last {
                Some((g, prev)) if same_group(prev, c) => g,
                _ => self.group_of(c),
            };
            last = Some((group, c));
            self.group.push(group);
            self.role.push(c.role);
            self.instance.push(c.worker.instance_id);
            self.rank.push(c.rank());
            self.block_size.push(c.block_size.unwrap_or(0));
            self.total_kv_blocks.push(c.total_kv_blocks.unwrap_or(0));
            self.max_num_batched_tokens
                .push(c.max_num_batched_tokens.unwrap_or(0));
        }
        // Rows fit u32: a pick reads at most u32::MAX of them.
        self.by_instance.extend(
            self.instance
                .iter()
                .enumerate()
                .map(|(row, &instance)| (instance, row as u32)),
        );
        self.by_instance.sort_unstable();
    }

    /// The rows of `instance`, ascending.
    #[inline]
    pub(super) fn rows_of(&self, instance: InstanceId) -> impl Iterator<Item = usize> + '_ {
        let start = self.by_instance.partition_point(|&(i, _)| i < instance);
        self.by_instance[start..]
            .iter()
            .take_while(move |&&(i, _)| i == instance)
            .map(|&(_, row)| row as usize)
    }

    fn group_of(&mut self, c: &Candidate) -> u32 {
        let model = match self.models.iter().position(|m| **m == *c.model) {
            Some(m) => m,
            None => {
                self.models.push(c.model.clone());
                self.models.len() - 1
            }
        };
        let namespace = match self
            .namespaces
            .iter()
            .position(|n| *n == c.worker.namespace)
        {
            Some(n) => n,
            None => {
                self.namespaces.push(c.worker.namespace.clone());
                self.namespaces.len() - 1
            }
        };
        // Both fit u32: at most one model and one namespace per candidate.
        let pair = (model as u32, namespace as u32);
        match self.groups.iter().position(|g| *g == pair) {
            Some(g) => g as u32,
            None => {
                self.groups.push(pair);
                (self.groups.len() - 1) as u32
            }
        }
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn len(&self) -> usize {
        self.group.len()
    }

    pub fn is_empty(&self) -> bool {
        self.group.is_empty()
    }

    /// Per group, the request's eligible-namespace position when the group serves `model` in an
    /// eligible namespace, else [`NOT_ELIGIBLE`]. At most `u16::MAX - 1` eligible namespaces
    /// count (at most 16 can be configured).
    pub(super) fn eligibility(&self, model: &str, eligible: &[Namespace], out: &mut Vec<u16>) {
        out.clear();
        let eligible = &eligible[..eligible.len().min(usize::from(NOT_ELIGIBLE))];
        let model_ok: Vec<bool> = self.models.iter().map(|m| **m == *model).collect();
        let ns_pos: Vec<u16> = self
            .namespaces
            .iter()
            .map(|n| {
                eligible
                    .iter()
                    .position(|e| e == n)
                    .map_or(NOT_ELIGIBLE, |p| p as u16)
            })
            .collect();
        out.extend(self.groups.iter().map(|&(m, n)| {
            if model_ok[m as usize] {
                ns_pos[n as usize]
            } else {
                NOT_ELIGIBLE
            }
        }));
    }
}

fn same_group(a: &Candidate, b: &Candidate) -> bool {
    (Arc::ptr_eq(&a.model, &b.model) || a.model == b.model)
        && a.worker.namespace == b.worker.namespace
}

/// The load store read by slot: what [`LoadView::slots`](super::LoadView::slots) hands a picker
/// so it reads each rank's sample by index, with no dynamic call or hash per rank.
#[derive(Clone, Copy)]
pub struct LoadSlots<'a> {
    pub store: &'a LoadStore,
    pub now: Tick,
    pub max_age: std::time::Duration,
}

impl std::fmt::Debug for LoadSlots<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadSlots")
            .field("epoch", &self.store.slot_epoch())
            .finish_non_exhaustive()
    }
}

impl LoadSlots<'_> {
    /// The sample state in `slot` ([`NO_SLOT`] or an emptied slot reads as never sampled): what
    /// [`sample_state`](super::candidates::sample_state) says, with the age test written as a
    /// comparison with `now - max_age` (loop-invariant in a scan) instead of a subtraction per
    /// rank.
    #[inline(always)]
    pub fn state_at(&self, slot: u32) -> SampleState {
        let Some(s) = self.store.at_slot(slot) else {
            return SampleState::Never;
        };
        // `now.since(received) <= max_age`: always when `now < max_age` (the age is below
        // `now`), else exactly when the sample was received at or after `now - max_age`.
        let fresh = self
            .now
            .0
            .checked_sub(self.max_age)
            .is_none_or(|oldest| s.received_at.0 >= oldest);
        SampleState::from_last(
            fresh,
            s.load.active_decode_blocks,
            s.load.active_prefill_tokens,
            s.load.kv_used_blocks,
        )
    }
}

/// The slots of one layout's ranks in one load store, resolved when the layout or the store's
/// slot epoch changes (a new generation, a rank's first sample, an eviction), not per pick.
#[derive(Debug, Default)]
pub struct SlotCache {
    entries: Vec<SlotEntry>,
    resolutions: u64,
}

#[derive(Debug)]
struct SlotEntry {
    layout: u64,
    epoch: u64,
    slots: Vec<u32>,
}

/// Layouts whose slots are kept at once (one per model picked recently).
pub const SLOT_CACHE_LAYOUTS: usize = 8;

impl SlotCache {
    /// The slots of `dense`'s ranks in `store`, resolving them if the layout or epoch changed.
    pub fn slots(&mut self, dense: &DenseRanks, store: &LoadStore) -> &[u32] {
        let epoch = store.slot_epoch();
        let pos = match self.entries.iter().position(|e| e.layout == dense.id) {
            Some(pos) => pos,
            None => {
                if self.entries.len() >= SLOT_CACHE_LAYOUTS {
                    self.entries.remove(0);
                }
                self.entries.push(SlotEntry {
                    layout: dense.id,
                    epoch: epoch.wrapping_add(1),
                    slots: Vec::new(),
                });
                self.entries.len() - 1
            }
        };
        let entry = &mut self.entries[pos];
        if entry.epoch != epoch || entry.slots.len() != dense.len() {
            entry.slots.clear();
            entry.slots.extend(
                dense
                    .instance
                    .iter()
                    .zip(&dense.rank)
                    .map(|(&i, &r)| store.slot(i, r).unwrap_or(NO_SLOT)),
            );
            entry.epoch = epoch;
            self.resolutions += 1;
        }
        &entry.slots
    }

    /// How many times slots were resolved (a layout or epoch change each).
    pub fn resolutions(&self) -> u64 {
        self.resolutions
    }
}
