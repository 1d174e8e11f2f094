//! A per-backend pool of HTTP/1.1 connections for plain-`http` backends (the hot path; HTTPS
//! backends keep the pooled hyper-util client of [`super::upstream`], which negotiates h2 or
//! http/1.1 by ALPN). The exchange itself is the client role of the one HTTP/1.1 codec
//! ([`crate::http1::client`]), run by the request's own task:
//! no task per connection, no channel between the socket and the response body.
//!
//! Why not the hyper-util legacy client here: per request it hashes the pool key (SipHash) twice,
//! checks a connection out through a waiter queue, spawns a task that waits for the connection to
//! be ready again and puts it back, and rebuilds the request's URI. Why not hyper's
//! `client::conn::http1` either (this pool's first version): each connection is a task of its own
//! that hands the answer over one frame at a time, so every upstream chunk cost a poll of both
//! tasks. This pool is one `Mutex`ed stack per backend: a request pops the most recently used idle
//! connection, and its response body pushes the connection back when it ends.
//!
//! Bounds, as the legacy client had them:
//! - **Connect timeout**: dialling (name resolution + TCP connect) is bounded by
//!   `connect_timeout`; a failure is [`UpstreamError::Connect`] (nothing was sent, so the proxy
//!   may try another replica).
//! - **Head timeout**: writing the request and reading the response head are bounded by the
//!   caller's `head_timeout`; the head itself by [`crate::http1::client::MAX_HEAD_BYTES`].
//! - **Idle cap**: at most `max_idle` idle connections are kept; one more going idle is closed.
//! - **Idle timeout**: an idle connection older than `idle_timeout` is never reused, and a reaper
//!   task (started with the first idle connection, ending with the pool) closes them every
//!   `idle_timeout`, so an idle connection lives at most twice that long.
//! - A response body dropped before its end (client gone) closes its connection: it is never
//!   reused with bytes of an old answer in flight. Nor is one whose answer said `Connection:
//!   close`, was delimited by the close, or was followed by bytes nobody asked for.
//! - A pooled connection is checked before use with one non-blocking read: one the backend closed
//!   meanwhile (or that holds stray bytes) is dropped, and one that refuses the request's first
//!   byte is given up for a fresh connection (nothing was sent on it).

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::http::{HeaderName, HeaderValue, Method, Response, header, uri};
use bytes::{Bytes, BytesMut};
use hyper::body::{Frame, SizeHint};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tracing::debug;

use super::upstream::UpstreamError;
use crate::http1::client::{self, Client};
use crate::http1::{self, ChunkedDecoder, Decoded, Framing, ProtocolError, Role as _};

/// A read asks for at least this much free buffer; the buffer grows by [`READ_RESERVE`].
const READ_MIN: usize = 4096;
const READ_RESERVE: usize = 16 * 1024;

/// A field borrowed for less long (so that the pool's own `Host` can follow the caller's).
fn shorter<'s, 'h: 's>(
    field: (&'h HeaderName, &'h HeaderValue),
) -> (&'s HeaderName, &'s HeaderValue) {
    field
}

/// One backend connection: the socket and what was read from it and not yet consumed.
#[derive(Debug)]
struct Conn {
    io: TcpStream,
    buf: BytesMut,
}

impl Conn {
    fn new(io: TcpStream) -> Self {
        Self {
            io,
            buf: BytesMut::new(),
        }
    }

    /// Reads what the socket holds into the buffer (`Ok(0)`: the backend closed it).
    ///
    /// Through `AsyncRead::poll_read`, not `try_read_buf`: tokio clears the socket's readiness
    /// after a short read (the socket is drained, epoll will say when more arrives), so the next
    /// read waits for that instead of trying a `recvfrom` that fails with `EAGAIN` (one wasted
    /// system call per read with `try_read_buf`, measured: docs/performance.md).
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.buf.capacity() - self.buf.len() < READ_MIN {
            self.buf.reserve(READ_RESERVE);
        }
        tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.buf)
    }

    async fn fill(&mut self) -> io::Result<usize> {
        std::future::poll_fn(|cx| self.poll_fill(cx)).await
    }

    /// Whether an idle connection can carry a request: nothing arrived on it meanwhile (no
    /// close, no stray bytes). One non-blocking read at most.
    fn is_reusable(&mut self) -> bool {
        if !self.buf.is_empty() {
            return false;
        }
        self.buf.reserve(READ_MIN);
        matches!(self.io.try_read_buf(&mut self.buf), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }

    /// Writes the whole request. `Err((wrote_any, error))`.
    async fn write(&mut self, head: &[u8], body: &[u8]) -> Result<(), (bool, io::Error)> {
        let first = match self.io.write(head).await {
            Ok(0) => return Err((false, io::ErrorKind::WriteZero.into())),
            Ok(n) => n,
            Err(error) => return Err((false, error)),
        };
        let rest = async {
            self.io.write_all(&head[first..]).await?;
            self.io.write_all(body).await
        };
        rest.await.map_err(|error| (true, error))
    }
}

