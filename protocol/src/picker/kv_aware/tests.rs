//! Rule-by-rule tests of the KV-aware picker with hand-computed costs, a differential property
//! test against a naive transcription of the seed's formula, and structural properties over
//! random multi-namespace fleets.

use std::collections::HashMap;
use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::ids::Namespace;
use crate::kv::hashing::BlockSize;
use crate::picker::tests::{FakeLoad, key};

const MODEL: &str = "m";

/// Block size 16, 100 KV blocks, a prefill budget of 1,000 tokens.
fn cand(ns: &str, id: u64, role: CandidateRole) -> Candidate {
    Candidate {
        worker: key(ns, id),
        role,
        model: MODEL.into(),
        dp_rank: Some(DpRank(0)),
        rank_declared: true,
        block_size: Some(16),
        total_kv_blocks: Some(100),
        max_num_batched_tokens: Some(1000),
    }
}

fn agg(id: u64) -> Candidate {
    cand("ns", id, CandidateRole::Aggregated)
}
fn dec(id: u64) -> Candidate {
    cand("ns", id, CandidateRole::Decode)
}
fn pre(id: u64) -> Candidate {
    cand("ns", id, CandidateRole::Prefill)
}

fn fresh(decode: Option<u64>, prefill: Option<u64>) -> SampleState {
    SampleState::Fresh {
        active_decode_blocks: decode,
        active_prefill_tokens: prefill,
        kv_used_blocks: None,
    }
}

fn bs16() -> BlockSize {
    BlockSize::new(16).expect("valid")
}

/// Overlaps at block size 16, as `find_matches` would list them (sorted, zeros omitted).
fn overlaps(list: &[(u64, u32)]) -> Vec<BlockOverlaps> {
    let mut ranks: Vec<RankOverlap> = list
        .iter()
        .filter(|(_, b)| *b > 0)
        .map(|(id, blocks)| RankOverlap {
            worker: InstanceId(*id),
            dp_rank: DpRank(0),
            blocks: *blocks,
        })
        .collect();
    ranks.sort();
    vec![BlockOverlaps {
        block_size: bs16(),
        ranks,
    }]
}

fn now() -> Tick {
    Tick(Duration::from_secs(100))
}

struct Harness {
    namespaces: Vec<Namespace>,
    candidates: Vec<Candidate>,
    load: FakeLoad,
    state: PickerState,
    params: KvPickParams,
    isl: u64,
    overlaps: Vec<BlockOverlaps>,
    unit: f64,
    load_signals: bool,
}

impl Harness {
    fn new(candidates: Vec<Candidate>, load: FakeLoad, overlap: &[(u64, u32)]) -> Self {
        Self {
            namespaces: vec![Namespace::new("ns")],
            candidates,
            load,
            state: PickerState::new(),
            params: KvPickParams::default(),
            isl: 64,
            overlaps: overlaps(overlap),
            unit: 0.0,
            load_signals: true,
        }
    }

    fn run(&mut self, kv: Result<(), KvUnavailable>) -> KvPickOutcome {
        let req = PickRequest {
            model: MODEL,
            eligible_namespaces: &self.namespaces,
            estimated_prompt_tokens: self.isl,
            load_signals: self.load_signals,
        };
        let input = KvPickInput {
            isl: self.isl,
            overlaps: &self.overlaps,
            unit: self.unit,
        };
        let picker = KvAwarePicker::new(self.params);
        picker.pick_kv(
            &mut PickContext::new(&req, &self.candidates, &self.load, &mut self.state, now()),
            kv.map(|()| &input),
        )
    }

    fn pick(&mut self) -> (Pick, KvSelectionResult) {
        let out = self.run(Ok(()));
        match out.outcome {
            PickOutcome::Picked(pick) => (pick, out.kv.expect("a kv result")),
            PickOutcome::NoCandidates(why) => panic!("expected a pick, got {why:?}"),
        }
    }

    fn decode_id(&mut self) -> u64 {
        self.pick().0.decode.worker.instance_id.0
    }
}

fn ids(pick: &Pick) -> (u64, Option<u64>) {
    (
        pick.decode.worker.instance_id.0,
        pick.prefill.as_ref().map(|p| p.worker.instance_id.0),
    )
}

// ---- Aggregated fleets: the formula scores the decode candidates --------------------------

#[test]
fn quiet_aggregated_fleet_goes_where_the_prefix_is_cached() {
    let mut h = Harness::new(vec![agg(1), agg(2), agg(3)], FakeLoad::default(), &[(2, 3)]);
    for _ in 0..3 {
        let (pick, result) = h.pick();
        assert_eq!(ids(&pick), (2, None));
        assert_eq!(result, KvSelectionResult::Overlap);
        assert_eq!(pick.reasons.decode, SelectionReason::KvAware);
        assert_eq!(pick.reasons.prefill, SelectionReason::NoPrefillPool);
    }
}

#[test]
fn without_overlap_or_fresh_backlog_ties_rotate_as_round_robin_stale() {
    let mut h = Harness::new(vec![agg(1), agg(2), agg(3)], FakeLoad::default(), &[]);
    let mut seen = Vec::new();
    for _ in 0..3 {
        let (pick, result) = h.pick();
        assert_eq!(pick.reasons.decode, SelectionReason::RoundRobinStale);
        assert_eq!(result, KvSelectionResult::NoOverlap);
        seen.push(pick.decode.worker.instance_id.0);
    }
    assert_eq!(seen, vec![1, 2, 3]);
    // Without load signals the same rotation is `round_robin`, and nothing is recorded.
    h.load_signals = false;
    let (pick, _) = h.pick();
    assert_eq!(pick.reasons.decode, SelectionReason::RoundRobin);
    assert_eq!(pick.dispatch, None);
}

