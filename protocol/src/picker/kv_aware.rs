//! The `KvAwarePicker`: upstream's KV cost formula (seed "The formula", dynamo-wire §12) over the
//! router's load store and the overlaps the caller read from the KV index.
//!
//! Which phase the formula scores:
//! * **Pair fleets** (some eligible namespace serves the model with prefill and decode workers):
//!   the formula scores the prefill ranks of every namespace holding such a pair (seed
//!   "Graph-local dispatch"), then decode is chosen within the prefill winner's namespace by the
//!   load-only rule ([`load_based::score`] / [`load_based::select`]); namespaces without a pair
//!   sit out. With conditional disaggregation, decode is scored by the formula's
//!   `max(0, decode_cost_blocks - overlap_credit_blocks)` instead, and the decode winner may
//!   prefill locally (a *bypass*, see [`KvAwarePicker::bypasses`]).
//! * **Aggregated fleets** (no prefill/decode pair): the decode candidates prefill their own
//!   requests, so the formula scores them; their decode blocks (`kv_used_blocks` on dynamo.vllm)
//!   are the backlog, plus `active_prefill_tokens` when a sample carries it.
//!
//! Freshness, per formula-scored phase: when some rank has a fresh sample carrying the phase's
//! backlog, those ranks and the quiet ranks (never sampled, or last sample all zero) compete on the
//! full formula, and the rest sit out; stalled ranks compete only when no other rank can. When
//! none has, every rank competes on overlap and size (`isl / bs - credit * overlap`), and the
//! cursor rotates only among equal minima (`round_robin_stale`, or `round_robin` without load
//! signals). Temperature 0 takes the lowest cost with the per-(model, phase) cursor breaking ties;
//! above 0 the caller's unit samples [`softmax_sample_index`]. A rank whose card lacks a valid
//! block size has no formula cost; when no rank has one, the phase falls back to the load-only
//! rule.
//!
//! Namespaces follow the load-based picker's pairing rules: pairs never cross namespaces,
//! aggregated workers beside a prefill/decode pool sit out, and an aggregated winner gets no
//! prefill (`no_prefill_pool`); only the order differs (the load-based picker compares decode
//! across namespaces first).
//! Without a KV input (no tokenizer, prompt too large, render failed, artifact unpinned) the whole
//! pick is the load-based one and the outcome reports why.
//!
//! How a formula-scored phase runs: at temperature 0 on the production path (samples mirrored per
//! row, overlaps laid onto rows, one block size on every row) as one pass over the rows
//! (`KvPass`) with the request's terms computed once ([`RequestCost`]), keeping per tier the
//! lowest cost, its tie count and first row (no per-rank writes); otherwise per member
//! (`KvAwarePicker::rank`, `select_kv`), which softmax sampling needs (every cost) and which the
//! view path, unsorted overlap lists and mixed block sizes take. Both choose the same rank
//! (`tests::kv_aware_gather_matches_the_reference_on_uniform_fleets`).

use super::dense::{DecodeColumn, DenseRanks, NOT_ELIGIBLE, Row, RowSample, role_bit};
use super::ledger::RankBacklog;
use super::load_based::{
    self, Backlogs, LoadBasedPicker, NamespaceLedgers, RequestSize, Samples, Scored, Scratch,
};
use super::tie_break::{
    Nearest, Place, TieDraw, Turn, near_tie_index_where, near_tie_set_where, take_slot,
};
use super::{
    Candidate, CandidateRole, DynamoWorkerPicker, NoCandidates, Phase, Pick, PickContext,
    PickOutcome, PickReasons, PickRequest, PickerState, Pinned, SampleState, SelectionReason,
};
use crate::ids::{DpRank, InstanceId};
use crate::kv::cost::{
    CandidateLoad, CostParams, RequestCost, argmin_with_cursor, candidate_cost, overlap_only_cost,
    sane, softmax_sample_index,
};
use crate::kv::hashing::BlockSize;
use crate::kv::index::RankOverlap;
use crate::time::Tick;

#[cfg(test)]
mod tests;

/// `dynamo.kv.conditional_disaggregation`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ConditionalDisaggregation {
    pub enabled: bool,
    /// Fraction of `total_kv_blocks` (0..=1) the decode winner's projected decode blocks may
    /// reach and still prefill locally; `None` adds no load condition.
    pub decode_busy_threshold: Option<f64>,
}

/// The `dynamo.kv` tunables the picker reads (upstream defaults: credit 1, scale 1, temperature 0).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvPickParams {
    pub overlap_score_credit: f64,
    pub prefill_load_scale: f64,
    /// 0 = lowest cost (cursor on ties); above 0 = softmax sampling with the input's unit.
    pub router_temperature: f64,
    pub conditional_disaggregation: ConditionalDisaggregation,
}

impl Default for KvPickParams {
    fn default() -> Self {
        Self {
            overlap_score_credit: 1.0,
            prefill_load_scale: 1.0,
            router_temperature: 0.0,
            conditional_disaggregation: ConditionalDisaggregation::default(),
        }
    }
}

impl KvPickParams {
    fn cost(&self) -> CostParams {
        CostParams {
            overlap_score_credit: self.overlap_score_credit,
            prefill_load_scale: self.prefill_load_scale,
        }
    }
}

/// The overlaps of one block size: `KvIndex::find_matches` over the request's hashes for it
/// (sorted by `(worker, dp_rank)`, ranks without overlap omitted).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockOverlaps {
    pub block_size: BlockSize,
    pub ranks: Vec<RankOverlap>,
}

impl BlockOverlaps {
    /// Blocks `(worker, rank)` holds; 0 when it is not listed.
    pub fn of(&self, worker: InstanceId, rank: DpRank) -> u64 {
        self.of_in(self.is_sorted(), worker, rank)
    }

    /// The list is sorted by `(worker, dp_rank)`, as `KvIndex::find_matches` returns it.
    pub fn is_sorted(&self) -> bool {
        self.ranks.is_sorted_by_key(|o| (o.worker, o.dp_rank))
    }

    /// [`Self::of`] with the list's sortedness known: a sorted list that binary search does not
    /// find `(worker, rank)` in does not hold it, so only an unsorted one is scanned.
    fn of_in(&self, sorted: bool, worker: InstanceId, rank: DpRank) -> u64 {
        match self
            .ranks
            .binary_search_by(|o| (o.worker, o.dp_rank).cmp(&(worker, rank)))
        {
            Ok(pos) => u64::from(self.ranks[pos].blocks),
            Err(_) if sorted => 0,
            // Tolerate an unsorted list from a caller: fall back to a scan.
            Err(_) => self
                .ranks
                .iter()
                .find(|o| o.worker == worker && o.dp_rank == rank)
                .map_or(0, |o| u64::from(o.blocks)),
        }
    }
}

/// One request's KV input, computed by the caller from the rendered prompt and the KV index.
#[derive(Clone, Copy, Debug)]
pub struct KvPickInput<'a> {
    /// Prompt length in tokens (the rendered token count).
    pub isl: u64,
    /// Overlaps per block size the model's workers declare.
    pub overlaps: &'a [BlockOverlaps],
    /// A caller-drawn value in `[0, 1)` for softmax sampling (unused at temperature 0).
    pub unit: f64,
}

impl KvPickInput<'_> {
    /// Blocks `(worker, rank)` holds at `block_size`; `sorted[i]` says whether `overlaps[i]`
    /// is sorted (checked once per pick, not per rank).
    fn overlap(
        &self,
        sorted: &[bool],
        block_size: BlockSize,
        worker: InstanceId,
        rank: DpRank,
    ) -> u64 {
        self.overlaps
            .iter()
            .zip(sorted.iter().copied().chain(std::iter::repeat(false)))
            .find(|(o, _)| o.block_size == block_size)
            .map_or(0, |(o, sorted)| o.of_in(sorted, worker, rank))
    }
}

/// Why a request has no KV input: the pick falls back to load-based selection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvUnavailable {
    /// No tokenizer loaded, or the model's workers disagree on one.
    TokenizerUnavailable,
    /// The rendered prompt exceeded the text or token cap.
    PromptTooLarge,
    /// The template failed, ran out of fuel, or missed its deadline.
    RenderUnavailable,
    /// The model's tokenizer or template is not in `kv.pinned_artifacts`.
    ArtifactUnpinned,
}

