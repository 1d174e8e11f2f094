//! The front door's connection layer: accepts TCP connections and serves the router over
//! HTTP/1.1 or h2c (hyper-util's auto builder, as `axum::serve` did) with a timer, so that no
//! client can hold a connection, and with it a file descriptor, for free. A connection starts
//! with the front door's own HTTP/1.1 server for the plain hot-route requests ([`fast`]), which
//! hands it to hyper at its first other request: to the auto builder (HTTP/1.1, or h2c's
//! preface) when it served nothing yet, to HTTP/1.1 only after it served a request.
//!
//! - **Header-read timeout** (HTTP/1.1): a request head must be whole within
//!   `server.header_read_timeout` of its first byte (a new connection's first head: of the
//!   connection's start), on both servers. The connection's own timer measures it
//!   ([`Conn::idle_for`]), not hyper's, which starts when a kept-alive connection begins to
//!   wait and so closed every kept-alive connection `header_read_timeout` after its answer.
//! - **Body-read timeout**: a request body must arrive whole within `server.body_read_timeout` of
//!   its head; a late body fails the read and the handler answers 408.
//! - **Send timeout**: an answer that could not be written on for `server.send_timeout` (the
//!   client stopped reading) closes the connection and releases what it held, on both servers
//!   ([`fast::Socket`]); a client that reads slowly but steadily is not cut.
//! - **Idle timeout**: a connection with no request in flight (nothing sent yet, a stalled head,
//!   an h2c connection without streams, a kept-alive connection) is closed after
//!   `server.idle_timeout`. A request is in flight from its head until its response body ends,
//!   so a streamed (SSE) response is never cut by either timeout.
//! - **Connection cap**: at most `server.max_connections` (lowered to what the process's
//!   open-file limit can carry) are open; a new connection beyond it closes the oldest idle one,
//!   or is itself refused when every open connection has a request in flight. Both count in
//!   `continuum_http_connections_shed_total{reason}`.
//! - **Host**: an HTTP/1.1 request without exactly one `Host` field, or with one that is not
//!   `host[:port]`, is answered 400 and its connection closed (RFC 9112 §3.2), on both servers.
//!
//! Every accepted socket gets `TCP_NODELAY` (see [`super::listener`]).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Request, Version, header};
use axum::response::IntoResponse as _;
use bytes::Bytes;
use continuum_actors::metrics::Metrics;
use futures::future::Either;
use futures::task::AtomicWaker;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use prometheus::{IntCounterVec, IntGauge, Opts};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, mpsc, watch};
use tokio::time::{Instant, Sleep};
use tower_service::Service as _;
use tracing::{debug, info, warn};

use crate::config::ServerConfig;
use crate::wire::BodyReadTimeout;
use crate::wire::error::ApiError;

mod fast;

/// What the connection layer serves itself, without the router: the routes a handler names
/// (the front door's hot routes, [`super::AppState`]'s implementation), on both servers: the
/// front door's own HTTP/1.1 server ([`fast`]) and hyper's after a hand-over. Its one entrance is
/// [`Handler::serve`].
pub trait Handler: Send + Sync + 'static {
    /// A route the handler serves.
    type Route: Copy + Send + 'static;

    /// The route a request of `method` to `path` (its query aside) names; `None`: the router's.
    fn route(&self, method: &str, path: &str) -> Option<Self::Route>;

    /// The largest request body the handler takes: a longer one goes to hyper's server, which
    /// hands it to [`Handler::serve`] to refuse (413) and closes the connection after it.
    fn max_body(&self) -> usize;

    /// Answers a request of `route`.
    fn serve(
        &self,
        route: Self::Route,
        headers: HeaderMap,
        body: Body,
    ) -> impl Future<Output = axum::response::Response> + Send;
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// File descriptors kept free of client connections (listener, logs, etcd, ZMQ, artifacts).
pub const FD_RESERVE: u64 = 64;

/// How long the accept loop backs off after an accept error (e.g. out of file descriptors).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(20);

/// Accept errors are logged at most this often (with a running count).
const ACCEPT_WARN_EVERY: Duration = Duration::from_secs(5);

