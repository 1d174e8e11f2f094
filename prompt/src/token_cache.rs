//! Exact, bounded tokenization cache for multi-turn chats: a follow-up turn tokenizes only what
//! is new since a rendered prompt it shares a prefix with.
//!
//! # Why it is exact
//!
//! A SentencePiece-style BPE tokenizer (TinyLlama, Llama 2, Mistral: normalizer `Prepend("▁")`
//! then `Replace(" ", "▁")`, no pre-tokenizer) runs BPE over each text piece between added tokens
//! as *one* word, which is what makes an 8k-token chat cost milliseconds. A BPE merge joins two
//! adjacent symbols into a vocabulary token whose text is their concatenation. So between a
//! character `x` and a following `▁`, no merge can ever happen unless some vocabulary token
//! contains `x▁`; when none does (and `x` is itself a vocabulary symbol, so it is never
//! byte-fallback or `<unk>`), BPE on the two sides is independent: tokenizing them apart and
//! concatenating gives exactly the whole word's tokens. [`Segmenter`] checks the tokenizer's
//! configuration and vocabulary for this once, then tokenizes every piece as segments cut at
//! such safe points, recording a checkpoint (raw byte offset of the space, tokens before it) at
//! cuts at least [`CHECKPOINT_SPACING`] bytes apart (any subset of safe cuts serves the
//! argument below).
//!
//! The pieces are found as `tokenizers` finds them: the same automaton (daachorse,
//! leftmost-longest) over the same added-token texts, all of which are matched on the raw text
//! since none normalizes (checked), without `tokenizers`' per-byte offset bookkeeping. Each
//! segment goes through a word cache of our own (`words`: segment → ids, bounded, exact because
//! it memoises the deterministic BPE of the normalized segment) and only on a miss to
//! `Model::tokenize`, which allocates a `String` per token. So the cost is linear in the prompt
//! (every step is a scan, a lookup per segment or a copy): no step sees more than one segment,
//! and segments are cut at every safe space (a long run without one, such as text without
//! spaces, is BPE'd as one word, which is superlinear in its length as for `tokenizers`).
//!
//! A later prompt that shares a prefix of `L` bytes with a cached one reuses the cached tokens up
//! to the last checkpoint `p` with `p + 1 <= L` whose suffix neither is empty nor starts with an
//! added token: tokenizing `text[p + 1..]` alone prepends the `▁` that stands for the space at
//! `p`, and since added tokens contain no space, the added-token split of the suffix is the
//! whole text's split after `p`. The result is therefore the full tokenization, which the
//! property tests check against `Tokenizer::encode_fast` over random conversations (short
//! ones, and long ones of tens of kB whose turns chain through the cache) and both tokenizer
//! fixtures. A tokenizer of any other shape (byte-level BPE with a regex pre-tokenizer,
//! WordPiece, Unigram, truncation or padding configured, added tokens that strip or normalize)
//! is tokenized in full every time: [`PromptTokenizer::supported`] says which.
//!
//! # Block hashes
//!
//! [`PromptTokenizer::tokenize_and_hash`] keeps each cached prompt's LocalBlockHashes (per block
//! size, with the seed they were hashed with) beside its ids: a follow-up takes the hashes of the
//! complete blocks inside the tokens it reuses and hashes only the blocks after them (a partial
//! last block is hashed again once it fills). A block's hash is XXH3 of its tokens with the seed,
//! nothing else, so this equals `prompt_block_hashes` of the whole prompt (property tests over
//! random conversations, both fixtures, one and two block sizes, a seed that changes mid-way).
//!
//! # Bound
//!
//! At most [`CacheLimits::max_entries`] prompts and [`CacheLimits::max_bytes`] bytes (the
//! rendered text, 4 bytes per token, 8 per checkpoint, 8 per block hash, plus a fixed overhead
//! per entry) are held per tokenizer, least recently used evicted first; a prompt larger than a
//! quarter of the byte budget is never cached. A follow-up that continues a cached prompt
//! (shares at least half of it) replaces its entry, so a conversation holds one entry, not one
//! per turn. A chat prompt costs about 8.7 bytes per token (≈ 4 of text, 4 of ids, 8 per 128
//! bytes of checkpoints, 0.625 of hashes at block sizes 16 and 64): a 128k-token conversation ≈
//! 1.1 MiB, within the 2 MiB per-prompt cap. The defaults ([`DEFAULT_CACHE_LIMITS`]: 64 prompts,
//! 8 MiB) hold 64 conversations of 8k tokens or 7 of 128k; the word cache adds at most 2 MiB. A
//! renderer whose template is message-local also keeps its conversations' rendered turns under
//! the same limits (`render::conversation`); the daemon keeps at most 16 renderers (the daemon's
//! `kv::prep::MAX_RENDERERS`), so at most 16 × 18 MiB = 288 MiB in all.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use continuum_protocol::kv::LocalBlockHash;
use continuum_protocol::kv::hashing::BlockSize;
use continuum_protocol::kv::prompt::extend_block_hashes;
use daachorse::{DoubleArrayAhoCorasick, DoubleArrayAhoCorasickBuilder, MatchKind};
use tokenizers::Tokenizer;
use tokenizers::models::ModelWrapper;

