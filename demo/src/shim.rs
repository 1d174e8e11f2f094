//! A simulated `dynamo.frontend --router-mode direct` for one namespace of the simulated fleet.
//!
//! It answers as Dynamo 1.6.1 does (dynamo-live §6, `fixtures/dynamo-1.6.1/transcripts`): pins
//! come from `x-dynamo-worker-instance-id` / `x-dynamo-prefill-instance-id` (and the 1.6.1
//! aliases), parsed as `trim().parse::<u64>()` so hex or garbage counts as absent; ranks from
//! `x-dynamo-dp-rank` / `x-dynamo-prefill-dp-rank`. In a namespace with prefill workers a missing
//! prefill id is a generic 500, an unknown prefill id or a missing/unknown decode id a 400 (after
//! the prefill ran, as upstream does); in an aggregated namespace a missing or unknown worker id
//! is a 400 and the prefill header is ignored. A model the namespace does not serve is a 404
//! with an empty body.
//!
//! Served requests book their prompt on the prefill rank and their KV blocks on the decode rank,
//! so the workers' published load rises and falls with the traffic; every request is logged
//! with the workers that served it and recorded in a bounded journal ([`ShimState::served`]).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use continuum_protocol::discovery::registration::WorkerType;
use continuum_protocol::ids::{DpRank, InstanceId};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tracing::{debug, error};

use crate::fleet::{Fleet, RankLoad, SimWorker};

mod reply;

use reply::{Reply, stream_reply};

/// Journal entries kept per frontend (oldest dropped first).
pub const MAX_JOURNAL: usize = 4096;
/// Largest request body read.
const MAX_BODY: usize = 1024 * 1024;
/// Completion tokens when the request names none.
const DEFAULT_MAX_TOKENS: u64 = 8;
/// The most tokens a simulated answer has: a larger `max_tokens` is capped (the demo's banner
/// says so, and the capped request is logged at debug).
pub const MAX_TOKENS: u64 = 64;

/// 1.6.1's header names and aliases (dynamo-wire §14.1).
const WORKER_HEADERS: [&str; 2] = ["x-dynamo-worker-instance-id", "x-worker-instance-id"];
const PREFILL_HEADERS: [&str; 2] = ["x-dynamo-prefill-instance-id", "x-prefill-instance-id"];
const RANK_HEADERS: [&str; 3] = ["x-dynamo-dp-rank", "x-dp-rank", "x-data-parallel-rank"];
const PREFILL_RANK_HEADERS: [&str; 2] = ["x-dynamo-prefill-dp-rank", "x-prefill-dp-rank"];

/// How long simulated work takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pace {
    /// A prefill's fixed cost.
    pub prefill: Duration,
    /// Time between two generated tokens.
    pub per_token: Duration,
}

impl Default for Pace {
    fn default() -> Self {
        Self {
            prefill: Duration::from_millis(20),
            per_token: Duration::from_millis(25),
        }
    }
}

/// Which OpenAI route a request came on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    ChatCompletions,
    Completions,
}

/// One journal entry: a request this frontend answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServedRequest {
    /// The response `id` the client saw (`chatcmpl-…` / `cmpl-…`), empty when refused.
    pub response_id: String,
    pub namespace: String,
    pub route: Route,
    pub stream: bool,
    pub status: u16,
    /// The decode (or aggregated) worker and rank that served it.
    pub decode: Option<(InstanceId, DpRank)>,
    /// The prefill worker and rank, in a disaggregated namespace.
    pub prefill: Option<(InstanceId, DpRank)>,
}

/// Shared state of one simulated frontend.
pub struct ShimState {
    namespace: String,
    model: String,
    fleet: Arc<Fleet>,
    pace: Pace,
    counter: AtomicU64,
    journal: Mutex<VecDeque<ServedRequest>>,
}

impl std::fmt::Debug for ShimState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShimState")
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

