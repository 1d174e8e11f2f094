//! The common case of the top-level body parse in one pass over the bytes.
//!
//! A body without `nvext` needs nothing but validation, `model`, `stream` and the prompt texts,
//! and is forwarded untouched. This scanner does all of it while walking the bytes once (after
//! the UTF-8 check), with no serde visitor, `RawValue` or second walk of `messages`. It accepts
//! a strict subset of what the slow path ([`super::parse_slow`]) accepts and returns `None`
//! whenever it is unsure: any malformed byte, nesting beyond [`MAX_JSON_DEPTH`], a `nvext` key, a
//! repeated `model` or `stream`, an escaped key where the router reads keys, an unexpected
//! escape, a number where the slow path would decode one, a `model` or `stream` of the wrong
//! type. The slow path then gives the verdict (and the error message) it always gave. The
//! property test in `super::tests` holds the two to the same answers.

use continuum_protocol::picker::estimate::TOKENS_PER_PROMPT;

use super::{MAX_JSON_DEPTH, PromptTexts, Shape, hex4};

/// What the fast path read of a body it accepts (the body goes out as sent, nothing stripped).
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Fast {
    pub model: String,
    pub stream: bool,
    pub prompt_tokens: u64,
}

/// Parses `text` when it is a plain top-level object the fast path can judge alone.
pub(super) fn parse(text: &str) -> Option<Fast> {
    let mut scanner = Scanner {
        text,
        pos: 0,
        depth: 0,
    };
    let head = scanner.top()?;
    scanner.skip_ws();
    if scanner.pos != text.len() {
        return None;
    }
    let model = head.model?;
    if model.trim().is_empty() {
        return None;
    }
    Some(Fast {
        model,
        stream: head.stream.unwrap_or(false),
        prompt_tokens: prompt_tokens(head.messages, head.prompt),
    })
}

/// The estimate over the last `messages` and the last `prompt`, as the slow path's `Head` sums it.
fn prompt_tokens(messages: PromptTexts, prompt: PromptTexts) -> u64 {
    if messages.count.saturating_add(prompt.count) == 0 {
        return 0;
    }
    messages
        .tokens
        .saturating_add(prompt.tokens)
        .saturating_add(TOKENS_PER_PROMPT)
}

/// The top level as the fast path reads it.
#[derive(Default)]
struct Head {
    model: Option<String>,
    /// `Some(false)` for an explicit `null`, as the slow path reads it.
    stream: Option<bool>,
    messages: PromptTexts,
    prompt: PromptTexts,
}

/// A string's contents (between the quotes) and whether it holds a `\` escape.
struct Span {
    start: usize,
    end: usize,
    escaped: bool,
}

/// A cursor over the body. Every method returns `None` to hand the body to the slow path.
struct Scanner<'a> {
    text: &'a str,
    pos: usize,
    /// Open arrays and objects around `pos`, bounded by [`MAX_JSON_DEPTH`] (which also bounds
    /// this scanner's recursion).
    depth: usize,
}

