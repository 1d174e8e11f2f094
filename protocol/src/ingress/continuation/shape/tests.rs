//! The shape reader agrees with the full reader: whenever it reads a chunk, the splice ends up
//! exactly as the `serde_json::Value` reader leaves it, and any chunk that is not its shape with
//! a valid JSON string in the text's place goes to the full reader.

use proptest::prelude::*;

use std::borrow::Cow;

use super::super::{ChatSplice, Refusal, Relayed};
use super::{decode, string_body};

/// Where a generated chunk's text string goes.
const TEXT: &str = "\u{0}TEXT\u{0}";

/// The splice's observable state after each event.
type State = (
    Vec<u8>,
    bool,
    String,
    Option<Refusal>,
    bool,
    u64,
    Option<String>,
);

fn state(s: &ChatSplice, out: Vec<u8>, cut: bool) -> State {
    (
        out,
        cut,
        s.text().to_owned(),
        s.refusal(),
        s.ended(),
        s.tokens_sent(),
        s.error_code().map(str::to_owned),
    )
}

/// One JSON object from its members, in this order, with `ws` around every token.
fn object(members: &[(&str, String)], ws: &str) -> String {
    let inner: Vec<String> = members
        .iter()
        .map(|(k, v)| format!("{ws}\"{k}\"{ws}:{ws}{v}{ws}"))
        .collect();
    format!("{{{}}}", inner.join(","))
}

/// Where a final chunk's finish reason goes (a JSON string from [`FINISHES`]).
const FINISH: &str = "\u{2}FINISH\u{2}";

/// Finish reasons of final chunks: strings with and without escapes, and one that is not JSON.
const FINISHES: [&str; 5] = [
    r#""stop""#,
    r#""length""#,
    r#""""#,
    r#""\u0073top""#,
    "\"\u{1}\"",
];

