//! Reading one artifact from where a card says it lives: a local file, or an HTTP(S) GET (a
//! worker's metadata URL, or the Hub for `hf://`). Bounded: the declared and announced lengths
//! are checked before allocating, the body is streamed with a running size check, and the whole
//! exchange has a deadline.

use std::fs::File;
use std::time::Duration;

use continuum_protocol::kv::artifacts::{
    MAX_ARTIFACT_BYTES, SizeError, check_declared_size, check_running_size,
};

use super::cache::read_bounded;

/// How long one HTTP fetch may take, connection to last byte.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(60);

/// Why one source failed.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error(transparent)]
    Size(#[from] SizeError),
    #[error("reading {path}: {source}")]
    Local {
        path: String,
        source: std::io::Error,
    },
    #[error("GET {url}: {reason}")]
    Http { url: String, reason: String },
}

/// Reads a local file: its length first, then at most [`MAX_ARTIFACT_BYTES`].
pub fn read_local(path: &str) -> Result<Vec<u8>, FetchError> {
    let err = |source| FetchError::Local {
        path: path.to_owned(),
        source,
    };
    let file = File::open(path).map_err(err)?;
    let len = file.metadata().map_err(err)?.len();
    check_declared_size(Some(len))?;
    read_bounded(file, len)
        .map_err(err)?
        .ok_or(FetchError::Size(SizeError::TooLarge(
            MAX_ARTIFACT_BYTES + 1,
        )))
}

/// The HTTP client for artifacts: rustls with the process-wide ring provider, no redirects to
/// other schemes, a total deadline per request.
pub fn client() -> Result<reqwest::Client, FetchError> {
    // ring is the one rustls provider of this process; main installs it too (idempotent).
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .timeout(FETCH_TIMEOUT)
        .connect_timeout(Duration::from_secs(10))
        .redirect(reqwest::redirect::Policy::limited(5))
        .build()
        .map_err(|e| FetchError::Http {
            url: String::new(),
            reason: e.to_string(),
        })
}

/// GETs `url` (with `bearer` as an Authorization token when set), refusing bodies past the
/// artifact bound as soon as they pass it.
pub async fn fetch_http(
    client: &reqwest::Client,
    url: &str,
    bearer: Option<&str>,
) -> Result<Vec<u8>, FetchError> {
    let err = |reason: String| FetchError::Http {
        url: url.to_owned(),
        reason,
    };
    let mut request = client.get(url);
    if let Some(token) = bearer {
        request = request.bearer_auth(token);
    }
    let mut response = request.send().await.map_err(|e| err(e.to_string()))?;
    if !response.status().is_success() {
        return Err(err(format!("status {}", response.status())));
    }
    let announced = response.content_length();
    check_declared_size(announced)?;
    let capacity = usize::try_from(announced.unwrap_or(0).min(MAX_ARTIFACT_BYTES)).unwrap_or(0);
    let mut bytes = Vec::with_capacity(capacity);
    while let Some(chunk) = response.chunk().await.map_err(|e| err(e.to_string()))? {
        check_running_size((bytes.len() + chunk.len()) as u64)?;
        bytes.extend_from_slice(&chunk);
    }
    Ok(bytes)
}
