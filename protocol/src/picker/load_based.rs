//! The default `LoadBasedPicker`: Dynamo's load-only cost formulas over the router's load store.
//!
//! * prefill cost = `active_prefill_tokens / max_num_batched_tokens`
//! * decode cost = `(active_decode_blocks + ceil(estimated_prompt_tokens / block_size)) /
//!   total_kv_blocks`, with `kv_used_blocks` standing in for a nil `active_decode_blocks`
//!
//! Each backlog adds the rank's unanswered dispatches from the [`DispatchLedger`]. A rank without a
//! fresh sample is *quiet* (never sampled, or its last sample reported no backlog) and competes
//! with zero backlog, or is *silent under load* (its last sample reported a backlog) and has no
//! cost. A rank whose fresh sample lacks the phase's field, or whose card lacks the capacity, has no
//! cost either. Per phase:
//!
//! 1. If some candidate has a fresh sample carrying the phase's field, the lowest defined cost
//!    wins among ranks that are not stalled, else among stalled ones (`load`); equal costs rotate
//!    on the phase's cursor. If no rank has a defined cost at all (no capacity on any card), the
//!    cursor rotates across all candidates (`round_robin`).
//! 2. Otherwise the cursor rotates across all candidates (`round_robin_stale`), and a stall is
//!    ignored since nothing could have answered the request.
//!
//! Decode is compared across eligible namespaces first; prefill is then picked within the winning
//! namespace. In a namespace serving the model with both prefill and decode workers, aggregated
//! workers are not decode candidates; elsewhere they are, and an aggregated winner gets no prefill
//! (`no_prefill_pool`). Costs are exact rationals compared by cross-multiplication, so equal loads
//! tie exactly.

use std::cmp::Ordering;

use super::dense::{DecodeColumn, DenseRanks, NOT_ELIGIBLE, Row, RowSample, role_bit};
use super::ledger::{DispatchLedger, DispatchLeg, NamespaceBacklog, RankBacklog};
use super::tie_break::{Nearest, Place, TieDraw, Turn, take_slot};
use super::{
    Candidate, CandidateRole, DynamoWorkerPicker, LoadView, NoCandidates, Phase, Pick, PickContext,
    PickOutcome, PickReasons, PickerState, Pinned, SampleState, SelectionReason,
};
use crate::ids::{DpRank, InstanceId, Namespace};
use crate::time::Tick;
pub(super) use row_backlogs::{RowBacklogCache, RowBacklogs};

mod beside;
mod row_backlogs;

/// A load cost `num / den` (`den > 0`), compared exactly: equality is equality of the ratios
/// (`1/3 == 2/6`), consistent with the ordering.
#[derive(Clone, Copy, Debug)]
pub struct Cost {
    pub num: u64,
    pub den: u64,
}

impl Cost {
    pub fn as_f64(self) -> f64 {
        self.num as f64 / self.den as f64
    }
}

impl Ord for Cost {
    #[inline]
    fn cmp(&self, other: &Self) -> Ordering {
        // Ranks of one fleet mostly share a capacity: then the numerators decide.
        if self.den == other.den {
            return self.num.cmp(&other.num);
        }
        (u128::from(self.num) * u128::from(other.den))
            .cmp(&(u128::from(other.num) * u128::from(self.den)))
    }
}

impl PartialEq for Cost {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Cost {}

impl PartialOrd for Cost {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// How one candidate scores for one phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scored {
    /// `None`: no defined cost (silent under load, a fresh sample without the phase's field, or
    /// no capacity on the card).
    pub cost: Option<Cost>,
    /// A fresh sample carries the phase's field.
    pub fresh_field: bool,
    pub stalled: bool,
}

/// The request's prompt size, with its block count memoised for the last block size seen: one
/// division per distinct block size instead of one per rank (a 64-bit division costs more than
/// the rest of a rank's scoring).
#[derive(Clone, Copy, Debug)]
pub struct RequestSize {
    tokens: u64,
    block_size: u32,
    blocks: u64,
}

impl RequestSize {
    pub fn new(estimated_prompt_tokens: u64) -> Self {
        Self {
            tokens: estimated_prompt_tokens,
            block_size: 0,
            blocks: 0,
        }
    }

    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// `ceil(tokens / block_size)`; 0 for a zero block size.
    #[inline]
    pub fn blocks(&mut self, block_size: u32) -> u64 {
        if block_size == 0 {
            return 0;
        }
        if block_size != self.block_size {
            self.block_size = block_size;
            self.blocks = self.tokens.div_ceil(u64::from(block_size));
        }
        self.blocks
    }
}

/// A rank's capacity as the cost formulas read it; 0 means "not declared" (a zero capacity
/// scores as undeclared).
#[derive(Clone, Copy, Debug)]
pub struct Capacity {
    pub block_size: u32,
    pub total_kv_blocks: u64,
    pub max_num_batched_tokens: u64,
}

impl Capacity {
    pub fn of(candidate: &Candidate) -> Self {
        Self {
            block_size: candidate.block_size.unwrap_or(0),
            total_kv_blocks: candidate.total_kv_blocks.unwrap_or(0),
            max_num_batched_tokens: candidate.max_num_batched_tokens.unwrap_or(0),
        }
    }

    #[inline]
    fn at(dense: &DenseRanks, i: usize) -> Self {
        Self {
            block_size: dense.block_size[i],
            total_kv_blocks: dense.total_kv_blocks[i],
            max_num_batched_tokens: dense.max_num_batched_tokens[i],
        }
    }
}

/// Scores `candidate` for `phase`: the sample's backlog (zero when quiet) plus the ledger's,
/// over the card's capacity.
pub fn score(
    phase: Phase,
    candidate: &Candidate,
    sample: SampleState,
    ledger: Option<NamespaceBacklog<'_>>,
    size: &mut RequestSize,
    now: Tick,
) -> Scored {
    score_rank(
        phase,
        Capacity::of(candidate),
        candidate.worker.instance_id,
        candidate.rank(),
        sample,
        ledger,
        size,
        now,
    )
}

/// [`score`] of one rank given by its capacity, instance and rank.
#[allow(clippy::too_many_arguments)]
#[inline]
pub fn score_rank(
    phase: Phase,
    capacity: Capacity,
    instance: InstanceId,
    rank: DpRank,
    sample: SampleState,
    ledger: Option<NamespaceBacklog<'_>>,
    size: &mut RequestSize,
    now: Tick,
) -> Scored {
    let backlog = ledger
        .map(|l| l.backlog(instance, rank, now))
        .unwrap_or_default();
    score_backlog(phase, capacity, sample, backlog, size)
}

/// [`score_rank`] with the rank's ledger backlog already read.
#[inline]
pub fn score_backlog(
    phase: Phase,
    capacity: Capacity,
    sample: SampleState,
    backlog: RankBacklog,
    size: &mut RequestSize,
) -> Scored {
    let fresh = sample.fresh_backlog(phase);
    let base = match sample {
        SampleState::Fresh { .. } => fresh,
        SampleState::Never
        | SampleState::Stale {
            last_had_backlog: false,
        } => Some(0),
        SampleState::Stale {
            last_had_backlog: true,
        } => None,
    };
    let cost = base.and_then(|base| match phase {
        Phase::Prefill => {
            let den = Some(capacity.max_num_batched_tokens).filter(|&d| d > 0)?;
            Some(Cost {
                num: base.saturating_add(backlog.prefill_tokens),
                den,
            })
        }
        Phase::Decode => {
            let block_size = Some(capacity.block_size).filter(|&b| b > 0)?;
            let den = Some(capacity.total_kv_blocks).filter(|&d| d > 0)?;
            let request_blocks = size.blocks(block_size);
            Some(Cost {
                num: base
                    .saturating_add(backlog.decode_blocks)
                    .saturating_add(request_blocks),
                den,
            })
        }
    });
    Scored {
        cost,
        fresh_field: fresh.is_some(),
        stalled: backlog.stalled,
    }
}

/// Chooses among scored candidates (in candidate order) for one phase. `cursor` is the phase's
/// round-robin value for this pick. Returns the chosen position and the reason.
pub fn select(
    scored: &[Scored],
    load_signals: bool,
    cursor: u64,
) -> Option<(usize, SelectionReason)> {
    let mut tally = Tally::default();
    for (pos, s) in scored.iter().enumerate() {
        tally.add(pos, s);
    }
    select_tallied(scored, &tally, load_signals, cursor)
}

/// [`select`] with the turn's tie-break: when a draw is given and the lowest cost decides (load
/// signals on, some fresh sample), the draw chooses among the ranks of the winning tier whose
/// cost is within the draw's slack of the lowest; `weight(pos)` is the request's own weight in
/// the cost unit of the rank at `pos`. Without a draw, exactly [`select`].
///
/// With peer slots ([`TieDraw::place`]), the slot of the tie set ([`take_slot`]) instead of a
/// draw; the positions the peers take are appended to `peers`.
pub fn select_turn(
    scored: &[Scored],
    load_signals: bool,
    turn: Turn,
    weight: impl Fn(usize) -> f64,
    peers: &mut Vec<u32>,
) -> Option<(usize, SelectionReason)> {
    let mut tally = Tally::default();
    for (pos, s) in scored.iter().enumerate() {
        tally.add(pos, s);
    }
    let tier = tally.tier().filter(|_| load_signals && tally.any_fresh);
    let (Some(draw), Some((tier_stalled, best))) = (turn.tie, tier) else {
        return select_tallied(scored, &tally, load_signals, turn.cursor);
    };
    let limit = best.cost.as_f64() + draw.slack(weight(best.first));
    let tied =
        |s: &Scored| s.stalled == tier_stalled && s.cost.is_some_and(|c| c.as_f64() <= limit);
    if let Some(place) = draw.place {
        let mut set: Vec<(f64, u32)> = scored
            .iter()
            .enumerate()
            .filter(|(_, s)| tied(s))
            .filter_map(|(pos, s)| Some((s.cost?.as_f64(), u32::try_from(pos).ok()?)))
            .collect();
        let own = take_slot(&mut set, place, peers).map_or(best.first, |p| p as usize);
        return Some((own, SelectionReason::Load));
    }
    let count = scored.iter().filter(|s| tied(s)).count();
    scored
        .iter()
        .enumerate()
        .filter(|(_, s)| tied(s))
        .nth(draw.nth(count))
        .map(|(pos, _)| (pos, SelectionReason::Load))
        .or(Some((best.first, SelectionReason::Load)))
}

/// The lowest cost of one tier, how many ranks tie on it, and the first of them.
#[derive(Clone, Copy, Debug)]
struct Best {
    cost: Cost,
    ties: usize,
    first: usize,
}

/// What [`select`] needs to know about a phase's scores, gathered while scoring, so the choice
/// costs no further pass over the ranks unless ties must be counted off.
#[derive(Clone, Copy, Debug, Default)]
struct Tally {
    any_fresh: bool,
    free: Option<Best>,
    stalled: Option<Best>,
}

impl Tally {
    /// The tier the lowest cost is chosen from (not stalled before stalled) and its best.
    fn tier(&self) -> Option<(bool, Best)> {
        match (self.free, self.stalled) {
            (Some(best), _) => Some((false, best)),
            (None, Some(best)) => Some((true, best)),
            (None, None) => None,
        }
    }

