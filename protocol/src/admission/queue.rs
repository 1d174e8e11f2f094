//! One model's wait queue: priority classes with aging, and deficit round robin between keys
//! inside a class.
//!
//! **Order.** Each waiting request has a class (0 is served first) and an *effective* class: its
//! class raised by one for every `aging` it has waited (never above 0), so the lowest class still
//! progresses. The queue serves the best effective class present, strictly. Inside that class,
//! keys (API key names) take turns by deficit round robin: each key holds a deficit; a key whose
//! deficit covers the cost of its oldest request in the class is served; otherwise every key of
//! the class is credited `quantum` per round, in rotation order, until one can be served. A key
//! that has nothing left waiting leaves the rotation and forgets its deficit. One key's burst
//! therefore takes its share of the turns, never another key's. Within one key, arrival order.
//!
//! [`WaitQueue::head`] picks the next request (and remembers the pick, so repeated calls agree
//! until it leaves or the order changes); [`WaitQueue::leave`] with `served` charges its cost.
//! Every step is bounded by the number of waiting requests: the rounds a pick needs are computed,
//! not iterated.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use super::Shed;
use crate::time::Tick;

/// Classes 0 (served first) to `CLASSES - 1`.
pub const CLASSES: u8 = 3;

/// The credit a key receives per round, in cost units (prompt tokens). At 1, turns are shared
/// in proportion to cost; a larger quantum lets a key send several small requests in a row (the
/// same long-run share, coarser turns). Rounds are computed, so a small quantum costs nothing.
pub const DEFAULT_QUANTUM: u64 = 1;

/// One queued request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ticket(pub u64);

/// Who waits: the request's class, its key (`""`: unauthenticated) and its cost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Waiting {
    pub class: u8,
    pub key: String,
    /// At least 1 (the prompt-size estimate).
    pub cost: u64,
}

impl Waiting {
    /// The default class (1) without a key, cost 1.
    pub fn anonymous() -> Self {
        Self {
            class: 1,
            key: String::new(),
            cost: 1,
        }
    }
}

/// How the queue orders its requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Order {
    /// A waiting request rises one class per `aging` waited (`None`: never).
    pub aging: Option<Duration>,
    pub quantum: u64,
}

