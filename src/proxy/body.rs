//! Bounded request-body reading, JSON validation and the removal of every body field a client
//! could pin a worker with.

use std::fmt;

use axum::body::Body;
use axum::http::{HeaderMap, header};
use bytes::Bytes;
use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;
use serde_json::value::RawValue;

use continuum_protocol::picker::estimate::{
    TOKENS_PER_MESSAGE, TOKENS_PER_PROMPT, estimate_text_tokens,
};

use super::relay::{CollectError, collect_bounded};
use crate::wire::error::ApiError;

mod fast;

/// Largest request body the OpenAI surface accepts, checked before any parsing.
pub const MAX_REQUEST_BODY_BYTES: usize = 8 * 1024 * 1024;

/// `nvext` fields that choose a worker, a rank or the prompt tokens; the direct-mode frontend
/// honours all of them (fixtures `transcripts/disagg/extra-cases.txt`, dynamo-wire §14.2–14.3).
pub const NVEXT_PIN_FIELDS: [&str; 6] = [
    "backend_instance_id",
    "decode_worker_id",
    "prefill_worker_id",
    "token_data",
    "dp_rank",
    "prefill_dp_rank",
];

/// A validated client request, ready to dispatch.
#[derive(Clone, Debug)]
pub struct ParsedBody {
    /// The client's model id (kept verbatim in the outbound body).
    pub model: String,
    /// `stream: true`.
    pub stream: bool,
    /// The outbound body: the client's bytes, re-encoded only when pin fields were removed.
    pub outbound: Bytes,
    /// How many pin fields were removed.
    pub stripped: usize,
    /// The tokenizer-free prompt-size estimate of `messages[].content` (strings and text parts)
    /// and `prompt` (a string or strings), read during this same top-level parse so the picker
    /// never parses the body again (`continuum_protocol::picker::estimate`).
    pub prompt_tokens: u64,
}

/// Reads at most `limit` bytes of `body`; a declared or actual excess is a 413.
pub async fn read_bounded(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
) -> Result<Bytes, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large(limit));
    }
    match collect_bounded(body, limit).await {
        Ok(bytes) => Ok(bytes),
        Err(CollectError::TooLarge(_)) => Err(too_large(limit)),
        Err(CollectError::Body(error)) if crate::wire::is_body_read_timeout(&error) => {
            Err(ApiError::RequestTimeout(error.to_string()))
        }
        Err(CollectError::Body(error)) => Err(ApiError::BadRequest(format!(
            "could not read the request body: {error}"
        ))),
    }
}

fn too_large(limit: usize) -> ApiError {
    ApiError::PayloadTooLarge(format!("the request body exceeds {limit} bytes"))
}

/// Deepest array/object nesting accepted anywhere in a body (serde_json's own recursion limit,
/// which the slow path's DOM parse enforces too).
pub const MAX_JSON_DEPTH: usize = 128;

/// Parses an OpenAI chat/completions body: a JSON object with a non-empty string `model`.
///
/// The whole body must be UTF-8 and every `\u` escape a valid code point (no lone surrogates),
/// including in values the router never reads: they are refused with 400 like any malformed JSON.
/// The parse reads only the top level: `model`, `stream`, and the key names of `nvext`; every
/// other value is validated as JSON and skipped without building a DOM, and the client's bytes
/// are forwarded untouched. A body whose `nvext` holds a pin field is forwarded with those
/// members cut out of the client's bytes (and `nvext` itself when nothing else is left in it):
/// one copy of the body, never a DOM of it. A repeated `model`, `stream` or `nvext` key is
/// refused: parsers disagree on which copy wins, so a forwarded body could otherwise carry a pin
/// the router never saw.
///
/// The common case (no `nvext`, no escapes where the router reads keys) is judged by
/// [`fast::parse`] in one pass; anything it is unsure of goes through [`parse_slow`], which gives
/// every verdict and error message the router always gave.
pub fn parse(bytes: Bytes) -> Result<ParsedBody, ApiError> {
    let fast = std::str::from_utf8(&bytes).ok().and_then(fast::parse);
    let Some(fast) = fast else {
        return parse_slow(bytes);
    };
    Ok(ParsedBody {
        model: fast.model,
        stream: fast.stream,
        outbound: bytes,
        stripped: 0,
        prompt_tokens: fast.prompt_tokens,
    })
}

