//! The Anthropic → Responses → Anthropic round trip for a `responses_only` model: request
//! mapping, buffered answers and streamed events, through the Anthropic converters.

use serde_json::{Value, json};

use super::*;
use crate::ingress::anthropic::{self, AnthropicStream, Limits};

fn anthropic_request(extra: Value) -> anthropic::ChatRequest {
    let mut body = json!({
        "model": "gpt-oss", "max_tokens": 64, "system": "Be terse.",
        "messages": [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}]}
        ],
        "tools": [{"name": "weather", "description": "Weather now",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    });
    for (k, v) in extra.as_object().into_iter().flatten() {
        body[k] = v.clone();
    }
    anthropic::messages_to_chat(body.to_string().as_bytes(), &Limits::default()).expect("chat")
}

#[test]
fn an_anthropic_request_becomes_a_responses_request() {
    let req = anthropic_request(json!({"temperature": 0.5}));
    let out: Value =
        serde_json::from_slice(&chat_to_responses(&req.body).expect("converted")).expect("json");
    assert_eq!(out["model"], "gpt-oss");
    assert_eq!(out["instructions"], "Be terse.");
    assert_eq!(out["max_output_tokens"], 64);
    assert_eq!(out["temperature"], 0.5);
    assert_eq!(
        out["input"],
        json!([
            {"role": "user", "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]},
            {"role": "assistant", "content": "Checking."},
            {"type": "function_call", "call_id": "toolu_1", "name": "weather",
             "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call_output", "call_id": "toolu_1", "output": "18 C"}
        ])
    );
    assert_eq!(out["tools"][0]["type"], "function");
    assert_eq!(out["tools"][0]["name"], "weather");
    assert_eq!(
        out["tools"][0]["parameters"]["properties"]["city"]["type"],
        "string"
    );
}

#[test]
fn stop_sequences_are_refused() {
    let req = anthropic_request(json!({"stop_sequences": ["END"]}));
    assert_eq!(chat_to_responses(&req.body).map_err(|e| e.status), Err(400));
}

#[test]
fn a_buffered_response_comes_back_as_an_anthropic_message() {
    let req = anthropic_request(json!({}));
    let answer = json!({
        "id": "resp_1", "object": "response", "status": "completed",
        "output": [
            {"type": "reasoning", "summary": []},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "It is 18 C."}]},
            {"type": "function_call", "call_id": "call_9", "name": "weather",
             "arguments": "{\"city\":\"Lyon\"}"}
        ],
        "usage": {"input_tokens": 30, "output_tokens": 7,
                  "input_tokens_details": {"cached_tokens": 16}}
    });
    let chat = responses_to_chat_answer(answer.to_string().as_bytes(), 1 << 20).expect("chat");
    let message =
        anthropic::chat_response_to_message(&chat, &req, 7, &Limits::default()).expect("message");
    assert_eq!(
        message["content"],
        json!([{"type": "text", "text": "It is 18 C."},
               {"type": "tool_use", "id": "call_9", "name": "weather", "input": {"city": "Lyon"}}])
    );
    assert_eq!(message["stop_reason"], "tool_use");
    assert_eq!(message["usage"]["input_tokens"], 30);
    assert_eq!(message["usage"]["output_tokens"], 7);
    assert_eq!(message["usage"]["cache_read_input_tokens"], 16);

    let incomplete = json!({"status": "incomplete", "output": [],
        "incomplete_details": {"reason": "max_output_tokens"}});
    let chat = responses_to_chat_answer(incomplete.to_string().as_bytes(), 1 << 20).expect("chat");
    let message =
        anthropic::chat_response_to_message(&chat, &req, 7, &Limits::default()).expect("message");
    assert_eq!(message["stop_reason"], "max_tokens");

    let failed = json!({"status": "failed", "output": [], "error": {"message": "boom"}});
    assert_eq!(
        responses_to_chat_answer(failed.to_string().as_bytes(), 1 << 20).map_err(|e| e.status),
        Err(502)
    );
    assert!(responses_to_chat_answer(b"[1]", 1 << 20).is_err());
    assert!(responses_to_chat_answer(answer.to_string().as_bytes(), 8).is_err());
}

/// Runs Responses events through [`ResponsesToChat`] and the Anthropic stream converter.
fn stream(events: &[Value]) -> Vec<anthropic::SseEvent> {
    let req = anthropic_request(json!({"stream": true}));
    let mut chat = ResponsesToChat::new(1 << 20);
    let mut conv = AnthropicStream::new(&req, 7, Limits::default());
    let mut out = Vec::new();
    for event in events {
        for chunk in chat.push(event.to_string().as_bytes()) {
            out.extend(conv.push(&chunk));
        }
    }
    out.extend(conv.finish());
    out
}

#[test]
fn a_streamed_response_comes_back_as_anthropic_events() {
    let events = stream(&[
        json!({"type": "response.created", "response": {"status": "in_progress"}}),
        json!({"type": "response.output_text.delta", "output_index": 0, "delta": "It is "}),
        json!({"type": "response.output_text.delta", "output_index": 0, "delta": "18 C."}),
        json!({"type": "response.output_item.added", "output_index": 1,
               "item": {"type": "function_call", "call_id": "call_9", "name": "weather"}}),
        json!({"type": "response.function_call_arguments.delta", "output_index": 1,
               "delta": "{\"city\":"}),
        json!({"type": "response.function_call_arguments.delta", "output_index": 1,
               "delta": "\"Lyon\"}"}),
        json!({"type": "response.completed", "response": {"status": "completed",
               "usage": {"input_tokens": 30, "output_tokens": 7}}}),
    ]);
    let names: Vec<&str> = events.iter().map(|e| e.event).collect();
    assert_eq!(names.first(), Some(&"message_start"));
    assert_eq!(names.last(), Some(&"message_stop"));
    let text: String = events
        .iter()
        .filter_map(|e| e.data["delta"]["text"].as_str())
        .collect();
    assert_eq!(text, "It is 18 C.");
    let args: String = events
        .iter()
        .filter_map(|e| e.data["delta"]["partial_json"].as_str())
        .collect();
    assert_eq!(args, "{\"city\":\"Lyon\"}");
    let tool = events
        .iter()
        .find(|e| e.data["content_block"]["type"] == "tool_use")
        .expect("a tool_use block");
    assert_eq!(tool.data["content_block"]["name"], "weather");
    let delta = events
        .iter()
        .find(|e| e.event == "message_delta")
        .expect("message_delta");
    assert_eq!(delta.data["delta"]["stop_reason"], "tool_use");
}

#[test]
fn a_failed_stream_ends_with_an_error_event() {
    for last in [
        json!({"type": "error", "message": "overloaded"}),
        json!({"type": "response.failed", "response": {"status": "failed",
               "error": {"message": "boom"}}}),
    ] {
        let events = stream(&[
            json!({"type": "response.output_text.delta", "output_index": 0, "delta": "Hi"}),
            last,
        ]);
        assert_eq!(events.last().map(|e| e.event), Some("error"));
    }
    // An event over the bound fails the stream too.
    let mut chat = ResponsesToChat::new(16);
    let out = chat.push(
        json!({"type": "response.output_text.delta", "delta": "x"})
            .to_string()
            .as_bytes(),
    );
    assert!(String::from_utf8_lossy(&out[0]).contains("error"));
    assert!(chat.push(b"[DONE]").is_empty(), "nothing after the failure");
}
