//! Direct-mode shim routing (`route`'s Dynamo step): for one request, gather the facts, make the
//! one call into `continuum_protocol::picker::decision::decide`, and turn its answer into a
//! dispatch plan ([`ShimDecision`]): the namespace's shim pool and the (prefill, decode) pins as
//! decimal `x-dynamo-*` headers (`dynamo.frontend --router-mode direct` executes the two-phase
//! handoff).
//!
//! The inputs: candidates from `picker::candidates` (rebuilt once per registry generation by the
//! `PickerActor`, or by the first request that races ahead of it), which watched namespaces have a
//! usable, permitted shim replica, load from the shared store, and the pluggable
//! `DynamoWorkerPicker` (`picker()` / `set_picker()`). What this module does with the answer:
//! selection metrics, the KV hash-parity prediction, the pins and the outbound body.
//!
//! The decision itself is one synchronous critical section: the load-store lock, then the
//! picker-state lock of the shared [`SharedPicker`] handle (the order every holder of both
//! takes); these are the only locks a load-based pick takes. It does not go through the
//! `PickerActor`'s mailbox: a ractor round trip costs more than the decision (see
//! docs/runtime-semantics.md, "Picker state").
//!
//! What a config asks of the pickers is derived once per config, not per request
//! ([`picker_config`]: the KV parameters, this replica's tie-break, the namespaces that may
//! receive `nvext.token_data`) and published with the installed picker as one snapshot
//! ([`continuum_actors::picker::Installed`]) by [`ShimRouter::reconfigure`], which the control
//! loop calls at start and on every applied reload: under `dynamo.kv.enabled` that installs the
//! `KvAwarePicker` (and the load-based one back when KV is turned off). A request loads the
//! snapshot without a lock, prepares the prompt through the [`KvPromptPrep`] hook, reads the
//! candidates' overlaps from the shared KV index, and may attach the rendered tokens as
//! `nvext.token_data`.

use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::{ArcSwap, ArcSwapOption};
use bytes::Bytes;
use continuum_actors::clock::now_tick;
use continuum_actors::kv_index::SharedKvIndex;
use continuum_actors::load::SharedLoadStore;
use continuum_actors::metrics::Metrics;

use super::metrics::{KvSelectionResult as KvSelectionLabel, SelectionMetrics};
use crate::proxy::metrics::RoutingPath;
use continuum_actors::picker::{PickerConfig, PickerWriter, SharedPicker, answer_arrivals};
use continuum_actors::registry::RegistryReader;
use continuum_protocol::admission::{self, Fleet};
use continuum_protocol::ids::Namespace;
use continuum_protocol::picker::decision::{
    Decision, DecisionInput, ParityTarget, PathClass, Routed, decide,
};
use continuum_protocol::picker::estimate::estimate_prompt_tokens;
use continuum_protocol::picker::ledger::DispatchId;
use continuum_protocol::picker::{
    BlockOverlaps, ConditionalDisaggregation, DynamoWorkerPicker, KvPickInput, KvPickParams,
    KvSelectionResult, KvUnavailable, Phase, TieBreak,
};
use tracing::{debug, warn};

use crate::config::Config;
use crate::config::admission::Bounds;
use crate::config::schema::KvConfig;
pub use crate::kv::{KvPrepRequest, KvPromptPrep, PreparedPrompt};
use crate::proxy::{Dispatch, ParsedBody};

/// The dispatch plan: where and how to send one request through a shim.
#[derive(Debug)]
pub struct ShimDecision {
    /// The namespace's shim replicas (backend names), already filtered by key policy and health.
    pub pool: Vec<String>,
    pub dispatch: Dispatch,
    pub path: RoutingPath,
    /// The ledger entry of this pick, to end when the response does (`SharedPicker::in_flight`
    /// gives the guard that ends it when dropped).
    pub dispatch_id: Option<DispatchId>,
    /// The outbound shim body when it differs from the client's (rendered tokens attached as
    /// `nvext.token_data`). Fallback copies to other backends always use the client's body.
    pub body: Option<Bytes>,
    /// What KV-aware selection made of the request (`None` when KV is off).
    pub kv: Option<KvSelectionResult>,
}

/// The Dynamo routing state shared by every request.
pub struct ShimRouter {
    config: Arc<ArcSwap<Config>>,
    registry: RegistryReader,
    load: SharedLoadStore,
    /// Installed picker (with its per-config inputs), candidate index, ledger and cursors,
    /// shared with the `PickerActor`.
    picker: SharedPicker,
    /// The one writer of the installed picker (`None`: another holder claimed it first, and
    /// this router only reads).
    writer: Option<PickerWriter>,
    metrics: Option<Arc<SelectionMetrics>>,
    /// The shared KV index overlaps are read from (`None`: no overlaps).
    kv_index: Option<SharedKvIndex>,
    /// The prompt preparation hook (`None`: `tokenizer_unavailable`), installed once.
    kv_prep: ArcSwapOption<PrepHook>,
    /// Softmax units: a randomly keyed hash of a counter (the picker draws no randomness).
    draws: (std::collections::hash_map::RandomState, AtomicU64),
}

