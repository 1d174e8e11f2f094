//! The tokenizer artifacts' family: `continuum_dynamo_kv_artifacts_total{result}`. Compiled and
//! registered without the `kv-artifacts` feature too (`lib.rs`), so a slim build's `/metrics`
//! keeps the family at 0 as before.

use prometheus::{IntCounterVec, Registry};

use crate::label_enum;
use crate::metrics::{Family, counter_vec};

label_enum! {
    /// `continuum_dynamo_kv_artifacts_total{result}`.
    KvArtifactResult {
        /// Fetched or read, checksum verified, loaded.
        Loaded => "loaded",
        /// Its blake3 checksum is not in `kv.pinned_artifacts`.
        Unpinned => "unpinned",
        /// An unsupported kv_cache_block_size or URI scheme.
        Unsupported => "unsupported",
        /// Larger than the 64 MiB artifact bound.
        Oversized => "oversized",
        ChecksumMismatch => "checksum_mismatch",
        FetchFailed => "fetch_failed",
        LoadFailed => "load_failed",
        /// Read from the content-addressed cache, checksum verified.
        CacheHit => "cache_hit",
        /// An http(s):// or hf:// path while kv.allow_{http,hf}_artifacts is false.
        Disallowed => "disallowed",
    }
}

/// The artifacts' family, every `result` at 0 from the start.
pub struct KvArtifactMetrics {
    artifacts: IntCounterVec,
}

impl Family for KvArtifactMetrics {
    fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let artifacts = counter_vec(
            registry,
            "continuum_dynamo_kv_artifacts_total",
            "Tokenizer and template artifacts by result.",
            &["result"],
        )?;
        for result in KvArtifactResult::ALL {
            artifacts.with_label_values(&[result.as_label()]);
        }
        Ok(Self { artifacts })
    }
}

impl KvArtifactMetrics {
    pub fn kv_artifact(&self, result: KvArtifactResult) {
        self.artifacts.with_label_values(&[result.as_label()]).inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::testing::{check_closed, metrics};

    #[test]
    fn results_are_closed_and_start_at_zero() {
        check_closed(KvArtifactResult::ALL, KvArtifactResult::as_label);
        let metrics = metrics();
        let artifacts = metrics.register::<KvArtifactMetrics>().expect("registers");
        assert!(
            metrics
                .render()
                .contains(r#"continuum_dynamo_kv_artifacts_total{result="cache_hit"} 0"#)
        );
        artifacts.kv_artifact(KvArtifactResult::Unpinned);
        assert_eq!(
            metrics.value(
                "continuum_dynamo_kv_artifacts_total",
                &[("result", "unpinned")]
            ),
            Some(1.0)
        );
    }
}
