//! The parts of a chat-completions request body the request converters write, as typed structs
//! over borrowed data: serialised once, straight to the body's bytes. Field order is the order the
//! converters always wrote (and the shim forwards).

use std::borrow::Cow;

use serde::{Serialize, Serializer};

use super::json::Json;

/// One chat message.
#[derive(Debug, Serialize)]
pub(crate) struct Message<'a> {
    pub role: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<&'a str>,
    pub content: Content<'a>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall<'a>>,
}

impl<'a> Message<'a> {
    /// `{"role": role, "content": text}`.
    pub fn text(role: &'static str, text: impl Into<Cow<'a, str>>) -> Self {
        Self {
            role,
            tool_call_id: None,
            content: Content::Text(text.into()),
            tool_calls: Vec::new(),
        }
    }

    /// `{"role": "tool", "tool_call_id": id, "content": text}`.
    pub fn tool(id: &'a str, text: impl Into<Cow<'a, str>>) -> Self {
        Self {
            tool_call_id: Some(id),
            ..Self::text("tool", text)
        }
    }
}

/// A message's `content`: `null`, a string or content parts.
#[derive(Debug)]
pub(crate) enum Content<'a> {
    Null,
    Text(Cow<'a, str>),
    Parts(Vec<Part<'a>>),
}

impl Serialize for Content<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Content::Null => s.serialize_unit(),
            Content::Text(t) => s.serialize_str(t),
            Content::Parts(p) => p.serialize(s),
        }
    }
}

/// A user content part.
#[derive(Debug, Serialize)]
#[serde(tag = "type")]
pub(crate) enum Part<'a> {
    #[serde(rename = "text")]
    Text { text: &'a str },
    #[serde(rename = "image_url")]
    ImageUrl { image_url: ImageUrl<'a> },
}

#[derive(Debug, Serialize)]
pub(crate) struct ImageUrl<'a> {
    pub url: Cow<'a, str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<&'a str>,
}

/// An assistant `tool_calls` entry.
#[derive(Debug, Serialize)]
pub(crate) struct ToolCall<'a> {
    pub id: &'a str,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall<'a>,
}

impl<'a> ToolCall<'a> {
    pub fn function(id: &'a str, name: &'a str, arguments: impl Into<Cow<'a, str>>) -> Self {
        Self {
            id,
            kind: "function",
            function: FunctionCall {
                name,
                arguments: arguments.into(),
            },
        }
    }
}

#[derive(Debug, Serialize)]
pub(crate) struct FunctionCall<'a> {
    pub name: &'a str,
    pub arguments: Cow<'a, str>,
}

/// A `tools` entry: `{"type": "function", "function": {...}}`.
#[derive(Debug, Serialize)]
pub(crate) struct Tool<'a> {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: Function<'a>,
}

#[derive(Debug, Serialize)]
pub(crate) struct Function<'a> {
    pub name: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<&'a str>,
    /// The client's schema, passed through.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parameters: Option<&'a Json<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// `tool_choice`: a mode string or one named function.
#[derive(Debug)]
pub(crate) enum ToolChoice<'a> {
    Mode(&'a str),
    Function(&'a str),
}

impl Serialize for ToolChoice<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Named<'a> {
            name: &'a str,
        }
        #[derive(Serialize)]
        struct Function<'a> {
            #[serde(rename = "type")]
            kind: &'static str,
            function: Named<'a>,
        }
        match self {
            ToolChoice::Mode(m) => s.serialize_str(m),
            ToolChoice::Function(name) => Function {
                kind: "function",
                function: Named { name },
            }
            .serialize(s),
        }
    }
}

/// `stream_options: {"include_usage": true}`.
#[derive(Debug, Serialize)]
pub(crate) struct StreamOptions {
    pub include_usage: bool,
}

/// `stream` and `stream_options` of a streamed request (both absent otherwise).
pub(crate) fn stream_fields(stream: bool) -> (Option<bool>, Option<StreamOptions>) {
    if stream {
        (
            Some(true),
            Some(StreamOptions {
                include_usage: true,
            }),
        )
    } else {
        (None, None)
    }
}

/// The body's bytes, in a buffer of `size_hint` bytes to start with (the converted body is about
/// as large as the client's). Serialising these structs does not fail in practice (string keys,
/// numbers that were parsed JSON numbers); if it did, the request is refused with a 500.
pub(crate) fn to_bytes(
    body: &impl Serialize,
    size_hint: usize,
) -> Result<Vec<u8>, super::anthropic::IngressError> {
    let mut out = Vec::with_capacity(size_hint);
    serde_json::to_writer(&mut out, body).map_err(|e| {
        super::anthropic::IngressError::new(500, format!("could not write the chat body: {e}"))
    })?;
    Ok(out)
}