#[test]
fn hand_computed_full_formula_trades_overlap_against_load() {
    // isl 64 at bs 16 = 4 blocks, defaults (credit 1, scale 1).
    // A: 10 decode blocks, holds all 4: prefill max(0, 4 - 4) = 0, decode 10 + 0 -> 10.
    // B: 3 decode blocks, no overlap: prefill 4, decode 3 + 4 -> 11.  A wins despite its load.
    let load = FakeLoad::default()
        .with("ns", 1, fresh(Some(10), None))
        .with("ns", 2, fresh(Some(3), None));
    let mut h = Harness::new(vec![agg(1), agg(2)], load, &[(1, 4)]);
    let (pick, result) = h.pick();
    assert_eq!(ids(&pick), (1, None));
    assert_eq!(pick.reasons.decode, SelectionReason::KvAware);
    assert_eq!(result, KvSelectionResult::Overlap);

    // A at 13 blocks costs 13 > 11: B wins, and its prefill holds nothing.
    let load = FakeLoad::default()
        .with("ns", 1, fresh(Some(13), None))
        .with("ns", 2, fresh(Some(3), None));
    let mut h = Harness::new(vec![agg(1), agg(2)], load, &[(1, 4)]);
    let (pick, result) = h.pick();
    assert_eq!(ids(&pick), (2, None));
    assert_eq!(result, KvSelectionResult::NoOverlap);
}

#[test]
fn aggregated_prefill_tokens_add_when_a_sample_carries_them() {
    // A: 0 decode blocks, 160 prefill tokens: (160 + 64) / 16 = 14 blocks + 4 -> 18.
    // B: 5 decode blocks, no prefill field: 4 + 5 + 4 -> 13.  B wins.
    let load = FakeLoad::default()
        .with("ns", 1, fresh(Some(0), Some(160)))
        .with("ns", 2, fresh(Some(5), None));
    let mut h = Harness::new(vec![agg(1), agg(2)], load, &[]);
    assert_eq!(h.decode_id(), 2);
}

#[test]
fn kv_used_blocks_stand_in_for_nil_decode_blocks() {
    let vllm = |kv_used| SampleState::Fresh {
        active_decode_blocks: None,
        active_prefill_tokens: None,
        kv_used_blocks: Some(kv_used),
    };
    let load = FakeLoad::default()
        .with("ns", 1, vllm(50))
        .with("ns", 2, vllm(5));
    let mut h = Harness::new(vec![agg(1), agg(2)], load, &[]);
    let (pick, _) = h.pick();
    assert_eq!(ids(&pick), (2, None));
    assert_eq!(pick.reasons.decode, SelectionReason::KvAware);
}

#[test]
fn ranks_silent_under_load_sit_out_while_quiet_ranks_compete() {
    // A holds the prefix but went silent with a backlog; B is fresh and busy; C is quiet.
    // B: 4 + 20 + 4 = 28.  C (quiet, zero backlog): 4 + 0 + 4 = 8.  A sits out.
    let load = FakeLoad::default()
        .with(
            "ns",
            1,
            SampleState::Stale {
                last_had_backlog: true,
            },
        )
        .with("ns", 2, fresh(Some(20), None));
    let mut h = Harness::new(vec![agg(1), agg(2), agg(3)], load, &[(1, 4)]);
    assert_eq!(h.decode_id(), 3);
}

#[test]
fn stale_fleets_compete_on_overlap_and_size_only() {
    // Every sample aged out (one with a backlog): nobody has a fresh field, so overlap decides
    // even for the rank that was busy.
    let load = FakeLoad::default()
        .with(
            "ns",
            1,
            SampleState::Stale {
                last_had_backlog: true,
            },
        )
        .with(
            "ns",
            2,
            SampleState::Stale {
                last_had_backlog: false,
            },
        );
    let mut h = Harness::new(vec![agg(1), agg(2)], load, &[(1, 1)]);
    let (pick, result) = h.pick();
    assert_eq!(ids(&pick), (1, None));
    assert_eq!(pick.reasons.decode, SelectionReason::KvAware);
    assert_eq!(result, KvSelectionResult::Overlap);
}

#[test]
fn block_sizes_are_matched_per_candidate() {
    // B has block size 32: its overlap is read from the 32-token list. isl 64:
    // A (bs 16, 1 block held): 4 - 1 = 3.  B (bs 32, 2 blocks held): 2 - 2 = 0.
    let mut b = agg(2);
    b.block_size = Some(32);
    let mut h = Harness::new(vec![agg(1), b], FakeLoad::default(), &[(1, 1)]);
    h.overlaps.push(BlockOverlaps {
        block_size: BlockSize::new(32).expect("valid"),
        ranks: vec![RankOverlap {
            worker: InstanceId(2),
            dp_rank: DpRank(0),
            blocks: 2,
        }],
    });
    assert_eq!(h.decode_id(), 2);
}

#[test]
fn without_a_valid_block_size_the_phase_takes_the_load_only_rule() {
    let mut a = agg(1);
    a.block_size = None;
    let mut b = agg(2);
    b.block_size = Some(3);
    let mut h = Harness::new(vec![a, b], FakeLoad::default(), &[(1, 4)]);
    let (pick, result) = h.pick();
    assert_eq!(pick.reasons.decode, SelectionReason::RoundRobinStale);
    assert_eq!(result, KvSelectionResult::NoOverlap);
}

#[test]
fn unanswered_dispatches_count_as_backlog() {
    // isl 1024 = 64 blocks. A holds 4: 60 + 60 = 120; B: 64 + 64 = 128, so A wins first. Its
    // unanswered dispatch then adds 64 decode blocks to A (184), and B wins.
    let load = FakeLoad::default()
        .with("ns", 1, fresh(Some(0), None))
        .with("ns", 2, fresh(Some(0), None));
    let mut h = Harness::new(vec![agg(1), agg(2)], load, &[(1, 4)]);
    h.isl = 16 * 64;
    assert_eq!(h.decode_id(), 1);
    assert_eq!(h.decode_id(), 2, "the ledger's backlog moves load to B");
    assert_eq!(h.state.ledger.len(), 2);
}

// ---- Pair fleets: load-only decode, formula prefill ---------------------------------------

#[test]
fn pair_fleet_scores_decode_by_load_and_prefill_by_the_formula() {
    // Decode: D10 (5 blocks) vs D11 (1 block) by load: D11.
    // Prefill, isl 64: P1 (0 tokens, no overlap): 4 + 4 = 8.  P2 (32 tokens, holds 4):
    // (32 + 64) / 16 - 4 = 2, decode 0 -> 2.  P2 wins.
    let load = FakeLoad::default()
        .with("ns", 10, fresh(Some(5), None))
        .with("ns", 11, fresh(Some(1), None))
        .with("ns", 1, fresh(Some(0), Some(0)))
        .with("ns", 2, fresh(Some(0), Some(32)));
    let mut h = Harness::new(vec![dec(10), dec(11), pre(1), pre(2)], load, &[(2, 4)]);
    let (pick, result) = h.pick();
    assert_eq!(ids(&pick), (11, Some(2)));
    assert_eq!(pick.reasons.decode, SelectionReason::Load);
    assert_eq!(pick.reasons.prefill, SelectionReason::KvAware);
    assert_eq!(result, KvSelectionResult::Overlap);
    assert!(pick.dispatch.is_some());
}

