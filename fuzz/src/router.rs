//! Fuzz-target bodies over the root crate's parsers: the front door fast server's request head
//! parser and hand-over decision (also against hyper's server), the backend client's response
//! head parser and chunked decoder (also against a reference decoder), the ingress relay's SSE
//! decoder (against a reference) and the config loader.
//!
//! Each `pub fn` is one target's whole body: `fuzz/fuzz_targets/<name>.rs` calls it, and the
//! corpus replay (`tests/it/fuzz_corpus.rs`, which includes this file by path) calls it with every
//! committed corpus file. A finding is a panic.

use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use continuum_router::config::{Config, EnvLookup, show_effective};
use continuum_router::front_door::ingress::SseDecoder;
use continuum_router::http1::chunked::{MAX_CHUNK_LINE_BYTES, MAX_TRAILER_BYTES};
use continuum_router::http1::client::Client;
use continuum_router::http1::server::{Accept, MAX_FAST_HEAD, Parsed as FastParsed, Server};
use continuum_router::http1::{self as h1, ChunkedDecoder, Decoded, Framing, Role as _};
use continuum_router::proxy::OpenAiRoute;
use http::{HeaderMap, Method, StatusCode, Version, header};

use super::common::{Source, pieces};

/// The fast server's head parser with the front door's hot routes (its connection layer's
/// handler): `FastParsed::Fast` for a plain hot request, else partial or handed over.
fn parse_fast_head(buf: &mut BytesMut, max_body: usize) -> FastParsed<OpenAiRoute> {
    let route = continuum_router::front_door::hot_route;
    Server::parse(
        buf,
        Accept {
            max_body,
            route: &route,
        },
    )
}

/// The fast server's head parser: what it does not serve leaves the buffer as it was (hyper gets
/// every byte), what it serves consumed exactly one head, and a head cut short is `Partial`.
pub fn fast_head(data: &[u8]) {
    let mut src = Source::new(data);
    let max_body = match src.byte() {
        0 => 0,
        b => usize::from(b) * 64,
    };
    let input = src.rest();
    let mut buf = BytesMut::from(input);
    match parse_fast_head(&mut buf, max_body) {
        FastParsed::Partial => {
            assert_eq!(&buf[..], input, "a partial head left the buffer as it was");
            assert!(input.len() < MAX_FAST_HEAD);
        }
        FastParsed::HandOff => assert_eq!(&buf[..], input, "hyper is handed every byte"),
        FastParsed::Fast(request) => {
            let consumed = input.len() - buf.len();
            assert_eq!(&buf[..], &input[consumed..], "only the head is consumed");
            assert!(consumed > 0 && consumed < MAX_FAST_HEAD);
            assert!(request.content_length <= max_body);
            assert!(matches!(
                request.route,
                OpenAiRoute::ChatCompletions | OpenAiRoute::Completions
            ));
            for name in [header::TRANSFER_ENCODING, header::EXPECT, header::UPGRADE] {
                assert!(!request.headers.contains_key(&name), "a plain request only");
            }
            assert_eq!(
                request
                    .headers
                    .get_all(header::CONTENT_LENGTH)
                    .iter()
                    .count(),
                1
            );
            // Any shorter prefix of the head is not a whole head yet.
            let mut prefix = BytesMut::from(&input[..consumed - 1]);
            assert!(matches!(
                parse_fast_head(&mut prefix, max_body),
                FastParsed::Partial | FastParsed::HandOff
            ));
        }
    }
}

/// Differential: a head the fast server serves is one hyper's server (the one it hands over to)
/// accepts with the same method, target, version, header fields and body length.
pub fn fast_head_vs_hyper(data: &[u8]) {
    let mut buf = BytesMut::from(data);
    let FastParsed::Fast(request) = parse_fast_head(&mut buf, 1 << 20) else {
        return;
    };
    let consumed = data.len() - buf.len();
    let head = &data[..consumed];
    let Some(seen) = hyper_reads(head) else {
        panic!(
            "the fast server serves a head hyper's server refuses: {:?}",
            String::from_utf8_lossy(head)
        );
    };
    assert_eq!(seen.method, Method::POST);
    assert_eq!(seen.version, Version::HTTP_11);
    let path = seen.path.split('?').next().unwrap_or_default();
    let route = match path {
        "/v1/chat/completions" => OpenAiRoute::ChatCompletions,
        "/v1/completions" => OpenAiRoute::Completions,
        other => panic!("hyper read the target {other:?}"),
    };
    assert_eq!(route, request.route);
    assert_eq!(seen.headers, request.headers, "the header fields differ");
    assert_eq!(seen.length, Some(request.content_length as u64));
}

