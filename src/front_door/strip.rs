//! Always-compiled stripping of every client-supplied worker pin.
//!
//! Clients can never choose a worker: every pinning header ([`crate::wire::pins`]) is removed at
//! the global middleware, before any handler sees the request. Body fields (`nvext.*`) are
//! stripped where bodies are parsed.

use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;

use crate::wire::pins::strip_pin_headers;

/// The global middleware.
pub async fn strip_client_pins(mut req: Request, next: Next) -> Response {
    strip_request_pins(req.headers_mut());
    let mut resp = next.run(req).await;
    // Nothing upstream-internal is ever echoed back either.
    strip_pin_headers(resp.headers_mut());
    resp
}

/// The request side of [`strip_client_pins`], also called by the connection layer's direct
/// dispatch of the hot routes (`super::serve_hot`), which strips the answer's pins too.
pub fn strip_request_pins(headers: &mut axum::http::HeaderMap) {
    let removed = strip_pin_headers(headers);
    if removed > 0 {
        tracing::debug!(removed, "Stripped client worker-pin headers.");
    }
}
