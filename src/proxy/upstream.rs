//! The pooled upstream HTTP client (hyper-util legacy client over plain HTTP) and backend
//! base-URL handling.

use std::time::Duration;

use axum::http::{Request, Response, Uri, uri};
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// Why an upstream exchange failed before a response head arrived.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// No connection could be made: nothing was sent, so another replica may be tried.
    #[error("connection failed: {0}")]
    Connect(String),
    /// The response head did not arrive in time; the request may have been processed.
    #[error("no response within {0:?}")]
    Timeout(Duration),
    /// The connection failed after the request was (possibly) sent.
    #[error("transport error: {0}")]
    Transport(String),
}

impl UpstreamError {
    /// Whether the same request may be sent to another replica without risk of running twice.
    pub fn is_connect(&self) -> bool {
        matches!(self, UpstreamError::Connect(_))
    }
}

const CHAT_COMPLETIONS: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

/// A backend URL that cannot be dialled.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error("invalid backend URL {url:?}: {reason}")]
    Invalid { url: String, reason: String },
    #[error("backend URL {0:?} uses https, which this build's proxy does not dial yet")]
    Https(String),
}

/// A parsed `backends[].url`: scheme, authority and an optional base path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    authority: uri::Authority,
    base_path: String,
    /// The OpenAI routes' URIs, built once: every request needs one.
    chat_completions: Option<Uri>,
    completions: Option<Uri>,
}

impl Target {
    pub fn parse(url: &str) -> Result<Self, TargetError> {
        let invalid = |reason: &str| TargetError::Invalid {
            url: url.to_owned(),
            reason: reason.to_owned(),
        };
        let parsed: Uri = url
            .parse()
            .map_err(|e: uri::InvalidUri| invalid(&e.to_string()))?;
        match parsed.scheme_str() {
            Some("http") => {}
            Some("https") => return Err(TargetError::Https(url.to_owned())),
            _ => return Err(invalid("the scheme must be http")),
        }
        let authority = parsed
            .authority()
            .cloned()
            .ok_or_else(|| invalid("no host"))?;
        let base_path = parsed.path().trim_end_matches('/').to_owned();
        let mut target = Self {
            authority,
            base_path,
            chat_completions: None,
            completions: None,
        };
        target.chat_completions = target.build_uri(CHAT_COMPLETIONS).ok();
        target.completions = target.build_uri(COMPLETIONS).ok();
        Ok(target)
    }

    /// The URI of `path` (starting with `/`) on this backend. A base URL ending in `/v1` is not
    /// doubled for `/v1/...` routes.
    pub fn uri(&self, path: &str) -> Result<Uri, TargetError> {
        let cached = match path {
            CHAT_COMPLETIONS => self.chat_completions.as_ref(),
            COMPLETIONS => self.completions.as_ref(),
            _ => None,
        };
        match cached {
            Some(uri) => Ok(uri.clone()),
            None => self.build_uri(path),
        }
    }

    fn build_uri(&self, path: &str) -> Result<Uri, TargetError> {
        let path = match (self.base_path.ends_with("/v1"), path.strip_prefix("/v1/")) {
            (true, Some(rest)) => format!("{}/{rest}", self.base_path),
            _ => format!("{}{path}", self.base_path),
        };
        Uri::builder()
            .scheme("http")
            .authority(self.authority.clone())
            .path_and_query(path.as_str())
            .build()
            .map_err(|e| TargetError::Invalid {
                url: format!("http://{}{path}", self.authority),
                reason: e.to_string(),
            })
    }

    pub fn authority(&self) -> &uri::Authority {
        &self.authority
    }
}

/// The shared, pooled client. Cheap to clone.
#[derive(Clone)]
pub struct Upstream {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Upstream {
    pub fn new(connect_timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(connect_timeout));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .build(connector);
        Self { client }
    }

    /// Sends `req`, waiting at most `head_timeout` for the response head.
    pub async fn send(
        &self,
        req: Request<Full<Bytes>>,
        head_timeout: Duration,
    ) -> Result<Response<Incoming>, UpstreamError> {
        match tokio::time::timeout(head_timeout, self.client.request(req)).await {
            Err(_) => Err(UpstreamError::Timeout(head_timeout)),
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(error)) if error.is_connect() => Err(UpstreamError::Connect(chain(&error))),
            Ok(Err(error)) => Err(UpstreamError::Transport(chain(&error))),
        }
    }
}

/// An error and its sources on one line.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_paths_join_without_doubling_v1() {
        let t = Target::parse("http://h:8000").expect("ok");
        assert_eq!(
            t.uri("/v1/chat/completions").expect("uri").to_string(),
            "http://h:8000/v1/chat/completions"
        );
        let t = Target::parse("http://h:8000/api/v1/").expect("ok");
        assert_eq!(
            t.uri("/v1/completions").expect("uri").to_string(),
            "http://h:8000/api/v1/completions"
        );
        assert_eq!(
            t.uri("/v1/chat/completions").expect("uri").to_string(),
            "http://h:8000/api/v1/chat/completions"
        );
        assert_eq!(
            t.uri("/health").expect("uri").to_string(),
            "http://h:8000/api/v1/health"
        );
        assert!(matches!(
            Target::parse("https://h"),
            Err(TargetError::Https(_))
        ));
        assert!(Target::parse("ftp://h").is_err());
        assert!(Target::parse("not a url").is_err());
    }
}
