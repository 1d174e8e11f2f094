//! Bounded request-body reading, JSON validation and the removal of every body field a client
//! could pin a worker with.

use axum::body::Body;
use axum::http::{HeaderMap, header};
use bytes::Bytes;
use http_body_util::{BodyExt, LengthLimitError, Limited};
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

/// Parses an OpenAI chat/completions body: a JSON object with a non-empty string `model`.
pub fn parse(bytes: Bytes) -> Result<ParsedBody, ApiError> {
    let mut value: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::BadRequest(format!("the request body is not valid JSON: {e}")))?;
    let object = value
        .as_object_mut()
        .ok_or_else(|| ApiError::BadRequest("the request body must be a JSON object".into()))?;
    let model = match object.get("model") {
        Some(Value::String(m)) if !m.trim().is_empty() => m.clone(),
        Some(_) => {
            return Err(ApiError::BadRequest(
                "`model` must be a non-empty string".into(),
            ));
        }
        None => return Err(ApiError::BadRequest("`model` is required".into())),
    };
    let stream = match object.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::BadRequest("`stream` must be a boolean".into())),
    };
    let stripped = strip_nvext_pins(&mut value);
    let outbound = if stripped == 0 {
        // Untouched bodies are forwarded byte for byte.
        bytes
    } else {
        Bytes::from(serde_json::to_vec(&value).map_err(|e| ApiError::Internal(e.to_string()))?)
    };
    Ok(ParsedBody {
        model,
        stream,
        outbound,
        stripped,
    })
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
}
