//! Conversion cost of the Anthropic Messages and OpenAI Responses ingresses (goal: added CPU
//! ≤ 20 µs for a 6 kB Messages request versus the same chat request).
//!
//! The chat route's own per-request body work is `proxy::body::parse` (validation, top-level
//! scan). An ingress adds, before it, the conversion (`messages_to_chat` / `responses_to_chat`,
//! which return the serialised chat body); the chat pipeline then parses that body as it parses
//! a chat request. "Added CPU" is therefore the conversion time alone; the
//! summary after criterion also prints both totals side by side. Then the per-answer costs: one
//! buffered chat completion converted back, and one streamed chat chunk through the SSE decoder,
//! the stream converter and its event encoding. Last, the added cost for the same conversations
//! grown from 1.5 kB to 96 kB. Under `cargo test --benches` (no `--bench`) a short pass only
//! checks the harness runs; `INGRESS_BENCH_ITERATIONS=n` runs only n conversions of each 6 kB
//! request and n chat parses, for callgrind's instruction counts (docs/performance.md).

#![allow(clippy::too_many_lines, reason = "test code is exempt")]

use std::hint::black_box;
use std::time::{Duration, Instant};

use bytes::Bytes;
use continuum_protocol::ingress::{anthropic, responses};
use continuum_router::front_door::ingress::SseDecoder;
use continuum_router::proxy::body;
use criterion::Criterion;
use serde_json::{Value, json};

const TARGET_BYTES: usize = 6 * 1024;

fn paragraph(turn: usize) -> String {
    format!(
        "Turn {turn}: the router reads kv-events from every worker, keeps a bounded radix index \
         of block hashes and credits prefill candidates for prefix blocks they hold. "
    )
}

fn weather_schema() -> Value {
    json!({ "type": "object", "properties": { "city": { "type": "string" } }, "required": ["city"] })
}

/// A multi-turn Messages request with a system prompt, a tool and a tool round trip, grown to
/// about `target` bytes (6 kB in the criterion runs); and the chat request it converts to (what a
/// chat client would send).
fn messages_request(target: usize) -> (Vec<u8>, Vec<u8>) {
    let mut messages = vec![
        json!({ "role": "user", "content": "Weather in Paris?" }),
        json!({ "role": "assistant", "content": [
            { "type": "text", "text": "Let me check." },
            { "type": "tool_use", "id": "toolu_1", "name": "weather", "input": { "city": "Paris" } } ] }),
        json!({ "role": "user", "content": [
            { "type": "tool_result", "tool_use_id": "toolu_1", "content": "18C, clear" } ] }),
    ];
    let mut turn = 0;
    loop {
        let req = json!({
            "model": "m", "max_tokens": 256, "system": "You are a careful assistant.",
            "tools": [{ "name": "weather", "description": "current weather", "input_schema": weather_schema() }],
            "messages": messages,
        });
        let bytes = req.to_string().into_bytes();
        if bytes.len() >= target {
            let chat = anthropic::messages_to_chat(&bytes, &anthropic::Limits::default())
                .expect("valid")
                .body;
            return (bytes, chat);
        }
        let role = if turn % 2 == 0 { "assistant" } else { "user" };
        messages.push(json!({ "role": role, "content": paragraph(turn) }));
        turn += 1;
    }
}

/// The same conversation as a Responses request (instructions, items, function call round
/// trip), about `target` bytes.
fn responses_request(target: usize) -> (Vec<u8>, Vec<u8>) {
    let mut input = vec![
        json!({ "role": "user", "content": "Weather in Paris?" }),
        json!({ "type": "function_call", "call_id": "call_1", "name": "weather",
                "arguments": "{\"city\":\"Paris\"}" }),
        json!({ "type": "function_call_output", "call_id": "call_1", "output": "18C, clear" }),
    ];
    let mut turn = 0;
    loop {
        let req = json!({
            "model": "m", "max_output_tokens": 256, "instructions": "You are a careful assistant.",
            "tools": [{ "type": "function", "name": "weather", "description": "current weather",
                        "parameters": weather_schema() }],
            "input": input,
        });
        let bytes = req.to_string().into_bytes();
        if bytes.len() >= target {
            let chat = responses::responses_to_chat(&bytes, &responses::Limits::default())
                .expect("valid")
                .body;
            return (bytes, chat);
        }
        let role = if turn % 2 == 0 { "assistant" } else { "user" };
        input.push(json!({ "role": role, "content": paragraph(turn) }));
        turn += 1;
    }
}

fn chat_response() -> Vec<u8> {
    json!({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{ "index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": "It is 18C and clear in Paris. ".repeat(8),
            "tool_calls": [{ "id": "call_2", "type": "function",
                             "function": { "name": "weather", "arguments": "{\"city\":\"Lyon\"}" } }] } }],
        "usage": { "prompt_tokens": 1500, "completion_tokens": 80, "total_tokens": 1580 },
    })
    .to_string()
    .into_bytes()
}

/// One typical streamed chat chunk (a few tokens of text) as SSE bytes.
fn chat_chunk() -> Vec<u8> {
    let chunk = json!({ "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                        "model": "m", "choices": [{ "index": 0, "delta": { "content": " clear in" },
                                                     "finish_reason": null }] });
    format!("data: {chunk}\n\n").into_bytes()
}

fn anthropic_ingress(bytes: &[u8]) -> Vec<u8> {
    anthropic::messages_to_chat(bytes, &anthropic::Limits::default())
        .expect("valid")
        .body
}

fn responses_ingress(bytes: &[u8]) -> Vec<u8> {
    responses::responses_to_chat(bytes, &responses::Limits::default())
        .expect("valid")
        .body
}