/// What hyper's HTTP/1 server made of a request head.
#[derive(Debug)]
struct Seen {
    method: Method,
    path: String,
    version: Version,
    headers: HeaderMap,
    length: Option<u64>,
}

thread_local! {
    static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a current-thread runtime");
}

/// Serves `head` (and nothing after it: the client half closes) with hyper's HTTP/1 server over
/// an in-memory pipe; the request hyper handed to its service, if any.
fn hyper_reads(head: &[u8]) -> Option<Seen> {
    use http_body_util::Empty;
    use hyper::body::Body as _;
    use tokio::io::AsyncWriteExt;

    let seen: Arc<Mutex<Option<Seen>>> = Arc::default();
    let slot = seen.clone();
    let service =
        hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
            let slot = slot.clone();
            async move {
                *slot.lock().expect("one thread") = Some(Seen {
                    method: request.method().clone(),
                    path: request.uri().to_string(),
                    version: request.version(),
                    headers: request.headers().clone(),
                    length: request.body().size_hint().exact(),
                });
                Ok::<_, std::convert::Infallible>(http::Response::new(Empty::<Bytes>::new()))
            }
        });
    RUNTIME.with(|runtime| {
        runtime.block_on(async {
            let (mut client, server) = tokio::io::duplex(1 << 20);
            client
                .write_all(head)
                .await
                .expect("the pipe holds the head");
            client.shutdown().await.expect("half close");
            // Half-close: the client's end of input must not abort a request hyper has read.
            let connection = hyper::server::conn::http1::Builder::new()
                .half_close(true)
                .serve_connection(hyper_util::rt::TokioIo::new(server), service);
            let _ = connection.await;
            drop(client);
        });
    });
    seen.lock().expect("one thread").take()
}

/// The backend client's response head parser and chunked decoder: fed in pieces they agree with
/// themselves fed whole; a parsed head holds no framing or connection field; a chunked body
/// decodes as the reference decoder says.
pub fn h1_response(data: &[u8]) {
    let mut src = Source::new(data);
    let method = [Method::GET, Method::POST, Method::HEAD, Method::PUT][src.below(4)].clone();
    let seed = src.byte();
    let input = src.rest();
    let whole = head_outcome(&[input], &method);
    let pieced = head_outcome(&pieces(input, seed), &method);
    assert_eq!(whole, pieced, "the head parsed whole and in pieces");
    if let Ok(Some((_, framing, _, rest))) = whole
        && framing == "Chunked"
    {
        chunked_agrees(&rest, seed);
    }
}

/// What `parse_head` made of `parts` fed one after another: status, framing and keep-alive, the
/// fields, and the bytes left after the head; `Ok(None)` while incomplete.
#[allow(clippy::type_complexity)]
fn head_outcome(
    parts: &[&[u8]],
    method: &Method,
) -> Result<Option<(String, String, Vec<(String, Vec<u8>)>, Vec<u8>)>, h1::ProtocolError> {
    let mut buf = BytesMut::new();
    for (i, part) in parts.iter().enumerate() {
        buf.extend_from_slice(part);
        let Some(head) = Client::parse(&mut buf, method)? else {
            continue;
        };
        // The rest of the input is what follows the head.
        for later in &parts[i + 1..] {
            buf.extend_from_slice(later);
        }
        assert!(!head.status.is_informational());
        assert_ne!(head.status, StatusCode::SWITCHING_PROTOCOLS);
        for name in [
            header::CONTENT_LENGTH,
            header::TRANSFER_ENCODING,
            header::CONNECTION,
        ] {
            assert!(!head.headers.contains_key(&name), "{name} is consumed");
        }
        if *method == Method::HEAD {
            assert_eq!(head.framing, Framing::Length(0));
        }
        if head.framing == Framing::UntilClose {
            assert!(
                !head.keep_alive,
                "a body read to the close ends the connection"
            );
        }
        if head.version == Version::HTTP_10 && head.keep_alive {
            assert!(matches!(head.framing, Framing::Length(_)) || head.framing == Framing::Chunked);
        }
        let fields = head
            .headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect();
        let summary = format!(
            "{} {:?} keep_alive={}",
            head.status, head.version, head.keep_alive
        );
        return Ok(Some((
            summary,
            format!("{:?}", head.framing),
            fields,
            buf.to_vec(),
        )));
    }
    Ok(None)
}

