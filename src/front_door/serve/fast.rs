//! The front door's own HTTP/1.1 server for the hot routes (the routes its [`Handler`] names:
//! `POST /v1/chat/completions` and `/v1/completions`), in front of hyper's.
//!
//! Every connection starts here. A request head that is a hot route's, in the plain form nearly
//! every client sends (HTTP/1.1, a `Content-Length` body within the handler's limit, no
//! `Transfer-Encoding`, `Expect` or `Upgrade`), is served by this loop: the head parsed in one
//! pass by the codec's server role ([`crate::http1::server`]), the body read whole, the handler
//! called with the header map, the answer's head ([`server::encode`]) and body written with one
//! write when it is whole. Anything else (another route, h2c's preface, HTTP/1.0, a chunked or
//! oversized body, a head larger than [`server::MAX_FAST_HEAD`] or one httparse refuses) is
//! handed to hyper's server at that request's first byte with every byte read so far
//! ([`Rewound`]), and hyper serves the connection from there on: its answers, limits and errors
//! are unchanged for everything but the plain hot request.
//!
//! Why: hyper's server connection cost ≈ 12 k instructions per proxied request, this loop about
//! a third of it (docs/performance.md, "Proxy vs nginx"; issue #16).
//!
//! The connection's limits stay those of [`super`]: its timer closes a connection whose head
//! is not whole `header_read_timeout` after its first byte (marked here when a read leaves a
//! head partial, [`Conn::head_started`]) or that waited `idle_timeout` with no request, a body
//! late beyond `body_read_timeout` fails the handler's read with [`BodyReadTimeout`] (a 408),
//! eviction and shutdown are the task's as for hyper's connections.

use std::future::{Future, poll_fn};
use std::io;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use bytes::{Buf, Bytes, BytesMut};
use hyper::body::Frame;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

use super::{BoxError, Conn, Handler, InFlight};
use crate::http1::server::{self, Accept, Parsed, Server};
use crate::http1::{Framing, Role as _, chunked};
use crate::wire::BodyReadTimeout;

/// What the read buffer starts with and grows by.
const READ_CHUNK: usize = 8 * 1024;

/// What a request body's own buffer starts with and grows by at least (doubling beyond it).
const BODY_CHUNK: usize = 64 * 1024;

/// Room under which the read buffer is grown before a read.
const READ_ROOM: usize = 1024;

/// Answer bytes gathered before they are written; a larger data frame is written as it is.
const WRITE_GATHER: usize = 64 * 1024;

/// How the loop ended.
pub enum End {
    /// The connection is done (closed by the client, by `Connection: close`, at shutdown, or
    /// on an error).
    Closed(io::Result<()>),
    /// hyper serves the connection from here on.
    HandOff {
        io: Rewound,
        /// Whether a request was served here first: the connection is HTTP/1.1 then, and hyper
        /// must not take bytes that follow as h2c's preface.
        served: bool,
    },
}

/// Serves plain hot-route requests on `stream` until the connection ends or a request is one
/// for hyper.
pub async fn serve<H: Handler>(
    mut stream: Socket,
    handler: Arc<H>,
    conn: Arc<Conn>,
    body_timeout: Duration,
) -> End {
    let mut buf = BytesMut::with_capacity(READ_CHUNK);
    let mut out = Vec::new();
    let mut served = false;
    let route = |method: &str, path: &str| handler.route(method, path);
    loop {
        let request = loop {
            let accept = Accept {
                max_body: handler.max_body(),
                route: &route,
            };
            match Server::parse(&mut buf, accept) {
                Parsed::Fast(request) => break request,
                Parsed::HandOff => {
                    let io = Rewound::new(stream, buf.freeze());
                    return End::HandOff { io, served };
                }
                // A head that did not come whole: timed from here ([`Conn::idle_for`]).
                Parsed::Partial if !buf.is_empty() => conn.head_started(),
                Parsed::Partial => {}
            }
            match read(&mut stream, &mut buf).await {
                Ok(0) => return End::Closed(Ok(())),
                Ok(_) => {}
                Err(error) => return End::Closed(Err(error)),
            }
        };
        let in_flight = InFlight::start(conn.clone());
        let (body, whole) =
            read_body(&mut stream, &mut buf, request.content_length, body_timeout).await;
        // Pinned where it is made: the handler's future is large, and moving it costs a copy.
        let answer = pin!(handler.serve(request.route, request.headers, body));
        let Some(response) = unless_gone(answer, &stream.inner, &mut buf).await else {
            // The client left: the handler, and with it the upstream request, is dropped.
            return End::Closed(Ok(()));
        };
        let keep = whole && !request.close && !conn.closing.load(Ordering::Acquire);
        let written = write_response(&mut stream, &mut buf, &mut out, response, keep).await;
        drop(in_flight);
        served = true;
        if out.capacity() > 2 * READ_CHUNK {
            // A large answer's buffer is not kept for the connection's life.
            out = Vec::new();
        }
        match written {
            Ok(true) if keep && !conn.closing.load(Ordering::Acquire) => {}
            Ok(_) => {
                let _ = stream.shutdown().await;
                return End::Closed(Ok(()));
            }
            Err(error) => return End::Closed(Err(error)),
        }
    }
}

