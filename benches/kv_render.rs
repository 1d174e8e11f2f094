//! Prompt preparation cost for KV-aware selection (goal: ≤ 2 ms for an 8k-token chat prompt):
//! rendering (minijinja, the Qwen-style template of tests/fixtures/render/rich.jinja with one
//! tool), then tokenizing (TinyLlama's tokenizer.json, from dynamo-llm 1.6.1's fixtures), then
//! hashing (XXH3 LocalBlockHashes for block sizes 16 and 64), end to end through
//! `PromptRenderer::prepare` on the blocking pool, and each stage alone. Criterion reports
//! means; the percentile pass after it times 300 single prepares and prints p50 / p99 / max,
//! then the same for the mocker's byte-level tiny model. Under `cargo test --benches` (no
//! `--bench`) a short pass only checks the harness runs.

#![allow(clippy::too_many_lines, reason = "test code is exempt")]

use std::hint::black_box;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use continuum_protocol::kv::prompt::{RenderLimits, block_plan, prompt_block_hashes};
use continuum_router::kv::{ChatTemplate, PromptRenderer, SpecialTokens};
use criterion::Criterion;

const TARGET_TOKENS: usize = 8_192;

fn fixtures() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// A multi-turn chat grown turn by turn until it tokenizes to about 8k tokens.
fn chat_of_about(
    tokenizer: &tokenizers::Tokenizer,
    renderer_tokens: impl Fn(&serde_json::Value) -> usize,
) -> serde_json::Value {
    let _ = tokenizer;
    let paragraph = "The router reads kv-events from every worker, keeps a bounded radix index of \
        block hashes, and credits prefill candidates for the prefix blocks they already hold. \
        Überprüfung der Latenz: 世界 — caches, queues and decode budgets all matter. ";
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": "You are a careful assistant for a routing team."}),
    ];
    let mut turn = 0usize;
    loop {
        let role = if turn.is_multiple_of(2) {
            "user"
        } else {
            "assistant"
        };
        messages.push(serde_json::json!({"role": role, "content": format!("Turn {turn}: {}", paragraph.repeat(3))}));
        let request = serde_json::json!({
            "model": "m",
            "messages": messages,
            "tools": [{"type": "function", "function": {"name": "lookup", "description": "Look up a worker", "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}}}}],
        });
        if renderer_tokens(&request) >= TARGET_TOKENS {
            return request;
        }
        turn += 1;
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let measuring = std::env::args().any(|a| a == "--bench");
    let dir = fixtures().join("models/TinyLlama_v1.1");
    let tokenizer = Arc::new(tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap());
    let config: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&std::fs::read(dir.join("tokenizer_config.json")).unwrap()).unwrap();
    let source = std::fs::read_to_string(fixtures().join("render/rich.jinja")).unwrap();
    let template =
        Arc::new(ChatTemplate::from_jinja(&source, SpecialTokens::from_config(&config)).unwrap());
    let renderer = PromptRenderer::new(
        Arc::clone(&tokenizer),
        Some(template),
        RenderLimits::default(),
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let sizes = [16u32, 64];

    let request = chat_of_about(&tokenizer, |request| {
        runtime
            .block_on(renderer.prepare(request, &sizes, None, None))
            .map_or(0, |p| p.isl)
    });
    let prepared = runtime
        .block_on(renderer.prepare(&request, &sizes, None, None))
        .unwrap();
    let text = runtime
        .block_on(renderer.render_text(&request))
        .unwrap()
        .unwrap();
    println!(
        "prompt: {} messages, {} bytes rendered, {} tokens, {} + {} blocks",
        request["messages"].as_array().map_or(0, Vec::len),
        text.len(),
        prepared.isl,
        prepared.hashes[0].1.len(),
        prepared.hashes[1].1.len()
    );
    let plan = block_plan(&sizes).unwrap();

    let mut criterion = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(if measuring { 4 } else { 1 }))
        .configure_from_args();
    criterion.bench_function("kv_render/prepare_8k_chat", |b| {
        b.iter(|| {
            runtime
                .block_on(renderer.prepare(black_box(&request), &sizes, None, None))
                .unwrap()
        })
    });
    criterion.bench_function("kv_render/render_only", |b| {
        b.iter(|| {
            runtime
                .block_on(renderer.render_text(black_box(&request)))
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
            .block_on(renderer.prepare(black_box(&request), &sizes, None, None))
            .unwrap();
        times.push(start.elapsed());
        black_box(prepared);
    }
    times.sort_unstable();
    // How long the seed's 5,000,000 fuel takes to run out: it must stay well under the 2 s
    // deadline, or the deadline (not fuel) is what ends runaway templates.
    let spin = ChatTemplate::from_jinja(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        SpecialTokens::default(),
    )
    .unwrap();
    let spinner = PromptRenderer::new(
        Arc::clone(&tokenizer),
        Some(Arc::new(spin)),
        RenderLimits::default(),
    );
    let start = Instant::now();
    let outcome = runtime.block_on(spinner.prepare(&request, &sizes, None, None));
    println!(
        "fuel_exhaustion: {:?} ({:?})",
        start.elapsed(),
        outcome.map(|p| p.isl)
    );
    println!(
        "prepare_8k_chat: n={runs} p50={:?} p99={:?} max={:?}",
        percentile(&times, 0.5),
        percentile(&times, 0.99),
        times[runs - 1]
    );

    // Multi-turn chats: a follow-up turn whose previous turn is in the tokenization cache, and
    // a first turn (a conversation the cache has never seen), against the uncached path
    // (render, `encode_fast` of the whole text, hash) measured in the same run.
    multi_turn(&runtime, &renderer, &tokenizer, &request, &sizes, measuring);

    // The mocker's tiny model: a byte-level BPE with a regex pre-tokenizer (as Llama 3 / Qwen
    // tokenizers are), where TinyLlama's SentencePiece-style BPE merges the whole prompt as one
    // word. Its own template and its own ~8k-token chat.
    let tiny = fixtures().join("render/tiny-model");
    let tiny_tokenizer =
        Arc::new(tokenizers::Tokenizer::from_file(tiny.join("tokenizer.json")).unwrap());
    let tiny_template = Arc::new(
        ChatTemplate::from_tokenizer_config_json(
            &std::fs::read(tiny.join("tokenizer_config.json")).unwrap(),
        )
        .unwrap(),
    );
    let tiny_renderer = PromptRenderer::new(
        Arc::clone(&tiny_tokenizer),
        Some(tiny_template),
        RenderLimits::default(),
    );
    let tiny_request = chat_of_about(&tiny_tokenizer, |request| {
        runtime
            .block_on(tiny_renderer.prepare(request, &sizes, None, None))
            .map_or(0, |p| p.isl)
    });
    let mut times = Vec::with_capacity(runs);
    let mut isl = 0;
    for _ in 0..runs {
        let start = Instant::now();
        let prepared = runtime
            .block_on(tiny_renderer.prepare(black_box(&tiny_request), &sizes, None, None))
            .unwrap();
        times.push(start.elapsed());
        isl = prepared.isl;
    }
    times.sort_unstable();
    println!(
        "prepare_8k_chat_byte_level ({isl} tokens): n={runs} p50={:?} p99={:?} max={:?}",
        percentile(&times, 0.5),
        percentile(&times, 0.99),
        times[runs - 1]
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

fn multi_turn(
    runtime: &tokio::runtime::Runtime,
    renderer: &PromptRenderer,
    tokenizer: &tokenizers::Tokenizer,
    request: &serde_json::Value,
    sizes: &[u32],
    measuring: bool,
) {
    let batches = if measuring { 10 } else { 1 };
    // Fewer conversations per batch than the cache holds, so every previous turn is cached.
    let per_batch = 24;
    let plan = block_plan(sizes).unwrap();
    let (mut uncached, mut first, mut follow_up) = (Vec::new(), Vec::new(), Vec::new());
    let mut k = 0;
    for _ in 0..batches {
        let chats: Vec<_> = (0..per_batch)
            .map(|_| {
                k += 1;
                conversation(request, k)
            })
            .collect();
        for chat in &chats {
            // Uncached: render, tokenize the whole text, hash.
            let start = Instant::now();
            let text = runtime
                .block_on(renderer.render_text(chat))
                .unwrap()
                .unwrap();
            let ids = tokenizer.encode_fast(text.as_str(), false).unwrap();
            black_box(prompt_block_hashes(ids.get_ids(), &plan, None, None));
            uncached.push(start.elapsed());
            // First turn: the conversation's previous turn, never seen by the cache.
            let previous = earlier_turn(chat, 1);
            let start = Instant::now();
            black_box(
                runtime
                    .block_on(renderer.prepare(&previous, sizes, None, None))
                    .unwrap(),
            );
            first.push(start.elapsed());
        }
        for chat in &chats {
            // Follow-up: the next turn, its previous turn cached.
            let start = Instant::now();
            black_box(
                runtime
                    .block_on(renderer.prepare(chat, sizes, None, None))
                    .unwrap(),
            );
            follow_up.push(start.elapsed());
        }
    }
    for (name, mut times) in [
        ("uncached_8k_chat (render + encode_fast + hash)", uncached),
        ("first_turn_8k_chat (cache miss)", first),
        ("follow_up_turn_8k_chat (previous turn cached)", follow_up),
    ] {
        times.sort_unstable();
        println!(
            "{name}: n={} p50={:?} p99={:?} max={:?}",
            times.len(),
            percentile(&times, 0.5),
            percentile(&times, 0.99),
            times[times.len() - 1]
        );
    }
    println!("token cache: {:?}", renderer.token_cache_stats());
}
