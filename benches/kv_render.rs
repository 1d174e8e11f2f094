//! Prompt preparation cost for KV-aware selection (goals: ≤ 2 ms for an 8k-token chat prompt,
//! ≤ 5 / 20 ms p50 for a 32k / 128k-token first turn, ≤ 1 ms p50 for a 128k follow-up turn):
//! rendering (minijinja), then tokenizing (TinyLlama's tokenizer.json, from dynamo-llm 1.6.1's
//! fixtures), then hashing (XXH3 LocalBlockHashes for block sizes 16 and 64), end to end through
//! `PromptRenderer::prepare` on the blocking pool, and each stage alone. Two templates: `rich`,
//! the Qwen-style template of tests/fixtures/render/rich.jinja with one tool (not
//! message-local: every turn is rendered whole), and `own`, TinyLlama's own chat template from
//! its tokenizer_config.json (message-local: a follow-up renders only its new messages).
//!
//! `KV_RENDER_TOKENS=1k,2k,4k,8k,16k,32k,64k,128k` (default `8k`; `k` is 1,024 tokens) picks
//! the chat sizes. For each size and template: a first turn (a conversation the caches have not
//! seen) and a follow-up turn (the previous turn cached), p50 / p99 end to end and the p50 of
//! each stage (render / tokenize / hash, timed apart on a shadow renderer and cache that see the
//! same prompts; the hash stage continues the previous turn's hashes as the cache does); with
//! `rich` only, the uncached path (render, `encode_fast` of the whole text, hash) and the
//! mocker's byte-level tiny model, which the segmenting cache does not support. A markdown
//! table of the curve closes the run. Criterion (means) runs for the `8k` size only. Under
//! `cargo test --benches` (no `--bench`) a short pass only checks the harness runs.

#![allow(clippy::too_many_lines, reason = "test code is exempt")]

use std::hint::black_box;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use continuum_protocol::kv::LocalBlockHash;
use continuum_protocol::kv::hashing::KV_HASH_SEED;
use continuum_protocol::kv::prompt::{
    RenderLimits, block_plan, extend_block_hashes, prompt_block_hashes,
};
use continuum_router::kv::token_cache::DEFAULT_CACHE_LIMITS;
use continuum_router::kv::{ChatTemplate, PromptRenderer, PromptTokenizer, SpecialTokens};
use criterion::Criterion;

/// The daemon as shipped: the binary allocates through mimalloc (the default `mimalloc`
/// feature), so the preparation measured here does too (with glibc's allocator, freeing and
/// consolidating chunks showed up high in the 128k-token profile).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const SIZES: [u32; 2] = [16, 64];

fn fixtures() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// `KV_RENDER_TOKENS`: `(label, tokens)` per size.
fn sizes_from_env() -> Vec<(String, usize)> {
    let list = std::env::var("KV_RENDER_TOKENS").unwrap_or_else(|_| "8k".into());
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            let tokens = match s.strip_suffix('k') {
                Some(k) => k.parse::<usize>().map(|k| k * 1024),
                None => s.parse::<usize>(),
            };
            let tokens = tokens.unwrap_or_else(|_| panic!("KV_RENDER_TOKENS: bad size {s:?}"));
            (s.to_owned(), tokens)
        })
        .collect()
}

