//! Relaying an upstream response: buffered (bounded, with a content length) or streamed frame by
//! frame as it arrives (SSE), with a final SSE error event if the upstream fails mid-stream.

use axum::body::Body;
use axum::http::{HeaderValue, Response, header};
use bytes::Bytes;
use futures::StreamExt;
use http_body_util::{BodyExt, BodyStream, Limited};
use hyper::body::Incoming;
use serde_json::json;
use tracing::warn;

use super::headers;
use crate::wire::error::ApiError;

/// Largest buffered (non-streaming) upstream response relayed.
pub const MAX_BUFFERED_RESPONSE_BYTES: usize = 64 * 1024 * 1024;

/// Collects the whole upstream body, then answers with an exact content length.
pub async fn buffered(
    upstream: Response<Incoming>,
    backend: &str,
) -> Result<Response<Body>, ApiError> {
    let (mut parts, body) = upstream.into_parts();
    headers::response(&mut parts.headers);
    let bytes = Limited::new(body, MAX_BUFFERED_RESPONSE_BYTES)
        .collect()
        .await
        .map_err(|error| {
            warn!(backend, %error, "An upstream response body failed or exceeded its bound.");
            ApiError::BadGateway(format!("the upstream response failed: {error}"))
        })?
        .to_bytes();
    parts.headers.remove(header::CONTENT_LENGTH);
    parts
        .headers
        .insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
    Ok(Response::from_parts(parts, Body::from(bytes)))
}

/// Passes every upstream data frame on as soon as it arrives; nothing is accumulated.
pub fn streamed(upstream: Response<Incoming>, backend: &str) -> Response<Body> {
    let (mut parts, body) = upstream.into_parts();
    headers::response(&mut parts.headers);
    // The relayed length may differ (a closing error event), so the body goes chunked.
    parts.headers.remove(header::CONTENT_LENGTH);
    // The backend name rides in the stream's state: no per-chunk copy.
    let state = Some((BodyStream::new(body), backend.to_owned()));
    let stream = futures::stream::unfold(state, |state| async move {
        let (mut frames, backend) = state?;
        loop {
            match frames.next().await {
                None => return None,
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) if !data.is_empty() => {
                        return Some((
                            Ok::<Bytes, std::convert::Infallible>(data),
                            Some((frames, backend)),
                        ));
                    }
                    // Trailers and empty frames carry nothing for the client.
                    _ => continue,
                },
                Some(Err(error)) => {
                    warn!(backend = %backend, %error, "An upstream stream failed after it started.");
                    return Some((Ok(error_event(&error.to_string())), None));
                }
            }
        }
    });
    Response::from_parts(parts, Body::from_stream(stream))
}

/// An OpenAI-style error as a final SSE event.
fn error_event(message: &str) -> Bytes {
    let body = json!({"error": {"message": format!("the upstream stream failed: {message}"),
                                "type": "bad_gateway", "code": "bad_gateway"}});
    Bytes::from(format!("data: {body}\n\n"))
}
