//! continuum-replay, behind `continuum-router replay`: offline policy replay. A trace (Mooncake
//! JSONL or an OpenAI-style request log) is replayed against a simulated fleet once per policy,
//! through the real pickers, the real load store and the real KV index, and the policies are
//! compared on prefix-hit rate, cached tokens, modelled TTFT and end-to-end latency, load
//! imbalance and selection reasons.
//! See `docs/replay.md`.
//!
//! | module | what it holds |
//! |---|---|
//! | [`trace`] | reading Mooncake and request-log lines (plain or `.gz`) into blocks |
//! | [`sim`] | the fleet simulation: discovery-built candidates, LRU caches, kv-events, load samples |
//! | [`latency`] | the latency model (prefill ∝ uncached tokens, decode ∝ output tokens, queueing) |
//! | [`report`] | `summary.json` and the stdout table |
//! | [`plots`] | the SVG plots |

// Test code is exempt from the 120-line limit; product code is linted in the non-test build.
#![cfg_attr(test, allow(clippy::too_many_lines, reason = "test code is exempt"))]

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use continuum_protocol::kv::hashing::BlockSize;
use continuum_protocol::picker::{ConditionalDisaggregation, KvPickParams};

pub mod latency;
pub mod plots;
pub mod report;
pub mod sim;
pub mod trace;

pub use sim::{Policy, PolicyRun, SimConfig, simulate};

/// Arguments of `continuum-router replay`.
#[derive(clap::Args, Debug, Clone)]
pub struct ReplayArgs {
    /// Trace file: Mooncake JSONL or an OpenAI-style request log (`.gz` is gunzipped).
    #[arg(long)]
    pub trace: PathBuf,
    /// Simulated decode workers (one rank each); aggregated without --prefill-workers.
    #[arg(long)]
    pub workers: u32,
    /// Prefill workers beside the decode workers: a disaggregated fleet of prefill/decode pairs.
    #[arg(long, default_value_t = 0)]
    pub prefill_workers: u32,
    /// `dynamo.kv.conditional_disaggregation.enabled` of the kv policy: a decode worker that holds
    /// the prompt prefills it itself.
    #[arg(long)]
    pub conditional_disagg: bool,
    /// `dynamo.kv.conditional_disaggregation.decode_busy_threshold` (0..=1 of total_kv_blocks);
    /// needs --conditional-disagg.
    #[arg(long)]
    pub decode_busy_threshold: Option<f64>,
    /// Prefix-cache capacity of each worker, in blocks.
    #[arg(long)]
    pub capacity: u64,
    /// Policies to compare, comma-separated: load, kv, round_robin.
    #[arg(long, value_delimiter = ',', default_value = "load,kv")]
    pub policy: Vec<Policy>,
    /// Divide trace timestamps by this (2 = twice the arrival rate).
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Output directory for summary.json and the plots (created if missing).
    #[arg(long)]
    pub out: PathBuf,
    /// Seed of the index hasher and the softmax draws.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Tokens per KV block (a multiple of 16 for Mooncake traces).
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// `dynamo.kv.overlap_score_credit` of the kv policy.
    #[arg(long, default_value_t = 1.0)]
    pub overlap_score_weight: f64,
    /// `dynamo.kv.prefill_load_scale` of the kv policy.
    #[arg(long, default_value_t = 1.0)]
    pub prefill_load_scale: f64,
    /// `dynamo.kv.router_temperature` of the kv policy (0 = lowest cost).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// How often each simulated worker publishes its load.
    #[arg(long, default_value = "50ms", value_parser = humantime::parse_duration)]
    pub load_interval: Duration,
    /// `dynamo.load.max_staleness`.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    pub max_staleness: Duration,
    /// Latency model: fixed prefill cost per request, ms.
    #[arg(long, default_value_t = 5.0)]
    pub prefill_overhead_ms: f64,
    /// Latency model: prefill cost per uncached prompt token, ms.
    #[arg(long, default_value_t = 0.1)]
    pub prefill_ms_per_token: f64,
    /// Latency model: decode cost per output token, ms.
    #[arg(long, default_value_t = 20.0)]
    pub decode_ms_per_token: f64,
    /// Latency model: prefill -> decode KV transfer cost per prompt token, ms (pairs only).
    #[arg(long, default_value_t = 0.01)]
    pub kv_transfer_ms_per_token: f64,
    /// Router replicas the trace is spread over, each with its own dispatch ledger.
    #[arg(long, default_value_t = 1)]
    pub replicas: u32,
    /// How requests reach the replicas: round_robin or random (a Kubernetes Service).
    #[arg(long, default_value = "round_robin")]
    pub replica_spread: sim::Spread,
    /// Delay between a worker publishing its load and the replicas receiving it.
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    pub load_lag: Duration,
    /// Each replica records its peers' dispatches in its ledger (after --share-lag).
    #[arg(long)]
    pub replica_sharing: bool,
    /// Delay before a peer's dispatch reaches a replica (batching + transport), with
    /// --replica-sharing.
    #[arg(long, default_value = "5ms", value_parser = humantime::parse_duration)]
    pub share_lag: Duration,
    /// `dynamo.load.tie_break_window` of every replica: ranks within this many times the
    /// request's own weight of the lowest cost tie, and a per-replica seeded draw picks (0: off).
    #[arg(long, default_value_t = 0.0)]
    pub tie_break_window: f64,
    /// `dynamo.load.peer_slots` of every replica: with --replica-sharing (peers known) and a
    /// tie-break window, replica i of N takes the i-th lowest cost of the tie set and counts the
    /// slots its peers take on the same view.
    #[arg(long)]
    pub peer_slots: bool,
    /// tokenizer.json for request-log traces.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Chat template for request-log traces: tokenizer_config.json or a .jinja file.
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
}

