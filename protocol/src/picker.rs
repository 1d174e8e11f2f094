//! Worker selection for direct-mode shim routing: which decode (and prefill) rank serves a request.
//!
//! A picker is a pure function of its inputs: the request (model, eligible namespaces, estimated
//! prompt size), the candidate ranks of the fleet snapshot, a [`LoadView`] over the load store, the
//! mutable [`PickerState`] (round-robin cursors and the [`DispatchLedger`] of unanswered
//! dispatches) and the caller's `now`. It reads no clock and draws no randomness, so every
//! decision replays in a unit test.
//!
//! | module | what it holds |
//! |---|---|
//! | [`decision`] | one request's routing decision (eligibility, reachability, pick, path, parity) |
//! | [`estimate`] | the tokenizer-free prompt-size heuristic |
//! | [`dense`] | the per-generation struct-of-arrays layout the pickers scan, samples by slot |
//! | [`ledger`] | unanswered dispatches: backlog until a sample answers, stalled ranks |
//! | [`load_based`] | the default [`LoadBasedPicker`] (Dynamo's load-only cost formulas) |
//! | [`kv_aware`] | the [`KvAwarePicker`] (upstream's KV cost formula over index overlaps) |
//! | [`reachability`] | unreachable ranks (lost load publisher) sit out before any picker runs |
//!
//! The picker works on its own small input types ([`Candidate`], [`SampleState`]); adapters from
//! the discovery snapshot and the load store live with the caller.

use std::collections::HashMap;
use std::sync::Arc;

use crate::ids::{DpRank, Namespace, WorkerKey};
use crate::time::Tick;

pub mod candidates;
pub mod decision;
pub mod dense;
pub mod estimate;
pub mod kv_aware;
pub mod ledger;
pub mod load_based;
pub mod reachability;
pub mod tie_break;

#[cfg(test)]
mod tests;

pub use dense::{DenseRanks, LoadSlots, SlotCache};
pub use estimate::{estimate_prompt_tokens, estimate_text_tokens};
pub use kv_aware::{
    BlockOverlaps, ConditionalDisaggregation, KvAwarePicker, KvPickInput, KvPickOutcome,
    KvPickParams, KvSelectionResult, KvUnavailable,
};
pub use ledger::{
    DISPATCH_MAX_AGE, DispatchId, DispatchLedger, DispatchLeg, MAX_LEDGER_DISPATCHES, RankBacklog,
    STALL_AFTER, STALL_MIN_BLOCKS,
};
pub use load_based::LoadBasedPicker;
pub use tie_break::{TieBreak, TieDraw, TieDraws};

/// Upper bound on the ranks one worker contributes: `data_parallel_size` is fleet-authored.
pub const MAX_DP_RANKS_PER_WORKER: u32 = 1024;

/// Upper bound on the models whose round-robin cursors are remembered; the table is cleared when a
/// new model would exceed it (a cursor is only a rotation offset, losing it is harmless).
pub const MAX_CURSOR_MODELS: usize = 1024;

/// Errors of this module: a fleet-authored rank range the picker refuses to expand.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PickerError {
    #[error("data_parallel_size {size} exceeds the limit of {MAX_DP_RANKS_PER_WORKER} ranks")]
    TooManyRanks { size: u32 },
    #[error("data-parallel ranks {start}..{start}+{size} overflow u32")]
    RankOverflow { start: u32, size: u32 },
}

/// The role a worker's model card declares.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CandidateRole {
    Prefill,
    Decode,
    /// Serves both phases itself; never paired with a prefill worker.
    Aggregated,
}

/// A selection phase, the `role` label of `continuum_dynamo_selection_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    Prefill,
    Decode,
}

impl Phase {
    pub const ALL: [Phase; 2] = [Phase::Prefill, Phase::Decode];

    pub fn as_label(self) -> &'static str {
        match self {
            Phase::Prefill => "prefill",
            Phase::Decode => "decode",
        }
    }

    fn index(self) -> usize {
        match self {
            Phase::Prefill => 0,
            Phase::Decode => 1,
        }
    }
}

/// Why a rank was chosen: the closed `reason` label of `continuum_dynamo_selection_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SelectionReason {
    /// Lowest defined load cost (ties rotate on the phase's cursor).
    Load,
    /// No candidate of the phase had a fresh sample carrying the phase's field: the cursor rotates
    /// across all candidates.
    RoundRobinStale,
    /// No usable signal at all (a source without load signals such as `kubernetes_pods`, or no
    /// candidate carrying the capacity the phase's cost needs): the cursor rotates.
    RoundRobin,
    /// No prefill worker was chosen: the decode winner is aggregated, or its namespace has no
    /// prefill worker for the model.
    NoPrefillPool,
    /// The KV-aware picker's formula (or overlap and size) chose the rank.
    KvAware,
    /// Conditional disaggregation: the decode worker prefills locally (role `prefill`).
    ConditionalBypass,
}

