//! The Anthropic Messages (`POST /v1/messages`, `POST /anthropic/v1/messages`) and OpenAI
//! Responses (`POST /v1/responses`, `POST /v1/responses/compact`) ingresses.
//!
//! Per request: authenticate (an Anthropic client's `x-api-key` counts as its bearer token),
//! read the bounded body, convert it to a chat-completions body
//! (`continuum_protocol::ingress`), and send that through the chat-completions pipeline
//! ([`crate::route::Router::serve`]): the same pin stripping, shim selection on the final body
//! (global prompts and system merges included), KV rendering, a fresh pin per send, retries and
//! fallbacks as `POST /v1/chat/completions`. The answer is converted back: buffered bodies whole,
//! streams event by event as the chat SSE chunks arrive. Errors, the router's own and the
//! upstream's, leave in the ingress's format (Anthropic error objects or OpenAI error objects);
//! a direct-mode refusal is the seed's 503 `disaggregated_prefill_decode_unavailable`.
//!
//! `/v1/responses` for a model served by a `responses_api: native` backend passes through
//! unconverted (route [`OpenAiRoute::Responses`]: pinned by model alone); `/v1/responses/compact`
//! always passes through, unpinned. A Messages request for a model a backend lists in
//! `responses_only_models` is converted to a Responses request and takes that same native
//! passthrough (`continuum_protocol::ingress::native`), its answer converted back.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::http_metrics::HttpRoute;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use continuum_protocol::admission::FLEET_BUSY_CODE;
use continuum_protocol::ingress::{anthropic, native, responses};
use futures::StreamExt;
use serde_json::Value;

use super::{AppState, admit};

mod sse;
use crate::proxy::OpenAiRoute;
use crate::proxy::relay::collect_bounded;
use crate::route::Caller;
pub use sse::SseDecoder;

/// Largest upstream error body read to convert it.
const MAX_ERROR_BODY_BYTES: usize = 64 * 1024;
/// Largest SSE event (all its `data:` lines) buffered from the upstream stream.
pub const MAX_SSE_EVENT_BYTES: usize = 4 * 1024 * 1024;

/// Which ingress a request arrived on: its error format and converters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Anthropic,
    Responses,
}

impl Kind {
    fn metric(self) -> HttpRoute {
        match self {
            Kind::Anthropic => HttpRoute::Messages,
            Kind::Responses => HttpRoute::Responses,
        }
    }

    /// An error in this ingress's format. `code` is the OpenAI-style code the router or the
    /// upstream gave, when known.
    fn error(self, status: StatusCode, message: &str, code: Option<&str>) -> Response {
        let refusal = code == Some(anthropic::DIRECT_MODE_REFUSAL_CODE);
        let (status, body) = match (self, refusal) {
            (Kind::Anthropic, true) => {
                let e = anthropic::direct_mode_refusal();
                (e.status, e.body())
            }
            (Kind::Responses, true) => {
                let e = responses::direct_mode_refusal();
                (e.status, responses::error_body(e.status, &e.message))
            }
            (Kind::Anthropic, false) => (
                status.as_u16(),
                anthropic::error_body(status.as_u16(), message),
            ),
            (Kind::Responses, false) => (
                status.as_u16(),
                responses::error_body(status.as_u16(), message),
            ),
        };
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
        let mut body = body;
        if code == Some(FLEET_BUSY_CODE) {
            fleet_busy(self, &mut body);
        }
        (status, axum::Json(body)).into_response()
    }

    fn refused(self, e: &anthropic::IngressError) -> Response {
        let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST);
        self.error(status, &e.message, None)
    }
}

/// The `admission` refusal (503 `fleet_busy`) in the ingress's shape: Anthropic's
/// `overloaded_error`; a Responses error object keeps the code.
fn fleet_busy(kind: Kind, body: &mut Value) {
    let (field, value) = match kind {
        Kind::Anthropic => ("type", "overloaded_error"),
        Kind::Responses => ("code", FLEET_BUSY_CODE),
    };
    if let Some(error) = body.get_mut("error").and_then(Value::as_object_mut) {
        error.insert(field.to_owned(), Value::from(value));
    }
}

