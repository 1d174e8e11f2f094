//! Bounds of prompt rendering and the block-hash plan of a rendered prompt (seed "Prompt
//! rendering and block hashing bounds"): pure numbers and checks, so the daemon's renderer only
//! does the IO (blocking pool, permits, clocks) around them.

use std::sync::Arc;
use std::time::Duration;

use super::LocalBlockHash;
use super::hashing::{BlockSize, local_block_hashes, salt_seed};

/// minijinja fuel per render (instructions).
pub const RENDER_FUEL: u64 = 5_000_000;
/// Rendered text cap in bytes (1 MiB).
pub const MAX_RENDERED_BYTES: usize = 1 << 20;
/// Token cap of one prompt.
pub const MAX_PROMPT_TOKENS: usize = 1_048_576;
/// How long a request waits for a render permit before it scores without a KV term.
pub const RENDER_PERMIT_WAIT: Duration = Duration::from_millis(20);
/// Total time from asking for a permit to holding hashes.
pub const RENDER_DEADLINE: Duration = Duration::from_secs(2);
/// Render permits are one per core, clamped to this range.
pub const MIN_RENDER_PERMITS: usize = 4;
pub const MAX_RENDER_PERMITS: usize = 32;
/// A model is hashed for at most this many distinct `kv_cache_block_size` values.
pub const MAX_BLOCK_SIZES: usize = 2;

/// Every bound of one render, in one value so tests can shrink them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RenderLimits {
    pub fuel: u64,
    pub max_rendered_bytes: usize,
    pub max_tokens: usize,
    pub permit_wait: Duration,
    pub deadline: Duration,
    pub permits: usize,
}

impl RenderLimits {
    /// The seed's limits on a machine with `cpus` cores.
    pub fn for_cpus(cpus: usize) -> Self {
        Self {
            fuel: RENDER_FUEL,
            max_rendered_bytes: MAX_RENDERED_BYTES,
            max_tokens: MAX_PROMPT_TOKENS,
            permit_wait: RENDER_PERMIT_WAIT,
            deadline: RENDER_DEADLINE,
            permits: render_permits(cpus),
        }
    }
}

impl Default for RenderLimits {
    fn default() -> Self {
        Self::for_cpus(MIN_RENDER_PERMITS)
    }
}

/// `clamp(cpus, 4, 32)`: enough permits that a small machine still renders concurrently, few
/// enough that renders never crowd out the blocking pool's other users.
pub fn render_permits(cpus: usize) -> usize {
    cpus.clamp(MIN_RENDER_PERMITS, MAX_RENDER_PERMITS)
}

/// How a prompt preparation failed, as the closed label set the selection metrics use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PrepareFailureKind {
    /// Rendered text or tokens over their cap (`kv_selection_total{result="prompt_too_large"}`).
    PromptTooLarge,
    /// No template, a template error, fuel, permit wait or deadline
    /// (`kv_selection_total{result="render_unavailable"}`).
    RenderUnavailable,
    /// The model's block sizes cannot be hashed (`kv_artifacts_total{result="unsupported"}`).
    Unsupported,
}

