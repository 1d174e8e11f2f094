//! Tokenizer artifacts, the IO shell: resolves each model's tokenizer and prompt formatter from
//! its workers' model cards, fetches and verifies the bytes, keeps them in the content-addressed
//! cache and loads `tokenizers::Tokenizer`s on the blocking pool.
//!
//! Every decision is `protocol::kv::artifacts`': fleet agreement ([`agree`]), pinning, URI policy,
//! size bounds and the loader's LRU / concurrency / retry bookkeeping ([`LoadBook`]). This handle
//! owns the cache directory, the HTTP client, the loaded tokenizers and the
//! `continuum_dynamo_kv_artifacts_total{result}` counts.
//!
//! Owned by the KV supervisor (the daemon while `dynamo.kv.enabled`): [`ArtifactRegistry::follow`]
//! re-plans on every registry generation, [`ArtifactRegistry::reconfigure`] on every config
//! reload (a removed pin drops its loaded tokenizer at once). Readers call
//! [`ArtifactRegistry::artifacts_for`] per request; it never blocks on IO.
//!
//! | module | what it holds |
//! |---|---|
//! | [`cache`] | `<cache_dir>/blobs/<checksum>`: owner-only, verified on every read, evicted if modified |
//! | [`fetch`] | bounded local reads and HTTP(S) GETs (rustls ring) |

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Weak};

use crate::lock::{Mutex, MutexGuard};

use continuum_protocol::discovery::records::Role;
use continuum_protocol::discovery::snapshot::DynamoSnapshot;
use continuum_protocol::ids::Namespace;
use continuum_protocol::kv::artifacts::{
    ArtifactKey, ArtifactPolicy, ArtifactSources, Checksum, DEFAULT_HF_ENDPOINT, Fetch,
    FormatterKind, LOAD_RETRY_AFTER, LoadBook, LoadState, SizeError, Sources, Unavailable,
    UriError, agree, check_declared_size, check_final_size,
};
use continuum_protocol::time::Tick;
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::metrics::Metrics;
use crate::registry::RegistryReader;

pub mod cache;
pub mod fetch;
pub mod metrics;

pub use self::metrics::{KvArtifactMetrics, KvArtifactResult};

#[cfg(test)]
mod tests;

use cache::{BlobCache, CacheRead};
use fetch::FetchError;

/// Models remembered for the once-per-model unpinned / unsupported logs before the memory is
/// reset (fleet-bounded in practice; a bound all the same).
const MAX_LOGGED: usize = 4096;

/// What the operator configured (`dynamo.kv`) plus the Hub environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArtifactConfig {
    pub policy: ArtifactPolicy,
    /// `kv.artifact_cache_dir`; blobs live under `<cache_dir>/blobs/`.
    pub cache_dir: PathBuf,
    /// `HF_TOKEN`, sent as a bearer token to the Hub only.
    pub hf_token: Option<String>,
}

impl ArtifactConfig {
    /// From `dynamo.kv` members; `HF_ENDPOINT` and `HF_TOKEN` come from the environment. Pins
    /// that do not parse are skipped (config validation refuses them before this point).
    pub fn from_kv(
        allow_http_artifacts: bool,
        allow_hf_artifacts: bool,
        pinned_artifacts: &[String],
        artifact_cache_dir: PathBuf,
    ) -> Self {
        let env = |name| std::env::var(name).ok().filter(|v: &String| !v.is_empty());
        Self {
            policy: ArtifactPolicy {
                allow_http: allow_http_artifacts,
                allow_hf: allow_hf_artifacts,
                hf_endpoint: env("HF_ENDPOINT").unwrap_or_else(|| DEFAULT_HF_ENDPOINT.to_owned()),
                pinned: pinned_artifacts
                    .iter()
                    .filter_map(|p| Checksum::parse(p))
                    .collect(),
            },
            cache_dir: artifact_cache_dir,
            hf_token: env("HF_TOKEN"),
        }
    }
}

