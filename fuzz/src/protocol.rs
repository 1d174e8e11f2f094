//! Fuzz-target bodies over `continuum-protocol`'s decoders: ZMTP, the MessagePack load-sample
//! reader (also against `rmpv`), kv-events, the kv-listener's SSE parser (against a reference),
//! the event-bus NDJSON framing and hello validation, the Anthropic Messages and Responses
//! converters (requests and streams, from structured input), the borrowed JSON tree (against
//! `serde_json`), and discovery (etcd keys and values, file-store names, the reducer, and the
//! Kubernetes DynamoWorkerMetadata source).
//!
//! Each `pub fn` is one target's whole body: `fuzz/fuzz_targets/<name>.rs` calls it, and the
//! corpus replay (`protocol/tests/it/fuzz_corpus.rs`, which includes this file by path) calls it
//! with every committed corpus file. A finding is a panic.

use std::collections::BTreeSet;

use continuum_protocol::discovery::file_store::{
    BUCKETS, FileVerdict, decode_file_name, encode_file_name, file_verdict,
};
use continuum_protocol::discovery::keys::{
    EVENT_CHANNELS_BUCKET, INSTANCES_BUCKET, MDC_BUCKET, classify,
};
use continuum_protocol::discovery::records::parse_record;
use continuum_protocol::discovery::{
    DiscoveryReducer, SourceEvent, decode_segment, encode_segment,
};
use continuum_protocol::event_bus::hello::Grant;
use continuum_protocol::event_bus::message::{ClientId, Message, Role};
use continuum_protocol::event_bus::ndjson::LineDecoder;
use continuum_protocol::event_bus::sse::{
    MalformedReason, Reset, SseItem, SseParser, decode_kv_events,
};
use continuum_protocol::event_bus::{Coverage, Refusal};
use continuum_protocol::event_plane::encode::{encode_active_load, encode_envelope};
use continuum_protocol::event_plane::msgpack::{Container, MsgpackError, Reader};
use continuum_protocol::event_plane::{
    StreamExpectation, decode_active_load, decode_delivery, decode_envelope, decode_frames,
};
use continuum_protocol::ids::{Namespace, PublisherId};
use continuum_protocol::ingress::{SseEvent, anthropic, responses};
use continuum_protocol::kube::metadata::{MetadataConfig, MetadataState};
use continuum_protocol::kube::objects::{DynamoWorkerMetadata, EndpointSlice};
use continuum_protocol::kv::{KvEventsError, decode_router_events, encode_router_events};
use continuum_protocol::time::UnixMillis;
use continuum_protocol::zmtp::publisher::READY_PUB;
use continuum_protocol::zmtp::{Delivery, GREETING, ZmtpLimits, ZmtpSub};
use serde_json::{Value, json};

use super::common::{Source, json as any_json, maybe, number, object, pieces, text};

/// The ZMTP SUB side: fed in pieces it agrees with itself fed whole (deliveries, error, bytes to
/// send); every delivery goes through the event-plane decoders. The first byte picks the limits,
/// the topic and whether a real PUB's greeting and READY come first.
pub fn zmtp(data: &[u8]) {
    let mut src = Source::new(data);
    let mode = src.byte();
    let seed = src.byte();
    let limits = if mode & 1 == 0 {
        ZmtpLimits::KV_METRICS
    } else {
        ZmtpLimits {
            max_frame_bytes: 64,
            max_message_frames: 3,
            max_message_bytes: 100,
            max_skip_bytes: 300,
            max_command_bytes: 64,
        }
    };
    let topic: &[u8] = [&b"kv_metrics"[..], b"kv-events", b""][usize::from(mode >> 1) % 3];
    let mut input = Vec::new();
    if mode & 0x80 == 0 {
        input.extend_from_slice(&GREETING);
        input.extend_from_slice(&READY_PUB);
    }
    input.extend_from_slice(src.rest());
    let whole = zmtp_run(topic, limits, &[&input]);
    let pieced = zmtp_run(topic, limits, &pieces(&input, seed));
    assert_eq!(whole, pieced, "the stream read whole and in pieces");
}

/// Deliveries (as text), the error, and the bytes queued for the peer.
fn zmtp_run(topic: &[u8], limits: ZmtpLimits, parts: &[&[u8]]) -> (Vec<String>, String, Vec<u8>) {
    let mut sub = ZmtpSub::new(topic, limits).expect("a short topic");
    let mut deliveries = Vec::new();
    let mut error = String::new();
    let mut out = Vec::new();
    for part in parts {
        let fed = sub.feed(part, |delivery| {
            if let Delivery::Message(message) = &delivery {
                assert!(message.frame_count() <= limits.max_message_frames);
                assert!(message.byte_len() <= limits.max_message_bytes);
            }
            let publisher = PublisherId(7);
            for expect in [
                StreamExpectation::kv_metrics(publisher),
                StreamExpectation::kv_events(publisher),
            ] {
                if let Ok(envelope) = decode_delivery(&delivery, expect) {
                    let _ = decode_active_load(envelope.payload);
                    let _ = decode_router_events(envelope.payload);
                }
            }
            deliveries.push(format!("{delivery:?}"));
        });
        assert!(sub.buffer_bytes() <= limits.max_message_bytes.max(512) + 4096);
        if let Err(e) = fed {
            error = e.to_string();
            break;
        }
    }
    // Our greeting is queued before any input; what the input made us answer follows it.
    sub.take_outgoing(&mut out);
    (deliveries, error, out)
}

