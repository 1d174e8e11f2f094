//! Rule-by-rule tests of the load-based picker, with hand-computed costs, and a property test of
//! its structural guarantees over random fleets.

use std::collections::HashMap;
use std::time::Duration;

use proptest::prelude::*;

use super::load_based::{Cost, RequestSize, Scored, score};
use super::*;
use crate::ids::{InstanceId, Namespace, WorkerKey};

const MODEL: &str = "Qwen/Qwen3-0.6B";

/// Shared with the KV-aware picker's tests.
pub(super) fn key(ns: &str, id: u64) -> WorkerKey {
    WorkerKey {
        namespace: Namespace::new(ns),
        instance_id: InstanceId(id),
    }
}

/// A candidate with block size 16, 100 KV blocks and a prefill budget of 1,000 tokens.
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

fn decode(id: u64) -> Candidate {
    cand("ns", id, CandidateRole::Decode)
}

fn prefill(id: u64) -> Candidate {
    cand("ns", id, CandidateRole::Prefill)
}

fn fresh_decode(blocks: u64) -> SampleState {
    SampleState::Fresh {
        active_decode_blocks: Some(blocks),
        active_prefill_tokens: None,
        kv_used_blocks: None,
    }
}

fn fresh_prefill(tokens: u64) -> SampleState {
    SampleState::Fresh {
        active_decode_blocks: Some(0),
        active_prefill_tokens: Some(tokens),
        kv_used_blocks: None,
    }
}

/// A load view over a fixed table (shared with the KV-aware picker's tests).
#[derive(Default)]
pub(super) struct FakeLoad(HashMap<(WorkerKey, DpRank), SampleState>);

impl FakeLoad {
    pub(super) fn with(mut self, ns: &str, id: u64, sample: SampleState) -> Self {
        self.0.insert((key(ns, id), DpRank(0)), sample);
        self
    }

    fn set(&mut self, ns: &str, id: u64, rank: u32, sample: SampleState) {
        self.0.insert((key(ns, id), DpRank(rank)), sample);
    }
}

impl LoadView for FakeLoad {
    fn sample(&self, worker: &WorkerKey, rank: DpRank) -> SampleState {
        self.0
            .get(&(worker.clone(), rank))
            .copied()
            .unwrap_or(SampleState::Never)
    }
}

pub(super) fn secs(s: u64) -> Tick {
    Tick(Duration::from_secs(s))
}

/// A 32-token request: 2 blocks of 16.
const TOKENS: u64 = 32;

struct Harness {
    namespaces: Vec<Namespace>,
    candidates: Vec<Candidate>,
    load: FakeLoad,
    state: PickerState,
    tokens: u64,
    load_signals: bool,
}

impl Harness {
    fn new(candidates: Vec<Candidate>, load: FakeLoad) -> Self {
        Self {
            namespaces: vec![Namespace::new("ns")],
            candidates,
            load,
            state: PickerState::new(),
            tokens: TOKENS,
            load_signals: true,
        }
    }

    fn outcome(&mut self, now: Tick) -> PickOutcome {
        let req = PickRequest {
            model: MODEL,
            eligible_namespaces: &self.namespaces,
            estimated_prompt_tokens: self.tokens,
            load_signals: self.load_signals,
        };
        LoadBasedPicker.pick(&mut PickContext::new(
            &req,
            &self.candidates,
            &self.load,
            &mut self.state,
            now,
        ))
    }

    fn pick(&mut self, now: Tick) -> Pick {
        match self.outcome(now) {
            PickOutcome::Picked(pick) => pick,
            PickOutcome::NoCandidates(why) => panic!("expected a pick, got {why:?}"),
        }
    }

    /// The decode instance ids of `n` picks at `now`.
    fn decode_ids(&mut self, n: usize, now: Tick) -> Vec<u64> {
        (0..n)
            .map(|_| self.pick(now).decode.worker.instance_id.0)
            .collect()
    }

    fn prefill_id(&mut self, now: Tick) -> Option<u64> {
        self.pick(now).prefill.map(|p| p.worker.instance_id.0)
    }
}

// ---- Cost formulas -------------------------------------------------------------------------

#[test]
fn decode_cost_adds_request_blocks_to_active_decode_blocks_over_total_kv_blocks() {
    // A: (10 + ceil(32/16)) / 100 = 0.12.  B: (5 + 2) / 40 = 0.175.  A wins with more blocks.
    let mut b = decode(2);
    b.total_kv_blocks = Some(40);
    let load = FakeLoad::default()
        .with("ns", 1, fresh_decode(10))
        .with("ns", 2, fresh_decode(5));
    let scored = score(
        Phase::Decode,
        &b,
        load.sample(&key("ns", 2), DpRank(0)),
        None,
        &mut RequestSize::new(TOKENS),
        secs(0),
    );
    assert_eq!(scored.cost, Some(Cost { num: 7, den: 40 }));
    let mut h = Harness::new(vec![decode(1), b], load);
    let pick = h.pick(secs(0));
    assert_eq!(pick.decode.worker.instance_id.0, 1);
    assert_eq!(pick.reasons.decode, SelectionReason::Load);
}

#[test]
fn decode_cost_falls_back_to_kv_used_blocks_when_active_decode_blocks_is_nil() {
    // A: nil active_decode_blocks, kv_used 50 -> (50 + 2) / 100.  B: active 20 (its kv_used 90 is
    // ignored) -> (20 + 2) / 100.  B wins; with A at kv_used 10 -> 12/100, A wins.
    let a_sample = |kv| SampleState::Fresh {
        active_decode_blocks: None,
        active_prefill_tokens: None,
        kv_used_blocks: Some(kv),
    };
    let b_sample = SampleState::Fresh {
        active_decode_blocks: Some(20),
        active_prefill_tokens: None,
        kv_used_blocks: Some(90),
    };
    let load = FakeLoad::default()
        .with("ns", 1, a_sample(50))
        .with("ns", 2, b_sample);
    let mut h = Harness::new(vec![decode(1), decode(2)], load);
    assert_eq!(h.pick(secs(0)).decode.worker.instance_id.0, 2);

    let load = FakeLoad::default()
        .with("ns", 1, a_sample(10))
        .with("ns", 2, b_sample);
    let mut h = Harness::new(vec![decode(1), decode(2)], load);
    assert_eq!(h.pick(secs(0)).decode.worker.instance_id.0, 1);
}

#[test]
fn prefill_cost_is_active_prefill_tokens_over_max_num_batched_tokens() {
    // P1: 4000 / 8192 = 0.49.  P2: 1000 / 1024 = 0.98.  P1 wins with more tokens queued.
    let mut p1 = prefill(11);
    p1.max_num_batched_tokens = Some(8192);
    let mut p2 = prefill(12);
    p2.max_num_batched_tokens = Some(1024);
    let load = FakeLoad::default()
        .with("ns", 1, fresh_decode(0))
        .with("ns", 11, fresh_prefill(4000))
        .with("ns", 12, fresh_prefill(1000));
    let mut h = Harness::new(vec![decode(1), p1, p2], load);
    let pick = h.pick(secs(0));
    assert_eq!(pick.prefill.map(|p| p.worker.instance_id.0), Some(11));
    assert_eq!(pick.reasons.prefill, SelectionReason::Load);
}

#[test]
fn costs_compare_exactly_so_equal_ratios_tie() {
    // 1/3 and 2/6 are equal; 1/3 < 334/1000.
    assert_eq!(
        Cost { num: 1, den: 3 }.cmp(&Cost { num: 2, den: 6 }),
        std::cmp::Ordering::Equal
    );
    assert!(
        Cost { num: 1, den: 3 }
            < Cost {
                num: 334,
                den: 1000
            }
    );
    assert!(
        Cost {
            num: u64::MAX,
            den: 1
        } > Cost {
            num: u64::MAX - 1,
            den: 1
        }
    );
}

// ---- Staleness: quiet, silent under load, no fresh sample -------------------------------------

#[test]
fn quiet_candidates_compete_with_zero_backlog() {
    // A fresh at 30 blocks: 32/100.  B never sampled and C stale without backlog: 2/100 each, so
    // they win and tie, rotating.
    let load = FakeLoad::default().with("ns", 1, fresh_decode(30)).with(
        "ns",
        3,
        SampleState::Stale {
            last_had_backlog: false,
        },
    );
    let mut h = Harness::new(vec![decode(1), decode(2), decode(3)], load);
    // Ledger backlog would break the tie; answer each dispatch immediately.
    let mut ids = Vec::new();
    for t in 0..4 {
        let pick = h.pick(secs(t));
        assert_eq!(pick.reasons.decode, SelectionReason::Load);
        let worker = pick.decode.worker.clone();
        ids.push(worker.instance_id.0);
        h.state
            .ledger
            .sample_arrived(&worker, secs(t).plus(Duration::from_millis(1)));
    }
    assert_eq!(ids, vec![2, 3, 2, 3]);
}

#[test]
fn a_stale_sample_is_quiet_only_when_it_reported_no_backlog() {
    assert_eq!(
        SampleState::from_last(false, Some(0), None, Some(0)),
        SampleState::Stale {
            last_had_backlog: false
        }
    );
    assert_eq!(
        SampleState::from_last(false, None, None, Some(3)),
        SampleState::Stale {
            last_had_backlog: true
        }
    );
    assert_eq!(
        SampleState::from_last(true, None, None, Some(3)),
        SampleState::Fresh {
            active_decode_blocks: None,
            active_prefill_tokens: None,
            kv_used_blocks: Some(3),
        }
    );
}

