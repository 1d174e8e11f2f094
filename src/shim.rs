//! Direct-mode shim routing: for one request, pick the (prefill, decode) ranks of a Dynamo fleet
//! and name the namespace's shim pool to send it to, with the pins as decimal `x-dynamo-*`
//! headers (`dynamo.frontend --router-mode direct` executes the two-phase handoff).
//!
//! Every decision is `protocol`'s: candidates come from `picker::candidates` (rebuilt once per
//! registry generation by the `PickerActor`, or by the first request that races ahead of it), load
//! from the shared store through a `LoadView` adapter, and the pick from the pluggable
//! `DynamoWorkerPicker` (`picker()` / `set_picker()`).
//!
//! The decision itself is one synchronous critical section: the load-store lock, then the
//! picker-state lock of the shared [`DynamoPicker`] handle (the order every holder of both
//! takes). It does not go through the `PickerActor`'s mailbox: a ractor round trip costs more
//! than the decision (see docs/runtime-semantics.md, "Picker state").

use std::sync::Arc;

use arc_swap::ArcSwap;
use continuum_actors::clock::now_tick;
use continuum_actors::load::DynamoLoadStore;
use continuum_actors::metrics::{Metrics, RoutingPath};
use continuum_actors::picker::{DynamoPicker, answer_arrivals};
use continuum_actors::registry::DynamoRegistry;
use continuum_protocol::ids::{DpRank, Namespace, WorkerKey};
use continuum_protocol::load_store::LoadStore;
use continuum_protocol::picker::candidates::sample_state;
use continuum_protocol::picker::estimate::estimate_prompt_tokens;
use continuum_protocol::picker::ledger::DispatchId;
use continuum_protocol::picker::{
    DynamoWorkerPicker, LoadView, PickOutcome, PickRequest, SampleState,
};
use continuum_protocol::time::Tick;
use tracing::debug;

use crate::config::Config;
use crate::proxy::Dispatch;

/// Where and how to send one request through a shim.
#[derive(Debug)]
pub struct ShimDecision {
    /// The namespace's shim replicas (backend names), already filtered by key policy and health.
    pub pool: Vec<String>,
    pub dispatch: Dispatch,
    pub path: RoutingPath,
    /// The ledger entry of this pick, to end when the response does.
    pub dispatch_id: Option<DispatchId>,
}

/// Ends a dispatch in the picker's ledger when dropped: a request that has ended (answered,
/// refused, failed or cancelled) may never have reached an engine, so it must not make its worker
/// look stalled.
pub struct DispatchGuard {
    router: Arc<ShimRouter>,
    id: DispatchId,
}

impl DispatchGuard {
    pub fn new(router: Arc<ShimRouter>, id: DispatchId) -> Self {
        Self { router, id }
    }
}

impl Drop for DispatchGuard {
    fn drop(&mut self) {
        self.router.request_ended(self.id);
    }
}

/// The Dynamo routing state shared by every request.
pub struct ShimRouter {
    config: Arc<ArcSwap<Config>>,
    registry: DynamoRegistry,
    load: DynamoLoadStore,
    /// Installed picker, candidate index, ledger and cursors, shared with the `PickerActor`.
    picker: DynamoPicker,
    metrics: Option<Metrics>,
}

impl std::fmt::Debug for ShimRouter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShimRouter").finish_non_exhaustive()
    }
}

/// The load store as the picker reads it: fresh while younger than `max_staleness`.
/// Borrows the store under the one lock a decision takes: no per-rank locking or cloning.
struct StoreView<'a> {
    store: &'a LoadStore,
    now: Tick,
    max_age: std::time::Duration,
}

impl LoadView for StoreView<'_> {
    fn sample(&self, worker: &WorkerKey, rank: DpRank) -> SampleState {
        let sample = self.store.latest(worker.instance_id, rank);
        sample_state(sample, self.now, self.max_age)
    }
}

impl ShimRouter {
    /// A router with its own picker state (no `PickerActor` maintains it: requests rebuild the
    /// index, answer arrivals and expire the ledger themselves).
    pub fn new(
        config: Arc<ArcSwap<Config>>,
        registry: DynamoRegistry,
        load: DynamoLoadStore,
        metrics: Option<Metrics>,
    ) -> Self {
        Self::with_picker(config, registry, load, DynamoPicker::new(), metrics)
    }

    /// A router over the picker state a `PickerActor` maintains (the daemon's wiring).
    pub fn with_picker(
        config: Arc<ArcSwap<Config>>,
        registry: DynamoRegistry,
        load: DynamoLoadStore,
        picker: DynamoPicker,
        metrics: Option<Metrics>,
    ) -> Self {
        Self {
            config,
            registry,
            load,
            picker,
            metrics,
        }
    }

    /// A dispatch ended (its response finished or failed).
    pub fn request_ended(&self, id: DispatchId) {
        self.picker.request_ended(id);
    }

    /// The active picker.
    pub fn picker(&self) -> Arc<dyn DynamoWorkerPicker> {
        self.picker.picker()
    }

    /// Replaces the picker (the KV-aware picker plugs in here).
    pub fn set_picker(&self, picker: Arc<dyn DynamoWorkerPicker>) {
        self.picker.set_picker(picker);
    }

    /// The shared picker state (admin view, the `PickerActor`).
    pub fn picker_state(&self) -> &DynamoPicker {
        &self.picker
    }

