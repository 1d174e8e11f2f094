//! Tokenizer artifacts, the pure rules (seed "The tokenizer dependency and its cache"): the model
//! card's `CheckedFile` slots, the [`ArtifactKey`] a model needs, URI classification, operator
//! pinning, fleet agreement, size bounds and the loader's bookkeeping ([`LoadBook`]: LRU, load
//! concurrency, total bytes, retry after failure).
//!
//! Model cards and chat templates are fleet-authored code: nothing is fetched, cached, loaded or
//! rendered unless every checksum of its key is listed in `kv.pinned_artifacts`. Content is
//! addressed by blake3 checksum alone, so workers that name the same bytes under different paths
//! (their own local directory, their own metadata URL) agree; any of their paths is a source.
//!
//! Nothing here does IO or reads a clock: the shell (`continuum_actors::kv_artifacts`) fetches,
//! verifies and loads, and passes `now` in.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

use crate::time::Tick;

/// One artifact larger than this is refused: by its card size before any fetch, and by its
/// actual bytes while streaming.
pub const MAX_ARTIFACT_BYTES: u64 = 64 * 1024 * 1024;
/// Loaded tokenizers kept at once (least recently used evicted first).
pub const MAX_LOADED_TOKENIZERS: usize = 16;
/// Loads running at once on the blocking pool.
pub const MAX_CONCURRENT_LOADS: usize = 2;
/// Verified artifact bytes held by loaded entries, all keys together.
pub const MAX_TOTAL_ARTIFACT_BYTES: u64 = 256 * 1024 * 1024;
/// A failed key is not tried again before this.
pub const LOAD_RETRY_AFTER: Duration = Duration::from_secs(5 * 60);
/// A card path longer than this makes its slot absent.
pub const MAX_ARTIFACT_PATH_BYTES: usize = 4096;
/// Distinct source paths kept per checksum (from different workers).
pub const MAX_SOURCES_PER_ARTIFACT: usize = 8;
/// Where `hf://` resolves when `HF_ENDPOINT` is unset.
pub const DEFAULT_HF_ENDPOINT: &str = "https://huggingface.co";

/// A `blake3:<64 lowercase hex>` content checksum.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Checksum([u8; 32]);

impl Checksum {
    /// Parses the card / config spelling: `blake3:` then exactly 64 lowercase hex digits.
    pub fn parse(text: &str) -> Option<Self> {
        let hex = text.strip_prefix("blake3:")?;
        if hex.len() != 64 {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, pair) in hex.as_bytes().chunks_exact(2).enumerate() {
            out[i] = (nibble(pair[0])? << 4) | nibble(pair[1])?;
        }
        Some(Self(out))
    }

    /// The blake3 checksum of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self(*blake3::hash(bytes).as_bytes())
    }

    pub fn from_bytes(digest: [u8; 32]) -> Self {
        Self(digest)
    }

    /// The 64 lowercase hex digits (the blob file name of the content-addressed cache).
    pub fn hex(&self) -> String {
        let mut s = String::with_capacity(64);
        for b in self.0 {
            s.push(char::from(HEX[usize::from(b >> 4)]));
            s.push(char::from(HEX[usize::from(b & 0xf)]));
        }
        s
    }

    /// Whether `bytes` hash to this checksum.
    pub fn matches(&self, bytes: &[u8]) -> bool {
        Self::of(bytes) == *self
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn nibble(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

impl fmt::Display for Checksum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "blake3:{}", self.hex())
    }
}

impl fmt::Debug for Checksum {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// A card's `CheckedFile { path, checksum, size }`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CheckedFile {
    /// A local absolute path, `file://`, `http(s)://` or `hf://<repo>/<file>`; bounded by
    /// [`MAX_ARTIFACT_PATH_BYTES`].
    pub path: String,
    pub checksum: Checksum,
    /// Absent on legacy cards.
    pub size: Option<u64>,
}

impl CheckedFile {
    /// A slot from its members as read from the card; `None` (slot absent) when any is unusable.
    pub fn from_parts(path: &str, checksum: &str, size: Option<u64>) -> Option<Self> {
        if path.is_empty() || path.len() > MAX_ARTIFACT_PATH_BYTES {
            return None;
        }
        Some(Self {
            path: path.to_owned(),
            checksum: Checksum::parse(checksum)?,
            size,
        })
    }
}

/// The card's `tokenizer` slot.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum TokenizerSlot {
    /// `{"hf_tokenizer_json": CheckedFile}`: loadable.
    HfTokenizerJson(CheckedFile),
    /// `{"tik_token_model": CheckedFile}`: not loadable by the router (counted `unsupported`).
    TikTokenModel(CheckedFile),
}