#[test]
fn silent_under_load_is_not_chosen_while_another_has_a_cost() {
    // A's last sample reported a backlog and aged out: no cost. B is nearly full (92/100) but has
    // a cost, so B takes every request.
    let load = FakeLoad::default()
        .with(
            "ns",
            1,
            SampleState::Stale {
                last_had_backlog: true,
            },
        )
        .with("ns", 2, fresh_decode(90));
    let mut h = Harness::new(vec![decode(1), decode(2)], load);
    assert_eq!(h.decode_ids(4, secs(0)), vec![2, 2, 2, 2]);
}

#[test]
fn a_fresh_sample_without_the_phase_field_has_no_cost() {
    // P1's fresh sample has nil active_prefill_tokens (dynamo.vllm): undefined. P2 reports 900 of
    // 1000 and still takes every prefill.
    let load = FakeLoad::default()
        .with("ns", 1, fresh_decode(0))
        .with("ns", 11, fresh_decode(0))
        .with("ns", 12, fresh_prefill(900));
    let mut h = Harness::new(vec![decode(1), prefill(11), prefill(12)], load);
    for t in 0..3 {
        assert_eq!(h.prefill_id(secs(t)), Some(12));
    }
}

#[test]
fn a_candidate_without_capacity_has_no_cost() {
    // A is idle but its card carries no total_kv_blocks: undefined. B at 50/100 wins.
    let mut a = decode(1);
    a.total_kv_blocks = None;
    let load = FakeLoad::default()
        .with("ns", 1, fresh_decode(0))
        .with("ns", 2, fresh_decode(50));
    let mut h = Harness::new(vec![a, decode(2)], load);
    assert_eq!(h.decode_ids(3, secs(0)), vec![2, 2, 2]);
}

#[test]
fn no_capacity_on_any_card_rotates_round_robin() {
    let mut a = decode(1);
    a.total_kv_blocks = None;
    let mut b = decode(2);
    b.block_size = None;
    let load = FakeLoad::default()
        .with("ns", 1, fresh_decode(0))
        .with("ns", 2, fresh_decode(0));
    let mut h = Harness::new(vec![a, b], load);
    let pick = h.pick(secs(0));
    assert_eq!(pick.reasons.decode, SelectionReason::RoundRobin);
    assert_eq!(h.decode_ids(3, secs(0)), vec![2, 1, 2]);
}

#[test]
fn equal_costs_rotate_on_the_phase_cursor() {
    // A, B, C at (10 + 2) / 100 tie; D at 12/50 never wins. Zero-token requests add no ledger
    // blocks, so the tie holds.
    let mut d = decode(4);
    d.total_kv_blocks = Some(50);
    let load = FakeLoad::default()
        .with("ns", 1, fresh_decode(10))
        .with("ns", 2, fresh_decode(10))
        .with("ns", 3, fresh_decode(10))
        .with("ns", 4, fresh_decode(10));
    let mut h = Harness::new(vec![decode(1), decode(2), decode(3), d], load);
    h.tokens = 0;
    assert_eq!(h.decode_ids(5, secs(0)), vec![1, 2, 3, 1, 2]);
}

#[test]
fn equal_ratios_over_different_capacities_tie_and_rotate() {
    // A: 12 / 100.  B: 6 / 50.  The same cost, so they rotate; C at 13 / 100 never wins.
    let mut b = decode(2);
    b.total_kv_blocks = Some(50);
    let load = FakeLoad::default()
        .with("ns", 1, fresh_decode(12))
        .with("ns", 2, fresh_decode(6))
        .with("ns", 3, fresh_decode(13));
    let mut h = Harness::new(vec![decode(1), b, decode(3)], load);
    h.tokens = 0;
    assert_eq!(h.decode_ids(4, secs(0)), vec![1, 2, 1, 2]);
}

#[test]
fn without_a_fresh_field_the_cursor_rotates_across_all_candidates_round_robin_stale() {
    // Nobody has a fresh decode field: A silent under load, B never sampled, C fresh but with
    // neither decode field. All three rotate, the silent one included.
    let c_sample = SampleState::Fresh {
        active_decode_blocks: None,
        active_prefill_tokens: Some(5),
        kv_used_blocks: None,
    };
    let load = FakeLoad::default()
        .with(
            "ns",
            1,
            SampleState::Stale {
                last_had_backlog: true,
            },
        )
        .with("ns", 3, c_sample);
    let mut h = Harness::new(vec![decode(1), decode(2), decode(3)], load);
    let pick = h.pick(secs(0));
    assert_eq!(pick.reasons.decode, SelectionReason::RoundRobinStale);
    assert_eq!(h.decode_ids(4, secs(0)), vec![2, 3, 1, 2]);
}

#[test]
fn a_vllm_prefill_pool_rotates_round_robin_stale_while_decode_uses_load() {
    let vllm = SampleState::Fresh {
        active_decode_blocks: None,
        active_prefill_tokens: None,
        kv_used_blocks: Some(3),
    };
    let load = FakeLoad::default()
        .with("ns", 1, vllm)
        .with("ns", 11, vllm)
        .with("ns", 12, vllm);
    let mut h = Harness::new(vec![decode(1), prefill(11), prefill(12)], load);
    let pick = h.pick(secs(0));
    assert_eq!(pick.reasons.decode, SelectionReason::Load);
    assert_eq!(pick.reasons.prefill, SelectionReason::RoundRobinStale);
    assert_eq!(pick.prefill.map(|p| p.worker.instance_id.0), Some(11));
    assert_eq!(h.prefill_id(secs(0)), Some(12));
    assert_eq!(h.prefill_id(secs(0)), Some(11));
}

#[test]
fn without_load_signals_the_cursor_rotates_round_robin_and_records_nothing() {
    let load = FakeLoad::default().with("ns", 1, fresh_decode(99));
    let mut h = Harness::new(vec![decode(1), decode(2), prefill(11)], load);
    h.load_signals = false;
    let pick = h.pick(secs(0));
    assert_eq!(pick.reasons.decode, SelectionReason::RoundRobin);
    assert_eq!(pick.reasons.prefill, SelectionReason::RoundRobin);
    assert_eq!(pick.dispatch, None);
    assert!(h.state.ledger.is_empty());
    assert_eq!(h.decode_ids(3, secs(0)), vec![2, 1, 2]);
}

#[test]
fn dropped_samples_after_a_missed_change_read_as_quiet() {
    // A's held sample says busy (80/100): B (40/100) wins. The subscription saw a gap and dropped
    // A's samples, so A reads as never sampled: quiet, zero backlog, and it wins.
    let load = FakeLoad::default()
        .with("ns", 1, fresh_decode(80))
        .with("ns", 2, fresh_decode(40));
    let mut h = Harness::new(vec![decode(1), decode(2)], load);
    assert_eq!(h.decode_ids(1, secs(0)), vec![2]);
    h.load.0.remove(&(key("ns", 1), DpRank(0)));
    assert_eq!(h.decode_ids(1, secs(0)), vec![1]);
}

// ---- Unanswered dispatches and stalls -----------------------------------------------------------

#[test]
fn unanswered_dispatches_fill_a_quiet_worker_up_to_its_peers_load() {
    // A is quiet (never publishes), B reports 5 blocks. Each request is 2 blocks. A costs
    // 0+2, 2+2, 4+2 (vs B's 5+2) for three requests, then 6+2 > 7: B takes the fourth.
    let load = FakeLoad::default().with("ns", 2, fresh_decode(5));
    let mut h = Harness::new(vec![decode(1), decode(2)], load);
    assert_eq!(h.decode_ids(4, secs(0)), vec![1, 1, 1, 2]);
    let a = key("ns", 1);
    assert_eq!(
        h.state.ledger.backlog(&a, DpRank(0), secs(0)).decode_blocks,
        6
    );
}

#[test]
fn a_sample_answers_every_dispatch_before_it() {
    let load = FakeLoad::default().with("ns", 2, fresh_decode(5));
    let mut h = Harness::new(vec![decode(1), decode(2)], load);
    assert_eq!(h.decode_ids(4, secs(0)), vec![1, 1, 1, 2]);
    // A sample from A (any rank) clears its 6 blocks: A costs 2 again and wins.
    h.state.ledger.sample_arrived(&key("ns", 1), secs(1));
    assert_eq!(h.decode_ids(1, secs(1)), vec![1]);
}

#[test]
fn unanswered_dispatches_age_out_after_thirty_seconds() {
    let load = FakeLoad::default().with("ns", 2, fresh_decode(5));
    let mut h = Harness::new(vec![decode(1), decode(2)], load);
    h.tokens = 16 * 4; // 4 blocks: A goes 0+4 < 9, then 4+4 < 9, then 8+4 > 9.
    assert_eq!(h.decode_ids(3, secs(0)), vec![1, 1, 2]);
    // B's own dispatch ages out with A's; B reports 5 again. At 30 s A is back to 4 < 9.
    assert_eq!(h.decode_ids(1, secs(30)), vec![1]);
}

#[test]
fn a_stalled_rank_is_not_chosen_while_another_has_a_cost() {
    // A (0 blocks) takes a 2-block request at t=0 and never answers. At t=5 s A would cost
    // (0 + 2 + 2) / 100, cheaper than B's (50 + 2) / 100, but A is stalled: B wins.
    let load = FakeLoad::default()
        .with("ns", 1, fresh_decode(0))
        .with("ns", 2, fresh_decode(50));
    let mut h = Harness::new(vec![decode(1), decode(2)], load);
    assert_eq!(h.decode_ids(1, secs(0)), vec![1]);
    assert_eq!(h.decode_ids(1, Tick::from_millis(4_999)), vec![1]);
    let pick = h.pick(secs(5));
    assert_eq!(pick.decode.worker.instance_id.0, 2);
    assert_eq!(pick.reasons.decode, SelectionReason::Load);
    // A sample from A clears the stall.
    h.state.ledger.sample_arrived(&key("ns", 1), secs(6));
    assert_eq!(h.decode_ids(1, secs(6)), vec![1]);
}