#[derive(Debug)]
struct Idle {
    conn: Conn,
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

fn lock<T>(guarded: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Pushes and pops only: a panic elsewhere leaves the stack consistent.
    guarded.lock().unwrap_or_else(PoisonError::into_inner)
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

    /// Sends a request of these header fields (any `Host` among them is replaced by the
    /// backend's) and body to `path_and_query`, waiting at most `head_timeout` for the response
    /// head (dialling included). The fields are encoded straight into the written request: the
    /// request path builds no header map for it ([`super::headers::Outbound::fields`]).
    pub async fn send<'h, H>(
        &self,
        method: &Method,
        path_and_query: &str,
        fields: H,
        body: &[u8],
        head_timeout: Duration,
    ) -> Result<Response<PooledBody>, UpstreamError>
    where
        H: IntoIterator<Item = (&'h HeaderName, &'h HeaderValue)>,
    {
        let exchange = self.exchange(method, path_and_query, fields, body);
        match tokio::time::timeout(head_timeout, exchange).await {
            Err(_) => Err(UpstreamError::Timeout(head_timeout)),
            Ok(result) => result,
        }
    }

    async fn exchange<'h, H>(
        &self,
        method: &Method,
        path_and_query: &str,
        fields: H,
        body: &[u8],
    ) -> Result<Response<PooledBody>, UpstreamError>
    where
        H: IntoIterator<Item = (&'h HeaderName, &'h HeaderValue)>,
    {
        let host = (&header::HOST, &self.inner.host_header);
        let mut closes = false;
        let fields = fields
            .into_iter()
            .filter(|(name, _)| *name != header::HOST)
            .inspect(|(name, value)| closes |= http1::asks_to_close(name, value));
        let mut head = Vec::with_capacity(256 + body.len().min(client::INLINE_BODY_BYTES));
        let inline = Client::encode(
            method,
            path_and_query,
            fields.map(shorter).chain(std::iter::once(host)),
            body,
            &mut head,
        );
        let body = if inline { &[][..] } else { body };

        let mut conn = match self.checkout() {
            Some(mut conn) => match conn.write(&head, body).await {
                Ok(()) => conn,
                // Refused before a byte went out (the backend closed it meanwhile): once more,
                // on a fresh connection.
                Err((false, _)) => self.fresh(&head, body).await?,
                Err((true, error)) => {
                    return Err(UpstreamError::Transport(format!(
                        "sending the request: {error}"
                    )));
                }
            },
            None => self.fresh(&head, body).await?,
        };
        let head = loop {
            match Client::parse(&mut conn.buf, method) {
                Ok(Some(head)) => break head,
                Ok(None) => {}
                Err(error) => return Err(UpstreamError::Transport(error.to_string())),
            }
            match conn.fill().await {
                Ok(0) => {
                    return Err(UpstreamError::Transport(
                        "the backend closed the connection before a response head".to_owned(),
                    ));
                }
                Ok(_) => {}
                Err(error) => {
                    return Err(UpstreamError::Transport(format!(
                        "reading the response: {error}"
                    )));
                }
            }
        };
        let state = match head.framing {
            Framing::Length(left) => BodyState::Length { left },
            Framing::Chunked => BodyState::Chunked(ChunkedDecoder::default()),
            Framing::UntilClose => BodyState::UntilClose,
        };
        let mut body = PooledBody {
            conn: Some(conn),
            state,
            reuse: head.keep_alive && !closes,
            pool: Arc::downgrade(&self.inner),
        };
        if matches!(body.state, BodyState::Length { left: 0 }) {
            // No body to read: the connection is free at once.
            body.finish();
        }
        let mut response = Response::new(body);
        *response.status_mut() = head.status;
        *response.version_mut() = head.version;
        *response.headers_mut() = head.headers;
        Ok(response)
    }

    /// A new connection with the request written on it.
    async fn fresh(&self, head: &[u8], body: &[u8]) -> Result<Conn, UpstreamError> {
        let mut conn = self.connect().await?;
        match conn.write(head, body).await {
            Ok(()) => Ok(conn),
            // Nothing was written: another replica may take it.
            Err((false, error)) => Err(UpstreamError::Connect(format!(
                "sending to {}:{}: {error}",
                self.inner.host, self.inner.port
            ))),
            Err((true, error)) => Err(UpstreamError::Transport(format!(
                "sending the request: {error}"
            ))),
        }
    }

    /// The most recently used idle connection that is still open, with nothing arrived on it.
    fn checkout(&self) -> Option<Conn> {
        loop {
            let Idle { mut conn, since } = lock(&self.inner.idle).pop()?;
            if since.elapsed() < self.inner.idle_timeout && conn.is_reusable() {
                return Some(conn);
            }
        }
    }

    async fn connect(&self) -> Result<Conn, UpstreamError> {
        let inner = &self.inner;
        let dial = TcpStream::connect((inner.host.as_str(), inner.port));
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
        Ok(Conn::new(stream))
    }
}

