//! Worker-pin headers: clients can never choose a worker, so every `x-dynamo-*` header and the
//! aliases real Dynamo 1.6.1's frontend also honours (`x-worker-instance-id`,
//! `x-prefill-instance-id`) are removed from requests (the front door's middleware) and from what
//! is sent upstream (the proxy's header hygiene).

use axum::http::HeaderMap;

/// Header names a client could pin a worker with on 1.6.1.
const PIN_ALIASES: [&str; 2] = ["x-worker-instance-id", "x-prefill-instance-id"];

/// True for a header name that could pin a worker.
pub fn is_pin_header(name: &str) -> bool {
    // Header names are lowercase in `http`.
    name.starts_with("x-dynamo-") || PIN_ALIASES.contains(&name)
}

/// Removes every pinning header; returns how many were removed.
///
/// One pass over the names first: a request without a pin (nearly all) costs no allocation and
/// no hash lookup.
pub fn strip_pin_headers(headers: &mut HeaderMap) -> usize {
    if !headers.keys().any(|k| is_pin_header(k.as_str())) {
        return 0;
    }
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