/// The front door's connection settings (`server.*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServeOptions {
    pub header_read_timeout: Duration,
    pub body_read_timeout: Duration,
    pub idle_timeout: Duration,
    pub send_timeout: Duration,
    pub max_connections: usize,
}

impl ServeOptions {
    pub fn from_config(server: &ServerConfig) -> Self {
        Self {
            header_read_timeout: server.header_read_timeout.get(),
            body_read_timeout: server.body_read_timeout.get(),
            idle_timeout: server.idle_timeout.get(),
            send_timeout: server.send_timeout.get(),
            max_connections: server.max_connections,
        }
    }
}

/// The connection cap the process can carry: `configured`, lowered when the soft open-file limit
/// `nofile` cannot hold that many client sockets plus one backend socket each and
/// [`FD_RESERVE`].
pub fn effective_max_connections(configured: usize, nofile: Option<u64>) -> usize {
    let Some(nofile) = nofile else {
        return configured;
    };
    let carried = usize::try_from(nofile.saturating_sub(FD_RESERVE) / 2).unwrap_or(usize::MAX);
    configured.min(carried.max(1))
}

/// The soft `RLIMIT_NOFILE` of this process, from `/proc/self/limits` (Linux); `None` elsewhere
/// or when unlimited.
pub fn soft_nofile_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits
        .lines()
        .find(|line| line.starts_with("Max open files"))?;
    line.trim_start_matches("Max open files")
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Why a connection was shed at the cap (`continuum_http_connections_shed_total{reason}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShedReason {
    /// The oldest connection with no request in flight was closed to make room.
    EvictedIdle,
    /// Every open connection had a request in flight: the new one was closed unserved.
    Refused,
}

impl ShedReason {
    pub const ALL: [ShedReason; 2] = [ShedReason::EvictedIdle, ShedReason::Refused];

    pub const fn as_label(self) -> &'static str {
        match self {
            ShedReason::EvictedIdle => "evicted_idle",
            ShedReason::Refused => "refused",
        }
    }
}

/// `continuum_http_connections`, `continuum_http_connections_limit` and
/// `continuum_http_connections_shed_total{reason}`.
#[derive(Clone)]
struct ConnMetrics {
    open: IntGauge,
    limit: IntGauge,
    shed: IntCounterVec,
}

impl ConnMetrics {
    fn new(metrics: Option<&Metrics>) -> Self {
        let open = IntGauge::new(
            "continuum_http_connections",
            "Client connections the front door holds open.",
        )
        .expect("a valid metric name");
        let limit = IntGauge::new(
            "continuum_http_connections_limit",
            "The front door's effective connection cap.",
        )
        .expect("a valid metric name");
        let shed = IntCounterVec::new(
            Opts::new(
                "continuum_http_connections_shed_total",
                "Client connections closed at the connection cap.",
            ),
            &["reason"],
        )
        .expect("a valid metric name");
        for reason in ShedReason::ALL {
            shed.with_label_values(&[reason.as_label()]);
        }
        if let Some(metrics) = metrics {
            let registry = metrics.registry();
            for collector in [
                Box::new(open.clone()) as Box<dyn prometheus::core::Collector>,
                Box::new(limit.clone()),
                Box::new(shed.clone()),
            ] {
                if let Err(error) = registry.register(collector) {
                    debug!(%error, "The front door's connection metrics are already registered.");
                }
            }
        }
        Self { open, limit, shed }
    }

    fn shed(&self, reason: ShedReason) {
        self.shed.with_label_values(&[reason.as_label()]).inc();
    }
}

/// One open connection's activity, shared by its task, its requests and the table.
struct Conn {
    /// Requests whose response body has not ended.
    in_flight: AtomicUsize,
    /// When `in_flight` last dropped to 0 (or the connection opened).
    idle_since: Mutex<Instant>,
    /// When the connection opened: what `head_since` counts from.
    opened: Instant,
    /// When the first byte of the request head being read arrived, in nanoseconds after
    /// `opened`, plus one; 0 while no head is being read (between requests, and for h2c). A new
    /// connection's first head is timed from its start.
    head_since: AtomicU64,
    /// `server.idle_timeout` and `server.header_read_timeout`.
    idle_timeout: Duration,
    header_read_timeout: Duration,
    /// Signalled to close the connection now (evicted at the cap).
    evict: Notify,
    /// Shutdown began while a request was in flight: [`fast`] closes after its answer.
    closing: AtomicBool,
}

/// Why the connection's timer closes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expired {
    /// No request in flight for `idle_timeout`.
    Idle,
    /// A request head not whole `header_read_timeout` after its first byte.
    Head,
}

impl Conn {
    fn new(options: &ServeOptions) -> Arc<Self> {
        let now = Instant::now();
        Arc::new(Self {
            in_flight: AtomicUsize::new(0),
            idle_since: Mutex::new(now),
            opened: now,
            head_since: AtomicU64::new(1),
            idle_timeout: options.idle_timeout,
            header_read_timeout: options.header_read_timeout,
            evict: Notify::new(),
            closing: AtomicBool::new(false),
        })
    }

    fn idle_since(&self) -> Instant {
        *self
            .idle_since
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// A request head's first byte arrived now (no-op when one is already being timed). [`fast`]
    /// calls it only when a head did not come whole with its first read, so a plain hot request
    /// reads no clock for it; for hyper, any read while no request is in flight does.
    fn head_started(&self) {
        if self.head_since.load(Ordering::Relaxed) == 0 {
            let since = Instant::now().saturating_duration_since(self.opened);
            let nanos = u64::try_from(since.as_nanos()).unwrap_or(u64::MAX - 1);
            self.head_since.store(nanos + 1, Ordering::Relaxed);
        }
    }

    /// No head is being read (a request started, or the connection is h2c).
    fn head_done(&self) {
        if self.head_since.load(Ordering::Relaxed) != 0 {
            self.head_since.store(0, Ordering::Relaxed);
        }
    }

    fn head_since(&self) -> Option<Instant> {
        match self.head_since.load(Ordering::Relaxed) {
            0 => None,
            n => Some(self.opened + Duration::from_nanos(n - 1)),
        }
    }

    /// Resolves once the connection has had no request in flight for `idle_timeout`, or a
    /// request head has not come whole `header_read_timeout` after its first byte.
    ///
    /// One timer for the connection's life, checked when it fires and set again: busy, to
    /// `min(idle_timeout, header_read_timeout)` later; idle, to the idle deadline, the head's
    /// deadline, or (no head being read) `header_read_timeout` later, whichever comes first. So
    /// a head that starts after a check is seen at the next one, before its deadline, and each
    /// deadline is met exactly. Requests neither wake this future nor move the timer (each did
    /// both before: a timer registered in the wheel and removed again per request, ≈ 2.5 k
    /// instructions; docs/performance.md, "Proxy vs nginx"): an idle connection's timer fires
    /// every `header_read_timeout`, a busy one's every `min(idle_timeout,
    /// header_read_timeout)`.
    async fn idle_for(&self) -> Expired {
        let check = self.idle_timeout.min(self.header_read_timeout);
        let timer = tokio::time::sleep(check);
        tokio::pin!(timer);
        loop {
            timer.as_mut().await;
            let now = Instant::now();
            let next = if self.in_flight.load(Ordering::Acquire) > 0 {
                now + check
            } else {
                let idle = self.idle_since() + self.idle_timeout;
                if now >= idle {
                    return Expired::Idle;
                }
                let head = match self.head_since() {
                    Some(since) if now >= since + self.header_read_timeout => {
                        return Expired::Head;
                    }
                    Some(since) => since + self.header_read_timeout,
                    None => now + self.header_read_timeout,
                };
                idle.min(head)
            };
            timer.as_mut().reset(next);
        }
    }
}

/// Marks a request in flight until dropped (with the response body, or with the handler's
/// future when the client goes away first). Its head is whole: the header-read timer stops.
struct InFlight(Arc<Conn>);

impl InFlight {
    fn start(conn: Arc<Conn>) -> Self {
        conn.in_flight.fetch_add(1, Ordering::AcqRel);
        conn.head_done();
        Self(conn)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            *self
                .0
                .idle_since
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Instant::now();
        }
    }
}

