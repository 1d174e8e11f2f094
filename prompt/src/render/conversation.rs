//! The rendered turns of conversations whose template is message-local
//! ([`crate::template`]'s locality check): a follow-up whose first messages and template inputs
//! equal a cached turn's renders only its new messages and is spliced after that turn's loop
//! text.
//!
//! Exact: the messages and inputs are compared whole and in order (key order included, since a
//! template may `tojson` a message), never by a hash; the statements before the loop are
//! rendered again and compared with the cached turn's; and for a message-local template the
//! text of each message's iteration is a function of that message, its index and the inputs.
//!
//! Bounded like the tokenization cache ([`CacheLimits`]: at most 64 turns and 8 MiB per
//! renderer by default, least recently used evicted first and counted, a turn over a quarter
//! of the bytes never held); a turn counts its rendered text, its messages (string bytes plus
//! [`NODE_BYTES`] per JSON node) and [`TURN_OVERHEAD`]. A follow-up replaces the turn it
//! continued, so a conversation holds one turn.

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use minijinja::value::{Serde, Value as TemplateValue};
use serde_json::Value;

use continuum_protocol::kv::prompt::RenderLimits;

use super::PrepareError;
use crate::template::{ChatTemplate, LocalText, RenderFailure, TemplateInput};
use crate::token_cache::CacheLimits;

/// Bytes counted per JSON node of a cached message beyond its string bytes.
const NODE_BYTES: usize = 48;
/// Bytes counted per turn beyond its text and messages.
const TURN_OVERHEAD: usize = 256;

/// One rendered turn of a conversation.
#[derive(Debug)]
pub(crate) struct Turn {
    /// The messages as the template saw them (text parts flattened).
    pub messages: Vec<Arc<Value>>,
    /// Everything else the template saw (tools, flags, template kwargs), compared in order.
    pub inputs: Arc<Value>,
    /// The whole rendered text.
    pub text: Arc<String>,
    /// Bytes of `text` before the loop's text.
    pub pre_len: usize,
    /// Where the loop's text ends (the statements after the loop follow).
    pub loop_end: usize,
}

impl Turn {
    fn bytes(&self) -> usize {
        self.messages
            .iter()
            .map(|m| json_bytes(m))
            .fold(self.text.len(), usize::saturating_add)
            .saturating_add(json_bytes(&self.inputs))
            .saturating_add(TURN_OVERHEAD)
    }
}

fn json_bytes(value: &Value) -> usize {
    NODE_BYTES.saturating_add(match value {
        Value::String(s) => s.len(),
        Value::Array(items) => items.iter().map(json_bytes).sum(),
        Value::Object(map) => map
            .iter()
            .map(|(k, v)| k.len().saturating_add(json_bytes(v)))
            .sum(),
        Value::Null | Value::Bool(_) | Value::Number(_) => 0,
    })
}

/// Equality that also compares object keys in order (serde_json's ignores their order).
pub(crate) fn same_json(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same_json(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .zip(y)
                    .all(|((kx, vx), (ky, vy))| kx == ky && same_json(vx, vy))
        }
        _ => a == b,
    }
}

#[derive(Debug)]
struct Entry {
    turn: Arc<Turn>,
    bytes: usize,
    last_used: u64,
}

#[derive(Debug, Default)]
struct Entries {
    entries: Vec<Entry>,
    bytes: usize,
    clock: u64,
}

/// Counters of one renderer's conversation cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConversationStats {
    /// Follow-ups that rendered only their new messages.
    pub hits: u64,
    /// Renders of a message-local template from the first message.
    pub misses: u64,
    /// Turns dropped to stay within the limits.
    pub evictions: u64,
    pub entries: usize,
    pub bytes: usize,
}

/// The cached turns of one renderer.
#[derive(Debug)]
pub(crate) struct Conversations {
    entries: Mutex<Entries>,
    limits: CacheLimits,
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
}

impl Conversations {
    pub fn new(limits: CacheLimits) -> Self {
        Self {
            entries: Mutex::new(Entries::default()),
            limits,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        }
    }

