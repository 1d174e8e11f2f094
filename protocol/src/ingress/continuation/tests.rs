//! Splicing an interrupted chat stream with its continuation yields the uninterrupted stream's
//! content, identity and terminal events, wherever the cut falls.

use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;

const ID: &str = "chatcmpl-original";
const MODEL: &str = "m";
const CREATED: u64 = 1_700_000_000;

fn chunk(id: &str, model: &str, created: u64, delta: Value, finish: Option<&str>) -> String {
    let c = json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
    format!("data: {c}\n\n")
}

/// A whole upstream stream of `tokens`: role chunk, content chunks, final chunk, usage, `[DONE]`.
fn stream(id: &str, model: &str, created: u64, tokens: &[String], prompt: u64) -> String {
    let mut s = chunk(
        id,
        model,
        created,
        json!({"role": "assistant", "content": ""}),
        None,
    );
    for t in tokens {
        s += &chunk(id, model, created, json!({"content": t}), None);
    }
    s += &chunk(id, model, created, json!({}), Some("stop"));
    let usage = json!({"id": id, "object": "chat.completion.chunk", "created": created,
        "model": model, "choices": [], "usage": {"prompt_tokens": prompt,
        "completion_tokens": tokens.len(), "total_tokens": prompt + tokens.len() as u64}});
    s += &format!("data: {usage}\n\n");
    s + "data: [DONE]\n\n"
}

/// Content, identities, final chunks, `[DONE]`s and the last usage of a relayed stream.
#[derive(Debug, PartialEq)]
struct Seen {
    text: String,
    ids: Vec<(Value, Value, Value, Value)>,
    finals: usize,
    dones: usize,
    errors: usize,
    roles: usize,
}

fn seen(bytes: &[u8]) -> Seen {
    let text = std::str::from_utf8(bytes).expect("whole events are whole UTF-8");
    let mut s = Seen {
        text: String::new(),
        ids: Vec::new(),
        finals: 0,
        dones: 0,
        errors: 0,
        roles: 0,
    };
    for event in text.split("\n\n").filter(|e| !e.is_empty()) {
        let data = event.strip_prefix("data: ").expect("data events only");
        if data == "[DONE]" {
            s.dones += 1;
            continue;
        }
        let v: Value = serde_json::from_str(data).expect("json");
        if v.get("error").is_some() {
            s.errors += 1;
            continue;
        }
        for c in v["choices"].as_array().expect("choices") {
            // Chat deltas, or completions' `text`.
            let text = c["delta"]["content"]
                .as_str()
                .or_else(|| c["text"].as_str());
            s.text += text.unwrap_or("");
            s.finals += usize::from(!c["finish_reason"].is_null());
            s.roles += usize::from(c["delta"].get("role").is_some());
            s.ids.push((
                v["id"].clone(),
                v["model"].clone(),
                v["created"].clone(),
                c["index"].clone(),
            ));
        }
    }
    s
}

