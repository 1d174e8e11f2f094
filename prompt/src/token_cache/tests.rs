//! The cache is exact (property tests against `encode_fast` over random texts and random
//! conversations rendered through both tokenizer fixtures' templates) and bounded.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use proptest::prelude::*;
use serde_json::json;
use tokenizers::Tokenizer;

use super::*;
use crate::render::PromptRenderer;
use crate::template::{ChatTemplate, SpecialTokens};
use continuum_protocol::kv::prompt::{RenderLimits, block_plan, prompt_block_hashes};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

/// Loaded once per test binary (parsing the 32,000-token vocabulary is slow unoptimised).
fn tinyllama_tokenizer() -> Arc<Tokenizer> {
    static LOADED: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    Arc::clone(LOADED.get_or_init(|| {
        Arc::new(
            Tokenizer::from_file(fixtures().join("models/TinyLlama_v1.1/tokenizer.json")).unwrap(),
        )
    }))
}

fn byte_level_tokenizer() -> Arc<Tokenizer> {
    static LOADED: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    Arc::clone(LOADED.get_or_init(|| {
        Arc::new(Tokenizer::from_file(fixtures().join("render/tiny-model/tokenizer.json")).unwrap())
    }))
}

fn full(tokenizer: &Tokenizer, text: &str) -> Vec<u32> {
    tokenizer
        .encode_fast(text, false)
        .unwrap()
        .get_ids()
        .to_vec()
}

/// Fragments that stress the cut rule: spaces in runs and at piece edges, the literal `▁`,
/// added tokens and their halves, newlines, multi-byte and unknown characters.
const FRAGMENTS: &[&str] = &[
    "a",
    "the",
    "router",
    "Hello",
    " ",
    "  ",
    "   ",
    "\n",
    "\n\n",
    "\t",
    "▁",
    "x▁",
    "▁▁",
    "<s>",
    "</s>",
    "<unk>",
    "<|im_start|>",
    "<|im_end|>",
    "<",
    "s>",
    "</",
    ".",
    ",",
    "'",
    "!",
    "?",
    "0",
    "42",
    "ü",
    "Überprüfung",
    "世界",
    "🙂",
    "\u{2028}",
    "-",
    "—",
    ":",
    "{\"a\": 1}",
];

fn text_strategy() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(FRAGMENTS), 0..40).prop_map(|parts| parts.concat())
}