/// Open connections by accept order (oldest first), for eviction at the cap.
#[derive(Default)]
struct Table {
    next: u64,
    open: BTreeMap<u64, Arc<Conn>>,
}

impl Table {
    fn insert(&mut self, conn: Arc<Conn>) -> u64 {
        let id = self.next;
        self.next += 1;
        self.open.insert(id, conn);
        id
    }

    /// Removes and returns the oldest connection with no request in flight.
    fn evict_oldest_idle(&mut self) -> Option<Arc<Conn>> {
        let id = self
            .open
            .iter()
            .find(|(_, conn)| conn.in_flight.load(Ordering::Acquire) == 0)
            .map(|(id, _)| *id)?;
        self.open.remove(&id)
    }
}

type SharedTable = Arc<Mutex<Table>>;

fn lock(table: &SharedTable) -> std::sync::MutexGuard<'_, Table> {
    table.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A request body that fails with [`BodyReadTimeout`] once its deadline passes.
///
/// The first `Pending` does not arm the timer: hyper hands a body over only once it was asked for
/// (its "want" signal), so every body's first poll is pending, and one the client already sent
/// arrives before the task's next poll. That poll is made sure of (the task wakes itself), and
/// the timer is armed there if the body is still pending; the deadline is fixed at the request's
/// start either way: a body that came with its head no longer registers a timer in the wheel
/// and removes it again.
struct TimedBody {
    inner: Incoming,
    deadline: Instant,
    timeout: Duration,
    /// Whether a `Pending` was already answered by a wake instead of the timer.
    yielded: bool,
    timer: Option<Pin<Box<Sleep>>>,
}