fn feed_in_frames(splice: &mut ChatSplice, bytes: &[u8], frames: &[usize]) -> (Vec<u8>, bool) {
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

proptest! {
    #[test]
    fn a_spliced_stream_is_the_uninterrupted_one(
        tokens in tokens(),
        cut_permille in 0u32..1000,
        frames in prop::collection::vec(1usize..40, 1..6),
    ) {
        let whole = stream(ID, MODEL, CREATED, &tokens, 7);
        // The cut falls anywhere before the final chunk ends: mid-event, mid-UTF-8 included.
        let final_at = whole.find("\"finish_reason\":\"stop\"").expect("final");
        let cut = (final_at as u64 * u64::from(cut_permille) / 1000) as usize;
        let original = &whole.as_bytes()[..cut];

        let mut splice = ChatSplice::new(1 << 20, 1 << 20);
        let (mut out, _) = feed_in_frames(&mut splice, original, &frames);
        prop_assert_eq!(splice.end(&mut out), Some(CutReason::Closed));
        prop_assert_eq!(splice.refusal(), None);
        let full: String = tokens.concat();
        let kept = splice.text().to_owned();
        prop_assert!(full.starts_with(&kept));

        // The continuation produces the rest, as another stream with its own identity.
        let rest: Vec<String> = tokenize_rest(&full[kept.len()..]);
        let body = splice
            .continuation_body(br#"{"model":"m","messages":[{"role":"user","content":"q"}],"max_tokens":100}"#)
            .expect("body");
        let body: Value = serde_json::from_slice(&body).expect("json");
        prop_assert_eq!(&body["messages"][1]["content"], &json!(kept));
        prop_assert_eq!(&body["continue_final_message"], &json!(true));
        prop_assert_eq!(&body["add_generation_prompt"], &json!(false));
        splice.start_continuation();
        let sent = splice.tokens_sent();
        let continuation = stream("chatcmpl-other", "other-model", 1, &rest, 7 + sent);
        let (more, cut_again) = feed_in_frames(&mut splice, continuation.as_bytes(), &frames);
        prop_assert!(!cut_again);
        out.extend(more);
        prop_assert_eq!(splice.end(&mut out), None);

        let spliced = seen(&out);
        let expected = seen(whole.as_bytes());
        prop_assert_eq!(&spliced.text, &expected.text);
        prop_assert_eq!(spliced.finals, 1);
        prop_assert_eq!(spliced.dones, 1);
        prop_assert_eq!(spliced.errors, 0);
        prop_assert!(spliced.roles <= 1);
        // The original's identity, or the continuation's when no original chunk got out.
        let identity = if splice_reached_client(&whole, cut) {
            (json!(ID), json!(MODEL), json!(CREATED), json!(0))
        } else {
            (json!("chatcmpl-other"), json!("other-model"), json!(1), json!(0))
        };
        prop_assert!(spliced.ids.iter().all(|i| *i == identity), "{:?}", spliced.ids);
        // Usage: the original prompt, the completion tokens of both parts.
        let usage = last_usage(&out);
        prop_assert_eq!(&usage["prompt_tokens"], &json!(7));
        prop_assert_eq!(&usage["completion_tokens"], &json!(sent + rest.len() as u64));
    }

    #[test]
    fn an_uninterrupted_stream_passes_unchanged(
        tokens in tokens(),
        frames in prop::collection::vec(1usize..40, 1..6),
    ) {
        let whole = stream(ID, MODEL, CREATED, &tokens, 7);
        let mut splice = ChatSplice::new(1 << 20, 1 << 20);
        let (mut out, cut) = feed_in_frames(&mut splice, whole.as_bytes(), &frames);
        prop_assert!(!cut);
        prop_assert_eq!(splice.end(&mut out), None);
        prop_assert_eq!(out, whole.into_bytes());
    }
}

/// Whether the first event was complete before the cut.
fn splice_reached_client(whole: &str, cut: usize) -> bool {
    whole.find("\n\n").is_some_and(|end| end + 2 <= cut)
}

fn tokenize_rest(rest: &str) -> Vec<String> {
    let chars: Vec<char> = rest.chars().collect();
    chars.chunks(3).map(|c| c.iter().collect()).collect()
}

fn last_usage(out: &[u8]) -> Value {
    let text = std::str::from_utf8(out).expect("utf8");
    text.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| v.get("usage").cloned())
        .last()
        .expect("usage")
}

#[test]
fn an_error_chunk_cuts_and_is_not_relayed() {
    let mut splice = ChatSplice::new(1024, 1024);
    let mut bytes = chunk(ID, MODEL, CREATED, json!({"content": "Hi"}), None);
    bytes += "data: {\"error\":{\"message\":\"engine died\"}}\n\n";
    let fed = splice.feed(bytes.as_bytes());
    assert_eq!(fed.cut, Some(CutReason::ErrorEvent));
    assert!(
        !String::from_utf8(fed.out)
            .expect("utf8")
            .contains("engine died")
    );
    assert_eq!(splice.text(), "Hi");
}

#[test]
fn tool_calls_reasoning_and_the_text_cap_refuse_a_continuation() {
    let mut splice = ChatSplice::new(1024, 1024);
    splice.feed(
        chunk(
            ID,
            MODEL,
            CREATED,
            json!({"tool_calls": [{"index": 0}]}),
            None,
        )
        .as_bytes(),
    );
    assert_eq!(splice.refusal(), Some(Refusal::ToolCall));

    let mut splice = ChatSplice::new(1024, 1024);
    splice.feed(chunk(ID, MODEL, CREATED, json!({"reasoning_content": "hm"}), None).as_bytes());
    assert_eq!(splice.refusal(), Some(Refusal::Reasoning));
    splice.feed(chunk(ID, MODEL, CREATED, json!({"content": "ok"}), None).as_bytes());
    assert_eq!(splice.refusal(), None, "reasoning ended when content began");

    let mut splice = ChatSplice::new(3, 1024);
    splice.feed(chunk(ID, MODEL, CREATED, json!({"content": "four"}), None).as_bytes());
    assert_eq!(splice.refusal(), Some(Refusal::OverCap));
}

#[test]
fn the_token_limits_shrink_by_what_was_sent() {
    let mut splice = ChatSplice::new(1024, 1024);
    let usage = json!({"id": ID, "choices": [{"index": 0, "delta": {"content": "a b"}}],
                       "usage": {"prompt_tokens": 3, "completion_tokens": 5}});
    splice.feed(format!("data: {usage}\n\n").as_bytes());
    assert_eq!(splice.tokens_sent(), 5);
    let body = splice
        .continuation_body(br#"{"messages":[],"max_tokens":8,"max_completion_tokens":4}"#)
        .expect("body");
    let body: Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(body["max_tokens"], json!(3));
    assert_eq!(body["max_completion_tokens"], json!(1));
    assert!(splice.continuation_body(b"[1]").is_err());
}

#[test]
fn an_ordinary_end_is_never_a_cut_and_crlf_events_are_read() {
    let mut splice = ChatSplice::new(1024, 1024);
    let bytes = chunk(ID, MODEL, CREATED, json!({}), Some("stop")).replace("\n\n", "\r\n\r\n");
    let fed = splice.feed(bytes.as_bytes());
    assert_eq!(fed.cut, None);
    let mut out = Vec::new();
    assert_eq!(splice.end(&mut out), None);
}

#[test]
fn a_second_continuation_carries_the_text_of_both_parts_before_it() {
    let mut splice = ChatSplice::new(1024, 1024);
    let mut out = Vec::new();
    out.extend(splice.feed(content_event(ID, "one ").as_bytes()).out);
    assert_eq!(splice.end(&mut out), Some(CutReason::Closed));
    splice.start_continuation();
    out.extend(splice.feed(content_event("c1", "two ").as_bytes()).out);
    assert_eq!(splice.end(&mut out), Some(CutReason::Closed));
    let body = splice
        .continuation_body(br#"{"messages":[{"role":"user","content":"q"}]}"#)
        .expect("body");
    let body: Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(body["messages"][1]["content"], json!("one two "));
    splice.start_continuation();
    let rest = content_event("c2", "three") + &chunk("c2", MODEL, 5, json!({}), Some("stop"));
    out.extend(splice.feed(rest.as_bytes()).out);
    assert_eq!(splice.end(&mut out), None);
    let spliced = seen(&out);
    assert_eq!(spliced.text, "one two three");
    assert_eq!((spliced.finals, spliced.dones), (1, 1));
    assert!(spliced.ids.iter().all(|(id, ..)| *id == json!(ID)));
}

fn content_event(id: &str, text: &str) -> String {
    chunk(id, MODEL, CREATED, json!({"content": text}), None)
}

/// A whole `/v1/completions` stream of `tokens`: text chunks, the final chunk, usage, `[DONE]`.
fn completion_stream(id: &str, model: &str, tokens: &[String], prompt: u64) -> String {
    let chunk = |text: &str, finish: Option<&str>| {
        let c = json!({"id": id, "object": "text_completion", "created": CREATED, "model": model,
                       "choices": [{"index": 0, "text": text, "finish_reason": finish}]});
        format!("data: {c}\n\n")
    };
    let mut s: String = tokens.iter().map(|t| chunk(t, None)).collect();
    s += &chunk("", Some("length"));
    let usage = json!({"id": id, "object": "text_completion", "created": CREATED, "model": model,
        "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": tokens.len(),
        "total_tokens": prompt + tokens.len() as u64}});
    s + &format!("data: {usage}\n\n") + "data: [DONE]\n\n"
}

proptest! {
    /// `/v1/completions`: the continuation extends the string prompt by the text that got out,
    /// and the client sees the uninterrupted text under the original identity.
    #[test]
    fn a_spliced_completions_stream_is_the_uninterrupted_one(
        tokens in tokens(),
        cut_permille in 0u32..1000,
        frames in prop::collection::vec(1usize..40, 1..6),
    ) {
        let whole = completion_stream("cmpl-original", MODEL, &tokens, 5);
        let final_at = whole.find("\"finish_reason\":\"length\"").expect("final");
        let cut = (final_at as u64 * u64::from(cut_permille) / 1000) as usize;
        let mut splice = ChatSplice::completions(1 << 20, 1 << 20);
        let (mut out, _) = feed_in_frames(&mut splice, &whole.as_bytes()[..cut], &frames);
        prop_assert_eq!(splice.end(&mut out), Some(CutReason::Closed));
        prop_assert_eq!(splice.refusal(), None);
        let full: String = tokens.concat();
        let kept = splice.text().to_owned();
        prop_assert!(full.starts_with(&kept));

        let body = splice
            .continuation_body(br#"{"model":"m","prompt":"Once upon","max_tokens":100}"#)
            .expect("body");
        let body: Value = serde_json::from_slice(&body).expect("json");
        prop_assert_eq!(&body["prompt"], &json!(format!("Once upon{kept}")));
        prop_assert!(body.get("continue_final_message").is_none());
        splice.start_continuation();
        let sent = splice.tokens_sent();
        prop_assert_eq!(&body["max_tokens"], &json!(100u64.saturating_sub(sent).max(1)));
        let rest = tokenize_rest(&full[kept.len()..]);
        let continuation = completion_stream("cmpl-other", "other-model", &rest, 5 + sent);
        let (more, cut_again) = feed_in_frames(&mut splice, continuation.as_bytes(), &frames);
        prop_assert!(!cut_again);
        out.extend(more);
        prop_assert_eq!(splice.end(&mut out), None);

        let spliced = seen(&out);
        prop_assert_eq!(&spliced.text, &full);
        prop_assert_eq!((spliced.finals, spliced.dones, spliced.errors), (1, 1, 0));
        let identity = if splice_reached_client(&whole, cut) {
            (json!("cmpl-original"), json!(MODEL), json!(CREATED), json!(0))
        } else {
            (json!("cmpl-other"), json!("other-model"), json!(CREATED), json!(0))
        };
        prop_assert!(spliced.ids.iter().all(|i| *i == identity), "{:?}", spliced.ids);
        let usage = last_usage(&out);
        prop_assert_eq!(&usage["prompt_tokens"], &json!(5));
        prop_assert_eq!(&usage["completion_tokens"], &json!(sent + rest.len() as u64));
    }
}

#[test]
fn a_completions_prompt_that_is_not_one_string_cannot_be_continued() {
    let mut splice = ChatSplice::completions(1024, 1024);
    let fed = splice.feed(completion_stream("c", MODEL, &["ab".into()], 1).as_bytes());
    assert!(fed.cut.is_none());
    for prompt in [r#"[1,2,3]"#, r#"["a","b"]"#, "null"] {
        let body = format!(r#"{{"model":"m","prompt":{prompt}}}"#);
        assert!(
            splice.continuation_body(body.as_bytes()).is_err(),
            "{prompt}"
        );
    }
}

/// One original chunk of many shapes: text with escapes and non-ASCII, a reasoning delta, a
/// tool call, a null or odd `delta` / `content`, a finish reason, usage (also a float one), an
/// other index, a duplicate key, an `error` key.
fn odd_chunk() -> impl Strategy<Value = String> {
    let text = prop_oneof![
        Just(String::new()),
        "[a-z \"\\\\é😀\n]{0,12}",
        Just("\"error\"".to_owned()),
    ];
    (text, 0..19u8).prop_map(|(text, shape)| {
        let t = serde_json::to_string(&text).expect("a JSON string");
        let head = format!(r#""id":"{ID}","model":"{MODEL}","created":{CREATED}"#);
        let body = match shape {
            0 => format!(r#"{{{head},"choices":[{{"index":0,"delta":{{"content":{t}}},"finish_reason":null}}]}}"#),
            1 => format!(r#"{{{head},"choices":[{{"index":0,"delta":{{"reasoning_content":{t}}}}}]}}"#),
            2 => format!(r#"{{{head},"choices":[{{"index":0,"delta":{{"tool_calls":[{{"index":0}}]}}}}]}}"#),
            3 => format!(r#"{{{head},"choices":[{{"index":0,"delta":null}}]}}"#),
            4 => format!(r#"{{{head},"choices":[{{"index":0,"delta":{{"content":[1]}}}}]}}"#),
            5 => format!(r#"{{{head},"choices":[{{"index":0,"delta":{{}},"finish_reason":"stop"}}]}}"#),
            6 => format!(r#"{{{head},"choices":[],"usage":{{"completion_tokens":7}}}}"#),
            7 => format!(r#"{{{head},"choices":[],"usage":{{"completion_tokens":7.5}}}}"#),
            8 => format!(r#"{{{head},"choices":[{{"index":1,"delta":{{"content":{t}}}}}]}}"#),
            9 => format!(r#"{{{head},"choices":[{{"index":0,"delta":{{"content":{t},"content":"x"}}}}]}}"#),
            10 => format!(r#"{{{head},"error":{{"code":"overloaded"}}}}"#),
            11 => format!(r#"{{{head},"choices":[{{"index":0,"delta":{{"reasoning":{t},"content":""}}}}]}}"#),
            12 => format!(r#"{{{head},"choices":[{{"index":0,"text":{t},"delta":{{"content":{t}}}}}]}}"#),
            // The identity odd or missing (a first chunk gives it to the stream).
            14 => format!(r#"{{"id":null,"model":"{MODEL}","choices":[{{"index":0,"delta":{{"content":{t}}}}}]}}"#),
            15 => format!(r#"{{"id":"{ID}","created":{{"a":[1]}},"choices":[{{"delta":{{"content":{t}}}}}]}}"#),
            16 => format!(r#"{{{head},"choices":[{{"index":null,"delta":{{"content":{t}}}}}]}}"#),
            17 => format!(r#"[{t},"m",1,[],null]"#),
            18 => format!(r#"{{{head},"id":"other","choices":[{{"index":0,"delta":{{"content":{t}}}}}]}}"#),
            _ => format!(r#"{{{head},"choices":[{{"index":0,"delta":{{"content":{t}}},"logprobs":{{"x":[1,2]}}}}]}}"#),
        };
        format!("data: {body}\n\n")
    })
}

proptest! {
    /// The typed reader of original chunks decides exactly as the `Value` reader: the same
    /// bytes relayed, text kept, refusal, end, cut and tokens sent, for either wire.
    #[test]
    fn the_typed_reader_agrees_with_the_value_reader(
        chunks in prop::collection::vec(odd_chunk(), 1..12),
        completions in any::<bool>(),
        cap in 8usize..64,
        role_first in any::<bool>(),
    ) {
        let make = |fast: bool| {
            let mut s = if completions {
                ChatSplice::completions(cap, 1 << 20)
            } else {
                ChatSplice::new(cap, 1 << 20)
            };
            s.fast = fast;
            s
        };
        // With the usual role chunk first, or the odd chunks from the start (the identity taken
        // from the first of them).
        let first = chunk(ID, MODEL, CREATED, json!({"role": "assistant", "content": ""}), None);
        let first = if role_first { first } else { String::new() };
        let whole = std::iter::once(first).chain(chunks).collect::<String>();
        let (mut fast, mut slow) = (make(true), make(false));
        let (a, b) = (fast.feed(whole.as_bytes()), slow.feed(whole.as_bytes()));
        prop_assert_eq!(a.out, b.out);
        prop_assert_eq!(a.cut, b.cut);
        prop_assert_eq!(fast.text(), slow.text());
        prop_assert_eq!(fast.refusal(), slow.refusal());
        prop_assert_eq!(fast.ended(), slow.ended());
        prop_assert_eq!(fast.tokens_sent(), slow.tokens_sent());
        prop_assert_eq!(fast.error_code(), slow.error_code());
        prop_assert_eq!(
            (&fast.id, &fast.model, &fast.created, &fast.index),
            (&slow.id, &slow.model, &slow.created, &slow.index)
        );
    }
}

/// Feeds `bytes` in frames of the `frames` sizes through [`ChatSplice::feed_frame`]; the relayed
/// bytes (a named prefix resolved against its frame) and whether a cut came.
fn feed_frames_uncopied(
    splice: &mut ChatSplice,
    bytes: &[u8],
    frames: &[usize],
) -> (Vec<u8>, bool) {
    let mut out = Vec::new();
    let mut rest = bytes;
    let mut sizes = frames.iter().cycle();
    while !rest.is_empty() {
        let n = (*sizes.next().unwrap_or(&1)).clamp(1, rest.len());
        let (relayed, cut) = splice.feed_frame(&rest[..n]);
        match relayed {
            Relayed::Prefix(k) => out.extend_from_slice(&rest[..k]),
            Relayed::Copied(bytes) => out.extend(bytes),
        }
        if cut.is_some() {
            return (out, true);
        }
        rest = &rest[n..];
    }
    (out, false)
}

/// Events a relay may meet besides chunks: a comment, CRLF blank lines, `[DONE]` spelled
/// otherwise, a second `[DONE]`, garbage data.
fn odd_event() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => odd_chunk(),
        1 => Just(": keep-alive\n\n".to_owned()),
        1 => odd_chunk().prop_map(|c| c.replace("\n\n", "\r\n\r\n")),
        1 => odd_chunk().prop_map(|c| c.replace("\n\n", "\n\r\n")),
        1 => Just("data:[DONE]\n\n".to_owned()),
        1 => Just("data: [DONE]\n\n".to_owned()),
        1 => Just("data: {\"id\n\n".to_owned()),
    ]
}

proptest! {
    /// Relaying frames uncopied decides exactly as copying them: the same bytes relayed, cut,
    /// text, refusal, end and tokens, on the original stream and after a continuation started,
    /// wherever the frames are cut (mid-event, mid-UTF-8 included).
    #[test]
    fn relaying_frames_uncopied_agrees_with_copying_them(
        events in prop::collection::vec(odd_event(), 1..12),
        continuation in prop::collection::vec(odd_event(), 0..8),
        frames in prop::collection::vec(1usize..300, 1..6),
        completions in any::<bool>(),
        cap in 8usize..64,
    ) {
        let make = || if completions {
            ChatSplice::completions(cap, 1 << 20)
        } else {
            ChatSplice::new(cap, 1 << 20)
        };
        let first = chunk(ID, MODEL, CREATED, json!({"role": "assistant", "content": ""}), None);
        let whole = std::iter::once(first).chain(events).collect::<String>();
        let rest = continuation.concat();
        let (mut uncopied, mut copied) = (make(), make());
        for part in [whole, rest] {
            let a = feed_frames_uncopied(&mut uncopied, part.as_bytes(), &frames);
            let b = feed_in_frames(&mut copied, part.as_bytes(), &frames);
            prop_assert_eq!(a, b);
            prop_assert_eq!(uncopied.text(), copied.text());
            prop_assert_eq!(uncopied.refusal(), copied.refusal());
            prop_assert_eq!(uncopied.ended(), copied.ended());
            prop_assert_eq!(uncopied.tokens_sent(), copied.tokens_sent());
            prop_assert_eq!(uncopied.error_code(), copied.error_code());
            prop_assert_eq!(&uncopied.partial, &copied.partial);
            uncopied.start_continuation();
            copied.start_continuation();
        }
        let (mut x, mut y) = (Vec::new(), Vec::new());
        prop_assert_eq!(uncopied.end(&mut x), copied.end(&mut y));
        prop_assert_eq!(x, y);
    }
}

/// A frame of whole events the original stream relays as they are is named as its own
/// prefix (no copy); a partial event stays behind, and a rewritten event is copied.
#[test]
fn whole_original_events_are_relayed_as_the_frame_itself() {
    let mut splice = ChatSplice::new(1 << 10, 1 << 20);
    let first = chunk(
        ID,
        MODEL,
        CREATED,
        json!({"role": "assistant", "content": ""}),
        None,
    );
    let second = chunk(ID, MODEL, CREATED, json!({"content": "hi"}), None);
    let frame = format!("{first}{second}data: {{\"id");
    let (relayed, cut) = splice.feed_frame(frame.as_bytes());
    assert_eq!(cut, None);
    assert_eq!(relayed, Relayed::Prefix(first.len() + second.len()));
    assert_eq!(splice.text(), "hi");
    splice.partial.clear();
    splice.start_continuation();
    let other = chunk("chatcmpl-other", "other", 1, json!({"content": "!"}), None);
    let (relayed, _) = splice.feed_frame(other.as_bytes());
    let Relayed::Copied(bytes) = relayed else {
        panic!("a continuation chunk is rewritten");
    };
    assert!(String::from_utf8_lossy(&bytes).contains(ID));
}

/// `ends_here` says exactly when an upstream end would be ordinary with nothing more to relay:
/// not before the final chunk, and in a continuation not before its `[DONE]` (which the splice
/// would add).
#[test]
fn an_ordinary_end_is_known_before_the_upstream_closes() {
    let mut s = ChatSplice::new(1 << 10, 1 << 20);
    let first = chunk(
        ID,
        MODEL,
        CREATED,
        json!({"role": "assistant", "content": "a"}),
        None,
    );
    s.feed(first.as_bytes());
    assert!(!s.ends_here());
    s.feed(chunk(ID, MODEL, CREATED, json!({}), Some("stop")).as_bytes());
    assert!(s.ends_here());
    s.start_continuation();
    assert!(!s.ends_here());
    s.feed(chunk("other", MODEL, CREATED, json!({}), Some("stop")).as_bytes());
    assert!(!s.ends_here(), "the continuation's [DONE] is still to come");
    let mut out = Vec::new();
    assert_eq!(s.end(&mut out), None);
    assert_eq!(out, b"data: [DONE]\n\n");
    s.start_continuation();
    s.feed(b"data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n");
    assert!(s.ends_here());
}
