//! Peer slots (`dynamo.load.peer_slots`): replicas with one view take distinct slots of the tie
//! set, each counts its peers' slots so their next decisions agree again, the slots never leave
//! the tie set, and a router alone picks exactly as the seeded draw does.

use std::collections::BTreeSet;

use proptest::prelude::*;

use super::super::*;
use super::picks::{fleet, pick};
use super::{Place, TieBreak, take_slot};

fn slotted(window: f64, replica: u32, count: u32) -> PickerState {
    let mut state = PickerState::new();
    state.tie.set(TieBreak {
        window,
        seed: TieBreak::seed_of(&format!("router-{replica}")),
        peer_slots: true,
    });
    state
        .ledger
        .set_place(Place::new(replica as usize, count as usize));
    state
}

/// Four replicas on one idle view of eight equal workers, two requests each, in turns (the
/// trace's bursts reach them round robin): every worker is taken exactly once, as one router
/// would spread eight requests. The seeded draw collides on the same view.
#[test]
fn replicas_with_one_view_take_distinct_slots_round_after_round() {
    let kv: &[(u64, u32)] = &[];
    for (role, kv) in [
        (CandidateRole::Decode, None),
        (CandidateRole::Aggregated, Some((32, kv))),
    ] {
        let (candidates, load) = fleet(&[10; 8], role);
        let mut states: Vec<PickerState> = (0..4).map(|r| slotted(2.0, r, 4)).collect();
        let mut taken = Vec::new();
        for _round in 0..2 {
            for state in &mut states {
                taken.push(pick(&candidates, &load, state, kv));
            }
        }
        let distinct: BTreeSet<u64> = taken.iter().copied().collect();
        assert_eq!(distinct.len(), 8, "{role:?}: {taken:?}");
        // Each replica's ledger holds its own two requests and its peers' six slots, one per
        // worker: the same view as its peers'.
        for state in &states {
            assert_eq!(state.ledger.peer_legs(), 6, "{role:?}");
        }
        // A router alone (no peer known) with peer slots on picks exactly as without the
        // tie-break (window 0), not as the seeded draw does.
        let picks = |window: f64, peer_slots: bool| -> Vec<u64> {
            let mut state = slotted(window, 0, 1);
            state.tie.set(TieBreak {
                peer_slots,
                ..state.tie.setting()
            });
            (0..12)
                .map(|_| pick(&candidates, &load, &mut state, kv))
                .collect()
        };
        assert_eq!(picks(2.0, true), picks(0.0, false), "{role:?}");
        assert_ne!(picks(2.0, true), picks(2.0, false), "{role:?}");
    }
}

/// Slots stay inside the tie set: with only two workers within the window, four replicas take
/// them two and two (round and round), never the loaded ones.
#[test]
fn slots_never_leave_the_tie_set() {
    let (candidates, load) = fleet(&[10, 500, 10, 500, 500], CandidateRole::Decode);
    let picks: Vec<u64> = (0..4)
        .map(|r| pick(&candidates, &load, &mut slotted(1.0, r, 4), None))
        .collect();
    assert_eq!(picks, [1, 3, 1, 3]);
}

proptest! {
    /// `take_slot` over any tie set: replica `i` of `count` takes the `(i mod len)`-th lowest
    /// (cost, then id); its peers' slots are the other `count - 1`; every replica's own slot plus
    /// its peers' is the same multiset, so their ledgers agree; with room, no two replicas share
    /// a slot.
    #[test]
    fn slots_are_the_lowest_in_order_and_every_replica_counts_the_same(
        costs in prop::collection::vec(0u32..20, 1..40),
        count in 1u32..12,
    ) {
        let tied: Vec<(f64, u32)> = costs
            .iter()
            .enumerate()
            .map(|(i, &c)| (f64::from(c), i as u32))
            .collect();
        let mut sorted = tied.clone();
        sorted.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let n = (count as usize).min(tied.len());
        let mut owns = Vec::new();
        let mut all: Option<Vec<u32>> = None;
        for index in 0..count {
            let mut set = tied.clone();
            let mut peers = Vec::new();
            let own = take_slot(&mut set, Place::new(index as usize, count as usize), &mut peers)
                .expect("a non-empty set");
            prop_assert_eq!(own, sorted[index as usize % n].1);
            prop_assert_eq!(peers.len(), count as usize - 1);
            let mut every = peers.clone();
            every.push(own);
            every.sort_unstable();
            match &all {
                Some(first) => prop_assert_eq!(first, &every),
                None => all = Some(every),
            }
            owns.push(own);
        }
        if tied.len() >= count as usize {
            let distinct: BTreeSet<u32> = owns.iter().copied().collect();
            prop_assert_eq!(distinct.len(), count as usize);
        }
        let mut empty = Vec::new();
        prop_assert_eq!(take_slot(&mut [], Place::new(0, count as usize), &mut empty), None);
        prop_assert!(empty.is_empty());
    }
}

#[test]
fn peer_slots_draw_nothing_alone_and_carry_the_place_with_peers() {
    let mut d = super::TieDraws::default();
    d.set(TieBreak {
        window: 2.0,
        seed: 1,
        peer_slots: true,
    });
    assert_eq!(d.draw(Place::ALONE), None);
    assert_eq!(
        d.draw(Place::new(1, 3)).unwrap().place,
        Some(Place::new(1, 3))
    );
    d.set(TieBreak {
        peer_slots: false,
        ..d.setting()
    });
    assert_eq!(
        d.draw(Place::new(1, 3)).unwrap().place,
        None,
        "the draw decides"
    );
    assert!(d.draw(Place::ALONE).is_some());
}

#[test]
fn a_place_is_clamped() {
    assert_eq!(Place::new(5, 0), Place::ALONE);
    assert_eq!(Place::new(5, 3), Place { index: 2, count: 3 });
    assert_eq!(Place::new(0, 1000).count, super::MAX_PEER_SLOTS);
    assert!(!Place::ALONE.has_peers() && Place::new(0, 2).has_peers());
}