impl TokenizerSlot {
    pub fn file(&self) -> &CheckedFile {
        match self {
            TokenizerSlot::HfTokenizerJson(f) | TokenizerSlot::TikTokenModel(f) => f,
        }
    }
}

/// What a `PromptFormatterArtifact` holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FormatterKind {
    /// `hf_tokenizer_config_json`: `tokenizer_config.json` (special tokens, maybe `chat_template`).
    TokenizerConfigJson,
    /// `hf_chat_template` (alias `hf_chat_template_jinja`): a Jinja file.
    ChatTemplateJinja,
    /// `hf_chat_template_json`: a JSON file with a `chat_template` member.
    ChatTemplateJson,
}

/// A card's `prompt_formatter` or `chat_template_file` slot.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FormatterSlot {
    pub kind: FormatterKind,
    pub file: CheckedFile,
    /// `is_custom` of the chat-template variants (false for `hf_tokenizer_config_json`).
    pub is_custom: bool,
}

/// The artifact slots of one worker's card. Every slot that is missing or unusable is `None`;
/// an unusable slot never fails the record.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct CardArtifacts {
    pub tokenizer: Option<TokenizerSlot>,
    pub prompt_formatter: Option<FormatterSlot>,
    pub chat_template_file: Option<FormatterSlot>,
}

/// The set of checksums a model needs: what workers must agree on, and what the loader keys its
/// cache by. Paths are not part of it: the same bytes may live under many paths.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ArtifactKey {
    /// `tokenizer.json`.
    pub tokenizer: Checksum,
    pub prompt_formatter: Option<(FormatterKind, Checksum)>,
    pub chat_template_file: Option<(FormatterKind, Checksum)>,
}

impl ArtifactKey {
    /// The key of one card, or why it has none.
    pub fn of(card: &CardArtifacts) -> Result<Self, Unavailable> {
        let tokenizer = match &card.tokenizer {
            None => return Err(Unavailable::MissingTokenizer),
            Some(TokenizerSlot::TikTokenModel(_)) => return Err(Unavailable::UnsupportedTokenizer),
            Some(TokenizerSlot::HfTokenizerJson(f)) => f.checksum,
        };
        let slot = |s: &Option<FormatterSlot>| s.as_ref().map(|s| (s.kind, s.file.checksum));
        Ok(Self {
            tokenizer,
            prompt_formatter: slot(&card.prompt_formatter),
            chat_template_file: slot(&card.chat_template_file),
        })
    }

    /// Every checksum of the key: tokenizer first, then prompt formatter, then chat template.
    pub fn checksums(&self) -> impl Iterator<Item = Checksum> + '_ {
        std::iter::once(self.tokenizer)
            .chain(self.prompt_formatter.map(|(_, c)| c))
            .chain(self.chat_template_file.map(|(_, c)| c))
    }

    /// Checksums of the key not in `pinned`, in key order, without repeats.
    pub fn unpinned(&self, pinned: &BTreeSet<Checksum>) -> Vec<Checksum> {
        let mut out: Vec<Checksum> = Vec::new();
        for c in self.checksums() {
            if !pinned.contains(&c) && !out.contains(&c) {
                out.push(c);
            }
        }
        out
    }
}

impl fmt::Display for ArtifactKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tokenizer={}", self.tokenizer)?;
        if let Some((_, c)) = self.prompt_formatter {
            write!(f, " prompt_formatter={c}")?;
        }
        if let Some((_, c)) = self.chat_template_file {
            write!(f, " chat_template_file={c}")?;
        }
        Ok(())
    }
}

/// Why a model has no usable artifacts. Each maps to a closed result label.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unavailable {
    #[error("no live worker serves the model")]
    NoWorkers,
    #[error("a worker's card names no tokenizer")]
    MissingTokenizer,
    #[error("a worker's card names a tiktoken model, which the router cannot load")]
    UnsupportedTokenizer,
    #[error("the model's {keys} workers name different artifacts")]
    Disagreement { keys: usize },
    #[error("artifacts not in kv.pinned_artifacts: {0:?}")]
    Unpinned(Vec<Checksum>),
}

impl Unavailable {
    /// The `continuum_dynamo_kv_selection_total{result}` a request scored without artifacts
    /// counts: `artifact_unpinned` for [`Unavailable::Unpinned`], else `tokenizer_unavailable`.
    pub fn selection_label(&self) -> &'static str {
        match self {
            Unavailable::Unpinned(_) => "artifact_unpinned",
            _ => "tokenizer_unavailable",
        }
    }
}