    #[inline]
    fn add(&mut self, pos: usize, s: &Scored) {
        self.any_fresh |= s.fresh_field;
        let Some(cost) = s.cost else { return };
        let best = if s.stalled {
            &mut self.stalled
        } else {
            &mut self.free
        };
        match best {
            Some(b) => match cost.cmp(&b.cost) {
                Ordering::Less => {
                    *b = Best {
                        cost,
                        ties: 1,
                        first: pos,
                    }
                }
                Ordering::Equal => b.ties += 1,
                Ordering::Greater => {}
            },
            None => {
                *best = Some(Best {
                    cost,
                    ties: 1,
                    first: pos,
                })
            }
        }
    }
}

/// [`select`] over scores already tallied (in the same order).
fn select_tallied(
    scored: &[Scored],
    tally: &Tally,
    load_signals: bool,
    cursor: u64,
) -> Option<(usize, SelectionReason)> {
    if scored.is_empty() {
        return None;
    }
    let rotate = |reason| Some((nth(scored.len(), cursor), reason));
    if !load_signals {
        return rotate(SelectionReason::RoundRobin);
    }
    if !tally.any_fresh {
        return rotate(SelectionReason::RoundRobinStale);
    }
    // Ranks that are not stalled win over stalled ones.
    let (tier_stalled, best) = match (tally.free, tally.stalled) {
        (Some(best), _) => (false, best),
        (None, Some(best)) => (true, best),
        (None, None) => return rotate(SelectionReason::RoundRobin),
    };
    let wanted = nth(best.ties, cursor);
    if wanted == 0 {
        return Some((best.first, SelectionReason::Load));
    }
    scored
        .iter()
        .enumerate()
        .skip(best.first + 1)
        .filter(|(_, s)| s.stalled == tier_stalled && s.cost.is_some_and(|c| c == best.cost))
        .nth(wanted - 1)
        .map(|(pos, _)| (pos, SelectionReason::Load))
}

fn nth(len: usize, cursor: u64) -> usize {
    // len > 0 at every call site; the remainder is < len, so it fits usize.
    (cursor % len.max(1) as u64) as usize
}

/// Eligible namespaces whose ledgers a pick resolves without allocating.
pub(super) const INLINE_NAMESPACES: usize = 16;

/// The ledger per eligible namespace (by position), resolved once per pick so each rank hashes
/// only its id: on the stack for up to [`INLINE_NAMESPACES`] namespaces (at most 16 can be
/// configured), in a `Vec` past that; none without load signals or pending dispatches.
pub(super) struct NamespaceLedgers<'a> {
    inline: [Option<NamespaceBacklog<'a>>; INLINE_NAMESPACES],
    spilled: Vec<Option<NamespaceBacklog<'a>>>,
    len: usize,
}

impl<'a> NamespaceLedgers<'a> {
    pub(super) fn resolve(
        ledger: &'a DispatchLedger,
        namespaces: &[Namespace],
        load_signals: bool,
    ) -> Self {
        let mut out = Self {
            inline: [None; INLINE_NAMESPACES],
            spilled: Vec::new(),
            len: 0,
        };
        if !load_signals || ledger.is_empty() {
            return out;
        }
        out.len = namespaces.len();
        if out.len <= INLINE_NAMESPACES {
            for (slot, n) in out.inline.iter_mut().zip(namespaces) {
                *slot = ledger.namespace(n);
            }
        } else {
            out.spilled = namespaces.iter().map(|n| ledger.namespace(n)).collect();
        }
        out
    }

    pub(super) fn as_slice(&self) -> &[Option<NamespaceBacklog<'a>>] {
        if self.len <= INLINE_NAMESPACES {
            &self.inline[..self.len]
        } else {
            &self.spilled
        }
    }
}

/// Buffers reused across picks.
#[derive(Debug, Default)]
pub(super) struct Scratch {
    /// Per eligible namespace, the roles its groups hold ([`role_bit`]s).
    pub(super) roles: Vec<u8>,
    /// Per `(group, role)` ([`Row::group_role`]): the eligible-namespace position when ranks
    /// of that group and role are candidates of the phase being picked, else [`NOT_ELIGIBLE`].
    /// Eligibility, role and the aggregated-sits-out rule in one lookup per rank.
    pub(super) table: Vec<u16>,
    /// The layout of a caller's candidates when it passes none.
    pub(super) dense: DenseRanks,
    /// Per layout group, its eligible-namespace position ([`NOT_ELIGIBLE`] when it does not
    /// serve the request).
    pub(super) eligible: Vec<u16>,
    /// The ledger's pending dispatches laid onto the layouts' rows, kept across picks.
    pub(super) rows: RowBacklogCache,
    /// The KV-aware picker's per-pick buffers.
    pub(super) kv: super::kv_aware::KvScratch,
    /// The column keys [`gather_column`] sets aside for one pick.
    pub(super) saved: Vec<(u32, u64)>,
    /// The rows a tie draw chooses among ([`RowPass::choose_tied`]).
    pub(super) tied: Vec<u32>,
    /// Peer slots: the tie set as `(cost, row)` ([`take_slot`]), and per phase
    /// ([`Phase::index`]) the rows this pick's peers take.
    pub(super) tie_set: Vec<(f64, u32)>,
    pub(super) peers: [Vec<u32>; 2],
    /// Peer slots on the decode fast pass ([`decide_slots`]): the lowest free costs, exact.
    pub(super) nearest: Nearest<Cost>,
}
/// Where one pick reads each rank's ledger backlog.
#[derive(Clone, Copy)]
pub(super) enum Backlogs<'b> {
    /// Nothing pending (or load signals off).
    Empty,
    /// Laid onto rows for this pick ([`RowBacklogs`]).
    ByRow(&'b RowBacklogs),
    /// Looked up per rank in its namespace's ledger (samples read through a view).
    Lookup(&'b [Option<NamespaceBacklog<'b>>]),
}

