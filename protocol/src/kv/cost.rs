//! Upstream's per-candidate cost (dynamo-wire §12, the seed's "The formula") and the two
//! selection rules: argmin with a caller-owned tie-break cursor at temperature 0, softmax
//! sampling with a caller-drawn unit above it. Lower cost is better.

use super::hashing::BlockSize;

/// Tunables of the formula (upstream defaults: both 1.0).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostParams {
    pub overlap_score_credit: f64,
    pub prefill_load_scale: f64,
}

impl Default for CostParams {
    fn default() -> Self {
        Self {
            overlap_score_credit: 1.0,
            prefill_load_scale: 1.0,
        }
    }
}

/// What the picker knows about one candidate rank for one request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CandidateLoad {
    /// Leading request blocks the rank holds (from `KvIndex::find_matches`).
    pub overlap_blocks: u64,
    pub active_prefill_tokens: u64,
    pub active_decode_blocks: u64,
}

/// Every intermediate of the formula, so callers (and logs) can use the part they need.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostBreakdown {
    pub cached_tokens: u64,
    pub raw_prefill_tokens: u64,
    pub raw_prefill_blocks: f64,
    pub overlap_credit_blocks: f64,
    pub adjusted_prefill: f64,
    pub decode_cost_blocks: f64,
    pub cost: f64,
}

impl CostBreakdown {
    /// Conditional disaggregation's decode score: `max(0, decode_cost_blocks - credit)`.
    pub fn conditional_decode_cost(&self) -> f64 {
        (self.decode_cost_blocks - self.overlap_credit_blocks).max(0.0)
    }
}

/// The seed's formula for one candidate with prompt length `isl` tokens:
///
/// ```text
/// cached_tokens         = min(overlap_blocks * bs, isl)
/// raw_prefill_tokens    = active_prefill_tokens + (isl - cached_tokens) + cached_tokens
/// raw_prefill_blocks    = raw_prefill_tokens / bs
/// overlap_credit_blocks = overlap_score_credit * overlap_blocks
/// adjusted_prefill      = max(0, raw_prefill_blocks - overlap_credit_blocks)
/// decode_cost_blocks    = active_decode_blocks + max(0, ceil(isl / bs) - overlap_blocks)
/// cost                  = prefill_load_scale * adjusted_prefill + decode_cost_blocks
/// ```
pub fn candidate_cost(
    isl: u64,
    block_size: BlockSize,
    load: CandidateLoad,
    params: CostParams,
) -> CostBreakdown {
    let bs = u64::from(block_size.get());
    let cached_tokens = load.overlap_blocks.saturating_mul(bs).min(isl);
    let raw_prefill_tokens = load
        .active_prefill_tokens
        .saturating_add(isl - cached_tokens)
        .saturating_add(cached_tokens);
    let raw_prefill_blocks = raw_prefill_tokens as f64 / bs as f64;
    let overlap_credit_blocks = params.overlap_score_credit * load.overlap_blocks as f64;
    let adjusted_prefill = (raw_prefill_blocks - overlap_credit_blocks).max(0.0);
    let request_blocks = isl.div_ceil(bs);
    let decode_cost_blocks = load.active_decode_blocks as f64
        + request_blocks.saturating_sub(load.overlap_blocks) as f64;
    let cost = params.prefill_load_scale * adjusted_prefill + decode_cost_blocks;
    CostBreakdown {
        cached_tokens,
        raw_prefill_tokens,
        raw_prefill_blocks,
        overlap_credit_blocks,
        adjusted_prefill,
        decode_cost_blocks,
        cost,
    }
}

/// [`candidate_cost`] and [`overlap_only_cost`] for many ranks of one request and one block
/// size: what depends only on the request (`ceil(isl / bs)`, `isl / bs`, the block size as a
/// float) is computed once, and each rank's cost takes the same `f64` operations in the same
/// order as the per-candidate functions, so it is bit-identical to them
/// (`tests::request_cost_is_bit_identical_to_the_per_candidate_formula`).
#[derive(Clone, Copy, Debug)]
pub struct RequestCost {
    isl: u64,
    bs: u64,
    bs_f: f64,
    /// `1 / bs` when `bs` is a power of two, else 0: dividing a float by a power of two and
    /// multiplying it by the exact reciprocal give the same result (both are exact for the
    /// finite, non-negative values below 2^64 the formula divides), and a multiplication costs
    /// a fraction of a division.
    inv_bs: f64,
    request_blocks: u64,
    /// `isl / bs` as [`overlap_only_cost`] computes it.
    quiet_blocks: f64,
    params: CostParams,
}