/// The prompt preparation hook (`ArcSwapOption` needs a sized payload).
struct PrepHook(Arc<dyn KvPromptPrep>);

impl std::fmt::Debug for ShimRouter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShimRouter").finish_non_exhaustive()
    }
}

impl ShimRouter {
    pub fn new(
        config: Arc<ArcSwap<Config>>,
        registry: RegistryReader,
        load: SharedLoadStore,
        metrics: Option<Metrics>,
    ) -> Self {
        Self::with_picker(config, registry, load, SharedPicker::new(), metrics)
    }

    /// A router over the picker state a `PickerActor` maintains (the daemon's wiring). It claims
    /// the picker's writer and publishes what the config held now asks of the pickers.
    pub fn with_picker(
        config: Arc<ArcSwap<Config>>,
        registry: RegistryReader,
        load: SharedLoadStore,
        picker: SharedPicker,
        metrics: Option<Metrics>,
    ) -> Self {
        let writer = picker.writer();
        if writer.is_none() {
            warn!("The picker's writer is held elsewhere; this router only reads the picker.");
        }
        let router = Self {
            config,
            registry,
            load,
            picker,
            writer,
            metrics: metrics.as_ref().and_then(Metrics::family),
            kv_index: None,
            kv_prep: ArcSwapOption::empty(),
            draws: (Default::default(), AtomicU64::new(0)),
        };
        router.reconfigure(&router.config.load());
        router
    }

    /// Reads overlaps from `index` when `dynamo.kv.enabled`.
    pub fn with_kv_index(mut self, index: SharedKvIndex) -> Self {
        self.kv_index = Some(index);
        self
    }

    /// Installs the prompt preparation hook (the tokenizer and renderer plug in here).
    pub fn set_kv_prep(&self, prep: Arc<dyn KvPromptPrep>) {
        self.kv_prep.store(Some(Arc::new(PrepHook(prep))));
    }

    /// Publishes what `config` asks of the pickers ([`picker_config`]) with the picker it
    /// installs: the KV-aware picker built from `dynamo.kv` when it is enabled and changed, the
    /// load-based picker back when it was turned off (a picker set by `set_picker` stays until
    /// `dynamo.kv` changes). The control loop calls it at start and on every applied reload;
    /// requests only read what it published.
    pub fn reconfigure(&self, config: &Config) {
        if let Some(writer) = &self.writer {
            writer.publish(picker_config(config));
        }
    }