/// [`parse`] for every body: the UTF-8 check, [`check_structure`], serde_json's top-level scan
/// with the `nvext` splice and the prompt walk, each its own pass.
fn parse_slow(bytes: Bytes) -> Result<ParsedBody, ApiError> {
    if let Err(error) = std::str::from_utf8(&bytes) {
        return Err(ApiError::BadRequest(format!(
            "the request body is not valid JSON: invalid UTF-8 at byte {}",
            error.valid_up_to()
        )));
    }
    check_structure(&bytes)?;
    let head = scan_head(&bytes)?;
    let prompt_tokens = head.prompt_tokens();
    let model = match head.model {
        Some(Scalar::Str(m)) if !m.trim().is_empty() => m,
        Some(_) => {
            return Err(ApiError::BadRequest(
                "`model` must be a non-empty string".into(),
            ));
        }
        None => return Err(ApiError::BadRequest("`model` is required".into())),
    };
    let stream = match head.stream {
        None | Some(Scalar::Null) => false,
        Some(Scalar::Bool(b)) => b,
        Some(_) => return Err(ApiError::BadRequest("`stream` must be a boolean".into())),
    };
    let Some(edit) = head.nvext.filter(|edit| edit.stripped > 0) else {
        // Untouched bodies are forwarded byte for byte.
        return Ok(ParsedBody {
            model,
            stream,
            outbound: bytes,
            stripped: 0,
            prompt_tokens,
        });
    };
    let outbound = Bytes::from(edit.apply(&bytes));
    Ok(ParsedBody {
        model,
        stream,
        outbound,
        stripped: edit.stripped,
        prompt_tokens,
    })
}

fn invalid_json(error: serde_json::Error) -> ApiError {
    ApiError::BadRequest(format!("the request body is not valid JSON: {error}"))
}

/// One pass over the bytes: refuses nesting deeper than [`MAX_JSON_DEPTH`] and `\u` escapes that
/// are lone surrogates.
///
/// The top-level scan skips values iteratively (no recursion limit of its own) and never decodes
/// the strings it skips, so both bounds a DOM parse would give are kept here. Brackets inside
/// strings are ignored; anything else malformed is left to the JSON parser to report.
fn check_structure(bytes: &[u8]) -> Result<(), ApiError> {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut i = 0usize;
    while let Some(&b) = bytes.get(i) {
        if in_string {
            match b {
                b'\\' if bytes.get(i + 1) == Some(&b'u') => {
                    i += escape_len(bytes, i)?;
                    continue;
                }
                // Any other escape is two bytes; the parser judges which letters are allowed.
                b'\\' => i += 1,
                b'"' => in_string = false,
                _ => {}
            }
            i += 1;
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > MAX_JSON_DEPTH {
                    return Err(ApiError::BadRequest(format!(
                        "the request body nests deeper than {MAX_JSON_DEPTH} levels"
                    )));
                }
            }
            // Unbalanced closers are the JSON parser's to report.
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        i += 1;
    }
    Ok(())
}

/// The length of the `\uXXXX` escape (or surrogate pair) at `at`, refusing lone surrogates the
/// way serde_json does when it decodes a string. Malformed hex is left to the parser.
fn escape_len(bytes: &[u8], at: usize) -> Result<usize, ApiError> {
    let Some(unit) = hex4(bytes, at + 2) else {
        return Ok(2);
    };
    let lone = || {
        ApiError::BadRequest(format!(
            "the request body is not valid JSON: lone surrogate in a \\u escape at byte {at}"
        ))
    };
    match unit {
        0xD800..=0xDBFF => {
            let low = (bytes.get(at + 6..at + 8) == Some(b"\\u".as_slice()))
                .then(|| hex4(bytes, at + 8))
                .flatten();
            match low {
                Some(0xDC00..=0xDFFF) => Ok(12),
                _ => Err(lone()),
            }
        }
        0xDC00..=0xDFFF => Err(lone()),
        _ => Ok(6),
    }
}

/// Four hex digits at `at` as a UTF-16 code unit.
fn hex4(bytes: &[u8], at: usize) -> Option<u16> {
    let digits = bytes.get(at..at + 4)?;
    digits.iter().try_fold(0u16, |acc, &d| {
        let v = (d as char).to_digit(16)?;
        Some(acc << 4 | v as u16)
    })
}

/// What the router reads of a body's top level.
#[derive(Default)]
struct Head {
    model: Option<Scalar>,
    stream: Option<Scalar>,
    /// Where `nvext` sits and which of its members are pins, when it is an object.
    nvext: Option<NvextEdit>,
    /// The texts of the last `messages` and the last `prompt` (a repeated key: the last copy
    /// counts, as in a DOM).
    messages: PromptTexts,
    prompt: PromptTexts,
}

impl Head {
    /// [`estimate_prompt_tokens`] over the messages' texts, then the prompt's.
    fn prompt_tokens(&self) -> u64 {
        let count = self.messages.count.saturating_add(self.prompt.count);
        if count == 0 {
            return 0;
        }
        self.messages
            .tokens
            .saturating_add(self.prompt.tokens)
            .saturating_add(TOKENS_PER_PROMPT)
    }
}

/// A top-level value reduced to what validation needs.
enum Scalar {
    Str(String),
    Bool(bool),
    Null,
    Other,
}