    /// The cached turn with the most messages that are, in order, the first of `messages`,
    /// rendered with the same `inputs`.
    pub fn lookup(&self, messages: &[Cow<'_, Value>], inputs: &Value) -> Option<Arc<Turn>> {
        let mut entries = lock(&self.entries);
        let mut best: Option<usize> = None;
        for (i, entry) in entries.entries.iter().enumerate() {
            let turn = &entry.turn;
            let k = turn.messages.len();
            if k == 0
                || k > messages.len()
                || best.is_some_and(|b| entries.entries[b].turn.messages.len() >= k)
                || !same_json(&turn.inputs, inputs)
                // The last shared message first: it tells conversations apart soonest.
                || !same_json(&turn.messages[k - 1], &messages[k - 1])
                || !turn.messages[..k - 1]
                    .iter()
                    .zip(messages)
                    .all(|(cached, new)| same_json(cached, new))
            {
                continue;
            }
            best = Some(i);
        }
        let Some(i) = best else {
            self.misses.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        self.hits.fetch_add(1, Ordering::Relaxed);
        entries.clock += 1;
        let clock = entries.clock;
        let entry = &mut entries.entries[i];
        entry.last_used = clock;
        Some(Arc::clone(&entry.turn))
    }

    /// Caches `turn`, replacing `continued` (the turn it was spliced after) if still held, then
    /// evicts least recently used turns down to the limits.
    pub fn insert(&self, turn: Turn, continued: Option<&Arc<Turn>>) {
        let bytes = turn.bytes();
        let mut entries = lock(&self.entries);
        if let Some(continued) = continued
            && let Some(i) = entries
                .entries
                .iter()
                .position(|e| Arc::ptr_eq(&e.turn, continued))
        {
            let old = entries.entries.swap_remove(i);
            entries.bytes -= old.bytes;
        }
        if self.limits.max_entries == 0 || bytes > self.limits.max_bytes / 4 {
            return;
        }
        while entries.entries.len() >= self.limits.max_entries
            || entries.bytes + bytes > self.limits.max_bytes
        {
            let Some(oldest) = crate::token_cache::least_recent(&entries.entries, |e| e.last_used)
            else {
                break;
            };
            let old = entries.entries.swap_remove(oldest);
            entries.bytes -= old.bytes;
            self.evictions.fetch_add(1, Ordering::Relaxed);
        }
        entries.clock += 1;
        let last_used = entries.clock;
        entries.bytes += bytes;
        entries.entries.push(Entry {
            turn: Arc::new(turn),
            bytes,
            last_used,
        });
    }

    pub fn stats(&self) -> ConversationStats {
        let entries = lock(&self.entries);
        ConversationStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            entries: entries.entries.len(),
            bytes: entries.bytes,
        }
    }
}

/// A render of a message-local template: from message `from` on, after the cached turn `base`.
#[derive(Debug)]
pub(super) struct LocalPlan {
    pub(super) from: usize,
    pub(super) base: Option<Arc<Turn>>,
    /// All the request's messages (for the turn cached next, and a whole render).
    pub(super) messages: Vec<Arc<serde_json::Value>>,
    pub(super) inputs: Arc<serde_json::Value>,
    pub(super) conversations: Arc<Conversations>,
}

impl LocalPlan {
    /// The whole text: the cached turn's up to its loop end, then `local`'s loop text and what
    /// follows it; `None` when the text before the loop is not the cached turn's (render whole).
    /// Caches the result as the conversation's turn.
    fn finish(&self, local: LocalText, max_bytes: usize) -> Option<Arc<String>> {
        let (text, pre_len, loop_end) = match &self.base {
            None => (local.text, local.loop_start, local.loop_end),
            Some(base) => {
                if local.text[..local.loop_start] != base.text[..base.pre_len] {
                    return None;
                }
                let tail = &local.text[local.loop_start..];
                let mut text = String::with_capacity(base.loop_end + tail.len());
                text.push_str(&base.text[..base.loop_end]);
                text.push_str(tail);
                let loop_end = base.loop_end + (local.loop_end - local.loop_start);
                (text, base.pre_len, loop_end)
            }
        };
        let text = Arc::new(text);
        if text.len() <= max_bytes {
            let turn = Turn {
                messages: self.messages.clone(),
                inputs: Arc::clone(&self.inputs),
                text: Arc::clone(&text),
                pre_len,
                loop_end,
            };
            self.conversations.insert(turn, self.base.as_ref());
        }
        Some(text)
    }
}

/// A chat's text: through the message-local rewrite when planned (and exact: else whole).
pub(super) fn render_chat(
    template: &ChatTemplate,
    mut input: TemplateInput,
    plan: Option<LocalPlan>,
    limits: &RenderLimits,
) -> Result<Arc<String>, PrepareError> {
    let (fuel, max) = (limits.fuel, limits.max_rendered_bytes);
    let failed = |failure| match failure {
        RenderFailure::TooLarge => PrepareError::RenderedTooLarge { limit: max },
        RenderFailure::OutOfFuel => PrepareError::OutOfFuel,
        RenderFailure::Template(message) => PrepareError::Template(message),
    };
    let Some(plan) = plan else {
        return template
            .render(&input, fuel, max)
            .map(Arc::new)
            .map_err(failed);
    };
    if let Some(local) = template
        .render_local(&input, plan.from, fuel, max)
        .map_err(failed)?
        && let Some(text) = plan.finish(local, max)
    {
        return Ok(text);
    }
    // Rendered whole: the input's earlier messages may be placeholders, so all are converted.
    if plan.from > 0 {
        let all: Vec<TemplateValue> = plan
            .messages
            .iter()
            .map(|m| TemplateValue::from(Serde(m.as_ref())))
            .collect();
        input.messages = TemplateValue::from(all);
    }
    template
        .render(&input, fuel, max)
        .map(Arc::new)
        .map_err(failed)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
