//! Bounded request-body reading, JSON validation and the removal of every body field a client
//! could pin a worker with.

use std::fmt;

use axum::body::Body;
use axum::http::{HeaderMap, header};
use bytes::Bytes;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use crate::front_door::error::ApiError;

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
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.downcast_ref::<LengthLimitError>().is_some() => Err(too_large(limit)),
        Err(error) => Err(ApiError::BadRequest(format!(
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
/// The fast path reads only the top level: `model`, `stream`, and the key names of `nvext`; every
/// other value is validated as JSON and skipped without building a DOM, and the client's bytes
/// are forwarded untouched. Only a body whose `nvext` holds a pin field is parsed whole and
/// re-encoded without it (clients that send pins are rare). A repeated `model`, `stream` or
/// `nvext` key is refused: parsers disagree on which copy wins, so a forwarded body could
/// otherwise carry a pin the router never saw.
pub fn parse(bytes: Bytes) -> Result<ParsedBody, ApiError> {
    check_depth(&bytes)?;
    let head = scan_head(&bytes)?;
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
    if !head.nvext_pins {
        // Untouched bodies are forwarded byte for byte.
        return Ok(ParsedBody {
            model,
            stream,
            outbound: bytes,
            stripped: 0,
        });
    }
    let mut value: Value = serde_json::from_slice(&bytes).map_err(invalid_json)?;
    let stripped = strip_nvext_pins(&mut value);
    let outbound =
        Bytes::from(serde_json::to_vec(&value).map_err(|e| ApiError::Internal(e.to_string()))?);
    Ok(ParsedBody {
        model,
        stream,
        outbound,
        stripped,
    })
}

fn invalid_json(error: serde_json::Error) -> ApiError {
    ApiError::BadRequest(format!("the request body is not valid JSON: {error}"))
}

/// Refuses nesting deeper than [`MAX_JSON_DEPTH`]. The fast path skips values iteratively (no
/// recursion limit of its own), so the bound the DOM parse used to give is kept here: one pass
/// over the bytes, brackets inside strings ignored.
fn check_depth(bytes: &[u8]) -> Result<(), ApiError> {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for &b in bytes {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
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
    }
    Ok(())
}

/// What the router reads of a body's top level.
#[derive(Default)]
struct Head {
    model: Option<Scalar>,
    stream: Option<Scalar>,
    /// `nvext` is an object holding at least one of [`NVEXT_PIN_FIELDS`].
    nvext_pins: bool,
}

/// A top-level value reduced to what validation needs.
enum Scalar {
    Str(String),
    Bool(bool),
    Null,
    Other,
}

fn scan_head(bytes: &[u8]) -> Result<Head, ApiError> {
    // A struct visitor would also accept a JSON array in field order: demand an object.
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        // Invalid JSON keeps its parser message; valid non-objects get the shape message.
        serde_json::from_slice::<IgnoredAny>(bytes).map_err(invalid_json)?;
        return Err(ApiError::BadRequest(
            "the request body must be a JSON object".into(),
        ));
    }
    serde_json::from_slice::<HeadSeed>(bytes)
        .map(|seed| seed.0)
        .map_err(invalid_json)
}

/// Deserializes the top-level object into a [`Head`].
struct HeadSeed(Head);

impl<'de> Deserialize<'de> for HeadSeed {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(HeadVisitor)
    }
}

struct HeadVisitor;

impl<'de> Visitor<'de> for HeadVisitor {
    type Value = HeadSeed;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<HeadSeed, A::Error> {
        let mut head = Head::default();
        let mut seen_nvext = false;
        while let Some(key) = map.next_key::<TopKey>()? {
            match key {
                TopKey::Model if head.model.is_some() => return Err(duplicate("model")),
                TopKey::Model => head.model = Some(map.next_value::<ScalarValue>()?.0),
                TopKey::Stream if head.stream.is_some() => return Err(duplicate("stream")),
                TopKey::Stream => head.stream = Some(map.next_value::<ScalarValue>()?.0),
                TopKey::Nvext if seen_nvext => return Err(duplicate("nvext")),
                TopKey::Nvext => {
                    seen_nvext = true;
                    head.nvext_pins = map.next_value::<NvextPins>()?.0;
                }
                TopKey::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(HeadSeed(head))
    }
}

fn duplicate<E: de::Error>(key: &str) -> E {
    E::custom(format_args!("the key `{key}` appears more than once"))
}

/// A top-level key, compared after JSON unescaping (`"nv\u0065xt"` is `nvext`).
enum TopKey {
    Model,
    Stream,
    Nvext,
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

/// Whether a top-level `nvext` value is an object with a pin field among its (unescaped) keys.
struct NvextPins(bool);

impl<'de> Deserialize<'de> for NvextPins {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct NvextVisitor;
        impl<'de> Visitor<'de> for NvextVisitor {
            type Value = NvextPins;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<NvextPins, A::Error> {
                let mut pins = false;
                while let Some(PinKey(pin)) = map.next_key()? {
                    pins |= pin;
                    map.next_value::<IgnoredAny>()?;
                }
                Ok(NvextPins(pins))
            }
            // Anything but an object carries no pin (and is forwarded as the client sent it).
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<NvextPins, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(NvextPins(false))
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<NvextPins, E> {
                Ok(NvextPins(false))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<NvextPins, E> {
                Ok(NvextPins(false))
            }
            fn visit_unit<E: de::Error>(self) -> Result<NvextPins, E> {
                Ok(NvextPins(false))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<NvextPins, E> {
                Ok(NvextPins(false))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<NvextPins, E> {
                Ok(NvextPins(false))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<NvextPins, E> {
                Ok(NvextPins(false))
            }
        }
        deserializer.deserialize_any(NvextVisitor)
    }
}

/// An `nvext` key: whether it names a pin field (after unescaping).
struct PinKey(bool);

impl<'de> Deserialize<'de> for PinKey {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct PinKeyVisitor;
        impl Visitor<'_> for PinKeyVisitor {
            type Value = PinKey;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object key")
            }
            fn visit_str<E: de::Error>(self, key: &str) -> Result<PinKey, E> {
                Ok(PinKey(NVEXT_PIN_FIELDS.contains(&key)))
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
    fn skipped_strings_are_checked_for_syntax_not_for_lone_surrogates() {
        // serde_json skips an unread string without decoding its escapes; the upstream decodes
        // (and judges) it. Keys the router reads are always decoded.
        let body = r#"{"model":"m","x":"\ud800"}"#;
        assert_eq!(parse(Bytes::from(body)).expect("passes").outbound, body);
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
