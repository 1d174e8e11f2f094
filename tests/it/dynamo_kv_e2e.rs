//! The KV-aware pipeline end to end against real NVIDIA Dynamo 1.6.1: two aggregated
//! `dynamo.mocker` workers with kv-events on, a real `dynamo.frontend --router-mode direct`.
//!
//! * `stored_blocks_of_real_workers_reach_the_index`: with `dynamo.kv.enabled`, the daemon
//!   subscribes to every mocker's kv-events publisher; the blocks requests make the workers store
//!   land in the index as `applied`.
//! * `kv_aware_routing_reuses_more_prefix_than_load_based` (issue #7 item 7): the tokenizer and
//!   chat template come from the worker cards (local paths, blake3-pinned by the test), the same
//!   multi-turn workload runs load-based (`kv.enabled: false`) and then KV-aware after a hot
//!   reload, and prefix reuse is measured by the mockers themselves: the frontend returns their
//!   prefix-cache hits as `usage.prompt_tokens_details.cached_tokens`. The worker each request
//!   ran on is read from the mockers' logs (they log the request id the answer carries). A third
//!   phase reloads `kv.send_token_data: true`: the frontend then serves the router's rendered
//!   tokens without tokenizing (its log's "no token_data; tokenizing prompt" warning stops).
//!
//! What the first real run showed:
//! * Rendering, tokenizing and XXH3 block hashing agree with what the mocker stores: every parity
//!   prediction matched `tokens_hash` (block size 16 from the cards), so no hashing fix was needed.
//! * With one shared system prompt and requests one at a time, the formula sends every request to
//!   the worker that first stored the prompt (overlap wins and nothing is in flight). Upstream's
//!   formula does the same; the workload therefore has two tenants (two system prompts that
//!   differ from the first block) so the assertion can see conversations spread and stick.
//! * Bug found and fixed: turning `kv.enabled` on restarts the subscriptions, which drops every
//!   load sample (missed-messages rule); an idle, change-driven mocker then publishes nothing new,
//!   so the dispatch ledger never saw the sample that had answered its last pinned request and
//!   kept it as backlog for the ledger's 30 s, pushing all KV-aware traffic to the other worker.
//!   `LoadStore::last_heard` now keeps when each worker was last heard from across drops, and the
//!   shim answers the ledger from it.
//! * Measured on the 2-core dev box (5 conversations x 4 turns, 2 tenants): load-based reuse
//!   0.55 (conversations alternate workers), KV-aware 0.74 (each conversation sticks to one
//!   worker), 18 `overlap` selections of 20, parity 20/20 `match`; with `nvext.token_data`
//!   the same 0.74 and 20/20, and the frontend tokenized none of those requests itself.
#![cfg(feature = "dynamo-e2e")]

use crate::support;

use std::path::Path;
use std::time::Duration;

