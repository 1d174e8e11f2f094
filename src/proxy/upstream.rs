//! The pooled upstream HTTP client (hyper-util legacy client over plain HTTP or rustls TLS, with
//! ALPN offering h2 and http/1.1) and backend base-URL handling. The request path sends to HTTPS
//! backends through it; plain-`http` backends get their own HTTP/1.1 connection pool
//! ([`super::pool`], [`Upstream::conn_pool`]). Health checks use it for every backend.

use std::sync::Arc;
use std::time::Duration;

use axum::http::{Request, Response, Uri, uri};
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls::pki_types::CertificateDer;

use super::pool::{BodyError, ConnPool, PooledBody};

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
}

/// A parsed `backends[].url`: scheme, authority and an optional base path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    https: bool,
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
        let https = match parsed.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => return Err(invalid("the scheme must be http or https")),
        };
        let authority = parsed
            .authority()
            .cloned()
            .ok_or_else(|| invalid("no host"))?;
        let base_path = parsed.path().trim_end_matches('/').to_owned();
        let mut target = Self {
            https,
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
        let scheme = if self.https { "https" } else { "http" };
        Uri::builder()
            .scheme(scheme)
            .authority(self.authority.clone())
            .path_and_query(path.as_str())
            .build()
            .map_err(|e| TargetError::Invalid {
                url: format!("{scheme}://{}{path}", self.authority),
                reason: e.to_string(),
            })
    }

    pub fn authority(&self) -> &uri::Authority {
        &self.authority
    }

    /// Whether the backend is dialled over TLS.
    pub fn is_https(&self) -> bool {
        self.https
    }
}

pub use crate::wire::tls::{MAX_CA_FILE_BYTES, read_ca_file};

