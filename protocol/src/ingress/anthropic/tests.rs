//! Tests of the Anthropic ingress converters: per-feature tables, golden round trips, exact SSE
//! event sequences, bounds, and property tests (arbitrary bodies and chunk sequences never panic).

use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;

fn limits() -> Limits {
    Limits::default()
}

fn convert(req: Value) -> Result<ChatRequest, IngressError> {
    messages_to_chat(req.to_string().as_bytes(), &limits())
}

fn base(extra: Value) -> Value {
    let mut v = json!({
        "model": "claude-x",
        "max_tokens": 64,
        "messages": [{ "role": "user", "content": "hi" }],
    });
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    v
}

fn body(req: Value) -> Value {
    convert(req).unwrap().body_json()
}

#[test]
fn minimal_request_converts() {
    let r = convert(base(json!({}))).unwrap();
    assert_eq!(
        r.body_json(),
        json!({
            "model": "claude-x",
            "max_tokens": 64,
            "messages": [{ "role": "user", "content": "hi" }],
        })
    );
    assert_eq!(r.model, "claude-x");
    assert!(!r.stream);
}

#[test]
fn system_string_and_blocks_become_one_leading_system_message() {
    let b = body(base(json!({ "system": "be brief" })));
    assert_eq!(
        b["messages"][0],
        json!({ "role": "system", "content": "be brief" })
    );
    let b = body(base(json!({ "system": [
        { "type": "text", "text": "a", "cache_control": { "type": "ephemeral" } },
        { "type": "text", "text": "b" },
    ] })));
    assert_eq!(
        b["messages"][0],
        json!({ "role": "system", "content": "a\nb" })
    );
    assert_eq!(b["messages"].as_array().unwrap().len(), 2);
    let e = convert(base(json!({ "system": [{ "type": "image" }] }))).unwrap_err();
    assert_eq!(e.status, 400);
}

#[test]
fn user_text_and_images_become_parts() {
    let b = body(base(json!({ "messages": [{ "role": "user", "content": [
        { "type": "text", "text": "what is this" },
        { "type": "image", "source": { "type": "base64", "media_type": "image/png", "data": "QUJD" } },
        { "type": "image", "source": { "type": "url", "url": "https://x/y.jpg" } },
    ] }] })));
    assert_eq!(
        b["messages"],
        json!([{ "role": "user", "content": [
            { "type": "text", "text": "what is this" },
            { "type": "image_url", "image_url": { "url": "data:image/png;base64,QUJD" } },
            { "type": "image_url", "image_url": { "url": "https://x/y.jpg" } },
        ] }])
    );
    let e = convert(base(json!({ "messages": [{ "role": "user", "content": [
        { "type": "image", "source": { "type": "file", "file_id": "f" } },
    ] }] })))
    .unwrap_err();
    assert_eq!((e.status, e.error_type()), (400, "invalid_request_error"));
}

#[test]
fn tool_use_and_tool_result_round_trip_into_chat_turns() {
    let b = body(base(json!({ "messages": [
        { "role": "user", "content": "weather in Paris and Rome?" },
        { "role": "assistant", "content": [
            { "type": "thinking", "thinking": "hmm", "signature": "s" },
            { "type": "text", "text": "Checking." },
            { "type": "tool_use", "id": "toolu_1", "name": "weather", "input": { "city": "Paris" } },
            { "type": "tool_use", "id": "toolu_2", "name": "weather", "input": { "city": "Rome" } },
        ] },
        { "role": "user", "content": [
            { "type": "tool_result", "tool_use_id": "toolu_1", "content": "18C" },
            { "type": "tool_result", "tool_use_id": "toolu_2", "is_error": true,
              "content": [{ "type": "text", "text": "timeout" }] },
            { "type": "text", "text": "thanks" },
        ] },
    ] })));
    assert_eq!(
        b["messages"],
        json!([
            { "role": "user", "content": "weather in Paris and Rome?" },
            { "role": "assistant", "content": "Checking.", "tool_calls": [
                { "id": "toolu_1", "type": "function",
                  "function": { "name": "weather", "arguments": "{\"city\":\"Paris\"}" } },
                { "id": "toolu_2", "type": "function",
                  "function": { "name": "weather", "arguments": "{\"city\":\"Rome\"}" } },
            ] },
            { "role": "tool", "tool_call_id": "toolu_1", "content": "18C" },
            { "role": "tool", "tool_call_id": "toolu_2", "content": "[tool error] timeout" },
            { "role": "user", "content": [{ "type": "text", "text": "thanks" }] },
        ])
    );
}

#[test]
fn assistant_with_only_tool_use_has_null_content() {
    let b = body(base(json!({ "messages": [
        { "role": "user", "content": "go" },
        { "role": "assistant", "content": [
            { "type": "tool_use", "id": "t", "name": "f", "input": {} } ] },
        { "role": "user", "content": [{ "type": "tool_result", "tool_use_id": "t" }] },
    ] })));
    assert_eq!(b["messages"][1]["content"], Value::Null);
    assert_eq!(
        b["messages"][2],
        json!({ "role": "tool", "tool_call_id": "t", "content": "" })
    );
    assert_eq!(
        b["messages"].as_array().unwrap().len(),
        3,
        "no empty user turn"
    );
}