#[test]
fn vllm_prefill_pools_without_prefill_backlog_compete_on_overlap() {
    // dynamo.vllm prefill workers publish no active_prefill_tokens: overlap decides, and ties
    // rotate as round_robin_stale.
    let load = FakeLoad::default()
        .with("ns", 10, fresh(Some(0), None))
        .with("ns", 1, fresh(Some(0), None))
        .with("ns", 2, fresh(Some(0), None));
    let mut h = Harness::new(vec![dec(10), pre(1), pre(2)], load, &[(2, 2)]);
    let (pick, _) = h.pick();
    assert_eq!(ids(&pick), (10, Some(2)));
    assert_eq!(pick.reasons.prefill, SelectionReason::KvAware);
    h.overlaps = overlaps(&[]);
    let a = h.pick().0;
    let b = h.pick().0;
    assert_eq!(a.reasons.prefill, SelectionReason::RoundRobinStale);
    assert_ne!(ids(&a).1, ids(&b).1, "ties rotate on the prefill cursor");
}

#[test]
fn mixed_namespaces_pair_within_the_paired_namespace() {
    // ns "a": prefill + decode + aggregated (the aggregated worker sits out even holding the
    // prefix); ns "b": aggregated and prefill, no decode worker: no prefill candidate there, so
    // in this pair fleet it sits out. Prefill never crosses namespaces.
    let candidates = vec![
        cand("a", 1, CandidateRole::Prefill),
        cand("a", 2, CandidateRole::Decode),
        cand("a", 3, CandidateRole::Aggregated),
        cand("b", 4, CandidateRole::Aggregated),
        cand("b", 5, CandidateRole::Prefill),
    ];
    let mut h = Harness::new(candidates, FakeLoad::default(), &[(3, 4), (5, 4)]);
    h.namespaces = vec![Namespace::new("a"), Namespace::new("b")];
    for _ in 0..6 {
        let (pick, _) = h.pick();
        assert_eq!(ids(&pick), (2, Some(1)));
    }
    // Without the pair namespace the aggregated one serves, unpaired.
    h.namespaces = vec![Namespace::new("b")];
    let (pick, _) = h.pick();
    assert_eq!(ids(&pick), (4, None));
    assert_eq!(pick.reasons.prefill, SelectionReason::NoPrefillPool);
}

#[test]
fn prefill_is_scored_across_namespaces_and_decode_picked_within_the_winner() {
    // Seed "Graph-local dispatch": ns "a" has the lighter decode worker, ns "b" the prefill
    // worker holding the prompt. The load-only order (decode first) would pair D10 with P1,
    // which holds nothing; the KV-aware order scores P1 (8) against P2 (isl 64, holds 4:
    // 64/16 - 4 = 0, plus 0 decode blocks) across namespaces and decodes on D11 beside P2.
    let load = FakeLoad::default()
        .with("a", 10, fresh(Some(1), None))
        .with("b", 11, fresh(Some(30), None))
        .with("a", 1, fresh(Some(0), Some(0)))
        .with("b", 2, fresh(Some(0), Some(0)));
    let candidates = vec![
        cand("a", 10, CandidateRole::Decode),
        cand("b", 11, CandidateRole::Decode),
        cand("a", 1, CandidateRole::Prefill),
        cand("b", 2, CandidateRole::Prefill),
    ];
    let mut h = Harness::new(candidates, load, &[(2, 4)]);
    h.namespaces = vec![Namespace::new("a"), Namespace::new("b")];
    let (pick, result) = h.pick();
    assert_eq!(ids(&pick), (11, Some(2)));
    assert_eq!(pick.namespace, Namespace::new("b"));
    assert_eq!(pick.reasons.prefill, SelectionReason::KvAware);
    assert_eq!(pick.reasons.decode, SelectionReason::Load);
    assert_eq!(result, KvSelectionResult::Overlap);
}

#[test]
fn prefill_only_fleets_have_no_decode_worker_and_other_models_none() {
    let mut h = Harness::new(vec![pre(1)], FakeLoad::default(), &[]);
    assert_eq!(
        h.run(Ok(())),
        KvPickOutcome {
            outcome: PickOutcome::NoCandidates(NoCandidates::NoDecodeWorker),
            kv: None
        }
    );
    let mut other = agg(1);
    other.model = "other".into();
    let mut h = Harness::new(vec![other], FakeLoad::default(), &[]);
    assert_eq!(
        h.run(Ok(())).outcome,
        PickOutcome::NoCandidates(NoCandidates::NoWorkerForModel)
    );
}

// ---- Without KV input ----------------------------------------------------------------------

#[test]
fn without_kv_input_the_pick_is_load_based_and_says_why() {
    let cases = [
        (KvUnavailable::TokenizerUnavailable, "tokenizer_unavailable"),
        (KvUnavailable::PromptTooLarge, "prompt_too_large"),
        (KvUnavailable::RenderUnavailable, "render_unavailable"),
        (KvUnavailable::ArtifactUnpinned, "artifact_unpinned"),
    ];
    for (why, label) in cases {
        let load = FakeLoad::default()
            .with("ns", 10, fresh(Some(50), None))
            .with("ns", 11, fresh(Some(1), None))
            .with("ns", 1, fresh(Some(0), Some(900)))
            .with("ns", 2, fresh(Some(0), Some(10)));
        let candidates = vec![dec(10), dec(11), pre(1), pre(2)];
        let mut h = Harness::new(candidates.clone(), load, &[(1, 4)]);
        let out = h.run(Err(why));
        assert_eq!(out.kv.map(KvSelectionResult::as_label), Some(label));
        let PickOutcome::Picked(pick) = out.outcome else {
            panic!("picked")
        };
        // The load-based choice: the least loaded decode and prefill, overlap ignored.
        assert_eq!(ids(&pick), (11, Some(2)));
        assert_eq!(pick.reasons.prefill, SelectionReason::Load);
        // The plain trait pick is the same load-based pick.
        let mut state = PickerState::new();
        let req = PickRequest {
            model: MODEL,
            eligible_namespaces: &h.namespaces,
            estimated_prompt_tokens: 64,
            load_signals: true,
        };
        let plain = KvAwarePicker::default().pick(&mut PickContext::new(
            &req,
            &candidates,
            &h.load,
            &mut state,
            now(),
        ));
        let PickOutcome::Picked(plain) = plain else {
            panic!("picked")
        };
        assert_eq!(ids(&plain), (11, Some(2)));
    }
}

