//! Mid-stream fallback of the native `/v1/responses` passthrough (issue 31) through
//! `Router::serve` against two loopback fake upstreams: b1 (`responses_api: native`) streams the
//! Responses events and is cut, b2 (converted, so it serves chat completions only) answers the
//! chat-completions continuation, whose chunks the router writes into the client's Responses
//! stream. The last test runs the official `openai` SDK over such a stream (`real-peers`).

use crate::support::mid_stream::{Fleet, armed, cut_once, proxy, read_until, rest_of};
use crate::support::upstream::{FakeUpstream, Recorded, Reply};

use std::sync::Arc;

use bytes::Bytes;
use continuum_actors::metrics::Metrics;
use continuum_router::config::schema::{
    BackendConfig, HumanDuration, MidStreamFallbackConfig, ResponsesApi,
};
use continuum_router::proxy::OpenAiRoute;
use continuum_router::route::Router;
use serde_json::{Value, json};
use tokio::sync::mpsc;

const RESP: &str = "resp_orig";
const MSG: &str = "msg_orig";

/// b1 serves `/v1/responses` natively (the original goes there); b2 serves chat completions.
fn backends(b1: &str, b2: &str) -> Vec<BackendConfig> {
    let mut native = crate::support::upstream::backend_config("b1", b1, &["m"]);
    native.responses_api = ResponsesApi::Native;
    vec![
        native,
        crate::support::upstream::backend_config("b2", b2, &["m"]),
    ]
}

async fn fleet(tune: impl FnOnce(&mut MidStreamFallbackConfig)) -> Fleet {
    let body = json!({"model": "m", "stream": true, "max_output_tokens": 50,
                      "instructions": "be brief", "input": "q"});
    let request = (OpenAiRoute::Responses, body, "responses");
    Fleet::start(backends, tune, request).await
}

fn event(kind: &str, seq: u64, mut data: Value) -> Bytes {
    data["type"] = json!(kind);
    data["sequence_number"] = json!(seq);
    Bytes::from(format!("event: {kind}\ndata: {data}\n\n"))
}

fn response(status: &str) -> Value {
    json!({"id": RESP, "object": "response", "created_at": 1_700_000_000, "status": status,
           "model": "m", "output": [], "usage": null, "error": null, "incomplete_details": null,
           "instructions": "be brief", "tools": [], "tool_choice": "auto",
           "parallel_tool_calls": true, "max_output_tokens": 50})
}

fn delta(seq: u64, text: &str) -> Bytes {
    event(
        "response.output_text.delta",
        seq,
        json!({"item_id": MSG, "output_index": 0, "content_index": 0, "delta": text,
               "logprobs": []}),
    )
}

/// The original's first events: created, in progress, the message item and its part, "Hello",
/// " wor" (sequence numbers 0..=5).
fn original_events() -> Vec<Bytes> {
    let item = json!({"id": MSG, "type": "message", "role": "assistant",
                      "status": "in_progress", "content": []});
    let part = json!({"type": "output_text", "text": "", "annotations": []});
    vec![
        event(
            "response.created",
            0,
            json!({"response": response("in_progress")}),
        ),
        event(
            "response.in_progress",
            1,
            json!({"response": response("in_progress")}),
        ),
        event(
            "response.output_item.added",
            2,
            json!({"output_index": 0, "item": item}),
        ),
        event(
            "response.content_part.added",
            3,
            json!({"item_id": MSG, "output_index": 0, "content_index": 0, "part": part}),
        ),
        delta(4, "Hello"),
        delta(5, " wor"),
    ]
}

/// The original's events, then half of the next one (a cut inside an event).
fn send_original(tx: &mpsc::UnboundedSender<Bytes>) {
    for bytes in original_events() {
        tx.send(bytes).expect("b1 streaming");
    }
    tx.send(Bytes::from_static(
        b"event: response.output_text.delta\ndata: {\"ty",
    ))
    .expect("b1 streaming");
}