/// The three renderers of the fixtures: TinyLlama's own template and the Qwen-style rich
/// template over TinyLlama's tokenizer, and the byte-level tiny model with its template.
fn renderers() -> Vec<PromptRenderer> {
    let tinyllama = fixtures().join("models/TinyLlama_v1.1");
    let config = std::fs::read(tinyllama.join("tokenizer_config.json")).unwrap();
    let own = ChatTemplate::from_tokenizer_config_json(&config).unwrap();
    let config: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&config).unwrap();
    let rich = ChatTemplate::from_jinja(
        &std::fs::read_to_string(fixtures().join("render/rich.jinja")).unwrap(),
        SpecialTokens::from_config(&config),
    )
    .unwrap();
    let tiny = fixtures().join("render/tiny-model");
    let tiny_template = ChatTemplate::from_tokenizer_config_json(
        &std::fs::read(tiny.join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    vec![
        PromptRenderer::new(
            tinyllama_tokenizer(),
            Some(Arc::new(own)),
            RenderLimits::default(),
        ),
        PromptRenderer::new(
            tinyllama_tokenizer(),
            Some(Arc::new(rich)),
            RenderLimits::default(),
        ),
        PromptRenderer::new(
            byte_level_tokenizer(),
            Some(Arc::new(tiny_template)),
            RenderLimits::default(),
        ),
    ]
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn the_sentencepiece_fixture_is_supported_and_the_byte_level_one_falls_back() {
    let tinyllama = PromptTokenizer::new(tinyllama_tokenizer(), DEFAULT_CACHE_LIMITS);
    assert_eq!(tinyllama.supported(), Ok(()));
    let byte_level = PromptTokenizer::new(byte_level_tokenizer(), DEFAULT_CACHE_LIMITS);
    assert_eq!(
        byte_level.supported(),
        Err("normalizer is not SentencePiece's Prepend + Replace")
    );
    let text = "Hello  world <s> again";
    assert_eq!(
        byte_level.tokenize(text).unwrap(),
        full(&byte_level_tokenizer(), text)
    );
    assert_eq!(
        byte_level.stats().entries,
        0,
        "an unsupported tokenizer caches nothing"
    );
}

#[test]
fn a_follow_up_turn_reuses_the_previous_turn_and_equals_full_tokenization() {
    let tokenizer = tinyllama_tokenizer();
    let cache = PromptTokenizer::new(Arc::clone(&tokenizer), DEFAULT_CACHE_LIMITS);
    let mut text = String::from("<|system|>\nYou are a careful assistant.</s>\n");
    for turn in 0..8 {
        text.push_str(&format!(
            "<|user|>\nTurn {turn}: the router credits cached prefix blocks. </s>\n<|assistant|>\n"
        ));
        assert_eq!(
            cache.tokenize(&text).unwrap(),
            full(&tokenizer, &text),
            "turn {turn}"
        );
        text.push_str("Noted, the index is bounded.</s>\n");
    }
    let stats = cache.stats();
    assert_eq!((stats.hits, stats.misses), (7, 1), "{stats:?}");
}

#[test]
fn entries_and_bytes_stay_within_the_limits_least_recently_used_first() {
    let tokenizer = tinyllama_tokenizer();
    let limits = CacheLimits {
        max_entries: 3,
        max_bytes: 64 * 1024,
    };
    let cache = PromptTokenizer::new(Arc::clone(&tokenizer), limits);
    let prompt = |i: usize| format!("conversation {i:04} says hello to the router again and again");
    for i in 0..10 {
        cache.tokenize(&prompt(i)).unwrap();
        let stats = cache.stats();
        assert!(
            stats.entries <= 3 && stats.bytes <= limits.max_bytes,
            "{stats:?}"
        );
    }
    // Ten prompts through three places: seven evicted, each counted.
    assert_eq!(cache.stats().evictions, 7);
    // The three most recent are held: a follow-up of #9 hits, one of #0 does not.
    let before = cache.stats();
    cache.tokenize(&format!("{} more", prompt(9))).unwrap();
    assert_eq!(cache.stats().hits, before.hits + 1);
    cache.tokenize(&format!("{} more", prompt(0))).unwrap();
    assert_eq!(cache.stats().hits, before.hits + 1, "#0 was evicted");

    // A prompt over a quarter of the byte budget is tokenized exactly but never held.
    let huge = "word ".repeat(limits.max_bytes / 16);
    let before = cache.stats();
    assert_eq!(cache.tokenize(&huge).unwrap(), full(&tokenizer, &huge));
    let after = cache.stats();
    assert_eq!(after.entries, before.entries);
    assert!(after.bytes <= limits.max_bytes);

    // Byte-bound eviction: prompts of ~10 kB each in a 64 kB budget.
    for i in 0..8 {
        let text = format!("{i} {}", "tokens of a long answer ".repeat(300));
        cache.tokenize(&text).unwrap();
        assert!(cache.stats().bytes <= limits.max_bytes);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Any text, tokenized from nothing, and then any text sharing an arbitrary prefix with it
    /// (cut anywhere, even inside a character run or an added token) through the cache.
    #[test]
    fn the_cache_equals_full_tokenization_on_random_texts(
        first in text_strategy(),
        cut in 0usize..400,
        rest in text_strategy(),
    ) {
        for tokenizer in [tinyllama_tokenizer(), byte_level_tokenizer()] {
            let cache = PromptTokenizer::new(Arc::clone(&tokenizer), DEFAULT_CACHE_LIMITS);
            prop_assert_eq!(cache.tokenize(&first).unwrap(), full(&tokenizer, &first));
            let mut at = cut.min(first.len());
            while !first.is_char_boundary(at) {
                at -= 1;
            }
            let second = format!("{}{rest}", &first[..at]);
            prop_assert_eq!(cache.tokenize(&second).unwrap(), full(&tokenizer, &second));
            let third = format!("{second}{first}");
            prop_assert_eq!(cache.tokenize(&third).unwrap(), full(&tokenizer, &third));
        }
    }

    /// Random conversations, rendered turn by turn through each fixture's template, prepared
    /// through one renderer (so each turn may reuse the previous): every turn's tokens equal
    /// the full tokenization of its rendered text.
    #[test]
    fn follow_up_turns_equal_full_tokenization(
        turns in prop::collection::vec(text_strategy(), 1..6),
        system in prop::option::of(text_strategy()),
    ) {
        let runtime = runtime();
        for renderer in renderers() {
            let mut messages = Vec::new();
            if let Some(system) = &system {
                messages.push(json!({"role": "system", "content": system}));
            }
            for (i, content) in turns.iter().enumerate() {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                messages.push(json!({"role": role, "content": content}));
                let request = json!({"model": "m", "messages": messages});
                let Ok(Some(text)) = runtime.block_on(renderer.render_text(&request)) else {
                    continue;
                };
                let prepared = runtime.block_on(renderer.prepare(&request, &[16], None, None));
                let tokenizer = renderer_tokenizer(&renderer);
                let want = full(&tokenizer, &text);
                match prepared {
                    Ok(prepared) => prop_assert_eq!(&*prepared.tokens, want.as_slice()),
                    Err(error) => prop_assert!(false, "{error}"),
                }
            }
        }
    }
}

fn renderer_tokenizer(renderer: &PromptRenderer) -> Arc<Tokenizer> {
    Arc::clone(renderer.prompt_tokenizer().tokenizer())
}

/// Longer messages: up to ~600 fragments (a few kB) each.
fn long_text_strategy() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(FRAGMENTS), 0..600).prop_map(|parts| parts.concat())
}

/// Words drawn from a pool larger than one message, so later turns hit the word cache with
/// segments earlier turns put there, in new neighbourhoods.
fn prose_strategy() -> impl Strategy<Value = String> {
    const WORDS: &[&str] = &[
        "router",
        "the",
        "blocks",
        "prefix",
        "Überprüfung",
        "世界",
        "kv-events",
        "worker,",
        "cache.",
        "(index)",
        "  spaced",
        "tab\there",
        "line\nbreak",
        "<s>",
        "a</s>b",
        "▁mark",
        "x▁",
        "🙂",
        "42",
        "3.14",
        "don't",
        "—",
        "{\"k\": [1, 2]}",
        "end.\n\n",
    ];
    prop::collection::vec(prop::sample::select(WORDS), 0..1500).prop_map(|words| words.join(" "))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(6))]

    /// Long random conversations (tens of kB rendered), turn by turn through each fixture's
    /// renderer: every turn is prepared through the caches (so reuse chains through the turns,
    /// the word cache fills, and the message-local templates render only new messages), and the
    /// tokens and block hashes of the last turns and of a turn picked at random equal the full
    /// tokenization of the text the template renders whole, and its hashes.
    #[test]
    fn long_conversations_equal_full_tokenization(
        turns in prop::collection::vec(prop_oneof![long_text_strategy(), prose_strategy()], 4..14),
        system in prop::option::of(prose_strategy()),
        checked in 0usize..14,
    ) {
        let runtime = runtime();
        for renderer in renderers() {
            let tokenizer = renderer_tokenizer(&renderer);
            let mut messages = Vec::new();
            if let Some(system) = &system {
                messages.push(json!({"role": "system", "content": system}));
            }
            for (i, content) in turns.iter().enumerate() {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                messages.push(json!({"role": role, "content": content}));
                let request = json!({"model": "m", "messages": messages});
                let prepared = runtime.block_on(renderer.prepare(&request, &[16], None, None));
                if i + 2 < turns.len() && i != checked {
                    continue;
                }
                let Ok(Some(text)) = runtime.block_on(renderer.render_text(&request)) else {
                    continue;
                };
                let want = full(&tokenizer, &text);
                match prepared {
                    Ok(prepared) => {
                        prop_assert_eq!(&*prepared.tokens, want.as_slice(), "turn {}", i);
                        let plan = block_plan(&[16]).unwrap();
                        prop_assert_eq!(
                            prepared.hashes,
                            prompt_block_hashes(&want, &plan, None, None),
                            "turn {}", i
                        );
                    }
                    Err(error) => prop_assert!(false, "{error}"),
                }
            }
            let stats = renderer.token_cache_stats();
            prop_assert!(stats.bytes <= DEFAULT_CACHE_LIMITS.max_bytes, "{:?}", stats);
            prop_assert!(stats.word_bytes <= 2 * words::GENERATION_BYTES, "{:?}", stats);
        }
    }
}