/// `future`'s output, or `None` once the client has closed the connection (or it failed) first.
///
/// As hyper's server does while a request is answered: an answer the client no longer waits for
/// is not worked on (a long generation's upstream request is dropped with it). Bytes that arrive
/// meanwhile (a pipelined request) stay in `buf`, and then, as in hyper, the connection is no
/// longer watched for its end. It costs no system call of its own: the read that finds the
/// socket empty here is the one the next head's wait would make.
async fn unless_gone<F: Future>(
    mut future: Pin<&mut F>,
    stream: &TcpStream,
    buf: &mut BytesMut,
) -> Option<F::Output> {
    poll_fn(|cx| {
        if let Poll::Ready(output) = future.as_mut().poll(cx) {
            return Poll::Ready(Some(output));
        }
        poll_gone(stream, buf, cx).map(|()| None)
    })
    .await
}

/// Ready once the client's socket reached its end or failed; see [`unless_gone`].
fn poll_gone(stream: &TcpStream, buf: &mut BytesMut, cx: &mut Context<'_>) -> Poll<()> {
    if !buf.is_empty() {
        return Poll::Pending;
    }
    loop {
        match stream.poll_read_ready(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Err(_)) => return Poll::Ready(()),
            Poll::Ready(Ok(())) => {}
        }
        if buf.capacity() - buf.len() < READ_ROOM {
            buf.reserve(READ_CHUNK);
        }
        match stream.try_read_buf(buf) {
            Ok(0) => return Poll::Ready(()),
            Ok(_) => return Poll::Pending,
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
            Err(_) => return Poll::Ready(()),
        }
    }
}

/// One read into `buf`, growing it by [`READ_CHUNK`] when it has little room.
async fn read(stream: &mut Socket, buf: &mut BytesMut) -> io::Result<usize> {
    if buf.capacity() - buf.len() < READ_ROOM {
        buf.reserve(READ_CHUNK);
    }
    stream.read_buf(buf).await
}

/// The request body of `length` bytes (its start may be in `buf`), and whether it came whole. A
/// body that is not whole within `timeout` of its head fails the handler's read with
/// [`BodyReadTimeout`] (its 408); one the client broke off fails it with the read's error.
async fn read_body(
    stream: &mut Socket,
    buf: &mut BytesMut,
    length: usize,
    timeout: Duration,
) -> (Body, bool) {
    if buf.len() >= length {
        return (Body::from(buf.split_to(length).freeze()), true);
    }
    // A body that did not come with its head: read into a buffer of its own (reads stop at the
    // body's end, and the connection's buffer does not keep a large body's room), grown with what
    // arrives, never with what the length only promises; with a timer, armed only here.
    let deadline = Instant::now() + timeout;
    let mut body = BytesMut::with_capacity(body_room(0, length));
    body.extend_from_slice(&buf.split());
    while body.len() < length {
        let remaining = length - body.len();
        if body.capacity() == body.len() {
            body.reserve(body_room(body.len(), length));
        }
        let mut limited = (&mut *stream).take(remaining as u64);
        let read = limited.read_buf(&mut body);
        let error: BoxError = match tokio::time::timeout_at(deadline, read).await {
            Ok(Ok(0)) => "the client closed the connection before the body was whole".into(),
            Ok(Ok(_)) => continue,
            Ok(Err(error)) => Box::new(error),
            Err(_) => Box::new(BodyReadTimeout(timeout)),
        };
        return (Body::new(Failed(Some(error))), false);
    }
    (Body::from(body.freeze()), true)
}