impl Inner {
    /// Takes `conn` back after its answer ended: kept (up to `max_idle`) or closed.
    fn put(self: &Arc<Self>, conn: Conn) {
        {
            let mut idle = lock(&self.idle);
            if idle.len() >= self.max_idle {
                return;
            }
            idle.push(Idle {
                conn,
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
        // Dropped outside the lock.
        let expired: Vec<Idle> = {
            let mut idle = lock(&pool.idle);
            let (expired, kept) = std::mem::take(&mut *idle)
                .into_iter()
                .partition(|c| now.duration_since(c.since) >= every);
            *idle = kept;
            expired
        };
        drop(expired);
    }
}

/// Why a pooled response body failed.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("reading the response body: {0}")]
    Io(#[from] io::Error),
    #[error("the backend closed the connection before the response body's end")]
    Truncated,
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
}

#[derive(Debug)]
enum BodyState {
    Length { left: u64 },
    Chunked(ChunkedDecoder),
    UntilClose,
    Done,
}

/// A backend's response body, read by the task that polls it: gives its connection back to the
/// pool when it ends (when the connection may carry another request).
#[derive(Debug)]
pub struct PooledBody {
    /// `None` once the body ended or failed.
    conn: Option<Conn>,
    state: BodyState,
    /// Whether the connection goes back to the pool at the body's end.
    reuse: bool,
    pool: Weak<Inner>,
}

impl PooledBody {
    /// The body ended: its connection goes back to the pool (when it may be reused and nothing
    /// beyond the answer arrived) or is closed.
    fn finish(&mut self) {
        self.state = BodyState::Done;
        if let Some(conn) = self.conn.take()
            && self.reuse
            && conn.buf.is_empty()
            && let Some(pool) = self.pool.upgrade()
        {
            pool.put(conn);
        }
    }

    fn fail(&mut self, error: BodyError) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        self.state = BodyState::Done;
        self.conn = None;
        Poll::Ready(Some(Err(error)))
    }
}

impl hyper::body::Body for PooledBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = &mut *self;
        loop {
            let Some(conn) = this.conn.as_mut() else {
                return Poll::Ready(None);
            };
            match &mut this.state {
                BodyState::Done => return Poll::Ready(None),
                BodyState::Length { left: 0 } => {
                    this.finish();
                    return Poll::Ready(None);
                }
                BodyState::Length { left } if !conn.buf.is_empty() => {
                    let take = usize::try_from(*left)
                        .unwrap_or(usize::MAX)
                        .min(conn.buf.len());
                    let data = conn.buf.split_to(take).freeze();
                    *left -= take as u64;
                    if *left == 0 {
                        this.finish();
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                BodyState::Chunked(decoder) => match decoder.decode(&mut conn.buf) {
                    Ok(Decoded::Data(data)) => return Poll::Ready(Some(Ok(Frame::data(data)))),
                    Ok(Decoded::End) => {
                        this.finish();
                        return Poll::Ready(None);
                    }
                    Ok(Decoded::NeedMore) => {}
                    Err(error) => return this.fail(error.into()),
                },
                BodyState::UntilClose if !conn.buf.is_empty() => {
                    let data = conn.buf.split().freeze();
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                BodyState::Length { .. } | BodyState::UntilClose => {}
            }
            let Some(conn) = this.conn.as_mut() else {
                return Poll::Ready(None);
            };
            match ready!(conn.poll_fill(cx)) {
                Ok(0) if matches!(this.state, BodyState::UntilClose) => {
                    this.finish();
                    return Poll::Ready(None);
                }
                Ok(0) => return this.fail(BodyError::Truncated),
                Ok(_) => {}
                Err(error) => return this.fail(error.into()),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.state, BodyState::Done | BodyState::Length { left: 0 })
    }

    fn size_hint(&self) -> SizeHint {
        match self.state {
            BodyState::Length { left } => SizeHint::with_exact(left),
            BodyState::Done => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use axum::http::HeaderMap;
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

    /// A small `POST` of the chat route through `pool`.
    async fn post(
        pool: &ConnPool,
        head_timeout: Duration,
    ) -> Result<Response<PooledBody>, UpstreamError> {
        let path = "/v1/chat/completions";
        pool.send(&Method::POST, path, &HeaderMap::new(), b"{}", head_timeout)
            .await
    }

    /// Sends `n` concurrent requests and reads every response to its end.
    async fn burst(pool: &ConnPool, n: usize) {
        let requests = (0..n).map(|_| async move {
            let resp = post(pool, Duration::from_secs(10)).await.expect("response");
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
            burst(&pool, 1).await;
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
        burst(&pool, 8).await;
        // The pool stays alive: only its reaper can close these.
        closed_within(&mut up.closed, 8).await;
        assert_eq!(pool.idle_count(), 0);
    }

    #[tokio::test]
    async fn idle_backend_connections_beyond_the_cap_close_at_once() {
        let mut up = backend(8, usize::MAX).await;
        let pool = pool(up.addr, Duration::from_secs(3600), 2);
        burst(&pool, 8).await;
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
        burst(&pool, 1).await;
        closed_within(&mut up.closed, 1).await;
        burst(&pool, 1).await;
        assert_eq!(up.accepted.load(Ordering::SeqCst), 2);
    }

    /// A response body dropped before its end (the client went away) closes its connection.
    #[tokio::test]
    async fn a_body_dropped_before_its_end_closes_the_connection() {
        let mut up = backend(1, usize::MAX).await;
        let pool = pool(up.addr, Duration::from_secs(3600), 8);
        let resp = post(&pool, Duration::from_secs(10))
            .await
            .expect("response");
        drop(resp);
        closed_within(&mut up.closed, 1).await;
        assert_eq!(pool.idle_count(), 0);
        burst(&pool, 1).await;
        assert_eq!(up.accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_refused_connection_is_a_connect_error() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        drop(listener);
        let pool = pool(addr, Duration::from_secs(3600), 8);
        let error = post(&pool, Duration::from_secs(10))
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

    /// A backend that answers the requests it reads, on any connection, with `replies` in turn
    /// (closing the connection after a reply marked so). Returns its address and the
    /// accepted-connection count.
    async fn scripted(
        replies: Vec<(&'static [u8], bool)>,
    ) -> (std::net::SocketAddr, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let accepted = Arc::new(AtomicUsize::new(0));
        let replies = Arc::new(Mutex::new(replies.into_iter()));
        let counter = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                let replies = replies.clone();
                tokio::spawn(async move {
                    let (mut buf, mut chunk) = (Vec::new(), [0u8; 1024]);
                    loop {
                        // One whole request: its head and its content-length body.
                        let request_end = loop {
                            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                                let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
                                let length: usize = head
                                    .lines()
                                    .find_map(|l| l.strip_prefix("content-length: "))
                                    .and_then(|n| n.trim().parse().ok())
                                    .unwrap_or(0);
                                if buf.len() >= end + 4 + length {
                                    break end + 4 + length;
                                }
                            }
                            match socket.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                        };
                        buf.drain(..request_end);
                        let Some((reply, close)) = lock(&replies).next() else {
                            return;
                        };
                        if socket.write_all(reply).await.is_err() || close {
                            return;
                        }
                    }
                });
            }
        });
        (addr, accepted)
    }

    async fn body_of(pool: &ConnPool) -> Result<Bytes, BodyError> {
        let resp = post(pool, Duration::from_secs(10))
            .await
            .expect("a response head");
        resp.into_body().collect().await.map(|b| b.to_bytes())
    }

    #[tokio::test]
    async fn chunked_answers_are_decoded_and_their_connection_reused() {
        const CHUNKED: &[u8] = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nx-trailer: t\r\n\r\n";
        let (addr, accepted) = scripted(vec![(CHUNKED, false), (CHUNKED, false)]).await;
        let pool = pool(addr, Duration::from_secs(3600), 8);
        for _ in 0..2 {
            assert_eq!(&body_of(&pool).await.expect("body")[..], b"hello world");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        assert_eq!(pool.idle_count(), 1);
    }

    #[tokio::test]
    async fn a_body_cut_short_is_an_error_and_its_connection_is_not_kept() {
        let (addr, accepted) = scripted(vec![
            (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort", true),
            (
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhel",
                true,
            ),
            (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", false),
        ])
        .await;
        let pool = pool(addr, Duration::from_secs(3600), 8);
        for _ in 0..2 {
            let error = body_of(&pool).await.expect_err("cut short");
            assert!(matches!(error, BodyError::Truncated), "{error}");
            assert_eq!(pool.idle_count(), 0);
        }
        assert_eq!(&body_of(&pool).await.expect("body")[..], b"ok");
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }

    /// `Connection: close`, bytes after the answer, a body delimited by the close, or an
    /// HTTP/1.0 answer with `Transfer-Encoding`: the connection is never reused.
    #[tokio::test]
    async fn connections_that_cannot_carry_another_request_are_not_reused() {
        let (addr, accepted) = scripted(vec![
            (
                b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok",
                false,
            ),
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokSTRAY",
                false,
            ),
            (b"HTTP/1.0 200 OK\r\n\r\nall of it", true),
            // A broken backend: HTTP/1.0 with `Transfer-Encoding` (RFC 9112 §6.1: close after).
            (
                b"HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\nconnection: keep-alive\r\n\r\n\
                  2\r\nok\r\n0\r\n\r\n",
                false,
            ),
            (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", false),
        ])
        .await;
        let pool = pool(addr, Duration::from_secs(3600), 8);
        assert_eq!(&body_of(&pool).await.expect("body")[..], b"ok");
        assert_eq!(pool.idle_count(), 0);
        assert_eq!(&body_of(&pool).await.expect("body")[..], b"ok");
        assert_eq!(pool.idle_count(), 0);
        assert_eq!(&body_of(&pool).await.expect("body")[..], b"all of it");
        assert_eq!(&body_of(&pool).await.expect("body")[..], b"ok");
        assert_eq!(pool.idle_count(), 0);
        assert_eq!(&body_of(&pool).await.expect("body")[..], b"ok");
        assert_eq!(accepted.load(Ordering::SeqCst), 5);
        assert_eq!(pool.idle_count(), 1);
    }

    #[tokio::test]
    async fn a_malformed_or_late_head_is_an_error_not_a_hang() {
        let (addr, _) = scripted(vec![
            (b"HTTP/1.1 200 OK\r\ncontent-length: nope\r\n\r\n", false),
            (b"HTTP/1.1 200 OK\r\n", false),
            (b"", true),
        ])
        .await;
        let pool = pool(addr, Duration::from_secs(3600), 8);
        let error = post(&pool, Duration::from_secs(10))
            .await
            .expect_err("malformed");
        assert!(
            matches!(&error, UpstreamError::Transport(m) if m.contains("content-length")),
            "{error}"
        );
        let error = post(&pool, Duration::from_millis(300))
            .await
            .expect_err("late");
        assert!(matches!(error, UpstreamError::Timeout(_)), "{error}");
        let error = post(&pool, Duration::from_secs(10))
            .await
            .expect_err("closed");
        assert!(
            matches!(&error, UpstreamError::Transport(m) if m.contains("before a response head")),
            "{error}"
        );
    }
}