#[test]
fn the_load_based_picker_reports_no_kv_result() {
    let mut state = PickerState::new();
    let namespaces = [Namespace::new("ns")];
    let req = PickRequest {
        model: MODEL,
        eligible_namespaces: &namespaces,
        estimated_prompt_tokens: 64,
        load_signals: true,
    };
    let candidates = [agg(1)];
    let load = FakeLoad::default();
    let out = LoadBasedPicker.pick_kv(
        &mut PickContext::new(&req, &candidates, &load, &mut state, now()),
        Err(KvUnavailable::TokenizerUnavailable),
    );
    assert_eq!(out.kv, None);
    assert!(matches!(out.outcome, PickOutcome::Picked(_)));
}

#[test]
fn result_labels_are_the_seeds_closed_set() {
    let labels: Vec<_> = KvSelectionResult::ALL
        .iter()
        .map(|r| r.as_label())
        .collect();
    assert_eq!(
        labels,
        [
            "overlap",
            "no_overlap",
            "tokenizer_unavailable",
            "prompt_too_large",
            "render_unavailable",
            "artifact_unpinned",
            "bypass"
        ]
    );
}

// ---- Temperature ---------------------------------------------------------------------------

#[test]
fn positive_temperature_samples_with_the_callers_unit() {
    // Quiet fleet, isl 64: costs 4 - 4 = 0 (A) and 4 (B). T = 1: p(A) = 1 / (1 + e^-1).
    let p_a = 1.0 / (1.0 + (-1.0f64).exp());
    let mut h = Harness::new(vec![agg(1), agg(2)], FakeLoad::default(), &[(1, 4)]);
    h.params.router_temperature = 1.0;
    h.unit = p_a - 1e-9;
    assert_eq!(h.decode_id(), 1);
    h.unit = p_a + 1e-9;
    let (pick, result) = h.pick();
    assert_eq!(ids(&pick), (2, None));
    assert_eq!(pick.reasons.decode, SelectionReason::KvAware);
    assert_eq!(result, KvSelectionResult::NoOverlap);
}

// ---- Conditional disaggregation -----------------------------------------------------------

fn conditional(threshold: Option<f64>) -> KvPickParams {
    KvPickParams {
        conditional_disaggregation: ConditionalDisaggregation {
            enabled: true,
            decode_busy_threshold: threshold,
        },
        ..KvPickParams::default()
    }
}

#[test]
fn conditional_decode_scores_subtract_the_overlap_credit() {
    // isl 64. D10: 10 decode blocks, holds 4: decode cost 10 + 0, minus 4 -> 6.
    // D11: 8 blocks, nothing held: 8 + 4 -> 12.  D10 wins (load-only would take D11).
    let load = FakeLoad::default()
        .with("ns", 10, fresh(Some(10), None))
        .with("ns", 11, fresh(Some(8), None));
    let mut h = Harness::new(vec![dec(10), dec(11), pre(1)], load, &[(10, 4), (1, 4)]);
    h.params = conditional(None);
    let (pick, _) = h.pick();
    assert_eq!(pick.decode.worker.instance_id.0, 10);
    assert_eq!(pick.reasons.decode, SelectionReason::KvAware);
    // Disabled: the load-only rule picks D11.
    h.params = KvPickParams::default();
    let (pick, _) = h.pick();
    assert_eq!(pick.decode.worker.instance_id.0, 11);
    assert_eq!(pick.reasons.decode, SelectionReason::Load);
}

#[test]
fn a_decode_winner_holding_the_prefix_prefills_locally() {
    // (threshold, decode sample, expected bypass)
    let cases: [(Option<f64>, Option<SampleState>, bool); 6] = [
        (None, None, true),
        // 10 active + (4 - 4) request blocks = 10 <= 0.5 * 100.
        (Some(0.5), Some(fresh(Some(10), None)), true),
        // 60 > 50: too busy.
        (Some(0.5), Some(fresh(Some(60), None)), false),
        // A missing sample vetoes.
        (Some(0.5), None, false),
        (
            Some(0.5),
            Some(SampleState::Stale {
                last_had_backlog: false,
            }),
            false,
        ),
        // Exactly at the threshold still bypasses.
        (Some(0.5), Some(fresh(Some(50), None)), true),
    ];
    for (threshold, sample, bypass) in cases {
        let mut load = FakeLoad::default();
        if let Some(sample) = sample {
            load = load.with("ns", 10, sample);
        }
        let mut h = Harness::new(vec![dec(10), pre(1)], load, &[(10, 4), (1, 2)]);
        h.params = conditional(threshold);
        let (pick, result) = h.pick();
        if bypass {
            assert_eq!(ids(&pick), (10, None), "{threshold:?} {sample:?}");
            assert_eq!(result, KvSelectionResult::Bypass);
            assert_eq!(pick.reasons.prefill, SelectionReason::ConditionalBypass);
        } else {
            assert_eq!(ids(&pick), (10, Some(1)), "{threshold:?} {sample:?}");
            assert_eq!(result, KvSelectionResult::Overlap);
            assert_eq!(pick.reasons.prefill, SelectionReason::KvAware);
        }
    }
}

#[test]
fn no_bypass_when_the_prefill_rank_holds_more_or_nothing_is_held() {
    for overlap in [[(10, 2), (1, 4)], [(10, 0), (1, 0)]] {
        let mut h = Harness::new(vec![dec(10), pre(1)], FakeLoad::default(), &overlap);
        h.params = conditional(None);
        let (pick, result) = h.pick();
        assert_eq!(ids(&pick), (10, Some(1)));
        assert_ne!(result, KvSelectionResult::Bypass);
    }
    // Disabled: never a bypass even when the decode worker holds everything.
    let mut h = Harness::new(vec![dec(10), pre(1)], FakeLoad::default(), &[(10, 4)]);
    let (pick, _) = h.pick();
    assert_eq!(ids(&pick), (10, Some(1)));
}

