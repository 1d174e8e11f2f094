//! The Anthropic Messages and Responses ingresses against real NVIDIA Dynamo 1.6.1
//! (`dynamo-e2e`): the official `anthropic` and `openai` SDKs (`CONTINUUM_PYTHON`, script
//! `tests/fixtures/ingress/drive_sdks.py`) send buffered and streamed requests through the router
//! to a real `dynamo.frontend --router-mode direct` over mocker prefill and decode workers. The
//! frontend refuses a disaggregated request that lacks either pin, so every parsed answer is a
//! pin pair it honoured; its log names the workers our picker chose. A client pin naming an
//! unknown worker (sent by the script) never reaches it. Then `responses_api: native` sends
//! `/v1/responses` to the frontend's own Responses route, pinned by model alone.
#![cfg(feature = "dynamo-e2e")]

use std::collections::BTreeSet;
use std::time::Duration;

use crate::support::dynamo::{DynamoStack, MODEL, Topology};

fn config_yaml(stack: &DynamoStack, native: bool) -> String {
    format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\n\
         disaggregated_serving:\n  enabled: true\n  fallback_to_unified: false\n\
         backends:\n  - name: dynamo-frontend\n    type: openai\n    url: \"{frontend}\"\n    \
         role: unified\n    models: [\"{MODEL}\"]\n    responses_api: {api}\n    \
         health_check:\n      enabled: false\n\
         dynamo:\n  enabled: true\n  discovery:\n    etcd:\n      endpoints: [\"{etcd}\"]\n      \
         namespace: \"{ns}\"\n  load:\n    direct_allow_cidrs: [\"127.0.0.0/8\"]\n  \
         shim:\n    backends: [dynamo-frontend]\n",
        frontend = stack.frontend_url(),
        etcd = stack.etcd_endpoint(),
        ns = stack.namespace(),
        api = if native { "native" } else { "converted" },
    )
}

