//! The request path's rate limits: the `rate_limits` config over
//! `continuum_protocol::ratelimit` state, with the proxy's clock.
//!
//! Keys are admitted in `crate::route::Router::serve` (one request and the prompt-size estimate);
//! a backend is debited when the proxy sends to it and skipped, while another candidate can
//! serve, when it would refuse. Completion tokens are debited after the answer from its `usage`
//! ([`UsageScan`]). One mutex guards all state: every step is a few integer operations and aHash lookups.
//! [`RateLimiter::reconfigure`] keeps the state of every key and backend whose limits did not
//! change. Refusals count in `continuum_rate_limited_total{scope, name}` (configured names only)
//! and forgotten key states in `continuum_rate_limit_evictions_total`.

use ahash::AHashMap as HashMap;
use std::sync::Mutex;

use continuum_protocol::ratelimit::table::KeyedState;
pub use continuum_protocol::ratelimit::{Limited, Scope};
use continuum_protocol::ratelimit::{Limits, Refusal};
use continuum_protocol::time::Tick;
use prometheus::{IntCounter, IntCounterVec, Opts, Registry};

use crate::config::rate_limits::{DEFAULT_MAX_TRACKED_KEYS, RateLimitsConfig};

/// The `name` label of the unauthenticated bucket (tracked under the empty name, which no
/// configured key has).
pub const UNAUTHENTICATED: &str = "unauthenticated";

#[derive(Default)]
struct State {
    keys_limits: HashMap<String, Limits>,
    unauthenticated: Option<Limits>,
    backend_limits: HashMap<String, Limits>,
    keys: Option<KeyedState>,
    backends: Option<KeyedState>,
}

impl State {
    /// The limits of a key (`None`: unauthenticated).
    fn key_limits(&self, name: Option<&str>) -> Option<Limits> {
        match name {
            None => self.unauthenticated,
            Some(name) => self.keys_limits.get(name).copied(),
        }
    }
}

#[derive(Clone)]
struct Counters {
    limited: IntCounterVec,
    evictions: IntCounter,
}

/// Rate-limit state of one router replica.
#[derive(Default)]
pub struct RateLimiter {
    state: Mutex<State>,
    counters: Option<Counters>,
}

impl std::fmt::Debug for RateLimiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimiter").finish_non_exhaustive()
    }
}