impl<'b> Backlogs<'b> {
    /// Where a pick over `dense` reads backlogs: nothing without ledgers, from the rows kept
    /// per layout when samples are mirrored (caught up with the instances whose legs changed
    /// since the last pick: `ledger` was expired at `now`), else looked up per rank.
    pub(super) fn new(
        ledgers: &'b [Option<NamespaceBacklog<'b>>],
        ledger: &DispatchLedger,
        mirrored: bool,
        dense: &DenseRanks,
        rows: &'b mut RowBacklogCache,
        now: Tick,
    ) -> Self {
        if ledgers.is_empty() {
            Backlogs::Empty
        } else if mirrored {
            Backlogs::ByRow(rows.caught_up(dense, ledger, now))
        } else {
            Backlogs::Lookup(ledgers)
        }
    }

    #[inline(always)]
    pub(super) fn get(&self, dense: &DenseRanks, row: usize, ns: usize, now: Tick) -> RankBacklog {
        match *self {
            Backlogs::Empty => RankBacklog::default(),
            Backlogs::ByRow(rows) => rows.get(row),
            Backlogs::Lookup(ledgers) => ledgers
                .get(ns)
                .copied()
                .flatten()
                .map(|l| l.backlog(dense.instance[row], dense.rank[row], now))
                .unwrap_or_default(),
        }
    }
}

/// Where one pick reads its ranks' samples.
#[derive(Clone, Copy)]
pub(super) enum Samples<'v> {
    /// Load signals are off: nothing is read.
    Off,
    /// The load store's samples mirrored per layout row (the production path).
    Mirror {
        rows: &'v [RowSample],
        /// The pick's freshness bound ([`LoadSlots::oldest`](super::dense::LoadSlots::oldest)).
        oldest: u64,
    },
    /// Through the view, one call per rank (views that are not a load store).
    View {
        load: &'v dyn LoadView,
        candidates: &'v [Candidate],
    },
}

impl<'v> Samples<'v> {
    /// The store's samples mirrored per row when the view is the store (slots resolved once per
    /// layout and slot epoch, rows re-read when written), else through the view; nothing when
    /// load signals are off.
    /// On the mirrored path, also the mirror's [`DecodeColumn`], up to date for this pick.
    pub(super) fn new(
        load_signals: bool,
        load: &'v dyn LoadView,
        candidates: &'v [Candidate],
        dense: &DenseRanks,
        cache: &'v mut super::dense::SlotCache,
    ) -> (Self, Option<&'v mut DecodeColumn>) {
        if !load_signals {
            (Samples::Off, None)
        } else if let Some(load) = load.slots() {
            let oldest = load.oldest();
            let (rows, column) = cache.samples_with_column(dense, load.store, oldest);
            (Samples::Mirror { rows, oldest }, Some(column))
        } else {
            (Samples::View { load, candidates }, None)
        }
    }

    #[inline]
    pub(super) fn get(&self, i: usize) -> SampleState {
        match *self {
            Samples::Off => SampleState::Never,
            Samples::Mirror { rows, oldest } => match rows.get(i) {
                Some(s) => s.state(oldest),
                None => SampleState::Never,
            },
            Samples::View { load, candidates } => match candidates.get(i) {
                Some(c) => load.sample(&c.worker, c.rank()),
                None => SampleState::Never,
            },
        }
    }
}

/// The default picker. Stateless: everything it mutates lives in [`PickerState`].
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadBasedPicker;

impl LoadBasedPicker {
    pub fn new() -> Self {
        Self
    }
}

/// Fills `roles` (per eligible namespace, the roles its groups hold) and `table` (per
/// `(group, role)`, the namespace position of decode candidates: decode ranks, and aggregated
/// ranks outside a namespace with both prefill and decode ranks). Returns whether any group
/// serves the request. O(groups), not O(ranks).
pub(super) fn plan_decode(
    dense: &DenseRanks,
    eligible: &[u16],
    namespaces: usize,
    roles: &mut Vec<u8>,
    table: &mut Vec<u16>,
) -> bool {
    roles.clear();
    roles.resize(namespaces, 0);
    let mut any_served = false;
    for (&ns, &bits) in eligible.iter().zip(&dense.group_roles) {
        if let Some(r) = roles.get_mut(usize::from(ns)) {
            *r |= bits;
            any_served = true;
        }
    }
    let paired = role_bit(CandidateRole::Prefill) | role_bit(CandidateRole::Decode);
    table.clear();
    table.resize(dense.groups() * 4, NOT_ELIGIBLE);
    for (g, &ns) in eligible.iter().enumerate() {
        let Some(&r) = roles.get(usize::from(ns)) else {
            continue;
        };
        table[Row::table_index(g, CandidateRole::Decode)] = ns;
        // Dynamo serves no prefill+aggregated pair: beside a prefill/decode pool, aggregated
        // workers sit out.
        if r & paired != paired {
            table[Row::table_index(g, CandidateRole::Aggregated)] = ns;
        }
    }
    any_served
}

/// A `RowBacklogs` holding nothing (for a pick without ledgers).
fn row_backlogs_empty() -> &'static RowBacklogs {
    static EMPTY: RowBacklogs = RowBacklogs::EMPTY;
    &EMPTY
}

/// Fills `table` with the prefill ranks of namespace position `ns`.
pub(super) fn plan_prefill(dense: &DenseRanks, eligible: &[u16], ns: u16, table: &mut Vec<u16>) {
    table.clear();
    table.resize(dense.groups() * 4, NOT_ELIGIBLE);
    for (g, &p) in eligible.iter().enumerate() {
        if p == ns {
            table[Row::table_index(g, CandidateRole::Prefill)] = ns;
        }
    }
}

/// What one pass over the rows gathered for one phase: the candidates counted and their scores
/// tallied.
#[derive(Clone, Copy, Debug, Default)]
struct Gathered {
    tally: Tally,
    candidates: usize,
}

/// One phase over the dense layout: the ranks whose `(group, role)` entry in `table` is an
/// eligible-namespace position are the candidates, each scored with `score(row, namespace
/// position, fused row)` into a [`Tally`] (no per-rank writes). The pass is instantiated once
/// per way of reading samples and backlogs, so the loop holds no dispatch.
struct RowPass<'p, F> {
    rows: &'p [Row],
    table: &'p [u16],
    score: F,
}

impl<F: FnMut(usize, usize, Row) -> Scored> RowPass<'_, F> {
    /// The candidates in row order with their namespace positions.
    #[inline(always)]
    fn candidates(&self) -> impl Iterator<Item = (usize, usize, Row)> + '_ {
        let table = self.table;
        self.rows.iter().enumerate().filter_map(move |(i, &row)| {
            let ns = table
                .get(row.group_role as usize)
                .copied()
                .unwrap_or(NOT_ELIGIBLE);
            (ns != NOT_ELIGIBLE).then_some((i, usize::from(ns), row))
        })
    }

    #[inline(always)]
    fn gather(&mut self) -> Gathered {
        let mut gathered = Gathered::default();
        let table = self.table;
        for (i, &row) in self.rows.iter().enumerate() {
            let ns = table
                .get(row.group_role as usize)
                .copied()
                .unwrap_or(NOT_ELIGIBLE);
            if ns == NOT_ELIGIBLE {
                continue;
            }
            gathered.candidates += 1;
            let s = (self.score)(i, usize::from(ns), row);
            gathered.tally.add(i, &s);
        }
        gathered
    }

    /// The choice among the gathered candidates (`None` when there are none), as [`select`]
    /// makes it over the candidates in row order; returns the chosen row. Rotations and
    /// ties past the first re-walk the rows (ties by re-scoring the ranks after the first).
    #[inline(always)]
    fn choose(
        &mut self,
        gathered: &Gathered,
        load_signals: bool,
        cursor: u64,
    ) -> Option<(usize, SelectionReason)> {
        if gathered.candidates == 0 {
            return None;
        }
        let tally = &gathered.tally;
        let rotated = |pass: &Self, reason| {
            pass.candidates()
                .nth(nth(gathered.candidates, cursor))
                .map(|(i, _, _)| (i, reason))
        };
        if !load_signals {
            return rotated(self, SelectionReason::RoundRobin);
        }
        if !tally.any_fresh {
            return rotated(self, SelectionReason::RoundRobinStale);
        }
        // Ranks that are not stalled win over stalled ones.
        let (tier_stalled, best) = match (tally.free, tally.stalled) {
            (Some(best), _) => (false, best),
            (None, Some(best)) => (true, best),
            (None, None) => return rotated(self, SelectionReason::RoundRobin),
        };
        let wanted = nth(best.ties, cursor);
        if wanted == 0 {
            return Some((best.first, SelectionReason::Load));
        }
        let table = self.table;
        let score = &mut self.score;
        self.rows
            .iter()
            .enumerate()
            .skip(best.first + 1)
            .filter_map(|(i, &row)| {
                let ns = table
                    .get(row.group_role as usize)
                    .copied()
                    .unwrap_or(NOT_ELIGIBLE);
                if ns == NOT_ELIGIBLE {
                    return None;
                }
                let s = score(i, usize::from(ns), row);
                (s.stalled == tier_stalled && s.cost.is_some_and(|c| c == best.cost)).then_some(i)
            })
            .nth(wanted - 1)
            .map(|i| (i, SelectionReason::Load))
    }
}