/// The load-sample reader: an envelope, an ActiveLoad, and four frames, from any bytes; what
/// decodes encodes back to bytes that decode to the same.
pub fn load_sample(data: &[u8]) {
    if let Ok(load) = decode_active_load(data) {
        assert_eq!(
            decode_active_load(&encode_active_load(&load)).ok(),
            Some(load)
        );
    }
    if let Ok(envelope) = decode_envelope(data) {
        assert_eq!(
            decode_envelope(&encode_envelope(&envelope)).ok(),
            Some(envelope)
        );
        let _ = decode_active_load(envelope.payload);
    }
    // Four frames: the first three bytes give the first three frames' lengths.
    let mut src = Source::new(data);
    let lengths = [src.below(12), src.below(12), src.below(12)];
    let mut rest = src.rest();
    let mut frames = [&[][..]; 4];
    for (frame, n) in frames.iter_mut().zip(lengths) {
        let (head, tail) = rest.split_at(n.min(rest.len()));
        *frame = head;
        rest = tail;
    }
    frames[3] = rest;
    for expect in [
        StreamExpectation::kv_metrics(PublisherId(7)),
        StreamExpectation::kv_events(PublisherId(7)),
    ] {
        if let Ok(envelope) = decode_frames(frames, expect) {
            assert_eq!(envelope.topic, expect.topic);
            assert!(envelope.payload.len() <= expect.max_payload);
            let _ = decode_active_load(envelope.payload);
        }
    }
}

/// Differential: the msgpack [`Reader`]'s primitives against `rmpv`'s reading of the same bytes
/// (`skip` consumes exactly one value, integers, strings, binaries and container headers agree).
pub fn msgpack_vs_rmpv(data: &[u8]) {
    let mut slice = data;
    let reference = rmpv::decode::read_value_with_max_depth(&mut slice, 1024);
    let used = data.len() - slice.len();
    let reference = reference.ok();

    let mut reader = Reader::new(data);
    match reader.skip() {
        Ok(()) => {
            assert!(reference.is_some(), "skip passed what rmpv refuses");
            assert_eq!(reader.position(), used, "skip consumed one value");
        }
        Err(MsgpackError::TooDeep) => {}
        // The one marker msgpack leaves unused: refused here, read as nil by rmpv.
        Err(MsgpackError::UnexpectedType { marker: 0xc1, .. }) => {}
        Err(e) => assert!(reference.is_none(), "skip refused ({e}) what rmpv reads"),
    }

    let mut reader = Reader::new(data);
    match (reader.uint(), &reference) {
        (Ok(n), Some(value)) => {
            assert_eq!(value.as_u64(), Some(n));
            assert_eq!(reader.position(), used);
        }
        (Ok(n), None) => panic!("uint read {n} where rmpv fails"),
        (Err(MsgpackError::NegativeInteger), Some(value)) => {
            assert!(value.as_i64().is_some_and(|n| n < 0));
        }
        (Err(MsgpackError::UnexpectedType { .. }), Some(value)) => {
            assert!(
                !value.is_u64() && !value.is_i64(),
                "uint refused the integer {value}"
            )
        }
        (Err(e), Some(value)) => panic!("uint failed ({e}) where rmpv read {value}"),
        (Err(_), None) => {}
    }

    let mut reader = Reader::new(data);
    match (reader.str_bytes(), &reference) {
        (Ok(bytes), Some(rmpv::Value::String(s))) => {
            assert_eq!(bytes, s.as_bytes());
            assert_eq!(reader.position(), used);
        }
        (Ok(_), _) => panic!("str read what rmpv does not read as a string"),
        (Err(MsgpackError::UnexpectedType { .. }), Some(value)) => assert!(!value.is_str()),
        (Err(e), Some(rmpv::Value::String(_))) => panic!("str failed ({e}) on a string"),
        (Err(_), _) => {}
    }

    let mut reader = Reader::new(data);
    match (reader.bin(), &reference) {
        (Ok(bytes), Some(rmpv::Value::Binary(b))) => {
            assert_eq!(bytes, &b[..]);
            assert_eq!(reader.position(), used);
        }
        (Ok(_), _) => panic!("bin read what rmpv does not read as a binary"),
        (Err(e), Some(rmpv::Value::Binary(_))) => panic!("bin failed ({e}) on a binary"),
        (Err(_), _) => {}
    }

    let mut reader = Reader::new(data);
    match (reader.container(), &reference) {
        (Ok(Container::Map(n)), Some(rmpv::Value::Map(m))) => assert_eq!(n, m.len()),
        (Ok(Container::Array(n)), Some(rmpv::Value::Array(a))) => assert_eq!(n, a.len()),
        (Ok(c), Some(value)) => panic!("container read {c:?} where rmpv read {value}"),
        (Err(e), Some(rmpv::Value::Map(_) | rmpv::Value::Array(_))) => {
            panic!("container failed ({e}) on a container")
        }
        _ => {}
    }
}