impl Default for Order {
    fn default() -> Self {
        Self {
            aging: None,
            quantum: DEFAULT_QUANTUM,
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Picked {
    ticket: Ticket,
    order: Order,
    until: Option<Tick>,
}

#[derive(Clone, Debug)]
struct Entry {
    ticket: Ticket,
    since: Tick,
    who: Waiting,
}

impl Entry {
    fn effective(&self, now: Tick, aging: Option<Duration>) -> u8 {
        let raised = match aging {
            Some(step) if !step.is_zero() => now.since(self.since).as_nanos() / step.as_nanos(),
            _ => 0,
        };
        let raised = u8::try_from(raised).unwrap_or(u8::MAX);
        self.who.class.saturating_sub(raised)
    }
}

/// One model's wait queue (see the module doc), bounded by the caller's `max_depth`.
#[derive(Debug, Default)]
pub struct WaitQueue {
    /// Arrival order.
    entries: VecDeque<Entry>,
    /// Keys with a waiting request, in rotation order (front: the key the turn is at).
    rotation: VecDeque<String>,
    deficits: HashMap<String, u64>,
    /// The last pick, valid until a request joins, it leaves, the order changes or `until` (the
    /// next time aging changes an effective class): repeated [`WaitQueue::head`] calls are O(1).
    picked: Option<Picked>,
    next: u64,
}

impl WaitQueue {
    pub fn new() -> Self {
        Self::default()
    }

    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Appends a request at `now`, or refuses it when `max_depth` wait already.
    pub fn join(&mut self, now: Tick, max_depth: usize, who: Waiting) -> Result<Ticket, Shed> {
        if self.entries.len() >= max_depth {
            return Err(Shed::QueueFull);
        }
        let ticket = Ticket(self.next);
        self.next = self.next.wrapping_add(1);
        let who = Waiting {
            class: who.class.min(CLASSES - 1),
            cost: who.cost.max(1),
            ..who
        };
        // A newcomer may be better than the last pick.
        self.picked = None;
        if !self.rotation.contains(&who.key) {
            self.rotation.push_back(who.key.clone());
        }
        self.entries.push_back(Entry {
            ticket,
            since: now,
            who,
        });
        Ok(ticket)
    }

    /// The request served next at `now` (see the module doc). O(1) while the last pick holds;
    /// otherwise one pass over the waiting requests per key in the best class.
    pub fn head(&mut self, now: Tick, order: &Order) -> Option<Ticket> {
        if let Some(p) = self.picked
            && p.order == *order
            && p.until.is_none_or(|until| now < until)
        {
            return Some(p.ticket);
        }
        let best = self
            .entries
            .iter()
            .map(|e| e.effective(now, order.aging))
            .min()?;
        let ticket = self.pick(now, order, best)?;
        self.picked = Some(Picked {
            ticket,
            order: *order,
            until: self.next_aging(now, order.aging),
        });
        Some(ticket)
    }

    /// The next time after `now` an effective class changes (`None`: never).
    fn next_aging(&self, now: Tick, aging: Option<Duration>) -> Option<Tick> {
        let step = aging.filter(|a| !a.is_zero())?.as_nanos();
        self.entries
            .iter()
            .filter(|e| e.effective(now, aging) > 0)
            .filter_map(|e| {
                let waited = now.since(e.since).as_nanos();
                let steps = waited / step + 1;
                let at = e.since.0.as_nanos().checked_add(steps.checked_mul(step)?)?;
                Some(Tick(Duration::from_nanos(u64::try_from(at).ok()?)))
            })
            .min()
    }

    /// Deficit round robin among the keys with a request in effective class `best`.
    fn pick(&mut self, now: Tick, order: &Order, best: u8) -> Option<Ticket> {
        let quantum = order.quantum.max(1);
        // Each rotation key's oldest request in the class: (position, ticket, cost).
        let firsts: Vec<(usize, Ticket, u64)> = self
            .rotation
            .iter()
            .enumerate()
            .filter_map(|(at, key)| {
                let e = self
                    .entries
                    .iter()
                    .find(|e| &e.who.key == key && e.effective(now, order.aging) == best)?;
                Some((at, e.ticket, e.who.cost))
            })
            .collect();
        let deficit = |q: &Self, at: usize| q.deficits.get(&q.rotation[at]).copied().unwrap_or(0);
        // Whole rounds every key of the class is credited before one can be served.
        let rounds = firsts
            .iter()
            .map(|&(at, _, cost)| cost.saturating_sub(deficit(self, at)).div_ceil(quantum))
            .min()?;
        let winner = firsts.iter().position(|&(at, _, cost)| {
            deficit(self, at).saturating_add(rounds.saturating_mul(quantum)) >= cost
        })?;
        for (i, &(at, _, _)) in firsts.iter().enumerate() {
            // Keys after the winner have not been visited in the last round yet.
            let visits = if i <= winner {
                rounds
            } else {
                rounds.saturating_sub(1)
            };
            let key = self.rotation[at].clone();
            let held = self.deficits.entry(key).or_insert(0);
            *held = held.saturating_add(visits.saturating_mul(quantum));
        }
        let (at, ticket, _) = firsts[winner];
        self.rotation.rotate_left(at);
        Some(ticket)
    }

    /// Removes `ticket` (dispatched when `served`: its cost is charged to its key; or shed or
    /// gone); how long it waited, `None` when it was not queued.
    pub fn leave(&mut self, ticket: Ticket, now: Tick, served: bool) -> Option<Duration> {
        let at = self.entries.iter().position(|e| e.ticket == ticket)?;
        let entry = self.entries.remove(at)?;
        if self.picked.is_some_and(|p| p.ticket == ticket) {
            self.picked = None;
        }
        let key = &entry.who.key;
        if served && let Some(held) = self.deficits.get_mut(key) {
            *held = held.saturating_sub(entry.who.cost);
        }
        if !self.entries.iter().any(|e| &e.who.key == key) {
            self.rotation.retain(|k| k != key);
            self.deficits.remove(key);
        } else if served && self.rotation.front() == Some(key) {
            // The turn moves on once the key's deficit no longer covers its next request.
            let next_cost = self
                .entries
                .iter()
                .find(|e| &e.who.key == key)
                .map_or(0, |e| e.who.cost);
            if self.deficits.get(key).copied().unwrap_or(0) < next_cost {
                self.rotation.rotate_left(1);
            }
        }
        Some(now.since(entry.since))
    }

    /// When `ticket` joined.
    pub fn since(&self, ticket: Ticket) -> Option<Tick> {
        self.entries
            .iter()
            .find(|e| e.ticket == ticket)
            .map(|e| e.since)
    }

    /// Keys in the rotation (bounded by the requests waiting).
    pub fn keys(&self) -> usize {
        self.rotation.len()
    }
}
