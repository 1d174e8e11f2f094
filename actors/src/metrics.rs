//! Process-wide Prometheus metrics: one registry, every family of the seed, closed label sets.
//!
//! Every label that is not bounded by fleet size is a Rust enum with `as_label()`, and every
//! method takes the enum, so a string from the network can never become a label value. The
//! fleet-bounded labels (`namespace`, `worker`, `dp_rank`) take the protocol's typed ids; a
//! worker's series are removed when it departs (`remove_worker`, `retain_workers`).
//!
//! Closed-set series start at 0 so `rate()` and absent-series alerts work from the first scrape.
//!
//! The registry also carries an OpenTelemetry SDK meter provider whose reader is
//! `opentelemetry-prometheus`: instruments created through [`Metrics::meter`] (or through
//! `opentelemetry::global::meter` after [`Metrics::install_global_meter_provider`]) are collected
//! into the same `/metrics` text on every scrape, next to a `target_info{service_name}` series.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::Arc;

use crate::lock::Mutex;

pub use continuum_protocol::discovery::DiscoveryEventKind;
pub use continuum_protocol::event_plane::LoadEventResult;
use continuum_protocol::ids::{DpRank, Namespace, WorkerKey};
/// `continuum_dynamo_kv_events_total{result}`: the one closed set the index, the envelope
/// decoder and this metric share.
pub use continuum_protocol::kv::KvEventResult;
pub use continuum_protocol::picker::{Phase as SelectionRole, SelectionReason};
use opentelemetry::metrics::{Meter, MeterProvider as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use prometheus::proto::MetricType;
use prometheus::{Encoder as _, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder};

use crate::lifecycle::ActorKind;

/// Errors building the metrics registry. Both arms mean a programming error (a family registered
/// twice, an invalid name), never bad input: label values are typed.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("registering a metric family failed: {0}")]
    Register(#[from] prometheus::Error),
    #[error("building the OpenTelemetry Prometheus exporter failed: {0}")]
    OtelExporter(String),
}

/// Defines a closed label set: an enum, its `ALL` list (for pre-initialisation and tests) and its
/// `as_label()` text.
macro_rules! label_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident => $label:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum $name {
            $($(#[$vmeta])* $variant),+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The Prometheus label value.
            pub const fn as_label(self) -> &'static str {
                match self {
                    $($name::$variant => $label),+
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_label())
            }
        }
    };
}
pub(crate) use label_enum;

label_enum! {
    /// The `reason` of `continuum_config_reload_refusals_total{reason}`: why a config reload
    /// (file watch, SIGHUP or `POST /admin/config/reload`) kept the running config.
    ReloadRefusal {
        /// The file could not be read, parsed or validated.
        Invalid => "invalid",
        /// It would remove every backend without writing `backends: []`.
        RemovesAllBackends => "removes_all_backends",
        /// It would disable the admin API (or drop its token) without `admin.enabled: false`.
        DisablesAdmin => "disables_admin",
    }
}

label_enum! {
    /// The `role` of `continuum_dynamo_workers{namespace, role}`.
    WorkerRole {
        Prefill => "prefill",
        Decode => "decode",
        Aggregated => "aggregated",
        /// Visible to operators, never routed to.
        Unknown => "unknown",
    }
}

label_enum! {
    /// The `state` of `continuum_dynamo_{load,kv}_subscriptions{state, transport}`.
    SubscriptionState {
        Pending => "pending",
        Connecting => "connecting",
        Connected => "connected",
        Backoff => "backoff",
    }
}

label_enum! {
    /// The `transport` of `continuum_dynamo_{load,kv}_subscriptions{state, transport}`.
    SubscriptionTransport {
        Direct => "direct",
        Broker => "broker",
    }
}

label_enum! {
    /// `continuum_dynamo_kv_hash_parity_total{model, result}`: was a KV-aware pick's predicted
    /// block hash stored by the worker under the same `tokens_hash`?
    KvParityResult {
        Match => "match",
        Mismatch => "mismatch",
    }
}

label_enum! {
    /// `continuum_dynamo_kv_selection_total{result}`.
    KvSelectionResult {
        Overlap => "overlap",
        NoOverlap => "no_overlap",
        TokenizerUnavailable => "tokenizer_unavailable",
        PromptTooLarge => "prompt_too_large",
        RenderUnavailable => "render_unavailable",
        ArtifactUnpinned => "artifact_unpinned",
        Bypass => "bypass",
    }
}

label_enum! {
    /// `continuum_dynamo_kv_artifacts_total{result}`.
    KvArtifactResult {
        /// Fetched or read, checksum verified, loaded.
        Loaded => "loaded",
        /// Its blake3 checksum is not in `kv.pinned_artifacts`.
        Unpinned => "unpinned",
        /// An unsupported kv_cache_block_size or URI scheme.
        Unsupported => "unsupported",
        /// Larger than the 64 MiB artifact bound.
        Oversized => "oversized",
        ChecksumMismatch => "checksum_mismatch",
        FetchFailed => "fetch_failed",
        LoadFailed => "load_failed",
        /// Read from the content-addressed cache, checksum verified.
        CacheHit => "cache_hit",
        /// An http(s):// or hf:// path while kv.allow_{http,hf}_artifacts is false.
        Disallowed => "disallowed",
    }
}

label_enum! {
    /// `disaggregated_requests_total{routing_path}`.
    RoutingPath {
        /// A prefill and a decode worker were pinned.
        Disaggregated => "disaggregated",
        /// Only a decode (or aggregated) worker was pinned.
        Aggregated => "aggregated",
        /// Conditional bypass or unified fallback: no prefill hop.
        Unified => "unified",
    }
}