// ---- Properties ----------------------------------------------------------------------------

/// The seed's formula, transcribed line by line, and its selection rules for one aggregated
/// namespace at temperature 0: the expected winners (in candidate order).
fn naive_winners(
    candidates: &[Candidate],
    samples: &[SampleState],
    overlap: &[u64],
    isl: u64,
    params: KvPickParams,
) -> Vec<usize> {
    let has_field = |s: &SampleState| match *s {
        SampleState::Fresh {
            active_decode_blocks,
            kv_used_blocks,
            ..
        } => active_decode_blocks.or(kv_used_blocks).is_some(),
        _ => false,
    };
    let any_fresh = samples.iter().any(has_field);
    let mut costs: Vec<Option<f64>> = Vec::new();
    for (i, c) in candidates.iter().enumerate() {
        let bs = u64::from(c.block_size.expect("set"));
        let ov = overlap[i];
        if !any_fresh {
            costs.push(Some(
                isl as f64 / bs as f64 - params.overlap_score_credit * ov as f64,
            ));
            continue;
        }
        let (active_prefill, active_decode) = match samples[i] {
            SampleState::Fresh {
                active_decode_blocks,
                active_prefill_tokens,
                kv_used_blocks,
            } => match active_decode_blocks.or(kv_used_blocks) {
                Some(d) => (active_prefill_tokens.unwrap_or(0), d),
                None => {
                    costs.push(None);
                    continue;
                }
            },
            SampleState::Never
            | SampleState::Stale {
                last_had_backlog: false,
            } => (0, 0),
            SampleState::Stale {
                last_had_backlog: true,
            } => {
                costs.push(None);
                continue;
            }
        };
        let cached_tokens = (ov * bs).min(isl);
        let raw_prefill_tokens = active_prefill + (isl - cached_tokens) + cached_tokens;
        let raw_prefill_blocks = raw_prefill_tokens as f64 / bs as f64;
        let overlap_credit_blocks = params.overlap_score_credit * ov as f64;
        let adjusted_prefill = (raw_prefill_blocks - overlap_credit_blocks).max(0.0);
        let decode_cost_blocks =
            active_decode as f64 + (isl.div_ceil(bs) as i64 - ov as i64).max(0) as f64;
        costs.push(Some(
            params.prefill_load_scale * adjusted_prefill + decode_cost_blocks,
        ));
    }
    let min = costs
        .iter()
        .flatten()
        .copied()
        .fold(f64::INFINITY, f64::min);
    costs
        .iter()
        .enumerate()
        .filter(|(_, c)| **c == Some(min))
        .map(|(i, _)| i)
        .collect()
}

fn sample_strategy() -> impl Strategy<Value = SampleState> {
    let field = || prop::option::of(0u64..200);
    prop_oneof![
        Just(SampleState::Never),
        any::<bool>().prop_map(|b| SampleState::Stale {
            last_had_backlog: b
        }),
        (field(), field(), field()).prop_map(|(d, p, k)| SampleState::Fresh {
            active_decode_blocks: d,
            active_prefill_tokens: p,
            kv_used_blocks: k,
        }),
    ]
}

proptest! {
    #[test]
    fn aggregated_picks_match_a_naive_transcription_of_the_formula(
        ranks in prop::collection::vec(
            (prop_oneof![Just(16u32), Just(32u32)], sample_strategy(), 0u64..10),
            1..7,
        ),
        isl in 0u64..400,
        credit in prop_oneof![Just(0.0), Just(0.5), Just(1.0), Just(2.0)],
        scale in prop_oneof![Just(0.5), Just(1.0), Just(3.0)],
    ) {
        let mut candidates = Vec::new();
        let mut load = FakeLoad::default();
        let mut by_size: HashMap<u32, Vec<RankOverlap>> = HashMap::new();
        for (i, (bs, sample, ov)) in ranks.iter().enumerate() {
            let id = i as u64 + 1;
            let mut c = agg(id);
            c.block_size = Some(*bs);
            candidates.push(c);
            load = load.with("ns", id, *sample);
            if *ov > 0 {
                by_size.entry(*bs).or_default().push(RankOverlap {
                    worker: InstanceId(id),
                    dp_rank: DpRank(0),
                    blocks: *ov as u32,
                });
            }
        }
        let params = KvPickParams {
            overlap_score_credit: credit,
            prefill_load_scale: scale,
            ..KvPickParams::default()
        };
        let samples: Vec<_> = ranks.iter().map(|r| r.1).collect();
        let overlap: Vec<_> = ranks.iter().map(|r| r.2).collect();
        let expected = naive_winners(&candidates, &samples, &overlap, isl, params);

        let mut h = Harness::new(candidates, load, &[]);
        h.isl = isl;
        h.params = params;
        h.overlaps = by_size
            .into_iter()
            .map(|(bs, mut ranks)| {
                ranks.sort();
                BlockOverlaps { block_size: BlockSize::new(bs).expect("valid"), ranks }
            })
            .collect();
        // A fresh cursor takes the first of equal minima.
        let won = (h.decode_id() - 1) as usize;
        prop_assert_eq!(Some(&won), expected.first(), "expected one of {:?}", expected);
    }

    #[test]
    fn pairs_never_cross_namespaces_and_never_pair_an_aggregated_worker(
        workers in prop::collection::vec((0usize..3, 0u8..3, 0u32..5), 1..10),
        conditional_on in any::<bool>(),
        fresh_prefill in any::<bool>(),
    ) {
        let names = ["a", "b", "c"];
        let mut candidates = Vec::new();
        let mut load = FakeLoad::default();
        let mut overlap = Vec::new();
        for (i, (ns, role, ov)) in workers.iter().enumerate() {
            let role = match role {
                0 => CandidateRole::Prefill,
                1 => CandidateRole::Decode,
                _ => CandidateRole::Aggregated,
            };
            let id = i as u64 + 1;
            candidates.push(cand(names[*ns], id, role));
            let prefill = fresh_prefill.then_some(u64::from(*ov) * 7);
            load = load.with(names[*ns], id, fresh(Some(u64::from(*ov)), prefill));
            overlap.push((id, *ov));
        }
        let mut h = Harness::new(candidates.clone(), load, &overlap);
        h.namespaces = names.iter().map(|n| Namespace::new(*n)).collect();
        if conditional_on {
            h.params = conditional(None);
        }
        for _ in 0..4 {
            let out = h.run(Ok(()));
            let PickOutcome::Picked(pick) = out.outcome else { continue };
            let ns = &pick.decode.worker.namespace;
            let has = |role| candidates.iter().any(|c| &c.worker.namespace == ns && c.role == role);
            let paired = has(CandidateRole::Prefill) && has(CandidateRole::Decode);
            prop_assert_ne!(pick.decode.role, CandidateRole::Prefill);
            if pick.decode.role == CandidateRole::Aggregated {
                prop_assert!(!paired, "aggregated workers sit out beside a pair pool");
                prop_assert!(pick.prefill.is_none());
                prop_assert_eq!(pick.reasons.prefill, SelectionReason::NoPrefillPool);
            }
            if let Some(p) = &pick.prefill {
                prop_assert_eq!(&p.worker.namespace, ns);
                prop_assert_eq!(p.role, CandidateRole::Prefill);
                prop_assert_eq!(pick.decode.role, CandidateRole::Decode);
            } else if pick.decode.role == CandidateRole::Decode && paired {
                prop_assert!(out.kv == Some(KvSelectionResult::Bypass));
            }
            prop_assert_eq!(out.kv == Some(KvSelectionResult::Bypass), pick.reasons.prefill == SelectionReason::ConditionalBypass);
        }
    }
}