mod prefix;
mod words;

use prefix::PrefixCache;
pub(crate) use prefix::least_recent;
use words::{Pending, Run, WordCache};

/// The SentencePiece space marker.
const SPACE_MARK: char = '\u{2581}';

/// Bytes counted per entry beyond its text, tokens and checkpoints.
const ENTRY_OVERHEAD: usize = 128;

/// Prompts whose first bytes differ cannot share a useful prefix: compared first.
const HEAD_BYTES: usize = 64;

/// Raw bytes between two recorded checkpoints at least: a follow-up re-tokenizes at most this
/// much (plus the run up to the next safe space) of what it shares with a cached prompt, and a
/// cached prompt holds one checkpoint (8 bytes) per this many bytes of text.
const CHECKPOINT_SPACING: usize = 128;

/// How many prompts and bytes one tokenizer's cache holds at most.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheLimits {
    pub max_entries: usize,
    pub max_bytes: usize,
}

/// 64 prompts, 8 MiB per tokenizer.
pub const DEFAULT_CACHE_LIMITS: CacheLimits = CacheLimits {
    max_entries: 64,
    max_bytes: 8 << 20,
};

impl Default for CacheLimits {
    fn default() -> Self {
        DEFAULT_CACHE_LIMITS
    }
}

/// Counters of one tokenizer's cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Prompts that reused a cached prefix.
    pub hits: u64,
    /// Prompts tokenized from the start (no cached prefix, or an unsupported tokenizer).
    pub misses: u64,
    /// Prompts dropped (least recently used first) to stay within the limits.
    pub evictions: u64,
    pub entries: usize,
    pub bytes: usize,
    /// Segments in the word cache, and their counted bytes (at most 2 MiB).
    pub words: usize,
    pub word_bytes: usize,
}

/// What the segmenting path needs to know about a supported tokenizer.
struct Segmenter {
    /// Characters `x` some vocabulary token contains as `x▁`: a cut before `▁` after them is not
    /// safe.
    joins_before_space: HashSet<char>,
    /// Characters that are vocabulary tokens on their own.
    single_chars: HashSet<char>,
    /// [`Self::safe_before`] of every ASCII character, looked up first.
    safe_ascii: [bool; 128],
    /// Added-token texts (none contains a space or `▁`).
    added: Vec<String>,
    /// The added tokens as `tokenizers` finds them in the raw text: the same automaton
    /// (daachorse, leftmost-longest) over the same patterns, with their ids; `None` when there
    /// are none.
    added_split: Option<DoubleArrayAhoCorasick<u32>>,
    words: WordCache,
}

impl std::fmt::Debug for Segmenter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segmenter")
            .field("added", &self.added)
            .field("words", &self.words)
            .finish_non_exhaustive()
    }
}