/// The closed `result` label of `continuum_dynamo_kv_selection_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvSelectionResult {
    /// The rank that prefills holds at least one block of the prompt.
    Overlap,
    NoOverlap,
    TokenizerUnavailable,
    PromptTooLarge,
    RenderUnavailable,
    ArtifactUnpinned,
    /// Conditional disaggregation: the decode winner prefills locally.
    Bypass,
}

impl KvSelectionResult {
    pub const ALL: [KvSelectionResult; 7] = [
        KvSelectionResult::Overlap,
        KvSelectionResult::NoOverlap,
        KvSelectionResult::TokenizerUnavailable,
        KvSelectionResult::PromptTooLarge,
        KvSelectionResult::RenderUnavailable,
        KvSelectionResult::ArtifactUnpinned,
        KvSelectionResult::Bypass,
    ];

    pub fn as_label(self) -> &'static str {
        match self {
            KvSelectionResult::Overlap => "overlap",
            KvSelectionResult::NoOverlap => "no_overlap",
            KvSelectionResult::TokenizerUnavailable => "tokenizer_unavailable",
            KvSelectionResult::PromptTooLarge => "prompt_too_large",
            KvSelectionResult::RenderUnavailable => "render_unavailable",
            KvSelectionResult::ArtifactUnpinned => "artifact_unpinned",
            KvSelectionResult::Bypass => "bypass",
        }
    }
}

impl From<KvUnavailable> for KvSelectionResult {
    fn from(why: KvUnavailable) -> Self {
        match why {
            KvUnavailable::TokenizerUnavailable => KvSelectionResult::TokenizerUnavailable,
            KvUnavailable::PromptTooLarge => KvSelectionResult::PromptTooLarge,
            KvUnavailable::RenderUnavailable => KvSelectionResult::RenderUnavailable,
            KvUnavailable::ArtifactUnpinned => KvSelectionResult::ArtifactUnpinned,
        }
    }
}

/// A pick plus what KV-aware selection made of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvPickOutcome {
    pub outcome: PickOutcome,
    /// `None` for pickers that do not look at KV input, and when nothing was picked.
    pub kv: Option<KvSelectionResult>,
}

impl KvPickOutcome {
    /// Conditional disaggregation chose local prefill: send only the worker pin, on the unified
    /// routing path.
    pub fn is_bypass(&self) -> bool {
        self.kv == Some(KvSelectionResult::Bypass)
    }
}

/// The KV-aware picker. Holds only its parameters; everything it mutates lives in
/// [`PickerState`], and its randomness is the input's `unit`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct KvAwarePicker {
    params: KvPickParams,
}

/// Which backlog a formula-scored phase reads and which cost it takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scoring {
    /// Prefill workers: `active_prefill_tokens` is the backlog.
    Prefill,
    /// Aggregated fleets: decode blocks are the backlog, prefill tokens added when present.
    Aggregated,
    /// Conditional disaggregation's decode score.
    ConditionalDecode,
}

impl Scoring {
    fn phase(self) -> Phase {
        match self {
            Scoring::Prefill => Phase::Prefill,
            Scoring::Aggregated | Scoring::ConditionalDecode => Phase::Decode,
        }
    }
}

/// One rank as a formula-scored phase sees it.
#[derive(Clone, Copy, Debug)]
struct KvRank {
    block_size: Option<BlockSize>,
    overlap: u64,
    /// `(prefill tokens, decode blocks)` when the rank may compete on the full formula.
    load: Option<(u64, u64)>,
    fresh_field: bool,
    stalled: bool,
}

/// A layout row serving the model in an eligible namespace.
#[derive(Clone, Copy, Debug)]
struct Matched {
    index: usize,
    namespace: usize,
}

/// The KV-aware picker's buffers, reused across picks (a pick allocates nothing per rank).
#[derive(Debug, Default)]
pub(super) struct KvScratch {
    /// The rows of the phase being chosen.
    members: Vec<Matched>,
    ranks: Vec<KvRank>,
    positions: Vec<usize>,
    costs: Vec<f64>,
    scored: Vec<Scored>,
    /// Per overlap list, whether it is sorted.
    sorted: Vec<bool>,
    overlaps: OverlapRows,
    /// Peer slots on the KV gather ([`KvPass::choose_slot`]): the lowest free costs.
    nearest: Nearest<()>,
}

/// The KV input's overlaps laid onto the layout's rows for one pick (stamped, like the
/// ledger's [`RowBacklogs`](super::load_based::RowBacklogs)): a rank's overlap is then one read
/// by row instead of a binary search per rank.
#[derive(Debug, Default)]
struct OverlapRows {
    /// Per row: the stamp it was written in and its blocks then.
    marks: Vec<(u32, u32)>,
    stamp: u32,
    /// The rows holding at least one block this pick, each once, in the lists' order.
    held: Vec<u32>,
}

impl OverlapRows {
    /// Lays `overlaps` onto `dense`'s rows. Only lists sorted strictly by `(worker, dp_rank)`
    /// (what `KvIndex::find_matches` returns) are laid: a rank is listed at most once, so the
    /// row holds what a binary search finds. Returns false (the caller then looks overlaps up
    /// per rank) when some list is not.
    fn fill(&mut self, dense: &DenseRanks, overlaps: &[BlockOverlaps]) -> bool {
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.marks.iter_mut().for_each(|m| *m = (0, 0));
            self.stamp = 1;
        }
        if self.marks.len() < dense.len() {
            self.marks.resize(dense.len(), (0, 0));
        }
        self.held.clear();
        for (j, list) in overlaps.iter().enumerate() {
            // The first list of a block size answers for it (`KvPickInput::overlap`); every
            // list must be sorted all the same.
            let answers = !overlaps[..j]
                .iter()
                .any(|o| o.block_size == list.block_size);
            // The order is checked while walking (rows stamped before a disorder is found are
            // never read: the caller looks overlaps up instead, and the next fill restamps).
            let mut last: Option<(u64, u32)> = None;
            // The list is sorted by worker: the ranks of one worker share its entries, and the
            // next worker's entries are guessed to follow the last one's.
            let (mut worker, mut entries, mut guess) = (None, &[][..], 0);
            for o in &list.ranks {
                let at = (o.worker.0, o.dp_rank.0);
                if last.is_some_and(|last| last >= at) {
                    return false;
                }
                last = Some(at);
                if !answers {
                    continue;
                }
                if worker != Some(o.worker) {
                    let next;
                    (entries, next) = dense.entries_of(o.worker, guess);
                    (worker, guess) = (Some(o.worker), next);
                }
                for &(_, row) in entries {
                    let row = row as usize;
                    if dense.rank[row] == o.dp_rank
                        && dense.block_size[row] == list.block_size.get()
                        && let Some(mark) = self.marks.get_mut(row)
                    {
                        if o.blocks > 0 && mark.0 != self.stamp {
                            self.held.push(row as u32);
                        }
                        *mark = (self.stamp, o.blocks);
                    }
                }
            }
        }
        true
    }

    /// The rows holding at least one block (after a [`Self::fill`] that returned true).
    fn held(&self) -> &[u32] {
        &self.held
    }

    #[inline]
    fn get(&self, row: usize) -> u64 {
        match self.marks.get(row) {
            Some(&(stamp, blocks)) if stamp == self.stamp => u64::from(blocks),
            _ => 0,
        }
    }
}

/// Where one pick reads each rank's overlap.
#[derive(Clone, Copy)]
enum Overlaps<'o> {
    ByRow(&'o OverlapRows),
    /// Per rank, in the input's lists (some list is not strictly sorted).
    Lookup {
        kv: &'o KvPickInput<'o>,
        sorted: &'o [bool],
    },
}

