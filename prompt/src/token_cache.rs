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
//! such safe points (the model's own word cache then serves repeated segments), recording a
//! checkpoint (raw byte offset of the space, tokens before it) at each cut.
//!
//! A later prompt that shares a prefix of `L` bytes with a cached one reuses the cached tokens up
//! to the last checkpoint `p` with `p + 1 <= L` whose suffix neither is empty nor starts with an
//! added token: tokenizing `text[p + 1..]` alone prepends the `▁` that stands for the space at
//! `p`, and since added tokens contain no space, the added-token split of the suffix is the
//! whole text's split after `p`. The result is therefore the full tokenization, which the
//! property tests check against `Tokenizer::encode_fast` over random conversations and both
//! tokenizer fixtures. A tokenizer of any other shape (byte-level BPE with a regex
//! pre-tokenizer, WordPiece, Unigram, truncation or padding configured, added tokens that strip
//! or normalize) is tokenized in full every time: [`PromptTokenizer::supported`] says which.
//!
//! # Bound
//!
//! At most [`CacheLimits::max_entries`] prompts and [`CacheLimits::max_bytes`] bytes (the
//! rendered text, 4 bytes per token, 8 per checkpoint, plus a fixed overhead per entry) are held
//! per tokenizer, least recently used evicted first; a prompt larger than a quarter of the byte
//! budget is never cached. The defaults ([`DEFAULT_CACHE_LIMITS`]: 64 prompts, 8 MiB) hold 64
//! conversations of 8k tokens; the daemon keeps at most 16 renderers
//! (the daemon's `kv::prep::MAX_RENDERERS`), so at most 128 MiB in all.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use tokenizers::models::ModelWrapper;
use tokenizers::{Model, OffsetReferential, OffsetType, Tokenizer};

/// The SentencePiece space marker.
const SPACE_MARK: char = '\u{2581}';

/// Bytes counted per entry beyond its text, tokens and checkpoints.
const ENTRY_OVERHEAD: usize = 128;

/// Prompts whose first bytes differ cannot share a useful prefix: compared first.
const HEAD_BYTES: usize = 64;

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
    pub entries: usize,
    pub bytes: usize,
}

/// What the segmenting path needs to know about a supported tokenizer.
#[derive(Debug)]
struct Segmenter {
    /// Characters `x` some vocabulary token contains as `x▁`: a cut before `▁` after them is not
    /// safe.
    joins_before_space: HashSet<char>,
    /// Characters that are vocabulary tokens on their own.
    single_chars: HashSet<char>,
    /// Added-token texts (none contains a space or `▁`).
    added: Vec<String>,
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
        for token in vocabulary.get_added_tokens_decoder().values() {
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
        }
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
        Ok(Self {
            joins_before_space,
            single_chars,
            added,
        })
    }

    /// A cut before the space at raw byte `at` of `piece` (after the piece's first character) is
    /// safe when the character before it is a vocabulary symbol that never joins a following `▁`.
    fn safe_before(&self, previous: char) -> bool {
        let previous = if previous == ' ' {
            SPACE_MARK
        } else {
            previous
        };
        self.single_chars.contains(&previous) && !self.joins_before_space.contains(&previous)
    }

    /// Tokenizes `text` as the tokenizer would (no special tokens added), appending ids to
    /// `ids` and checkpoints `(offset + raw byte of a cut space, tokens before it)` to `cuts`.
    fn tokenize(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        offset: usize,
        ids: &mut Vec<u32>,
        cuts: &mut Vec<(u32, u32)>,
    ) -> Result<(), String> {
        let pieces = tokenizer
            .get_added_vocabulary()
            .extract_and_normalize(None::<&tokenizers::NormalizerWrapper>, text);
        let model = tokenizer.get_model();
        let mut segment = String::new();
        for (piece, (start, _), tokens) in
            pieces.get_splits(OffsetReferential::Original, OffsetType::Byte)
        {
            if let Some(tokens) = tokens {
                ids.extend(tokens.iter().map(|t| t.id));
                continue;
            }
            if piece.is_empty() {
                continue;
            }
            // The piece normalized ("▁" + spaces as "▁"), cut before safe spaces.
            segment.clear();
            segment.push(SPACE_MARK);
            let mut previous: Option<char> = None;
            for (at, c) in piece.char_indices() {
                if c == ' '
                    && let Some(p) = previous
                    && self.safe_before(p)
                {
                    push_tokens(model, &segment, ids)?;
                    segment.clear();
                    let raw = offset + start + at;
                    if let (Ok(raw), Ok(count)) = (u32::try_from(raw), u32::try_from(ids.len())) {
                        cuts.push((raw, count));
                    }
                }
                segment.push(if c == ' ' { SPACE_MARK } else { c });
                previous = Some(c);
            }
            push_tokens(model, &segment, ids)?;
        }
        Ok(())
    }
}

