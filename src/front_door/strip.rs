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
    let removed = strip_pin_headers(req.headers_mut());
    if removed > 0 {
        tracing::debug!(removed, "Stripped client worker-pin headers.");
    }
    let mut resp = next.run(req).await;
    // Nothing upstream-internal is ever echoed back either.
    strip_pin_headers(resp.headers_mut());
    resp
}