#[test]
fn a_stall_lasts_until_the_request_ages_out() {
    let load = FakeLoad::default()
        .with("ns", 1, fresh_decode(0))
        .with("ns", 2, fresh_decode(50));
    let mut h = Harness::new(vec![decode(1), decode(2)], load);
    assert_eq!(h.decode_ids(1, secs(0)), vec![1]);
    assert_eq!(h.decode_ids(1, secs(29)), vec![2]);
    assert_eq!(h.decode_ids(1, secs(30)), vec![1]);
}

#[test]
fn a_one_block_request_never_marks_a_stall() {
    let load = FakeLoad::default()
        .with("ns", 1, fresh_decode(0))
        .with("ns", 2, fresh_decode(50));
    let mut h = Harness::new(vec![decode(1), decode(2)], load);
    h.tokens = 16;
    assert_eq!(h.decode_ids(1, secs(0)), vec![1]);
    assert_eq!(h.decode_ids(1, secs(10)), vec![1]);
}

#[test]
fn the_decode_half_of_a_pair_never_stalls_but_its_prefill_does() {
    // D1 (0 blocks) and P11 (0 tokens) serve the t=0 pair and never answer. At t=5 s D1 still
    // wins decode ((0 + 2 + 2) / 100 vs (50 + 2) / 100): the decode half is exempt. P11 is
    // stalled (a 2-block prefill), so P12 (500/1000, versus P11's 32/1000) takes the prefill.
    let load = FakeLoad::default()
        .with("ns", 1, fresh_decode(0))
        .with("ns", 2, fresh_decode(50))
        .with("ns", 11, fresh_prefill(0))
        .with("ns", 12, fresh_prefill(500));
    let mut h = Harness::new(vec![decode(1), decode(2), prefill(11), prefill(12)], load);
    let first = h.pick(secs(0));
    assert_eq!(first.decode.worker.instance_id.0, 1);
    assert_eq!(first.prefill.map(|p| p.worker.instance_id.0), Some(11));
    let later = h.pick(secs(5));
    assert_eq!(later.decode.worker.instance_id.0, 1);
    assert_eq!(later.prefill.map(|p| p.worker.instance_id.0), Some(12));
}

#[test]
fn an_ended_request_never_marks_a_stall() {
    let load = FakeLoad::default()
        .with("ns", 1, fresh_decode(0))
        .with("ns", 2, fresh_decode(50));
    let mut h = Harness::new(vec![decode(1), decode(2)], load);
    let first = h.pick(secs(0));
    assert_eq!(first.decode.worker.instance_id.0, 1);
    // Refused by the frontend: it may never have reached the engine.
    h.state
        .ledger
        .request_ended(first.dispatch.expect("load signals record dispatches"));
    // Its 2 blocks still count as backlog: A costs 4/100 and wins.
    assert_eq!(h.decode_ids(1, secs(5)), vec![1]);
}

#[test]
fn a_withdrawn_pick_adds_no_backlog() {
    let load = FakeLoad::default().with("ns", 2, fresh_decode(1));
    let mut h = Harness::new(vec![decode(1), decode(2)], load);
    // A (0 + 2) beats B (1 + 2); withdrawn, A has no backlog and wins again.
    for _ in 0..3 {
        let pick = h.pick(secs(0));
        assert_eq!(pick.decode.worker.instance_id.0, 1);
        h.state.ledger.withdraw(pick.dispatch.expect("recorded"));
    }
}

#[test]
fn stalled_ranks_compete_on_cost_when_every_ranked_candidate_is_stalled() {
    // Both take a request at t=0 (A first at 0+2, then B: A's 2+2 vs B's 1+2) and both stall.
    // At t=5 s A costs (0 + 2 + 2) / 100 and B (1 + 2 + 2) / 100: both stalled, A wins.
    let load = FakeLoad::default()
        .with("ns", 1, fresh_decode(0))
        .with("ns", 2, fresh_decode(1));
    let mut h = Harness::new(vec![decode(1), decode(2)], load);
    assert_eq!(h.decode_ids(2, secs(0)), vec![1, 2]);
    assert_eq!(h.decode_ids(1, secs(5)), vec![1]);
}

#[test]
fn a_stall_is_ignored_when_no_candidate_has_a_fresh_sample() {
    // Nobody ever published: round_robin_stale rotates A, B, A, ... and A's unanswered t=0
    // request does not keep it out at t=5 s.
    let mut h = Harness::new(vec![decode(1), decode(2)], FakeLoad::default());
    assert_eq!(h.decode_ids(1, secs(0)), vec![1]);
    let ids = h.decode_ids(2, secs(5));
    assert_eq!(ids, vec![2, 1]);
    let pick = h.pick(secs(5));
    assert_eq!(pick.reasons.decode, SelectionReason::RoundRobinStale);
}

// ---- Mixed namespaces ---------------------------------------------------------------------------

#[test]
fn aggregated_workers_sit_out_beside_a_prefill_decode_pool() {
    // The idle aggregated worker would be cheapest, but its namespace pairs prefill with decode.
    let load = FakeLoad::default()
        .with("ns", 1, fresh_decode(60))
        .with("ns", 21, fresh_decode(0));
    let candidates = vec![
        decode(1),
        prefill(11),
        cand("ns", 21, CandidateRole::Aggregated),
    ];
    let mut h = Harness::new(candidates, load);
    for t in 0..3 {
        let pick = h.pick(secs(t));
        assert_eq!(pick.decode.worker.instance_id.0, 1);
        assert_eq!(pick.prefill.map(|p| p.worker.instance_id.0), Some(11));
    }
}

#[test]
fn an_aggregated_decode_winner_gets_no_prefill_even_beside_prefill_workers() {
    // Prefill + aggregated, no decode worker: the aggregated worker decodes, alone.
    let candidates = vec![prefill(11), cand("ns", 21, CandidateRole::Aggregated)];
    let mut h = Harness::new(candidates, FakeLoad::default());
    let pick = h.pick(secs(0));
    assert_eq!(pick.decode.worker.instance_id.0, 21);
    assert_eq!(pick.decode.role, CandidateRole::Aggregated);
    assert_eq!(pick.prefill, None);
    assert_eq!(pick.reasons.prefill, SelectionReason::NoPrefillPool);
    assert_eq!(pick.reasons.labels()[1], ("prefill", "no_prefill_pool"));
}

#[test]
fn decode_and_aggregated_workers_compete_without_a_prefill_pool() {
    // Decode at 40/100 vs aggregated at 10/100: the aggregated worker wins; no prefill pool.
    let load = FakeLoad::default()
        .with("ns", 1, fresh_decode(38))
        .with("ns", 21, fresh_decode(8));
    let candidates = vec![decode(1), cand("ns", 21, CandidateRole::Aggregated)];
    let mut h = Harness::new(candidates, load);
    let pick = h.pick(secs(0));
    assert_eq!(pick.decode.worker.instance_id.0, 21);
    assert_eq!(pick.reasons.prefill, SelectionReason::NoPrefillPool);
    // A decode winner without a prefill pool is pinned alone too.
    let mut h = Harness::new(vec![decode(1)], FakeLoad::default());
    let pick = h.pick(secs(0));
    assert_eq!(
        (pick.prefill, pick.reasons.prefill),
        (None, SelectionReason::NoPrefillPool)
    );
}

#[test]
fn decode_is_compared_across_namespaces_then_prefill_within_the_winner() {
    // ns "a": busy decode (70/100), idle prefill. ns "b": idle decode, busy prefill (900/1000).
    // Decode goes to b, and the prefill stays in b despite a's idle prefill.
    let load = FakeLoad::default()
        .with("a", 1, fresh_decode(70))
        .with("a", 11, fresh_prefill(0))
        .with("b", 2, fresh_decode(0))
        .with("b", 12, fresh_prefill(900));
    let candidates = vec![
        cand("a", 1, CandidateRole::Decode),
        cand("a", 11, CandidateRole::Prefill),
        cand("b", 2, CandidateRole::Decode),
        cand("b", 12, CandidateRole::Prefill),
    ];
    let mut h = Harness::new(candidates, load);
    h.namespaces = vec![Namespace::new("a"), Namespace::new("b")];
    let pick = h.pick(secs(0));
    assert_eq!(pick.namespace, Namespace::new("b"));
    assert_eq!(pick.decode.worker, key("b", 2));
    assert_eq!(pick.prefill.map(|p| p.worker), Some(key("b", 12)));
}

#[test]
fn roles_are_judged_per_namespace() {
    // ns "a" has prefill + decode (its aggregated worker sits out); ns "b" has only an aggregated
    // worker, which stays a decode candidate and wins on cost (0 vs 60 blocks).
    let load = FakeLoad::default()
        .with("a", 1, fresh_decode(60))
        .with("a", 21, fresh_decode(0))
        .with("b", 22, fresh_decode(0));
    let candidates = vec![
        cand("a", 1, CandidateRole::Decode),
        cand("a", 11, CandidateRole::Prefill),
        cand("a", 21, CandidateRole::Aggregated),
        cand("b", 22, CandidateRole::Aggregated),
    ];
    let mut h = Harness::new(candidates, load);
    h.namespaces = vec![Namespace::new("a"), Namespace::new("b")];
    let pick = h.pick(secs(0));
    assert_eq!(pick.decode.worker, key("b", 22));
    assert_eq!(pick.prefill, None);
}