    /// A unit in `[0, 1)` for softmax sampling.
    fn draw_unit(&self) -> f64 {
        let n = self.draws.1.fetch_add(1, Ordering::Relaxed);
        let mut hasher = self.draws.0.build_hasher();
        hasher.write_u64(n);
        (hasher.finish() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Picks workers like [`ShimRouter::decide`], first preparing the prompt for KV-aware
    /// selection when `dynamo.kv.enabled`.
    pub async fn decide_async(
        &self,
        client_model: &str,
        body: &[u8],
        allowed: &[String],
        usable: impl Fn(&str) -> bool,
    ) -> Option<ShimDecision> {
        self.decide_async_estimated(client_model, body, None, allowed, usable)
            .await
    }

    /// [`ShimRouter::decide_async`] for a body the proxy parsed: its prompt-size estimate comes
    /// from that parse ([`ParsedBody::prompt_tokens`]), so the body is not parsed again for it.
    pub async fn decide_async_parsed(
        &self,
        body: &ParsedBody,
        allowed: &[String],
        usable: impl Fn(&str) -> bool,
    ) -> Option<ShimDecision> {
        self.decide_async_estimated(
            &body.model,
            &body.outbound,
            Some(body.prompt_tokens),
            allowed,
            usable,
        )
        .await
    }

    async fn decide_async_estimated(
        &self,
        client_model: &str,
        body: &[u8],
        prompt_tokens: Option<u64>,
        allowed: &[String],
        usable: impl Fn(&str) -> bool,
    ) -> Option<ShimDecision> {
        let config = self.config.load_full();
        if !config.dynamo.enabled
            || !config.disaggregated_serving.enabled
            || !config.dynamo.kv.enabled
        {
            let kv = Some(Err(KvUnavailable::TokenizerUnavailable));
            return self.decide_with(client_model, body, prompt_tokens, allowed, usable, kv);
        }
        let model = mapped_model(&config, client_model);
        let held = self.picker.index_for(&self.registry);
        let block_sizes = held.index.block_sizes(model);
        if block_sizes.is_empty() {
            return self.decide_with(client_model, body, prompt_tokens, allowed, usable, None);
        }
        let prep = self.kv_prep.load_full();
        // The prompt preparation reads the body as a DOM; the size estimate (when the preparation
        // fails) comes from the proxy's parse, or from this DOM for a caller without one.
        let parsed = serde_json::from_slice::<serde_json::Value>(body).ok();
        let prompt_tokens =
            prompt_tokens.or_else(|| Some(parsed.as_ref().map_or(0, estimate_value_tokens)));
        // The prompt the frontend will render: the dispatch applies the replica's rewrites.
        let rewritten = parsed.as_ref().and_then(|value| {
            let rewrite = first_replica_rewrite(&config)?;
            let mut value = value.clone();
            rewrite.apply(&mut value).then_some(value)
        });
        let prepared = match (prep, rewritten.as_ref().or(parsed.as_ref())) {
            (Some(prep), Some(value)) => {
                let request = KvPrepRequest {
                    model,
                    body: value,
                    block_sizes,
                };
                prep.0.prepare(request).await
            }
            (None, _) => Err(KvUnavailable::TokenizerUnavailable),
            (Some(_), None) => Err(KvUnavailable::RenderUnavailable),
        };
        self.decide_with(
            client_model,
            body,
            prompt_tokens,
            allowed,
            usable,
            Some(prepared),
        )
    }

    /// Whether the fleet can take a request of `client_model` now, for `admission`: the Dynamo
    /// model name and [`Fleet`]; `None` when admission does not apply (no busy threshold, the
    /// Dynamo path off, or no worker serves the model). Reads the samples and the unanswered
    /// dispatches under the decision's locks (same order).
    pub fn fleet(
        &self,
        client_model: &str,
        allowed: &[String],
        usable: impl Fn(&str) -> bool,
    ) -> Option<(Arc<str>, Fleet)> {
        let config = self.config.load();
        let threshold = config.admission.busy_threshold.threshold();
        if !threshold.is_set() || !config.dynamo.enabled || !config.disaggregated_serving.enabled {
            return None;
        }
        let model = mapped_model(&config, client_model);
        let held = self.picker.index_for(&self.registry);
        let candidates = held.index.for_model(model);
        let name = candidates.first()?.model.clone();
        let eligible: Vec<Namespace> = namespace_replicas(&config, allowed, &usable)
            .into_iter()
            .filter_map(|(ns, usable)| usable.then_some(ns))
            .collect();
        let (now, max_age) = (now_tick(), config.dynamo.load.max_staleness.get());
        let fleet = self.load.with(|store| {
            self.picker.with_state(store, |state| {
                answer_arrivals(&mut state.ledger, store);
                state.ledger.expire(now);
                admission::fleet(&threshold, candidates, &eligible, |c| {
                    admission::rank_load(c, store, &state.ledger, now, max_age)
                })
            })
        });
        Some((name, fleet))
    }

    /// `admission`'s queue bounds and order as configured now (a reload applies to requests
    /// already waiting).
    pub fn admission_bounds(&self) -> Bounds {
        self.config.load().admission.bounds()
    }

    /// The priority class of the key `name` (`None`: unauthenticated) asking for `asked`, 0
    /// served first.
    pub fn admission_class(&self, name: Option<&str>, asked: Option<&str>) -> u8 {
        self.config.load().admission.class_of(name, asked)
    }

    /// A counter bumped after every load-store update (a waiting request re-checks the fleet).
    pub fn load_changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.load.subscribe()
    }

    /// The active picker.
    pub fn picker(&self) -> Arc<dyn DynamoWorkerPicker> {
        self.picker.picker()
    }

    /// Replaces the picker (a plug-in picker installs here), through this router's writer.
    pub fn set_picker(&self, picker: Arc<dyn DynamoWorkerPicker>) {
        if let Some(writer) = &self.writer {
            writer.set_picker(picker);
        }
    }

    /// The shared picker state (admin view, the `PickerActor`).
    pub fn picker_state(&self) -> &SharedPicker {
        &self.picker
    }

    /// Picks workers for a request of `client_model` whose outbound body is `body`. `usable`
    /// tells whether a backend replica is healthy and admitted. `None` means the Dynamo path does
    /// not apply (disabled, no usable shim replica, or no worker serves the model): the caller
    /// routes normally.
    /// Under `dynamo.kv.enabled` this scores without a KV term (`tokenizer_unavailable`); use
    /// [`ShimRouter::decide_async`] to prepare the prompt first.
    pub fn decide(
        &self,
        client_model: &str,
        body: &[u8],
        allowed: &[String],
        usable: impl Fn(&str) -> bool,
    ) -> Option<ShimDecision> {
        let kv = Err(KvUnavailable::TokenizerUnavailable);
        self.decide_with(client_model, body, None, allowed, usable, Some(kv))
    }

    /// [`ShimRouter::decide`] for a body the proxy parsed: its prompt-size estimate comes from
    /// that parse ([`ParsedBody::prompt_tokens`]), so the body is not parsed again for it.
    pub fn decide_parsed(
        &self,
        body: &ParsedBody,
        allowed: &[String],
        usable: impl Fn(&str) -> bool,
    ) -> Option<ShimDecision> {
        let kv = Err(KvUnavailable::TokenizerUnavailable);
        let tokens = Some(body.prompt_tokens);
        self.decide_with(
            &body.model,
            &body.outbound,
            tokens,
            allowed,
            usable,
            Some(kv),
        )
    }

    /// The decision, with the prepared prompt (or why there is none) when KV applies;
    /// `prompt_tokens` is the body's prompt-size estimate when the caller has it (else `body` is
    /// parsed for it, only if a pick needs it). Gathers the inputs, calls [`decide`] once inside
    /// the locks, then performs its answer.
    fn decide_with(
        &self,
        client_model: &str,
        body: &[u8],
        prompt_tokens: Option<u64>,
        allowed: &[String],
        usable: impl Fn(&str) -> bool,
        prepared: Option<Result<PreparedPrompt, KvUnavailable>>,
    ) -> Option<ShimDecision> {
        let config = self.config.load();
        if !config.dynamo.enabled || !config.disaggregated_serving.enabled {
            return None;
        }
        let kv_config = &config.dynamo.kv;
        let prepared = prepared.filter(|_| kv_config.enabled);
        let namespaces = namespace_replicas(&config, allowed, &usable);
        let model = mapped_model(&config, client_model);
        let held = self.picker.index_for(&self.registry);
        let candidates = held.index.for_model(model);
        let overlaps = self.overlaps(&prepared);
        let estimate = || prompt_tokens.unwrap_or_else(|| estimate_tokens(body));
        let input = DecisionInput {
            model,
            namespaces,
            candidates,
            layout: held.index.layout_for(model),
            estimate_prompt_tokens: &estimate,
            load_signals: self.registry.snapshot().signals().load,
            kv: self.kv_input(&prepared, &overlaps),
            now: now_tick(),
            max_age: config.dynamo.load.max_staleness.get(),
        };
        let now = input.now;
        // The installed picker and its per-config inputs: one lock-free load.
        let installed = self.picker.installed();
        let tie_break = installed.config.tie_break;
        // One load-store lock for the whole decision (order: load store, then picker state).
        let decision = self.load.with(|store| {
            self.picker.with_state(store, |state| {
                state.tie.set(tie_break);
                // Samples that arrived since earlier dispatches answer them (the PickerActor does
                // this on every store change; a request racing ahead of it catches up here).
                answer_arrivals(&mut state.ledger, store);
                state.ledger.expire(now);
                decide(input, &*installed.picker, store, state)
            })
        });
        let routed = match decision {
            Decision::Route(routed) => routed,
            Decision::Skip(why) => {
                debug!(model, reason = ?why, "No Dynamo worker for the request; routing normally.");
                return None;
            }
        };
        self.record(model, &routed, &prepared);
        let body = match &prepared {
            Some(Ok(prompt))
                if kv_config.send_token_data
                    && installed.config.token_data.contains(&routed.pick.namespace) =>
            {
                with_token_data(body, &prompt.tokens)
            }
            _ => None,
        };
        let pool = pool_of(&config, &routed.pick.namespace, allowed, &usable);
        Some(ShimDecision::new(routed, pool, body))
    }

    /// Overlaps per block size of a prepared prompt, read under one guard of the shared index.
    fn overlaps(
        &self,
        prepared: &Option<Result<PreparedPrompt, KvUnavailable>>,
    ) -> Vec<BlockOverlaps> {
        let (Some(Ok(prompt)), Some(kv_index)) = (prepared, &self.kv_index) else {
            return Vec::new();
        };
        let queries: Vec<_> = prompt
            .hashes
            .iter()
            .map(|(block_size, hashes)| (*block_size, hashes.as_slice()))
            .collect();
        kv_index
            .overlaps_by_block_size(&queries)
            .into_iter()
            .map(|(block_size, ranks)| BlockOverlaps { block_size, ranks })
            .collect()
    }

    /// The picker's KV input: `None` when KV is off, the reason when the prompt is not prepared.
    fn kv_input<'a>(
        &self,
        prepared: &Option<Result<PreparedPrompt, KvUnavailable>>,
        overlaps: &'a [BlockOverlaps],
    ) -> Option<Result<KvPickInput<'a>, KvUnavailable>> {
        match prepared {
            Some(Ok(prompt)) => Some(Ok(KvPickInput {
                isl: prompt.tokens.len() as u64,
                overlaps,
                unit: self.draw_unit(),
            })),
            Some(Err(failure)) => Some(Err(*failure)),
            None => None,
        }
    }

    /// Performs a pick's side effects: selection metrics, the KV hash-parity prediction and the
    /// debug line.
    fn record(
        &self,
        model: &str,
        routed: &Routed,
        prepared: &Option<Result<PreparedPrompt, KvUnavailable>>,
    ) {
        let pick = &routed.pick;
        if let Some(metrics) = &self.metrics {
            metrics.selection(Phase::Decode, pick.reasons.decode);
            metrics.selection(Phase::Prefill, pick.reasons.prefill);
            if let Some(result) = routed.kv {
                metrics.kv_selection(kv_label(result));
            }
        }
        if let (Some(Ok(prompt)), Some(kv_index), Some(target)) =
            (prepared, &self.kv_index, routed.parity)
        {
            predict_parity(kv_index, model, prompt, target);
        }
        debug!(
            model,
            namespace = %pick.namespace,
            decode_worker_id = pick.decode.worker.instance_id.0,
            decode_dp_rank = pick.decode.dp_rank.map(|r| r.0),
            decode_reason = pick.reasons.decode.as_label(),
            prefill_worker_id = pick.prefill.as_ref().map(|p| p.worker.instance_id.0),
            prefill_dp_rank = pick.prefill.as_ref().and_then(|p| p.dp_rank).map(|r| r.0),
            prefill_reason = pick.reasons.prefill.as_label(),
            "Picked Dynamo workers for a request."
        );
    }
}

