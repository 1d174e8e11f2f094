//! Always-compiled stripping of every client-supplied worker pin.
//!
//! Clients can never choose a worker: every `x-dynamo-*` header, and the aliases real Dynamo
//! 1.6.1's frontend also honours (`x-worker-instance-id`, `x-prefill-instance-id`), are removed at
//! the global middleware, before any handler sees the request. Body fields (`nvext.*`) are
//! stripped where bodies are parsed.

use axum::extract::Request;
use axum::http::HeaderMap;
use axum::middleware::Next;
use axum::response::Response;

/// Header names a client could pin a worker with on 1.6.1.
const PIN_ALIASES: [&str; 2] = ["x-worker-instance-id", "x-prefill-instance-id"];

/// True for a header name that could pin a worker.
pub fn is_pin_header(name: &str) -> bool {
    // Header names are lowercase in `http`.
    name.starts_with("x-dynamo-") || PIN_ALIASES.contains(&name)
}

/// Removes every pinning header; returns how many were removed.
pub fn strip_pin_headers(headers: &mut HeaderMap) -> usize {
    let doomed: Vec<_> = headers
        .keys()
        .filter(|k| is_pin_header(k.as_str()))
        .cloned()
        .collect();
    let mut removed = 0;
    for name in doomed {
        removed += headers.get_all(&name).iter().count();
        headers.remove(&name);
    }
    removed
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn strips_every_pin_header_and_keeps_the_rest() {
        let mut h = HeaderMap::new();
        h.insert("x-dynamo-worker-instance-id", HeaderValue::from_static("1"));
        h.append("x-dynamo-worker-instance-id", HeaderValue::from_static("2"));
        h.insert(
            "X-Dynamo-Prefill-Instance-Id",
            HeaderValue::from_static("3"),
        );
        h.insert("x-dynamo-dp-rank", HeaderValue::from_static("0"));
        h.insert("x-worker-instance-id", HeaderValue::from_static("4"));
        h.insert("x-prefill-instance-id", HeaderValue::from_static("5"));
        h.insert("x-dynamox", HeaderValue::from_static("keep"));
        h.insert("authorization", HeaderValue::from_static("Bearer k"));
        assert_eq!(strip_pin_headers(&mut h), 6);
        assert_eq!(h.len(), 2);
        assert!(h.contains_key("x-dynamox") && h.contains_key("authorization"));
    }
}
