//! Admission tests: the busy rule rank by rank (fresh, stale and missing samples, the ledger's
//! unanswered dispatches, prefill ranks and ineligible namespaces), the arrival rule, and a
//! property test of the queue against a plain model (bounded, arrival order, leave removes).

use std::collections::VecDeque;
use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::event_plane::ActiveLoad;
use crate::ids::{DpRank, InstanceId, PublisherId, WorkerKey};
use crate::load_store::LoadSample;
use crate::picker::ledger::DispatchLeg;
use crate::time::UnixMillis;

const MAX_AGE: Duration = Duration::from_secs(3);

fn cand(ns: &str, id: u64, role: CandidateRole) -> Candidate {
    Candidate {
        worker: WorkerKey {
            namespace: Namespace::new(ns),
            instance_id: InstanceId(id),
        },
        role,
        model: "m".into(),
        dp_rank: Some(DpRank(0)),
        rank_declared: true,
        block_size: Some(16),
        total_kv_blocks: Some(100),
        max_num_batched_tokens: Some(1000),
    }
}

fn sample(id: u64, blocks: u64, prefill: Option<u64>, at: Tick, sequence: u64) -> LoadSample {
    LoadSample {
        load: ActiveLoad {
            worker_id: InstanceId(id),
            dp_rank: DpRank(0),
            active_decode_blocks: Some(blocks),
            active_prefill_tokens: prefill,
            kv_used_blocks: None,
        },
        publisher_id: PublisherId(id),
        sequence,
        published_at: UnixMillis(0),
        received_at: at,
    }
}

fn store(ids: &[u64]) -> LoadStore {
    let mut store = LoadStore::new();
    store.set_live_and_retain(ids.iter().map(|&id| InstanceId(id)));
    store
}

const KV: BusyThreshold = BusyThreshold {
    kv_usage: Some(0.9),
    prefill_tokens: None,
};

fn at(secs: u64) -> Tick {
    Tick::from_millis(secs * 1000)
}

#[test]
fn a_rank_is_busy_at_its_kv_fraction_or_prefill_tokens() {
    let load = |decode, prefill| RankLoad {
        decode_blocks: Some(decode),
        prefill_tokens: Some(prefill),
        total_kv_blocks: Some(100),
    };
    assert!(!load(89, 0).is_busy(&KV));
    assert!(load(90, 0).is_busy(&KV));
    let prefill = BusyThreshold {
        kv_usage: None,
        prefill_tokens: Some(500),
    };
    assert!(!load(100, 499).is_busy(&prefill));
    assert!(load(0, 500).is_busy(&prefill));
    // No capacity on the card: the KV fraction cannot bind.
    let unknown = RankLoad {
        total_kv_blocks: None,
        ..load(1000, 0)
    };
    assert!(!unknown.is_busy(&KV));
    assert!(!RankLoad::default().is_busy(&KV));
}

#[test]
fn the_model_is_busy_only_when_every_eligible_decode_rank_is() {
    let ns = [Namespace::new("a")];
    let cands = [
        cand("a", 1, CandidateRole::Decode),
        cand("a", 2, CandidateRole::Aggregated),
        cand("a", 3, CandidateRole::Prefill),
        cand("b", 4, CandidateRole::Decode),
    ];
    let mut s = store(&[1, 2, 3, 4]);
    let ledger = DispatchLedger::new();
    let now = at(10);
    let look = |s: &LoadStore| fleet(&KV, &cands, &ns, |c| rank_load(c, s, &ledger, now, MAX_AGE));
    // Never published: room.
    assert_eq!(look(&s), Fleet::Room);
    s.apply(sample(1, 95, None, now, 1));
    assert_eq!(look(&s), Fleet::Room);
    s.apply(sample(2, 90, None, now, 1));
    // The prefill rank (idle) and namespace b's rank (idle) do not count.
    s.apply(sample(3, 0, None, now, 1));
    s.apply(sample(4, 0, None, now, 1));
    assert_eq!(look(&s), Fleet::Busy);
    // A fresh sample with room frees the model.
    s.apply(sample(2, 10, None, now, 2));
    assert_eq!(look(&s), Fleet::Room);
    // No threshold: always room; no eligible rank: unknown.
    assert_eq!(
        fleet(&BusyThreshold::default(), &cands, &ns, |_| unreachable!()),
        Fleet::Room
    );
    assert_eq!(
        fleet(&KV, &cands, &[Namespace::new("c")], |_| unreachable!()),
        Fleet::Unknown
    );
}