#[test]
fn ineligible_namespaces_and_other_models_are_never_chosen() {
    let mut other_model = decode(3);
    other_model.model = "other".into();
    let load = FakeLoad::default()
        .with("ns", 1, fresh_decode(90))
        .with("ns", 3, fresh_decode(0))
        .with("nopool", 2, fresh_decode(0));
    let candidates = vec![
        decode(1),
        cand("nopool", 2, CandidateRole::Decode),
        other_model,
    ];
    let mut h = Harness::new(candidates, load);
    assert_eq!(h.decode_ids(3, secs(0)), vec![1, 1, 1]);
}

#[test]
fn no_worker_for_the_model_falls_through() {
    let mut h = Harness::new(
        vec![cand("other", 1, CandidateRole::Decode)],
        FakeLoad::default(),
    );
    assert_eq!(
        h.outcome(secs(0)),
        PickOutcome::NoCandidates(NoCandidates::NoWorkerForModel)
    );
    let mut h = Harness::new(vec![prefill(11)], FakeLoad::default());
    assert_eq!(
        h.outcome(secs(0)),
        PickOutcome::NoCandidates(NoCandidates::NoDecodeWorker)
    );
    assert!(h.state.ledger.is_empty());
}

// ---- Ranks, cursors, labels ---------------------------------------------------------------------

#[test]
fn each_dp_rank_is_a_candidate_with_its_own_sample() {
    let ranks: Vec<_> = dp_ranks(4, Some(2)).expect("small range").collect();
    assert_eq!(
        ranks,
        vec![(Some(DpRank(4)), true), (Some(DpRank(5)), true)]
    );
    let candidates: Vec<_> = ranks
        .into_iter()
        .map(|(dp_rank, rank_declared)| Candidate {
            dp_rank,
            rank_declared,
            ..decode(1)
        })
        .collect();
    let mut load = FakeLoad::default();
    load.set("ns", 1, 4, fresh_decode(50));
    load.set("ns", 1, 5, fresh_decode(10));
    let mut h = Harness::new(candidates, load);
    let pick = h.pick(secs(0));
    assert_eq!(pick.decode.dp_rank, Some(DpRank(5)));
    assert_eq!(pick.decode.rank_header(), Some(DpRank(5)));
}

#[test]
fn rank_headers_are_sent_whenever_data_parallel_size_is_declared() {
    assert_eq!(
        dp_ranks(0, Some(0)).expect("zero").collect::<Vec<_>>(),
        vec![(Some(DpRank(0)), true)]
    );
    assert_eq!(
        dp_ranks(0, None).expect("undeclared").collect::<Vec<_>>(),
        vec![(None, false)]
    );
    assert_eq!(
        dp_ranks(0, Some(MAX_DP_RANKS_PER_WORKER + 1)).err(),
        Some(PickerError::TooManyRanks {
            size: MAX_DP_RANKS_PER_WORKER + 1
        })
    );
    assert_eq!(
        dp_ranks(u32::MAX, Some(2)).err(),
        Some(PickerError::RankOverflow {
            start: u32::MAX,
            size: 2
        })
    );
    let undeclared = Candidate {
        dp_rank: None,
        rank_declared: false,
        ..decode(1)
    };
    let mut h = Harness::new(
        vec![undeclared],
        FakeLoad::default().with("ns", 1, fresh_decode(1)),
    );
    let pick = h.pick(secs(0));
    assert_eq!(pick.decode.rank_header(), None);
    // Samples of an undeclared worker are keyed by rank 0.
    assert_eq!(pick.reasons.decode, SelectionReason::Load);
}

#[test]
fn cursors_are_kept_per_model() {
    // Two models alternating on one shared cursor would each see only even or odd offsets.
    let mut candidates = vec![decode(1), decode(2)];
    for id in [3, 4] {
        candidates.push(Candidate {
            model: "other".into(),
            ..decode(id)
        });
    }
    let mut h = Harness::new(candidates, FakeLoad::default());
    let namespaces = h.namespaces.clone();
    let mut seen = Vec::new();
    for _ in 0..2 {
        seen.extend(h.decode_ids(1, secs(0)));
        let req = PickRequest {
            model: "other",
            eligible_namespaces: &namespaces,
            estimated_prompt_tokens: TOKENS,
            load_signals: true,
        };
        match LoadBasedPicker.pick(&mut PickContext::new(
            &req,
            &h.candidates,
            &h.load,
            &mut h.state,
            secs(0),
        )) {
            PickOutcome::Picked(pick) => seen.push(pick.decode.worker.instance_id.0),
            PickOutcome::NoCandidates(why) => panic!("{why:?}"),
        }
    }
    assert_eq!(seen, vec![1, 3, 2, 4]);
    assert_eq!(h.state.cursor(MODEL, Phase::Decode), 2);
}

#[test]
fn selection_labels_are_a_closed_distinct_set() {
    let labels: Vec<_> = SelectionReason::ALL.iter().map(|r| r.as_label()).collect();
    assert_eq!(
        labels,
        vec![
            "load",
            "round_robin_stale",
            "round_robin",
            "no_prefill_pool",
            "kv_aware",
            "conditional_bypass"
        ]
    );
    assert_eq!(Phase::ALL.map(Phase::as_label), ["prefill", "decode"]);
}

#[test]
fn the_picker_is_object_safe_and_shareable() {
    let picker: std::sync::Arc<dyn DynamoWorkerPicker> =
        std::sync::Arc::new(LoadBasedPicker::new());
    assert_eq!(picker.name(), "load_based");
    let mut state = PickerState::new();
    let namespaces = [Namespace::new("ns")];
    let req = PickRequest {
        model: MODEL,
        eligible_namespaces: &namespaces,
        estimated_prompt_tokens: estimate_prompt_tokens(["hello"]),
        load_signals: true,
    };
    let outcome = picker.pick(&mut PickContext::new(
        &req,
        &[decode(1)],
        &NoLoad,
        &mut state,
        secs(0),
    ));
    assert!(matches!(outcome, PickOutcome::Picked(_)));
}

// ---- Properties ---------------------------------------------------------------------------------

pub(super) fn arb_sample() -> impl Strategy<Value = SampleState> {
    prop_oneof![
        Just(SampleState::Never),
        any::<bool>().prop_map(|b| SampleState::Stale {
            last_had_backlog: b
        }),
        (
            proptest::option::of(0u64..200),
            proptest::option::of(0u64..5000),
            proptest::option::of(0u64..200)
        )
            .prop_map(|(d, p, k)| SampleState::Fresh {
                active_decode_blocks: d,
                active_prefill_tokens: p,
                kv_used_blocks: k,
            }),
    ]
}

fn arb_role() -> impl Strategy<Value = CandidateRole> {
    prop_oneof![
        Just(CandidateRole::Prefill),
        Just(CandidateRole::Decode),
        Just(CandidateRole::Aggregated),
    ]
}

#[derive(Clone, Debug)]
pub(super) struct ArbCandidate {
    pub ns: usize,
    pub id: u64,
    pub role: CandidateRole,
    pub model: usize,
    pub ranks: u32,
    pub capacity: bool,
}

pub(super) fn arb_candidate() -> impl Strategy<Value = ArbCandidate> {
    (
        0usize..3,
        1u64..6,
        arb_role(),
        0usize..2,
        1u32..3,
        proptest::bool::weighted(0.8),
    )
        .prop_map(|(ns, id, role, model, ranks, capacity)| ArbCandidate {
            ns,
            id,
            role,
            model,
            ranks,
            capacity,
        })
}

/// One step of a random session: a pick, or a sample answering a worker's dispatches.
#[derive(Clone, Debug)]
enum Step {
    Pick {
        model: usize,
        tokens: u64,
        advance_ms: u64,
    },
    Sample {
        ns: usize,
        id: u64,
    },
    End {
        nth: usize,
    },
}

fn arb_step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0usize..2, 0u64..400, 0u64..7000)
            .prop_map(|(model, tokens, advance_ms)| Step::Pick { model, tokens, advance_ms }),
        1 => (0usize..3, 1u64..6).prop_map(|(ns, id)| Step::Sample { ns, id }),
        1 => (0usize..8).prop_map(|nth| Step::End { nth }),
    ]
}

pub(super) const NAMESPACES: [&str; 3] = ["a", "b", "c"];
pub(super) const MODELS: [&str; 2] = [MODEL, "other"];