/// kv-events payloads (msgpack, as the ZMQ publishers send them): decoded batches stay within the
/// bounds and survive our encoding and the event bus's SSE framing unchanged.
pub fn kv_events(data: &[u8]) {
    let Ok(events) = decode_router_events(data) else {
        return;
    };
    let encoded = encode_router_events(&events);
    assert_eq!(decode_router_events(&encoded).ok().as_ref(), Some(&events));
    let mut parser = SseParser::default();
    parser.push(&continuum_protocol::event_bus::sse::encode_kv_events(
        42, &events,
    ));
    match parser.next_item() {
        Some(SseItem::KvEvents { id, events: again }) => {
            assert_eq!(id, Some(42));
            assert_eq!(again, events);
        }
        // A batch whose JSON form is over the SSE event bound.
        Some(SseItem::Oversized) => {}
        other => panic!("the SSE framing of a decoded batch read back as {other:?}"),
    }
}

/// Differential: the kv-listener's SSE parser fed in pieces against [`reference_event_stream`]
/// over the whole stream, with a bound no event reaches; then with a small bound, that it stays
/// within it and keeps parsing.
pub fn kv_listener_sse(data: &[u8]) {
    let mut src = Source::new(data);
    let seed = src.byte();
    let small = usize::from(src.byte()) + 1;
    let input = src.rest();
    let mut parser = SseParser::new(input.len() + 2);
    let mut items = Vec::new();
    for piece in pieces(input, seed) {
        parser.push(piece);
        items.extend(std::iter::from_fn(|| parser.next_item()));
    }
    assert_eq!(items, reference_event_stream(input));
    let mut bounded = SseParser::new(small);
    for piece in pieces(input, seed) {
        bounded.push(piece);
        assert!(bounded.buffered() <= 2 * small + 1);
        while bounded.next_item().is_some() {}
    }
}

/// The event stream as the kv-listener reads it, written plainly: lines end at CRLF, LF or CR;
/// `field: value` (one optional space), `:` comments; a blank line dispatches an event that had
/// any field; `id` must be decimal digits (else the event is `BadId`); `kv_events` and `reset`
/// data decode, other types are `UnknownEvent`.
fn reference_event_stream(input: &[u8]) -> Vec<SseItem> {
    let mut lines = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i < input.len() {
        match input[i] {
            b'\n' => {
                lines.push(&input[start..i]);
                start = i + 1;
            }
            b'\r' => {
                lines.push(&input[start..i]);
                if input.get(i + 1) == Some(&b'\n') {
                    i += 1;
                }
                start = i + 1;
            }
            _ => {}
        }
        i += 1;
    }
    let mut items = Vec::new();
    let (mut id, mut event, mut data, mut bad_id) = (None, None::<Vec<u8>>, None::<Vec<u8>>, false);
    for line in lines {
        if line.is_empty() {
            let (id, event, data, bad) = (id.take(), event.take(), data.take(), bad_id);
            bad_id = false;
            if id.is_none() && event.is_none() && data.is_none() && !bad {
                continue;
            }
            let data = data.unwrap_or_default();
            items.push(if bad {
                SseItem::Malformed(MalformedReason::BadId)
            } else {
                match event.as_deref() {
                    Some(b"kv_events") => match decode_kv_events(&data) {
                        Ok(events) => SseItem::KvEvents { id, events },
                        Err(KvEventsError::OverCapacity) => {
                            SseItem::Malformed(MalformedReason::OverCapacity)
                        }
                        Err(_) => SseItem::Malformed(MalformedReason::BadData),
                    },
                    Some(b"reset") => match serde_json::from_slice::<Reset>(&data) {
                        Ok(reset) => SseItem::Reset(reset),
                        Err(_) => SseItem::Malformed(MalformedReason::BadData),
                    },
                    _ => SseItem::Malformed(MalformedReason::UnknownEvent),
                }
            });
            continue;
        }
        if line[0] == b':' {
            continue;
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(c) => (
                &line[..c],
                line[c + 1..].strip_prefix(b" ").unwrap_or(&line[c + 1..]),
            ),
            None => (line, &b""[..]),
        };
        match field {
            b"data" => match &mut data {
                Some(d) => {
                    d.push(b'\n');
                    d.extend_from_slice(value);
                }
                None => data = Some(value.to_vec()),
            },
            b"event" => event = Some(value.to_vec()),
            b"id" => {
                let digits = !value.is_empty() && value.iter().all(u8::is_ascii_digit);
                match std::str::from_utf8(value)
                    .ok()
                    .and_then(|s| s.parse::<u64>().ok())
                {
                    Some(n) if digits => id = Some(n),
                    _ => bad_id = true,
                }
            }
            _ => {}
        }
    }
    items
}

