//! Rate-limit arithmetic: GCRA buckets for requests and tokens per minute, with a burst.
//!
//! A [`Bucket`] is one GCRA cell: its *theoretical arrival time* (`tat`), kept in nanoseconds
//! scaled by the rate (`ns * per_minute`) so every step is exact integer arithmetic. It behaves
//! as a token bucket of capacity `burst` refilled at `per_minute` per minute: a cost of `n` is
//! admitted when the bucket holds `min(n, burst)` (a cost above the burst passes only from a full
//! bucket, and then leaves a debt the following requests wait out), and an unconditional
//! [`Bucket::debit`] (completion tokens counted after the answer) may leave a debt too.
//!
//! [`Limits`] pairs a requests bucket with a tokens bucket ([`LimitState`]): a request is
//! admitted only when both admit it, and only then are both debited. The caller owns the clock:
//! `now` is always an argument. [`table::KeyedState`] holds the per-name states under an LRU cap.
//!
//! The response fields follow draft-ietf-httpapi-ratelimit-headers (structured fields):
//! `RateLimit-Policy: "rpm";q=60;w=60` and `RateLimit: "rpm";r=0;t=12`.

pub mod table;
#[cfg(test)]
mod tests;

use std::time::Duration;

use crate::time::Tick;

/// The window every rate is expressed over.
pub const WINDOW: Duration = Duration::from_secs(60);
const WINDOW_NS: u128 = 60_000_000_000;

/// A rate: `per_minute` units refilled per minute, at most `burst` held (both at least 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rate {
    pub per_minute: u64,
    pub burst: u64,
}

impl Rate {
    /// A rate; zeros are raised to 1 (configuration validation refuses them first).
    pub fn new(per_minute: u64, burst: u64) -> Self {
        Self {
            per_minute: per_minute.max(1),
            burst: burst.max(1),
        }
    }
}

/// One GCRA cell. `Default` is a full bucket.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bucket {
    /// Theoretical arrival time, in `ns * per_minute` units.
    tat: u128,
}

fn scaled(now: Tick, rate: Rate) -> u128 {
    now.0.as_nanos() * u128::from(rate.per_minute)
}

impl Bucket {
    /// How long until a cost of `cost` would be admitted (zero: now).
    pub fn wait(&self, rate: Rate, now: Tick, cost: u64) -> Duration {
        let now = scaled(now, rate);
        let need = u128::from(cost.min(rate.burst)) * WINDOW_NS;
        let limit = u128::from(rate.burst) * WINDOW_NS;
        let after = self.tat.max(now) + need;
        let excess = after.saturating_sub(now).saturating_sub(limit);
        let ns = excess.div_ceil(u128::from(rate.per_minute));
        Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX))
    }

    /// Debits `cost` without asking (a debt is allowed).
    pub fn debit(&mut self, rate: Rate, now: Tick, cost: u64) {
        let now = scaled(now, rate);
        self.tat = self.tat.max(now) + u128::from(cost) * WINDOW_NS;
    }

    /// Whole units held now (0 while in debt).
    pub fn remaining(&self, rate: Rate, now: Tick) -> u64 {
        let now = scaled(now, rate);
        let used = self.tat.saturating_sub(now);
        let limit = u128::from(rate.burst) * WINDOW_NS;
        u64::try_from(limit.saturating_sub(used) / WINDOW_NS).unwrap_or(u64::MAX)
    }

    /// Time until the bucket is full again.
    pub fn until_full(&self, rate: Rate, now: Tick) -> Duration {
        let used = self.tat.saturating_sub(scaled(now, rate));
        let ns = used.div_ceil(u128::from(rate.per_minute));
        Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX))
    }
}

/// Which policy refused: requests or tokens per minute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Policy {
    Requests,
    Tokens,
}

impl Policy {
    /// The policy's name in the `RateLimit` fields.
    pub const fn name(self) -> &'static str {
        match self {
            Policy::Requests => "rpm",
            Policy::Tokens => "tpm",
        }
    }
}

/// The limits of one key or backend (either may be unset).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Limits {
    pub requests: Option<Rate>,
    pub tokens: Option<Rate>,
}

impl Limits {
    /// Whether any limit is set.
    pub fn is_set(&self) -> bool {
        self.requests.is_some() || self.tokens.is_some()
    }