use serde_json::json;
use support::dynamo::{DynamoStack, MODEL, Topology};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_blocks_of_real_workers_reach_the_index() {
    let stack = DynamoStack::start(Topology::Agg).await;
    let yaml = format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\n\
         disaggregated_serving:\n  enabled: true\n  fallback_to_unified: false\n\
         backends:\n  - name: dynamo-frontend\n    type: openai\n    url: \"{frontend}\"\n    \
         models: [\"{MODEL}\"]\n    health_check:\n      enabled: false\n\
         dynamo:\n  enabled: true\n  discovery:\n    etcd:\n      endpoints: [\"{etcd}\"]\n      \
         namespace: \"{ns}\"\n  load:\n    direct_allow_cidrs: [\"127.0.0.0/8\"]\n  \
         shim:\n    backends: [dynamo-frontend]\n  kv:\n    enabled: true\n",
        frontend = stack.frontend_url(),
        etcd = stack.etcd_endpoint(),
        ns = stack.namespace(),
    );
    let daemon = support::daemon::start(&yaml).await;
    support::daemon::wait_for_workers(&daemon, 2).await;
    let metrics = daemon.metrics().clone();
    let connected = |m: &continuum_actors::metrics::Metrics| {
        m.value(
            "continuum_dynamo_kv_subscriptions",
            &[("state", "connected"), ("transport", "direct")],
        )
        .unwrap_or(0.0)
    };
    let mut changes = daemon.load_store().subscribe();
    tokio::time::timeout(Duration::from_secs(30), async {
        while connected(&metrics) < 2.0 {
            changes.changed().await.expect("store alive");
        }
    })
    .await
    .expect("both kv-events subscriptions connected");

    let url = format!("http://{}/v1/chat/completions", daemon.local_addr());
    let client = reqwest::Client::new();
    let prefix = "You are a careful assistant. ".repeat(40);
    for i in 0..20 {
        let body = json!({"model": MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": format!("{prefix} question {i}")}]});
        let resp = client.post(&url).json(&body).send().await.expect("send");
        assert_eq!(resp.status(), 200);
    }
    let applied = |m: &continuum_actors::metrics::Metrics| {
        m.value("continuum_dynamo_kv_events_total", &[("result", "applied")])
            .unwrap_or(0.0)
    };
    // kv-events and kv_metrics changes travel together; wake on the load store's changes.
    tokio::time::timeout(Duration::from_secs(30), async {
        while applied(&metrics) < 1.0 || daemon.kv_index().stats().nodes == 0 {
            changes.changed().await.expect("store alive");
        }
    })
    .await
    .expect("stored events applied to the index");
    let stats = daemon.kv_index().stats();
    assert!(stats.nodes > 0 && stats.ranks >= 1, "{stats:?}");
    let malformed = metrics
        .value(
            "continuum_dynamo_kv_events_total",
            &[("result", "malformed")],
        )
        .unwrap_or(0.0);
    assert_eq!(malformed, 0.0, "every real batch decodes");
    daemon.shutdown().await;
}

/// Conversations per phase. Odd on purpose: with an even count and two workers, a plain rotation
/// would send every turn of a conversation to the same worker and hide the difference.
const CONVERSATIONS: usize = 5;
/// Turns per conversation; each resends the whole history.
const TURNS: usize = 4;
/// System prompts per phase: conversation `c` belongs to tenant `c % TENANTS`.
const TENANTS: usize = 2;
/// Words of each tenant's shared system prompt (about one token each: the tiny model's BPE was
/// trained on these words), i.e. about 20 blocks of 16 tokens.
const SYSTEM_WORDS: usize = 300;
/// Words of each user turn (about 6 blocks).
const TURN_WORDS: usize = 90;
const ADMIN_TOKEN: &str = "kv-e2e-admin";

/// Words the tiny tokenizer was trained on (scripts/make_tiny_model.py), so prompts stay short
/// in tokens yet differ between conversations.
const WORDS: [&str; 31] = [
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "what", "is",
    "capital", "of", "france", "please", "tell", "me", "a", "story", "about", "router", "that",
    "routes", "requests", "to", "workers", "prefill", "decode", "cache", "block",
];

/// `n` words from a seeded xorshift: deterministic text, distinct per seed.
fn words(seed: u64, n: usize) -> String {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.push(WORDS[(state % WORDS.len() as u64) as usize]);
    }
    out.join(" ")
}