/// The event bus's control channel: NDJSON framing fed in pieces agrees with itself fed whole;
/// every line is decoded, a decoded message re-encodes to itself, and a hello is validated against
/// a broker's and a kv_listener's grant with what those grants allow checked.
pub fn event_bus_ndjson_hello(data: &[u8]) {
    let mut src = Source::new(data);
    let seed = src.byte();
    let max = usize::from(src.byte()) * 16 + 2;
    let input = src.rest();
    let lines = |parts: &[&[u8]]| {
        let mut decoder = LineDecoder::new(max);
        let mut lines = Vec::new();
        let mut failed = false;
        for part in parts {
            if decoder.decode_all(part, |line| lines.push(line)).is_err() {
                failed = true;
                break;
            }
            assert!(decoder.buffered() < max);
        }
        (lines, failed)
    };
    let whole = lines(&[input]);
    assert_eq!(
        whole,
        lines(&pieces(input, seed)),
        "framing whole and in pieces"
    );
    let broker = Grant {
        id: ClientId::new("broker-a"),
        role: Role::Broker,
        namespaces: BTreeSet::from([Namespace::new("dynamo"), Namespace::new("prod")]),
        backends: BTreeSet::new(),
    };
    let listener = Grant {
        id: ClientId::new("listener-a"),
        role: Role::KvListener,
        namespaces: BTreeSet::new(),
        backends: BTreeSet::from(["vllm-a".to_owned(), "sglang-b".to_owned()]),
    };
    for line in whole.0 {
        assert!(line.len() < max && !line.is_empty() && !line.contains(&b'\n'));
        let Ok(message) = Message::decode(&line) else {
            continue;
        };
        let encoded = message.encode();
        assert_eq!(
            Message::decode(&encoded[..encoded.len() - 1]).as_ref(),
            Ok(&message)
        );
        let Message::Hello(hello) = message else {
            continue;
        };
        for grant in [&broker, &listener] {
            for version in [1, 2] {
                let verdict: Result<_, Refusal> = hello.validate(grant, version);
                let Ok(accepted) = verdict else {
                    continue;
                };
                assert_eq!(accepted.role, grant.role);
                assert_eq!(accepted.client_id, grant.id);
                assert!(hello.versions.contains(&accepted.version));
                match accepted.coverage {
                    Coverage::Namespaces(set) => {
                        assert!(!set.is_empty() && set.is_subset(&grant.namespaces))
                    }
                    Coverage::Backends(set) => {
                        assert!(!set.is_empty() && set.is_subset(&grant.backends))
                    }
                }
            }
        }
    }
}

/// Words the ingress generators draw keys and strings from.
const INGRESS_WORDS: &[&str] = &[
    "user",
    "assistant",
    "system",
    "developer",
    "tool",
    "text",
    "image",
    "tool_use",
    "tool_result",
    "thinking",
    "redacted_thinking",
    "input_text",
    "input_image",
    "output_text",
    "function_call",
    "function_call_output",
    "message",
    "reasoning",
    "refusal",
    "auto",
    "any",
    "none",
    "required",
    "function",
    "url",
    "base64",
    "json_schema",
    "json_object",
    "content",
    "role",
    "type",
    "name",
    "id",
    "call_id",
    "arguments",
    "input",
    "model",
    "",
    "[DONE]",
];

/// The Anthropic Messages ingress: a request (structured or raw bytes) converts or is refused;
/// a converted one's chat stream (structured chunks) converts to Anthropic events that end once.
pub fn anthropic(data: &[u8]) {
    let mut src = Source::new(data);
    let limits = anthropic_limits(small_limits(&mut src));
    let body = if src.below(8) == 0 {
        src.bytes(4096).to_vec()
    } else {
        serde_json::to_vec(&anthropic_request(&mut src)).expect("a Value serialises")
    };
    let Ok(request) = anthropic::messages_to_chat(&body, &limits) else {
        return;
    };
    assert!(
        request.body_json().is_object(),
        "the chat body is a JSON object"
    );
    if src.bool() {
        let chat = chat_response_bytes(&mut src);
        let _ = anthropic::chat_response_to_message(&chat, &request, 7, &limits);
        return;
    }
    let mut stream = anthropic::AnthropicStream::new(&request, 7, limits);
    drive_stream(&mut src, &mut stream);
}

/// The Responses ingress, as [`anthropic`].
pub fn responses(data: &[u8]) {
    let mut src = Source::new(data);
    let limits = responses_limits(small_limits(&mut src));
    let body = if src.below(8) == 0 {
        src.bytes(4096).to_vec()
    } else {
        serde_json::to_vec(&responses_request(&mut src)).expect("a Value serialises")
    };
    let _ = responses::requested_model(&body);
    let Ok(request) = responses::responses_to_chat(&body, &limits) else {
        return;
    };
    assert!(
        request.body_json().is_object(),
        "the chat body is a JSON object"
    );
    if src.bool() {
        let chat = chat_response_bytes(&mut src);
        let _ = responses::chat_response_to_response(&chat, &request, 7, 9, &limits);
        return;
    }
    let mut stream = responses::ResponsesStream::new(&request, 7, 1_700_000_000, limits);
    drive_stream(&mut src, &mut stream);
}

/// Small bounds (reached by the generated input) a quarter of the time, else large ones.
fn small_limits(src: &mut Source<'_>) -> bool {
    src.below(4) == 0
}

fn anthropic_limits(small: bool) -> anthropic::Limits {
    anthropic::Limits {
        max_body_bytes: if small { 256 } else { 1 << 20 },
        max_chunk_bytes: if small { 128 } else { 1 << 20 },
        max_tool_arg_bytes: if small { 16 } else { 1 << 20 },
        max_blocks: if small { 2 } else { 64 },
    }
}

