//! Tests of the Responses ingress converters: per-feature tables, exact SSE event sequences,
//! bounds, and property tests (arbitrary bodies and chunk sequences never panic).

use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;

fn convert(req: Value) -> Result<ChatRequest, IngressError> {
    responses_to_chat(req.to_string().as_bytes(), &Limits::default())
}

fn body(req: Value) -> Value {
    convert(req).expect("valid request").body_json()
}

fn status(req: Value) -> u16 {
    convert(req).expect_err("refused").status
}

#[test]
fn string_input_and_instructions() {
    let r = convert(json!({
        "model": "m", "input": "hi", "instructions": "be brief", "max_output_tokens": 32,
        "temperature": 0.5, "metadata": { "k": "v" }, "store": false,
    }))
    .unwrap();
    assert_eq!(
        r.body_json(),
        json!({
            "model": "m",
            "messages": [
                { "role": "system", "content": "be brief" },
                { "role": "user", "content": "hi" },
            ],
            "max_tokens": 32,
            "temperature": 0.5,
        })
    );
    assert!(!r.stream);
    assert_eq!(r.echo["metadata"], json!({ "k": "v" }));
}

#[test]
fn items_convert_in_order_with_tool_round_trip() {
    let b = body(json!({ "model": "m", "input": [
        { "role": "developer", "content": "sys" },
        { "type": "message", "role": "user", "content": [
            { "type": "input_text", "text": "weather " },
            { "type": "input_image", "image_url": "https://x/y.png", "detail": "low" },
        ] },
        { "type": "message", "role": "assistant", "content": [
            { "type": "output_text", "text": "Let me check.", "annotations": [] } ] },
        { "type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{\"city\":\"P\"}" },
        { "type": "function_call", "call_id": "c2", "name": "time", "arguments": "{}" },
        { "type": "reasoning", "id": "r", "summary": [] },
        { "type": "function_call_output", "call_id": "c1", "output": "sunny" },
        { "type": "function_call_output", "call_id": "c2",
          "output": [{ "type": "input_text", "text": "noon" }] },
    ] }));
    assert_eq!(
        b["messages"],
        json!([
            { "role": "system", "content": "sys" },
            { "role": "user", "content": [
                { "type": "text", "text": "weather " },
                { "type": "image_url", "image_url": { "url": "https://x/y.png", "detail": "low" } },
            ] },
            { "role": "assistant", "content": "Let me check.", "tool_calls": [
                { "id": "c1", "type": "function",
                  "function": { "name": "weather", "arguments": "{\"city\":\"P\"}" } },
                { "id": "c2", "type": "function", "function": { "name": "time", "arguments": "{}" } },
            ] },
            { "role": "tool", "tool_call_id": "c1", "content": "sunny" },
            { "role": "tool", "tool_call_id": "c2", "content": "noon" },
        ])
    );
}

#[test]
fn a_function_call_after_a_user_turn_opens_its_own_assistant_message() {
    let b = body(json!({ "model": "m", "input": [
        { "role": "user", "content": "q" },
        { "type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}" },
    ] }));
    assert_eq!(
        b["messages"][1],
        json!({ "role": "assistant", "content": null, "tool_calls": [
            { "id": "c1", "type": "function", "function": { "name": "f", "arguments": "{}" } } ] })
    );
}

#[test]
fn tools_tool_choice_text_format_and_stream() {
    let r = convert(json!({
        "model": "m", "input": "x", "stream": true, "parallel_tool_calls": false,
        "tools": [{ "type": "function", "name": "weather", "description": "d",
                    "parameters": { "type": "object" }, "strict": true }],
        "tool_choice": { "type": "function", "name": "weather" },
        "text": { "format": { "type": "json_schema", "name": "s", "schema": { "type": "object" } } },
    }))
    .unwrap();
    assert!(r.stream);
    assert_eq!(
        r.body_json()["tools"],
        json!([{ "type": "function", "function": {
            "name": "weather", "description": "d", "parameters": { "type": "object" }, "strict": true } }])
    );
    assert_eq!(
        r.body_json()["tool_choice"],
        json!({ "type": "function", "function": { "name": "weather" } })
    );
    assert_eq!(r.body_json()["parallel_tool_calls"], json!(false));
    assert_eq!(
        r.body_json()["response_format"],
        json!({ "type": "json_schema", "json_schema": { "name": "s", "schema": { "type": "object" } } })
    );
    assert_eq!(
        r.body_json()["stream_options"],
        json!({ "include_usage": true })
    );
    assert_eq!(
        body(json!({ "model": "m", "input": "x", "tool_choice": "required" }))["tool_choice"],
        json!("required")
    );
}