impl PrepareFailureKind {
    pub fn label(self) -> &'static str {
        match self {
            Self::PromptTooLarge => "prompt_too_large",
            Self::RenderUnavailable => "render_unavailable",
            Self::Unsupported => "unsupported",
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BlockPlanError {
    #[error("kv_cache_block_size {0} is outside 16..=65536")]
    OutOfRange(u32),
    #[error("{0} distinct kv_cache_block_size values; at most {MAX_BLOCK_SIZES} are hashed")]
    TooMany(usize),
}

/// The distinct, validated block sizes of a model's workers, ascending. Checked before any
/// rendering, so an unsupported model costs no blocking-pool time.
pub fn block_plan(sizes: &[u32]) -> Result<Vec<BlockSize>, BlockPlanError> {
    let mut plan: Vec<BlockSize> = Vec::with_capacity(MAX_BLOCK_SIZES);
    for &size in sizes {
        let size = BlockSize::new(size).map_err(|_| BlockPlanError::OutOfRange(size))?;
        if !plan.contains(&size) {
            if plan.len() == MAX_BLOCK_SIZES {
                let distinct = distinct_count(sizes);
                return Err(BlockPlanError::TooMany(distinct));
            }
            plan.push(size);
        }
    }
    plan.sort_unstable();
    Ok(plan)
}

fn distinct_count(sizes: &[u32]) -> usize {
    let mut sorted = sizes.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    sorted.len()
}

/// Appends to `hashes` the LocalBlockHashes of the complete blocks of `tokens` after the first
/// `hashes.len()`, so a prompt that continues a hashed one hashes only its new blocks. Exact
/// when the first `hashes.len()` blocks of `tokens` are the ones `hashes` was computed from
/// with `seed`: a LocalBlockHash is a function of its block's tokens and the seed alone (the
/// chained SequenceHash is derived from them by the index). A trailing partial block is
/// ignored, so it is hashed once it fills; `hashes` longer than `tokens` allows is truncated.
pub fn extend_block_hashes(
    hashes: &mut Vec<LocalBlockHash>,
    tokens: &[u32],
    size: BlockSize,
    seed: u64,
) {
    let block = size.get() as usize;
    hashes.truncate(tokens.len() / block);
    let start = hashes.len() * block;
    hashes.extend(local_block_hashes(&tokens[start..], size, seed));
}

/// The LocalBlockHashes the index is keyed by (`KvIndex::find_matches`), per block size.
pub fn prompt_block_hashes(
    tokens: &[u32],
    plan: &[BlockSize],
    lora_name: Option<&str>,
    cache_salt: Option<&str>,
) -> Vec<(BlockSize, Vec<LocalBlockHash>)> {
    let seed = salt_seed(lora_name, cache_salt);
    plan.iter()
        .map(|&size| (size, local_block_hashes(tokens, size, seed)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::hashing::KV_HASH_SEED;

    #[test]
    fn permits_are_clamped_to_four_through_thirty_two() {
        for (cpus, want) in [
            (0, 4),
            (1, 4),
            (4, 4),
            (7, 7),
            (32, 32),
            (33, 32),
            (512, 32),
        ] {
            assert_eq!(render_permits(cpus), want, "{cpus} cpus");
        }
        assert_eq!(RenderLimits::for_cpus(2).permits, 4);
        assert_eq!(RenderLimits::default().fuel, 5_000_000);
        assert_eq!(RenderLimits::default().max_rendered_bytes, 1_048_576);
        assert_eq!(RenderLimits::default().max_tokens, 1_048_576);
    }

    #[test]
    fn block_plan_dedupes_sorts_and_refuses_a_third_size_or_a_bad_one() {
        let size = |n| BlockSize::new(n).unwrap();
        assert_eq!(block_plan(&[]), Ok(vec![]));
        assert_eq!(block_plan(&[64, 16, 64]), Ok(vec![size(16), size(64)]));
        assert_eq!(block_plan(&[16, 32, 64]), Err(BlockPlanError::TooMany(3)));
        assert_eq!(block_plan(&[16, 8]), Err(BlockPlanError::OutOfRange(8)));
        assert_eq!(
            block_plan(&[65_537]),
            Err(BlockPlanError::OutOfRange(65_537))
        );
    }

    #[test]
    fn extended_hashes_equal_hashes_of_the_whole_prompt() {
        let size = BlockSize::new(16).unwrap();
        let seed = salt_seed(Some("lora"), None);
        let tokens: Vec<u32> = (0..200).map(|i| i * 7 + 3).collect();
        let whole = local_block_hashes(&tokens, size, seed);
        for shared in [0, 5, 16, 31, 32, 100, 200] {
            // The hashes of the blocks inside a shared prefix, extended over the whole prompt.
            let mut hashes = local_block_hashes(&tokens[..shared], size, seed);
            extend_block_hashes(&mut hashes, &tokens, size, seed);
            assert_eq!(hashes, whole, "{shared} tokens shared");
        }
        // Hashes of a longer prompt are cut to the blocks this one has.
        let mut hashes = whole.clone();
        extend_block_hashes(&mut hashes, &tokens[..40], size, seed);
        assert_eq!(hashes, whole[..2]);
    }

    #[test]
    fn hashes_per_size_use_the_request_seed() {
        let tokens: Vec<u32> = (0..40).collect();
        let plan = block_plan(&[16, 32]).unwrap();
        let hashes = prompt_block_hashes(&tokens, &plan, None, None);
        assert_eq!(hashes.len(), 2);
        assert_eq!(hashes[0].1.len(), 2);
        assert_eq!(hashes[1].1.len(), 1);
        assert_eq!(
            hashes[0].1,
            local_block_hashes(&tokens, plan[0], KV_HASH_SEED)
        );
        let salted = prompt_block_hashes(&tokens, &plan, Some("lora"), Some("tenant"));
        assert_ne!(salted[0].1, hashes[0].1);
        // wire §11.5: tokens 0..31, B = 16.
        let want = [15_310_707_395_893_867_146u64, 15_292_316_782_987_903_195];
        assert_eq!(hashes[0].1.iter().map(|h| h.0).collect::<Vec<_>>(), want);
    }

    #[test]
    fn labels_are_the_seed_result_names() {
        assert_eq!(
            PrepareFailureKind::PromptTooLarge.label(),
            "prompt_too_large"
        );
        assert_eq!(
            PrepareFailureKind::RenderUnavailable.label(),
            "render_unavailable"
        );
        assert_eq!(PrepareFailureKind::Unsupported.label(), "unsupported");
    }
}

/// A prompt ready for the index: its token ids and, per block size, its LocalBlockHashes (what
/// `KvIndex::find_matches` takes). The daemon's renderer produces it; the KV preparation hook and
/// the request path above it read it, so it lives here, below both.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparedPrompt {
    pub tokens: Arc<[u32]>,
    /// Input sequence length in tokens (`tokens.len()`), the `isl` of the cost formula.
    pub isl: usize,
    pub hashes: Vec<(BlockSize, Vec<LocalBlockHash>)>,
}

impl PreparedPrompt {
    /// The hashes for `size`, if it was one of the sizes asked for.
    pub fn hashes_for(&self, size: BlockSize) -> Option<&[LocalBlockHash]> {
        self.hashes
            .iter()
            .find(|(s, _)| *s == size)
            .map(|(_, h)| h.as_slice())
    }
}