/// Where one checksum can be read from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ArtifactSources {
    /// The distinct card paths of the model's workers, sorted, at most
    /// [`MAX_SOURCES_PER_ARTIFACT`].
    pub paths: Vec<String>,
    /// The largest size any card declares (checked before fetching).
    pub declared_size: Option<u64>,
}

/// Where each checksum of an agreed key can be read from.
pub type Sources = BTreeMap<Checksum, ArtifactSources>;

/// Fleet agreement: the key every live worker of one model names, and the paths to fetch it
/// from. One worker without a usable tokenizer, or two distinct keys (a rolling tokenizer
/// upgrade), and the model has none.
pub fn agree<'a>(
    workers: impl IntoIterator<Item = &'a CardArtifacts>,
) -> Result<(ArtifactKey, Sources), Unavailable> {
    let mut keys: BTreeSet<ArtifactKey> = BTreeSet::new();
    let mut first_error: Option<Unavailable> = None;
    let mut sources: Sources = BTreeMap::new();
    let mut any = false;
    for card in workers {
        any = true;
        match ArtifactKey::of(card) {
            Ok(key) => {
                keys.insert(key);
                let files = card
                    .tokenizer
                    .as_ref()
                    .map(TokenizerSlot::file)
                    .into_iter()
                    .chain(card.prompt_formatter.as_ref().map(|s| &s.file))
                    .chain(card.chat_template_file.as_ref().map(|s| &s.file));
                for file in files {
                    let entry = sources.entry(file.checksum).or_default();
                    if entry.paths.len() < MAX_SOURCES_PER_ARTIFACT
                        && !entry.paths.contains(&file.path)
                    {
                        entry.paths.push(file.path.clone());
                    }
                    entry.declared_size = entry.declared_size.max(file.size);
                }
            }
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    if !any {
        return Err(Unavailable::NoWorkers);
    }
    if let Some(e) = first_error {
        return Err(e);
    }
    let mut it = keys.iter();
    match (it.next(), it.next()) {
        (Some(key), None) => {
            for entry in sources.values_mut() {
                entry.paths.sort();
            }
            Ok((*key, sources))
        }
        _ => Err(Unavailable::Disagreement { keys: keys.len() }),
    }
}

/// What an artifact path names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ArtifactUri {
    /// An absolute local path (`/…` or `file:///…`).
    Local(String),
    /// An `http://` or `https://` URL (a worker's own metadata endpoint).
    Http(String),
    /// `hf://<repo>/<file>`: the Hugging Face Hub.
    Hf { repo: String, file: String },
}

/// Why a path cannot be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum UriError {
    #[error("{scheme} artifacts are not allowed (kv.allow_{scheme}_artifacts: false)")]
    Disallowed { scheme: &'static str },
    #[error("artifact path is not an absolute path, file://, http(s):// or hf://<repo>/<file>")]
    Unsupported,
}

impl ArtifactUri {
    /// Classifies a card path. Relative paths and other schemes are unsupported.
    pub fn classify(path: &str) -> Result<Self, UriError> {
        if let Some(rest) = path.strip_prefix("file://") {
            // `file:///abs` or `file://localhost/abs`.
            let rest = rest.strip_prefix("localhost").unwrap_or(rest);
            return local(rest);
        }
        if path.starts_with('/') {
            return local(path);
        }
        let lower = path
            .get(..8)
            .map(str::to_ascii_lowercase)
            .unwrap_or_default();
        if lower.starts_with("http://") || lower.starts_with("https://") {
            let authority = path.split_once("://").map(|(_, r)| r).unwrap_or_default();
            if authority.is_empty() || authority.starts_with('/') {
                return Err(UriError::Unsupported);
            }
            return Ok(ArtifactUri::Http(path.to_owned()));
        }
        if let Some(rest) = path.strip_prefix("hf://") {
            let segments: Vec<&str> = rest.split('/').collect();
            if segments.iter().any(|s| !hf_segment(s)) {
                return Err(UriError::Unsupported);
            }
            // Hub repo ids are `org/name` (or a bare legacy `name`): the file is what follows.
            let (repo, file) = match segments.len() {
                0 | 1 => return Err(UriError::Unsupported),
                2 => (segments[0].to_owned(), segments[1].to_owned()),
                _ => (segments[..2].join("/"), segments[2..].join("/")),
            };
            return Ok(ArtifactUri::Hf { repo, file });
        }
        Err(UriError::Unsupported)
    }
}

fn local(path: &str) -> Result<ArtifactUri, UriError> {
    let ok = path.starts_with('/')
        && !path.contains('\0')
        && !path.split('/').any(|s| s == "..")
        && !path.ends_with('/');
    if ok {
        Ok(ArtifactUri::Local(path.to_owned()))
    } else {
        Err(UriError::Unsupported)
    }
}

fn hf_segment(s: &str) -> bool {
    !s.is_empty()
        && s != "."
        && s != ".."
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// What the operator allows (`dynamo.kv` and the environment).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArtifactPolicy {
    /// `kv.allow_http_artifacts` (default true).
    pub allow_http: bool,
    /// `kv.allow_hf_artifacts` (default false).
    pub allow_hf: bool,
    /// `HF_ENDPOINT`, else [`DEFAULT_HF_ENDPOINT`].
    pub hf_endpoint: String,
    /// `kv.pinned_artifacts`.
    pub pinned: BTreeSet<Checksum>,
}

impl Default for ArtifactPolicy {
    fn default() -> Self {
        Self {
            allow_http: true,
            allow_hf: false,
            hf_endpoint: DEFAULT_HF_ENDPOINT.to_owned(),
            pinned: BTreeSet::new(),
        }
    }
}

/// How to read one artifact.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fetch {
    Local(String),
    /// GET this URL; `hf_auth` means send `HF_TOKEN` as a bearer token (Hub URLs only, so the
    /// token never reaches a worker).
    Http {
        url: String,
        hf_auth: bool,
    },
}

