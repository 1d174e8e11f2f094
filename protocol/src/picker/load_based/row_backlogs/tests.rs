//! The rows kept across picks against a naive reference: every leg in one list, answered as a
//! prefix of its worker's legs in dispatch order, read at the pick's time.

use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;

use super::RowBacklogCache;
use crate::ids::{DpRank, InstanceId, Namespace, WorkerKey};
use crate::picker::dense::DenseRanks;
use crate::picker::ledger::{
    DISPATCH_MAX_AGE, DispatchId, DispatchLedger, DispatchLeg, RankBacklog, STALL_AFTER,
    STALL_MIN_BLOCKS,
};
use crate::picker::{Candidate, CandidateRole};
use crate::time::Tick;

const NAMESPACES: [&str; 2] = ["a", "b"];

fn key(ns: usize, id: u64) -> WorkerKey {
    WorkerKey {
        namespace: Namespace::new(NAMESPACES[ns]),
        instance_id: InstanceId(id),
    }
}

/// Instances 1..=3 in both namespaces, two ranks each; the second layout leaves instance 2 of
/// namespace `b` out and lists the rest in another order (a layout per model).
fn layouts() -> [DenseRanks; 2] {
    let model: Arc<str> = "m".into();
    let cand = |ns: usize, id: u64, rank: u32| Candidate {
        worker: key(ns, id),
        role: CandidateRole::Decode,
        model: model.clone(),
        dp_rank: Some(DpRank(rank)),
        rank_declared: true,
        block_size: Some(16),
        total_kv_blocks: Some(100),
        max_num_batched_tokens: Some(1000),
    };
    let mut all = Vec::new();
    for ns in 0..2 {
        for id in 1..=3 {
            for rank in 0..2 {
                all.push(cand(ns, id, rank));
            }
        }
    }
    let mut other: Vec<Candidate> = all
        .iter()
        .filter(|c| c.worker != key(1, 2))
        .cloned()
        .collect();
    other.reverse();
    [DenseRanks::build(&all), DenseRanks::build(&other)]
}

#[derive(Clone, Debug)]
enum Op {
    /// A dispatch recorded `back_ms` before the clock (out of time order when the previous
    /// was recorded later), after the clock advanced `advance_ms`.
    Record {
        ns: usize,
        id: u64,
        rank: u32,
        blocks: u64,
        exempt: bool,
        advance_ms: u64,
        back_ms: u64,
    },
    /// As many dispatches at once as to outrun the change log a pick catches up from.
    Burst {
        id: u64,
        count: u8,
    },
    /// A sample of one worker (one namespace) received `back_ms` before the clock.
    Sample {
        ns: usize,
        id: u64,
        back_ms: u64,
    },
    /// The store's last arrival of instance `id` (every namespace).
    Arrived {
        id: u64,
        back_ms: u64,
    },
    End {
        nth: usize,
    },
    Withdraw {
        nth: usize,
    },
    /// A pick over layout `layout` at the clock.
    Pick {
        layout: usize,
        advance_ms: u64,
    },
}

fn arb_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0usize..2, 1u64..4, 0u32..2, 0u64..4, any::<bool>(), 0u64..4000, prop_oneof![3 => Just(0u64), 1 => 0u64..3000])
            .prop_map(|(ns, id, rank, blocks, exempt, advance_ms, back_ms)| Op::Record {
                ns, id, rank, blocks, exempt, advance_ms, back_ms
            }),
        1 => (1u64..4, 20u8..40).prop_map(|(id, count)| Op::Burst { id, count }),
        2 => (0usize..2, 1u64..4, 0u64..3000).prop_map(|(ns, id, back_ms)| Op::Sample { ns, id, back_ms }),
        1 => (1u64..4, 0u64..3000).prop_map(|(id, back_ms)| Op::Arrived { id, back_ms }),
        1 => (0usize..32).prop_map(|nth| Op::End { nth }),
        1 => (0usize..32).prop_map(|nth| Op::Withdraw { nth }),
        4 => (0usize..2, 0u64..6000).prop_map(|(layout, advance_ms)| Op::Pick { layout, advance_ms }),
    ]
}