impl SelectionReason {
    pub const ALL: [SelectionReason; 6] = [
        SelectionReason::Load,
        SelectionReason::RoundRobinStale,
        SelectionReason::RoundRobin,
        SelectionReason::NoPrefillPool,
        SelectionReason::KvAware,
        SelectionReason::ConditionalBypass,
    ];

    pub fn as_label(self) -> &'static str {
        match self {
            SelectionReason::Load => "load",
            SelectionReason::RoundRobinStale => "round_robin_stale",
            SelectionReason::RoundRobin => "round_robin",
            SelectionReason::NoPrefillPool => "no_prefill_pool",
            SelectionReason::KvAware => "kv_aware",
            SelectionReason::ConditionalBypass => "conditional_bypass",
        }
    }
}

/// One routable (worker, dp_rank) of the fleet snapshot.
///
/// Workers with `data_parallel_size > 1` contribute one candidate per rank (see [`dp_ranks`]).
/// Pass candidates in a stable order (snapshot order): round-robin cursors index into it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub worker: WorkerKey,
    pub role: CandidateRole,
    /// The Dynamo display name the worker serves (after `shim.model_map`). Share one `Arc` per
    /// model across candidates: the picker then recognises a match by pointer, without reading
    /// the bytes.
    pub model: Arc<str>,
    /// `None` when the card declares no `data_parallel_size`; load samples are then keyed by rank 0.
    pub dp_rank: Option<DpRank>,
    /// `data_parallel_size` is declared (including 0): the rank header is sent.
    pub rank_declared: bool,
    pub block_size: Option<u32>,
    pub total_kv_blocks: Option<u64>,
    pub max_num_batched_tokens: Option<u64>,
}

impl Candidate {
    /// The rank load samples and ledger entries are keyed by (ActiveLoad decodes a missing
    /// `dp_rank` as 0).
    pub fn rank(&self) -> DpRank {
        self.dp_rank.unwrap_or_default()
    }
}

/// The `(dp_rank, rank_declared)` pairs a worker contributes, one per rank from
/// `data_parallel_start_rank`. No declared size yields one undeclared rank; a declared 0 is read
/// as one rank (its header is still sent).
pub fn dp_ranks(
    start: u32,
    size: Option<u32>,
) -> Result<impl Iterator<Item = (Option<DpRank>, bool)>, PickerError> {
    let (count, declared) = match size {
        None => (1, false),
        Some(size) if size > MAX_DP_RANKS_PER_WORKER => {
            return Err(PickerError::TooManyRanks { size });
        }
        Some(size) => (size.max(1), true),
    };
    if start.checked_add(count - 1).is_none() {
        return Err(PickerError::RankOverflow { start, size: count });
    }
    Ok((0..count).map(move |offset| {
        if declared {
            (Some(DpRank(start + offset)), true)
        } else {
            (None, false)
        }
    }))
}

/// What the load store holds for one (worker, dp_rank), as the caller's adapter reads it against
/// `dynamo.load.max_staleness`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SampleState {
    /// A sample younger than `max_staleness`.
    Fresh {
        active_decode_blocks: Option<u64>,
        active_prefill_tokens: Option<u64>,
        kv_used_blocks: Option<u64>,
    },
    /// The last sample aged out; `last_had_backlog` says whether it reported any load.
    Stale { last_had_backlog: bool },
    /// No sample held (never published, or dropped after a missed change).
    Never,
}

impl SampleState {
    /// Classifies the last sample held for a rank: fresh while it is within `max_staleness`,
    /// else stale, remembering whether it reported any backlog (a nonzero field). A worker that
    /// goes idle publishes zeros and falls silent, so a stale all-zero sample reads as quiet.
    #[inline]
    pub fn from_last(
        fresh: bool,
        active_decode_blocks: Option<u64>,
        active_prefill_tokens: Option<u64>,
        kv_used_blocks: Option<u64>,
    ) -> Self {
        if fresh {
            SampleState::Fresh {
                active_decode_blocks,
                active_prefill_tokens,
                kv_used_blocks,
            }
        } else {
            let busy = |field: Option<u64>| field.is_some_and(|v| v > 0);
            SampleState::Stale {
                last_had_backlog: busy(active_decode_blocks)
                    || busy(active_prefill_tokens)
                    || busy(kv_used_blocks),
            }
        }
    }