/// The TLS settings of an upstream client: the webpki roots plus `extra_roots` (a backend's CA
/// file), ring provider, TLS 1.2 and 1.3. ALPN (h2, http/1.1) is set by the connector.
pub fn tls_config(extra_roots: &[CertificateDer<'static>]) -> Result<rustls::ClientConfig, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add_parsable_certificates(webpki_root_certs::TLS_SERVER_ROOT_CERTS.iter().cloned());
    for cert in extra_roots {
        roots.add(cert.clone()).map_err(|e| e.to_string())?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// The shared, pooled client. Cheap to clone.
#[derive(Clone)]
pub struct Upstream {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    connect_timeout: Duration,
    idle_timeout: Duration,
    max_idle: usize,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("connect_timeout", &self.connect_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("max_idle", &self.max_idle)
            .finish_non_exhaustive()
    }
}

/// How long an idle pooled backend connection is kept before it is closed (the pool's reaper
/// runs at this interval, so an idle connection lives up to twice this long).
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// Idle pooled connections kept per backend host; more are closed when they go idle.
pub const POOL_MAX_IDLE_PER_HOST: usize = 64;

impl Upstream {
    pub fn new(connect_timeout: Duration) -> Self {
        Self::with_pool(connect_timeout, POOL_IDLE_TIMEOUT, POOL_MAX_IDLE_PER_HOST)
    }

    /// A client whose idle backend connections close after `idle_timeout`, at most `max_idle`
    /// of them kept per host. The pool needs a timer for the idle timeout to take effect:
    /// without one hyper-util never closes an idle connection.
    pub fn with_pool(connect_timeout: Duration, idle_timeout: Duration, max_idle: usize) -> Self {
        // The webpki roots alone always make a valid configuration.
        let tls = tls_config(&[]).unwrap_or_else(|_| {
            rustls::ClientConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .expect("ring supports the default protocol versions")
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth()
        });
        Self::build(tls, connect_timeout, idle_timeout, max_idle)
    }

    /// A client with the same connect timeout and pool settings that also trusts `extra_roots`
    /// (a backend's `tls.ca_file`). It has its own connection pool.
    pub fn trusting(&self, extra_roots: &[CertificateDer<'static>]) -> Result<Self, String> {
        let tls = tls_config(extra_roots)?;
        Ok(Self::build(
            tls,
            self.connect_timeout,
            self.idle_timeout,
            self.max_idle,
        ))
    }

    fn build(
        tls: rustls::ClientConfig,
        connect_timeout: Duration,
        idle_timeout: Duration,
        max_idle: usize,
    ) -> Self {
        let mut http = HttpConnector::new();
        http.set_connect_timeout(Some(connect_timeout));
        http.set_nodelay(true);
        // `https_or_http` leaves the URI scheme check to the connector; the SNI name is the URL
        // host. Offering h2 first: when the server picks it, the client speaks HTTP/2.
        http.enforce_http(false);
        let connector = HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(idle_timeout)
            .pool_max_idle_per_host(max_idle)
            .build(connector);
        Self {
            client,
            connect_timeout,
            idle_timeout,
            max_idle,
        }
    }

    /// A per-backend HTTP/1.1 connection pool for `target` with this client's connect timeout and
    /// idle settings, for a plain-`http` target (`None` for HTTPS, which this client dials).
    pub fn conn_pool(&self, target: &Target) -> Option<ConnPool> {
        if target.is_https() {
            return None;
        }
        ConnPool::new(
            target.authority(),
            self.connect_timeout,
            self.idle_timeout,
            self.max_idle,
        )
        .ok()
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

/// A backend's response body: from the per-backend connection pool (plain `http`) or from the
/// hyper-util client (HTTPS, health checks).
pub enum UpstreamBody {
    Pooled(PooledBody),
    Client(Incoming),
}

impl UpstreamBody {
    /// The empty polls the streamed relay makes before handing gathered bytes over: none for a
    /// pooled body (the relay's own poll reads its socket: pending means nothing is there), the
    /// relay's default for the client's (its connection task hands frames over one at a time).
    pub fn relay_idle_polls(&self) -> u32 {
        match self {
            UpstreamBody::Pooled(_) => 0,
            UpstreamBody::Client(_) => super::relay::IDLE_POLLS,
        }
    }
}

/// Why an upstream response body failed.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamBodyError {
    #[error(transparent)]
    Pooled(#[from] BodyError),
    #[error(transparent)]
    Client(#[from] hyper::Error),
}

impl hyper::body::Body for UpstreamBody {
    type Data = Bytes;
    type Error = UpstreamBodyError;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, UpstreamBodyError>>> {
        match self.get_mut() {
            UpstreamBody::Pooled(body) => std::pin::Pin::new(body)
                .poll_frame(cx)
                .map_err(UpstreamBodyError::from),
            UpstreamBody::Client(body) => std::pin::Pin::new(body)
                .poll_frame(cx)
                .map_err(UpstreamBodyError::from),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            UpstreamBody::Pooled(body) => body.is_end_stream(),
            UpstreamBody::Client(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        match self {
            UpstreamBody::Pooled(body) => body.size_hint(),
            UpstreamBody::Client(body) => body.size_hint(),
        }
    }
}

/// An error and its sources on one line.
pub(super) fn chain(error: &dyn std::error::Error) -> String {
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
        let t = Target::parse("https://h/v1").expect("https is dialled");
        assert!(t.is_https());
        assert_eq!(
            t.uri("/v1/chat/completions").expect("uri").to_string(),
            "https://h/v1/chat/completions"
        );
        assert!(Target::parse("ftp://h").is_err());
        assert!(Target::parse("not a url").is_err());
    }

    /// A keep-alive HTTP/1.1 backend on a real socket that answers once `together` requests are
    /// in flight (so the client must open that many connections) and reports each closed
    /// connection.
    async fn backend(together: usize) -> (std::net::SocketAddr, tokio::sync::mpsc::Receiver<()>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (closed_tx, closed_rx) = tokio::sync::mpsc::channel(64);
        let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(together));
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let (closed_tx, barrier) = (closed_tx.clone(), barrier.clone());
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 1024];
                    let mut first = true;
                    loop {
                        match socket.read(&mut chunk).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            buf.drain(..end + 4);
                            if std::mem::take(&mut first) {
                                barrier.wait().await;
                            }
                            let reply = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                            if socket.write_all(reply).await.is_err() {
                                return;
                            }
                        }
                    }
                    let _ = closed_tx.send(()).await;
                });
            }
        });
        (addr, closed_rx)
    }

    /// Sends `n` concurrent requests and reads every response to its end.
    async fn burst(upstream: &Upstream, addr: std::net::SocketAddr, n: usize) {
        use http_body_util::BodyExt;
        let requests = (0..n).map(|_| {
            let req = Request::get(format!("http://{addr}/"))
                .body(Full::new(Bytes::new()))
                .expect("request");
            async move {
                let resp = upstream
                    .send(req, Duration::from_secs(10))
                    .await
                    .expect("response");
                resp.into_body().collect().await.expect("body");
            }
        });
        futures::future::join_all(requests).await;
    }

    async fn closed_within(rx: &mut tokio::sync::mpsc::Receiver<()>, n: usize) {
        let wait = async {
            for _ in 0..n {
                rx.recv().await.expect("backend running");
            }
        };
        tokio::time::timeout(Duration::from_secs(20), wait)
            .await
            .unwrap_or_else(|_| panic!("{n} idle backend connections were not closed"));
    }

    #[tokio::test]
    async fn idle_backend_connections_close_after_the_idle_timeout() {
        let (addr, mut closed) = backend(8).await;
        let upstream = Upstream::with_pool(Duration::from_secs(5), Duration::from_millis(200), 64);
        burst(&upstream, addr, 8).await;
        // The client (and its pool) stay alive: only the pool's idle timeout can close these.
        closed_within(&mut closed, 8).await;
        drop(upstream);
    }

    #[tokio::test]
    async fn idle_backend_connections_beyond_the_per_host_cap_close_at_once() {
        let (addr, mut closed) = backend(8).await;
        let upstream = Upstream::with_pool(Duration::from_secs(5), Duration::from_secs(3600), 2);
        burst(&upstream, addr, 8).await;
        closed_within(&mut closed, 6).await;
        assert!(
            closed.try_recv().is_err(),
            "the 2 kept idle connections stay open"
        );
        drop(upstream);
    }
}