#[test]
fn a_stale_sample_has_room_and_unanswered_dispatches_add_load() {
    let c = cand("a", 1, CandidateRole::Decode);
    let mut s = store(&[1]);
    let mut ledger = DispatchLedger::new();
    s.apply(sample(1, 95, None, at(0), 1));
    assert!(rank_load(&c, &s, &ledger, at(1), MAX_AGE).is_busy(&KV));
    assert!(!rank_load(&c, &s, &ledger, at(4), MAX_AGE).is_busy(&KV));
    s.apply(sample(1, 50, None, at(5), 2));
    let load = rank_load(&c, &s, &ledger, at(5), MAX_AGE);
    assert_eq!(load.decode_blocks, Some(50));
    ledger.record_dispatch(
        &[DispatchLeg {
            worker: c.worker.clone(),
            rank: DpRank(0),
            prefill_tokens: 0,
            decode_blocks: 45,
            request_blocks: 45,
            stall_exempt: false,
        }],
        at(5),
    );
    let load = rank_load(&c, &s, &ledger, at(5), MAX_AGE);
    assert_eq!(load.decode_blocks, Some(95));
    assert!(load.is_busy(&KV));
}

#[test]
fn arrivals_never_overtake_a_waiting_request() {
    assert_eq!(step(Fleet::Room, 0, 4), Step::Go);
    assert_eq!(step(Fleet::Unknown, 0, 4), Step::Go);
    assert_eq!(step(Fleet::Room, 1, 4), Step::Wait);
    assert_eq!(step(Fleet::Busy, 0, 4), Step::Wait);
    assert_eq!(step(Fleet::Busy, 4, 4), Step::Shed(Shed::QueueFull));
    assert_eq!(step(Fleet::Busy, 0, 0), Step::Shed(Shed::QueueFull));
}

#[test]
fn retry_after_rounds_up_to_a_whole_second() {
    let busy = |ms| Busy {
        reason: Shed::MaxWait,
        model: "m".into(),
        retry_after: Duration::from_millis(ms),
    };
    assert_eq!(busy(0).retry_after_secs(), 1);
    assert_eq!(busy(1001).retry_after_secs(), 2);
    assert_eq!(busy(30_000).retry_after_secs(), 30);
}

#[derive(Clone, Debug)]
enum Op {
    Join(u8),
    Leave(u8),
    ServeHead,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..8).prop_map(Op::Join),
        any::<u8>().prop_map(Op::Leave),
        Just(Op::ServeHead),
    ]
}

proptest! {
    /// The queue against a plain model: a `VecDeque` of tickets. It never holds more than the
    /// `max_depth` it was joined with, serves in arrival order, and a leaving request is gone
    /// whatever its place (the waiters behind it move up).
    #[test]
    fn the_queue_is_bounded_ordered_and_leaves_cleanly(
        ops in proptest::collection::vec(op(), 0..200),
    ) {
        let mut queue = WaitQueue::new();
        let mut model: VecDeque<(Ticket, Tick)> = VecDeque::new();
        let mut issued: Vec<Ticket> = Vec::new();
        for (i, op) in ops.into_iter().enumerate() {
            let now = Tick::from_millis(i as u64);
            match op {
                Op::Join(depth) => {
                    let depth = usize::from(depth);
                    match queue.join(now, depth, Waiting::anonymous()) {
                        Ok(t) => {
                            prop_assert!(model.len() < depth);
                            model.push_back((t, now));
                            issued.push(t);
                        }
                        Err(Shed::QueueFull) => prop_assert!(model.len() >= depth),
                        Err(other) => prop_assert!(false, "unexpected {other:?}"),
                    }
                }
                Op::Leave(pick) => {
                    if issued.is_empty() {
                        continue;
                    }
                    let t = issued[usize::from(pick) % issued.len()];
                    let held = model.iter().position(|(m, _)| *m == t);
                    let waited = queue.leave(t, now, false);
                    match held {
                        Some(at) => {
                            let (_, since) = model.remove(at).expect("held");
                            prop_assert_eq!(waited, Some(now.since(since)));
                        }
                        None => prop_assert_eq!(waited, None),
                    }
                }
                Op::ServeHead => {
                    prop_assert_eq!(queue.head(now, &Order::default()), model.front().map(|(t, _)| *t));
                    if let Some((t, _)) = model.pop_front() {
                        prop_assert!(queue.leave(t, now, true).is_some());
                    }
                }
            }
            prop_assert_eq!(queue.len(), model.len());
            prop_assert_eq!(queue.head(now, &Order::default()), model.front().map(|(t, _)| *t));
            for (t, since) in &model {
                prop_assert_eq!(queue.since(*t), Some(*since));
            }
        }
    }
}

fn who(class: u8, key: &str, cost: u64) -> Waiting {
    Waiting {
        class,
        key: key.into(),
        cost,
    }
}

/// Serves heads until empty; the keys in serving order.
fn drain(queue: &mut WaitQueue, now: Tick, order: &Order) -> Vec<Ticket> {
    let mut served = Vec::new();
    while let Some(t) = queue.head(now, order) {
        assert!(queue.leave(t, now, true).is_some());
        served.push(t);
    }
    served
}