/// Read-only inputs shared by the phases of one pick.
struct Ctx<'r, 'a> {
    req: &'r PickRequest<'a>,
    kv: &'r KvPickInput<'r>,
    dense: &'r DenseRanks,
    /// Each rank's sample by row (mirrored from the load store on the production path).
    samples: Samples<'r>,
    /// The mirror's decode column, up to date for this pick (mirrored path only).
    column: Option<&'r DecodeColumn>,
    backlogs: Backlogs<'r>,
    overlaps: Overlaps<'r>,
    now: Tick,
}

impl Ctx<'_, '_> {
    /// The sample of row `index` (never sampled when load signals are off).
    fn sample(&self, index: usize) -> SampleState {
        self.samples.get(index)
    }

    fn backlog(&self, m: Matched) -> RankBacklog {
        self.backlogs
            .get(self.dense, m.index, m.namespace, self.now)
    }

    fn block_size_at(&self, row: usize) -> Option<BlockSize> {
        self.dense
            .block_size
            .get(row)
            .and_then(|&b| BlockSize::new(b).ok())
    }

    fn overlap_at(&self, row: usize) -> u64 {
        match self.overlaps {
            Overlaps::ByRow(rows) => rows.get(row),
            Overlaps::Lookup { kv, sorted } => self.block_size_at(row).map_or(0, |bs| {
                kv.overlap(sorted, bs, self.dense.instance[row], self.dense.rank[row])
            }),
        }
    }
}

fn block_size_of(c: &Candidate) -> Option<BlockSize> {
    c.block_size.and_then(|b| BlockSize::new(b).ok())
}

/// The buffers one phase's choice fills.
struct Buffers<'s> {
    ranks: &'s mut Vec<KvRank>,
    positions: &'s mut Vec<usize>,
    costs: &'s mut Vec<f64>,
    scored: &'s mut Vec<Scored>,
    /// Peer slots: the tie set, and per phase the candidates the peers take.
    slots: &'s mut Vec<(f64, u32)>,
    peers: &'s mut [Vec<u32>; 2],
    nearest: &'s mut Nearest<()>,
}

impl KvAwarePicker {
    pub fn new(params: KvPickParams) -> Self {
        Self { params }
    }

    pub fn params(&self) -> KvPickParams {
        self.params
    }

    /// Reads one rank for a formula-scored phase: its overlap and, when it may compete on the
    /// full formula, its backlog (sample plus the ledger's unanswered dispatches).
    fn rank(&self, ctx: &Ctx<'_, '_>, m: Matched, scoring: Scoring) -> KvRank {
        let sample = ctx.sample(m.index);
        let backlog = ctx.backlog(m);
        let fresh_field = sample.fresh_backlog(scoring.phase()).is_some();
        let base = match sample {
            SampleState::Fresh {
                active_decode_blocks,
                active_prefill_tokens,
                kv_used_blocks,
            } => {
                let decode = active_decode_blocks.or(kv_used_blocks);
                match scoring {
                    Scoring::Prefill => active_prefill_tokens.map(|p| (p, decode.unwrap_or(0))),
                    Scoring::Aggregated | Scoring::ConditionalDecode => {
                        decode.map(|d| (active_prefill_tokens.unwrap_or(0), d))
                    }
                }
            }
            // Quiet: never sampled, or the last sample reported nothing.
            SampleState::Never
            | SampleState::Stale {
                last_had_backlog: false,
            } => Some((0, 0)),
            SampleState::Stale {
                last_had_backlog: true,
            } => None,
        };
        KvRank {
            block_size: ctx.block_size_at(m.index),
            overlap: ctx.overlap_at(m.index),
            load: base.map(|(p, d)| {
                (
                    p.saturating_add(backlog.prefill_tokens),
                    d.saturating_add(backlog.decode_blocks),
                )
            }),
            fresh_field,
            stalled: backlog.stalled,
        }
    }
    /// Chooses among `ranks` with the formula; `None` when no rank can be scored (no valid block
    /// size anywhere), and the caller falls back to the load-only rule.
    #[allow(clippy::too_many_arguments)]
    fn select_kv(
        &self,
        ctx: &Ctx<'_, '_>,
        ranks: &[KvRank],
        positions: &mut Vec<usize>,
        costs: &mut Vec<f64>,
        scoring: Scoring,
        turn: Turn,
        (slots, peers): (&mut Vec<(f64, u32)>, &mut Vec<u32>),
    ) -> Option<(usize, SelectionReason)> {
        let isl = ctx.kv.isl;
        let any_fresh = ctx.req.load_signals && ranks.iter().any(|r| r.fresh_field);
        positions.clear();
        costs.clear();
        if any_fresh {
            let competes = |r: &KvRank| r.block_size.is_some() && r.load.is_some();
            let any_free = ranks.iter().any(|r| competes(r) && !r.stalled);
            for (pos, r) in ranks.iter().enumerate() {
                let (Some(bs), Some((prefill, decode))) = (r.block_size, r.load) else {
                    continue;
                };
                if any_free && r.stalled {
                    continue;
                }
                let load = CandidateLoad {
                    overlap_blocks: r.overlap,
                    active_prefill_tokens: prefill,
                    active_decode_blocks: decode,
                };
                let breakdown = candidate_cost(isl, bs, load, self.params.cost());
                positions.push(pos);
                costs.push(match scoring {
                    Scoring::ConditionalDecode => breakdown.conditional_decode_cost(),
                    Scoring::Prefill | Scoring::Aggregated => breakdown.cost,
                });
            }
        } else {
            for (pos, r) in ranks.iter().enumerate() {
                let Some(bs) = r.block_size else { continue };
                positions.push(pos);
                costs.push(overlap_only_cost(
                    isl,
                    bs,
                    r.overlap,
                    self.params.overlap_score_credit,
                ));
            }
        }
        if costs.is_empty() {
            return None;
        }
        let temperature = self.params.router_temperature;
        let chosen = if temperature > 0.0 {
            softmax_sample_index(costs, temperature, ctx.kv.unit)?
        } else if let Some(draw) = turn.tie {
            // The request's own weight in the formula's unit: its prompt blocks.
            let weight = ranks
                .iter()
                .find_map(|r| r.block_size)
                .map_or(0.0, |bs| isl as f64 / f64::from(bs.get()));
            // Only ranks holding at least as much of the prompt as the lowest tie.
            let overlap = |i: usize| {
                positions
                    .get(i)
                    .and_then(|&p| ranks.get(p))
                    .map(|r| r.overlap)
            };
            let keep = |lowest, i| overlap(i) >= overlap(lowest);
            match draw.place {
                // Peer slots: this replica's slot of the tie set; its peers' slots, as
                // positions into `ranks`, go to `peers`.
                Some(place) => {
                    near_tie_set_where(costs, draw.slack(weight), keep, slots);
                    let from = peers.len();
                    let own = take_slot(slots, place, peers);
                    for p in &mut peers[from..] {
                        *p = positions
                            .get(*p as usize)
                            .and_then(|&q| u32::try_from(q).ok())
                            .unwrap_or(u32::MAX);
                    }
                    own.map(|i| i as usize)
                        .or_else(|| argmin_with_cursor(costs, turn.cursor))?
                }
                None => near_tie_index_where(costs, draw.slack(weight), &draw, keep)
                    .or_else(|| argmin_with_cursor(costs, turn.cursor))?,
            }
        } else {
            argmin_with_cursor(costs, turn.cursor)?
        };
        let reason = if any_fresh || temperature > 0.0 {
            SelectionReason::KvAware
        } else {
            // Overlap and size decided unless the minimum was shared: then the cursor did.
            let min = costs[chosen];
            let ties = costs.iter().filter(|c| **c == min).count();
            match (ties > 1, ctx.req.load_signals) {
                (false, _) => SelectionReason::KvAware,
                (true, true) => SelectionReason::RoundRobinStale,
                (true, false) => SelectionReason::RoundRobin,
            }
        };
        positions.get(chosen).map(|&pos| (pos, reason))
    }