impl Scanner<'_> {
    fn bytes(&self) -> &[u8] {
        self.text.as_bytes()
    }

    fn peek(&self) -> Option<u8> {
        self.bytes().get(self.pos).copied()
    }

    /// JSON's whitespace (not `is_ascii_whitespace`, which also takes form feed).
    fn skip_ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.pos += 1;
        }
    }

    fn eat(&mut self, byte: u8) -> Option<()> {
        (self.peek()? == byte).then(|| self.pos += 1)
    }

    fn enter(&mut self) -> Option<()> {
        self.depth += 1;
        (self.depth <= MAX_JSON_DEPTH).then_some(())
    }

    /// After a member or an element: `true` on `,`, `false` on `close` (consumed, depth left).
    fn next_or_close(&mut self, close: u8) -> Option<bool> {
        self.skip_ws();
        let byte = self.peek()?;
        self.pos += 1;
        if byte == b',' {
            return Some(true);
        }
        (byte == close).then(|| self.depth -= 1)?;
        Some(false)
    }

    /// Opens a container at `pos`; `true` when it is empty (and already closed).
    fn open(&mut self, open: u8, close: u8) -> Option<bool> {
        self.eat(open)?;
        self.enter()?;
        self.skip_ws();
        if self.peek()? == close {
            self.pos += 1;
            self.depth -= 1;
            return Some(true);
        }
        Some(false)
    }

    /// A key and its colon; the value follows (whitespace skipped).
    fn key(&mut self) -> Option<Span> {
        self.skip_ws();
        let key = self.string()?;
        self.skip_ws();
        self.eat(b':')?;
        self.skip_ws();
        Some(key)
    }

    /// The top-level object: `model`, `stream`, the prompt fields; everything else validated.
    fn top(&mut self) -> Option<Head> {
        self.skip_ws();
        let mut head = Head::default();
        if self.open(b'{', b'}')? {
            return Some(head);
        }
        loop {
            let key = self.key()?;
            if key.escaped {
                return None;
            }
            match self.bytes().get(key.start..key.end)? {
                b"model" if head.model.is_none() => head.model = Some(self.owned_string()?),
                b"stream" if head.stream.is_none() => head.stream = Some(self.bool_or_null()?),
                b"model" | b"stream" | b"nvext" => return None,
                b"messages" => head.messages = self.value(Shape::Messages)?,
                b"prompt" => head.prompt = self.value(Shape::Prompt)?,
                _ => {
                    self.value(Shape::Ignored)?;
                }
            }
            if !self.next_or_close(b'}')? {
                return Some(head);
            }
        }
    }

    /// Any value, read as the estimate reads it at `shape` (see [`Shape`]).
    fn value(&mut self, shape: Shape) -> Option<PromptTexts> {
        match self.peek()? {
            b'"' => {
                let span = self.string()?;
                let mut texts = PromptTexts::default();
                if matches!(shape, Shape::Content | Shape::Text | Shape::Prompt) {
                    texts.add(&self.decoded(&span)?);
                }
                Some(texts)
            }
            b'[' => self.array(shape),
            b'{' => self.object(shape),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            // Where the slow path decodes a number (any shape but `Ignored`) it may refuse one
            // out of range: leave those to it.
            b'-' | b'0'..=b'9' if matches!(shape, Shape::Ignored) => self.number(),
            _ => None,
        }
    }

    fn literal(&mut self, word: &[u8]) -> Option<PromptTexts> {
        let end = self.pos + word.len();
        (self.bytes().get(self.pos..end)? == word).then(|| self.pos = end)?;
        Some(PromptTexts::default())
    }

    fn bool_or_null(&mut self) -> Option<bool> {
        let (word, value): (&[u8], bool) = match self.peek()? {
            b't' => (b"true", true),
            b'f' => (b"false", false),
            b'n' => (b"null", false),
            _ => return None,
        };
        self.literal(word)?;
        Some(value)
    }

    fn array(&mut self, shape: Shape) -> Option<PromptTexts> {
        let item = shape.element();
        let mut texts = PromptTexts::default();
        if self.open(b'[', b']')? {
            return Some(texts);
        }
        loop {
            self.skip_ws();
            texts.merge(self.value(item)?);
            if !self.next_or_close(b']')? {
                return Some(texts);
            }
        }
    }

    /// An object; a message's last `content` and a part's last `text` count, as in a DOM.
    fn object(&mut self, shape: Shape) -> Option<PromptTexts> {
        let wanted: Option<(&[u8], Shape)> = match shape {
            Shape::Message => Some((b"content", Shape::Content)),
            Shape::Part => Some((b"text", Shape::Text)),
            _ => None,
        };
        let mut texts = PromptTexts::default();
        if self.open(b'{', b'}')? {
            return Some(texts);
        }
        loop {
            let key = self.key()?;
            match wanted {
                // An escaped key could spell the wanted one: the slow path unescapes it.
                Some(_) if key.escaped => return None,
                Some((name, inner)) if self.bytes().get(key.start..key.end)? == name => {
                    texts = self.value(inner)?;
                }
                _ => {
                    self.value(Shape::Ignored)?;
                }
            }
            if !self.next_or_close(b'}')? {
                return Some(texts);
            }
        }
    }

    /// A string at `pos`, validated: no control character, only JSON's escapes, `\u` escapes
    /// that are code points (a surrogate only in a high-low pair).
    fn string(&mut self) -> Option<Span> {
        self.eat(b'"')?;
        let start = self.pos;
        let mut escaped = false;
        loop {
            self.pos = plain_run_end(self.bytes(), self.pos);
            match self.peek()? {
                b'"' => break,
                b'\\' => {
                    escaped = true;
                    self.pos += escape_len(self.bytes(), self.pos)?;
                }
                _ => return None,
            }
        }
        let end = self.pos;
        self.pos += 1;
        Some(Span {
            start,
            end,
            escaped,
        })
    }

    /// A string value the router keeps (`model`), decoded.
    fn owned_string(&mut self) -> Option<String> {
        if self.peek()? != b'"' {
            return None;
        }
        let span = self.string()?;
        self.decoded(&span).map(|text| text.into_owned())
    }

    /// The contents of a validated string, unescaped only when it holds escapes.
    fn decoded(&self, span: &Span) -> Option<std::borrow::Cow<'_, str>> {
        let raw = self.text.get(span.start..span.end)?;
        if !span.escaped {
            return Some(std::borrow::Cow::Borrowed(raw));
        }
        unescape(raw).map(std::borrow::Cow::Owned)
    }

    /// A number in JSON's grammar: `-`? (`0` | [1-9][0-9]*) (`.` [0-9]+)? ([eE] [+-]? [0-9]+)?.
    fn number(&mut self) -> Option<PromptTexts> {
        let _ = self.eat(b'-');
        match self.peek()? {
            b'0' => self.pos += 1,
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        if self.eat(b'.').is_some() {
            self.some_digits()?;
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.pos += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.pos += 1;
            }
            self.some_digits()?;
        }
        Some(PromptTexts::default())
    }

    fn digits(&mut self) {
        while self.peek().is_some_and(|b| b.is_ascii_digit()) {
            self.pos += 1;
        }
    }

    fn some_digits(&mut self) -> Option<()> {
        let start = self.pos;
        self.digits();
        (self.pos > start).then_some(())
    }
}

