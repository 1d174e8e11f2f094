//! Splicing an interrupted native Responses stream with its (chat-completions) continuation
//! yields the uninterrupted stream's text, ids, sequence order and one terminal event, wherever
//! the cut falls (mid-event and mid-UTF-8 included).

use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;

const RESP: &str = "resp_original";
const MSG: &str = "msg_original";
const BODY: &[u8] = br#"{"model":"m","input":"q","stream":true,"max_output_tokens":100}"#;

fn event(kind: &str, seq: u64, mut data: Value) -> String {
    data["type"] = json!(kind);
    data["sequence_number"] = json!(seq);
    format!("event: {kind}\ndata: {data}\n\n")
}

fn response(status: &str, output: Value, usage: Value) -> Value {
    json!({"id": RESP, "object": "response", "created_at": 1_700_000_000, "status": status,
           "model": "m", "output": output, "usage": usage, "error": null,
           "incomplete_details": null, "tools": [], "tool_choice": "auto",
           "parallel_tool_calls": true})
}

fn part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

fn message(text: Option<&str>, status: &str) -> Value {
    let content = text.map_or_else(|| json!([]), |t| json!([part(t)]));
    json!({"id": MSG, "type": "message", "role": "assistant", "status": status,
           "content": content})
}

/// A whole native Responses stream answering `tokens` (as vLLM / OpenAI write it).
fn responses_stream(tokens: &[String]) -> String {
    let full: String = tokens.concat();
    let at = json!({"item_id": MSG, "output_index": 0, "content_index": 0});
    let with = |mut v: Value, k: &str, x: Value| {
        v[k] = x;
        v
    };
    let mut s = event(
        "response.created",
        0,
        json!({"response": response("in_progress", json!([]), Value::Null)}),
    );
    s += &event(
        "response.in_progress",
        1,
        json!({"response": response("in_progress", json!([]), Value::Null)}),
    );
    s += &event(
        "response.output_item.added",
        2,
        json!({"output_index": 0, "item": message(None, "in_progress")}),
    );
    s += &event(
        "response.content_part.added",
        3,
        with(at.clone(), "part", part("")),
    );
    let mut seq = 4;
    for t in tokens {
        let d = with(with(at.clone(), "delta", json!(t)), "logprobs", json!([]));
        s += &event("response.output_text.delta", seq, d);
        seq += 1;
    }
    s += &event(
        "response.output_text.done",
        seq,
        with(at.clone(), "text", json!(full)),
    );
    s += &event(
        "response.content_part.done",
        seq + 1,
        with(at, "part", part(&full)),
    );
    let item = message(Some(&full), "completed");
    s += &event(
        "response.output_item.done",
        seq + 2,
        json!({"output_index": 0, "item": item}),
    );
    let usage =
        json!({"input_tokens": 7, "output_tokens": tokens.len(), "total_tokens": 7 + tokens.len()});
    s += &event(
        "response.completed",
        seq + 3,
        json!({"response": response("completed", json!([item]), usage)}),
    );
    s
}

/// A chat-completions stream of `tokens` (the continuation), with usage and `[DONE]`.
fn chat_stream(tokens: &[String], prompt: u64) -> String {
    let chunk = |delta: Value, finish: Option<&str>| {
        let c = json!({"id": "chatcmpl-other", "object": "chat.completion.chunk", "created": 1,
                       "model": "other", "choices": [{"index": 0, "delta": delta,
                       "finish_reason": finish}]});
        format!("data: {c}\n\n")
    };
    let mut s = chunk(json!({"role": "assistant", "content": ""}), None);
    for t in tokens {
        s += &chunk(json!({"content": t}), None);
    }
    s += &chunk(json!({}), Some("stop"));
    let usage = json!({"id": "chatcmpl-other", "choices": [], "usage": {"prompt_tokens": prompt,
        "completion_tokens": tokens.len(), "total_tokens": prompt + tokens.len() as u64}});
    s + &format!("data: {usage}\n\ndata: [DONE]\n\n")
}

/// The events of a relayed stream (the `data` objects), in order.
fn events(bytes: &[u8]) -> Vec<Value> {
    let text = std::str::from_utf8(bytes).expect("whole events are whole UTF-8");
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let data = e
                .lines()
                .find_map(|l| l.strip_prefix("data: "))
                .expect("data");
            let v: Value = serde_json::from_str(data).expect("json");
            let named = e.lines().find_map(|l| l.strip_prefix("event: "));
            assert!(
                named.is_none_or(|n| v["type"] == n),
                "event name is its type: {e}"
            );
            v
        })
        .collect()
}