impl hyper::body::Body for TimedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => Poll::Ready(frame.map(|f| f.map_err(BoxError::from))),
            Poll::Pending if !this.yielded => {
                this.yielded = true;
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            Poll::Pending => {
                let deadline = this.deadline;
                let timer = this
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => {
                        Poll::Ready(Some(Err(Box::new(BodyReadTimeout(this.timeout)))))
                    }
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        hyper::body::Body::is_end_stream(&self.inner)
    }

    fn size_hint(&self) -> SizeHint {
        hyper::body::Body::size_hint(&self.inner)
    }
}

/// A response body that keeps its request in flight until it ends or is dropped.
struct TrackedBody {
    inner: Body,
    _in_flight: InFlight,
}

impl hyper::body::Body for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        hyper::body::Body::is_end_stream(&self.inner)
    }

    fn size_hint(&self) -> SizeHint {
        hyper::body::Body::size_hint(&self.inner)
    }
}

/// Serves `router` on `listener` until `shutdown` resolves, then stops accepting, lets every
/// connection finish its in-flight requests (graceful), and returns when all are closed.
///
/// With `hot` (for the daemon, the state `router` was built with), the routes it names
/// ([`Handler::route`]: `POST /v1/chat/completions` and `/v1/completions`) are dispatched to it
/// without the router ([`Handler::serve`]); every other request goes through `router`.
pub async fn serve<H: Handler>(
    listener: TcpListener,
    router: Router,
    hot: Option<Arc<H>>,
    options: ServeOptions,
    metrics: Option<&Metrics>,
    shutdown: impl Future<Output = ()> + Send,
) {
    let conn_metrics = ConnMetrics::new(metrics);
    let nofile = soft_nofile_limit();
    let cap = effective_max_connections(options.max_connections, nofile);
    if cap < options.max_connections {
        warn!(
            configured = options.max_connections,
            effective = cap,
            soft_nofile_limit = nofile,
            "The open-file limit cannot carry server.max_connections client connections (each \
             may need a backend socket too); capping connections lower. Raise the limit \
             (ulimit -n, LimitNOFILE=) to use the configured cap."
        );
    } else {
        info!(
            max_connections = cap,
            soft_nofile_limit = nofile,
            "Front door connection cap."
        );
    }
    conn_metrics
        .limit
        .set(i64::try_from(cap).unwrap_or(i64::MAX));

    let mut builder = auto::Builder::new(TokioExecutor::new());
    // The header-read timeout is the connection's own ([`Conn::idle_for`]): hyper's starts when
    // a kept-alive connection begins to wait, not at the next request's first byte.
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(None);
    builder.http2().timer(TokioTimer::new());
    let h1_builder = Arc::new(builder.clone().http1_only());
    let builder = Arc::new(builder);
    let table = SharedTable::default();
    let (stop_tx, stop_rx) = watch::channel(false);
    // Every connection task holds a clone; `recv()` returns `None` once all have ended.
    let (alive_tx, mut alive_rx) = mpsc::channel::<Infallible>(1);

    let (mut accept_errors, mut last_warned) = (0u64, None);
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _peer)) => stream,
            Err(error) => {
                // Out of descriptors (or another transient failure): free one idle connection
                // if there is one, and back off so the loop does not spin.
                if let Some(victim) = lock(&table).evict_oldest_idle() {
                    victim.evict.notify_one();
                    conn_metrics.shed(ShedReason::EvictedIdle);
                }
                accept_errors += 1;
                if last_warned.is_none_or(|at: Instant| at.elapsed() >= ACCEPT_WARN_EVERY) {
                    warn!(%error, accept_errors, "accept error");
                    last_warned = Some(Instant::now());
                }
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        super::configure_accepted(&stream);
        let conn = Conn::new(&options);
        let id = {
            let mut table = lock(&table);
            if table.open.len() >= cap {
                match table.evict_oldest_idle() {
                    Some(victim) => {
                        victim.evict.notify_one();
                        conn_metrics.shed(ShedReason::EvictedIdle);
                    }
                    None => {
                        conn_metrics.shed(ShedReason::Refused);
                        drop(table);
                        drop(stream);
                        continue;
                    }
                }
            }
            table.insert(conn.clone())
        };
        conn_metrics.open.inc();
        let task = Connection {
            router: router.clone(),
            hot: hot.clone(),
            conn,
            id,
            table: table.clone(),
            options,
            builder: builder.clone(),
            h1_builder: h1_builder.clone(),
            stop: stop_rx.clone(),
            metrics: conn_metrics.clone(),
            _alive: alive_tx.clone(),
        };
        tokio::spawn(task.run(stream));
    }
    drop(listener);
    let _ = stop_tx.send(true);
    drop(alive_tx);
    let _ = alive_rx.recv().await;
}