/// The verified bytes of a prompt formatter or chat template, by kind. Rendering is the
/// renderer's: these are only bytes whose checksum is pinned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PromptFormatterSource {
    /// `tokenizer_config.json` (special tokens, usually a `chat_template`).
    TokenizerConfigJson(Arc<[u8]>),
    /// A Jinja chat template file.
    ChatTemplateJinja(Arc<[u8]>),
    /// A JSON file with a `chat_template` member.
    ChatTemplateJson(Arc<[u8]>),
}

impl PromptFormatterSource {
    fn new(kind: FormatterKind, bytes: Arc<[u8]>) -> Self {
        match kind {
            FormatterKind::TokenizerConfigJson => Self::TokenizerConfigJson(bytes),
            FormatterKind::ChatTemplateJinja => Self::ChatTemplateJinja(bytes),
            FormatterKind::ChatTemplateJson => Self::ChatTemplateJson(bytes),
        }
    }

    pub fn kind(&self) -> FormatterKind {
        match self {
            Self::TokenizerConfigJson(_) => FormatterKind::TokenizerConfigJson,
            Self::ChatTemplateJinja(_) => FormatterKind::ChatTemplateJinja,
            Self::ChatTemplateJson(_) => FormatterKind::ChatTemplateJson,
        }
    }

    pub fn bytes(&self) -> &Arc<[u8]> {
        match self {
            Self::TokenizerConfigJson(b)
            | Self::ChatTemplateJinja(b)
            | Self::ChatTemplateJson(b) => b,
        }
    }
}

/// Everything a model's prompts are rendered and tokenized with, all pinned and verified.
#[derive(Debug)]
pub struct ModelArtifacts {
    pub key: ArtifactKey,
    pub tokenizer: Arc<tokenizers::Tokenizer>,
    /// The card's `prompt_formatter` slot.
    pub prompt_formatter: Option<PromptFormatterSource>,
    /// The card's `chat_template_file` slot (overrides the formatter's template upstream).
    pub chat_template_file: Option<PromptFormatterSource>,
    /// Verified artifact bytes behind this entry (counted against the 256 MiB bound).
    pub bytes: u64,
}

/// Why a model has no artifacts right now.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ArtifactUnavailable {
    /// The fleet does not agree, names none, or names unpinned ones.
    #[error(transparent)]
    Fleet(#[from] Unavailable),
    /// Agreed and pinned, not loaded yet.
    #[error("the model's artifacts are loading")]
    Loading,
    /// Agreed and pinned, but the last load failed (retried after five minutes).
    #[error("loading the model's artifacts failed; retried after {LOAD_RETRY_AFTER:?}")]
    Failed,
}

impl ArtifactUnavailable {
    /// The `continuum_dynamo_kv_selection_total{result}` label of a request scored without
    /// artifacts: `artifact_unpinned` or `tokenizer_unavailable`.
    pub fn selection_label(&self) -> &'static str {
        match self {
            ArtifactUnavailable::Fleet(u) => u.selection_label(),
            _ => "tokenizer_unavailable",
        }
    }
}

type Decision = Result<ArtifactKey, Unavailable>;

struct State {
    config: ArtifactConfig,
    cache: Option<BlobCache>,
    book: LoadBook,
    loaded: HashMap<ArtifactKey, Arc<ModelArtifacts>>,
    by_ns_model: BTreeMap<(Namespace, String), Decision>,
    by_model: BTreeMap<String, Decision>,
    sources: BTreeMap<ArtifactKey, Sources>,
    logged: BTreeSet<(String, Option<Checksum>)>,
    snapshot: Option<Arc<DynamoSnapshot>>,
}

struct Inner {
    state: Mutex<State>,
    metrics: Option<Arc<KvArtifactMetrics>>,
    client: Option<reqwest::Client>,
    origin: tokio::time::Instant,
    generation: watch::Sender<u64>,
}

/// The per-process artifact registry. Cheap to clone.
#[derive(Clone)]
pub struct ArtifactRegistry {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ArtifactRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArtifactRegistry")
            .field("generation", &*self.inner.generation.borrow())
            .finish_non_exhaustive()
    }
}

