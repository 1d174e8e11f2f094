//! Table tests of [`decide`]: one row per branch (eligibility, no candidates, no pick, each path
//! class, the reachability gate, the KV outcomes and the parity target).

use std::cell::Cell;
use std::time::Duration;

use super::*;
use crate::ids::{PublisherId, WorkerKey};
use crate::kv::hashing::BlockSize;
use crate::kv::index::RankOverlap;
use crate::picker::{
    BlockOverlaps, CandidateRole, ConditionalDisaggregation, KvAwarePicker, KvPickParams,
    LoadBasedPicker,
};

const MODEL: &str = "m";

fn cand(ns: &str, id: u64, role: CandidateRole) -> Candidate {
    Candidate {
        worker: WorkerKey {
            namespace: Namespace::new(ns),
            instance_id: InstanceId(id),
        },
        role,
        model: MODEL.into(),
        dp_rank: Some(DpRank(0)),
        rank_declared: true,
        block_size: Some(16),
        total_kv_blocks: Some(100),
        max_num_batched_tokens: Some(1000),
    }
}

fn dec(id: u64) -> Candidate {
    cand("ns", id, CandidateRole::Decode)
}
fn pre(id: u64) -> Candidate {
    cand("ns", id, CandidateRole::Prefill)
}
fn agg(id: u64) -> Candidate {
    cand("ns", id, CandidateRole::Aggregated)
}

fn now() -> Tick {
    Tick(Duration::from_secs(100))
}

/// Overlaps at block size 16 (sorted, zeros omitted).
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
        block_size: BlockSize::new(16).expect("valid"),
        ranks,
    }]
}

/// One row: the fleet, which namespaces have a usable replica, the KV input, unreachable workers.
struct Row<'a> {
    namespaces: &'a [(&'a str, bool)],
    candidates: Vec<Candidate>,
    kv: Option<Result<(u64, Vec<BlockOverlaps>), KvUnavailable>>,
    unreachable: &'a [u64],
    picker: &'a dyn DynamoWorkerPicker,
}

impl Row<'_> {
    /// The decision, and how often the prompt estimate was asked for.
    fn decide(&self) -> (Decision, u32) {
        let mut store = LoadStore::new();
        let live: Vec<InstanceId> = self
            .candidates
            .iter()
            .map(|c| c.worker.instance_id)
            .collect();
        store.set_live_and_retain(live);
        store.mark_unreachable(
            PublisherId(1),
            self.unreachable.iter().map(|id| InstanceId(*id)),
            now(),
        );
        let asked = Cell::new(0);
        let estimate = || {
            asked.set(asked.get() + 1);
            7
        };
        let kv = self.kv.as_ref().map(|kv| match kv {
            Ok((isl, overlaps)) => Ok(KvPickInput {
                isl: *isl,
                overlaps,
                unit: 0.0,
            }),
            Err(why) => Err(*why),
        });
        let input = DecisionInput {
            model: MODEL,
            namespaces: self
                .namespaces
                .iter()
                .map(|(ns, usable)| (Namespace::new(*ns), *usable))
                .collect(),
            candidates: &self.candidates,
            layout: None,
            estimate_prompt_tokens: &estimate,
            load_signals: true,
            kv,
            now: now(),
            max_age: Duration::from_secs(5),
        };
        let decision = decide(input, self.picker, &store, &mut PickerState::new());
        (decision, asked.get())
    }
}

fn routed(decision: Decision) -> Routed {
    match decision {
        Decision::Route(routed) => routed,
        Decision::Skip(skip) => panic!("expected a pick, got {skip:?}"),
    }
}

/// (decode worker, prefill worker) ids.
type Pins = (u64, Option<u64>);

/// A KV row's input.
type KvRowInput = Result<(u64, Vec<BlockOverlaps>), KvUnavailable>;

fn pins(routed: &Routed) -> Pins {
    (
        routed.pick.decode.worker.instance_id.0,
        routed.pick.prefill.as_ref().map(|p| p.worker.instance_id.0),
    )
}

fn kv_aware(conditional: bool) -> KvAwarePicker {
    KvAwarePicker::new(KvPickParams {
        conditional_disaggregation: ConditionalDisaggregation {
            enabled: conditional,
            decode_busy_threshold: None,
        },
        ..KvPickParams::default()
    })
}