/// One client connection's task.
struct Connection<H> {
    router: Router,
    hot: Option<Arc<H>>,
    conn: Arc<Conn>,
    id: u64,
    table: SharedTable,
    options: ServeOptions,
    builder: Arc<auto::Builder<TokioExecutor>>,
    /// `builder` for HTTP/1.1 only: for a connection the front door's own server handed over
    /// after serving a request on it.
    h1_builder: Arc<auto::Builder<TokioExecutor>>,
    stop: watch::Receiver<bool>,
    metrics: ConnMetrics,
    _alive: mpsc::Sender<Infallible>,
}

impl<H: Handler> Connection<H> {
    async fn run(mut self, stream: TcpStream) {
        // The side futures are polled only when they were woken: most wakes of this task are the
        // connection's own (every relayed frame of a streamed answer). The task's waker is
        // registered once per poll for all three.
        let conn = self.conn.clone();
        let task = Arc::new(AtomicWaker::new());
        let mut sides = Sides {
            evicted: Gated::new(conn.evict.notified(), &task),
            idle: Gated::new(conn.idle_for(), &task),
            stopped: Gated::new(self.stop.wait_for(|stop| *stop), &task),
            task,
            draining: false,
        };
        let stream = fast::Socket::new(stream, self.options.send_timeout);
        let io = match self.hot.clone() {
            Some(state) => {
                let fast = fast::serve(stream, state, conn.clone(), self.options.body_read_timeout);
                tokio::pin!(fast);
                loop {
                    match sides.wait(fast.as_mut()).await {
                        Event::Ended(fast::End::HandOff { io, served }) => {
                            break Some((io, served));
                        }
                        Event::Ended(fast::End::Closed(result)) => {
                            if let Err(error) = result {
                                debug!(%error, "A client connection ended with an error.");
                            }
                            break None;
                        }
                        Event::Evicted | Event::Idle => break None,
                        Event::Stopped if conn.in_flight.load(Ordering::Acquire) == 0 => {
                            break None;
                        }
                        Event::Stopped => {
                            conn.closing.store(true, Ordering::Release);
                            sides.draining = true;
                        }
                    }
                }
            }
            None => Some((fast::Rewound::new(stream, Bytes::new()), false)),
        };
        if let Some((io, served)) = io {
            let io = io.timing_heads(conn.clone(), served);
            let service = hyper_service(
                self.router.clone(),
                self.conn.clone(),
                self.hot.clone(),
                self.options.body_read_timeout,
            );
            // A connection that already carried a request is HTTP/1.1: the auto builder would
            // take h2c's preface after it for a new connection's (it sniffs at the hand-over).
            let builder = if served {
                &self.h1_builder
            } else {
                &self.builder
            };
            let connection = builder.serve_connection(TokioIo::new(io), service);
            tokio::pin!(connection);
            if sides.draining {
                connection.as_mut().graceful_shutdown();
            }
            loop {
                match sides.wait(connection.as_mut()).await {
                    Event::Ended(result) => {
                        if let Err(error) = result {
                            debug!(error = %error, "A client connection ended with an error.");
                        }
                        break;
                    }
                    Event::Evicted | Event::Idle => break,
                    Event::Stopped => {
                        connection.as_mut().graceful_shutdown();
                        sides.draining = true;
                    }
                }
            }
        }
        lock(&self.table).open.remove(&self.id);
        self.metrics.open.dec();
    }
}

