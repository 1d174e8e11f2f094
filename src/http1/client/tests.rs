//! The client role's tests: the request's encoding, the response head's parse and bounds, the
//! control fields it consumes and the framing of RFC 9112 §6.3.

use bytes::BytesMut;
use http::header;
use proptest::prelude::*;

use super::*;
use crate::http1::MAX_HEADERS;

fn head_of(bytes: &[u8], method: &Method) -> Result<Option<Head>, ProtocolError> {
    Client::parse(&mut BytesMut::from(bytes), method)
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
    let inline = Client::encode(
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
    Client::encode(&Method::GET, "", &HeaderMap::new(), b"", &mut out);
    assert_eq!(
        &out[..],
        b"GET / HTTP/1.1\r\n\r\n",
        "no length for an empty GET"
    );
    let mut out = Vec::new();
    Client::encode(&Method::POST, "/", &HeaderMap::new(), b"", &mut out);
    assert_eq!(&out[..], b"POST / HTTP/1.1\r\ncontent-length: 0\r\n\r\n");

    let big = vec![b'x'; INLINE_BODY_BYTES + 1];
    let mut out = Vec::new();
    assert!(!Client::encode(
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
    let head = Client::parse(&mut buf, &Method::POST)
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
    let head = Client::parse(&mut buf, &Method::POST)
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

proptest! {
    /// Any bytes as a response head: parsed, incomplete or an error, never a panic.
    #[test]
    fn arbitrary_heads_never_panic(prefix in "HTTP/1\\.[01] [0-9]{3} [ -~]{0,10}\r\n", wire in proptest::collection::vec(any::<u8>(), 0..300)) {
        let mut bytes = prefix.into_bytes();
        bytes.extend_from_slice(&wire);
        let _ = head_of(&bytes, &Method::POST);
    }
}
