//! Breaking the herd of router replicas: a replica-seeded choice among near-equal candidates.
//!
//! Several router replicas that decide in the same instant read the same published load and
//! the same KV index; whatever they share of their in-flight dispatches arrives a publish
//! interval later. With the same view, a deterministic argmin sends every replica to the same
//! "best" rank (docs/replay.md, "Several router replicas"). The tie-break treats as tied the
//! ranks whose cost is within `window` × *the request's own weight* (what this dispatch adds to
//! a rank's cost: its prompt blocks for decode and for the KV formula, its prompt tokens for
//! load-based prefill) above the lowest, and chooses one of them uniformly by a draw from a
//! counter hashed with the replica's seed. Replicas with identical views then diverge, while a
//! rank that is worse by more than the window is never chosen. A difference smaller than one
//! request is what a peer's simultaneous dispatch would add anyway, so within it the "best" is
//! noise to the herd.
//!
//! The draw is deterministic for a seed (a replay replays); the live router seeds it from the
//! replica id (`replica_sync.replica_id`, else `$POD_NAME`, else the host name). The picker
//! itself still draws no randomness: the draw comes from [`TieDraws`], held in the
//! [`PickerState`](super::PickerState) of the replica.
//!
//! **Peer slots** (`dynamo.load.peer_slots`): a replica that knows its [`Place`] among the live
//! replicas — `index` of `count`, from `replica_sync`'s peer table — takes the `index`-th lowest
//! cost of the tie set instead of a random one, and counts the slots its peers take on the same
//! view (the other `count − 1` lowest, each with this request's weight) as peer contributions
//! until a load sample answers them ([`take_slot`]). Replicas deciding on one view then do what
//! one router would have done with `count` requests of this size: one per slot, and their next
//! decisions see every slot taken. A random draw only makes collisions less likely; the slots
//! remove them while the views agree.
//! A replica that knows no peer decides as without the tie-break.

use crate::kv::mooncake::splitmix64;

/// The largest `dynamo.load.tie_break_window` (a window of 16 requests is no longer a tie).
pub const MAX_WINDOW: f64 = 16.0;

/// Replicas a [`Place`] counts at most: the peers' slots a pick records are bounded by it.
pub const MAX_PEER_SLOTS: u32 = 64;

/// This replica's place among the live router replicas (itself and its peers, ordered by
/// replica id): `index` of `count`. `count` 1 is a router alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Place {
    pub index: u32,
    pub count: u32,
}

impl Place {
    /// A router alone (no peer known).
    pub const ALONE: Place = Place { index: 0, count: 1 };

    /// `index` of `count`, with `count` clamped to `1..=`[`MAX_PEER_SLOTS`] and `index` below it.
    pub fn new(index: usize, count: usize) -> Self {
        let count = u32::try_from(count)
            .unwrap_or(MAX_PEER_SLOTS)
            .clamp(1, MAX_PEER_SLOTS);
        let index = u32::try_from(index).unwrap_or(u32::MAX) % count;
        Place { index, count }
    }

    /// Whether peers are known.
    pub fn has_peers(&self) -> bool {
        self.count > 1
    }
}

impl Default for Place {
    fn default() -> Self {
        Self::ALONE
    }
}

/// `dynamo.load.tie_break_window` and the replica's seed: the window (0 = off: the lowest cost wins, the round-robin cursor
/// rotates exact ties) and the replica's seed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TieBreak {
    /// Ranks within `window` × the request's own weight of the lowest cost tie.
    pub window: f64,
    /// The replica's seed: replicas with different seeds draw differently.
    pub seed: u64,
    /// `dynamo.load.peer_slots`: with peers known, take this replica's slot of the tie set and
    /// count its peers' slots (see the module docs) instead of drawing.
    pub peer_slots: bool,
}

impl TieBreak {
    /// No tie-break: exact ties rotate on the cursor, as without one.
    pub const OFF: TieBreak = TieBreak {
        window: 0.0,
        seed: 0,
        peer_slots: false,
    };

    /// Whether a window is set (a non-finite or non-positive window is off).
    pub fn is_on(&self) -> bool {
        self.window.is_finite() && self.window > 0.0
    }

    /// A seed from a replica id (FNV-1a, then mixed): stable across restarts and platforms.
    pub fn seed_of(replica_id: &str) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in replica_id.as_bytes() {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        splitmix64(h)
    }
}

impl Default for TieBreak {
    fn default() -> Self {
        Self::OFF
    }
}

/// One phase's draw: the window and 64 random-looking bits, or with peer slots on and peers
/// known, this replica's place (the bits are then unused).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TieDraw {
    pub window: f64,
    pub bits: u64,
    pub place: Option<Place>,
}

