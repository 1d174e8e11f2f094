//! The front door's connection layer: accepts TCP connections and serves the router over
//! HTTP/1.1 or h2c (hyper-util's auto builder, as `axum::serve` did) with a timer, so that no
//! client can hold a connection, and with it a file descriptor, for free. A connection starts
//! with the front door's own HTTP/1.1 server for the plain hot-route requests ([`fast`]), which
//! hands it to hyper at its first other request.
//!
//! - **Header-read timeout** (HTTP/1.1): a connection waiting for a request must deliver the whole
//!   head within `server.header_read_timeout` (while [`fast`] serves it, the idle timer with the
//!   shorter of the two limits; then hyper's timer).
//! - **Body-read timeout**: a request body must arrive whole within `server.body_read_timeout` of
//!   its head; a late body fails the read and the handler answers 408.
//! - **Idle timeout**: a connection with no request in flight (nothing sent yet, a stalled head,
//!   an h2c connection without streams, a kept-alive connection) is closed after
//!   `server.idle_timeout`. A request is in flight from its head until its response body ends,
//!   so a streamed (SSE) response is never cut by either timeout.
//! - **Connection cap**: at most `server.max_connections` (lowered to what the process's
//!   open-file limit can carry) are open; a new connection beyond it closes the oldest idle one,
//!   or is itself refused when every open connection has a request in flight. Both count in
//!   `continuum_http_connections_shed_total{reason}`.
//!
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
use axum::http::{HeaderValue, Request, Version, header};
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

/// The fast server's head parser and hand-over decision, for the fuzz targets (`fuzz/`) and their
/// corpus replay only.
#[doc(hidden)]
pub use fast::{MAX_FAST_HEAD, Parsed as FastParsed, parse as parse_fast_head};

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
    pub max_connections: usize,
}

