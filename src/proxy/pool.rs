//! A per-backend pool of HTTP/1.1 connections for plain-`http` backends, over
//! `hyper::client::conn::http1` (the hot path; HTTPS backends keep the pooled hyper-util client of
//! [`super::upstream`], which negotiates h2 or http/1.1 by ALPN).
//!
//! Why not the hyper-util legacy client here: per request it hashes the pool key (SipHash) twice,
//! checks a connection out through a waiter queue, spawns a task that waits for the connection to
//! be ready again and puts it back, and rebuilds the request's URI. This pool is one `Mutex`ed
//! stack per backend: a request pops the most recently used idle connection, and its response body
//! pushes the connection back when it ends.
//!
//! Bounds, as the legacy client had them:
//! - **Connect timeout**: dialling (name resolution + TCP connect) is bounded by
//!   `connect_timeout`; a failure is [`UpstreamError::Connect`] (nothing was sent, so the proxy
//!   may try another replica).
//! - **Idle cap**: at most `max_idle` idle connections are kept; one more going idle is closed.
//! - **Idle timeout**: an idle connection older than `idle_timeout` is never reused, and a reaper
//!   task (started with the first idle connection, ending with the pool) closes them every
//!   `idle_timeout`, so an idle connection lives at most twice that long.
//! - A response body dropped before its end (client gone) closes its connection: it is never
//!   reused with bytes of an old answer in flight.
//! - A pooled connection the backend closed meanwhile hands the request back unsent
//!   (`try_send_request`); it is then sent once on a fresh connection.

use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::http::{HeaderValue, Request, Response, Uri, header, uri};
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::time::Instant;
use tracing::debug;

use super::upstream::{UpstreamError, chain};

type Sender = http1::SendRequest<Full<Bytes>>;

#[derive(Debug)]
struct Idle {
    sender: Sender,
    since: Instant,
}

#[derive(Debug)]
struct Inner {
    /// Idle connections, most recently used last.
    idle: Mutex<Vec<Idle>>,
    /// Whether the reaper task runs.
    reaping: std::sync::atomic::AtomicBool,
    host: String,
    port: u16,
    /// The `Host` header every request carries (`host[:port]`, the port when not 80).
    host_header: HeaderValue,
    connect_timeout: Duration,
    idle_timeout: Duration,
    max_idle: usize,
}

/// The connection pool of one plain-`http` backend. Cheap to clone.
#[derive(Clone)]
pub struct ConnPool {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ConnPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnPool")
            .field("host", &self.inner.host)
            .field("port", &self.inner.port)
            .field("idle", &self.idle_count())
            .finish_non_exhaustive()
    }
}