impl<F: FnMut(usize, usize, Row) -> Scored> RowPass<'_, F> {
    /// [`Self::choose`] with the replica's tie draw: when the lowest cost decides, the draw
    /// chooses among the winning tier's ranks within its slack of the lowest (`weight(row)`: the
    /// request's own weight in that row's cost unit), found by one re-walk into `tied`; a
    /// rotation stays the cursor's. `gathered` must be [`Self::gather`]'s (complete) tally.
    ///
    /// With peer slots ([`TieDraw::place`]), the slot of the tie set ([`take_slot`], over
    /// `slots`) instead of a draw; the rows the peers take are appended to `peers`.
    #[allow(clippy::too_many_arguments)]
    fn choose_tied(
        &mut self,
        gathered: &Gathered,
        load_signals: bool,
        cursor: u64,
        draw: TieDraw,
        weight: impl Fn(usize) -> f64,
        tied: &mut Vec<u32>,
        (slots, peers): (&mut Vec<(f64, u32)>, &mut Vec<u32>),
    ) -> Option<(usize, SelectionReason)> {
        let tally = &gathered.tally;
        let tier = tally
            .tier()
            .filter(|_| load_signals && tally.any_fresh && gathered.candidates > 0);
        let Some((tier_stalled, best)) = tier else {
            return self.choose(gathered, load_signals, cursor);
        };
        let limit = best.cost.as_f64() + draw.slack(weight(best.first));
        tied.clear();
        slots.clear();
        let table = self.table;
        for (i, &row) in self.rows.iter().enumerate() {
            let ns = table
                .get(row.group_role as usize)
                .copied()
                .unwrap_or(NOT_ELIGIBLE);
            if ns == NOT_ELIGIBLE {
                continue;
            }
            let s = (self.score)(i, usize::from(ns), row);
            if s.stalled == tier_stalled
                && let Some(cost) = s.cost.map(Cost::as_f64).filter(|&c| c <= limit)
            {
                tied.push(u32::try_from(i).unwrap_or(u32::MAX));
                if draw.place.is_some() {
                    slots.push((cost, u32::try_from(i).unwrap_or(u32::MAX)));
                }
            }
        }
        if let Some(place) = draw.place {
            let own = take_slot(slots, place, peers).map_or(best.first, |row| row as usize);
            return Some((own, SelectionReason::Load));
        }
        let pick = tied
            .get(draw.nth(tied.len()))
            .map_or(best.first, |&i| i as usize);
        Some((pick, SelectionReason::Load))
    }
}

/// What one request adds to the cost of the rank at `row` for `phase` (its prompt blocks over
/// `total_kv_blocks` for decode, its tokens over `max_num_batched_tokens` for prefill): the
/// tie-break's unit. 0 when the card lacks the capacity.
pub(super) fn request_weight(phase: Phase, dense: &DenseRanks, row: usize, tokens: u64) -> f64 {
    let cap = Capacity::at(dense, row);
    match phase {
        Phase::Decode if cap.block_size > 0 && cap.total_kv_blocks > 0 => {
            tokens.div_ceil(u64::from(cap.block_size)) as f64 / cap.total_kv_blocks as f64
        }
        Phase::Prefill if cap.max_num_batched_tokens > 0 => {
            tokens as f64 / cap.max_num_batched_tokens as f64
        }
        _ => 0.0,
    }
}

/// The lowest cost of one tier while gathering, kept in registers (`ties == 0`: none yet).
#[derive(Clone, Copy, Debug, Default)]
struct Lowest {
    num: u64,
    den: u64,
    ties: usize,
    first: usize,
}

impl Lowest {
    #[inline(always)]
    fn add(&mut self, row: usize, cost: Cost) {
        if self.ties == 0 {
            *self = Lowest {
                num: cost.num,
                den: cost.den,
                ties: 1,
                first: row,
            };
            return;
        }
        match cost.cmp(&Cost {
            num: self.num,
            den: self.den,
        }) {
            Ordering::Less => {
                *self = Lowest {
                    num: cost.num,
                    den: cost.den,
                    ties: 1,
                    first: row,
                }
            }
            Ordering::Equal => self.ties += 1,
            Ordering::Greater => {}
        }
    }

    /// [`Self::add`] for rows offered out of row order: a tie keeps the lowest row first, as
    /// offering them in row order would.
    #[inline]
    fn add_unordered(&mut self, row: usize, cost: Cost) {
        if self.ties != 0
            && cost
                == (Cost {
                    num: self.num,
                    den: self.den,
                })
        {
            self.ties += 1;
            self.first = self.first.min(row);
        } else {
            self.add(row, cost);
        }
    }

    fn best(self) -> Option<Best> {
        (self.ties > 0).then_some(Best {
            cost: Cost {
                num: self.num,
                den: self.den,
            },
            ties: self.ties,
            first: self.first,
        })
    }
}

/// The decode gather of the production path (samples mirrored per row, the ledger's backlogs
/// laid onto rows or none): what [`RowPass::gather`] over [`mirrored_decode`] gathers, written
/// as one loop over the fused rows and the mirror. A rank's cost without its ledger backlog is
/// a lower bound of its cost, so a rank that already loses to the lowest free cost on that
/// bound loses: only a rank that may win or tie reads its row's backlog and is tallied
/// ([`Tallies::offer`], out of line). The stalled tier, which only counts when no free rank
/// has a cost, is then complete whenever it is read: while no free cost exists every costed
/// rank is offered. The candidates are counted per `(group, role)`, not per rank. Not
/// inlined: its own function keeps its few live values in registers.
/// Every row declares `block_size` ([`DenseRanks::uniform_block_size`]): the request's
/// blocks are computed once.
///
/// With `SLOTS` (peer slots, `near` given), the free tier's lowest costs are kept in `near`
/// too ([`Tallies::offer`]), and a rank is skipped only when it also cannot enter them: the
/// cut is then the last of the `k` kept, not the lowest ([`Cut`]). `None` when a numerator or
/// capacity compared reaches 2^53, where `f64` costs (the slots' order) could disagree with
/// the exact order the skip relies on: the caller then takes the generic pass.
#[inline(never)]
fn gather_mirrored<const SLOTS: bool>(
    dense: &DenseRanks,
    block_size: u32,
    mirror: &[RowSample],
    table: &[u16],
    backlogs: &RowBacklogs,
    (oldest, tokens): (u64, u64),
    near: Option<&mut Nearest<Cost>>,
) -> Option<Gathered> {
    let rows = &dense.rows[..];
    let n = rows.len().min(mirror.len());
    let (rows, mirror) = (&rows[..n], &mirror[..n]);
    let mut tallies = Tallies {
        free: Lowest::default(),
        stalled: Lowest::default(),
        backlogs,
        near,
        cut: Cut::default(),
        wide: 0,
    };
    let mut any_fresh = false;
    let request_blocks = RequestSize::new(tokens).blocks(block_size);
    for (i, (row, sample)) in rows.iter().zip(mirror).enumerate() {
        if table
            .get(row.group_role as usize)
            .is_none_or(|&ns| ns == NOT_ELIGIBLE)
        {
            continue;
        }
        let base = if sample.at > oldest {
            if sample.flags & RowSample::HAS_DECODE == 0 {
                continue;
            }
            any_fresh = true;
            sample.decode
        } else if sample.flags & RowSample::BUSY != 0 {
            continue;
        } else {
            0
        };
        let den = row.total_kv_blocks;
        if row.block_size == 0 || den == 0 {
            continue;
        }
        let num = base.saturating_add(request_blocks);
        let cut = if SLOTS {
            tallies.cut
        } else {
            let free = &tallies.free;
            Cut {
                on: free.ties != 0,
                num: free.num,
                den: free.den,
            }
        };
        if cut.on {
            let loses = if den == cut.den {
                num > cut.num || (SLOTS && num == cut.num)
            } else {
                let (a, b) = (
                    u128::from(num) * u128::from(cut.den),
                    u128::from(cut.num) * u128::from(den),
                );
                a > b || (SLOTS && a == b)
            };
            if loses {
                continue;
            }
        }
        if SLOTS {
            tallies.wide |= num | den;
        }
        tallies.offer(i, num, den);
    }
    if SLOTS && tallies.wide >= EXACT_F64 {
        return None;
    }
    let candidates = dense
        .group_role_rows
        .iter()
        .zip(table)
        .filter(|&(_, &ns)| ns != NOT_ELIGIBLE)
        .map(|(&rows, _)| rows as usize)
        .sum();
    Some(Gathered {
        tally: Tally {
            any_fresh,
            free: tallies.free.best(),
            stalled: tallies.stalled.best(),
        },
        candidates,
    })
}