impl ServeOptions {
    pub fn from_config(server: &ServerConfig) -> Self {
        Self {
            header_read_timeout: server.header_read_timeout.get(),
            body_read_timeout: server.body_read_timeout.get(),
            idle_timeout: server.idle_timeout.get(),
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
    /// Signalled to close the connection now (evicted at the cap).
    evict: Notify,
    /// How long the connection may wait for a request, in nanoseconds: `idle_timeout`, or, while
    /// the front door's own server ([`fast`]) reads the heads, the shorter of it and
    /// `header_read_timeout` (hyper's header timer takes that part over when it takes the
    /// connection).
    idle_limit: AtomicU64,
    /// Shutdown began while a request was in flight: [`fast`] closes after its answer.
    closing: AtomicBool,
}

impl Conn {
    fn new(idle_limit: Duration) -> Arc<Self> {
        let conn = Arc::new(Self {
            in_flight: AtomicUsize::new(0),
            idle_since: Mutex::new(Instant::now()),
            evict: Notify::new(),
            idle_limit: AtomicU64::new(0),
            closing: AtomicBool::new(false),
        });
        conn.set_idle_limit(idle_limit);
        conn
    }

    fn idle_limit(&self) -> Duration {
        Duration::from_nanos(self.idle_limit.load(Ordering::Relaxed))
    }

    /// Takes effect at the idle timer's next check: a limit only ever grows (at the hand-over to
    /// hyper), and the timer armed for the shorter one fires first.
    fn set_idle_limit(&self, limit: Duration) {
        let nanos = u64::try_from(limit.as_nanos()).unwrap_or(u64::MAX);
        self.idle_limit.store(nanos, Ordering::Relaxed);
    }

    fn idle_since(&self) -> Instant {
        *self
            .idle_since
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Resolves once the connection has had no request in flight for its idle limit
    /// ([`Conn::idle_limit`], read at every check).
    ///
    /// One timer for the connection's life, checked when it fires and set again: busy, to a
    /// full `timeout` later; idle, to `timeout` after the last request ended. Requests neither
    /// wake this future nor move the timer (each did both before: a timer registered in the wheel
    /// and removed again per request, ≈ 2.5 k instructions; docs/performance.md, "Proxy vs
    /// nginx"). It still closes the connection exactly `timeout` after its last request ended.
    async fn idle_for(&self) {
        let timer = tokio::time::sleep(self.idle_limit());
        tokio::pin!(timer);
        loop {
            timer.as_mut().await;
            let timeout = self.idle_limit();
            let now = Instant::now();
            let deadline = if self.in_flight.load(Ordering::Acquire) > 0 {
                now + timeout
            } else {
                self.idle_since() + timeout
            };
            if now >= deadline {
                return;
            }
            timer.as_mut().reset(deadline);
        }
    }
}

/// Marks a request in flight until dropped (with the response body, or with the handler's
/// future when the client goes away first).
struct InFlight(Arc<Conn>);

impl InFlight {
    fn start(conn: Arc<Conn>) -> Self {
        conn.in_flight.fetch_add(1, Ordering::AcqRel);
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
/// With `hot` (the state `router` was built with), the hot routes ([`super::hot_route`]: `POST
/// /v1/chat/completions` and `/v1/completions`) are dispatched here without the router
/// ([`super::serve_hot`]); every other request goes through `router`.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    hot: Option<Arc<super::AppState>>,
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
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(options.header_read_timeout);
    builder.http2().timer(TokioTimer::new());
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
        let conn = Conn::new(if hot.is_some() {
            options.idle_timeout.min(options.header_read_timeout)
        } else {
            options.idle_timeout
        });
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
struct Connection {
    router: Router,
    hot: Option<Arc<super::AppState>>,
    conn: Arc<Conn>,
    id: u64,
    table: SharedTable,
    options: ServeOptions,
    builder: Arc<auto::Builder<TokioExecutor>>,
    stop: watch::Receiver<bool>,
    metrics: ConnMetrics,
    _alive: mpsc::Sender<Infallible>,
}

impl Connection {
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
        let io = match self.hot.clone() {
            Some(state) => {
                let fast = fast::serve(stream, state, conn.clone(), self.options.body_read_timeout);
                tokio::pin!(fast);
                loop {
                    match sides.wait(fast.as_mut()).await {
                        Event::Ended(fast::End::HandOff(io)) => break Some(io),
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
            None => Some(fast::Rewound::new(stream, Bytes::new())),
        };
        if let Some(io) = io {
            // hyper's header-read timer covers the waits for a head from here on.
            conn.set_idle_limit(self.options.idle_timeout);
            let service = {
                let (router, conn) = (self.router.clone(), self.conn.clone());
                let hot = self.hot.clone();
                let body_timeout = self.options.body_read_timeout;
                hyper::service::service_fn(move |req: Request<Incoming>| {
                    let direct = hot.as_ref().and_then(|state| {
                        Some((state, super::hot_route(req.method(), req.uri().path())?))
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
                        Some((state, route)) => {
                            let state = state.clone();
                            Either::Left(Either::Left(async move {
                                let response = super::serve_hot(&state, route, req).await;
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
            };
            let connection = self.builder.serve_connection(TokioIo::new(io), service);
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

/// Whether an HTTP/1.x request's `Host` fields are what RFC 9112 §3.2 asks: exactly one, valid
/// ([`fast::valid_host`]), in HTTP/1.1; at most one in HTTP/1.0. An HTTP/2 request names its
/// authority in `:authority` and is not checked.
fn host_is_valid<B>(req: &Request<B>) -> bool {
    let version = req.version();
    if version > Version::HTTP_11 {
        return true;
    }
    let mut hosts = req.headers().get_all(header::HOST).iter();
    match (hosts.next(), hosts.next()) {
        (None, _) => version < Version::HTTP_11,
        (Some(host), None) => fast::valid_host(host.as_bytes()),
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

impl<A: Future, B: Future, C: Future> Sides<A, B, C> {
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
            if self.idle.poll_if_woken().is_ready() {
                debug!("Closing a client connection idle for server.idle_timeout.");
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

    #[test]
    fn the_soft_limit_is_read_on_linux() {
        if cfg!(target_os = "linux") {
            assert!(soft_nofile_limit().is_some_and(|n| n > 0));
        }
    }
}