label_enum! {
    /// `disaggregated_errors_total{phase}`.
    DisaggregatedPhase {
        /// Selection or a direct-mode refusal before any worker ran.
        Orchestration => "orchestration",
        Prefill => "prefill",
        Decode => "decode",
    }
}

label_enum! {
    /// `continuum_mid_stream_fallback_total{ingress}`.
    MidStreamIngress {
        ChatCompletions => "chat_completions",
        Completions => "completions",
        /// The native `/v1/responses` passthrough.
        Responses => "responses",
    }
}

label_enum! {
    /// `continuum_mid_stream_fallback_total{reason}`: why the stream counts as cut.
    MidStreamReason {
        /// The upstream failed or closed before its terminal event.
        Closed => "closed",
        /// No event within `inactivity_timeout`.
        Stalled => "stalled",
        /// An error chunk instead of content.
        ErrorEvent => "error_event",
    }
}

label_enum! {
    /// `continuum_mid_stream_fallback_total{result}`: what followed the cut.
    MidStreamResult {
        /// A fallback target answered; its stream continues the client's.
        Continued => "continued",
        /// Every attempt's fallback failed or stalled before its head.
        FallbackFailed => "fallback_failed",
        /// No unified candidate besides the excluded ones.
        NoFallback => "no_fallback",
        /// The retry budget refused.
        BudgetExhausted => "budget_exhausted",
        /// `max_attempts` continuations were already made.
        AttemptsExhausted => "attempts_exhausted",
        /// The cut fell inside a tool call.
        RefusedToolCall => "refused_tool_call",
        /// The cut fell inside a reasoning block.
        RefusedReasoning => "refused_reasoning",
        /// The answer text exceeded `max_buffered_bytes`.
        DisarmedOverCap => "disarmed_over_cap",
        /// Several choices, or a body the continuation cannot be built from.
        RefusedUnsupported => "refused_unsupported",
    }
}

/// One load sample's gauge values. `None` (a nil field upstream) exports no series.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerLoadGauges {
    pub active_decode_blocks: Option<u64>,
    pub active_prefill_tokens: Option<u64>,
    pub kv_used_blocks: Option<u64>,
}

/// The process-wide metrics. Cheap to clone; build once in `main` and hand clones down.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

struct Inner {
    registry: Registry,
    meter_provider: SdkMeterProvider,
    discovery_events: IntCounterVec,
    discovery_connected: IntGauge,
    workers: IntGaugeVec,
    load_events: IntCounterVec,
    load_subscriptions: IntGaugeVec,
    worker_active_decode_blocks: IntGaugeVec,
    worker_active_prefill_tokens: IntGaugeVec,
    worker_kv_used_blocks: IntGaugeVec,
    selection: IntCounterVec,
    kv_subscriptions: IntGaugeVec,
    kv_events: IntCounterVec,
    kv_hash_parity: IntCounterVec,
    kv_selection: IntCounterVec,
    kv_artifacts: IntCounterVec,
    disaggregated_requests: IntCounterVec,
    disaggregated_errors: IntCounterVec,
    actor_restarts: IntCounterVec,
    config_reload_refusals: IntCounterVec,
    restart_budget_exhausted: IntCounterVec,
    build_info: IntGaugeVec,
    unreachable_workers: IntGauge,
    workers_marked_unreachable: prometheus::IntCounter,
    mid_stream_fallback: IntCounterVec,
    mid_stream_tokens_resent: prometheus::IntCounter,
    /// `continuum_dynamo_event_bus_*` (actors/src/event_bus/metrics.rs).
    event_bus: crate::event_bus::EventBusMetrics,
    /// Which dp_ranks of a worker have gauge series, so a departed worker's series can all be
    /// removed (the Prometheus client has no "remove by partial labels").
    worker_ranks: Mutex<HashMap<WorkerKey, BTreeSet<DpRank>>>,
}

