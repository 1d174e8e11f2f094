//! Backend availability state machines: the per-backend circuit breaker and the active health
//! check's threshold counter. Pure logic; the daemon's backend pool owns the clock and the IO.
//!
//! Breaker: `Closed` counts consecutive failures; at `failure_threshold` it opens. `Open` rejects
//! until `cool_down` has passed, then admits exactly one probe (`HalfOpen`). The probe's success
//! closes the breaker, its failure re-opens it. A probe whose outcome never arrives (the client
//! went away) is presumed lost after another `cool_down`, so the breaker cannot stick half-open.

use std::time::Duration;

use crate::time::Tick;

/// Breaker tuning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive failures that open a closed breaker (at least 1).
    pub failure_threshold: u32,
    /// How long an open breaker rejects before admitting one probe.
    pub cool_down: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            failure_threshold: 5,
            cool_down: Duration::from_secs(30),
        }
    }
}

/// The breaker's state, for observability and tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BreakerState {
    Closed { consecutive_failures: u32 },
    Open { since: Tick },
    HalfOpen { probe_since: Tick },
}

impl BreakerState {
    pub fn as_label(self) -> &'static str {
        match self {
            BreakerState::Closed { .. } => "closed",
            BreakerState::Open { .. } => "open",
            BreakerState::HalfOpen { .. } => "half_open",
        }
    }
}

/// What the breaker says about sending one request now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Closed: send.
    Allowed,
    /// The single half-open probe: send, and report its outcome.
    Probe,
    /// Open (or a probe is in flight): do not send.
    Rejected,
}

impl Admission {
    pub fn is_admitted(self) -> bool {
        !matches!(self, Admission::Rejected)
    }
}

/// One backend's circuit breaker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Breaker {
    config: BreakerConfig,
    state: BreakerState,
}

impl Breaker {
    pub fn new(config: BreakerConfig) -> Self {
        Self {
            config: BreakerConfig {
                failure_threshold: config.failure_threshold.max(1),
                ..config
            },
            state: BreakerState::Closed {
                consecutive_failures: 0,
            },
        }
    }

    pub fn state(&self) -> BreakerState {
        self.state
    }

    /// Whether [`Breaker::admit`] would admit now, without taking the probe slot.
    pub fn would_admit(&self, now: Tick) -> bool {
        match self.state {
            BreakerState::Closed { .. } => true,
            BreakerState::Open { since } => now.since(since) >= self.config.cool_down,
            BreakerState::HalfOpen { probe_since } => {
                now.since(probe_since) >= self.config.cool_down
            }
        }
    }

    /// Asks to send one request now; a `Probe` answer moves the breaker half-open.
    pub fn admit(&mut self, now: Tick) -> Admission {
        match self.state {
            BreakerState::Closed { .. } => Admission::Allowed,
            BreakerState::Open { .. } | BreakerState::HalfOpen { .. } if self.would_admit(now) => {
                self.state = BreakerState::HalfOpen { probe_since: now };
                Admission::Probe
            }
            BreakerState::Open { .. } | BreakerState::HalfOpen { .. } => Admission::Rejected,
        }
    }

    /// A request succeeded: any state closes.
    pub fn on_success(&mut self) {
        self.state = BreakerState::Closed {
            consecutive_failures: 0,
        };
    }

    /// A request failed (transport error or 5xx). Returns true when this failure opened it.
    pub fn on_failure(&mut self, now: Tick) -> bool {
        match self.state {
            BreakerState::Closed {
                consecutive_failures,
            } => {
                let failures = consecutive_failures.saturating_add(1);
                if failures >= self.config.failure_threshold {
                    self.state = BreakerState::Open { since: now };
                    true
                } else {
                    self.state = BreakerState::Closed {
                        consecutive_failures: failures,
                    };
                    false
                }
            }
            BreakerState::HalfOpen { .. } => {
                self.state = BreakerState::Open { since: now };
                true
            }
            // A late failure of a request admitted before the breaker opened: the cool-down
            // restarts so the probe waits for a quiet period.
            BreakerState::Open { .. } => {
                self.state = BreakerState::Open { since: now };
                false
            }
        }
    }
}

/// What one answered response means for its backend's breaker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResponseVerdict {
    /// The replica is serving (a 2xx-4xx, or a request-level refusal): [`Breaker::on_success`].
    Serving,
    /// The replica (or what fronts it) is failing: [`Breaker::on_failure`].
    Failing,
}

/// Classifies an upstream answer for the breaker. Transport failures and timeouts never get
/// here (they always count). Gateway-class answers (502, 503, 504) count as failures. A 500 that
/// carries the frontend's own JSON error body (`frontend_error_body`: Dynamo 1.6.1 answers a
/// missing prefill id or a pinned instance that just left that way) is a refusal of that one
/// request by a healthy replica, so it does not count; a 500 without one (a crash page, an
/// empty body) does. Other statuses (including 501 and 505+) are answers about the request.
pub fn classify_response(status: u16, frontend_error_body: bool) -> ResponseVerdict {
    match status {
        502..=504 => ResponseVerdict::Failing,
        500 if !frontend_error_body => ResponseVerdict::Failing,
        _ => ResponseVerdict::Serving,
    }
}

/// Health tuning from `backends[].health_check`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HealthThresholds {
    /// Consecutive failed probes that mark a healthy backend unhealthy (at least 1).
    pub unhealthy: u32,
    /// Consecutive passed probes that mark an unhealthy backend healthy (at least 1).
    pub healthy: u32,
}

/// A health transition caused by one probe result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HealthTransition {
    BecameHealthy,
    BecameUnhealthy,
}