impl TieDraw {
    /// The absolute slack in cost units, given the request's own weight in those units.
    #[inline]
    pub fn slack(&self, request_weight: f64) -> f64 {
        let slack = self.window * request_weight;
        if slack.is_finite() && slack > 0.0 {
            slack
        } else {
            0.0
        }
    }

    /// Which of `count` tied ranks the draw takes (Lemire's multiply-shift: uniform, no division).
    #[inline]
    pub fn nth(&self, count: usize) -> usize {
        ((u128::from(self.bits) * count as u128) >> 64) as usize
    }
}

/// One phase's turn: its round-robin cursor value and, with the tie-break on, its draw.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Turn {
    pub cursor: u64,
    pub tie: Option<TieDraw>,
}

/// A replica's tie-break settings and its draw counter.
#[derive(Clone, Debug, Default)]
pub struct TieDraws {
    setting: TieBreak,
    draws: u64,
}

impl TieDraws {
    /// Applies `setting`; the counter restarts only when the seed changes.
    pub fn set(&mut self, setting: TieBreak) {
        if setting.seed != self.setting.seed {
            self.draws = 0;
        }
        self.setting = setting;
    }

    pub fn setting(&self) -> TieBreak {
        self.setting
    }

    /// The next draw, `None` when the tie-break is off (no counter advances then). `place` is
    /// this replica's among its peers: with peer slots on, the draw carries it when a peer is
    /// known, and there is none while the replica is alone (the lowest cost wins, exactly as
    /// without the tie-break: a single router keeps its behaviour and its fast passes).
    #[inline]
    pub fn draw(&mut self, place: Place) -> Option<TieDraw> {
        if !self.setting.is_on() || (self.setting.peer_slots && !place.has_peers()) {
            return None;
        }
        self.draws = self.draws.wrapping_add(1);
        Some(TieDraw {
            window: self.setting.window,
            bits: splitmix64(self.setting.seed ^ splitmix64(self.draws)),
            place: (self.setting.peer_slots && place.has_peers()).then_some(place),
        })
    }
}

/// Peer slots: `tied` is the tie set as `(cost, id)` in any order (ids distinct). Orders its
/// `place.count` lowest by cost then id (the rest stays unordered), returns the id in slot
/// `place.index` and appends to `peers` the ids of the other slots, one per peer: slot `k` of
/// `count` is the `k mod len`-th lowest, so a tie set smaller than the replicas is taken round
/// and round as one router would. `None` (and no peer) when `tied` is empty.
pub fn take_slot(tied: &mut [(f64, u32)], place: Place, peers: &mut Vec<u32>) -> Option<u32> {
    if tied.is_empty() {
        return None;
    }
    let count = place.count.clamp(1, MAX_PEER_SLOTS) as usize;
    let n = count.min(tied.len());
    let order = |a: &(f64, u32), b: &(f64, u32)| slot_order(*a, *b);
    if n < tied.len() {
        tied.select_nth_unstable_by(n - 1, order);
    }
    tied[..n].sort_unstable_by(order);
    let own = place.index as usize % count;
    peers.extend((0..count).filter(|&k| k != own).map(|k| tied[k % n].1));
    Some(tied[own % n].1)
}

/// The order [`take_slot`] gives a tie set: by cost, then by id.
#[inline]
fn slot_order(a: (f64, u32), b: (f64, u32)) -> std::cmp::Ordering {
    a.0.total_cmp(&b.0).then(a.1.cmp(&b.1))
}

/// Peer slots inside a fast pass: the `k` lowest `(cost, id)` offered (in [`take_slot`]'s
/// order, `k` the replicas' count), each with a payload `T` (what the pass prunes on), kept
/// while the pass walks its ranks, so the tie set needs no second walk. The tie window is
/// relative to the lowest cost, known only at the end: the `k` lowest are kept, and
/// [`Self::take`] applies the window. Sorted, at most `k` ≤ [`MAX_PEER_SLOTS`] entries, in a
/// buffer reused across picks.
#[derive(Debug)]
pub struct Nearest<T> {
    k: usize,
    kept: Vec<(f64, u32, T)>,
}

impl<T> Default for Nearest<T> {
    fn default() -> Self {
        Self {
            k: 1,
            kept: Vec::new(),
        }
    }
}

impl<T: Copy> Nearest<T> {
    /// Empties the set for a pick by a replica at `place`.
    pub fn reset(&mut self, place: Place) {
        self.k = place.count.clamp(1, MAX_PEER_SLOTS) as usize;
        self.kept.clear();
    }