/// The byte ranges of a top-level `nvext` object, enough to cut its pin members out of the
/// client's bytes without decoding anything else.
struct NvextEdit {
    /// Where the previous top-level member's value ends (or just past the body's `{` when `nvext`
    /// is the first member).
    before: usize,
    /// Whether a top-level member precedes `nvext`.
    has_previous: bool,
    /// The `nvext` value (`{` to `}`).
    value: std::ops::Range<usize>,
    /// Each `nvext` member in order: its value's range and whether its key is a pin field.
    members: Vec<(std::ops::Range<usize>, bool)>,
    /// How many distinct pin fields the object holds (a repeated key counts once, as a DOM sees it).
    stripped: usize,
}

impl NvextEdit {
    /// The client's bytes with the pin members removed, and `nvext` with them when it holds
    /// nothing else. One allocation of at most the body's size.
    fn apply(&self, body: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(body.len());
        if self.members.iter().all(|(_, pin)| *pin) {
            if self.has_previous {
                // `, "nvext": {...}` goes: from the previous value's end to nvext's end.
                out.extend_from_slice(&body[..self.before]);
                out.extend_from_slice(&body[self.value.end..]);
            } else {
                // First member: `"nvext": {...} ,` goes, up to the next key (or the closing `}`).
                let key = key_start(body, self.before);
                let mut next = self.value.end;
                let rest = skip_ws(body, next);
                if body.get(rest) == Some(&b',') {
                    next = skip_ws(body, rest + 1);
                }
                out.extend_from_slice(&body[..key]);
                out.extend_from_slice(&body[next..]);
            }
            return out;
        }
        out.extend_from_slice(&body[..self.value.start]);
        out.push(b'{');
        // Each member's text runs from its key's opening quote to its value's end; the bytes
        // between one value's end and the next key are whitespace and a comma only.
        let mut boundary = self.value.start + 1;
        let mut first = true;
        for (value, pin) in &self.members {
            if !pin {
                if !first {
                    out.push(b',');
                }
                first = false;
                out.extend_from_slice(&body[key_start(body, boundary)..value.end]);
            }
            boundary = value.end;
        }
        out.push(b'}');
        out.extend_from_slice(&body[self.value.end..]);
        out
    }
}

/// The opening quote of the key that follows `from` (only whitespace and a comma lie between).
fn key_start(body: &[u8], from: usize) -> usize {
    body[from..]
        .iter()
        .position(|&b| b == b'"')
        .map_or(body.len(), |p| from + p)
}

fn skip_ws(body: &[u8], from: usize) -> usize {
    body[from.min(body.len())..]
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .map_or(body.len(), |p| from + p)
}

fn scan_head(bytes: &[u8]) -> Result<Head, ApiError> {
    // A struct visitor would also accept a JSON array in field order: demand an object.
    let open = bytes
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(bytes.len());
    if bytes.get(open) != Some(&b'{') {
        // Invalid JSON keeps its parser message; valid non-objects get the shape message.
        serde_json::from_slice::<IgnoredAny>(bytes).map_err(invalid_json)?;
        return Err(ApiError::BadRequest(
            "the request body must be a JSON object".into(),
        ));
    }
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let head = (&mut deserializer)
        .deserialize_map(HeadVisitor {
            base: bytes.as_ptr() as usize,
            len: bytes.len(),
            open,
        })
        .map_err(invalid_json)?;
    deserializer.end().map_err(invalid_json)?;
    Ok(head)
}

/// Reads the top-level object into a [`Head`], noting where each value ends (values borrow
/// from the body, so their offsets are pointer differences from its start).
struct HeadVisitor {
    base: usize,
    len: usize,
    /// Offset of the body's `{`.
    open: usize,
}

impl HeadVisitor {
    fn range<E: de::Error>(&self, raw: &RawValue) -> Result<std::ops::Range<usize>, E> {
        range_in(self.base, self.len, raw)
    }
}

/// Where `raw` (borrowed from the body at `base`, `len` bytes) sits in the body.
fn range_in<E: de::Error>(
    base: usize,
    len: usize,
    raw: &RawValue,
) -> Result<std::ops::Range<usize>, E> {
    let text = raw.get();
    (text.as_ptr() as usize)
        .checked_sub(base)
        .map(|start| start..start + text.len())
        .filter(|range| range.end <= len)
        .ok_or_else(|| E::custom("a value outside the body"))
}