/// 2^53: integers below it convert to `f64` exactly, so their ratios round in their exact
/// order (ties included).
const EXACT_F64: u64 = 1 << 53;

/// Where [`gather_mirrored`] skips a rank on its cost without its ledger backlog (a lower
/// bound; `on`: once there is a cut). Without peer slots the cut is the lowest free cost, and a
/// rank above it is skipped (a tie there counts). With them it is the `k`-th lowest kept
/// ([`Nearest::full_last`]), once `k` are kept, and a rank at or above it is skipped: it comes
/// later in row order, so it cannot enter the kept ones, nor come before the lowest's first
/// row (the free tier's tie count is then a lower bound, which the slots do not read).
#[derive(Clone, Copy, Debug, Default)]
struct Cut {
    on: bool,
    num: u64,
    den: u64,
}

/// Peer slots on the production decode path (samples mirrored, backlogs by row or none, one
/// block size): one pass keeps the free tier's `place.count` lowest ([`column_slots`] over the
/// decode column where every row is a candidate of one capacity, else [`gather_mirrored`]),
/// and the slot is taken from those within the window ([`Nearest::take`]), instead of the
/// generic pass and a re-walk into the whole tie set. `None` where it cannot answer (no free
/// rank has a cost, or no fresh sample: a rotation or the stalled tier; numerators too wide):
/// the caller takes the generic pass, the cursor untouched. Chooses exactly what
/// [`RowPass::choose_tied`] chooses, and appends the same peers.
#[allow(clippy::too_many_arguments)]
fn decide_slots(
    dense: &DenseRanks,
    (block_size, tokens): (u32, u64),
    (mirror, oldest): (&[RowSample], u64),
    table: &[u16],
    backlogs: &RowBacklogs,
    (draw, place): (TieDraw, Place),
    (near, tie_set, peers): (&mut Nearest<Cost>, &mut Vec<(f64, u32)>, &mut Vec<u32>),
    column: Option<(&mut DecodeColumn, &mut Vec<(u32, u64)>)>,
    advance: &mut impl FnMut() -> u64,
) -> Option<(usize, SelectionReason)> {
    near.reset(place);
    let from_column = match column {
        Some((column, saved))
            if block_size > 0
                && column.keys().len() == dense.len()
                && dense.all_candidates(table) =>
        {
            dense.uniform_kv_blocks.and_then(|den| {
                let request_blocks = RequestSize::new(tokens).blocks(block_size);
                column_slots(column, backlogs, saved, (request_blocks, den), near)
            })
        }
        _ => None,
    };
    let (cost, first) = match from_column {
        Some(best) => best,
        None => {
            near.reset(place);
            let gathered = gather_mirrored::<true>(
                dense,
                block_size,
                mirror,
                table,
                backlogs,
                (oldest, tokens),
                Some(&mut *near),
            )?;
            let best = gathered.tally.free.filter(|_| gathered.tally.any_fresh)?;
            (best.cost, best.first)
        }
    };
    let best = Best {
        cost,
        ties: 1,
        first,
    };
    advance();
    let weight = request_weight(Phase::Decode, dense, best.first, tokens);
    let limit = best.cost.as_f64() + draw.slack(weight);
    let own = near
        .take(limit, place, tie_set, peers)
        .map_or(best.first, |row| row as usize);
    Some((own, SelectionReason::Load))
}

/// The decode choice of the production path: from the mirror's [`DecodeColumn`] when every
/// row is a candidate of one nonzero capacity ([`gather_column`], then [`choose_column`]),
/// else [`gather_mirrored`] and the pass's own choice.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn decide_mirrored<F: FnMut(usize, usize, Row) -> Scored>(
    pass: RowPass<'_, F>,
    dense: &DenseRanks,
    block_size: u32,
    mirror: &[RowSample],
    backlogs: &RowBacklogs,
    oldest: u64,
    tokens: u64,
    column: Option<(&mut DecodeColumn, &mut Vec<(u32, u64)>)>,
    advance: &mut impl FnMut() -> u64,
) -> Option<(usize, SelectionReason)> {
    if let Some((column, saved)) = column
        && block_size > 0
        && let Some(den) = dense.uniform_kv_blocks.filter(|&d| d > 0)
        && column.keys().len() == dense.len()
        && dense.all_candidates(pass.table)
    {
        let request_blocks = RequestSize::new(tokens).blocks(block_size);
        if beside::many_backlogged(backlogs, column.keys().len()) {
            if let Some(gathered) = beside::gather_beside(column, backlogs, request_blocks, den) {
                return beside::choose_beside(column, backlogs, request_blocks, &gathered, advance);
            }
        } else if let Some(gathered) = gather_column(column, backlogs, saved, request_blocks, den) {
            return choose_column(column, saved, backlogs, request_blocks, &gathered, advance);
        }
    }
    let gathered = gather_mirrored::<false>(
        dense,
        block_size,
        mirror,
        pass.table,
        backlogs,
        (oldest, tokens),
        None,
    );
    decide(pass, gathered, true, advance)
}

/// Request blocks, and numerators with them, below which [`column_slots`] answers: distinct
/// numerators below 2^52 over one capacity give distinct `f64` costs, in their order.
const SLOT_BLOCKS: u64 = 1 << 40;
const SLOT_NUMS: u64 = 1 << 52;

/// [`gather_mirrored`]'s peer slots from the decode column (every row a candidate of one
/// nonzero capacity `den`): the narrowed keys scanned once in row order, a key offered only
/// while it is below the `k`-th kept (an equal key comes later, so it cannot enter), with the
/// ledger's backlogged rows set aside and offered after with their backlogs. Over one
/// capacity, `f64` order is numerator order, so the first kept is the lowest cost's first
/// row: returns it with its cost. `None` where the column cannot answer exactly (a key equal
/// to "no cost", wide numerators, fewer than `k` keys below `u32::MAX`, no fresh sample, no
/// free rank): the caller then runs [`gather_mirrored`].
#[inline(never)]
fn column_slots(
    column: &mut DecodeColumn,
    backlogs: &RowBacklogs,
    saved: &mut Vec<(u32, u64)>,
    (request_blocks, den): (u64, u64),
    near: &mut Nearest<Cost>,
) -> Option<(Cost, usize)> {
    if !column.exact() || column.fresh() == 0 || request_blocks >= SLOT_BLOCKS || den == 0 {
        return None;
    }
    let (keys, narrow) = column.keys_mut();
    if narrow.len() != keys.len() || den >= EXACT_F64 {
        return None;
    }
    saved.clear();
    for &row in backlogs.rows() {
        if let Some(key) = keys.get_mut(row as usize)
            && *key != DecodeColumn::NONE
        {
            saved.push((row, *key));
            *key = DecodeColumn::NONE;
        }
    }
    set_aside(narrow, saved);
    let mut cut = u32::MAX;
    for (i, &key) in narrow.iter().enumerate() {
        if key < cut {
            let cost = Cost {
                num: u64::from(key) + request_blocks,
                den,
            };
            near.offer(cost.as_f64(), i as u32, cost);
            if let Some((_, last)) = near.full_last() {
                // Below `u32::MAX + SLOT_BLOCKS`: the last kept is a key offered here.
                cut = u32::try_from(last.num - request_blocks).unwrap_or(u32::MAX);
            }
        }
    }
    put_back(keys, narrow, saved);
    // Fewer than `k` keys below `u32::MAX`: a wider key may be among the lowest.
    near.full_last()?;
    for &(row, key) in saved.iter() {
        let backlog = backlogs.get(row as usize);
        let num = key
            .saturating_add(request_blocks)
            .saturating_add(backlog.decode_blocks);
        if num >= SLOT_NUMS {
            return None;
        }
        if !backlog.stalled {
            let cost = Cost { num, den };
            near.offer(cost.as_f64(), row, cost);
        }
    }
    near.first().map(|(cost, row)| (cost, row as usize))
}