    /// Picks workers for a request of `client_model` whose outbound body is `body`. `usable`
    /// tells whether a backend replica is healthy and admitted. `None` means the Dynamo path does
    /// not apply (disabled, no usable shim replica, or no worker serves the model): the caller
    /// routes normally.
    pub fn decide(
        &self,
        client_model: &str,
        body: &[u8],
        allowed: &[String],
        usable: impl Fn(&str) -> bool,
    ) -> Option<ShimDecision> {
        let config = self.config.load();
        if !config.dynamo.enabled || !config.disaggregated_serving.enabled {
            return None;
        }
        let shim = &config.dynamo.shim;
        let permitted = |name: &&String| allowed.is_empty() || allowed.contains(name);
        let pool_of = |ns: &Namespace| -> Vec<String> {
            shim.backends_for(ns.as_str())
                .iter()
                .filter(permitted)
                .filter(|name| usable(name))
                .cloned()
                .collect()
        };
        // Only namespaces with a usable, permitted replica are offered to the picker.
        let mut eligible = config.dynamo.discovery.namespaces();
        eligible.retain(|ns| {
            shim.backends_for(ns.as_str())
                .iter()
                .filter(permitted)
                .any(|name| usable(name))
        });
        if eligible.is_empty() {
            return None;
        }
        let model = shim
            .model_map
            .get(client_model)
            .map(String::as_str)
            .unwrap_or(client_model);
        let held = self.picker.index_for(&self.registry);
        let candidates = held.index.for_model(model);
        if candidates.is_empty() {
            return None;
        }
        let now = now_tick();
        let request = PickRequest {
            model,
            eligible_namespaces: &eligible,
            estimated_prompt_tokens: estimate_tokens(body),
            load_signals: self.registry.snapshot().signals().load,
        };
        let picker = self.picker.picker();
        let max_age = config.dynamo.load.max_staleness.get();
        // One load-store lock for the whole decision (order: load store, then picker state).
        let outcome = self.load.with(|store| {
            self.picker.with_state(|state| {
                // Samples that arrived since earlier dispatches answer them (the PickerActor does
                // this on every store change; a request racing ahead of it catches up here).
                answer_arrivals(&mut state.ledger, store);
                state.ledger.expire(now);
                let view = StoreView {
                    store,
                    now,
                    max_age,
                };
                picker.pick(&request, candidates, &view, state, now)
            })
        });
        let pick = match outcome {
            PickOutcome::Picked(pick) => pick,
            PickOutcome::NoCandidates(why) => {
                debug!(
                    model,
                    reason = why.as_label(),
                    "No Dynamo worker for the request; routing normally."
                );
                return None;
            }
        };
        if let Some(metrics) = &self.metrics {
            metrics.selection(
                continuum_protocol::picker::Phase::Decode,
                pick.reasons.decode,
            );
            metrics.selection(
                continuum_protocol::picker::Phase::Prefill,
                pick.reasons.prefill,
            );
        }
        let pool = pool_of(&pick.namespace);
        let dispatch = Dispatch::pins(
            pick.decode.worker.instance_id,
            pick.decode.rank_header(),
            pick.prefill
                .as_ref()
                .map(|p| (p.worker.instance_id, p.rank_header())),
        );
        let path = if pick.prefill.is_some() {
            RoutingPath::Disaggregated
        } else {
            RoutingPath::Aggregated
        };
        Some(ShimDecision {
            pool,
            dispatch,
            path,
            dispatch_id: pick.dispatch,
        })
    }
}

/// The coarse prompt-size estimate from a chat (`messages[].content`) or completions (`prompt`)
/// body; no tokenizer.
pub fn estimate_tokens(body: &[u8]) -> u64 {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(body) else {
        return 0;
    };
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

/// What a direct-mode frontend says when a disaggregated request lacks a prefill pin
/// (`DIRECT_MODE_PREFILL_ID_ERROR`). Dynamo 1.6.1 logs it and answers a generic 500, which then
/// takes the decode-failure arm; a release that puts it in the body gets the 503.
pub const DIRECT_MODE_PREFILL_ID_ERROR: &str = "Prefill worker ID required in Direct routing mode";

/// Whether a buffered shim answer is the direct-mode prefill refusal.
pub fn is_prefill_id_refusal(body: &[u8]) -> bool {
    body.windows(DIRECT_MODE_PREFILL_ID_ERROR.len())
        .any(|w| w == DIRECT_MODE_PREFILL_ID_ERROR.as_bytes())
}

/// On a stream, only these heads (and transport failures) fall back; other 4xx are relayed.
pub fn falls_back_on_stream(status: http::StatusCode) -> bool {
    status.is_server_error()
        || status == http::StatusCode::TOO_MANY_REQUESTS
        || status == http::StatusCode::REQUEST_TIMEOUT
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_refusal_is_recognised_in_a_body() {
        let body =
            br#"{"message":"Prefill worker ID required in Direct routing mode but none found"}"#;
        assert!(is_prefill_id_refusal(body));
        assert!(!is_prefill_id_refusal(
            br#"{"message":"Failed to generate completions"}"#
        ));
    }

    #[test]
    fn streams_fall_back_only_on_5xx_429_408() {
        for code in [500, 502, 503, 429, 408] {
            assert!(falls_back_on_stream(
                http::StatusCode::from_u16(code).expect("code")
            ));
        }
        for code in [400, 401, 404, 422] {
            assert!(!falls_back_on_stream(
                http::StatusCode::from_u16(code).expect("code")
            ));
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
