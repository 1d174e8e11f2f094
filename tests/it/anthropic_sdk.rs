//! The Anthropic ingress converters' outputs validated by the real SDKs (`real-peers`).
//!
//! Buffered `Message`s, every streamed event and every error body produced by
//! `continuum_protocol::ingress::anthropic` are checked with the `anthropic` Python SDK's pydantic
//! types, and the simulated upstream chat answers with the `openai` SDK's, by
//! `tests/fixtures/ingress/validate_anthropic.py` run under `CONTINUUM_PYTHON` (default
//! `python3`; needs `anthropic` and `openai`, which `scripts/test.sh` installs into its venv).
#![cfg(feature = "real-peers")]

use std::io::Write;
use std::process::{Command, Stdio};

use continuum_protocol::ingress::anthropic::{
    AnthropicStream, ChatRequest, Limits, chat_response_to_message, direct_mode_refusal,
    error_body, messages_to_chat,
};
use serde_json::{Value, json};

fn request(extra: Value) -> ChatRequest {
    let mut v = json!({
        "model": "claude-x", "max_tokens": 128,
        "messages": [{ "role": "user", "content": "Weather in Paris?" }],
        "stop_sequences": ["END"],
        "tools": [{ "name": "weather", "description": "current weather",
                    "input_schema": { "type": "object", "properties": { "city": { "type": "string" } } } }],
    });
    for (k, x) in extra.as_object().expect("object") {
        v[k] = x.clone();
    }
    messages_to_chat(v.to_string().as_bytes(), &Limits::default()).expect("valid request")
}

fn chat_response(message: Value, finish: &str, stop_reason: Value) -> Value {
    json!({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1_700_000_000, "model": "served",
        "choices": [{ "index": 0, "message": message, "finish_reason": finish, "logprobs": null,
                      "stop_reason": stop_reason }],
        "usage": { "prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17,
                   "prompt_tokens_details": { "cached_tokens": 4 } },
    })
}

fn chunk(delta: Value, finish: Option<&str>) -> Value {
    json!({ "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1_700_000_000,
            "model": "served",
            "choices": [{ "index": 0, "delta": delta, "finish_reason": finish, "logprobs": null }] })
}

#[test]
fn outputs_validate_with_the_real_sdks() {
    let limits = Limits::default();
    let req = request(json!({}));
    let chat_responses = vec![
        chat_response(
            json!({ "role": "assistant", "content": "Sunny." }),
            "stop",
            Value::Null,
        ),
        chat_response(
            json!({ "role": "assistant", "content": "Sunny. " }),
            "stop",
            json!("END"),
        ),
        chat_response(
            json!({ "role": "assistant", "content": "Sun" }),
            "length",
            Value::Null,
        ),
        chat_response(
            json!({ "role": "assistant", "content": "Checking.", "tool_calls": [
                { "id": "call_1", "type": "function",
                  "function": { "name": "weather", "arguments": "{\"city\":\"Paris\"}" } } ] }),
            "tool_calls",
            Value::Null,
        ),
        chat_response(
            json!({ "role": "assistant", "content": "" }),
            "content_filter",
            Value::Null,
        ),
    ];
    let mut messages = Vec::new();
    for (i, c) in chat_responses.iter().enumerate() {
        let m = chat_response_to_message(c.to_string().as_bytes(), &req, i as u128, &limits)
            .expect("converts");
        messages.push(m);
    }
    let stops: Vec<&Value> = messages.iter().map(|m| &m["stop_reason"]).collect();
    assert_eq!(
        stops,
        [
            &json!("end_turn"),
            &json!("stop_sequence"),
            &json!("max_tokens"),
            &json!("tool_use"),
            &json!("refusal")
        ]
    );

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
            json!({ "tool_calls": [{ "index": 0, "function": { "arguments": "ty\":\"Paris\"}" } }] }),
            None,
        ),
        chunk(json!({}), Some("tool_calls")),
        json!({ "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1_700_000_000,
                "model": "served", "choices": [],
                "usage": { "prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29 } }),
    ];
    let mut events = Vec::new();
    let mut stream = AnthropicStream::new(&request(json!({ "stream": true })), 9, limits);
    for c in &chunks {
        events.extend(stream.push(c.to_string().as_bytes()));
    }
    events.extend(stream.push(b"[DONE]"));
    assert_eq!(events.last().map(|e| e.event), Some("message_stop"));
    let mut failing = AnthropicStream::new(&req, 10, limits);
    events.extend(failing.push(b"{broken"));
    assert_eq!(events.last().map(|e| e.event), Some("error"));
    let events: Vec<Value> = events
        .iter()
        .map(|e| json!({ "event": e.event, "data": e.data }))
        .collect();

    let mut errors: Vec<Value> = [400, 401, 403, 404, 413, 429, 500, 502, 503, 529]
        .iter()
        .map(|s| error_body(*s, "refused"))
        .collect();
    errors.push(direct_mode_refusal().body());
    errors.push(
        messages_to_chat(b"{", &limits)
            .expect_err("malformed")
            .body(),
    );

    let mut wrong = messages[0].clone();
    wrong["stop_reason"] = json!("finished");
    let mut no_usage = messages[0].clone();
    no_usage.as_object_mut().expect("object").remove("usage");

    let doc = json!({
        "messages": messages,
        "events": events,
        "errors": errors,
        "chat_responses": chat_responses,
        "chat_chunks": chunks,
        "must_fail": [wrong, no_usage],
    });
    let want =
        messages.len() + events.len() + errors.len() + chat_responses.len() + chunks.len() + 2;

    let python = std::env::var("CONTINUUM_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/ingress/validate_anthropic.py"
    );
    let mut child = Command::new(&python)
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {python} (set CONTINUUM_PYTHON): {e}"));
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(doc.to_string().as_bytes())
        .expect("write document");
    let out = child.wait_with_output().expect("validator exits");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "SDK validation failed (needs anthropic + openai in {python}):\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout.trim(), format!("ok {want}"));
}