/// The chat-completions continuation: a role chunk, "ld!", the final chunk, usage, `[DONE]`.
fn continuation_chunks() -> Vec<Bytes> {
    let chunk = |delta: Value, finish: Option<&str>| {
        let c = json!({"id": "cont", "object": "chat.completion.chunk", "created": 2,
                       "model": "m", "choices": [{"index": 0, "delta": delta,
                       "finish_reason": finish}]});
        Bytes::from(format!("data: {c}\n\n"))
    };
    let usage = json!({"id": "cont", "choices": [],
                       "usage": {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}});
    vec![
        chunk(json!({"role": "assistant", "content": ""}), None),
        chunk(json!({"content": "ld!"}), None),
        chunk(json!({}), Some("stop")),
        Bytes::from(format!("data: {usage}\n\n")),
        Bytes::from_static(b"data: [DONE]\n\n"),
    ]
}

fn send_rest(tx: &mpsc::UnboundedSender<Bytes>) {
    for bytes in continuation_chunks() {
        tx.send(bytes).expect("b2 streaming");
    }
}

/// The `data` objects of a relayed Responses stream, in order.
fn events(bytes: &[u8]) -> Vec<Value> {
    let text = std::str::from_utf8(bytes).expect("utf8");
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let data = e.lines().find_map(|l| l.strip_prefix("data: "));
            serde_json::from_str(data.expect("a data line")).expect("json")
        })
        .collect()
}

/// Checks one well-formed stream and returns (deltas, terminal event types, terminal event).
fn read(events: &[Value]) -> (String, Vec<String>, Value) {
    let seqs: Vec<u64> = events
        .iter()
        .map(|e| e["sequence_number"].as_u64().expect("sequence_number"))
        .collect();
    assert!(
        seqs.windows(2).all(|w| w[0] < w[1]),
        "sequence numbers strictly increase: {seqs:?}"
    );
    let (mut text, mut terminals, mut last) = (String::new(), vec![], Value::Null);
    for e in events {
        let kind = e["type"].as_str().expect("type");
        if let Some(response) = e.get("response") {
            assert_eq!(response["id"], RESP, "one response id");
        }
        if kind == "response.output_text.delta" {
            assert_eq!(
                (&e["item_id"], &e["output_index"], &e["content_index"]),
                (&json!(MSG), &json!(0), &json!(0)),
                "the original item"
            );
            text += e["delta"].as_str().expect("delta");
        }
        if ["response.completed", "response.failed", "error"].contains(&kind) {
            terminals.push(kind.to_owned());
            last = e.clone();
        }
    }
    (text, terminals, last)
}

fn assert_continuation_request(recorded: &Recorded) {
    assert_eq!(recorded.path, "/v1/chat/completions");
    let body = recorded.json();
    let messages = body["messages"].as_array().expect("messages");
    assert_eq!(messages[0]["role"], "system", "the instructions, converted");
    assert_eq!(
        messages.last().expect("last"),
        &json!({"role": "assistant", "content": "Hello wor"})
    );
    assert_eq!(body["continue_final_message"], json!(true));
    assert_eq!(body["add_generation_prompt"], json!(false));
    assert_eq!(body["stream"], json!(true));
    assert!(body["max_tokens"].as_u64().expect("max_tokens") < 50);
}