    /// `RateLimit-Policy`: one item per set limit.
    pub fn policy_field(&self) -> String {
        let mut items = Vec::new();
        for (policy, rate) in self.rates() {
            items.push(format!(
                "\"{}\";q={};w={}",
                policy.name(),
                rate.per_minute,
                WINDOW.as_secs()
            ));
        }
        items.join(", ")
    }

    fn rates(&self) -> impl Iterator<Item = (Policy, Rate)> {
        let requests = self.requests.map(|r| (Policy::Requests, r));
        let tokens = self.tokens.map(|r| (Policy::Tokens, r));
        requests.into_iter().chain(tokens)
    }
}

/// A refusal: which policy binds, how long to wait, and the `RateLimit` field values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub policy: Policy,
    pub retry_after: Duration,
    /// `RateLimit-Policy`.
    pub policy_field: String,
    /// `RateLimit`.
    pub limit_field: String,
}

impl Refusal {
    /// `Retry-After` in whole seconds (rounded up, at least 1).
    pub fn retry_after_secs(&self) -> u64 {
        let secs = self.retry_after.as_secs() + u64::from(self.retry_after.subsec_nanos() > 0);
        secs.max(1)
    }
}

/// Whose limit refused: the `scope` metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scope {
    /// An API key's (or the unauthenticated) limit.
    Key,
    /// Every backend that could serve the request is at its limit.
    Backend,
}

impl Scope {
    /// The label value.
    pub const fn as_label(self) -> &'static str {
        match self {
            Scope::Key => "key",
            Scope::Backend => "backend",
        }
    }
}

/// A refusal and the configured name of the limit that gave it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limited {
    pub scope: Scope,
    pub name: String,
    pub refusal: Refusal,
}

/// The buckets of one key or backend.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LimitState {
    pub requests: Bucket,
    pub tokens: Bucket,
}

impl LimitState {
    /// The wait before one request costing `tokens` would be admitted, and the binding policy;
    /// `None`: admitted now. Debits nothing.
    pub fn check(&self, limits: &Limits, now: Tick, tokens: u64) -> Option<(Policy, Duration)> {
        let requests = limits
            .requests
            .map(|r| (Policy::Requests, self.requests.wait(r, now, 1)));
        let tokens = limits
            .tokens
            .map(|r| (Policy::Tokens, self.tokens.wait(r, now, tokens)));
        requests
            .into_iter()
            .chain(tokens)
            .filter(|(_, wait)| !wait.is_zero())
            .max_by_key(|(_, wait)| *wait)
    }

    /// Admits one request costing `tokens` (both buckets debited) or refuses it (nothing
    /// debited).
    pub fn admit(&mut self, limits: &Limits, now: Tick, tokens: u64) -> Result<(), Refusal> {
        if let Some((policy, retry_after)) = self.check(limits, now, tokens) {
            return Err(Refusal {
                policy,
                retry_after,
                policy_field: limits.policy_field(),
                limit_field: self.limit_field(limits, now, Some((policy, retry_after))),
            });
        }
        self.debit(limits, now, 1, tokens);
        Ok(())
    }

    /// Debits `requests` and `tokens` unconditionally (completion tokens after the answer).
    pub fn debit(&mut self, limits: &Limits, now: Tick, requests: u64, tokens: u64) {
        if let Some(rate) = limits.requests {
            self.requests.debit(rate, now, requests);
        }
        if let Some(rate) = limits.tokens {
            self.tokens.debit(rate, now, tokens);
        }
    }

    /// `RateLimit`: remaining units and seconds until refill per set limit; a refused policy's
    /// `t` is its wait.
    pub fn limit_field(
        &self,
        limits: &Limits,
        now: Tick,
        refused: Option<(Policy, Duration)>,
    ) -> String {
        let mut items = Vec::new();
        for (policy, rate) in limits.rates() {
            let bucket = match policy {
                Policy::Requests => self.requests,
                Policy::Tokens => self.tokens,
            };
            let (remaining, wait) = match refused {
                Some((p, wait)) if p == policy => (0, wait),
                _ => (bucket.remaining(rate, now), bucket.until_full(rate, now)),
            };
            let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
            items.push(format!("\"{}\";r={remaining};t={secs}", policy.name()));
        }
        items.join(", ")
    }
}