/// The bytes a string's contents stop at: its closing quote, an escape, or a control character
/// (refused). A table lookup per byte instead of three comparisons (callgrind: the string walk was
/// the scan's largest part).
static STOPS_A_STRING: [bool; 256] = {
    let mut table = [false; 256];
    let mut byte = 0;
    while byte < 0x20 {
        table[byte] = true;
        byte += 1;
    }
    table[b'"' as usize] = true;
    table[b'\\' as usize] = true;
    table
};

/// Where the run of plain string bytes from `from` ends: the first byte that
/// [stops a string](STOPS_A_STRING), or the end of `bytes`. Eight bytes at a time while eight
/// remain (a quote, a backslash or a byte below 0x20 found by word arithmetic), then a table
/// lookup per byte.
fn plain_run_end(bytes: &[u8], from: usize) -> usize {
    const ONES: u64 = u64::from_le_bytes([0x01; 8]);
    const HIGHS: u64 = u64::from_le_bytes([0x80; 8]);
    // The high bit of every byte of `word` below `n` (n ≤ 0x80). A borrow can also flag a byte
    // above a flagged one, never one below it: the lowest flag is always a true one.
    let below = |word: u64, n: u8| word.wrapping_sub(ONES * u64::from(n)) & !word & HIGHS;
    let mut at = from;
    while let Some(chunk) = bytes.get(at..at + 8) {
        let mut word = [0; 8];
        word.copy_from_slice(chunk);
        let word = u64::from_le_bytes(word);
        // A byte equal to `b` is one below 1 once xored with `b`.
        let stops = below(word ^ (ONES * u64::from(b'"')), 1)
            | below(word ^ (ONES * u64::from(b'\\')), 1)
            | below(word, 0x20);
        if stops != 0 {
            return at + (stops.trailing_zeros() / 8) as usize;
        }
        at += 8;
    }
    while bytes
        .get(at)
        .is_some_and(|&byte| !STOPS_A_STRING[usize::from(byte)])
    {
        at += 1;
    }
    at
}

/// The length of the escape at `at` (a `\`): two bytes for JSON's one-letter escapes, six for a
/// `\u` code point, twelve for a surrogate pair; `None` for anything else.
fn escape_len(bytes: &[u8], at: usize) -> Option<usize> {
    match bytes.get(at + 1)? {
        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => Some(2),
        b'u' => match hex4(bytes, at + 2)? {
            0xD800..=0xDBFF => {
                (bytes.get(at + 6..at + 8)? == b"\\u").then_some(())?;
                matches!(hex4(bytes, at + 8)?, 0xDC00..=0xDFFF).then_some(12)
            }
            0xDC00..=0xDFFF => None,
            _ => Some(6),
        },
        _ => None,
    }
}