fn push_tokens(model: &ModelWrapper, segment: &str, ids: &mut Vec<u32>) -> Result<(), String> {
    let tokens = model.tokenize(segment).map_err(|e| e.to_string())?;
    ids.extend(tokens.iter().map(|t| t.id));
    Ok(())
}

#[derive(Debug)]
struct Entry {
    text: String,
    ids: Vec<u32>,
    cuts: Vec<(u32, u32)>,
    last_used: u64,
}

impl Entry {
    fn bytes(&self) -> usize {
        entry_bytes(self.text.len(), self.ids.len(), self.cuts.len())
    }
}

fn entry_bytes(text: usize, ids: usize, cuts: usize) -> usize {
    text.saturating_add(ids.saturating_mul(4))
        .saturating_add(cuts.saturating_mul(8))
        .saturating_add(ENTRY_OVERHEAD)
}

#[derive(Debug, Default)]
struct PrefixCache {
    entries: Vec<Entry>,
    bytes: usize,
    clock: u64,
}

/// The reusable start of a cached prompt: its tokens before the checkpoint at `cut`.
struct Reuse {
    cut: usize,
    ids: Vec<u32>,
    cuts: Vec<(u32, u32)>,
}

impl PrefixCache {
    /// The longest reusable prefix of `text` among the cached prompts.
    fn lookup(&mut self, text: &str, added: &[String]) -> Option<Reuse> {
        let head = &text.as_bytes()[..text.len().min(HEAD_BYTES)];
        let mut best: Option<(usize, usize)> = None;
        for (i, entry) in self.entries.iter().enumerate() {
            if !entry.text.as_bytes().starts_with(head) && !text.starts_with(entry.text.as_str()) {
                continue;
            }
            let common = common_prefix(entry.text.as_bytes(), text.as_bytes());
            if best.is_none_or(|(_, len)| common > len) {
                best = Some((i, common));
            }
        }
        let (i, common) = best?;
        let entry = &mut self.entries[i];
        // The last checkpoint inside the common prefix whose suffix is non-empty and starts
        // with no added token.
        let usable = |p: usize| {
            p < common
                && p + 1 < text.len()
                && text.is_char_boundary(p + 1)
                && !added.iter().any(|a| text[p + 1..].starts_with(a.as_str()))
        };
        let end = entry.cuts.partition_point(|&(p, _)| (p as usize) < common);
        let k = (0..end).rev().find(|&k| usable(entry.cuts[k].0 as usize))?;
        let (p, count) = entry.cuts[k];
        self.clock += 1;
        entry.last_used = self.clock;
        Some(Reuse {
            cut: p as usize,
            ids: entry.ids[..count as usize].to_vec(),
            cuts: entry.cuts[..=k].to_vec(),
        })
    }

    fn insert(&mut self, text: &str, ids: &[u32], cuts: Vec<(u32, u32)>, limits: CacheLimits) {
        let bytes = entry_bytes(text.len(), ids.len(), cuts.len());
        if limits.max_entries == 0 || bytes > limits.max_bytes / 4 {
            return;
        }
        if let Some(pos) = self.entries.iter().position(|e| e.text == text) {
            let old = self.entries.swap_remove(pos);
            self.bytes -= old.bytes();
        }
        while self.entries.len() >= limits.max_entries || self.bytes + bytes > limits.max_bytes {
            let Some(oldest) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(i, _)| i)
            else {
                break;
            };
            let old = self.entries.swap_remove(oldest);
            self.bytes -= old.bytes();
        }
        self.clock += 1;
        self.entries.push(Entry {
            text: text.to_owned(),
            ids: ids.to_vec(),
            cuts,
            last_used: self.clock,
        });
        self.bytes += bytes;
    }
}

/// The length of the common prefix of `a` and `b`, compared a block at a time.
fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    const BLOCK: usize = 256;
    let len = a.len().min(b.len());
    let mut at = 0;
    while at + BLOCK <= len && a[at..at + BLOCK] == b[at..at + BLOCK] {
        at += BLOCK;
    }
    at + a[at..len]
        .iter()
        .zip(&b[at..len])
        .take_while(|(x, y)| x == y)
        .count()
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
        let Some(segmenter) = self.segmenter() else {
            self.misses.fetch_add(1, Ordering::Relaxed);
            return self
                .tokenizer
                .encode_fast(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| e.to_string());
        };
        let reuse = lock(&self.cache).lookup(text, &segmenter.added);
        let (mut ids, mut cuts, from) = match reuse {
            Some(reuse) => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                (reuse.ids, reuse.cuts, reuse.cut + 1)
            }
            None => {
                self.misses.fetch_add(1, Ordering::Relaxed);
                (Vec::new(), Vec::new(), 0)
            }
        };
        segmenter.tokenize(&self.tokenizer, &text[from..], from, &mut ids, &mut cuts)?;
        lock(&self.cache).insert(text, &ids, cuts, self.limits);
        Ok(ids)
    }

    pub fn stats(&self) -> CacheStats {
        let cache = lock(&self.cache);
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            entries: cache.entries.len(),
            bytes: cache.bytes,
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests;
