//! The front door's own HTTP/1.1 server for the hot routes (`POST /v1/chat/completions` and
//! `/v1/completions`, [`super::super::hot_route`]), in front of hyper's.
//!
//! Every connection starts here. A request head that is a hot route's, in the plain form nearly
//! every client sends (HTTP/1.1, a `Content-Length` body within `max_request_body_bytes`, no
//! `Transfer-Encoding`, `Expect` or `Upgrade`), is served by this loop: the head parsed in one
//! pass, the body read whole, the handler called with the header map, the answer's head and body
//! written with one write when it is whole. Anything else (another route, h2c's preface,
//! HTTP/1.0, a chunked or oversized body, a head larger than [`MAX_FAST_HEAD`] or one httparse
//! refuses) is handed to hyper's server at that request's first byte with every byte read so
//! far ([`Rewound`]), and hyper serves the connection from there on: its answers, limits and
//! errors are unchanged for everything but the plain hot request.
//!
//! Why: hyper's server connection cost ≈ 12 k instructions per proxied request, this loop about
//! a third of it (docs/performance.md, "Proxy vs nginx"; issue #16).
//!
//! The connection's limits stay those of [`super`]: the idle timer closes a connection that
//! waited for a head longer than `min(header_read_timeout, idle_timeout)` (the header-read
//! timeout measured as hyper does, from when the connection began to wait for the head), a body
//! late beyond `body_read_timeout` fails the handler's read with [`BodyReadTimeout`] (a 408),
//! eviction and shutdown are the task's as for hyper's connections.

use std::future::{Future, poll_fn};
use std::io;
use std::mem::MaybeUninit;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::Response;
use bytes::{Buf, Bytes, BytesMut};
use hyper::body::Frame;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::{BoxError, Conn, InFlight};
use crate::front_door::AppState;
use crate::proxy::OpenAiRoute;
use crate::proxy::h1::MAX_HEADERS;
use crate::wire::BodyReadTimeout;

/// The largest request head served here; a longer one is handed to hyper (whose own bound,
/// about 400 KiB, then applies).
pub const MAX_FAST_HEAD: usize = 64 * 1024;

/// What the read buffer starts with and grows by.
const READ_CHUNK: usize = 8 * 1024;

/// What a request body's own buffer starts with and grows by at least (doubling beyond it).
const BODY_CHUNK: usize = 64 * 1024;

/// Room under which the read buffer is grown before a read.
const READ_ROOM: usize = 1024;

/// Answer bytes gathered before they are written; a larger data frame is written as it is.
const WRITE_GATHER: usize = 64 * 1024;

/// What the start of the read buffer holds.
#[derive(Debug)]
pub enum Parsed {
    /// Not a whole head yet: read more.
    Partial,
    /// A plain hot-route request, served here.
    Fast(Request),
    /// Anything else: hyper serves the connection from this request on.
    HandOff,
}

/// A plain hot-route request's head.
#[derive(Debug)]
pub struct Request {
    pub route: OpenAiRoute,
    /// Every field of the head, as hyper's server hands them to a service.
    pub headers: HeaderMap,
    pub content_length: usize,
    /// `Connection: close`: the connection ends after the answer.
    pub close: bool,
}

