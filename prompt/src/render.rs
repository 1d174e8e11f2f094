//! Prompt preparation for KV-aware selection: chat template + tokenizer + block hashes on the
//! blocking pool, under a shared permit semaphore, a permit wait and a total deadline (seed
//! "Prompt rendering and block hashing bounds").
//!
//! `/v1/chat/completions` bodies are rendered through the model's chat template;
//! `/v1/completions` prompts (a string or token ids) are tokenized or taken as they are. Both
//! encode without adding special tokens, as transformers' `apply_chat_template` and Dynamo's
//! frontend do, so the ids are the ones the worker hashes.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use minijinja::value::{Serde, Value};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use continuum_protocol::kv::hashing::{BlockSize, salt_seed};
use continuum_protocol::kv::prompt::{
    BlockPlanError, PrepareFailureKind, RenderLimits, block_plan,
};

use super::template::{ChatTemplate, TemplateInput};
use super::token_cache::{
    CacheLimits, CacheStats, DEFAULT_CACHE_LIMITS, PromptTokenizer, Tokenized,
};

mod conversation;

pub use conversation::ConversationStats;
use conversation::{Conversations, LocalPlan, render_chat};

/// Messages in one chat request beyond this are not rendered (a 1 MiB prompt cap makes more
/// than this many turns meaningless, and it bounds the context built before fuel counts).
const MAX_MESSAGES: usize = 65_536;

pub use continuum_protocol::kv::prompt::PreparedPrompt;

