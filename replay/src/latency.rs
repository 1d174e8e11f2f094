//! The latency model: simple, documented, and the same for every policy, so TTFT and end-to-end
//! latency compare placements rather than predict production.
//!
//! Each worker has one prefill lane, served first come first served:
//! * **prefill** of a request takes `prefill_overhead + uncached_tokens × prefill_per_token`, where
//!   `uncached_tokens = input_tokens − cached_tokens` (the prefix the worker's cache held when the
//!   request was dispatched);
//! * **queueing**: prefill starts when the lane is free (`max(arrival, lane_free_at)`);
//! * **TTFT** = prefill end − arrival;
//! * **disaggregated pairs**: the prefill worker's lane prefills; then the prompt tokens the decode
//!   worker's own prefix cache does not hold move to it at `kv_transfer_per_token`, and TTFT ends
//!   when they have arrived (prefill end + transfer − arrival). A decode worker's lane serves only
//!   the requests it prefills itself (conditional disaggregation's bypass);
//! * **decode** then takes `output_tokens × decode_per_token` (continuous batching is assumed to
//!   hide batch size: decode does not queue), and **end-to-end** = TTFT + decode.
//!
//! Defaults (a mid-size model on one GPU): 5 ms overhead, 0.1 ms per uncached prompt token
//! (10k tokens/s prefill), 20 ms per output token, 0.01 ms per transferred prompt token (100k
//! tokens/s between a prefill and a decode worker).

use std::time::Duration;

/// The model's three constants.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct LatencyModel {
    pub prefill_overhead_us: u64,
    pub prefill_per_token_us: f64,
    pub decode_per_token_us: f64,
    pub kv_transfer_per_token_us: f64,
}

impl Default for LatencyModel {
    fn default() -> Self {
        Self {
            prefill_overhead_us: 5_000,
            prefill_per_token_us: 100.0,
            decode_per_token_us: 20_000.0,
            kv_transfer_per_token_us: 10.0,
        }
    }
}

impl LatencyModel {
    /// Prefill time of `uncached_tokens`, in microseconds.
    pub fn prefill_us(&self, uncached_tokens: u64) -> u64 {
        self.prefill_overhead_us
            .saturating_add((uncached_tokens as f64 * self.prefill_per_token_us).round() as u64)
    }

    /// Decode time of `output_tokens`, in microseconds.
    pub fn decode_us(&self, output_tokens: u64) -> u64 {
        (output_tokens as f64 * self.decode_per_token_us).round() as u64
    }

    /// Time to move `tokens` prompt tokens' KV from a prefill worker to its decode worker.
    pub fn transfer_us(&self, tokens: u64) -> u64 {
        (tokens as f64 * self.kv_transfer_per_token_us).round() as u64
    }

    pub fn prefill(&self, uncached_tokens: u64) -> Duration {
        Duration::from_micros(self.prefill_us(uncached_tokens))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_is_linear_in_uncached_tokens_and_decode_in_output() {
        let m = LatencyModel::default();
        assert_eq!(m.prefill_us(0), 5_000);
        assert_eq!(m.prefill_us(1_000), 105_000);
        assert_eq!(m.decode_us(10), 200_000);
        assert_eq!(m.transfer_us(1_000), 10_000);
        assert_eq!(m.prefill(1_000), Duration::from_millis(105));
    }
}