impl RequestCost {
    pub fn new(isl: u64, block_size: BlockSize, params: CostParams) -> Self {
        let bs = u64::from(block_size.get());
        Self {
            isl,
            bs,
            bs_f: bs as f64,
            inv_bs: if bs.is_power_of_two() {
                1.0 / bs as f64
            } else {
                0.0
            },
            request_blocks: isl.div_ceil(bs),
            quiet_blocks: isl as f64 / f64::from(block_size.get()),
            params,
        }
    }

    /// `(adjusted_prefill, overlap_credit_blocks, decode_cost_blocks)` of [`candidate_cost`].
    #[inline(always)]
    fn parts(&self, load: CandidateLoad) -> (f64, f64, f64) {
        let cached_tokens = load.overlap_blocks.saturating_mul(self.bs).min(self.isl);
        let raw_prefill_tokens = load
            .active_prefill_tokens
            .saturating_add(self.isl - cached_tokens)
            .saturating_add(cached_tokens);
        let raw_prefill_blocks = if self.inv_bs != 0.0 {
            raw_prefill_tokens as f64 * self.inv_bs
        } else {
            raw_prefill_tokens as f64 / self.bs_f
        };
        let overlap_credit_blocks = self.params.overlap_score_credit * load.overlap_blocks as f64;
        let adjusted_prefill = (raw_prefill_blocks - overlap_credit_blocks).max(0.0);
        let decode_cost_blocks = load.active_decode_blocks as f64
            + self.request_blocks.saturating_sub(load.overlap_blocks) as f64;
        (adjusted_prefill, overlap_credit_blocks, decode_cost_blocks)
    }

    /// [`candidate_cost`]`(..).cost`.
    #[inline(always)]
    pub fn cost(&self, load: CandidateLoad) -> f64 {
        let (adjusted_prefill, _, decode_cost_blocks) = self.parts(load);
        self.params.prefill_load_scale * adjusted_prefill + decode_cost_blocks
    }

    /// [`candidate_cost`]`(..).conditional_decode_cost()`.
    #[inline(always)]
    pub fn conditional_decode_cost(&self, load: CandidateLoad) -> f64 {
        let (_, overlap_credit_blocks, decode_cost_blocks) = self.parts(load);
        (decode_cost_blocks - overlap_credit_blocks).max(0.0)
    }

    /// Whether [`Self::cost`] (the full formula's cost, made [`sane`]) is at least the rank's
    /// `active_decode_blocks` for every load: with `prefill_load_scale >= 0` the prefill term
    /// is non-negative (or NaN, which [`sane`] makes +inf) and the decode term is the decode
    /// blocks plus a non-negative count, and float addition and conversion are monotone. A
    /// pass can then skip ranks whose decode blocks alone lose.
    pub fn bounded_below_by_decode(&self) -> bool {
        self.params.prefill_load_scale >= 0.0
    }

    /// Whole blocks that [`Self::cost`] adds, at least, to the decode blocks of a rank holding
    /// none of the prompt (overlap 0): the prefill term at no prefill backlog, floored, plus
    /// the prompt's `ceil(isl / bs)` decode blocks. With overlap 0 every term of the formula is
    /// monotone in the backlogs (the credit's product with 0 is the same for every load) and
    /// float operations are monotone, so such a rank with `d` decode blocks costs at least
    /// `floor + d`, both integers converting exactly: a pass may skip it on its decode blocks
    /// against a bound this much lower than [`Self::bounded_below_by_decode`]'s. `None` where
    /// no bound holds (a negative or NaN prefill scale) or a term is not below 2^52.
    pub fn zero_overlap_floor(&self) -> Option<u64> {
        const LIMIT: f64 = 4_503_599_627_370_496.0; // 2^52
        if !self.bounded_below_by_decode() || self.request_blocks >= 1 << 52 {
            return None;
        }
        let (adjusted_prefill, _, _) = self.parts(CandidateLoad::default());
        let prefill = self.params.prefill_load_scale * adjusted_prefill;
        if !(0.0..LIMIT).contains(&prefill) {
            return None;
        }
        // Non-negative and below 2^52: the truncation is the floor; the sum stays below 2^53.
        Some(prefill as u64 + self.request_blocks)
    }

    /// [`overlap_only_cost`] with this request's size, block size and credit.
    #[inline(always)]
    pub fn overlap_only(&self, overlap_blocks: u64) -> f64 {
        self.quiet_blocks - self.params.overlap_score_credit * overlap_blocks as f64
    }
}