/// A multi-turn chat of `turns` messages after the system prompt, with one tool.
fn chat(turns: usize) -> serde_json::Value {
    let paragraph = "The router reads kv-events from every worker, keeps a bounded radix index of \
        block hashes, and credits prefill candidates for the prefix blocks they already hold. \
        Überprüfung der Latenz: 世界 — caches, queues and decode budgets all matter. ";
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": "You are a careful assistant for a routing team."}),
    ];
    for turn in 0..turns {
        let role = if turn.is_multiple_of(2) {
            "user"
        } else {
            "assistant"
        };
        messages.push(serde_json::json!({"role": role, "content": format!("Turn {turn}: {}", paragraph.repeat(3))}));
    }
    serde_json::json!({
        "model": "m",
        "messages": messages,
        "tools": [{"type": "function", "function": {"name": "lookup", "description": "Look up a worker", "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}}}}],
    })
}

/// The shortest [`chat`] that tokenizes to at least `target` tokens.
fn chat_of_about(target: usize, count: impl Fn(&serde_json::Value) -> usize) -> serde_json::Value {
    let mut high = 1;
    while count(&chat(high)) < target {
        high *= 2;
    }
    let mut low = high / 2;
    while high - low > 1 {
        let middle = low + (high - low) / 2;
        if count(&chat(middle)) >= target {
            high = middle;
        } else {
            low = middle;
        }
    }
    chat(high)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1e3)
}

/// Samples sorted, with p50 / p99 / max.
struct Timings(Vec<Duration>);

impl Timings {
    fn new(mut times: Vec<Duration>) -> Self {
        times.sort_unstable();
        Self(times)
    }
    fn p50(&self) -> Duration {
        percentile(&self.0, 0.5)
    }
    fn p99(&self) -> Duration {
        percentile(&self.0, 0.99)
    }
    fn line(&self) -> String {
        format!(
            "n={} p50={:?} p99={:?} max={:?}",
            self.0.len(),
            self.p50(),
            self.p99(),
            self.0[self.0.len() - 1]
        )
    }
}

/// One model's renderer and the tokenizer and template behind it.
struct Model {
    tokenizer: Arc<tokenizers::Tokenizer>,
    template: Arc<ChatTemplate>,
}

impl Model {
    fn tinyllama() -> Self {
        let dir = fixtures().join("models/TinyLlama_v1.1");
        let tokenizer =
            Arc::new(tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap());
        let config: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&std::fs::read(dir.join("tokenizer_config.json")).unwrap())
                .unwrap();
        let source = std::fs::read_to_string(fixtures().join("render/rich.jinja")).unwrap();
        let template = Arc::new(
            ChatTemplate::from_jinja(&source, SpecialTokens::from_config(&config)).unwrap(),
        );
        Self {
            tokenizer,
            template,
        }
    }

    /// TinyLlama's tokenizer with its own chat template (tokenizer_config.json), which is
    /// message-local: a follow-up renders only its new messages.
    fn tinyllama_own() -> Self {
        let dir = fixtures().join("models/TinyLlama_v1.1");
        let tokenizer =
            Arc::new(tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap());
        let template = Arc::new(
            ChatTemplate::from_tokenizer_config_json(
                &std::fs::read(dir.join("tokenizer_config.json")).unwrap(),
            )
            .unwrap(),
        );
        Self {
            tokenizer,
            template,
        }
    }

    /// The mocker's tiny model: a byte-level BPE with a regex pre-tokenizer (as Llama 3 / Qwen
    /// tokenizers are), where TinyLlama's SentencePiece-style BPE merges each piece as one word.
    fn byte_level() -> Self {
        let tiny = fixtures().join("render/tiny-model");
        let tokenizer =
            Arc::new(tokenizers::Tokenizer::from_file(tiny.join("tokenizer.json")).unwrap());
        let template = Arc::new(
            ChatTemplate::from_tokenizer_config_json(
                &std::fs::read(tiny.join("tokenizer_config.json")).unwrap(),
            )
            .unwrap(),
        );
        Self {
            tokenizer,
            template,
        }
    }

    fn renderer(&self) -> PromptRenderer {
        PromptRenderer::new(
            Arc::clone(&self.tokenizer),
            Some(Arc::clone(&self.template)),
            RenderLimits::default(),
        )
    }

    /// A chat of about `target` tokens through this model's template and tokenizer.
    fn chat_of_about(&self, runtime: &tokio::runtime::Runtime, target: usize) -> serde_json::Value {
        let counter = self.renderer();
        chat_of_about(target, |request| {
            runtime
                .block_on(counter.prepare(request, &SIZES, None, None))
                .map_or(0, |p| p.isl)
        })
    }
}

/// One size's figures, for the closing table.
struct Row {
    label: String,
    template: &'static str,
    tokens: usize,
    bytes: usize,
    first: Timings,
    first_stages: [Duration; 3],
    follow_up: Timings,
    follow_up_stages: [Duration; 3],
    uncached: Timings,
    entry_bytes: usize,
    byte_level: Timings,
    byte_level_tokens: usize,
}