impl<'de> Visitor<'de> for HeadVisitor {
    type Value = Head;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Head, A::Error> {
        let mut head = Head::default();
        let mut seen_nvext = false;
        let mut previous_end = None;
        while let Some(key) = map.next_key::<TopKey>()? {
            let raw: &'de RawValue = map.next_value()?;
            let range = self.range(raw)?;
            match key {
                TopKey::Model if head.model.is_some() => return Err(duplicate("model")),
                TopKey::Model => head.model = Some(scalar(raw)?),
                TopKey::Stream if head.stream.is_some() => return Err(duplicate("stream")),
                TopKey::Stream => head.stream = Some(scalar(raw)?),
                TopKey::Nvext if seen_nvext => return Err(duplicate("nvext")),
                TopKey::Nvext => {
                    seen_nvext = true;
                    head.nvext = nvext_members(self.base, self.len, raw)?.map(|members| {
                        let stripped = NVEXT_PIN_FIELDS
                            .iter()
                            .enumerate()
                            .filter(|(i, _)| members.iter().any(|(_, pin)| *pin == Some(*i)))
                            .count();
                        NvextEdit {
                            before: previous_end.unwrap_or(self.open + 1),
                            has_previous: previous_end.is_some(),
                            value: range.clone(),
                            members: members
                                .into_iter()
                                .map(|(value, pin)| (value, pin.is_some()))
                                .collect(),
                            stripped,
                        }
                    });
                }
                TopKey::Messages => head.messages = prompt_texts(raw, PromptField::Messages)?,
                TopKey::Prompt => head.prompt = prompt_texts(raw, PromptField::Prompt)?,
                TopKey::Other => {}
            }
            previous_end = Some(range.end);
        }
        Ok(head)
    }
}

fn duplicate<E: de::Error>(key: &str) -> E {
    E::custom(format_args!("the key `{key}` appears more than once"))
}

fn scalar<E: de::Error>(raw: &RawValue) -> Result<Scalar, E> {
    serde_json::from_str::<ScalarValue>(raw.get())
        .map(|v| v.0)
        .map_err(E::custom)
}

/// The members of an `nvext` object (value range, index of the pin field its key names), or
/// `None` when `nvext` is not an object (then it carries no pin and is forwarded as sent).
#[allow(clippy::type_complexity)]
fn nvext_members<E: de::Error>(
    base: usize,
    len: usize,
    raw: &RawValue,
) -> Result<Option<Vec<(std::ops::Range<usize>, Option<usize>)>>, E> {
    if !raw.get().starts_with('{') {
        return Ok(None);
    }
    struct Members<'a> {
        base: usize,
        len: usize,
        marker: std::marker::PhantomData<&'a ()>,
    }
    impl<'de> Visitor<'de> for Members<'de> {
        type Value = Vec<(std::ops::Range<usize>, Option<usize>)>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut members = Vec::new();
            while let Some(PinKey(pin)) = map.next_key()? {
                let value: &'de RawValue = map.next_value()?;
                members.push((range_in(self.base, self.len, value)?, pin));
            }
            Ok(members)
        }
    }
    let mut deserializer = serde_json::Deserializer::from_str(raw.get());
    (&mut deserializer)
        .deserialize_map(Members {
            base,
            len,
            marker: std::marker::PhantomData,
        })
        .map(Some)
        .map_err(E::custom)
}

/// A top-level key, compared after JSON unescaping (`"nv\u0065xt"` is `nvext`).
enum TopKey {
    Model,
    Stream,
    Nvext,
    Messages,
    Prompt,
    Other,
}

impl<'de> Deserialize<'de> for TopKey {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl Visitor<'_> for KeyVisitor {
            type Value = TopKey;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object key")
            }
            fn visit_str<E: de::Error>(self, key: &str) -> Result<TopKey, E> {
                Ok(match key {
                    "model" => TopKey::Model,
                    "stream" => TopKey::Stream,
                    "nvext" => TopKey::Nvext,
                    "messages" => TopKey::Messages,
                    "prompt" => TopKey::Prompt,
                    _ => TopKey::Other,
                })
            }
        }
        deserializer.deserialize_str(KeyVisitor)
    }
}

/// Any JSON value as a [`Scalar`]; arrays and objects are skipped and reported as `Other`.
struct ScalarValue(Scalar);