fn mean(runs: usize, mut f: impl FnMut()) -> Duration {
    for _ in 0..runs / 10 {
        f();
    }
    let start = Instant::now();
    for _ in 0..runs {
        f();
    }
    start.elapsed() / runs as u32
}

fn main() {
    let measuring = std::env::args().any(|a| a == "--bench");
    let (messages, messages_chat) = messages_request(TARGET_BYTES);
    let (responses_body, responses_chat) = responses_request(TARGET_BYTES);
    let answer = chat_response();
    let chunk = chat_chunk();
    let a_req = anthropic::messages_to_chat(&messages, &anthropic::Limits::default()).unwrap();
    let r_req =
        responses::responses_to_chat(&responses_body, &responses::Limits::default()).unwrap();
    println!(
        "messages request {} B (chat {} B), responses request {} B (chat {} B)",
        messages.len(),
        messages_chat.len(),
        responses_body.len(),
        responses_chat.len()
    );

    // `INGRESS_BENCH_ITERATIONS=n`: only n conversions of each 6 kB request and n chat parses,
    // for instruction counts under callgrind (independent of the machine's load; see
    // docs/performance.md, "Ingress conversion").
    if let Some(n) = std::env::var("INGRESS_BENCH_ITERATIONS")
        .ok()
        .and_then(|n| n.parse::<usize>().ok())
    {
        for _ in 0..n {
            black_box(anthropic_ingress(black_box(&messages)));
            black_box(responses_ingress(black_box(&responses_body)));
            black_box(body::parse(Bytes::from(messages_chat.clone())).unwrap());
        }
        return;
    }

    let mut criterion = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(if measuring { 3 } else { 1 }))
        .configure_from_args();
    criterion.bench_function("ingress/chat_parse_6k", |b| {
        b.iter(|| body::parse(Bytes::from(black_box(&messages_chat).clone())).unwrap())
    });
    criterion.bench_function("ingress/messages_convert_6k", |b| {
        b.iter(|| anthropic_ingress(black_box(&messages)))
    });
    criterion.bench_function("ingress/responses_convert_6k", |b| {
        b.iter(|| responses_ingress(black_box(&responses_body)))
    });
    criterion.bench_function("ingress/messages_buffered_answer", |b| {
        b.iter(|| {
            anthropic::chat_response_to_message(
                black_box(&answer),
                &a_req,
                1,
                &anthropic::Limits::default(),
            )
            .unwrap()
        })
    });
    criterion.bench_function("ingress/responses_buffered_answer", |b| {
        b.iter(|| {
            responses::chat_response_to_response(
                black_box(&answer),
                &r_req,
                1,
                0,
                &responses::Limits::default(),
            )
            .unwrap()
        })
    });
    // Per streamed event: a started stream, one chunk decoded, converted and encoded.
    let mut sse = SseDecoder::new(1 << 20);
    let mut a_stream = anthropic::AnthropicStream::new(&a_req, 1, anthropic::Limits::default());
    a_stream.push(&chunk[6..chunk.len() - 2]);
    criterion.bench_function("ingress/messages_stream_event", |b| {
        b.iter(|| {
            let mut out = Vec::new();
            for data in sse.push(black_box(&chunk)).unwrap() {
                for e in a_stream.push(&data) {
                    out.extend(e.to_bytes());
                }
            }
            out
        })
    });
    let mut r_stream = responses::ResponsesStream::new(
        &r_req,
        1,
        0,
        responses::Limits {
            max_output_bytes: usize::MAX,
            ..responses::Limits::default()
        },
    );
    r_stream.push(&chunk[6..chunk.len() - 2]);
    criterion.bench_function("ingress/responses_stream_event", |b| {
        b.iter(|| {
            let mut out = Vec::new();
            for data in sse.push(black_box(&chunk)).unwrap() {
                for e in r_stream.push(&data) {
                    out.extend(e.to_bytes());
                }
            }
            out
        })
    });
    criterion.final_summary();

    // The goal, side by side: the chat route's parse vs an ingress's conversion + the same parse.
    let runs = if measuring { 20_000 } else { 100 };
    let chat = mean(runs, || {
        black_box(body::parse(Bytes::from(messages_chat.clone())).unwrap());
    });
    for (name, convert, bytes) in [
        (
            "messages",
            anthropic_ingress as fn(&[u8]) -> Vec<u8>,
            &messages,
        ),
        ("responses", responses_ingress, &responses_body),
    ] {
        let added = mean(runs, || {
            black_box(convert(black_box(bytes)));
        });
        let total = mean(runs, || {
            let converted = convert(black_box(bytes));
            black_box(body::parse(Bytes::from(converted)).unwrap());
        });
        println!(
            "{name} 6 kB: chat route {chat:?}, through the ingress {total:?}, added {added:?} \
             (goal <= 20us: {})",
            if added <= Duration::from_micros(20) {
                "met"
            } else {
                "NOT met"
            }
        );
    }

    // How the added cost grows with the body: the same conversations grown to 1.5-96 kB.
    println!("body size: chat route parse | messages added | responses added");
    for target in [1536, 6 * 1024, 24 * 1024, 96 * 1024] {
        let (m, m_chat) = messages_request(target);
        let (r, _) = responses_request(target);
        let runs = (runs * TARGET_BYTES / target).max(10);
        let chat = mean(runs, || {
            black_box(body::parse(Bytes::from(m_chat.clone())).unwrap());
        });
        let m_added = mean(runs, || {
            black_box(anthropic_ingress(black_box(&m)));
        });
        let r_added = mean(runs, || {
            black_box(responses_ingress(black_box(&r)));
        });
        println!(
            "{} B / {} B: {chat:?} | {m_added:?} | {r_added:?}",
            m.len(),
            r.len()
        );
    }
}
