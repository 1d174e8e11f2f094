//! The client role: a request encoded into one buffer, a response head parsed (informational
//! heads skipped, a protocol switch refused), and its body's framing (RFC 9112 §6.3) with the
//! connection's persistence. The backend connection pool (`proxy::pool`) runs it.
//!
//! What the backend sends is untrusted: the head is bounded ([`MAX_HEAD_BYTES`],
//! [`super::MAX_HEADERS`]) before it is accepted and a malformed byte is a [`ProtocolError`].

use bytes::BytesMut;
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Version};

use super::head::{Spans, slots};
use super::{Framing, Role, decimal, is_framing, push_field, push_length, tokens};

/// Most bytes a response head (informational heads before it included) may take: hyper's
/// default read-buffer bound, which the pool had before (8 KiB + 100 headers of 4 KiB).
pub const MAX_HEAD_BYTES: usize = 8192 + 4096 * 100;

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

/// The client end of a connection: it writes requests and reads responses.
#[derive(Clone, Copy, Debug)]
pub struct Client;

impl Role for Client {
    /// The method of the request the response answers (a `HEAD`'s answer has no body).
    type Context<'a> = &'a Method;
    /// `Ok(None)`: the head is not complete yet (read more). On success the head's bytes are
    /// consumed from the buffer; what follows is the body's start.
    type Parsed = Result<Option<Head>, ProtocolError>;

    /// Parses the response head at the start of `buf`, skipping informational (1xx) heads
    /// before it.
    fn parse(buf: &mut BytesMut, method: &Method) -> Self::Parsed {
        loop {
            if buf.is_empty() {
                return Ok(None);
            }
            let (consumed, code, version, spans) =
                {
                    let mut fields = slots();
                    let mut response = httparse::Response::new(&mut []);
                    let parsed = httparse::ParserConfig::default()
                        .parse_response_with_uninit_headers(&mut response, buf, &mut fields);
                    let consumed = match parsed {
                        Ok(httparse::Status::Complete(consumed)) => consumed,
                        Ok(httparse::Status::Partial) if buf.len() >= MAX_HEAD_BYTES => {
                            return Err(ProtocolError::HeadTooLarge);
                        }
                        Ok(httparse::Status::Partial) => return Ok(None),
                        Err(error) => return Err(ProtocolError::Head(error.to_string())),
                    };
                    let spans = Spans::record(buf, response.headers);
                    (
                        consumed,
                        response.code.unwrap_or_default(),
                        response.version,
                        spans,
                    )
                };
            if consumed > MAX_HEAD_BYTES {
                return Err(ProtocolError::HeadTooLarge);
            }
            let status =
                StatusCode::from_u16(code).map_err(|e| ProtocolError::Head(e.to_string()))?;
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
            return answer(status, version, &head, &spans, method).map(Some);
        }
    }
}

/// The final answer's head from its fields: the control fields consumed into its framing and
/// persistence, every other field kept.
fn answer(
    status: StatusCode,
    version: Version,
    head: &bytes::Bytes,
    spans: &Spans,
    method: &Method,
) -> Result<Head, ProtocolError> {
    let mut control = Control::default();
    // Room for the two fields a relaying caller adds (its exact length, its own routing header)
    // without the map growing: growing rehashes every field.
    let mut headers = spans
        .map(head, 2, |name, value| control.read(name, value))
        .map_err(|error| ProtocolError::Head(error.to_string()))?;
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
    Ok(Head {
        status,
        version,
        headers,
        framing,
        keep_alive,
    })
}

impl Client {
    /// Appends the request head (origin form, HTTP/1.1) and, when it is small, the body to
    /// `out`. `Content-Length` and `Transfer-Encoding` are this encoder's: the body is sent with
    /// its exact length. Returns whether the body was appended (else the caller writes it after
    /// the head).
    pub fn encode<'h>(
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
            if !is_framing(name) {
                push_field(out, name.as_str().as_bytes(), value.as_bytes());
            }
        }
        let sends_length =
            !body.is_empty() || matches!(*method, Method::POST | Method::PUT | Method::PATCH);
        if sends_length {
            push_length(out, body.len() as u64);
        }
        out.extend_from_slice(b"\r\n");
        let inline = body.len() <= INLINE_BODY_BYTES;
        if inline {
            out.extend_from_slice(body);
        }
        inline
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
                for token in tokens(value) {
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
            let chunked = tokens(codings)
                .next_back()
                .is_some_and(|coding| coding.eq_ignore_ascii_case(b"chunked"));
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
    for part in tokens(value) {
        let n = decimal(part).ok_or(ProtocolError::ContentLength)?;
        if seen.is_some_and(|seen| seen != n) {
            return Err(ProtocolError::ContentLength);
        }
        seen = Some(n);
    }
    Ok(seen)
}

#[cfg(test)]
mod tests;