fn responses_limits(small: bool) -> responses::Limits {
    responses::Limits {
        max_body_bytes: if small { 256 } else { 1 << 20 },
        max_chunk_bytes: if small { 128 } else { 1 << 20 },
        max_output_bytes: if small { 16 } else { 1 << 20 },
        max_items: if small { 2 } else { 64 },
    }
}

/// Feeds chat chunks until the input runs out, then ends the stream: every event is an SSE event
/// with a JSON object as data, nothing follows the end, and the stream is done after `finish`.
fn drive_stream(src: &mut Source<'_>, stream: &mut dyn Converter) {
    let check = |events: &[SseEvent]| {
        for event in events {
            let bytes = event.to_bytes();
            assert!(bytes.starts_with(b"event: ") && bytes.ends_with(b"\n\n"));
            assert!(event.data.is_object());
        }
    };
    for _ in 0..32 {
        if src.is_empty() {
            break;
        }
        let chunk = match src.below(16) {
            0 => src.bytes(64).to_vec(),
            1 => b"[DONE]".to_vec(),
            2 => serde_json::to_vec(&json!({"error": {"message": text(src, INGRESS_WORDS)}}))
                .expect("a Value serialises"),
            _ => serde_json::to_vec(&chat_chunk(src)).expect("a Value serialises"),
        };
        let done_before = stream.is_done();
        let events = stream.push(&chunk);
        if done_before {
            assert!(events.is_empty(), "nothing follows the end");
        }
        check(&events);
    }
    check(&stream.finish());
    assert!(stream.is_done(), "finish ends the stream");
    assert!(stream.finish().is_empty() && stream.push(b"[DONE]").is_empty());
}

/// The two stream converters behind one interface.
trait Converter {
    fn push(&mut self, data: &[u8]) -> Vec<SseEvent>;
    fn finish(&mut self) -> Vec<SseEvent>;
    fn is_done(&self) -> bool;
}

impl Converter for anthropic::AnthropicStream {
    fn push(&mut self, data: &[u8]) -> Vec<SseEvent> {
        anthropic::AnthropicStream::push(self, data)
    }
    fn finish(&mut self) -> Vec<SseEvent> {
        anthropic::AnthropicStream::finish(self)
    }
    fn is_done(&self) -> bool {
        anthropic::AnthropicStream::is_done(self)
    }
}

impl Converter for responses::ResponsesStream {
    fn push(&mut self, data: &[u8]) -> Vec<SseEvent> {
        responses::ResponsesStream::push(self, data)
    }
    fn finish(&mut self) -> Vec<SseEvent> {
        responses::ResponsesStream::finish(self)
    }
    fn is_done(&self) -> bool {
        responses::ResponsesStream::is_done(self)
    }
}

/// One upstream chat-completions chunk, mostly well formed.
fn chat_chunk(src: &mut Source<'_>) -> Value {
    let w = INGRESS_WORDS;
    let delta = object(
        vec![
            ("role", maybe(src, w, |s| json!(text(s, w)))),
            ("content", maybe(src, w, |s| json!(text(s, w)))),
            ("reasoning_content", maybe(src, w, |s| json!(text(s, w)))),
            (
                "tool_calls",
                maybe(src, w, |s| {
                    Value::Array(
                        (0..s.below(3))
                            .map(|_| {
                                let f = object(
                                    vec![
                                        ("name", maybe(s, w, |s| json!(text(s, w)))),
                                        ("arguments", maybe(s, w, |s| json!(text(s, w)))),
                                    ],
                                    s,
                                    w,
                                );
                                object(
                                    vec![
                                        ("index", maybe(s, w, |s| json!(s.below(4)))),
                                        ("id", maybe(s, w, |s| json!(text(s, w)))),
                                        ("type", Some(json!("function"))),
                                        ("function", Some(f)),
                                    ],
                                    s,
                                    w,
                                )
                            })
                            .collect(),
                    )
                }),
            ),
        ],
        src,
        w,
    );
    let finish = ["stop", "length", "tool_calls", "content_filter", "error"];
    let choice = object(
        vec![
            ("index", Some(json!(0))),
            ("delta", Some(delta)),
            ("finish_reason", maybe(src, w, |s| json!(s.pick(&finish)))),
        ],
        src,
        w,
    );
    object(
        vec![
            ("id", Some(json!("chatcmpl-1"))),
            ("object", Some(json!("chat.completion.chunk"))),
            ("choices", maybe(src, w, |_| json!([choice]))),
            ("usage", maybe(src, w, usage)),
        ],
        src,
        w,
    )
}

fn usage(src: &mut Source<'_>) -> Value {
    json!({
        "prompt_tokens": Value::Number(number(src)),
        "completion_tokens": Value::Number(number(src)),
        "prompt_tokens_details": {"cached_tokens": Value::Number(number(src))},
    })
}

/// A buffered chat-completions response body: raw bytes sometimes, else [`chat_response`].
fn chat_response_bytes(src: &mut Source<'_>) -> Vec<u8> {
    if src.below(8) == 0 {
        return src.bytes(256).to_vec();
    }
    serde_json::to_vec(&chat_response(src)).expect("a Value serialises")
}