/// A fresh 128-bit id for a message or response (randomly keyed hashes of a counter).
fn fresh_id() -> u128 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let state = std::collections::hash_map::RandomState::new();
    let mut a = state.build_hasher();
    a.write_u64(n);
    let mut b = state.build_hasher();
    b.write_u64(!n);
    (u128::from(a.finish()) << 64) | u128::from(b.finish())
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Admits the request as every OpenAI route is ([`super::admit`]: API key, bounded body);
/// `Err` is the refusal in the ingress's format.
async fn read_client(
    state: &AppState,
    kind: Kind,
    headers: &mut HeaderMap,
    body: Body,
) -> Result<(Caller, Bytes), Response> {
    if kind == Kind::Anthropic {
        // The Anthropic SDKs send their key as `x-api-key`; it is never forwarded.
        if let Some(key) = headers.remove("x-api-key")
            && !headers.contains_key(header::AUTHORIZATION)
            && let Ok(value) = HeaderValue::from_bytes(&[b"Bearer ", key.as_bytes()].concat())
        {
            headers.insert(header::AUTHORIZATION, value);
        }
    }
    admit(state, headers, body).await.map_err(|e| {
        let message = e.to_string();
        let status = e.into_response().status();
        kind.error(status, &message, None)
    })
}

/// Runs one ingress request and counts it in `continuum_http_requests_total` under `route`.
async fn observed(
    state: &AppState,
    route: HttpRoute,
    handle: impl std::future::Future<Output = Response>,
) -> Response {
    let started = std::time::Instant::now();
    let response = handle.await;
    state
        .route
        .observe(route, response.status(), started.elapsed());
    response
}

/// `POST /v1/messages` and `POST /anthropic/v1/messages`.
pub async fn anthropic_messages(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    observed(
        &state,
        Kind::Anthropic.metric(),
        messages(&state, headers, body),
    )
    .await
}

async fn messages(state: &AppState, mut headers: HeaderMap, body: Body) -> Response {
    let kind = Kind::Anthropic;
    let (caller, bytes) = match read_client(state, kind, &mut headers, body).await {
        Ok(read) => read,
        Err(resp) => return resp,
    };
    let limits = anthropic::Limits {
        max_body_bytes: state.route.max_request_body_bytes(),
        ..anthropic::Limits::default()
    };
    let mut req = match anthropic::messages_to_chat(&bytes, &limits) {
        Ok(req) => req,
        Err(e) => return kind.refused(&e),
    };
    let id = fresh_id();
    if state
        .route
        .proxy()
        .responses_only(&req.model, &caller.allowed_backends)
    {
        return messages_via_responses(state, headers, caller, req, id, limits).await;
    }
    let resp = send_chat(state, headers, caller, std::mem::take(&mut req.body)).await;
    if !resp.status().is_success() {
        return upstream_error(kind, resp).await;
    }
    if req.stream {
        let conv = anthropic::AnthropicStream::new(&req, id, limits);
        return stream_back(resp, Converter::Anthropic(Box::new(conv)));
    }
    let (parts, body) = resp.into_parts();
    let chat = match collect(body, limits.max_chunk_bytes).await {
        Ok(chat) => chat,
        Err(message) => return kind.error(StatusCode::BAD_GATEWAY, &message, None),
    };
    match anthropic::chat_response_to_message(&chat, &req, id, &limits) {
        Ok(message) => json_back(parts, &message),
        Err(e) => kind.refused(&e),
    }
}

/// A Messages request for a `responses_only` model: the converted chat body becomes a Responses
/// request passed through to the backend's native `/v1/responses` (route
/// [`OpenAiRoute::Responses`]: pinned by model alone, no `nvext.token_data`), and the Responses
/// answer comes back through the chat shape into a `Message` or Anthropic events.
async fn messages_via_responses(
    state: &AppState,
    mut headers: HeaderMap,
    caller: Caller,
    req: anthropic::ChatRequest,
    id: u128,
    limits: anthropic::Limits,
) -> Response {
    let kind = Kind::Anthropic;
    let body = match native::chat_to_responses(&req.body) {
        Ok(body) => body,
        Err(e) => return kind.refused(&e),
    };
    headers.remove(header::CONTENT_LENGTH);
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let resp = state
        .route
        .serve(OpenAiRoute::Responses, headers, caller, Bytes::from(body))
        .await;
    if !resp.status().is_success() {
        return upstream_error(kind, resp).await;
    }
    if req.stream {
        let chat = native::ResponsesToChat::new(limits.max_chunk_bytes);
        let conv = anthropic::AnthropicStream::new(&req, id, limits);
        return stream_back(
            resp,
            Converter::AnthropicViaResponses(Box::new((chat, conv))),
        );
    }
    let (parts, body) = resp.into_parts();
    let answer = match collect(body, limits.max_chunk_bytes).await {
        Ok(answer) => answer,
        Err(message) => return kind.error(StatusCode::BAD_GATEWAY, &message, None),
    };
    let message = native::responses_to_chat_answer(&answer, limits.max_chunk_bytes)
        .and_then(|chat| anthropic::chat_response_to_message(&chat, &req, id, &limits));
    match message {
        Ok(message) => json_back(parts, &message),
        Err(e) => kind.refused(&e),
    }
}

