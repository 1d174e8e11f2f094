//! Several router replicas behind one Service: how the trace is spread over them, and the two
//! delayed deliveries each replica sees — the workers' published load (after `load_lag`) and,
//! with sharing, its peers' dispatches (after `share_lag`).
//!
//! Every replica reads the same published load (one store, delivered to all replicas after the
//! same lag) and the same kv-events (one index); what differs is its own dispatch ledger: the
//! requests it sent that no load sample has answered yet. Without sharing a replica does not see
//! what its peers dispatched until the workers' load reflects it; with sharing each dispatch is
//! recorded in every peer's ledger `share_lag` after it was made.

use std::collections::VecDeque;
use std::time::Duration;

use continuum_protocol::kv::mooncake::splitmix64;
use continuum_protocol::picker::tie_break::Place;
use continuum_protocol::picker::{DispatchLeg, TieBreak};

/// How requests are spread over the replicas, as a Kubernetes Service would.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Spread {
    /// Request i goes to replica i mod N (kube-proxy IPVS `rr`).
    #[default]
    RoundRobin,
    /// A seeded uniform draw per request (kube-proxy iptables mode).
    Random,
}

impl Spread {
    pub fn as_label(self) -> &'static str {
        match self {
            Spread::RoundRobin => "round_robin",
            Spread::Random => "random",
        }
    }

    /// The replica (of `count`) that takes the `i`-th request of the trace.
    pub fn replica_of(self, i: u64, count: u32, seed: u64) -> usize {
        let n = u64::from(count.max(1));
        let pick = match self {
            Spread::RoundRobin => i % n,
            // A hash independent of the softmax draws, so spreading changes no other draw.
            Spread::Random => splitmix64(splitmix64(seed ^ 0x5eed_5be1) ^ i) % n,
        };
        pick as usize
    }
}

impl std::str::FromStr for Spread {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "round_robin" => Ok(Spread::RoundRobin),
            "random" => Ok(Spread::Random),
            other => Err(format!(
                "unknown spread `{other}` (expected round_robin or random)"
            )),
        }
    }
}

/// The simulated router replicas.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Replicas {
    /// Router replicas (1: one router, the replay's original behaviour).
    pub count: u32,
    pub spread: Spread,
    /// Delay between a worker publishing its load and the replicas receiving it.
    pub load_lag: Duration,
    /// Each replica records its peers' dispatches in its own ledger.
    pub sharing: bool,
    /// Delay before a peer's dispatch reaches a replica's ledger (batching + transport).
    pub share_lag: Duration,
    /// `dynamo.load.tie_break_window` of every replica (0: off).
    pub tie_break_window: f64,
    /// `dynamo.load.peer_slots` of every replica (used with `sharing`: peers known).
    pub peer_slots: bool,
}

impl Replicas {
    /// Replica `replica`'s tie-break: the window, and a seed of the replay's seed and the
    /// replica's index (the live router's comes from its replica id).
    pub fn tie_break(&self, seed: u64, replica: u32) -> TieBreak {
        TieBreak {
            window: self.tie_break_window,
            seed: splitmix64(splitmix64(seed ^ 0x71e_b4ea) ^ u64::from(replica)),
            peer_slots: self.peer_slots,
        }
    }

    /// Replica `replica`'s place among its peers: known only with sharing (the live router
    /// learns it from `replica_sync`'s peer table), else alone.
    pub fn place(&self, replica: u32) -> Place {
        if self.sharing && self.count > 1 {
            Place::new(replica as usize, self.count as usize)
        } else {
            Place::ALONE
        }
    }
}

/// Upper bound on simulated replicas.
pub const MAX_REPLICAS: u32 = 64;

impl Default for Replicas {
    fn default() -> Self {
        Self {
            count: 1,
            spread: Spread::RoundRobin,
            load_lag: Duration::ZERO,
            sharing: false,
            share_lag: Duration::from_millis(5),
            tie_break_window: 0.0,
            peer_slots: false,
        }
    }
}

/// One dispatch on its way to the peers of the replica that made it.
#[derive(Clone, Debug)]
pub(super) struct SharedDispatch {
    /// When the peers receive it, µs.
    pub(super) deliver_us: u64,
    pub(super) origin: usize,
    pub(super) legs: Vec<DispatchLeg>,
}

/// A FIFO of items due at non-decreasing times (a constant lag after non-decreasing events).
#[derive(Debug)]
pub(super) struct Delayed<T> {
    queue: VecDeque<(u64, T)>,
}

impl<T> Default for Delayed<T> {
    fn default() -> Self {
        Self {
            queue: VecDeque::new(),
        }
    }
}

impl<T> Delayed<T> {
    /// Queues `item` for `due_us`.
    pub(super) fn push(&mut self, due_us: u64, item: T) {
        self.queue.push_back((due_us, item));
    }

    /// The next item due at or before `t_us`, in queue order.
    pub(super) fn pop_due(&mut self, t_us: u64) -> Option<T> {
        if self.queue.front().is_some_and(|(due, _)| *due <= t_us) {
            self.queue.pop_front().map(|(_, item)| item)
        } else {
            None
        }
    }
}

/// Whole microseconds of `d`, saturating.
pub(super) fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_spreads_evenly_in_turn() {
        let picks: Vec<usize> = (0..8)
            .map(|i| Spread::RoundRobin.replica_of(i, 3, 7))
            .collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2, 0, 1]);
        assert!((0..100).all(|i| Spread::RoundRobin.replica_of(i, 1, 0) == 0));
    }

    #[test]
    fn random_spread_is_seeded_uniform_and_in_range() {
        let count = 4;
        let mut per = [0u32; 4];
        for i in 0..8000 {
            per[Spread::Random.replica_of(i, count, 1)] += 1;
        }
        // Roughly 2,000 each: far from round robin's exact turns, close to uniform.
        assert!(per.iter().all(|&n| (1800..2200).contains(&n)), "{per:?}");
        let a: Vec<usize> = (0..64)
            .map(|i| Spread::Random.replica_of(i, 4, 1))
            .collect();
        let b: Vec<usize> = (0..64)
            .map(|i| Spread::Random.replica_of(i, 4, 1))
            .collect();
        let c: Vec<usize> = (0..64)
            .map(|i| Spread::Random.replica_of(i, 4, 2))
            .collect();
        assert_eq!(a, b, "same seed, same spread");
        assert_ne!(a, c, "another seed, another spread");
        assert_ne!(a, (0..64).map(|i| i % 4).collect::<Vec<_>>());
        assert!((0..100).all(|i| Spread::Random.replica_of(i, 1, 9) == 0));
    }

    #[test]
    fn spreads_parse_by_label() {
        for spread in [Spread::RoundRobin, Spread::Random] {
            assert_eq!(spread.as_label().parse::<Spread>(), Ok(spread));
        }
        assert!("hash".parse::<Spread>().is_err());
    }

    #[test]
    fn delayed_items_come_out_only_once_due_and_in_order() {
        let mut d = Delayed::default();
        d.push(10, 'a');
        d.push(10, 'b');
        d.push(25, 'c');
        assert_eq!(d.pop_due(9), None);
        assert_eq!(d.pop_due(10), Some('a'));
        assert_eq!(d.pop_due(10), Some('b'));
        assert_eq!(d.pop_due(24), None);
        assert_eq!(d.pop_due(100), Some('c'));
        assert_eq!(d.pop_due(100), None);
    }
}