    /// The backlog a fresh sample carries for `phase`: prefill tokens, or decode blocks with
    /// `kv_used_blocks` standing in for a nil `active_decode_blocks` (live 1.4.2 dynamo.vllm).
    #[inline]
    pub fn fresh_backlog(&self, phase: Phase) -> Option<u64> {
        match *self {
            SampleState::Fresh {
                active_decode_blocks,
                active_prefill_tokens,
                kv_used_blocks,
            } => match phase {
                Phase::Prefill => active_prefill_tokens,
                Phase::Decode => active_decode_blocks.or(kv_used_blocks),
            },
            SampleState::Stale { .. } | SampleState::Never => None,
        }
    }
}

/// Read access to the load store, implemented by the caller.
pub trait LoadView {
    fn sample(&self, worker: &WorkerKey, rank: DpRank) -> SampleState;

    /// The store read by slot, when the view is a [`LoadStore`](crate::load_store::LoadStore):
    /// the pickers then read each rank's sample by index instead of calling [`Self::sample`]
    /// per rank. Must agree with [`Self::sample`].
    fn slots(&self) -> Option<LoadSlots<'_>> {
        None
    }
}

/// A [`LoadView`] that holds nothing: every rank reads as [`SampleState::Never`].
#[derive(Clone, Copy, Debug, Default)]
pub struct NoLoad;

impl LoadView for NoLoad {
    fn sample(&self, _worker: &WorkerKey, _rank: DpRank) -> SampleState {
        SampleState::Never
    }
}

/// One request's selection inputs.
#[derive(Clone, Copy, Debug)]
pub struct PickRequest<'a> {
    /// The Dynamo display name (client model id after `shim.model_map`).
    pub model: &'a str,
    /// Namespaces with a usable shim replica for this request.
    pub eligible_namespaces: &'a [Namespace],
    /// From [`estimate_prompt_tokens`].
    pub estimated_prompt_tokens: u64,
    /// False when the discovery source carries no load signal (`kubernetes_pods`): the picker
    /// rotates with reason `round_robin` and records no dispatches.
    pub load_signals: bool,
}

/// A chosen rank, ready for the `x-dynamo-*` headers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pinned {
    pub worker: WorkerKey,
    pub role: CandidateRole,
    pub dp_rank: Option<DpRank>,
    pub rank_declared: bool,
}

impl Pinned {
    fn of(candidate: &Candidate) -> Self {
        Self {
            worker: candidate.worker.clone(),
            role: candidate.role,
            dp_rank: candidate.dp_rank,
            rank_declared: candidate.rank_declared,
        }
    }

    /// The rank to send as a header: present (including 0) whenever `data_parallel_size` is
    /// declared.
    pub fn rank_header(&self) -> Option<DpRank> {
        self.rank_declared.then(|| self.dp_rank.unwrap_or_default())
    }
}

/// The `reason` label per phase for `continuum_dynamo_selection_total{role, reason}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PickReasons {
    pub decode: SelectionReason,
    pub prefill: SelectionReason,
}

impl PickReasons {
    /// `(role, reason)` label pairs, one per phase, for the selection counter.
    pub fn labels(&self) -> [(&'static str, &'static str); 2] {
        [
            (Phase::Decode.as_label(), self.decode.as_label()),
            (Phase::Prefill.as_label(), self.prefill.as_label()),
        ]
    }
}

/// A selection: a decode rank and, for a decode worker of a namespace with a prefill pool, a
/// prefill rank of the same namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pick {
    pub namespace: Namespace,
    pub decode: Pinned,
    pub prefill: Option<Pinned>,
    pub reasons: PickReasons,
    /// The ledger entry recording this dispatch (`None` when load signals are off). Report its end
    /// with [`DispatchLedger::request_ended`], or [`DispatchLedger::withdraw`] it if it was never
    /// sent.
    pub dispatch: Option<DispatchId>,
}

/// Why no pick was made: the request falls through to standard routing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoCandidates {
    /// No worker in an eligible namespace serves the model.
    NoWorkerForModel,
    /// Only prefill workers serve the model: nothing can decode.
    NoDecodeWorker,
}

