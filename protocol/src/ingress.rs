//! Client-facing ingress protocols converted to and from the OpenAI chat-completions shape the shim
//! backends speak (seed "Anthropic Messages and Responses ingresses").
//!
//! | module | what it holds |
//! |---|---|
//! | [`anthropic`] | Anthropic Messages API (`POST /v1/messages`, `/anthropic/v1/messages`): request → chat body, buffered chat response → `Message`, chat SSE chunks → Anthropic SSE events ([`anthropic::AnthropicStream`]), Anthropic error objects |
//! | [`prompts`] | per-backend `global_prompts` / `requires_single_leading_system` rewrites of a chat body, shared by dispatch and KV rendering |
//! | [`responses`] | OpenAI Responses API (`POST /v1/responses`): request → chat body, buffered chat response → `Response`, chat SSE chunks → Responses events ([`responses::ResponsesStream`]), OpenAI error objects |
//!
//! Sans-IO like the rest of the crate: bytes or `serde_json::Value`s in, values or bytes out; ids
//! arrive as arguments, nothing reads a clock. Routes are wired elsewhere.

pub mod anthropic;
pub mod prompts;
pub mod responses;