impl ArtifactPolicy {
    /// How to read `path`, or why it may not be read.
    pub fn resolve(&self, path: &str) -> Result<Fetch, UriError> {
        match ArtifactUri::classify(path)? {
            ArtifactUri::Local(p) => Ok(Fetch::Local(p)),
            ArtifactUri::Http(url) if self.allow_http => Ok(Fetch::Http {
                url,
                hf_auth: false,
            }),
            ArtifactUri::Http(_) => Err(UriError::Disallowed { scheme: "http" }),
            ArtifactUri::Hf { repo, file } if self.allow_hf => Ok(Fetch::Http {
                url: format!(
                    "{}/{repo}/resolve/main/{file}",
                    self.hf_endpoint.trim_end_matches('/')
                ),
                hf_auth: true,
            }),
            ArtifactUri::Hf { .. } => Err(UriError::Disallowed { scheme: "hf" }),
        }
    }

    pub fn is_pinned(&self, checksum: &Checksum) -> bool {
        self.pinned.contains(checksum)
    }
}

/// Why bytes were refused on size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    #[error("{0} bytes exceed the {MAX_ARTIFACT_BYTES}-byte artifact bound")]
    TooLarge(u64),
    #[error("{actual} bytes where the card declares {declared}")]
    Mismatch { declared: u64, actual: u64 },
}

/// The card size, checked before anything is fetched.
pub fn check_declared_size(declared: Option<u64>) -> Result<(), SizeError> {
    match declared {
        Some(n) if n > MAX_ARTIFACT_BYTES => Err(SizeError::TooLarge(n)),
        _ => Ok(()),
    }
}

/// The running size while streaming: refuse as soon as it passes the bound.
pub fn check_running_size(received: u64) -> Result<(), SizeError> {
    if received > MAX_ARTIFACT_BYTES {
        Err(SizeError::TooLarge(received))
    } else {
        Ok(())
    }
}

/// The complete bytes against the card's size (when it declares one).
pub fn check_final_size(declared: Option<u64>, actual: u64) -> Result<(), SizeError> {
    check_running_size(actual)?;
    match declared {
        Some(d) if d != actual => Err(SizeError::Mismatch {
            declared: d,
            actual,
        }),
        _ => Ok(()),
    }
}

/// One key's state in the loader.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoadState {
    Loading,
    /// Loaded: holds `bytes` of verified artifacts; `used` is the LRU stamp.
    Loaded {
        bytes: u64,
        used: u64,
    },
    /// Failed; not retried before `retry_at`.
    Failed {
        retry_at: Tick,
    },
}

/// What the shell must do after a [`LoadBook`] decision.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadPlan {
    /// Start loading these (on the blocking pool).
    pub start: Vec<ArtifactKey>,
    /// Drop these loaded entries (unpinned, unwanted past the LRU bound, or over the byte bound).
    pub evict: Vec<ArtifactKey>,
}

/// The loader's bookkeeping: which keys are loading, loaded or waiting to retry, under
/// [`MAX_CONCURRENT_LOADS`], [`MAX_LOADED_TOKENIZERS`] and [`MAX_TOTAL_ARTIFACT_BYTES`].
#[derive(Clone, Debug, Default)]
pub struct LoadBook {
    states: BTreeMap<ArtifactKey, LoadState>,
    stamp: u64,
}

impl LoadBook {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn state(&self, key: &ArtifactKey) -> Option<&LoadState> {
        self.states.get(key)
    }

    pub fn loading(&self) -> usize {
        self.states
            .values()
            .filter(|s| matches!(s, LoadState::Loading))
            .count()
    }