/// A chunk skeleton with [`TEXT`] where the text string goes (`delta.content`, or `text` for
/// completions), the text key maybe nested elsewhere too, tool calls, reasoning, a role, a
/// finish reason, usage, an `error` member, keys in any order, whitespace; and the same
/// skeleton as a final chunk (the finish reason [`FINISH`] when it was `null`), once without the
/// text member and once with an empty text.
fn skeleton(completions: bool) -> impl Strategy<Value = [String; 3]> {
    (
        any::<[bool; 10]>(),
        prop::sample::select(vec!["", " ", "\n", "\t ", "\r\n"]),
        any::<prop::sample::Index>(),
        any::<prop::sample::Index>(),
        any::<prop::sample::Index>(),
        any::<bool>(),
    )
        .prop_map(move |(flags, ws, r1, r2, r3, role)| {
            let render = |text: Option<&str>, finish: &str| {
                let nested = r#"{"content":" Once","text":" Once","error":null}"#.to_owned();
                let mut delta: Vec<(&str, String)> = Vec::new();
                if !completions && let Some(text) = text {
                    delta.push(("content", text.to_owned()));
                }
                if flags[0] {
                    delta.push((
                        "tool_calls",
                        r#"[{"index":0,"function":{"arguments":"{\"content\":\"x\"}"}}]"#.into(),
                    ));
                }
                if flags[1] {
                    let r = if flags[2] { r#""thinking""# } else { r#""""# };
                    delta.push(("reasoning_content", r.into()));
                }
                if flags[3] {
                    delta.push(("extra", nested.clone()));
                }
                // A `role` (a shape is the chunk without it while the stream has none).
                if role {
                    delta.push(("role", r#""assistant""#.into()));
                }
                if delta.len() > 1 {
                    let n = delta.len();
                    delta.swap(0, r1.index(n));
                }
                let mut choice: Vec<(&str, String)> = vec![
                    ("index", if flags[4] && flags[5] { "1" } else { "0" }.into()),
                    ("delta", object(&delta, ws)),
                    ("finish_reason", finish.into()),
                    (
                        "logprobs",
                        if flags[7] {
                            r#"{"content":[{"token":" Once"}]}"#.into()
                        } else {
                            "null".into()
                        },
                    ),
                ];
                if completions && let Some(text) = text {
                    choice.push(("text", text.to_owned()));
                }
                let n = choice.len();
                choice.swap(r2.index(n), n - 1);
                let mut top: Vec<(&str, String)> = vec![
                    ("id", r#""chatcmpl-1""#.into()),
                    ("object", r#""chat.completion.chunk""#.into()),
                    ("created", "1700000000".into()),
                    ("model", r#""m""#.into()),
                    ("choices", format!("[{}]", object(&choice, ws))),
                ];
                if flags[8] {
                    top.push((
                        "usage",
                        if flags[9] {
                            r#"{"completion_tokens":3}"#.into()
                        } else {
                            "null".into()
                        },
                    ));
                }
                if flags[4] && !flags[5] {
                    top.push(("meta", nested));
                }
                if flags[5] && flags[9] {
                    top.push(("error", r#"{"code":"overloaded"}"#.into()));
                }
                let n = top.len();
                top.swap(r3.index(n), n - 1);
                object(&top, ws)
            };
            let (finish, last) = if flags[6] {
                (r#""stop""#, r#""stop""#)
            } else {
                ("null", FINISH)
            };
            [
                render(Some(TEXT), finish),
                render(None, last),
                render(Some(r#""""#), last),
            ]
        })
}

/// A text string's bytes between its quotes: valid JSON (escapes, `\u` escapes and surrogate
/// pairs, unicode) or not (a stray quote or backslash, a raw control character, a lone
/// surrogate, a bad escape, invalid UTF-8).
fn raw_text() -> impl Strategy<Value = Vec<u8>> {
    let plain = "[a-z é日本🦀\"\\\\\n\t\u{1}/]{0,6}";
    prop_oneof![
        6 => plain.prop_map(|t| {
            let q = serde_json::to_string(&t).expect("a JSON string");
            q.as_bytes()[1..q.len() - 1].to_vec()
        }),
        2 => plain.prop_map(|t| {
            t.encode_utf16().map(|u| format!("\\u{u:04x}")).collect::<String>().into_bytes()
        }),
        1 => Just(b" Once".to_vec()),
        1 => prop::sample::select(
            [
                "a\"b", "a\\", "\\x", "\\ud800", "\\udc00x", "\\ud800\\u0041", "\x01", "a\"}",
                "\\u12", "", "\\\"", "\\\\",
            ]
            .map(|s| s.as_bytes().to_vec())
            .into_iter()
            .chain([vec![0xff], vec![0xc3], vec![0xed, 0xa0, 0x80]])
            .collect::<Vec<_>>(),
        ),
    ]
}

/// A stream: the role chunk, then chunks of a few skeletons (most often as content chunks, else
/// as final chunks) with texts and finish reasons from small pools (a text that repeats is what
/// a shape learnt at the wrong place would misread).
fn chunks(completions: bool) -> impl Strategy<Value = Vec<Vec<u8>>> {
    (
        prop::collection::vec(skeleton(completions), 1..4),
        prop::collection::vec(raw_text(), 1..4),
        prop::collection::vec(
            (
                any::<(prop::sample::Index, prop::sample::Index)>(),
                prop_oneof![6 => Just(0usize), 1 => Just(1usize), 1 => Just(2usize)],
                prop::sample::select(FINISHES.to_vec()),
            ),
            1..16,
        ),
    )
        .prop_map(|(skeletons, pool, picks)| {
            picks
                .into_iter()
                .map(|((which, text), variant, finish)| {
                    let raw = &pool[text.index(pool.len())];
                    let skeleton = skeletons[which.index(skeletons.len())][variant]
                        .replace(FINISH, finish)
                        .replace(TEXT, "\u{0}");
                    let mut data = b"data: ".to_vec();
                    match skeleton.split_once('\u{0}') {
                        Some((head, tail)) => {
                            data.extend_from_slice(head.as_bytes());
                            data.push(b'"');
                            data.extend_from_slice(raw);
                            data.push(b'"');
                            data.extend_from_slice(tail.as_bytes());
                        }
                        None => data.extend_from_slice(skeleton.as_bytes()),
                    }
                    data.extend_from_slice(b"\n\n");
                    data
                })
                .collect()
        })
}

fn splice(completions: bool, fast: bool, cap: usize) -> ChatSplice {
    let mut s = if completions {
        ChatSplice::completions(cap, 1 << 20)
    } else {
        ChatSplice::new(cap, 1 << 20)
    };
    s.fast = fast;
    s
}

const ROLE: &[u8] = b"data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n";

/// Feeds `events` one by one into a splice with shapes and one with the `Value` reader only,
/// comparing them after each, and a third with shapes one event per frame
/// ([`ChatSplice::feed_frame`], whose shaped events are matched whole); returns how many chunks
/// the first read by their shape (the third must read as many).
fn agree(events: &[Vec<u8>], completions: bool, cap: usize) -> Result<u64, TestCaseError> {
    let (mut fast, mut slow, mut framed) = (
        splice(completions, true, cap),
        splice(completions, false, cap),
        splice(completions, true, cap),
    );
    for event in std::iter::once(ROLE).chain(events.iter().map(Vec::as_slice)) {
        let (a, b) = (fast.feed(event), slow.feed(event));
        let (relayed, cut) = framed.feed_frame(event);
        let c = match relayed {
            Relayed::Prefix(n) => event[..n].to_vec(),
            Relayed::Copied(out) => out,
        };
        let expected = state(&slow, b.out, b.cut.is_some());
        prop_assert_eq!(state(&fast, a.out, a.cut.is_some()), expected.clone());
        prop_assert_eq!(state(&framed, c, cut.is_some()), expected);
        prop_assert_eq!(fast.in_reasoning, slow.in_reasoning);
        prop_assert_eq!(framed.in_reasoning, slow.in_reasoning);
        if a.cut.is_some() {
            break;
        }
    }
    prop_assert_eq!(framed.shaped, fast.shaped);
    Ok(fast.shaped)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    /// Whatever the chunks, the splice reading by shape decides as the `Value` reader after
    /// every event: the bytes relayed, the cut, the text kept, refusal, end, tokens, error code.
    #[test]
    fn the_shape_reader_agrees_with_the_value_reader(
        events in chunks(false),
        cap in prop::sample::select(vec![16usize, 1 << 16]),
    ) {
        agree(&events, false, cap)?;
    }

    #[test]
    fn the_shape_reader_agrees_on_completions(
        events in chunks(true),
        cap in prop::sample::select(vec![16usize, 1 << 16]),
    ) {
        agree(&events, true, cap)?;
    }

    /// A learnt shape with any bytes in the text's place: read by shape exactly when they are
    /// a valid JSON string body, and then as the `Value` reader reads the chunk.
    #[test]
    fn any_bytes_in_the_texts_place_are_read_by_shape_only_when_valid(
        raw in prop::collection::vec(any::<u8>(), 0..12),
        completions in any::<bool>(),
    ) {
        let plain = if completions {
            r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":[{"index":0,"text":"#
        } else {
            r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"m","choices":[{"index":0,"delta":{"content":"#
        };
        let tail: &[u8] = if completions { b"\"}]}\n\n" } else { b"\"}}]}\n\n" };
        let event = |text: &[u8]| [b"data: ", plain.as_bytes(), b"\"", text, tail].concat();
        let valid = serde_json::from_slice::<String>(&[b"\"", &raw[..], b"\""].concat()).is_ok();
        let events = [event(b"hello"), event(&raw)];
        let shaped = agree(&events, completions, 1 << 16)?;
        prop_assert_eq!(shaped, u64::from(valid));
    }
}

/// The two-pass read [`string_body`] replaced: the closing quote found first (escapes
/// skipped), then the bytes before it decoded.
fn two_pass(s: &[u8]) -> Option<(usize, Cow<'_, str>)> {
    let mut j = 0;
    let close = loop {
        j += memchr::memchr2(b'"', b'\\', s.get(j..)?)?;
        if s[j] == b'"' {
            break j;
        }
        j += 2;
    };
    Some((close, decode(&s[..close])?))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    /// The one-pass string read finds the same end and the same value as the two passes, and
    /// refuses the same bodies, whatever the bytes (quotes, escapes, control bytes, invalid
    /// UTF-8, no closing quote).
    #[test]
    fn the_one_pass_string_read_is_the_two_pass_read(
        s in prop::collection::vec(
            prop_oneof![
                4 => any::<u8>(),
                2 => prop::sample::select(b"\"\\u0dn\x01 a\xc3\xa9".to_vec()),
            ],
            0..24,
        ),
    ) {
        prop_assert_eq!(string_body(&s), two_pass(&s));
    }
}

/// Streams shaped like Dynamo 1.6.1's and vLLM's are read by shape after their role chunk, the
/// final chunk too (as the content shape foretells it), without a probe.
#[test]
fn real_streams_are_read_by_shape() {
    let dynamo = |delta: &str, finish: &str| {
        format!("data: {{\"id\":\"chatcmpl-bee7\",\"choices\":[{{\"index\":0,\"delta\":{delta},\"finish_reason\":{finish},\"logprobs\":null}}],\"created\":1796450204,\"model\":\"tiny\",\"object\":\"chat.completion.chunk\"}}\n\n").into_bytes()
    };
    let vllm = |delta: &str, finish: &str| {
        format!("data: {{\"id\":\"chatcmpl-9\",\"object\":\"chat.completion.chunk\",\"created\":1796450204,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{delta},\"logprobs\":null,\"finish_reason\":{finish},\"stop_reason\":null}}]}}\n\n").into_bytes()
    };
    type Make = fn(&str, &str) -> Vec<u8>;
    let cases: [(Make, &str, &str); 3] = [
        (dynamo, r#"{"content":" Once","role":"assistant"}"#, "{}"),
        (
            vllm,
            r#"{"role":"assistant","content":""}"#,
            r#"{"content":""}"#,
        ),
        (vllm, r#"{"role":"assistant","content":" Once"}"#, "{}"),
    ];
    for (make, first, last) in cases {
        let mut events = vec![make(first, "null")];
        if first.ends_with(r#""content":""}"#) {
            events.push(make(r#"{"content":" Once"}"#, "null"));
        }
        for word in [" upon", " a", " time", " \\\"é\\\"", " 日本", " 🦀", "\\n"] {
            events.push(make(&format!(r#"{{"content":"{word}"}}"#), "null"));
        }
        events.push(make(last, r#""length""#));
        events.push(b"data: [DONE]\n\n".to_vec());
        let mut s = ChatSplice::new(1 << 16, 1 << 20);
        for e in &events {
            assert!(s.feed(e).cut.is_none());
        }
        assert_eq!(s.text(), " Once upon a time \"é\" 日本 🦀\n");
        assert!(s.ended());
        assert_eq!(
            s.shaped,
            events.len() as u64 - 2,
            "all but the role chunk and [DONE]: {first}"
        );
        assert_eq!(
            s.shape_tries, 0,
            "the typed reader names the text: no probe"
        );
    }
}

/// A shape whose first text holds an escape (not borrowed by the typed reader) is proved by a
/// probe; a stream whose chunks change shape learns the new one from the typed reader.
#[test]
fn an_escaped_text_is_probed_and_a_new_shape_replaces_the_old() {
    let chunk = |delta: &str| {
        format!("data: {{\"id\":\"c\",\"choices\":[{{\"index\":0,\"delta\":{delta},\"finish_reason\":null}}],\"model\":\"m\"}}\n\n").into_bytes()
    };
    let mut s = ChatSplice::new(1 << 16, 1 << 20);
    for delta in [
        r#"{"content":"\u00e9\n"}"#,
        r#"{"content":" a"}"#,
        r#"{"content":" b","extra":1}"#,
        r#"{"content":" c","extra":2}"#,
        r#"{"content":" d","extra":2}"#,
    ] {
        assert!(s.feed(&chunk(delta)).cut.is_none());
    }
    assert_eq!(s.text(), "é\n a b c d");
    assert_eq!(s.shape_tries, 1, "the escaped text's shape was probed");
    assert_eq!(
        s.shaped, 2,
        "\" a\" by the probed shape, \" d\" by the one learnt at \" c\""
    );
}

/// Two choices of one index, one opening a reasoning block and one with the text: whether the
/// block is still open after the chunk depends on the text being empty, so no shape is kept
/// (the typed reader's text is not taken, and the probe with the emptied string fails).
#[test]
fn a_reasoning_choice_beside_the_text_keeps_no_shape() {
    let chunk = |text: &str| {
        format!("data: {{\"id\":\"chatcmpl-1\",\"choices\":[{{\"index\":0,\"delta\":{{\"reasoning_content\":\"r\"}}}},{{\"index\":0,\"delta\":{{\"content\":\"{text}\"}}}}],\"model\":\"m\"}}\n\n").into_bytes()
    };
    for escaped in [false, true] {
        let first = if escaped { "\\n" } else { "y" };
        let events = [chunk(first), chunk("z"), chunk("")];
        assert_eq!(agree(&events, false, 1 << 16).expect("agree"), 0);
    }
}
