//! The cached prompts of [`super::PromptTokenizer`]: their text, ids, checkpoints and block
//! hashes, the longest reusable prefix of a new prompt among them, least-recently-used eviction.

use std::sync::Arc;

use super::{BlockHashes, CacheLimits, ENTRY_OVERHEAD, HEAD_BYTES, Tokenized};

#[derive(Debug)]
pub(super) struct Entry {
    text: String,
    ids: Arc<[u32]>,
    cuts: Vec<(u32, u32)>,
    hashes: BlockHashes,
    last_used: u64,
    /// Unique per insertion: names the entry a follow-up reused.
    serial: u64,
}

impl Entry {
    fn bytes(&self) -> usize {
        entry_bytes(
            self.text.len(),
            self.ids.len(),
            self.cuts.len(),
            self.hashes.count(),
        )
    }
}

/// Text, 4 bytes per id, 8 per checkpoint, 8 per block hash, plus [`ENTRY_OVERHEAD`].
fn entry_bytes(text: usize, ids: usize, cuts: usize, hashes: usize) -> usize {
    text.saturating_add(ids.saturating_mul(4))
        .saturating_add(cuts.saturating_mul(8))
        .saturating_add(hashes.saturating_mul(8))
        .saturating_add(ENTRY_OVERHEAD)
}

#[derive(Debug, Default)]
pub(super) struct PrefixCache {
    pub(super) entries: Vec<Entry>,
    pub(super) bytes: usize,
    pub(super) evictions: u64,
    clock: u64,
}

/// The reusable start of a cached prompt: its tokens before the checkpoint at `cut`, and the
/// hashes of the complete blocks among them (when hashed with the seed asked for).
pub(super) struct Reuse {
    pub(super) cut: usize,
    pub(super) ids: Vec<u32>,
    pub(super) cuts: Vec<(u32, u32)>,
    pub(super) hashes: BlockHashes,
    /// The entry reused, when the new prompt continues it (shares at least half of it): the
    /// new prompt's entry replaces it, so a conversation holds one entry, not one per turn.
    pub(super) continued: Option<u64>,
}

impl PrefixCache {
    /// The longest reusable prefix of `text` among the cached prompts.
    pub(super) fn lookup(&mut self, text: &str, added: &[String], seed: u64) -> Option<Reuse> {
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
        let count = count as usize;
        let mut hashes = BlockHashes {
            seed,
            per_size: Vec::new(),
        };
        if entry.hashes.seed == seed {
            // Only blocks wholly inside the reused tokens: a partial block is hashed again.
            hashes.per_size = entry
                .hashes
                .per_size
                .iter()
                .map(|(size, h)| {
                    let whole = (count / size.get() as usize).min(h.len());
                    (*size, h[..whole].to_vec())
                })
                .collect();
        }
        let mut ids = Vec::with_capacity(text.len() / 3);
        ids.extend_from_slice(&entry.ids[..count]);
        Some(Reuse {
            cut: p as usize,
            ids,
            cuts: entry.cuts[..=k].to_vec(),
            hashes,
            continued: (common.saturating_mul(2) >= entry.text.len()).then_some(entry.serial),
        })
    }

    /// Caches `text`, replacing the entry it `continued` (if still held) and any entry of the
    /// same text, then evicting least recently used entries down to the limits.
    pub(super) fn insert(
        &mut self,
        text: &str,
        tokenized: &Tokenized,
        cuts: Vec<(u32, u32)>,
        continued: Option<u64>,
        limits: CacheLimits,
    ) {
        let bytes = entry_bytes(
            text.len(),
            tokenized.ids.len(),
            cuts.len(),
            tokenized.hashes.count(),
        );
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
            let Some(oldest) = least_recent(&self.entries, |e| e.last_used) else {
                break;
            };
            let old = self.entries.swap_remove(oldest);
            self.bytes -= old.bytes();
            self.evictions += 1;
        }
        self.clock += 1;
        let mut cuts = cuts;
        cuts.shrink_to_fit();
        self.entries.push(Entry {
            text: text.to_owned(),
            ids: Arc::clone(&tokenized.ids),
            cuts,
            hashes: tokenized.hashes.clone(),
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

/// The position of the least recently used of `entries` (`None`: empty), for the bounded caches'
/// eviction.
pub(crate) fn least_recent<E>(entries: &[E], last_used: impl Fn(&E) -> u64) -> Option<usize> {
    entries
        .iter()
        .enumerate()
        .min_by_key(|(_, e)| last_used(e))
        .map(|(i, _)| i)
}