/// What a client reads off a Responses stream, checked for well-formedness on the way.
#[derive(Debug, PartialEq)]
struct Read {
    deltas: String,
    /// (item_id, output_index, content_index) of every text event.
    at: Vec<(Value, Value, Value)>,
    done_texts: Vec<String>,
    terminals: Vec<String>,
    final_text: String,
    usage: Value,
}

fn read(events: &[Value]) -> Read {
    let mut r = Read {
        deltas: String::new(),
        at: vec![],
        done_texts: vec![],
        terminals: vec![],
        final_text: String::new(),
        usage: Value::Null,
    };
    let seqs: Vec<u64> = events
        .iter()
        .map(|e| e["sequence_number"].as_u64().expect("seq"))
        .collect();
    assert!(
        seqs.windows(2).all(|w| w[0] < w[1]),
        "strictly increasing: {seqs:?}"
    );
    for e in events {
        let kind = e["type"].as_str().expect("type");
        if let Some(response) = e.get("response") {
            assert_eq!(response["id"], RESP, "one response id");
        }
        match kind {
            "response.output_text.delta" => {
                r.deltas += e["delta"].as_str().expect("delta");
                r.at.push((
                    e["item_id"].clone(),
                    e["output_index"].clone(),
                    e["content_index"].clone(),
                ));
            }
            "response.output_text.done" => {
                r.done_texts.push(e["text"].as_str().expect("text").into())
            }
            "response.content_part.done" => r
                .done_texts
                .push(e["part"]["text"].as_str().expect("text").into()),
            "response.output_item.done" => r.done_texts.push(
                e["item"]["content"][0]["text"]
                    .as_str()
                    .expect("text")
                    .into(),
            ),
            "response.completed" | "response.incomplete" | "response.failed" | "error" => {
                r.terminals.push(kind.into());
                r.final_text = e["response"]["output"][0]["content"][0]["text"]
                    .as_str()
                    .unwrap_or("")
                    .into();
                r.usage = e["response"]["usage"].clone();
            }
            _ => {}
        }
    }
    r
}

fn feed_in_frames(splice: &mut ResponsesSplice, bytes: &[u8], frames: &[usize]) -> (Vec<u8>, bool) {
    let mut out = Vec::new();
    let mut rest = bytes;
    let mut sizes = frames.iter().cycle();
    while !rest.is_empty() {
        let n = (*sizes.next().unwrap_or(&1)).clamp(1, rest.len());
        let fed = splice.feed(&rest[..n]);
        out.extend(fed.out);
        if fed.cut.is_some() {
            return (out, true);
        }
        rest = &rest[n..];
    }
    (out, false)
}

fn tokens() -> impl Strategy<Value = Vec<String>> {
    prop::collection::vec("[a-z é日本🦀]{1,4}", 1..24)
}

fn tokenize_rest(rest: &str) -> Vec<String> {
    let chars: Vec<char> = rest.chars().collect();
    chars.chunks(3).map(|c| c.iter().collect()).collect()
}