fn main() {
    let measuring = std::env::args().any(|a| a == "--bench");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let tinyllama = Model::tinyllama();
    let own = Model::tinyllama_own();
    let byte_level = Model::byte_level();
    let mut rows = Vec::new();
    for (label, target) in sizes_from_env() {
        let runs = if measuring {
            (8_000_000 / target).clamp(30, 300)
        } else {
            2
        };
        let request = tinyllama.chat_of_about(&runtime, target);
        if label == "8k" {
            criterion_pass(&runtime, &tinyllama, &request, measuring);
        }
        let own_request = own.chat_of_about(&runtime, target);
        let own_row = curve(&runtime, &own, "own", &label, &own_request, runs);
        let mut row = curve(&runtime, &tinyllama, "rich", &label, &request, runs);
        let tiny_request = byte_level.chat_of_about(&runtime, target);
        let renderer = byte_level.renderer();
        let mut times = Vec::with_capacity(runs);
        for _ in 0..runs {
            let start = Instant::now();
            let prepared = runtime
                .block_on(renderer.prepare(black_box(&tiny_request), &SIZES, None, None))
                .unwrap();
            times.push(start.elapsed());
            row.byte_level_tokens = prepared.isl;
        }
        row.byte_level = Timings::new(times);
        println!(
            "prepare_{label}_chat_byte_level ({} tokens): {}",
            row.byte_level_tokens,
            row.byte_level.line()
        );
        rows.push(row);
        rows.push(own_row);
    }
    fuel_exhaustion(&runtime, &tinyllama);
    print_table(&rows);
}

/// Criterion means of the whole preparation and of each stage alone, and the p50 / p99 of 300
/// single prepares of the same prompt (8k only).
fn criterion_pass(
    runtime: &tokio::runtime::Runtime,
    model: &Model,
    request: &serde_json::Value,
    measuring: bool,
) {
    let renderer = model.renderer();
    let tokenizer = &model.tokenizer;
    let prepared = runtime
        .block_on(renderer.prepare(request, &SIZES, None, None))
        .unwrap();
    let text = runtime
        .block_on(renderer.render_text(request))
        .unwrap()
        .unwrap();
    let plan = block_plan(&SIZES).unwrap();
    let mut criterion = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(if measuring { 4 } else { 1 }))
        .configure_from_args();
    criterion.bench_function("kv_render/prepare_8k_chat", |b| {
        b.iter(|| {
            runtime
                .block_on(renderer.prepare(black_box(request), &SIZES, None, None))
                .unwrap()
        })
    });
    criterion.bench_function("kv_render/render_only", |b| {
        b.iter(|| {
            runtime
                .block_on(renderer.render_text(black_box(request)))
                .unwrap()
        })
    });
    criterion.bench_function("kv_render/tokenize_only", |b| {
        b.iter(|| {
            tokenizer
                .encode_fast(black_box(text.as_str()), false)
                .unwrap()
        })
    });
    criterion.bench_function("kv_render/hash_only", |b| {
        b.iter(|| prompt_block_hashes(black_box(&prepared.tokens), &plan, None, None))
    });
    criterion.final_summary();
    let runs = if measuring { 300 } else { 5 };
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        let start = Instant::now();
        let prepared = runtime
            .block_on(renderer.prepare(black_box(request), &SIZES, None, None))
            .unwrap();
        times.push(start.elapsed());
        black_box(prepared);
    }
    println!("prepare_8k_chat: {}", Timings::new(times).line());
}

/// How long the seed's 5,000,000 fuel takes to run out: it must stay well under the 2 s
/// deadline, or the deadline (not fuel) is what ends runaway templates.
fn fuel_exhaustion(runtime: &tokio::runtime::Runtime, model: &Model) {
    let spin = ChatTemplate::from_jinja(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        SpecialTokens::default(),
    )
    .unwrap();
    let spinner = PromptRenderer::new(
        Arc::clone(&model.tokenizer),
        Some(Arc::new(spin)),
        RenderLimits::default(),
    );
    let start = Instant::now();
    let outcome = runtime.block_on(spinner.prepare(&chat(4), &SIZES, None, None));
    println!(
        "fuel_exhaustion: {:?} ({:?})",
        start.elapsed(),
        outcome.map(|p| p.isl)
    );
}

/// `request` with its system prompt made unique by `k` (a different conversation).
fn conversation(request: &serde_json::Value, k: usize) -> serde_json::Value {
    let mut request = request.clone();
    if let Some(first) = request["messages"].get_mut(0) {
        first["content"] =
            format!("Conversation {k}. You are a careful assistant for a routing team.").into();
    }
    request
}

