//! The one HTTP/1.1 codec, sans-IO: request and response heads, the body framing rules of RFC
//! 9112 §6.3 and the chunked coding, for both ends of the proxy. Its two roles differ only where
//! the protocol makes them differ, as hyper's `proto/h1/role.rs` serves its `Server` and `Client`
//! through one trait ([`Role`]):
//!
//! - [`server`]: the front door's own HTTP/1.1 server (`front_door::serve`'s `fast`) parses a
//!   request head and either serves it (a plain request with a `Content-Length` body) or hands
//!   every byte to hyper's server, which answers whatever it does not take; it encodes the answer's
//!   head and, when the answer has no length, its chunks.
//! - [`client`]: the backend connection pool (`proxy::pool`) encodes a request in one buffer and
//!   parses the response head, whose framing it reads with [`chunked::ChunkedDecoder`].
//!
//! One rule set for both: the head goes through `httparse` (its token and field-value rules: a
//! field name with a byte beyond `tchar` or an obs-folded line is malformed), bounded in bytes and
//! in fields before it is accepted; the fields are kept as slices of the head's bytes
//! ([`head`]); `Connection` is read as a token list and `Content-Length` as plain decimals
//! ([`decimal`]); the framing fields (`Content-Length`, `Transfer-Encoding`) are the encoder's own
//! and never copied from a header map. Everything read is untrusted: a malformed byte is a
//! refusal (the server's hand-over, the client's [`ProtocolError`]), never a panic.
//!
//! No IO and no tasks here: the connection layers (`front_door::serve::fast`, `proxy::pool`)
//! read and write the sockets and keep the timeouts.

use bytes::BytesMut;
use http::{HeaderName, HeaderValue, header};

pub mod chunked;
pub mod client;
mod head;
pub mod server;

pub use chunked::{ChunkedDecoder, Decoded};
pub use client::ProtocolError;

/// Most header fields in one head (hyper's default), requests and responses alike.
pub const MAX_HEADERS: usize = 100;

/// How a message body is delimited (RFC 9112 §6.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    /// Exactly this many bytes (0: no body).
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// Everything until the sender closes the connection (a response only).
    UntilClose,
}

/// What one end of a connection reads and writes: the parse of the heads it receives, with
/// what that parse needs to know of the exchange.
///
/// [`server::Server`] reads requests (knowing the body limit and which targets it serves);
/// [`client::Client`] reads responses (knowing the method of the request they answer).
pub trait Role {
    /// What the parse needs besides the bytes.
    type Context<'a>
    where
        Self: 'a;
    /// What the parse made of the start of the buffer.
    type Parsed;

    /// Parses the head at the start of `buf`; on a whole head its bytes are consumed, otherwise
    /// `buf` holds what it held.
    fn parse(buf: &mut BytesMut, context: Self::Context<'_>) -> Self::Parsed;
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

/// The tokens of a comma-separated list field (`Connection`, `Transfer-Encoding`), trimmed.
pub fn tokens(list: &[u8]) -> impl DoubleEndedIterator<Item = &[u8]> {
    list.split(|&b| b == b',').map(<[u8]>::trim_ascii)
}

/// Whether this field asks for the connection to close after the exchange
/// (`Connection: close`, RFC 9112 §9.6).
pub fn asks_to_close(name: &HeaderName, value: &HeaderValue) -> bool {
    name == header::CONNECTION
        && tokens(value.as_bytes()).any(|token| token.eq_ignore_ascii_case(b"close"))
}

/// Whether a field is one of the framing fields the encoder writes itself.
fn is_framing(name: &HeaderName) -> bool {
    name == header::CONTENT_LENGTH || name == header::TRANSFER_ENCODING
}

/// Appends `name: value` and its CRLF.
fn push_field(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// Appends `content-length: n` and its CRLF.
fn push_length(out: &mut Vec<u8>, n: u64) {
    push_field(
        out,
        b"content-length",
        itoa::Buffer::new().format(n).as_bytes(),
    );
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
                && literal.iter().all(|&b| {
                    b.is_ascii_hexdigit() || matches!(b, b':' | b'.') || reg_name_byte(b)
                });
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
            b'-' | b'.'
                | b'_'
                | b'~'
                | b'%'
                | b'!'
                | b'$'
                | b'&'
                | b'\''
                | b'('
                | b')'
                | b'*'
                | b'+'
                | b','
                | b';'
                | b'='
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_are_plain_decimals() {
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
    }

    #[test]
    fn a_field_asking_to_close_is_seen() {
        let close =
            |name: HeaderName, value| asks_to_close(&name, &HeaderValue::from_static(value));
        assert!(close(header::CONNECTION, "TE, close"));
        assert!(close(header::CONNECTION, "Close"));
        assert!(!close(header::CONNECTION, "keep-alive"));
        assert!(!close(HeaderName::from_static("x-connection"), "close"));
    }
}
