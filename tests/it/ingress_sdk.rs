//! The Anthropic Messages and OpenAI Responses ingresses driven end to end by the real
//! `anthropic` and `openai` Python SDKs (`real-peers`): the router serves on a loopback socket in
//! front of a local hyper upstream that answers OpenAI chat completions with tool calls, buffered
//! and streamed. `tests/fixtures/ingress/drive_sdks.py` (run under `CONTINUUM_PYTHON`) makes the
//! calls and checks every parsed answer; this side scripts the upstream and checks what reached
//! it: the converted chat bodies, tool round trips, and no client pin (header or `nvext`).
#![cfg(feature = "real-peers")]

use std::sync::Arc;
use std::time::Duration;

use crate::support::upstream::{FakeUpstream, Recorded, Reply};
use arc_swap::ArcSwap;
use axum::http::StatusCode;
use bytes::Bytes;
use continuum_actors::tree::ActorTree;
use continuum_router::config::schema::{BackendConfig, DisaggregatedServingConfig};
use continuum_router::front_door::{self, AppState, LiveSettings};
use continuum_router::proxy::{Proxy, ProxyOptions};
use continuum_router::readiness::Readiness;
use continuum_router::route::Router;
use serde_json::{Value, json};
use tokio::sync::mpsc;

/// Small enough that the scripts' oversized requests are refused with 413.
const BODY_LIMIT: usize = 64 * 1024;

fn backend(url: &str) -> BackendConfig {
    crate::support::upstream::backend_config("up", url, &["m"])
}

/// The router on a loopback socket; returns its base URL.
async fn serve_router(backends: &[BackendConfig]) -> String {
    let options = ProxyOptions {
        max_request_body_bytes: BODY_LIMIT,
        ..ProxyOptions::default()
    };
    let proxy = Arc::new(Proxy::new(options, None));
    proxy.set_backends(backends, &DisaggregatedServingConfig::default());
    let (control, _rx) = mpsc::channel(1);
    let state = AppState {
        live: Arc::new(ArcSwap::from_pointee(LiveSettings::default())),
        readiness: Readiness::new(),
        metrics: Arc::new(String::new),
        tree: ActorTree::default(),
        control,
        dynamo_workers: Arc::new(|| json!({})),
        fleet_summary: Arc::new(|| json!({})),
        fleet_models: Arc::new(|_: &[String]| Vec::new()),
        route: Arc::new(Router::new(proxy)),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, front_door::router(state)).await;
    });
    format!("http://{addr}")
}

fn usage(completion: u64) -> Value {
    json!({ "prompt_tokens": 12, "completion_tokens": completion,
            "total_tokens": 12 + completion })
}

fn buffered(message: Value, finish: &str) -> Reply {
    Reply::Json(
        StatusCode::OK,
        json!({ "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
                "choices": [{ "index": 0, "message": message, "finish_reason": finish }],
                "usage": usage(5) }),
        vec![],
    )
}

fn text(t: &str) -> Reply {
    buffered(json!({ "role": "assistant", "content": t }), "stop")
}

fn tool_call() -> Reply {
    buffered(
        json!({ "role": "assistant", "content": null, "tool_calls": [
            { "id": "call_1", "type": "function",
              "function": { "name": "weather", "arguments": "{\"city\":\"Paris\"}" } } ] }),
        "tool_calls",
    )
}