/// A buffered chat-completions response, mostly well formed.
fn chat_response(src: &mut Source<'_>) -> Value {
    let w = INGRESS_WORDS;
    let message = object(
        vec![
            ("role", Some(json!("assistant"))),
            ("content", maybe(src, w, |s| json!(text(s, w)))),
            ("reasoning_content", maybe(src, w, |s| json!(text(s, w)))),
            (
                "tool_calls",
                maybe(src, w, |s| {
                    json!([{"id": text(s, w), "type": "function",
                        "function": {"name": text(s, w), "arguments": text(s, w)}}])
                }),
            ),
        ],
        src,
        w,
    );
    let finish = ["stop", "length", "tool_calls", "content_filter"];
    object(
        vec![
            ("id", Some(json!("chatcmpl-1"))),
            (
                "choices",
                maybe(
                    src,
                    w,
                    |s| json!([{"index": 0, "message": message, "finish_reason": s.pick(&finish)}]),
                ),
            ),
            ("usage", maybe(src, w, usage)),
        ],
        src,
        w,
    )
}

/// An Anthropic Messages request, mostly well formed.
fn anthropic_request(src: &mut Source<'_>) -> Value {
    let w = INGRESS_WORDS;
    let block = |s: &mut Source<'_>| match s.below(6) {
        0 => json!({"type": "text", "text": text(s, w)}),
        1 => json!({"type": "image", "source": {"type": s.pick(&["base64", "url"]),
            "media_type": "image/png", "data": text(s, w), "url": text(s, w)}}),
        2 => json!({"type": "tool_use", "id": text(s, w), "name": text(s, w),
            "input": any_json(s, 2, w)}),
        3 => json!({"type": "tool_result", "tool_use_id": text(s, w),
            "content": if s.bool() { json!(text(s, w)) } else { json!([{"type": "text", "text": text(s, w)}]) },
            "is_error": s.bool()}),
        4 => json!({"type": s.pick(&["thinking", "redacted_thinking"]), "thinking": text(s, w),
            "signature": "x", "data": "y"}),
        _ => any_json(s, 2, w),
    };
    let content = |s: &mut Source<'_>| {
        if s.bool() {
            json!(text(s, w))
        } else {
            Value::Array((0..s.below(4)).map(|_| block(s)).collect())
        }
    };
    let messages = |s: &mut Source<'_>| {
        Value::Array(
            (0..s.below(5))
                .map(|_| {
                    let fields = vec![
                        (
                            "role",
                            maybe(s, w, |s| json!(s.pick(&["user", "assistant"]))),
                        ),
                        ("content", maybe(s, w, content)),
                    ];
                    object(fields, s, w)
                })
                .collect(),
        )
    };
    let tools = |s: &mut Source<'_>| {
        Value::Array(
            (0..s.below(3))
                .map(|_| {
                    json!({"name": text(s, w), "description": text(s, w),
                        "input_schema": {"type": "object", "properties": any_json(s, 2, w)}})
                })
                .collect(),
        )
    };
    let fields = vec![
        ("model", maybe(src, w, |s| json!(text(s, w)))),
        ("max_tokens", maybe(src, w, |s| Value::Number(number(s)))),
        ("messages", maybe(src, w, messages)),
        ("system", maybe(src, w, content)),
        ("tools", maybe(src, w, tools)),
        (
            "tool_choice",
            maybe(src, w, |s| {
                json!({"type": s.pick(&["auto", "any", "tool", "none"]), "name": text(s, w),
                    "disable_parallel_tool_use": s.bool()})
            }),
        ),
        (
            "stop_sequences",
            maybe(src, w, |s| {
                json!((0..s.below(3)).map(|_| text(s, w)).collect::<Vec<_>>())
            }),
        ),
        ("stream", maybe(src, w, |s| json!(s.bool()))),
        ("temperature", maybe(src, w, |s| Value::Number(number(s)))),
        ("top_p", maybe(src, w, |s| Value::Number(number(s)))),
        ("top_k", maybe(src, w, |s| Value::Number(number(s)))),
        (
            "metadata",
            maybe(src, w, |s| json!({"user_id": text(s, w)})),
        ),
    ];
    object(fields, src, w)
}

