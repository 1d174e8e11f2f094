//! The HTTP/1.1 client codec of the connection pool ([`super::pool`]): a request encoded into
//! one buffer, a response head parsed with `httparse`, and the response body's framing
//! (RFC 9112 §6.3) with a chunked decoder that hands over every chunk already read in one go.
//!
//! Why not hyper's client connection: it runs each backend connection as a task of its own and
//! hands the response over through channels (one frame at a time), so every answer costs the
//! request's task and the connection's task a poll each per frame, and its chunked decoder reads
//! every framing byte through its buffer one at a time (docs/performance.md, "Proxy vs nginx").
//! Here the request's own task reads the socket.
//!
//! Everything the backend sends is untrusted: a head is bounded ([`MAX_HEAD_BYTES`],
//! [`MAX_HEADERS`]) before it is accepted, a chunk-size line and the trailers are bounded, and a
//! malformed byte is an error, never a panic.

use std::mem::MaybeUninit;

use bytes::{Buf, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Version, header};

/// Most bytes a response head (informational heads before it included) may take: hyper's
/// default read-buffer bound, which the pool had before (8 KiB + 100 headers of 4 KiB).
pub const MAX_HEAD_BYTES: usize = 8192 + 4096 * 100;

/// Most header fields in one response head (hyper's default).
pub const MAX_HEADERS: usize = 100;

/// Most bytes of one chunk-size line (the size, extensions and the CRLF).
pub const MAX_CHUNK_LINE_BYTES: usize = 4096;

/// Most bytes of a chunked body's trailer section (read and dropped).
pub const MAX_TRAILER_BYTES: usize = 16 * 1024;

/// A request body up to this size is copied behind the head and both go out in one write.
pub const INLINE_BODY_BYTES: usize = 64 * 1024;

/// What the backend sent that is not HTTP/1.1 as this client reads it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("malformed response head: {0}")]
    Head(String),
    #[error("the response head exceeds {MAX_HEAD_BYTES} bytes")]
    HeadTooLarge,
    #[error("the backend answered with a protocol switch (101), which was not asked for")]
    Upgrade,
    #[error("invalid content-length")]
    ContentLength,
    #[error("malformed chunked body: {0}")]
    Chunked(&'static str),
}

/// How the response body is delimited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    /// Exactly this many bytes (0: no body).
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// Everything until the backend closes the connection.
    UntilClose,
}

/// A parsed response head.
#[derive(Debug)]
pub struct Head {
    pub status: StatusCode,
    pub version: Version,
    /// The head's fields less the framing and connection ones (`Content-Length`,
    /// `Transfer-Encoding`, `Connection` and the names it lists, `Keep-Alive`), which the codec
    /// consumed into `framing` and `keep_alive`.
    pub headers: HeaderMap,
    pub framing: Framing,
    /// Whether the connection may carry another request once this body ended.
    pub keep_alive: bool,
}

