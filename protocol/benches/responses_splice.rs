//! What arming the native `/v1/responses` passthrough for mid-stream continuation (issue 31)
//! costs per relayed event: `ResponsesSplice::feed` reading an original Responses stream (every
//! event parsed once into a `serde_json::Value`), and writing a chat-completions continuation's
//! chunks as Responses events; beside them `ChatSplice::feed_frame` on the equivalent chat stream
//! (the armed chat path) for scale. One event per frame, as an upstream's writes arrive. Also the
//! splice's own size (memory per armed stream: this, plus the `response` object of
//! `response.created`, the answer text and the finished output items, each bounded).
//!
//! `cargo bench -p continuum-protocol --bench responses_splice [-- EVENTS]` (default 2,000
//! text deltas per stream). Plain timed loops (median of 21 runs), no criterion.

use std::hint::black_box;
use std::time::{Duration, Instant};

use continuum_protocol::ingress::continuation::{ChatSplice, ResponsesSplice};
use serde_json::{Value, json};

const RUNS: usize = 21;

fn event(kind: &str, seq: usize, mut data: Value) -> Vec<u8> {
    data["type"] = json!(kind);
    data["sequence_number"] = json!(seq);
    format!("event: {kind}\ndata: {data}\n\n").into_bytes()
}

/// A native Responses stream of `n` text deltas, one `Vec` per event.
fn responses_events(n: usize) -> Vec<Vec<u8>> {
    let response = json!({"id": "resp_0123456789abcdef", "object": "response",
        "created_at": 1_700_000_000, "status": "in_progress", "model": "Qwen/Qwen3-32B",
        "output": [], "tools": [], "tool_choice": "auto", "parallel_tool_calls": true});
    let item = json!({"id": "msg_0123456789abcdef", "type": "message", "role": "assistant",
                      "status": "in_progress", "content": []});
    let mut out = vec![
        event("response.created", 0, json!({"response": response})),
        event("response.in_progress", 1, json!({"response": response})),
        event(
            "response.output_item.added",
            2,
            json!({"output_index": 0, "item": item}),
        ),
        event(
            "response.content_part.added",
            3,
            json!({"item_id": "msg_0123456789abcdef", "output_index": 0, "content_index": 0,
                   "part": {"type": "output_text", "text": "", "annotations": []}}),
        ),
    ];
    for i in 0..n {
        out.push(event(
            "response.output_text.delta",
            4 + i,
            json!({"item_id": "msg_0123456789abcdef", "output_index": 0, "content_index": 0,
                   "delta": " token", "logprobs": []}),
        ));
    }
    out
}

/// The equivalent chat-completions stream of `n` content chunks.
fn chat_events(n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|_| {
            let c = json!({"id": "chatcmpl-0123456789abcdef", "object": "chat.completion.chunk",
                           "created": 1_700_000_000, "model": "Qwen/Qwen3-32B",
                           "choices": [{"index": 0, "delta": {"content": " token"},
                                        "finish_reason": null}]});
            format!("data: {c}\n\n").into_bytes()
        })
        .collect()
}

/// The proxy bench's stream (`benches/proxy_overhead.rs`, `PROXY_BENCH=mid_stream`): 64
/// Dynamo 1.6.1-shaped content chunks of ≈ 200 bytes (the first with `role`), the final chunk and
/// `[DONE]`.
fn dynamo_events() -> Vec<Vec<u8>> {
    let id = "chatcmpl-bee766b5-87ba-4cb1-994e-349ca7ec0da5";
    let chunk = |delta: &str, finish: &str| {
        format!(
            "data: {{\"id\":\"{id}\",\"choices\":[{{\"index\":0,\"delta\":{delta},\"finish_reason\":{finish},\"logprobs\":null}}],\"created\":1796450204,\"model\":\"tiny\",\"object\":\"chat.completion.chunk\"}}\n\n"
        )
        .into_bytes()
    };
    let words = [
        " sp", " mp", " router", "ed", " the", " cache", " é", " block",
    ];
    let mut out = vec![chunk(r#"{"content":" Once","role":"assistant"}"#, "null")];
    out.extend((1..64).map(|i| chunk(&format!(r#"{{"content":"{}"}}"#, words[i % 8]), "null")));
    out.push(chunk("{}", r#""length""#));
    out.push(b"data: [DONE]\n\n".to_vec());
    out
}

fn median(mut runs: Vec<Duration>) -> Duration {
    runs.sort();
    runs[runs.len() / 2]
}

#[expect(
    clippy::disallowed_methods,
    reason = "a bench times itself; the protocol code it measures reads no clock"
)]
fn per_event(name: &str, events: usize, mut run: impl FnMut() -> usize) {
    let runs: Vec<Duration> = (0..RUNS)
        .map(|_| {
            let start = Instant::now();
            black_box(run());
            start.elapsed()
        })
        .collect();
    let ns = median(runs).as_nanos() as f64 / events as f64;
    println!("{name:<58} {ns:>8.0} ns/event");
}

fn main() {
    let n = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(2_000);
    let responses = responses_events(n);
    let chat = chat_events(n);
    println!("{n} text deltas per stream, one event per frame, median of {RUNS} runs");
    per_event("ChatSplice::feed_frame (armed chat, for scale)", n, || {
        let mut splice = ChatSplice::new(1 << 20, 1 << 22);
        chat.iter()
            .map(|e| splice.feed_frame(e).0.is_empty() as usize)
            .sum()
    });
    let dynamo = dynamo_events();
    per_event(
        "ChatSplice::feed_frame, the proxy bench's 66-event stream",
        dynamo.len() * 100,
        || {
            let mut streams = 0;
            for _ in 0..100 {
                let mut splice = ChatSplice::new(1 << 20, 1 << 22);
                streams += dynamo
                    .iter()
                    .map(|e| splice.feed_frame(e).0.is_empty() as usize)
                    .sum::<usize>();
            }
            streams / 100
        },
    );
    per_event(
        "ResponsesSplice::feed, original Responses events",
        responses.len(),
        || {
            let mut splice = ResponsesSplice::new(1 << 20, 1 << 22);
            responses.iter().map(|e| splice.feed(e).out.len()).sum()
        },
    );
    per_event(
        "ResponsesSplice::feed, chat continuation → Responses",
        n,
        || {
            let mut splice = ResponsesSplice::new(1 << 20, 1 << 22);
            splice.feed(&responses[..4].concat());
            splice.start_continuation();
            chat.iter().map(|e| splice.feed(e).out.len()).sum()
        },
    );
    println!(
        "size_of::<ResponsesSplice>() = {} B (plus the kept response object, text and items)",
        std::mem::size_of::<ResponsesSplice>()
    );
}