struct Leg {
    id: DispatchId,
    worker: WorkerKey,
    rank: DpRank,
    at: Tick,
    blocks: u64,
    may_stall: bool,
}

/// The naive reference: legs in dispatch order.
#[derive(Default)]
struct Naive {
    legs: Vec<Leg>,
}

impl Naive {
    /// A sample of `worker` received at `at` answers its legs before `at`, up to the first that
    /// is not (its legs in dispatch order).
    fn answer(&mut self, worker: &WorkerKey, at: Tick) {
        let mut answering = true;
        self.legs.retain(|l| {
            if &l.worker != worker || !answering {
                return true;
            }
            answering = l.at < at;
            !answering
        });
    }

    fn backlog(&self, worker: &WorkerKey, rank: DpRank, now: Tick) -> RankBacklog {
        let mut out = RankBacklog::default();
        for l in self
            .legs
            .iter()
            .filter(|l| &l.worker == worker && l.rank == rank)
        {
            let age = now.since(l.at);
            if age >= DISPATCH_MAX_AGE {
                continue;
            }
            out.prefill_tokens += l.blocks * 16;
            out.decode_blocks += l.blocks;
            out.stalled |= l.may_stall && age >= STALL_AFTER;
        }
        out
    }
}

fn before(clock: Tick, back_ms: u64) -> Tick {
    Tick(clock.0.saturating_sub(Duration::from_millis(back_ms)))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    /// The rows a pick reads (kept per layout, caught up from the ledger's change log, or
    /// re-laid whole when it does not reach back) equal the naive reference's backlog of every
    /// row's (namespace, instance, rank) at the pick's time, under dispatches recorded out of
    /// time order, answers, ends, withdrawals and expiry.
    #[test]
    fn the_rows_kept_across_picks_match_a_naive_reference(
        ops in proptest::collection::vec(arb_op(), 1..120),
    ) {
        let layouts = layouts();
        let mut ledger = DispatchLedger::new();
        let mut cache = RowBacklogCache::default();
        let mut naive = Naive::default();
        let mut ids = Vec::new();
        let mut clock = Tick(Duration::from_secs(100));
        let record = |ledger: &mut DispatchLedger, naive: &mut Naive, ids: &mut Vec<DispatchId>, leg: DispatchLeg, at: Tick| {
            let id = ledger.record_dispatch(std::slice::from_ref(&leg), at);
            ids.push(id);
            naive.legs.push(Leg {
                id,
                may_stall: !leg.stall_exempt && leg.request_blocks >= STALL_MIN_BLOCKS,
                worker: leg.worker,
                rank: leg.rank,
                at,
                blocks: leg.decode_blocks,
            });
        };
        let leg = |ns: usize, id: u64, rank: u32, blocks: u64, exempt: bool| DispatchLeg {
            worker: key(ns, id),
            rank: DpRank(rank),
            prefill_tokens: blocks * 16,
            decode_blocks: blocks,
            request_blocks: blocks,
            stall_exempt: exempt,
        };
        for op in ops {
            match op {
                Op::Record { ns, id, rank, blocks, exempt, advance_ms, back_ms } => {
                    clock = clock.plus(Duration::from_millis(advance_ms));
                    let at = before(clock, back_ms);
                    record(&mut ledger, &mut naive, &mut ids, leg(ns, id, rank, blocks, exempt), at);
                }
                Op::Burst { id, count } => {
                    for n in 0..u64::from(count) {
                        let l = leg((n % 2) as usize, id, (n % 3 == 0) as u32, n % 4, n % 5 == 0);
                        record(&mut ledger, &mut naive, &mut ids, l, clock);
                    }
                }
                Op::Sample { ns, id, back_ms } => {
                    let at = before(clock, back_ms);
                    ledger.sample_arrived(&key(ns, id), at);
                    naive.answer(&key(ns, id), at);
                }
                Op::Arrived { id, back_ms } => {
                    let at = before(clock, back_ms);
                    ledger.answer_arrivals(|instance| (instance.0 == id).then_some(at));
                    for ns in 0..2 {
                        naive.answer(&key(ns, id), at);
                    }
                }
                Op::End { nth } => {
                    if let Some(&id) = ids.get(nth % ids.len().max(1)) {
                        ledger.request_ended(id);
                        for l in naive.legs.iter_mut().filter(|l| l.id == id) {
                            l.may_stall = false;
                        }
                    }
                }
                Op::Withdraw { nth } => {
                    if let Some(&id) = ids.get(nth % ids.len().max(1)) {
                        ledger.withdraw(id);
                        naive.legs.retain(|l| l.id != id);
                    }
                }
                Op::Pick { layout, advance_ms } => {
                    clock = clock.plus(Duration::from_millis(advance_ms));
                    let dense = &layouts[layout];
                    // What a pick does: expire at its time, then read the rows.
                    ledger.expire(clock);
                    let rows = cache.caught_up(dense, &ledger, clock);
                    let mut backlogged = 0;
                    for row in 0..dense.len() {
                        let worker = WorkerKey {
                            namespace: dense.namespace_of(row).expect("a row's namespace").clone(),
                            instance_id: dense.instance[row],
                        };
                        let want = naive.backlog(&worker, dense.rank[row], clock);
                        prop_assert_eq!(rows.get(row), want, "row {} ({:?}) at {:?}", row, worker, clock);
                        // The same read as columns beside the keys.
                        let (decode, stall_from, now) = rows.columns();
                        prop_assert_eq!(decode[row], want.decode_blocks);
                        prop_assert_eq!(stall_from[row] <= now, want.stalled);
                        // Every aged leg is gone: the ledger agrees on what it holds.
                        prop_assert_eq!(ledger.backlog(&worker, dense.rank[row], clock), want);
                        backlogged += usize::from(naive.legs.iter().any(|l| l.worker == worker && l.rank == dense.rank[row] && clock.since(l.at) < DISPATCH_MAX_AGE));
                    }
                    // Each backlogged row once in the set-aside list, no other.
                    let mut listed = rows.rows().to_vec();
                    listed.sort_unstable();
                    listed.dedup();
                    prop_assert_eq!(listed.len(), rows.rows().len());
                    prop_assert_eq!(listed.len(), backlogged);
                    let live = naive.legs.iter().filter(|l| clock.since(l.at) < DISPATCH_MAX_AGE).count();
                    prop_assert_eq!(ledger.unanswered(), live, "expiry at {:?} leaves no aged leg", clock);
                }
            }
        }
    }
}

