//! HTTP vocabulary the front door, the route and the proxy share, kept below all three so the
//! request path imports only downward.
//!
//! | module | what it holds |
//! |---|---|
//! | [`error`] | [`ApiError`](error::ApiError): every failure the OpenAI surface and the admin API answer |
//! | [`pins`] | which header names could pin a worker, and stripping them |
//! | [`tls`] | reading a backend's CA file (config validation and the upstream client) |
//!
//! [`BodyReadTimeout`] is the error a request body fails with when it is late (the connection
//! layer raises it, the body reader turns it into a 408).

pub mod error;
pub mod pins;
pub mod tls;

use std::time::Duration;

/// The request body failed to arrive within `server.body_read_timeout`.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {0:?}")]
pub struct BodyReadTimeout(pub Duration);

/// Whether `error` (or one of its sources) is a [`BodyReadTimeout`].
pub fn is_body_read_timeout(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut current = Some(error);
    while let Some(e) = current {
        if e.is::<BodyReadTimeout>() {
            return true;
        }
        current = e.source();
    }
    false
}