/// What `config` asks of the pickers, derived once per config (the control loop's
/// [`ShimRouter::reconfigure`]): the KV parameters when `dynamo.kv.enabled`, this replica's
/// tie-break ([`tie_break_of`]; the replica id may read the environment and the host name) and
/// the namespaces that may receive `nvext.token_data` ([`token_data_namespaces`]).
pub fn picker_config(config: &Config) -> PickerConfig {
    let kv = &config.dynamo.kv;
    PickerConfig {
        kv: kv.enabled.then(|| kv_params(kv)),
        tie_break: tie_break_of(config, |k| std::env::var(k).ok()),
        token_data: token_data_namespaces(config),
    }
}

/// The tie-break `config` asks of this replica: `dynamo.load.tie_break_window`, seeded by the
/// replica id (`replica_sync.replica_id`, else `$POD_NAME`, else the host name) so replicas
/// deciding on the same view diverge, whether or not `replica_sync` is enabled.
pub fn tie_break_of(config: &Config, env: impl Fn(&str) -> Option<String>) -> TieBreak {
    let window = config.dynamo.load.tie_break_window;
    if !(window.is_finite() && window > 0.0) {
        return TieBreak::OFF;
    }
    let id = config.replica_sync.resolved_replica_id(env);
    TieBreak {
        window,
        seed: TieBreak::seed_of(&id),
        peer_slots: config.dynamo.load.peer_slots,
    }
}