/// b1 is cut as `reason` says after " wor"; b2 continues.
async fn continued_after(reason: &str) {
    let mut f = fleet(|_| {}).await;
    let (tx1, rx1) = mpsc::unbounded_channel();
    let (tx2, rx2) = mpsc::unbounded_channel();
    f.b1.push(Reply::SseThenCut(rx1));
    f.b2.push(Reply::SseThenCut(rx2));
    let resp = f.stream().await;
    assert_eq!(f.b1.next_request().await.path, "/v1/responses");
    if reason == "error_event" {
        for bytes in original_events() {
            tx1.send(bytes).expect("b1 streaming");
        }
    } else {
        send_original(&tx1);
    }
    let mut body = resp.into_body();
    let seen = read_until(&mut body, " wor").await;
    // "stalled": b1 stays open and silent; the paused clock reaches the inactivity timeout.
    let mut open = Some(tx1);
    if reason == "error_event" {
        let error = event(
            "error",
            6,
            json!({"code": "server_error", "message": "engine died", "param": null}),
        );
        open.as_ref().expect("open").send(error).expect("b1");
    } else if reason == "closed" {
        open = None;
    }
    send_rest(&tx2);
    let collect = tokio::spawn(rest_of(seen, body));
    // Bounded, so that a router that never continues fails here instead of hanging.
    let asked = tokio::time::timeout(std::time::Duration::from_secs(600), f.b2.next_request());
    assert_continuation_request(&asked.await.expect("a continuation request"));
    drop(tx2);
    let bytes = collect.await.expect("join");
    let all = events(&bytes);
    let (text, terminals, done) = read(&all);
    assert_eq!(text, "Hello world!");
    assert_eq!(terminals, ["response.completed"]);
    assert_eq!(all[6]["sequence_number"], 6, "the next sequence number");
    let output = &done["response"]["output"];
    assert_eq!(output[0]["id"], MSG);
    assert_eq!(output[0]["content"][0]["text"], "Hello world!");
    assert_eq!(done["response"]["instructions"], "be brief");
    let usage = &done["response"]["usage"];
    let sent = usage["output_tokens"].as_u64().expect("output") - 2;
    assert_eq!(usage["input_tokens"], json!(12 - sent));
    assert_eq!(f.count(reason, "continued"), 1);
    drop(open);
}

#[tokio::test]
async fn a_responses_stream_cut_after_n_events_is_continued_seamlessly() {
    continued_after("closed").await;
}

#[tokio::test]
async fn a_responses_error_event_is_continued() {
    continued_after("error_event").await;
}

#[tokio::test(start_paused = true)]
async fn a_stalled_responses_stream_is_continued() {
    continued_after("stalled").await;
}

#[tokio::test]
async fn a_responses_fallback_that_fails_too_ends_with_one_response_failed() {
    let mut f = fleet(|_| {}).await;
    f.b2.push(Reply::status(500));
    let bytes = cut_once(&mut f, send_original, " wor").await;
    let (text, terminals, failed) = read(&events(&bytes));
    assert_eq!(text, "Hello wor");
    assert_eq!(terminals, ["response.failed"]);
    assert_eq!(failed["response"]["status"], "failed");
    assert_eq!(failed["response"]["error"]["code"], "server_error");
    assert_continuation_request(&f.b2.next_request().await);
    assert_eq!(f.count("closed", "fallback_failed"), 1);
}

#[tokio::test]
async fn a_responses_cut_inside_a_function_call_is_not_continued() {
    let mut f = fleet(|_| {}).await;
    let send = |tx: &mpsc::UnboundedSender<Bytes>| {
        let call = json!({"id": "fc_1", "type": "function_call", "call_id": "c", "name": "f",
                          "arguments": "", "status": "in_progress"});
        let args = json!({"item_id": "fc_1", "output_index": 0, "delta": "{\"a"});
        for bytes in [
            event(
                "response.created",
                0,
                json!({"response": response("in_progress")}),
            ),
            event(
                "response.output_item.added",
                1,
                json!({"output_index": 0, "item": call}),
            ),
            event("response.function_call_arguments.delta", 2, args),
        ] {
            tx.send(bytes).expect("b1 streaming");
        }
    };
    let bytes = cut_once(&mut f, send, "arguments.delta").await;
    let (_, terminals, _) = read(&events(&bytes));
    assert_eq!(terminals, ["response.failed"]);
    assert_eq!(f.count("closed", "refused_tool_call"), 1);
    assert!(f.b2.try_request().is_none());
}

#[tokio::test]
async fn switched_off_a_cut_responses_stream_is_relayed_as_before() {
    let mut f = fleet(|c| c.enabled = false).await;
    let bytes = cut_once(&mut f, send_original, " wor").await;
    let text = String::from_utf8_lossy(&bytes);
    assert!(text.contains("the upstream stream failed"), "{text}");
    assert!(!text.contains("response.completed"), "{text}");
    assert!(f.b2.try_request().is_none());
}

