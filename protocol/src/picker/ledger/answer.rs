//! Answering dispatches from the load store's arrivals, visiting only the instances that may
//! have something to answer.
//!
//! A request answers the ledger from the store before it picks (and the `PickerActor` after
//! every store update). Walking every instance holding legs cost O(backlogged workers) per
//! call: ~500 lookups per request when a fleet's publishers fall silent. Answering an
//! instance by the same arrival twice changes nothing, so a call needs to visit only the
//! instances with a sample written since the last call (the store's change log) and those
//! whose legs changed since (the ledger's).

use super::{DispatchLedger, unfilter};
use crate::ids::InstanceId;
use crate::load_store::LoadStore;
use crate::time::Tick;

/// The load store's and the ledger's state when [`DispatchLedger::answer_store`] last left
/// every held instance answered by its last arrival.
#[derive(Clone, Copy, Debug)]
pub(super) struct AnsweredMark {
    store_epoch: u64,
    store_changes: u64,
    ledger_changes: u64,
}

impl DispatchLedger {
    /// [`Self::answer_arrivals`] from `store`'s arrivals ([`LoadStore::last_arrival`]), visiting
    /// only the instances with a sample written since the last call and those whose legs
    /// changed since. Every instance held is visited when the store's slots moved
    /// ([`LoadStore::slot_epoch`]: a written slot then may no longer name its writer), the
    /// store is another, or either change log no longer reaches back.
    pub fn answer_store(&mut self, store: &LoadStore) {
        let epoch = store.slot_epoch();
        let mut to_answer = std::mem::take(&mut self.to_answer);
        to_answer.clear();
        let incremental = match self.answered {
            Some(mark) if mark.store_epoch == epoch => match (
                store.changed_since(mark.store_changes),
                self.changed_since(mark.ledger_changes),
            ) {
                (Some(written), Some(changed)) => {
                    // A slot keeps its key while the epoch holds: its sample names the writer.
                    to_answer.extend(
                        written.filter_map(|slot| store.at_slot(slot).map(|s| s.load.worker_id)),
                    );
                    to_answer.extend(changed);
                    true
                }
                _ => false,
            },
            _ => false,
        };
        if incremental {
            for &instance in &to_answer {
                if let Some(at) = store.last_arrival(instance) {
                    self.answer_instance(instance, at);
                }
            }
        } else if !self.is_empty() {
            self.answer_arrivals(|instance| store.last_arrival(instance));
        }
        self.to_answer = to_answer;
        self.answered = Some(AnsweredMark {
            store_epoch: epoch,
            store_changes: store.changes(),
            ledger_changes: self.change_log.changes(),
        });
    }