impl<'de> Deserialize<'de> for ScalarValue {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ScalarVisitor;
        impl<'de> Visitor<'de> for ScalarVisitor {
            type Value = ScalarValue;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ScalarValue, E> {
                Ok(ScalarValue(Scalar::Str(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<ScalarValue, E> {
                Ok(ScalarValue(Scalar::Str(v)))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<ScalarValue, E> {
                Ok(ScalarValue(Scalar::Bool(v)))
            }
            fn visit_unit<E: de::Error>(self) -> Result<ScalarValue, E> {
                Ok(ScalarValue(Scalar::Null))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<ScalarValue, E> {
                Ok(ScalarValue(Scalar::Other))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<ScalarValue, E> {
                Ok(ScalarValue(Scalar::Other))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<ScalarValue, E> {
                Ok(ScalarValue(Scalar::Other))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<ScalarValue, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(ScalarValue(Scalar::Other))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ScalarValue, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(ScalarValue(Scalar::Other))
            }
        }
        deserializer.deserialize_any(ScalarVisitor)
    }
}

/// The texts one top-level field contributes to the prompt-size estimate: the sum of their
/// per-text estimates with the per-message framing, and how many there are.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct PromptTexts {
    tokens: u64,
    count: u64,
}

impl PromptTexts {
    fn add(&mut self, text: &str) {
        self.tokens = self
            .tokens
            .saturating_add(estimate_text_tokens(text))
            .saturating_add(TOKENS_PER_MESSAGE);
        self.count += 1;
    }

    fn merge(&mut self, other: PromptTexts) {
        self.tokens = self.tokens.saturating_add(other.tokens);
        self.count = self.count.saturating_add(other.count);
    }
}

/// Which top-level field a value is read as.
#[derive(Clone, Copy)]
enum PromptField {
    /// `messages`: an array of messages, each an object whose last `content` is a string or an
    /// array of parts, each an object whose last `text` is a string.
    Messages,
    /// `prompt`: a string, or an array whose strings count.
    Prompt,
}

/// The texts of a top-level `messages` or `prompt` value. The value was just read (and
/// validated) as raw JSON by the top-level scan; this walks its bytes once more as typed,
/// borrowed JSON: no DOM, strings decoded only when they hold escapes. Anything of another shape
/// contributes nothing, as the picker's estimate over a DOM would read it.
fn prompt_texts<E: de::Error>(raw: &RawValue, field: PromptField) -> Result<PromptTexts, E> {
    let mut deserializer = serde_json::Deserializer::from_str(raw.get());
    let shape = match field {
        PromptField::Messages => Shape::Messages,
        PromptField::Prompt => Shape::Prompt,
    };
    de::DeserializeSeed::deserialize(shape, &mut deserializer)
        .map(|Walked(texts)| texts)
        .map_err(E::custom)
}

/// What a value means to the estimate at its position in a `messages` or `prompt` value.
#[derive(Clone, Copy)]
enum Shape {
    /// The `messages` array.
    Messages,
    /// One message: an object with `content`.
    Message,
    /// A message's `content`: a string, or an array of parts.
    Content,
    /// One content part: an object with `text`.
    Part,
    /// A value that counts when it is a string (a part's `text`, a `prompt` array item).
    Text,
    /// The `prompt`: a string or an array of strings.
    Prompt,
    /// Skipped.
    Ignored,
}

impl Shape {
    /// The shape of each element when a value of this shape is an array.
    fn element(self) -> Shape {
        match self {
            Shape::Messages => Shape::Message,
            Shape::Content => Shape::Part,
            Shape::Prompt => Shape::Text,
            _ => Shape::Ignored,
        }
    }
}

/// The texts found in one value.
struct Walked(PromptTexts);

/// An object key compared with the one key a shape reads (after unescaping).
struct KeyIs(&'static str);

impl<'de> de::DeserializeSeed<'de> for KeyIs {
    type Value = bool;
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<bool, D::Error> {
        struct KeyVisitor(&'static str);
        impl Visitor<'_> for KeyVisitor {
            type Value = bool;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object key")
            }
            fn visit_str<E: de::Error>(self, key: &str) -> Result<bool, E> {
                Ok(key == self.0)
            }
        }
        deserializer.deserialize_str(KeyVisitor(self.0))
    }
}

impl<'de> de::DeserializeSeed<'de> for Shape {
    type Value = Walked;
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Walked, D::Error> {
        match self {
            Shape::Ignored => {
                IgnoredAny::deserialize(deserializer)?;
                Ok(Walked(PromptTexts::default()))
            }
            _ => deserializer.deserialize_any(self),
        }
    }
}

impl<'de> Visitor<'de> for Shape {
    type Value = Walked;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Walked, E> {
        let mut texts = PromptTexts::default();
        if matches!(self, Shape::Content | Shape::Text | Shape::Prompt) {
            texts.add(v);
        }
        Ok(Walked(texts))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Walked, A::Error> {
        let item = self.element();
        let mut texts = PromptTexts::default();
        while let Some(Walked(found)) = seq.next_element_seed(item)? {
            texts.merge(found);
        }
        Ok(Walked(texts))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Walked, A::Error> {
        let (key, value) = match self {
            Shape::Message => ("content", Shape::Content),
            Shape::Part => ("text", Shape::Text),
            _ => ("", Shape::Ignored),
        };
        // A repeated key: the last copy counts, as in a DOM.
        let mut texts = PromptTexts::default();
        while let Some(wanted) = map.next_key_seed(KeyIs(key))? {
            if wanted && !key.is_empty() {
                texts = map.next_value_seed(value)?.0;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(Walked(texts))
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Walked, E> {
        Ok(Walked(PromptTexts::default()))
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Walked, E> {
        Ok(Walked(PromptTexts::default()))
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Walked, E> {
        Ok(Walked(PromptTexts::default()))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Walked, E> {
        Ok(Walked(PromptTexts::default()))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Walked, E> {
        Ok(Walked(PromptTexts::default()))
    }
}

/// An `nvext` key: the index of the pin field it names (after unescaping), if any.
struct PinKey(Option<usize>);

impl<'de> Deserialize<'de> for PinKey {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct PinKeyVisitor;
        impl Visitor<'_> for PinKeyVisitor {
            type Value = PinKey;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object key")
            }
            fn visit_str<E: de::Error>(self, key: &str) -> Result<PinKey, E> {
                Ok(PinKey(
                    NVEXT_PIN_FIELDS.iter().position(|field| *field == key),
                ))
            }
        }
        deserializer.deserialize_str(PinKeyVisitor)
    }
}

/// Removes [`NVEXT_PIN_FIELDS`] from `body.nvext`; an `nvext` left empty is removed too.
/// Returns how many fields were removed (counting an emptied `nvext` as a change).
pub fn strip_nvext_pins(body: &mut Value) -> usize {
    let Some(object) = body.as_object_mut() else {
        return 0;
    };
    let Some(Value::Object(nvext)) = object.get_mut("nvext") else {
        return 0;
    };
    let removed = NVEXT_PIN_FIELDS
        .iter()
        .filter(|field| nvext.remove(**field).is_some())
        .count();
    if removed > 0 && nvext.is_empty() {
        object.remove("nvext");
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pins_are_removed_and_other_fields_kept() {
        let body = json!({
            "model": "m", "stream": true, "messages": [],
            "nvext": {"backend_instance_id": 1, "decode_worker_id": 2, "prefill_worker_id": 3,
                      "token_data": [1, 2], "dp_rank": 0, "prefill_dp_rank": 1, "greed_sampling": true}
        });
        let parsed = parse(Bytes::from(body.to_string())).expect("valid");
        assert_eq!(parsed.model, "m");
        assert!(parsed.stream);
        assert_eq!(parsed.stripped, 6);
        let out: Value = serde_json::from_slice(&parsed.outbound).expect("json");
        assert_eq!(out["nvext"], json!({"greed_sampling": true}));
        assert_eq!(out["messages"], json!([]));
    }

    #[test]
    fn an_emptied_nvext_disappears_and_clean_bodies_pass_verbatim() {
        let mut v = json!({"model": "m", "nvext": {"token_data": [1]}});
        assert_eq!(strip_nvext_pins(&mut v), 1);
        assert_eq!(v, json!({"model": "m"}));
        let raw = Bytes::from_static(br#"{"model":"m",  "z":1,"a":2}"#);
        assert_eq!(parse(raw.clone()).expect("valid").outbound, raw);
    }

    #[test]
    fn model_and_shape_are_validated() {
        for bad in [
            r#"[1]"#,
            r#"{"model": 3}"#,
            r#"{}"#,
            r#"{"model": " "}"#,
            "nope",
            r#"{"model":"m","stream":"yes"}"#,
        ] {
            assert!(
                matches!(parse(Bytes::from(bad)), Err(ApiError::BadRequest(_))),
                "{bad}"
            );
        }
    }

    /// The pre-fast-path semantics: a DOM parse; pins stripped; the verdict on the same bytes.
    fn reference(bytes: &[u8]) -> Option<(String, bool, usize)> {
        let mut value: Value = serde_json::from_slice(bytes).ok()?;
        let object = value.as_object()?;
        let model = object.get("model")?.as_str()?.to_owned();
        let stream = match object.get("stream") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return None,
        };
        let stripped = strip_nvext_pins(&mut value);
        Some((model, stream, stripped))
    }

    #[test]
    fn the_fast_path_agrees_with_a_dom_parse_on_bodies_without_duplicates() {
        let bodies = [
            r#"{"model":"m"}"#,
            r#"  {"model":"m","stream":true,"messages":[{"role":"user","content":"{[\"nvext\"]}"}]}"#,
            r#"{"stream":null,"model":"m","nvext":{"greed_sampling":true}}"#,
            r#"{"model":"m","nvext":{"backend_instance_id":1}}"#,
            r#"{"model":"m","nvext":{"a":{"backend_instance_id":1},"prefill_dp_rank":0}}"#,
            r#"{"model":"m","nvext":[{"backend_instance_id":1}]}"#,
            r#"{"model":"m","nvext":null}"#,
            r#"{"model":"m","nvext":"backend_instance_id"}"#,
            r#"{"model":"m","x":{"nvext":{"backend_instance_id":1}}}"#,
            r#"{"model":"m","nvext":{"token_data":[1],"token_data":[2]}}"#,
            r#"{"m\u006fdel":"m","str\u0065am":false,"nv\u0065xt":{"decode_worker_\u0069d":2,"k":1}}"#,
            r#"{"model":"\u00e9\ud83d\ude00","stream":false}"#,
        ];
        for body in bodies {
            let parsed = parse(Bytes::from(body)).expect(body);
            let (model, stream, stripped) = reference(body.as_bytes()).expect(body);
            assert_eq!(
                (parsed.model.as_str(), parsed.stream, parsed.stripped),
                (model.as_str(), stream, stripped),
                "{body}"
            );
            if stripped == 0 {
                assert_eq!(parsed.outbound, body.as_bytes(), "{body}");
            }
            // Whatever went out has no pin left in its top-level nvext.
            let mut out: Value = serde_json::from_slice(&parsed.outbound).expect("json");
            assert_eq!(strip_nvext_pins(&mut out), 0, "{body}");
        }
    }

    #[test]
    fn escaped_pin_keys_are_stripped_after_unescaping() {
        let body = r#"{"model":"m","nv\u0065xt":{"backend_instance_\u0069d":5,"x":1}}"#;
        let parsed = parse(Bytes::from(body)).expect("valid");
        assert_eq!(parsed.stripped, 1);
        let out: Value = serde_json::from_slice(&parsed.outbound).expect("json");
        assert_eq!(out, json!({"model": "m", "nvext": {"x": 1}}));
    }

    #[test]
    fn repeated_routing_keys_are_refused() {
        for body in [
            r#"{"model":"m","nvext":{"backend_instance_id":5},"nvext":{}}"#,
            r#"{"model":"m","nvext":{},"nv\u0065xt":{"backend_instance_id":5}}"#,
            r#"{"model":"m","model":"n"}"#,
            r#"{"model":"m","stream":false,"stream":true}"#,
        ] {
            assert!(
                matches!(parse(Bytes::from(body)), Err(ApiError::BadRequest(_))),
                "{body}"
            );
        }
        // Repeats elsewhere carry no routing meaning and pass as sent.
        let body = r#"{"model":"m","max_tokens":1,"max_tokens":2}"#;
        assert_eq!(parse(Bytes::from(body)).expect("valid").outbound, body);
    }

    #[test]
    fn nesting_is_bounded_and_brackets_in_strings_do_not_count() {
        let nest = |depth: usize| {
            format!(
                r#"{{"model":"m","x":{}{}}}"#,
                "[".repeat(depth - 1),
                "]".repeat(depth - 1)
            )
        };
        assert!(parse(Bytes::from(nest(MAX_JSON_DEPTH))).is_ok());
        for depth in [MAX_JSON_DEPTH + 1, 200_000] {
            assert!(matches!(
                parse(Bytes::from(nest(depth))),
                Err(ApiError::BadRequest(_))
            ));
        }
        let body = format!(
            r#"{{"model":"m","x":"{}\"{}"}}"#,
            "[".repeat(10_000),
            "{".repeat(10_000)
        );
        assert!(parse(Bytes::from(body)).is_ok());
    }

    #[test]
    fn non_objects_and_broken_json_are_refused() {
        for bad in [
            r#"["m", true, {}]"#,
            r#""model""#,
            "",
            "   ",
            r#"{"model":"m""#,
            r#"{"model":"m"} trailing"#,
            r#"{"model":"m","x":tru}"#,
            r#"{"model":"m","x":"\u12"}"#,
            r#"{"m\ud800odel":"m"}"#,
        ] {
            assert!(
                matches!(parse(Bytes::from(bad)), Err(ApiError::BadRequest(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn skipped_strings_are_refused_for_invalid_utf8_and_lone_surrogates() {
        // serde_json skips an unread string without decoding it: the router checks it instead.
        let mut bad = br#"{"model":"m","messages":[{"role":"user","content":""#.to_vec();
        bad.extend_from_slice(b"\xff\xfe\xc0\x80");
        bad.extend_from_slice(br#""}]}"#);
        assert!(matches!(
            parse(Bytes::from(bad)),
            Err(ApiError::BadRequest(_))
        ));
        for bad in [
            r#"{"model":"m","x":"\ud800"}"#,
            r#"{"model":"m","x":"\udc00"}"#,
            r#"{"model":"m","x":"\ud800\u0041"}"#,
            r#"{"model":"m","x":"\ud800\\udc00"}"#,
            r#"{"model":"m","x":"a\uD83D"}"#,
            r#"{"model":"m","nvext":{"token_data":1,"y":"\udfff"}}"#,
        ] {
            let serde: Result<Value, _> = serde_json::from_str(bad);
            assert!(serde.is_err(), "serde refuses {bad}");
            assert!(
                matches!(parse(Bytes::from(bad)), Err(ApiError::BadRequest(_))),
                "{bad}"
            );
        }
        // Pairs, escaped backslashes and plain escapes pass.
        for good in [
            r#"{"model":"m","x":"\ud83d\ude00"}"#,
            r#"{"model":"m","x":"\\ud800"}"#,
            r#"{"model":"m","x":"\u00e9\n\"\\"}"#,
        ] {
            assert_eq!(parse(Bytes::from(good)).expect(good).outbound, good);
        }
    }

    mod splice {
        use super::*;
        use proptest::prelude::*;

        /// Any small JSON value, nested, sometimes holding pin-named keys of its own.
        fn json_value() -> impl Strategy<Value = Value> {
            let leaf = prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::Bool),
                any::<i32>().prop_map(|n| json!(n)),
                "[a-z{}\\[\\]\",:\\\\ é😀]{0,8}".prop_map(Value::String),
            ];
            leaf.prop_recursive(3, 24, 4, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                    prop::collection::vec((key_name(), inner), 0..4)
                        .prop_map(|members| Value::Object(members.into_iter().collect())),
                ]
            })
        }

        fn key_name() -> impl Strategy<Value = String> {
            prop_oneof![
                prop::sample::select(NVEXT_PIN_FIELDS.to_vec()).prop_map(str::to_owned),
                prop::sample::select(vec!["greed_sampling", "annotations", "a", "nvext"])
                    .prop_map(str::to_owned),
            ]
        }

        /// A key as the client may spell it: plain, or with one character `\u`-escaped.
        fn spelled(key: String) -> impl Strategy<Value = String> {
            let len = key.len();
            (any::<bool>(), 0..len.max(1)).prop_map(move |(escape, at)| {
                if !escape || key.is_empty() {
                    return format!("\"{key}\"");
                }
                let (head, tail) = key.split_at(at);
                let mut chars = tail.chars();
                let c = chars.next().unwrap_or('a');
                format!("\"{head}\\u{:04x}{}\"", c as u32, chars.as_str())
            })
        }

        fn ws() -> impl Strategy<Value = &'static str> {
            prop::sample::select(vec!["", " ", "\n  ", "\t"])
        }

        fn object(members: Vec<(String, String)>) -> impl Strategy<Value = String> {
            let n = members.len();
            prop::collection::vec((ws(), ws(), ws(), ws()), n + 1).prop_map(move |spaces| {
                let mut out = String::from("{");
                for (i, (key, value)) in members.iter().enumerate() {
                    let (a, b, c, d) = spaces[i];
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&format!("{a}{key}{b}:{c}{value}{d}"));
                }
                out.push_str(spaces[n].0);
                out.push('}');
                out
            })
        }

        fn member() -> impl Strategy<Value = (String, String)> {
            (key_name().prop_flat_map(spelled), json_value())
                .prop_map(|(key, value)| (key, value.to_string()))
        }

        fn nvext() -> impl Strategy<Value = String> {
            prop_oneof![
                4 => prop::collection::vec(member(), 0..6).prop_flat_map(object),
                1 => json_value().prop_map(|v| v.to_string()),
            ]
        }

        fn body() -> impl Strategy<Value = String> {
            let others = prop::collection::vec(
                (
                    prop::sample::select(vec!["messages", "max_tokens", "x", "nvext_extra"]),
                    json_value(),
                ),
                0..4,
            );
            (
                spelled("nvext".into()),
                nvext(),
                any::<Option<bool>>(),
                others,
            )
                .prop_flat_map(|(key, nvext, stream, others)| {
                    let mut members =
                        vec![("\"model\"".to_owned(), "\"m\"".to_owned()), (key, nvext)];
                    if let Some(stream) = stream {
                        members.push(("\"stream\"".into(), stream.to_string()));
                    }
                    for (key, value) in others {
                        members.push((format!("\"{key}\""), value.to_string()));
                    }
                    Just(members).prop_shuffle().prop_flat_map(object)
                })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]

            /// Cutting pins out of the bytes gives what the DOM rewrite gives.
            #[test]
            fn the_splice_agrees_with_the_dom_rewrite(body in body()) {
                let mut dom: Value = serde_json::from_str(&body).expect("generated JSON");
                let removed = strip_nvext_pins(&mut dom);
                let parsed = parse(Bytes::from(body.clone())).expect("valid");
                prop_assert_eq!(parsed.stripped, removed);
                let out: Value = serde_json::from_slice(&parsed.outbound).expect("spliced JSON");
                prop_assert_eq!(&out, &dom);
                if removed == 0 {
                    prop_assert_eq!(&parsed.outbound[..], body.as_bytes());
                }
            }
        }
    }

    #[tokio::test]
    async fn bodies_over_the_limit_are_refused_before_parsing() {
        let big = Bytes::from(vec![b' '; 1025]);
        let error = read_bounded(&HeaderMap::new(), Body::from(big.clone()), 1024).await;
        assert!(matches!(error, Err(ApiError::PayloadTooLarge(_))));
        let mut declared = HeaderMap::new();
        declared.insert(header::CONTENT_LENGTH, "4096".parse().expect("value"));
        let error = read_bounded(&declared, Body::from("{}"), 1024).await;
        assert!(matches!(error, Err(ApiError::PayloadTooLarge(_))));
        let fits = read_bounded(&HeaderMap::new(), Body::from(big), 2048).await;
        assert_eq!(fits.expect("fits").len(), 1025);
    }
}