/// Hash parity: the rank that prefills this request should soon store the prompt's blocks past
/// the overlap it already held.
fn predict_parity(
    kv_index: &SharedKvIndex,
    model: &str,
    prompt: &PreparedPrompt,
    target: ParityTarget,
) {
    let Some((_, hashes)) = prompt
        .hashes
        .iter()
        .find(|(size, _)| size.get() == target.block_size)
    else {
        return;
    };
    let held = usize::try_from(target.held_blocks)
        .unwrap_or(usize::MAX)
        .min(hashes.len());
    kv_index.record_prediction(model, target.worker, target.dp_rank, &hashes[held..]);
}

/// Every watched namespace, with whether a permitted shim replica is usable there (checked
/// without building pools: only the winner's pool is needed).
fn namespace_replicas(
    config: &Config,
    allowed: &[String],
    usable: &impl Fn(&str) -> bool,
) -> Vec<(Namespace, bool)> {
    let shim = &config.dynamo.shim;
    config
        .dynamo
        .discovery
        .namespaces()
        .into_iter()
        .map(|ns| {
            let served = shim
                .backends_for(ns.as_str())
                .iter()
                .filter(|name| allowed.is_empty() || allowed.contains(name))
                .any(|name| usable(name));
            (ns, served)
        })
        .collect()
}

/// The namespace's shim replicas the caller may use that are usable now.
fn pool_of(
    config: &Config,
    namespace: &Namespace,
    allowed: &[String],
    usable: &impl Fn(&str) -> bool,
) -> Vec<String> {
    config
        .dynamo
        .shim
        .backends_for(namespace.as_str())
        .iter()
        .filter(|name| allowed.is_empty() || allowed.contains(name))
        .filter(|name| usable(name))
        .cloned()
        .collect()
}

impl ShimDecision {
    /// The dispatch plan of a pick: pins as headers, the path label, the ledger entry.
    fn new(routed: Routed, pool: Vec<String>, body: Option<Bytes>) -> Self {
        let pick = routed.pick;
        let dispatch = Dispatch::pins(
            pick.decode.worker.instance_id,
            pick.decode.rank_header(),
            pick.prefill
                .as_ref()
                .map(|p| (p.worker.instance_id, p.rank_header())),
        );
        let path = match routed.path {
            PathClass::Unified => RoutingPath::Unified,
            PathClass::Disaggregated => RoutingPath::Disaggregated,
            PathClass::Aggregated => RoutingPath::Aggregated,
        };
        Self {
            pool,
            dispatch,
            path,
            dispatch_id: pick.dispatch,
            body,
            kv: routed.kv,
        }
    }
}

/// The prompt rewrites KV rendering applies: the first shim replica's (`shim.backends[0]`, or
/// the first pool's first replica), `None` when it has none.
pub fn first_replica_rewrite(
    config: &Config,
) -> Option<continuum_protocol::ingress::prompts::PromptRewrite> {
    let shim = &config.dynamo.shim;
    let first = shim
        .backends
        .first()
        .or_else(|| shim.pools.first().and_then(|p| p.backends.first()))?;
    let rewrite = config.backend(first)?.prompt_rewrite();
    (!rewrite.is_noop()).then_some(rewrite)
}