fn counter_vec(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> Result<IntCounterVec, MetricsError> {
    let vec = IntCounterVec::new(Opts::new(name, help), labels)?;
    registry.register(Box::new(vec.clone()))?;
    Ok(vec)
}

fn gauge_vec(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> Result<IntGaugeVec, MetricsError> {
    let vec = IntGaugeVec::new(Opts::new(name, help), labels)?;
    registry.register(Box::new(vec.clone()))?;
    Ok(vec)
}

/// Gauges hold `i64`; load figures are `u64` from the wire and saturate rather than wrap.
fn gauge_value(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

impl Metrics {
    /// Builds the registry, registers every family and pre-initialises closed-set series at 0.
    /// `service_name` becomes the `service_name` label of `target_info`.
    #[expect(clippy::too_many_lines, reason = "on tests/it/tidy/long_functions.txt")]
    pub fn new(service_name: &str) -> Result<Self, MetricsError> {
        let registry = Registry::new();
        let exporter = opentelemetry_prometheus::exporter()
            .with_registry(registry.clone())
            .build()
            .map_err(|error| MetricsError::OtelExporter(error.to_string()))?;
        let meter_provider = SdkMeterProvider::builder()
            .with_reader(exporter)
            .with_resource(
                Resource::builder()
                    .with_service_name(service_name.to_owned())
                    .build(),
            )
            .build();

        let r = &registry;
        let inner = Inner {
            discovery_events: counter_vec(
                r,
                "continuum_dynamo_discovery_events_total",
                "Discovery records or resources refused, and watcher restarts, by kind.",
                &["kind"],
            )?,
            discovery_connected: {
                let gauge = IntGauge::new(
                    "continuum_dynamo_discovery_connected",
                    "1 while the discovery source's watches are open, else 0.",
                )?;
                r.register(Box::new(gauge.clone()))?;
                gauge
            },
            workers: gauge_vec(
                r,
                "continuum_dynamo_workers",
                "Materialised workers in the published fleet view, by namespace and role.",
                &["namespace", "role"],
            )?,
            load_events: counter_vec(
                r,
                "continuum_dynamo_load_events_total",
                "kv_metrics frames applied or dropped, by result.",
                &["result"],
            )?,
            load_subscriptions: gauge_vec(
                r,
                "continuum_dynamo_load_subscriptions",
                "kv_metrics subscriptions by state and transport.",
                &["state", "transport"],
            )?,
            worker_active_decode_blocks: gauge_vec(
                r,
                "continuum_dynamo_worker_active_decode_blocks",
                "Last sampled active decode blocks of a worker rank.",
                &["namespace", "worker", "dp_rank"],
            )?,
            worker_active_prefill_tokens: gauge_vec(
                r,
                "continuum_dynamo_worker_active_prefill_tokens",
                "Last sampled active prefill tokens of a worker rank.",
                &["namespace", "worker", "dp_rank"],
            )?,
            worker_kv_used_blocks: gauge_vec(
                r,
                "continuum_dynamo_worker_kv_used_blocks",
                "Last sampled KV cache blocks in use on a worker rank.",
                &["namespace", "worker", "dp_rank"],
            )?,
            selection: counter_vec(
                r,
                "continuum_dynamo_selection_total",
                "Worker selections by role and reason.",
                &["role", "reason"],
            )?,
            kv_subscriptions: gauge_vec(
                r,
                "continuum_dynamo_kv_subscriptions",
                "kv-events subscriptions by state and transport.",
                &["state", "transport"],
            )?,
            kv_events: counter_vec(
                r,
                "continuum_dynamo_kv_events_total",
                "kv-events applied or dropped, by result.",
                &["result"],
            )?,
            kv_hash_parity: counter_vec(
                r,
                "continuum_dynamo_kv_hash_parity_total",
                "KV-aware picks whose predicted block hashes the worker stored (match) or not, by model.",
                &["model", "result"],
            )?,
            kv_selection: counter_vec(
                r,
                "continuum_dynamo_kv_selection_total",
                "KV-aware selections by result.",
                &["result"],
            )?,
            kv_artifacts: counter_vec(
                r,
                "continuum_dynamo_kv_artifacts_total",
                "Tokenizer and template artifacts by result.",
                &["result"],
            )?,
            disaggregated_requests: counter_vec(
                r,
                "disaggregated_requests_total",
                "Requests routed through the direct-mode shim, by routing path.",
                &["routing_path"],
            )?,
            disaggregated_errors: counter_vec(
                r,
                "disaggregated_errors_total",
                "Disaggregated routing failures by phase.",
                &["phase"],
            )?,
            actor_restarts: counter_vec(
                r,
                "continuum_actor_restarts_total",
                "Supervisor restarts of a failed actor, by actor kind.",
                &["actor"],
            )?,
            config_reload_refusals: counter_vec(
                r,
                "continuum_config_reload_refusals_total",
                "Config reloads refused (the running config stays), by reason.",
                &["reason"],
            )?,
            restart_budget_exhausted: counter_vec(
                r,
                "continuum_actor_restart_budget_exhausted_total",
                "Supervisors that spent a child's restart budget and escalated, by actor kind.",
                &["actor"],
            )?,
            build_info: gauge_vec(
                r,
                "continuum_router_build_info",
                "Always 1: the running binary's version and compiled Cargo features.",
                &["version", "features"],
            )?,
            unreachable_workers: {
                let gauge = IntGauge::new(
                    "continuum_dynamo_unreachable_workers",
                    "Registered workers whose kv_metrics publisher was lost and refuses reconnects.",
                )?;
                r.register(Box::new(gauge.clone()))?;
                gauge
            },
            workers_marked_unreachable: {
                let counter = prometheus::IntCounter::new(
                    "continuum_dynamo_workers_marked_unreachable_total",
                    "Times a registered worker was marked unreachable after its load publisher was lost.",
                )?;
                r.register(Box::new(counter.clone()))?;
                counter
            },
            mid_stream_fallback: counter_vec(
                r,
                "continuum_mid_stream_fallback_total",
                "Streams cut after their first byte, by ingress, reason and what followed.",
                &["ingress", "reason", "result"],
            )?,
            mid_stream_tokens_resent: {
                let counter = prometheus::IntCounter::new(
                    "continuum_mid_stream_fallback_tokens_resent_total",
                    "Completion tokens sent again as the partial answer of a continuation request.",
                )?;
                r.register(Box::new(counter.clone()))?;
                counter
            },
            event_bus: crate::event_bus::EventBusMetrics::register(r)?,
            registry,
            meter_provider,
            worker_ranks: Mutex::new(HashMap::new()),
        };
        inner.preinitialise();
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    /// The registry, for a custom scrape handler or extra families.
    pub fn registry(&self) -> &Registry {
        &self.inner.registry
    }

    /// The event-bus families.
    pub fn event_bus(&self) -> &crate::event_bus::EventBusMetrics {
        &self.inner.event_bus
    }

    /// The OpenTelemetry meter provider that exports into [`Self::registry`].
    pub fn meter_provider(&self) -> &SdkMeterProvider {
        &self.inner.meter_provider
    }

    /// An OpenTelemetry meter whose instruments appear in [`Self::render`]. Counters get a
    /// `_total` suffix and every series an `otel_scope_name` label. Give instruments names
    /// that differ from the native families above: a clash makes the scrape drop one family.
    pub fn meter(&self, scope: &'static str) -> Meter {
        self.inner.meter_provider.meter(scope)
    }

    /// Makes `opentelemetry::global::meter(..)` export into this registry.
    pub fn install_global_meter_provider(&self) {
        opentelemetry::global::set_meter_provider(self.inner.meter_provider.clone());
    }

    /// The `Content-Type` of [`Self::render`]'s output, for the `/metrics` handler.
    pub const CONTENT_TYPE: &'static str = prometheus::TEXT_FORMAT;

    /// The Prometheus text exposition of every family, native and OpenTelemetry.
    pub fn render(&self) -> String {
        let families = self.inner.registry.gather();
        let mut buffer = Vec::new();
        // The text encoder fails only on a write error, and a Vec never fails to write.
        if let Err(error) = TextEncoder::new().encode(&families, &mut buffer) {
            tracing::warn!(%error, "Failed to encode the metrics text.");
        }
        String::from_utf8(buffer).unwrap_or_else(|error| {
            // Label values are typed and ASCII; this is unreachable in practice, and a lossy
            // scrape is better than an empty one.
            String::from_utf8_lossy(error.as_bytes()).into_owned()
        })
    }

    /// The current value of one series, for tests and the admin API: `None` when the series
    /// does not exist. Labels are matched exactly and must name every label of the family.
    pub fn value(&self, family: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let family = self
            .inner
            .registry
            .gather()
            .into_iter()
            .find(|mf| mf.name() == family)?;
        let metric = family.get_metric().iter().find(|metric| {
            let pairs = metric.get_label();
            pairs.len() == labels.len()
                && labels.iter().all(|(name, value)| {
                    pairs
                        .iter()
                        .any(|pair| pair.name() == *name && pair.value() == *value)
                })
        })?;
        match family.get_field_type() {
            MetricType::COUNTER => Some(metric.get_counter().get_value()),
            MetricType::GAUGE => Some(metric.get_gauge().get_value()),
            _ => None,
        }
    }

    // ----- discovery -------------------------------------------------------------------------

    pub fn discovery_event(&self, kind: DiscoveryEventKind) {
        self.inner
            .discovery_events
            .with_label_values(&[kind.as_label()])
            .inc();
    }

    pub fn discovery_events(&self, kind: DiscoveryEventKind, n: u64) {
        self.inner
            .discovery_events
            .with_label_values(&[kind.as_label()])
            .inc_by(n);
    }

    pub fn set_discovery_connected(&self, connected: bool) {
        self.inner.discovery_connected.set(i64::from(connected));
    }

    pub fn set_workers(&self, namespace: &Namespace, role: WorkerRole, count: u64) {
        self.inner
            .workers
            .with_label_values(&[namespace.as_str(), role.as_label()])
            .set(gauge_value(count));
    }

    /// Removes a namespace's worker-count series (the namespace left the configuration).
    pub fn remove_workers_namespace(&self, namespace: &Namespace) {
        for role in WorkerRole::ALL {
            // Absent series are fine: the namespace may never have had that role.
            let _ = self
                .inner
                .workers
                .remove_label_values(&[namespace.as_str(), role.as_label()]);
        }
    }

    // ----- load signals ----------------------------------------------------------------------

    pub fn load_event(&self, result: LoadEventResult) {
        self.load_events(result, 1);
    }

    pub fn load_events(&self, result: LoadEventResult, count: u64) {
        self.inner
            .load_events
            .with_label_values(&[result.as_label()])
            .inc_by(count);
    }

    pub fn set_load_subscriptions(
        &self,
        state: SubscriptionState,
        transport: SubscriptionTransport,
        count: u64,
    ) {
        self.inner
            .load_subscriptions
            .with_label_values(&[state.as_label(), transport.as_label()])
            .set(gauge_value(count));
    }

    /// Workers currently marked unreachable in the load store.
    pub fn set_unreachable_workers(&self, count: u64) {
        self.inner.unreachable_workers.set(gauge_value(count));
    }

    /// `count` workers were just marked unreachable.
    pub fn workers_marked_unreachable(&self, count: u64) {
        self.inner.workers_marked_unreachable.inc_by(count);
    }

    /// One mid-stream cut (`src/route/mid_stream.rs`).
    pub fn mid_stream_fallback(
        &self,
        ingress: MidStreamIngress,
        reason: MidStreamReason,
        result: MidStreamResult,
    ) {
        let labels = [ingress.as_label(), reason.as_label(), result.as_label()];
        self.inner
            .mid_stream_fallback
            .with_label_values(&labels)
            .inc();
    }

    /// Completion tokens re-sent in a continuation request.
    pub fn mid_stream_tokens_resent(&self, tokens: u64) {
        self.inner.mid_stream_tokens_resent.inc_by(tokens);
    }

    /// Exports one (worker, dp_rank) sample. A `None` field removes that gauge's series.
    pub fn set_worker_load(&self, worker: &WorkerKey, dp_rank: DpRank, load: WorkerLoadGauges) {
        let namespace = worker.namespace.as_str();
        let hex = worker.instance_id.hex();
        let rank = dp_rank.to_string();
        let labels = [namespace, hex.as_str(), rank.as_str()];
        for (vec, value) in [
            (
                &self.inner.worker_active_decode_blocks,
                load.active_decode_blocks,
            ),
            (
                &self.inner.worker_active_prefill_tokens,
                load.active_prefill_tokens,
            ),
            (&self.inner.worker_kv_used_blocks, load.kv_used_blocks),
        ] {
            match value {
                Some(value) => vec.with_label_values(&labels).set(gauge_value(value)),
                None => {
                    let _ = vec.remove_label_values(&labels);
                }
            }
        }
        self.inner
            .worker_ranks
            .lock()
            .entry(worker.clone())
            .or_default()
            .insert(dp_rank);
    }

    /// Removes every gauge series of a departed worker, all ranks.
    pub fn remove_worker(&self, worker: &WorkerKey) {
        let ranks = self.inner.worker_ranks.lock().remove(worker);
        if let Some(ranks) = ranks {
            self.inner.remove_worker_series(worker, &ranks);
        }
    }

    /// Keeps the gauge series of workers for which `live` holds and removes the rest (the
    /// metrics half of the load store's `set_live_and_retain`).
    pub fn retain_workers(&self, mut live: impl FnMut(&WorkerKey) -> bool) {
        let departed: Vec<(WorkerKey, BTreeSet<DpRank>)> = {
            let mut ranks = self.inner.worker_ranks.lock();
            let gone: Vec<WorkerKey> = ranks.keys().filter(|k| !live(k)).cloned().collect();
            gone.into_iter()
                .filter_map(|key| ranks.remove_entry(&key))
                .collect()
        };
        for (worker, ranks) in departed {
            self.inner.remove_worker_series(&worker, &ranks);
        }
    }

    // ----- selection and KV ------------------------------------------------------------------

    pub fn selection(&self, role: SelectionRole, reason: SelectionReason) {
        self.inner
            .selection
            .with_label_values(&[role.as_label(), reason.as_label()])
            .inc();
    }

    pub fn set_kv_subscriptions(
        &self,
        state: SubscriptionState,
        transport: SubscriptionTransport,
        count: u64,
    ) {
        self.inner
            .kv_subscriptions
            .with_label_values(&[state.as_label(), transport.as_label()])
            .set(gauge_value(count));
    }

    pub fn kv_event(&self, result: KvEventResult) {
        self.kv_events(result, 1);
    }

    pub fn kv_events(&self, result: KvEventResult, count: u64) {
        self.inner
            .kv_events
            .with_label_values(&[result.as_label()])
            .inc_by(count);
    }

    /// `model` is a fleet model name (bounded by the fleet view); remove its series with
    /// [`Metrics::remove_kv_hash_parity_model`] when it leaves.
    pub fn kv_hash_parity(&self, model: &str, result: KvParityResult) {
        self.inner
            .kv_hash_parity
            .with_label_values(&[model, result.as_label()])
            .inc();
    }

    /// Removes a departed model's parity series.
    pub fn remove_kv_hash_parity_model(&self, model: &str) {
        for result in KvParityResult::ALL {
            // A result that never happened has no series; nothing to remove then.
            let _ = self
                .inner
                .kv_hash_parity
                .remove_label_values(&[model, result.as_label()]);
        }
    }

    pub fn kv_selection(&self, result: KvSelectionResult) {
        self.inner
            .kv_selection
            .with_label_values(&[result.as_label()])
            .inc();
    }

    pub fn kv_artifact(&self, result: KvArtifactResult) {
        self.inner
            .kv_artifacts
            .with_label_values(&[result.as_label()])
            .inc();
    }

    // ----- front door and process ------------------------------------------------------------

    pub fn disaggregated_request(&self, path: RoutingPath) {
        self.inner
            .disaggregated_requests
            .with_label_values(&[path.as_label()])
            .inc();
    }

    pub fn disaggregated_error(&self, phase: DisaggregatedPhase) {
        self.inner
            .disaggregated_errors
            .with_label_values(&[phase.as_label()])
            .inc();
    }

    pub fn actor_restart(&self, kind: ActorKind) {
        self.inner
            .actor_restarts
            .with_label_values(&[kind.as_label()])
            .inc();
    }

    pub fn config_reload_refused(&self, reason: ReloadRefusal) {
        self.inner
            .config_reload_refusals
            .with_label_values(&[reason.as_label()])
            .inc();
    }

    /// A supervisor spent `kind`'s restart budget and escalated (or gave up starting it).
    pub fn restart_budget_exhausted(&self, kind: ActorKind) {
        self.inner
            .restart_budget_exhausted
            .with_label_values(&[kind.as_label()])
            .inc();
    }

    /// Sets `continuum_router_build_info{version, features} 1` (the only series of the family).
    /// Both values are compile-time constants of the binary, never input.
    pub fn set_build_info(&self, version: &'static str, features: &'static str) {
        self.inner.build_info.reset();
        self.inner
            .build_info
            .with_label_values(&[version, features])
            .set(1);
    }
}

impl Inner {
    fn preinitialise(&self) {
        for kind in DiscoveryEventKind::ALL {
            self.discovery_events.with_label_values(&[kind.as_label()]);
        }
        self.discovery_connected.set(0);
        for result in LoadEventResult::ALL {
            self.load_events.with_label_values(&[result.as_label()]);
        }
        for state in SubscriptionState::ALL {
            for transport in SubscriptionTransport::ALL {
                let labels = [state.as_label(), transport.as_label()];
                self.load_subscriptions.with_label_values(&labels);
                self.kv_subscriptions.with_label_values(&labels);
            }
        }
        for role in SelectionRole::ALL {
            for reason in SelectionReason::ALL {
                self.selection
                    .with_label_values(&[role.as_label(), reason.as_label()]);
            }
        }
        for result in KvEventResult::ALL {
            self.kv_events.with_label_values(&[result.as_label()]);
        }
        for result in KvSelectionResult::ALL {
            self.kv_selection.with_label_values(&[result.as_label()]);
        }
        for result in KvArtifactResult::ALL {
            self.kv_artifacts.with_label_values(&[result.as_label()]);
        }
        for path in RoutingPath::ALL {
            self.disaggregated_requests
                .with_label_values(&[path.as_label()]);
        }
        for phase in DisaggregatedPhase::ALL {
            self.disaggregated_errors
                .with_label_values(&[phase.as_label()]);
        }
        for ingress in MidStreamIngress::ALL {
            for reason in MidStreamReason::ALL {
                for result in MidStreamResult::ALL {
                    let labels = [ingress.as_label(), reason.as_label(), result.as_label()];
                    self.mid_stream_fallback.with_label_values(&labels);
                }
            }
        }
        for kind in ActorKind::ALL {
            self.actor_restarts.with_label_values(&[kind.as_label()]);
            self.restart_budget_exhausted
                .with_label_values(&[kind.as_label()]);
        }
        for reason in ReloadRefusal::ALL {
            self.config_reload_refusals
                .with_label_values(&[reason.as_label()]);
        }
    }

    fn remove_worker_series(&self, worker: &WorkerKey, ranks: &BTreeSet<DpRank>) {
        let namespace = worker.namespace.as_str();
        let hex = worker.instance_id.hex();
        for rank in ranks {
            let rank = rank.to_string();
            let labels = [namespace, hex.as_str(), rank.as_str()];
            for vec in [
                &self.worker_active_decode_blocks,
                &self.worker_active_prefill_tokens,
                &self.worker_kv_used_blocks,
            ] {
                // A nil field never had a series; nothing to remove then.
                let _ = vec.remove_label_values(&labels);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use continuum_protocol::ids::InstanceId;
    use opentelemetry::KeyValue;

    use super::*;

    fn metrics() -> Metrics {
        Metrics::new("continuum-router-test").expect("families register once")
    }

    fn worker(ns: &str, id: u64) -> WorkerKey {
        WorkerKey {
            namespace: Namespace::new(ns),
            instance_id: InstanceId(id),
        }
    }

    /// Every closed label value is a valid, unique, snake-case Prometheus label value.
    fn check_closed<T: Copy + fmt::Debug>(all: &[T], label: impl Fn(T) -> &'static str) {
        let mut seen = BTreeSet::new();
        for value in all {
            let text = label(*value);
            assert!(
                !text.is_empty()
                    && text
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{value:?} -> {text:?}"
            );
            assert!(seen.insert(text), "duplicate label {text:?}");
        }
    }

    #[test]
    fn label_sets_are_closed_and_unique() {
        check_closed(&DiscoveryEventKind::ALL, DiscoveryEventKind::as_label);
        check_closed(WorkerRole::ALL, WorkerRole::as_label);
        check_closed(&LoadEventResult::ALL, LoadEventResult::as_label);
        check_closed(SubscriptionState::ALL, SubscriptionState::as_label);
        check_closed(SubscriptionTransport::ALL, SubscriptionTransport::as_label);
        check_closed(&SelectionRole::ALL, SelectionRole::as_label);
        check_closed(&SelectionReason::ALL, SelectionReason::as_label);
        check_closed(&KvEventResult::ALL, KvEventResult::as_label);
        check_closed(KvParityResult::ALL, KvParityResult::as_label);
        check_closed(KvSelectionResult::ALL, KvSelectionResult::as_label);
        check_closed(KvArtifactResult::ALL, KvArtifactResult::as_label);
        check_closed(RoutingPath::ALL, RoutingPath::as_label);
        check_closed(DisaggregatedPhase::ALL, DisaggregatedPhase::as_label);
        check_closed(ActorKind::ALL, ActorKind::as_label);
        check_closed(ReloadRefusal::ALL, ReloadRefusal::as_label);
    }

    /// The label values the seed names verbatim are spelled exactly so.
    #[test]
    fn seed_label_values_are_spelled_as_the_seed() {
        fn of<T: Copy>(all: &[T], label: fn(T) -> &'static str) -> BTreeSet<&'static str> {
            all.iter().map(|v| label(*v)).collect()
        }
        let labels = |all: &[&'static str]| all.iter().copied().collect::<BTreeSet<_>>();
        let kinds = of(&DiscoveryEventKind::ALL, DiscoveryEventKind::as_label);
        for kind in ["duplicate", "restart", "refused", "mismatch", "malformed"] {
            assert!(kinds.contains(kind), "{kind}");
        }
        let load = of(&LoadEventResult::ALL, LoadEventResult::as_label);
        for result in [
            "malformed",
            "unknown_version",
            "topic_mismatch",
            "oversized",
            "identity_mismatch",
            "over_capacity",
            "transport_refused",
        ] {
            assert!(load.contains(result), "{result}");
        }
        let kv_selection = of(KvSelectionResult::ALL, KvSelectionResult::as_label);
        assert_eq!(
            kv_selection,
            labels(&[
                "overlap",
                "no_overlap",
                "tokenizer_unavailable",
                "prompt_too_large",
                "render_unavailable",
                "artifact_unpinned",
                "bypass"
            ])
        );
        let states = of(SubscriptionState::ALL, SubscriptionState::as_label);
        assert_eq!(
            states,
            labels(&["pending", "connecting", "connected", "backoff"])
        );
    }

    #[test]
    fn build_info_and_budget_families_export() {
        let metrics = metrics();
        metrics.set_build_info("9.9.9", "real-peers");
        metrics.set_build_info("1.2.3", "none");
        let text = metrics.render();
        assert!(text.contains(r#"continuum_router_build_info{features="none",version="1.2.3"} 1"#));
        assert!(!text.contains("9.9.9"), "one build_info series only");
        metrics.restart_budget_exhausted(ActorKind::Discovery);
        assert_eq!(
            metrics.value(
                "continuum_actor_restart_budget_exhausted_total",
                &[("actor", "discovery")]
            ),
            Some(1.0)
        );
    }

    #[test]
    fn render_contains_every_family_preinitialised() {
        let metrics = metrics();
        let text = metrics.render();
        for family in [
            "continuum_dynamo_discovery_events_total",
            "continuum_dynamo_discovery_connected",
            "continuum_dynamo_load_events_total",
            "continuum_dynamo_load_subscriptions",
            "continuum_dynamo_selection_total",
            "continuum_dynamo_kv_subscriptions",
            "continuum_dynamo_kv_events_total",
            "continuum_dynamo_kv_selection_total",
            "continuum_dynamo_kv_artifacts_total",
            "disaggregated_requests_total",
            "disaggregated_errors_total",
            "continuum_actor_restarts_total",
            "continuum_config_reload_refusals_total",
            "continuum_actor_restart_budget_exhausted_total",
        ] {
            assert!(text.contains(&format!("# TYPE {family} ")), "{family}");
        }
        assert!(text.contains(r#"continuum_dynamo_discovery_events_total{kind="duplicate"} 0"#));
        assert!(text.contains(
            r#"continuum_dynamo_kv_subscriptions{state="backoff",transport="broker"} 0"#
        ));
        assert!(text.contains(r#"continuum_actor_restarts_total{actor="subscription"} 0"#));
        assert_eq!(
            metrics.value(
                "continuum_dynamo_selection_total",
                &[("role", "prefill"), ("reason", "no_prefill_pool")]
            ),
            Some(0.0)
        );
        // Families whose labels are fleet-bound have no series until the fleet is seen.
        assert!(!text.contains("continuum_dynamo_worker_kv_used_blocks{"));
        assert!(!text.contains("continuum_dynamo_workers{"));
    }

    /// The kv-events result labels are exactly those the metric had before the enums merged.
    #[test]
    fn kv_event_labels_are_unchanged_and_parity_series_leave_with_their_model() {
        let labels: BTreeSet<&str> = KvEventResult::ALL.iter().map(|r| r.as_label()).collect();
        let expected: BTreeSet<&str> = [
            "applied",
            "replay",
            "gap",
            "other_tier",
            "malformed",
            "unknown_version",
            "topic_mismatch",
            "oversized",
            "identity_mismatch",
            "over_capacity",
            "transport_refused",
            "cache_owner",
            "orphan",
        ]
        .into_iter()
        .collect();
        assert_eq!(labels, expected);
        let metrics = metrics();
        metrics.kv_hash_parity("m", KvParityResult::Match);
        metrics.kv_hash_parity("m", KvParityResult::Mismatch);
        metrics.kv_hash_parity("n", KvParityResult::Match);
        let v = |model: &str, result: &str| {
            metrics.value(
                "continuum_dynamo_kv_hash_parity_total",
                &[("model", model), ("result", result)],
            )
        };
        assert_eq!(v("m", "mismatch"), Some(1.0));
        metrics.remove_kv_hash_parity_model("m");
        assert_eq!(v("m", "match"), None);
        assert_eq!(v("m", "mismatch"), None);
        assert_eq!(v("n", "match"), Some(1.0));
    }

    #[test]
    fn counters_and_gauges_move_by_typed_labels() {
        let metrics = metrics();
        metrics.discovery_event(DiscoveryEventKind::Duplicate);
        metrics.discovery_event(DiscoveryEventKind::Duplicate);
        metrics.set_discovery_connected(true);
        metrics.load_events(LoadEventResult::Applied, 5);
        metrics.selection(SelectionRole::Decode, SelectionReason::RoundRobinStale);
        metrics.kv_event(KvEventResult::Gap);
        metrics.kv_selection(KvSelectionResult::Bypass);
        metrics.kv_artifact(KvArtifactResult::Unpinned);
        metrics.disaggregated_request(RoutingPath::Disaggregated);
        metrics.disaggregated_error(DisaggregatedPhase::Orchestration);
        metrics.actor_restart(ActorKind::Discovery);
        metrics.set_load_subscriptions(
            SubscriptionState::Connected,
            SubscriptionTransport::Direct,
            3,
        );
        metrics.set_workers(&Namespace::new("dynamo"), WorkerRole::Decode, 2);

        let v = |family: &str, labels: &[(&str, &str)]| metrics.value(family, labels);
        assert_eq!(
            v(
                "continuum_dynamo_discovery_events_total",
                &[("kind", "duplicate")]
            ),
            Some(2.0)
        );
        assert_eq!(v("continuum_dynamo_discovery_connected", &[]), Some(1.0));
        assert_eq!(
            v(
                "continuum_dynamo_load_events_total",
                &[("result", "applied")]
            ),
            Some(5.0)
        );
        assert_eq!(
            v(
                "continuum_dynamo_selection_total",
                &[("role", "decode"), ("reason", "round_robin_stale")]
            ),
            Some(1.0)
        );
        assert_eq!(
            v("continuum_dynamo_kv_events_total", &[("result", "gap")]),
            Some(1.0)
        );
        assert_eq!(
            v(
                "continuum_dynamo_kv_selection_total",
                &[("result", "bypass")]
            ),
            Some(1.0)
        );
        assert_eq!(
            v(
                "continuum_dynamo_kv_artifacts_total",
                &[("result", "unpinned")]
            ),
            Some(1.0)
        );
        assert_eq!(
            v(
                "disaggregated_requests_total",
                &[("routing_path", "disaggregated")]
            ),
            Some(1.0)
        );
        assert_eq!(
            v("disaggregated_errors_total", &[("phase", "orchestration")]),
            Some(1.0)
        );
        assert_eq!(
            v("continuum_actor_restarts_total", &[("actor", "discovery")]),
            Some(1.0)
        );
        assert_eq!(
            v(
                "continuum_dynamo_load_subscriptions",
                &[("state", "connected"), ("transport", "direct")]
            ),
            Some(3.0)
        );
        assert_eq!(
            v(
                "continuum_dynamo_workers",
                &[("namespace", "dynamo"), ("role", "decode")]
            ),
            Some(2.0)
        );
        metrics.remove_workers_namespace(&Namespace::new("dynamo"));
        assert_eq!(
            v(
                "continuum_dynamo_workers",
                &[("namespace", "dynamo"), ("role", "decode")]
            ),
            None
        );
    }

    #[test]
    fn worker_gauges_export_present_fields_and_are_removed_on_departure() {
        let metrics = metrics();
        let a = worker("dynamo", 0x1a7f2b);
        let b = worker("dynamo", 0xbeef);
        metrics.set_worker_load(
            &a,
            DpRank(0),
            WorkerLoadGauges {
                active_decode_blocks: Some(7),
                active_prefill_tokens: None,
                kv_used_blocks: Some(9),
            },
        );
        metrics.set_worker_load(
            &a,
            DpRank(1),
            WorkerLoadGauges {
                active_decode_blocks: Some(1),
                ..WorkerLoadGauges::default()
            },
        );
        metrics.set_worker_load(
            &b,
            DpRank(0),
            WorkerLoadGauges {
                kv_used_blocks: Some(u64::MAX),
                ..WorkerLoadGauges::default()
            },
        );
        let labels = |w: &str, r: &'static str| {
            [("namespace", "dynamo"), ("worker", w), ("dp_rank", r)].map(|(k, v)| (k, v.to_owned()))
        };
        let v = |family: &str, w: &str, r: &'static str| {
            let owned = labels(w, r);
            let pairs: Vec<(&str, &str)> = owned.iter().map(|(k, v)| (*k, v.as_str())).collect();
            metrics.value(family, &pairs)
        };
        assert_eq!(
            v(
                "continuum_dynamo_worker_active_decode_blocks",
                "1a7f2b",
                "0"
            ),
            Some(7.0)
        );
        assert_eq!(
            v("continuum_dynamo_worker_kv_used_blocks", "1a7f2b", "0"),
            Some(9.0)
        );
        // A nil field exports no series.
        assert_eq!(
            v(
                "continuum_dynamo_worker_active_prefill_tokens",
                "1a7f2b",
                "0"
            ),
            None
        );
        assert_eq!(
            v(
                "continuum_dynamo_worker_active_decode_blocks",
                "1a7f2b",
                "1"
            ),
            Some(1.0)
        );
        // u64 beyond i64 saturates instead of wrapping negative.
        assert_eq!(
            v("continuum_dynamo_worker_kv_used_blocks", "beef", "0"),
            Some(i64::MAX as f64)
        );

        // A later sample with the field now nil removes that series.
        metrics.set_worker_load(
            &a,
            DpRank(0),
            WorkerLoadGauges {
                active_decode_blocks: Some(8),
                ..WorkerLoadGauges::default()
            },
        );
        assert_eq!(
            v("continuum_dynamo_worker_kv_used_blocks", "1a7f2b", "0"),
            None
        );
        assert_eq!(
            v(
                "continuum_dynamo_worker_active_decode_blocks",
                "1a7f2b",
                "0"
            ),
            Some(8.0)
        );

        metrics.remove_worker(&a);
        assert_eq!(
            v(
                "continuum_dynamo_worker_active_decode_blocks",
                "1a7f2b",
                "0"
            ),
            None
        );
        assert_eq!(
            v(
                "continuum_dynamo_worker_active_decode_blocks",
                "1a7f2b",
                "1"
            ),
            None
        );
        assert_eq!(
            v("continuum_dynamo_worker_kv_used_blocks", "beef", "0"),
            Some(i64::MAX as f64)
        );

        metrics.retain_workers(|key| key != &b);
        assert!(!metrics.render().contains("worker=\"beef\""));
        // Removing an unknown worker is a no-op, not a panic.
        metrics.remove_worker(&worker("other", 1));
    }

    #[test]
    fn opentelemetry_instruments_export_into_the_same_registry() {
        let metrics = metrics();
        let counter = metrics
            .meter("continuum.test")
            .u64_counter("continuum_otel_probe")
            .with_description("A probe counter.")
            .build();
        counter.add(3, &[KeyValue::new("probe", "yes")]);
        let text = metrics.render();
        assert!(text.contains("continuum_otel_probe_total{"), "{text}");
        assert!(
            text.contains(r#"otel_scope_name="continuum.test""#),
            "{text}"
        );
        assert!(text.contains("} 3"), "{text}");
        assert!(
            text.contains(r#"service_name="continuum-router-test""#),
            "target_info carries the service name: {text}"
        );
        // The native families are still there beside the OpenTelemetry ones.
        assert!(text.contains("continuum_dynamo_discovery_connected 0"));
    }

    #[test]
    fn clones_share_one_registry() {
        let metrics = metrics();
        let clone = metrics.clone();
        clone.actor_restart(ActorKind::Root);
        assert_eq!(
            metrics.value("continuum_actor_restarts_total", &[("actor", "root")]),
            Some(1.0)
        );
    }
}
