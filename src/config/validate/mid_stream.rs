//! Rules of `disaggregated_serving.mid_stream_fallback` (issue 31).

use std::time::Duration;

use super::super::Diagnostic;
use super::super::schema::MidStreamFallbackConfig;

/// Most continuation attempts per request.
pub const MAX_ATTEMPTS: u32 = 8;
/// `inactivity_timeout` bounds.
pub const MIN_INACTIVITY: Duration = Duration::from_millis(100);
pub const MAX_INACTIVITY: Duration = Duration::from_secs(3600);
/// `max_buffered_bytes` bounds.
pub const MIN_BUFFERED_BYTES: usize = 1024;
pub const MAX_BUFFERED_BYTES: usize = 64 * 1024 * 1024;

const PATH: &str = "disaggregated_serving.mid_stream_fallback";

/// Every error of the section, path-addressed.
pub fn validate(config: &MidStreamFallbackConfig) -> Vec<Diagnostic> {
    let mut out = Vec::new();
    let mut err = |key: &str, message: String| {
        out.push(Diagnostic::error(format!("{PATH}.{key}"), message));
    };
    if !(1..=MAX_ATTEMPTS).contains(&config.max_attempts) {
        err("max_attempts", format!("must be 1..={MAX_ATTEMPTS}"));
    }
    let timeout = config.inactivity_timeout.get();
    if !(MIN_INACTIVITY..=MAX_INACTIVITY).contains(&timeout) {
        err(
            "inactivity_timeout",
            format!("must be between {MIN_INACTIVITY:?} and {MAX_INACTIVITY:?}"),
        );
    }
    if !(0.0..=1.0).contains(&config.budget_ratio) {
        err("budget_ratio", "must be between 0 and 1".into());
    }
    if !(0.0..=1_000_000.0).contains(&config.budget_min_per_s) {
        err("budget_min_per_s", "must be between 0 and 1000000".into());
    }
    if !(MIN_BUFFERED_BYTES..=MAX_BUFFERED_BYTES).contains(&config.max_buffered_bytes) {
        err(
            "max_buffered_bytes",
            format!("must be between {MIN_BUFFERED_BYTES} and {MAX_BUFFERED_BYTES}"),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_bound_is_reported_with_its_yaml_path() {
        assert!(validate(&MidStreamFallbackConfig::default()).is_empty());
        let bad = MidStreamFallbackConfig {
            enabled: true,
            max_attempts: 0,
            inactivity_timeout: crate::config::schema::HumanDuration::from_millis(1),
            budget_ratio: 1.5,
            budget_min_per_s: f64::NAN,
            max_buffered_bytes: 1,
        };
        let paths: Vec<String> = validate(&bad).into_iter().map(|d| d.path).collect();
        for key in [
            "max_attempts",
            "inactivity_timeout",
            "budget_ratio",
            "budget_min_per_s",
            "max_buffered_bytes",
        ] {
            assert!(paths.contains(&format!("{PATH}.{key}")), "{key}: {paths:?}");
        }
    }
}