/// Parses the request head at the start of `buf`. On [`Parsed::Fast`] the head's bytes are
/// consumed (the header values share them); otherwise `buf` holds what it held.
pub fn parse(buf: &mut BytesMut, max_body: usize) -> Parsed {
    if buf.is_empty() {
        return Parsed::Partial;
    }
    // Where each field's name and value sit in the head (offsets into `buf`), so that the values
    // can share the head's bytes instead of each being copied.
    // A head served here is at most `MAX_FAST_HEAD` (64 KiB) long: its offsets fit in 16 bits.
    let mut spans = [(0u16, 0u16, 0u16, 0u16); MAX_HEADERS];
    let (consumed, route, count, control) = {
        let mut fields = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
        let mut request = httparse::Request::new(&mut []);
        let parsed = httparse::ParserConfig::default().parse_request_with_uninit_headers(
            &mut request,
            buf,
            &mut fields,
        );
        let consumed = match parsed {
            Ok(httparse::Status::Complete(consumed)) if consumed < MAX_FAST_HEAD => consumed,
            Ok(httparse::Status::Partial) if buf.len() < MAX_FAST_HEAD => return Parsed::Partial,
            // Too long, malformed or too many fields: hyper answers it as it always did.
            _ => return Parsed::HandOff,
        };
        if request.version != Some(1) || request.method != Some("POST") {
            return Parsed::HandOff;
        }
        let Some(route) = hot_route(request.path.unwrap_or_default()) else {
            return Parsed::HandOff;
        };
        let start = buf.as_ptr() as usize;
        // httparse's slices lie in `buf`'s first `consumed` bytes; the spans are checked against
        // the head all the same (a span outside it is handed to hyper, not a panic).
        let at = |slice: &[u8]| {
            u16::try_from((slice.as_ptr() as usize).wrapping_sub(start)).unwrap_or(u16::MAX)
        };
        let mut control = Control::default();
        for (span, field) in spans.iter_mut().zip(request.headers.iter()) {
            if !control.read(field.name.as_bytes(), field.value) {
                return Parsed::HandOff;
            }
            let name = field.name.as_bytes();
            let length = |slice: &[u8]| u16::try_from(slice.len()).unwrap_or(u16::MAX);
            *span = (at(name), length(name), at(field.value), length(field.value));
        }
        (consumed, route, request.headers.len(), control)
    };
    if control.hosts != 1 {
        // No `Host`, or two: hyper's server answers it (400, [`super::host_is_valid`]).
        return Parsed::HandOff;
    }
    let Some(content_length) = control.length.filter(|&n| n <= max_body) else {
        // No length (a request without a body is the handler's 400, hyper's way) or more than
        // the handler accepts (its 413, which leaves the body unread: hyper closes after it).
        return Parsed::HandOff;
    };
    let head = buf.split_to(consumed).freeze();
    let mut headers = HeaderMap::with_capacity(count);
    for &(name_at, name_len, value_at, value_len) in &spans[..count] {
        let (name_at, value_at) = (usize::from(name_at), usize::from(value_at));
        let name = head
            .get(name_at..name_at + usize::from(name_len))
            .and_then(|name| HeaderName::from_bytes(name).ok());
        let value_end = value_at + usize::from(value_len);
        let value = if value_len == 0 {
            // An empty value's slice need not point into the head.
            Some(HeaderValue::from_static(""))
        } else if value_end <= head.len() {
            HeaderValue::from_maybe_shared(head.slice(value_at..value_end)).ok()
        } else {
            None
        };
        let (Some(name), Some(value)) = (name, value) else {
            // A field hyper judges (its 400): every byte goes back in front of the rest.
            let mut whole = BytesMut::with_capacity(head.len() + buf.len());
            whole.extend_from_slice(&head);
            whole.extend_from_slice(buf);
            *buf = whole;
            return Parsed::HandOff;
        };
        headers.append(name, value);
    }
    Parsed::Fast(Request {
        route,
        headers,
        content_length,
        close: control.close,
    })
}

/// The hot route an origin-form request target names (its query aside;
/// [`super::super::hot_path`] decides). A query with a byte hyper's target parser refuses (`"`,
/// `<`, `>`, `#`, `\`, `^`, a byte beyond ASCII, …) is not served here: hyper answers it (400),
/// so both servers keep one rule.
fn hot_route(target: &str) -> Option<OpenAiRoute> {
    // A byte scan: `split_once('?')` cost 135 instructions per request.
    let end = target
        .bytes()
        .position(|b| b == b'?')
        .unwrap_or(target.len());
    let query = target.as_bytes().get(end + 1..).unwrap_or_default();
    if !query.iter().all(|&b| plain_query_byte(b)) {
        return None;
    }
    super::super::hot_path(&target[..end])
}

/// A byte `http::Uri` takes as it is in a query (WHATWG's query state: `!`, `$`–`;`, `=`,
/// `?`–`~`).
fn plain_query_byte(b: u8) -> bool {
    matches!(b, b'!' | b'$'..=b';' | b'=' | b'?'..=b'~')
}

/// The fields of a request head that decide whether it is served here.
#[derive(Debug, Default)]
struct Control {
    /// The one `Content-Length` field's length; `None` for none.
    length: Option<usize>,
    close: bool,
    /// `Host` fields seen (each valid).
    hosts: u8,
}