impl ArtifactRegistry {
    /// A registry with no fleet yet. Opens (creates) the cache directory; a cache that cannot
    /// be opened is logged and artifacts are then fetched on every load.
    pub fn new(config: ArtifactConfig, metrics: Option<Metrics>) -> Self {
        let client = match fetch::client() {
            Ok(c) => Some(c),
            Err(error) => {
                warn!(%error, "Built no HTTP client for tokenizer artifacts; only local paths load.");
                None
            }
        };
        let (generation, _) = watch::channel(0);
        let cache = open_cache(&config);
        Self {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    config,
                    cache,
                    book: LoadBook::new(),
                    loaded: HashMap::new(),
                    by_ns_model: BTreeMap::new(),
                    by_model: BTreeMap::new(),
                    sources: BTreeMap::new(),
                    logged: BTreeSet::new(),
                    snapshot: None,
                }),
                metrics: metrics.as_ref().and_then(Metrics::family),
                client,
                origin: tokio::time::Instant::now(),
                generation,
            }),
        }
    }

    /// The artifacts of `model` as served in `namespace`: every live worker of it there must name
    /// the same pinned [`ArtifactKey`], and its load must have finished. Never blocks on IO.
    pub fn artifacts_for(
        &self,
        namespace: &Namespace,
        model: &str,
    ) -> Result<Arc<ModelArtifacts>, ArtifactUnavailable> {
        let mut state = self.inner.lock();
        let decision = state
            .by_ns_model
            .get(&(namespace.clone(), model.to_owned()))
            .cloned();
        lookup(&mut state, decision)
    }

    /// Like [`Self::artifacts_for`], over every configured namespace serving `model` (they must
    /// all agree).
    pub fn artifacts_for_model(
        &self,
        model: &str,
    ) -> Result<Arc<ModelArtifacts>, ArtifactUnavailable> {
        let mut state = self.inner.lock();
        let decision = state.by_model.get(model).cloned();
        lookup(&mut state, decision)
    }

    /// Re-plans for a new fleet snapshot: agreement per model, pin checks, loads to start and
    /// entries to drop. Call from within the tokio runtime (loads are spawned).
    pub fn observe(&self, snapshot: Arc<DynamoSnapshot>) {
        let mut state = self.inner.lock();
        state.snapshot = Some(snapshot);
        self.replan(&mut state);
    }

    /// Applies a reloaded `dynamo.kv` (pins, allowances, cache directory). A removed pin drops
    /// the loaded tokenizer before this returns.
    pub fn reconfigure(&self, config: ArtifactConfig) {
        let mut state = self.inner.lock();
        if state.config == config {
            return;
        }
        if state.config.cache_dir != config.cache_dir {
            state.cache = open_cache(&config);
        }
        if state.config.policy.pinned != config.policy.pinned {
            // Pins changed: the unpinned warnings are due again for what is still unpinned.
            state.logged.clear();
        }
        state.config = config;
        self.replan(&mut state);
        drop(state);
        self.bump();
    }

    /// Re-plans on every registry generation until the registry is dropped.
    pub fn follow(&self, registry: RegistryReader) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(async move {
            let mut generations = registry.subscribe();
            loop {
                this.observe(registry.snapshot());
                if generations.changed().await.is_err() {
                    break;
                }
            }
        })
    }

    /// A generation bumped whenever a load finishes or the configuration changes (for waiting
    /// in tests and for readers that cache derived state).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.inner.generation.subscribe()
    }

    /// Keys with a loaded tokenizer, sorted.
    pub fn loaded_keys(&self) -> Vec<ArtifactKey> {
        let state = self.inner.lock();
        let mut keys: Vec<ArtifactKey> = state.loaded.keys().copied().collect();
        keys.sort();
        keys
    }

    fn now(&self) -> Tick {
        Tick(tokio::time::Instant::now().saturating_duration_since(self.inner.origin))
    }

    fn bump(&self) {
        self.inner.generation.send_modify(|g| *g += 1);
    }

    fn count(&self, result: KvArtifactResult) {
        if let Some(metrics) = &self.inner.metrics {
            metrics.kv_artifact(result);
        }
    }

    fn replan(&self, state: &mut State) {
        let Some(snapshot) = state.snapshot.clone() else {
            return;
        };
        let mut by_ns_model = BTreeMap::new();
        let mut by_model: BTreeMap<String, Vec<&continuum_protocol::discovery::view::Worker>> =
            BTreeMap::new();
        let mut sources: BTreeMap<ArtifactKey, Sources> = BTreeMap::new();
        for (namespace, model) in snapshot.models() {
            let workers: Vec<_> = snapshot
                .workers_for_model(namespace, model)
                .filter(|w| w.role != Role::Unknown)
                .map(Arc::as_ref)
                .collect();
            by_model
                .entry(model.to_owned())
                .or_default()
                .extend(workers.iter().copied());
            let decision = self.decide(state, model, &workers, &mut sources);
            by_ns_model.insert((namespace.clone(), model.to_owned()), decision);
        }
        let by_model: BTreeMap<String, Decision> = by_model
            .into_iter()
            .map(|(model, workers)| {
                let decision = self.decide(state, &model, &workers, &mut sources);
                (model, decision)
            })
            .collect();
        let wanted: BTreeSet<ArtifactKey> = by_ns_model
            .values()
            .chain(by_model.values())
            .filter_map(|d| d.as_ref().ok().copied())
            .collect();
        state.by_ns_model = by_ns_model;
        state.by_model = by_model;
        // Keep the sources of keys still loading or failed (a retry needs them) as well as the
        // wanted ones.
        let book = &state.book;
        state
            .sources
            .retain(|k, _| book.state(k).is_some() && !sources.contains_key(k));
        state.sources.extend(sources);
        let now = self.now();
        let plan = state.book.plan(&wanted, &state.config.policy, now);
        for key in &plan.evict {
            if state.loaded.remove(key).is_some() {
                info!(key = %key, "Dropped loaded tokenizer artifacts.");
            }
        }
        for key in plan.start {
            let job = LoadJob {
                key,
                sources: state.sources.get(&key).cloned().unwrap_or_default(),
                policy: state.config.policy.clone(),
                hf_token: state.config.hf_token.clone(),
                cache: state.cache.clone(),
            };
            let this = self.clone();
            tokio::spawn(async move {
                let result = this.load(job).await;
                this.finished(key, result);
            });
        }
    }

    /// Agreement and pinning for one set of workers, logging an unpinned or unsupported model
    /// once.
    fn decide(
        &self,
        state: &mut State,
        model: &str,
        workers: &[&continuum_protocol::discovery::view::Worker],
        sources: &mut BTreeMap<ArtifactKey, Sources>,
    ) -> Decision {
        if state.logged.len() > MAX_LOGGED {
            state.logged.clear();
        }
        let (key, found) = match agree(workers.iter().map(|w| w.artifacts.as_ref())) {
            Ok(agreed) => agreed,
            Err(Unavailable::UnsupportedTokenizer) => {
                if state.logged.insert((model.to_owned(), None)) {
                    warn!(
                        model,
                        "A worker card names a tiktoken tokenizer, which the router cannot load; the model is scored without a KV term."
                    );
                    self.count(KvArtifactResult::Unsupported);
                }
                return Err(Unavailable::UnsupportedTokenizer);
            }
            Err(other) => return Err(other),
        };
        let unpinned = key.unpinned(&state.config.policy.pinned);
        if !unpinned.is_empty() {
            for checksum in &unpinned {
                if state.logged.insert((model.to_owned(), Some(*checksum))) {
                    warn!(model, checksum = %checksum, "Not loading an unpinned tokenizer artifact; review it (b3sum) and add its checksum to dynamo.kv.pinned_artifacts.");
                    self.count(KvArtifactResult::Unpinned);
                }
            }
            return Err(Unavailable::Unpinned(unpinned));
        }
        let entry = sources.entry(key).or_default();
        for (checksum, found) in found {
            let slot: &mut ArtifactSources = entry.entry(checksum).or_default();
            for path in found.paths {
                if !slot.paths.contains(&path) {
                    slot.paths.push(path);
                }
            }
            slot.declared_size = slot.declared_size.max(found.declared_size);
        }
        Ok(key)
    }

    fn finished(&self, key: ArtifactKey, result: Result<ModelArtifacts, KvArtifactResult>) {
        let mut state = self.inner.lock();
        let now = self.now();
        match result {
            Ok(artifacts) => {
                self.count(KvArtifactResult::Loaded);
                let evicted = state.book.finished(key, Ok(artifacts.bytes), now);
                if !evicted.contains(&key) {
                    info!(key = %key, bytes = artifacts.bytes, "Loaded tokenizer artifacts.");
                    state.loaded.insert(key, Arc::new(artifacts));
                }
                for key in evicted {
                    state.loaded.remove(&key);
                }
            }
            Err(result) => {
                self.count(result);
                warn!(key = %key, result = result.as_label(), "Failed to load tokenizer artifacts; retrying in 5 minutes.");
                state.book.finished(key, Err(()), now);
                let weak = Arc::downgrade(&self.inner);
                tokio::spawn(retry_later(weak));
            }
        }
        // A finished load frees a slot for a queued one.
        self.replan(&mut state);
        drop(state);
        self.bump();
    }

    async fn load(&self, job: LoadJob) -> Result<ModelArtifacts, KvArtifactResult> {
        let key = job.key;
        let tokenizer_bytes = self.acquire(&job, key.tokenizer).await?;
        let mut bytes = tokenizer_bytes.len() as u64;
        let prompt_formatter = match key.prompt_formatter {
            None => None,
            Some((kind, checksum)) => Some((kind, self.acquire(&job, checksum).await?)),
        };
        let chat_template_file = match key.chat_template_file {
            None => None,
            Some((kind, checksum)) => Some((kind, self.acquire(&job, checksum).await?)),
        };
        for (_, b) in prompt_formatter.iter().chain(chat_template_file.iter()) {
            bytes += b.len() as u64;
        }
        let tokenizer = tokio::task::spawn_blocking(move || {
            tokenizers::Tokenizer::from_bytes(&tokenizer_bytes).map_err(|e| e.to_string())
        })
        .await
        .map_err(|_| KvArtifactResult::LoadFailed)?
        .map_err(|error| {
            warn!(%error, key = %key, "tokenizer.json did not load.");
            KvArtifactResult::LoadFailed
        })?;
        let source = |s: Option<(FormatterKind, Vec<u8>)>| {
            s.map(|(kind, b)| PromptFormatterSource::new(kind, Arc::from(b)))
        };
        Ok(ModelArtifacts {
            key,
            tokenizer: Arc::new(tokenizer),
            prompt_formatter: source(prompt_formatter),
            chat_template_file: source(chat_template_file),
            bytes,
        })
    }

    /// One artifact's verified bytes: from the cache, else from the first source that yields
    /// them. Failures are counted by the caller through the returned result.
    async fn acquire(
        &self,
        job: &LoadJob,
        checksum: Checksum,
    ) -> Result<Vec<u8>, KvArtifactResult> {
        if let Some(cache) = job.cache.clone() {
            let read = tokio::task::spawn_blocking(move || cache.read(&checksum)).await;
            match read {
                Ok(Ok(CacheRead::Hit(bytes))) => {
                    self.count(KvArtifactResult::CacheHit);
                    return Ok(bytes);
                }
                Ok(Ok(CacheRead::Miss)) => {}
                Ok(Ok(CacheRead::Evicted)) => {
                    warn!(checksum = %checksum, "Evicted a cached artifact that no longer matches its checksum; fetching it again.");
                    self.count(KvArtifactResult::ChecksumMismatch);
                }
                Ok(Err(error)) => warn!(%error, "Reading the artifact cache failed."),
                Err(error) => warn!(%error, "The artifact cache read did not finish."),
            }
        }
        let found = job.sources.get(&checksum).cloned().unwrap_or_default();
        if check_declared_size(found.declared_size).is_err() {
            warn!(checksum = %checksum, size = found.declared_size, "Refused an artifact whose card size exceeds 64 MiB.");
            return Err(KvArtifactResult::Oversized);
        }
        let mut outcome = KvArtifactResult::Unsupported;
        for path in &found.paths {
            let fetched = match job.policy.resolve(path) {
                Err(UriError::Disallowed { scheme }) => {
                    debug!(checksum = %checksum, scheme, "Skipped an artifact source the policy disallows.");
                    outcome = KvArtifactResult::Disallowed;
                    continue;
                }
                Err(UriError::Unsupported) => continue,
                Ok(Fetch::Local(p)) => tokio::task::spawn_blocking(move || fetch::read_local(&p))
                    .await
                    .unwrap_or_else(|e| {
                        Err(FetchError::Http {
                            url: String::new(),
                            reason: e.to_string(),
                        })
                    }),
                Ok(Fetch::Http { url, hf_auth }) => match &self.inner.client {
                    Some(client) => {
                        let bearer = if hf_auth {
                            job.hf_token.as_deref()
                        } else {
                            None
                        };
                        fetch::fetch_http(client, &url, bearer).await
                    }
                    None => continue,
                },
            };
            let bytes = match fetched {
                Ok(bytes) => bytes,
                Err(FetchError::Size(_)) => {
                    outcome = KvArtifactResult::Oversized;
                    continue;
                }
                Err(error) => {
                    debug!(%error, checksum = %checksum, "An artifact source failed.");
                    outcome = KvArtifactResult::FetchFailed;
                    continue;
                }
            };
            let verified = match check_final_size(found.declared_size, bytes.len() as u64) {
                Err(SizeError::TooLarge(_)) => Err(KvArtifactResult::Oversized),
                Err(SizeError::Mismatch { .. }) => Err(KvArtifactResult::ChecksumMismatch),
                Ok(()) if !checksum.matches(&bytes) => Err(KvArtifactResult::ChecksumMismatch),
                Ok(()) => Ok(()),
            };
            if let Err(result) = verified {
                warn!(checksum = %checksum, result = result.as_label(), "An artifact source served bytes that do not match the card.");
                outcome = result;
                continue;
            }
            if let Some(cache) = job.cache.clone() {
                let stored = bytes.clone();
                let write =
                    tokio::task::spawn_blocking(move || cache.write(&checksum, &stored)).await;
                if let Ok(Err(error)) = write {
                    warn!(%error, "Caching a verified artifact failed.");
                }
            }
            return Ok(bytes);
        }
        Err(outcome)
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }
}