impl Segmenter {
    /// The segmenter of `tokenizer`, or why its shape is not one the cut rule is proven for.
    fn for_tokenizer(tokenizer: &Tokenizer) -> Result<Self, &'static str> {
        let expected = serde_json::json!({"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u{2581}"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}]});
        let normalizer = tokenizer
            .get_normalizer()
            .map(serde_json::to_value)
            .transpose()
            .map_err(|_| "normalizer does not serialize")?;
        if normalizer.as_ref() != Some(&expected) {
            return Err("normalizer is not SentencePiece's Prepend + Replace");
        }
        if tokenizer.get_pre_tokenizer().is_some() {
            return Err("a pre-tokenizer is configured");
        }
        if tokenizer.get_truncation().is_some() || tokenizer.get_padding().is_some() {
            return Err("truncation or padding is configured");
        }
        let ModelWrapper::BPE(bpe) = tokenizer.get_model() else {
            return Err("the model is not BPE");
        };
        if bpe.dropout.is_some_and(|d| d > 0.0)
            || bpe.continuing_subword_prefix.is_some()
            || bpe.end_of_word_suffix.is_some()
            || bpe.ignore_merges
        {
            return Err("BPE dropout, subword affixes or ignore_merges");
        }
        let vocabulary = tokenizer.get_added_vocabulary();
        if vocabulary.get_encode_special_tokens() {
            return Err("special tokens are encoded as text");
        }
        let mut added = Vec::new();
        let mut patterns = Vec::new();
        for (&id, token) in vocabulary.get_added_tokens_decoder() {
            if token.normalized
                || token.lstrip
                || token.rstrip
                || token.single_word
                || token.content.is_empty()
                || token.content.contains([' ', SPACE_MARK])
            {
                return Err("an added token strips, normalizes or holds a space");
            }
            added.push(token.content.clone());
            patterns.push((token.content.clone(), id));
        }
        let added_split = if patterns.is_empty() {
            None
        } else {
            Some(
                DoubleArrayAhoCorasickBuilder::new()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build_with_values(patterns)
                    .map_err(|_| "the added tokens do not build a matcher")?,
            )
        };
        let mut joins_before_space = HashSet::new();
        let mut single_chars = HashSet::new();
        for token in bpe.get_vocab().keys() {
            let mut chars = token.chars();
            if let (Some(c), None) = (chars.next(), chars.next()) {
                single_chars.insert(c);
            }
            let mut previous: Option<char> = None;
            for c in token.chars() {
                if c == SPACE_MARK
                    && let Some(p) = previous
                {
                    joins_before_space.insert(p);
                }
                previous = Some(c);
            }
        }
        if !single_chars.contains(&SPACE_MARK) {
            return Err("the vocabulary has no ▁ token");
        }
        let safe_ascii = std::array::from_fn(|b| {
            let c = char::from(b as u8);
            let c = if c == ' ' { SPACE_MARK } else { c };
            single_chars.contains(&c) && !joins_before_space.contains(&c)
        });
        Ok(Self {
            joins_before_space,
            single_chars,
            safe_ascii,
            added,
            added_split,
            words: WordCache::default(),
        })
    }

    /// A cut before a space is safe when the character before it is a vocabulary symbol that
    /// never joins a following `▁`.
    fn safe_before(&self, previous: char) -> bool {
        if let Some(&safe) = self.safe_ascii.get(previous as usize) {
            return safe;
        }
        self.single_chars.contains(&previous) && !self.joins_before_space.contains(&previous)
    }

    /// Tokenizes `text` as the tokenizer would (no special tokens added), appending ids to
    /// `ids` and checkpoints `(offset + raw byte of a cut space, tokens before it)` to `cuts`,
    /// at least [`CHECKPOINT_SPACING`] bytes apart.
    fn tokenize(
        &self,
        model: &ModelWrapper,
        text: &str,
        offset: usize,
        ids: &mut Vec<u32>,
        cuts: &mut Vec<(u32, u32)>,
    ) -> Result<(), String> {
        let mut pending = Pending::default();
        let mut run = Run {
            model,
            ids,
            cuts,
            pending: &mut pending,
            next_cut: 0,
            scratch: String::new(),
        };
        let mut start = 0;
        if let Some(split) = &self.added_split {
            for found in split.leftmost_find_iter(text) {
                if found.start() > start {
                    self.piece(&mut run, &text[start..found.start()], offset + start)?;
                }
                run.ids.push(found.value());
                start = found.end();
            }
        }
        if start < text.len() {
            self.piece(&mut run, &text[start..], offset + start)?;
        }
        self.words.insert(pending);
        Ok(())
    }

    /// One text piece between added tokens (non-empty): normalized (`▁` prepended, spaces as
    /// `▁`), cut before safe spaces, each segment through the word cache.
    fn piece(&self, run: &mut Run<'_>, piece: &str, offset: usize) -> Result<(), String> {
        let words = self.words.read();
        let mut segment = 0;
        for at in memchr::memchr_iter(b' ', piece.as_bytes()) {
            let Some(previous) = piece[..at].chars().next_back() else {
                continue;
            };
            if !self.safe_before(previous) {
                continue;
            }
            run.segment(&words, &piece[segment..at], segment == 0)?;
            segment = at;
            let raw = offset + at;
            if raw >= run.next_cut
                && let (Ok(raw), Ok(count)) = (u32::try_from(raw), u32::try_from(run.ids.len()))
            {
                run.cuts.push((raw, count));
                run.next_cut = raw as usize + CHECKPOINT_SPACING;
            }
        }
        run.segment(&words, &piece[segment..], segment == 0)
    }
}

/// The LocalBlockHashes of a prompt's complete blocks per block size, all with one seed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockHashes {
    pub seed: u64,
    pub per_size: Vec<(BlockSize, Vec<LocalBlockHash>)>,
}

impl BlockHashes {
    fn count(&self) -> usize {
        self.per_size.iter().map(|(_, h)| h.len()).sum()
    }
}

/// A prompt's token ids and block hashes ([`PromptTokenizer::tokenize_and_hash`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tokenized {
    /// Shared with the cache entry (no copy).
    pub ids: Arc<[u32]>,
    pub hashes: BlockHashes,
}

