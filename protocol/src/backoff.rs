//! Reconnect backoff and supervisor restart budgets, as pure state machines.
//!
//! Randomness (for jitter) and time arrive as arguments so the schedules are testable exactly.

use std::collections::VecDeque;
use std::time::Duration;

use crate::time::Tick;

/// How a delay is spread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Jitter {
    /// The delay is exactly the current step (discovery watches).
    None,
    /// Full jitter: uniform in `[0, step]` (load and KV subscriptions).
    Full,
}

/// An exponential schedule: `initial`, doubling, capped at `max`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackoffPolicy {
    pub initial: Duration,
    pub max: Duration,
    pub jitter: Jitter,
}

impl BackoffPolicy {
    /// Subscriptions: full-jitter exponential backoff 500 ms → 30 s.
    pub const SUBSCRIPTION: BackoffPolicy = BackoffPolicy {
        initial: Duration::from_millis(500),
        max: Duration::from_secs(30),
        jitter: Jitter::Full,
    };
}

/// The running state of one backoff schedule.
#[derive(Clone, Debug)]
pub struct Backoff {
    policy: BackoffPolicy,
    step: Duration,
}

impl Backoff {
    pub fn new(policy: BackoffPolicy) -> Self {
        Self {
            policy,
            step: policy.initial,
        }
    }

    pub fn policy(&self) -> BackoffPolicy {
        self.policy
    }

    /// The delay before the next attempt, then doubles the step (capped at `max`).
    /// `unit` is a uniform draw in `[0, 1)`, used only under full jitter.
    pub fn next_delay(&mut self, unit: f64) -> Duration {
        let step = self.step.min(self.policy.max);
        let delay = match self.policy.jitter {
            Jitter::None => step,
            Jitter::Full => step.mul_f64(unit.clamp(0.0, 1.0)),
        };
        self.step = step.saturating_mul(2).min(self.policy.max);
        delay
    }

    /// Back to the floor.
    pub fn reset(&mut self) {
        self.step = self.policy.initial;
    }

    /// A session that lasted `lasted` ended: the floor is restored only when it lasted at least
    /// `reset_after`, so a peer that accepts and immediately closes cannot cause a
    /// floor-rate reconnect loop. Returns the delay before the next attempt.
    pub fn session_ended(
        &mut self,
        lasted: Duration,
        reset_after: Duration,
        unit: f64,
    ) -> Duration {
        if lasted >= reset_after {
            self.reset();
        }
        self.next_delay(unit)
    }

    /// The step the next failure would wait (before jitter).
    pub fn current_step(&self) -> Duration {
        self.step
    }
}

/// What a supervisor does about a failed child.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestartDecision {
    /// Restart the child after this delay.
    Restart { after: Duration },
    /// The budget is spent: escalate to the parent.
    Escalate,
}

/// Erlang-style restart intensity: at most `max_restarts` within `period`, each restart after a
/// backoff step (kube-runtime's 800 ms → 30 s ×2 by default).
#[derive(Clone, Debug)]
pub struct RestartBudget {
    max_restarts: usize,
    period: Duration,
    recent: VecDeque<Tick>,
    backoff: Backoff,
}

impl RestartBudget {
    pub const DEFAULT_MAX_RESTARTS: usize = 5;
    pub const DEFAULT_PERIOD: Duration = Duration::from_secs(60);
    pub const DEFAULT_BACKOFF: BackoffPolicy = BackoffPolicy {
        initial: Duration::from_millis(800),
        max: Duration::from_secs(30),
        jitter: Jitter::None,
    };

    pub fn new(max_restarts: usize, period: Duration, backoff: BackoffPolicy) -> Self {
        Self {
            max_restarts,
            period,
            recent: VecDeque::with_capacity(max_restarts.min(64) + 1),
            backoff: Backoff::new(backoff),
        }
    }

    /// Records a failure at `now` and decides.
    pub fn on_failure(&mut self, now: Tick) -> RestartDecision {
        while let Some(&oldest) = self.recent.front() {
            if now.since(oldest) > self.period {
                self.recent.pop_front();
            } else {
                break;
            }
        }
        if self.recent.is_empty() {
            // A quiet period ends the escalation of delays too.
            self.backoff.reset();
        }
        if self.recent.len() >= self.max_restarts {
            return RestartDecision::Escalate;
        }
        self.recent.push_back(now);
        RestartDecision::Restart {
            after: self.backoff.next_delay(0.0),
        }
    }

    /// An operator asked for a restart: it does not spend the failure budget.
    pub fn restarts_in_window(&self) -> usize {
        self.recent.len()
    }
}

impl Default for RestartBudget {
    fn default() -> Self {
        Self::new(
            Self::DEFAULT_MAX_RESTARTS,
            Self::DEFAULT_PERIOD,
            Self::DEFAULT_BACKOFF,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn doubles_to_the_cap_without_jitter() {
        let mut b = Backoff::new(BackoffPolicy {
            initial: ms(500),
            max: ms(3000),
            jitter: Jitter::None,
        });
        let got: Vec<_> = (0..6).map(|_| b.next_delay(0.7)).collect();
        assert_eq!(
            got,
            vec![ms(500), ms(1000), ms(2000), ms(3000), ms(3000), ms(3000)]
        );
    }

    #[test]
    fn full_jitter_scales_the_step() {
        let mut b = Backoff::new(BackoffPolicy::SUBSCRIPTION);
        assert_eq!(b.next_delay(0.5), ms(250));
        assert_eq!(b.next_delay(0.0), ms(0));
        assert_eq!(b.next_delay(1.0), ms(2000));
    }

    #[test]
    fn short_sessions_keep_growing_and_long_ones_reset() {
        let mut b = Backoff::new(BackoffPolicy {
            initial: ms(500),
            max: ms(30_000),
            jitter: Jitter::None,
        });
        assert_eq!(b.session_ended(ms(10), ms(30_000), 0.0), ms(500));
        assert_eq!(b.session_ended(ms(10), ms(30_000), 0.0), ms(1000));
        assert_eq!(b.session_ended(ms(29_999), ms(30_000), 0.0), ms(2000));
        assert_eq!(b.session_ended(ms(30_000), ms(30_000), 0.0), ms(500));
    }

    #[test]
    fn budget_escalates_when_spent_and_recovers_after_the_period() {
        let mut budget =
            RestartBudget::new(2, Duration::from_secs(10), RestartBudget::DEFAULT_BACKOFF);
        let t = Tick::from_millis;
        assert_eq!(
            budget.on_failure(t(0)),
            RestartDecision::Restart { after: ms(800) }
        );
        assert_eq!(
            budget.on_failure(t(1000)),
            RestartDecision::Restart { after: ms(1600) }
        );
        assert_eq!(budget.on_failure(t(2000)), RestartDecision::Escalate);
        // Both earlier failures left the window: the schedule starts over.
        assert_eq!(
            budget.on_failure(t(20_000)),
            RestartDecision::Restart { after: ms(800) }
        );
    }
}
