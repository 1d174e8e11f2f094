//! The dense per-generation layout the pickers scan: one struct-of-arrays row per candidate rank
//! (capacity, role, (model, namespace) group, instance and rank), built once per registry
//! generation with the [`CandidateIndex`](super::candidates::CandidateIndex), never per request.
//!
//! A decode pass reads, per rank, one fused 16-byte [`Row`] (group and role, block size, KV
//! capacity) and the rank's sample mirrored per row ([`RowSample`], 32 bytes): no 112-byte
//! [`Candidate`], no ~104-byte `Option<LoadSample>`, no namespace or model string, no hash of a
//! `WorkerKey`. The rows' load-store slots are resolved once per
//! [`LoadStore::slot_epoch`](crate::load_store::LoadStore::slot_epoch) (a key gained or lost its
//! sample), and the mirror is caught up from the store's change log
//! ([`LoadStore::changed_since`](crate::load_store::LoadStore::changed_since)) when samples were
//! written; both live in the [`PickerState`](super::PickerState)'s [`SlotCache`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{Candidate, CandidateRole, SampleState};
use crate::id_hash::IdMap;
use crate::ids::{DpRank, InstanceId, Namespace};
use crate::load_store::{LoadSample, LoadStore};
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
    /// What a decode pass reads per rank, fused into one 16-byte row: the scan streams one
    /// array.
    pub(super) rows: Vec<Row>,
    /// Per group, the roles its rows hold ([`role_bit`] of each role present).
    pub(super) group_roles: Vec<u8>,
    /// Rows per `(group, role)` ([`Row::table_index`]): a phase's candidates are counted per
    /// pick from its table, not per rank.
    pub(super) group_role_rows: Vec<u32>,
    /// The block size every row declares (0 included), when they all declare the same one:
    /// a decode pass then computes the request's blocks once.
    pub(super) uniform_block_size: Option<u32>,
    /// The KV capacity every row declares (0 included), when they all declare the same one: a
    /// decode pass over such a layout compares costs by their numerators alone.
    pub(super) uniform_kv_blocks: Option<u64>,
    /// Every row as `(instance, row)`, sorted: the rows of one instance, found by binary search
    /// when the ledger's few pending dispatches are laid onto rows.
    by_instance: Vec<(InstanceId, u32)>,
    /// Per instance, the position of its first entry in `by_instance`: the ledger's legs,
    /// listed in no order, find their rows by one hash each instead of a binary search.
    instance_start: IdMap<InstanceId, u32>,
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
            rows: Vec::with_capacity(candidates.len()),
            group_roles: Vec::new(),
            group_role_rows: Vec::new(),
            uniform_block_size: None,
            uniform_kv_blocks: None,
            by_instance: Vec::with_capacity(candidates.len()),
            instance_start: IdMap::default(),
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
        self.rows.clear();
        self.group_roles.clear();
        self.group_role_rows.clear();
        self.by_instance.clear();
        self.instance_start.clear();
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
            self.rows.push(Row::new(
                group,
                c.role,
                c.block_size.unwrap_or(0),
                c.total_kv_blocks.unwrap_or(0),
            ));
        }
        self.group_roles.resize(self.groups.len(), 0);
        self.group_role_rows.resize(self.groups.len() * 4, 0);
        self.uniform_block_size = uniform(&self.block_size);
        self.uniform_kv_blocks = uniform(&self.total_kv_blocks);
        for ((&group, &role), row) in self.group.iter().zip(&self.role).zip(&self.rows) {
            if let Some(roles) = self.group_roles.get_mut(group as usize) {
                *roles |= role_bit(role);
            }
            if let Some(count) = self.group_role_rows.get_mut(row.group_role as usize) {
                *count = count.saturating_add(1);
            }
        }
        // Rows fit u32: a pick reads at most u32::MAX of them.
        self.by_instance.extend(
            self.instance
                .iter()
                .enumerate()
                .map(|(row, &instance)| (instance, row as u32)),
        );
        self.by_instance.sort_unstable();
        for (pos, &(instance, _)) in self.by_instance.iter().enumerate().rev() {
            // Positions fit u32 as the rows do; the last insert per instance is its first entry.
            self.instance_start.insert(instance, pos as u32);
        }
    }

    /// The rows of `instance`, ascending.
    #[inline]
    pub(super) fn rows_of(&self, instance: InstanceId) -> impl Iterator<Item = usize> + '_ {
        let start = self
            .instance_start
            .get(&instance)
            .map_or(self.by_instance.len(), |&p| p as usize);
        self.by_instance[start.min(self.by_instance.len())..]
            .iter()
            .take_while(move |&&(i, _)| i == instance)
            .map(|&(_, row)| row as usize)
    }

    /// The entries of `instance` (`(instance, row)`, rows ascending) and the position just
    /// past them in the layout's instance order. `guess` is where they may start: a caller
    /// walking instances in ascending order passes the position this returned for the last
    /// one, and a list holding most ranks finds the next instance right there; otherwise (a
    /// list holding few ranks) one hash lookup finds them. The guess is only tried: any value
    /// gives the same entries. No entries: an empty slice and `guess`.
    #[inline]
    pub(super) fn entries_of(
        &self,
        instance: InstanceId,
        guess: usize,
    ) -> (&[(InstanceId, u32)], usize) {
        let entries = &self.by_instance[..];
        let start = match entries.get(guess) {
            Some(&(i, _)) if i == instance => Some(guess),
            _ => self.instance_start.get(&instance).map(|&p| p as usize),
        };
        let Some(tail) = start.and_then(|s| entries.get(s..)) else {
            return (&[], guess);
        };
        let len = tail.iter().take_while(|&&(i, _)| i == instance).count();
        (&tail[..len], start.unwrap_or(guess) + len)
    }

    /// Whether `table` (per `(group, role)`, [`Row::table_index`]) makes every row of the
    /// layout a candidate: a pass may then read per-row columns without the table.
    pub(super) fn all_candidates(&self, table: &[u16]) -> bool {
        self.group_role_rows.len() == table.len()
            && self
                .group_role_rows
                .iter()
                .zip(table)
                .all(|(&rows, &ns)| rows == 0 || ns != NOT_ELIGIBLE)
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

    /// The namespace of `row`.
    #[inline]
    pub(super) fn namespace_of(&self, row: usize) -> Option<&Namespace> {
        let &(_, n) = self.groups.get(*self.group.get(row)? as usize)?;
        self.namespaces.get(n as usize)
    }

    pub fn len(&self) -> usize {
        self.group.len()
    }

    /// Distinct (model, namespace) groups.
    pub(super) fn groups(&self) -> usize {
        self.groups.len()
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
        // Per group, its model and namespace compared directly: a layout holds few groups, and
        // a pick allocates nothing for them.
        out.extend(self.groups.iter().enumerate().map(|(g, &(m, n))| {
            let model_ok = self.models.get(m as usize).is_some_and(|m| **m == *model);
            // A group id rows cannot name exactly is never eligible (see `MAX_ROW_GROUPS`).
            if !model_ok || g >= MAX_ROW_GROUPS as usize {
                return NOT_ELIGIBLE;
            }
            self.namespaces
                .get(n as usize)
                .and_then(|ns| eligible.iter().position(|e| e == ns))
                .map_or(NOT_ELIGIBLE, |p| p as u16)
        }));
    }
}

