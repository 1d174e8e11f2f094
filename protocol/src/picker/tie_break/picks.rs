//! The tie-break through both pickers: replicas with one identical view spread their picks, a
//! pick never leaves the tie set (nor, KV-aware, trades cached blocks away), the window 0 picks
//! as before, and a seed replays.

use std::collections::BTreeSet;
use std::time::Duration;

use super::super::tests::{FakeLoad, key};
use super::super::*;
use super::TieBreak;
use crate::ids::InstanceId;
use crate::kv::hashing::BlockSize;
use crate::kv::index::RankOverlap;

const MODEL: &str = "m";

/// Block size 16, 1,000 KV blocks, a prefill budget of 1,000 tokens.
pub(super) fn cand(id: u64, role: CandidateRole) -> Candidate {
    Candidate {
        worker: key("ns", id),
        role,
        model: MODEL.into(),
        dp_rank: Some(DpRank(0)),
        rank_declared: true,
        block_size: Some(16),
        total_kv_blocks: Some(1000),
        max_num_batched_tokens: Some(1000),
    }
}

pub(super) fn fresh(blocks: u64) -> SampleState {
    SampleState::Fresh {
        active_decode_blocks: Some(blocks),
        active_prefill_tokens: None,
        kv_used_blocks: None,
    }
}

fn now() -> Tick {
    Tick(Duration::from_secs(100))
}

/// A fleet of `loads.len()` workers (ids 1..) of `role`, each with its fresh decode blocks.
pub(super) fn fleet(loads: &[u64], role: CandidateRole) -> (Vec<Candidate>, FakeLoad) {
    let mut load = FakeLoad::default();
    let mut candidates = Vec::new();
    for (i, blocks) in loads.iter().enumerate() {
        let id = i as u64 + 1;
        candidates.push(cand(id, role));
        load = load.with("ns", id, fresh(*blocks));
    }
    (candidates, load)
}

fn state(window: f64, replica: &str) -> PickerState {
    let mut state = PickerState::new();
    state.tie.set(TieBreak {
        window,
        seed: TieBreak::seed_of(replica),
        peer_slots: false,
    });
    state
}

/// One pick's decode id; `kv` = (isl, overlaps by worker id) for the KV-aware picker, else the
/// load-based one with a 32-token request.
pub(super) fn pick(
    candidates: &[Candidate],
    load: &FakeLoad,
    state: &mut PickerState,
    kv: Option<(u64, &[(u64, u32)])>,
) -> u64 {
    let namespaces = [Namespace::new("ns")];
    let req = PickRequest {
        model: MODEL,
        eligible_namespaces: &namespaces,
        estimated_prompt_tokens: kv.map_or(32, |(isl, _)| isl),
        load_signals: true,
    };
    let mut ctx = PickContext::new(&req, candidates, load, state, now());
    let outcome = match kv {
        None => LoadBasedPicker.pick(&mut ctx),
        Some((isl, list)) => {
            let mut ranks: Vec<RankOverlap> = list
                .iter()
                .map(|&(id, blocks)| RankOverlap {
                    worker: InstanceId(id),
                    dp_rank: DpRank(0),
                    blocks,
                })
                .collect();
            ranks.sort();
            let overlaps = [BlockOverlaps {
                block_size: BlockSize::new(16).expect("valid"),
                ranks,
            }];
            let input = KvPickInput {
                isl,
                overlaps: &overlaps,
                unit: 0.0,
            };
            KvAwarePicker::new(KvPickParams::default())
                .pick_kv(&mut ctx, Ok(&input))
                .outcome
        }
    };
    match outcome {
        PickOutcome::Picked(pick) => pick.decode.worker.instance_id.0,
        PickOutcome::NoCandidates(why) => panic!("expected a pick, got {why:?}"),
    }
}