/// The namespaces whose shim pool may receive `nvext.token_data` (seed "nvext.token_data"): every
/// replica of the pool requires the body rewrite the prompt was rendered with (the first shim
/// replica's `global_prompts` and `requires_single_leading_system`, [`first_replica_rewrite`]).
/// A replica that rewrites differently would be handed tokens of a prompt it does not serve.
pub fn token_data_namespaces(config: &Config) -> Vec<Namespace> {
    let rendered = first_replica_rewrite(config).unwrap_or_default();
    let rewrite_of = |name: &String| {
        config
            .backend(name)
            .map(|b| b.prompt_rewrite())
            .unwrap_or_default()
    };
    let shim = &config.dynamo.shim;
    config
        .dynamo
        .discovery
        .namespaces()
        .into_iter()
        .filter(|ns| {
            shim.backends_for(ns.as_str())
                .iter()
                .all(|name| rewrite_of(name) == rendered)
        })
        .collect()
}

/// The client model id as the fleet names it (`shim.model_map`).
fn mapped_model<'a>(config: &'a Config, client_model: &'a str) -> &'a str {
    config
        .dynamo
        .shim
        .model_map
        .get(client_model)
        .map(String::as_str)
        .unwrap_or(client_model)
}

/// The `dynamo.kv` tunables as the picker reads them.
pub fn kv_params(kv: &KvConfig) -> KvPickParams {
    KvPickParams {
        overlap_score_credit: kv.overlap_score_credit,
        prefill_load_scale: kv.prefill_load_scale,
        router_temperature: kv.router_temperature,
        conditional_disaggregation: ConditionalDisaggregation {
            enabled: kv.conditional_disaggregation.enabled,
            decode_busy_threshold: kv.conditional_disaggregation.decode_busy_threshold,
        },
    }
}

fn kv_label(result: KvSelectionResult) -> KvSelectionLabel {
    match result {
        KvSelectionResult::Overlap => KvSelectionLabel::Overlap,
        KvSelectionResult::NoOverlap => KvSelectionLabel::NoOverlap,
        KvSelectionResult::TokenizerUnavailable => KvSelectionLabel::TokenizerUnavailable,
        KvSelectionResult::PromptTooLarge => KvSelectionLabel::PromptTooLarge,
        KvSelectionResult::RenderUnavailable => KvSelectionLabel::RenderUnavailable,
        KvSelectionResult::ArtifactUnpinned => KvSelectionLabel::ArtifactUnpinned,
        KvSelectionResult::Bypass => KvSelectionLabel::Bypass,
    }
}

/// `body` with `nvext.token_data` set to `tokens` (replacing any value). `None` when the body is
/// not a JSON object (it was validated as one, so this does not happen on the request path).
pub fn with_token_data(body: &[u8], tokens: &[u32]) -> Option<Bytes> {
    let mut value: serde_json::Value = serde_json::from_slice(body).ok()?;
    let object = value.as_object_mut()?;
    let nvext = object
        .entry("nvext")
        .or_insert_with(|| serde_json::Value::Object(Default::default()));
    if !nvext.is_object() {
        *nvext = serde_json::Value::Object(Default::default());
    }
    nvext.as_object_mut()?.insert(
        "token_data".into(),
        serde_json::Value::from(tokens.to_vec()),
    );
    serde_json::to_vec(&value).ok().map(Bytes::from)
}

/// The coarse prompt-size estimate from a chat (`messages[].content`) or completions (`prompt`)
/// body; no tokenizer. The request path reads it from the proxy's parse instead
/// ([`ParsedBody::prompt_tokens`], which agrees with this on every valid body).
pub fn estimate_tokens(body: &[u8]) -> u64 {
    serde_json::from_slice::<serde_json::Value>(body)
        .map(|value| estimate_value_tokens(&value))
        .unwrap_or(0)
}

