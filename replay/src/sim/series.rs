//! The run's time series: per bucket of simulated time, the block hit rate and each worker's mean
//! active blocks; over all arrivals, the decode workers' load imbalance (max / mean and the
//! coefficient of variation).

use continuum_protocol::picker::{Candidate, CandidateRole};

use super::workers::SimWorker;
use super::{PolicyRun, SimConfig, arrival_us};
use crate::trace::TraceRequest;

/// The run's time series: arrivals fall into `cfg.buckets` equal buckets of the trace's span;
/// per bucket, the block hit rate and each worker's mean active blocks; over all arrivals, the
/// decode workers' load imbalance.
pub(super) struct Series {
    buckets: usize,
    span_us: u64,
    decoders: usize,
    /// Per bucket: (hit blocks, prompt blocks).
    pub(super) hits: Vec<(u64, u64)>,
    /// Per worker, per bucket: (sum of active blocks, arrivals seen).
    load: Vec<Vec<(u64, u64)>>,
    imbalance_sum: f64,
    imbalance_n: u64,
    /// Sum over the same arrivals of the coefficient of variation of the decode workers' blocks.
    cv_sum: f64,
}

impl Series {
    pub(super) fn new(cfg: &SimConfig, trace: &[TraceRequest], candidates: &[Candidate]) -> Self {
        let buckets = cfg.buckets.max(1);
        Self {
            buckets,
            span_us: trace
                .last()
                .map_or(0, |r| arrival_us(r, cfg.speedup))
                .max(1),
            decoders: candidates
                .iter()
                .filter(|c| c.role != CandidateRole::Prefill)
                .count()
                .max(1),
            hits: vec![(0, 0); buckets],
            load: vec![vec![(0, 0); buckets]; candidates.len()],
            imbalance_sum: 0.0,
            imbalance_n: 0,
            cv_sum: 0.0,
        }
    }

    /// Bucket start times, seconds.
    pub(super) fn starts_s(&self) -> Vec<f64> {
        (0..self.buckets)
            .map(|b| (b as f64 * self.span_us as f64 / self.buckets as f64) / 1e6)
            .collect()
    }

    pub(super) fn bucket_of(&self, t: u64) -> usize {
        ((t as u128 * self.buckets as u128 / (self.span_us as u128 + 1)) as usize)
            .min(self.buckets - 1)
    }

    /// The workers' active blocks as an arrival in `bucket` sees them.
    pub(super) fn sample_load(&mut self, workers: &[SimWorker], bucket: usize) {
        let mut max_load = 0u64;
        let mut total_load = 0u64;
        let mut squares = 0f64;
        for (w, worker) in workers.iter().enumerate() {
            let slot = &mut self.load[w][bucket];
            slot.0 += worker.active_blocks;
            slot.1 += 1;
            if worker.decodes {
                max_load = max_load.max(worker.active_blocks);
                total_load += worker.active_blocks;
                squares += (worker.active_blocks as f64).powi(2);
            }
        }
        if total_load > 0 {
            self.imbalance_sum += max_load as f64 * self.decoders as f64 / total_load as f64;
            self.imbalance_n += 1;
            let n = self.decoders as f64;
            let mean = total_load as f64 / n;
            let variance = (squares / n - mean * mean).max(0.0);
            self.cv_sum += variance.sqrt() / mean;
        }
    }

    pub(super) fn finish(self, run: &mut PolicyRun, prefilling_workers: usize) {
        let capacity_us = self.span_us as f64 * prefilling_workers.max(1) as f64;
        run.utilisation = run.prefill_busy_us as f64 / capacity_us;
        run.load_imbalance = if self.imbalance_n == 0 {
            1.0
        } else {
            self.imbalance_sum / self.imbalance_n as f64
        };
        run.load_cv = if self.imbalance_n == 0 {
            0.0
        } else {
            self.cv_sum / self.imbalance_n as f64
        };
        run.hit_rate_series = self
            .hits
            .iter()
            .map(|(hit, total)| (*total > 0).then(|| *hit as f64 / *total as f64))
            .collect();
        run.worker_load_series = self
            .load
            .iter()
            .map(|per_bucket| {
                per_bucket
                    .iter()
                    .map(|(sum, n)| (*n > 0).then(|| *sum as f64 / *n as f64))
                    .collect()
            })
            .collect();
    }
}
