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

use super::ledger::{DispatchLeg, NamespaceBacklog};
use super::{
    Candidate, CandidateRole, DynamoWorkerPicker, LoadView, NoCandidates, Phase, Pick, PickOutcome,
    PickReasons, PickRequest, PickerState, Pinned, SampleState, SelectionReason,
};
use crate::time::Tick;

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
    fn cmp(&self, other: &Self) -> Ordering {
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
    let backlog = ledger
        .map(|l| l.backlog(candidate.worker.instance_id, candidate.rank(), now))
        .unwrap_or_default();
    let cost = base.and_then(|base| match phase {
        Phase::Prefill => {
            let den = candidate.max_num_batched_tokens.filter(|&d| d > 0)?;
            Some(Cost {
                num: base.saturating_add(backlog.prefill_tokens),
                den,
            })
        }
        Phase::Decode => {
            let block_size = candidate.block_size.filter(|&b| b > 0)?;
            let den = candidate.total_kv_blocks.filter(|&d| d > 0)?;
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
const INLINE_NAMESPACES: usize = 16;

/// A candidate that serves the model in an eligible namespace.
#[derive(Clone, Copy, Debug)]
struct Matched {
    index: u32,
    namespace: u16,
}

#[derive(Clone, Copy, Debug, Default)]
struct Roles {
    prefill: bool,
    decode: bool,
    aggregated: bool,
}

/// Buffers reused across picks.
#[derive(Debug, Default)]
pub(super) struct Scratch {
    /// Prefill ranks serving the model in an eligible namespace.
    matched: Vec<Matched>,
    roles: Vec<Roles>,
    positions: Vec<Matched>,
    scored: Vec<Scored>,
}

/// The default picker. Stateless: everything it mutates lives in [`PickerState`].
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadBasedPicker;

impl LoadBasedPicker {
    pub fn new() -> Self {
        Self
    }
}

impl DynamoWorkerPicker for LoadBasedPicker {
    fn name(&self) -> &'static str {
        "load_based"
    }

    fn pick(
        &self,
        req: &PickRequest<'_>,
        candidates: &[Candidate],
        load: &dyn LoadView,
        state: &mut PickerState,
        now: Tick,
    ) -> PickOutcome {
        let PickerState {
            ledger,
            cursors,
            scratch,
        } = state;
        ledger.expire(now);
        let Scratch {
            matched,
            roles,
            positions,
            scored,
        } = scratch;
        matched.clear();
        roles.clear();
        // More than u16::MAX namespaces cannot be configured (at most 16); ignore any beyond.
        let namespaces = &req.eligible_namespaces[..req.eligible_namespaces.len().min(1 << 15)];
        roles.resize(namespaces.len(), Roles::default());

        // The ledger per eligible namespace, resolved once so each rank hashes only its id. At
        // most 16 namespaces can be configured: those fit on the stack.
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
        let tokens = req.estimated_prompt_tokens;
        let mut size = RequestSize::new(tokens);

        // One pass over the candidates (the fat, cache-unfriendly input): those serving the model
        // in an eligible namespace, each namespace's roles, and a decode score for every decode
        // and aggregated rank. Prefill ranks are only remembered; they are scored in the winner's
        // namespace alone. Candidates usually come grouped by namespace, so the previous one's
        // namespace is tried first.
        positions.clear();
        scored.clear();
        let mut any_served = false;
        let mut decode_tally = Tally::default();
        let mut last_ns: Option<usize> = None;
        // (address, length) of a candidate model already found equal to the request's.
        let mut known_model: (*const u8, usize) = (std::ptr::null(), 0);
        for (index, c) in candidates.iter().enumerate() {
            let model = (c.model.as_ptr(), c.model.len());
            if model != known_model {
                if !str_eq(&c.model, req.model) {
                    continue;
                }
                known_model = model;
            }
            let ns = match last_ns {
                Some(ns) if str_eq(namespaces[ns].as_str(), c.worker.namespace.as_str()) => ns,
                _ => match namespaces.iter().position(|n| *n == c.worker.namespace) {
                    Some(ns) => ns,
                    None => continue,
                },
            };
            last_ns = Some(ns);
            any_served = true;
            let Ok(index) = u32::try_from(index) else {
                break;
            };
            let m = Matched {
                index,
                namespace: ns as u16,
            };
            match c.role {
                CandidateRole::Prefill => {
                    roles[ns].prefill = true;
                    matched.push(m);
                    continue;
                }
                CandidateRole::Decode => roles[ns].decode = true,
                CandidateRole::Aggregated => roles[ns].aggregated = true,
            }
            let s = score_one(Phase::Decode, c, req, load, ledgers, ns, &mut size, now);
            decode_tally.add(scored.len(), &s);
            positions.push(m);
            scored.push(s);
        }
        if !any_served {
            return PickOutcome::NoCandidates(NoCandidates::NoWorkerForModel);
        }
        // Dynamo serves no prefill+aggregated pair: beside a prefill/decode pool, aggregated
        // workers sit out.
        if roles.iter().any(|r| r.prefill && r.decode && r.aggregated) {
            let mut kept = 0;
            for i in 0..positions.len() {
                let m = positions[i];
                let r = roles[usize::from(m.namespace)];
                let sits_out = r.prefill
                    && r.decode
                    && candidates[m.index as usize].role == CandidateRole::Aggregated;
                if !sits_out {
                    positions[kept] = m;
                    scored[kept] = scored[i];
                    kept += 1;
                }
            }
            if kept < positions.len() {
                positions.truncate(kept);
                scored.truncate(kept);
                decode_tally = Tally::default();
                for (pos, s) in scored.iter().enumerate() {
                    decode_tally.add(pos, s);
                }
            }
        }
        if positions.is_empty() {
            return PickOutcome::NoCandidates(NoCandidates::NoDecodeWorker);
        }
        let cursor = cursors.advance(req.model, Phase::Decode);
        let Some((pos, decode_reason)) =
            select_tallied(scored, &decode_tally, req.load_signals, cursor)
        else {
            return PickOutcome::NoCandidates(NoCandidates::NoDecodeWorker);
        };
        let Some(&won) = positions.get(pos) else {
            return PickOutcome::NoCandidates(NoCandidates::NoDecodeWorker);
        };
        let decode = &candidates[won.index as usize];
        let decode_ns = usize::from(won.namespace);

        // Then prefill within the decode winner's namespace, for a decode worker only.
        let mut prefill: Option<&Candidate> = None;
        let mut prefill_reason = SelectionReason::NoPrefillPool;
        if decode.role == CandidateRole::Decode && roles[decode_ns].prefill {
            positions.clear();
            scored.clear();
            let mut prefill_tally = Tally::default();
            for m in matched.iter() {
                let c = &candidates[m.index as usize];
                if usize::from(m.namespace) != decode_ns || c.role != CandidateRole::Prefill {
                    continue;
                }
                let ns = usize::from(m.namespace);
                let s = score_one(Phase::Prefill, c, req, load, ledgers, ns, &mut size, now);
                prefill_tally.add(scored.len(), &s);
                positions.push(*m);
                scored.push(s);
            }
            let cursor = cursors.advance(req.model, Phase::Prefill);
            if let Some((pos, reason)) =
                select_tallied(scored, &prefill_tally, req.load_signals, cursor)
                && let Some(won) = positions.get(pos)
            {
                prefill = Some(&candidates[won.index as usize]);
                prefill_reason = reason;
            }
        }

        let dispatch = req
            .load_signals
            .then(|| record_pair(ledger, prefill, decode, tokens, now));

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

#[allow(clippy::too_many_arguments)]
fn score_one(
    phase: Phase,
    c: &Candidate,
    req: &PickRequest<'_>,
    load: &dyn LoadView,
    ledgers: &[Option<NamespaceBacklog<'_>>],
    ns: usize,
    size: &mut RequestSize,
    now: Tick,
) -> Scored {
    if !req.load_signals {
        // Rotation only: skip the load lookups.
        return Scored {
            cost: None,
            fresh_field: false,
            stalled: false,
        };
    }
    let sample = load.sample(&c.worker, c.rank());
    let ledger = ledgers.get(ns).copied().flatten();
    score(phase, c, sample, ledger, size, now)
}

/// String equality without a `memcmp` call for the short strings (namespaces, most model names)
/// compared once per candidate.
#[inline]
fn str_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let len = a.len();
    if len != b.len() {
        return false;
    }
    let word = |s: &[u8], at: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&s[at..at + 8]);
        u64::from_ne_bytes(w)
    };
    let half = |s: &[u8], at: usize| {
        let mut w = [0u8; 4];
        w.copy_from_slice(&s[at..at + 4]);
        u32::from_ne_bytes(w)
    };
    match len {
        // Two overlapping loads cover 4..=7 and 8..=16 bytes.
        8..=16 => word(a, 0) == word(b, 0) && word(a, len - 8) == word(b, len - 8),
        4..=7 => half(a, 0) == half(b, 0) && half(a, len - 4) == half(b, len - 4),
        0..=3 => a.iter().zip(b).all(|(x, y)| x == y),
        _ => a == b,
    }
}

/// The request's size in blocks of `block_size` (0 when the card declares none).
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
    let mut legs = Vec::with_capacity(2);
    if let Some(p) = prefill {
        legs.push(DispatchLeg {
            worker: p.worker.clone(),
            rank: p.rank(),
            prefill_tokens: tokens,
            decode_blocks: 0,
            request_blocks: blocks_of(tokens, p.block_size),
            stall_exempt: false,
        });
    }
    let blocks = blocks_of(tokens, decode.block_size);
    legs.push(DispatchLeg {
        worker: decode.worker.clone(),
        rank: decode.rank(),
        prefill_tokens: 0,
        decode_blocks: blocks,
        request_blocks: blocks,
        stall_exempt: prefill.is_some(),
    });
    ledger.record_dispatch(&legs, now)
}

pub(crate) fn blocks_of(tokens: u64, block_size: Option<u32>) -> u64 {
    block_size
        .filter(|&b| b > 0)
        .map_or(0, |b| tokens.div_ceil(u64::from(b)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn str_eq_matches_slice_equality_at_every_length() {
        let text = "namespace-prod-graph-0123456789";
        for len in 0..text.len() {
            let a = &text[..len];
            let same = a.to_owned();
            assert!(str_eq(a, &same), "{a:?}");
            for at in 0..len {
                let mut other = same.clone().into_bytes();
                other[at] ^= 1;
                let other = String::from_utf8(other).expect("ascii stays utf-8");
                assert!(!str_eq(a, &other), "{a:?} vs {other:?}");
            }
            assert!(!str_eq(a, &text[..len + 1]));
        }
    }
}
