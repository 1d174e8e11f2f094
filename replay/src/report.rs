//! `summary.json` and the stdout table.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use super::latency::LatencyModel;
use super::sim::PolicyRun;

/// Latency percentiles, milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
}

impl Percentiles {
    /// Nearest-rank percentiles of `values_us`, in milliseconds.
    pub fn of_us(values_us: &[u64]) -> Self {
        if values_us.is_empty() {
            return Self::default();
        }
        let mut sorted = values_us.to_vec();
        sorted.sort_unstable();
        let at = |q: f64| {
            let rank = (q * sorted.len() as f64).ceil() as usize;
            sorted[rank.clamp(1, sorted.len()) - 1] as f64 / 1000.0
        };
        let mean = sorted.iter().map(|v| *v as f64).sum::<f64>() / sorted.len() as f64 / 1000.0;
        Self {
            p50: at(0.50),
            p90: at(0.90),
            p99: at(0.99),
            mean,
        }
    }
}

/// One policy in `summary.json`.
#[derive(Clone, Debug, Serialize)]
pub struct PolicySummary {
    pub policy: String,
    pub requests: u64,
    pub unrouted: u64,
    pub input_tokens: u64,
    pub cached_tokens: u64,
    /// Cached prompt blocks / prompt blocks.
    pub prefix_hit_rate: f64,
    /// Cached prompt tokens / prompt tokens.
    pub cached_token_share: f64,
    pub ttft_ms: Percentiles,
    pub e2e_ms: Percentiles,
    /// Mean over arrivals of max / mean active blocks across workers (1 = even).
    pub load_imbalance: f64,
    /// Mean over arrivals of std / mean active blocks across decode workers (0 = even).
    pub load_cv: f64,
    /// Prefill lane time used / (prefilling workers × the trace's span).
    pub utilisation: f64,
    /// Requests each worker took part in: decode workers first, then prefill workers.
    pub requests_per_worker: Vec<u64>,
    /// Prompt tokens moved from prefill to decode workers (pairs only).
    pub transferred_tokens: u64,
    /// Requests a decode worker prefilled itself (conditional disaggregation).
    pub bypasses: u64,
    pub selections: BTreeMap<String, u64>,
    pub kv_results: BTreeMap<String, u64>,
    pub events_not_applied: u64,
    pub index_disagreements: u64,
}

impl PolicySummary {
    pub fn of(run: &PolicyRun) -> Self {
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        Self {
            policy: run.policy.map_or("", |p| p.as_label()).to_owned(),
            requests: run.requests,
            unrouted: run.unrouted,
            input_tokens: run.input_tokens,
            cached_tokens: run.cached_tokens,
            prefix_hit_rate: ratio(run.hit_blocks, run.prompt_blocks),
            cached_token_share: ratio(run.cached_tokens, run.input_tokens),
            ttft_ms: Percentiles::of_us(&run.ttft_us),
            e2e_ms: Percentiles::of_us(&run.e2e_us),
            load_imbalance: run.load_imbalance,
            load_cv: run.load_cv,
            utilisation: run.utilisation,
            requests_per_worker: run.requests_per_worker.clone(),
            transferred_tokens: run.transferred_tokens,
            bypasses: run.bypasses,
            selections: run.selections.clone(),
            kv_results: run.kv_results.clone(),
            events_not_applied: run.events_not_applied,
            index_disagreements: run.index_disagreements,
        }
    }
}

/// The KV tunables in `summary.json`.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct KvSettings {
    pub overlap_score_weight: f64,
    pub prefill_load_scale: f64,
    pub router_temperature: f64,
    pub conditional_disaggregation: bool,
    pub decode_busy_threshold: Option<f64>,
}

/// The router replicas in `summary.json`.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct ReplicaSettings {
    pub count: u32,
    /// `round_robin` or `random`.
    pub spread: &'static str,
    pub load_lag_ms: f64,
    pub sharing: bool,
    pub share_lag_ms: f64,
    /// `dynamo.load.tie_break_window` of every replica (0: off).
    pub tie_break_window: f64,
    /// `dynamo.load.peer_slots` of every replica.
    pub peer_slots: bool,
}

impl ReplicaSettings {
    pub fn of(r: &crate::sim::Replicas) -> Self {
        Self {
            count: r.count,
            spread: r.spread.as_label(),
            load_lag_ms: r.load_lag.as_secs_f64() * 1000.0,
            sharing: r.sharing,
            share_lag_ms: r.share_lag.as_secs_f64() * 1000.0,
            tie_break_window: r.tie_break_window,
            peer_slots: r.peer_slots,
        }
    }
}

/// `summary.json`.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub trace: String,
    pub requests: usize,
    pub skipped_lines: u64,
    pub skip_reasons: Vec<String>,
    /// Decode (or aggregated) workers.
    pub workers: u32,
    pub prefill_workers: u32,
    pub capacity_blocks: u64,
    pub block_size: u32,
    pub speedup: f64,
    pub seed: u64,
    pub load_interval_ms: f64,
    pub max_staleness_ms: f64,
    pub kv: KvSettings,
    pub replicas: ReplicaSettings,
    pub latency_model: LatencyModel,
    pub policies: Vec<PolicySummary>,
    pub plots: Vec<String>,
}

/// The stdout table: one row per policy.
pub fn table(summary: &Summary) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "replay of {} ({} requests, {} workers{} × {} blocks of {} tokens)",
        summary.trace,
        summary.requests,
        summary.workers,
        if summary.prefill_workers > 0 {
            format!(" + {} prefill workers", summary.prefill_workers)
        } else {
            String::new()
        },
        summary.capacity_blocks,
        summary.block_size
    );
    let _ = writeln!(
        out,
        "{:<12} {:>9} {:>14} {:>10} {:>10} {:>10} {:>10} {:>10}  selections",
        "policy",
        "hit_rate",
        "cached_tokens",
        "ttft_p50",
        "ttft_p99",
        "e2e_p50",
        "e2e_p99",
        "imbalance"
    );
    for p in &summary.policies {
        let selections: Vec<String> = p
            .selections
            .iter()
            .filter(|(label, _)| label.starts_with("decode/"))
            .map(|(label, n)| format!("{}={n}", &label["decode/".len()..]))
            .collect();
        let _ = writeln!(
            out,
            "{:<12} {:>8.1}% {:>14} {:>8.0}ms {:>8.0}ms {:>8.0}ms {:>8.0}ms {:>10.2}  {}",
            p.policy,
            p.prefix_hit_rate * 100.0,
            p.cached_tokens,
            p.ttft_ms.p50,
            p.ttft_ms.p99,
            p.e2e_ms.p50,
            p.e2e_ms.p99,
            p.load_imbalance,
            selections.join(" ")
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank_in_ms() {
        let values: Vec<u64> = (1..=100).map(|v| v * 1000).collect();
        let p = Percentiles::of_us(&values);
        assert_eq!((p.p50, p.p90, p.p99), (50.0, 90.0, 99.0));
        assert_eq!(p.mean, 50.5);
        assert_eq!(Percentiles::of_us(&[]), Percentiles::default());
    }
}