/// An OpenAI Responses request, mostly well formed.
fn responses_request(src: &mut Source<'_>) -> Value {
    let w = INGRESS_WORDS;
    let part = |s: &mut Source<'_>| match s.below(4) {
        0 => json!({"type": s.pick(&["input_text", "output_text", "text"]), "text": text(s, w)}),
        1 => json!({"type": "input_image", "image_url": text(s, w), "detail": "auto"}),
        2 => json!({"type": "refusal", "refusal": text(s, w)}),
        _ => any_json(s, 2, w),
    };
    let item = |s: &mut Source<'_>| match s.below(5) {
        0 => json!({"type": "function_call", "call_id": text(s, w), "name": text(s, w),
            "arguments": text(s, w)}),
        1 => json!({"type": "function_call_output", "call_id": text(s, w), "output": text(s, w)}),
        2 => json!({"type": "reasoning", "summary": []}),
        3 => any_json(s, 2, w),
        _ => {
            let content = if s.bool() {
                json!(text(s, w))
            } else {
                Value::Array((0..s.below(3)).map(|_| part(s)).collect())
            };
            json!({"type": "message",
                "role": s.pick(&["user", "assistant", "system", "developer"]),
                "content": content})
        }
    };
    let input = |s: &mut Source<'_>| {
        if s.below(4) == 0 {
            json!(text(s, w))
        } else {
            Value::Array((0..s.below(5)).map(|_| item(s)).collect())
        }
    };
    let tools = |s: &mut Source<'_>| {
        Value::Array(
            (0..s.below(3))
                .map(|_| {
                    json!({"type": "function", "name": text(s, w), "description": text(s, w),
                        "parameters": {"type": "object"}, "strict": s.bool()})
                })
                .collect(),
        )
    };
    let fields = vec![
        ("model", maybe(src, w, |s| json!(text(s, w)))),
        ("input", maybe(src, w, input)),
        ("instructions", maybe(src, w, |s| json!(text(s, w)))),
        (
            "max_output_tokens",
            maybe(src, w, |s| Value::Number(number(s))),
        ),
        ("tools", maybe(src, w, tools)),
        (
            "tool_choice",
            maybe(src, w, |s| {
                if s.bool() {
                    json!(s.pick(&["auto", "none", "required"]))
                } else {
                    json!({"type": "function", "name": text(s, w)})
                }
            }),
        ),
        ("parallel_tool_calls", maybe(src, w, |s| json!(s.bool()))),
        ("stream", maybe(src, w, |s| json!(s.bool()))),
        ("background", maybe(src, w, |s| json!(s.bool()))),
        ("store", maybe(src, w, |s| json!(s.bool()))),
        ("previous_response_id", maybe(src, w, |s| json!(text(s, w)))),
        (
            "text",
            maybe(src, w, |s| {
                json!({"format": {"type": s.pick(&["text", "json_schema", "json_object"]),
                    "name": text(s, w), "schema": any_json(s, 2, w), "strict": s.bool()}})
            }),
        ),
        ("temperature", maybe(src, w, |s| Value::Number(number(s)))),
        ("user", maybe(src, w, |s| json!(text(s, w)))),
        ("metadata", maybe(src, w, |s| any_json(s, 1, w))),
    ];
    object(fields, src, w)
}

