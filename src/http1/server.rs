//! The server role: a request head parsed in one pass and judged (served here, or every byte
//! handed to hyper's server, which answers whatever this server does not take), and the answer's
//! head encoded with its framing. The front door's own HTTP/1.1 server (`front_door::serve`'s
//! `fast`) runs it.
//!
//! What is served here is the plain request nearly every client sends: HTTP/1.1, a target its
//! caller routes ([`Accept::route`]), exactly one valid `Host`, one plain `Content-Length` within
//! [`Accept::max_body`], no `Transfer-Encoding`, `Expect` or `Upgrade`, and a head of at most
//! [`MAX_FAST_HEAD`] bytes that httparse accepts. Anything else is [`Parsed::HandOff`], with the
//! buffer as it was: hyper's server then judges it as it always did, so both servers keep one
//! rule.

use std::marker::PhantomData;
use std::time::SystemTime;

use bytes::BytesMut;
use http::{HeaderMap, StatusCode, header};

use super::head::{Spans, slots};
use super::{Framing, Role, asks_to_close, decimal, is_framing, push_field, push_length, tokens};

/// The largest request head served here; a longer one is handed to hyper (whose own bound,
/// about 400 KiB, then applies).
pub const MAX_FAST_HEAD: usize = 64 * 1024;

/// What the start of the read buffer holds.
#[derive(Debug)]
pub enum Parsed<R> {
    /// Not a whole head yet: read more.
    Partial,
    /// A plain request of a route served here.
    Fast(Request<R>),
    /// Anything else: hyper serves the connection from this request on.
    HandOff,
}

/// A plain request's head.
#[derive(Debug)]
pub struct Request<R> {
    pub route: R,
    /// Every field of the head, as hyper's server hands them to a service.
    pub headers: HeaderMap,
    pub content_length: usize,
    /// `Connection: close`: the connection ends after the answer.
    pub close: bool,
}

/// What the server takes: the body limit, and the route a request's method and path (its query
/// aside) name, `None` for a request it does not serve.
pub struct Accept<'a, R> {
    pub max_body: usize,
    pub route: &'a (dyn Fn(&str, &str) -> Option<R> + 'a),
}

/// The server end of a connection: it reads requests and writes answers.
#[derive(Debug)]
pub struct Server<R>(PhantomData<fn() -> R>);

impl<R> Role for Server<R> {
    type Context<'a>
        = Accept<'a, R>
    where
        Self: 'a;
    /// On [`Parsed::Fast`] the head's bytes are consumed (the header values share them);
    /// otherwise the buffer holds what it held.
    type Parsed = Parsed<R>;

    fn parse(buf: &mut BytesMut, accept: Accept<'_, R>) -> Parsed<R> {
        if buf.is_empty() {
            return Parsed::Partial;
        }
        let (consumed, route, spans, control) = {
            let mut fields = slots();
            let mut request = httparse::Request::new(&mut []);
            let parsed = httparse::ParserConfig::default().parse_request_with_uninit_headers(
                &mut request,
                buf,
                &mut fields,
            );
            let consumed = match parsed {
                Ok(httparse::Status::Complete(consumed)) if consumed < MAX_FAST_HEAD => consumed,
                Ok(httparse::Status::Partial) if buf.len() < MAX_FAST_HEAD => {
                    return Parsed::Partial;
                }
                // Too long, malformed or too many fields: hyper answers it as it always did.
                _ => return Parsed::HandOff,
            };
            if request.version != Some(1) {
                return Parsed::HandOff;
            }
            let route = plain_path(request.path.unwrap_or_default())
                .and_then(|path| (accept.route)(request.method.unwrap_or_default(), path));
            let Some(route) = route else {
                return Parsed::HandOff;
            };
            let mut control = Control::default();
            for field in &*request.headers {
                if !control.read(field.name.as_bytes(), field.value) {
                    return Parsed::HandOff;
                }
            }
            (
                consumed,
                route,
                Spans::record(buf, request.headers),
                control,
            )
        };
        if control.hosts != 1 {
            // No `Host`, or two: hyper's server answers it (400).
            return Parsed::HandOff;
        }
        let Some(content_length) = control.length.filter(|&n| n <= accept.max_body) else {
            // No length (a request without a body is the handler's 400, hyper's way) or more
            // than the handler accepts (its 413, which leaves the body unread: hyper closes after
            // it).
            return Parsed::HandOff;
        };
        let head = buf.split_to(consumed).freeze();
        let Ok(headers) = spans.map(&head, 0, |_, _| false) else {
            // A field hyper judges (its 400): every byte goes back in front of the rest.
            let mut whole = BytesMut::with_capacity(head.len() + buf.len());
            whole.extend_from_slice(&head);
            whole.extend_from_slice(buf);
            *buf = whole;
            return Parsed::HandOff;
        };
        Parsed::Fast(Request {
            route,
            headers,
            content_length,
            close: control.close,
        })
    }
}

/// The path of an origin-form request target whose query (if any) holds only bytes `http::Uri`
/// takes as they are. A query with another byte (`"`, `<`, `>` among them, which hyper's server
/// refuses with 400; `#`, which starts a fragment; a byte beyond ASCII) is not served here:
/// hyper judges it.
fn plain_path(target: &str) -> Option<&str> {
    // A byte scan: `split_once('?')` cost 135 instructions per request.
    let end = target
        .bytes()
        .position(|b| b == b'?')
        .unwrap_or(target.len());
    let query = target.as_bytes().get(end + 1..).unwrap_or_default();
    query
        .iter()
        .all(|&b| plain_query_byte(b))
        .then(|| &target[..end])
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
                self.hosts == 1 && super::valid_host(value)
            }
            6 if is(b"expect") => false,
            7 if is(b"upgrade") => false,
            17 if is(b"transfer-encoding") => false,
            10 if is(b"connection") => {
                for token in tokens(value) {
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
                let length = decimal(value).and_then(|n| usize::try_from(n).ok());
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

/// How an encoded answer goes on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Answer {
    /// The body's framing; `None` when the answer has none (1xx, 204, 304): the head ends it.
    pub body: Option<Framing>,
    /// Whether the connection may carry another request after it.
    pub keep: bool,
}

/// Appends the answer's head to `out`: its status line, its fields less the framing and
/// connection ones (this connection's own), a `date` when it has none, `connection: close` when
/// the connection will not be kept (`keep` false, or the answer asks to close), and its framing:
/// `length` when known, chunked otherwise.
pub fn encode(
    status: StatusCode,
    headers: &HeaderMap,
    length: Option<u64>,
    keep: bool,
    out: &mut Vec<u8>,
) -> Answer {
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    let mut keep = keep;
    let mut dated = false;
    for (name, value) in headers {
        if is_framing(name) {
            continue;
        }
        if name == header::CONNECTION {
            keep &= !asks_to_close(name, value);
            continue;
        }
        dated |= name == header::DATE;
        push_field(out, name.as_str().as_bytes(), value.as_bytes());
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
        return Answer { body: None, keep };
    }
    let body = match length {
        Some(n) => {
            push_length(out, n);
            Framing::Length(n)
        }
        None => {
            out.extend_from_slice(b"transfer-encoding: chunked\r\n");
            Framing::Chunked
        }
    };
    out.extend_from_slice(b"\r\n");
    Answer {
        body: Some(body),
        keep,
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

#[cfg(test)]
mod tests;
