//! The server role's tests: a plain request is served with every field, anything else is
//! handed over with every byte; the answer's head and its date.

use bytes::BytesMut;
use http::HeaderValue;

use super::*;
use crate::http1::MAX_HEADERS;
use crate::proxy::OpenAiRoute;

/// The front door's hot routes, as the connection layer's handler names them.
fn hot(method: &str, path: &str) -> Option<OpenAiRoute> {
    crate::front_door::hot_route(method, path)
}

fn parse(buf: &mut BytesMut, max_body: usize) -> Parsed<OpenAiRoute> {
    Server::parse(
        buf,
        Accept {
            max_body,
            route: &hot,
        },
    )
}

fn parsed(head: &[u8]) -> (Parsed<OpenAiRoute>, BytesMut) {
    let mut buf = BytesMut::from(head);
    (parse(&mut buf, 1_000), buf)
}

fn fast(head: &[u8]) -> (Request<OpenAiRoute>, BytesMut) {
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
    for host in [
        "r",
        "router:8080",
        "10.0.0.1:80",
        "[::1]:8080",
        "[fe80::1%25eth0]",
        "a_b.c",
        "",
    ] {
        let head = format!("POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n{body}");
        let (request, _) = fast(head.as_bytes());
        assert_eq!(request.headers["host"], host);
    }
}

#[test]
fn the_date_is_an_http_date() {
    let mut out = Vec::new();
    push_date(&mut out);
    let date = std::str::from_utf8(&out).expect("ASCII");
    assert!(httpdate::parse_http_date(date).is_ok(), "{date}");
}

#[test]
fn an_answer_head_carries_its_framing_and_the_connection_s_fate() {
    let mut headers = HeaderMap::new();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("a/b"));
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("999"));
    headers.insert(header::DATE, HeaderValue::from_static("today"));
    let mut out = Vec::new();
    let answer = encode(StatusCode::OK, &headers, Some(2), true, &mut out);
    assert_eq!(
        answer,
        Answer {
            body: Some(Framing::Length(2)),
            keep: true
        }
    );
    assert_eq!(
        String::from_utf8(out).expect("ASCII"),
        "HTTP/1.1 200 OK\r\ncontent-type: a/b\r\ndate: today\r\ncontent-length: 2\r\n\r\n"
    );
    headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
    let mut out = Vec::new();
    let answer = encode(StatusCode::OK, &headers, None, true, &mut out);
    assert_eq!(
        answer,
        Answer {
            body: Some(Framing::Chunked),
            keep: false
        }
    );
    assert!(out.ends_with(b"connection: close\r\ntransfer-encoding: chunked\r\n\r\n"));
    let mut out = Vec::new();
    let answer = encode(
        StatusCode::NO_CONTENT,
        &HeaderMap::new(),
        None,
        false,
        &mut out,
    );
    assert_eq!(
        answer,
        Answer {
            body: None,
            keep: false
        }
    );
    assert!(out.starts_with(b"HTTP/1.1 204 No Content\r\ndate: "));
    assert!(out.ends_with(b"\r\nconnection: close\r\n\r\n"));
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