/// The service hyper's server calls for each request once it took a connection over: `hot`'s
/// routes to it, every other request to `router`; each request in flight on `conn` from its head
/// until its answer's body ends, its body read under `body_timeout`, its `Host` checked first.
fn hyper_service<H: Handler>(
    router: Router,
    conn: Arc<Conn>,
    hot: Option<Arc<H>>,
    body_timeout: Duration,
) -> impl hyper::service::Service<
    Request<Incoming>,
    Response = axum::response::Response,
    Error = Infallible,
    Future: Send + 'static,
> + Clone
+ Send
+ 'static {
    hyper::service::service_fn(move |req: Request<Incoming>| {
        let direct = hot.as_ref().and_then(|handler| {
            Some((
                handler,
                handler.route(req.method().as_str(), req.uri().path())?,
            ))
        });
        let in_flight = InFlight::start(conn.clone());
        let req = req.map(|inner| {
            Body::new(TimedBody {
                inner,
                deadline: Instant::now() + body_timeout,
                timeout: body_timeout,
                yielded: false,
                timer: None,
            })
        });
        let tracked = |response: axum::response::Response| {
            response.map(|inner| {
                Body::new(TrackedBody {
                    inner,
                    _in_flight: in_flight,
                })
            })
        };
        match direct {
            _ if !host_is_valid(&req) => {
                Either::Left(Either::Right(std::future::ready(Ok(tracked(bad_host())))))
            }
            Some((handler, route)) => {
                let handler = handler.clone();
                Either::Left(Either::Left(async move {
                    let (parts, body) = req.into_parts();
                    let response = handler.serve(route, parts.headers, body).await;
                    Ok::<_, Infallible>(tracked(response))
                }))
            }
            None => {
                let mut router = router.clone();
                Either::Right(async move {
                    let response = router.call(req).await?;
                    Ok::<_, Infallible>(tracked(response))
                })
            }
        }
    })
}

/// Whether an HTTP/1.x request's `Host` fields are what RFC 9112 §3.2 asks: exactly one, valid
/// ([`crate::http1::valid_host`]), in HTTP/1.1; at most one in HTTP/1.0. An HTTP/2 request names
/// its authority in `:authority` and is not checked.
fn host_is_valid<B>(req: &Request<B>) -> bool {
    let version = req.version();
    if version > Version::HTTP_11 {
        return true;
    }
    let mut hosts = req.headers().get_all(header::HOST).iter();
    match (hosts.next(), hosts.next()) {
        (None, _) => version < Version::HTTP_11,
        (Some(host), None) => crate::http1::valid_host(host.as_bytes()),
        (Some(_), Some(_)) => false,
    }
}