/// `POST /v1/responses`.
pub async fn responses(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    observed(
        &state,
        Kind::Responses.metric(),
        responses_inner(&state, headers, body),
    )
    .await
}

async fn responses_inner(state: &AppState, mut headers: HeaderMap, body: Body) -> Response {
    let kind = Kind::Responses;
    let (caller, bytes) = match read_client(state, kind, &mut headers, body).await {
        Ok(read) => read,
        Err(resp) => return resp,
    };
    let limits = responses::Limits {
        max_body_bytes: state.route.max_request_body_bytes(),
        ..responses::Limits::default()
    };
    // A model a native backend serves passes through unconverted, pinned by model alone (a body
    // that is not a JSON object naming a string model is left to the converter to refuse).
    if let Some(model) = responses::requested_model(&bytes)
        && state
            .route
            .proxy()
            .responses_native(&model, &caller.allowed_backends)
    {
        headers.remove(header::CONTENT_LENGTH);
        return state
            .route
            .serve(OpenAiRoute::Responses, headers, caller, bytes)
            .await;
    }
    let mut req = match responses::responses_to_chat(&bytes, &limits) {
        Ok(req) => req,
        Err(e) => return kind.refused(&e),
    };
    let (id, created_at) = (fresh_id(), unix_now());
    let resp = send_chat(state, headers, caller, std::mem::take(&mut req.body)).await;
    if !resp.status().is_success() {
        return upstream_error(kind, resp).await;
    }
    if req.stream {
        let conv = responses::ResponsesStream::new(&req, id, created_at, limits);
        return stream_back(resp, Converter::Responses(Box::new(conv)));
    }
    let (parts, body) = resp.into_parts();
    let chat = match collect(body, limits.max_chunk_bytes).await {
        Ok(chat) => chat,
        Err(message) => return kind.error(StatusCode::BAD_GATEWAY, &message, None),
    };
    match responses::chat_response_to_response(&chat, &req, id, created_at, &limits) {
        Ok(response) => json_back(parts, &response),
        Err(e) => kind.refused(&e),
    }
}

/// `POST /v1/responses/compact`: passed through to the model's backend without pins.
pub async fn responses_compact(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let compact = async {
        match admit(&state, &headers, body).await {
            Ok((caller, bytes)) => {
                state
                    .route
                    .serve(OpenAiRoute::ResponsesCompact, headers, caller, bytes)
                    .await
            }
            Err(error) => error.into_response(),
        }
    };
    observed(&state, HttpRoute::Responses, compact).await
}

/// The converted body through the chat-completions pipeline ([`crate::route::Router::serve`]),
/// which admits, bounds and validates it as any chat request.
async fn send_chat(
    state: &AppState,
    mut headers: HeaderMap,
    caller: Caller,
    chat: Vec<u8>,
) -> Response {
    headers.remove(header::CONTENT_LENGTH);
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let body = Bytes::from(chat);
    state
        .route
        .serve(OpenAiRoute::ChatCompletions, headers, caller, body)
        .await
}

/// Reads a whole body of at most `limit` bytes.
async fn collect(body: Body, limit: usize) -> Result<Bytes, String> {
    collect_bounded(body, limit)
        .await
        .map_err(|e| format!("the upstream response failed or exceeded {limit} bytes: {e}"))
}

/// A non-2xx answer of the chat pipeline (the router's `ApiError` or the upstream's body) in the
/// ingress's format, with the same status.
async fn upstream_error(kind: Kind, resp: Response) -> Response {
    let status = resp.status();
    let retry = resp.headers().clone();
    let bytes = collect(resp.into_body(), MAX_ERROR_BODY_BYTES)
        .await
        .unwrap_or_default();
    let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let err = v.get("error").filter(|e| e.is_object()).unwrap_or(&v);
    let message = err
        .get("message")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .unwrap_or_else(|| format!("the upstream answered {status}"));
    let code = err.get("code").and_then(Value::as_str);
    let mut converted = kind.error(status, &message, code);
    // A 429's `Retry-After` and `RateLimit` fields stay with the converted body.
    for name in RATE_LIMIT_FIELDS {
        if let Some(value) = retry.get(name) {
            converted.headers_mut().insert(name, value.clone());
        }
    }
    converted
}

/// The response fields of a 429 (the router's own or the upstream's) every ingress keeps.
const RATE_LIMIT_FIELDS: [&str; 4] = [
    "retry-after",
    "retry-after-ms",
    "ratelimit-policy",
    "ratelimit",
];

/// A converted JSON body with the pipeline's response headers (routing path, disclosed
/// identities).
fn json_back(mut parts: axum::http::response::Parts, body: &Value) -> Response {
    let bytes = Bytes::from(body.to_string());
    parts.status = StatusCode::OK;
    parts.headers.remove(header::TRANSFER_ENCODING);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    parts
        .headers
        .insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
    Response::from_parts(parts, Body::from(bytes))
}

