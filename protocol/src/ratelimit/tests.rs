//! Rate-limit tests: the GCRA buckets against a plain token-bucket model over long random
//! sequences of requests, debits and clock steps; the field formats; the LRU table.

use std::time::Duration;

use proptest::prelude::*;

use super::table::KeyedState;
use super::*;

/// The reference: a token bucket whose level (in `token * 60 s` nanosecond units, so exact) is
/// refilled by `per_minute` per nanosecond up to `burst`, may go negative on a debit, and admits
/// a cost when it holds `min(cost, burst)`.
#[derive(Clone, Debug)]
struct Model {
    rate: Rate,
    level: i128,
    at: u128,
}

impl Model {
    fn new(rate: Rate) -> Self {
        Self {
            rate,
            level: i128::from(rate.burst) * WINDOW_NS as i128,
            at: 0,
        }
    }

    fn advance(&mut self, now: u128) {
        let dt = now - self.at;
        self.at = now;
        let cap = i128::from(self.rate.burst) * WINDOW_NS as i128;
        let refill = (dt * u128::from(self.rate.per_minute)) as i128;
        self.level = (self.level + refill).min(cap);
    }

    fn wait_ns(&self, cost: u64) -> u128 {
        let need = i128::from(cost.min(self.rate.burst)) * WINDOW_NS as i128;
        if self.level >= need {
            0
        } else {
            ((need - self.level) as u128).div_ceil(u128::from(self.rate.per_minute))
        }
    }

    fn take(&mut self, cost: u64) -> bool {
        let ok = self.wait_ns(cost) == 0;
        if ok {
            self.level -= i128::from(cost) * WINDOW_NS as i128;
        }
        ok
    }

    fn remaining(&self) -> u64 {
        (self.level.max(0) / WINDOW_NS as i128) as u64
    }
}

#[derive(Clone, Debug)]
enum Step {
    Advance(u64),
    Take(u64),
    Debit(u64),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0u64..5_000_000_000).prop_map(Step::Advance),
        (0u64..2_000).prop_map(Step::Advance),
        (0u64..40).prop_map(Step::Take),
        (0u64..40).prop_map(Step::Debit),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn gcra_matches_the_token_bucket_model(
        per_minute in 1u64..100_000,
        burst in 1u64..50,
        steps in proptest::collection::vec(step(), 1..400),
    ) {
        let rate = Rate::new(per_minute, burst);
        let mut bucket = Bucket::default();
        let mut model = Model::new(rate);
        let mut now = Duration::ZERO;
        for step in steps {
            match step {
                Step::Advance(ns) => now += Duration::from_nanos(ns),
                Step::Take(cost) => {
                    model.advance(now.as_nanos());
                    let wait = bucket.wait(rate, Tick(now), cost);
                    prop_assert_eq!(wait.as_nanos(), model.wait_ns(cost));
                    let admitted = model.take(cost);
                    prop_assert_eq!(admitted, wait.is_zero());
                    if admitted {
                        bucket.debit(rate, Tick(now), cost);
                    }
                }
                Step::Debit(cost) => {
                    model.advance(now.as_nanos());
                    model.level -= i128::from(cost) * WINDOW_NS as i128;
                    bucket.debit(rate, Tick(now), cost);
                }
            }
            model.advance(now.as_nanos());
            prop_assert_eq!(bucket.remaining(rate, Tick(now)), model.remaining());
        }
    }

    /// A pair admits only when both buckets do, and a refusal debits neither.
    #[test]
    fn a_pair_debits_both_or_neither(
        rpm in 1u64..600,
        tpm in 1u64..6_000,
        steps in proptest::collection::vec((0u64..3_000_000_000, 0u64..200), 1..200),
    ) {
        let limits = Limits { requests: Some(Rate::new(rpm, 3)), tokens: Some(Rate::new(tpm, 100)) };
        let mut state = LimitState::default();
        let (mut requests, mut tokens) = (Model::new(Rate::new(rpm, 3)), Model::new(Rate::new(tpm, 100)));
        let mut now = Duration::ZERO;
        for (dt, cost) in steps {
            now += Duration::from_nanos(dt);
            requests.advance(now.as_nanos());
            tokens.advance(now.as_nanos());
            let both = requests.wait_ns(1) == 0 && tokens.wait_ns(cost) == 0;
            let result = state.admit(&limits, Tick(now), cost);
            prop_assert_eq!(result.is_ok(), both);
            if both {
                requests.take(1);
                tokens.take(cost);
            } else {
                let refusal = result.expect_err("refused");
                let wait = requests.wait_ns(1).max(tokens.wait_ns(cost));
                prop_assert_eq!(refusal.retry_after.as_nanos(), wait);
            }
        }
    }
}