    /// The load-only rule for one phase over `members`.
    fn select_load(
        ctx: &Ctx<'_, '_>,
        members: &[Matched],
        scored: &mut Vec<Scored>,
        phase: Phase,
        turn: Turn,
        peers: &mut Vec<u32>,
    ) -> Option<(usize, SelectionReason)> {
        let mut size = RequestSize::new(ctx.kv.isl);
        scored.clear();
        scored.extend(members.iter().map(|m| {
            load_based::score_at(
                phase,
                ctx.dense,
                m.index,
                ctx.samples,
                ctx.backlogs,
                m.namespace,
                &mut size,
                ctx.now,
            )
        }));
        let weight = |pos: usize| {
            members.get(pos).map_or(0.0, |m| {
                load_based::request_weight(phase, ctx.dense, m.index, ctx.kv.isl)
            })
        };
        load_based::select_turn(scored, ctx.req.load_signals, turn, weight, peers)
    }

    /// One phase over the rows `table` makes candidates: the KV gather ([`Self::gather`]) when
    /// the pick is one it serves, else the per-member path ([`Self::choose`]) over those rows
    /// listed in `members` (only then: listing them is a pass and a write per rank).
    #[allow(clippy::too_many_arguments)]
    fn choose_phase(
        &self,
        ctx: &Ctx<'_, '_>,
        bufs: &mut Buffers<'_>,
        members: &mut Vec<Matched>,
        table: &[u16],
        scoring: Option<Scoring>,
        phase: Phase,
        turn: Turn,
    ) -> Option<(Matched, SelectionReason)> {
        let scoring = match scoring {
            Some(s) => match self.gather(ctx, table, s, turn, bufs, phase) {
                Gathered::Chosen(index, reason) => {
                    let namespace = ctx
                        .dense
                        .rows
                        .get(index)
                        .and_then(|row| table.get(row.group_role as usize))
                        .copied()
                        .filter(|&ns| ns != NOT_ELIGIBLE);
                    if let Some(ns) = namespace {
                        let namespace = usize::from(ns);
                        return Some((Matched { index, namespace }, reason));
                    }
                    // Not a candidate row (cannot happen): the per-member path decides.
                    Some(s)
                }
                // No rank has a formula cost: the load-only rule decides, as after `select_kv`.
                Gathered::NoFormula => None,
                Gathered::NotApplicable => Some(s),
            },
            None => None,
        };
        members_of(ctx.dense, table, members);
        self.choose(ctx, bufs, members, scoring, phase, turn)
    }

    /// A formula-scored phase at temperature 0 on the production path (samples mirrored, the
    /// overlaps laid onto rows, one block size on every row): one pass over the rows
    /// ([`KvPass`]) choosing exactly what [`Self::rank`] + [`Self::select_kv`] choose, without
    /// materialising ranks or costs; with peer slots, the slot and the peers' slots (into
    /// `bufs.peers`) as `select_kv` takes them ([`KvPass::choose_slot`]). Everything else
    /// (softmax sampling needs every cost; the view path; unsorted overlap lists; mixed block
    /// sizes; the seeded draw, which chooses among every near-equal cost) is
    /// [`Gathered::NotApplicable`].
    fn gather(
        &self,
        ctx: &Ctx<'_, '_>,
        table: &[u16],
        scoring: Scoring,
        turn: Turn,
        bufs: &mut Buffers<'_>,
        phase: Phase,
    ) -> Gathered {
        let cursor = turn.cursor;
        let slot = match turn.tie {
            None => None,
            Some(
                draw @ TieDraw {
                    place: Some(place), ..
                },
            ) => Some((draw, place)),
            Some(_) => return Gathered::NotApplicable,
        };
        if self.params.router_temperature > 0.0 {
            return Gathered::NotApplicable;
        }
        let block_size = ctx
            .dense
            .uniform_block_size
            .and_then(|b| BlockSize::new(b).ok());
        let (
            Samples::Mirror {
                rows: mirror,
                oldest,
            },
            Overlaps::ByRow(overlaps),
            Some(block_size),
        ) = (ctx.samples, ctx.overlaps, block_size)
        else {
            return Gathered::NotApplicable;
        };
        if mirror.len() != ctx.dense.rows.len() {
            return Gathered::NotApplicable;
        }
        // The column's keys are the decode blocks of an aggregated score's load when every row
        // is a candidate; with a fresh row among them the quiet tier cannot decide.
        let column = ctx.column.filter(|c| {
            scoring == Scoring::Aggregated
                && c.fresh() > 0
                && c.keys().len() == mirror.len()
                && ctx.dense.all_candidates(table)
        });
        let pass = KvPass {
            rows: &ctx.dense.rows,
            mirror,
            keys: column.map(DecodeColumn::keys),
            narrow: column.map(DecodeColumn::narrow).unwrap_or_default(),
            table,
            overlaps,
            oldest,
            formula: RequestCost::new(ctx.kv.isl, block_size, self.params.cost()),
            scoring,
            load_signals: ctx.req.load_signals,
        };
        // Instantiated per way of reading backlogs, so the loop holds no dispatch.
        if let Some((draw, place)) = slot {
            // The request's own weight in the formula's unit: its prompt blocks.
            let weight = ctx.kv.isl as f64 / f64::from(block_size.get());
            let slots = Slots {
                slack: draw.slack(weight),
                place,
                near: &mut *bufs.nearest,
                tied: &mut *bufs.slots,
                peers: &mut bufs.peers[phase.index()],
            };
            return match ctx.backlogs {
                Backlogs::Empty => pass.choose_slot(|_, _| RankBacklog::default(), slots),
                Backlogs::ByRow(rows) => pass.choose_slot(|i, _| rows.get(i), slots),
                Backlogs::Lookup(_) => pass.choose_slot(
                    |i, ns| ctx.backlogs.get(ctx.dense, i, usize::from(ns), ctx.now),
                    slots,
                ),
            };
        }
        match ctx.backlogs {
            Backlogs::Empty => pass.choose(|_, _| RankBacklog::default(), cursor),
            Backlogs::ByRow(rows) => pass.choose(|i, _| rows.get(i), cursor),
            Backlogs::Lookup(_) => pass.choose(
                |i, ns| ctx.backlogs.get(ctx.dense, i, usize::from(ns), ctx.now),
                cursor,
            ),
        }
    }

    /// One phase: the formula when it can score anyone, else the load-only rule.
    fn choose(
        &self,
        ctx: &Ctx<'_, '_>,
        bufs: &mut Buffers<'_>,
        members: &[Matched],
        scoring: Option<Scoring>,
        phase: Phase,
        turn: Turn,
    ) -> Option<(Matched, SelectionReason)> {
        // Peer slots come out as positions into `members`, then become candidate indices.
        let peers = &mut bufs.peers[phase.index()];
        peers.clear();
        let to_candidates = |peers: &mut Vec<u32>| {
            for p in peers.iter_mut() {
                *p = members
                    .get(*p as usize)
                    .and_then(|m| u32::try_from(m.index).ok())
                    .unwrap_or(u32::MAX);
            }
        };
        if let Some(scoring) = scoring {
            bufs.ranks.clear();
            bufs.ranks
                .extend(members.iter().map(|m| self.rank(ctx, *m, scoring)));
            let out = (&mut *bufs.slots, &mut *peers);
            if let Some((pos, reason)) = self.select_kv(
                ctx,
                bufs.ranks,
                bufs.positions,
                bufs.costs,
                scoring,
                turn,
                out,
            ) {
                to_candidates(peers);
                return members.get(pos).map(|m| (*m, reason));
            }
            peers.clear();
        }
        let (pos, reason) = Self::select_load(ctx, members, bufs.scored, phase, turn, peers)?;
        to_candidates(peers);
        members.get(pos).map(|m| (*m, reason))
    }
    /// Conditional disaggregation's per-request decision for a decode winner `decode` whose
    /// namespace has a prefill pool, against the prefill rank the formula would otherwise pair it
    /// with. The decode worker prefills locally when it already holds some of the prompt and at
    /// least as much as that prefill rank (a remote prefill would recompute or re-send blocks it
    /// has), and, with `decode_busy_threshold`, its projected decode blocks stay at or below the
    /// threshold's share of `total_kv_blocks`. A missing fresh sample or capacity vetoes.
    pub fn bypasses(
        &self,
        decode: &Candidate,
        decode_overlap: u64,
        prefill_overlap: u64,
        sample: SampleState,
        ledger_decode_blocks: u64,
        isl: u64,
    ) -> bool {
        let conditional = self.params.conditional_disaggregation;
        if !conditional.enabled || decode_overlap == 0 || decode_overlap < prefill_overlap {
            return false;
        }
        let Some(threshold) = conditional.decode_busy_threshold else {
            return true;
        };
        let (Some(active), Some(total), Some(bs)) = (
            sample.fresh_backlog(Phase::Decode),
            decode.total_kv_blocks.filter(|&t| t > 0),
            block_size_of(decode),
        ) else {
            return false;
        };
        let request_blocks = isl.div_ceil(u64::from(bs.get()));
        let projected = active
            .saturating_add(ledger_decode_blocks)
            .saturating_add(request_blocks.saturating_sub(decode_overlap));
        projected as f64 <= threshold * total as f64
    }