/// Numerators below which [`gather_column`] adds the request's blocks without saturating (and
/// so keeps distinct backlogs distinct).
const COLUMN_LIMIT: u64 = 1 << 62;

/// What [`gather_mirrored`] gathers, for a layout where every row is a candidate and declares
/// one nonzero block size and one nonzero KV capacity `den` (so costs compare by numerator),
/// read from the mirror's [`DecodeColumn`]: the lowest decode backlog over the column and the
/// rows holding it (two tight passes with no per-rank branch on the sample or the row), with
/// the ledger's few backlogged rows set aside during them and tallied after, out of row order.
/// `None` where the column cannot answer exactly (a fresh field equal to the column's "no
/// cost", or numerators near saturation): the caller then runs [`gather_mirrored`].
#[inline(never)]
fn gather_column(
    column: &mut DecodeColumn,
    backlogs: &RowBacklogs,
    saved: &mut Vec<(u32, u64)>,
    request_blocks: u64,
    den: u64,
) -> Option<Gathered> {
    if !column.exact() || request_blocks >= COLUMN_LIMIT {
        return None;
    }
    let any_fresh = column.fresh() > 0;
    let (keys, narrow) = column.keys_mut();
    // The backlogged rows leave the dense passes (their cost is not their key)...
    saved.clear();
    for &row in backlogs.rows() {
        if let Some(key) = keys.get_mut(row as usize)
            && *key != DecodeColumn::NONE
        {
            saved.push((row, *key));
            *key = DecodeColumn::NONE;
        }
    }
    set_aside(narrow, saved);
    let dense = lowest_key(keys, narrow);
    // ...and come back before anything returns.
    put_back(keys, narrow, saved);
    let mut free = match dense {
        None => Lowest::default(),
        Some((key, _, _)) if key >= COLUMN_LIMIT => return None,
        Some((key, ties, first)) => Lowest {
            num: key + request_blocks,
            den,
            ties,
            first,
        },
    };
    let mut stalled = Lowest::default();
    for &(row, key) in saved.iter() {
        let backlog = backlogs.get(row as usize);
        let cost = Cost {
            num: key
                .saturating_add(request_blocks)
                .saturating_add(backlog.decode_blocks),
            den,
        };
        let tier = if backlog.stalled {
            &mut stalled
        } else {
            &mut free
        };
        tier.add_unordered(row as usize, cost);
    }
    Some(Gathered {
        tally: Tally {
            any_fresh,
            free: free.best(),
            stalled: stalled.best(),
        },
        candidates: keys.len(),
    })
}

/// The lowest key other than [`DecodeColumn::NONE`], how many rows hold it and the first of
/// them: a branch-free minimum, then a count from the first row holding it. Over the narrowed
/// keys (half the bytes) when their minimum is below `u32::MAX`, which then is the lowest key
/// and held by exactly the rows whose narrowed key it is; else over the keys themselves.
#[inline(always)]
fn lowest_key(keys: &[u64], narrow: &[u32]) -> Option<(u64, usize, usize)> {
    if narrow.len() == keys.len() {
        let lowest = narrow.iter().fold(u32::MAX, |m, &k| m.min(k));
        if lowest != u32::MAX {
            let first = narrow.iter().position(|&k| k == lowest)?;
            return Some((
                u64::from(lowest),
                count_key(&narrow[first..], lowest),
                first,
            ));
        }
    }
    let lowest = keys.iter().fold(DecodeColumn::NONE, |m, &k| m.min(k));
    if lowest == DecodeColumn::NONE {
        return None;
    }
    let first = keys.iter().position(|&k| k == lowest)?;
    Some((lowest, count_key(&keys[first..], lowest), first))
}

/// Sets the narrowed keys of the `saved` rows to "no cost" (their keys already are).
fn set_aside(narrow: &mut [u32], saved: &[(u32, u64)]) {
    for &(row, _) in saved {
        if let Some(k) = narrow.get_mut(row as usize) {
            *k = u32::MAX;
        }
    }
}

/// Puts the `saved` rows' keys (and narrowed keys) back.
fn put_back(keys: &mut [u64], narrow: &mut [u32], saved: &[(u32, u64)]) {
    for &(row, key) in saved {
        if let Some(k) = keys.get_mut(row as usize) {
            *k = key;
        }
        if let Some(k) = narrow.get_mut(row as usize) {
            *k = DecodeColumn::narrowed(key);
        }
    }
}

/// What choosing after a column gather settles before counting ties off the column: `Err` the
/// answer (no candidate, a rotation, or the lowest tier's first row); `Ok` the tier (`stalled`),
/// its lowest and which of its ties (from 1) is wanted. The cursor advances once per candidate
/// set, as in every pass.
fn column_start(
    gathered: &Gathered,
    advance: &mut impl FnMut() -> u64,
) -> Result<(bool, Best, usize), Option<(usize, SelectionReason)>> {
    if gathered.candidates == 0 {
        return Err(None);
    }
    let cursor = advance();
    let tally = &gathered.tally;
    let rotated = |reason| Err(Some((nth(gathered.candidates, cursor), reason)));
    if !tally.any_fresh {
        return rotated(SelectionReason::RoundRobinStale);
    }
    let (stalled, best) = match (tally.free, tally.stalled) {
        (Some(best), _) => (false, best),
        (None, Some(best)) => (true, best),
        (None, None) => return rotated(SelectionReason::RoundRobin),
    };
    match nth(best.ties, cursor) {
        0 => Err(Some((best.first, SelectionReason::Load))),
        wanted => Ok((stalled, best, wanted)),
    }
}

/// What [`RowPass::choose`] chooses after [`gather_column`] gathered (every row a candidate,
/// with load signals): a rotation is the cursor's row itself, and a tie past the first is
/// counted off the column ([`column_tie`]) instead of re-scoring the rows.
#[inline(never)]
fn choose_column(
    column: &mut DecodeColumn,
    saved: &mut [(u32, u64)],
    backlogs: &RowBacklogs,
    request_blocks: u64,
    gathered: &Gathered,
    advance: &mut impl FnMut() -> u64,
) -> Option<(usize, SelectionReason)> {
    let (stalled, best, wanted) = match column_start(gathered, advance) {
        Ok(tie) => tie,
        Err(settled) => return settled,
    };
    column_tie(
        column,
        saved,
        backlogs,
        request_blocks,
        stalled,
        best.cost,
        wanted,
    )
    .map(|row| (row, SelectionReason::Load))
}

/// The `wanted`-th row (from 0, in row order) costing `cost` in the tier `stalled`, after
/// [`gather_column`] (which set aside the `saved` backlogged rows): the rows without a backlog
/// tie when their key plus the request's blocks is the cost (free tier only), counted 64 keys
/// at a time; the backlogged rows tie by their key, backlog and tier, merged in row order.
fn column_tie(
    column: &mut DecodeColumn,
    saved: &mut [(u32, u64)],
    backlogs: &RowBacklogs,
    request_blocks: u64,
    stalled: bool,
    cost: Cost,
    wanted: usize,
) -> Option<usize> {
    saved.sort_unstable_by_key(|&(row, _)| row);
    // Rows without a backlog are free: in the stalled tier only backlogged rows tie. A target
    // equal to `NONE` would match the rows set aside; `gather_column` keeps keys below it.
    let target = (!stalled)
        .then(|| cost.num.checked_sub(request_blocks))
        .flatten()
        .filter(|&t| t != DecodeColumn::NONE);
    let (keys, narrow) = column.keys_mut();
    for &(row, _) in saved.iter() {
        if let Some(key) = keys.get_mut(row as usize) {
            *key = DecodeColumn::NONE;
        }
    }
    set_aside(narrow, saved);
    // A target below `u32::MAX` is counted off the narrowed keys (the rows holding it are the
    // rows whose narrowed key it is), a larger one off the keys.
    let narrowed = target
        .and_then(|t| u32::try_from(t).ok())
        .filter(|&t| t != u32::MAX && narrow.len() == keys.len());
    let count_in = |from: usize, to: usize| match (narrowed, target) {
        (Some(t), _) => count_key(narrow.get(from..to).unwrap_or_default(), t),
        (None, Some(t)) => count_key(keys.get(from..to).unwrap_or_default(), t),
        (None, None) => 0,
    };
    let nth_in = |from: usize, to: usize, n: usize| {
        match (narrowed, target) {
            (Some(t), _) => nth_key(narrow.get(from..to).unwrap_or_default(), t, n),
            (None, Some(t)) => nth_key(keys.get(from..to).unwrap_or_default(), t, n),
            (None, None) => None,
        }
        .map(|i| from + i)
    };
    let found = (|| {
        let mut remaining = wanted;
        let mut from = 0;
        for &(row, key) in saved.iter() {
            let backlog = backlogs.get(row as usize);
            let ties = backlog.stalled == stalled
                && key
                    .saturating_add(request_blocks)
                    .saturating_add(backlog.decode_blocks)
                    == cost.num;
            if !ties {
                continue;
            }
            let row = row as usize;
            let between = count_in(from, row);
            if remaining < between {
                return nth_in(from, row, remaining);
            }
            remaining -= between;
            if remaining == 0 {
                return Some(row);
            }
            remaining -= 1;
            from = row + 1;
        }
        nth_in(from, keys.len(), remaining)
    })();
    put_back(keys, narrow, saved);
    found
}