async fn drive(base: &str, scenario: &str) {
    let python = std::env::var("CONTINUUM_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/ingress/drive_sdks.py"
    );
    let run = tokio::process::Command::new(&python)
        .args([script, base, scenario])
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(300), run)
        .await
        .expect("the SDK script finishes within 300 s")
        .unwrap_or_else(|e| panic!("starting {python} (set CONTINUUM_PYTHON): {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.trim_end().ends_with("OK"),
        "{scenario} failed (needs anthropic + openai in {python}):\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Worker ids the frontend's log says it selected in direct mode.
fn selected_in_log(stack: &DynamoStack) -> Vec<u64> {
    let log =
        strip_ansi(&std::fs::read_to_string(stack.log_dir().join("frontend.log")).expect("log"));
    log.lines()
        .filter(|l| l.contains("Selected worker") && l.contains("router_mode=\"direct\""))
        .filter_map(|l| {
            l.split("worker_id=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

fn count(daemon: &continuum_router::daemon::Daemon, family: &str, labels: &[(&str, &str)]) -> f64 {
    daemon.metrics().value(family, labels).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdks_are_served_by_the_real_frontend_with_our_pins() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let stack = DynamoStack::start(Topology::Disagg).await;
    let known: BTreeSet<u64> = stack.workers().iter().map(|w| w.instance_id).collect();

    let daemon = crate::support::daemon::start(&config_yaml(&stack, false)).await;
    crate::support::daemon::wait_for_workers(&daemon, 2).await;
    let before = selected_in_log(&stack).len();
    drive(&format!("http://{}", daemon.local_addr()), "dynamo").await;
    // 3 x (buffered + streamed) on each ingress, all disaggregated with a pin pair.
    assert_eq!(
        count(
            &daemon,
            "disaggregated_requests_total",
            &[("routing_path", "disaggregated")]
        ),
        12.0
    );
    for route in ["messages", "responses"] {
        assert_eq!(
            count(
                &daemon,
                "continuum_http_requests_total",
                &[("route", route), ("status_class", "2xx")]
            ),
            6.0,
            "{route}"
        );
    }
    let selected = selected_in_log(&stack);
    assert!(
        selected.len() >= before + 12,
        "the frontend logged a direct-mode selection per request: {} new",
        selected.len() - before
    );
    let distinct: BTreeSet<u64> = selected.iter().copied().collect();
    assert!(
        distinct.is_subset(&known),
        "only real workers: {distinct:?}"
    );
    assert_eq!(distinct.len(), 2, "prefill and decode were pinned");
    daemon.shutdown().await;

    // Native /v1/responses: the frontend's own Responses route, pinned by model alone.
    let daemon = crate::support::daemon::start(&config_yaml(&stack, true)).await;
    crate::support::daemon::wait_for_workers(&daemon, 2).await;
    let before = selected_in_log(&stack).len();
    drive(&format!("http://{}", daemon.local_addr()), "dynamo-native").await;
    assert_eq!(
        count(
            &daemon,
            "disaggregated_requests_total",
            &[("routing_path", "disaggregated")]
        ),
        1.0
    );
    assert!(selected_in_log(&stack).len() > before);
    daemon.shutdown().await;
}

const WORDS: [&str; 31] = [
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "what", "is",
    "capital", "of", "france", "please", "tell", "me", "a", "story", "about", "router", "that",
    "routes", "requests", "to", "workers", "prefill", "decode", "cache", "block",
];

/// `n` words the mocker's tiny tokenizer was trained on, from a seeded xorshift.
fn words(seed: u64, n: usize) -> String {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            WORDS[(state % WORDS.len() as u64) as usize]
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn blake3_pin(path: &std::path::Path) -> String {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    format!("blake3:{}", blake3::hash(&bytes).to_hex())
}

/// KV-aware selection with `global_prompts` + `requires_single_leading_system` on the replica;
/// the frontend tokenizes the prompt itself (no `nvext.token_data`), so every parity prediction
/// compares our rendering of the rewritten conversation with what the worker stored.
fn kv_yaml(stack: &DynamoStack, cache: &std::path::Path) -> String {
    let pins = [
        blake3_pin(&stack.model_dir().join("tokenizer.json")),
        blake3_pin(&stack.model_dir().join("tokenizer_config.json")),
    ];
    format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\n\
         disaggregated_serving:\n  enabled: true\n  fallback_to_unified: false\n\
         backends:\n  - name: dynamo-frontend\n    type: openai\n    url: \"{frontend}\"\n    \
         models: [\"{MODEL}\"]\n    global_prompts: [\"{global}\"]\n    \
         requires_single_leading_system: true\n    health_check:\n      enabled: false\n\
         dynamo:\n  enabled: true\n  discovery:\n    etcd:\n      endpoints: [\"{etcd}\"]\n      \
         namespace: \"{ns}\"\n  load:\n    direct_allow_cidrs: [\"127.0.0.0/8\"]\n  \
         shim:\n    backends: [dynamo-frontend]\n  kv:\n    enabled: true\n    \
         pinned_artifacts: [\"{p0}\", \"{p1}\"]\n    artifact_cache_dir: \"{cache}\"\n",
        frontend = stack.frontend_url(),
        etcd = stack.etcd_endpoint(),
        ns = stack.namespace(),
        global = words(7, 120),
        p0 = pins[0],
        p1 = pins[1],
        cache = cache.display(),
    )
}

/// Hash parity on the Messages and Responses paths: multi-turn conversations alternate between
/// the two ingresses; each prediction of the blocks the chosen worker will store (made from our
/// rendering of the rewritten prompt) is checked against what the real mocker stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_hash_parity_holds_on_both_ingresses_with_global_prompts() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let stack = DynamoStack::start(Topology::Agg).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon =
        crate::support::daemon::start(&kv_yaml(&stack, &dir.path().join("artifacts"))).await;
    crate::support::daemon::wait_for_workers(&daemon, 2).await;
    let value = |family: &str, labels: &[(&str, &str)]| count(&daemon, family, labels);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    while value(
        "continuum_dynamo_kv_artifacts_total",
        &[("result", "loaded")],
    ) < 1.0
        || value(
            "continuum_dynamo_kv_subscriptions",
            &[("state", "connected"), ("transport", "direct")],
        ) < 2.0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "tokenizer loaded, kv-events subscribed"
        );
        tick.tick().await;
    }
    let client = reqwest::Client::new();
    let base = format!("http://{}", daemon.local_addr());
    let system = words(11, 60);
    for conversation in 0..2u64 {
        let mut history: Vec<serde_json::Value> = Vec::new();
        for turn in 0..3u64 {
            let text = words(100 + conversation * 10 + turn, 50);
            history.push(serde_json::json!({ "role": "user", "content": text }));
            let (path, body) = if turn % 2 == conversation % 2 {
                (
                    "/v1/messages",
                    serde_json::json!({ "model": MODEL, "max_tokens": 8,
                    "system": system, "messages": history }),
                )
            } else {
                (
                    "/v1/responses",
                    serde_json::json!({ "model": MODEL, "max_output_tokens": 8,
                    "instructions": system, "input": history }),
                )
            };
            let resp = client
                .post(format!("{base}{path}"))
                .json(&body)
                .send()
                .await
                .expect("send");
            assert_eq!(
                resp.status(),
                200,
                "{path} conversation {conversation} turn {turn}"
            );
            let answer: serde_json::Value = resp.json().await.expect("json");
            let reply = if path == "/v1/messages" {
                answer["content"][0]["text"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned()
            } else {
                answer["output"][0]["content"][0]["text"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned()
            };
            history.push(serde_json::json!({ "role": "assistant", "content": reply }));
            let index = daemon.kv_index();
            while index.parity_pending() > 0 {
                assert!(
                    tokio::time::Instant::now() < deadline + Duration::from_secs(60),
                    "parity predictions decided"
                );
                tick.tick().await;
            }
        }
    }
    let parity = |result: &str| {
        value(
            "continuum_dynamo_kv_hash_parity_total",
            &[("model", MODEL), ("result", result)],
        )
    };
    println!(
        "ingress kv parity: match={} mismatch={} overlap selections={}",
        parity("match"),
        parity("mismatch"),
        value(
            "continuum_dynamo_kv_selection_total",
            &[("result", "overlap")]
        )
    );
    assert!(parity("match") > 0.0, "parity predictions were checked");
    assert_eq!(
        parity("mismatch"),
        0.0,
        "our rendering matches what the workers stored"
    );
    assert!(
        value(
            "continuum_dynamo_kv_selection_total",
            &[("result", "overlap")]
        ) > 0.0,
        "later turns found their history in the index"
    );
    daemon.shutdown().await;
}

/// The frontend colours its log even with NO_COLOR; drop `ESC [ ... m` sequences.
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for next in chars.by_ref() {
                if next.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