    /// The pick with a KV input (or the reason there is none).
    pub fn pick_with(
        &self,
        ctx: &mut PickContext<'_>,
        kv: Result<&KvPickInput<'_>, KvUnavailable>,
    ) -> KvPickOutcome {
        let kv = match kv {
            Ok(kv) => kv,
            Err(why) => {
                let outcome = LoadBasedPicker.pick(ctx);
                let kv = matches!(outcome, PickOutcome::Picked(_)).then(|| why.into());
                return KvPickOutcome { outcome, kv };
            }
        };
        let (req, candidates, load, now) = (ctx.request, ctx.candidates, ctx.load, ctx.now);
        let PickerState {
            ledger,
            cursors,
            scratch,
            slots,
            tie,
        } = &mut *ctx.state;
        ledger.expire(now);
        let place = ledger.place();
        let Scratch {
            roles,
            table,
            dense: own_dense,
            eligible,
            rows: row_backlogs,
            kv: kv_scratch,
            saved: _,
            tied: _,
            tie_set,
            peers,
            nearest: _,
        } = scratch;
        peers.iter_mut().for_each(Vec::clear);
        let KvScratch {
            members,
            ranks,
            positions,
            costs,
            scored,
            sorted,
            overlaps: overlap_rows,
            nearest,
        } = kv_scratch;
        let dense: &DenseRanks = match ctx.dense {
            Some(dense) if dense.len() == candidates.len() => dense,
            _ => {
                own_dense.rebuild(candidates);
                &*own_dense
            }
        };
        let namespaces = &req.eligible_namespaces
            [..req.eligible_namespaces.len().min(usize::from(NOT_ELIGIBLE))];
        dense.eligibility(req.model, namespaces, eligible);
        // Per namespace its roles; per (group, role) the decode candidates: decode workers, and
        // aggregated workers outside prefill/decode pools.
        if !load_based::plan_decode(dense, eligible, namespaces.len(), roles, table) {
            return KvPickOutcome {
                outcome: PickOutcome::NoCandidates(NoCandidates::NoWorkerForModel),
                kv: None,
            };
        }
        let paired_bits = role_bit(CandidateRole::Prefill) | role_bit(CandidateRole::Decode);
        let paired = |ns: u16| {
            roles
                .get(usize::from(ns))
                .is_some_and(|&r| r & paired_bits == paired_bits)
        };
        let (decode_candidates, pair_fleet) = tabled(dense, table, paired);
        if decode_candidates == 0 {
            return KvPickOutcome {
                outcome: PickOutcome::NoCandidates(NoCandidates::NoDecodeWorker),
                kv: None,
            };
        }
        let conditional = pair_fleet && self.params.conditional_disaggregation.enabled;

        let resolved = NamespaceLedgers::resolve(ledger, namespaces, req.load_signals);
        let ledgers = resolved.as_slice();
        let (samples, column) = Samples::new(req.load_signals, load, candidates, dense, slots);
        let backlogs = Backlogs::new(
            ledgers,
            ledger,
            matches!(samples, Samples::Mirror { .. }),
            dense,
            row_backlogs,
            now,
        );
        let overlaps = if overlap_rows.fill(dense, kv.overlaps) {
            Overlaps::ByRow(overlap_rows)
        } else {
            sorted.clear();
            sorted.extend(kv.overlaps.iter().map(BlockOverlaps::is_sorted));
            Overlaps::Lookup { kv, sorted }
        };
        let ctx = Ctx {
            req,
            kv,
            dense,
            samples,
            column: column.map(|c| &*c),
            backlogs,
            overlaps,
            now,
        };
        let mut bufs = Buffers {
            ranks,
            positions,
            costs,
            scored,
            slots: tie_set,
            peers,
            nearest,
        };
        let decode_scoring = if !pair_fleet {
            Some(Scoring::Aggregated)
        } else if conditional {
            Some(Scoring::ConditionalDecode)
        } else {
            None
        };
        // Pair fleets: prefill first, scored across the namespaces holding a prefill/decode pair,
        // then decode within the winner's namespace (graph-local dispatch).
        let prefill_first = if pair_fleet {
            plan_paired_prefill(dense, eligible, roles, table);
            let turn = Turn {
                cursor: cursors.advance(req.model, Phase::Prefill),
                tie: tie.draw(place),
            };
            self.choose_phase(
                &ctx,
                &mut bufs,
                members,
                table,
                Some(Scoring::Prefill),
                Phase::Prefill,
                turn,
            )
        } else {
            None
        };
        match prefill_first {
            Some((p, _)) => plan_decode_in(
                dense,
                eligible,
                u16::try_from(p.namespace).unwrap_or(NOT_ELIGIBLE),
                table,
            ),
            // No prefill rank could be chosen: decode across the namespaces, unpaired.
            None if pair_fleet => {
                load_based::plan_decode(dense, eligible, namespaces.len(), roles, table);
            }
            None => {}
        }
        let turn = Turn {
            cursor: cursors.advance(req.model, Phase::Decode),
            tie: tie.draw(place),
        };
        let chosen = self.choose_phase(
            &ctx,
            &mut bufs,
            members,
            table,
            decode_scoring,
            Phase::Decode,
            turn,
        );
        let Some((won, decode_reason)) = chosen else {
            return KvPickOutcome {
                outcome: PickOutcome::NoCandidates(NoCandidates::NoDecodeWorker),
                kv: None,
            };
        };
        let Some(decode) = candidates.get(won.index) else {
            return KvPickOutcome {
                outcome: PickOutcome::NoCandidates(NoCandidates::NoDecodeWorker),
                kv: None,
            };
        };

        let mut prefill: Option<(usize, &Candidate)> = None;
        let mut prefill_reason = SelectionReason::NoPrefillPool;
        let mut bypass = false;
        if let Some((p, reason)) = prefill_first
            && decode.role == CandidateRole::Decode
            && let Some(c) = candidates.get(p.index)
        {
            let ledger_decode = ctx.backlog(won).decode_blocks;
            bypass = conditional
                && self.bypasses(
                    decode,
                    ctx.overlap_at(won.index),
                    ctx.overlap_at(p.index),
                    ctx.sample(won.index),
                    ledger_decode,
                    kv.isl,
                );
            if bypass {
                prefill_reason = SelectionReason::ConditionalBypass;
            } else {
                prefill = Some((p.index, c));
                prefill_reason = reason;
            }
        }
        // The rank that prefills decides the result: the prefill rank, else the decode winner.
        let result = if bypass {
            KvSelectionResult::Bypass
        } else if ctx.overlap_at(prefill.map_or(won.index, |(row, _)| row)) > 0 {
            KvSelectionResult::Overlap
        } else {
            KvSelectionResult::NoOverlap
        };
        let prefill = prefill.map(|(_, c)| c);

        let tokens = kv.isl;
        let dispatch = req.load_signals.then(|| {
            // A bypassed prefill phase took no slot: its peers' slots are not theirs either.
            if bypass {
                bufs.peers[Phase::Prefill.index()].clear();
            }
            load_based::record_peer_slots(ledger, candidates, bufs.peers, tokens, now);
            load_based::record_pair(ledger, prefill, decode, tokens, now)
        });
        KvPickOutcome {
            outcome: PickOutcome::Picked(Pick {
                namespace: decode.worker.namespace.clone(),
                decode: Pinned::of(decode),
                prefill: prefill.map(Pinned::of),
                reasons: PickReasons {
                    decode: decode_reason,
                    prefill: prefill_reason,
                },
                dispatch,
            }),
            kv: Some(result),
        }
    }
}