// ---- The dense pass against the per-candidate reference ------------------------------------

mod reference;

use crate::load_store::LoadStore;
use crate::picker::DenseRanks;
use crate::picker::candidates::StoreView;
use crate::picker::dp_ranks;
use crate::picker::tests::{
    ArbCandidate, MODELS, NAMESPACES, NoSlots, arb_candidate, arb_sample, secs, stored,
};
use crate::picker::tie_break::{Place, TieBreak};

/// One step of a random KV-aware session.
#[derive(Clone, Debug)]
enum KvStep {
    Pick {
        model: usize,
        isl: u64,
        unit: f64,
        advance_ms: u64,
    },
    /// A new sample for one rank (replacing a held one or taking a slot), answering the
    /// worker's dispatches.
    Sample {
        id: u64,
        rank: u32,
        decode: u64,
    },
    /// A publisher dropped: its samples are gone (slots freed).
    Drop {
        id: u64,
    },
    End {
        nth: usize,
    },
}

fn kv_step() -> impl Strategy<Value = KvStep> {
    prop_oneof![
        4 => (0usize..2, 0u64..400, 0.0f64..1.0, 0u64..2000)
            .prop_map(|(model, isl, unit, advance_ms)| KvStep::Pick { model, isl, unit, advance_ms }),
        2 => (1u64..6, 0u32..2, 0u64..60).prop_map(|(id, rank, decode)| KvStep::Sample { id, rank, decode }),
        1 => (1u64..6).prop_map(|id| KvStep::Drop { id }),
        1 => (0usize..8).prop_map(|nth| KvStep::End { nth }),
    ]
}

fn kv_params() -> impl Strategy<Value = KvPickParams> {
    (
        prop_oneof![Just(0.0), Just(1.0), Just(2.0)],
        prop_oneof![Just(0.5), Just(1.0)],
        prop_oneof![3 => Just(0.0), 1 => Just(0.7)],
        prop_oneof![
            Just(ConditionalDisaggregation::default()),
            Just(ConditionalDisaggregation {
                enabled: true,
                decode_busy_threshold: None
            }),
            Just(ConditionalDisaggregation {
                enabled: true,
                decode_busy_threshold: Some(0.5)
            }),
        ],
    )
        .prop_map(|(credit, scale, temperature, conditional)| KvPickParams {
            overlap_score_credit: credit,
            prefill_load_scale: scale,
            router_temperature: temperature,
            conditional_disaggregation: conditional,
        })
}

/// One random KV-aware session for [`check_against_reference`].
#[derive(Debug)]
struct Session {
    arb: Vec<ArbCandidate>,
    samples: Vec<SampleState>,
    /// Per worker id, its block size.
    block_sizes: Vec<u32>,
    overlap: Vec<u32>,
    unsorted: bool,
    eligible_mask: usize,
    load_signals: bool,
    params: KvPickParams,
    steps: Vec<KvStep>,
    /// Every candidate declares its capacity (with one block size: a layout of one block size).
    all_capacity: bool,
    /// Peer slots (window, index, count): the dense and view paths then pick with them and are
    /// compared with each other (peers' slots included), not with the reference.
    slots: Option<(f64, usize, usize)>,
}