#[test]
fn tools_and_tool_choice_map() {
    let tools = json!([{ "name": "weather", "description": "get weather", "strict": true,
        "input_schema": { "type": "object", "properties": { "city": { "type": "string" } } } },
        { "type": "custom", "name": "noop", "input_schema": { "type": "object" } }]);
    let b = body(base(
        json!({ "tools": tools, "tool_choice": { "type": "auto" } }),
    ));
    assert_eq!(
        b["tools"],
        json!([
            { "type": "function", "function": { "name": "weather", "description": "get weather",
              "parameters": { "type": "object", "properties": { "city": { "type": "string" } } } } },
            { "type": "function", "function": { "name": "noop",
              "parameters": { "type": "object" } } },
        ])
    );
    let cases = [
        (json!({ "type": "auto" }), json!("auto"), None),
        (json!({ "type": "any" }), json!("required"), None),
        (json!({ "type": "none" }), json!("none"), None),
        (
            json!({ "type": "tool", "name": "weather", "disable_parallel_tool_use": true }),
            json!({ "type": "function", "function": { "name": "weather" } }),
            Some(json!(false)),
        ),
    ];
    for (choice, want, parallel) in cases {
        let b = body(base(json!({ "tools": tools, "tool_choice": choice })));
        assert_eq!(b["tool_choice"], want, "{choice}");
        assert_eq!(b.get("parallel_tool_calls").cloned(), parallel, "{choice}");
    }
    for bad in [
        json!({ "type": "sometimes" }),
        json!({ "type": "tool" }),
        json!("auto"),
    ] {
        assert_eq!(
            convert(base(json!({ "tool_choice": bad })))
                .unwrap_err()
                .status,
            400
        );
    }
    let server = json!([{ "type": "web_search_20250305", "name": "web_search" }]);
    assert_eq!(
        convert(base(json!({ "tools": server })))
            .unwrap_err()
            .status,
        400
    );
}

#[test]
fn sampling_stop_metadata_and_stream_map() {
    let r = convert(base(json!({
        "temperature": 0.5, "top_p": 0.9, "top_k": 40,
        "stop_sequences": ["END", "###"],
        "metadata": { "user_id": "u-1" },
        "stream": true,
    })))
    .unwrap();
    let b = &r.body_json();
    assert_eq!(b["temperature"], json!(0.5));
    assert_eq!(b["top_p"], json!(0.9));
    assert_eq!(b["top_k"], json!(40));
    assert_eq!(b["stop"], json!(["END", "###"]));
    assert_eq!(b["user"], json!("u-1"));
    assert_eq!(b["stream"], json!(true));
    assert_eq!(b["stream_options"], json!({ "include_usage": true }));
    assert_eq!(r.stop_sequences, vec!["END".to_owned(), "###".to_owned()]);
    assert!(r.stream);
    let b = body(base(json!({ "stream": false })));
    assert!(b.get("stream").is_none() && b.get("stream_options").is_none());
}

#[test]
fn unknown_fields_are_ignored() {
    let r = convert(base(json!({
        "thinking": { "type": "enabled", "budget_tokens": 1024 },
        "service_tier": "auto",
        "future_field": { "nested": [1, 2, 3] },
        "messages": [{ "role": "user", "future": 1, "content": [
            { "type": "text", "text": "hi", "cache_control": { "type": "ephemeral" }, "x": 1 },
        ] }],
    })))
    .unwrap();
    assert_eq!(
        r.body_json(),
        json!({ "model": "claude-x", "max_tokens": 64, "messages": [
            { "role": "user", "content": [{ "type": "text", "text": "hi" }] } ] })
    );
}