/// Differential: the chunked decoder against [`reference_chunked`], over the whole input.
pub fn h1_chunked_vs_reference(data: &[u8]) {
    let mut src = Source::new(data);
    let seed = src.byte();
    chunked_agrees(src.rest(), seed);
}

/// How a chunked body ended, with the body bytes decoded up to there.
#[derive(Debug, PartialEq, Eq)]
enum Chunked {
    /// The body ended after this many input bytes.
    Ended(Vec<u8>, usize),
    /// The input ended inside the body.
    NeedMore(Vec<u8>),
    Error(Vec<u8>),
}

fn chunked_agrees(input: &[u8], seed: u8) {
    let expected = reference_chunked(input);
    assert_eq!(decode_chunked(&[input]), expected, "whole input");
    assert_eq!(
        decode_chunked(&pieces(input, seed)),
        expected,
        "input in pieces"
    );
}

/// [`ChunkedDecoder`] over `parts` fed one after another into one buffer, as the pool reads.
fn decode_chunked(parts: &[&[u8]]) -> Chunked {
    let mut decoder = ChunkedDecoder::default();
    let mut buf = BytesMut::new();
    let mut body = Vec::new();
    let mut fed = 0;
    for part in parts {
        buf.extend_from_slice(part);
        fed += part.len();
        loop {
            match decoder.decode(&mut buf) {
                Ok(Decoded::Data(data)) => {
                    assert!(!data.is_empty(), "data is never empty");
                    body.extend_from_slice(&data);
                }
                Ok(Decoded::NeedMore) => {
                    assert!(buf.is_empty(), "more is asked for only when all was read");
                    break;
                }
                Ok(Decoded::End) => return Chunked::Ended(body, fed - buf.len()),
                Err(_) => return Chunked::Error(body),
            }
        }
    }
    Chunked::NeedMore(body)
}

/// A line-at-a-time chunked decoder written from RFC 9112 §7.1 with the client's bounds
/// (`chunk-size [BWS] [; ext]` CRLF with at most 16 hex digits and a line of at most
/// `MAX_CHUNK_LINE_BYTES` bytes; data then CRLF; after the last chunk, trailer lines ending in LF
/// up to the empty CRLF line, at most `MAX_TRAILER_BYTES` bytes).
fn reference_chunked(input: &[u8]) -> Chunked {
    let mut at = 0;
    let mut body = Vec::new();
    loop {
        // The chunk-size line: its content ends at the first CR or LF.
        let rest = &input[at..];
        let end = rest.iter().position(|&b| b == b'\r' || b == b'\n');
        let content = &rest[..end.unwrap_or(rest.len())];
        let digits = content.iter().take_while(|b| b.is_ascii_hexdigit()).count();
        let after = &content[digits..];
        let ws = after
            .iter()
            .take_while(|&&b| b == b' ' || b == b'\t')
            .count();
        let shape_ok = digits <= 16
            && (digits > 0 || content.is_empty() && end.is_none())
            && (after[ws..].is_empty() || after[ws] == b';');
        let too_long = |n: usize| n > MAX_CHUNK_LINE_BYTES;
        if !shape_ok {
            // The first offending byte may lie beyond the line bound: either way an error.
            return Chunked::Error(body);
        }
        let Some(end) = end else {
            return if too_long(content.len()) {
                Chunked::Error(body)
            } else {
                Chunked::NeedMore(body)
            };
        };
        if rest[end] == b'\n' || digits == 0 {
            return Chunked::Error(body);
        }
        // CR: the LF must follow.
        match rest.get(end + 1) {
            None if too_long(end + 1) => return Chunked::Error(body),
            None => return Chunked::NeedMore(body),
            Some(b'\n') if !too_long(end + 2) => {}
            Some(_) => return Chunked::Error(body),
        }
        let size = content[..digits].iter().fold(0u64, |n, &b| {
            n << 4 | u64::from((b as char).to_digit(16).unwrap_or(0))
        });
        at += end + 2;
        if size == 0 {
            return reference_trailers(input, at, body);
        }
        let available = (input.len() - at) as u64;
        if available < size {
            body.extend_from_slice(&input[at..]);
            return Chunked::NeedMore(body);
        }
        let size = size as usize;
        body.extend_from_slice(&input[at..at + size]);
        at += size;
        match &input[at..] {
            [] | [b'\r'] => return Chunked::NeedMore(body),
            [b'\r', b'\n', ..] => at += 2,
            _ => return Chunked::Error(body),
        }
    }
}