/// The router's config: KV-aware selection on or off, and whether the rendered tokens travel to
/// the frontend as `nvext.token_data`.
fn kv_yaml(
    stack: &DynamoStack,
    kv_enabled: bool,
    send_token_data: bool,
    pins: &[String],
    cache: &Path,
) -> String {
    let pins = pins
        .iter()
        .map(|p| format!("\"{p}\""))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\n\
         admin:\n  enabled: true\n  token: \"{ADMIN_TOKEN}\"\n\
         disaggregated_serving:\n  enabled: true\n  fallback_to_unified: false\n\
         backends:\n  - name: dynamo-frontend\n    type: openai\n    url: \"{frontend}\"\n    \
         models: [\"{MODEL}\"]\n    health_check:\n      enabled: false\n\
         dynamo:\n  enabled: true\n  discovery:\n    etcd:\n      endpoints: [\"{etcd}\"]\n      \
         namespace: \"{ns}\"\n  load:\n    direct_allow_cidrs: [\"127.0.0.0/8\"]\n  \
         shim:\n    backends: [dynamo-frontend]\n  kv:\n    enabled: {kv_enabled}\n    \
         send_token_data: {send_token_data}\n    \
         pinned_artifacts: [{pins}]\n    artifact_cache_dir: \"{cache}\"\n",
        frontend = stack.frontend_url(),
        etcd = stack.etcd_endpoint(),
        ns = stack.namespace(),
        cache = cache.display(),
    )
}

/// `blake3:<hex>` of a file, as a worker card names it.
fn blake3_pin(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    format!("blake3:{}", blake3::hash(&bytes).to_hex())
}