/// The text of a string whose escapes [`Scanner::string`] validated.
fn unescape(raw: &str) -> Option<String> {
    let bytes = raw.as_bytes();
    let mut out = String::with_capacity(raw.len());
    let mut i = 0;
    while let Some(at) = bytes.get(i..)?.iter().position(|&b| b == b'\\') {
        out.push_str(raw.get(i..i + at)?);
        i += at;
        let (ch, len) = match bytes.get(i + 1)? {
            b'"' => ('"', 2),
            b'\\' => ('\\', 2),
            b'/' => ('/', 2),
            b'b' => ('\u{8}', 2),
            b'f' => ('\u{c}', 2),
            b'n' => ('\n', 2),
            b'r' => ('\r', 2),
            b't' => ('\t', 2),
            _ => code_point(bytes, i)?,
        };
        out.push(ch);
        i += len;
    }
    out.push_str(raw.get(i..)?);
    Some(out)
}

/// The character of the `\u` escape (or surrogate pair) at `at`, and its length.
fn code_point(bytes: &[u8], at: usize) -> Option<(char, usize)> {
    let unit = u32::from(hex4(bytes, at + 2)?);
    if !(0xD800..=0xDBFF).contains(&unit) {
        return Some((char::from_u32(unit)?, 6));
    }
    let low = u32::from(hex4(bytes, at + 8)?);
    (0xDC00..=0xDFFF).contains(&low).then_some(())?;
    let ch = char::from_u32(0x10000 + ((unit - 0xD800) << 10) + low.checked_sub(0xDC00)?)?;
    Some((ch, 12))
}

#[cfg(test)]
mod tests {
    use super::super::{ParsedBody, parse as parse_any, parse_slow};
    use super::*;
    use bytes::Bytes;
    use proptest::prelude::*;

    /// A parse's outcome in comparable form: the accepted body's fields, or the error's text.
    fn outcome(
        result: Result<ParsedBody, crate::wire::error::ApiError>,
    ) -> Result<(String, bool, usize, Bytes, u64), String> {
        result
            .map(|p| (p.model, p.stream, p.stripped, p.outbound, p.prompt_tokens))
            .map_err(|e| format!("{e:?}"))
    }

    /// The fast path, when it answers, answers as the slow path does; `parse` as a whole always
    /// answers as the slow path does.
    fn agree(body: &[u8]) -> Result<bool, TestCaseError> {
        let bytes = Bytes::copy_from_slice(body);
        let slow = outcome(parse_slow(bytes.clone()));
        prop_assert_eq!(&outcome(parse_any(bytes.clone())), &slow);
        let Some(fast) = std::str::from_utf8(body).ok().and_then(parse) else {
            return Ok(false);
        };
        let Ok((model, stream, stripped, outbound, prompt_tokens)) = slow else {
            return Err(TestCaseError::fail(format!(
                "fast accepted what slow refused: {slow:?}"
            )));
        };
        prop_assert_eq!(
            fast,
            Fast {
                model,
                stream,
                prompt_tokens
            }
        );
        prop_assert_eq!(stripped, 0);
        prop_assert_eq!(&outbound[..], body);
        Ok(true)
    }