proptest! {
    #[test]
    fn a_spliced_responses_stream_is_the_uninterrupted_one(
        tokens in tokens(),
        cut_permille in 0u32..1000,
        frames in prop::collection::vec(1usize..40, 1..6),
    ) {
        let whole = responses_stream(&tokens);
        // Anywhere before `response.completed` is whole: mid-event, mid-UTF-8 included.
        let cut = ((whole.len() - 2) as u64 * u64::from(cut_permille) / 1000) as usize;
        let mut splice = ResponsesSplice::new(1 << 20, 1 << 20);
        let (mut out, _) = feed_in_frames(&mut splice, &whole.as_bytes()[..cut], &frames);
        prop_assert_eq!(splice.end(&mut out), Some(CutReason::Closed));
        let created_out = whole.find("\n\n").is_some_and(|end| end + 2 <= cut);
        if !created_out {
            // Nothing to continue: one `error` event ends the stream.
            prop_assert_eq!(splice.refusal(), Some(Refusal::Unsupported));
            out.extend(splice.failure_event("cut"));
            let all = events(&out);
            prop_assert_eq!(read(&all).terminals, vec!["error".to_owned()]);
            return Ok(());
        }
        prop_assert_eq!(splice.refusal(), None);
        let full: String = tokens.concat();
        let kept = splice.text().to_owned();
        prop_assert!(full.starts_with(&kept));

        let body: Value = serde_json::from_slice(&splice.continuation_body(BODY).expect("body")).expect("json");
        let messages = body["messages"].as_array().expect("messages");
        prop_assert_eq!(messages.last().expect("last"), &json!({"role": "assistant", "content": kept}));
        prop_assert_eq!(&body["continue_final_message"], &json!(true));
        prop_assert_eq!(&body["add_generation_prompt"], &json!(false));
        let sent = splice.tokens_sent();
        prop_assert_eq!(&body["max_tokens"], &json!(100u64.saturating_sub(sent).max(1)));

        splice.start_continuation();
        let rest = tokenize_rest(&full[kept.len()..]);
        let (more, cut_again) = feed_in_frames(&mut splice, chat_stream(&rest, 7 + sent).as_bytes(), &frames);
        prop_assert!(!cut_again);
        out.extend(more);
        prop_assert_eq!(splice.end(&mut out), None);

        let spliced = read(&events(&out));
        prop_assert_eq!(&spliced.deltas, &full);
        prop_assert_eq!(&spliced.terminals, &vec!["response.completed".to_owned()]);
        prop_assert_eq!(&spliced.final_text, &full);
        prop_assert_eq!(&spliced.done_texts, &vec![full.clone(); 3]);
        // The original item's ids, or one item of the splice's own when the original's was not out.
        let item_out = whole.find("response.output_item.added").is_some_and(|at| {
            whole[at..].find("\n\n").is_some_and(|end| at + end + 2 <= cut)
        });
        let item = if item_out { json!(MSG) } else { json!(format!("msg_{RESP}_0")) };
        prop_assert!(spliced.at.iter().all(|a| *a == (item.clone(), json!(0), json!(0))), "{:?}", spliced.at);
        prop_assert_eq!(&spliced.usage["input_tokens"], &json!(7));
        prop_assert_eq!(&spliced.usage["output_tokens"], &json!(sent + rest.len() as u64));
    }

    #[test]
    fn an_uninterrupted_responses_stream_passes_unchanged(
        tokens in tokens(),
        frames in prop::collection::vec(1usize..40, 1..6),
    ) {
        let whole = responses_stream(&tokens);
        let mut splice = ResponsesSplice::new(1 << 20, 1 << 20);
        let (mut out, cut) = feed_in_frames(&mut splice, whole.as_bytes(), &frames);
        prop_assert!(!cut);
        prop_assert_eq!(splice.end(&mut out), None);
        prop_assert_eq!(out, whole.into_bytes());
    }
}

/// The original's first events, up to and including `n` text deltas.
fn head(tokens: &[&str]) -> String {
    let tokens: Vec<String> = tokens.iter().map(|t| (*t).to_owned()).collect();
    let whole = responses_stream(&tokens);
    let end = whole
        .find("event: response.output_text.done")
        .expect("done");
    whole[..end].to_owned()
}

#[test]
fn an_error_event_or_response_failed_cuts_the_stream_without_being_relayed() {
    for error in [
        event(
            "error",
            9,
            json!({"code": "server_error", "message": "engine died", "param": null}),
        ),
        "data: {\"error\":{\"message\":\"Service temporarily unavailable\",\"code\":503}}\n\n"
            .to_owned(),
        event(
            "response.failed",
            9,
            json!({"response": {"id": RESP, "error": {"code": "server_error"}}}),
        ),
    ] {
        let mut splice = ResponsesSplice::new(1 << 20, 1 << 20);
        let fed = splice.feed(format!("{}{error}", head(&["Hel", "lo"])).as_bytes());
        assert_eq!(fed.cut, Some(CutReason::ErrorEvent), "{error}");
        assert!(
            !String::from_utf8_lossy(&fed.out).contains("failed\""),
            "{error}"
        );
        assert_eq!(splice.text(), "Hello");
        assert_eq!(splice.refusal(), None);
    }
}

#[test]
fn a_cut_inside_a_function_call_or_reasoning_is_refused_with_one_response_failed() {
    let call = json!({"id": "fc_1", "type": "function_call", "call_id": "c", "name": "f",
                      "arguments": "", "status": "in_progress"});
    let reasoning = json!({"id": "rs_1", "type": "reasoning", "summary": [], "content": []});
    for (item, refusal) in [(call, Refusal::ToolCall), (reasoning, Refusal::Reasoning)] {
        let mut s = event(
            "response.created",
            0,
            json!({"response": response("in_progress", json!([]), Value::Null)}),
        );
        s += &event(
            "response.output_item.added",
            1,
            json!({"output_index": 0, "item": item}),
        );
        let mut splice = ResponsesSplice::new(1 << 20, 1 << 20);
        let mut out = splice.feed(s.as_bytes()).out;
        assert_eq!(splice.end(&mut out), Some(CutReason::Closed));
        assert_eq!(splice.refusal(), Some(refusal));
        out.extend(splice.failure_event("the upstream stream was cut"));
        let all = events(&out);
        let last = all.last().expect("an event");
        assert_eq!(last["type"], "response.failed");
        assert_eq!(last["sequence_number"], 2);
        assert_eq!(last["response"]["id"], RESP);
        assert_eq!(last["response"]["status"], "failed");
        assert_eq!(last["response"]["error"]["code"], "server_error");
        assert_eq!(read(&all).terminals, ["response.failed"]);
    }
}