/// One bit per role, in [`DenseRanks::group_roles`].
#[inline]
pub(super) fn role_bit(role: CandidateRole) -> u8 {
    1 << role_code(role)
}

#[inline]
fn role_code(role: CandidateRole) -> u32 {
    match role {
        CandidateRole::Prefill => 0,
        CandidateRole::Decode => 1,
        CandidateRole::Aggregated => 2,
    }
}

/// Groups a [`Row`] can name: the group index shares a `u32` with the role's two bits. A layout
/// reaching it would hold 2^30 distinct (model, namespace) pairs, one candidate (112 bytes)
/// each; rows past it share the last group id (never eligible: see [`DenseRanks::eligibility`]).
pub(super) const MAX_ROW_GROUPS: u32 = (1 << 30) - 1;

/// What a decode pass reads of one rank, in 16 bytes: its group and role (as one index into a
/// per-pick table of `4 × groups` entries), its block size and its KV capacity (0: not
/// declared).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Row {
    /// `group << 2 | role code`.
    pub(super) group_role: u32,
    pub(super) block_size: u32,
    pub(super) total_kv_blocks: u64,
}

impl Row {
    fn new(group: u32, role: CandidateRole, block_size: u32, total_kv_blocks: u64) -> Self {
        Self {
            group_role: group.min(MAX_ROW_GROUPS) << 2 | role_code(role),
            block_size,
            total_kv_blocks,
        }
    }