/// How much a body buffer holding `have` of `length` bytes grows by when full: what is left, at
/// most [`BODY_CHUNK`] or as much as it holds (so it doubles), whatever the length promises.
fn body_room(have: usize, length: usize) -> usize {
    length.saturating_sub(have).min(BODY_CHUNK.max(have))
}

/// A request body that fails at its first poll.
struct Failed(Option<BoxError>);

impl hyper::body::Body for Failed {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Poll::Ready(self.0.take().map(Err))
    }
}

/// Writes `response` (head and body, framed by its length when known, chunked otherwise;
/// [`server::encode`]); `Ok(false)` when the connection cannot be kept (the body failed, or the
/// answer says `Connection: close`). `keep` false adds `Connection: close`.
async fn write_response(
    stream: &mut Socket,
    buf: &mut BytesMut,
    out: &mut Vec<u8>,
    response: Response,
    keep: bool,
) -> io::Result<bool> {
    let (parts, body) = response.into_parts();
    out.clear();
    let length = hyper::body::Body::size_hint(&body).exact();
    let answer = server::encode(parts.status, &parts.headers, length, keep, out);
    let Some(framing) = answer.body else {
        stream.write_all(out).await?;
        return Ok(answer.keep);
    };
    let whole = write_body(stream, buf, out, body, framing).await?;
    Ok(answer.keep && whole)
}

/// Writes the body after the head already in `out`; `Ok(false)` when the body failed or did not
/// match its length (the answer is cut: the connection must close). While it waits for the
/// body, the client's end is watched ([`unless_gone`]; `buf` keeps what arrives meanwhile).
async fn write_body(
    stream: &mut Socket,
    buf: &mut BytesMut,
    out: &mut Vec<u8>,
    body: Body,
    framing: Framing,
) -> io::Result<bool> {
    let length = match framing {
        Framing::Length(n) => Some(n),
        Framing::Chunked | Framing::UntilClose => None,
    };
    let mut body = pin!(body);
    let mut sent = 0u64;
    loop {
        // What is ready joins what is gathered; before waiting, the gathered bytes go out.
        let mut poll = |cx: &mut Context<'_>| hyper::body::Body::poll_frame(body.as_mut(), cx);
        let ready = poll_fn(|cx| Poll::Ready(poll(cx))).await;
        let frame = match ready {
            Poll::Ready(frame) => frame,
            Poll::Pending => {
                flush(stream, out).await?;
                unless_gone(pin!(poll_fn(poll)), &stream.inner, buf)
                    .await
                    .ok_or_else(|| io::Error::from(io::ErrorKind::ConnectionAborted))?
            }
        };
        let data = match frame {
            None => break,
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) if !data.is_empty() => data,
                _ => continue,
            },
            Some(Err(_)) => {
                // A chunked answer is left without its last chunk: the client sees it cut.
                flush(stream, out).await?;
                return Ok(false);
            }
        };
        sent += data.len() as u64;
        if length.is_some_and(|n| sent > n) {
            flush(stream, out).await?;
            return Ok(false);
        }
        if length.is_none() {
            chunked::push_size(out, data.len());
        }
        if out.len() + data.len() > WRITE_GATHER {
            flush(stream, out).await?;
            stream.write_all(&data).await?;
        } else {
            out.extend_from_slice(&data);
        }
        if length.is_none() {
            out.extend_from_slice(chunked::DATA_END);
        }
    }
    let whole = match length {
        None => {
            out.extend_from_slice(chunked::LAST_CHUNK);
            true
        }
        Some(n) => sent == n,
    };
    flush(stream, out).await?;
    Ok(whole)
}

async fn flush(stream: &mut Socket, out: &mut Vec<u8>) -> io::Result<()> {
    if !out.is_empty() {
        stream.write_all(out).await?;
        out.clear();
    }
    Ok(())
}

/// The client's socket. A write that could not go on for `send_timeout` (the client stopped
/// reading and the socket's buffer is full) fails with `TimedOut`: the connection closes, and
/// the answer it held (up to the relay's bounds) is released. The timer is armed only when a
/// write finds the socket full, and set again at each progress (nginx's `send_timeout`).
pub struct Socket {
    inner: TcpStream,
    send_timeout: Duration,
    /// The send timer, made at the first write that had to wait.
    stalled: Option<Pin<Box<Sleep>>>,
    /// Whether the timer runs for the current wait.
    armed: bool,
}