/// The answer to a request [`host_is_valid`] refuses: 400, and the connection closes after it.
fn bad_host() -> axum::response::Response {
    let error = ApiError::BadRequest(
        "an HTTP/1.1 request needs exactly one Host header, with a valid host[:port]".into(),
    );
    let mut response = error.into_response();
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// What ended a wait of the connection task.
enum Event<T> {
    /// The connection (or the front door's own server on it) ended, with its output.
    Ended(T),
    Evicted,
    Idle,
    /// Shutdown began: drain the connection.
    Stopped,
}

/// The connection task's side futures: eviction, the idle timer, shutdown.
struct Sides<A, B, C> {
    evicted: Gated<A>,
    idle: Gated<B>,
    stopped: Gated<C>,
    /// Where the task registers its waker for the three.
    task: Arc<AtomicWaker>,
    /// Shutdown was seen (it is not waited for again).
    draining: bool,
}

impl<A: Future, B: Future<Output = Expired>, C: Future> Sides<A, B, C> {
    /// Polls `serving` until it ends or a side future does.
    async fn wait<F: Future>(&mut self, mut serving: Pin<&mut F>) -> Event<F::Output> {
        std::future::poll_fn(|cx| {
            if let Poll::Ready(output) = serving.as_mut().poll(cx) {
                return Poll::Ready(Event::Ended(output));
            }
            // Registered before the flags are read: a wake between the two is not lost.
            self.task.register(cx.waker());
            if self.evicted.poll_if_woken().is_ready() {
                debug!("Closing an idle client connection at the connection cap.");
                return Poll::Ready(Event::Evicted);
            }
            if let Poll::Ready(expired) = self.idle.poll_if_woken() {
                match expired {
                    Expired::Idle => {
                        debug!("Closing a client connection idle for server.idle_timeout.");
                    }
                    Expired::Head => debug!(
                        "Closing a client connection whose request head took longer than \
                         server.header_read_timeout."
                    ),
                }
                return Poll::Ready(Event::Idle);
            }
            if !self.draining && self.stopped.poll_if_woken().is_ready() {
                return Poll::Ready(Event::Stopped);
            }
            Poll::Pending
        })
        .await
    }
}

/// A future polled only on its first poll and after its own waker fired, not at every poll of
/// the task around it.
///
/// The connection task waits on the connection and three side futures (eviction, idle
/// timeout, shutdown); a plain `select!` polls all of them at every wake of the task, and each
/// poll of a registered `Notified` or `watch` future takes a lock. Almost every wake is the
/// connection's (a streamed answer wakes the task once per relayed frame), so the side futures
/// get a waker of their own that marks them woken and wakes the task through `task`, which the
/// task registers its waker in once per poll for all of them (one registration per side future
/// per poll cost ≈ 2.8 k instructions per SSE request; docs/performance.md, "Proxy vs nginx").
struct Gated<F> {
    future: Pin<Box<F>>,
    signal: Arc<Signal>,
    /// `signal` as a waker, made once.
    waker: std::task::Waker,
}

/// What a [`Gated`] future's waker sets.
struct Signal {
    woken: AtomicBool,
    /// Where the task around the gated futures registers its waker.
    task: Arc<AtomicWaker>,
}

impl std::task::Wake for Signal {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.task.wake();
    }
}

impl<F: Future> Gated<F> {
    /// `future`, waking the task registered in `task`.
    fn new(future: F, task: &Arc<AtomicWaker>) -> Self {
        let signal = Arc::new(Signal {
            // The first poll registers the future's waker.
            woken: AtomicBool::new(true),
            task: task.clone(),
        });
        Self {
            future: Box::pin(future),
            waker: std::task::Waker::from(signal.clone()),
            signal,
        }
    }