/// The rows `table` makes candidates, counted per `(group, role)`, and whether one of them sits
/// in a namespace `paired` accepts: what a pass over the rows finds, in O(groups).
fn tabled(dense: &DenseRanks, table: &[u16], paired: impl Fn(u16) -> bool) -> (usize, bool) {
    let mut count = 0usize;
    let mut any_paired = false;
    for (&rows, &ns) in dense.group_role_rows.iter().zip(table) {
        if ns == NOT_ELIGIBLE || rows == 0 {
            continue;
        }
        count = count.saturating_add(rows as usize);
        any_paired |= paired(ns);
    }
    (count, any_paired)
}

/// The prefill candidates of a pair fleet: the prefill rows of every eligible namespace that
/// also holds a decode worker for the model (`roles` as [`load_based::plan_decode`] left them).
fn plan_paired_prefill(dense: &DenseRanks, eligible: &[u16], roles: &[u8], table: &mut Vec<u16>) {
    let paired = role_bit(CandidateRole::Prefill) | role_bit(CandidateRole::Decode);
    table.clear();
    table.resize(dense.groups() * 4, NOT_ELIGIBLE);
    for (g, &ns) in eligible.iter().enumerate() {
        if roles
            .get(usize::from(ns))
            .is_some_and(|&r| r & paired == paired)
        {
            table[Row::table_index(g, CandidateRole::Prefill)] = ns;
        }
    }
}

/// The decode candidates of the paired namespace at position `ns` (its aggregated workers sit
/// out beside the pair pool).
fn plan_decode_in(dense: &DenseRanks, eligible: &[u16], ns: u16, table: &mut Vec<u16>) {
    table.clear();
    table.resize(dense.groups() * 4, NOT_ELIGIBLE);
    for (g, &p) in eligible.iter().enumerate() {
        if p == ns {
            table[Row::table_index(g, CandidateRole::Decode)] = ns;
        }
    }
}

/// Lists the rows `table` makes candidates, in row order, with their namespace positions.
fn members_of(dense: &DenseRanks, table: &[u16], members: &mut Vec<Matched>) {
    members.clear();
    members.extend(dense.rows.iter().enumerate().filter_map(|(index, row)| {
        let ns = table
            .get(row.group_role as usize)
            .copied()
            .unwrap_or(NOT_ELIGIBLE);
        (ns != NOT_ELIGIBLE).then_some(Matched {
            index,
            namespace: usize::from(ns),
        })
    }));
}

/// How [`KvAwarePicker::gather`] ended.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Gathered {
    /// The chosen row and why.
    Chosen(usize, SelectionReason),
    /// No rank has a formula cost: the load-only rule decides.
    NoFormula,
    /// Not a pick the gather serves (or the lowest cost is not finite, where the reason's tie
    /// count reads raw costs): the per-member path decides.
    NotApplicable,
}

/// The lowest cost of one tier while gathering, in row order (`ties == 0`: none yet).
#[derive(Clone, Copy, Debug)]
struct Lowest {
    cost: f64,
    ties: usize,
    first: usize,
}

impl Lowest {
    const NONE: Lowest = Lowest {
        cost: f64::INFINITY,
        ties: 0,
        first: 0,
    };

    /// Tallies row `row` at `cost` (never NaN: [`sane`]) as [`argmin_with_cursor`] compares:
    /// the minimum, how many equal it (`-0.0 == 0.0`), the first of them.
    #[inline(always)]
    fn add(&mut self, row: usize, cost: f64) {
        if self.ties == 0 || cost < self.cost {
            *self = Lowest {
                cost,
                ties: 1,
                first: row,
            };
        } else if cost == self.cost {
            self.ties += 1;
        }
    }

    /// [`Self::add`] for rows offered out of row order: a tie keeps the lowest row first, as
    /// offering them in row order would (a tied row is offered once either way).
    #[inline(always)]
    fn add_any_order(&mut self, row: usize, cost: f64) {
        if self.ties != 0 && cost == self.cost {
            self.ties += 1;
            self.first = self.first.min(row);
        } else {
            self.add(row, cost);
        }
    }
}

/// What one pass over a phase's rows found: whether a rank carries the phase's fresh backlog,
/// and per tier the lowest cost. Which tier decides is known only at the end, so all three are
/// kept: `quiet` on overlap and size alone (every candidate), `free` and `stalled` on the full
/// formula (ranks with a load, split by the ledger's stall).
#[derive(Clone, Copy, Debug)]
struct KvTally {
    any_fresh: bool,
    quiet: Lowest,
    free: Lowest,
    stalled: Lowest,
}

impl KvTally {
    /// Tallies a costed rank in the stalled or the free tier; `true` when it went to the free
    /// one, whose lowest cost bounds the ranks still worth costing.
    #[inline(always)]
    fn place(&mut self, row: usize, cost: f64, stalled: bool) -> bool {
        if stalled {
            self.stalled.add(row, cost);
        } else {
            self.free.add(row, cost);
        }
        !stalled
    }

    /// [`Self::place`] for rows offered out of row order.
    #[inline(always)]
    fn place_any_order(&mut self, row: usize, cost: f64, stalled: bool) -> bool {
        if stalled {
            self.stalled.add_any_order(row, cost);
        } else {
            self.free.add_any_order(row, cost);
        }
        !stalled
    }
}

/// The tier a choice was made in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tier {
    Quiet,
    Free,
    Stalled,
}

/// One rank as a [`KvPass`] scores it: what [`KvAwarePicker::rank`] reads and the costs
/// `select_kv` would give it, made sane.
#[derive(Clone, Copy, Debug)]
struct RankCost {
    /// `overlap_only_cost`.
    quiet: f64,
    /// The full formula's cost and whether the rank is stalled; `None`: silent under load, or
    /// a fresh sample without the phase's field.
    full: Option<(f64, bool)>,
}

/// A formula-scored phase over the layout's rows on the production path: the fused rows, the
/// sample mirror and the overlaps laid onto rows, with everything that depends only on the
/// request hoisted into `formula` ([`RequestCost`]), so a rank costs a few integer operations
/// and the formula's own `f64` operations.
#[derive(Clone, Copy)]
struct KvPass<'p> {
    rows: &'p [Row],
    mirror: &'p [RowSample],
    /// The mirror's [`DecodeColumn`] keys, when every row is a candidate, the scoring is
    /// aggregated and some row is fresh with the decode field ([`KvPass::gather_keyed`]).
    keys: Option<&'p [u64]>,
    /// The same keys narrowed ([`DecodeColumn::narrow`]).
    narrow: &'p [u32],
    table: &'p [u16],
    overlaps: &'p OverlapRows,
    oldest: u64,
    formula: RequestCost,
    scoring: Scoring,
    load_signals: bool,
}