#[test]
fn a_burst_then_one_per_refill_interval() {
    let limits = Limits {
        requests: Some(Rate::new(60, 2)),
        tokens: None,
    };
    let mut state = LimitState::default();
    assert!(state.admit(&limits, Tick::ZERO, 0).is_ok());
    assert!(state.admit(&limits, Tick::ZERO, 0).is_ok());
    let refusal = state.admit(&limits, Tick::ZERO, 0).expect_err("third");
    assert_eq!(refusal.policy, Policy::Requests);
    assert_eq!(refusal.retry_after, Duration::from_secs(1));
    assert_eq!(refusal.retry_after_secs(), 1);
    assert_eq!(refusal.policy_field, "\"rpm\";q=60;w=60");
    assert_eq!(refusal.limit_field, "\"rpm\";r=0;t=1");
    assert!(state.admit(&limits, Tick::from_millis(999), 0).is_err());
    assert!(state.admit(&limits, Tick::from_millis(1000), 0).is_ok());
}

#[test]
fn a_completion_debt_is_waited_out() {
    let limits = Limits {
        requests: None,
        tokens: Some(Rate::new(600, 100)),
    };
    let mut state = LimitState::default();
    assert!(state.admit(&limits, Tick::ZERO, 50).is_ok());
    state.debit(&limits, Tick::ZERO, 0, 150);
    // 100 tokens of debt: 10 s at 10 tokens per second before one token is held again.
    let refusal = state.admit(&limits, Tick::ZERO, 1).expect_err("in debt");
    assert_eq!(refusal.policy, Policy::Tokens);
    assert_eq!(refusal.retry_after, Duration::from_millis(10_100));
    assert_eq!(
        refusal.limit_field, "\"tpm\";r=0;t=11",
        "the refused policy's t is its wait"
    );
    // A prompt above the burst passes from a full bucket only.
    assert!(state.admit(&limits, Tick::from_millis(20_000), 500).is_ok());
}

#[test]
fn the_table_keeps_unchanged_names_and_evicts_the_least_recent() {
    let a = Limits {
        requests: Some(Rate::new(60, 1)),
        tokens: None,
    };
    let b = Limits {
        requests: Some(Rate::new(120, 1)),
        tokens: None,
    };
    let mut table = KeyedState::new(2);
    assert!(table.admit("a", &a, Tick::ZERO, 0).is_ok());
    assert!(table.admit("b", &a, Tick::ZERO, 0).is_ok());
    assert!(!table.would_admit("a", &a, Tick::ZERO, 0));
    // Reload: "a" unchanged keeps its empty bucket, "b" changed starts full.
    table.reconfigure(2, |name| Some(if name == "a" { a } else { b }));
    assert!(table.admit("a", &a, Tick::ZERO, 0).is_err());
    assert!(table.admit("b", &b, Tick::ZERO, 0).is_ok());
    // A third name evicts the least recently used ("a").
    assert!(table.admit("c", &a, Tick::ZERO, 0).is_ok());
    assert_eq!(table.len(), 2);
    assert_eq!(table.evictions(), 1);
    assert!(
        table.admit("a", &a, Tick::ZERO, 0).is_ok(),
        "forgotten: full"
    );
    assert_eq!(table.evictions(), 2);
    // Removed names are forgotten on reload.
    table.reconfigure(1, |_| None);
    assert!(table.is_empty());
}
