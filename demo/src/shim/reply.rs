//! The simulated frontend's answer: deterministic filler text, buffered as one chat or
//! completion object or streamed as one SSE chunk per token (then `[DONE]`), with usage.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::Route;
use crate::fleet::Booking;

/// The generated answer.
pub(super) struct Reply {
    pub(super) id: String,
    pub(super) model: String,
    pub(super) route: Route,
    pub(super) prompt_tokens: u64,
    pub(super) max_tokens: u64,
    pub(super) created: u64,
}

/// Deterministic filler text, one short word per token.
fn token(i: u64) -> String {
    const WORDS: [&str; 8] = [
        "route", "load", "pick", "decode", "prefill", "rank", "fleet", "kv",
    ];
    let word = WORDS[(i % WORDS.len() as u64) as usize];
    if i == 0 {
        word.to_owned()
    } else {
        format!(" {word}")
    }
}

impl Reply {
    fn usage(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.max_tokens,
            "total_tokens": self.prompt_tokens + self.max_tokens,
        })
    }

    pub(super) fn buffered(&self) -> Value {
        let text: String = (0..self.max_tokens).map(token).collect();
        match self.route {
            Route::ChatCompletions => json!({
                "id": self.id,
                "choices": [{"index": 0, "message": {"content": text, "refusal": null, "role": "assistant"}, "finish_reason": "length", "logprobs": null}],
                "created": self.created,
                "model": self.model,
                "object": "chat.completion",
                "usage": self.usage(),
            }),
            Route::Completions => json!({
                "id": self.id,
                "choices": [{"text": text, "index": 0, "finish_reason": "length"}],
                "created": self.created,
                "model": self.model,
                "system_fingerprint": null,
                "object": "text_completion",
                "usage": self.usage(),
            }),
        }
    }

    /// The SSE chunk carrying token `i`, or the closing chunk when `i == max_tokens`.
    fn chunk(&self, i: u64) -> Value {
        let last = i >= self.max_tokens;
        match self.route {
            Route::ChatCompletions => {
                let delta = if last {
                    json!({})
                } else if i == 0 {
                    json!({"content": token(i), "role": "assistant"})
                } else {
                    json!({"content": token(i)})
                };
                json!({
                    "id": self.id,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": if last { json!("length") } else { Value::Null }, "logprobs": null}],
                    "created": self.created,
                    "model": self.model,
                    "object": "chat.completion.chunk",
                })
            }
            Route::Completions => json!({
                "id": self.id,
                "choices": [{"text": if last { String::new() } else { token(i) }, "index": 0, "finish_reason": if last { json!("length") } else { Value::Null }}],
                "created": self.created,
                "model": self.model,
                "object": "text_completion",
            }),
        }
    }
}

/// Streams one SSE event per token with `per_token` between them, then `[DONE]`. The decode
/// booking lives as long as the stream, so a client that goes away releases it.
pub(super) fn stream_reply(reply: Reply, per_token: Duration, booking: Booking) -> Response {
    let state = (reply, 0u64, Some(booking));
    let events = futures::stream::unfold(state, move |(reply, i, booking)| async move {
        let booking = booking?;
        if i > reply.max_tokens {
            drop(booking);
            return Some((
                Ok::<_, Infallible>(Bytes::from_static(b"data: [DONE]\n\n")),
                (reply, i + 1, None),
            ));
        }
        if i > 0 {
            // Simulated per-token engine time: tokens stream as a real engine's would.
            tokio::time::sleep(per_token).await;
        }
        let event = Bytes::from(format!("data: {}\n\n", reply.chunk(i)));
        Some((Ok(event), (reply, i + 1, Some(booking))))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(events))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_ends_with_a_finish_chunk() {
        let reply = Reply {
            id: "chatcmpl-demo-0".into(),
            model: "demo-disagg".into(),
            route: Route::ChatCompletions,
            prompt_tokens: 3,
            max_tokens: 2,
            created: 1,
        };
        assert_eq!(reply.chunk(0)["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(reply.chunk(2)["choices"][0]["finish_reason"], "length");
        assert_eq!(
            reply.buffered()["choices"][0]["message"]["content"],
            "route load"
        );
    }
}