    pub fn loaded(&self) -> impl Iterator<Item = &ArtifactKey> {
        self.states
            .iter()
            .filter(|(_, s)| matches!(s, LoadState::Loaded { .. }))
            .map(|(k, _)| k)
    }

    pub fn loaded_bytes(&self) -> u64 {
        self.states
            .values()
            .map(|s| match s {
                LoadState::Loaded { bytes, .. } => *bytes,
                _ => 0,
            })
            .sum()
    }

    /// Marks `key` as used now (LRU order). Unknown or not-loaded keys are ignored.
    pub fn touch(&mut self, key: &ArtifactKey) {
        self.stamp += 1;
        if let Some(LoadState::Loaded { used, .. }) = self.states.get_mut(key) {
            *used = self.stamp;
        }
    }

    /// Decides, for the keys the fleet currently `wanted` (already agreed and fully pinned),
    /// which loads to start and which entries to drop. Keys with an unpinned checksum are
    /// dropped whatever their state; failed keys start again once their retry time passed.
    pub fn plan(
        &mut self,
        wanted: &BTreeSet<ArtifactKey>,
        policy: &ArtifactPolicy,
        now: Tick,
    ) -> LoadPlan {
        let mut plan = LoadPlan::default();
        // A removed pin drops the loaded tokenizer and forgets failures (a re-pin retries now).
        let unpinned: Vec<ArtifactKey> = self
            .states
            .keys()
            .filter(|k| !k.unpinned(&policy.pinned).is_empty())
            .copied()
            .collect();
        for key in unpinned {
            if let Some(LoadState::Loaded { .. }) = self.states.remove(&key) {
                plan.evict.push(key);
            }
        }
        // Wanted keys first touched now, so the LRU never evicts what the fleet just asked for
        // in favour of what it stopped asking for.
        for key in wanted {
            if key.unpinned(&policy.pinned).is_empty() {
                self.touch(key);
            }
        }
        let mut loading = self.loading();
        for key in wanted {
            if loading >= MAX_CONCURRENT_LOADS {
                break;
            }
            if !key.unpinned(&policy.pinned).is_empty() {
                continue;
            }
            let start = match self.states.get(key) {
                None => true,
                Some(LoadState::Failed { retry_at }) => now >= *retry_at,
                Some(LoadState::Loading | LoadState::Loaded { .. }) => false,
            };
            if start {
                self.states.insert(*key, LoadState::Loading);
                plan.start.push(*key);
                loading += 1;
            }
        }
        plan.evict.extend(self.enforce_bounds());
        plan
    }

    /// Records a finished load: `Ok(bytes)` held, or a failure retried after
    /// [`LOAD_RETRY_AFTER`]. Returns entries evicted to stay within bounds. A result for a key
    /// no longer loading (dropped meanwhile) is ignored and returns the key itself for eviction.
    pub fn finished(
        &mut self,
        key: ArtifactKey,
        result: Result<u64, ()>,
        now: Tick,
    ) -> Vec<ArtifactKey> {
        if self.states.get(&key) != Some(&LoadState::Loading) {
            return if result.is_ok() {
                vec![key]
            } else {
                Vec::new()
            };
        }
        match result {
            Ok(bytes) => {
                self.stamp += 1;
                self.states.insert(
                    key,
                    LoadState::Loaded {
                        bytes,
                        used: self.stamp,
                    },
                );
                self.enforce_bounds()
            }
            Err(()) => {
                self.states.insert(
                    key,
                    LoadState::Failed {
                        retry_at: now.plus(LOAD_RETRY_AFTER),
                    },
                );
                Vec::new()
            }
        }
    }

    /// The earliest retry time of a failed key, for the shell's timer.
    pub fn next_retry(&self) -> Option<Tick> {
        self.states
            .values()
            .filter_map(|s| match s {
                LoadState::Failed { retry_at } => Some(*retry_at),
                _ => None,
            })
            .min()
    }