    #[test]
    fn common_bodies_take_the_fast_path() {
        for body in [
            r#"{"model":"m","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Say hello in two words, please."}],"max_tokens":16}"#,
            r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"line\nnext \"quoted\" \u00e9\ud83d\ude00"}]}"#,
            r#" {"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a b"},{"type":"image_url","image_url":{"url":"x"}}]}],"temperature":0.7,"stop":null}"#,
            r#"{"prompt":["a","b c"],"model":"m\u0031","stream":null,"max_tokens":-1e5}"#,
        ] {
            assert!(agree(body.as_bytes()).expect(body), "{body}");
        }
    }

    #[test]
    fn doubtful_bodies_go_the_slow_way() {
        for body in [
            r#"{"model":"m","nvext":{}}"#,
            r#"{"model":"m","model":"m"}"#,
            r#"{"m\u006fdel":"m"}"#,
            r#"{"model":"m","messages":[{"c\u006fntent":"x"}]}"#,
            r#"{"model":"m","messages":[1e400]}"#,
            r#"{"model":"m","x":"\ud800"}"#,
            r#"{"model":"m","x":"\q"}"#,
            r#"{"model":"m","x":01}"#,
            "{\"model\":\"m\",\"x\":\"\u{1}\"}",
            "\u{c}{\"model\":\"m\"}",
            r#"{"model":" "}"#,
            r#"{"model":"m"} x"#,
        ] {
            assert!(!agree(body.as_bytes()).expect(body), "{body}");
        }
    }

    /// String contents as a client may spell them.
    fn string() -> impl Strategy<Value = String> {
        let piece = prop::sample::select(vec![
            "a",
            "bc",
            " ",
            "  ",
            "\\n",
            "\\t",
            "\\\"",
            "\\\\",
            "\\/",
            "\\b",
            "\\u00e9",
            "\\u0041",
            "\\ud83d\\ude00",
            "\\uD83D\\uDE00",
            "é",
            "😀",
            "你好",
            "{",
            "[",
            "]",
            "}",
            ",",
            ":",
            "\\u0020",
            "\\u2003",
            "\u{2003}",
            "\\u0000",
            "\\ud800",
            "\\udc00",
            "\\uDFFF",
            "\\ud83d\\u0041",
        ]);
        prop::collection::vec(piece, 0..6).prop_map(|p| format!("\"{}\"", p.concat()))
    }

    fn number() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<i64>().prop_map(|n| n.to_string()),
            any::<f64>().prop_map(|n| if n.is_finite() {
                n.to_string()
            } else {
                "0".into()
            }),
            prop::sample::select(vec![
                "0",
                "-0",
                "1.5",
                "-2.5e10",
                "1e400",
                "-1e400",
                "1E-7",
                "1e+2",
                "0.0",
                "123456789012345678901234567890",
            ])
            .prop_map(str::to_owned),
        ]
    }

    fn ws() -> impl Strategy<Value = &'static str> {
        prop::sample::select(vec!["", "", "", " ", "\n  ", "\t", "\r\n"])
    }

    fn key() -> impl Strategy<Value = String> {
        prop::sample::select(vec![
            "\"content\"",
            "\"text\"",
            "\"role\"",
            "\"type\"",
            "\"x\"",
            "\"c\\u006fntent\"",
            "\"te\\u0078t\"",
            "\"model\"",
            "\"\"",
        ])
        .prop_map(str::to_owned)
    }

    fn members(inner: impl Strategy<Value = String>, n: usize) -> impl Strategy<Value = String> {
        prop::collection::vec((key(), ws(), ws(), inner), 0..n).prop_map(|members| {
            let items: Vec<String> = members
                .into_iter()
                .map(|(k, a, b, v)| format!("{a}{k}{b}:{v}"))
                .collect();
            format!("{{{}}}", items.join(","))
        })
    }

    fn elements(inner: impl Strategy<Value = String>, n: usize) -> impl Strategy<Value = String> {
        prop::collection::vec((ws(), inner), 0..n).prop_map(|items| {
            let items: Vec<String> = items.into_iter().map(|(a, v)| format!("{a}{v}")).collect();
            format!("[{}]", items.join(","))
        })
    }

    /// Any JSON value, nested a few levels.
    fn value() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            prop::sample::select(vec!["null", "true", "false"]).prop_map(str::to_owned),
            number(),
            string(),
        ];
        leaf.prop_recursive(4, 32, 4, |inner| {
            prop_oneof![elements(inner.clone(), 4), members(inner, 4)]
        })
    }

    /// `messages` as clients send it, and sometimes anything else.
    fn messages() -> impl Strategy<Value = String> {
        let part = prop_oneof![
            3 => (string(), value()).prop_map(|(t, v)| format!(r#"{{"type":"text","text":{t},"extra":{v}}}"#)),
            1 => value(),
        ];
        let content = prop_oneof![3 => string(), 2 => elements(part, 4), 1 => value()];
        let message = prop_oneof![
            4 => (content.clone(), prop::option::of(content))
                .prop_map(|(c, again)| match again {
                    Some(again) => format!(r#"{{"role":"user","content":{c},"content":{again}}}"#),
                    None => format!(r#"{{"role":"user","content":{c}}}"#),
                }),
            1 => value(),
        ];
        prop_oneof![4 => elements(message, 5), 1 => value()]
    }

    fn prompt() -> impl Strategy<Value = String> {
        prop_oneof![
            string(),
            elements(prop_oneof![3 => string(), 1 => value()], 4),
            value()
        ]
    }

    /// A deep value near the nesting bound.
    fn deep() -> impl Strategy<Value = String> {
        (MAX_JSON_DEPTH - 3..MAX_JSON_DEPTH + 3, any::<bool>()).prop_map(|(depth, objects)| {
            if objects {
                format!("{}1{}", "{\"a\":".repeat(depth), "}".repeat(depth))
            } else {
                format!("{}{}", "[".repeat(depth), "]".repeat(depth))
            }
        })
    }

    /// A top-level member: mostly the fields the router reads, sometimes a repeat, an escaped
    /// key, `nvext`, a wrongly typed value or a deep one.
    fn member() -> impl Strategy<Value = (String, String)> {
        let named = |k: &'static str, v: BoxedStrategy<String>| {
            v.prop_map(move |v| (format!("\"{k}\""), v))
        };
        prop_oneof![
            3 => named("messages", messages().boxed()),
            2 => named("prompt", prompt().boxed()),
            2 => named("stream", prop_oneof![
                4 => prop::sample::select(vec!["true", "false", "null"]).prop_map(str::to_owned),
                1 => value(),
            ].boxed()),
            1 => named("model", prop_oneof![3 => string(), 1 => value()].boxed()),
            2 => named("max_tokens", value().boxed()),
            1 => named("nvext", value().boxed()),
            1 => named("x", deep().boxed()),
            1 => (prop::sample::select(vec!["\"m\\u006fdel\"", "\"str\\u0065am\"", "\"nv\\u0065xt\"", "\"\\u0078\""]), value())
                .prop_map(|(k, v)| (k.to_owned(), v)),
        ]
    }

    fn body() -> impl Strategy<Value = String> {
        let model = prop_oneof![
            6 => Just("\"m\"".to_owned()),
            1 => string(),
        ];
        (
            model,
            prop::collection::vec(member(), 0..5),
            any::<bool>(),
            ws(),
            ws(),
        )
            .prop_flat_map(|(model, others, model_first, a, b)| {
                let mut all = others;
                if model_first {
                    all.insert(0, ("\"model\"".to_owned(), model));
                } else {
                    all.push(("\"model\"".to_owned(), model));
                }
                (Just(all).prop_shuffle(), Just(a), Just(b)).prop_map(|(all, a, b)| {
                    let items: Vec<String> = all
                        .into_iter()
                        .map(|(k, v)| format!("{a}{k}{b}:{b}{v}{a}"))
                        .collect();
                    format!("{a}{{{}}}{b}", items.join(","))
                })
            })
    }

    /// A few byte edits: inserted, replaced or removed, from bytes that matter to JSON.
    fn mutated() -> impl Strategy<Value = Vec<u8>> {
        let byte = prop::sample::select(b"\"\\{}[],:u0e-.+ \n\x01\x0c\xff\xc3\xa9d8tnfaz".to_vec());
        (
            body(),
            prop::collection::vec((any::<prop::sample::Index>(), 0..3u8, byte), 1..4),
        )
            .prop_map(|(body, edits)| {
                let mut bytes = body.into_bytes();
                for (at, op, byte) in edits {
                    let i = at.index(bytes.len() + 1);
                    match op {
                        0 => bytes.insert(i, byte),
                        1 if i < bytes.len() => bytes[i] = byte,
                        _ if i < bytes.len() => {
                            bytes.remove(i);
                        }
                        _ => bytes.push(byte),
                    }
                }
                bytes
            })
    }

    /// The word-at-a-time run end is the byte loop's, at every offset of every length.
    #[test]
    fn plain_runs_end_where_the_byte_loop_says() {
        let byte_loop = |bytes: &[u8], from: usize| {
            (from..bytes.len())
                .find(|&at| STOPS_A_STRING[usize::from(bytes[at])])
                .unwrap_or(bytes.len())
        };
        let alphabet: &[u8] = b"a\"\\\x00\x1f\x20\x7f\x80\xff\x21\x5b\x5d";
        for len in 0..20 {
            for stop in 0..len {
                for &byte in alphabet {
                    let mut bytes = vec![b'x'; len];
                    bytes[stop] = byte;
                    for from in 0..=len {
                        assert_eq!(
                            plain_run_end(&bytes, from),
                            byte_loop(&bytes, from),
                            "{bytes:?} from {from}"
                        );
                    }
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]

        #[test]
        fn plain_run_ends_agree_with_the_byte_loop(bytes in prop::collection::vec(any::<u8>(), 0..40), from in 0usize..41) {
            let from = from.min(bytes.len());
            let expected = (from..bytes.len())
                .find(|&at| STOPS_A_STRING[usize::from(bytes[at])])
                .unwrap_or(bytes.len());
            prop_assert_eq!(plain_run_end(&bytes, from), expected);
        }

        #[test]
        fn the_fast_path_agrees_with_the_slow_one(body in body()) {
            agree(body.as_bytes())?;
        }

        #[test]
        fn the_fast_path_agrees_with_the_slow_one_on_mutated_bodies(body in mutated()) {
            agree(&body)?;
        }
    }
}