impl Socket {
    pub fn new(inner: TcpStream, send_timeout: Duration) -> Self {
        Self {
            inner,
            send_timeout,
            stalled: None,
            armed: false,
        }
    }

    /// A write's outcome under the send timer.
    fn timed<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.armed = false;
            return polled;
        }
        let deadline = Instant::now() + self.send_timeout;
        let stalled = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if !std::mem::replace(&mut self.armed, true) {
            stalled.as_mut().reset(deadline);
        }
        match stalled.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client took no answer bytes for server.send_timeout",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for Socket {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Socket {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.timed(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.timed(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// h2c's connection preface.
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Whether a connection's first bytes are (the start of) h2c's preface.
fn h2_preface(first: &[u8]) -> bool {
    !first.is_empty() && H2_PREFACE.starts_with(&first[..first.len().min(H2_PREFACE.len())])
}

/// The client's socket with the bytes already read from it in front: what hyper's server reads
/// first when it takes a connection over.
pub struct Rewound {
    prefix: Bytes,
    inner: Socket,
    /// The connection whose HTTP/1.1 request heads hyper reads from here: bytes read while no
    /// request is in flight start its header-read timer ([`Conn::head_started`]). `None` for h2c
    /// (and until [`Rewound::timing_heads`]).
    heads: Option<Arc<Conn>>,
    /// The protocol is still to be told from the first bytes read (there was no prefix).
    sniff: bool,
}

impl Rewound {
    pub fn new(inner: Socket, prefix: Bytes) -> Self {
        Self {
            prefix,
            inner,
            heads: None,
            sniff: false,
        }
    }

    /// Times the request heads hyper reads on `conn` over HTTP/1.1: always when `http1` (the
    /// connection already carried a request), else unless its first bytes are h2c's preface
    /// (whose streams, not heads, keep it busy: its first head's timer is stopped).
    pub fn timing_heads(mut self, conn: Arc<Conn>, http1: bool) -> Self {
        if !http1 && self.prefix.is_empty() {
            self.sniff = true;
        } else if !http1 && h2_preface(&self.prefix) {
            conn.head_done();
            return self;
        }
        self.heads = Some(conn);
        self
    }

    /// `read` came from the socket.
    fn seen(&mut self, read: &[u8]) {
        if read.is_empty() {
            return;
        }
        if std::mem::take(&mut self.sniff)
            && h2_preface(read)
            && let Some(conn) = self.heads.take()
        {
            conn.head_done();
        }
        if let Some(conn) = &self.heads
            && conn.in_flight.load(Ordering::Acquire) == 0
        {
            conn.head_started();
        }
    }
}

impl AsyncRead for Rewound {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if !this.prefix.is_empty() {
            let n = this.prefix.len().min(buf.remaining());
            buf.put_slice(&this.prefix[..n]);
            this.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        this.seen(&buf.filled()[before..]);
        polled
    }
}

impl AsyncWrite for Rewound {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A declared length is room promised, not given: the body's buffer grows with what came.
    #[test]
    fn a_body_buffer_grows_with_what_arrives() {
        assert_eq!(body_room(0, 100), 100);
        assert_eq!(body_room(0, 8_000_000), BODY_CHUNK);
        assert_eq!(body_room(BODY_CHUNK, 8_000_000), BODY_CHUNK);
        assert_eq!(body_room(1_000_000, 8_000_000), 1_000_000);
        assert_eq!(body_room(7_900_000, 8_000_000), 100_000);
        assert_eq!(body_room(8_000_000, 8_000_000), 0);
    }

    #[tokio::test]
    async fn a_rewound_socket_reads_its_prefix_first() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let mut client = client.expect("connect");
        let (server, _) = accepted.expect("accept");
        client.write_all(b" world").await.expect("write");
        drop(client);
        let server = Socket::new(server, Duration::from_secs(60));
        let mut rewound = Rewound::new(server, Bytes::from_static(b"hello"));
        let mut read = Vec::new();
        rewound.read_to_end(&mut read).await.expect("read");
        assert_eq!(read, b"hello world");
    }
}
