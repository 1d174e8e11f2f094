//! The segmenting path's own word cache: a normalized segment's token ids, so a segment seen
//! before costs one hash lookup and a copy instead of a call into the BPE model (which
//! allocates a `String` per token it returns); [`Run`] is one tokenization's segments through it.
//!
//! Exact because it memoises a pure function: a key is a segment's raw text with its leading
//! space (the first segment of a piece gets one, standing for the normalizer's `Prepend("▁")`),
//! its value is `BPE::tokenize` of that text with every space replaced by `▁`, and the BPE
//! model is deterministic (no dropout: the segmenter refuses tokenizers with dropout).
//!
//! Bounded: segments over [`MAX_WORD_BYTES`] are never cached, and two generations of at most
//! [`GENERATION_BYTES`] each (key bytes + 4 bytes per id + [`WORD_OVERHEAD`] per entry) are
//! held: when the current generation is full it becomes the previous one and the older is
//! dropped; a hit in the previous generation is copied into the current one, so words in use
//! survive. At most 2 × 1 MiB per tokenizer.

use std::collections::HashMap;
use std::sync::RwLock;

use tokenizers::Model;
use tokenizers::models::ModelWrapper;

/// Segments longer than this (bytes) are tokenized by the model every time.
pub(super) const MAX_WORD_BYTES: usize = 64;
/// Bytes one generation holds at most; two generations are held.
pub(super) const GENERATION_BYTES: usize = 1 << 20;
/// Bytes counted per entry beyond its key and ids (the map slot, two boxes' headers).
pub(super) const WORD_OVERHEAD: usize = 64;
/// Misses (and previous-generation hits) one tokenization remembers for insertion at its end.
const MAX_PENDING: usize = 8192;

type Map = HashMap<Box<str>, Box<[u32]>, ahash::RandomState>;

#[derive(Debug, Default)]
struct Generations {
    current: Map,
    current_bytes: usize,
    previous: Map,
    previous_bytes: usize,
}

fn word_bytes(key: &str, ids: &[u32]) -> usize {
    key.len() + ids.len() * 4 + WORD_OVERHEAD
}

impl Generations {
    fn insert(&mut self, key: Box<str>, ids: Box<[u32]>) {
        if self.current.contains_key(&key) {
            return;
        }
        let bytes = word_bytes(&key, &ids);
        if self.current_bytes + bytes > GENERATION_BYTES {
            self.previous = std::mem::take(&mut self.current);
            self.previous_bytes = std::mem::take(&mut self.current_bytes);
        }
        self.current_bytes += bytes;
        self.current.insert(key, ids);
    }
}

/// The shared cache: readers look words up while tokenizing; what they missed is inserted
/// under the write lock once, at the end of their tokenization.
#[derive(Debug, Default)]
pub(super) struct WordCache {
    inner: RwLock<Generations>,
}

/// What one tokenization looked up and missed, to insert when it is done.
#[derive(Debug, Default)]
pub(super) struct Pending(Vec<(Box<str>, Box<[u32]>)>);

impl Pending {
    pub(super) fn push(&mut self, key: &str, ids: &[u32]) {
        if self.0.len() < MAX_PENDING {
            self.0.push((key.into(), ids.into()));
        }
    }
}

/// A read view of the cache for the length of one piece.
pub(super) struct Words<'a>(std::sync::RwLockReadGuard<'a, Generations>);

impl Words<'_> {
    /// The ids of `key`, and whether they came from the previous generation (to be copied
    /// into the current one).
    pub(super) fn get(&self, key: &str) -> Option<(&[u32], bool)> {
        if let Some(ids) = self.0.current.get(key) {
            return Some((ids, false));
        }
        self.0.previous.get(key).map(|ids| (&ids[..], true))
    }
}

impl WordCache {
    pub(super) fn read(&self) -> Words<'_> {
        Words(self.inner.read().unwrap_or_else(|p| p.into_inner()))
    }

    pub(super) fn insert(&self, pending: Pending) {
        if pending.0.is_empty() {
            return;
        }
        let mut inner = self.inner.write().unwrap_or_else(|p| p.into_inner());
        for (key, ids) in pending.0 {
            inner.insert(key, ids);
        }
    }

    /// Entries and counted bytes held (both generations).
    pub(super) fn size(&self) -> (usize, usize) {
        let inner = self.inner.read().unwrap_or_else(|p| p.into_inner());
        (
            inner.current.len() + inner.previous.len(),
            inner.current_bytes + inner.previous_bytes,
        )
    }
}

/// The state of one tokenization.
pub(super) struct Run<'a> {
    pub(super) model: &'a ModelWrapper,
    pub(super) ids: &'a mut Vec<u32>,
    pub(super) cuts: &'a mut Vec<(u32, u32)>,
    pub(super) pending: &'a mut Pending,
    /// The raw offset from which the next checkpoint may be recorded.
    pub(super) next_cut: usize,
    pub(super) scratch: String,
}

impl Run<'_> {
    /// One segment's tokens: `raw` starts with the space it was cut before, or is the piece's
    /// first segment (`first`), which the normalizer's `Prepend` gives a `▁`. Either way its
    /// key is raw text with a leading space, whose normalization is every space as `▁`.
    pub(super) fn segment(
        &mut self,
        words: &Words<'_>,
        raw: &str,
        first: bool,
    ) -> Result<(), String> {
        let key = if first {
            self.scratch.clear();
            self.scratch.push(' ');
            self.scratch.push_str(raw);
            self.scratch.as_str()
        } else {
            raw
        };
        let cacheable = key.len() <= MAX_WORD_BYTES;
        if cacheable && let Some((ids, previous)) = words.get(key) {
            self.ids.extend_from_slice(ids);
            if previous {
                self.pending.push(key, ids);
            }
            return Ok(());
        }
        let normalized = key.replace(' ', "\u{2581}");
        let tokens = self
            .model
            .tokenize(&normalized)
            .map_err(|e| e.to_string())?;
        let from = self.ids.len();
        self.ids.extend(tokens.iter().map(|t| t.id));
        if cacheable {
            self.pending.push(key, &self.ids[from..]);
        }
        Ok(())
    }
}
