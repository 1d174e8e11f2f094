//! The `KvAwarePicker`: upstream's KV cost formula (seed "The formula", dynamo-wire §12) over the
//! router's load store and the overlaps the caller read from the KV index.
//!
//! Which phase the formula scores:
//! * **Pair fleets** (some eligible namespace serves the model with prefill and decode workers):
//!   decode is chosen by the load-only rule ([`load_based::score`] / [`load_based::select`]), then
//!   prefill within the winner's namespace by the formula. With conditional disaggregation, decode
//!   is scored by the formula's `max(0, decode_cost_blocks - overlap_credit_blocks)` instead, and
//!   the decode winner may prefill locally (a *bypass*, see [`KvAwarePicker::bypasses`]).
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
//! Namespaces follow the load-based picker's rules exactly: pairs never cross namespaces, a
//! prefill rank is chosen only beside a decode winner of its namespace, aggregated workers beside
//! a prefill/decode pool sit out, and an aggregated winner gets no prefill (`no_prefill_pool`).
//! Without a KV input (no tokenizer, prompt too large, render failed, artifact unpinned) the whole
//! pick is the load-based one and the outcome reports why.

use super::dense::{DenseRanks, NOT_ELIGIBLE, role_bit};
use super::ledger::{NamespaceBacklog, RankBacklog};
use super::load_based::{
    self, Backlogs, INLINE_NAMESPACES, LoadBasedPicker, RequestSize, Samples, Scored, Scratch,
};
use super::{
    Candidate, CandidateRole, DynamoWorkerPicker, NoCandidates, Phase, Pick, PickContext,
    PickOutcome, PickReasons, PickRequest, PickerState, Pinned, SampleState, SelectionReason,
};
use crate::ids::{DpRank, InstanceId};
use crate::kv::cost::{
    CandidateLoad, CostParams, argmin_with_cursor, candidate_cost, overlap_only_cost,
    softmax_sample_index,
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
}

/// The KV input's overlaps laid onto the layout's rows for one pick (stamped, like the
/// ledger's [`RowBacklogs`](super::load_based::RowBacklogs)): a rank's overlap is then one read
/// by row instead of a binary search per rank.
#[derive(Debug, Default)]
struct OverlapRows {
    /// Per row: the stamp it was written in and its blocks then.
    marks: Vec<(u32, u32)>,
    stamp: u32,
}

impl OverlapRows {
    /// Lays `overlaps` onto `dense`'s rows. Only lists sorted strictly by `(worker, dp_rank)`
    /// (what `KvIndex::find_matches` returns) are laid: a rank is listed at most once, so the
    /// row holds what a binary search finds. Returns false (the caller then looks overlaps up
    /// per rank) when some list is not.
    fn fill(&mut self, dense: &DenseRanks, overlaps: &[BlockOverlaps]) -> bool {
        let strictly_sorted = overlaps.iter().all(|o| {
            o.ranks
                .is_sorted_by(|a, b| (a.worker, a.dp_rank) < (b.worker, b.dp_rank))
        });
        if !strictly_sorted {
            return false;
        }
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.marks.iter_mut().for_each(|m| *m = (0, 0));
            self.stamp = 1;
        }
        if self.marks.len() < dense.len() {
            self.marks.resize(dense.len(), (0, 0));
        }
        for (j, list) in overlaps.iter().enumerate() {
            // The first list of a block size answers for it (`KvPickInput::overlap`).
            if overlaps[..j]
                .iter()
                .any(|o| o.block_size == list.block_size)
            {
                continue;
            }
            for o in &list.ranks {
                for row in dense.rows_of(o.worker) {
                    if dense.rank[row] == o.dp_rank
                        && dense.block_size[row] == list.block_size.get()
                        && let Some(mark) = self.marks.get_mut(row)
                    {
                        *mark = (self.stamp, o.blocks);
                    }
                }
            }
        }
        true
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
    fn select_kv(
        &self,
        ctx: &Ctx<'_, '_>,
        ranks: &[KvRank],
        positions: &mut Vec<usize>,
        costs: &mut Vec<f64>,
        scoring: Scoring,
        cursor: u64,
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
        } else {
            argmin_with_cursor(costs, cursor)?
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
        cursor: u64,
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
        load_based::select(scored, ctx.req.load_signals, cursor)
    }

