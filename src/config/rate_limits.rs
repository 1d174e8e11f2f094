//! `rate_limits`: requests and tokens per minute per API key, for unauthenticated use, and per
//! backend (a Dynamo shim replica is a backend), with their validation rules.
//!
//! Keys and backends are named by their configured `api_keys[].name` / `backends[].name`, never
//! by the secret. The limits are per router replica (docs/runtime-semantics.md).

use std::collections::BTreeMap;

use continuum_protocol::ratelimit::{Limits, Rate};
use serde::{Deserialize, Serialize};

use super::schema::Config;
use super::{Diagnostic, Severity};

/// Default most API-key states tracked at once (`rate_limits.max_tracked_keys`).
pub const DEFAULT_MAX_TRACKED_KEYS: usize = 10_000;
/// Largest `max_tracked_keys` accepted.
pub const MAX_TRACKED_KEYS: usize = 1_000_000;
/// Largest per-minute rate or burst accepted.
pub const MAX_RATE: u64 = 1_000_000_000_000;

/// `rate_limits`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RateLimitsConfig {
    /// Limits of requests without an API key (the front door is open: no `api_keys`).
    pub unauthenticated: Option<RateLimitConfig>,
    /// Limits by `api_keys[].name`.
    pub api_keys: BTreeMap<String, RateLimitConfig>,
    /// Limits by `backends[].name`; a backend at its limit is skipped while another can serve.
    pub backends: BTreeMap<String, RateLimitConfig>,
    /// Most key states held (least recently used forgotten first, counted).
    pub max_tracked_keys: usize,
}

impl Default for RateLimitsConfig {
    fn default() -> Self {
        Self {
            unauthenticated: None,
            api_keys: BTreeMap::new(),
            backends: BTreeMap::new(),
            max_tracked_keys: DEFAULT_MAX_TRACKED_KEYS,
        }
    }
}

/// One set of limits; unset parts do not limit. A burst defaults to the per-minute rate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RateLimitConfig {
    pub requests_per_minute: Option<u64>,
    pub request_burst: Option<u64>,
    /// Prompt tokens (estimated) at admission plus completion tokens (from `usage`) after the
    /// answer.
    pub tokens_per_minute: Option<u64>,
    pub token_burst: Option<u64>,
}

impl RateLimitConfig {
    /// The arithmetic's limits.
    pub fn limits(&self) -> Limits {
        let rate = |per_minute: Option<u64>, burst: Option<u64>| {
            per_minute.map(|p| Rate::new(p, burst.unwrap_or(p)))
        };
        Limits {
            requests: rate(self.requests_per_minute, self.request_burst),
            tokens: rate(self.tokens_per_minute, self.token_burst),
        }
    }
}

/// The `rate_limits` rules: names exist, rates and bursts within `1..=MAX_RATE`, a burst only
/// with its rate, `max_tracked_keys` within bounds; an unauthenticated limit with `api_keys`
/// configured never applies (warning).
pub fn validate(config: &Config) -> Vec<Diagnostic> {
    let limits = &config.rate_limits;
    let mut out = Vec::new();
    if !(1..=MAX_TRACKED_KEYS).contains(&limits.max_tracked_keys) {
        out.push(Diagnostic::error(
            "rate_limits.max_tracked_keys",
            format!("max_tracked_keys must be between 1 and {MAX_TRACKED_KEYS}"),
        ));
    }
    if let Some(unauthenticated) = &limits.unauthenticated {
        one(&mut out, "rate_limits.unauthenticated", unauthenticated);
        if !config.api_keys.is_empty() {
            out.push(Diagnostic::warning(
                "rate_limits.unauthenticated",
                "api_keys are configured, so every request is authenticated and this limit never applies",
            ));
        }
    }
    for (name, limit) in &limits.api_keys {
        let path = format!("rate_limits.api_keys.{name}");
        if !config.api_keys.iter().any(|k| &k.name == name) {
            out.push(Diagnostic::error(
                &path,
                format!("no api_keys[] entry is named {name:?}"),
            ));
        }
        one(&mut out, &path, limit);
    }
    for (name, limit) in &limits.backends {
        let path = format!("rate_limits.backends.{name}");
        if config.backend(name).is_none() {
            out.push(Diagnostic::error(
                &path,
                format!("backend {name:?} is not defined in backends[]"),
            ));
        }
        one(&mut out, &path, limit);
    }
    debug_assert!(out.iter().all(|d| d.path.starts_with("rate_limits")));
    out.sort_by_key(|d| d.severity == Severity::Warning);
    out
}

fn one(out: &mut Vec<Diagnostic>, path: &str, limit: &RateLimitConfig) {
    for (key, value) in [
        ("requests_per_minute", limit.requests_per_minute),
        ("request_burst", limit.request_burst),
        ("tokens_per_minute", limit.tokens_per_minute),
        ("token_burst", limit.token_burst),
    ] {
        if value.is_some_and(|v| !(1..=MAX_RATE).contains(&v)) {
            out.push(Diagnostic::error(
                format!("{path}.{key}"),
                format!("{key} must be between 1 and {MAX_RATE}"),
            ));
        }
    }
    for (burst, rate, name) in [
        (
            limit.request_burst,
            limit.requests_per_minute,
            "request_burst",
        ),
        (limit.token_burst, limit.tokens_per_minute, "token_burst"),
    ] {
        if burst.is_some() && rate.is_none() {
            out.push(Diagnostic::error(
                format!("{path}.{name}"),
                format!("{name} needs its per-minute rate"),
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::schema::{ApiKeyConfig, Config};

    fn errors(config: &Config) -> Vec<(String, String)> {
        validate(config)
            .into_iter()
            .map(|d| (d.path, d.message))
            .collect()
    }

    #[test]
    fn unknown_names_zero_rates_and_lone_bursts_are_refused() {
        let mut c = Config::default();
        c.api_keys.push(ApiKeyConfig {
            key: "k".into(),
            name: "team-a".into(),
            allowed_backends: None,
        });
        let ok = RateLimitConfig {
            requests_per_minute: Some(60),
            ..RateLimitConfig::default()
        };
        c.rate_limits.api_keys.insert("team-a".into(), ok);
        assert!(errors(&c).is_empty());
        c.rate_limits.api_keys.insert(
            "team-b".into(),
            RateLimitConfig {
                requests_per_minute: Some(0),
                token_burst: Some(5),
                ..RateLimitConfig::default()
            },
        );
        c.rate_limits.backends.insert("gone".into(), ok);
        c.rate_limits.max_tracked_keys = 0;
        c.rate_limits.unauthenticated = Some(ok);
        let paths: Vec<String> = errors(&c).into_iter().map(|(p, _)| p).collect();
        assert_eq!(
            paths,
            [
                "rate_limits.max_tracked_keys",
                "rate_limits.api_keys.team-b",
                "rate_limits.api_keys.team-b.requests_per_minute",
                "rate_limits.api_keys.team-b.token_burst",
                "rate_limits.backends.gone",
                "rate_limits.unauthenticated",
            ]
        );
    }

    #[test]
    fn a_burst_defaults_to_the_rate() {
        let limits = RateLimitConfig {
            tokens_per_minute: Some(1000),
            ..RateLimitConfig::default()
        }
        .limits();
        assert_eq!(limits.requests, None);
        assert_eq!(limits.tokens, Some(Rate::new(1000, 1000)));
    }
}
