//! The KV-aware pick as it read candidates before the dense pass (each rank's `Candidate`,
//! its sample through the `LoadView`, its ledger backlog and overlap looked up per rank), kept
//! as the reference the production pick must equal exactly.

use super::super::*;
use crate::picker::ledger::{DispatchLedger, NamespaceBacklog};
use crate::picker::{CursorTable, LoadView};

#[derive(Clone, Copy)]
struct Matched {
    index: usize,
    namespace: usize,
}

#[derive(Clone, Copy, Default)]
struct Roles {
    prefill: bool,
    decode: bool,
}

struct Ctx<'r> {
    req: &'r PickRequest<'r>,
    kv: &'r KvPickInput<'r>,
    candidates: &'r [Candidate],
    load: &'r dyn LoadView,
    ledger: &'r DispatchLedger,
    now: Tick,
}

impl Ctx<'_> {
    fn sample(&self, index: usize) -> SampleState {
        if !self.req.load_signals {
            return SampleState::Never;
        }
        let c = &self.candidates[index];
        self.load.sample(&c.worker, c.rank())
    }

    fn ledger(&self, ns: usize) -> Option<NamespaceBacklog<'_>> {
        if !self.req.load_signals || self.ledger.is_empty() {
            return None;
        }
        self.ledger.namespace(&self.req.eligible_namespaces[ns])
    }

    fn overlap_of(&self, c: &Candidate) -> u64 {
        block_size_of(c).map_or(0, |bs| {
            self.kv
                .overlaps
                .iter()
                .find(|o| o.block_size == bs)
                .map_or(0, |o| o.of(c.worker.instance_id, c.rank()))
        })
    }
}

/// The reference picker: the same parameters, its own cursors and ledger.
pub(super) struct ReferenceKv {
    pub params: KvPickParams,
    pub ledger: DispatchLedger,
    cursors: CursorTable,
}

impl ReferenceKv {
    pub fn new(params: KvPickParams) -> Self {
        Self {
            params,
            ledger: DispatchLedger::new(),
            cursors: CursorTable::default(),
        }
    }

    fn rank(&self, ctx: &Ctx<'_>, m: Matched, scoring: Scoring) -> KvRank {
        let c = &ctx.candidates[m.index];
        let sample = ctx.sample(m.index);
        let backlog = ctx
            .ledger(m.namespace)
            .map(|l| l.backlog(c.worker.instance_id, c.rank(), ctx.now))
            .unwrap_or_default();
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
            SampleState::Never
            | SampleState::Stale {
                last_had_backlog: false,
            } => Some((0, 0)),
            SampleState::Stale {
                last_had_backlog: true,
            } => None,
        };
        KvRank {
            block_size: block_size_of(c),
            overlap: ctx.overlap_of(c),
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

    fn select_kv(
        &self,
        ctx: &Ctx<'_>,
        ranks: &[KvRank],
        scoring: Scoring,
        cursor: u64,
    ) -> Option<(usize, SelectionReason)> {
        let isl = ctx.kv.isl;
        let any_fresh = ctx.req.load_signals && ranks.iter().any(|r| r.fresh_field);
        let mut positions = Vec::new();
        let mut costs = Vec::new();
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
            softmax_sample_index(&costs, temperature, ctx.kv.unit)?
        } else {
            argmin_with_cursor(&costs, cursor)?
        };
        let reason = if any_fresh || temperature > 0.0 {
            SelectionReason::KvAware
        } else {
            let min = costs[chosen];
            let ties = costs.iter().filter(|c| **c == min).count();
            match (ties > 1, ctx.req.load_signals) {
                (false, _) => SelectionReason::KvAware,
                (true, true) => SelectionReason::RoundRobinStale,
                (true, false) => SelectionReason::RoundRobin,
            }
        };
        Some((positions[chosen], reason))
    }

    fn select_load(
        ctx: &Ctx<'_>,
        members: &[Matched],
        phase: Phase,
        cursor: u64,
    ) -> Option<(usize, SelectionReason)> {
        let mut size = RequestSize::new(ctx.kv.isl);
        let scored: Vec<Scored> = members
            .iter()
            .map(|m| {
                let c = &ctx.candidates[m.index];
                if !ctx.req.load_signals {
                    return Scored::UNSCORED;
                }
                load_based::score(
                    phase,
                    c,
                    ctx.sample(m.index),
                    ctx.ledger(m.namespace),
                    &mut size,
                    ctx.now,
                )
            })
            .collect();
        load_based::select(&scored, ctx.req.load_signals, cursor)
    }

    fn choose(
        &self,
        ctx: &Ctx<'_>,
        members: &[Matched],
        scoring: Option<Scoring>,
        phase: Phase,
        cursor: u64,
    ) -> Option<(Matched, SelectionReason)> {
        if let Some(scoring) = scoring {
            let ranks: Vec<KvRank> = members
                .iter()
                .map(|m| self.rank(ctx, *m, scoring))
                .collect();
            if let Some((pos, reason)) = self.select_kv(ctx, &ranks, scoring, cursor) {
                return Some((members[pos], reason));
            }
        }
        let (pos, reason) = Self::select_load(ctx, members, phase, cursor)?;
        members.get(pos).map(|m| (*m, reason))
    }