proptest! {
    #[test]
    fn picks_stay_eligible_graph_local_and_never_pair_prefill_with_aggregated(
        arb in proptest::collection::vec(arb_candidate(), 0..14),
        samples in proptest::collection::vec(arb_sample(), 30),
        eligible_mask in 1usize..8,
        load_signals in proptest::bool::weighted(0.85),
        steps in proptest::collection::vec(arb_step(), 1..20),
    ) {
        // Worker ids are unique per namespace: the first occurrence of (ns, id) wins.
        let mut seen = std::collections::HashSet::new();
        let mut candidates = Vec::new();
        let mut load = FakeLoad::default();
        for (i, a) in arb.iter().enumerate() {
            if !seen.insert((a.ns, a.id)) {
                continue;
            }
            for (offset, (dp_rank, rank_declared)) in
                dp_ranks(0, Some(a.ranks)).expect("small").enumerate()
            {
                candidates.push(Candidate {
                    worker: key(NAMESPACES[a.ns], a.id),
                    role: a.role,
                    model: MODELS[a.model].into(),
                    dp_rank,
                    rank_declared,
                    block_size: a.capacity.then_some(if a.id % 2 == 0 { 16 } else { 32 }),
                    // Capacities 50 and 100 make equal ratios with different terms.
                    total_kv_blocks: a.capacity.then_some(if a.id % 3 == 0 { 50 } else { 100 }),
                    max_num_batched_tokens: a.capacity.then_some(1000),
                });
                load.set(
                    NAMESPACES[a.ns],
                    a.id,
                    offset as u32,
                    samples[(i * 3 + offset) % samples.len()],
                );
            }
        }
        let namespaces: Vec<Namespace> = (0..3)
            .filter(|i| eligible_mask & (1 << i) != 0)
            .map(|i| Namespace::new(NAMESPACES[i]))
            .collect();
        let mut state = PickerState::new();
        let mut now = Tick::ZERO;
        let mut dispatches = Vec::new();
        for step in steps {
            let (model, tokens) = match step {
                Step::Pick { model, tokens, advance_ms } => {
                    now = now.plus(Duration::from_millis(advance_ms));
                    (MODELS[model], tokens)
                }
                Step::Sample { ns, id } => {
                    state.ledger.sample_arrived(&key(NAMESPACES[ns], id), now);
                    continue;
                }
                Step::End { nth } => {
                    if !dispatches.is_empty() {
                        state.ledger.request_ended(dispatches[nth % dispatches.len()]);
                    }
                    continue;
                }
            };
            let req = PickRequest {
                model,
                eligible_namespaces: &namespaces,
                estimated_prompt_tokens: tokens,
                load_signals,
            };
            let serving: Vec<&Candidate> = candidates
                .iter()
                .filter(|c| &*c.model == model && namespaces.contains(&c.worker.namespace))
                .collect();
            let has = |ns: &Namespace, role| {
                serving.iter().any(|c| &c.worker.namespace == ns && c.role == role)
            };
            let pools = |ns: &Namespace| {
                has(ns, CandidateRole::Prefill) && has(ns, CandidateRole::Decode)
            };
            let decodable = serving.iter().any(|c| match c.role {
                CandidateRole::Decode => true,
                CandidateRole::Aggregated => !pools(&c.worker.namespace),
                CandidateRole::Prefill => false,
            });
            // Scores before the pick, for the cost-minimality check (the pick records a dispatch).
            let ledger_now = |c: &Candidate, st: &PickerState, phase| {
                let view = st.ledger.namespace(&c.worker.namespace);
                score(phase, c, load.sample(&c.worker, c.rank()), view, &mut RequestSize::new(tokens), now)
            };
            state.ledger.expire(now);
            let before: Vec<(Candidate, Scored)> = serving
                .iter()
                .map(|c| ((*c).clone(), ledger_now(c, &state, Phase::Decode)))
                .collect();
            let outcome = LoadBasedPicker.pick(&mut PickContext::new(&req, &candidates, &load, &mut state, now));
            let pick = match outcome {
                PickOutcome::NoCandidates(why) => {
                    prop_assert!(!decodable, "fell through with decodable candidates: {why:?}");
                    prop_assert_eq!(
                        why,
                        if serving.is_empty() {
                            NoCandidates::NoWorkerForModel
                        } else {
                            NoCandidates::NoDecodeWorker
                        }
                    );
                    continue;
                }
                PickOutcome::Picked(pick) => pick,
            };
            prop_assert!(decodable);
            if let Some(id) = pick.dispatch {
                dispatches.push(id);
            }
            let decode = serving
                .iter()
                .find(|c| c.worker == pick.decode.worker && c.dp_rank == pick.decode.dp_rank);
            prop_assert!(decode.is_some(), "decode winner is not an eligible candidate");
            let decode = decode.copied().expect("checked");
            prop_assert_eq!(&pick.namespace, &decode.worker.namespace);
            prop_assert!(decode.role != CandidateRole::Prefill);
            if decode.role == CandidateRole::Aggregated {
                prop_assert!(!pools(&decode.worker.namespace));
                prop_assert!(pick.prefill.is_none());
                prop_assert_eq!(pick.reasons.prefill, SelectionReason::NoPrefillPool);
            }
            match &pick.prefill {
                Some(p) => {
                    let prefill = serving
                        .iter()
                        .find(|c| c.worker == p.worker && c.dp_rank == p.dp_rank);
                    prop_assert!(prefill.is_some(), "prefill is not an eligible candidate");
                    let prefill = prefill.copied().expect("checked");
                    prop_assert_eq!(prefill.role, CandidateRole::Prefill);
                    prop_assert_eq!(&prefill.worker.namespace, &pick.namespace);
                    prop_assert_eq!(decode.role, CandidateRole::Decode);
                }
                None => {
                    // A decode winner is paired whenever its namespace has a prefill worker.
                    if decode.role == CandidateRole::Decode {
                        prop_assert!(!has(&pick.namespace, CandidateRole::Prefill));
                    }
                }
            }
            // Load selections are cost-minimal among the tier they came from.
            if pick.reasons.decode == SelectionReason::Load {
                let winner = before
                    .iter()
                    .find(|(c, _)| c.worker == decode.worker && c.dp_rank == decode.dp_rank)
                    .map(|(_, s)| *s)
                    .expect("winner was scored");
                let cost = winner.cost.expect("a load winner has a cost");
                for (c, s) in &before {
                    let competes = match c.role {
                        CandidateRole::Decode => true,
                        CandidateRole::Aggregated => !pools(&c.worker.namespace),
                        CandidateRole::Prefill => false,
                    };
                    if !competes {
                        continue;
                    }
                    if let Some(other) = s.cost {
                        if !s.stalled || winner.stalled {
                            prop_assert!(cost <= other, "{:?} beat by {:?}", winner, s);
                        }
                        if !s.stalled {
                            prop_assert!(!winner.stalled, "stalled winner beside a free cost");
                        }
                    }
                }
            }
        }
    }
}

// ---- Differential: the optimised picker against a naive reading of the rules ---------------------

/// The picker rules read as plainly as possible: filter, score every rank with an exact rational,
/// pick the cheapest tier's ties by cursor. No scratch buffers, no filters, no memoised sizes; the
/// ledger is read through its per-worker [`DispatchLedger::backlog`].
struct Reference {
    ledger: DispatchLedger,
    cursors: HashMap<String, [u64; 2]>,
}

impl Reference {
    fn new() -> Self {
        Self {
            ledger: DispatchLedger::new(),
            cursors: HashMap::new(),
        }
    }

    fn advance(&mut self, model: &str, phase: Phase) -> u64 {
        let slot = &mut self.cursors.entry(model.to_string()).or_default()[phase.index()];
        let value = *slot;
        *slot += 1;
        value
    }

    /// `(num, den)` of a rank's cost, or `None`; whether a fresh sample carries the phase's
    /// field; whether the ledger marks the rank stalled.
    fn cost(
        &self,
        phase: Phase,
        c: &Candidate,
        sample: SampleState,
        tokens: u64,
        now: Tick,
    ) -> (Option<(u64, u64)>, bool, bool) {
        let field = match (sample, phase) {
            (
                SampleState::Fresh {
                    active_prefill_tokens,
                    ..
                },
                Phase::Prefill,
            ) => active_prefill_tokens,
            (
                SampleState::Fresh {
                    active_decode_blocks,
                    kv_used_blocks,
                    ..
                },
                Phase::Decode,
            ) => active_decode_blocks.or(kv_used_blocks),
            _ => None,
        };
        let base = match sample {
            SampleState::Fresh { .. } => field,
            SampleState::Never => Some(0),
            SampleState::Stale { last_had_backlog } => (!last_had_backlog).then_some(0),
        };
        let backlog = self.ledger.backlog(&c.worker, c.rank(), now);
        let cost = base.and_then(|base| match phase {
            Phase::Prefill => {
                let den = c.max_num_batched_tokens.filter(|&d| d > 0)?;
                Some((base.saturating_add(backlog.prefill_tokens), den))
            }
            Phase::Decode => {
                let bs = u64::from(c.block_size.filter(|&b| b > 0)?);
                let den = c.total_kv_blocks.filter(|&d| d > 0)?;
                let blocks = tokens.div_ceil(bs);
                Some((
                    base.saturating_add(backlog.decode_blocks)
                        .saturating_add(blocks),
                    den,
                ))
            }
        });
        (cost, field.is_some(), backlog.stalled)
    }