    /// Answers `instance`'s legs (in every namespace) by a sample that arrived at `at`.
    fn answer_instance(&mut self, instance: InstanceId, at: Tick) {
        let Self {
            namespaces,
            filter,
            legs,
            change_log,
            ..
        } = self;
        let mut emptied = false;
        for ns in namespaces.iter_mut() {
            let Some(pendings) = ns.workers.get_mut(&instance) else {
                continue;
            };
            let held = pendings.len();
            while pendings.front().is_some_and(|p| p.at < at) {
                pendings.pop_front();
                unfilter(filter, legs, instance);
            }
            if pendings.len() != held {
                change_log.push(instance);
            }
            if pendings.is_empty() {
                ns.workers.remove(&instance);
                emptied |= ns.workers.is_empty();
            }
        }
        if emptied {
            namespaces.retain(|ns| !ns.workers.is_empty());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use proptest::prelude::*;

    use super::super::DispatchLedger;
    use super::super::tests::{key, leg};
    use crate::event_plane::ActiveLoad;
    use crate::ids::{DpRank, InstanceId, PublisherId};
    use crate::load_store::{LoadSample, LoadStore};
    use crate::time::{Tick, UnixMillis};

    #[derive(Clone, Debug)]
    enum Op {
        /// A dispatch `back_ms` before the clock (out of time order now and then).
        Record {
            ns: usize,
            id: u64,
            rank: u32,
            blocks: u64,
            advance_ms: u64,
            back_ms: u64,
        },
        /// A sample applied to the store, received `back_ms` before the clock.
        Sample {
            id: u64,
            rank: u32,
            back_ms: u64,
            publisher: u64,
        },
        /// The publisher's samples dropped (slots freed: the store's epoch moves).
        Drop {
            publisher: u64,
        },
        /// Instance `id` leaves the live set (its samples and arrival forgotten), or comes back.
        Live {
            id: u64,
            live: bool,
        },
        Withdraw {
            nth: usize,
        },
        SampleArrived {
            ns: usize,
            id: u64,
            back_ms: u64,
        },
        /// Both ledgers answered from the store, then compared.
        Answer,
    }

    fn arb_op() -> impl Strategy<Value = Op> {
        prop_oneof![
            5 => (0usize..2, 1u64..5, 0u32..2, 0u64..4, 0u64..2000, prop_oneof![3 => Just(0u64), 1 => 0u64..1500])
                .prop_map(|(ns, id, rank, blocks, advance_ms, back_ms)| Op::Record { ns, id, rank, blocks, advance_ms, back_ms }),
            4 => (1u64..5, 0u32..2, 0u64..1500, 0u64..2).prop_map(|(id, rank, back_ms, publisher)| Op::Sample { id, rank, back_ms, publisher }),
            1 => (0u64..9).prop_map(|publisher| Op::Drop { publisher }),
            1 => (1u64..5, any::<bool>()).prop_map(|(id, live)| Op::Live { id, live }),
            1 => (0usize..32).prop_map(|nth| Op::Withdraw { nth }),
            1 => (0usize..2, 1u64..5, 0u64..1500).prop_map(|(ns, id, back_ms)| Op::SampleArrived { ns, id, back_ms }),
            4 => Just(Op::Answer),
        ]
    }

    const NS: [&str; 2] = ["a", "b"];

    proptest! {
        /// Answering from the store incrementally leaves exactly what answering every held
        /// instance by its last arrival leaves, while samples arrive out of order, publishers
        /// drop, workers leave and come back, and dispatches are withdrawn or answered directly.
        #[test]
        fn answering_incrementally_matches_answering_every_instance(
            ops in proptest::collection::vec(arb_op(), 1..150),
        ) {
            let mut store = LoadStore::new();
            let mut live: std::collections::BTreeSet<u64> = (1..5).collect();
            store.set_live_and_retain(live.iter().map(|&i| InstanceId(i)));
            let (mut inc, mut full) = (DispatchLedger::new(), DispatchLedger::new());
            let mut ids = Vec::new();
            let mut clock = Tick(Duration::from_secs(10));
            let mut sequence = 0;
            let back = |clock: Tick, ms: u64| Tick(clock.0.saturating_sub(Duration::from_millis(ms)));
            for op in ops {
                match op {
                    Op::Record { ns, id, rank, blocks, advance_ms, back_ms } => {
                        clock = clock.plus(Duration::from_millis(advance_ms));
                        let mut l = leg(key(NS[ns], id), blocks, false);
                        l.rank = DpRank(rank);
                        let at = back(clock, back_ms);
                        let a = inc.record_dispatch(std::slice::from_ref(&l), at);
                        let b = full.record_dispatch(std::slice::from_ref(&l), at);
                        prop_assert_eq!(a, b);
                        ids.push(a);
                    }
                    Op::Sample { id, rank, back_ms, publisher } => {
                        sequence += 1;
                        store.apply(LoadSample {
                            load: ActiveLoad {
                                worker_id: InstanceId(id),
                                dp_rank: DpRank(rank),
                                active_decode_blocks: Some(1),
                                active_prefill_tokens: None,
                                kv_used_blocks: None,
                            },
                            publisher_id: PublisherId(id * 2 + publisher),
                            sequence,
                            published_at: UnixMillis(0),
                            received_at: back(clock, back_ms),
                        });
                    }
                    Op::Drop { publisher } => {
                        store.drop_publisher(PublisherId(publisher));
                    }
                    Op::Live { id, live: on } => {
                        if on { live.insert(id); } else { live.remove(&id); }
                        store.set_live_and_retain(live.iter().map(|&i| InstanceId(i)));
                    }
                    Op::Withdraw { nth } => {
                        if let Some(&id) = ids.get(nth % ids.len().max(1)) {
                            inc.withdraw(id);
                            full.withdraw(id);
                        }
                    }
                    Op::SampleArrived { ns, id, back_ms } => {
                        let at = back(clock, back_ms);
                        inc.sample_arrived(&key(NS[ns], id), at);
                        full.sample_arrived(&key(NS[ns], id), at);
                    }
                    Op::Answer => {
                        inc.answer_store(&store);
                        full.answer_arrivals(|instance| store.last_arrival(instance));
                        prop_assert_eq!(inc.unanswered(), full.unanswered());
                        prop_assert_eq!(inc.pending_legs(), full.pending_legs());
                        for ns in NS {
                            for id in 1..5 {
                                for rank in 0..2 {
                                    let w = key(ns, id);
                                    prop_assert_eq!(
                                        inc.backlog(&w, DpRank(rank), clock),
                                        full.backlog(&w, DpRank(rank), clock)
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