#[test]
fn refusals_are_400_and_oversize_is_413() {
    for bad in [
        json!({ "input": "x" }),
        json!({ "model": 3, "input": "x" }),
        json!({ "model": "m" }),
        json!({ "model": "m", "input": 5 }),
        json!({ "model": "m", "input": "x", "previous_response_id": "resp_1" }),
        json!({ "model": "m", "input": "x", "conversation": "c" }),
        json!({ "model": "m", "input": "x", "background": true }),
        json!({ "model": "m", "input": "x", "tools": [{ "type": "web_search" }] }),
        json!({ "model": "m", "input": "x", "tool_choice": "sometimes" }),
        json!({ "model": "m", "input": "x", "max_output_tokens": 0 }),
        json!({ "model": "m", "input": "x", "stream": "yes" }),
        json!({ "model": "m", "input": [{ "type": "item_reference", "id": "x" }] }),
        json!({ "model": "m", "input": [{ "role": "tool", "content": "x" }] }),
        json!({ "model": "m", "input": [{ "role": "user", "content": [{ "type": "input_file", "file_id": "f" }] }] }),
        json!({ "model": "m", "input": [{ "role": "user", "content": [{ "type": "input_image", "file_id": "f" }] }] }),
        json!({ "model": "m", "input": [{ "type": "function_call", "call_id": "c", "name": "f" }] }),
        json!({ "model": "m", "input": "x", "text": { "format": { "type": "yaml" } } }),
        json!([1, 2]),
    ] {
        assert_eq!(status(bad.clone()), 400, "{bad}");
    }
    let err = responses_to_chat(b"{not json", &Limits::default()).unwrap_err();
    assert_eq!(err.status, 400);
    let limits = Limits {
        max_body_bytes: 8,
        ..Limits::default()
    };
    let err = responses_to_chat(br#"{"model":"m","input":"x"}"#, &limits).unwrap_err();
    assert_eq!(err.status, 413);
    assert_eq!(
        error_body(413, &err.message)["error"]["code"],
        json!("request_too_large")
    );
    let refusal = direct_mode_refusal();
    assert_eq!(refusal.status, 503);
    let b = error_body(refusal.status, &refusal.message);
    assert_eq!(b["error"]["code"], json!(DIRECT_MODE_REFUSAL_CODE));
    assert_eq!(b["error"]["type"], json!("server_error"));
}

fn request(extra: Value) -> ChatRequest {
    let mut v = json!({ "model": "m", "input": "x" });
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    convert(v).unwrap()
}

#[test]
fn buffered_response_with_text_and_tool_calls() {
    let req = request(json!({ "tools": [{ "type": "function", "name": "f" }] }));
    let chat = json!({
        "id": "c", "object": "chat.completion", "created": 1, "model": "served",
        "choices": [{ "index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": "ok", "tool_calls": [
                { "id": "call_9", "type": "function", "function": { "name": "f", "arguments": "{\"a\":1}" } } ] } }],
        "usage": { "prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                   "prompt_tokens_details": { "cached_tokens": 4 } },
    });
    let r = chat_response_to_response(
        chat.to_string().as_bytes(),
        &req,
        1,
        1_700_000_000,
        &Limits::default(),
    )
    .unwrap();
    assert_eq!(r["id"], json!(response_id(1)));
    assert_eq!(r["object"], json!("response"));
    assert_eq!(r["status"], json!("completed"));
    assert_eq!(r["model"], json!("m"));
    assert_eq!(r["output"][0]["type"], json!("message"));
    assert_eq!(r["output"][0]["content"][0]["text"], json!("ok"));
    assert_eq!(
        r["output"][1],
        json!({ "id": call_item_id(1, 0), "type": "function_call", "status": "completed",
                "call_id": "call_9", "name": "f", "arguments": "{\"a\":1}" })
    );
    assert_eq!(r["usage"]["input_tokens"], json!(7));
    assert_eq!(r["usage"]["total_tokens"], json!(10));
    assert_eq!(
        r["usage"]["input_tokens_details"]["cached_tokens"],
        json!(4)
    );
    assert_eq!(r["tools"][0]["name"], json!("f"));

    let length =
        json!({ "choices": [{ "finish_reason": "length", "message": { "content": "a" } }] });
    let r = chat_response_to_response(
        length.to_string().as_bytes(),
        &req,
        1,
        0,
        &Limits::default(),
    )
    .unwrap();
    assert_eq!(r["status"], json!("incomplete"));
    assert_eq!(
        r["incomplete_details"],
        json!({ "reason": "max_output_tokens" })
    );
    for bad in [&b"{}"[..], b"nope", br#"{"choices":[{}]}"#] {
        let e = chat_response_to_response(bad, &req, 1, 0, &Limits::default()).unwrap_err();
        assert_eq!(e.status, 502);
    }
}

fn chunk(delta: Value, finish: Option<&str>) -> Vec<u8> {
    json!({ "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }] })
        .to_string()
        .into_bytes()
}

fn run(stream: &mut ResponsesStream, chunks: &[Vec<u8>]) -> Vec<SseEvent> {
    let mut out = Vec::new();
    for c in chunks {
        out.extend(stream.push(c));
    }
    out.extend(stream.finish());
    out
}

#[test]
fn stream_event_sequence_for_text_then_tool_call() {
    let req = request(json!({ "stream": true }));
    let mut s = ResponsesStream::new(&req, 2, 5, Limits::default());
    let usage = json!({ "choices": [], "usage": { "prompt_tokens": 4, "completion_tokens": 2 } })
        .to_string()
        .into_bytes();
    let events = run(
        &mut s,
        &[
            chunk(json!({ "role": "assistant", "content": "" }), None),
            chunk(json!({ "content": "He" }), None),
            chunk(json!({ "content": "llo" }), None),
            chunk(
                json!({ "tool_calls": [{ "index": 0, "id": "call_1", "type": "function",
                                  "function": { "name": "f", "arguments": "{\"a\"" } }] }),
                None,
            ),
            chunk(
                json!({ "tool_calls": [{ "index": 0, "function": { "arguments": ":1}" } }] }),
                None,
            ),
            chunk(json!({}), Some("tool_calls")),
            usage,
            b"[DONE]".to_vec(),
        ],
    );
    let names: Vec<&str> = events.iter().map(|e| e.event).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e.data["sequence_number"], json!(i));
        assert_eq!(e.data["type"], json!(e.event));
    }
    assert_eq!(events[6].data["text"], json!("Hello"));
    assert_eq!(events[12].data["arguments"], json!("{\"a\":1}"));
    assert_eq!(events[9].data["output_index"], json!(1));
    let done = &events[14].data["response"];
    assert_eq!(done["status"], json!("completed"));
    assert_eq!(done["output"].as_array().unwrap().len(), 2);
    assert_eq!(done["output"][1]["call_id"], json!("call_1"));
    assert_eq!(done["usage"]["output_tokens"], json!(2));
    assert!(s.is_done());
    assert!(
        s.push(&chunk(json!({ "content": "late" }), None))
            .is_empty()
    );
}

#[test]
fn stream_failures_end_with_response_failed() {
    let req = request(json!({ "stream": true }));
    let cases: Vec<Vec<Vec<u8>>> = vec![
        vec![b"not json".to_vec()],
        vec![br#"{"error":{"message":"boom"}}"#.to_vec()],
        vec![chunk(json!({ "content": "a" }), None)],
        vec![
            chunk(
                json!({ "tool_calls": [{ "index": 0, "function": { "name": "f" } }] }),
                None,
            ),
            chunk(json!({ "content": "b" }), None),
            chunk(
                json!({ "tool_calls": [{ "index": 0, "function": { "arguments": "{}" } }] }),
                None,
            ),
        ],
    ];
    for chunks in cases {
        let mut s = ResponsesStream::new(&req, 3, 0, Limits::default());
        let events = run(&mut s, &chunks);
        let last = events.last().unwrap();
        assert_eq!(last.event, "response.failed");
        assert_eq!(last.data["response"]["status"], json!("failed"));
        assert_eq!(
            last.data["response"]["error"]["code"],
            json!("server_error")
        );
        assert_eq!(
            events
                .iter()
                .filter(|e| e.event == "response.failed")
                .count(),
            1
        );
    }
    let limits = Limits {
        max_output_bytes: 3,
        ..Limits::default()
    };
    let mut s = ResponsesStream::new(&req, 3, 0, limits);
    let events = run(&mut s, &[chunk(json!({ "content": "abcd" }), Some("stop"))]);
    assert_eq!(events.last().unwrap().event, "response.failed");
}

#[test]
fn length_finish_is_response_incomplete() {
    let req = request(json!({ "stream": true }));
    let mut s = ResponsesStream::new(&req, 4, 0, Limits::default());
    let events = run(&mut s, &[chunk(json!({ "content": "a" }), Some("length"))]);
    let last = events.last().unwrap();
    assert_eq!(last.event, "response.incomplete");
    assert_eq!(
        last.data["response"]["incomplete_details"]["reason"],
        json!("max_output_tokens")
    );
}

fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        "[a-z_]{0,12}".prop_map(Value::String),
        prop_oneof![
            Just("message"),
            Just("function_call"),
            Just("function_call_output"),
            Just("input_text"),
            Just("input_image"),
            Just("user"),
            Just("assistant"),
            Just("function"),
        ]
        .prop_map(|s| json!(s)),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec(
                (
                    prop_oneof![
                        Just("type".to_owned()),
                        Just("role".to_owned()),
                        Just("content".to_owned()),
                        Just("text".to_owned()),
                        Just("call_id".to_owned()),
                        Just("name".to_owned()),
                        Just("arguments".to_owned()),
                        Just("output".to_owned()),
                        "[a-z]{1,6}",
                    ],
                    inner
                ),
                0..6
            )
            .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

proptest! {
    #[test]
    fn arbitrary_requests_never_panic(input in arb_json(), tools in arb_json(), tc in arb_json()) {
        let req = json!({ "model": "m", "input": input, "tools": tools, "tool_choice": tc });
        match convert(req) {
            Ok(r) => prop_assert!(r.body_json()["messages"].is_array()),
            Err(e) => prop_assert!(e.status == 400),
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = responses_to_chat(&bytes, &Limits::default());
    }

    #[test]
    fn arbitrary_chunk_sequences_end_exactly_once(
        chunks in prop::collection::vec(
            prop_oneof![
                "[a-z]{0,4}".prop_map(|t| chunk(json!({ "content": t }), None)),
                (0u64..3, "[a-z{}:\"]{0,4}").prop_map(|(i, a)| chunk(
                    json!({ "tool_calls": [{ "index": i, "function": { "name": "f", "arguments": a } }] }),
                    None,
                )),
                prop_oneof![Just("stop"), Just("length"), Just("tool_calls")]
                    .prop_map(|f| chunk(json!({}), Some(f))),
                Just(b"[DONE]".to_vec()),
                prop::collection::vec(any::<u8>(), 0..16),
            ],
            0..12,
        )
    ) {
        let req = request(json!({ "stream": true }));
        let mut s = ResponsesStream::new(&req, 9, 0, Limits::default());
        let events = run(&mut s, &chunks);
        prop_assert!(s.is_done());
        let terminal = events.iter().filter(|e| matches!(e.event,
            "response.completed" | "response.incomplete" | "response.failed")).count();
        prop_assert_eq!(terminal, 1);
        prop_assert_eq!(events[0].event, "response.created");
        for (i, e) in events.iter().enumerate() {
            prop_assert_eq!(&e.data["sequence_number"], &json!(i));
        }
        // Every added item is done before the terminal event.
        let added = events.iter().filter(|e| e.event == "response.output_item.added").count();
        let done = events.iter().filter(|e| e.event == "response.output_item.done").count();
        let last = events.last().unwrap();
        if last.event != "response.failed" {
            prop_assert_eq!(added, done);
        }
    }
}

fn refusal(req: &str) -> String {
    responses_to_chat(req.as_bytes(), &Limits::default())
        .expect_err("refused")
        .message
}

#[test]
fn refusals_name_the_path_of_the_bad_value() {
    let input = |items: &str| refusal(&format!(r#"{{"model":"m","input":{items}}}"#));
    assert_eq!(
        input(
            r#"[{"role":"user","content":"a"},{"role":"user","content":[{"type":"input_text","text":1}]}]"#
        ),
        "input[1].content[0].text: expected a string, got number"
    );
    assert_eq!(
        input(
            r#"[{"type":"function_call_output","call_id":"c","output":[{"type":"input_text","refusal":"x"}]}]"#
        ),
        "input[0].output[0].text: expected a string, got null"
    );
    assert_eq!(
        input(r#"[{"type":"message","role":"assistant","content":[{"type":"refusal"}]}]"#),
        "input[0].content[0].refusal: expected a string, got null"
    );
    assert_eq!(
        input(r#"[{"type":7}]"#),
        "input[0].type: expected a string, got number"
    );
    assert_eq!(
        refusal(
            r#"{"model":"m","input":"x","tools":[{"type":"function","name":"f","strict":"yes"}]}"#
        ),
        "tools[0].strict: expected a boolean, got string"
    );
}

/// The converted body is written directly: its exact text, key order included.
#[test]
fn the_chat_body_text_is_written_in_a_fixed_key_order() {
    let r = responses_to_chat(
        br#"{"stream":true,"text":{"format":{"type":"json_schema","name":"n","schema":{"type":"object"},"strict":true}},
            "parallel_tool_calls":false,"tool_choice":"required","user":"u","top_p":0.5,"temperature":1,
            "tools":[{"type":"function","name":"w","parameters":{"b":1,"a":2}}],"max_output_tokens":16,
            "input":[{"role":"developer","content":"d"},{"role":"user","content":[{"type":"input_image","image_url":"http://i","detail":"low"}]},
                     {"role":"assistant","content":"a"},{"type":"function_call","call_id":"c","name":"w","arguments":"{}"},
                     {"type":"function_call_output","call_id":"c","output":"o"}],
            "instructions":"s","model":"m"}"#,
        &Limits::default(),
    )
    .unwrap();
    assert_eq!(
        String::from_utf8(r.body).unwrap(),
        concat!(
            r#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"system","content":"d"},"#,
            r#"{"role":"user","content":[{"type":"image_url","image_url":{"url":"http://i","detail":"low"}}]},"#,
            r#"{"role":"assistant","content":"a","tool_calls":[{"id":"c","type":"function","function":{"name":"w","arguments":"{}"}}]},"#,
            r#"{"role":"tool","tool_call_id":"c","content":"o"}],"#,
            r#""max_tokens":16,"temperature":1,"top_p":0.5,"user":"u","#,
            r#""tools":[{"type":"function","function":{"name":"w","parameters":{"b":1,"a":2}}}],"#,
            r#""tool_choice":"required","parallel_tool_calls":false,"#,
            r#""response_format":{"type":"json_schema","json_schema":{"name":"n","schema":{"type":"object"},"strict":true}},"#,
            r#""stream":true,"stream_options":{"include_usage":true}}"#
        )
    );
}

#[test]
fn the_requested_model_is_read_without_converting() {
    assert_eq!(
        requested_model(br#"{"input":[{"x":1}],"model":"m","previous_response_id":"r"}"#),
        Some("m".into())
    );
    assert_eq!(requested_model(br#"{"model":3}"#), None);
    assert_eq!(requested_model(br#"{"model":"m""#), None);
    assert_eq!(requested_model(b"[]"), None);
}
