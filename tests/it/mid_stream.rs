//! Mid-stream fallback of chat-completions and completions streams (issue 31) through `Router::serve` against
//! two loopback fake upstreams: b1 answers first and is cut, b2 is the unified fallback (the
//! round-robin cursor of a fresh pool starts at b1, and a continuation excludes b1).

use crate::support::mid_stream::{Fleet, cut_once, read_until, rest_of};
use crate::support::upstream::{Recorded, Reply};

use axum::http::{HeaderMap, StatusCode};
use bytes::Bytes;
use continuum_router::config::schema::{HumanDuration, MidStreamFallbackConfig};
use continuum_router::proxy::OpenAiRoute;
use continuum_router::route::Caller;
use serde_json::{Value, json};
use tokio::sync::mpsc;

async fn fleet(tune: impl FnOnce(&mut MidStreamFallbackConfig)) -> Fleet {
    let backends = |b1: &str, b2: &str| {
        ["b1", "b2"]
            .into_iter()
            .zip([b1, b2])
            .map(|(name, url)| crate::support::upstream::backend_config(name, url, &["m"]))
            .collect()
    };
    let body = json!({"model": "m", "stream": true, "max_tokens": 50,
                      "messages": [{"role": "user", "content": "q"}]});
    let request = (OpenAiRoute::ChatCompletions, body, "chat_completions");
    Fleet::start(backends, tune, request).await
}