impl ReplayArgs {
    /// The simulation settings these arguments ask for.
    pub fn sim_config(&self) -> anyhow::Result<SimConfig> {
        let block_size = BlockSize::new(self.block_size).context("--block-size")?;
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            bail!("--speedup must be a positive number");
        }
        if self.capacity == 0 {
            bail!("--capacity must be at least 1 block");
        }
        let ms = |v: f64, name: &str| -> anyhow::Result<f64> {
            if v.is_finite() && v >= 0.0 {
                Ok(v * 1000.0)
            } else {
                bail!("{name} must be a non-negative number")
            }
        };
        for (v, name) in [
            (self.overlap_score_weight, "--overlap-score-weight"),
            (self.prefill_load_scale, "--prefill-load-scale"),
            (self.temperature, "--temperature"),
            (self.tie_break_window, "--tie-break-window"),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                bail!("{name} must be a non-negative number");
            }
        }
        if let Some(threshold) = self.decode_busy_threshold {
            if !(threshold.is_finite() && (0.0..=1.0).contains(&threshold)) {
                bail!("--decode-busy-threshold is a fraction of total_kv_blocks in 0.0..=1.0");
            }
            if !self.conditional_disagg {
                bail!("--decode-busy-threshold needs --conditional-disagg");
            }
        }
        if self.conditional_disagg && self.prefill_workers == 0 {
            bail!(
                "--conditional-disagg needs --prefill-workers (an aggregated fleet has no pairs)"
            );
        }
        if self.load_interval.is_zero() {
            bail!("--load-interval must be above zero");
        }
        if self.replicas == 0 || self.replicas > sim::replicas::MAX_REPLICAS {
            bail!("--replicas must be 1..={}", sim::replicas::MAX_REPLICAS);
        }
        let mut cfg = SimConfig::new(self.workers, self.capacity, block_size);
        cfg.replicas = sim::Replicas {
            count: self.replicas,
            spread: self.replica_spread,
            load_lag: self.load_lag,
            sharing: self.replica_sharing,
            share_lag: self.share_lag,
            tie_break_window: self.tie_break_window,
            peer_slots: self.peer_slots,
        };
        cfg.prefill_workers = self.prefill_workers;
        cfg.speedup = self.speedup;
        cfg.seed = self.seed;
        cfg.load_interval = self.load_interval;
        cfg.max_staleness = self.max_staleness;
        cfg.kv = KvPickParams {
            overlap_score_credit: self.overlap_score_weight,
            prefill_load_scale: self.prefill_load_scale,
            router_temperature: self.temperature,
            conditional_disaggregation: ConditionalDisaggregation {
                enabled: self.conditional_disagg,
                decode_busy_threshold: self.decode_busy_threshold,
            },
        };
        cfg.latency = latency::LatencyModel {
            prefill_overhead_us: ms(self.prefill_overhead_ms, "--prefill-overhead-ms")? as u64,
            prefill_per_token_us: ms(self.prefill_ms_per_token, "--prefill-ms-per-token")?,
            decode_per_token_us: ms(self.decode_ms_per_token, "--decode-ms-per-token")?,
            kv_transfer_per_token_us: ms(
                self.kv_transfer_ms_per_token,
                "--kv-transfer-ms-per-token",
            )?,
        };
        Ok(cfg)
    }
}