impl NoCandidates {
    pub fn as_label(self) -> &'static str {
        match self {
            NoCandidates::NoWorkerForModel => "no_worker_for_model",
            NoCandidates::NoDecodeWorker => "no_decode_worker",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PickOutcome {
    Picked(Pick),
    NoCandidates(NoCandidates),
}

/// Everything one pick reads and mutates, in one value instead of six parameters: the request,
/// the candidate ranks (with their dense layout when the caller holds one per generation), the
/// load view, the mutable [`PickerState`] and the caller's `now`.
pub struct PickContext<'a> {
    pub request: &'a PickRequest<'a>,
    /// In a stable order (snapshot order): round-robin cursors index into it.
    pub candidates: &'a [Candidate],
    /// `candidates`' layout, built once per generation ([`candidates::CandidateIndex`]). `None`:
    /// the pick lays them out itself into reused scratch (same result, O(n) more work).
    pub dense: Option<&'a DenseRanks>,
    pub load: &'a dyn LoadView,
    pub state: &'a mut PickerState,
    pub now: Tick,
}

impl<'a> PickContext<'a> {
    /// A context without a prebuilt layout.
    pub fn new(
        request: &'a PickRequest<'a>,
        candidates: &'a [Candidate],
        load: &'a dyn LoadView,
        state: &'a mut PickerState,
        now: Tick,
    ) -> Self {
        Self {
            request,
            candidates,
            dense: None,
            load,
            state,
            now,
        }
    }

    /// Uses `dense`, the layout of exactly `candidates` (ignored if its length differs).
    pub fn with_layout(mut self, dense: &'a DenseRanks) -> Self {
        self.dense = (dense.len() == self.candidates.len()).then_some(dense);
        self
    }
}

impl std::fmt::Debug for PickContext<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PickContext")
            .field("request", self.request)
            .field("candidates", &self.candidates.len())
            .field("dense", &self.dense.map(DenseRanks::id))
            .field("now", &self.now)
            .finish_non_exhaustive()
    }
}

/// A worker picker, replaceable at runtime (`registry.picker()` / `set_picker()` hold an
/// `Arc<dyn DynamoWorkerPicker>`).
pub trait DynamoWorkerPicker: Send + Sync {
    /// A short name for logs and the admin API.
    fn name(&self) -> &'static str;

    fn pick(&self, ctx: &mut PickContext<'_>) -> PickOutcome;

    /// A pick that may use the request's KV input (`Err` says why there is none). Pickers that
    /// ignore KV keep this default: their plain pick, with no KV result.
    fn pick_kv(
        &self,
        ctx: &mut PickContext<'_>,
        kv: Result<&KvPickInput<'_>, KvUnavailable>,
    ) -> KvPickOutcome {
        let _ = kv;
        KvPickOutcome {
            outcome: self.pick(ctx),
            kv: None,
        }
    }
}

/// Everything a picker mutates: per-(model, phase) round-robin cursors, the dispatch ledger, and
/// scratch buffers reused across picks so a pick does not allocate per candidate.
#[derive(Debug, Default)]
pub struct PickerState {
    pub ledger: DispatchLedger,
    cursors: CursorTable,
    scratch: load_based::Scratch,
    /// Load-store slots per layout, resolved when the layout or the store's slot epoch changes.
    pub slots: SlotCache,
    /// The replica's tie-break among near-equal ranks (`dynamo.load.tie_break_window`) and its
    /// draw counter; off by default.
    pub tie: TieDraws,
}

impl PickerState {
    pub fn new() -> Self {
        Self::default()
    }

    /// The current cursor value for `(model, phase)` (0 when none is held).
    pub fn cursor(&self, model: &str, phase: Phase) -> u64 {
        self.cursors.get(model, phase)
    }

    /// Models whose round-robin cursors are held.
    pub fn cursor_models(&self) -> usize {
        self.cursors.by_model.len()
    }
}

/// Round-robin cursors keyed by model, so two models interleaving on one cursor cannot pin each
/// other's rotation to the same offsets.
#[derive(Debug, Default)]
struct CursorTable {
    by_model: HashMap<String, [u64; 2]>,
}

impl CursorTable {
    fn get(&self, model: &str, phase: Phase) -> u64 {
        self.by_model
            .get(model)
            .map_or(0, |cursors| cursors[phase.index()])
    }

    /// Returns the cursor's value and advances it.
    fn advance(&mut self, model: &str, phase: Phase) -> u64 {
        if let Some(cursors) = self.by_model.get_mut(model) {
            let value = cursors[phase.index()];
            cursors[phase.index()] = value.wrapping_add(1);
            return value;
        }
        if self.by_model.len() >= MAX_CURSOR_MODELS {
            self.by_model.clear();
        }
        let mut cursors = [0; 2];
        cursors[phase.index()] = 1;
        self.by_model.insert(model.to_owned(), cursors);
        0
    }
}