impl KvPass<'_> {
    /// The namespace position of a candidate row, `None` for a row the phase does not score.
    #[inline(always)]
    fn namespace(&self, row: &Row) -> Option<u16> {
        match self.table.get(row.group_role as usize) {
            Some(&ns) if ns != NOT_ELIGIBLE => Some(ns),
            _ => None,
        }
    }

    /// `(load, fresh_field)` of a mirrored sample, as [`KvAwarePicker::rank`] reads its
    /// [`RowSample::state`]: the sample's `(prefill tokens, decode blocks)` when fresh with the
    /// phase's field, `(0, 0)` when quiet (never sampled, or stale without backlog), none when
    /// silent under load or fresh without the field.
    #[inline(always)]
    fn load(&self, sample: &RowSample) -> (Option<(u64, u64)>, bool) {
        if sample.at > self.oldest {
            let decode = (sample.flags & RowSample::HAS_DECODE != 0).then_some(sample.decode);
            let prefill = (sample.flags & RowSample::HAS_PREFILL != 0).then_some(sample.prefill);
            match self.scoring {
                Scoring::Prefill => (prefill.map(|p| (p, decode.unwrap_or(0))), prefill.is_some()),
                Scoring::Aggregated | Scoring::ConditionalDecode => {
                    (decode.map(|d| (prefill.unwrap_or(0), d)), decode.is_some())
                }
            }
        } else if sample.at != 0 && sample.flags & RowSample::BUSY != 0 {
            (None, false)
        } else {
            (Some((0, 0)), false)
        }
    }

    /// Row `i` (namespace position `ns`) scored: its backlog read only when it has a load.
    #[inline(always)]
    fn score<B: Fn(usize, u16) -> RankBacklog>(
        &self,
        i: usize,
        ns: u16,
        sample: &RowSample,
        backlog: &B,
    ) -> RankCost {
        let overlap = self.overlaps.get(i);
        let (load, _) = self.load(sample);
        let full = load.map(|load| self.full(i, ns, overlap, load, backlog));
        RankCost {
            quiet: sane(self.formula.overlap_only(overlap)),
            full,
        }
    }

    /// The full formula's cost of a rank with a load, and whether it is stalled.
    #[inline(always)]
    fn full<B: Fn(usize, u16) -> RankBacklog>(
        &self,
        i: usize,
        ns: u16,
        overlap: u64,
        (prefill, decode): (u64, u64),
        backlog: &B,
    ) -> (f64, bool) {
        let b = backlog(i, ns);
        let load = CandidateLoad {
            overlap_blocks: overlap,
            active_prefill_tokens: prefill.saturating_add(b.prefill_tokens),
            active_decode_blocks: decode.saturating_add(b.decode_blocks),
        };
        let cost = match self.scoring {
            Scoring::ConditionalDecode => self.formula.conditional_decode_cost(load),
            Scoring::Prefill | Scoring::Aggregated => self.formula.cost(load),
        };
        (sane(cost), b.stalled)
    }

    /// One loop over the rows and the mirror: every candidate tallied into the tiers that can
    /// still decide, no per-rank writes. The quiet tier only decides when no rank carries a
    /// fresh backlog, so it is no longer tallied once one does. Where the cost is at least the
    /// rank's decode blocks ([`RequestCost::bounded_below_by_decode`]; not conditional
    /// disaggregation's decode score), a rank whose sample's decode blocks already exceed the
    /// lowest free cost so far loses to it whatever its overlap and ledger backlog (a rank
    /// holding none of the prompt: exceed it less the prompt's own cost, [`DecodeBounds`]): it
    /// is skipped before its backlog is read or the formula computed (such a rank, stalled or not,
    /// cannot decide: the stalled tier only counts when no free rank has a cost). Not inlined:
    /// its own function keeps its live values in registers.
    ///
    /// With peer slots (`near` given), the free tier's lowest costs are kept in `near` too, and
    /// the bound is the `k`-th kept ([`Nearest::full_last`]) instead of the lowest: a rank
    /// skipped costs more than it, so it can neither enter the kept ones nor tie the lowest.
    #[inline(never)]
    fn gather<B: Fn(usize, u16) -> RankBacklog>(
        &self,
        backlog: &B,
        mut near: Option<&mut Nearest<()>>,
    ) -> KvTally {
        let n = self.rows.len().min(self.mirror.len());
        let (rows, mirror) = (&self.rows[..n], &self.mirror[..n]);
        let mut tally = KvTally {
            any_fresh: false,
            quiet: Lowest::NONE,
            free: Lowest::NONE,
            stalled: Lowest::NONE,
        };
        let prunes =
            self.scoring != Scoring::ConditionalDecode && self.formula.bounded_below_by_decode();
        if prunes && let Some(keys) = self.keys {
            return self.gather_keyed(keys, backlog, near);
        }
        let floor = self.formula.zero_overlap_floor();
        let mut bounds = DecodeBounds::NONE;
        for (i, (row, sample)) in rows.iter().zip(mirror).enumerate() {
            let Some(ns) = self.namespace(row) else {
                continue;
            };
            let (load, fresh_field) = self.load(sample);
            tally.any_fresh |= fresh_field;
            if !tally.any_fresh {
                let quiet = sane(self.formula.overlap_only(self.overlaps.get(i)));
                tally.quiet.add(i, quiet);
            }
            let Some(load) = load else {
                continue;
            };
            if bounds.loses(load.1, || self.overlaps.get(i)) {
                continue;
            }
            let (cost, stalled) = self.full(i, ns, self.overlaps.get(i), load, backlog);
            if tally.place(i, cost, stalled)
                && let Some(cut) = cut_after(near.as_deref_mut(), i, cost, tally.free.cost)
                && prunes
            {
                bounds = DecodeBounds::below(cut, floor);
            }
        }
        tally
    }

    /// [`Self::gather`] where the column's `keys` stand for every row's decode blocks (every
    /// row a candidate, aggregated scoring, the bound applies) and some row is fresh with the
    /// decode field (so the quiet tier cannot decide and is not tallied). The ranks holding
    /// part of the prompt are scored first (few, and the likely winners: the bound they set is
    /// tight); then the others, skipped on their keys against [`DecodeBounds::no_overlap`]
    /// alone, [`KEY_BLOCK`] narrowed keys at a time where the bound allows ("no cost" is the
    /// largest key). Only a rank that may still win or tie reads its row, sample and backlog,
    /// as [`Self::gather`] does. Ranks are tallied out of row order
    /// ([`KvTally::place_any_order`]): what a rank is skipped on is a strict loss to the lowest
    /// free cost so far, never a tie, so the tiers end as a pass in row order ends.
    #[inline(never)]
    fn gather_keyed<B: Fn(usize, u16) -> RankBacklog>(
        &self,
        keys: &[u64],
        backlog: &B,
        mut near: Option<&mut Nearest<()>>,
    ) -> KvTally {
        let n = self.rows.len().min(self.mirror.len()).min(keys.len());
        let keys = &keys[..n];
        let mut tally = KvTally {
            any_fresh: true,
            quiet: Lowest::NONE,
            free: Lowest::NONE,
            stalled: Lowest::NONE,
        };
        let floor = self.formula.zero_overlap_floor();
        let mut bounds = DecodeBounds::NONE;
        let mut offer = |i: usize, key: u64, bounds: &mut DecodeBounds| {
            if key > bounds.any {
                return;
            }
            let (Some(row), Some(sample)) = (self.rows.get(i), self.mirror.get(i)) else {
                return;
            };
            let Some(ns) = self.namespace(row) else {
                return;
            };
            let (Some(load), _) = self.load(sample) else {
                return;
            };
            if load.1 > bounds.any {
                return;
            }
            let (cost, stalled) = self.full(i, ns, self.overlaps.get(i), load, backlog);
            if tally.place_any_order(i, cost, stalled)
                && let Some(cut) = cut_after(near.as_deref_mut(), i, cost, tally.free.cost)
            {
                *bounds = DecodeBounds::below(cut, floor);
            }
        };
        // A rank holding part of the prompt loses only on the bound for any rank.
        for &row in self.overlaps.held() {
            let i = row as usize;
            if let Some(&key) = keys.get(i) {
                offer(i, key, &mut bounds);
            }
        }
        let mut i = 0;
        while i < n {
            // Against a bound below `u32::MAX`, a block whose narrowed keys all exceed it is
            // skipped whole (compared four at a time, no branch per rank).
            let end = (i + KEY_BLOCK).min(n);
            if let Ok(bound) = u32::try_from(bounds.no_overlap)
                && let Some(block) = self.narrow.get(i..end)
                && !block.iter().fold(false, |any, &k| any | (k <= bound))
            {
                i = end;
                continue;
            }
            for (j, &key) in keys[i..end].iter().enumerate() {
                // The ranks holding part of the prompt were offered above.
                if key > bounds.no_overlap || self.overlaps.get(i + j) != 0 {
                    continue;
                }
                offer(i + j, key, &mut bounds);
            }
            i = end;
        }
        tally
    }

    /// The choice `select_kv` makes at temperature 0 from the gathered tiers: with a fresh
    /// backlog somewhere, the full formula among free ranks, else among stalled ones; without,
    /// overlap and size among all. The `cursor`-th of several tied ranks is found by re-walking
    /// the rows after the first (rare).
    fn choose<B: Fn(usize, u16) -> RankBacklog>(&self, backlog: B, cursor: u64) -> Gathered {
        let tally = self.gather(&backlog, None);
        let any_fresh = self.load_signals && tally.any_fresh;
        let (tier, best) = match (any_fresh, tally.free, tally.stalled, tally.quiet) {
            (true, free, _, _) if free.ties > 0 => (Tier::Free, free),
            (true, _, stalled, _) if stalled.ties > 0 => (Tier::Stalled, stalled),
            (false, _, _, quiet) if quiet.ties > 0 => (Tier::Quiet, quiet),
            _ => return Gathered::NoFormula,
        };
        if best.cost == f64::INFINITY {
            return Gathered::NotApplicable;
        }
        let reason = match (any_fresh || best.ties == 1, self.load_signals) {
            (true, _) => SelectionReason::KvAware,
            (false, true) => SelectionReason::RoundRobinStale,
            (false, false) => SelectionReason::RoundRobin,
        };
        // ties > 0: the remainder is below it, so it fits usize.
        let wanted = (cursor % best.ties as u64) as usize;
        if wanted == 0 {
            return Gathered::Chosen(best.first, reason);
        }
        let found = self
            .rows
            .iter()
            .zip(self.mirror)
            .enumerate()
            .skip(best.first + 1)
            .filter_map(|(i, (row, sample))| {
                let rank = self.score(i, self.namespace(row)?, sample, &backlog);
                let cost = match tier {
                    Tier::Quiet => Some(rank.quiet),
                    Tier::Free => rank.full.filter(|&(_, stalled)| !stalled).map(|(c, _)| c),
                    Tier::Stalled => rank.full.filter(|&(_, stalled)| stalled).map(|(c, _)| c),
                };
                (cost == Some(best.cost)).then_some(i)
            })
            .nth(wanted - 1);
        match found {
            Some(i) => Gathered::Chosen(i, reason),
            None => Gathered::NotApplicable,
        }
    }
}

