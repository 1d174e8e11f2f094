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
//! # Bound
//!
//! At most [`CacheLimits::max_entries`] prompts and [`CacheLimits::max_bytes`] bytes (the
//! rendered text, 4 bytes per token, 8 per checkpoint, plus a fixed overhead per entry) are held
//! per tokenizer, least recently used evicted first; a prompt larger than a quarter of the byte
//! budget is never cached. A follow-up that continues a cached prompt (shares at least half of
//! it) replaces its entry, so a conversation holds one entry, not one per turn. A chat prompt
//! costs about 8 bytes per token (≈ 4 of text, 4 of ids, 8 per 128 bytes of checkpoints): a
//! 128k-token conversation ≈ 1.0 MiB, within the 2 MiB per-prompt cap. The defaults
//! ([`DEFAULT_CACHE_LIMITS`]: 64 prompts, 8 MiB) hold 64 conversations of 8k tokens or 7 of 128k;
//! the word cache adds at most 2 MiB; the daemon keeps at most 16 renderers (the daemon's
//! `kv::prep::MAX_RENDERERS`), so at most 160 MiB in all.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use daachorse::{DoubleArrayAhoCorasick, DoubleArrayAhoCorasickBuilder, MatchKind};
use tokenizers::Tokenizer;
use tokenizers::models::ModelWrapper;

mod words;

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

#[derive(Debug)]
struct Entry {
    text: String,
    ids: Vec<u32>,
    cuts: Vec<(u32, u32)>,
    last_used: u64,
    /// Unique per insertion: names the entry a follow-up reused.
    serial: u64,
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
    /// The entry reused, when the new prompt continues it (shares at least half of it): the
    /// new prompt's entry replaces it, so a conversation holds one entry, not one per turn.
    continued: Option<u64>,
}

impl PrefixCache {
    /// The longest reusable prefix of `text` among the cached prompts.
    fn lookup(&mut self, text: &str, added: &[String]) -> Option<Reuse> {
        let head = &text.as_bytes()[..text.len().min(HEAD_BYTES)];
        let mut best: Option<(usize, usize)> = None;
        for (i, entry) in self.entries.iter().enumerate() {
            // An entry no longer than the best common prefix so far cannot beat it.
            if best.is_some_and(|(_, len)| entry.text.len() <= len)
                || (!entry.text.as_bytes().starts_with(head)
                    && !text.starts_with(entry.text.as_str()))
            {
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
            continued: (common.saturating_mul(2) >= entry.text.len()).then_some(entry.serial),
        })
    }

    /// Caches `text`, replacing the entry it `continued` (if still held) and any entry of the
    /// same text, then evicting least recently used entries down to the limits.
    fn insert(
        &mut self,
        text: &str,
        ids: &[u32],
        cuts: Vec<(u32, u32)>,
        continued: Option<u64>,
        limits: CacheLimits,
    ) {
        let bytes = entry_bytes(text.len(), ids.len(), cuts.len());
        if limits.max_entries == 0 || bytes > limits.max_bytes / 4 {
            return;
        }
        let mut i = 0;
        while i < self.entries.len() {
            let entry = &self.entries[i];
            if entry.text == text || Some(entry.serial) == continued {
                let old = self.entries.swap_remove(i);
                self.bytes -= old.bytes();
            } else {
                i += 1;
            }
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
        let mut cuts = cuts;
        cuts.shrink_to_fit();
        self.entries.push(Entry {
            text: text.to_owned(),
            ids: ids.to_vec(),
            cuts,
            last_used: self.clock,
            serial: self.clock,
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
        let (mut ids, mut cuts, from, continued) = match reuse {
            Some(reuse) => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                (reuse.ids, reuse.cuts, reuse.cut + 1, reuse.continued)
            }
            None => {
                self.misses.fetch_add(1, Ordering::Relaxed);
                (Vec::new(), Vec::new(), 0, None)
            }
        };
        segmenter.tokenize(
            self.tokenizer.get_model(),
            &text[from..],
            from,
            &mut ids,
            &mut cuts,
        )?;
        lock(&self.cache).insert(text, &ids, cuts, continued, self.limits);
        Ok(ids)
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
            entries: cache.entries.len(),
            bytes: cache.bytes,
            words,
            word_bytes,
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests;