/// `request` without its last `n` messages (an earlier turn of the same conversation).
fn earlier_turn(request: &serde_json::Value, n: usize) -> serde_json::Value {
    let mut request = request.clone();
    if let Some(messages) = request["messages"].as_array_mut() {
        let keep = messages.len().saturating_sub(n);
        messages.truncate(keep);
    }
    request
}

/// A turn's ids and per-size block hashes, as the next turn's hash stage continues them.
type Hashed = (Vec<u32>, Vec<Vec<LocalBlockHash>>);

/// The stages of one preparation timed apart: render (through `shadow_renderer`, which has seen
/// the same prompts, so a follow-up through a message-local template renders only its new
/// messages), tokenize (through `shadow`, a cache that has seen the same prompts), hash (the
/// blocks after those inside the tokens shared with `previous`, as the cache does).
fn stages(
    runtime: &tokio::runtime::Runtime,
    shadow_renderer: &PromptRenderer,
    shadow: &PromptTokenizer,
    request: &serde_json::Value,
    previous: Option<&Hashed>,
) -> ([Duration; 3], Hashed) {
    let plan = block_plan(&SIZES).unwrap();
    let start = Instant::now();
    let text = runtime
        .block_on(shadow_renderer.render_text_as_prepared(request))
        .unwrap()
        .unwrap();
    let rendered = start.elapsed();
    let start = Instant::now();
    let ids = shadow.tokenize(&text).unwrap();
    let tokenized = start.elapsed();
    let shared = previous.map_or(0, |(old, _)| {
        old.iter().zip(&ids).take_while(|(a, b)| a == b).count()
    });
    let start = Instant::now();
    let hashes: Vec<Vec<LocalBlockHash>> = plan
        .iter()
        .enumerate()
        .map(|(i, &size)| {
            let reused = previous.map_or(&[][..], |(_, h)| {
                &h[i][..(shared / size.get() as usize).min(h[i].len())]
            });
            let mut hashes = reused.to_vec();
            extend_block_hashes(&mut hashes, &ids, size, KV_HASH_SEED);
            hashes
        })
        .collect();
    let hashed = start.elapsed();
    black_box(&hashes);
    ([rendered, tokenized, hashed], (ids, hashes))
}

fn stage_p50(samples: &[[Duration; 3]]) -> [Duration; 3] {
    std::array::from_fn(|i| Timings::new(samples.iter().map(|s| s[i]).collect()).p50())
}