/// [`estimate_tokens`] of an already parsed body.
fn estimate_value_tokens(value: &serde_json::Value) -> u64 {
    let mut texts: Vec<&str> = Vec::new();
    if let Some(messages) = value.get("messages").and_then(|m| m.as_array()) {
        for message in messages {
            match message.get("content") {
                Some(serde_json::Value::String(s)) => texts.push(s),
                Some(serde_json::Value::Array(parts)) => {
                    texts.extend(parts.iter().filter_map(|p| p.get("text")?.as_str()));
                }
                _ => {}
            }
        }
    }
    match value.get("prompt") {
        Some(serde_json::Value::String(s)) => texts.push(s),
        Some(serde_json::Value::Array(items)) => {
            texts.extend(items.iter().filter_map(|i| i.as_str()))
        }
        _ => {}
    }
    estimate_prompt_tokens(texts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_data_is_set_or_replaced_and_other_nvext_fields_kept() {
        let out = with_token_data(br#"{"model":"m"}"#, &[1, 2]).expect("object");
        let v: serde_json::Value = serde_json::from_slice(&out).expect("json");
        assert_eq!(v["nvext"]["token_data"], serde_json::json!([1, 2]));
        let out = with_token_data(
            br#"{"model":"m","nvext":{"token_data":[9],"greed_sampling":true}}"#,
            &[3],
        )
        .expect("object");
        let v: serde_json::Value = serde_json::from_slice(&out).expect("json");
        assert_eq!(
            v["nvext"],
            serde_json::json!({"token_data": [3], "greed_sampling": true})
        );
        assert_eq!(with_token_data(b"[1]", &[1]), None);
    }

    /// Two namespaces, one pool each; `b_prompts` are the second pool's second replica's
    /// `global_prompts`.
    fn two_pools(b_prompts: &str) -> Config {
        let text = format!(
            "backends:\n\
             - {{name: a1, type: openai, url: \"http://127.0.0.1:1\", models: [m]}}\n\
             - {{name: b1, type: openai, url: \"http://127.0.0.1:2\", models: [m]}}\n\
             - {{name: b2, type: openai, url: \"http://127.0.0.1:3\", models: [m], \
                 global_prompts: {b_prompts}}}\n\
             dynamo:\n  enabled: true\n  discovery:\n    etcd:\n      \
             endpoints: [\"http://127.0.0.1:2379\"]\n      namespaces: [a, b]\n  shim:\n    \
             pools:\n    - {{namespace: a, backends: [a1]}}\n    \
             - {{namespace: b, backends: [b1, b2]}}\n"
        );
        Config::from_yaml_str(&text, &std::collections::HashMap::<String, String>::new())
            .expect("config")
    }

    #[test]
    fn token_data_is_withheld_from_pools_whose_replicas_rewrite_differently() {
        let names = |config: &Config| -> Vec<String> {
            token_data_namespaces(config)
                .iter()
                .map(|ns| ns.as_str().to_owned())
                .collect()
        };
        assert_eq!(names(&two_pools("[]")), ["a", "b"]);
        // b2 adds a system prompt the rendered tokens do not carry: pool b gets no token data.
        assert_eq!(names(&two_pools("[\"be brief\"]")), ["a"]);
    }

    #[test]
    fn at_most_two_valid_block_sizes_are_hashed() {
        use continuum_protocol::ids::{InstanceId, WorkerKey};
        use continuum_protocol::picker::Candidate;
        use continuum_protocol::picker::CandidateRole;
        use continuum_protocol::picker::candidates::hashed_block_sizes;
        let cand = |bs: Option<u32>| Candidate {
            worker: WorkerKey {
                namespace: Namespace::new("ns"),
                instance_id: InstanceId(1),
            },
            role: CandidateRole::Aggregated,
            model: "m".into(),
            dp_rank: None,
            rank_declared: false,
            block_size: bs,
            total_kv_blocks: None,
            max_num_batched_tokens: None,
        };
        let sizes = hashed_block_sizes(&[
            cand(Some(64)),
            cand(Some(16)),
            cand(None),
            cand(Some(8)),
            cand(Some(16)),
            cand(Some(32)),
        ]);
        let sizes: Vec<u32> = sizes.iter().map(|b| b.get()).collect();
        assert_eq!(sizes, vec![16, 32]);
    }

    #[test]
    fn the_tie_break_is_seeded_by_the_replica_id() {
        let mut config = Config::default();
        assert_eq!(
            tie_break_of(&config, |_| None),
            TieBreak::OFF,
            "off by default"
        );
        config.dynamo.load.tie_break_window = 2.0;
        let pod = |name: &'static str| move |k: &str| (k == "POD_NAME").then(|| name.to_owned());
        let a = tie_break_of(&config, pod("router-a"));
        assert_eq!(a.window, config.dynamo.load.tie_break_window);
        assert!(a.is_on());
        assert_eq!(
            a,
            tie_break_of(&config, pod("router-a")),
            "stable per replica"
        );
        assert_ne!(a.seed, tie_break_of(&config, pod("router-b")).seed);
        assert!(!a.peer_slots, "peer slots off by default");
        config.dynamo.load.peer_slots = true;
        assert!(tie_break_of(&config, pod("router-a")).peer_slots);
        // replica_sync.replica_id wins over the pod name, whether or not the sync is enabled.
        config.replica_sync.replica_id = "router-b".into();
        assert_eq!(
            tie_break_of(&config, pod("router-a")).seed,
            TieBreak::seed_of("router-b")
        );
        config.dynamo.load.tie_break_window = 0.0;
        assert_eq!(tie_break_of(&config, pod("router-a")), TieBreak::OFF);
    }

    #[test]
    fn kv_params_follow_the_config() {
        let mut kv = KvConfig::default();
        assert_eq!(kv_params(&kv), KvPickParams::default());
        kv.router_temperature = 0.5;
        kv.conditional_disaggregation.enabled = true;
        kv.conditional_disaggregation.decode_busy_threshold = Some(0.25);
        let params = kv_params(&kv);
        assert_eq!(params.router_temperature, 0.5);
        assert_eq!(
            params.conditional_disaggregation,
            ConditionalDisaggregation {
                enabled: true,
                decode_busy_threshold: Some(0.25)
            }
        );
    }

    mod proxy_estimate {
        use super::*;
        use proptest::prelude::*;

        /// Text as clients send it: ASCII words, whitespace of every kind, non-ASCII, escapes.
        fn text() -> impl Strategy<Value = String> {
            "[ a-z\\t\\n\u{85}\u{A0}\u{3000}é你😀\"\\\\]{0,24}"
        }

        /// A JSON value that is not text: what the estimate must skip.
        fn other() -> impl Strategy<Value = String> {
            prop::sample::select(vec![
                "null",
                "1",
                "-2.5e3",
                "true",
                "{}",
                "[]",
                r#"{"text":"x"}"#,
                r#"["x"]"#,
                r#"{"content":"x"}"#,
                "18446744073709551616",
            ])
            .prop_map(str::to_owned)
        }

        fn string(text: String) -> String {
            serde_json::Value::String(text).to_string()
        }

        /// An object written member by member, so keys may repeat (the last copy counts).
        fn object(members: Vec<(String, String)>) -> String {
            let inner: Vec<String> = members
                .iter()
                .map(|(k, v)| format!("\"{k}\":{v}"))
                .collect();
            format!("{{{}}}", inner.join(","))
        }

        fn part() -> impl Strategy<Value = String> {
            prop_oneof![
                prop::collection::vec(
                    (
                        prop::sample::select(vec!["type", "text", "t\\u0065xt", "image_url"]),
                        prop_oneof![text().prop_map(string), other()],
                    ),
                    0..3,
                )
                .prop_map(|m| object(m.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())),
                other(),
                text().prop_map(string),
            ]
        }

        fn content() -> impl Strategy<Value = String> {
            prop_oneof![
                3 => text().prop_map(string),
                2 => prop::collection::vec(part(), 0..4).prop_map(|p| format!("[{}]", p.join(","))),
                1 => other(),
            ]
        }

        fn message() -> impl Strategy<Value = String> {
            prop_oneof![
                4 => prop::collection::vec(
                    (
                        prop::sample::select(vec!["role", "content", "c\\u006fntent", "name"]),
                        content(),
                    ),
                    0..4,
                )
                .prop_map(|m| object(m.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())),
                1 => other(),
            ]
        }

        fn messages() -> impl Strategy<Value = String> {
            prop_oneof![
                4 => prop::collection::vec(message(), 0..5).prop_map(|m| format!("[{}]", m.join(","))),
                1 => other(),
                1 => text().prop_map(string),
            ]
        }

        fn prompt() -> impl Strategy<Value = String> {
            prop_oneof![
                text().prop_map(string),
                prop::collection::vec(prop_oneof![text().prop_map(string), other()], 0..4)
                    .prop_map(|p| format!("[{}]", p.join(","))),
                other(),
            ]
        }

        fn body() -> impl Strategy<Value = String> {
            let member = prop_oneof![
                4 => messages().prop_map(|v| ("messages".to_owned(), v)),
                1 => messages().prop_map(|v| ("m\\u0065ssages".to_owned(), v)),
                2 => prompt().prop_map(|v| ("prompt".to_owned(), v)),
                1 => other().prop_map(|v| ("max_tokens".to_owned(), v)),
                1 => Just(("nvext".to_owned(), r#"{"backend_instance_id":1,"x":2}"#.to_owned())),
            ];
            prop::collection::vec(member, 0..4).prop_map(|mut members| {
                // A repeated `nvext` is refused by the parse (tested in `proxy::body`).
                let mut seen_nvext = false;
                members
                    .retain(|(key, _)| key != "nvext" || !std::mem::replace(&mut seen_nvext, true));
                members.insert(0, ("model".to_owned(), "\"m\"".to_owned()));
                object(members)
            })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]

            /// The proxy's parse estimates the prompt exactly as a DOM parse of the outbound
            /// body does (repeated keys, escaped keys, every shape the estimate skips).
            #[test]
            fn the_proxy_parse_estimates_as_a_dom_parse_does(body in body()) {
                let parsed = crate::proxy::body::parse(Bytes::from(body.clone())).expect("valid");
                prop_assert_eq!(parsed.prompt_tokens, estimate_tokens(&parsed.outbound), "{}", body);
                prop_assert_eq!(parsed.prompt_tokens, estimate_tokens(body.as_bytes()), "{}", body);
            }
        }
    }

    #[test]
    fn prompt_estimates_read_chat_and_completion_bodies() {
        let chat = br#"{"model":"m","messages":[{"role":"user","content":"one two three"},{"role":"user","content":[{"type":"text","text":"four"}]}]}"#;
        let completion = br#"{"model":"m","prompt":"one two three four"}"#;
        assert!(estimate_tokens(chat) > 0);
        assert!(estimate_tokens(completion) > 0);
        assert_eq!(estimate_tokens(b"not json"), 0);
    }
}