    /// The index of `(group, role)` in a table of `4 × groups` entries.
    pub(super) fn table_index(group: usize, role: CandidateRole) -> usize {
        group * 4 + role_code(role) as usize
    }
}

fn same_group(a: &Candidate, b: &Candidate) -> bool {
    (Arc::ptr_eq(&a.model, &b.model) || a.model == b.model)
        && a.worker.namespace == b.worker.namespace
}

/// The load store as the pickers read it on the production path: what
/// [`LoadView::slots`](super::LoadView::slots) hands a picker so it mirrors each row's sample by
/// slot ([`SlotCache::samples`]), with no dynamic call or hash per rank.
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

/// One rank's last sample as a pick reads it, mirrored per layout row (32 bytes instead of a
/// ~104-byte `Option<LoadSample>` behind a slot): when it arrived and the backlog fields, with
/// the rules of [`SampleState::from_last`] folded in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RowSample {
    /// `received_at` in nanoseconds plus one; 0: no sample held. Fresh exactly when
    /// `at > oldest` ([`LoadSlots::oldest`]).
    pub(super) at: u64,
    /// `active_decode_blocks`, else `kv_used_blocks` (valid with [`RowSample::HAS_DECODE`]).
    pub(super) decode: u64,
    /// `active_prefill_tokens` (valid with [`RowSample::HAS_PREFILL`]).
    pub(super) prefill: u64,
    pub(super) flags: u32,
}

impl RowSample {
    pub(super) const HAS_DECODE: u32 = 1;
    pub(super) const HAS_PREFILL: u32 = 2;
    /// Some field reported a nonzero backlog (a stale sample then reads as silent under load).
    pub(super) const BUSY: u32 = 4;

    /// The mirror of `sample` (`None`: never sampled).
    pub fn of(sample: Option<&LoadSample>) -> Self {
        let Some(s) = sample else {
            return Self::default();
        };
        let busy = |field: Option<u64>| field.is_some_and(|v| v > 0);
        let decode = s.load.active_decode_blocks.or(s.load.kv_used_blocks);
        let mut flags = 0;
        if decode.is_some() {
            flags |= Self::HAS_DECODE;
        }
        if s.load.active_prefill_tokens.is_some() {
            flags |= Self::HAS_PREFILL;
        }
        if busy(s.load.active_decode_blocks)
            || busy(s.load.active_prefill_tokens)
            || busy(s.load.kv_used_blocks)
        {
            flags |= Self::BUSY;
        }
        Self {
            at: nanos(s.received_at.0).saturating_add(1),
            decode: decode.unwrap_or(0),
            prefill: s.load.active_prefill_tokens.unwrap_or(0),
            flags,
        }
    }

    /// The state [`sample_state`](super::candidates::sample_state) gives the mirrored sample
    /// for a pick whose freshness bound is `oldest` (the raw `active_decode_blocks` /
    /// `kv_used_blocks` pair is read as its combination, the only way the pickers read it).
    #[inline]
    pub fn state(&self, oldest: u64) -> SampleState {
        if self.at == 0 {
            SampleState::Never
        } else if self.at > oldest {
            SampleState::Fresh {
                active_decode_blocks: (self.flags & Self::HAS_DECODE != 0).then_some(self.decode),
                active_prefill_tokens: (self.flags & Self::HAS_PREFILL != 0)
                    .then_some(self.prefill),
                kv_used_blocks: None,
            }
        } else {
            SampleState::Stale {
                last_had_backlog: self.flags & Self::BUSY != 0,
            }
        }
    }

    /// The decode backlog a pick scores from this sample: the fresh field (`Some`, and `true`:
    /// a fresh sample carries it), 0 when quiet (never sampled, or stale without backlog), no
    /// cost when silent under load or fresh without the field.
    #[inline(always)]
    pub(super) fn decode_base(&self, oldest: u64) -> (Option<u64>, bool) {
        if self.at > oldest {
            if self.flags & Self::HAS_DECODE != 0 {
                (Some(self.decode), true)
            } else {
                (None, false)
            }
        } else if self.flags & Self::BUSY != 0 {
            (None, false)
        } else {
            (Some(0), false)
        }
    }
}