/// How many of `keys` are `target` (branch-free, so the compiler vectorises it).
#[inline(always)]
fn count_key<K: Copy + PartialEq>(keys: &[K], target: K) -> usize {
    keys.iter().map(|&k| usize::from(k == target)).sum()
}

/// The position of the `n`-th (from 0) key equal to `target`: whole blocks of 64 keys counted
/// and skipped, then one block walked.
fn nth_key<K: Copy + PartialEq>(keys: &[K], target: K, mut n: usize) -> Option<usize> {
    const BLOCK: usize = 64;
    for (b, block) in keys.chunks(BLOCK).enumerate() {
        let count = count_key(block, target);
        if n < count {
            return block
                .iter()
                .enumerate()
                .filter(|&(_, &k)| k == target)
                .nth(n)
                .map(|(i, _)| b * BLOCK + i);
        }
        n -= count;
    }
    None
}

/// The two tiers [`gather_mirrored`] tallies, and where it reads a row's ledger backlog; with
/// peer slots, the free tier's lowest kept (`near`), the cut they set and the bits of every
/// numerator and capacity compared (`wide`).
struct Tallies<'b> {
    free: Lowest,
    stalled: Lowest,
    backlogs: &'b RowBacklogs,
    near: Option<&'b mut Nearest<Cost>>,
    cut: Cut,
    wide: u64,
}

impl Tallies<'_> {
    /// Tallies row `row`, whose cost without its ledger backlog is `num / den`, with its
    /// backlog (if its row holds one this pick).
    #[inline(never)]
    fn offer(&mut self, row: usize, num: u64, den: u64) {
        let backlog = self.backlogs.get(row);
        let cost = Cost {
            num: num.saturating_add(backlog.decode_blocks),
            den,
        };
        if backlog.stalled {
            self.stalled.add(row, cost);
            return;
        }
        self.free.add(row, cost);
        let Some(near) = self.near.as_deref_mut() else {
            return;
        };
        self.wide |= cost.num;
        near.offer(cost.as_f64(), u32::try_from(row).unwrap_or(u32::MAX), cost);
        if let Some((_, last)) = near.full_last() {
            self.cut = Cut {
                on: true,
                num: last.num,
                den: last.den,
            };
        }
    }
}

/// The decode score of a rank from its mirrored sample (the production path): what
/// [`score_backlog`] gives for [`Phase::Decode`], read from 16 + 32 bytes.
#[inline(always)]
fn mirrored_decode(
    row: Row,
    sample: &RowSample,
    oldest: u64,
    backlog: RankBacklog,
    size: &mut RequestSize,
) -> Scored {
    let (base, fresh_field) = sample.decode_base(oldest);
    let cost = match base {
        Some(base) if row.block_size > 0 && row.total_kv_blocks > 0 => Some(Cost {
            num: base
                .saturating_add(backlog.decode_blocks)
                .saturating_add(size.blocks(row.block_size)),
            den: row.total_kv_blocks,
        }),
        _ => None,
    };
    Scored {
        cost,
        fresh_field,
        stalled: backlog.stalled,
    }
}

impl DynamoWorkerPicker for LoadBasedPicker {
    fn name(&self) -> &'static str {
        "load_based"
    }

    fn pick(&self, ctx: &mut PickContext<'_>) -> PickOutcome {
        let req = ctx.request;
        let candidates = ctx.candidates;
        let now = ctx.now;
        let PickerState {
            ledger,
            cursors,
            scratch,
            slots: slot_cache,
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
            kv: _,
            saved,
            tied,
            tie_set,
            peers,
            nearest,
        } = scratch;
        peers.iter_mut().for_each(Vec::clear);
        let dense: &DenseRanks = match ctx.dense {
            Some(dense) if dense.len() == candidates.len() => dense,
            _ => {
                own_dense.rebuild(candidates);
                &*own_dense
            }
        };
        // At most 16 namespaces can be configured; positions past u16 range are ignored.
        let namespaces = &req.eligible_namespaces
            [..req.eligible_namespaces.len().min(usize::from(NOT_ELIGIBLE))];
        dense.eligibility(req.model, namespaces, eligible);
        if !plan_decode(dense, eligible, namespaces.len(), roles, table) {
            return PickOutcome::NoCandidates(NoCandidates::NoWorkerForModel);
        }

        let resolved = NamespaceLedgers::resolve(ledger, namespaces, req.load_signals);
        let ledgers = resolved.as_slice();
        // Samples mirrored per row when the view is the store (slots resolved once per layout
        // and slot epoch, rows re-read when written), else through the view.
        let (samples, mut column) =
            Samples::new(req.load_signals, ctx.load, candidates, dense, slot_cache);
        // On the store's path, the rows' backlogs kept for the layout are caught up first.
        let backlogs = Backlogs::new(
            ledgers,
            ledger,
            matches!(samples, Samples::Mirror { .. }),
            dense,
            row_backlogs,
            now,
        );
        let tokens = req.estimated_prompt_tokens;
        let mut size = RequestSize::new(tokens);

        // Decode: one pass scoring every decode candidate into a tally; a rotation or a tie past
        // the first re-walks the rows. The pass is instantiated per way of reading samples and
        // backlogs. With peer slots on the production path, the fast pass keeps the slots'
        // candidates; with the seeded draw (or where that pass cannot answer), the generic
        // pass (complete tally) and one re-walk.
        let draw = tie.draw(place);
        let slotted = match (draw, samples, backlogs, dense.uniform_block_size) {
            (
                Some(
                    draw @ TieDraw {
                        place: Some(place), ..
                    },
                ),
                Samples::Mirror {
                    rows: mirror,
                    oldest,
                },
                Backlogs::Empty | Backlogs::ByRow(_),
                Some(block_size),
            ) => decide_slots(
                dense,
                (block_size, tokens),
                (mirror, oldest),
                table,
                match backlogs {
                    Backlogs::ByRow(rows) => rows,
                    _ => row_backlogs_empty(),
                },
                (draw, place),
                (nearest, tie_set, &mut peers[Phase::Decode.index()]),
                column.as_deref_mut().map(|c| (c, &mut *saved)),
                &mut || cursors.advance(req.model, Phase::Decode),
            ),
            _ => None,
        };
        let decode = if slotted.is_some() {
            slotted
        } else if let Some(draw) = draw {
            let mut pass = RowPass {
                rows: &dense.rows,
                table,
                score: |i, ns, _| {
                    score_at(
                        Phase::Decode,
                        dense,
                        i,
                        samples,
                        backlogs,
                        ns,
                        &mut size,
                        now,
                    )
                },
            };
            let gathered = pass.gather();
            if gathered.candidates == 0 {
                None
            } else {
                let cursor = cursors.advance(req.model, Phase::Decode);
                let weight = |row| request_weight(Phase::Decode, dense, row, tokens);
                let out = (&mut *tie_set, &mut peers[Phase::Decode.index()]);
                pass.choose_tied(&gathered, req.load_signals, cursor, draw, weight, tied, out)
            }
        } else {
            let mut advance = || cursors.advance(req.model, Phase::Decode);
            let rows = &dense.rows[..];
            let table = &table[..];
            match (samples, backlogs) {
                (Samples::Off, _) => decide(
                    RowPass {
                        rows,
                        table,
                        score: |_, _, _| Scored::UNSCORED,
                    },
                    None,
                    false,
                    &mut advance,
                ),
                (
                    Samples::Mirror {
                        rows: mirror,
                        oldest,
                    },
                    Backlogs::Empty,
                ) if let Some(block_size) = dense.uniform_block_size => decide_mirrored(
                    RowPass {
                        rows,
                        table,
                        score: |i, _, row| match mirror.get(i) {
                            Some(s) => {
                                mirrored_decode(row, s, oldest, RankBacklog::default(), &mut size)
                            }
                            None => Scored::UNSCORED,
                        },
                    },
                    dense,
                    block_size,
                    mirror,
                    row_backlogs_empty(),
                    oldest,
                    tokens,
                    column.map(|c| (c, saved)),
                    &mut advance,
                ),
                (
                    Samples::Mirror {
                        rows: mirror,
                        oldest,
                    },
                    Backlogs::ByRow(by_row),
                ) if let Some(block_size) = dense.uniform_block_size => decide_mirrored(
                    RowPass {
                        rows,
                        table,
                        score: |i, _, row| match mirror.get(i) {
                            Some(s) => mirrored_decode(row, s, oldest, by_row.get(i), &mut size),
                            None => Scored::UNSCORED,
                        },
                    },
                    dense,
                    block_size,
                    mirror,
                    by_row,
                    oldest,
                    tokens,
                    column.map(|c| (c, saved)),
                    &mut advance,
                ),
                _ => decide(
                    RowPass {
                        rows,
                        table,
                        score: |i, ns, _| {
                            score_at(
                                Phase::Decode,
                                dense,
                                i,
                                samples,
                                backlogs,
                                ns,
                                &mut size,
                                now,
                            )
                        },
                    },
                    None,
                    req.load_signals,
                    &mut advance,
                ),
            }
        };
        let Some((won, decode_reason)) = decode else {
            return PickOutcome::NoCandidates(NoCandidates::NoDecodeWorker);
        };
        let (Some(decode), Some(row)) = (candidates.get(won), dense.rows.get(won)) else {
            return PickOutcome::NoCandidates(NoCandidates::NoDecodeWorker);
        };
        let decode_ns = table
            .get(row.group_role as usize)
            .copied()
            .unwrap_or(NOT_ELIGIBLE);

        // Then prefill within the decode winner's namespace, for a decode worker only.
        let mut prefill: Option<&Candidate> = None;
        let mut prefill_reason = SelectionReason::NoPrefillPool;
        let has_prefill = roles
            .get(usize::from(decode_ns))
            .is_some_and(|&r| r & role_bit(CandidateRole::Prefill) != 0);
        if decode.role == CandidateRole::Decode && has_prefill {
            plan_prefill(dense, eligible, decode_ns, table);
            let mut pass = RowPass {
                rows: &dense.rows,
                table,
                score: |i, ns, _| {
                    score_at(
                        Phase::Prefill,
                        dense,
                        i,
                        samples,
                        backlogs,
                        ns,
                        &mut size,
                        now,
                    )
                },
            };
            let gathered = pass.gather();
            let cursor = cursors.advance(req.model, Phase::Prefill);
            let chosen = match tie.draw(place) {
                Some(draw) => {
                    let weight = |row| request_weight(Phase::Prefill, dense, row, tokens);
                    let out = (&mut *tie_set, &mut peers[Phase::Prefill.index()]);
                    pass.choose_tied(&gathered, req.load_signals, cursor, draw, weight, tied, out)
                }
                None => pass.choose(&gathered, req.load_signals, cursor),
            };
            if let Some((won, reason)) = chosen {
                prefill = candidates.get(won);
                prefill_reason = reason;
            }
        }

        let dispatch = req.load_signals.then(|| {
            record_peer_slots(ledger, candidates, peers, tokens, now);
            record_pair(ledger, prefill, decode, tokens, now)
        });

        PickOutcome::Picked(Pick {
            namespace: decode.worker.namespace.clone(),
            decode: Pinned::of(decode),
            prefill: prefill.map(Pinned::of),
            reasons: PickReasons {
                decode: decode_reason,
                prefill: prefill_reason,
            },
            dispatch,
        })
    }
}