/// A tokenizer with its exact prefix cache (see the module docs).
pub struct PromptTokenizer {
    tokenizer: Arc<Tokenizer>,
    /// Analysed on first use (on the blocking pool), not when a renderer is built.
    segmenter: OnceLock<Option<Segmenter>>,
    cache: Mutex<PrefixCache>,
    limits: CacheLimits,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl std::fmt::Debug for PromptTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptTokenizer")
            .field("limits", &self.limits)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl PromptTokenizer {
    pub fn new(tokenizer: Arc<Tokenizer>, limits: CacheLimits) -> Self {
        Self {
            tokenizer,
            segmenter: OnceLock::new(),
            cache: Mutex::new(PrefixCache::default()),
            limits,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    fn segmenter(&self) -> Option<&Segmenter> {
        self.segmenter
            .get_or_init(|| Segmenter::for_tokenizer(&self.tokenizer).ok())
            .as_ref()
    }

    /// Whether the tokenizer's shape is one the cache handles (else every prompt is tokenized
    /// in full); the reason when it is not.
    pub fn supported(&self) -> Result<(), &'static str> {
        Segmenter::for_tokenizer(&self.tokenizer).map(|_| ())
    }

    /// The token ids of `text`, without special tokens added: exactly
    /// `Tokenizer::encode_fast(text, false)`'s.
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>, String> {
        self.tokenize_and_hash(text, &[], 0).map(|t| t.ids.to_vec())
    }

    /// [`Self::tokenize`] and the LocalBlockHashes of the complete blocks for each size of
    /// `plan` with `seed`: a prompt that continues a cached one hashes only the blocks after
    /// those wholly inside the reused tokens (exactly `prompt_block_hashes` of the ids: a
    /// block's hash depends on its tokens and the seed alone).
    pub fn tokenize_and_hash(
        &self,
        text: &str,
        plan: &[BlockSize],
        seed: u64,
    ) -> Result<Tokenized, String> {
        let Some(segmenter) = self.segmenter() else {
            self.misses.fetch_add(1, Ordering::Relaxed);
            let ids: Arc<[u32]> = self
                .tokenizer
                .encode_fast(text, false)
                .map(|e| e.get_ids().into())
                .map_err(|e| e.to_string())?;
            let hashes = hash_blocks(&ids, plan, seed, BlockHashes::default());
            return Ok(Tokenized { ids, hashes });
        };
        let reuse = lock(&self.cache).lookup(text, &segmenter.added, seed);
        let (mut ids, mut cuts, reused, from, continued) = match reuse {
            Some(reuse) => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                let from = reuse.cut + 1;
                (reuse.ids, reuse.cuts, reuse.hashes, from, reuse.continued)
            }
            None => {
                self.misses.fetch_add(1, Ordering::Relaxed);
                (Vec::new(), Vec::new(), BlockHashes::default(), 0, None)
            }
        };
        segmenter.tokenize(
            self.tokenizer.get_model(),
            &text[from..],
            from,
            &mut ids,
            &mut cuts,
        )?;
        let hashes = hash_blocks(&ids, plan, seed, reused);
        let tokenized = Tokenized {
            ids: ids.into(),
            hashes,
        };
        lock(&self.cache).insert(text, &tokenized, cuts, continued, self.limits);
        Ok(tokenized)
    }

    /// Token ids not from text (a completions prompt of ids), hashed in full and not cached.
    pub fn hash_ids(ids: Arc<[u32]>, plan: &[BlockSize], seed: u64) -> Tokenized {
        let hashes = hash_blocks(&ids, plan, seed, BlockHashes::default());
        Tokenized { ids, hashes }
    }

    pub fn stats(&self) -> CacheStats {
        let (words, word_bytes) = self
            .segmenter
            .get()
            .and_then(Option::as_ref)
            .map_or((0, 0), |s| s.words.size());
        let cache = lock(&self.cache);
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            evictions: cache.evictions,
            entries: cache.entries.len(),
            bytes: cache.bytes,
            words,
            word_bytes,
        }
    }
}

/// The hashes of `ids` for each size of `plan`, continuing `reused` (blocks of a shared prefix,
/// hashed with `seed`) where it has the size.
fn hash_blocks(ids: &[u32], plan: &[BlockSize], seed: u64, reused: BlockHashes) -> BlockHashes {
    let mut reused = if reused.seed == seed {
        reused.per_size
    } else {
        Vec::new()
    };
    let per_size = plan
        .iter()
        .map(|&size| {
            let mut hashes = reused
                .iter_mut()
                .find(|(s, _)| *s == size)
                .map(|(_, h)| std::mem::take(h))
                .unwrap_or_default();
            extend_block_hashes(&mut hashes, ids, size, seed);
            (size, hashes)
        })
        .collect();
    BlockHashes { seed, per_size }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests;