    fn select<'c>(
        &mut self,
        phase: Phase,
        ranks: &[&'c Candidate],
        req: &PickRequest<'_>,
        load: &dyn LoadView,
        now: Tick,
    ) -> (&'c Candidate, SelectionReason) {
        let cursor = self.advance(req.model, phase);
        let rotate = |reason| (ranks[(cursor % ranks.len() as u64) as usize], reason);
        if !req.load_signals {
            return rotate(SelectionReason::RoundRobin);
        }
        let scored: Vec<_> = ranks
            .iter()
            .map(|c| {
                let sample = load.sample(&c.worker, c.rank());
                (
                    *c,
                    self.cost(phase, c, sample, req.estimated_prompt_tokens, now),
                )
            })
            .collect();
        if !scored.iter().any(|(_, (_, fresh, _))| *fresh) {
            return rotate(SelectionReason::RoundRobinStale);
        }
        let tier = |stalled: bool| -> Vec<(&'c Candidate, (u64, u64))> {
            scored
                .iter()
                .filter(|(_, (_, _, s))| *s == stalled)
                .filter_map(|(c, (cost, _, _))| cost.map(|cost| (*c, cost)))
                .collect()
        };
        let free = tier(false);
        let ranked = if free.is_empty() { tier(true) } else { free };
        if ranked.is_empty() {
            return rotate(SelectionReason::RoundRobin);
        }
        let below = |a: (u64, u64), b: (u64, u64)| {
            u128::from(a.0) * u128::from(b.1) < u128::from(b.0) * u128::from(a.1)
        };
        let best = ranked
            .iter()
            .map(|(_, cost)| *cost)
            .fold(ranked[0].1, |m, c| if below(c, m) { c } else { m });
        let ties: Vec<&Candidate> = ranked
            .iter()
            .filter(|(_, c)| !below(*c, best) && !below(best, *c))
            .map(|(c, _)| *c)
            .collect();
        (
            ties[(cursor % ties.len() as u64) as usize],
            SelectionReason::Load,
        )
    }

    fn pick(
        &mut self,
        req: &PickRequest<'_>,
        candidates: &[Candidate],
        load: &dyn LoadView,
        now: Tick,
    ) -> PickOutcome {
        self.ledger.expire(now);
        let serving: Vec<&Candidate> = candidates
            .iter()
            .filter(|c| {
                &*c.model == req.model && req.eligible_namespaces.contains(&c.worker.namespace)
            })
            .collect();
        if serving.is_empty() {
            return PickOutcome::NoCandidates(NoCandidates::NoWorkerForModel);
        }
        let has = |ns: &Namespace, role| {
            serving
                .iter()
                .any(|c| &c.worker.namespace == ns && c.role == role)
        };
        let pools =
            |ns: &Namespace| has(ns, CandidateRole::Prefill) && has(ns, CandidateRole::Decode);
        let decoders: Vec<&Candidate> = serving
            .iter()
            .copied()
            .filter(|c| match c.role {
                CandidateRole::Decode => true,
                CandidateRole::Aggregated => !pools(&c.worker.namespace),
                CandidateRole::Prefill => false,
            })
            .collect();
        if decoders.is_empty() {
            return PickOutcome::NoCandidates(NoCandidates::NoDecodeWorker);
        }
        let (decode, decode_reason) = self.select(Phase::Decode, &decoders, req, load, now);
        let ns = &decode.worker.namespace;
        let (prefill, prefill_reason) =
            if decode.role == CandidateRole::Decode && has(ns, CandidateRole::Prefill) {
                let prefills: Vec<&Candidate> = serving
                    .iter()
                    .copied()
                    .filter(|c| &c.worker.namespace == ns && c.role == CandidateRole::Prefill)
                    .collect();
                let (p, reason) = self.select(Phase::Prefill, &prefills, req, load, now);
                (Some(p), reason)
            } else {
                (None, SelectionReason::NoPrefillPool)
            };
        let tokens = req.estimated_prompt_tokens;
        let blocks = |c: &Candidate| {
            c.block_size
                .filter(|&b| b > 0)
                .map_or(0, |b| tokens.div_ceil(u64::from(b)))
        };
        let dispatch = req.load_signals.then(|| {
            let mut legs = Vec::new();
            if let Some(p) = prefill {
                legs.push(DispatchLeg {
                    worker: p.worker.clone(),
                    rank: p.rank(),
                    prefill_tokens: tokens,
                    decode_blocks: 0,
                    request_blocks: blocks(p),
                    stall_exempt: false,
                });
            }
            legs.push(DispatchLeg {
                worker: decode.worker.clone(),
                rank: decode.rank(),
                prefill_tokens: 0,
                decode_blocks: blocks(decode),
                request_blocks: blocks(decode),
                stall_exempt: prefill.is_some(),
            });
            self.ledger.record_dispatch(&legs, now)
        });
        PickOutcome::Picked(Pick {
            namespace: ns.clone(),
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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn the_picker_matches_a_naive_reference_on_random_fleets(
        arb in proptest::collection::vec(arb_candidate(), 0..40),
        samples in proptest::collection::vec(arb_sample(), 30),
        eligible_mask in 1usize..8,
        load_signals in proptest::bool::weighted(0.85),
        steps in proptest::collection::vec(arb_step(), 1..40),
    ) {
        let mut seen = std::collections::HashSet::new();
        let mut candidates = Vec::new();
        let mut load = FakeLoad::default();
        // One shared name per model, as the candidate index builds them.
        let models: [std::sync::Arc<str>; 2] = [MODELS[0].into(), MODELS[1].into()];
        for (i, a) in arb.iter().enumerate() {
            if !seen.insert((a.ns, a.id)) {
                continue;
            }
            for (offset, (dp_rank, rank_declared)) in
                dp_ranks(0, Some(a.ranks)).expect("small").enumerate()
            {
                candidates.push(Candidate {
                    worker: key(NAMESPACES[a.ns], a.id),
                    role: a.role,
                    model: models[a.model].clone(),
                    dp_rank,
                    rank_declared,
                    block_size: a.capacity.then_some(if a.id % 2 == 0 { 16 } else { 32 }),
                    total_kv_blocks: a.capacity.then_some(if a.id % 3 == 0 { 50 } else { 100 }),
                    max_num_batched_tokens: a.capacity.then_some(if a.id % 4 == 0 { 500 } else { 1000 }),
                });
                load.set(NAMESPACES[a.ns], a.id, offset as u32, samples[(i * 3 + offset) % samples.len()]);
            }
        }
        let namespaces: Vec<Namespace> = (0..3)
            .filter(|i| eligible_mask & (1 << i) != 0)
            .map(|i| Namespace::new(NAMESPACES[i]))
            .collect();
        let mut state = PickerState::new();
        let mut reference = Reference::new();
        let mut now = Tick::ZERO;
        let mut dispatches = Vec::new();
        for step in steps {
            let (model, tokens) = match step {
                Step::Pick { model, tokens, advance_ms } => {
                    now = now.plus(Duration::from_millis(advance_ms));
                    (MODELS[model], tokens)
                }
                Step::Sample { ns, id } => {
                    state.ledger.sample_arrived(&key(NAMESPACES[ns], id), now);
                    reference.ledger.sample_arrived(&key(NAMESPACES[ns], id), now);
                    continue;
                }
                Step::End { nth } => {
                    if !dispatches.is_empty() {
                        let id = dispatches[nth % dispatches.len()];
                        state.ledger.request_ended(id);
                        reference.ledger.request_ended(id);
                    }
                    continue;
                }
            };
            let req = PickRequest {
                model,
                eligible_namespaces: &namespaces,
                estimated_prompt_tokens: tokens,
                load_signals,
            };
            let fast = LoadBasedPicker.pick(&mut PickContext::new(&req, &candidates, &load, &mut state, now));
            let naive = reference.pick(&req, &candidates, &load, now);
            prop_assert_eq!(&fast, &naive);
            if let PickOutcome::Picked(Pick { dispatch: Some(id), .. }) = fast {
                dispatches.push(id);
            }
        }
    }
}

/// The load store read through `StoreView::sample` only: the per-rank view path.
pub(super) struct NoSlots<'a>(pub super::candidates::StoreView<'a>);

impl LoadView for NoSlots<'_> {
    fn sample(&self, worker: &WorkerKey, rank: DpRank) -> SampleState {
        self.0.sample(worker, rank)
    }
}

/// A `Step::Sample` of the fast-against-reference properties: `fresh` for worker `id`'s rank
/// `ns % 2`, received `now`; namespace 1's samples also answer the worker's legs in every
/// namespace of both states.
fn sample_step(
    store: &mut LoadStore,
    states: [&mut PickerState; 2],
    sequence: &mut u64,
    now: Tick,
    (ns, id): (usize, u64),
    fresh: SampleState,
) {
    if let Some(mut s) = stored(id, (ns % 2) as u32, fresh, *sequence) {
        s.received_at = now;
        store.apply(s);
        *sequence += 1;
    }
    if ns == 1 {
        for state in states {
            for n in NAMESPACES {
                state.ledger.sample_arrived(&key(n, id), now);
            }
        }
    }
}

/// A `Step::End` of the same properties: a publisher drops out, or time passes the freshness
/// bound.
fn end_step(store: &mut LoadStore, now: &mut Tick, nth: usize) {
    let gone = (nth % 5) as u64 + 1;
    if nth.is_multiple_of(2) {
        store.drop_publisher(crate::ids::PublisherId(gone));
    } else {
        *now = now.plus(Duration::from_millis(2500));
    }
}

pub(super) fn stored(id: u64, rank: u32, sample: SampleState, sequence: u64) -> Option<LoadSample> {
    let (fields, at) = match sample {
        SampleState::Never => return None,
        SampleState::Stale { last_had_backlog } => (
            (Some(u64::from(last_had_backlog) * 5), None, None),
            Tick::ZERO,
        ),
        SampleState::Fresh {
            active_decode_blocks,
            active_prefill_tokens,
            kv_used_blocks,
        } => (
            (active_decode_blocks, active_prefill_tokens, kv_used_blocks),
            secs(100),
        ),
    };
    Some(LoadSample {
        load: crate::event_plane::ActiveLoad {
            worker_id: InstanceId(id),
            dp_rank: DpRank(rank),
            active_decode_blocks: fields.0,
            active_prefill_tokens: fields.1,
            kv_used_blocks: fields.2,
        },
        publisher_id: crate::ids::PublisherId(id),
        sequence,
        published_at: crate::time::UnixMillis(0),
        received_at: at,
    })
}

use crate::load_store::{LoadSample, LoadStore};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// The production path (the layout built once, samples mirrored per row by load-store slot,
    /// slots re-resolved when a key gains or loses its sample, the mirror caught up from the
    /// store's change log, ledger legs laid onto rows) picks exactly what the per-rank view
    /// path picks, while samples are replaced, publishers dropped and workers evicted.
    #[test]
    fn the_slot_path_matches_the_view_path(
        arb in proptest::collection::vec(arb_candidate(), 0..40),
        samples in proptest::collection::vec(arb_sample(), 30),
        eligible_mask in 1usize..8,
        steps in proptest::collection::vec(arb_step(), 1..40),
    ) {
        let mut seen = std::collections::HashSet::new();
        let mut candidates = Vec::new();
        let mut store = LoadStore::new();
        store.set_live_and_retain((1..6).map(InstanceId));
        let mut sequence = 1;
        let models: [std::sync::Arc<str>; 2] = [MODELS[0].into(), MODELS[1].into()];
        for (i, a) in arb.iter().enumerate() {
            if !seen.insert((a.ns, a.id)) {
                continue;
            }
            for (offset, (dp_rank, rank_declared)) in
                dp_ranks(0, Some(a.ranks)).expect("small").enumerate()
            {
                candidates.push(Candidate {
                    worker: key(NAMESPACES[a.ns], a.id),
                    role: a.role,
                    model: models[a.model].clone(),
                    dp_rank,
                    rank_declared,
                    block_size: a.capacity.then_some(16),
                    total_kv_blocks: a.capacity.then_some(if a.id % 3 == 0 { 50 } else { 100 }),
                    max_num_batched_tokens: a.capacity.then_some(1000),
                });
                if let Some(s) = stored(a.id, offset as u32, samples[(i * 3 + offset) % samples.len()], sequence) {
                    store.apply(s);
                    sequence += 1;
                }
            }
        }
        let layout = DenseRanks::build(&candidates);
        let namespaces: Vec<Namespace> = (0..3)
            .filter(|i| eligible_mask & (1 << i) != 0)
            .map(|i| Namespace::new(NAMESPACES[i]))
            .collect();
        let (mut slotted, mut viewed) = (PickerState::new(), PickerState::new());
        let mut now = secs(100);
        for (n, step) in steps.into_iter().enumerate() {
            match step {
                Step::Pick { model, tokens, .. } => {
                    let req = PickRequest {
                        model: MODELS[model],
                        eligible_namespaces: &namespaces,
                        estimated_prompt_tokens: tokens,
                        load_signals: true,
                    };
                    let view = super::candidates::StoreView { store: &store, now, max_age: Duration::from_secs(3) };
                    let fast = LoadBasedPicker.pick(
                        &mut PickContext::new(&req, &candidates, &view, &mut slotted, now).with_layout(&layout),
                    );
                    let plain = NoSlots(super::candidates::StoreView { store: &store, now, max_age: Duration::from_secs(3) });
                    let slow = LoadBasedPicker.pick(&mut PickContext::new(&req, &candidates, &plain, &mut viewed, now));
                    prop_assert_eq!(fast, slow);
                }
                Step::Sample { id, .. } => {
                    // A new sample for rank 0 (a slot gained or replaced), every other one after
                    // dropping the worker's samples (slots freed and reused).
                    if n % 2 == 0 {
                        store.drop_publisher(crate::ids::PublisherId(id));
                    }
                    let fresh = SampleState::Fresh {
                        active_decode_blocks: Some(id * 7 % 50),
                        active_prefill_tokens: Some(id * 11 % 300),
                        kv_used_blocks: None,
                    };
                    if let Some(s) = stored(id, 0, fresh, sequence) {
                        store.apply(s);
                        sequence += 1;
                    }
                    now = now.plus(Duration::from_millis(500));
                }
                Step::End { nth } => {
                    // A worker leaves the live set: its samples are evicted.
                    let gone = (nth % 5) as u64 + 1;
                    store.set_live_and_retain((1..6).filter(|&i| i != gone).map(InstanceId));
                }
            }
        }
    }
}

