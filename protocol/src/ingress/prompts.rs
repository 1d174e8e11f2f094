//! Per-backend prompt rewrites of a chat-completions body: `backends[].global_prompts` and
//! `backends[].requires_single_leading_system` (seed "Anthropic Messages and Responses
//! ingresses" and the rendering bullet of "KV-overlap-aware prefill selection").
//!
//! The same function runs on dispatch (the body a backend receives) and before KV rendering (the
//! prompt the KV-aware picker hashes), so the prefix hashes match what the frontend renders.
//!
//! - `global_prompts`: system texts the operator puts before every conversation, in order, as
//!   leading `system` messages (before the client's own messages).
//! - `requires_single_leading_system`: every `system` (and `developer`) message is removed and
//!   their texts, in order, are joined with a blank line into one `system` message at the
//!   start; for chat templates that refuse a system message anywhere but first, or more than one.

use serde_json::{Value, json};

/// What one backend asks of its chat bodies.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PromptRewrite {
    pub global_prompts: Vec<String>,
    pub requires_single_leading_system: bool,
}

impl PromptRewrite {
    /// Whether the rewrite changes anything.
    pub fn is_noop(&self) -> bool {
        self.global_prompts.is_empty() && !self.requires_single_leading_system
    }

    /// Rewrites `body.messages` in place. A body without a `messages` array (a completions
    /// body, or one the backend will refuse anyway) is left alone; returns whether it changed.
    pub fn apply(&self, body: &mut Value) -> bool {
        if self.is_noop() {
            return false;
        }
        let Some(messages) = body.get_mut("messages").and_then(Value::as_array_mut) else {
            return false;
        };
        if !self.global_prompts.is_empty() {
            let leading = self
                .global_prompts
                .iter()
                .map(|p| json!({ "role": "system", "content": p }));
            messages.splice(0..0, leading);
        }
        if self.requires_single_leading_system {
            let mut texts = Vec::new();
            messages.retain(|m| {
                let role = m.get("role").and_then(Value::as_str);
                if matches!(role, Some("system") | Some("developer")) {
                    texts.push(text_of(m.get("content").unwrap_or(&Value::Null)));
                    false
                } else {
                    true
                }
            });
            if !texts.is_empty() {
                messages.insert(
                    0,
                    json!({ "role": "system", "content": texts.join("\n\n") }),
                );
            }
        }
        true
    }

    /// [`apply`](Self::apply) on bytes: `None` when the body is unchanged (or not JSON).
    pub fn apply_bytes(&self, body: &[u8]) -> Option<Vec<u8>> {
        if self.is_noop() {
            return None;
        }
        let mut v: Value = serde_json::from_slice(body).ok()?;
        self.apply(&mut v).then(|| v.to_string().into_bytes())
    }
}

/// A message's text: a string, or its text parts concatenated.
fn text_of(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rw(prompts: &[&str], single: bool) -> PromptRewrite {
        PromptRewrite {
            global_prompts: prompts.iter().map(|s| (*s).to_owned()).collect(),
            requires_single_leading_system: single,
        }
    }

    #[test]
    fn global_prompts_lead_in_order() {
        let mut b = json!({ "messages": [{ "role": "user", "content": "q" }] });
        assert!(rw(&["a", "b"], false).apply(&mut b));
        assert_eq!(
            b["messages"],
            json!([
                { "role": "system", "content": "a" },
                { "role": "system", "content": "b" },
                { "role": "user", "content": "q" },
            ])
        );
    }

    #[test]
    fn system_messages_merge_into_one_leading_message() {
        let mut b = json!({ "messages": [
            { "role": "user", "content": "q" },
            { "role": "system", "content": [{ "type": "text", "text": "s1" }] },
            { "role": "developer", "content": "s2" },
            { "role": "assistant", "content": "a" },
        ] });
        assert!(rw(&["g"], true).apply(&mut b));
        assert_eq!(
            b["messages"],
            json!([
                { "role": "system", "content": "g\n\ns1\n\ns2" },
                { "role": "user", "content": "q" },
                { "role": "assistant", "content": "a" },
            ])
        );
        // Idempotent once merged.
        let before = b.clone();
        rw(&[], true).apply(&mut b);
        assert_eq!(b, before);
    }

    #[test]
    fn noop_and_non_chat_bodies_are_untouched() {
        let mut b = json!({ "prompt": "x" });
        assert!(!rw(&["g"], true).apply(&mut b));
        assert!(rw(&[], false).apply_bytes(br#"{"messages":[]}"#).is_none());
        assert!(rw(&["g"], false).apply_bytes(b"not json").is_none());
        let out = rw(&["g"], false)
            .apply_bytes(br#"{"messages":[]}"#)
            .unwrap();
        assert_eq!(
            serde_json::from_slice::<Value>(&out).unwrap()["messages"][0]["content"],
            json!("g")
        );
    }
}