/// A duration in nanoseconds, saturating (at 584 years).
#[inline]
fn nanos(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl LoadSlots<'_> {
    /// The pick's freshness bound for [`RowSample::at`]: a sample is fresh when
    /// `now.since(received) <= max_age`, i.e. always when `now < max_age`, else exactly when it
    /// was received at or after `now - max_age` (`at = received + 1 > now - max_age`).
    #[inline]
    pub fn oldest(&self) -> u64 {
        self.now.0.checked_sub(self.max_age).map_or(0, nanos)
    }
}

/// The slots of one layout's ranks in one load store, resolved when the layout or the store's
/// slot epoch changes (a new generation, a rank's first sample, an eviction), not per pick; and
/// each row's sample mirrored ([`RowSample`]), caught up from the store's change log
/// ([`LoadStore::changed_since`]) when samples were written since the last pick.
#[derive(Debug, Default)]
pub struct SlotCache {
    entries: Vec<SlotEntry>,
    resolutions: u64,
    refills: u64,
}

#[derive(Debug)]
struct SlotEntry {
    layout: u64,
    epoch: u64,
    slots: Vec<u32>,
    /// `(slot, row)` for every row holding a slot, sorted: the rows a logged write touches.
    by_slot: Vec<(u32, u32)>,
    samples: Vec<RowSample>,
    /// The store's [`LoadStore::changes`] the mirror reflects.
    seen: u64,
    /// The mirror's decode backlogs as one column, for passes that read nothing else per rank.
    column: DecodeColumn,
}

/// Layouts whose slots are kept at once (one per model picked recently).
pub const SLOT_CACHE_LAYOUTS: usize = 8;

impl SlotCache {
    /// The slots of `dense`'s ranks in `store`, resolving them if the layout or epoch changed.
    pub fn slots(&mut self, dense: &DenseRanks, store: &LoadStore) -> &[u32] {
        let pos = self.entry(dense, store);
        &self.entries[pos].slots
    }

    /// Each of `dense`'s rows' sample in `store`, mirrored: slots resolved if the layout or
    /// epoch changed, rows written since the last call re-read.
    pub fn samples(&mut self, dense: &DenseRanks, store: &LoadStore) -> &[RowSample] {
        let pos = self.caught_up(dense, store);
        &self.entries[pos].samples
    }

    /// [`Self::samples`], with the rows' [`DecodeColumn`] brought up to date for a pick whose
    /// freshness bound is `oldest` ([`LoadSlots::oldest`]).
    pub(super) fn samples_with_column(
        &mut self,
        dense: &DenseRanks,
        store: &LoadStore,
        oldest: u64,
    ) -> (&[RowSample], &mut DecodeColumn) {
        let pos = self.caught_up(dense, store);
        let entry = &mut self.entries[pos];
        entry.column.update(&entry.samples, oldest);
        (&entry.samples, &mut entry.column)
    }

    /// The entry of `dense` in `store` with its mirror caught up.
    fn caught_up(&mut self, dense: &DenseRanks, store: &LoadStore) -> usize {
        let pos = self.entry(dense, store);
        let entry = &mut self.entries[pos];
        if entry.seen != store.changes() {
            // Catching up costs a binary search per logged write; past an eighth of the rows
            // re-reading them all is cheaper.
            let behind = store.changes().wrapping_sub(entry.seen);
            let caught_up = match store.changed_since(entry.seen) {
                Some(changed) if behind <= (dense.len() / 8) as u64 => {
                    for slot in changed {
                        let first = entry.by_slot.partition_point(|&(s, _)| s < slot);
                        for &(s, row) in &entry.by_slot[first..] {
                            if s != slot {
                                break;
                            }
                            if let Some(mirror) = entry.samples.get_mut(row as usize) {
                                *mirror = RowSample::of(store.at_slot(slot));
                                entry.column.rewritten(row);
                            }
                        }
                    }
                    true
                }
                _ => false,
            };
            if !caught_up {
                entry.refill(store);
                self.refills += 1;
            }
            entry.seen = store.changes();
        }
        pos
    }

