//! Trace input: Mooncake JSONL and OpenAI-style request logs, plain or gzip (`.gz`), read into
//! [`TraceRequest`]s at the simulated fleet's block size.
//!
//! * **Mooncake** lines carry `timestamp` (ms), `input_length`, `output_length` and `hash_ids`;
//!   the ids become blocks as `continuum_protocol::kv::mooncake` documents (32 units of 16 tokens
//!   per 512-token id, a block of `bs` tokens = `bs / 16` units).
//! * **Request logs** carry `timestamp` (ms), `messages` (OpenAI chat messages) and
//!   `output_length`; optional `model`, `cache_salt`. The messages are rendered with the given
//!   chat template and tokenized with the given tokenizer through [`PromptRenderer`] (the
//!   renderer the shim's pinned-artifact path uses), and hashed at the block size exactly as the
//!   shim hashes prompts.
//!
//! The format is chosen per line (`hash_ids` → Mooncake, `messages` → request log). Every line is
//! bounded ([`MAX_LINE_BYTES`], [`MAX_HASH_IDS`]); a line that cannot be read is counted and
//! skipped, with the first few reasons kept for the report.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use continuum_protocol::kv::LocalBlockHash;
use continuum_protocol::kv::hashing::BlockSize;
use continuum_protocol::kv::mooncake::local_hashes;
use continuum_protocol::kv::prompt::RenderLimits;

use continuum_prompt::{ChatTemplate, PromptRenderer, SpecialTokens};

/// A longer line is skipped (a 1 MiB prompt, JSON-escaped, fits comfortably).
pub const MAX_LINE_BYTES: usize = 8 << 20;
/// `hash_ids` beyond this (≈ 33M tokens) make a line unreadable.
pub const MAX_HASH_IDS: usize = 65_536;
/// Lines read at most.
pub const MAX_REQUESTS: usize = 10_000_000;
/// Skip reasons kept for the report.
const MAX_REASONS: usize = 5;

/// One request of the trace, at the fleet's block size.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceRequest {
    /// Arrival, milliseconds from the trace's origin (before `--speedup`).
    pub timestamp_ms: f64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// LocalBlockHashes of the prompt's complete blocks.
    pub blocks: Vec<LocalBlockHash>,
}

/// The tokenizer and chat template request logs are rendered with.
#[derive(Clone, Debug)]
pub struct PromptFiles {
    /// `tokenizer.json`.
    pub tokenizer: PathBuf,
    /// `tokenizer_config.json` (its `chat_template`) or a `.jinja` template.
    pub chat_template: Option<PathBuf>,
}

/// A loaded trace and what was skipped.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    pub requests: Vec<TraceRequest>,
    pub skipped: u64,
    pub skip_reasons: Vec<String>,
}

impl Trace {
    fn skip(&mut self, line: usize, why: impl std::fmt::Display) {
        self.skipped += 1;
        if self.skip_reasons.len() < MAX_REASONS {
            self.skip_reasons.push(format!("line {line}: {why}"));
        }
    }
}

/// Opens `path`, gunzipping when its name ends in `.gz`.
fn open(path: &Path) -> anyhow::Result<Box<dyn BufRead>> {
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let gz = path.extension().is_some_and(|e| e == "gz");
    Ok(if gz {
        Box::new(BufReader::new(flate2::read::MultiGzDecoder::new(file)))
    } else {
        Box::new(BufReader::new(file))
    })
}

/// Reads one line of at most [`MAX_LINE_BYTES`] into `buf`: `Ok(None)` at the end, `Some(false)`
/// for a longer line (read past, not kept).
fn next_line(reader: &mut dyn BufRead, buf: &mut Vec<u8>) -> std::io::Result<Option<bool>> {
    buf.clear();
    let mut limited = (&mut *reader).take(MAX_LINE_BYTES as u64 + 1);
    let n = limited.read_until(b'\n', buf)?;
    if n == 0 {
        return Ok(None);
    }
    if buf.len() > MAX_LINE_BYTES && buf.last() != Some(&b'\n') {
        // Drain the rest of the over-long line.
        let mut sink = Vec::new();
        loop {
            sink.clear();
            let mut chunk = (&mut *reader).take(1 << 20);
            let got = chunk.read_until(b'\n', &mut sink)?;
            if got == 0 || sink.last() == Some(&b'\n') {
                break;
            }
        }
        return Ok(Some(false));
    }
    Ok(Some(true))
}

fn field_u64(v: &serde_json::Value, name: &str) -> Result<u64, String> {
    v.get(name)
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| format!("`{name}` is missing or not a non-negative integer"))
}

fn timestamp(v: &serde_json::Value) -> Result<f64, String> {
    v.get("timestamp")
        .and_then(serde_json::Value::as_f64)
        .filter(|t| t.is_finite() && *t >= 0.0)
        .ok_or_else(|| "`timestamp` is missing or not a non-negative number".to_owned())
}