/// A streamed answer: text, then a tool call whose arguments arrive in two fragments.
fn streamed() -> Reply {
    let (tx, rx) = mpsc::unbounded_channel();
    let chunk = |delta: Value, finish: Value| {
        json!({ "id": "chatcmpl-2", "object": "chat.completion.chunk", "created": 1, "model": "m",
                "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }] })
    };
    let events = [
        chunk(json!({ "role": "assistant", "content": "" }), Value::Null),
        chunk(json!({ "content": "Let me " }), Value::Null),
        chunk(json!({ "content": "check." }), Value::Null),
        chunk(
            json!({ "tool_calls": [{ "index": 0, "id": "call_2", "type": "function",
                                     "function": { "name": "weather", "arguments": "{\"city\"" } }] }),
            Value::Null,
        ),
        chunk(
            json!({ "tool_calls": [{ "index": 0, "function": { "arguments": ":\"Paris\"}" } }] }),
            Value::Null,
        ),
        chunk(json!({}), json!("tool_calls")),
        json!({ "id": "chatcmpl-2", "object": "chat.completion.chunk", "created": 1, "model": "m",
                "choices": [], "usage": usage(9) }),
    ];
    for e in events {
        tx.send(Bytes::from(format!("data: {e}\n\n")))
            .expect("queued");
    }
    tx.send(Bytes::from_static(b"data: [DONE]\n\n"))
        .expect("queued");
    Reply::Sse(rx)
}

async fn drive(base: &str, scenario: &str) {
    let python = std::env::var("CONTINUUM_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/ingress/drive_sdks.py"
    );
    let run = tokio::process::Command::new(&python)
        .args([script, base, scenario])
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the SDK script finishes within 120 s")
        .unwrap_or_else(|e| panic!("starting {python} (set CONTINUUM_PYTHON): {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.trim_end().ends_with("OK"),
        "{scenario} failed (needs anthropic + openai in {python}):\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn assert_unpinned(seen: &Recorded) {
    for (name, _) in &seen.headers {
        let name = name.as_str();
        assert!(
            !name.starts_with("x-dynamo-") && name != "x-worker-instance-id",
            "client pin {name} reached the upstream"
        );
    }
    assert!(
        seen.json().get("nvext").is_none(),
        "nvext reached the upstream"
    );
}

/// The four chat requests each scenario makes, in order.
async fn four(up: &mut FakeUpstream) -> [Value; 4] {
    let first = up.next_request().await;
    assert_unpinned(&first);
    let mut out = [first.json(), Value::Null, Value::Null, Value::Null];
    for slot in out.iter_mut().skip(1) {
        let seen = up.next_request().await;
        assert_eq!(seen.path, "/v1/chat/completions");
        assert_unpinned(&seen);
        *slot = seen.json();
    }
    assert!(
        up.try_request().is_none(),
        "refused requests reached the upstream"
    );
    out
}

fn script(up: &FakeUpstream) {
    up.push(text("Sunny."));
    up.push(tool_call());
    up.push(text("Sunny."));
    up.push(streamed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_sdk_buffered_streamed_tools_and_errors() {
    let mut up = FakeUpstream::start().await;
    script(&up);
    let base = serve_router(&[backend(&up.url())]).await;
    drive(&base, "messages").await;
    let [first, _, round_trip, stream] = four(&mut up).await;
    assert_eq!(
        first,
        json!({ "model": "m", "messages": [{ "role": "user", "content": "hi" }], "max_tokens": 64 })
    );
    let msgs = round_trip["messages"].as_array().expect("messages");
    assert_eq!(
        msgs[1]["tool_calls"][0]["function"],
        json!({ "name": "weather", "arguments": "{\"city\":\"Paris\"}" })
    );
    assert_eq!(
        msgs[2],
        json!({ "role": "tool", "tool_call_id": "call_1", "content": "18C, clear" })
    );
    assert_eq!(stream["stream"], json!(true));
    assert_eq!(stream["stream_options"], json!({ "include_usage": true }));
    assert_eq!(stream["tools"][0]["function"]["name"], json!("weather"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_sdk_responses_buffered_streamed_tools_and_errors() {
    let mut up = FakeUpstream::start().await;
    script(&up);
    let base = serve_router(&[backend(&up.url())]).await;
    drive(&base, "responses").await;
    let [first, _, round_trip, stream] = four(&mut up).await;
    assert_eq!(
        first["messages"],
        json!([{ "role": "system", "content": "be brief" }, { "role": "user", "content": "hi" }])
    );
    let msgs = round_trip["messages"].as_array().expect("messages");
    assert_eq!(msgs[1]["role"], json!("assistant"));
    assert_eq!(msgs[1]["tool_calls"][0]["id"], json!("call_1"));
    assert_eq!(
        msgs[2],
        json!({ "role": "tool", "tool_call_id": "call_1", "content": "18C" })
    );
    assert_eq!(stream["stream"], json!(true));
    assert_eq!(stream["tools"][0]["function"]["name"], json!("weather"));
}

/// `responses_api: native`: `/v1/responses` bodies pass through to the backend's own route, and
/// `/v1/responses/compact` always does; pins are stripped from both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_responses_pass_through() {
    let mut up = FakeUpstream::start().await;
    let mut native = backend(&up.url());
    native.responses_api = continuum_router::config::schema::ResponsesApi::Native;
    let answer = json!({ "id": "resp_native", "object": "response" });
    up.push(Reply::Json(StatusCode::OK, answer.clone(), vec![]));
    up.push(Reply::Json(StatusCode::OK, answer.clone(), vec![]));
    let base = serve_router(&[native]).await;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::new();
    let body = json!({ "model": "m", "input": "hi", "previous_response_id": "resp_0",
                       "nvext": { "backend_instance_id": 7 } });
    for path in ["/v1/responses", "/v1/responses/compact"] {
        let resp = client
            .post(format!("{base}{path}"))
            .header("x-dynamo-decode-instance-id", "7")
            .json(&body)
            .send()
            .await
            .expect("router answers");
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.json::<Value>().await.expect("json"), answer);
        let seen = up.next_request().await;
        assert_eq!(seen.path, path);
        assert_unpinned(&seen);
        assert_eq!(seen.json()["previous_response_id"], json!("resp_0"));
    }
}

/// A model a backend lists in `responses_only_models`, asked for through the Anthropic ingress,
/// goes to the backend's own `/v1/responses` as a Responses request (pinned by model alone on the
/// shim path) and comes back as an Anthropic `Message` or event stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_only_models_take_the_native_passthrough_from_the_anthropic_ingress() {
    let mut up = FakeUpstream::start().await;
    let mut only = backend(&up.url());
    only.responses_api = continuum_router::config::schema::ResponsesApi::Native;
    only.responses_only_models = vec!["m".into()];
    let answer = json!({ "id": "resp_1", "object": "response", "status": "completed",
        "output": [{ "type": "message", "role": "assistant",
                     "content": [{ "type": "output_text", "text": "Bonjour." }] }],
        "usage": { "input_tokens": 9, "output_tokens": 2 } });
    up.push(Reply::Json(StatusCode::OK, answer, vec![]));
    let (tx, rx) = mpsc::unbounded_channel();
    for e in [
        json!({ "type": "response.created", "response": { "status": "in_progress" } }),
        json!({ "type": "response.output_text.delta", "output_index": 0, "delta": "Bon" }),
        json!({ "type": "response.output_text.delta", "output_index": 0, "delta": "jour." }),
        json!({ "type": "response.completed", "response": { "status": "completed",
                "usage": { "input_tokens": 9, "output_tokens": 2 } } }),
    ] {
        tx.send(Bytes::from(format!(
            "event: {}\ndata: {e}\n\n",
            e["type"].as_str().expect("type")
        )))
        .expect("queued");
    }
    drop(tx);
    up.push(Reply::Sse(rx));
    let base = serve_router(&[only]).await;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::new();
    let body = |stream: bool| {
        json!({ "model": "m", "max_tokens": 16, "system": "Answer in French.", "stream": stream,
                "messages": [{ "role": "user", "content": "Hello" }] })
    };

    let resp = client
        .post(format!("{base}/v1/messages"))
        .json(&body(false))
        .send()
        .await
        .expect("router answers");
    assert_eq!(resp.status(), 200);
    let message: Value = resp.json().await.expect("json");
    assert_eq!(message["type"], "message");
    assert_eq!(
        message["content"],
        json!([{ "type": "text", "text": "Bonjour." }])
    );
    assert_eq!(message["stop_reason"], "end_turn");
    assert_eq!(message["usage"]["output_tokens"], 2);
    let seen = up.next_request().await;
    assert_eq!(seen.path, "/v1/responses");
    assert_unpinned(&seen);
    let sent = seen.json();
    assert_eq!(sent["model"], "m");
    assert_eq!(sent["instructions"], "Answer in French.");
    assert_eq!(sent["max_output_tokens"], 16);
    assert_eq!(
        sent["input"],
        json!([{ "role": "user", "content": [{ "type": "input_text", "text": "Hello" }] }])
    );
    assert!(sent.get("messages").is_none());

    let resp = client
        .post(format!("{base}/v1/messages"))
        .json(&body(true))
        .send()
        .await
        .expect("router answers");
    assert_eq!(resp.status(), 200);
    let text = resp.text().await.expect("stream");
    assert!(text.starts_with("event: message_start"), "{text}");
    assert!(text.contains("\"text\":\"Bon\"") && text.contains("\"text\":\"jour.\""));
    assert!(text.contains("event: message_stop"), "{text}");
    let seen = up.next_request().await;
    assert_eq!(seen.path, "/v1/responses");
    assert_eq!(seen.json()["stream"], json!(true));
}

/// Malformed bodies are 400s in each ingress's format and never reach the upstream; an upstream
/// refusal keeps its status and is reshaped (Anthropic `rate_limit_error`, OpenAI error object).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_leave_in_each_ingress_format() {
    let mut up = FakeUpstream::start().await;
    let base = serve_router(&[backend(&up.url())]).await;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::new();
    let post = |path: &str, body: &'static str| {
        client
            .post(format!("{base}{path}"))
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    for path in ["/v1/messages", "/anthropic/v1/messages"] {
        let resp = post(path, "{not json").await.expect("answer");
        assert_eq!(resp.status(), 400);
        let v: Value = resp.json().await.expect("json");
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    let resp = post("/v1/responses", r#"{"model":"m","input":7}"#)
        .await
        .expect("answer");
    assert_eq!(resp.status(), 400);
    let v: Value = resp.json().await.expect("json");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(
        v["error"]["message"]
            .as_str()
            .expect("message")
            .contains("input")
    );
    assert!(
        up.try_request().is_none(),
        "a malformed body reached the upstream"
    );

    up.push(Reply::status(429));
    let resp = post(
        "/v1/messages",
        r#"{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"x"}]}"#,
    )
    .await
    .expect("answer");
    assert_eq!(resp.status(), 429);
    let v: Value = resp.json().await.expect("json");
    assert_eq!(v["error"]["type"], "rate_limit_error");
    assert_eq!(v["error"]["message"], "scripted");
    up.next_request().await;

    up.push(Reply::status(429));
    let resp = post("/v1/responses", r#"{"model":"m","input":"x"}"#)
        .await
        .expect("answer");
    assert_eq!(resp.status(), 429);
    let v: Value = resp.json().await.expect("json");
    assert_eq!(v["error"]["type"], "rate_limit_error");
    up.next_request().await;

    // An unknown model: the router's own 404, reshaped.
    let resp = post(
        "/v1/messages",
        r#"{"model":"nope","max_tokens":8,"messages":[{"role":"user","content":"x"}]}"#,
    )
    .await
    .expect("answer");
    assert_eq!(resp.status(), 404);
    let v: Value = resp.json().await.expect("json");
    assert_eq!(v["error"]["type"], "not_found_error");
}