    /// The entry of `dense` in `store` (slots resolved and samples mirrored afresh when the
    /// layout or the epoch changed).
    fn entry(&mut self, dense: &DenseRanks, store: &LoadStore) -> usize {
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
                    by_slot: Vec::new(),
                    samples: Vec::new(),
                    seen: 0,
                    column: DecodeColumn::default(),
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
            entry.by_slot.clear();
            // Rows fit u32 (a pick reads at most u32::MAX of them).
            entry.by_slot.extend(
                entry
                    .slots
                    .iter()
                    .enumerate()
                    .filter(|&(_, &slot)| slot != NO_SLOT)
                    .map(|(row, &slot)| (slot, row as u32)),
            );
            entry.by_slot.sort_unstable();
            entry.epoch = epoch;
            entry.refill(store);
            entry.seen = store.changes();
            self.resolutions += 1;
        }
        pos
    }

    /// How many times slots were resolved (a layout or epoch change each).
    pub fn resolutions(&self) -> u64 {
        self.resolutions
    }

    /// How many times a mirror was re-read whole because the store's change log no longer
    /// reached back to it (or too many rows changed), beside the resolutions.
    pub fn refills(&self) -> u64 {
        self.refills
    }
}

impl SlotEntry {
    fn refill(&mut self, store: &LoadStore) {
        self.samples.clear();
        self.samples.extend(self.slots.iter().map(|&slot| {
            if slot == NO_SLOT {
                RowSample::default()
            } else {
                RowSample::of(store.at_slot(slot))
            }
        }));
        self.column.stale_all();
    }
}

/// The value every element of `values` holds, when there is one (`None` for an empty slice).
fn uniform<T: Copy + PartialEq>(values: &[T]) -> Option<T> {
    let (&first, rest) = values.split_first()?;
    rest.iter().all(|&v| v == first).then_some(first)
}

/// Each mirrored row's decode backlog as a pick scores it ([`RowSample::decode_base`]), one `u64`
/// per row: a decode pass over a layout where every row is a candidate of one capacity then
/// reads 8 bytes per rank and compares them, and a KV-aware pass skips ranks by one comparison
/// each. Which rows are fresh depends on the pick's freshness bound; the column is valid for
/// every bound in `[lo, hi)` (no row's `at` lies between), rebuilt when a pick's bound leaves
/// that range (a row aged out) and patched per row the mirror re-reads, so a pick costs
/// `O(rows written since the last pick)` beside the pass.
#[derive(Debug, Default)]
pub(super) struct DecodeColumn {
    /// Per row: the decode backlog (the fresh field, or 0 when quiet), or [`DecodeColumn::NONE`]
    /// (silent under load, or fresh without the field).
    keys: Vec<u64>,
    /// Per row: the key narrowed to 32 bits (`min(key, u32::MAX)`), for scans comparing whole
    /// blocks of keys against a bound below `u32::MAX` (four to a 128-bit register).
    narrow: Vec<u32>,
    /// Per row: [`DecodeColumn::FRESH`] and [`DecodeColumn::COLLIDES`] bits.
    class: Vec<u8>,
    /// Rows fresh with the decode field.
    fresh: usize,
    /// Rows whose fresh field is [`DecodeColumn::NONE`] itself (the column cannot tell them
    /// from no cost).
    collisions: usize,
    lo: u64,
    hi: u64,
    /// The column matches the mirror for bounds in `[lo, hi)` once `dirty` rows are patched.
    valid: bool,
    /// Rows the mirror re-read since the last update (at most an eighth of the rows; past that
    /// the column is rebuilt).
    dirty: Vec<u32>,
}

impl DecodeColumn {
    /// No decode cost.
    pub(super) const NONE: u64 = u64::MAX;
    const FRESH: u8 = 1;
    const COLLIDES: u8 = 2;

    /// Per row, the decode backlog or [`Self::NONE`].
    pub(super) fn keys(&self) -> &[u64] {
        &self.keys
    }

    /// Per row, [`Self::keys`] narrowed to `min(key, u32::MAX)`: against a bound below
    /// `u32::MAX`, a narrowed key is at most the bound exactly when its key is.
    pub(super) fn narrow(&self) -> &[u32] {
        &self.narrow
    }

