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
//! always passes through, unpinned.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::http_metrics::HttpRoute;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use continuum_protocol::ingress::{anthropic, responses};
use futures::StreamExt;
use serde_json::Value;

use super::{AppState, admit};
use crate::proxy::OpenAiRoute;
use crate::proxy::relay::collect_bounded;
use crate::route::Caller;

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
        (status, axum::Json(body)).into_response()
    }

    fn refused(self, e: &anthropic::IngressError) -> Response {
        let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST);
        self.error(status, &e.message, None)
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
}

impl Converter {
    fn push(&mut self, data: &[u8], out: &mut Vec<u8>) {
        match self {
            Converter::Anthropic(c) => c.push(data).iter().for_each(|e| out.extend(e.to_bytes())),
            Converter::Responses(c) => c.push(data).iter().for_each(|e| out.extend(e.to_bytes())),
        }
    }

    fn finish(&mut self, out: &mut Vec<u8>) {
        match self {
            Converter::Anthropic(c) => c.finish().iter().for_each(|e| out.extend(e.to_bytes())),
            Converter::Responses(c) => c.finish().iter().for_each(|e| out.extend(e.to_bytes())),
        }
    }

    fn is_done(&self) -> bool {
        match self {
            Converter::Anthropic(c) => c.is_done(),
            Converter::Responses(c) => c.is_done(),
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

/// Splits an SSE byte stream into the `data` payloads of its events (multi-line `data:` fields
/// joined with `\n`; comments, `event:`, `id:` and `retry:` lines ignored). At most `max` bytes
/// of an unfinished line plus the event's data are buffered.
#[derive(Debug)]
pub struct SseDecoder {
    line: Vec<u8>,
    data: Option<Vec<u8>>,
    max: usize,
}

impl SseDecoder {
    pub fn new(max: usize) -> Self {
        Self {
            line: Vec::new(),
            data: None,
            max,
        }
    }

    /// Feeds bytes; returns the payloads of the events they complete. `Err` when an event
    /// outgrows the bound (the decoder is then reset).
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, String> {
        let mut out = Vec::new();
        let mut rest = bytes;
        while let Some(pos) = rest.iter().position(|&b| b == b'\n') {
            let (head, tail) = rest.split_at(pos);
            rest = &tail[1..];
            self.line.extend_from_slice(head);
            self.check()?;
            let mut line = std::mem::take(&mut self.line);
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            self.line_done(&line, &mut out);
        }
        self.line.extend_from_slice(rest);
        self.check()?;
        Ok(out)
    }

    fn check(&mut self) -> Result<(), String> {
        let held = self.line.len() + self.data.as_ref().map_or(0, Vec::len);
        if held > self.max {
            self.line.clear();
            self.data = None;
            return Err(format!("an upstream SSE event exceeds {} bytes", self.max));
        }
        Ok(())
    }

    fn line_done(&mut self, line: &[u8], out: &mut Vec<Vec<u8>>) {
        if line.is_empty() {
            if let Some(data) = self.data.take() {
                out.push(data);
            }
            return;
        }
        if let Some(value) = line.strip_prefix(b"data:") {
            let value = value.strip_prefix(b" ").unwrap_or(value);
            match &mut self.data {
                Some(data) => {
                    data.push(b'\n');
                    data.extend_from_slice(value);
                }
                None => self.data = Some(value.to_vec()),
            }
        }
    }

    /// End of stream: the payload of an event left without its blank line, if any.
    pub fn finish(&mut self) -> Option<Vec<u8>> {
        let line = std::mem::take(&mut self.line);
        let mut out = Vec::new();
        if !line.is_empty() {
            self.line_done(&line, &mut out);
        }
        self.data.take().or_else(|| out.pop())
    }
}

#[cfg(test)]
mod tests {
    use super::{Kind, SseDecoder};
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

    #[test]
    fn sse_events_split_across_chunks_and_lines() {
        let mut d = SseDecoder::new(1024);
        assert!(d.push(b"data: {\"a\"").unwrap().is_empty());
        assert_eq!(
            d.push(b":1}\r\n\r\n: comment\nevent: x\ndata: [DONE]\n\ndata: p\ndata: q\n\n")
                .unwrap(),
            vec![b"{\"a\":1}".to_vec(), b"[DONE]".to_vec(), b"p\nq".to_vec()]
        );
        assert!(d.push(b"data:tail").unwrap().is_empty());
        assert_eq!(d.finish(), Some(b"tail".to_vec()));
        assert_eq!(d.finish(), None);
    }

    #[test]
    fn an_event_over_the_bound_is_refused() {
        let mut d = SseDecoder::new(8);
        assert!(d.push(b"data: 0123456789").is_err());
        assert_eq!(d.push(b"data: ok\n\n").unwrap(), vec![b"ok".to_vec()]);
    }
}