impl Control {
    /// Reads one field; `false` when the request is not a plain one.
    fn read(&mut self, name: &[u8], value: &[u8]) -> bool {
        let is = |control: &[u8]| name.eq_ignore_ascii_case(control);
        match name.len() {
            4 if is(b"host") => {
                // A second one, or an invalid value, is hyper's server's 400.
                self.hosts += 1;
                self.hosts == 1 && valid_host(value)
            }
            6 if is(b"expect") => false,
            7 if is(b"upgrade") => false,
            17 if is(b"transfer-encoding") => false,
            10 if is(b"connection") => {
                for token in value.split(|&b| b == b',').map(<[u8]>::trim_ascii) {
                    if token.eq_ignore_ascii_case(b"close") {
                        self.close = true;
                    } else if token.eq_ignore_ascii_case(b"upgrade") {
                        return false;
                    }
                }
                true
            }
            14 if is(b"content-length") => {
                // One plain decimal length; a list, a repeat or anything odd is hyper's to judge.
                let length = crate::proxy::h1::decimal(value).and_then(|n| usize::try_from(n).ok());
                match length {
                    Some(length) if self.length.is_none() => {
                        self.length = Some(length);
                        true
                    }
                    _ => false,
                }
            }
            _ => true,
        }
    }
}

/// Whether a `Host` value is `uri-host [ ":" port ]` (RFC 9110 §7.2, RFC 3986 §3.2.2): a
/// registered name (unreserved, sub-delims and %-escapes) or a bracketed IP literal, then an
/// optional decimal port. Empty is valid (a target without an authority). A byte scan.
pub fn valid_host(value: &[u8]) -> bool {
    let (host, port) = match value.first() {
        Some(b'[') => {
            let Some(close) = value.iter().position(|&b| b == b']') else {
                return false;
            };
            let literal = &value[1..close];
            let literal_ok = !literal.is_empty()
                && literal
                    .iter()
                    .all(|&b| b.is_ascii_hexdigit() || matches!(b, b':' | b'.') || reg_name_byte(b));
            if !literal_ok {
                return false;
            }
            (&value[..0], &value[close + 1..])
        }
        _ => {
            let end = value.iter().position(|&b| b == b':').unwrap_or(value.len());
            (&value[..end], &value[end..])
        }
    };
    host.iter().all(|&b| reg_name_byte(b))
        && match port.split_first() {
            None => true,
            Some((b':', digits)) => digits.len() <= 5 && digits.iter().all(u8::is_ascii_digit),
            Some(_) => false,
        }
}

/// A byte of a registered name: unreserved, sub-delims or `%` (RFC 3986 §3.2.2).
fn reg_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric()
        || matches!(
            b,
            b'-' | b'.' | b'_' | b'~' | b'%' | b'!' | b'$' | b'&' | b'\'' | b'(' | b')' | b'*'
                | b'+' | b',' | b';' | b'='
        )
}

/// How the loop ended.
pub enum End {
    /// The connection is done (closed by the client, by `Connection: close`, at shutdown, or
    /// on an error).
    Closed(io::Result<()>),
    /// hyper serves the connection from here on.
    HandOff(Rewound),
}