#[test]
fn malformed_requests_are_400_in_anthropic_shape() {
    let cases: Vec<&[u8]> = vec![
        b"",
        b"{",
        b"[]",
        b"null",
        br#"{"max_tokens":1,"messages":[]}"#,
        br#"{"model":1,"max_tokens":1,"messages":[]}"#,
        br#"{"model":"m","messages":[]}"#,
        br#"{"model":"m","max_tokens":0,"messages":[]}"#,
        br#"{"model":"m","max_tokens":-1,"messages":[]}"#,
        br#"{"model":"m","max_tokens":1.5,"messages":[]}"#,
        br#"{"model":"m","max_tokens":1}"#,
        br#"{"model":"m","max_tokens":1,"messages":{}}"#,
        br#"{"model":"m","max_tokens":1,"messages":[{"role":"system","content":"x"}]}"#,
        br#"{"model":"m","max_tokens":1,"messages":[{"role":"user","content":5}]}"#,
        br#"{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[{"type":"document"}]}]}"#,
        br#"{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[{"text":"no type"}]}]}"#,
        br#"{"model":"m","max_tokens":1,"messages":[{"role":"assistant","content":[{"type":"tool_use","id":"a","name":"b","input":[1]}]}]}"#,
        br#"{"model":"m","max_tokens":1,"messages":[],"temperature":"hot"}"#,
        br#"{"model":"m","max_tokens":1,"messages":[],"stream":"yes"}"#,
        br#"{"model":"m","max_tokens":1,"messages":[],"stop_sequences":[1]}"#,
        br#"{"model":"m","max_tokens":1,"messages":[],"metadata":{"user_id":7}}"#,
    ];
    for c in cases {
        let e = messages_to_chat(c, &limits()).unwrap_err();
        assert_eq!(e.status, 400, "{}", String::from_utf8_lossy(c));
        let b = e.body();
        assert_eq!(b["type"], "error");
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert!(
            b["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
    }
}

#[test]
fn deeply_nested_json_is_400_not_a_stack_overflow() {
    let mut s = String::from(r#"{"model":"m","max_tokens":1,"messages":[],"x":"#);
    s.push_str(&"[".repeat(100_000));
    assert_eq!(
        messages_to_chat(s.as_bytes(), &limits())
            .unwrap_err()
            .status,
        400
    );
}

#[test]
fn oversized_body_is_413_before_parsing() {
    let small = Limits {
        max_body_bytes: 16,
        ..Limits::default()
    };
    let b = base(json!({})).to_string();
    let e = messages_to_chat(b.as_bytes(), &small).unwrap_err();
    assert_eq!((e.status, e.error_type()), (413, "request_too_large"));
    // Size wins over malformedness: the limit is checked before any parsing.
    let e = messages_to_chat(&[b'{'; 17], &small).unwrap_err();
    assert_eq!(e.status, 413);
    assert_eq!(e.body()["error"]["type"], "request_too_large");
    assert!(messages_to_chat(&b.as_bytes()[..16], &small).is_err_and(|e| e.status == 400));
}

#[test]
fn error_body_maps_statuses() {
    let cases = [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "api_error"),
        (529, "overloaded_error"),
    ];
    for (status, ty) in cases {
        assert_eq!(
            error_body(status, "m"),
            json!({ "type": "error", "error": { "type": ty, "message": "m" } })
        );
    }
    let r = direct_mode_refusal();
    assert_eq!(r.status, 503);
    let b = r.body();
    assert_eq!(b["error"]["type"], "api_error");
    assert!(
        b["error"]["message"]
            .as_str()
            .unwrap()
            .ends_with("disaggregated_prefill_decode_unavailable")
    );
}

fn req_with_stops(stops: &[&str]) -> ChatRequest {
    convert(base(json!({ "stop_sequences": stops }))).unwrap()
}

fn chat_response(message: Value, finish: &str, extra_choice: Value) -> Vec<u8> {
    let mut choice = json!({ "index": 0, "message": message, "finish_reason": finish });
    for (k, v) in extra_choice.as_object().unwrap() {
        choice[k] = v.clone();
    }
    json!({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "served",
        "choices": [choice],
        "usage": { "prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18 },
    })
    .to_string()
    .into_bytes()
}

#[test]
fn buffered_text_response_converts() {
    let req = req_with_stops(&[]);
    let chat = chat_response(
        json!({ "role": "assistant", "content": "Hello!" }),
        "stop",
        json!({}),
    );
    let m = chat_response_to_message(&chat, &req, 0xabc, &limits()).unwrap();
    assert_eq!(
        m,
        json!({
            "id": "msg_00000000000000000000000000000abc",
            "type": "message", "role": "assistant", "model": "claude-x",
            "content": [{ "type": "text", "text": "Hello!" }],
            "stop_reason": "end_turn", "stop_sequence": null,
            "usage": { "input_tokens": 11, "output_tokens": 7 },
        })
    );
}

#[test]
fn finish_reasons_map_to_stop_reasons() {
    let req = req_with_stops(&["END"]);
    let msg = json!({ "role": "assistant", "content": "x" });
    let cases = [
        ("stop", json!({}), "end_turn", Value::Null),
        (
            "stop",
            json!({ "stop_reason": "END" }),
            "stop_sequence",
            json!("END"),
        ),
        (
            "stop",
            json!({ "stop_reason": "OTHER" }),
            "end_turn",
            Value::Null,
        ),
        (
            "stop",
            json!({ "stop_reason": 128001 }),
            "end_turn",
            Value::Null,
        ),
        ("length", json!({}), "max_tokens", Value::Null),
        ("tool_calls", json!({}), "tool_use", Value::Null),
        ("content_filter", json!({}), "refusal", Value::Null),
    ];
    for (finish, extra, want, seq) in cases {
        let m = chat_response_to_message(
            &chat_response(msg.clone(), finish, extra),
            &req,
            1,
            &limits(),
        )
        .unwrap();
        assert_eq!(m["stop_reason"], want, "{finish}");
        assert_eq!(m["stop_sequence"], seq, "{finish}");
    }
}

#[test]
fn buffered_tool_calls_become_tool_use_blocks() {
    let req = req_with_stops(&[]);
    let chat = chat_response(
        json!({ "role": "assistant", "content": null, "tool_calls": [
            { "id": "call_1", "type": "function",
              "function": { "name": "weather", "arguments": "{\"city\": \"Paris\"}" } },
            { "type": "function", "function": { "name": "now", "arguments": "" } },
        ] }),
        "tool_calls",
        json!({}),
    );
    let m = chat_response_to_message(&chat, &req, 5, &limits()).unwrap();
    assert_eq!(
        m["content"],
        json!([
            { "type": "tool_use", "id": "call_1", "name": "weather", "input": { "city": "Paris" } },
            { "type": "tool_use", "id": "toolu_00000000000000000000000000000005_1", "name": "now",
              "input": {} },
        ])
    );
    assert_eq!(m["stop_reason"], "tool_use");
    let bad = chat_response(
        json!({ "role": "assistant", "tool_calls": [
            { "id": "c", "function": { "name": "f", "arguments": "{not json" } } ] }),
        "tool_calls",
        json!({}),
    );
    let e = chat_response_to_message(&bad, &req, 5, &limits()).unwrap_err();
    assert_eq!((e.status, e.error_type()), (502, "api_error"));
}

#[test]
fn malformed_upstream_responses_are_502() {
    let req = req_with_stops(&[]);
    for bad in [
        &b"nope"[..],
        b"{}",
        br#"{"choices":[]}"#,
        br#"{"choices":[{"index":0}]}"#,
    ] {
        let e = chat_response_to_message(bad, &req, 1, &limits()).unwrap_err();
        assert_eq!(e.status, 502);
    }
    let tiny = Limits {
        max_chunk_bytes: 4,
        ..Limits::default()
    };
    let chat = chat_response(json!({ "content": "x" }), "stop", json!({}));
    assert_eq!(
        chat_response_to_message(&chat, &req, 1, &tiny)
            .unwrap_err()
            .status,
        502
    );
}

/// Anthropic request → chat body → simulated chat answer → Anthropic Message.
#[test]
fn golden_round_trip_with_tools() {
    let anthropic_req = json!({
        "model": "claude-x", "max_tokens": 256, "system": "You are a weather bot.",
        "tools": [{ "name": "weather", "description": "current weather",
                    "input_schema": { "type": "object", "properties": { "city": { "type": "string" } },
                                      "required": ["city"] } }],
        "tool_choice": { "type": "any" },
        "messages": [{ "role": "user", "content": "Weather in Paris?" }],
    });
    let req = convert(anthropic_req).unwrap();
    assert_eq!(
        req.body_json(),
        json!({
            "model": "claude-x", "max_tokens": 256,
            "messages": [
                { "role": "system", "content": "You are a weather bot." },
                { "role": "user", "content": "Weather in Paris?" },
            ],
            "tools": [{ "type": "function", "function": { "name": "weather",
                "description": "current weather",
                "parameters": { "type": "object", "properties": { "city": { "type": "string" } },
                                "required": ["city"] } } }],
            "tool_choice": "required",
        })
    );
    let chat = chat_response(
        json!({ "role": "assistant", "content": "Let me check.", "tool_calls": [
            { "id": "call_9", "type": "function",
              "function": { "name": "weather", "arguments": "{\"city\":\"Paris\"}" } } ] }),
        "tool_calls",
        json!({}),
    );
    let m = chat_response_to_message(&chat, &req, 1, &limits()).unwrap();
    assert_eq!(
        m,
        json!({
            "id": "msg_00000000000000000000000000000001", "type": "message", "role": "assistant",
            "model": "claude-x",
            "content": [
                { "type": "text", "text": "Let me check." },
                { "type": "tool_use", "id": "call_9", "name": "weather", "input": { "city": "Paris" } },
            ],
            "stop_reason": "tool_use", "stop_sequence": null,
            "usage": { "input_tokens": 11, "output_tokens": 7 },
        })
    );
    // The Message's content fed back as an assistant turn gives the same chat tool call.
    let next = convert(json!({ "model": "claude-x", "max_tokens": 16, "messages": [
        { "role": "user", "content": "Weather in Paris?" },
        { "role": "assistant", "content": m["content"] },
        { "role": "user", "content": [{ "type": "tool_result", "tool_use_id": "call_9", "content": "18C" }] },
    ] }))
    .unwrap();
    assert_eq!(
        next.body_json()["messages"][1],
        json!({ "role": "assistant", "content": "Let me check.", "tool_calls": [
            { "id": "call_9", "type": "function",
              "function": { "name": "weather", "arguments": "{\"city\":\"Paris\"}" } } ] })
    );
    assert_eq!(next.body_json()["messages"][2]["tool_call_id"], "call_9");
}

fn chunk(delta: Value, finish: Option<&str>) -> Vec<u8> {
    json!({ "id": "c", "object": "chat.completion.chunk", "created": 1, "model": "served",
            "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }] })
    .to_string()
    .into_bytes()
}

fn run(stream: &mut AnthropicStream, chunks: &[Vec<u8>]) -> Vec<SseEvent> {
    let mut out = Vec::new();
    for c in chunks {
        out.extend(stream.push(c));
    }
    out.extend(stream.finish());
    out
}

#[test]
fn stream_text_then_split_tool_call_exact_sequence() {
    let req = convert(base(json!({ "stream": true }))).unwrap();
    let mut s = AnthropicStream::new(&req, 7, limits());
    let chunks = vec![
        chunk(json!({ "role": "assistant", "content": "" }), None),
        chunk(json!({ "content": "Let me " }), None),
        chunk(json!({ "content": "check." }), None),
        chunk(
            json!({ "tool_calls": [{ "index": 0, "id": "call_1", "type": "function",
            "function": { "name": "weather", "arguments": "" } }] }),
            None,
        ),
        chunk(
            json!({ "tool_calls": [{ "index": 0, "function": { "arguments": "{\"ci" } }] }),
            None,
        ),
        chunk(
            json!({ "tool_calls": [{ "index": 0, "function": { "arguments": "ty\": \"Paris\"}" } }] }),
            None,
        ),
        chunk(json!({}), Some("tool_calls")),
        json!({ "id": "c", "object": "chat.completion.chunk", "choices": [],
                "usage": { "prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29 } })
        .to_string()
        .into_bytes(),
        b"[DONE]".to_vec(),
    ];
    let events = run(&mut s, &chunks);
    let want = vec![
        (
            "message_start",
            json!({ "type": "message_start", "message": {
            "id": "msg_00000000000000000000000000000007", "type": "message", "role": "assistant",
            "model": "claude-x", "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": { "input_tokens": 0, "output_tokens": 0 } } }),
        ),
        ("ping", json!({ "type": "ping" })),
        (
            "content_block_start",
            json!({ "type": "content_block_start", "index": 0,
            "content_block": { "type": "text", "text": "" } }),
        ),
        (
            "content_block_delta",
            json!({ "type": "content_block_delta", "index": 0,
            "delta": { "type": "text_delta", "text": "Let me " } }),
        ),
        (
            "content_block_delta",
            json!({ "type": "content_block_delta", "index": 0,
            "delta": { "type": "text_delta", "text": "check." } }),
        ),
        (
            "content_block_stop",
            json!({ "type": "content_block_stop", "index": 0 }),
        ),
        (
            "content_block_start",
            json!({ "type": "content_block_start", "index": 1,
            "content_block": { "type": "tool_use", "id": "call_1", "name": "weather", "input": {} } }),
        ),
        (
            "content_block_delta",
            json!({ "type": "content_block_delta", "index": 1,
            "delta": { "type": "input_json_delta", "partial_json": "{\"ci" } }),
        ),
        (
            "content_block_delta",
            json!({ "type": "content_block_delta", "index": 1,
            "delta": { "type": "input_json_delta", "partial_json": "ty\": \"Paris\"}" } }),
        ),
        (
            "content_block_stop",
            json!({ "type": "content_block_stop", "index": 1 }),
        ),
        (
            "message_delta",
            json!({ "type": "message_delta",
            "delta": { "stop_reason": "tool_use", "stop_sequence": null },
            "usage": { "input_tokens": 20, "output_tokens": 9 } }),
        ),
        ("message_stop", json!({ "type": "message_stop" })),
    ];
    let got: Vec<(&str, Value)> = events.iter().map(|e| (e.event, e.data.clone())).collect();
    assert_eq!(got, want);
    assert!(s.is_done());
    assert!(
        s.push(&chunk(json!({ "content": "late" }), None))
            .is_empty()
    );
    assert_eq!(
        events[1].to_bytes(),
        b"event: ping\ndata: {\"type\":\"ping\"}\n\n".to_vec()
    );
}

#[test]
fn stream_two_tool_calls_and_stop_sequence() {
    let req = req_with_stops(&["END"]);
    let mut s = AnthropicStream::new(&req, 1, limits());
    let events = run(
        &mut s,
        &[
            chunk(
                json!({ "tool_calls": [{ "index": 0, "id": "a", "function": { "name": "f", "arguments": "{}" } }] }),
                None,
            ),
            chunk(
                json!({ "tool_calls": [{ "index": 1, "id": "b", "function": { "name": "g", "arguments": "{}" } }] }),
                None,
            ),
        ],
    );
    let names: Vec<&str> = events.iter().map(|e| e.event).collect();
    assert_eq!(
        names.last(),
        Some(&"error"),
        "no finish_reason → error: {names:?}"
    );

    let mut s = AnthropicStream::new(&req, 1, limits());
    let mut c = chunk(json!({ "content": "abc" }), Some("stop"));
    let mut v: Value = serde_json::from_slice(&c).unwrap();
    v["choices"][0]["stop_reason"] = json!("END");
    c = v.to_string().into_bytes();
    let events = run(&mut s, &[c]);
    let delta = events.iter().find(|e| e.event == "message_delta").unwrap();
    assert_eq!(
        delta.data["delta"],
        json!({ "stop_reason": "stop_sequence", "stop_sequence": "END" })
    );
    assert_eq!(events.last().unwrap().event, "message_stop");
}

#[test]
fn stream_errors_end_with_one_error_event() {
    let req = req_with_stops(&[]);
    let cases: Vec<Vec<Vec<u8>>> = vec![
        vec![b"{not json".to_vec()],
        vec![br#"{"error":{"message":"boom","type":"internal"}}"#.to_vec()],
        vec![b"[DONE]".to_vec()],
        vec![chunk(json!({ "content": "hi" }), None)],
        vec![
            chunk(
                json!({ "tool_calls": [{ "index": 0, "id": "a", "function": { "name": "f" } }] }),
                None,
            ),
            chunk(json!({ "content": "x" }), None),
            chunk(
                json!({ "tool_calls": [{ "index": 0, "function": { "arguments": "{}" } }] }),
                None,
            ),
        ],
    ];
    for chunks in cases {
        let mut s = AnthropicStream::new(&req, 1, limits());
        let events = run(&mut s, &chunks);
        assert_eq!(events[0].event, "message_start");
        let last = events.last().unwrap();
        assert_eq!(last.event, "error");
        assert_eq!(last.data["type"], "error");
        assert_eq!(last.data["error"]["type"], "api_error");
        assert_eq!(events.iter().filter(|e| e.event == "error").count(), 1);
        assert!(!events.iter().any(|e| e.event == "message_stop"));
    }
}

#[test]
fn stream_bounds_are_enforced() {
    let req = req_with_stops(&[]);
    let small = Limits {
        max_tool_arg_bytes: 8,
        max_blocks: 2,
        max_chunk_bytes: 4096,
        ..Limits::default()
    };
    let mut s = AnthropicStream::new(&req, 1, small);
    let events = run(
        &mut s,
        &[
            chunk(
                json!({ "tool_calls": [{ "index": 0, "id": "a", "function": { "name": "f", "arguments": "{\"k\":" } }] }),
                None,
            ),
            chunk(
                json!({ "tool_calls": [{ "index": 0, "function": { "arguments": "\"long\"}" } }] }),
                None,
            ),
        ],
    );
    let last = events.last().unwrap();
    assert_eq!(last.event, "error");
    assert!(
        last.data["error"]["message"]
            .as_str()
            .unwrap()
            .contains("tool arguments")
    );

    let mut s = AnthropicStream::new(&req, 1, small);
    let events = run(
        &mut s,
        &[
            chunk(json!({ "content": "a" }), None),
            chunk(
                json!({ "tool_calls": [{ "index": 0, "id": "a", "function": { "name": "f" } }] }),
                None,
            ),
            chunk(
                json!({ "tool_calls": [{ "index": 1, "id": "b", "function": { "name": "g" } }] }),
                None,
            ),
        ],
    );
    assert_eq!(
        events
            .iter()
            .filter(|e| e.event == "content_block_start")
            .count(),
        2
    );
    assert_eq!(events.last().unwrap().event, "error");

    let mut s = AnthropicStream::new(&req, 1, small);
    let events = run(&mut s, &[vec![b' '; 5000]]);
    assert_eq!(events.last().unwrap().event, "error");
}

/// Block indexes are contiguous, every start has one stop before the next start, and the stream
/// ends with message_stop or error.
fn check_well_formed(events: &[SseEvent]) {
    assert_eq!(events[0].event, "message_start");
    assert_eq!(events[1].event, "ping");
    let mut open: Option<u64> = None;
    let mut next = 0u64;
    for e in &events[2..events.len() - 1] {
        let idx = e.data.get("index").and_then(Value::as_u64);
        match e.event {
            "content_block_start" => {
                assert_eq!(open, None);
                assert_eq!(idx, Some(next));
                open = idx;
                next += 1;
            }
            "content_block_delta" => assert_eq!(idx, open.or(Some(u64::MAX))),
            "content_block_stop" => {
                assert_eq!(idx, open);
                open = None;
            }
            "message_delta" => assert_eq!(open, None),
            other => panic!("unexpected {other} mid-stream"),
        }
    }
    let last = events.last().unwrap().event;
    assert!(last == "message_stop" || last == "error", "{last}");
}

fn arb_chunk() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..64),
        Just(b"[DONE]".to_vec()),
        "[a-z ]{0,12}".prop_map(|t| chunk(json!({ "content": t }), None)),
        (0u64..3, proptest::option::of("[a-z]{1,4}"), "[{}\":a-z0-9]{0,10}").prop_map(|(i, id, args)| {
            chunk(
                json!({ "tool_calls": [{ "index": i, "id": id, "function": { "name": "f", "arguments": args } }] }),
                None,
            )
        }),
        prop_oneof![Just("stop"), Just("length"), Just("tool_calls")]
            .prop_map(|f| chunk(json!({}), Some(f))),
        Just(br#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}"#.to_vec()),
    ]
}

fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        "[a-z_]{0,8}".prop_map(Value::String),
        prop_oneof![
            Just("user"),
            Just("assistant"),
            Just("text"),
            Just("image"),
            Just("tool_use"),
            Just("tool_result"),
            Just("base64"),
            Just("url"),
            Just("auto"),
            Just("tool")
        ]
        .prop_map(|s| json!(s)),
    ];
    leaf.prop_recursive(5, 64, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            proptest::collection::btree_map(
                prop_oneof![
                    Just("type".to_owned()),
                    Just("role".to_owned()),
                    Just("content".to_owned()),
                    Just("text".to_owned()),
                    Just("source".to_owned()),
                    Just("input".to_owned()),
                    Just("tool_use_id".to_owned()),
                    Just("name".to_owned()),
                    Just("id".to_owned()),
                    "[a-z]{1,6}",
                ],
                inner,
                0..5,
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        if let Err(e) = messages_to_chat(&bytes, &limits()) {
            prop_assert!(e.status == 400);
        }
    }

    #[test]
    fn arbitrary_request_shapes_are_ok_or_400(
        messages in proptest::collection::vec(arb_json(), 0..4),
        system in arb_json(),
        tools in arb_json(),
        tool_choice in arb_json(),
    ) {
        let req = json!({ "model": "m", "max_tokens": 8, "messages": messages, "system": system,
                          "tools": tools, "tool_choice": tool_choice });
        match messages_to_chat(req.to_string().as_bytes(), &limits()) {
            Ok(r) => prop_assert!(r.body_json()["messages"].is_array()),
            Err(e) => {
                prop_assert_eq!(e.status, 400);
                let b = e.body();
                prop_assert_eq!(b["error"]["type"].as_str(), Some("invalid_request_error"));
            }
        }
    }

    #[test]
    fn arbitrary_chunk_sequences_end_well_formed(chunks in proptest::collection::vec(arb_chunk(), 0..12)) {
        let req = req_with_stops(&[]);
        let mut s = AnthropicStream::new(&req, 3, Limits { max_blocks: 3, max_tool_arg_bytes: 24, ..Limits::default() });
        let events = run(&mut s, &chunks);
        prop_assert!(s.is_done());
        check_well_formed(&events);
    }

    #[test]
    fn arbitrary_chat_responses_never_panic(v in arb_json()) {
        let req = req_with_stops(&[]);
        let wrapped = json!({ "choices": [{ "message": v, "finish_reason": "stop" }] });
        if let Err(e) = chat_response_to_message(wrapped.to_string().as_bytes(), &req, 1, &limits()) {
            prop_assert_eq!(e.status, 502);
        }
    }
}

/// Splits `s` at the (sorted, deduplicated, char-boundary) positions in `cuts`.
fn split_at(s: &str, cuts: &[usize]) -> Vec<String> {
    let mut at: Vec<usize> = cuts
        .iter()
        .map(|c| c % (s.len() + 1))
        .filter(|c| s.is_char_boundary(*c))
        .collect();
    at.sort_unstable();
    at.dedup();
    let mut out = Vec::new();
    let mut prev = 0;
    for c in at.into_iter().chain([s.len()]) {
        out.push(s[prev..c].to_owned());
        prev = c;
    }
    out
}

proptest! {
    /// Streaming round trip: however the upstream splits a text answer and a tool call's
    /// arguments, the text deltas concatenate to the text and the `input_json_delta`s to JSON equal
    /// to the buffered conversion's `input`.
    #[test]
    fn stream_reassembles_to_the_buffered_answer(
        text in "[a-zA-Z0-9 .,é]{1,40}",
        city in "[a-zA-Z ]{0,12}",
        n in any::<i32>(),
        text_cuts in proptest::collection::vec(any::<usize>(), 0..6),
        arg_cuts in proptest::collection::vec(any::<usize>(), 0..6),
    ) {
        let req = req_with_stops(&[]);
        let args = json!({ "city": city, "n": n }).to_string();
        let mut chunks = Vec::new();
        for t in split_at(&text, &text_cuts) {
            chunks.push(chunk(json!({ "content": t }), None));
        }
        for (i, a) in split_at(&args, &arg_cuts).into_iter().enumerate() {
            let mut call = json!({ "index": 0, "function": { "arguments": a } });
            if i == 0 {
                call["id"] = json!("call_1");
                call["function"]["name"] = json!("f");
            }
            chunks.push(chunk(json!({ "tool_calls": [call] }), None));
        }
        chunks.push(chunk(json!({}), Some("tool_calls")));
        chunks.push(b"[DONE]".to_vec());
        let mut s = AnthropicStream::new(&req, 1, limits());
        let events = run(&mut s, &chunks);
        check_well_formed(&events);
        prop_assert_eq!(events.last().unwrap().event, "message_stop");
        let deltas = |ty: &str, field: &str| -> String {
            events
                .iter()
                .filter(|e| e.event == "content_block_delta" && e.data["delta"]["type"] == ty)
                .map(|e| e.data["delta"][field].as_str().unwrap().to_owned())
                .collect()
        };
        prop_assert_eq!(deltas("text_delta", "text"), text.clone());
        let streamed: Value = serde_json::from_str(&deltas("input_json_delta", "partial_json")).unwrap();

        let buffered = chat_response(
            json!({ "role": "assistant", "content": text, "tool_calls": [
                { "id": "call_1", "type": "function", "function": { "name": "f", "arguments": args } } ] }),
            "tool_calls",
            json!({}),
        );
        let m = chat_response_to_message(&buffered, &req, 1, &limits()).unwrap();
        prop_assert_eq!(&m["content"][1]["input"], &streamed);
        let stop = events.iter().find(|e| e.event == "message_delta").unwrap();
        prop_assert_eq!(&stop.data["delta"]["stop_reason"], &m["stop_reason"]);
    }

    /// Request round trip: a well-formed tool conversation converts, every tool_use id reappears
    /// as a chat tool_call id, every tool_result as a `tool` message with that id, in order.
    #[test]
    fn tool_conversations_keep_ids_in_order(
        turns in proptest::collection::vec(("[a-z]{1,6}", proptest::collection::vec("[a-z]{1,5}", 1..4)), 1..5),
    ) {
        let mut messages = Vec::new();
        let mut want_ids = Vec::new();
        for (t, (text, calls)) in turns.iter().enumerate() {
            messages.push(json!({ "role": "user", "content": text }));
            let ids: Vec<String> = (0..calls.len()).map(|c| format!("toolu_{t}_{c}")).collect();
            let uses: Vec<Value> = calls
                .iter()
                .zip(&ids)
                .map(|(name, id)| json!({ "type": "tool_use", "id": id, "name": name, "input": { "q": text } }))
                .collect();
            messages.push(json!({ "role": "assistant", "content": uses }));
            let results: Vec<Value> = ids
                .iter()
                .map(|id| json!({ "type": "tool_result", "tool_use_id": id, "content": "ok" }))
                .collect();
            messages.push(json!({ "role": "user", "content": results }));
            want_ids.extend(ids);
        }
        let b = body(base(json!({ "messages": messages })));
        let msgs = b["messages"].as_array().unwrap();
        let call_ids: Vec<&str> = msgs
            .iter()
            .filter_map(|m| m.get("tool_calls"))
            .flat_map(|c| c.as_array().unwrap().iter().map(|c| c["id"].as_str().unwrap()))
            .collect();
        let result_ids: Vec<&str> = msgs
            .iter()
            .filter(|m| m["role"] == "tool")
            .map(|m| m["tool_call_id"].as_str().unwrap())
            .collect();
        prop_assert_eq!(&call_ids, &want_ids);
        prop_assert_eq!(&result_ids, &want_ids);
        prop_assert_eq!(msgs.len(), turns.len() * 2 + want_ids.len());
    }
}

fn refusal(req: &str) -> String {
    messages_to_chat(req.as_bytes(), &limits())
        .expect_err("refused")
        .message
}

#[test]
fn refusals_name_the_path_of_the_bad_value() {
    let m = |messages: &str| {
        refusal(&format!(
            r#"{{"model":"m","max_tokens":8,"messages":{messages}}}"#
        ))
    };
    assert_eq!(
        m(
            r#"[{"role":"user","content":"a"},{"role":"user","content":[{"type":"text","text":1}]}]"#
        ),
        "messages[1].content[0].text: expected a string, got number"
    );
    assert_eq!(
        m(r#"[{"role":"user","content":[{"type":"image","source":{"type":"file"}}]}]"#),
        "messages[0].content[0].source.type: `file` is not supported (base64 or url)"
    );
    assert_eq!(
        m(
            r#"[{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":null}]}]}]"#
        ),
        "messages[0].content[0].content[0].text: expected a string, got null"
    );
    assert_eq!(
        m(
            r#"[{"role":"assistant","content":[{"type":"tool_use","id":"t","name":"n","input":[]}]}]"#
        ),
        "messages[0].content[0].input: expected an object, got array"
    );
    assert_eq!(
        m(r#"[{"role":"assistant","content":7}]"#),
        "messages[0].content: expected a string or an array of content blocks, got number"
    );
    assert_eq!(
        refusal(
            r#"{"model":"m","max_tokens":8,"messages":[],"system":[{"type":"text","text":"a"},{"type":"image"}]}"#
        ),
        "system[1]: block type `image` is not supported here (text only)"
    );
    assert_eq!(
        refusal(r#"{"model":"m","max_tokens":8,"messages":[],"stop_sequences":["a",2]}"#),
        "stop_sequences[1]: expected a string, got number"
    );
    assert_eq!(
        refusal(r#"{"model":"m","max_tokens":8,"messages":[],"tools":[{"name":"w"}]}"#),
        "tools[0].input_schema: expected an object, got null"
    );
    assert!(
        refusal(r#"{"model":"m","max_tokens":8,"messages":[]"#)
            .starts_with("request body is not valid JSON: EOF while parsing")
    );
}

/// The converted body is written directly (no `Value` in between): its exact text, key order
/// included, is what the chat route receives.
#[test]
fn the_chat_body_text_is_written_in_a_fixed_key_order() {
    let r = messages_to_chat(
        br#"{"stream":true,"metadata":{"user_id":"u"},"tool_choice":{"type":"tool","name":"w","disable_parallel_tool_use":true},
            "tools":[{"name":"w","description":"d","input_schema":{"type":"object","b":1,"a":2}}],
            "stop_sequences":["x"],"top_k":5,"top_p":0.5,"temperature":1,"system":"s",
            "messages":[{"role":"user","content":[{"type":"text","text":"q\u00e9\"\n"}]},
                        {"role":"assistant","content":[{"type":"text","text":"a"},{"type":"tool_use","id":"t","name":"w","input":{"z":1,"y":[2]}}]},
                        {"role":"user","content":[{"type":"tool_result","tool_use_id":"t","is_error":true}]}],
            "max_tokens":16,"model":"m","unknown":{"x":[1]}}"#,
        &limits(),
    )
    .unwrap();
    assert_eq!(
        String::from_utf8(r.body).unwrap(),
        concat!(
            r#"{"model":"m","messages":[{"role":"system","content":"s"},"#,
            r#"{"role":"user","content":[{"type":"text","text":"qé\"\n"}]},"#,
            r#"{"role":"assistant","content":"a","tool_calls":[{"id":"t","type":"function","function":{"name":"w","arguments":"{\"z\":1,\"y\":[2]}"}}]},"#,
            r#"{"role":"tool","tool_call_id":"t","content":"[tool error] "}],"#,
            r#""max_tokens":16,"temperature":1,"top_p":0.5,"top_k":5,"stop":["x"],"#,
            r#""tools":[{"type":"function","function":{"name":"w","description":"d","parameters":{"type":"object","b":1,"a":2}}}],"#,
            r#""tool_choice":{"type":"function","function":{"name":"w"}},"parallel_tool_calls":false,"#,
            r#""user":"u","stream":true,"stream_options":{"include_usage":true}}"#
        )
    );
}
