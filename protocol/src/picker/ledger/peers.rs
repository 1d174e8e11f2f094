//! Peer router replicas in the ledger (`replica_sync`): what a peer holds unanswered is recorded
//! here as one peer dispatch, counted like this router's own legs and answered by samples the
//! same way, but never marking a stall and never published back; and this router's own legs,
//! summed per rank, are what it publishes to its peers.

use super::{DISPATCH_MAX_AGE, DispatchId, DispatchLedger, DispatchLeg};
use crate::ids::{DpRank, InstanceId, Namespace};
use crate::picker::tie_break::Place;
use crate::time::Tick;

/// This router's unanswered legs on one rank, summed: what its peers add to that rank.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct LocalContribution {
    pub namespace: Namespace,
    pub instance: InstanceId,
    pub rank: DpRank,
    pub prefill_tokens: u64,
    pub decode_blocks: u64,
    /// Unanswered requests (legs) on the rank.
    pub requests: u32,
}

impl DispatchLedger {
    /// This router's place among the live replicas (itself and the peers it hears from, by
    /// replica id), for `dynamo.load.peer_slots`; [`Place::ALONE`] until a peer is known.
    pub fn place(&self) -> Place {
        self.place
    }

    /// Sets this router's place (`replica_sync`'s peer table keeps it; the replay sets it).
    pub fn set_place(&mut self, place: Place) {
        self.place = place;
    }

    /// Records the slots this router's peers take on its view of one pick (`dynamo.load.peer_slots`,
    /// [`take_slot`](crate::picker::tie_break::take_slot)): peer legs like a peer's
    /// contributions (answered by samples, never a stall, never published), ended by no request.
    pub fn record_peer_slots(&mut self, legs: &[DispatchLeg], now: Tick) {
        if !legs.is_empty() {
            self.record(legs, now, true);
        }
    }

    /// Records a peer replica's contributions at `now` as one dispatch (one leg per entry): they
    /// count as backlog until a sample answers them, [`Self::withdraw`] replaces them or they age
    /// out, and never mark a stall.
    pub fn record_peer(&mut self, legs: &[DispatchLeg], now: Tick) -> DispatchId {
        self.record(legs, now, true)
    }

    /// Forgets every peer dispatch (the replica sync stopped or restarted) and the peers' place;
    /// how many dispatches there were.
    pub fn withdraw_peers(&mut self) -> usize {
        self.place = Place::ALONE;
        let peers: Vec<DispatchId> = self.order.iter().filter(|d| d.peer).map(|d| d.id).collect();
        for &id in &peers {
            self.withdraw(id);
        }
        peers.len()
    }

    /// Legs of peer dispatches still held.
    pub fn peer_legs(&self) -> usize {
        self.namespaces
            .iter()
            .flat_map(|ns| ns.workers.values())
            .map(|p| p.peer_len())
            .sum()
    }

    /// This router's own legs still counting at `now`, summed per `(namespace, instance,
    /// rank)`, sorted; at most `max` of them (the rest left out), and whether any were.
    pub fn local_contributions(&self, now: Tick, max: usize) -> (Vec<LocalContribution>, bool) {
        // Namespaces in name order, then per instance its ranks (few) summed, then one sort.
        let mut order: Vec<usize> = (0..self.namespaces.len()).collect();
        order.sort_unstable_by(|&a, &b| {
            self.namespaces[a]
                .namespace
                .as_str()
                .cmp(self.namespaces[b].namespace.as_str())
        });
        let mut sums: Vec<(usize, InstanceId, DpRank, u64, u64, u32)> = Vec::new();
        let mut ranks: Vec<(DpRank, u64, u64, u32)> = Vec::new();
        for (pos, &ns_index) in order.iter().enumerate() {
            for (&instance, pendings) in &self.namespaces[ns_index].workers {
                ranks.clear();
                pendings.for_each_local(|p| {
                    if now.since(p.at) >= DISPATCH_MAX_AGE {
                        return;
                    }
                    let at = match ranks.iter().position(|r| r.0 == p.rank) {
                        Some(at) => at,
                        None => {
                            ranks.push((p.rank, 0, 0, 0));
                            ranks.len() - 1
                        }
                    };
                    let r = &mut ranks[at];
                    r.1 = r.1.saturating_add(p.prefill_tokens);
                    r.2 = r.2.saturating_add(p.decode_blocks);
                    r.3 = r.3.saturating_add(1);
                });
                sums.extend(ranks.iter().map(|r| (pos, instance, r.0, r.1, r.2, r.3)));
            }
        }
        sums.sort_unstable_by_key(|e| (e.0, e.1, e.2));
        let truncated = sums.len() > max;
        let out = sums
            .into_iter()
            .take(max)
            .map(
                |(pos, instance, rank, tokens, blocks, requests)| LocalContribution {
                    namespace: self.namespaces[order[pos]].namespace.clone(),
                    instance,
                    rank,
                    prefill_tokens: tokens,
                    decode_blocks: blocks,
                    requests,
                },
            )
            .collect();
        (out, truncated)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{key, leg, s};
    use super::*;

    #[test]
    fn peer_legs_count_as_backlog_but_are_never_published_nor_stalled() {
        let w = key("ns", 1);
        let mut ledger = DispatchLedger::new();
        ledger.record_dispatch(&[leg(w.clone(), 3, false)], s(1));
        let peer = ledger.record_peer(&[leg(w.clone(), 5, false)], s(1));
        let b = ledger.backlog(&w, DpRank(0), s(7));
        assert_eq!(
            (b.decode_blocks, b.stalled),
            (8, true),
            "the local leg stalls"
        );
        assert_eq!(ledger.peer_legs(), 1);
        let (local, truncated) = ledger.local_contributions(s(2), 10);
        assert!(!truncated);
        assert_eq!(local.len(), 1);
        assert_eq!((local[0].decode_blocks, local[0].requests), (3, 1));
        ledger.withdraw(peer);
        assert_eq!(ledger.backlog(&w, DpRank(0), s(2)).decode_blocks, 3);
        ledger.record_peer(&[leg(w.clone(), 5, false)], s(2));
        ledger.record_peer(&[leg(key("ns", 2), 5, false)], s(2));
        assert_eq!(ledger.withdraw_peers(), 2);
        assert_eq!(ledger.peer_legs(), 0);
        assert_eq!(ledger.backlog(&w, DpRank(0), s(2)).decode_blocks, 3);
    }

    #[test]
    fn local_contributions_sum_per_rank_and_are_bounded() {
        let mut ledger = DispatchLedger::new();
        for id in 0..4 {
            ledger.record_dispatch(&[leg(key("ns", id), 1, false)], s(1));
            ledger.record_dispatch(&[leg(key("ns", id), 2, false)], s(1));
        }
        let (all, truncated) = ledger.local_contributions(s(1), 10);
        assert!(!truncated);
        assert_eq!(all.len(), 4);
        assert!(all.iter().all(|c| c.decode_blocks == 3 && c.requests == 2));
        let (two, truncated) = ledger.local_contributions(s(1), 2);
        assert!(truncated);
        assert_eq!(two, all[..2]);
        assert!(
            ledger.local_contributions(s(31), 10).0.is_empty(),
            "aged out"
        );
    }
}