#[tokio::test]
async fn a_client_leaving_during_a_responses_continuation_drops_the_upstream_request() {
    let mut f = fleet(|c| c.inactivity_timeout = HumanDuration::from_secs(600)).await;
    let (tx1, rx1) = mpsc::unbounded_channel();
    let (tx2, rx2) = mpsc::unbounded_channel();
    f.b1.push(Reply::SseThenCut(rx1));
    f.b2.push(Reply::Sse(rx2));
    let resp = f.stream().await;
    f.b1.next_request().await;
    send_original(&tx1);
    let mut body = resp.into_body();
    read_until(&mut body, " wor").await;
    drop(tx1);
    tx2.send(continuation_chunks()[1].clone()).expect("b2");
    read_until(&mut body, "ld!").await;
    f.b2.next_request().await;
    drop(body);
    tx2.closed().await;
}

/// The official `openai` SDK consumes cut-and-continued native Responses streams without an
/// exception, raw (`responses.create(stream=True)`) and through its accumulating helper
/// (`responses.stream()`, which checks ids, output indexes and the final response):
/// `tests/fixtures/ingress/mid_stream_responses_sdk.py` under `CONTINUUM_PYTHON`.
#[cfg(feature = "real-peers")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_consumes_a_continued_responses_stream() {
    use arc_swap::ArcSwap;
    use continuum_actors::tree::ActorTree;
    use continuum_router::front_door::{self, AppState, LiveSettings};
    use continuum_router::readiness::Readiness;

    let (b1, mut b2) = (FakeUpstream::start().await, FakeUpstream::start().await);
    // Two calls: the first original is cut inside an event once its text reached the client,
    // the second sends an engine error event; each continuation answers the rest.
    let mut originals = std::collections::VecDeque::new();
    for call in 0..2 {
        let (tx1, rx1) = mpsc::unbounded_channel();
        if call == 0 {
            send_original(&tx1);
        } else {
            original_events()
                .into_iter()
                .for_each(|b| tx1.send(b).expect("b1"));
        }
        b1.push(Reply::SseThenCut(rx1));
        originals.push_back(tx1);
        let (tx2, rx2) = mpsc::unbounded_channel();
        send_rest(&tx2);
        b2.push(Reply::Sse(rx2));
    }
    let metrics = Metrics::new("mid-stream-responses-sdk").expect("metrics");
    let proxy = proxy(
        &backends(&b1.url(), &b2.url()),
        Some(metrics.clone()),
        armed(|_| {}),
    );
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
        route: Arc::new(Router::new(Arc::new(proxy))),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        let _ = axum::serve(listener, front_door::router(state)).await;
    });
    let python = std::env::var("CONTINUUM_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/ingress/mid_stream_responses_sdk.py"
    );
    let mut child = tokio::process::Command::new(&python)
        .args([script, &base])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {python} (set CONTINUUM_PYTHON): {e}"));
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
    let mut said = Vec::new();
    loop {
        let line = tokio::time::timeout(std::time::Duration::from_secs(60), lines.next_line())
            .await
            .expect("the SDK script answers within a minute")
            .expect("the script's stdout");
        let Some(line) = line else {
            let out = child.wait_with_output().await.expect("the script's exit");
            panic!(
                "the SDK script failed after {said:?}:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        said.push(line.clone());
        match line.as_str() {
            // The call's first text reached the client: cut its original.
            "FIRST" => match originals.len() {
                2 => drop(originals.pop_front()),
                _ => {
                    let error = json!({"code": "server_error", "message": "engine died"});
                    let tx1 = originals.front().expect("the second original");
                    tx1.send(event("error", 6, error)).expect("b1");
                }
            },
            "OK" => break,
            _ => {}
        }
    }
    for _ in 0..2 {
        assert_continuation_request(&b2.next_request().await);
    }
    let text = metrics.render();
    for reason in ["closed", "error_event"] {
        let labels = format!(r#"ingress="responses",reason="{reason}",result="continued""#);
        let once = |l: &&str| l.contains(&labels) && l.ends_with(" 1");
        assert!(text.lines().any(|l| once(&l)), "{text}");
    }
    drop(originals);
}