    /// Evicts least recently used loaded entries past the count and byte bounds.
    fn enforce_bounds(&mut self) -> Vec<ArtifactKey> {
        let mut evicted = Vec::new();
        loop {
            let loaded: Vec<(u64, ArtifactKey)> = self
                .states
                .iter()
                .filter_map(|(k, s)| match s {
                    LoadState::Loaded { used, .. } => Some((*used, *k)),
                    _ => None,
                })
                .collect();
            let over = loaded.len() > MAX_LOADED_TOKENIZERS
                || self.loaded_bytes() > MAX_TOTAL_ARTIFACT_BYTES;
            let Some((_, lru)) = loaded.iter().min() else {
                break;
            };
            if !over {
                break;
            }
            self.states.remove(lru);
            evicted.push(*lru);
        }
        evicted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ck(c: char) -> Checksum {
        Checksum::parse(&format!("blake3:{}", c.to_string().repeat(64))).expect("valid")
    }

    fn file(path: &str, c: char) -> CheckedFile {
        CheckedFile {
            path: path.into(),
            checksum: ck(c),
            size: Some(10),
        }
    }

    fn card(tok: char, fmt: Option<char>, path: &str) -> CardArtifacts {
        CardArtifacts {
            tokenizer: Some(TokenizerSlot::HfTokenizerJson(file(
                &format!("{path}/tokenizer.json"),
                tok,
            ))),
            prompt_formatter: fmt.map(|c| FormatterSlot {
                kind: FormatterKind::TokenizerConfigJson,
                file: file(&format!("{path}/tokenizer_config.json"), c),
                is_custom: false,
            }),
            chat_template_file: None,
        }
    }

    fn pinned(cs: &[char]) -> ArtifactPolicy {
        ArtifactPolicy {
            pinned: cs.iter().map(|c| ck(*c)).collect(),
            ..ArtifactPolicy::default()
        }
    }

    #[test]
    fn checksums_parse_only_blake3_lowercase_64_hex() {
        let text = format!("blake3:{}", "0a".repeat(32));
        let c = Checksum::parse(&text).expect("valid");
        assert_eq!(c.to_string(), text);
        assert_eq!(c.hex(), "0a".repeat(32));
        for bad in [
            format!("blake3:{}", "0A".repeat(32)),
            format!("blake3:{}", "0a".repeat(31)),
            format!("blake3:{}0", "0a".repeat(32)),
            format!("sha256:{}", "0a".repeat(32)),
            format!("blake3:{}zz", "0a".repeat(31)),
            "blake3:".into(),
            String::new(),
        ] {
            assert_eq!(Checksum::parse(&bad), None, "{bad}");
        }
        assert!(Checksum::of(b"abc").matches(b"abc"));
        assert!(!Checksum::of(b"abc").matches(b"abd"));
        // blake3("") from the reference implementation.
        assert_eq!(
            Checksum::of(b"").hex(),
            "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
        );
    }

    #[test]
    fn checked_file_refuses_unusable_members() {
        let good = format!("blake3:{}", "1".repeat(64));
        assert!(CheckedFile::from_parts("/m/tokenizer.json", &good, None).is_some());
        assert!(CheckedFile::from_parts("", &good, None).is_none());
        assert!(CheckedFile::from_parts("/m/t", "blake3:nope", None).is_none());
        let long = format!("/{}", "a".repeat(MAX_ARTIFACT_PATH_BYTES));
        assert!(CheckedFile::from_parts(&long, &good, None).is_none());
    }

    #[test]
    fn uris_classify() {
        let check = |path: &str, want: Result<ArtifactUri, UriError>| {
            assert_eq!(ArtifactUri::classify(path), want, "{path}");
        };
        check(
            "/m/tokenizer.json",
            Ok(ArtifactUri::Local("/m/tokenizer.json".into())),
        );
        check(
            "file:///m/t.json",
            Ok(ArtifactUri::Local("/m/t.json".into())),
        );
        check(
            "file://localhost/m/t.json",
            Ok(ArtifactUri::Local("/m/t.json".into())),
        );
        check(
            "http://10.0.0.5:9090/v1/metadata/ns/c/e/slug/base/tokenizer.json",
            Ok(ArtifactUri::Http(
                "http://10.0.0.5:9090/v1/metadata/ns/c/e/slug/base/tokenizer.json".into(),
            )),
        );
        check(
            "https://h/t.json",
            Ok(ArtifactUri::Http("https://h/t.json".into())),
        );
        check(
            "hf://Qwen/Qwen3-0.6B/tokenizer.json",
            Ok(ArtifactUri::Hf {
                repo: "Qwen/Qwen3-0.6B".into(),
                file: "tokenizer.json".into(),
            }),
        );
        check(
            "hf://gpt2/tokenizer.json",
            Ok(ArtifactUri::Hf {
                repo: "gpt2".into(),
                file: "tokenizer.json".into(),
            }),
        );
        for bad in [
            "tokenizer.json",
            "m/tokenizer.json",
            "/m/../etc/passwd",
            "/m/",
            "file://host/m",
            "s3://b/t.json",
            "http:///x",
            "hf://Qwen",
            "hf://Qwen/../x",
            "hf://Qwen//x",
            "hf://Qwen/Q?x/t.json",
        ] {
            assert_eq!(
                ArtifactUri::classify(bad),
                Err(UriError::Unsupported),
                "{bad}"
            );
        }
    }

    #[test]
    fn policy_gates_http_and_hf_and_builds_hub_urls() {
        let mut policy = ArtifactPolicy::default();
        assert_eq!(
            policy.resolve("http://w:1/t.json"),
            Ok(Fetch::Http {
                url: "http://w:1/t.json".into(),
                hf_auth: false
            })
        );
        assert_eq!(
            policy.resolve("hf://Qwen/Qwen3-0.6B/tokenizer.json"),
            Err(UriError::Disallowed { scheme: "hf" })
        );
        policy.allow_hf = true;
        policy.hf_endpoint = "http://127.0.0.1:9/".into();
        assert_eq!(
            policy.resolve("hf://Qwen/Qwen3-0.6B/tokenizer.json"),
            Ok(Fetch::Http {
                url: "http://127.0.0.1:9/Qwen/Qwen3-0.6B/resolve/main/tokenizer.json".into(),
                hf_auth: true
            })
        );
        policy.allow_http = false;
        assert_eq!(
            policy.resolve("https://w/t.json"),
            Err(UriError::Disallowed { scheme: "http" })
        );
        assert_eq!(
            policy.resolve("/m/t.json"),
            Ok(Fetch::Local("/m/t.json".into()))
        );
    }

    #[test]
    fn fleet_agreement_needs_one_key_from_every_worker() {
        let a = card('a', Some('b'), "/w1");
        let a_elsewhere = card('a', Some('b'), "http://w2:1/meta");
        let (key, sources) = agree([&a, &a_elsewhere]).expect("agreed");
        assert_eq!(key.tokenizer, ck('a'));
        assert_eq!(
            key.prompt_formatter,
            Some((FormatterKind::TokenizerConfigJson, ck('b')))
        );
        assert_eq!(
            sources[&ck('a')].paths,
            vec![
                "/w1/tokenizer.json".to_owned(),
                "http://w2:1/meta/tokenizer.json".to_owned()
            ]
        );
        assert_eq!(sources[&ck('a')].declared_size, Some(10));
        // A rolling tokenizer upgrade: two keys.
        let upgraded = card('c', Some('b'), "/w3");
        assert_eq!(
            agree([&a, &upgraded]),
            Err(Unavailable::Disagreement { keys: 2 })
        );
        // Same tokenizer, different formatter: still a different key.
        let other_fmt = card('a', None, "/w4");
        assert_eq!(
            agree([&a, &other_fmt]),
            Err(Unavailable::Disagreement { keys: 2 })
        );
        let none = CardArtifacts::default();
        assert_eq!(agree([&a, &none]), Err(Unavailable::MissingTokenizer));
        let tiktoken = CardArtifacts {
            tokenizer: Some(TokenizerSlot::TikTokenModel(file("/w/t.model", 'a'))),
            ..CardArtifacts::default()
        };
        assert_eq!(agree([&tiktoken]), Err(Unavailable::UnsupportedTokenizer));
        assert_eq!(agree([]), Err(Unavailable::NoWorkers));
        assert_eq!(
            Unavailable::Unpinned(vec![ck('a')]).selection_label(),
            "artifact_unpinned"
        );
        assert_eq!(
            Unavailable::NoWorkers.selection_label(),
            "tokenizer_unavailable"
        );
    }

    #[test]
    fn unpinned_lists_every_missing_checksum_once() {
        let key = ArtifactKey {
            tokenizer: ck('a'),
            prompt_formatter: Some((FormatterKind::TokenizerConfigJson, ck('b'))),
            chat_template_file: Some((FormatterKind::ChatTemplateJinja, ck('b'))),
        };
        assert_eq!(key.unpinned(&pinned(&[]).pinned), vec![ck('a'), ck('b')]);
        assert_eq!(key.unpinned(&pinned(&['a']).pinned), vec![ck('b')]);
        assert!(key.unpinned(&pinned(&['a', 'b']).pinned).is_empty());
    }

    #[test]
    fn sizes_are_bounded_before_and_while_reading() {
        assert_eq!(check_declared_size(None), Ok(()));
        assert_eq!(check_declared_size(Some(MAX_ARTIFACT_BYTES)), Ok(()));
        assert_eq!(
            check_declared_size(Some(MAX_ARTIFACT_BYTES + 1)),
            Err(SizeError::TooLarge(MAX_ARTIFACT_BYTES + 1))
        );
        assert!(check_running_size(MAX_ARTIFACT_BYTES + 1).is_err());
        assert_eq!(check_final_size(Some(5), 5), Ok(()));
        assert_eq!(check_final_size(None, 5), Ok(()));
        assert_eq!(
            check_final_size(Some(5), 6),
            Err(SizeError::Mismatch {
                declared: 5,
                actual: 6
            })
        );
    }

    fn key(c: char) -> ArtifactKey {
        ArtifactKey {
            tokenizer: ck(c),
            prompt_formatter: None,
            chat_template_file: None,
        }
    }

    fn hex_char(i: usize) -> char {
        char::from(HEX[i % 16])
    }

    #[test]
    fn load_book_bounds_concurrency_and_retries_after_five_minutes() {
        let policy = pinned(&['a', 'b', 'c']);
        let mut book = LoadBook::new();
        let wanted: BTreeSet<_> = [key('a'), key('b'), key('c')].into();
        let plan = book.plan(&wanted, &policy, Tick::ZERO);
        assert_eq!(plan.start, vec![key('a'), key('b')], "two loads at once");
        assert!(book.plan(&wanted, &policy, Tick::ZERO).start.is_empty());
        assert!(book.finished(key('a'), Err(()), Tick::ZERO).is_empty());
        let plan = book.plan(&wanted, &policy, Tick::ZERO);
        assert_eq!(plan.start, vec![key('c')], "the failed key waits");
        book.finished(key('b'), Ok(100), Tick::ZERO);
        book.finished(key('c'), Ok(100), Tick::ZERO);
        let just_before = Tick::ZERO.plus(LOAD_RETRY_AFTER - Duration::from_millis(1));
        assert!(book.plan(&wanted, &policy, just_before).start.is_empty());
        assert_eq!(book.next_retry(), Some(Tick::ZERO.plus(LOAD_RETRY_AFTER)));
        let plan = book.plan(&wanted, &policy, Tick::ZERO.plus(LOAD_RETRY_AFTER));
        assert_eq!(plan.start, vec![key('a')]);
        assert_eq!(book.loaded_bytes(), 200);
    }

    #[test]
    fn removing_a_pin_drops_the_loaded_key() {
        let mut book = LoadBook::new();
        let wanted: BTreeSet<_> = [key('a')].into();
        book.plan(&wanted, &pinned(&['a']), Tick::ZERO);
        book.finished(key('a'), Ok(1), Tick::ZERO);
        assert_eq!(book.loaded().count(), 1);
        let plan = book.plan(&wanted, &pinned(&[]), Tick::ZERO);
        assert_eq!(plan.evict, vec![key('a')]);
        assert!(plan.start.is_empty());
        assert_eq!(book.loaded().count(), 0);
        // A load finishing after its pin was removed is dropped, not kept.
        book.plan(&wanted, &pinned(&['a']), Tick::ZERO);
        book.plan(&wanted, &pinned(&[]), Tick::ZERO);
        assert_eq!(book.finished(key('a'), Ok(1), Tick::ZERO), vec![key('a')]);
        assert_eq!(book.loaded().count(), 0);
    }

    #[test]
    fn lru_evicts_past_sixteen_tokenizers_and_the_byte_bound() {
        let keys: Vec<ArtifactKey> = (0..=MAX_LOADED_TOKENIZERS)
            .map(|i| ArtifactKey {
                tokenizer: Checksum::parse(&format!(
                    "blake3:{}{}",
                    hex_char(i / 16),
                    hex_char(i).to_string().repeat(63)
                ))
                .expect("valid"),
                prompt_formatter: None,
                chat_template_file: None,
            })
            .collect();
        let policy = ArtifactPolicy {
            pinned: keys.iter().map(|k| k.tokenizer).collect(),
            ..ArtifactPolicy::default()
        };
        let mut book = LoadBook::new();
        let mut evicted = Vec::new();
        for k in &keys {
            let plan = book.plan(&[*k].into(), &policy, Tick::ZERO);
            assert_eq!(plan.start, vec![*k]);
            evicted.extend(book.finished(*k, Ok(1), Tick::ZERO));
            if k == &keys[1] {
                // keys[0] used after keys[1]: keys[1] becomes the least recently used.
                book.touch(&keys[0]);
            }
        }
        assert_eq!(evicted, vec![keys[1]]);
        assert_eq!(book.loaded().count(), MAX_LOADED_TOKENIZERS);
        // Bytes: two large entries past 256 MiB evict the older.
        let mut book = LoadBook::new();
        let big = MAX_TOTAL_ARTIFACT_BYTES / 2 + 1;
        book.plan(&[keys[0], keys[1]].into(), &policy, Tick::ZERO);
        assert!(book.finished(keys[0], Ok(big), Tick::ZERO).is_empty());
        assert_eq!(book.finished(keys[1], Ok(big), Tick::ZERO), vec![keys[0]]);
        assert_eq!(book.loaded_bytes(), big);
    }
}