#[test]
fn slots_are_resolved_once_per_layout_and_store_epoch() {
    let candidates = vec![decode(1), decode(2)];
    let layout = DenseRanks::build(&candidates);
    let mut store = LoadStore::new();
    store.set_live_and_retain([InstanceId(1), InstanceId(2)]);
    let fresh = SampleState::Fresh {
        active_decode_blocks: Some(10),
        active_prefill_tokens: None,
        kv_used_blocks: None,
    };
    store.apply(stored(1, 0, fresh, 1).expect("a sample"));
    let namespaces = [Namespace::new("ns")];
    let req = PickRequest {
        model: MODEL,
        eligible_namespaces: &namespaces,
        estimated_prompt_tokens: TOKENS,
        load_signals: true,
    };
    let mut state = PickerState::new();
    let pick = |store: &LoadStore, state: &mut PickerState| {
        let view = super::candidates::StoreView {
            store,
            now: secs(100),
            max_age: Duration::from_secs(3),
        };
        match LoadBasedPicker.pick(
            &mut PickContext::new(&req, &candidates, &view, state, secs(100)).with_layout(&layout),
        ) {
            PickOutcome::Picked(pick) => pick.decode.worker.instance_id.0,
            PickOutcome::NoCandidates(why) => panic!("{why:?}"),
        }
    };
    // Worker 2 was never sampled (quiet, cost 2/100) and beats worker 1 (12/100).
    assert_eq!(pick(&store, &mut state), 2);
    assert_eq!(pick(&store, &mut state), 2);
    assert_eq!(
        state.slots.resolutions(),
        1,
        "same layout and epoch: no re-resolution"
    );
    // Replacing a held sample keeps the epoch; its new value is read through the same slot.
    store.apply(
        stored(
            1,
            0,
            SampleState::Fresh {
                active_decode_blocks: Some(0),
                active_prefill_tokens: None,
                kv_used_blocks: None,
            },
            2,
        )
        .expect("a sample"),
    );
    state.ledger = DispatchLedger::new();
    assert_eq!(
        pick(&store, &mut state),
        1,
        "1 now costs 2/100 and wins the tie on the cursor"
    );
    assert_eq!(state.slots.resolutions(), 1);
    // Worker 2's first sample gives it a slot: the epoch changes and slots are resolved again.
    store.apply(
        stored(
            2,
            0,
            SampleState::Fresh {
                active_decode_blocks: Some(90),
                active_prefill_tokens: None,
                kv_used_blocks: None,
            },
            3,
        )
        .expect("a sample"),
    );
    state.ledger = DispatchLedger::new();
    assert_eq!(pick(&store, &mut state), 1);
    assert_eq!(state.slots.resolutions(), 2);
}