/// Multi-turn chats of one size: a first turn (a conversation the cache has never seen), a
/// follow-up turn (its previous turn cached), and the uncached path (render, `encode_fast` of
/// the whole text, hash) measured in the same run.
fn curve(
    runtime: &tokio::runtime::Runtime,
    model: &Model,
    template: &'static str,
    label: &str,
    request: &serde_json::Value,
    runs: usize,
) -> Row {
    let renderer = model.renderer();
    let shadow_renderer = model.renderer();
    let shadow = PromptTokenizer::new(Arc::clone(&model.tokenizer), DEFAULT_CACHE_LIMITS);
    let plan = block_plan(&SIZES).unwrap();
    let text = runtime
        .block_on(renderer.render_text(request))
        .unwrap()
        .unwrap();
    let tokens = runtime
        .block_on(renderer.prepare(request, &SIZES, None, None))
        .unwrap()
        .isl;
    let entry_bytes = renderer.token_cache_stats().bytes + renderer.conversation_stats().bytes;
    println!(
        "{label} {template} prompt: {} messages, {} bytes rendered, {tokens} tokens, {entry_bytes} bytes cached (tokens, hashes and rendered turn)",
        request["messages"].as_array().map_or(0, Vec::len),
        text.len(),
    );
    // Fewer conversations per batch than the cache holds, so every previous turn is cached.
    let per_batch = (DEFAULT_CACHE_LIMITS.max_bytes / 2 / entry_bytes.max(1)).clamp(1, 24);
    let batches = runs.div_ceil(per_batch);
    let (mut first, mut follow_up) = (Vec::new(), Vec::new());
    let (mut first_stages, mut follow_up_stages) = (Vec::new(), Vec::new());
    let mut uncached = Vec::new();
    // The uncached path and the byte-level fixture are measured with the rich template only.
    let uncached_runs = if template == "rich" {
        (runs / 10).max(2)
    } else {
        0
    };
    let mut k = 0;
    for _ in 0..batches {
        let chats: Vec<_> = (0..per_batch)
            .map(|_| {
                k += 1;
                conversation(request, k)
            })
            .collect();
        let mut previous = Vec::with_capacity(chats.len());
        for chat in &chats {
            if uncached.len() < uncached_runs {
                let start = Instant::now();
                let text = runtime
                    .block_on(renderer.render_text(chat))
                    .unwrap()
                    .unwrap();
                let ids = model.tokenizer.encode_fast(text.as_str(), false).unwrap();
                black_box(prompt_block_hashes(ids.get_ids(), &plan, None, None));
                uncached.push(start.elapsed());
            }
            // First turn: the conversation's previous turn, never seen by the cache.
            let earlier = earlier_turn(chat, 1);
            let start = Instant::now();
            black_box(
                runtime
                    .block_on(renderer.prepare(&earlier, &SIZES, None, None))
                    .unwrap(),
            );
            first.push(start.elapsed());
            let (timed, hashed) = stages(runtime, &shadow_renderer, &shadow, &earlier, None);
            first_stages.push(timed);
            previous.push(hashed);
        }
        for (chat, previous) in chats.iter().zip(&previous) {
            // Follow-up: the next turn, its previous turn cached.
            let start = Instant::now();
            black_box(
                runtime
                    .block_on(renderer.prepare(chat, &SIZES, None, None))
                    .unwrap(),
            );
            follow_up.push(start.elapsed());
            let (timed, _) = stages(runtime, &shadow_renderer, &shadow, chat, Some(previous));
            follow_up_stages.push(timed);
        }
    }
    let row = Row {
        label: label.to_owned(),
        template,
        tokens,
        bytes: text.len(),
        first: Timings::new(first),
        first_stages: stage_p50(&first_stages),
        follow_up: Timings::new(follow_up),
        follow_up_stages: stage_p50(&follow_up_stages),
        uncached: Timings::new(if uncached.is_empty() {
            vec![Duration::ZERO]
        } else {
            uncached
        }),
        entry_bytes,
        byte_level: Timings::new(vec![Duration::ZERO]),
        byte_level_tokens: 0,
    };
    let split = |s: [Duration; 3]| {
        format!(
            "render {} / tokenize {} / hash {} ms",
            ms(s[0]),
            ms(s[1]),
            ms(s[2])
        )
    };
    if uncached_runs > 0 {
        println!(
            "uncached_{label}_chat (render + encode_fast + hash): {}",
            row.uncached.line()
        );
    }
    println!(
        "first_turn_{label}_{template}_chat (cache miss): {}; p50 {}",
        row.first.line(),
        split(row.first_stages)
    );
    println!(
        "follow_up_turn_{label}_{template}_chat (previous turn cached): {}; p50 {}",
        row.follow_up.line(),
        split(row.follow_up_stages)
    );
    println!("token cache: {:?}", renderer.token_cache_stats());
    println!("conversation cache: {:?}", renderer.conversation_stats());
    row
}

fn print_table(rows: &[Row]) {
    println!();
    println!(
        "| chat | template | first turn p50 / p99 | render / tokenize / hash | follow-up p50 / p99 | render / tokenize / hash | cached bytes | uncached p50 | byte-level first turn p50 / p99 |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for row in rows {
        let split = |s: [Duration; 3]| format!("{} / {} / {}", ms(s[0]), ms(s[1]), ms(s[2]));
        println!(
            "| {} ({} tokens, {} kB) | {} | {} / {} | {} | {} / {} | {} | {} | {} | {} / {} ({} tokens) |",
            row.label,
            row.tokens,
            row.bytes / 1000,
            row.template,
            ms(row.first.p50()),
            ms(row.first.p99()),
            split(row.first_stages),
            ms(row.follow_up.p50()),
            ms(row.follow_up.p99()),
            split(row.follow_up_stages),
            row.entry_bytes,
            ms(row.uncached.p50()),
            ms(row.byte_level.p50()),
            ms(row.byte_level.p99()),
            row.byte_level_tokens,
        );
    }
}
