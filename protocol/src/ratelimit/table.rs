//! Per-name rate-limit state under an LRU cap.
//!
//! Names are configured key or backend names (a closed set). Each entry remembers the limits it
//! was filled under: [`KeyedState::reconfigure`] keeps the state of a name whose limits did not
//! change and forgets the rest, so a reload never refills an unchanged key's buckets. Beyond
//! `cap` entries the least recently used one is forgotten (its next request starts from a full
//! bucket) and counted in [`KeyedState::evictions`].

use ahash::AHashMap;

use super::{LimitState, Limits, Refusal};
use crate::time::Tick;

#[derive(Clone, Debug)]
struct Entry {
    limits: Limits,
    state: LimitState,
    used: u64,
}

/// Rate-limit state by name, at most `cap` entries.
#[derive(Clone, Debug)]
pub struct KeyedState {
    entries: AHashMap<String, Entry>,
    cap: usize,
    clock: u64,
    evictions: u64,
}

impl KeyedState {
    /// An empty table holding at most `cap` names (at least 1).
    pub fn new(cap: usize) -> Self {
        Self {
            entries: AHashMap::new(),
            cap: cap.max(1),
            clock: 0,
            evictions: 0,
        }
    }

    /// Names currently tracked.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no name is tracked.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Entries forgotten to stay within the cap, since creation.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Keeps the state of every name whose limits are unchanged (`limits_of` answers the new
    /// limits, `None` when the name has none any more); forgets the others. A new cap applies.
    pub fn reconfigure(&mut self, cap: usize, limits_of: impl Fn(&str) -> Option<Limits>) {
        self.cap = cap.max(1);
        self.entries
            .retain(|name, entry| limits_of(name) == Some(entry.limits));
        while self.entries.len() > self.cap {
            self.evict();
        }
    }

    /// The state of `name` under `limits` (a fresh, full one when untracked or tracked under
    /// other limits), marked used.
    fn entry(&mut self, name: &str, limits: &Limits) -> &mut Entry {
        self.clock += 1;
        let used = self.clock;
        let fresh = self.entries.get(name).is_none_or(|e| e.limits != *limits);
        if fresh {
            if !self.entries.contains_key(name) && self.entries.len() >= self.cap {
                self.evict();
            }
            self.entries.insert(
                name.to_owned(),
                Entry {
                    limits: *limits,
                    state: LimitState::default(),
                    used,
                },
            );
        }
        let entry = self.entries.get_mut(name).expect("inserted above");
        entry.used = used;
        entry
    }

    fn evict(&mut self) {
        let oldest = self
            .entries
            .iter()
            .min_by_key(|(_, e)| e.used)
            .map(|(name, _)| name.clone());
        if let Some(name) = oldest {
            self.entries.remove(&name);
            self.evictions += 1;
        }
    }

    /// Admits one request of `name` costing `tokens`, or refuses it (nothing debited).
    pub fn admit(
        &mut self,
        name: &str,
        limits: &Limits,
        now: Tick,
        tokens: u64,
    ) -> Result<(), Refusal> {
        self.entry(name, limits).state.admit(limits, now, tokens)
    }

    /// Whether `name` would admit a request costing `tokens` now (debits nothing; an untracked
    /// name would).
    pub fn would_admit(&self, name: &str, limits: &Limits, now: Tick, tokens: u64) -> bool {
        match self.entries.get(name) {
            Some(e) if e.limits == *limits => e.state.check(limits, now, tokens).is_none(),
            _ => true,
        }
    }

    /// Debits `tokens` from `name`'s tokens bucket unconditionally (completion tokens).
    pub fn debit_tokens(&mut self, name: &str, limits: &Limits, now: Tick, tokens: u64) {
        self.entry(name, limits).state.debit(limits, now, 0, tokens);
    }
}