    /// Polls the future if its waker fired since its last poll (or it was never polled). The
    /// caller registers the task's waker in `task` first, so that a wake after the flag is read
    /// reaches the task.
    fn poll_if_woken(&mut self) -> Poll<F::Output> {
        if !self.signal.woken.load(Ordering::Acquire)
            || !self.signal.woken.swap(false, Ordering::AcqRel)
        {
            return Poll::Pending;
        }
        self.future
            .as_mut()
            .poll(&mut Context::from_waker(&self.waker))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_is_lowered_to_what_the_fd_limit_carries() {
        assert_eq!(effective_max_connections(4096, None), 4096);
        assert_eq!(effective_max_connections(4096, Some(1024)), 480);
        assert_eq!(effective_max_connections(100, Some(1024)), 100);
        assert_eq!(effective_max_connections(4096, Some(10)), 1);
        assert_eq!(effective_max_connections(4096, Some(1_048_576)), 4096);
    }

    /// A gated future is polled once to register, then only after its own waker fired.
    #[tokio::test(start_paused = true)]
    async fn a_gated_future_is_polled_only_when_woken() {
        let notify = Arc::new(Notify::new());
        let polls = Arc::new(AtomicUsize::new(0));
        let task = Arc::new(AtomicWaker::new());
        let mut gated = Gated::new(
            {
                let (notify, polls) = (notify.clone(), polls.clone());
                let mut notified = Box::pin(async move { notify.notified().await });
                std::future::poll_fn(move |cx| {
                    polls.fetch_add(1, Ordering::SeqCst);
                    notified.as_mut().poll(cx)
                })
            },
            &task,
        );
        // The connection task's way of waiting on it.
        let mut wait = std::future::poll_fn(|cx| {
            task.register(cx.waker());
            gated.poll_if_woken()
        });
        for _ in 0..3 {
            assert!(futures::poll!(&mut wait).is_pending());
        }
        assert_eq!(polls.load(Ordering::SeqCst), 1);
        notify.notify_one();
        // Paused time: were the wake lost, the runtime would jump to the hour's end.
        tokio::time::timeout(Duration::from_secs(3600), wait)
            .await
            .expect("the notification reaches the gated future");
        assert_eq!(polls.load(Ordering::SeqCst), 2);
    }

    /// The connection's timer on the paused clock: a new connection's first head is timed from
    /// its start; a kept-alive connection waits `idle_timeout`, however long its request took;
    /// a later head is timed from its first byte.
    #[tokio::test(start_paused = true)]
    async fn heads_are_timed_from_their_first_byte_and_waits_for_a_request_by_idle_timeout() {
        use tokio::time::advance;
        let options = ServeOptions {
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(60),
            send_timeout: Duration::from_secs(60),
            max_connections: 1,
        };
        let timed = |conn: &Arc<Conn>| {
            let (conn, start) = (conn.clone(), Instant::now());
            tokio::spawn(async move { (conn.idle_for().await, start.elapsed()) })
        };

        // Nothing sent: the first head's timer, from the connection's start.
        let silent = Conn::new(&options);
        let closed = timed(&silent).await.expect("timer");
        assert_eq!(closed, (Expired::Head, Duration::from_secs(10)));

        // A request of 30 s, then nothing: closed `idle_timeout` after its answer.
        let kept = Conn::new(&options);
        let timer = timed(&kept);
        let request = InFlight::start(kept.clone());
        advance(Duration::from_secs(30)).await;
        drop(request);
        let closed = timer.await.expect("timer");
        assert_eq!(closed, (Expired::Idle, Duration::from_secs(90)));

        // A request, 20 s of quiet, then a head's first byte that nothing follows: closed
        // `header_read_timeout` after that byte.
        let stalled = Conn::new(&options);
        let timer = timed(&stalled);
        drop(InFlight::start(stalled.clone()));
        advance(Duration::from_secs(20)).await;
        assert!(!timer.is_finished(), "kept alive past header_read_timeout");
        stalled.head_started();
        advance(Duration::from_secs(3)).await;
        stalled.head_started();
        let closed = timer.await.expect("timer");
        assert_eq!(closed, (Expired::Head, Duration::from_secs(30)));
    }

    #[test]
    fn the_soft_limit_is_read_on_linux() {
        if cfg!(target_os = "linux") {
            assert!(soft_nofile_limit().is_some_and(|n| n > 0));
        }
    }
}