    /// Per row, the keys and their narrowed copies, mutable: a pass may set rows aside (both
    /// to their "no cost" value) and must put them back.
    pub(super) fn keys_mut(&mut self) -> (&mut [u64], &mut [u32]) {
        (&mut self.keys, &mut self.narrow)
    }

    /// Rows fresh with the decode field (every row a candidate: whether one carries the
    /// phase's fresh backlog).
    pub(super) fn fresh(&self) -> usize {
        self.fresh
    }

    /// Whether every key is exact (no fresh field equals [`Self::NONE`]).
    pub(super) fn exact(&self) -> bool {
        self.collisions == 0
    }

    /// The mirror re-read `row`.
    fn rewritten(&mut self, row: u32) {
        if !self.valid {
            return;
        }
        if self.dirty.len() >= (self.keys.len() / 8).max(1) {
            self.stale_all();
        } else {
            self.dirty.push(row);
        }
    }

    /// The whole mirror changed: rebuild on the next update.
    fn stale_all(&mut self) {
        self.valid = false;
        self.dirty.clear();
    }

    /// The key and class of `sample` at bound `oldest`.
    #[inline]
    fn classify(sample: &RowSample, oldest: u64) -> (u64, u8) {
        match sample.decode_base(oldest) {
            (Some(decode), true) => {
                let collides = if decode == Self::NONE {
                    Self::COLLIDES
                } else {
                    0
                };
                (decode, Self::FRESH | collides)
            }
            (Some(base), false) => (base, 0),
            (None, _) => (Self::NONE, 0),
        }
    }

    /// Brings the column up to date with `samples` for bound `oldest`.
    fn update(&mut self, samples: &[RowSample], oldest: u64) {
        let in_range = self.lo <= oldest && oldest < self.hi;
        if !self.valid || !in_range || self.keys.len() != samples.len() {
            self.rebuild(samples, oldest);
            return;
        }
        let Self {
            keys,
            narrow,
            class,
            fresh,
            collisions,
            lo,
            hi,
            dirty,
            ..
        } = self;
        for &row in dirty.iter() {
            let row = row as usize;
            let (Some(sample), Some(key), Some(short), Some(cls)) = (
                samples.get(row),
                keys.get_mut(row),
                narrow.get_mut(row),
                class.get_mut(row),
            ) else {
                continue;
            };
            Self::count(fresh, collisions, *cls, false);
            (*key, *cls) = Self::classify(sample, oldest);
            *short = Self::narrowed(*key);
            Self::count(fresh, collisions, *cls, true);
            // The row's `at` now bounds the range on its side of `oldest`.
            if sample.at > oldest {
                *hi = (*hi).min(sample.at);
            } else {
                *lo = (*lo).max(sample.at);
            }
        }
        dirty.clear();
    }

    #[inline]
    fn count(fresh: &mut usize, collisions: &mut usize, class: u8, add: bool) {
        let (f, c) = (
            usize::from(class & Self::FRESH != 0),
            usize::from(class & Self::COLLIDES != 0),
        );
        if add {
            *fresh += f;
            *collisions += c;
        } else {
            *fresh = fresh.saturating_sub(f);
            *collisions = collisions.saturating_sub(c);
        }
    }

    #[inline]
    pub(super) fn narrowed(key: u64) -> u32 {
        u32::try_from(key).unwrap_or(u32::MAX)
    }

    fn rebuild(&mut self, samples: &[RowSample], oldest: u64) {
        self.keys.clear();
        self.narrow.clear();
        self.class.clear();
        self.dirty.clear();
        self.fresh = 0;
        self.collisions = 0;
        self.lo = 0;
        self.hi = u64::MAX;
        for sample in samples {
            let (key, class) = Self::classify(sample, oldest);
            self.keys.push(key);
            self.narrow.push(Self::narrowed(key));
            self.class.push(class);
            Self::count(&mut self.fresh, &mut self.collisions, class, true);
            if sample.at > oldest {
                self.hi = self.hi.min(sample.at);
            } else {
                self.lo = self.lo.max(sample.at);
            }
        }
        self.valid = true;
    }
}