    pub fn pick(
        &mut self,
        req: &PickRequest<'_>,
        candidates: &[Candidate],
        load: &dyn LoadView,
        kv: &KvPickInput<'_>,
        now: Tick,
    ) -> KvPickOutcome {
        self.ledger.expire(now);
        let namespaces = req.eligible_namespaces;
        let mut matched: Vec<Matched> = Vec::new();
        let mut roles = vec![Roles::default(); namespaces.len()];
        for (index, c) in candidates.iter().enumerate() {
            if *c.model != *req.model {
                continue;
            }
            let Some(namespace) = namespaces.iter().position(|n| *n == c.worker.namespace) else {
                continue;
            };
            match c.role {
                CandidateRole::Prefill => roles[namespace].prefill = true,
                CandidateRole::Decode => roles[namespace].decode = true,
                CandidateRole::Aggregated => {}
            }
            matched.push(Matched { index, namespace });
        }
        if matched.is_empty() {
            return KvPickOutcome {
                outcome: PickOutcome::NoCandidates(NoCandidates::NoWorkerForModel),
                kv: None,
            };
        }
        let paired = |ns: usize| roles[ns].prefill && roles[ns].decode;
        let decode_pool: Vec<Matched> = matched
            .iter()
            .copied()
            .filter(|m| match candidates[m.index].role {
                CandidateRole::Prefill => false,
                CandidateRole::Decode => true,
                CandidateRole::Aggregated => !paired(m.namespace),
            })
            .collect();
        if decode_pool.is_empty() {
            return KvPickOutcome {
                outcome: PickOutcome::NoCandidates(NoCandidates::NoDecodeWorker),
                kv: None,
            };
        }
        let pair_fleet = decode_pool.iter().any(|m| paired(m.namespace));
        let conditional = pair_fleet && self.params.conditional_disaggregation.enabled;
        let decode_scoring = if !pair_fleet {
            Some(Scoring::Aggregated)
        } else if conditional {
            Some(Scoring::ConditionalDecode)
        } else {
            None
        };
        let ledger = std::mem::take(&mut self.ledger);
        let ctx = Ctx {
            req,
            kv,
            candidates,
            load,
            ledger: &ledger,
            now,
        };
        // Pair fleets: prefill across the paired namespaces first, decode within the winner's.
        let prefill_first = if pair_fleet {
            let members: Vec<Matched> = matched
                .iter()
                .copied()
                .filter(|m| {
                    paired(m.namespace) && candidates[m.index].role == CandidateRole::Prefill
                })
                .collect();
            let cursor = self.cursors.advance(req.model, Phase::Prefill);
            self.choose(
                &ctx,
                &members,
                Some(Scoring::Prefill),
                Phase::Prefill,
                cursor,
            )
        } else {
            None
        };
        let decode_pool: Vec<Matched> = match prefill_first {
            Some((p, _)) => decode_pool
                .into_iter()
                .filter(|m| m.namespace == p.namespace)
                .collect(),
            None => decode_pool,
        };
        let cursor = self.cursors.advance(req.model, Phase::Decode);
        let Some((won, decode_reason)) =
            self.choose(&ctx, &decode_pool, decode_scoring, Phase::Decode, cursor)
        else {
            self.ledger = ledger;
            return KvPickOutcome {
                outcome: PickOutcome::NoCandidates(NoCandidates::NoDecodeWorker),
                kv: None,
            };
        };
        let decode = &candidates[won.index];
        let mut prefill: Option<&Candidate> = None;
        let mut prefill_reason = SelectionReason::NoPrefillPool;
        let mut bypass = false;
        if let Some((p, reason)) = prefill_first
            && decode.role == CandidateRole::Decode
        {
            let p = &candidates[p.index];
            let ledger_decode = ctx
                .ledger(won.namespace)
                .map(|l| l.backlog(decode.worker.instance_id, decode.rank(), now))
                .unwrap_or_default()
                .decode_blocks;
            let picker = KvAwarePicker::new(self.params);
            bypass = conditional
                && picker.bypasses(
                    decode,
                    ctx.overlap_of(decode),
                    ctx.overlap_of(p),
                    ctx.sample(won.index),
                    ledger_decode,
                    kv.isl,
                );
            if bypass {
                prefill_reason = SelectionReason::ConditionalBypass;
            } else {
                prefill = Some(p);
                prefill_reason = reason;
            }
        }
        let result = if bypass {
            KvSelectionResult::Bypass
        } else if ctx.overlap_of(prefill.unwrap_or(decode)) > 0 {
            KvSelectionResult::Overlap
        } else {
            KvSelectionResult::NoOverlap
        };
        self.ledger = ledger;
        let tokens = kv.isl;
        let dispatch = req
            .load_signals
            .then(|| load_based::record_pair(&mut self.ledger, prefill, decode, tokens, now));
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