struct LoadJob {
    key: ArtifactKey,
    sources: Sources,
    policy: ArtifactPolicy,
    hf_token: Option<String>,
    cache: Option<BlobCache>,
}

fn open_cache(config: &ArtifactConfig) -> Option<BlobCache> {
    match BlobCache::open(&config.cache_dir) {
        Ok(cache) => Some(cache),
        Err(error) => {
            warn!(%error, "Opened no artifact cache; artifacts are fetched on every load.");
            None
        }
    }
}

fn lookup(
    state: &mut State,
    decision: Option<Decision>,
) -> Result<Arc<ModelArtifacts>, ArtifactUnavailable> {
    let key = match decision {
        None => return Err(Unavailable::NoWorkers.into()),
        Some(Err(unavailable)) => return Err(unavailable.into()),
        Some(Ok(key)) => key,
    };
    if let Some(found) = state.loaded.get(&key).cloned() {
        state.book.touch(&key);
        return Ok(found);
    }
    match state.book.state(&key) {
        Some(LoadState::Failed { .. }) => Err(ArtifactUnavailable::Failed),
        _ => Err(ArtifactUnavailable::Loading),
    }
}

/// Re-plans once the retry delay has passed, unless the registry is gone.
async fn retry_later(inner: Weak<Inner>) {
    tokio::time::sleep(LOAD_RETRY_AFTER).await;
    if let Some(inner) = inner.upgrade() {
        let this = ArtifactRegistry { inner };
        let mut state = this.inner.lock();
        this.replan(&mut state);
    }
}