fn chunk(id: &str, delta: Value, finish: Option<&str>) -> Bytes {
    let c = json!({"id": id, "object": "chat.completion.chunk", "created": 11, "model": id,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
    Bytes::from(format!("data: {c}\n\n"))
}

fn content(id: &str, text: &str) -> Bytes {
    chunk(id, json!({"content": text}), None)
}

/// Sends the original's first events: the role, "Hello", " wor", then half an event.
fn send_original(tx: &mpsc::UnboundedSender<Bytes>) {
    send_whole_events(tx);
    tx.send(Bytes::from_static(b"data: {\"id\":\"orig\",\"choi"))
        .expect("b1 streaming");
}

/// The role, "Hello", " wor".
fn send_whole_events(tx: &mpsc::UnboundedSender<Bytes>) {
    for bytes in [
        chunk("orig", json!({"role": "assistant", "content": ""}), None),
        content("orig", "Hello"),
        content("orig", " wor"),
    ] {
        tx.send(bytes).expect("b1 streaming");
    }
}

/// The continuation's answer: a role chunk, "ld!", the final chunk, usage and `[DONE]`.
fn send_rest(tx: &mpsc::UnboundedSender<Bytes>) {
    let usage = json!({"id": "cont", "choices": [],
                       "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}});
    for bytes in [
        chunk("cont", json!({"role": "assistant", "content": ""}), None),
        content("cont", "ld!"),
        chunk("cont", json!({}), Some("stop")),
        Bytes::from(format!("data: {usage}\n\n")),
        Bytes::from_static(b"data: [DONE]\n\n"),
    ] {
        tx.send(bytes).expect("b2 streaming");
    }
}

/// Text, ids, final chunks, `[DONE]`s and error events of a relayed stream.
fn read(bytes: &[u8]) -> (String, Vec<String>, usize, usize, usize) {
    let text = std::str::from_utf8(bytes).expect("utf8");
    let (mut answer, mut ids, mut finals, mut dones, mut errors) = (String::new(), vec![], 0, 0, 0);
    for event in text.split("\n\n").filter(|e| !e.is_empty()) {
        let data = event.strip_prefix("data: ").expect("data events");
        if data == "[DONE]" {
            dones += 1;
            continue;
        }
        let v: Value = serde_json::from_str(data).expect("json");
        if v.get("error").is_some() {
            errors += 1;
            continue;
        }
        ids.push(v["id"].as_str().expect("id").to_owned());
        for c in v["choices"].as_array().expect("choices") {
            answer += c["delta"]["content"].as_str().unwrap_or("");
            finals += usize::from(!c["finish_reason"].is_null());
        }
    }
    (answer, ids, finals, dones, errors)
}

fn assert_continuation_request(recorded: &Recorded) {
    let body = recorded.json();
    let messages = body["messages"].as_array().expect("messages");
    assert_eq!(
        messages.last().expect("last"),
        &json!({"role": "assistant", "content": "Hello wor"})
    );
    assert_eq!(body["continue_final_message"], json!(true));
    assert_eq!(body["add_generation_prompt"], json!(false));
    assert!(body["max_tokens"].as_u64().expect("max_tokens") < 50);
}

/// b1 is cut as `reason` says after its first events; b2 continues.
async fn continued_after(reason: &str) {
    let mut f = fleet(|_| {}).await;
    let (tx1, rx1) = mpsc::unbounded_channel();
    let (tx2, rx2) = mpsc::unbounded_channel();
    f.b1.push(Reply::SseThenCut(rx1));
    f.b2.push(Reply::SseThenCut(rx2));
    let resp = f.stream().await;
    f.b1.next_request().await;
    if reason == "error_event" {
        send_whole_events(&tx1);
    } else {
        send_original(&tx1);
    }
    let mut body = resp.into_body();
    let seen = read_until(&mut body, " wor").await;
    // "stalled": b1 stays open and silent; the paused clock reaches the inactivity timeout.
    let mut open = Some(tx1);
    if reason == "error_event" {
        let error = b"data: {\"error\":{\"message\":\"engine died\",\"code\":500}}\n\n";
        let tx1 = open.as_ref().expect("open");
        tx1.send(Bytes::from_static(error)).expect("b1 streaming");
    } else if reason == "closed" {
        open = None;
    }
    send_rest(&tx2);
    let collect = tokio::spawn(rest_of(seen, body));
    assert_continuation_request(&f.b2.next_request().await);
    drop(tx2);
    let bytes = collect.await.expect("join");
    let (answer, ids, finals, dones, errors) = read(&bytes);
    assert_eq!(answer, "Hello world!");
    assert!(ids.iter().all(|id| id == "orig"), "{ids:?}");
    assert_eq!((finals, dones, errors), (1, 1, 0));
    let usage = String::from_utf8_lossy(&bytes);
    assert!(usage.contains("\"prompt_tokens\":"), "{usage}");
    assert_eq!(f.count(reason, "continued"), 1);
    drop(open);
}

#[tokio::test]
async fn a_stream_cut_after_n_events_is_continued_seamlessly() {
    continued_after("closed").await;
}

#[tokio::test]
async fn an_engine_error_event_is_continued() {
    continued_after("error_event").await;
}

#[tokio::test(start_paused = true)]
async fn a_stalled_stream_is_continued() {
    continued_after("stalled").await;
}

#[tokio::test]
async fn a_fallback_that_fails_too_ends_with_one_error_event() {
    let mut f = fleet(|_| {}).await;
    f.b2.push(Reply::status(500));
    let bytes = cut_once(&mut f, send_original, " wor").await;
    let (answer, _, finals, dones, errors) = read(&bytes);
    assert_eq!(answer, "Hello wor");
    assert_eq!((finals, dones, errors), (0, 0, 1));
    assert_continuation_request(&f.b2.next_request().await);
    assert_eq!(f.count("closed", "fallback_failed"), 1);
}

#[tokio::test]
async fn an_exhausted_budget_ends_with_one_error_event_and_no_continuation() {
    let mut f = fleet(|c| {
        c.budget_ratio = 0.0;
        c.budget_min_per_s = 0.0;
    })
    .await;
    let bytes = cut_once(&mut f, send_original, " wor").await;
    let (answer, _, _, dones, errors) = read(&bytes);
    assert_eq!((answer.as_str(), dones, errors), ("Hello wor", 0, 1));
    assert_eq!(f.count("closed", "budget_exhausted"), 1);
    assert!(f.b2.try_request().is_none());
}

#[tokio::test]
async fn a_client_leaving_during_the_continuation_drops_the_upstream_request() {
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
    tx2.send(content("cont", "ld")).expect("b2 streaming");
    read_until(&mut body, "ld").await;
    f.b2.next_request().await;
    drop(body);
    // b2's response body is dropped with the client's: its feeding channel closes.
    tx2.closed().await;
}

#[tokio::test]
async fn a_cut_inside_a_tool_call_is_not_continued() {
    let mut f = fleet(|_| {}).await;
    let call = json!({"tool_calls": [{"index": 0, "id": "c",
                                        "function": {"name": "f", "arguments": "{\"a"}}]});
    let send = |tx: &mpsc::UnboundedSender<Bytes>| {
        tx.send(chunk("orig", call, None)).expect("b1 streaming");
    };
    let bytes = cut_once(&mut f, send, "tool_calls").await;
    let (_, _, _, dones, errors) = read(&bytes);
    assert_eq!((dones, errors), (0, 1));
    assert_eq!(f.count("closed", "refused_tool_call"), 1);
    assert!(f.b2.try_request().is_none());
}

#[tokio::test]
async fn switched_off_a_cut_stream_ends_as_before_without_a_continuation() {
    let mut f = fleet(|c| c.enabled = false).await;
    let bytes = cut_once(&mut f, send_original, " wor").await;
    let text = String::from_utf8_lossy(&bytes);
    assert!(text.contains("the upstream stream failed"), "{text}");
    assert!(f.b2.try_request().is_none());
    assert_eq!(f.count("closed", "continued"), 0);
}

/// One `/v1/completions` stream event.
fn text_chunk(id: &str, text: &str, finish: Option<&str>) -> Bytes {
    let c = json!({"id": id, "object": "text_completion", "created": 11, "model": id,
                   "choices": [{"index": 0, "text": text, "finish_reason": finish}]});
    Bytes::from(format!("data: {c}\n\n"))
}

#[tokio::test]
async fn a_cut_completions_stream_is_continued_from_the_extended_prompt() {
    let mut f = fleet(|_| {}).await;
    let (tx1, rx1) = mpsc::unbounded_channel();
    let (tx2, rx2) = mpsc::unbounded_channel();
    f.b1.push(Reply::SseThenCut(rx1));
    f.b2.push(Reply::Sse(rx2));
    let body = json!({"model": "m", "stream": true, "max_tokens": 50, "prompt": "Say:"});
    let resp = f
        .router
        .serve(
            OpenAiRoute::Completions,
            HeaderMap::new(),
            Caller::default(),
            Bytes::from(body.to_string()),
        )
        .await;
    assert_eq!(resp.status(), StatusCode::OK);
    f.b1.next_request().await;
    for bytes in [
        text_chunk("orig", "Hello", None),
        text_chunk("orig", " wor", None),
    ] {
        tx1.send(bytes).expect("b1 streaming");
    }
    tx1.send(Bytes::from_static(b"data: {\"id\":\"or"))
        .expect("b1 streaming");
    let mut body = resp.into_body();
    let seen = read_until(&mut body, " wor").await;
    drop(tx1);
    for bytes in [
        text_chunk("cont", "ld!", None),
        text_chunk("cont", "", Some("stop")),
        Bytes::from_static(b"data: [DONE]\n\n"),
    ] {
        tx2.send(bytes).expect("b2 streaming");
    }
    drop(tx2);
    // The client keeps reading: that is what drives the cut and the continuation.
    let collect = tokio::spawn(rest_of(seen, body));
    let asked = tokio::time::timeout(std::time::Duration::from_secs(10), f.b2.next_request());
    let continuation = asked.await.expect("a continuation request").json();
    assert_eq!(continuation["prompt"], json!("Say:Hello wor"));
    assert!(continuation.get("messages").is_none());
    assert!(continuation["max_tokens"].as_u64().expect("max_tokens") < 50);
    let bytes = collect.await.expect("join");
    let text = String::from_utf8_lossy(&bytes);
    let events: Vec<Value> = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("json"))
        .collect();
    let answer: String = events
        .iter()
        .filter_map(|v| v["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(answer, "Hello world!");
    assert!(events.iter().all(|v| v["id"] == "orig"), "{text}");
    assert_eq!(text.matches("[DONE]").count(), 1);
    assert_eq!(text.matches("\"finish_reason\":\"stop\"").count(), 1);
    assert_eq!(f.count_on("completions", "closed", "continued"), 1);
}

/// A continued answer's completion tokens are split over its backends: b1 (cut) pays for the
/// text it sent, b2 (which finished) for the rest its usage reports.
#[tokio::test]
async fn a_continued_answer_charges_each_backend_its_part() {
    use continuum_router::config::rate_limits::{RateLimitConfig, RateLimitsConfig};
    let mut f = fleet(|_| {}).await;
    let limit = RateLimitConfig {
        tokens_per_minute: Some(100),
        ..RateLimitConfig::default()
    };
    let mut limits = RateLimitsConfig::default();
    limits.backends.insert("b1".into(), limit);
    limits.backends.insert("b2".into(), limit);
    let proxy = f.router.proxy().clone();
    proxy.limits().reconfigure(&limits);
    let (tx1, rx1) = mpsc::unbounded_channel();
    let (tx2, rx2) = mpsc::unbounded_channel();
    f.b1.push(Reply::SseThenCut(rx1));
    f.b2.push(Reply::SseThenCut(rx2));
    let resp = f.stream().await;
    f.b1.next_request().await;
    send_whole_events(&tx1);
    let mut body = resp.into_body();
    let seen = read_until(&mut body, " wor").await;
    drop(tx1);
    let usage = json!({"id": "cont", "choices": [],
                       "usage": {"prompt_tokens": 9, "completion_tokens": 90, "total_tokens": 99}});
    for bytes in [
        content("cont", "ld!"),
        chunk("cont", json!({}), Some("stop")),
        Bytes::from(format!("data: {usage}\n\n")),
        Bytes::from_static(b"data: [DONE]\n\n"),
    ] {
        tx2.send(bytes).expect("b2 streaming");
    }
    let collect = tokio::spawn(rest_of(seen, body));
    f.b2.next_request().await;
    drop(tx2);
    let bytes = collect.await.expect("join");
    let (answer, _, finals, dones, errors) = read(&bytes);
    assert_eq!(
        (answer.as_str(), finals, dones, errors),
        ("Hello world!", 1, 1, 0)
    );
    let now = proxy.now();
    assert!(
        proxy.limits().backend_would_admit("b1", now, 50),
        "b1 paid only for the few tokens it sent"
    );
    assert!(
        !proxy.limits().backend_would_admit("b2", now, 50),
        "b2 paid for the 90 it generated"
    );
}