/// The KV-aware pick over the dense layout (samples mirrored from a real load store, the
/// ledger and the overlaps laid onto rows) and over the per-rank view path picks exactly what
/// the per-candidate reference picks at every step of `session`.
fn check_against_reference(session: Session) -> Result<(), TestCaseError> {
    let Session {
        arb,
        samples,
        block_sizes,
        overlap,
        unsorted,
        eligible_mask,
        load_signals,
        params,
        steps,
        all_capacity,
        slots,
    } = session;
    let mut seen = std::collections::HashSet::new();
    let mut candidates = Vec::new();
    let mut store = LoadStore::new();
    store.set_live_and_retain((1..6).map(InstanceId));
    let mut sequence = 1;
    let models: [std::sync::Arc<str>; 2] = [MODELS[0].into(), MODELS[1].into()];
    for (i, a) in arb.iter().enumerate() {
        let ArbCandidate {
            ns,
            id,
            role,
            model,
            ranks,
            capacity,
        } = *a;
        let capacity = capacity || all_capacity;
        if !seen.insert((ns, id)) {
            continue;
        }
        for (offset, (dp_rank, rank_declared)) in
            dp_ranks(0, Some(ranks)).expect("small").enumerate()
        {
            candidates.push(Candidate {
                worker: key(NAMESPACES[ns], id),
                role,
                model: models[model].clone(),
                dp_rank,
                rank_declared,
                block_size: capacity.then_some(block_sizes[id as usize]),
                total_kv_blocks: capacity.then_some(if id.is_multiple_of(3) { 50 } else { 100 }),
                max_num_batched_tokens: capacity.then_some(1000),
            });
            if let Some(s) = stored(
                id,
                offset as u32,
                samples[(i * 3 + offset) % samples.len()],
                sequence,
            ) {
                store.apply(s);
                sequence += 1;
            }
        }
    }
    // Overlaps per block size, sorted by (worker, rank) as `find_matches` lists them (or
    // reversed: a caller's unsorted list).
    let mut lists: Vec<BlockOverlaps> = [16u32, 32, 48]
        .iter()
        .map(|&bs| {
            let mut ranks: Vec<RankOverlap> = (1..6u64)
                .flat_map(|id| (0..2u32).map(move |r| (id, r)))
                .filter(|&(id, _)| block_sizes[id as usize] == bs)
                .filter_map(|(id, r)| {
                    let blocks = overlap[(id as usize * 2 + r as usize) % overlap.len()];
                    (blocks > 0).then_some(RankOverlap {
                        worker: InstanceId(id),
                        dp_rank: DpRank(r),
                        blocks,
                    })
                })
                .collect();
            if unsorted {
                ranks.reverse();
            }
            BlockOverlaps {
                block_size: BlockSize::new(bs).expect("valid"),
                ranks,
            }
        })
        .collect();
    lists.retain(|l| !l.ranks.is_empty());
    let layout = DenseRanks::build(&candidates);
    let namespaces: Vec<Namespace> = (0..3)
        .filter(|i| eligible_mask & (1 << i) != 0)
        .map(|i| Namespace::new(NAMESPACES[i]))
        .collect();
    let picker = KvAwarePicker::new(params);
    let (mut dense_state, mut view_state) = (PickerState::new(), PickerState::new());
    if let Some((window, index, count)) = slots {
        for state in [&mut dense_state, &mut view_state] {
            state.tie.set(TieBreak {
                window,
                seed: 3,
                peer_slots: true,
            });
            state.ledger.set_place(Place::new(index, count));
        }
    }
    let mut reference = reference::ReferenceKv::new(params);
    let max_age = Duration::from_secs(3);
    let mut now = secs(100);
    let mut dispatches = Vec::new();
    for step in steps {
        let (model, isl, unit) = match step {
            KvStep::Pick {
                model,
                isl,
                unit,
                advance_ms,
            } => {
                now = now.plus(Duration::from_millis(advance_ms));
                (MODELS[model], isl, unit)
            }
            KvStep::Sample { id, rank, decode } => {
                let fresh = SampleState::Fresh {
                    active_decode_blocks: Some(decode),
                    active_prefill_tokens: (!decode.is_multiple_of(3)).then_some(decode * 5),
                    kv_used_blocks: None,
                };
                if let Some(mut s) = stored(id, rank, fresh, sequence) {
                    s.received_at = now;
                    store.apply(s);
                    sequence += 1;
                }
                for ns in NAMESPACES {
                    for state in [
                        &mut dense_state.ledger,
                        &mut view_state.ledger,
                        &mut reference.ledger,
                    ] {
                        state.sample_arrived(&key(ns, id), now);
                    }
                }
                continue;
            }
            KvStep::Drop { id } => {
                store.drop_publisher(crate::ids::PublisherId(id));
                continue;
            }
            KvStep::End { nth } => {
                if !dispatches.is_empty() {
                    let id = dispatches[nth % dispatches.len()];
                    dense_state.ledger.request_ended(id);
                    view_state.ledger.request_ended(id);
                    reference.ledger.request_ended(id);
                }
                continue;
            }
        };
        let req = PickRequest {
            model,
            eligible_namespaces: &namespaces,
            estimated_prompt_tokens: isl,
            load_signals,
        };
        let input = KvPickInput {
            isl,
            overlaps: &lists,
            unit,
        };
        let view = StoreView {
            store: &store,
            now,
            max_age,
        };
        let fast = picker.pick_with(
            &mut PickContext::new(&req, &candidates, &view, &mut dense_state, now)
                .with_layout(&layout),
            Ok(&input),
        );
        let plain = NoSlots(StoreView {
            store: &store,
            now,
            max_age,
        });
        let viewed = picker.pick_with(
            &mut PickContext::new(&req, &candidates, &plain, &mut view_state, now),
            Ok(&input),
        );
        let expected = if slots.is_some() {
            prop_assert_eq!(&dense_state.scratch.peers, &view_state.scratch.peers);
            prop_assert_eq!(
                dense_state.ledger.peer_legs(),
                view_state.ledger.peer_legs()
            );
            viewed.clone()
        } else {
            reference.pick(&req, &candidates, &plain, &input, now)
        };
        prop_assert_eq!(&fast, &expected);
        prop_assert_eq!(&viewed, &expected);
        if let PickOutcome::Picked(Pick {
            dispatch: Some(id), ..
        }) = expected.outcome
        {
            dispatches.push(id);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// The KV-aware pick over the dense layout and over the per-rank view path picks exactly
    /// what the per-candidate reference picks, across random multi-namespace fleets, samples
    /// replaced and dropped, dispatches answered and ended, sorted and unsorted overlap lists.
    #[test]
    fn kv_aware_picks_match_the_reference_on_random_fleets(
        arb in proptest::collection::vec(arb_candidate(), 0..30),
        samples in proptest::collection::vec(arb_sample(), 30),
        block_sizes in proptest::collection::vec(prop_oneof![Just(16u32), Just(32), Just(8)], 6),
        overlap in proptest::collection::vec(0u32..6, 12),
        unsorted in proptest::bool::weighted(0.2),
        eligible_mask in 1usize..8,
        load_signals in proptest::bool::weighted(0.85),
        params in kv_params(),
        steps in proptest::collection::vec(kv_step(), 1..30),
    ) {
        check_against_reference(Session {
            arb, samples, block_sizes, overlap, unsorted, eligible_mask, load_signals, params,
            steps, all_capacity: false, slots: None,
        })?;
    }

    /// The same on layouts of one block size (a power of two or not), where temperature 0 on
    /// the mirrored path takes the KV gather (`KvPass`): one pass, no per-rank buffers. Half the
    /// sessions send prompts of 0–3 tokens, where a rank's cost is its decode blocks plus a
    /// fraction: ties, and ranks at the gather's decode-blocks bound, are then common.
    #[test]
    fn kv_aware_gather_matches_the_reference_on_uniform_fleets(
        arb in proptest::collection::vec(arb_candidate(), 0..30),
        samples in proptest::collection::vec(arb_sample(), 30),
        block_size in prop_oneof![Just(16u32), Just(32), Just(48)],
        overlap in proptest::collection::vec(0u32..6, 12),
        unsorted in proptest::bool::weighted(0.2),
        eligible_mask in 1usize..8,
        load_signals in proptest::bool::weighted(0.85),
        params in kv_params(),
        steps in proptest::collection::vec(kv_step(), 1..30),
        small_prompts in any::<bool>(),
    ) {
        let steps = steps
            .into_iter()
            .map(|step| match step {
                KvStep::Pick { model, isl, unit, advance_ms } if small_prompts => {
                    KvStep::Pick { model, isl: isl % 4, unit, advance_ms }
                }
                step => step,
            })
            .collect();
        check_against_reference(Session {
            arb, samples, block_sizes: vec![block_size; 6], overlap, unsorted, eligible_mask,
            load_signals, params, steps, all_capacity: true, slots: None,
        })?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// The same on single pools (one model, every namespace eligible, no prefill pool, one
    /// block size, temperature 0), where every rank is a candidate of an aggregated score and
    /// the gather skips ranks on the mirror's decode column (`KvPass::gather_keyed`).
    #[test]
    fn kv_aware_keyed_gather_matches_the_reference_on_single_pools(
        arb in proptest::collection::vec(arb_candidate(), 1..30),
        samples in proptest::collection::vec(arb_sample(), 30),
        block_size in prop_oneof![Just(16u32), Just(32), Just(48)],
        overlap in proptest::collection::vec(0u32..6, 12),
        aggregated in any::<bool>(),
        params in kv_params(),
        steps in proptest::collection::vec(kv_step(), 1..40),
        small_prompts in any::<bool>(),
    ) {
        let role = if aggregated { CandidateRole::Aggregated } else { CandidateRole::Decode };
        let arb = arb
            .into_iter()
            .map(|a| ArbCandidate { model: 0, role, ..a })
            .collect();
        let steps = steps
            .into_iter()
            .map(|step| match step {
                KvStep::Pick { isl, unit, advance_ms, .. } => KvStep::Pick {
                    model: 0,
                    isl: if small_prompts { isl % 4 } else { isl },
                    unit,
                    advance_ms,
                },
                step => step,
            })
            .collect();
        let params = KvPickParams { router_temperature: 0.0, ..params };
        check_against_reference(Session {
            arb, samples, block_sizes: vec![block_size; 6], overlap, unsorted: false,
            eligible_mask: 7, load_signals: true, params, steps, all_capacity: true, slots: None,
        })?;
    }
}

/// The skip bound of a rank holding none of the prompt sits exactly where its cost passes the
/// lowest: a rank costing the lowest exactly (a tie the cursor must count) is still scored.
#[test]
fn a_rank_without_overlap_is_skipped_only_past_a_tie() {
    use crate::kv::cost::{CandidateLoad, CostParams, RequestCost};
    // 1,600 tokens in blocks of 16: 100 prefill blocks and 100 decode blocks on top of `d`.
    let formula = RequestCost::new(1_600, BlockSize::new(16).unwrap(), CostParams::default());
    let floor = formula.zero_overlap_floor();
    assert_eq!(floor, Some(200));
    let cost = |d| {
        formula.cost(CandidateLoad {
            overlap_blocks: 0,
            active_prefill_tokens: 0,
            active_decode_blocks: d,
        })
    };
    let lowest = cost(50);
    assert_eq!(lowest, 250.0);
    let bounds = DecodeBounds::below(lowest, floor);
    assert!(!bounds.loses(50, || 0), "a tie is scored");
    assert!(bounds.loses(51, || 0) && cost(51) > lowest);
    assert!(!bounds.loses(51, || 1), "a rank holding a block is scored");
    assert!(
        bounds.loses(251, || 1_000),
        "past the lowest itself every rank loses"
    );
    // No bound before a first cost, and none below a cost past the exact range.
    assert!(!DecodeBounds::NONE.loses(u64::MAX - 1, || 0));
    assert!(!DecodeBounds::below(f64::INFINITY, floor).loses(u64::MAX - 1, || 0));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    /// Peer slots: the KV gather (`KvPass::choose_slot`: the free tier's `count` lowest kept in
    /// the pass, the ranks holding the prompt costed again when the lowest holds part of it)
    /// takes the same slot and records the same peers' slots as the per-member path
    /// (`select_kv` over every cost), on uniform fleets and on single pools (the keyed gather),
    /// at temperature 0, for every place and window.
    #[test]
    fn kv_aware_fast_slots_match_the_per_member_path(
        arb in proptest::collection::vec(arb_candidate(), 1..30),
        samples in proptest::collection::vec(arb_sample(), 30),
        block_size in prop_oneof![Just(16u32), Just(32), Just(48)],
        overlap in proptest::collection::vec(0u32..6, 12),
        single_pool in any::<bool>(),
        params in kv_params(),
        steps in proptest::collection::vec(kv_step(), 1..40),
        small_prompts in any::<bool>(),
        (count, index) in (2usize..10).prop_flat_map(|c| (Just(c), 0..c)),
        window in prop_oneof![Just(0.25), Just(1.0), Just(2.0), Just(8.0), Just(16.0)],
    ) {
        let arb = arb
            .into_iter()
            .map(|a| if single_pool {
                ArbCandidate { model: 0, role: CandidateRole::Aggregated, ..a }
            } else {
                a
            })
            .collect();
        let steps = steps
            .into_iter()
            .map(|step| match step {
                KvStep::Pick { model, isl, unit, advance_ms } => KvStep::Pick {
                    model: if single_pool { 0 } else { model },
                    isl: if small_prompts { isl % 4 } else { isl },
                    unit,
                    advance_ms,
                },
                step => step,
            })
            .collect();
        let params = KvPickParams { router_temperature: 0.0, ..params };
        check_against_reference(Session {
            arb, samples, block_sizes: vec![block_size; 6], overlap, unsorted: false,
            eligible_mask: 7, load_signals: true, params, steps, all_capacity: true,
            slots: Some((window, index, count)),
        })?;
    }
}