/// Gathers one phase (or takes what `gathered` gathered the same way), advances its cursor
/// when it has candidates, and chooses.
#[inline(always)]
fn decide<F: FnMut(usize, usize, Row) -> Scored>(
    mut pass: RowPass<'_, F>,
    gathered: Option<Gathered>,
    load_signals: bool,
    advance: &mut impl FnMut() -> u64,
) -> Option<(usize, SelectionReason)> {
    let gathered = match gathered {
        Some(g) => g,
        None => pass.gather(),
    };
    if gathered.candidates == 0 {
        return None;
    }
    pass.choose(&gathered, load_signals, advance())
}

impl Scored {
    /// Rotation only: load signals are off.
    pub(super) const UNSCORED: Scored = Scored {
        cost: None,
        fresh_field: false,
        stalled: false,
    };
}

/// Scores rank `i` of the layout for `phase` (no lookups when load signals are off).
#[allow(clippy::too_many_arguments)]
#[inline]
pub(super) fn score_at(
    phase: Phase,
    dense: &DenseRanks,
    i: usize,
    samples: Samples<'_>,
    backlogs: Backlogs<'_>,
    ns: usize,
    size: &mut RequestSize,
    now: Tick,
) -> Scored {
    if let Samples::Off = samples {
        // Rotation only: skip the load lookups.
        return Scored::UNSCORED;
    }
    let backlog = backlogs.get(dense, i, ns, now);
    score_backlog(phase, Capacity::at(dense, i), samples.get(i), backlog, size)
}
/// Records one pick in the ledger: the prefill leg (if any) with the request's tokens, the decode
/// leg with its blocks; the decode half of a pair is stall-exempt (it receives the request only
/// after the prefill).
pub(crate) fn record_pair(
    ledger: &mut super::ledger::DispatchLedger,
    prefill: Option<&Candidate>,
    decode: &Candidate,
    tokens: u64,
    now: Tick,
) -> super::ledger::DispatchId {
    let blocks = blocks_of(tokens, decode.block_size);
    let decode_leg = DispatchLeg {
        worker: decode.worker.clone(),
        rank: decode.rank(),
        prefill_tokens: 0,
        decode_blocks: blocks,
        request_blocks: blocks,
        stall_exempt: prefill.is_some(),
    };
    // The legs on the stack: a pick allocates no list for them.
    match prefill {
        Some(p) => {
            let prefill_leg = DispatchLeg {
                worker: p.worker.clone(),
                rank: p.rank(),
                prefill_tokens: tokens,
                decode_blocks: 0,
                request_blocks: blocks_of(tokens, p.block_size),
                stall_exempt: false,
            };
            ledger.record_dispatch(&[prefill_leg, decode_leg], now)
        }
        None => ledger.record_dispatch(&[decode_leg], now),
    }
}

/// Records the slots this pick's peers take ([`take_slot`]; per phase, candidate indices in
/// `peers`) as peer legs of this request's weight: prompt tokens on a prefill slot, prompt
/// blocks on a decode slot. Nothing without peer slots.
pub(crate) fn record_peer_slots(
    ledger: &mut super::ledger::DispatchLedger,
    candidates: &[Candidate],
    peers: &[Vec<u32>; 2],
    tokens: u64,
    now: Tick,
) {
    if peers.iter().all(Vec::is_empty) {
        return;
    }
    let mut legs = Vec::with_capacity(peers.iter().map(Vec::len).sum());
    for phase in Phase::ALL {
        for c in peers[phase.index()]
            .iter()
            .filter_map(|&i| candidates.get(i as usize))
        {
            let blocks = blocks_of(tokens, c.block_size);
            legs.push(DispatchLeg {
                worker: c.worker.clone(),
                rank: c.rank(),
                prefill_tokens: if phase == Phase::Prefill { tokens } else { 0 },
                decode_blocks: if phase == Phase::Decode { blocks } else { 0 },
                request_blocks: blocks,
                stall_exempt: true,
            });
        }
    }
    ledger.record_peer_slots(&legs, now);
}

pub(crate) fn blocks_of(tokens: u64, block_size: Option<u32>) -> u64 {
    block_size
        .filter(|&b| b > 0)
        .map_or(0, |b| tokens.div_ceil(u64::from(b)))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::{count_key, nth_key};

    proptest! {
        /// Counting a key off 64 at a time finds what a walk over every key finds, across
        /// block edges.
        #[test]
        fn the_nth_key_is_the_walks_nth(
            keys in proptest::collection::vec(0u64..4, 0..300),
            target in 0u64..4,
            n in 0usize..200,
        ) {
            let walked = keys.iter().enumerate().filter(|&(_, &k)| k == target).nth(n).map(|(i, _)| i);
            prop_assert_eq!(nth_key(&keys, target, n), walked);
            prop_assert_eq!(count_key(&keys, target), keys.iter().filter(|&&k| k == target).count());
        }
    }
}