/// The seed's quiet-fleet rule (no fresh prefill backlog anywhere): candidates compete on
/// request size and overlap alone, `isl / bs - overlap_score_credit * overlap_blocks`.
pub fn overlap_only_cost(
    isl: u64,
    block_size: BlockSize,
    overlap_blocks: u64,
    overlap_score_credit: f64,
) -> f64 {
    isl as f64 / f64::from(block_size.get()) - overlap_score_credit * overlap_blocks as f64
}

/// NaN sorts as +inf: a candidate whose cost cannot be computed is never preferred.
#[inline(always)]
pub fn sane(cost: f64) -> f64 {
    if cost.is_nan() { f64::INFINITY } else { cost }
}

/// Temperature 0: the lowest cost wins; among exactly equal minima the `cursor`-th (mod the tie
/// count) wins, so a caller that advances its per-phase cursor rotates through ties
/// deterministically. `None` only for an empty slice.
pub fn argmin_with_cursor(costs: &[f64], cursor: u64) -> Option<usize> {
    let min = costs.iter().copied().map(sane).reduce(f64::min)?;
    let ties = costs.iter().filter(|c| sane(**c) == min).count() as u64;
    let pick = (cursor % ties) as usize;
    costs
        .iter()
        .enumerate()
        .filter(|(_, c)| sane(**c) == min)
        .nth(pick)
        .map(|(i, _)| i)
}