    /// Keeps `(cost, id)` if it is among the `k` lowest so far (ids distinct).
    #[inline]
    pub fn offer(&mut self, cost: f64, id: u32, payload: T) {
        if self.kept.len() >= self.k {
            match self.kept.last() {
                Some(&(c, i, _)) if slot_order((cost, id), (c, i)).is_lt() => {
                    self.kept.pop();
                }
                _ => return,
            }
        }
        let at = self
            .kept
            .partition_point(|&(c, i, _)| slot_order((c, i), (cost, id)).is_lt());
        self.kept.insert(at, (cost, id, payload));
    }

    /// The `k`-th lowest's cost and payload once `k` are kept: an offer that does not order
    /// before it is not kept.
    #[inline]
    pub fn full_last(&self) -> Option<(f64, T)> {
        if self.kept.len() >= self.k {
            self.kept.last().map(|&(c, _, t)| (c, t))
        } else {
            None
        }
    }

    /// The lowest kept: its payload and id.
    pub fn first(&self) -> Option<(T, u32)> {
        self.kept.first().map(|&(_, i, t)| (t, i))
    }

    /// [`take_slot`] over the tie set's lowest: the kept costs at most `limit` (the lowest
    /// plus the window's slack), copied into `tied`. When every cost of the tie set was offered,
    /// this is what [`take_slot`] over the whole tie set gives: it only reads its `place.count`
    /// lowest, and those are the first kept within the limit.
    pub fn take(
        &self,
        limit: f64,
        place: Place,
        tied: &mut Vec<(f64, u32)>,
        peers: &mut Vec<u32>,
    ) -> Option<u32> {
        tied.clear();
        tied.extend(
            self.kept
                .iter()
                .filter(|&&(c, _, _)| c <= limit)
                .map(|&(c, i, _)| (c, i)),
        );
        take_slot(tied, place, peers)
    }
}

/// The position the draw chooses among `costs`: uniformly among the finite costs at most
/// `slack` above the lowest finite cost (the tie set). `None` when no cost is finite.
pub fn near_tie_index(costs: &[f64], slack: f64, draw: &TieDraw) -> Option<usize> {
    near_tie_index_where(costs, slack, draw, |_, _| true)
}

/// [`near_tie_index`] over the tie set narrowed by `keep(lowest, pos)`: `pos` ties only if it
/// also keeps against the position of the lowest cost (the first lowest; it always keeps
/// itself). The KV-aware picker keeps only ranks holding at least as much of the prompt as the
/// lowest, so the draw spreads load and never trades cached blocks away.
pub fn near_tie_index_where(
    costs: &[f64],
    slack: f64,
    draw: &TieDraw,
    keep: impl Fn(usize, usize) -> bool,
) -> Option<usize> {
    let (lowest, min) = costs
        .iter()
        .copied()
        .enumerate()
        .filter(|(_, c)| c.is_finite())
        .reduce(|a, b| if b.1 < a.1 { b } else { a })?;
    let limit = min + slack.max(0.0);
    let tied = |(i, c): &(usize, &f64)| {
        c.is_finite() && **c <= limit && (*i == lowest || keep(lowest, *i))
    };
    let count = costs.iter().enumerate().filter(tied).count();
    costs
        .iter()
        .enumerate()
        .filter(tied)
        .nth(draw.nth(count))
        .map(|(i, _)| i)
        .or(Some(lowest))
}

/// The tie set [`near_tie_index_where`] chooses from, as `(cost, position)` pairs in position
/// order, into `out` (cleared first); empty when no cost is finite.
pub fn near_tie_set_where(
    costs: &[f64],
    slack: f64,
    keep: impl Fn(usize, usize) -> bool,
    out: &mut Vec<(f64, u32)>,
) {
    out.clear();
    let Some((lowest, min)) = costs
        .iter()
        .copied()
        .enumerate()
        .filter(|(_, c)| c.is_finite())
        .reduce(|a, b| if b.1 < a.1 { b } else { a })
    else {
        return;
    };
    let limit = min + slack.max(0.0);
    out.extend(
        costs
            .iter()
            .enumerate()
            .filter(|&(i, c)| c.is_finite() && *c <= limit && (i == lowest || keep(lowest, i)))
            .map(|(i, c)| (*c, u32::try_from(i).unwrap_or(u32::MAX))),
    );
}