/// Polls `done` every 20 ms until it holds; panics with `what` after `limit`.
async fn poll_until(limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + limit;
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    loop {
        tick.tick().await;
        if done() {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
    }
}

/// What one phase of the workload measured: the workers' own prefix-cache hits and where each
/// request ran.
#[derive(Debug, Default)]
struct Reuse {
    requests: u64,
    prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`: the mocker's own prefix-cache hits.
    cached_tokens: u64,
    /// Per conversation, the request id of each turn (the mocker logs it as `request_id`).
    request_ids: Vec<Vec<String>>,
}

impl Reuse {
    fn ratio(&self) -> f64 {
        self.cached_tokens as f64 / self.prompt_tokens.max(1) as f64
    }

    /// Per conversation, the index (in start order) of the worker each turn ran on, read from
    /// the workers' logs; `?` when no log names the request.
    fn placements(&self, stack: &DynamoStack) -> Vec<String> {
        let logs: Vec<String> = stack
            .workers()
            .iter()
            .map(|w| std::fs::read_to_string(&w.log).unwrap_or_default())
            .collect();
        self.request_ids
            .iter()
            .map(|ids| {
                ids.iter()
                    .map(|id| {
                        let needle = id.as_str();
                        logs.iter()
                            .position(|log| !id.is_empty() && log.contains(needle))
                            .map_or('?', |i| char::from(b'0' + i as u8))
                    })
                    .collect()
            })
            .collect()
    }
}

/// Pinned requests the frontend tokenized itself (no `nvext.token_data`), from its log.
fn frontend_retokenizations(stack: &DynamoStack) -> usize {
    std::fs::read_to_string(stack.log_dir().join("frontend.log"))
        .unwrap_or_default()
        .matches("no token_data; tokenizing prompt")
        .count()
}

/// Runs the multi-turn workload (phase `tag` gives it text of its own) through the router:
/// [`CONVERSATIONS`] conversations of [`TURNS`] turns, interleaved turn by turn, each resending
/// its history after one of [`TENANTS`] long system prompts. With `sync_parity`, each response
/// waits until the daemon's parity predictions are decided (the worker's stored blocks reached
/// the index), so the next decision sees what the last request stored.
async fn run_workload(
    daemon: &continuum_router::daemon::Daemon,
    tag: u64,
    sync_parity: bool,
) -> Reuse {
    let url = format!("http://{}/v1/chat/completions", daemon.local_addr());
    let client = reqwest::Client::new();
    let systems: Vec<String> = (0..TENANTS as u64)
        .map(|t| {
            // Tenant-specific words first: the tenants' prompts differ from the first block.
            format!(
                "{} (phase {tag} tenant {t} system prompt)",
                words(tag * 1000 + 100 * t, SYSTEM_WORDS)
            )
        })
        .collect();
    let mut histories: Vec<Vec<serde_json::Value>> = (0..CONVERSATIONS)
        .map(|c| vec![json!({"role": "system", "content": systems[c % TENANTS]})])
        .collect();
    let mut reuse = Reuse {
        request_ids: vec![Vec::new(); CONVERSATIONS],
        ..Reuse::default()
    };
    for turn in 0..TURNS {
        for (c, history) in histories.iter_mut().enumerate() {
            let seed = tag * 1000 + 500 + (c * TURNS + turn) as u64;
            history.push(json!({"role": "user",
                "content": format!("conversation {c} turn {turn}: {}", words(seed, TURN_WORDS))}));
            let body = json!({"model": MODEL, "max_tokens": 8, "messages": history});
            let resp = client.post(&url).json(&body).send().await.expect("send");
            assert_eq!(resp.status(), 200, "conversation {c} turn {turn}");
            let answer: serde_json::Value = resp.json().await.expect("json answer");
            let usage = &answer["usage"];
            reuse.requests += 1;
            reuse.prompt_tokens += usage["prompt_tokens"].as_u64().expect("prompt_tokens");
            reuse.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
            let id = answer["id"].as_str().unwrap_or_default();
            reuse.request_ids[c].push(id.trim_start_matches("chatcmpl-").to_owned());
            let content = answer["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            history.push(json!({"role": "assistant", "content": content}));
            if sync_parity {
                let index = daemon.kv_index();
                poll_until(
                    Duration::from_secs(10),
                    "parity predictions decided",
                    || index.parity_pending() == 0,
                )
                .await;
            }
        }
    }
    reuse
}

/// issue #7 item 7: the same multi-turn workload, routed load-based and then KV-aware (a hot
/// reload of `dynamo.kv.enabled` in between), on two real aggregated mockers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_aware_routing_reuses_more_prefix_than_load_based() {
    let stack = DynamoStack::start(Topology::Agg).await;
    let pins = vec![
        blake3_pin(&stack.model_dir().join("tokenizer.json")),
        blake3_pin(&stack.model_dir().join("tokenizer_config.json")),
    ];
    let dir = tempfile::tempdir().expect("tempdir");
    let cache = dir.path().join("artifacts");
    let config = dir.path().join("router.yaml");
    std::fs::write(&config, kv_yaml(&stack, false, false, &pins, &cache)).expect("write config");
    let daemon = support::daemon::start_file(&config).await;
    support::daemon::wait_for_workers(&daemon, 2).await;
    let metrics = daemon.metrics().clone();
    let value =
        |family: &str, labels: &[(&str, &str)]| metrics.value(family, labels).unwrap_or(0.0);

    // Phase 1: load-based (kv off).
    let load_based = run_workload(&daemon, 1, false).await;
    assert_eq!(
        value(
            "continuum_dynamo_kv_selection_total",
            &[("result", "overlap")]
        ),
        0.0
    );

    // Phase 2: KV-aware, after a hot reload; fresh text so phase 1's cache contents do not help.
    std::fs::write(&config, kv_yaml(&stack, true, false, &pins, &cache)).expect("write config");
    daemon.reload().await.expect("reload applies");
    poll_until(
        Duration::from_secs(30),
        "kv-events subscribed and tokenizer loaded",
        || {
            value(
                "continuum_dynamo_kv_subscriptions",
                &[("state", "connected"), ("transport", "direct")],
            ) >= 2.0
                && value(
                    "continuum_dynamo_kv_artifacts_total",
                    &[("result", "loaded")],
                ) >= 1.0
        },
    )
    .await;
    let kv_aware = run_workload(&daemon, 2, true).await;

    // Phase 3: KV-aware with the rendered tokens sent as `nvext.token_data`; the frontend then
    // skips its own tokenization (it warns once per pinned request that lacks token_data).
    let retokenized = || frontend_retokenizations(&stack);
    let before = retokenized();
    std::fs::write(&config, kv_yaml(&stack, true, true, &pins, &cache)).expect("write config");
    daemon.reload().await.expect("reload applies");
    let with_tokens = run_workload(&daemon, 3, true).await;
    let retokenized_with_tokens = retokenized() - before;

    let selections =
        |result: &str| value("continuum_dynamo_kv_selection_total", &[("result", result)]);
    let kv_aware_selections: f64 = ["prefill", "decode"]
        .iter()
        .map(|role| {
            value(
                "continuum_dynamo_selection_total",
                &[("role", role), ("reason", "kv_aware")],
            )
        })
        .sum();
    let view: serde_json::Value = reqwest::Client::new()
        .get(format!(
            "http://{}/admin/dynamo/workers",
            daemon.local_addr()
        ))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .expect("admin view")
        .json()
        .await
        .expect("json view");
    let parity = &view["kv_hash_parity"][MODEL];
    let checked = parity["checked"].as_u64().unwrap_or(0);
    let matched = parity["matched"].as_u64().unwrap_or(0);
    let parity_metric = |result: &str| {
        value(
            "continuum_dynamo_kv_hash_parity_total",
            &[("model", MODEL), ("result", result)],
        )
    };
    println!(
        "kv e2e: with nvext.token_data reuse {:.3} ({}/{}), placements {:?}; frontend \
         tokenized {before} earlier pinned requests itself and {retokenized_with_tokens} of these",
        with_tokens.ratio(),
        with_tokens.cached_tokens,
        with_tokens.prompt_tokens,
        with_tokens.placements(&stack)
    );
    println!(
        "kv e2e: worker per turn, one string per conversation: load-based {:?}, KV-aware {:?}",
        load_based.placements(&stack),
        kv_aware.placements(&stack)
    );
    println!(
        "kv e2e: load-based reuse {:.3} ({}/{} prompt tokens cached over {} requests); \
         KV-aware reuse {:.3} ({}/{} over {}); kv selections overlap={} no_overlap={} \
         tokenizer_unavailable={} render_unavailable={}; selection kv_aware={}; \
         parity checked={checked} matched={matched} (metric match={} mismatch={})",
        load_based.ratio(),
        load_based.cached_tokens,
        load_based.prompt_tokens,
        load_based.requests,
        kv_aware.ratio(),
        kv_aware.cached_tokens,
        kv_aware.prompt_tokens,
        kv_aware.requests,
        selections("overlap"),
        selections("no_overlap"),
        selections("tokenizer_unavailable"),
        selections("render_unavailable"),
        kv_aware_selections,
        parity_metric("match"),
        parity_metric("mismatch"),
    );
    assert!(selections("overlap") > 0.0, "KV-aware picks saw overlap");
    // Each conversation stays with the worker holding its history, and the tenants' prompts
    // spread the conversations over both workers.
    let placements = kv_aware.placements(&stack);
    for (c, turns) in placements.iter().enumerate() {
        let first = turns.chars().next().expect("a turn");
        assert!(
            first != '?' && turns.chars().all(|w| w == first),
            "conversation {c} stayed on one worker under KV-aware routing: {placements:?}"
        );
    }
    assert!(
        placements.iter().any(|p| p.starts_with('0'))
            && placements.iter().any(|p| p.starts_with('1')),
        "KV-aware routing used both workers: {placements:?}"
    );
    assert!(kv_aware_selections > 0.0);
    assert!(
        kv_aware.ratio() > load_based.ratio(),
        "KV-aware reuse {:.3} must beat load-based {:.3}",
        kv_aware.ratio(),
        load_based.ratio()
    );
    assert!(before > 0, "the frontend log names requests it tokenized");
    assert_eq!(
        retokenized_with_tokens, 0,
        "the frontend used the router's token_data"
    );
    assert!(
        with_tokens.ratio() > load_based.ratio(),
        "KV-aware with token_data {:.3}",
        with_tokens.ratio()
    );
    assert!(checked > 0, "parity checked some predictions: {view}");
    assert_eq!(
        matched, checked,
        "every checked prediction matched: {parity}"
    );
    daemon.shutdown().await;
}