/// Runs the replay: reads the trace, simulates each policy, writes `summary.json` and the plots
/// into `--out`, and returns the summary.
pub fn run(args: &ReplayArgs) -> anyhow::Result<report::Summary> {
    let cfg = args.sim_config()?;
    if args.policy.is_empty() {
        bail!("--policy names no policy");
    }
    let mut policies = args.policy.clone();
    policies.dedup();
    let prompt = args.tokenizer.clone().map(|tokenizer| trace::PromptFiles {
        tokenizer,
        chat_template: args.chat_template.clone(),
    });
    let trace = trace::load(&args.trace, cfg.block_size, prompt.as_ref())?;
    if trace.requests.is_empty() {
        bail!(
            "{} holds no replayable request ({} lines skipped{})",
            args.trace.display(),
            trace.skipped,
            trace
                .skip_reasons
                .first()
                .map(|r| format!(", first: {r}"))
                .unwrap_or_default()
        );
    }
    let candidates = sim::fleet_candidates(&cfg)?;
    let mut runs = Vec::new();
    for policy in policies {
        let bar = progress_bar(trace.requests.len() as u64, policy);
        let mut tick = |done: u64| {
            if let Some(bar) = &bar {
                bar.set_position(done);
            }
        };
        runs.push(simulate(
            &trace.requests,
            policy,
            &cfg,
            &candidates,
            &mut tick,
        ));
        if let Some(bar) = bar {
            bar.finish_and_clear();
        }
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    let plots = plots::write_all(&runs, &args.out)?;
    let summary = report::Summary {
        trace: args.trace.display().to_string(),
        requests: trace.requests.len(),
        skipped_lines: trace.skipped,
        skip_reasons: trace.skip_reasons,
        workers: cfg.workers,
        prefill_workers: cfg.prefill_workers,
        capacity_blocks: cfg.capacity_blocks,
        block_size: cfg.block_size.get(),
        speedup: cfg.speedup,
        seed: cfg.seed,
        load_interval_ms: cfg.load_interval.as_secs_f64() * 1000.0,
        max_staleness_ms: cfg.max_staleness.as_secs_f64() * 1000.0,
        kv: report::KvSettings {
            overlap_score_weight: cfg.kv.overlap_score_credit,
            prefill_load_scale: cfg.kv.prefill_load_scale,
            router_temperature: cfg.kv.router_temperature,
            conditional_disaggregation: cfg.kv.conditional_disaggregation.enabled,
            decode_busy_threshold: cfg.kv.conditional_disaggregation.decode_busy_threshold,
        },
        replicas: report::ReplicaSettings::of(&cfg.replicas),
        latency_model: cfg.latency,
        policies: runs.iter().map(report::PolicySummary::of).collect(),
        plots: plots
            .iter()
            .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect(),
    };
    let path = args.out.join("summary.json");
    let json = serde_json::to_string_pretty(&summary).context("encoding summary.json")?;
    std::fs::write(&path, json + "\n")
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(summary)
}

/// A progress bar on stderr, only when stderr is a terminal.
fn progress_bar(len: u64, policy: Policy) -> Option<indicatif::ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = indicatif::ProgressBar::new(len);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{prefix:>12} [{bar:40}] {pos}/{len} requests ({eta})",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(policy.as_label());
    Some(bar)
}