impl ShimState {
    /// Every request answered so far (at most [`MAX_JOURNAL`], oldest first).
    pub fn served(&self) -> Vec<ServedRequest> {
        self.journal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    fn record(&self, entry: ServedRequest) {
        let mut journal = self.journal.lock().unwrap_or_else(|p| p.into_inner());
        if journal.len() >= MAX_JOURNAL {
            journal.pop_front();
        }
        journal.push_back(entry);
    }

    fn disaggregated(&self) -> bool {
        self.fleet
            .in_namespace(&self.namespace)
            .any(|w| w.worker_type() == WorkerType::Prefill)
    }

    fn worker(&self, id: InstanceId, types: &[WorkerType]) -> Option<&Arc<SimWorker>> {
        self.fleet
            .in_namespace(&self.namespace)
            .find(|w| w.instance_id == id && types.contains(&w.worker_type()))
    }
}

/// A running simulated frontend.
pub struct ShimServer {
    state: Arc<ShimState>,
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for ShimServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShimServer")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl ShimServer {
    /// Serves the frontend of `namespace` (model `model`) on `listener`.
    pub fn start(
        listener: TcpListener,
        namespace: &str,
        model: &str,
        fleet: Arc<Fleet>,
        pace: Pace,
    ) -> std::io::Result<Self> {
        let addr = listener.local_addr()?;
        let state = Arc::new(ShimState {
            namespace: namespace.to_owned(),
            model: model.to_owned(),
            fleet,
            pace,
            counter: AtomicU64::new(0),
            journal: Mutex::new(VecDeque::new()),
        });
        let app = Router::new()
            .route("/health", get(health))
            .route("/v1/models", get(models))
            .route(
                "/v1/chat/completions",
                post(|s: State<Arc<ShimState>>, h: HeaderMap, b: Bytes| {
                    generate(s, h, b, Route::ChatCompletions)
                }),
            )
            .route(
                "/v1/completions",
                post(|s: State<Arc<ShimState>>, h: HeaderMap, b: Bytes| {
                    generate(s, h, b, Route::Completions)
                }),
            )
            .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
            .with_state(state.clone());
        let task = tokio::spawn(async move {
            if let Err(error) = axum::serve(listener, app).await {
                error!(%error, "The simulated Dynamo frontend stopped.");
            }
        });
        Ok(Self { state, addr, task })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn state(&self) -> &Arc<ShimState> {
        &self.state
    }
}

impl Drop for ShimServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn health() -> impl IntoResponse {
    axum::Json(json!({"status": "healthy"}))
}

async fn models(State(state): State<Arc<ShimState>>) -> impl IntoResponse {
    axum::Json(json!({
        "object": "list",
        "data": [{"id": state.model, "object": "model", "created": unix_secs(), "owned_by": "nvidia"}],
    }))
}

fn unix_secs() -> u64 {
    continuum_actors::clock::now_unix().0 / 1000
}

/// A header's value as 1.6.1 reads it: `trim().parse::<u64>()`, anything else is absent.
fn header_u64(headers: &HeaderMap, names: &[&str]) -> Option<u64> {
    names.iter().find_map(|name| {
        headers
            .get(*name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
    })
}

fn header_rank(headers: &HeaderMap, names: &[&str]) -> DpRank {
    DpRank(
        header_u64(headers, names)
            .and_then(|r| u32::try_from(r).ok())
            .unwrap_or(0),
    )
}

fn failed_500() -> Response {
    (
        StatusCode::INTERNAL_SERVER_ERROR,
        axum::Json(json!({"message": "Failed to generate completions", "type": "Internal Server Error", "code": 500})),
    )
        .into_response()
}

fn invalid_400() -> Response {
    (
        StatusCode::BAD_REQUEST,
        axum::Json(json!({"message": "Invalid request", "type": "Bad Request", "code": 400})),
    )
        .into_response()
}

/// What a parsed request asks for.
struct Ask {
    stream: bool,
    prompt_tokens: u64,
    max_tokens: u64,
}

fn parse(body: &[u8], route: Route) -> Option<(String, Ask)> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let model = value.get("model")?.as_str()?.to_owned();
    let max_tokens = value
        .get("max_tokens")
        .or_else(|| value.get("max_completion_tokens"))
        .and_then(Value::as_u64)
        .unwrap_or(DEFAULT_MAX_TOKENS);
    if max_tokens > MAX_TOKENS {
        debug!(
            asked = max_tokens,
            cap = MAX_TOKENS,
            "Simulated frontend caps max_tokens."
        );
    }
    let max_tokens = max_tokens.clamp(1, MAX_TOKENS);
    let prompt = match route {
        Route::ChatCompletions => value.get("messages")?.to_string(),
        Route::Completions => value.get("prompt")?.to_string(),
    };
    Some((
        model,
        Ask {
            stream: value
                .get("stream")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            // About four characters a token, at least one.
            prompt_tokens: (prompt.len() as u64).div_ceil(4).max(1),
            max_tokens,
        },
    ))
}

/// The prefill leg of a disaggregated request: the pinned prefill worker must be known and own
/// the pinned rank; the prompt is booked on it for the simulated prefill time (it has run when
/// this returns, before the decode worker is checked, as upstream does). `Err` is the refusal,
/// already recorded.
async fn prefill_leg(
    state: &ShimState,
    headers: &HeaderMap,
    prompt_tokens: u64,
    mut entry: ServedRequest,
) -> Result<ServedRequest, Response> {
    let Some(prefill_id) = header_u64(headers, &PREFILL_HEADERS).map(InstanceId) else {
        error!(
            namespace = %state.namespace,
            "Prefill worker ID required in Direct routing mode but none found in request. \
             Expected prefill_worker_id to be set via x-dynamo-prefill-instance-id header by \
             external router (e.g., EPP)."
        );
        entry.status = 500;
        state.record(entry);
        return Err(failed_500());
    };
    let prefill_rank = header_rank(headers, &PREFILL_RANK_HEADERS);
    let Some(prefill) = state
        .worker(prefill_id, &[WorkerType::Prefill])
        .filter(|w| w.owns_rank(prefill_rank))
    else {
        error!(
            namespace = %state.namespace,
            "Remote prefill failed, failing request error=InvalidRequest: \
             nvext.prefill_worker_id={} does not identify a known worker",
            prefill_id.0
        );
        entry.status = 400;
        state.record(entry);
        return Err(invalid_400());
    };
    // The prefill runs before the decode worker is checked, as upstream does.
    let booking = prefill.book(
        prefill_rank,
        RankLoad {
            prefill_tokens: prompt_tokens,
            decode_blocks: prompt_tokens.div_ceil(u64::from(prefill.spec.block_size)),
        },
    );
    // Simulated engine time: the prefill booking holds published load while it "runs".
    tokio::time::sleep(state.pace.prefill).await;
    entry.prefill = Some((prefill_id, prefill_rank));
    drop(booking);
    Ok(entry)
}

async fn generate(
    State(state): State<Arc<ShimState>>,
    headers: HeaderMap,
    body: Bytes,
    route: Route,
) -> Response {
    let Some((model, ask)) = parse(&body, route) else {
        debug!("Refused a request whose body is not a valid OpenAI request.");
        return invalid_400();
    };
    if model != state.model {
        // 1.6.1 answers an unknown model with a bare 404.
        return StatusCode::NOT_FOUND.into_response();
    }
    let mut entry = ServedRequest {
        response_id: String::new(),
        namespace: state.namespace.clone(),
        route,
        stream: ask.stream,
        status: 0,
        decode: None,
        prefill: None,
    };
    let decode_id = header_u64(&headers, &WORKER_HEADERS).map(InstanceId);
    let decode_rank = header_rank(&headers, &RANK_HEADERS);
    let decode_types: &[WorkerType] = if state.disaggregated() {
        entry = match prefill_leg(&state, &headers, ask.prompt_tokens, entry).await {
            Ok(entry) => entry,
            Err(refusal) => return refusal,
        };
        &[WorkerType::Decode]
    } else {
        &[WorkerType::Aggregated, WorkerType::Decode]
    };
    let Some(decode_id) = decode_id else {
        debug!(
            namespace = %state.namespace,
            "worker ID required for {} request in Direct routing mode",
            if entry.prefill.is_some() { "decode" } else { "aggregated" }
        );
        entry.status = 400;
        state.record(entry);
        return invalid_400();
    };
    let Some(decode) = state
        .worker(decode_id, decode_types)
        .filter(|w| w.owns_rank(decode_rank))
    else {
        debug!(
            namespace = %state.namespace,
            "nvext.decode_worker_id={} does not identify a known worker",
            decode_id.0
        );
        entry.status = 400;
        state.record(entry);
        return invalid_400();
    };
    let aggregated = entry.prefill.is_none();
    let blocks = (ask.prompt_tokens + ask.max_tokens).div_ceil(u64::from(decode.spec.block_size));
    let booking = decode.book(
        decode_rank,
        RankLoad {
            // An aggregated worker prefills the prompt itself.
            prefill_tokens: if aggregated { ask.prompt_tokens } else { 0 },
            decode_blocks: blocks,
        },
    );
    let n = state.counter.fetch_add(1, Ordering::Relaxed);
    let response_id = match route {
        Route::ChatCompletions => format!("chatcmpl-{}-{n}", state.namespace),
        Route::Completions => format!("cmpl-{}-{n}", state.namespace),
    };
    entry.response_id = response_id.clone();
    entry.decode = Some((decode_id, decode_rank));
    entry.status = 200;
    let decode_load = decode.load(decode_rank);
    // Debug: one line per request would scroll the demo's banner away (RUST_LOG shows it).
    debug!(
        namespace = %state.namespace,
        request = %response_id,
        prefill_worker_id = entry.prefill.map(|(id, _)| id.0),
        prefill_dp_rank = entry.prefill.map(|(_, rank)| rank.0),
        decode_worker_id = decode_id.0,
        decode_dp_rank = decode_rank.0,
        decode_active_blocks = decode_load.decode_blocks,
        stream = ask.stream,
        "Simulated frontend is serving a request on the pinned workers."
    );
    state.record(entry);
    let reply = Reply {
        id: response_id,
        model: state.model.clone(),
        route,
        prompt_tokens: ask.prompt_tokens,
        max_tokens: ask.max_tokens,
        created: unix_secs(),
    };
    if ask.stream {
        stream_reply(reply, state.pace.per_token, booking)
    } else {
        // Simulated decode time for the whole answer, so the booking shows as load meanwhile.
        tokio::time::sleep(state.pace.per_token * ask.max_tokens as u32).await;
        drop(booking);
        axum::Json(reply.buffered()).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_parse_as_1_6_1_does() {
        let mut h = HeaderMap::new();
        h.insert("x-dynamo-worker-instance-id", " 42 ".parse().unwrap());
        h.insert("x-dynamo-prefill-instance-id", "0x2a".parse().unwrap());
        h.insert("x-dp-rank", "1".parse().unwrap());
        assert_eq!(header_u64(&h, &WORKER_HEADERS), Some(42));
        assert_eq!(header_u64(&h, &PREFILL_HEADERS), None);
        assert_eq!(header_rank(&h, &RANK_HEADERS), DpRank(1));
        assert_eq!(header_rank(&h, &PREFILL_RANK_HEADERS), DpRank(0));
    }
}