/// Active health: healthy until `unhealthy` consecutive probes fail, then unhealthy until
/// `healthy` consecutive probes pass. Starts healthy so a new backend serves before its first
/// probe completes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthTracker {
    thresholds: HealthThresholds,
    healthy: bool,
    streak: u32,
}

impl HealthTracker {
    pub fn new(thresholds: HealthThresholds) -> Self {
        Self {
            thresholds: HealthThresholds {
                unhealthy: thresholds.unhealthy.max(1),
                healthy: thresholds.healthy.max(1),
            },
            healthy: true,
            streak: 0,
        }
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy
    }

    /// Folds one probe result in; `streak` counts results that disagree with the current state.
    pub fn record(&mut self, passed: bool) -> Option<HealthTransition> {
        if passed == self.healthy {
            self.streak = 0;
            return None;
        }
        self.streak = self.streak.saturating_add(1);
        let needed = if self.healthy {
            self.thresholds.unhealthy
        } else {
            self.thresholds.healthy
        };
        if self.streak < needed {
            return None;
        }
        self.healthy = passed;
        self.streak = 0;
        Some(if passed {
            HealthTransition::BecameHealthy
        } else {
            HealthTransition::BecameUnhealthy
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker(threshold: u32) -> Breaker {
        Breaker::new(BreakerConfig {
            failure_threshold: threshold,
            cool_down: Duration::from_secs(10),
        })
    }

    fn t(s: u64) -> Tick {
        Tick(Duration::from_secs(s))
    }

    #[test]
    fn refusals_do_not_open_and_gateway_errors_do() {
        assert_eq!(classify_response(500, true), ResponseVerdict::Serving);
        assert_eq!(classify_response(500, false), ResponseVerdict::Failing);
        for status in [502, 503, 504] {
            assert_eq!(classify_response(status, true), ResponseVerdict::Failing);
        }
        for status in [200, 400, 404, 429, 501, 505] {
            assert_eq!(classify_response(status, false), ResponseVerdict::Serving);
        }
        let mut b = breaker(5);
        for _ in 0..10 {
            match classify_response(500, true) {
                ResponseVerdict::Serving => b.on_success(),
                ResponseVerdict::Failing => {
                    b.on_failure(t(1));
                }
            }
        }
        assert_eq!(b.state().as_label(), "closed");
    }

    #[test]
    fn consecutive_failures_open_and_a_success_resets_the_count() {
        let mut b = breaker(3);
        assert!(!b.on_failure(t(0)));
        assert!(!b.on_failure(t(0)));
        b.on_success();
        assert!(!b.on_failure(t(1)));
        assert!(!b.on_failure(t(1)));
        assert_eq!(b.admit(t(1)), Admission::Allowed);
        assert!(b.on_failure(t(2)));
        assert_eq!(b.state(), BreakerState::Open { since: t(2) });
        assert_eq!(b.admit(t(3)), Admission::Rejected);
        assert!(!b.would_admit(t(11)));
    }

    #[test]
    fn one_probe_after_the_cool_down_then_close_on_success() {
        let mut b = breaker(1);
        b.on_failure(t(0));
        assert!(b.would_admit(t(10)));
        assert_eq!(b.admit(t(10)), Admission::Probe);
        // Only one probe at a time.
        assert_eq!(b.admit(t(11)), Admission::Rejected);
        assert!(!b.would_admit(t(11)));
        b.on_success();
        assert_eq!(
            b.state(),
            BreakerState::Closed {
                consecutive_failures: 0
            }
        );
        assert_eq!(b.admit(t(11)), Admission::Allowed);
    }

    #[test]
    fn a_failed_probe_reopens_for_a_full_cool_down() {
        let mut b = breaker(2);
        b.on_failure(t(0));
        b.on_failure(t(0));
        assert_eq!(b.admit(t(10)), Admission::Probe);
        assert!(b.on_failure(t(12)));
        assert_eq!(b.admit(t(21)), Admission::Rejected);
        assert_eq!(b.admit(t(22)), Admission::Probe);
    }

    #[test]
    fn a_lost_probe_is_replaced_after_another_cool_down() {
        let mut b = breaker(1);
        b.on_failure(t(0));
        assert_eq!(b.admit(t(10)), Admission::Probe);
        assert_eq!(b.admit(t(19)), Admission::Rejected);
        assert_eq!(b.admit(t(20)), Admission::Probe);
    }

    #[test]
    fn a_late_failure_while_open_restarts_the_cool_down() {
        let mut b = breaker(1);
        b.on_failure(t(0));
        assert!(!b.on_failure(t(5)));
        assert_eq!(b.admit(t(10)), Admission::Rejected);
        assert_eq!(b.admit(t(15)), Admission::Probe);
    }

    #[test]
    fn zero_threshold_means_one() {
        let mut b = breaker(0);
        assert!(b.on_failure(t(0)));
    }

    #[test]
    fn health_needs_consecutive_results_to_flip() {
        let mut h = HealthTracker::new(HealthThresholds {
            unhealthy: 3,
            healthy: 2,
        });
        assert!(h.is_healthy());
        assert_eq!(h.record(false), None);
        assert_eq!(h.record(false), None);
        assert_eq!(h.record(true), None);
        assert_eq!(h.record(false), None);
        assert_eq!(h.record(false), None);
        assert_eq!(h.record(false), Some(HealthTransition::BecameUnhealthy));
        assert!(!h.is_healthy());
        assert_eq!(h.record(true), None);
        assert_eq!(h.record(false), None);
        assert_eq!(h.record(true), None);
        assert_eq!(h.record(true), Some(HealthTransition::BecameHealthy));
        assert!(h.is_healthy());
    }
}