/// Peer slots in a [`KvPass`]: the window's slack in cost units, this replica's place, the
/// lowest free costs kept, the tie set's buffer and the rows the peers take.
struct Slots<'s> {
    slack: f64,
    place: Place,
    near: &'s mut Nearest<()>,
    tied: &'s mut Vec<(f64, u32)>,
    peers: &'s mut Vec<u32>,
}

impl KvPass<'_> {
    /// The slot `select_kv` takes at temperature 0 with peer slots, from one [`Self::gather`]
    /// keeping the free tier's `place.count` lowest: the tie set is the free ranks within the
    /// slack of the lowest holding at least as much of the prompt as it (the first lowest). When
    /// the lowest holds none, every rank qualifies and the kept ones are the tie set's lowest.
    /// When it holds some, only ranks holding at least as much do: those hold part of the
    /// prompt, so they are the few rows of [`OverlapRows::held`], costed again. The peers'
    /// slots go to `slots.peers` as rows. `NotApplicable` where the full formula among free
    /// ranks does not decide (no fresh backlog, every ranked rank stalled, no finite lowest).
    fn choose_slot<B: Fn(usize, u16) -> RankBacklog>(
        &self,
        backlog: B,
        slots: Slots<'_>,
    ) -> Gathered {
        let Slots {
            slack,
            place,
            near,
            tied,
            peers,
        } = slots;
        near.reset(place);
        let tally = self.gather(&backlog, Some(&mut *near));
        let free = tally.free;
        if !(self.load_signals && tally.any_fresh && free.ties > 0 && free.cost.is_finite()) {
            return Gathered::NotApplicable;
        }
        let held = self.overlaps.get(free.first);
        if held > 0 {
            near.reset(place);
            for &row in self.overlaps.held() {
                let i = row as usize;
                let overlap = self.overlaps.get(i);
                if overlap < held {
                    continue;
                }
                let (Some(r), Some(sample)) = (self.rows.get(i), self.mirror.get(i)) else {
                    continue;
                };
                let (Some(ns), (Some(load), _)) = (self.namespace(r), self.load(sample)) else {
                    continue;
                };
                let (cost, stalled) = self.full(i, ns, overlap, load, &backlog);
                if !stalled {
                    near.offer(cost, row, ());
                }
            }
        }
        let own = near.take(free.cost + slack, place, tied, peers);
        Gathered::Chosen(
            own.map_or(free.first, |row| row as usize),
            SelectionReason::KvAware,
        )
    }
}

/// After a rank was tallied in the free tier at `cost`: the cost past which a rank can no
/// longer matter. Without peer slots the lowest free cost; with them (`near`), the rank is
/// kept among the lowest, and the bound is the `k`-th kept once `k` are (none before).
#[inline(always)]
fn cut_after(near: Option<&mut Nearest<()>>, row: usize, cost: f64, lowest: f64) -> Option<f64> {
    match near {
        None => Some(lowest),
        Some(near) => {
            near.offer(cost, u32::try_from(row).unwrap_or(u32::MAX), ());
            near.full_last().map(|(cut, ())| cut)
        }
    }
}

/// Keys [`KvPass::gather_keyed`] skips at once when every one of them loses. Tests use blocks
/// of 8, so their small fleets span several blocks.
const KEY_BLOCK: usize = if cfg!(test) { 8 } else { 32 };

/// Decode blocks above which a rank loses to the lowest free cost so far (`u64::MAX`: no bound
/// yet): `any` for every rank ([`decode_bound`]), `no_overlap` for a rank holding none of the
/// prompt, which also pays for the whole prompt ([`RequestCost::zero_overlap_floor`]: it costs
/// at least `floor + d`, so `d > floor(lowest) - floor` gives a cost of at least
/// `floor(lowest) + 1 > lowest`). On a large fleet few ranks hold a prefix, and the prompt's
/// own blocks dwarf the spread of decode backlogs, so most ranks lose on their key alone.
#[derive(Clone, Copy, Debug)]
struct DecodeBounds {
    any: u64,
    no_overlap: u64,
}

impl DecodeBounds {
    const NONE: DecodeBounds = DecodeBounds {
        any: u64::MAX,
        no_overlap: u64::MAX,
    };

    /// The bounds below a new lowest free cost.
    #[inline(always)]
    fn below(lowest: f64, floor: Option<u64>) -> Self {
        let any = decode_bound(lowest);
        let no_overlap = match floor {
            Some(floor) if any != u64::MAX => any.saturating_sub(floor),
            _ => any,
        };
        DecodeBounds { any, no_overlap }
    }

    /// Whether a rank whose sample holds `decode` blocks loses whatever its ledger backlog;
    /// `overlap` (its blocks of the prompt) is read only for a rank between the two bounds.
    #[inline(always)]
    fn loses(&self, decode: u64, overlap: impl FnOnce() -> u64) -> bool {
        decode > self.any || (decode > self.no_overlap && overlap() == 0)
    }
}

/// The largest decode-block count that does not exceed `lowest` (a cost, never NaN): a rank
/// whose decode blocks exceed it costs more than `lowest` where the cost is bounded below by
/// them (`d > floor(lowest)` gives `d >= floor(lowest) + 1 > lowest`, and that integer, at most
/// 2^53, converts to `f64` exactly). `u64::MAX` (no rank is skipped) for a negative or
/// non-finite `lowest`, or one past 2^53.
#[inline(always)]
fn decode_bound(lowest: f64) -> u64 {
    const EXACT: f64 = 9_007_199_254_740_992.0; // 2^53
    if (0.0..EXACT).contains(&lowest) {
        // Non-negative and below 2^53: the truncation is the floor, and fits.
        lowest as u64
    } else {
        u64::MAX
    }
}

impl DynamoWorkerPicker for KvAwarePicker {
    fn name(&self) -> &'static str {
        "kv_aware"
    }

    /// Without a KV input the pick is the load-based one.
    fn pick(&self, ctx: &mut PickContext<'_>) -> PickOutcome {
        LoadBasedPicker.pick(ctx)
    }

    fn pick_kv(
        &self,
        ctx: &mut PickContext<'_>,
        kv: Result<&KvPickInput<'_>, KvUnavailable>,
    ) -> KvPickOutcome {
        self.pick_with(ctx, kv)
    }
}