/// Why a prompt was not prepared; [`PrepareError::kind`] is the metric label.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PrepareError {
    #[error("rendered prompt is over {limit} bytes")]
    RenderedTooLarge { limit: usize },
    #[error("prompt has {tokens} tokens, over the {limit}-token cap")]
    TooManyTokens { tokens: usize, limit: usize },
    #[error("chat request but the model has no chat template")]
    NoTemplate,
    #[error("request has neither messages nor a prompt the router can tokenize: {0}")]
    BadRequest(&'static str),
    #[error("chat template failed: {0}")]
    Template(String),
    #[error("chat template ran out of fuel")]
    OutOfFuel,
    #[error("tokenizer failed: {0}")]
    Tokenizer(String),
    #[error("no render permit within {0:?}")]
    PermitTimeout(Duration),
    #[error("render missed its {0:?} deadline")]
    Deadline(Duration),
    #[error("render task failed: {0}")]
    TaskFailed(String),
    #[error("block sizes cannot be hashed: {0}")]
    Unsupported(#[from] BlockPlanError),
}

impl PrepareError {
    pub fn kind(&self) -> PrepareFailureKind {
        match self {
            Self::RenderedTooLarge { .. } | Self::TooManyTokens { .. } => {
                PrepareFailureKind::PromptTooLarge
            }
            Self::Unsupported(_) => PrepareFailureKind::Unsupported,
            Self::NoTemplate
            | Self::BadRequest(_)
            | Self::Template(_)
            | Self::OutOfFuel
            | Self::Tokenizer(_)
            | Self::PermitTimeout(_)
            | Self::Deadline(_)
            | Self::TaskFailed(_) => PrepareFailureKind::RenderUnavailable,
        }
    }
}

/// The process-wide render permits: one semaphore shared by every model's renderer, so the
/// blocking pool never holds more than `permits` renders at once whatever the model count.
#[derive(Clone, Debug)]
pub struct RenderPermits(Arc<Semaphore>);

impl RenderPermits {
    pub fn new(permits: usize) -> Self {
        Self(Arc::new(Semaphore::new(permits)))
    }

    /// `clamp(available_parallelism, 4, 32)` permits.
    pub fn for_this_machine() -> Self {
        Self::new(RenderLimits::for_cpus(available_cpus()).permits)
    }

    pub fn available(&self) -> usize {
        self.0.available_permits()
    }
}

/// Cores this process may use (1 when the platform cannot say).
pub fn available_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// One model's tokenizer and chat template, and the bounds to run them under.
#[derive(Clone, Debug)]
pub struct PromptRenderer {
    /// The tokenizer behind its exact prefix cache (follow-up turns tokenize only what is new).
    tokenizer: Arc<PromptTokenizer>,
    template: Option<Arc<ChatTemplate>>,
    limits: RenderLimits,
    permits: RenderPermits,
    /// Rendered turns of message-local templates: a follow-up renders only its new messages.
    conversations: Arc<Conversations>,
}

impl PromptRenderer {
    /// A renderer with its own `limits.permits` permits; use [`Self::with_permits`] to share one
    /// pool across models.
    pub fn new(
        tokenizer: Arc<tokenizers::Tokenizer>,
        template: Option<Arc<ChatTemplate>>,
        limits: RenderLimits,
    ) -> Self {
        let permits = RenderPermits::new(limits.permits);
        Self {
            tokenizer: Arc::new(PromptTokenizer::new(tokenizer, DEFAULT_CACHE_LIMITS)),
            template,
            limits,
            permits,
            conversations: Arc::new(Conversations::new(DEFAULT_CACHE_LIMITS)),
        }
    }

    pub fn with_permits(mut self, permits: RenderPermits) -> Self {
        self.permits = permits;
        self
    }

    pub fn limits(&self) -> RenderLimits {
        self.limits
    }

    /// Replaces the tokenization and conversation caches with empty ones of `limits` (tests,
    /// benches).
    pub fn with_cache_limits(mut self, limits: CacheLimits) -> Self {
        let tokenizer = Arc::clone(self.tokenizer.tokenizer());
        self.tokenizer = Arc::new(PromptTokenizer::new(tokenizer, limits));
        self.conversations = Arc::new(Conversations::new(limits));
        self
    }

    /// The conversation cache's counters (message-local templates only).
    pub fn conversation_stats(&self) -> ConversationStats {
        self.conversations.stats()
    }

    /// The tokenizer and its cache.
    pub fn prompt_tokenizer(&self) -> &Arc<PromptTokenizer> {
        &self.tokenizer
    }

    /// The tokenization cache's counters.
    pub fn token_cache_stats(&self) -> CacheStats {
        self.tokenizer.stats()
    }

    /// Renders (chat) or reads (completions) the request's prompt, tokenizes it and hashes it
    /// for each of `block_sizes` (at most two distinct, each 16..=65536) with the request's LoRA
    /// name and cache salt. Never panics on any request body.
    pub async fn prepare(
        &self,
        request: &serde_json::Value,
        block_sizes: &[u32],
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Result<PreparedPrompt, PrepareError> {
        let plan = block_plan(block_sizes)?;
        let job = Job::from_request(request, self.template.as_deref(), Some(&self.conversations))?;
        let tokenizer = Arc::clone(&self.tokenizer);
        let seed = salt_seed(lora_name, cache_salt);
        self.bounded(move |template, limits| {
            let tokenized = job.tokenize(&tokenizer, template, limits, &plan, seed)?;
            Ok(PreparedPrompt {
                isl: tokenized.ids.len(),
                tokens: tokenized.ids,
                hashes: tokenized.hashes.per_size,
            })
        })
        .await
    }

    /// The text [`Self::prepare`] would tokenize (the rendered chat, or a completions prompt
    /// string), under the same bounds, rendered whole by the template as pinned (never from
    /// the conversation cache); `None` for a token-id prompt. For parity tests and operators'
    /// debugging.
    pub async fn render_text(
        &self,
        request: &serde_json::Value,
    ) -> Result<Option<String>, PrepareError> {
        self.render_text_with(request, None).await
    }

    /// [`Self::render_text`] as [`Self::prepare`] renders: a follow-up through a message-local
    /// template renders only its new messages after the cached turn (and caches its own).
    /// Benches time the render stage with it.
    pub async fn render_text_as_prepared(
        &self,
        request: &serde_json::Value,
    ) -> Result<Option<String>, PrepareError> {
        self.render_text_with(request, Some(&self.conversations))
            .await
    }

    async fn render_text_with(
        &self,
        request: &serde_json::Value,
        conversations: Option<&Arc<Conversations>>,
    ) -> Result<Option<String>, PrepareError> {
        let job = Job::from_request(request, self.template.as_deref(), conversations)?;
        self.bounded(
            move |template, limits| match job.render(template, limits)? {
                Rendered::Text(text) => Ok(Some(Arc::unwrap_or_clone(text))),
                Rendered::Tokens(_) => Ok(None),
            },
        )
        .await
    }

    /// Runs `work` on the blocking pool holding a permit, within the permit wait and deadline.
    async fn bounded<T, F>(&self, work: F) -> Result<T, PrepareError>
    where
        T: Send + 'static,
        F: FnOnce(Option<&ChatTemplate>, &RenderLimits) -> Result<T, PrepareError> + Send + 'static,
    {
        let start = Instant::now();
        let permit = acquire(&self.permits, self.limits.permit_wait).await?;
        let template = self.template.clone();
        let limits = self.limits;
        let task = tokio::task::spawn_blocking(move || {
            // The permit lives as long as the work, not as long as the waiter: a render that
            // outlives its deadline still occupies its permit until fuel stops it.
            let _permit: OwnedSemaphorePermit = permit;
            work(template.as_deref(), &limits)
        });
        match tokio::time::timeout_at(start + self.limits.deadline, task).await {
            Ok(Ok(result)) => result,
            Ok(Err(join)) => Err(PrepareError::TaskFailed(join.to_string())),
            Err(_) => Err(PrepareError::Deadline(self.limits.deadline)),
        }
    }
}

async fn acquire(
    permits: &RenderPermits,
    wait: Duration,
) -> Result<OwnedSemaphorePermit, PrepareError> {
    match tokio::time::timeout(wait, Arc::clone(&permits.0).acquire_owned()).await {
        Ok(Ok(permit)) => Ok(permit),
        // The semaphore is never closed; treat it like a timeout rather than panic.
        Ok(Err(_)) | Err(_) => Err(PrepareError::PermitTimeout(wait)),
    }
}

/// What the blocking task does, decided (and the body parsed) before a permit is taken.
#[derive(Debug)]
enum Job {
    Chat(TemplateInput, Option<LocalPlan>),
    Text(String),
    Tokens(Vec<u32>),
}

impl Job {
    /// The job of `request`; a chat through a message-local template with `conversations`
    /// given renders only the messages after a cached turn it continues.
    fn from_request(
        request: &serde_json::Value,
        template: Option<&ChatTemplate>,
        conversations: Option<&Arc<Conversations>>,
    ) -> Result<Self, PrepareError> {
        if let Some(messages) = request.get("messages") {
            let template = template.ok_or(PrepareError::NoTemplate)?;
            return chat_job(request, messages, template, conversations);
        }
        match request.get("prompt") {
            Some(serde_json::Value::String(text)) => Ok(Job::Text(text.clone())),
            Some(serde_json::Value::Array(items)) => completion_array(items),
            _ => Err(PrepareError::BadRequest("no messages or prompt")),
        }
    }

    fn render(
        self,
        template: Option<&ChatTemplate>,
        limits: &RenderLimits,
    ) -> Result<Rendered, PrepareError> {
        let text = match self {
            Job::Tokens(tokens) => return Ok(Rendered::Tokens(tokens)),
            Job::Text(text) => Arc::new(text),
            Job::Chat(input, plan) => {
                let template = template.ok_or(PrepareError::NoTemplate)?;
                render_chat(template, input, plan, limits)?
            }
        };
        if text.len() > limits.max_rendered_bytes {
            return Err(PrepareError::RenderedTooLarge {
                limit: limits.max_rendered_bytes,
            });
        }
        Ok(Rendered::Text(text))
    }

    /// Renders, tokenizes (through the cache, which also continues the block hashes of a
    /// cached prefix) and hashes for each size of `plan` with `seed`.
    fn tokenize(
        self,
        tokenizer: &PromptTokenizer,
        template: Option<&ChatTemplate>,
        limits: &RenderLimits,
        plan: &[BlockSize],
        seed: u64,
    ) -> Result<Tokenized, PrepareError> {
        match self.render(template, limits)? {
            Rendered::Tokens(tokens) => {
                cap_tokens(tokens.len(), limits.max_tokens)?;
                Ok(PromptTokenizer::hash_ids(tokens.into(), plan, seed))
            }
            Rendered::Text(text) => {
                let tokenized = tokenizer
                    .tokenize_and_hash(text.as_str(), plan, seed)
                    .map_err(PrepareError::Tokenizer)?;
                cap_tokens(tokenized.ids.len(), limits.max_tokens)?;
                Ok(tokenized)
            }
        }
    }
}

enum Rendered {
    Text(Arc<String>),
    Tokens(Vec<u32>),
}

fn cap_tokens(tokens: usize, limit: usize) -> Result<(), PrepareError> {
    if tokens > limit {
        Err(PrepareError::TooManyTokens { tokens, limit })
    } else {
        Ok(())
    }
}

/// `/v1/completions` `prompt` as an array: token ids, or a batch of one string / one id list.
/// Larger batches have no single prefix to score.
fn completion_array(items: &[serde_json::Value]) -> Result<Job, PrepareError> {
    match items {
        [serde_json::Value::String(text)] => return Ok(Job::Text(text.clone())),
        [serde_json::Value::Array(ids)] => return token_ids(ids).map(Job::Tokens),
        _ => {}
    }
    if items.iter().all(serde_json::Value::is_number) {
        return token_ids(items).map(Job::Tokens);
    }
    Err(PrepareError::BadRequest(
        "prompt is a batch; only one prompt is scored",
    ))
}

fn token_ids(items: &[serde_json::Value]) -> Result<Vec<u32>, PrepareError> {
    items
        .iter()
        .map(|item| {
            item.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or(PrepareError::BadRequest("prompt token ids must be u32"))
        })
        .collect()
}

/// The job of a chat body: messages with text-only content-part lists flattened to one string
/// (Dynamo's frontend does the same before rendering, so templates written for string content
/// see strings), tools, `add_generation_prompt` and `chat_template_kwargs`; with
/// `conversations` and a message-local template, only the messages after the cached turn the
/// chat continues are converted for the template (the others are never read by it).
fn chat_job(
    request: &serde_json::Value,
    messages: &serde_json::Value,
    template: &ChatTemplate,
    conversations: Option<&Arc<Conversations>>,
) -> Result<Job, PrepareError> {
    let serde_json::Value::Array(messages) = messages else {
        return Err(PrepareError::BadRequest("messages is not an array"));
    };
    if messages.len() > MAX_MESSAGES {
        return Err(PrepareError::BadRequest("too many messages"));
    }
    // Borrowed unless flattened: a 128k-token chat is not copied before minijinja's own copy.
    let messages: Vec<Cow<'_, serde_json::Value>> =
        messages.iter().map(flatten_text_parts).collect();
    let tools = match request.get("tools") {
        Some(tools @ serde_json::Value::Array(list)) if !list.is_empty() => Some(tools),
        _ => None,
    };
    let continue_final = request
        .get("continue_final_message")
        .and_then(serde_json::Value::as_bool)
        .unwrap_or(false);
    let add_generation_prompt = !continue_final
        && request
            .get("add_generation_prompt")
            .and_then(serde_json::Value::as_bool)
            .unwrap_or(true);
    let mut kwargs = Vec::new();
    for key in ["chat_template_args", "chat_template_kwargs"] {
        if let Some(serde_json::Value::Object(args)) = request.get(key) {
            kwargs.extend(args.iter());
        }
    }
    let size_hint = messages
        .iter()
        .filter_map(|m| m.get("content").and_then(serde_json::Value::as_str))
        .map(|c| c.len() + 64)
        .sum::<usize>()
        + 4096;
    let mut input = TemplateInput {
        messages: Value::from(()),
        tools: tools.map_or(Value::from(()), |t| Value::from(Serde(t))),
        has_tools: tools.is_some(),
        add_generation_prompt,
        extra: kwargs
            .iter()
            .map(|(k, v)| (Value::from(k.as_str()), Value::from(Serde(*v))))
            .collect(),
        size_hint,
    };
    let Some(conversations) = conversations.filter(|_| template.is_local(tools.is_some())) else {
        input.messages = Value::from(Serde(&messages));
        return Ok(Job::Chat(input, None));
    };
    let inputs = serde_json::json!([
        tools,
        add_generation_prompt,
        kwargs
            .iter()
            .map(|(k, v)| serde_json::json!([k, v]))
            .collect::<Vec<_>>(),
    ]);
    let base = conversations.lookup(&messages, &inputs);
    let from = base.as_ref().map_or(0, |turn| turn.messages.len());
    let mut all = base
        .as_ref()
        .map(|turn| turn.messages.clone())
        .unwrap_or_default();
    all.extend(
        messages[from..]
            .iter()
            .map(|m| Arc::new(m.as_ref().clone())),
    );
    let values: Vec<Value> = std::iter::repeat_n(Value::from(()), from)
        .chain(
            messages[from..]
                .iter()
                .map(|m| Value::from(Serde(m.as_ref()))),
        )
        .collect();
    input.messages = Value::from(values);
    input.size_hint = messages[from..]
        .iter()
        .filter_map(|m| m.get("content").and_then(serde_json::Value::as_str))
        .map(|c| c.len() + 64)
        .sum::<usize>()
        + 4096;
    Ok(Job::Chat(
        input,
        Some(LocalPlan {
            from,
            base,
            messages: all,
            inputs: Arc::new(inputs),
            conversations: Arc::clone(conversations),
        }),
    ))
}

/// `content: [{type: "text", text}, ...]` → the texts joined by `\n`; lists with other part
/// types stay lists (a multimodal template renders them itself).
pub(crate) fn flatten_text_parts(message: &serde_json::Value) -> Cow<'_, serde_json::Value> {
    let Some(serde_json::Value::Array(parts)) = message.get("content") else {
        return Cow::Borrowed(message);
    };
    let texts: Option<Vec<&str>> = parts
        .iter()
        .map(|part| {
            (part.get("type")?.as_str()? == "text")
                .then(|| part.get("text")?.as_str())
                .flatten()
        })
        .collect();
    let Some(texts) = texts else {
        return Cow::Borrowed(message);
    };
    let mut out = message.clone();
    if let Some(object) = out.as_object_mut() {
        object.insert(
            "content".into(),
            serde_json::Value::String(texts.join("\n")),
        );
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests;