/// The stream converters behind one interface.
enum Converter {
    Anthropic(Box<anthropic::AnthropicStream>),
    Responses(Box<responses::ResponsesStream>),
    /// A `responses_only` model's Responses events, through chat chunks, into Anthropic events.
    AnthropicViaResponses(Box<(native::ResponsesToChat, anthropic::AnthropicStream)>),
}

impl Converter {
    fn push(&mut self, data: &[u8], out: &mut Vec<u8>) {
        match self {
            Converter::Anthropic(c) => c.push(data).iter().for_each(|e| out.extend(e.to_bytes())),
            Converter::Responses(c) => c.push(data).iter().for_each(|e| out.extend(e.to_bytes())),
            Converter::AnthropicViaResponses(c) => {
                let (chat, conv) = &mut **c;
                for chunk in chat.push(data) {
                    conv.push(&chunk)
                        .iter()
                        .for_each(|e| out.extend(e.to_bytes()));
                }
            }
        }
    }

    fn finish(&mut self, out: &mut Vec<u8>) {
        match self {
            Converter::Anthropic(c) => c.finish().iter().for_each(|e| out.extend(e.to_bytes())),
            Converter::Responses(c) => c.finish().iter().for_each(|e| out.extend(e.to_bytes())),
            Converter::AnthropicViaResponses(c) => {
                c.1.finish().iter().for_each(|e| out.extend(e.to_bytes()))
            }
        }
    }

    fn is_done(&self) -> bool {
        match self {
            Converter::Anthropic(c) => c.is_done(),
            Converter::Responses(c) => c.is_done(),
            Converter::AnthropicViaResponses(c) => c.1.is_done(),
        }
    }
}

/// Converts the pipeline's chat SSE body into the ingress's event stream as it arrives.
fn stream_back(resp: Response, converter: Converter) -> Response {
    let (mut parts, body) = resp.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    parts
        .headers
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    let state = Some((
        body.into_data_stream(),
        converter,
        SseDecoder::new(MAX_SSE_EVENT_BYTES),
    ));
    let stream = futures::stream::unfold(state, |state| async move {
        let (mut frames, mut conv, mut sse) = state?;
        loop {
            let mut out = Vec::new();
            match frames.next().await {
                Some(Ok(chunk)) => {
                    match sse.push(&chunk) {
                        Ok(events) => events.iter().for_each(|d| conv.push(d, &mut out)),
                        // An oversized event: the converter ends the stream with its error.
                        Err(message) => conv.push(message.as_bytes(), &mut out),
                    }
                    if conv.is_done() {
                        return Some((Ok::<_, std::convert::Infallible>(Bytes::from(out)), None));
                    }
                    if !out.is_empty() {
                        return Some((Ok(Bytes::from(out)), Some((frames, conv, sse))));
                    }
                }
                // The upstream ended (or failed): close the stream, with an error event when no
                // finish reason was seen.
                Some(Err(_)) | None => {
                    if let Some(data) = sse.finish() {
                        conv.push(&data, &mut out);
                    }
                    conv.finish(&mut out);
                    return (!out.is_empty()).then(|| (Ok(Bytes::from(out)), None));
                }
            }
        }
    });
    Response::from_parts(parts, Body::from_stream(stream))
}

#[cfg(test)]
mod tests {
    use super::Kind;
    use axum::http::StatusCode;
    use http_body_util::BodyExt;

    async fn body_of(resp: axum::response::Response) -> (u16, serde_json::Value) {
        let status = resp.status().as_u16();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&bytes).unwrap())
    }

    #[tokio::test]
    async fn a_direct_mode_refusal_is_the_seed_503_in_both_formats() {
        let code = Some(continuum_protocol::ingress::anthropic::DIRECT_MODE_REFUSAL_CODE);
        let (status, v) =
            body_of(Kind::Anthropic.error(StatusCode::SERVICE_UNAVAILABLE, "refused", code)).await;
        assert_eq!(status, 503);
        assert_eq!(v["error"]["type"], "api_error");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .ends_with("disaggregated_prefill_decode_unavailable")
        );
        let (status, v) =
            body_of(Kind::Responses.error(StatusCode::SERVICE_UNAVAILABLE, "refused", code)).await;
        assert_eq!(status, 503);
        assert_eq!(
            v["error"]["code"],
            "disaggregated_prefill_decode_unavailable"
        );
        let (status, v) =
            body_of(Kind::Anthropic.error(StatusCode::PAYLOAD_TOO_LARGE, "big", None)).await;
        assert_eq!(status, 413);
        assert_eq!(v["error"]["type"], "request_too_large");
    }
}