#[test]
fn a_reasoning_item_followed_by_text_is_continued() {
    let reasoning = json!({"id": "rs_1", "type": "reasoning", "summary": [], "content": []});
    let mut s = event(
        "response.created",
        0,
        json!({"response": response("in_progress", json!([]), Value::Null)}),
    );
    s += &event(
        "response.output_item.added",
        1,
        json!({"output_index": 0, "item": reasoning}),
    );
    s += &event(
        "response.content_part.added",
        2,
        json!({"item_id": "rs_1", "output_index": 0,
        "content_index": 0, "part": {"type": "reasoning_text", "text": ""}}),
    );
    s += &event(
        "response.output_item.done",
        3,
        json!({"output_index": 0, "item": reasoning}),
    );
    s += &event(
        "response.output_item.added",
        4,
        json!({"output_index": 1, "item": message(None, "in_progress")}),
    );
    s += &event(
        "response.content_part.added",
        5,
        json!({"item_id": MSG, "output_index": 1,
        "content_index": 0, "part": part("")}),
    );
    let mut splice = ResponsesSplice::new(1 << 20, 1 << 20);
    splice.feed(s.as_bytes());
    assert_eq!(
        splice.refusal(),
        Some(Refusal::Reasoning),
        "no answer text yet"
    );
    let delta = event(
        "response.output_text.delta",
        6,
        json!({"item_id": MSG, "output_index": 1,
        "content_index": 0, "delta": "Hi"}),
    );
    splice.feed(delta.as_bytes());
    assert_eq!(splice.refusal(), None);
    splice.start_continuation();
    let mut out = splice
        .feed(chat_stream(&[" there".into()], 9).as_bytes())
        .out;
    assert_eq!(splice.end(&mut out), None);
    let all = events(&out);
    let done = all.last().expect("terminal");
    assert_eq!(done["type"], "response.completed");
    assert_eq!(
        done["sequence_number"],
        all[0]["sequence_number"].as_u64().expect("seq") + 4
    );
    assert_eq!(all[0]["sequence_number"], 7);
    let output = done["response"]["output"].as_array().expect("output");
    assert_eq!(output.len(), 2, "the reasoning item and the message");
    assert_eq!(output[1]["content"][0]["text"], "Hi there");
}

#[test]
fn the_kept_text_is_capped_and_past_the_cap_continuation_is_refused() {
    let mut splice = ResponsesSplice::new(4, 1 << 20);
    splice.feed(head(&["Hel", "lo"]).as_bytes());
    assert_eq!(splice.refusal(), Some(Refusal::OverCap));
    assert!(splice.text().len() <= 4);
}

/// A frontend that closes the message item before its error event (Dynamo 1.6.1 does): the
/// closing events are held back, never reach the client, and the continuation goes on in the
/// same item; without the error they are relayed as they came.
#[test]
fn closing_events_before_an_error_are_held_back_and_the_item_continues() {
    let whole = responses_stream(&["Hel".into(), "lo".into()]);
    let closing_at = whole
        .find("event: response.output_text.done")
        .expect("done");
    let completed_at = whole.find("event: response.completed").expect("completed");
    let error = event(
        "error",
        9,
        json!({"code": "server_error", "message": "engine died"}),
    );
    let mut splice = ResponsesSplice::new(1 << 20, 1 << 20);
    let fed = splice.feed(format!("{}{error}", &whole[..completed_at]).as_bytes());
    assert_eq!(fed.cut, Some(CutReason::ErrorEvent));
    assert_eq!(
        fed.out,
        &whole.as_bytes()[..closing_at],
        "nothing after the deltas got out"
    );
    assert_eq!(splice.refusal(), None);
    splice.start_continuation();
    let mut out = fed.out;
    out.extend(splice.feed(chat_stream(&["!".into()], 9).as_bytes()).out);
    assert_eq!(splice.end(&mut out), None);
    let spliced = read(&events(&out));
    assert_eq!(spliced.deltas, "Hello!");
    assert_eq!(spliced.done_texts, vec!["Hello!".to_owned(); 3]);
    assert_eq!(spliced.terminals, ["response.completed"]);
    assert!(spliced.at.iter().all(|a| a.0 == MSG), "{:?}", spliced.at);

    // Followed by the terminal event, the held events go out in order, unchanged.
    let mut splice = ResponsesSplice::new(1 << 20, 1 << 20);
    let part = splice.feed(&whole.as_bytes()[..completed_at]).out;
    assert_eq!(part, &whole.as_bytes()[..closing_at]);
    let mut rest = splice.feed(&whole.as_bytes()[completed_at..]).out;
    assert_eq!(splice.end(&mut rest), None);
    assert_eq!([part, rest].concat(), whole.into_bytes());
}