fn reference_trailers(input: &[u8], start: usize, body: Vec<u8>) -> Chunked {
    let mut at = start;
    let bounded = |at: usize, body: Vec<u8>| {
        if at - start > MAX_TRAILER_BYTES {
            Chunked::Error(body)
        } else {
            Chunked::NeedMore(body)
        }
    };
    loop {
        if at - start > MAX_TRAILER_BYTES {
            return Chunked::Error(body);
        }
        match input.get(at) {
            None => return bounded(at, body),
            Some(b'\r') => {
                return match input.get(at + 1) {
                    None => bounded(at + 1, body),
                    Some(b'\n') if at + 2 - start <= MAX_TRAILER_BYTES => {
                        Chunked::Ended(body, at + 2)
                    }
                    Some(_) => Chunked::Error(body),
                };
            }
            Some(_) => match input[at..].iter().position(|&b| b == b'\n') {
                Some(lf) => at += lf + 1,
                None => return bounded(input.len(), body),
            },
        }
    }
}

/// Differential: the ingress relay's SSE decoder (`front_door::ingress::SseDecoder`) fed in
/// pieces against [`reference_sse`] over the whole stream; and, with a small bound, that an
/// oversized event is refused without the decoder failing later.
pub fn relay_sse_vs_reference(data: &[u8]) {
    let mut src = Source::new(data);
    let seed = src.byte();
    let small = usize::from(src.byte());
    let input = src.rest();
    let mut decoder = SseDecoder::new(input.len() + 1);
    let mut events = Vec::new();
    for piece in pieces(input, seed) {
        events.extend(decoder.push(piece).expect("within the bound"));
    }
    let last = decoder.finish();
    assert_eq!((events, last), reference_sse(input));
    let mut bounded = SseDecoder::new(small);
    for piece in pieces(input, seed) {
        if let Ok(events) = bounded.push(piece) {
            assert!(events.iter().all(|e| e.len() <= small));
        }
    }
    if let Some(last) = bounded.finish() {
        assert!(last.len() <= small + 1);
    }
}

/// The relay decoder's contract written plainly: lines end at LF (one CR before it is dropped),
/// `data:` lines (one optional space after the colon) are joined with LF, a blank line ends an
/// event that had data, everything else is ignored; at the end of the stream, an unfinished line
/// counts as a line (as it is, CR included) and the unfinished event's data is returned.
fn reference_sse(input: &[u8]) -> (Vec<Vec<u8>>, Option<Vec<u8>>) {
    let mut events = Vec::new();
    let mut data: Option<Vec<u8>> = None;
    let mut lines: Vec<&[u8]> = input.split(|&b| b == b'\n').collect();
    let unfinished = lines.pop().unwrap_or_default();
    let mut line_done = |line: &[u8], data: &mut Option<Vec<u8>>| {
        if line.is_empty() {
            events.extend(data.take());
        } else if let Some(value) = line.strip_prefix(b"data:") {
            let value = value.strip_prefix(b" ").unwrap_or(value);
            match data {
                Some(d) => {
                    d.push(b'\n');
                    d.extend_from_slice(value);
                }
                None => *data = Some(value.to_vec()),
            }
        }
    };
    for line in lines {
        line_done(line.strip_suffix(b"\r").unwrap_or(line), &mut data);
    }
    if !unfinished.is_empty() {
        line_done(unfinished, &mut data);
    }
    (events, data)
}

/// No environment variable is set, but the names asked for are.
struct Env;

impl EnvLookup for Env {
    fn var(&self, name: &str) -> Option<String> {
        name.len().is_multiple_of(2).then(|| format!("v-{name}"))
    }
}

/// The config loader (YAML, `${VAR}` interpolation, typed deserialisation, validation): any text
/// is a config or an error, never a panic; a valid config's effective YAML (`config show`) loads
/// back to the same config.
pub fn config_yaml(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(loaded) = Config::from_yaml_str_validated(text, &Env) else {
        return;
    };
    let shown = show_effective(&loaded.config);
    if shown.contains('$') {
        // A literal `${...}` (written `$${...}`) would be interpolated on the way back.
        return;
    }
    let again = Config::from_yaml_str(&shown, &Env)
        .unwrap_or_else(|e| panic!("the effective config does not load: {e}\n{shown}"));
    assert_eq!(
        show_effective(&again),
        shown,
        "the effective config is a fixed point"
    );
}