/// Serves plain hot-route requests on `stream` until the connection ends or a request is one
/// for hyper.
pub async fn serve(
    mut stream: TcpStream,
    state: Arc<AppState>,
    conn: Arc<Conn>,
    body_timeout: Duration,
) -> End {
    let mut buf = BytesMut::with_capacity(READ_CHUNK);
    let mut out = Vec::new();
    loop {
        let request = loop {
            match parse(&mut buf, state.route.max_request_body_bytes()) {
                Parsed::Fast(request) => break request,
                Parsed::HandOff => return End::HandOff(Rewound::new(stream, buf.freeze())),
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
        let handler = pin!(super::super::serve_hot_parts(
            &state,
            request.route,
            request.headers,
            body
        ));
        let Some(response) = unless_gone(handler, &stream, &mut buf).await else {
            // The client left: the handler, and with it the upstream request, is dropped.
            return End::Closed(Ok(()));
        };
        let keep = whole && !request.close && !conn.closing.load(Ordering::Acquire);
        let written = write_response(&mut stream, &mut buf, &mut out, response, keep).await;
        drop(in_flight);
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
async fn read(stream: &mut TcpStream, buf: &mut BytesMut) -> io::Result<usize> {
    if buf.capacity() - buf.len() < READ_ROOM {
        buf.reserve(READ_CHUNK);
    }
    stream.read_buf(buf).await
}

/// The request body of `length` bytes (its start may be in `buf`), and whether it came whole. A
/// body that is not whole within `timeout` of its head fails the handler's read with
/// [`BodyReadTimeout`] (its 408); one the client broke off fails it with the read's error.
async fn read_body(
    stream: &mut TcpStream,
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

/// Writes `response` (head and body, framed by its length when known, chunked otherwise);
/// `Ok(false)` when the connection cannot be kept (the body failed, or the answer says
/// `Connection: close`). `keep` false adds `Connection: close`.
async fn write_response(
    stream: &mut TcpStream,
    buf: &mut BytesMut,
    out: &mut Vec<u8>,
    response: Response,
    keep: bool,
) -> io::Result<bool> {
    let (parts, body) = response.into_parts();
    out.clear();
    let status = parts.status;
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    let mut keep = keep;
    let mut dated = false;
    for (name, value) in &parts.headers {
        // The framing is this connection's own.
        if name == header::CONTENT_LENGTH || name == header::TRANSFER_ENCODING {
            continue;
        }
        if name == header::CONNECTION {
            if crate::proxy::h1::asks_to_close(name, value) {
                keep = false;
            }
            continue;
        }
        dated |= name == header::DATE;
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    if !dated {
        out.extend_from_slice(b"date: ");
        push_date(out);
        out.extend_from_slice(b"\r\n");
    }
    if !keep {
        out.extend_from_slice(b"connection: close\r\n");
    }
    if status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        out.extend_from_slice(b"\r\n");
        stream.write_all(out).await?;
        return Ok(keep);
    }
    let length = hyper::body::Body::size_hint(&body).exact();
    match length {
        Some(n) => {
            out.extend_from_slice(b"content-length: ");
            out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
            out.extend_from_slice(b"\r\n\r\n");
        }
        None => out.extend_from_slice(b"transfer-encoding: chunked\r\n\r\n"),
    }
    let whole = write_body(stream, buf, out, body, length).await?;
    Ok(keep && whole)
}

/// Writes the body after the head already in `out`; `Ok(false)` when the body failed or did not
/// match its length (the answer is cut: the connection must close). While it waits for the
/// body, the client's end is watched ([`unless_gone`]; `buf` keeps what arrives meanwhile).
async fn write_body(
    stream: &mut TcpStream,
    buf: &mut BytesMut,
    out: &mut Vec<u8>,
    body: Body,
    length: Option<u64>,
) -> io::Result<bool> {
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
                unless_gone(pin!(poll_fn(poll)), stream, buf)
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
            out.extend_from_slice(hex(data.len(), &mut [0; 16]));
            out.extend_from_slice(b"\r\n");
        }
        if out.len() + data.len() > WRITE_GATHER {
            flush(stream, out).await?;
            stream.write_all(&data).await?;
        } else {
            out.extend_from_slice(&data);
        }
        if length.is_none() {
            out.extend_from_slice(b"\r\n");
        }
    }
    let whole = match length {
        None => {
            out.extend_from_slice(b"0\r\n\r\n");
            true
        }
        Some(n) => sent == n,
    };
    flush(stream, out).await?;
    Ok(whole)
}

async fn flush(stream: &mut TcpStream, out: &mut Vec<u8>) -> io::Result<()> {
    if !out.is_empty() {
        stream.write_all(out).await?;
        out.clear();
    }
    Ok(())
}

/// `n` in lowercase hexadecimal (a chunk's size line).
fn hex(mut n: usize, digits: &mut [u8; 16]) -> &[u8] {
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b"0123456789abcdef"[n % 16];
        n /= 16;
        if n == 0 {
            return &digits[at..];
        }
    }
}

/// Appends the current time as an HTTP date (IMF-fixdate), formatted once per second per
/// thread as hyper's server does.
fn push_date(out: &mut Vec<u8>) {
    use std::cell::RefCell;
    thread_local! {
        static CACHED: RefCell<(u64, String)> = const { RefCell::new((u64::MAX, String::new())) };
    }
    let now = SystemTime::now();
    let second = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |since| since.as_secs());
    CACHED.with(|cached| {
        let mut cached = cached.borrow_mut();
        if cached.0 != second {
            *cached = (second, httpdate::fmt_http_date(now));
        }
        out.extend_from_slice(cached.1.as_bytes());
    });
}

/// The client's socket with the bytes already read from it in front: what hyper's server reads
/// first when it takes a connection over.
pub struct Rewound {
    prefix: Bytes,
    inner: TcpStream,
}

impl Rewound {
    pub fn new(inner: TcpStream, prefix: Bytes) -> Self {
        Self { prefix, inner }
    }
}

impl AsyncRead for Rewound {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
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
        self.inner.is_write_vectored()
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

    fn parsed(head: &[u8]) -> (Parsed, BytesMut) {
        let mut buf = BytesMut::from(head);
        (parse(&mut buf, 1_000), buf)
    }

    fn fast(head: &[u8]) -> (Request, BytesMut) {
        match parsed(head) {
            (Parsed::Fast(request), rest) => (request, rest),
            (other, _) => panic!("not served here: {other:?}"),
        }
    }

    fn handed_off(head: &[u8]) {
        let (parsed, rest) = parsed(head);
        assert!(matches!(parsed, Parsed::HandOff), "{parsed:?}");
        assert_eq!(&rest[..], head, "a handed-off head is left whole for hyper");
    }

    #[test]
    fn a_plain_hot_request_is_served_here_with_every_field() {
        let (request, rest) = fast(
            b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\n\
              X-A: 1\r\nx-a: 2\r\n\r\n{}POST",
        );
        assert_eq!(request.route, OpenAiRoute::ChatCompletions);
        assert_eq!(request.content_length, 2);
        assert!(!request.close);
        assert_eq!(request.headers.len(), 4);
        assert_eq!(request.headers["host"], "r");
        assert_eq!(request.headers["content-length"], "2");
        let repeated: Vec<_> = request.headers.get_all("x-a").iter().collect();
        assert_eq!(repeated, ["1", "2"]);
        assert_eq!(
            &rest[..],
            b"{}POST",
            "the body and what follows stay in the buffer"
        );

        let (request, _) = fast(
            b"POST /v1/completions? HTTP/1.1\r\nconnection: keep-alive, Close\r\n\
              host: r\r\ncontent-length: 0\r\nx-empty:\r\n\r\n",
        );
        assert_eq!(request.route, OpenAiRoute::Completions);
        assert!(request.close);
        assert_eq!(request.headers["x-empty"], "");
    }

    #[test]
    fn a_partial_head_waits_and_an_endless_one_is_handed_off() {
        let (parsed, rest) = parsed(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r");
        assert!(matches!(parsed, Parsed::Partial));
        assert_eq!(rest.len(), 43);
        let mut endless = b"POST /v1/chat/completions HTTP/1.1\r\nx: ".to_vec();
        endless.resize(MAX_FAST_HEAD, b'a');
        handed_off(&endless);
    }

    #[test]
    fn everything_but_the_plain_hot_request_goes_to_hyper() {
        for head in [
            &b"GET /health HTTP/1.1\r\n\r\n"[..],
            b"GET /v1/chat/completions HTTP/1.1\r\n\r\n",
            b"POST /v1/models HTTP/1.1\r\ncontent-length: 0\r\n\r\n",
            b"POST /v1/chat/completions/ HTTP/1.1\r\ncontent-length: 0\r\n\r\n",
            b"POST /v1/chat/completionsx HTTP/1.1\r\ncontent-length: 0\r\n\r\n",
            b"POST /v1/completion HTTP/1.1\r\ncontent-length: 0\r\n\r\n",
            b"POST /v1/chat/completions#x HTTP/1.1\r\ncontent-length: 0\r\n\r\n",
            // Query bytes hyper's target parser refuses (its 400).
            b"POST /v1/chat/completions?a=\"b\" HTTP/1.1\r\nhost: r\r\ncontent-length: 0\r\n\r\n",
            b"POST /v1/chat/completions?<script> HTTP/1.1\r\nhost: r\r\ncontent-length: 0\r\n\r\n",
            b"POST /v1/completions?a#b HTTP/1.1\r\nhost: r\r\ncontent-length: 0\r\n\r\n",
            b"POST /v1/completions?\xc3\xa9 HTTP/1.1\r\nhost: r\r\ncontent-length: 0\r\n\r\n",
            b"POST http://r/v1/chat/completions HTTP/1.1\r\ncontent-length: 0\r\n\r\n",
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
            b"POST /v1/chat/completions HTTP/1.0\r\ncontent-length: 0\r\n\r\n",
            // Framing hyper decides.
            b"POST /v1/chat/completions HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n",
            b"POST /v1/chat/completions HTTP/1.1\r\n\r\n",
            b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 2\r\ncontent-length: 2\r\n\r\n",
            b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 2, 2\r\n\r\n",
            b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: +2\r\n\r\n",
            b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 99999999999999999999\r\n\r\n",
            // Beyond the handler's limit (1,000 here): its 413, and hyper closes after it.
            b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 1001\r\n\r\n",
            b"POST /v1/chat/completions HTTP/1.1\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\n",
            b"POST /v1/chat/completions HTTP/1.1\r\nconnection: upgrade\r\nupgrade: h2c\r\ncontent-length: 2\r\n\r\n",
            // Malformed.
            b"POST /v1/chat/completions HTTP/1.1\r\nbad name: 1\r\ncontent-length: 2\r\n\r\n",
            b"POST /v1/chat/completions HTTP/1.1\r\nx: a\r\n b\r\ncontent-length: 2\r\n\r\n",
        ] {
            handed_off(head);
        }
        let mut many = b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 0\r\n".to_vec();
        for i in 0..MAX_HEADERS {
            many.extend_from_slice(format!("x-{i}: {i}\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        handed_off(&many);
    }

    /// No `Host`, two, or an invalid one: hyper's server answers it (400).
    #[test]
    fn a_missing_repeated_or_invalid_host_goes_to_hyper() {
        let body = "content-length: 2\r\n\r\n{}";
        for fields in [
            "",
            "host: r\r\nhost: r\r\n",
            "host: a b/c\r\n",
            "host: r/x\r\n",
            "host: user@r\r\n",
            "host: r:80x\r\n",
            "host: [::1\r\n",
        ] {
            let head = format!("POST /v1/chat/completions HTTP/1.1\r\n{fields}{body}");
            handed_off(head.as_bytes());
        }
        for host in ["r", "router:8080", "10.0.0.1:80", "[::1]:8080", "[fe80::1%25eth0]", "a_b.c", ""] {
            let head = format!("POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n{body}");
            let (request, _) = fast(head.as_bytes());
            assert_eq!(request.headers["host"], host);
        }
    }

    #[test]
    fn numbers_and_dates_are_written_as_http_wants() {
        use crate::proxy::h1::decimal;
        assert_eq!(decimal(b"0"), Some(0));
        assert_eq!(decimal(b"0042"), Some(42));
        assert_eq!(
            decimal(b"9999999999999999999"),
            Some(9_999_999_999_999_999_999)
        );
        for bad in [
            &b""[..],
            b"+1",
            b"-1",
            b" 1",
            b"1 ",
            b"0x1",
            b"1,1",
            b"10000000000000000000",
        ] {
            assert_eq!(decimal(bad), None, "{bad:?}");
        }
        assert_eq!(hex(0, &mut [0; 16]), b"0");
        assert_eq!(hex(0x1f2e, &mut [0; 16]), b"1f2e");
        assert_eq!(
            hex(usize::MAX, &mut [0; 16]),
            format!("{:x}", usize::MAX).as_bytes()
        );
        let mut out = Vec::new();
        push_date(&mut out);
        let date = std::str::from_utf8(&out).expect("ASCII");
        assert!(httpdate::parse_http_date(date).is_ok(), "{date}");
    }

    mod generated {
        use super::*;
        use proptest::prelude::*;

        /// A field from a vocabulary of the ones that decide, plus arbitrary names and values.
        fn field() -> impl Strategy<Value = (String, Vec<u8>)> {
            let value = proptest::collection::vec(any::<u8>(), 0..12);
            prop_oneof![
                1 => (Just("Content-Length".to_owned()), "[0-9 ,+-]{0,6}")
                    .prop_map(|(n, v)| (n, v.into_bytes())),
                1 => (Just("Transfer-Encoding".to_owned()), Just(b"chunked".to_vec())),
                1 => (Just("Expect".to_owned()), Just(b"100-continue".to_vec())),
                2 => (Just("Connection".to_owned()), "(close|keep-alive|upgrade|x)(, ?(close|x))?")
                    .prop_map(|(n, v)| (n, v.into_bytes())),
                6 => ("[A-Za-z][A-Za-z0-9-]{0,8}", "[ -~]{0,12}")
                    .prop_map(|(n, v)| (n, v.into_bytes())),
                2 => ("[ -~]{1,4}", value),
            ]
        }

        fn request() -> impl Strategy<Value = (Vec<u8>, usize)> {
            (
                prop_oneof![
                    4 => Just("POST /v1/chat/completions HTTP/1.1"),
                    4 => Just("POST /v1/completions?a=b HTTP/1.1"),
                    1 => Just("POST /v1/chat/completions HTTP/1.0"),
                    1 => Just("GET /v1/completions HTTP/1.1"),
                    1 => Just("POST /health HTTP/1.1"),
                ],
                proptest::collection::vec(field(), 0..5),
                // Mostly one plain length among them, at any place.
                proptest::option::weighted(0.8, "[0-9]{1,4}"),
                any::<prop::sample::Index>(),
                proptest::collection::vec(any::<u8>(), 0..16),
                any::<prop::sample::Index>(),
                // Mostly one `Host`, at the start.
                proptest::option::weighted(0.8, "[a-z0-9.:]{0,6}"),
            )
                .prop_map(|(line, mut fields, length, at, rest, cut, host)| {
                    if let Some(length) = length {
                        let at = at.index(fields.len() + 1);
                        fields.insert(at, ("content-length".to_owned(), length.into_bytes()));
                    }
                    if let Some(host) = host {
                        fields.insert(0, ("Host".to_owned(), host.into_bytes()));
                    }
                    let mut bytes = format!("{line}\r\n").into_bytes();
                    for (name, value) in &fields {
                        bytes.extend_from_slice(name.as_bytes());
                        bytes.extend_from_slice(b": ");
                        bytes.extend_from_slice(value);
                        bytes.extend_from_slice(b"\r\n");
                    }
                    bytes.extend_from_slice(b"\r\n");
                    bytes.extend_from_slice(&rest);
                    let cut = cut.index(bytes.len() + 1);
                    (bytes, cut)
                })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2048))]

            /// Whatever arrives, the parse never panics; a head it serves is consumed exactly
            /// (what follows stays, every field is in the map, the length is the one field's)
            /// and is a plain hot request; anything else leaves every byte for hyper.
            #[test]
            fn a_head_is_served_exactly_or_left_whole((bytes, cut) in request()) {
                for input in [&bytes[..], &bytes[..cut]] {
                    let mut buf = BytesMut::from(input);
                    match parse(&mut buf, 5_000) {
                        Parsed::Fast(request) => {
                            // The head ends at the first empty line; httparse also takes a
                            // bare LF as a line's end.
                            let end = input
                                .windows(2)
                                .enumerate()
                                .find_map(|(at, w)| match w {
                                    b"\n\n" => Some(at + 2),
                                    b"\n\r" if input.get(at + 2) == Some(&b'\n') => Some(at + 3),
                                    _ => None,
                                })
                                .expect("a whole head");
                            prop_assert_eq!(&buf[..], &input[end..]);
                            let head = String::from_utf8_lossy(&input[..end]).to_ascii_lowercase();
                            prop_assert!(head.starts_with("post /v1/"));
                            prop_assert!(head.contains(" http/1.1\r\n"));
                            for refused in ["\ntransfer-encoding:", "\nexpect:", "upgrade"] {
                                prop_assert!(!head.contains(refused), "{}", head);
                            }
                            let lengths: Vec<&str> = head
                                .split('\n')
                                .map(|l| l.trim_end_matches('\r'))
                                .filter_map(|l| l.strip_prefix("content-length: "))
                                .map(str::trim)
                                .collect();
                            prop_assert_eq!(lengths.len(), 1);
                            let hosts = head.split('\n').filter(|l| l.starts_with("host:")).count();
                            prop_assert_eq!(hosts, 1);
                            prop_assert_eq!(lengths[0].parse::<usize>().ok(), Some(request.content_length));
                            prop_assert_eq!(request.headers.len(), head.matches('\n').count() - 2);
                        }
                        Parsed::Partial | Parsed::HandOff => prop_assert_eq!(&buf[..], input),
                    }
                }
            }
        }
    }

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
        let mut rewound = Rewound::new(server, Bytes::from_static(b"hello"));
        let mut read = Vec::new();
        rewound.read_to_end(&mut read).await.expect("read");
        assert_eq!(read, b"hello world");
    }
}
