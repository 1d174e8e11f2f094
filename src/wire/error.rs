//! The one HTTP error type: every failure the front door returns is an `ApiError`, rendered as an
//! OpenAI-style JSON body `{"error": {"message", "type", "code"}}`.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("missing or invalid credentials")]
    Unauthenticated,
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Internal(String),
    /// A direct-mode frontend refused the pair for lack of a prefill id (no retry).
    #[error("{0}")]
    PrefillDecodeUnavailable(String),
    /// The shim failed and `fallback_to_unified` is off.
    #[error("{0}")]
    DisaggregatedDecodeFailed(String),
    /// The request body did not arrive within `server.body_read_timeout`.
    #[error("{0}")]
    RequestTimeout(String),
    /// The request body exceeds the front door's bound.
    #[error("{0}")]
    PayloadTooLarge(String),
    /// No backend the caller may use serves the requested model.
    #[error("{0}")]
    ModelNotFound(String),
    /// The upstream failed before answering (transport error).
    #[error("{0}")]
    BadGateway(String),
    /// The upstream did not answer within the proxy's deadline.
    #[error("{0}")]
    GatewayTimeout(String),
    /// A rate limit binds: 429 with `Retry-After` and the `RateLimit` fields.
    #[error("{}", rate_limit_message(.0))]
    RateLimited(Box<continuum_protocol::ratelimit::Limited>),
    /// Every eligible worker of the model stayed busy (`admission`): 503 `fleet_busy` with
    /// `Retry-After`.
    #[error("{}", fleet_busy_message(.0))]
    FleetBusy(Box<continuum_protocol::admission::Busy>),
}

fn fleet_busy_message(busy: &continuum_protocol::admission::Busy) -> String {
    let why = match busy.reason {
        continuum_protocol::admission::Shed::QueueFull => "its admission queue is full",
        continuum_protocol::admission::Shed::MaxWait => {
            "the request waited admission.queue.max_wait in its queue"
        }
    };
    format!(
        "every worker serving model {:?} is busy and {why}; retry after {} s",
        busy.model,
        busy.retry_after_secs()
    )
}

fn rate_limit_message(limited: &continuum_protocol::ratelimit::Limited) -> String {
    let policy = match limited.refusal.policy {
        continuum_protocol::ratelimit::Policy::Requests => "requests",
        continuum_protocol::ratelimit::Policy::Tokens => "tokens",
    };
    let whose = match limited.scope {
        continuum_protocol::ratelimit::Scope::Key => "this API key",
        continuum_protocol::ratelimit::Scope::Backend => "every backend serving the model",
    };
    format!(
        "rate limit reached: {whose} is over its {policy} per minute; retry after {} s",
        limited.refusal.retry_after_secs()
    )
}

/// The rate-limit response fields of a refusal: `Retry-After` (whole seconds), `retry-after-ms`
/// (the OpenAI and Anthropic SDKs read it first), `RateLimit-Policy` and `RateLimit`.
pub fn rate_limit_headers(
    limited: &continuum_protocol::ratelimit::Limited,
) -> Vec<(axum::http::HeaderName, axum::http::HeaderValue)> {
    use axum::http::{HeaderName, HeaderValue, header};
    let refusal = &limited.refusal;
    let mut out = vec![(
        header::RETRY_AFTER,
        HeaderValue::from(refusal.retry_after_secs()),
    )];
    let ms = u64::try_from(refusal.retry_after.as_millis().max(1)).unwrap_or(u64::MAX);
    out.push((
        HeaderName::from_static("retry-after-ms"),
        HeaderValue::from(ms),
    ));
    for (name, value) in [
        ("ratelimit-policy", &refusal.policy_field),
        ("ratelimit", &refusal.limit_field),
    ] {
        if let Ok(value) = HeaderValue::from_str(value) {
            out.push((HeaderName::from_static(name), value));
        }
    }
    out
}

impl ApiError {
    fn parts(&self) -> (StatusCode, &'static str) {
        match self {
            ApiError::Unauthenticated => (StatusCode::UNAUTHORIZED, "unauthenticated"),
            ApiError::Forbidden(_) => (StatusCode::FORBIDDEN, "forbidden"),
            ApiError::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            ApiError::BadRequest(_) => (StatusCode::BAD_REQUEST, "invalid_request"),
            ApiError::Conflict(_) => (StatusCode::CONFLICT, "conflict"),
            ApiError::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            ApiError::RequestTimeout(_) => (StatusCode::REQUEST_TIMEOUT, "request_timeout"),
            ApiError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal_error"),
            ApiError::PrefillDecodeUnavailable(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "disaggregated_prefill_decode_unavailable",
            ),
            ApiError::DisaggregatedDecodeFailed(_) => {
                (StatusCode::BAD_GATEWAY, "disaggregated_decode_failed")
            }
            ApiError::PayloadTooLarge(_) => (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large"),
            ApiError::ModelNotFound(_) => (StatusCode::NOT_FOUND, "model_not_found"),
            ApiError::BadGateway(_) => (StatusCode::BAD_GATEWAY, "bad_gateway"),
            ApiError::GatewayTimeout(_) => (StatusCode::GATEWAY_TIMEOUT, "gateway_timeout"),
            ApiError::RateLimited(_) => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_exceeded"),
            ApiError::FleetBusy(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                continuum_protocol::admission::FLEET_BUSY_CODE,
            ),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code) = self.parts();
        let kind = match &self {
            // OpenAI's own 429 body: `type` names the limit (`requests` or `tokens`).
            ApiError::RateLimited(l) => match l.refusal.policy {
                continuum_protocol::ratelimit::Policy::Requests => "requests",
                continuum_protocol::ratelimit::Policy::Tokens => "tokens",
            },
            _ => code,
        };
        let body = json!({"error": {"message": self.to_string(), "type": kind, "code": code}});
        let mut response = (status, Json(body)).into_response();
        if let ApiError::RateLimited(limited) = &self {
            response.headers_mut().extend(rate_limit_headers(limited));
        }
        if let ApiError::FleetBusy(busy) = &self {
            use axum::http::{HeaderName, HeaderValue, header};
            let ms = u64::try_from(busy.retry_after.as_millis().max(1)).unwrap_or(u64::MAX);
            let headers = response.headers_mut();
            headers.insert(header::RETRY_AFTER, busy.retry_after_secs().into());
            headers.insert(
                HeaderName::from_static("retry-after-ms"),
                HeaderValue::from(ms),
            );
        }
        response
    }
}