    /// One phase: the formula when it can score anyone, else the load-only rule.
    fn choose(
        &self,
        ctx: &Ctx<'_, '_>,
        bufs: &mut Buffers<'_>,
        members: &[Matched],
        scoring: Option<Scoring>,
        phase: Phase,
        cursor: u64,
    ) -> Option<(Matched, SelectionReason)> {
        if let Some(scoring) = scoring {
            bufs.ranks.clear();
            bufs.ranks
                .extend(members.iter().map(|m| self.rank(ctx, *m, scoring)));
            if let Some((pos, reason)) =
                self.select_kv(ctx, bufs.ranks, bufs.positions, bufs.costs, scoring, cursor)
            {
                return members.get(pos).map(|m| (*m, reason));
            }
        }
        let (pos, reason) = Self::select_load(ctx, members, bufs.scored, phase, cursor)?;
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
        } = &mut *ctx.state;
        ledger.expire(now);
        let Scratch {
            roles,
            table,
            dense: own_dense,
            eligible,
            rows: row_backlogs,
            kv: kv_scratch,
        } = scratch;
        let KvScratch {
            members,
            ranks,
            positions,
            costs,
            scored,
            sorted,
            overlaps: overlap_rows,
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
        if members.is_empty() {
            return KvPickOutcome {
                outcome: PickOutcome::NoCandidates(NoCandidates::NoDecodeWorker),
                kv: None,
            };
        }
        let paired_bits = role_bit(CandidateRole::Prefill) | role_bit(CandidateRole::Decode);
        let paired = |ns: usize| {
            roles
                .get(ns)
                .is_some_and(|&r| r & paired_bits == paired_bits)
        };
        let pair_fleet = members.iter().any(|m| paired(m.namespace));
        let conditional = pair_fleet && self.params.conditional_disaggregation.enabled;

        let mut inline: [Option<NamespaceBacklog<'_>>; INLINE_NAMESPACES] =
            [None; INLINE_NAMESPACES];
        let spilled: Vec<Option<NamespaceBacklog<'_>>>;
        let ledgers: &[Option<NamespaceBacklog<'_>>] = if !req.load_signals || ledger.is_empty() {
            &[]
        } else if namespaces.len() <= INLINE_NAMESPACES {
            for (slot, n) in inline.iter_mut().zip(namespaces) {
                *slot = ledger.namespace(n);
            }
            &inline[..namespaces.len()]
        } else {
            spilled = namespaces.iter().map(|n| ledger.namespace(n)).collect();
            &spilled
        };
        let samples = Samples::new(req.load_signals, load, candidates, dense, slots);
        let backlogs = Backlogs::new(
            ledger,
            ledgers,
            matches!(samples, Samples::Mirror { .. }),
            dense,
            eligible,
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
            backlogs,
            overlaps,
            now,
        };
        let mut bufs = Buffers {
            ranks,
            positions,
            costs,
            scored,
        };
        let decode_scoring = if !pair_fleet {
            Some(Scoring::Aggregated)
        } else if conditional {
            Some(Scoring::ConditionalDecode)
        } else {
            None
        };
        let cursor = cursors.advance(req.model, Phase::Decode);
        let chosen = self.choose(
            &ctx,
            &mut bufs,
            members,
            decode_scoring,
            Phase::Decode,
            cursor,
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
        let has_prefill = roles
            .get(won.namespace)
            .is_some_and(|&r| r & role_bit(CandidateRole::Prefill) != 0);
        if decode.role == CandidateRole::Decode && has_prefill {
            members.clear();
            members.extend(
                dense
                    .rows
                    .iter()
                    .zip(&dense.group)
                    .zip(&dense.role)
                    .enumerate()
                    .filter(|&(_, ((_, &group), &role))| {
                        role == CandidateRole::Prefill
                            && eligible
                                .get(group as usize)
                                .is_some_and(|&ns| usize::from(ns) == won.namespace)
                    })
                    .map(|(index, _)| Matched {
                        index,
                        namespace: won.namespace,
                    }),
            );
            let cursor = cursors.advance(req.model, Phase::Prefill);
            if let Some((p, reason)) = self.choose(
                &ctx,
                &mut bufs,
                members,
                Some(Scoring::Prefill),
                Phase::Prefill,
                cursor,
            ) && let Some(c) = candidates.get(p.index)
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
        let dispatch = req
            .load_signals
            .then(|| load_based::record_pair(ledger, prefill, decode, tokens, now));
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
