//! `GET /admin/ui`: the live fleet page. Three hand-written assets embedded in the binary (no
//! CDN, no build step). The shell and its script and stylesheet are served without the admin
//! token so the login form can load; every data call the page makes carries
//! `Authorization: Bearer` from session storage, never the URL. A strict Content-Security-Policy
//! allows only these same-origin assets and same-origin fetches: no inline script or style.

use axum::Router;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;

use super::AppState;

const INDEX_HTML: &str = include_str!("ui/index.html");
const APP_JS: &str = include_str!("ui/app.js");
const APP_CSS: &str = include_str!("ui/app.css");

/// Sent with every asset of the page.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self'; img-src 'self'; connect-src 'self'; base-uri 'none'; \
     form-action 'none'; frame-ancestors 'none'";

pub fn routes() -> Router<AppState> {
    Router::new()
        .route(
            "/admin/ui",
            get(|| asset("text/html; charset=utf-8", INDEX_HTML)),
        )
        .route(
            "/admin/ui/",
            get(|| asset("text/html; charset=utf-8", INDEX_HTML)),
        )
        .route(
            "/admin/ui/app.js",
            get(|| asset("text/javascript; charset=utf-8", APP_JS)),
        )
        .route(
            "/admin/ui/app.css",
            get(|| asset("text/css; charset=utf-8", APP_CSS)),
        )
}

async fn asset(content_type: &'static str, body: &'static str) -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
            (header::X_FRAME_OPTIONS, "DENY"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
}