#[test]
fn a_pick_re_lays_only_what_changed_and_reads_the_stall_at_its_time() {
    let layouts = layouts();
    let dense = &layouts[0];
    let mut ledger = DispatchLedger::new();
    let mut cache = RowBacklogCache::default();
    let t = |s: u64| Tick(Duration::from_secs(s));
    let leg = |id: u64, blocks: u64| DispatchLeg {
        worker: key(0, id),
        rank: DpRank(0),
        prefill_tokens: 0,
        decode_blocks: blocks,
        request_blocks: blocks,
        stall_exempt: false,
    };
    ledger.record_dispatch(&[leg(1, 4)], t(10));
    ledger.expire(t(10));
    let row = dense
        .rows_of(InstanceId(1))
        .find(|&r| {
            dense.rank[r] == DpRank(0) && dense.namespace_of(r) == Some(&Namespace::new("a"))
        })
        .expect("a row");
    let rows = cache.caught_up(dense, &ledger, t(10));
    assert_eq!(
        (rows.get(row).decode_blocks, rows.get(row).stalled),
        (4, false)
    );
    // No write since: the same rows, stalled once the leg is five seconds old.
    let seen = ledger.changes();
    let rows = cache.caught_up(dense, &ledger, t(15));
    assert_eq!(ledger.changes(), seen);
    assert_eq!(
        (rows.get(row).decode_blocks, rows.get(row).stalled),
        (4, true)
    );
    // Aged out at 40 s: expiry is a write the rows catch up with.
    ledger.expire(t(40));
    let rows = cache.caught_up(dense, &ledger, t(40));
    assert_eq!(rows.get(row), RankBacklog::default());
    assert!(rows.rows().is_empty());
}