#[test]
fn a_better_class_is_served_first_and_aging_lifts_the_lowest() {
    let order = Order {
        aging: Some(Duration::from_secs(10)),
        quantum: DEFAULT_QUANTUM,
    };
    let mut q = WaitQueue::new();
    let low = q.join(at(0), 8, who(2, "batch", 10)).expect("room");
    let high = q.join(at(1), 8, who(0, "ops", 10)).expect("room");
    // Strictly by class while nobody has aged.
    assert_eq!(q.head(at(1), &order), Some(high));
    assert_eq!(q.leave(high, at(1), true), Some(Duration::ZERO));
    let normal = q.join(at(15), 8, who(1, "web", 10)).expect("room");
    // At 20 s the class-2 request has risen two classes: it goes before the class-1 one (risen
    // by none yet) and before a class-0 arrival of another key that joined later.
    let fresh = q.join(at(20), 8, who(0, "ops", 10)).expect("room");
    assert_eq!(q.head(at(20), &order), Some(low));
    assert_eq!(drain(&mut q, at(20), &order), [low, fresh, normal]);
    // Without aging the class-2 request waits for every better one.
    let mut q = WaitQueue::new();
    let low = q.join(at(0), 8, who(2, "batch", 10)).expect("room");
    let high = q.join(at(50), 8, who(0, "ops", 10)).expect("room");
    assert_eq!(drain(&mut q, at(100), &Order::default()), [high, low]);
}

#[test]
fn keys_of_one_class_take_turns_whatever_their_backlog() {
    let order = Order {
        aging: None,
        quantum: 100,
    };
    let mut q = WaitQueue::new();
    let flood: Vec<Ticket> = (0..6)
        .map(|_| q.join(at(0), 64, who(1, "flood", 100)).expect("room"))
        .collect();
    let steady: Vec<Ticket> = (0..2)
        .map(|_| q.join(at(1), 64, who(1, "steady", 100)).expect("room"))
        .collect();
    let served = drain(&mut q, at(2), &order);
    assert_eq!(
        served,
        [
            flood[0], steady[0], flood[1], steady[1], flood[2], flood[3], flood[4], flood[5]
        ]
    );
    assert_eq!(q.keys(), 0, "emptied keys leave the rotation");
}

#[test]
fn an_abandoned_pick_is_replaced_and_classes_are_clamped() {
    let mut q = WaitQueue::new();
    let a = q.join(at(0), 8, who(9, "a", 1)).expect("room");
    let b = q.join(at(0), 8, who(2, "b", 1)).expect("room");
    assert_eq!(q.head(at(0), &Order::default()), Some(a));
    assert!(q.leave(a, at(0), false).is_some());
    assert_eq!(q.head(at(0), &Order::default()), Some(b));
    assert_eq!(q.leave(a, at(0), false), None);
}

proptest! {
    /// Two keys in one class, both backlogged: over any prefix of the serving order their served
    /// costs differ by at most one quantum plus the largest request (deficit round robin's
    /// bound), whichever key arrived with more; every request is served exactly once.
    #[test]
    fn deficit_round_robin_shares_the_turns(
        a in proptest::collection::vec(1u64..=400, 1..40),
        b in proptest::collection::vec(1u64..=400, 1..40),
        quantum in 1u64..=300,
    ) {
        let order = Order { aging: None, quantum };
        let mut q = WaitQueue::new();
        let mut cost = std::collections::HashMap::new();
        for (key, costs) in [("a", &a), ("b", &b)] {
            for &c in costs {
                let t = q.join(at(0), usize::MAX, who(1, key, c)).expect("room");
                cost.insert(t, (key, c));
            }
        }
        let (mut left_a, mut left_b) = (a.len(), b.len());
        let (mut served_a, mut served_b) = (0u64, 0u64);
        let mut seen = std::collections::HashSet::new();
        while let Some(t) = q.head(at(0), &order) {
            prop_assert!(seen.insert(t));
            q.leave(t, at(0), true);
            let (key, c) = cost[&t];
            if key == "a" { served_a += c; left_a -= 1 } else { served_b += c; left_b -= 1 }
            if left_a > 0 && left_b > 0 {
                prop_assert!(served_a.abs_diff(served_b) <= quantum + 400,
                    "a {served_a} b {served_b}");
            }
        }
        prop_assert_eq!(seen.len(), a.len() + b.len());
    }
}

#[test]
fn the_remembered_pick_ends_when_aging_changes_a_class() {
    let order = Order {
        aging: Some(Duration::from_secs(10)),
        quantum: DEFAULT_QUANTUM,
    };
    let mut q = WaitQueue::new();
    let low = q.join(at(0), 8, who(2, "batch", 1000)).expect("room");
    let normal = q.join(at(15), 8, who(1, "web", 1)).expect("room");
    // At 16 s both are in class 1: the cheaper request's key gets there first.
    assert_eq!(q.head(at(16), &order), Some(normal));
    assert_eq!(q.head(at(19), &order), Some(normal));
    // At 20 s the class-2 request has risen twice (no request joined or left): it is strictly
    // better now.
    assert_eq!(q.head(at(20), &order), Some(low));
    // A changed order is never answered from the remembered pick.
    let strict = Order {
        aging: None,
        ..order
    };
    assert_eq!(q.head(at(20), &strict), Some(normal));
}