#[test]
fn the_dynamo_path_is_skipped_without_an_eligible_namespace_candidates_or_a_pick() {
    let load = LoadBasedPicker::new();
    let rows: [(Row<'_>, Skip, u32); 4] = [
        // No namespace has a usable replica: nothing else is looked at.
        (
            Row {
                namespaces: &[("ns", false)],
                candidates: vec![dec(10)],
                kv: None,
                unreachable: &[],
                picker: &load,
            },
            Skip::NoEligibleNamespace,
            0,
        ),
        (
            Row {
                namespaces: &[],
                candidates: vec![dec(10)],
                kv: None,
                unreachable: &[],
                picker: &load,
            },
            Skip::NoEligibleNamespace,
            0,
        ),
        // No worker serves the model.
        (
            Row {
                namespaces: &[("ns", true)],
                candidates: vec![],
                kv: None,
                unreachable: &[],
                picker: &load,
            },
            Skip::NoCandidates,
            0,
        ),
        // Only prefill workers: nothing decodes.
        (
            Row {
                namespaces: &[("ns", true)],
                candidates: vec![pre(1)],
                kv: None,
                unreachable: &[],
                picker: &load,
            },
            Skip::NoPick(NoCandidates::NoDecodeWorker),
            1,
        ),
    ];
    for (row, skip, asked) in rows {
        assert_eq!(row.decide(), (Decision::Skip(skip), asked));
    }
}

#[test]
fn only_namespaces_with_a_usable_replica_are_offered_to_the_picker() {
    let load = LoadBasedPicker::new();
    let other = |id| cand("other", id, CandidateRole::Decode);
    // The model is served only where no replica is usable: no pick.
    let row = Row {
        namespaces: &[("ns", true), ("other", false)],
        candidates: vec![other(20)],
        kv: None,
        unreachable: &[],
        picker: &load,
    };
    assert_eq!(
        row.decide().0,
        Decision::Skip(Skip::NoPick(NoCandidates::NoWorkerForModel))
    );
    // Both usable: the other namespace's worker is picked.
    let row = Row {
        namespaces: &[("ns", false), ("other", true)],
        candidates: vec![dec(10), other(20)],
        kv: None,
        unreachable: &[],
        picker: &load,
    };
    assert_eq!(pins(&routed(row.decide().0)), (20, None));
}

#[test]
fn the_path_class_follows_the_pins() {
    let load = LoadBasedPicker::new();
    let rows: [(Vec<Candidate>, PathClass, Pins); 3] = [
        (
            vec![dec(10), pre(1)],
            PathClass::Disaggregated,
            (10, Some(1)),
        ),
        (vec![dec(10)], PathClass::Aggregated, (10, None)),
        (vec![agg(30)], PathClass::Aggregated, (30, None)),
    ];
    for (candidates, path, expected) in rows {
        let row = Row {
            namespaces: &[("ns", true)],
            candidates,
            kv: None,
            unreachable: &[],
            picker: &load,
        };
        let (decision, asked) = row.decide();
        let routed = routed(decision);
        assert_eq!((routed.path, pins(&routed)), (path, expected));
        assert_eq!((routed.kv, routed.parity, asked), (None, None, 1));
    }
}

#[test]
fn unreachable_ranks_sit_out_while_a_reachable_rank_serves_the_phase() {
    let load = LoadBasedPicker::new();
    // Round robin from a fresh cursor would take the first decode rank: it is unreachable.
    let row = Row {
        namespaces: &[("ns", true)],
        candidates: vec![dec(10), dec(11), pre(1)],
        kv: None,
        unreachable: &[10],
        picker: &load,
    };
    assert_eq!(pins(&routed(row.decide().0)), (11, Some(1)));
    // Every decode rank unreachable: they all stay (nothing better exists).
    let row = Row {
        unreachable: &[10, 11],
        ..row
    };
    assert_eq!(pins(&routed(row.decide().0)), (10, Some(1)));
}

#[test]
fn kv_outcomes_and_the_parity_target() {
    let plain = kv_aware(false);
    let bypassing = kv_aware(true);
    // (picker, kv input, path, pins, kv result, parity (worker, held), estimate asked)
    type Expected = (PathClass, Pins, KvSelectionResult, Option<(u64, u64)>, u32);
    let rows: [(&dyn DynamoWorkerPicker, KvRowInput, Expected); 4] = [
        // The prefill rank is the parity target, with the blocks it already held.
        (
            &plain,
            Ok((64, overlaps(&[(10, 4), (1, 2)]))),
            (
                PathClass::Disaggregated,
                (10, Some(1)),
                KvSelectionResult::Overlap,
                Some((1, 2)),
                0,
            ),
        ),
        // Nothing held anywhere: the target holds 0.
        (
            &plain,
            Ok((64, overlaps(&[]))),
            (
                PathClass::Disaggregated,
                (10, Some(1)),
                KvSelectionResult::NoOverlap,
                Some((1, 0)),
                0,
            ),
        ),
        // Conditional bypass: unified path, the decode rank prefills and is the target.
        (
            &bypassing,
            Ok((64, overlaps(&[(10, 4), (1, 2)]))),
            (
                PathClass::Unified,
                (10, None),
                KvSelectionResult::Bypass,
                Some((10, 4)),
                0,
            ),
        ),
        // No prepared prompt: scored on the estimate, no parity target.
        (
            &plain,
            Err(KvUnavailable::TokenizerUnavailable),
            (
                PathClass::Disaggregated,
                (10, Some(1)),
                KvSelectionResult::TokenizerUnavailable,
                None,
                1,
            ),
        ),
    ];
    for (picker, kv, (path, expected_pins, result, parity, asked)) in rows {
        let row = Row {
            namespaces: &[("ns", true)],
            candidates: vec![dec(10), pre(1)],
            kv: Some(kv),
            unreachable: &[],
            picker,
        };
        let (decision, estimates) = row.decide();
        let routed = routed(decision);
        assert_eq!(routed.path, path);
        assert_eq!(pins(&routed), expected_pins);
        assert_eq!(routed.kv, Some(result));
        assert_eq!(routed.parity.map(|p| (p.worker.0, p.held_blocks)), parity);
        if let Some(target) = routed.parity {
            assert_eq!((target.dp_rank, target.block_size), (DpRank(0), 16));
        }
        assert_eq!(estimates, asked);
    }
}

#[test]
fn a_prefiller_without_a_declared_block_size_has_no_parity_target() {
    let plain = kv_aware(false);
    let mut prefill = pre(1);
    prefill.block_size = None;
    let row = Row {
        namespaces: &[("ns", true)],
        candidates: vec![dec(10), prefill],
        kv: Some(Ok((64, overlaps(&[(1, 2)])))),
        unreachable: &[],
        picker: &plain,
    };
    let routed = routed(row.decide().0);
    assert_eq!(pins(&routed), (10, Some(1)));
    assert_eq!(routed.parity, None);
}