#[test]
fn a_conversation_holds_one_entry_and_a_128k_token_one_is_cached() {
    let tokenizer = tinyllama_tokenizer();
    let cache = PromptTokenizer::new(Arc::clone(&tokenizer), DEFAULT_CACHE_LIMITS);
    // ~128k tokens of chat-like text, grown by turns: each turn continues the previous one,
    // whose entry it replaces.
    let paragraph = "The router reads kv-events from every worker, keeps a bounded radix index \
        of block hashes. Überprüfung der Latenz: 世界 — caches and queues all matter. ";
    let mut text = String::from("<s>[INST] You are a careful assistant. [/INST]");
    let mut turn = 0;
    let mut ids = Vec::new();
    while ids.len() < 131_072 {
        text.push_str(&format!(" Turn {turn}: {}</s>", paragraph.repeat(40)));
        ids = cache.tokenize(&text).unwrap();
        assert_eq!(
            cache.stats().entries,
            1,
            "turn {turn}: one entry per conversation"
        );
        turn += 1;
    }
    assert_eq!(ids, full(&tokenizer, &text));
    let stats = cache.stats();
    assert_eq!(stats.misses, 1, "{stats:?}");
    // Text + 4 bytes per token + 8 bytes per checkpoint (one per 128 bytes at most) + overhead.
    let bound = text.len() + 4 * ids.len() + 8 * (text.len() / CHECKPOINT_SPACING + 1) + 128;
    assert!(stats.bytes <= bound, "{stats:?} over {bound}");
    assert!(
        stats.bytes <= DEFAULT_CACHE_LIMITS.max_bytes / 4,
        "{stats:?}"
    );
    // A second conversation sharing only the start is a separate entry.
    let other = format!("{} Another conversation.", &text[..200]);
    assert_eq!(cache.tokenize(&other).unwrap(), full(&tokenizer, &other));
    assert_eq!(cache.stats().entries, 2);
}