/// A Mooncake line as a request.
pub fn mooncake_request(
    v: &serde_json::Value,
    block_size: BlockSize,
) -> Result<TraceRequest, String> {
    let ids = v
        .get("hash_ids")
        .and_then(serde_json::Value::as_array)
        .ok_or("`hash_ids` is not an array")?;
    if ids.len() > MAX_HASH_IDS {
        return Err(format!("more than {MAX_HASH_IDS} hash_ids"));
    }
    let ids: Vec<u64> = ids
        .iter()
        .map(|x| x.as_u64().ok_or("a hash_id is not a non-negative integer"))
        .collect::<Result<_, _>>()?;
    let input_tokens = field_u64(v, "input_length")?;
    let blocks = local_hashes(&ids, input_tokens, block_size).map_err(|e| e.to_string())?;
    Ok(TraceRequest {
        timestamp_ms: timestamp(v)?,
        input_tokens,
        output_tokens: field_u64(v, "output_length")?,
        blocks,
    })
}

/// Renders request-log lines with one tokenizer and template.
pub struct LogRenderer {
    renderer: PromptRenderer,
    runtime: tokio::runtime::Runtime,
}

impl LogRenderer {
    pub fn load(files: &PromptFiles) -> anyhow::Result<Self> {
        let tokenizer = tokenizers::Tokenizer::from_file(&files.tokenizer)
            .map_err(|e| anyhow::anyhow!("tokenizer {}: {e}", files.tokenizer.display()))?;
        let template = match &files.chat_template {
            None => None,
            Some(path) => {
                let bytes = std::fs::read(path)
                    .with_context(|| format!("cannot read {}", path.display()))?;
                let is_json = path.extension().is_some_and(|e| e == "json");
                let template = if is_json {
                    ChatTemplate::from_tokenizer_config_json(&bytes)
                } else {
                    let text = String::from_utf8(bytes)
                        .with_context(|| format!("{} is not UTF-8", path.display()))?;
                    ChatTemplate::from_jinja(&text, SpecialTokens::default())
                }
                .map_err(|e| anyhow::anyhow!("chat template {}: {e}", path.display()))?;
                Some(Arc::new(template))
            }
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .context("cannot start a runtime for rendering")?;
        Ok(Self {
            renderer: PromptRenderer::new(Arc::new(tokenizer), template, RenderLimits::default()),
            runtime,
        })
    }

    /// A request-log line as a request.
    pub fn request(
        &self,
        v: &serde_json::Value,
        block_size: BlockSize,
    ) -> Result<TraceRequest, String> {
        let timestamp_ms = timestamp(v)?;
        let output_tokens = field_u64(v, "output_length")?;
        let messages = v.get("messages").ok_or("`messages` is missing")?;
        let mut body = serde_json::json!({ "messages": messages });
        if let Some(model) = v.get("model") {
            body["model"] = model.clone();
        }
        let salt = v.get("cache_salt").and_then(serde_json::Value::as_str);
        let prepared = self
            .runtime
            .block_on(
                self.renderer
                    .prepare(&body, &[block_size.get()], None, salt),
            )
            .map_err(|e| e.to_string())?;
        let blocks = prepared
            .hashes_for(block_size)
            .map(<[_]>::to_vec)
            .unwrap_or_default();
        Ok(TraceRequest {
            timestamp_ms,
            input_tokens: prepared.isl as u64,
            output_tokens,
            blocks,
        })
    }
}

/// Reads `path` (Mooncake or request-log lines), hashing at `block_size`. Request-log lines need
/// `prompt` files; without them they are skipped. Requests are returned sorted by timestamp
/// (stable: equal timestamps keep file order).
pub fn load(
    path: &Path,
    block_size: BlockSize,
    prompt: Option<&PromptFiles>,
) -> anyhow::Result<Trace> {
    let mut reader = open(path)?;
    let renderer = prompt.map(LogRenderer::load).transpose()?;
    let mut trace = Trace::default();
    let mut buf = Vec::new();
    let mut line_no = 0usize;
    while let Some(fits) =
        next_line(&mut *reader, &mut buf).with_context(|| format!("reading {}", path.display()))?
    {
        line_no += 1;
        if !fits {
            trace.skip(line_no, format!("longer than {MAX_LINE_BYTES} bytes"));
            continue;
        }
        if buf.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        if trace.requests.len() >= MAX_REQUESTS {
            bail!("{} holds more than {MAX_REQUESTS} requests", path.display());
        }
        let value: serde_json::Value = match serde_json::from_slice(&buf) {
            Ok(v) => v,
            Err(e) => {
                trace.skip(line_no, format!("not JSON: {e}"));
                continue;
            }
        };
        let parsed = if value.get("hash_ids").is_some() {
            mooncake_request(&value, block_size)
        } else if value.get("messages").is_some() {
            match &renderer {
                Some(r) => r.request(&value, block_size),
                None => Err("a request-log line needs --tokenizer".to_owned()),
            }
        } else {
            Err("neither `hash_ids` nor `messages`".to_owned())
        };
        match parsed {
            Ok(request) => trace.requests.push(request),
            Err(why) => trace.skip(line_no, why),
        }
    }
    trace
        .requests
        .sort_by(|a, b| a.timestamp_ms.total_cmp(&b.timestamp_ms));
    Ok(trace)
}