/// Temperature > 0 (wire §12.3): `p_i ∝ exp(-(c_i - c_min) / ((c_max - c_min) * T))`, then the
/// first `i` whose cumulative probability reaches `unit` (a caller-drawn value in `[0, 1)`).
/// All-equal costs (or all non-finite) sample uniformly; non-finite costs get probability 0
/// when any cost is finite. A non-positive or NaN temperature degrades to the cursor-free argmin.
pub fn softmax_sample_index(logits: &[f64], temperature: f64, unit: f64) -> Option<usize> {
    if logits.is_empty() {
        return None;
    }
    let unit = if unit.is_finite() {
        unit.clamp(0.0, 1.0)
    } else {
        0.0
    };
    if temperature.is_nan() || temperature <= 0.0 {
        return argmin_with_cursor(logits, 0);
    }
    let finite: Vec<f64> = logits.iter().copied().filter(|c| c.is_finite()).collect();
    let uniform = |n: usize| ((unit * n as f64) as usize).min(n - 1);
    if finite.is_empty() {
        return Some(uniform(logits.len()));
    }
    let c_min = finite.iter().copied().fold(f64::INFINITY, f64::min);
    let c_max = finite.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let range = c_max - c_min;
    if range == 0.0 || !range.is_finite() {
        // Equal finite costs, or a span too large to represent: treat the finite ones as equal.
        let finite_positions: Vec<usize> = logits
            .iter()
            .enumerate()
            .filter(|(_, c)| c.is_finite())
            .map(|(i, _)| i)
            .collect();
        return Some(finite_positions[uniform(finite_positions.len())]);
    }
    let weights: Vec<f64> = logits
        .iter()
        .map(|c| {
            if c.is_finite() {
                (-(c - c_min) / (range * temperature)).exp()
            } else {
                0.0
            }
        })
        .collect();
    let total: f64 = weights.iter().sum();
    let mut cumulative = 0.0;
    let mut last_positive = 0;
    for (i, w) in weights.iter().enumerate() {
        if *w > 0.0 {
            last_positive = i;
            cumulative += w / total;
            if unit <= cumulative {
                return Some(i);
            }
        }
    }
    // Rounding can leave the cumulative sum a hair under 1.
    Some(last_positive)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bs(n: u32) -> BlockSize {
        BlockSize::new(n).unwrap()
    }

    #[test]
    fn hand_computed_cost_with_overlap() {
        // isl 100, bs 16, overlap 3, prefill backlog 64 tokens, 10 decode blocks, defaults.
        let b = candidate_cost(
            100,
            bs(16),
            CandidateLoad {
                overlap_blocks: 3,
                active_prefill_tokens: 64,
                active_decode_blocks: 10,
            },
            CostParams::default(),
        );
        assert_eq!(b.cached_tokens, 48);
        assert_eq!(b.raw_prefill_tokens, 164);
        assert_eq!(b.raw_prefill_blocks, 10.25);
        assert_eq!(b.overlap_credit_blocks, 3.0);
        assert_eq!(b.adjusted_prefill, 7.25);
        // ceil(100/16) = 7 request blocks, 3 already held.
        assert_eq!(b.decode_cost_blocks, 14.0);
        assert_eq!(b.cost, 21.25);
        assert_eq!(b.conditional_decode_cost(), 11.0);
    }

    #[test]
    fn overlap_beyond_prompt_caps_cached_tokens_and_floors_at_zero() {
        let b = candidate_cost(
            32,
            bs(16),
            CandidateLoad {
                overlap_blocks: 5,
                active_prefill_tokens: 0,
                active_decode_blocks: 0,
            },
            CostParams {
                overlap_score_credit: 2.0,
                prefill_load_scale: 3.0,
            },
        );
        assert_eq!(b.cached_tokens, 32);
        assert_eq!(b.raw_prefill_blocks, 2.0);
        assert_eq!(b.overlap_credit_blocks, 10.0);
        assert_eq!(b.adjusted_prefill, 0.0);
        assert_eq!(b.decode_cost_blocks, 0.0);
        assert_eq!(b.cost, 0.0);
    }

    #[test]
    fn scale_weights_prefill_only() {
        let load = CandidateLoad {
            overlap_blocks: 0,
            active_prefill_tokens: 32,
            active_decode_blocks: 4,
        };
        let b = candidate_cost(
            64,
            bs(32),
            load,
            CostParams {
                overlap_score_credit: 1.0,
                prefill_load_scale: 0.5,
            },
        );
        // raw prefill = (32 + 64) / 32 = 3 blocks, halved; decode = 4 + 2.
        assert_eq!(b.cost, 1.5 + 6.0);
        assert_eq!(overlap_only_cost(64, bs(32), 1, 1.0), 1.0);
    }

    #[test]
    fn argmin_rotates_ties_with_the_cursor() {
        let costs = [3.0, 1.0, 2.0, 1.0, 1.0];
        assert_eq!(argmin_with_cursor(&costs, 0), Some(1));
        assert_eq!(argmin_with_cursor(&costs, 1), Some(3));
        assert_eq!(argmin_with_cursor(&costs, 2), Some(4));
        assert_eq!(argmin_with_cursor(&costs, 3), Some(1));
        assert_eq!(argmin_with_cursor(&[], 7), None);
        assert_eq!(argmin_with_cursor(&[f64::NAN, 5.0], 0), Some(1));
        assert_eq!(argmin_with_cursor(&[f64::NAN, f64::NAN], 1), Some(1));
    }

    #[test]
    fn softmax_matches_hand_computed_probabilities() {
        // costs 0 and 1, T = 1: weights 1 and e^-1; p0 = 1 / (1 + e^-1) ≈ 0.731.
        let p0 = 1.0 / (1.0 + (-1.0f64).exp());
        assert_eq!(softmax_sample_index(&[0.0, 1.0], 1.0, 0.0), Some(0));
        assert_eq!(softmax_sample_index(&[0.0, 1.0], 1.0, p0 - 1e-9), Some(0));
        assert_eq!(softmax_sample_index(&[0.0, 1.0], 1.0, p0 + 1e-9), Some(1));
        assert_eq!(softmax_sample_index(&[0.0, 1.0], 1.0, 0.999_999), Some(1));
        // Scale invariance: the range normalises the costs.
        assert_eq!(
            softmax_sample_index(&[100.0, 200.0], 1.0, p0 + 1e-9),
            Some(1)
        );
    }

    #[test]
    fn softmax_edge_cases() {
        assert_eq!(softmax_sample_index(&[], 1.0, 0.5), None);
        // All equal: uniform over the candidates.
        assert_eq!(
            softmax_sample_index(&[2.0, 2.0, 2.0, 2.0], 0.7, 0.0),
            Some(0)
        );
        assert_eq!(
            softmax_sample_index(&[2.0, 2.0, 2.0, 2.0], 0.7, 0.5),
            Some(2)
        );
        assert_eq!(
            softmax_sample_index(&[2.0, 2.0, 2.0, 2.0], 0.7, 0.99),
            Some(3)
        );
        // Infinite costs never win while a finite one exists.
        assert_eq!(
            softmax_sample_index(&[f64::INFINITY, 1.0], 1.0, 0.99),
            Some(1)
        );
        assert_eq!(
            softmax_sample_index(&[f64::NAN, 1.0, 3.0], 1.0, 0.0),
            Some(1)
        );
        // Zero temperature is the argmin; out-of-range units are clamped.
        assert_eq!(softmax_sample_index(&[5.0, 1.0], 0.0, 0.9), Some(1));
        assert_eq!(softmax_sample_index(&[0.0, 1.0], 1.0, 7.0), Some(1));
        assert_eq!(softmax_sample_index(&[0.0, 1.0], 1.0, f64::NAN), Some(0));
        // A very low temperature concentrates on the minimum.
        assert_eq!(softmax_sample_index(&[0.0, 1.0], 0.01, 0.999), Some(0));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        /// The hoisted formula gives the per-candidate functions' costs bit for bit, for
        /// powers of two (the reciprocal multiplication) and other block sizes, extreme loads
        /// (saturation, the `2^53` float range) and unusual parameters.
        #[test]
        fn request_cost_is_bit_identical_to_the_per_candidate_formula(
            isl in proptest::prop_oneof![0u64..5_000, proptest::prelude::any::<u64>()],
            block in proptest::prop_oneof![
                proptest::sample::select(vec![16u32, 32, 64, 128, 65_536]),
                16u32..=65_536,
            ],
            overlap in proptest::prop_oneof![0u64..400, proptest::prelude::any::<u64>()],
            prefill in proptest::prop_oneof![0u64..100_000, proptest::prelude::any::<u64>()],
            decode in proptest::prop_oneof![0u64..2_000, proptest::prelude::any::<u64>()],
            credit in proptest::sample::select(vec![0.0, 0.5, 1.0, 2.0, -1.0, 1e300, f64::INFINITY, f64::NAN]),
            scale in proptest::sample::select(vec![0.0, 0.5, 1.0, 3.0, -2.0, f64::INFINITY, f64::NAN]),
        ) {
            let params = CostParams {
                overlap_score_credit: credit,
                prefill_load_scale: scale,
            };
            let load = CandidateLoad {
                overlap_blocks: overlap,
                active_prefill_tokens: prefill,
                active_decode_blocks: decode,
            };
            let hoisted = RequestCost::new(isl, bs(block), params);
            let b = candidate_cost(isl, bs(block), load, params);
            proptest::prop_assert_eq!(hoisted.cost(load).to_bits(), b.cost.to_bits());
            proptest::prop_assert_eq!(
                hoisted.conditional_decode_cost(load).to_bits(),
                b.conditional_decode_cost().to_bits()
            );
            proptest::prop_assert_eq!(
                hoisted.overlap_only(overlap).to_bits(),
                overlap_only_cost(isl, bs(block), overlap, credit).to_bits()
            );
            if hoisted.bounded_below_by_decode() {
                proptest::prop_assert!(sane(hoisted.cost(load)) >= decode as f64);
            }
        }

        /// What a pass relies on when it skips a rank holding none of the prompt: with
        /// `F = floor(lowest)`, decode blocks above `F - zero_overlap_floor()` cost strictly
        /// more than `lowest`, whatever the prefill backlog.
        #[test]
        fn a_rank_without_overlap_costs_at_least_its_floor(
            isl in proptest::prop_oneof![0u64..200_000, proptest::prelude::any::<u64>()],
            block in proptest::sample::select(vec![16u32, 64, 100, 1_000, 65_536]),
            prefill in proptest::prop_oneof![
                proptest::strategy::Just(0u64),
                0u64..100_000,
                proptest::prelude::any::<u64>()
            ],
            decode in proptest::prop_oneof![0u64..20_000, proptest::prelude::any::<u64>()],
            lowest in proptest::prop_oneof![
                proptest::strategy::Strategy::prop_map(0u64..30_000, |v| v as f64),
                0.0f64..30_000.0,
                0.0f64..9.0e15
            ],
            credit in proptest::sample::select(vec![0.0, 0.5, 1.0, 2.0, -1.0, 1e300, f64::INFINITY, f64::NAN]),
            scale in proptest::sample::select(vec![0.0, 0.5, 1.0, 3.0, -2.0, 1e-300, f64::INFINITY, f64::NAN]),
        ) {
            let params = CostParams {
                overlap_score_credit: credit,
                prefill_load_scale: scale,
            };
            let hoisted = RequestCost::new(isl, bs(block), params);
            let Some(floor) = hoisted.zero_overlap_floor() else {
                return Ok(());
            };
            let bound = (lowest as u64).saturating_sub(floor);
            // The drawn decode blocks, and the fewest the bound skips (where ties are won).
            for decode in [decode, bound.saturating_add(1)] {
                let load = CandidateLoad {
                    overlap_blocks: 0,
                    active_prefill_tokens: prefill,
                    active_decode_blocks: decode,
                };
                if decode > bound {
                    proptest::prop_assert!(sane(hoisted.cost(load)) > lowest, "{load:?}");
                }
            }
        }
    }
}