#[test]
fn the_row_mirror_catches_up_from_the_store_change_log_and_equals_a_reread() {
    use super::dense::{RowSample, SlotCache};
    let candidates: Vec<Candidate> = (1..=64).map(decode).collect();
    let layout = DenseRanks::build(&candidates);
    let mut store = LoadStore::new();
    store.set_live_and_retain((1..=64).map(InstanceId));
    let mut sequence = 1;
    let mut write = |store: &mut LoadStore, id: u64, blocks: u64| {
        let sample = SampleState::Fresh {
            active_decode_blocks: (!blocks.is_multiple_of(5)).then_some(blocks),
            active_prefill_tokens: Some(blocks * 3),
            kv_used_blocks: Some(blocks + 1),
        };
        let mut s = stored(id, 0, sample, sequence).expect("a sample");
        s.received_at = Tick(Duration::from_millis(sequence));
        sequence += 1;
        store.apply(s);
    };
    for id in (1..=64).filter(|id| id % 4 != 0) {
        write(&mut store, id, id);
    }
    let mut cache = SlotCache::default();
    let reread = |store: &LoadStore| -> Vec<RowSample> {
        candidates
            .iter()
            .map(|c| RowSample::of(store.latest(c.worker.instance_id, c.rank())))
            .collect()
    };
    assert_eq!(cache.samples(&layout, &store), &reread(&store)[..]);
    assert_eq!((cache.resolutions(), cache.refills()), (1, 0));
    // A few held samples replaced: caught up from the log, no re-read.
    for id in [1, 2, 3, 5] {
        write(&mut store, id, id * 10);
    }
    assert_eq!(cache.samples(&layout, &store), &reread(&store)[..]);
    assert_eq!((cache.resolutions(), cache.refills()), (1, 0));
    // More than an eighth of the rows: re-read whole.
    for id in (1..=40).filter(|id| id % 4 != 0) {
        write(&mut store, id, id * 7);
    }
    assert_eq!(cache.samples(&layout, &store), &reread(&store)[..]);
    assert_eq!((cache.resolutions(), cache.refills()), (1, 1));
    // A rank's first sample moves the epoch: slots resolved again.
    write(&mut store, 4, 9);
    assert_eq!(cache.samples(&layout, &store), &reread(&store)[..]);
    assert_eq!((cache.resolutions(), cache.refills()), (2, 1));
    // Nothing written: nothing read.
    assert_eq!(cache.samples(&layout, &store), &reread(&store)[..]);
    assert_eq!((cache.resolutions(), cache.refills()), (2, 1));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// On pools where every rank is a candidate of one capacity (one model, every namespace
    /// eligible, no prefill pool), the production path reads the mirror's decode column
    /// (`dense::DecodeColumn`, patched per re-read row and rebuilt when a sample ages out) and
    /// sets the ledger's backlogged rows aside: it picks exactly what the per-rank view path
    /// picks while samples arrive at different times and age out, and dispatches pile up.
    #[test]
    fn the_column_path_matches_the_view_path_on_uniform_pools(
        arb in proptest::collection::vec(arb_candidate(), 1..40),
        samples in proptest::collection::vec(arb_sample(), 30),
        aggregated in any::<bool>(),
        steps in proptest::collection::vec(arb_step(), 1..60),
        huge in proptest::bool::weighted(0.1),
    ) {
        let mut seen = std::collections::HashSet::new();
        let mut candidates = Vec::new();
        let mut store = LoadStore::new();
        store.set_live_and_retain((1..6).map(InstanceId));
        let mut sequence = 1;
        let model: std::sync::Arc<str> = MODELS[0].into();
        let role = if aggregated { CandidateRole::Aggregated } else { CandidateRole::Decode };
        for (i, a) in arb.iter().enumerate() {
            if !seen.insert((a.ns, a.id)) {
                continue;
            }
            for (offset, (dp_rank, rank_declared)) in
                dp_ranks(0, Some(a.ranks)).expect("small").enumerate()
            {
                candidates.push(Candidate {
                    worker: key(NAMESPACES[a.ns], a.id),
                    role,
                    model: model.clone(),
                    dp_rank,
                    rank_declared,
                    block_size: Some(16),
                    total_kv_blocks: Some(100),
                    max_num_batched_tokens: Some(1000),
                });
                if let Some(s) = stored(a.id, offset as u32, samples[(i * 3 + offset) % samples.len()], sequence) {
                    store.apply(s);
                    sequence += 1;
                }
            }
        }
        let layout = DenseRanks::build(&candidates);
        let namespaces: Vec<Namespace> = NAMESPACES.iter().map(|&n| Namespace::new(n)).collect();
        let (mut slotted, mut viewed) = (PickerState::new(), PickerState::new());
        let mut now = secs(100);
        for step in steps {
            match step {
                Step::Pick { tokens, advance_ms, .. } => {
                    now = now.plus(Duration::from_millis(advance_ms % 1500));
                    let req = PickRequest {
                        model: MODELS[0],
                        eligible_namespaces: &namespaces,
                        estimated_prompt_tokens: tokens,
                        load_signals: true,
                    };
                    let view = super::candidates::StoreView { store: &store, now, max_age: Duration::from_secs(3) };
                    let fast = LoadBasedPicker.pick(
                        &mut PickContext::new(&req, &candidates, &view, &mut slotted, now).with_layout(&layout),
                    );
                    let plain = NoSlots(super::candidates::StoreView { store: &store, now, max_age: Duration::from_secs(3) });
                    let slow = LoadBasedPicker.pick(&mut PickContext::new(&req, &candidates, &plain, &mut viewed, now));
                    prop_assert_eq!(fast, slow);
                }
                Step::Sample { ns, id } => {
                    // A new sample for one rank, received now (a fresh field of `u64::MAX`
                    // now and then: the column's "no cost" value).
                    let decode = if huge { u64::MAX - (id % 2) } else { id * 7 % 50 + ns as u64 };
                    let fresh = SampleState::Fresh {
                        active_decode_blocks: (ns != 2).then_some(decode),
                        active_prefill_tokens: Some(id * 11 % 300),
                        kv_used_blocks: None,
                    };
                    let states = [&mut slotted, &mut viewed];
                    sample_step(&mut store, states, &mut sequence, now, (ns, id), fresh);
                }
                Step::End { nth } => end_step(&mut store, &mut now, nth),
            }
        }
    }
}

/// Decode blocks past which `the_fast_slots_match_the_generic_pass` shifts samples: none, near
/// 2^51 (costs over different capacities then round to one `f64` while their exact ratios
/// differ), just below 2^53 and near `u64::MAX` (the fast pass hands over to the generic one).
const SHIFTS: [u64; 4] = [0, 1 << 51, (1 << 53) - 300, u64::MAX - 400];

fn shifted(sample: SampleState, shift: u64) -> SampleState {
    match sample {
        SampleState::Fresh {
            active_decode_blocks,
            active_prefill_tokens,
            kv_used_blocks,
        } => SampleState::Fresh {
            active_decode_blocks: active_decode_blocks.map(|d| d.saturating_add(shift)),
            active_prefill_tokens,
            kv_used_blocks: kv_used_blocks.map(|d| d.saturating_add(shift)),
        },
        other => other,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    /// Peer slots: the production path's fast pass (`load_based::decide_slots`, the free tier's
    /// `count` lowest kept while the rows are walked) takes the same slot and records the same
    /// peers' slots as the generic pass and its re-walk into the whole tie set (the per-rank view
    /// path), for every place, window and fleet: mixed capacities, stalls, backlogs, costs
    /// whose `f64` values tie while their exact ratios differ, and numerators past 2^53.
    #[test]
    fn the_fast_slots_match_the_generic_pass(
        arb in proptest::collection::vec(arb_candidate(), 1..40),
        samples in proptest::collection::vec(arb_sample(), 30),
        steps in proptest::collection::vec(arb_step(), 1..40),
        (count, index) in (2usize..10).prop_flat_map(|c| (Just(c), 0..c)),
        window in prop_oneof![Just(0.25), Just(1.0), Just(2.0), Just(8.0), Just(16.0)],
        shift in prop::sample::select(SHIFTS.to_vec()),
        odd_capacity in any::<bool>(),
        single_pool in any::<bool>(),
    ) {
        let mut seen = std::collections::HashSet::new();
        let mut candidates = Vec::new();
        let mut store = LoadStore::new();
        store.set_live_and_retain((1..6).map(InstanceId));
        let mut sequence = 1;
        let models: [std::sync::Arc<str>; 2] = [MODELS[0].into(), MODELS[1].into()];
        // A single pool (one model, one role, one capacity, every namespace eligible): the
        // decode column's pass (`load_based::column_slots`).
        let capacities: [u64; 3] = match (single_pool, odd_capacity) {
            (true, _) => [100; 3],
            (false, true) => [3, 7, 1_000_003],
            (false, false) => [50, 100, 100],
        };
        let arb: Vec<ArbCandidate> = arb
            .into_iter()
            .map(|a| if single_pool {
                ArbCandidate { model: 0, role: CandidateRole::Decode, capacity: true, ..a }
            } else {
                a
            })
            .collect();
        for (i, a) in arb.iter().enumerate() {
            if !seen.insert((a.ns, a.id)) {
                continue;
            }
            for (offset, (dp_rank, rank_declared)) in
                dp_ranks(0, Some(a.ranks)).expect("small").enumerate()
            {
                candidates.push(Candidate {
                    worker: key(NAMESPACES[a.ns], a.id),
                    role: a.role,
                    model: models[a.model].clone(),
                    dp_rank,
                    rank_declared,
                    // One block size (the fast pass's layout); a missing capacity scores none.
                    block_size: Some(16),
                    total_kv_blocks: a.capacity.then_some(capacities[a.id as usize % 3]),
                    max_num_batched_tokens: a.capacity.then_some(1000),
                });
                let sample = shifted(samples[(i * 3 + offset) % samples.len()], shift);
                if let Some(s) = stored(a.id, offset as u32, sample, sequence) {
                    store.apply(s);
                    sequence += 1;
                }
            }
        }
        let layout = DenseRanks::build(&candidates);
        let namespaces: Vec<Namespace> = NAMESPACES.iter().map(|&n| Namespace::new(n)).collect();
        let state = || {
            let mut state = PickerState::new();
            state.tie.set(tie_break::TieBreak { window, seed: 7, peer_slots: true });
            state.ledger.set_place(tie_break::Place::new(index, count));
            state
        };
        let (mut slotted, mut viewed) = (state(), state());
        let mut now = secs(100);
        for step in steps {
            match step {
                Step::Pick { model, tokens, advance_ms } => {
                    now = now.plus(Duration::from_millis(advance_ms % 1500));
                    let req = PickRequest {
                        model: MODELS[if single_pool { 0 } else { model }],
                        eligible_namespaces: &namespaces,
                        estimated_prompt_tokens: tokens,
                        load_signals: true,
                    };
                    let view = super::candidates::StoreView { store: &store, now, max_age: Duration::from_secs(3) };
                    let fast = LoadBasedPicker.pick(
                        &mut PickContext::new(&req, &candidates, &view, &mut slotted, now).with_layout(&layout),
                    );
                    let plain = NoSlots(super::candidates::StoreView { store: &store, now, max_age: Duration::from_secs(3) });
                    let slow = LoadBasedPicker.pick(&mut PickContext::new(&req, &candidates, &plain, &mut viewed, now));
                    prop_assert_eq!(fast, slow);
                    prop_assert_eq!(&slotted.scratch.peers, &viewed.scratch.peers);
                    prop_assert_eq!(slotted.ledger.peer_legs(), viewed.ledger.peer_legs());
                }
                Step::Sample { ns, id } => {
                    let fresh = shifted(SampleState::Fresh {
                        active_decode_blocks: (ns != 2).then_some(id * 7 % 50 + ns as u64),
                        active_prefill_tokens: Some(id * 11 % 300),
                        kv_used_blocks: None,
                    }, shift);
                    let states = [&mut slotted, &mut viewed];
                    sample_step(&mut store, states, &mut sequence, now, (ns, id), fresh);
                }
                Step::End { nth } => end_step(&mut store, &mut now, nth),
            }
        }
    }
}