impl RateLimiter {
    /// A limiter with no limits; counted in `registry` when given (a second registration in the
    /// same registry leaves it uncounted).
    pub fn new(registry: Option<&Registry>) -> Self {
        let counters = registry.and_then(|r| register(r).ok());
        Self {
            state: Mutex::new(State::default()),
            counters,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Applies `rate_limits`: unchanged keys and backends keep their buckets.
    pub fn reconfigure(&self, config: &RateLimitsConfig) {
        let collect = |m: &std::collections::BTreeMap<String, _>| -> HashMap<String, Limits> {
            m.iter()
                .map(
                    |(name, l): (&String, &crate::config::rate_limits::RateLimitConfig)| {
                        (name.clone(), l.limits())
                    },
                )
                .filter(|(_, l)| l.is_set())
                .collect()
        };
        let mut state = self.lock();
        state.keys_limits = collect(&config.api_keys);
        state.backend_limits = collect(&config.backends);
        state.unauthenticated = config
            .unauthenticated
            .map(|l| l.limits())
            .filter(Limits::is_set);
        let cap = config.max_tracked_keys.max(1);
        let State {
            keys_limits,
            unauthenticated,
            backend_limits,
            keys,
            backends,
        } = &mut *state;
        let key_of = |name: &str| match name {
            "" => *unauthenticated,
            _ => keys_limits.get(name).copied(),
        };
        keys.get_or_insert_with(|| KeyedState::new(cap))
            .reconfigure(cap, key_of);
        let backends_cap = backend_limits.len().max(1);
        backends
            .get_or_insert_with(|| KeyedState::new(backends_cap))
            .reconfigure(backends_cap, |name| backend_limits.get(name).copied());
        if let Some(counters) = &self.counters {
            let gone = |name: &str, scope: Scope| match scope {
                Scope::Key if name == UNAUTHENTICATED => {
                    unauthenticated.is_none() && !keys_limits.contains_key(name)
                }
                Scope::Key => key_of(name).is_none(),
                Scope::Backend => !backend_limits.contains_key(name),
            };
            prune(&counters.limited, gone);
        }
    }

    /// Admits one request of the key `name` (`None`: unauthenticated) with a prompt of
    /// `prompt_tokens`; a key without limits always passes.
    pub fn admit_key(
        &self,
        name: Option<&str>,
        now: Tick,
        prompt_tokens: u64,
    ) -> Result<(), Limited> {
        let mut state = self.lock();
        let Some(limits) = state.key_limits(name) else {
            return Ok(());
        };
        let keys = state
            .keys
            .get_or_insert_with(|| KeyedState::new(DEFAULT_MAX_TRACKED_KEYS));
        let before = keys.evictions();
        let result = keys.admit(name.unwrap_or(""), &limits, now, prompt_tokens);
        let evicted = keys.evictions() - before;
        drop(state);
        if let Some(counters) = &self.counters {
            counters.evictions.inc_by(evicted);
        }
        let label = name.unwrap_or(UNAUTHENTICATED);
        result.map_err(|refusal| {
            let limited = limited(Scope::Key, label, refusal);
            self.count(&limited);
            limited
        })
    }

    /// Whether the backend `name` would take a request with `prompt_tokens` now.
    pub fn backend_would_admit(&self, name: &str, now: Tick, prompt_tokens: u64) -> bool {
        let state = self.lock();
        match (state.backend_limits.get(name), &state.backends) {
            (Some(limits), Some(table)) => table.would_admit(name, limits, now, prompt_tokens),
            _ => true,
        }
    }

    /// Debits one request of the backend `name`, or refuses it.
    pub fn admit_backend(&self, name: &str, now: Tick, prompt_tokens: u64) -> Result<(), Limited> {
        let mut state = self.lock();
        let Some(limits) = state.backend_limits.get(name).copied() else {
            return Ok(());
        };
        let table = state.backends.get_or_insert_with(|| KeyedState::new(64));
        let result = table.admit(name, &limits, now, prompt_tokens);
        drop(state);
        result.map_err(|refusal| limited(Scope::Backend, name, refusal))
    }

    /// The refusal the backend `name` would give a request with `prompt_tokens` now, if any.
    pub fn backend_refusal(&self, name: &str, now: Tick, prompt_tokens: u64) -> Option<Limited> {
        let state = self.lock();
        let limits = *state.backend_limits.get(name)?;
        let mut probe = state.backends.as_ref()?.clone();
        drop(state);
        probe
            .admit(name, &limits, now, prompt_tokens)
            .err()
            .map(|refusal| limited(Scope::Backend, name, refusal))
    }

    /// Whether completion tokens of this key or backend are limited (the answer's `usage` is
    /// worth reading).
    pub fn counts_tokens(&self, key: Option<&str>, backend: Option<&str>) -> bool {
        let state = self.lock();
        let key = state.key_limits(key);
        let backend = backend.and_then(|b| state.backend_limits.get(b).copied());
        key.is_some_and(|l| l.tokens.is_some()) || backend.is_some_and(|l| l.tokens.is_some())
    }

    /// Whether any backend has a tokens limit (a continued stream may end on any of them).
    pub fn counts_any_backend_tokens(&self) -> bool {
        self.lock()
            .backend_limits
            .values()
            .any(|l| l.tokens.is_some())
    }

    /// Debits an answer's completion tokens from its key and backend.
    pub fn debit_completion(
        &self,
        key: Option<&str>,
        backend: Option<&str>,
        now: Tick,
        tokens: u64,
    ) {
        let mut state = self.lock();
        if let (Some(limits), Some(table)) = (state.key_limits(key), state.keys.as_mut()) {
            table.debit_tokens(key.unwrap_or(""), &limits, now, tokens);
        }
        if let Some(backend) = backend
            && let Some(limits) = state.backend_limits.get(backend).copied()
            && let Some(table) = state.backends.as_mut()
        {
            table.debit_tokens(backend, &limits, now, tokens);
        }
    }

    /// Counts one refused request in `continuum_rate_limited_total`.
    pub fn count(&self, limited: &Limited) {
        if let Some(counters) = &self.counters {
            counters
                .limited
                .with_label_values(&[limited.scope.as_label(), &limited.name])
                .inc();
        }
    }
}

fn limited(scope: Scope, name: &str, refusal: Refusal) -> Limited {
    Limited {
        scope,
        name: name.to_owned(),
        refusal,
    }
}

fn register(registry: &Registry) -> Result<Counters, prometheus::Error> {
    let limited = IntCounterVec::new(
        Opts::new(
            "continuum_rate_limited_total",
            "Requests answered 429 at a rate limit: of their API key (scope key) or because every backend that could serve them was at its limit (scope backend), by configured name.",
        ),
        &["scope", "name"],
    )?;
    let evictions = IntCounter::new(
        "continuum_rate_limit_evictions_total",
        "API-key rate-limit states forgotten to stay within rate_limits.max_tracked_keys.",
    )?;
    registry.register(Box::new(limited.clone()))?;
    registry.register(Box::new(evictions.clone()))?;
    Ok(Counters { limited, evictions })
}

/// Removes the series of names no longer configured (the label set stays closed).
fn prune(limited: &IntCounterVec, gone: impl Fn(&str, Scope) -> bool) {
    use prometheus::core::Collector;
    for family in limited.collect() {
        for metric in family.get_metric() {
            let label = |n: &str| {
                metric
                    .get_label()
                    .iter()
                    .find(|l| l.name() == n)
                    .map(|l| l.value().to_owned())
            };
            let (Some(scope), Some(name)) = (label("scope"), label("name")) else {
                continue;
            };
            let scope_of = if scope == "key" {
                Scope::Key
            } else {
                Scope::Backend
            };
            if gone(&name, scope_of) {
                let _ = limited.remove_label_values(&[&scope, &name]);
            }
        }
    }
}