/// Differential: the ingress converters' borrowed JSON tree against `serde_json::Value` (accept or
/// refuse alike; the same value, the same compact text, the same member by key).
pub fn json_vs_serde_json(data: &[u8]) {
    let reference = serde_json::from_slice::<Value>(data);
    let ours = continuum_protocol::ingress::json_tree_for_fuzzing(data);
    match (&ours, &reference) {
        (Ok((value, text)), Ok(expected)) => {
            assert_eq!(value, expected);
            // With `preserve_order` (as the router and the fuzz crate build serde_json) the
            // compact text is the same; without it `Value` sorts its keys and only the values
            // compare (the protocol crate's own tests).
            if serde_json::to_string(&json!({"b": 0, "a": 0}))
                .ok()
                .as_deref()
                == Some(r#"{"b":0,"a":0}"#)
            {
                assert_eq!(text, &expected.to_string());
            }
        }
        (Err(_), Err(_)) => {}
        _ => panic!("the tree and serde_json disagree: {ours:?} vs {reference:?}"),
    }
    for key in ["model", "messages", "input", "", "a"] {
        let field = continuum_protocol::ingress::json_field_for_fuzzing(data, key);
        let Ok(whole) = &reference else {
            // A member is read without the rest being built, so a number beyond `f64` elsewhere
            // (which `Value` refuses) does not hide it; anything not JSON at all does.
            if serde_json::from_slice::<serde::de::IgnoredAny>(data).is_err() {
                assert_eq!(field, None, "the member {key:?} of what is not JSON");
            }
            continue;
        };
        let expected = whole.as_object().and_then(|o| o.get(key));
        assert_eq!(field.as_ref(), expected, "the member {key:?}");
    }
}

/// Discovery: etcd keys and values (parsed alone, then applied in sequences of puts, deletes and
/// resyncs to the reducer), and file-store names (encoding round trips, verdicts).
pub fn discovery(data: &[u8]) {
    const NAMESPACE: &str = "dynamo";
    let mut src = Source::new(data);
    let mut reducer = DiscoveryReducer::new(Namespace::new(NAMESPACE));
    let mut now = 1_700_000_000_000;
    while !src.is_empty() {
        let key = discovery_key(&mut src);
        let event = match src.below(8) {
            0 => SourceEvent::Init,
            1 => SourceEvent::InitDone,
            2 => SourceEvent::Delete { key },
            3 => {
                let value = discovery_value(&mut src);
                SourceEvent::InitApply { key, value }
            }
            _ => {
                let value = discovery_value(&mut src);
                if let Some((_, Ok(parsed))) = classify(NAMESPACE, &key) {
                    let _ = parse_record(&parsed, &value);
                }
                SourceEvent::Apply { key, value }
            }
        };
        now += src.below(5000) as u64;
        reducer.apply(event, UnixMillis(now));
        let _ = reducer.take_changes();
        let view = reducer.view();
        for worker in view.workers() {
            assert!(view.worker(worker.instance_id()).is_some());
        }
    }
    // File-store names: the segment and name encodings round trip, a name decodes to one key.
    let name = String::from_utf8_lossy(data);
    assert_eq!(
        decode_segment(&encode_segment(&name)).ok().as_deref(),
        Some(&*name)
    );
    if !name.is_empty() {
        assert_eq!(
            decode_file_name(&encode_file_name(&name)).ok().as_deref(),
            Some(&*name)
        );
    }
    if let Ok(key) = decode_file_name(&name) {
        // One key has one file name (escapes' hex digits in either case).
        let mut canonical = String::new();
        let mut chars = name.chars();
        while let Some(c) = chars.next() {
            canonical.push(c);
            if c == '%' {
                canonical.extend(chars.by_ref().take(2).map(|h| h.to_ascii_uppercase()));
            }
        }
        assert_eq!(encode_file_name(&key), canonical);
    }
    for bucket in BUCKETS {
        if let FileVerdict::Key(key) = file_verdict(NAMESPACE, bucket, &name) {
            assert!(key.starts_with(bucket));
        }
    }
}

/// A key in one of the watched buckets, mostly of the right shape.
fn discovery_key(src: &mut Source<'_>) -> String {
    let bucket = src.pick(&[
        INSTANCES_BUCKET,
        MDC_BUCKET,
        EVENT_CHANNELS_BUCKET,
        "v1/other/",
    ]);
    let namespace = src.pick(&["dynamo", "dynamo", "other", ""]);
    let words = [
        "backend",
        "prefill",
        "generate",
        "a%2Fb",
        "1",
        "ff",
        "0x1",
        "kv-events",
    ];
    let segments: Vec<String> = (0..src.below(9)).map(|_| text(src, &words)).collect();
    let id = format!("{:x}", src.below(8));
    format!("{bucket}{namespace}/{}/{id}", segments.join("/"))
}

/// A record value: mostly a generated JSON record of the shapes Dynamo writes.
fn discovery_value(src: &mut Source<'_>) -> Vec<u8> {
    let w = &[
        "Endpoint",
        "Model",
        "EventChannel",
        "backend",
        "generate",
        "dynamo",
        "tcp",
        "nats",
        "10.0.0.1:5555/x",
        "kv-events",
        "kv_metrics",
        "decode",
        "prefill",
        "endpoint",
        "component",
        "namespace",
        "instance_id",
        "transport",
        "card_json",
        "type",
        "topic",
        "scope",
        "kind",
        "name",
        "model",
        "display_name",
        "tcp://10.0.0.1:5557",
    ][..];
    let value = match src.below(6) {
        0 => return src.bytes(256).to_vec(),
        1 => any_json(src, 3, w),
        2 => json!({"type": "Endpoint", "namespace": "dynamo", "component": text(src, w),
            "endpoint": text(src, w), "instance_id": src.below(8),
            "transport": {"tcp": text(src, w)}}),
        3 => json!({"type": "Model", "namespace": "dynamo", "component": text(src, w),
            "endpoint": "generate", "instance_id": src.below(8),
            "card_json": {"display_name": text(src, w), "model_type": any_json(src, 1, w),
                "kv_cache_block_size": src.below(64), "runtime_config": any_json(src, 2, w)}}),
        _ => json!({"type": "EventChannel", "scope": {"kind": "endpoint", "endpoint":
            {"namespace": "dynamo", "component": text(src, w), "name": "generate"}},
            "topic": src.pick(&["kv-events", "kv_metrics", "x"]), "instance_id": src.below(8),
            "transport": {"zmq": {"endpoint": text(src, w)}}}),
    };
    serde_json::to_vec(&value).expect("a Value serialises")
}

/// The Kubernetes DynamoWorkerMetadata source: resources and EndpointSlices (JSON documents from
/// the input) applied, deleted and relisted; every step's events go to a reducer.
pub fn kube_metadata(data: &[u8]) {
    let namespace = Namespace::new("dynamo");
    let mut state = MetadataState::with_bounds(
        MetadataConfig {
            namespaces: vec![namespace.clone()],
        },
        8,
        64 * 1024,
    );
    let mut reducer = DiscoveryReducer::new(namespace);
    let mut src = Source::new(data);
    let mut resources = Vec::new();
    let mut slices = Vec::new();
    let mut now = 1_700_000_000_000;
    while !src.is_empty() {
        let op = src.below(6);
        let doc = src.bytes(2048);
        let step = match op {
            0 | 1 => match serde_json::from_slice::<DynamoWorkerMetadata>(doc) {
                Ok(resource) => {
                    let step = state.apply_resource(&resource);
                    resources.push(resource);
                    step
                }
                Err(_) => continue,
            },
            2 => match serde_json::from_slice::<EndpointSlice>(doc) {
                Ok(slice) => {
                    let step = state.apply_slice(&slice);
                    slices.push(slice);
                    step
                }
                Err(_) => continue,
            },
            3 => state.delete_resource(&String::from_utf8_lossy(doc)),
            4 => state.delete_slice(&String::from_utf8_lossy(doc)),
            _ => state.relist(&resources, &slices),
        };
        assert!(state.resource_count() <= 8);
        for event in step.events {
            now += 1;
            reducer.apply(event, UnixMillis(now));
        }
    }
}