/// Appends the request head (origin form, HTTP/1.1) and, when it is small, the body to `out`.
/// `Content-Length` and `Transfer-Encoding` are this encoder's: the body is sent with its exact
/// length. Returns whether the body was appended (else the caller writes it after the head).
pub fn encode_request<'h>(
    method: &Method,
    path_and_query: &str,
    headers: impl IntoIterator<Item = (&'h HeaderName, &'h HeaderValue)>,
    body: &[u8],
    out: &mut Vec<u8>,
) -> bool {
    out.extend_from_slice(method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(if path_and_query.is_empty() {
        b"/"
    } else {
        path_and_query.as_bytes()
    });
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in headers {
        if name == header::CONTENT_LENGTH || name == header::TRANSFER_ENCODING {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    let sends_length =
        !body.is_empty() || matches!(*method, Method::POST | Method::PUT | Method::PATCH);
    if sends_length {
        out.extend_from_slice(b"content-length: ");
        out.extend_from_slice(itoa::Buffer::new().format(body.len()).as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    let inline = body.len() <= INLINE_BODY_BYTES;
    if inline {
        out.extend_from_slice(body);
    }
    inline
}

/// Whether this request field asks for the connection to close after the answer.
pub fn asks_to_close(name: &HeaderName, value: &HeaderValue) -> bool {
    name == header::CONNECTION && has_token(value.as_bytes(), b"close")
}

/// Parses the response head at the start of `buf`, skipping informational (1xx) heads before
/// it. `Ok(None)`: the head is not complete yet (read more). On success the head's bytes are
/// consumed from `buf`; what follows is the body's start.
pub fn parse_head(buf: &mut BytesMut, method: &Method) -> Result<Option<Head>, ProtocolError> {
    loop {
        if buf.is_empty() {
            return Ok(None);
        }
        // Where each field's name and value sit in the head (offsets into `buf`), so that the
        // values can share the head's bytes instead of each being copied.
        let mut spans = [(0u32, 0u32, 0u32, 0u32); MAX_HEADERS];
        let (consumed, code, version, count) = {
            let mut fields = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
            let mut response = httparse::Response::new(&mut []);
            let parsed = httparse::ParserConfig::default().parse_response_with_uninit_headers(
                &mut response,
                buf,
                &mut fields,
            );
            let consumed = match parsed {
                Ok(httparse::Status::Complete(consumed)) => consumed,
                Ok(httparse::Status::Partial) if buf.len() >= MAX_HEAD_BYTES => {
                    return Err(ProtocolError::HeadTooLarge);
                }
                Ok(httparse::Status::Partial) => return Ok(None),
                Err(error) => return Err(ProtocolError::Head(error.to_string())),
            };
            let start = buf.as_ptr() as usize;
            // httparse's slices lie in `buf`; the spans are checked against the head below all
            // the same (a span outside it is an error, not a panic).
            let at = |slice: &[u8]| (slice.as_ptr() as usize).wrapping_sub(start) as u32;
            for (span, field) in spans.iter_mut().zip(response.headers.iter()) {
                let name = field.name.as_bytes();
                *span = (
                    at(name),
                    name.len() as u32,
                    at(field.value),
                    field.value.len() as u32,
                );
            }
            (
                consumed,
                response.code.unwrap_or_default(),
                response.version,
                response.headers.len(),
            )
        };
        if consumed > MAX_HEAD_BYTES {
            return Err(ProtocolError::HeadTooLarge);
        }
        let status = StatusCode::from_u16(code).map_err(|e| ProtocolError::Head(e.to_string()))?;
        if status == StatusCode::SWITCHING_PROTOCOLS {
            return Err(ProtocolError::Upgrade);
        }
        let head = buf.split_to(consumed).freeze();
        if status.is_informational() {
            // 100 Continue, 103 Early Hints: the answer follows.
            continue;
        }
        let version = match version {
            Some(0) => Version::HTTP_10,
            _ => Version::HTTP_11,
        };
        // Room for the two fields a relaying caller adds (its exact length, its own routing
        // header) without the map growing: growing rehashes every field.
        let mut headers = HeaderMap::with_capacity(count + 2);
        let mut control = Control::default();
        for &(name_at, name_len, value_at, value_len) in &spans[..count] {
            let outside = || ProtocolError::Head("a header field outside the head".to_owned());
            let (name_at, value_at) = (name_at as usize, value_at as usize);
            let name = head
                .get(name_at..name_at + name_len as usize)
                .ok_or_else(outside)?;
            let value_end = value_at + value_len as usize;
            let Some(value) = head.get(value_at..value_end) else {
                return Err(outside());
            };
            if control.read(name, value) {
                continue;
            }
            let name =
                HeaderName::from_bytes(name).map_err(|e| ProtocolError::Head(e.to_string()))?;
            let value = HeaderValue::from_maybe_shared(head.slice(value_at..value_end))
                .map_err(|e| ProtocolError::Head(e.to_string()))?;
            headers.append(name, value);
        }
        // The names `Connection` lists are hop-by-hop by declaration, wherever they stood.
        for named in control.named.drain(..) {
            if let Ok(name) = HeaderName::from_bytes(named) {
                headers.remove(name);
            }
        }
        let (framing, delimited) = control.framing(status, method)?;
        // RFC 9112 §6.1: an HTTP/1.0 message with `Transfer-Encoding` has faulty framing; it is
        // read as framed, and its connection closed after it.
        let faulty = version == Version::HTTP_10 && control.transfer_encoding.is_some();
        let keep_alive = delimited && !faulty && control.persistent(version);
        return Ok(Some(Head {
            status,
            version,
            headers,
            framing,
            keep_alive,
        }));
    }
}

/// The fields of a response head that frame its body and manage its connection
/// (`Content-Length`, `Transfer-Encoding`, `Connection` and the names it lists, `Keep-Alive`),
/// read in the head's one pass. They describe this message on this connection only, so they are
/// consumed here and are not in [`Head::headers`] ([`Head::framing`] and [`Head::keep_alive`]
/// carry what they said).
#[derive(Debug)]
struct Control<'h> {
    /// The last `Transfer-Encoding` value (its final coding decides chunked).
    transfer_encoding: Option<&'h [u8]>,
    /// Whether any `Content-Length` came.
    content_length: bool,
    /// What the `Content-Length` values agreed on: `Err` for a malformed or conflicting one
    /// (raised only when the length decides the framing).
    length: Result<Option<u64>, ProtocolError>,
    close: bool,
    keep_alive: bool,
    /// The other names `Connection` lists.
    named: Vec<&'h [u8]>,
}

impl Default for Control<'_> {
    fn default() -> Self {
        Self {
            transfer_encoding: None,
            content_length: false,
            length: Ok(None),
            close: false,
            keep_alive: false,
            named: Vec::new(),
        }
    }
}

impl<'h> Control<'h> {
    /// Takes `name: value` when it is a control field (`true`), else leaves it (`false`).
    fn read(&mut self, name: &[u8], value: &'h [u8]) -> bool {
        let is = |control: &[u8]| name.eq_ignore_ascii_case(control);
        match name.len() {
            10 if is(b"connection") => {
                for token in value.split(|&b| b == b',').map(<[u8]>::trim_ascii) {
                    if token.eq_ignore_ascii_case(b"close") {
                        self.close = true;
                    } else if token.eq_ignore_ascii_case(b"keep-alive") {
                        self.keep_alive = true;
                    } else if !token.is_empty() {
                        self.named.push(token);
                    }
                }
            }
            10 if is(b"keep-alive") => {}
            14 if is(b"content-length") => {
                self.content_length = true;
                self.length = self.length.clone().and_then(|seen| agreed(seen, value));
            }
            17 if is(b"transfer-encoding") => self.transfer_encoding = Some(value),
            _ => return false,
        }
        true
    }

    /// The body's framing (RFC 9112 §6.3), and whether the connection may be reused after it (a
    /// body delimited by the close, or one that carried both `Transfer-Encoding` and
    /// `Content-Length`, is not).
    fn framing(
        &self,
        status: StatusCode,
        method: &Method,
    ) -> Result<(Framing, bool), ProtocolError> {
        if *method == Method::HEAD
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED
        {
            return Ok((Framing::Length(0), true));
        }
        if let Some(codings) = self.transfer_encoding {
            let chunked = codings
                .rsplit(|&b| b == b',')
                .next()
                .is_some_and(|coding| coding.trim_ascii().eq_ignore_ascii_case(b"chunked"));
            return Ok(if chunked {
                (Framing::Chunked, !self.content_length)
            } else {
                (Framing::UntilClose, false)
            });
        }
        Ok(match self.length.clone()? {
            Some(n) => (Framing::Length(n), true),
            None => (Framing::UntilClose, false),
        })
    }

    /// HTTP/1.1 persists unless `Connection: close`; HTTP/1.0 only with `Connection: keep-alive`.
    fn persistent(&self, version: Version) -> bool {
        !self.close && (version == Version::HTTP_11 || self.keep_alive)
    }
}

/// The length a `Content-Length` value (a comma-separated list of equal lengths) agrees on with
/// the length `seen` before it.
fn agreed(mut seen: Option<u64>, value: &[u8]) -> Result<Option<u64>, ProtocolError> {
    for part in value.split(|&b| b == b',') {
        let n = decimal(part.trim_ascii()).ok_or(ProtocolError::ContentLength)?;
        if seen.is_some_and(|seen| seen != n) {
            return Err(ProtocolError::ContentLength);
        }
        seen = Some(n);
    }
    Ok(seen)
}

/// A plain decimal length: 1 to 19 ASCII digits (so it cannot overflow), nothing else.
pub fn decimal(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || digits.len() > 19 {
        return None;
    }
    digits.iter().try_fold(0u64, |n, &b| {
        b.is_ascii_digit().then(|| n * 10 + u64::from(b - b'0'))
    })
}

fn has_token(list: &[u8], token: &[u8]) -> bool {
    list.split(|&b| b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
}

/// What one step of the chunked decoder found in the buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Decoded {
    /// Body bytes (never empty).
    Data(Bytes),
    /// The buffer ends inside framing or before data: read more.
    NeedMore,
    /// The last chunk and the trailers were read: the body ended.
    End,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Reading the size's hex digits (`digits` read so far).
    Size {
        value: u64,
        digits: u8,
    },
    /// Whitespace after the size, before a `;` or the CR.
    SizeWs {
        value: u64,
    },
    /// A chunk extension (read and dropped), up to the CR.
    Extension {
        value: u64,
    },
    /// The LF after a size line's CR.
    SizeLf {
        value: u64,
    },
    /// Inside a chunk's data.
    Data {
        left: u64,
    },
    DataCr,
    DataLf,
    /// At the start of a trailer line (or of the final empty line).
    TrailerStart,
    /// Inside a trailer field.
    TrailerLine,
    /// The LF of the final empty line.
    EndLf,
    Ended,
}

/// The `Transfer-Encoding: chunked` decoder: consumes framing from the read buffer and hands
/// chunk data out of it without copying.
#[derive(Debug)]
pub struct ChunkedDecoder {
    state: State,
    /// Bytes of the current chunk-size line.
    line: usize,
    /// Bytes of the trailer section.
    trailers: usize,
}

impl Default for ChunkedDecoder {
    fn default() -> Self {
        Self {
            state: State::Size {
                value: 0,
                digits: 0,
            },
            line: 0,
            trailers: 0,
        }
    }
}

impl ChunkedDecoder {
    /// Decodes from the front of `buf` until it has data to hand out, needs more bytes, or the
    /// body ended.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded, ProtocolError> {
        loop {
            if let State::Data { left } = self.state {
                if buf.is_empty() {
                    return Ok(Decoded::NeedMore);
                }
                let take = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
                let left = left - take as u64;
                self.state = if left == 0 {
                    State::DataCr
                } else {
                    State::Data { left }
                };
                return Ok(Decoded::Data(buf.split_to(take).freeze()));
            }
            if self.state == State::Ended {
                return Ok(Decoded::End);
            }
            let Some(&byte) = buf.first() else {
                return Ok(Decoded::NeedMore);
            };
            buf.advance(1);
            self.step(byte)?;
        }
    }

    /// One framing byte.
    fn step(&mut self, byte: u8) -> Result<(), ProtocolError> {
        match self.state {
            State::Size { .. }
            | State::SizeWs { .. }
            | State::Extension { .. }
            | State::SizeLf { .. } => {
                self.line += 1;
                if self.line > MAX_CHUNK_LINE_BYTES {
                    return Err(ProtocolError::Chunked("chunk-size line too long"));
                }
            }
            State::TrailerStart | State::TrailerLine | State::EndLf => {
                self.trailers += 1;
                if self.trailers > MAX_TRAILER_BYTES {
                    return Err(ProtocolError::Chunked("trailers too long"));
                }
            }
            _ => {}
        }
        self.state = match (self.state, byte) {
            (State::Size { value, digits }, b) if b.is_ascii_hexdigit() => {
                if digits == 16 {
                    return Err(ProtocolError::Chunked("chunk size too large"));
                }
                let digit = u64::from((b as char).to_digit(16).unwrap_or_default());
                State::Size {
                    value: (value << 4) | digit,
                    digits: digits + 1,
                }
            }
            (State::Size { digits: 0, .. }, _) => {
                return Err(ProtocolError::Chunked("missing chunk size"));
            }
            (State::Size { value, .. } | State::SizeWs { value }, b'\r') => State::SizeLf { value },
            (State::Size { value, .. } | State::SizeWs { value }, b' ' | b'\t') => {
                State::SizeWs { value }
            }
            (State::Size { value, .. } | State::SizeWs { value }, b';') => {
                State::Extension { value }
            }
            (State::Size { .. } | State::SizeWs { .. }, _) => {
                return Err(ProtocolError::Chunked("invalid chunk size"));
            }
            (State::Extension { value }, b'\r') => State::SizeLf { value },
            (State::Extension { .. }, b'\n') => {
                return Err(ProtocolError::Chunked("bare LF in a chunk-size line"));
            }
            (State::Extension { value }, _) => State::Extension { value },
            (State::SizeLf { value }, b'\n') => {
                self.line = 0;
                if value == 0 {
                    State::TrailerStart
                } else {
                    State::Data { left: value }
                }
            }
            (State::SizeLf { .. }, _) => {
                return Err(ProtocolError::Chunked("expected LF after a chunk size"));
            }
            (State::DataCr, b'\r') => State::DataLf,
            (State::DataLf, b'\n') => State::Size {
                value: 0,
                digits: 0,
            },
            (State::DataCr | State::DataLf, _) => {
                return Err(ProtocolError::Chunked("expected CRLF after chunk data"));
            }
            (State::TrailerStart, b'\r') => State::EndLf,
            (State::TrailerStart | State::TrailerLine, b'\n') => State::TrailerStart,
            (State::TrailerStart | State::TrailerLine, _) => State::TrailerLine,
            (State::EndLf, b'\n') => State::Ended,
            (State::EndLf, _) => {
                return Err(ProtocolError::Chunked("expected LF at the body's end"));
            }
            (State::Data { .. } | State::Ended, _) => self.state,
        };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn head_of(bytes: &[u8], method: &Method) -> Result<Option<Head>, ProtocolError> {
        parse_head(&mut BytesMut::from(bytes), method)
    }

    #[test]
    fn a_request_goes_out_with_its_exact_length_and_without_framing_headers_of_its_own() {
        let mut headers = HeaderMap::new();
        headers.insert(header::HOST, HeaderValue::from_static("backend:8000"));
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("999"));
        headers.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        headers.insert("x-request-id", HeaderValue::from_static("abc"));
        let mut out = Vec::new();
        let inline = encode_request(
            &Method::POST,
            "/v1/chat/completions?x=1",
            &headers,
            b"{}",
            &mut out,
        );
        assert!(inline);
        assert_eq!(
            String::from_utf8(out).expect("ascii"),
            "POST /v1/chat/completions?x=1 HTTP/1.1\r\nhost: backend:8000\r\nx-request-id: abc\r\n\
             content-length: 2\r\n\r\n{}"
        );

        let mut out = Vec::new();
        encode_request(&Method::GET, "", &HeaderMap::new(), b"", &mut out);
        assert_eq!(
            &out[..],
            b"GET / HTTP/1.1\r\n\r\n",
            "no length for an empty GET"
        );
        let mut out = Vec::new();
        encode_request(&Method::POST, "/", &HeaderMap::new(), b"", &mut out);
        assert_eq!(&out[..], b"POST / HTTP/1.1\r\ncontent-length: 0\r\n\r\n");

        let big = vec![b'x'; INLINE_BODY_BYTES + 1];
        let mut out = Vec::new();
        assert!(!encode_request(
            &Method::POST,
            "/",
            &HeaderMap::new(),
            &big,
            &mut out
        ));
        assert!(
            out.ends_with(b"content-length: 65537\r\n\r\n"),
            "the body is written apart"
        );
    }

    /// The framing and connection fields are the codec's: consumed in the head's pass (what they
    /// said is in `framing` and `keep_alive`), with every name `Connection` lists, before or
    /// after it; the rest stay, repeated names in their order.
    #[test]
    fn control_fields_are_consumed_and_the_rest_kept() {
        let head = head_of(
            b"HTTP/1.1 200 OK\r\nX-Before: 1\r\nContent-Length: 2\r\nSet-Cookie: a\r\n\
              Connection: X-Before, close, , x-after\r\nKeep-Alive: timeout=5\r\n\
              Set-Cookie: b\r\nx-after: 2\r\nDate: today\r\n\r\nok",
            &Method::POST,
        )
        .expect("valid")
        .expect("complete");
        let mut kept: Vec<_> = head
            .headers
            .iter()
            .map(|(k, v)| format!("{k}: {}", v.to_str().expect("ascii")))
            .collect();
        kept.sort();
        assert_eq!(kept, ["date: today", "set-cookie: a", "set-cookie: b"]);
        let cookies: Vec<_> = head.headers.get_all("set-cookie").iter().collect();
        assert_eq!(cookies, ["a", "b"], "repeated values keep their order");
        assert_eq!(head.framing, Framing::Length(2));
        assert!(!head.keep_alive, "close");

        let head = head_of(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n",
            &Method::POST,
        )
        .expect("valid")
        .expect("complete");
        assert!(head.headers.is_empty());
        assert_eq!(head.framing, Framing::Chunked);
        assert!(head.keep_alive);
    }

    #[test]
    fn a_head_is_parsed_and_consumed_and_the_body_start_stays() {
        let mut buf = BytesMut::from(
            &b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\nok"[..],
        );
        let head = parse_head(&mut buf, &Method::POST)
            .expect("valid")
            .expect("complete");
        assert_eq!(head.status, StatusCode::OK);
        assert_eq!(head.version, Version::HTTP_11);
        assert_eq!(head.headers["content-type"], "application/json");
        assert_eq!(head.framing, Framing::Length(2));
        assert!(head.keep_alive);
        assert_eq!(&buf[..], b"ok");
    }

    #[test]
    fn a_partial_head_asks_for_more_until_its_bound() {
        assert!(
            head_of(b"HTTP/1.1 200 OK\r\nContent-Le", &Method::POST)
                .expect("valid")
                .is_none()
        );
        let mut huge = b"HTTP/1.1 200 OK\r\nx: ".to_vec();
        huge.resize(MAX_HEAD_BYTES, b'a');
        assert_eq!(
            head_of(&huge, &Method::POST).unwrap_err(),
            ProtocolError::HeadTooLarge
        );
    }

    #[test]
    fn malformed_heads_are_errors() {
        for bad in [
            &b"HTTP/1.1 2000 OK\r\n\r\n"[..],
            b"HTTP/2.0 200 OK\r\n\r\n",
            b"NOT HTTP\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nbad header\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nx: a\x01b\r\n\r\n",
        ] {
            assert!(
                matches!(head_of(bad, &Method::POST), Err(ProtocolError::Head(_))),
                "{bad:?}"
            );
        }
        let mut many = b"HTTP/1.1 200 OK\r\n".to_vec();
        for i in 0..=MAX_HEADERS {
            many.extend_from_slice(format!("x-{i}: v\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        assert!(matches!(
            head_of(&many, &Method::POST),
            Err(ProtocolError::Head(_))
        ));
        assert_eq!(
            head_of(b"HTTP/1.1 101 Switching Protocols\r\n\r\n", &Method::POST).unwrap_err(),
            ProtocolError::Upgrade
        );
    }

    #[test]
    fn informational_heads_are_skipped() {
        let mut buf = BytesMut::from(
            &b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 0\r\n\r\n"[..],
        );
        let head = parse_head(&mut buf, &Method::POST)
            .expect("valid")
            .expect("complete");
        assert_eq!(head.status, StatusCode::CREATED);
        assert!(!head.headers.contains_key("link"));
        assert!(buf.is_empty());
    }

    #[test]
    fn the_framing_follows_rfc_9112() {
        use Framing::{Chunked, Length, UntilClose};
        let (post, head) = (&Method::POST, &Method::HEAD);
        type Case<'a> = (&'a str, &'a Method, Result<(Framing, bool), ProtocolError>);
        let cases: &[Case] = &[
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 5",
                post,
                Ok((Length(5), true)),
            ),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 5, 5\r\ncontent-length: 5",
                post,
                Ok((Length(5), true)),
            ),
            (
                "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked",
                post,
                Ok((Chunked, true)),
            ),
            (
                "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, Chunked",
                post,
                Ok((Chunked, true)),
            ),
            // Both: the coding wins and the connection is not reused.
            (
                "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 5",
                post,
                Ok((Chunked, false)),
            ),
            (
                "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip",
                post,
                Ok((UntilClose, false)),
            ),
            ("HTTP/1.1 200 OK", post, Ok((UntilClose, false))),
            ("HTTP/1.1 204 No Content", post, Ok((Length(0), true))),
            (
                "HTTP/1.1 304 Not Modified\r\ncontent-length: 7",
                post,
                Ok((Length(0), true)),
            ),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 7",
                head,
                Ok((Length(0), true)),
            ),
            // Persistence.
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: Close",
                post,
                Ok((Length(0), false)),
            ),
            (
                "HTTP/1.0 200 OK\r\ncontent-length: 0",
                post,
                Ok((Length(0), false)),
            ),
            (
                "HTTP/1.0 200 OK\r\ncontent-length: 0\r\nconnection: keep-alive",
                post,
                Ok((Length(0), true)),
            ),
            // An HTTP/1.0 answer with `Transfer-Encoding` is read, and its connection closed
            // (RFC 9112 §6.1), whatever it says of keep-alive.
            (
                "HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\nconnection: keep-alive",
                post,
                Ok((Chunked, false)),
            ),
        ];
        for (text, method, expected) in cases {
            let got = head_of(format!("{text}\r\n\r\n").as_bytes(), method)
                .map(|h| h.map(|h| (h.framing, h.keep_alive)).expect("complete"));
            assert_eq!(&got, expected, "{text:?}");
        }
        for bad in ["5, 6", "-1", "+5", "0x5", "", "99999999999999999999"] {
            let text = format!("HTTP/1.1 200 OK\r\ncontent-length: {bad}\r\n\r\n");
            let got = head_of(text.as_bytes(), post).map(|h| h.map(|h| h.framing));
            assert_eq!(got, Err(ProtocolError::ContentLength), "{bad:?}");
        }
    }

    #[test]
    fn a_request_asking_to_close_is_seen() {
        let close =
            |name: HeaderName, value| asks_to_close(&name, &HeaderValue::from_static(value));
        assert!(close(header::CONNECTION, "TE, close"));
        assert!(close(header::CONNECTION, "Close"));
        assert!(!close(header::CONNECTION, "keep-alive"));
        assert!(!close(HeaderName::from_static("x-connection"), "close"));
    }

    /// Decodes `wire` fed in pieces at `cuts`; returns the data and whether the body ended, or
    /// the error.
    fn decode_in_pieces(
        wire: &[u8],
        cuts: &[usize],
    ) -> Result<(Vec<u8>, bool, Vec<u8>), ProtocolError> {
        let mut decoder = ChunkedDecoder::default();
        let (mut buf, mut out, mut fed) = (BytesMut::new(), Vec::new(), 0);
        let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (wire.len() + 1)).collect();
        cuts.push(wire.len());
        cuts.sort_unstable();
        for cut in cuts {
            buf.extend_from_slice(&wire[fed..cut.max(fed)]);
            fed = cut.max(fed);
            loop {
                match decoder.decode(&mut buf)? {
                    Decoded::Data(data) => {
                        assert!(!data.is_empty());
                        out.extend_from_slice(&data);
                    }
                    Decoded::NeedMore => break,
                    Decoded::End => {
                        // What follows the body: the buffer and what was not fed yet.
                        let mut rest = buf.to_vec();
                        rest.extend_from_slice(&wire[fed..]);
                        return Ok((out, true, rest));
                    }
                }
            }
        }
        // Every piece fed and no end seen.
        Ok((out, false, buf.to_vec()))
    }

    fn encode_chunked(
        data: &[u8],
        sizes: &[usize],
        extension: bool,
        trailer: bool,
        upper: bool,
    ) -> Vec<u8> {
        let mut wire = Vec::new();
        let mut at = 0;
        let mut sizes = sizes.iter().cycle();
        while at < data.len() {
            let n = (*sizes.next().expect("cycled")).clamp(1, data.len() - at);
            let size = if upper {
                format!("{n:X}")
            } else {
                format!("{n:x}")
            };
            wire.extend_from_slice(size.as_bytes());
            if extension {
                wire.extend_from_slice(b" ;name=\"v\"");
            }
            wire.extend_from_slice(b"\r\n");
            wire.extend_from_slice(&data[at..at + n]);
            wire.extend_from_slice(b"\r\n");
            at += n;
        }
        wire.extend_from_slice(b"0\r\n");
        if trailer {
            wire.extend_from_slice(b"x-trailer: 1\r\nx-other: two\r\n");
        }
        wire.extend_from_slice(b"\r\n");
        wire
    }

    proptest! {
        /// Whatever the chunk sizes, extensions, trailers and read boundaries, the decoder hands
        /// out exactly the body, ends exactly at its end, and leaves what follows in the buffer.
        #[test]
        fn a_chunked_body_decodes_to_its_data_in_any_read_pieces(
            data in proptest::collection::vec(any::<u8>(), 0..600),
            sizes in proptest::collection::vec(1usize..300, 1..6),
            cuts in proptest::collection::vec(any::<usize>(), 0..12),
            extension in any::<bool>(),
            trailer in any::<bool>(),
            upper in any::<bool>(),
        ) {
            let mut wire = encode_chunked(&data, &sizes, extension, trailer, upper);
            wire.extend_from_slice(b"HTTP/1.1 next");
            let (out, ended, rest) = decode_in_pieces(&wire, &cuts).expect("valid");
            prop_assert!(ended);
            prop_assert_eq!(out, data);
            prop_assert_eq!(&rest[..], b"HTTP/1.1 next");
        }

        /// Any bytes: an error, more wanted or an end — never a panic, and never more data out
        /// than came in.
        #[test]
        fn arbitrary_bytes_never_panic_the_decoder(
            wire in proptest::collection::vec(any::<u8>(), 0..400),
            cuts in proptest::collection::vec(any::<usize>(), 0..6),
        ) {
            if let Ok((out, _, _)) = decode_in_pieces(&wire, &cuts) {
                prop_assert!(out.len() <= wire.len());
            }
        }

        /// Any bytes as a response head: parsed, incomplete or an error, never a panic.
        #[test]
        fn arbitrary_heads_never_panic(prefix in "HTTP/1\\.[01] [0-9]{3} [ -~]{0,10}\r\n", wire in proptest::collection::vec(any::<u8>(), 0..300)) {
            let mut bytes = prefix.into_bytes();
            bytes.extend_from_slice(&wire);
            let _ = head_of(&bytes, &Method::POST);
        }
    }

    #[test]
    fn malformed_chunked_framing_is_an_error() {
        for (bad, what) in [
            (&b"\r\n"[..], "missing chunk size"),
            (b"g\r\n", "missing chunk size"),
            (b"5 5\r\n", "invalid chunk size"),
            (b"5\n", "invalid chunk size"),
            (b"5\r\rhello", "expected LF after a chunk size"),
            (b"2\r\nokX", "expected CRLF after chunk data"),
            (b"2\r\nok\rX", "expected CRLF after chunk data"),
            (b"1;a\nb\r\n", "bare LF in a chunk-size line"),
            (b"11111111111111111\r\n", "chunk size too large"),
            (b"0\r\n\rX", "expected LF at the body's end"),
        ] {
            assert_eq!(
                decode_in_pieces(bad, &[]).unwrap_err(),
                ProtocolError::Chunked(what),
                "{bad:?}"
            );
        }
        let mut long = b"1;".to_vec();
        long.resize(MAX_CHUNK_LINE_BYTES + 1, b'x');
        assert_eq!(
            decode_in_pieces(&long, &[]).unwrap_err(),
            ProtocolError::Chunked("chunk-size line too long")
        );
        let mut trailers = b"0\r\n".to_vec();
        while trailers.len() < MAX_TRAILER_BYTES + 16 {
            trailers.extend_from_slice(b"x-t: 123456789\r\n");
        }
        assert_eq!(
            decode_in_pieces(&trailers, &[]).unwrap_err(),
            ProtocolError::Chunked("trailers too long")
        );
        // Sixteen hex digits is the most a size may have.
        assert!(decode_in_pieces(b"ffffffffffffffff\r\nabc", &[]).is_ok());
    }
}