fn lock(idle: &Mutex<Vec<Idle>>) -> std::sync::MutexGuard<'_, Vec<Idle>> {
    // Pushes and pops only: a panic elsewhere leaves the stack consistent.
    idle.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ConnPool {
    /// A pool for the backend at `authority` (plain `http`; port 80 by default).
    pub fn new(
        authority: &uri::Authority,
        connect_timeout: Duration,
        idle_timeout: Duration,
        max_idle: usize,
    ) -> Result<Self, String> {
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        let port = authority.port_u16().unwrap_or(80);
        // As hyper-util's client writes it: the host, and the port when it is not the default.
        let host_header = match authority.port_u16() {
            Some(port) if port != 80 => format!("{}:{port}", authority.host()),
            _ => authority.host().to_owned(),
        };
        let host_header = HeaderValue::from_str(&host_header).map_err(|e| e.to_string())?;
        Ok(Self {
            inner: Arc::new(Inner {
                idle: Mutex::new(Vec::new()),
                reaping: std::sync::atomic::AtomicBool::new(false),
                host: host.to_owned(),
                port,
                host_header,
                connect_timeout,
                idle_timeout,
                max_idle,
            }),
        })
    }

    /// Idle connections held now.
    pub fn idle_count(&self) -> usize {
        lock(&self.inner.idle).len()
    }

    /// Sends `req` (its URI's path and query are sent in origin form; `Host` is the backend's),
    /// waiting at most `head_timeout` for the response head (dialling included).
    pub async fn send(
        &self,
        req: Request<Full<Bytes>>,
        head_timeout: Duration,
    ) -> Result<Response<PooledBody>, UpstreamError> {
        match tokio::time::timeout(head_timeout, self.exchange(req)).await {
            Err(_) => Err(UpstreamError::Timeout(head_timeout)),
            Ok(result) => result,
        }
    }

    async fn exchange(
        &self,
        mut req: Request<Full<Bytes>>,
    ) -> Result<Response<PooledBody>, UpstreamError> {
        if req.uri().authority().is_some() {
            let origin = req
                .uri()
                .path_and_query()
                .cloned()
                .map_or_else(|| Uri::from_static("/"), Uri::from);
            *req.uri_mut() = origin;
        }
        req.headers_mut()
            .insert(header::HOST, self.inner.host_header.clone());
        if let Some(mut sender) = self.checkout().await {
            match sender.try_send_request(req).await {
                Ok(resp) => return Ok(self.wrap(resp, sender)),
                Err(mut error) => match error.take_message() {
                    // Not sent (the backend closed the idle connection): once more, fresh.
                    Some(unsent) => req = unsent,
                    None => return Err(UpstreamError::Transport(chain(&error.into_error()))),
                },
            }
        }
        let mut sender = self.connect().await?;
        match sender.try_send_request(req).await {
            Ok(resp) => Ok(self.wrap(resp, sender)),
            // Nothing was written: another replica may take it.
            Err(error) if error.message().is_some() => {
                Err(UpstreamError::Connect(chain(&error.into_error())))
            }
            Err(error) => Err(UpstreamError::Transport(chain(&error.into_error()))),
        }
    }

    fn wrap(&self, resp: Response<Incoming>, sender: Sender) -> Response<PooledBody> {
        let pool = Arc::downgrade(&self.inner);
        resp.map(|inner| PooledBody {
            inner,
            giveback: Some((sender, pool)),
        })
    }

    /// The most recently used idle connection that is still open and ready.
    async fn checkout(&self) -> Option<Sender> {
        loop {
            let Idle { mut sender, since } = lock(&self.inner.idle).pop()?;
            if since.elapsed() >= self.inner.idle_timeout || sender.is_closed() {
                continue;
            }
            if sender.is_ready() {
                return Some(sender);
            }
            // Its last answer ended a moment ago and the connection task has not yet made it
            // ready again: wait for that (or its close), bounded.
            if let Ok(Ok(())) =
                tokio::time::timeout(self.inner.connect_timeout, sender.ready()).await
            {
                return Some(sender);
            }
        }
    }

    async fn connect(&self) -> Result<Sender, UpstreamError> {
        let inner = &self.inner;
        let dial = tokio::net::TcpStream::connect((inner.host.as_str(), inner.port));
        let stream = match tokio::time::timeout(inner.connect_timeout, dial).await {
            Err(_) => {
                return Err(UpstreamError::Connect(format!(
                    "connecting to {}:{} timed out after {:?}",
                    inner.host, inner.port, inner.connect_timeout
                )));
            }
            Ok(Err(error)) => {
                return Err(UpstreamError::Connect(format!(
                    "connecting to {}:{}: {error}",
                    inner.host, inner.port
                )));
            }
            Ok(Ok(stream)) => stream,
        };
        if let Err(error) = stream.set_nodelay(true) {
            debug!(%error, "Could not set TCP_NODELAY on a backend connection.");
        }
        let (sender, connection) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| UpstreamError::Connect(chain(&e)))?;
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                debug!(%error, "A backend connection ended with an error.");
            }
        });
        Ok(sender)
    }
}

impl Inner {
    /// Takes `sender` back after its answer ended: kept (up to `max_idle`) or closed.
    fn put(self: &Arc<Self>, sender: Sender) {
        if sender.is_closed() {
            return;
        }
        {
            let mut idle = lock(&self.idle);
            if idle.len() >= self.max_idle {
                return;
            }
            idle.push(Idle {
                sender,
                since: Instant::now(),
            });
        }
        if !self.reaping.swap(true, std::sync::atomic::Ordering::AcqRel)
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(reap(Arc::downgrade(self), self.idle_timeout));
        }
    }
}