#[test]
fn the_word_cache_stays_within_two_generations() {
    let words = words::WordCache::default();
    let mut inserted = 0;
    for round in 0..40 {
        let mut pending = words::Pending::default();
        for i in 0..2000 {
            pending.push(&format!(" word{round}x{i}"), &[1, 2, 3]);
            inserted += 1;
        }
        words.insert(pending);
        let (entries, bytes) = words.size();
        assert!(
            bytes <= 2 * words::GENERATION_BYTES,
            "{entries} entries, {bytes} bytes"
        );
        assert!(entries <= inserted);
    }
    // The newest words are held; the oldest were dropped.
    let view = words.read();
    assert_eq!(
        view.get(" word39x1999").map(|(ids, _)| ids.to_vec()),
        Some(vec![1, 2, 3])
    );
    assert!(view.get(" word0x0").is_none());
}

/// Templates whose earlier messages render differently once messages are appended (the count
/// up front, a marker on the last message): a follow-up shares only a short text prefix with
/// its previous turn, so the cache reuses little or nothing, and must still be exact.
fn non_prefix_stable_renderers() -> Vec<PromptRenderer> {
    const SHIFTING: &str = "{{ messages | length }} messages\n{% for m in messages %}\
        {% if loop.last %}<|im_start|>last {% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}";
    [tinyllama_tokenizer(), byte_level_tokenizer()]
        .into_iter()
        .map(|tokenizer| {
            let template = ChatTemplate::from_jinja(SHIFTING, SpecialTokens::default()).unwrap();
            PromptRenderer::new(tokenizer, Some(Arc::new(template)), RenderLimits::default())
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Random conversations turn by turn through one renderer per template and tokenizer (the
    /// fixtures' own templates, the Qwen-style rich one, and a template that is not prefix
    /// stable), with one or two block sizes and a LoRA name / cache salt that changes at a
    /// random turn: every turn's ids and block hashes equal the full path's (`encode_fast` of
    /// the rendered text, `prompt_block_hashes` of those ids), whatever the cache reused.
    #[test]
    fn follow_up_turns_equal_the_full_path_ids_and_hashes(
        turns in prop::collection::vec(text_strategy(), 1..8),
        system in prop::option::of(text_strategy()),
        sizes in prop::sample::select(vec![vec![16u32], vec![16, 64], vec![64, 17]]),
        switch in 0usize..10,
        before in prop::option::of(prop::sample::select(vec!["lora-a", ""])),
        after in prop::option::of(prop::sample::select(vec!["lora-b", "salt"])),
    ) {
        let runtime = runtime();
        let plan = block_plan(&sizes).unwrap();
        for renderer in renderers().into_iter().chain(non_prefix_stable_renderers()) {
            let tokenizer = renderer_tokenizer(&renderer);
            let mut messages = Vec::new();
            if let Some(system) = &system {
                messages.push(json!({"role": "system", "content": system}));
            }
            for (i, content) in turns.iter().enumerate() {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                messages.push(json!({"role": role, "content": content}));
                let request = json!({"model": "m", "messages": messages});
                let (lora, salt) = if i < switch { (before, None) } else { (None, after) };
                let prepared = runtime.block_on(renderer.prepare(&request, &sizes, lora, salt));
                let Ok(Some(text)) = runtime.block_on(renderer.render_text(&request)) else {
                    prop_assert!(prepared.is_err(), "turn {}", i);
                    continue;
                };
                let want = full(&tokenizer, &text);
                let prepared = prepared.map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(&*prepared.tokens, want.as_slice(), "turn {}", i);
                prop_assert_eq!(
                    &prepared.hashes,
                    &prompt_block_hashes(&want, &plan, lora, salt),
                    "turn {}", i
                );
            }
        }
    }
}

/// A conversation through TinyLlama's own template (message-local): every follow-up renders
/// only its new messages after the cached turn, one turn is held, and the ids and hashes equal
/// the full path's (the template rendered whole, `encode_fast`, `prompt_block_hashes`).
#[test]
fn follow_ups_of_a_local_template_render_only_new_messages() {
    let runtime = runtime();
    let renderer = renderers().remove(0);
    let tokenizer = renderer_tokenizer(&renderer);
    let plan = block_plan(&[16, 64]).unwrap();
    let mut messages = vec![json!({"role": "system", "content": "You are careful."})];
    for turn in 0..8 {
        let role = if turn % 2 == 0 { "user" } else { "assistant" };
        messages.push(json!({"role": role, "content": format!("Turn {turn}: {}", "the router credits prefix blocks. ".repeat(turn + 1))}));
        let request = json!({"model": "m", "messages": messages});
        let prepared = runtime
            .block_on(renderer.prepare(&request, &[16, 64], None, Some("salt")))
            .unwrap();
        let text = runtime
            .block_on(renderer.render_text(&request))
            .unwrap()
            .unwrap();
        let want = full(&tokenizer, &text);
        assert_eq!(&*prepared.tokens, want.as_slice(), "turn {turn}");
        assert_eq!(
            prepared.hashes,
            prompt_block_hashes(&want, &plan, None, Some("salt")),
            "turn {turn}"
        );
    }
    let stats = renderer.conversation_stats();
    assert_eq!(
        (stats.hits, stats.misses, stats.entries),
        (7, 1, 1),
        "{stats:?}"
    );
    // Another tool list is another input: rendered whole, a second turn held.
    let request = json!({"model": "m", "messages": messages, "chat_template_kwargs": {"x": 1}});
    runtime
        .block_on(renderer.prepare(&request, &[16], None, None))
        .unwrap();
    let stats = renderer.conversation_stats();
    assert_eq!(
        (stats.hits, stats.misses, stats.entries),
        (7, 2, 2),
        "{stats:?}"
    );
}

#[test]
fn the_conversation_cache_stays_within_its_limits_and_counts_evictions() {
    let runtime = runtime();
    let limits = CacheLimits {
        max_entries: 3,
        max_bytes: 64 * 1024,
    };
    let renderer = renderers().remove(0).with_cache_limits(limits);
    for i in 0..10 {
        let request = json!({"model": "m", "messages": [
            {"role": "user", "content": format!("conversation {i} {}", "words ".repeat(50))}]});
        runtime
            .block_on(renderer.prepare(&request, &[16], None, None))
            .unwrap();
        let stats = renderer.conversation_stats();
        assert!(
            stats.entries <= 3 && stats.bytes <= limits.max_bytes,
            "{stats:?}"
        );
    }
    // Ten conversations through three places: seven evicted, each counted.
    let stats = renderer.conversation_stats();
    assert_eq!((stats.misses, stats.evictions), (10, 7), "{stats:?}");
}