/// Each of 32 replicas' first pick on one identical view.
fn first_picks(
    window: f64,
    loads: &[u64],
    role: CandidateRole,
    kv: Option<(u64, &[(u64, u32)])>,
) -> Vec<u64> {
    let (candidates, load) = fleet(loads, role);
    (0..32)
        .map(|r| {
            pick(
                &candidates,
                &load,
                &mut state(window, &format!("router-{r}")),
                kv,
            )
        })
        .collect()
}

#[test]
fn identical_views_spread_across_replicas_in_both_pickers() {
    let loads = [10; 8];
    let kv: &[(u64, u32)] = &[];
    for (role, kv) in [
        (CandidateRole::Decode, None),
        (CandidateRole::Aggregated, Some((64, kv))),
    ] {
        // Without the tie-break every replica goes to the same worker: the herd.
        let herd = first_picks(0.0, &loads, role, kv);
        assert!(herd.iter().all(|&id| id == herd[0]), "{herd:?}");
        let spread = first_picks(1.0, &loads, role, kv);
        let distinct = spread.iter().collect::<BTreeSet<_>>().len();
        assert!(distinct >= 6, "{role:?}: {spread:?}");
    }
}

#[test]
fn a_pick_never_leaves_the_tie_set() {
    // A 32-token request is 2 blocks: at window 1 the tie set is the workers within 2 blocks of
    // the lowest (loads 5, 6, 7), never 8 or more.
    let loads = [9, 5, 40, 7, 6, 8, 100, 5];
    let (candidates, load) = fleet(&loads, CandidateRole::Decode);
    let mut seen = BTreeSet::new();
    for r in 0..64 {
        let mut s = state(1.0, &format!("replica-{r}"));
        for _ in 0..4 {
            // A fresh state each time would hide the ledger; one state's own dispatches count.
            seen.insert(pick(&candidates, &load, &mut s, None));
            s.ledger = DispatchLedger::default();
        }
    }
    assert_eq!(
        seen,
        BTreeSet::from([2, 4, 5, 8]),
        "workers with loads 5, 7, 6, 5"
    );
}

#[test]
fn kv_aware_ties_never_trade_cached_blocks_away() {
    // isl 64 = 4 blocks, window 4 (a slack of 16 blocks): worker 3 holds 2 of the prompt's
    // blocks (cost 4 lower) and wins every draw; the others tie among themselves only when
    // nobody holds more.
    let loads = [10; 6];
    let held: &[(u64, u32)] = &[(3, 2)];
    let picks = first_picks(4.0, &loads, CandidateRole::Aggregated, Some((64, held)));
    assert!(picks.iter().all(|&id| id == 3), "{picks:?}");
    // Two workers hold the same prefix: the draw spreads between those two, not elsewhere.
    let held: &[(u64, u32)] = &[(3, 2), (5, 2)];
    let (candidates, load) = fleet(&loads, CandidateRole::Aggregated);
    let picks: BTreeSet<u64> = (0..32)
        .map(|r| {
            let mut s = state(4.0, &format!("r{r}"));
            pick(&candidates, &load, &mut s, Some((64, held)))
        })
        .collect();
    assert_eq!(picks, BTreeSet::from([3, 5]));
}

#[test]
fn a_single_candidate_is_always_chosen_and_a_seed_replays() {
    let (candidates, load) = fleet(&[50], CandidateRole::Decode);
    for r in 0..16 {
        assert_eq!(
            pick(&candidates, &load, &mut state(16.0, &format!("{r}")), None),
            1
        );
    }
    let loads = [10, 11, 10, 12, 10, 11, 10, 10];
    let (candidates, load) = fleet(&loads, CandidateRole::Decode);
    let run = |replica: &str| -> Vec<u64> {
        let mut s = state(1.0, replica);
        (0..20)
            .map(|_| pick(&candidates, &load, &mut s, None))
            .collect()
    };
    assert_eq!(run("router-a"), run("router-a"));
    assert_ne!(run("router-a"), run("router-b"));
}