/// Closes idle connections older than `every`, every `every`, while the pool lives.
async fn reap(pool: Weak<Inner>, every: Duration) {
    let mut ticks = tokio::time::interval_at(Instant::now() + every, every);
    loop {
        ticks.tick().await;
        let Some(pool) = pool.upgrade() else { return };
        let now = Instant::now();
        // Dropped outside the lock (closing a connection wakes its task).
        let expired: Vec<Idle> = {
            let mut idle = lock(&pool.idle);
            let (expired, kept) = std::mem::take(&mut *idle)
                .into_iter()
                .partition(|c| now.duration_since(c.since) >= every || c.sender.is_closed());
            *idle = kept;
            expired
        };
        drop(expired);
    }
}

/// A backend's response body: gives its connection back to the pool when it ends.
#[derive(Debug)]
pub struct PooledBody {
    inner: Incoming,
    giveback: Option<(Sender, Weak<Inner>)>,
}

impl PooledBody {
    fn give_back(&mut self) {
        if let Some((sender, pool)) = self.giveback.take()
            && let Some(pool) = pool.upgrade()
        {
            pool.put(sender);
        }
    }
}

impl hyper::body::Body for PooledBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => self.give_back(),
            Poll::Ready(Some(Ok(_))) if self.inner.is_end_stream() => self.give_back(),
            // A failed body: its connection is not reused.
            Poll::Ready(Some(Err(_))) => self.giveback = None,
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::sync::mpsc;

    use super::*;

    /// A keep-alive HTTP/1.1 backend on a real socket. It answers `ok` to each request head once
    /// `together` requests are in flight on distinct connections (so a burst needs that many
    /// connections), closes a connection after `close_after` answers on it, and reports each
    /// closed connection and each request's `Host` header. Returns the accepted-connection count.
    struct Backend {
        addr: std::net::SocketAddr,
        accepted: Arc<AtomicUsize>,
        closed: mpsc::Receiver<()>,
        hosts: mpsc::UnboundedReceiver<String>,
    }

    async fn backend(together: usize, close_after: usize) -> Backend {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (closed_tx, closed) = mpsc::channel(64);
        let (hosts_tx, hosts) = mpsc::unbounded_channel();
        let accepted = Arc::new(AtomicUsize::new(0));
        let barrier = Arc::new(tokio::sync::Barrier::new(together));
        let counter = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                let (closed_tx, hosts_tx, barrier) =
                    (closed_tx.clone(), hosts_tx.clone(), barrier.clone());
                tokio::spawn(async move {
                    let (mut buf, mut chunk, mut answered) = (Vec::new(), [0u8; 1024], 0);
                    'read: loop {
                        match socket.read(&mut chunk).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
                            let host = head
                                .lines()
                                .find_map(|l| l.strip_prefix("host: "))
                                .unwrap_or_default()
                                .to_owned();
                            let _ = hosts_tx.send(host);
                            buf.drain(..end + 4);
                            if answered == 0 {
                                barrier.wait().await;
                            }
                            answered += 1;
                            let reply = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                            if socket.write_all(reply).await.is_err() || answered == close_after {
                                break 'read;
                            }
                        }
                    }
                    drop(socket);
                    let _ = closed_tx.send(()).await;
                });
            }
        });
        Backend {
            addr,
            accepted,
            closed,
            hosts,
        }
    }

    fn pool(addr: std::net::SocketAddr, idle_timeout: Duration, max_idle: usize) -> ConnPool {
        let authority: uri::Authority = addr.to_string().parse().expect("authority");
        ConnPool::new(&authority, Duration::from_secs(5), idle_timeout, max_idle).expect("pool")
    }

    fn request(addr: std::net::SocketAddr) -> Request<Full<Bytes>> {
        Request::post(format!("http://{addr}/v1/chat/completions"))
            .body(Full::new(Bytes::from_static(b"{}")))
            .expect("request")
    }

    /// Sends `n` concurrent requests and reads every response to its end.
    async fn burst(pool: &ConnPool, addr: std::net::SocketAddr, n: usize) {
        let requests = (0..n).map(|_| async move {
            let resp = pool
                .send(request(addr), Duration::from_secs(10))
                .await
                .expect("response");
            let body = resp.into_body().collect().await.expect("body").to_bytes();
            assert_eq!(&body[..], b"ok");
        });
        futures::future::join_all(requests).await;
    }

    async fn closed_within(rx: &mut mpsc::Receiver<()>, n: usize) {
        let wait = async {
            for _ in 0..n {
                rx.recv().await.expect("backend running");
            }
        };
        tokio::time::timeout(Duration::from_secs(20), wait)
            .await
            .unwrap_or_else(|_| panic!("{n} backend connections were not closed"));
    }

    #[tokio::test]
    async fn sequential_requests_reuse_one_connection_with_the_backends_host() {
        let mut up = backend(1, usize::MAX).await;
        let pool = pool(up.addr, Duration::from_secs(3600), 8);
        for _ in 0..5 {
            burst(&pool, up.addr, 1).await;
        }
        assert_eq!(up.accepted.load(Ordering::SeqCst), 1);
        assert_eq!(pool.idle_count(), 1);
        assert_eq!(
            up.hosts.recv().await.expect("a request"),
            up.addr.to_string()
        );
    }

    #[tokio::test]
    async fn idle_backend_connections_close_after_the_idle_timeout() {
        let mut up = backend(8, usize::MAX).await;
        let pool = pool(up.addr, Duration::from_millis(200), 64);
        burst(&pool, up.addr, 8).await;
        // The pool stays alive: only its reaper can close these.
        closed_within(&mut up.closed, 8).await;
        assert_eq!(pool.idle_count(), 0);
    }

    #[tokio::test]
    async fn idle_backend_connections_beyond_the_cap_close_at_once() {
        let mut up = backend(8, usize::MAX).await;
        let pool = pool(up.addr, Duration::from_secs(3600), 2);
        burst(&pool, up.addr, 8).await;
        closed_within(&mut up.closed, 6).await;
        assert!(up.closed.try_recv().is_err(), "the 2 kept stay open");
        assert_eq!(pool.idle_count(), 2);
    }

    /// The backend closes each connection after one answer: the next request finds the pooled
    /// connection closed (or gets it back unsent) and goes out on a fresh one.
    #[tokio::test]
    async fn a_connection_the_backend_closed_is_not_reused() {
        let mut up = backend(1, 1).await;
        let pool = pool(up.addr, Duration::from_secs(3600), 8);
        burst(&pool, up.addr, 1).await;
        closed_within(&mut up.closed, 1).await;
        burst(&pool, up.addr, 1).await;
        assert_eq!(up.accepted.load(Ordering::SeqCst), 2);
    }

    /// A response body dropped before its end (the client went away) closes its connection.
    #[tokio::test]
    async fn a_body_dropped_before_its_end_closes_the_connection() {
        let mut up = backend(1, usize::MAX).await;
        let pool = pool(up.addr, Duration::from_secs(3600), 8);
        let resp = pool
            .send(request(up.addr), Duration::from_secs(10))
            .await
            .expect("response");
        drop(resp);
        closed_within(&mut up.closed, 1).await;
        assert_eq!(pool.idle_count(), 0);
        burst(&pool, up.addr, 1).await;
        assert_eq!(up.accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_refused_connection_is_a_connect_error() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        drop(listener);
        let pool = pool(addr, Duration::from_secs(3600), 8);
        let error = pool
            .send(request(addr), Duration::from_secs(10))
            .await
            .expect_err("nothing listens");
        assert!(error.is_connect(), "{error}");
    }

    #[test]
    fn the_host_header_omits_the_default_port() {
        let at = |authority: &str| {
            let authority: uri::Authority = authority.parse().expect("authority");
            ConnPool::new(&authority, Duration::ZERO, Duration::ZERO, 0)
                .expect("pool")
                .inner
                .host_header
                .clone()
        };
        assert_eq!(at("backend:80"), "backend");
        assert_eq!(at("backend"), "backend");
        assert_eq!(at("backend:8000"), "backend:8000");
        assert_eq!(at("[::1]:8000"), "[::1]:8000");
    }
}