#[cfg(test)]
mod picks;
#[cfg(test)]
mod slots;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn draws(window: f64, seed: u64) -> TieDraws {
        let mut d = TieDraws::default();
        d.set(TieBreak {
            window,
            seed,
            peer_slots: false,
        });
        d
    }

    #[test]
    fn off_draws_nothing() {
        let mut d = TieDraws::default();
        assert_eq!(d.draw(Place::ALONE), None);
        for window in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert_eq!(draws(window, 7).draw(Place::ALONE), None, "{window}");
        }
        assert!(draws(0.5, 7).draw(Place::ALONE).is_some());
    }

    #[test]
    fn a_single_candidate_is_always_chosen() {
        let mut d = draws(1.0, 3);
        for _ in 0..100 {
            let draw = d.draw(Place::ALONE).unwrap();
            assert_eq!(near_tie_index(&[42.0], 1e9, &draw), Some(0));
            assert_eq!(
                near_tie_index(&[f64::INFINITY, 5.0, f64::NAN], 1e9, &draw),
                Some(1)
            );
        }
        let draw = d.draw(Place::ALONE).unwrap();
        assert_eq!(near_tie_index(&[], 1.0, &draw), None);
        assert_eq!(near_tie_index(&[f64::NAN, f64::INFINITY], 1.0, &draw), None);
    }

    #[test]
    fn identical_views_spread_across_replicas() {
        // 32 replicas, one identical view of eight equal ranks: a deterministic argmin would
        // send all of them to rank 0; seeded draws spread them over (nearly) every rank.
        let costs = [10.0; 8];
        let picks: Vec<usize> = (0..32u64)
            .map(|replica| {
                let mut d = draws(0.5, TieBreak::seed_of(&format!("router-{replica}")));
                near_tie_index(&costs, 0.0, &d.draw(Place::ALONE).unwrap()).unwrap()
            })
            .collect();
        let distinct = picks
            .iter()
            .collect::<std::collections::BTreeSet<_>>()
            .len();
        assert!(distinct >= 6, "{picks:?}");
        // And over many decisions each replica covers the whole tie set about evenly.
        let mut per = [0u32; 8];
        let mut d = draws(0.5, 11);
        for _ in 0..8000 {
            per[near_tie_index(&costs, 0.0, &d.draw(Place::ALONE).unwrap()).unwrap()] += 1;
        }
        assert!(per.iter().all(|&n| (850..1150).contains(&n)), "{per:?}");
    }

    #[test]
    fn seeds_of_replica_ids_differ_and_are_stable() {
        assert_eq!(TieBreak::seed_of("router-0"), TieBreak::seed_of("router-0"));
        assert_ne!(TieBreak::seed_of("router-0"), TieBreak::seed_of("router-1"));
        assert_ne!(TieBreak::seed_of(""), TieBreak::seed_of("a"));
    }

    #[test]
    fn a_new_seed_restarts_the_counter_and_a_new_window_does_not() {
        let mut a = draws(1.0, 5);
        let first = a.draw(Place::ALONE).unwrap();
        a.set(TieBreak {
            window: 2.0,
            seed: 5,
            peer_slots: false,
        });
        let second = a.draw(Place::ALONE).unwrap();
        assert_ne!(first.bits, second.bits, "the counter kept going");
        a.set(TieBreak {
            window: 2.0,
            seed: 6,
            peer_slots: false,
        });
        a.set(TieBreak {
            window: 2.0,
            seed: 5,
            peer_slots: false,
        });
        assert_eq!(
            a.draw(Place::ALONE).unwrap().bits,
            first.bits,
            "restarted on the seed"
        );
    }

    proptest! {
        #[test]
        fn never_outside_the_tie_set_and_deterministic(
            costs in prop::collection::vec(
                prop_oneof![8 => -1e6f64..1e6, 1 => Just(f64::INFINITY), 1 => Just(f64::NAN)],
                1..40,
            ),
            slack in 0f64..1e5,
            seed in any::<u64>(),
            window in 0.01f64..16.0,
        ) {
            let mut a = draws(window, seed);
            let mut b = draws(window, seed);
            for _ in 0..8 {
                let (da, db) = (a.draw(Place::ALONE).unwrap(), b.draw(Place::ALONE).unwrap());
                let chosen = near_tie_index(&costs, slack, &da);
                prop_assert_eq!(chosen, near_tie_index(&costs, slack, &db));
                let min = costs.iter().copied().filter(|c| c.is_finite()).reduce(f64::min);
                match (chosen, min) {
                    (Some(i), Some(min)) => {
                        prop_assert!(costs[i].is_finite());
                        prop_assert!(costs[i] <= min + slack, "{} > {} + {}", costs[i], min, slack);
                    }
                    (None, None) => {}
                    other => prop_assert!(false, "{:?}", other),
                }
            }
        }

        #[test]
        fn zero_slack_keeps_the_lowest_cost(
            costs in prop::collection::vec(0u32..50, 1..30),
            seed in any::<u64>(),
        ) {
            let costs: Vec<f64> = costs.into_iter().map(f64::from).collect();
            let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
            let draw = draws(1.0, seed).draw(Place::ALONE).unwrap();
            let i = near_tie_index(&costs, 0.0, &draw).unwrap();
            prop_assert_eq!(costs[i], min);
        }
    }
}
