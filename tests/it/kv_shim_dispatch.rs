//! KV-aware selection through the daemon's shim path, against a real etcd holding synthetic
//! Dynamo worker records, a pre-populated KV index, a deterministic test-only prompt preparation
//! hook (whitespace "tokenizer") and loopback stand-ins for the direct-mode frontend and a unified
//! backend: overlap decides the worker, rendered tokens ride as `nvext.token_data` (client copies
//! never do, nor fallback copies), `dynamo.kv` fields hot-reload by switching pickers, and a
//! conditional-disaggregation bypass sends only the worker pin on the unified path.
#![cfg(feature = "real-peers")]

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use continuum_router::config::Config;
use continuum_router::daemon::{Daemon, RunOptions};
use etcd_client::{Client, PutOptions};
use serde_json::{Value, json};
use support::etcd::EtcdServer;
use support::kv_prep::{WhitespacePrep, index_blocks, text_hashes, tokens_of};
use support::upstream::{FakeUpstream, Reply, completion};
use tokio::net::TcpListener;

const NS: &str = "kvtest";
/// 40 words: two complete blocks of 16 tokens.
const PROMPT: &str = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi \
    omicron pi rho sigma tau upsilon phi chi psi omega one two three four five six seven eight \
    nine ten eleven twelve thirteen fourteen fifteen sixteen";

/// Registers one worker under its own lease and returns its instance id (the lease id).
async fn put_worker(client: &mut Client, component: &str, worker_type: &str) -> u64 {
    let lease = client.lease_grant(120, None).await.expect("lease").id();
    let id = lease as u64;
    let runtime = json!({"total_kv_blocks": 1024, "max_num_batched_tokens": 8192});
    let endpoint = json!({"type": "Endpoint", "namespace": NS, "component": component,
        "endpoint": "generate", "instance_id": id, "transport": {"tcp": "127.0.0.1:1/x"}});
    let card = json!({"type": "Model", "namespace": NS, "component": component,
        "endpoint": "generate", "instance_id": id, "card_json": {"display_name": "tiny",
        "worker_type": worker_type, "kv_cache_block_size": 16, "runtime_config": runtime}});
    for (key, value) in [
        (
            format!("v1/instances/{NS}/{component}/generate/{id:x}"),
            endpoint,
        ),
        (format!("v1/mdc/{NS}/{component}/generate/{id:x}"), card),
    ] {
        client
            .put(
                key,
                serde_json::to_vec(&value).expect("json"),
                Some(PutOptions::new().with_lease(lease)),
            )
            .await
            .expect("put");
    }
    id
}

fn yaml(etcd: &EtcdServer, shim: &FakeUpstream, unified: &FakeUpstream, kv: &str) -> String {
    format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\n\
         disaggregated_serving:\n  enabled: true\n  fallback_to_unified: true\n\
         backends:\n  - name: shim\n    type: openai\n    url: \"{}\"\n    models: [tiny]\n    \
         health_check:\n      enabled: false\n  - name: unified\n    type: openai\n    url: \"{}\"\n    \
         models: [tiny]\n    health_check:\n      enabled: false\n\
         dynamo:\n  enabled: true\n  discovery:\n    etcd:\n      endpoints: [\"{}\"]\n      \
         namespace: {NS}\n  shim:\n    backends: [shim]\n  kv:\n{kv}",
        shim.url(),
        unified.url(),
        etcd.endpoint()
    )
}

async fn start(text: &str, dir: &tempfile::TempDir) -> Daemon {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let path = dir.path().join("router.yaml");
    std::fs::write(&path, text).expect("write config");
    let config = Config::load(&path).expect("valid config").config;
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let daemon = Daemon::start(
        RunOptions {
            config,
            config_path: Some(path),
            demo: false,
        },
        listener,
    )
    .await
    .expect("daemon starts");
    daemon
        .shim()
        .expect("the shim path is installed")
        .set_kv_prep(Arc::new(WhitespacePrep::default()));
    daemon
}

async fn reload(daemon: &Daemon, dir: &tempfile::TempDir, text: &str) {
    std::fs::write(dir.path().join("router.yaml"), text).expect("write config");
    daemon.reload().await.expect("reload applies");
}

async fn wait_for_workers(daemon: &Daemon, n: usize) {
    let registry = daemon.registry();
    let mut generations = registry.subscribe();
    tokio::time::timeout(Duration::from_secs(30), async {
        while registry.snapshot().workers().len() < n {
            generations.changed().await.expect("registry alive");
        }
    })
    .await
    .expect("workers discovered");
}

struct Sent {
    status: u16,
    routing_path: Option<String>,
}

/// A chat request carrying client pins and client token data, none of which may reach a worker.
async fn chat(daemon: &Daemon) -> Sent {
    let resp = reqwest::Client::new()
        .post(format!(
            "http://{}/v1/chat/completions",
            daemon.local_addr()
        ))
        .header("x-dynamo-worker-instance-id", "1")
        .json(
            &json!({"model": "tiny", "messages": [{"role": "user", "content": PROMPT}],
                      "nvext": {"token_data": [7, 7, 7], "greed_sampling": true}}),
        )
        .send()
        .await
        .expect("send");
    Sent {
        status: resp.status().as_u16(),
        routing_path: resp
            .headers()
            .get("x-continuum-routing-path")
            .map(|v| v.to_str().expect("ascii").to_string()),
    }
}

fn pin(seen: &support::upstream::Recorded, name: &str) -> Option<u64> {
    seen.headers
        .get(name)
        .map(|v| v.to_str().expect("ascii").parse().expect("decimal"))
}

fn metric(daemon: &Daemon, family: &str, labels: &[(&str, &str)]) -> f64 {
    daemon.metrics().value(family, labels).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlap_selects_the_worker_and_kv_settings_hot_reload() {
    let etcd = EtcdServer::start().await;
    let mut client = etcd.client().await;
    let a = put_worker(&mut client, "backend", "aggregated").await;
    let b = put_worker(&mut client, "backend", "aggregated").await;
    let mut shim = FakeUpstream::start().await;
    let mut unified = FakeUpstream::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let kv_on = "    enabled: true\n    send_token_data: true\n";
    let daemon = start(&yaml(&etcd, &shim, &unified, kv_on), &dir).await;
    wait_for_workers(&daemon, 2).await;
    index_blocks(&daemon, b, &text_hashes(PROMPT, 16)).await;
    let expected_tokens: Vec<Value> = tokens_of(&json!({"messages": [{"content": PROMPT}]}))
        .into_iter()
        .map(Value::from)
        .collect();

    // 1. The quiet fleet competes on overlap: B holds the prompt's two blocks, every time. The
    //    rendered tokens replace the client's token data; other nvext fields stay.
    for _ in 0..3 {
        shim.push(Reply::Json(http::StatusCode::OK, completion("ok"), vec![]));
        let sent = chat(&daemon).await;
        assert_eq!(sent.status, 200);
        assert_eq!(sent.routing_path.as_deref(), Some("aggregated"));
        let seen = shim.next_request().await;
        assert_eq!(pin(&seen, "x-dynamo-worker-instance-id"), Some(b));
        assert_eq!(pin(&seen, "x-dynamo-prefill-instance-id"), None);
        let body = seen.json();
        assert_eq!(
            body["nvext"]["token_data"],
            Value::from(expected_tokens.clone())
        );
        assert_eq!(body["nvext"]["greed_sampling"], true);
    }
    assert_eq!(
        daemon.shim().expect("shim").picker().name(),
        "kv_aware",
        "dynamo.kv.enabled installs the KV-aware picker"
    );
    let selected = |result| {
        metric(
            &daemon,
            "continuum_dynamo_kv_selection_total",
            &[("result", result)],
        )
    };
    assert_eq!(selected("overlap"), 3.0);
    assert_eq!(
        metric(
            &daemon,
            "continuum_dynamo_selection_total",
            &[("role", "decode"), ("reason", "kv_aware")]
        ),
        3.0
    );

    // 2. A failing shim falls back to the unified backend with the client's body: no token data
    //    (neither the rendered one nor the client's).
    shim.push(Reply::status(500));
    unified.push(Reply::Json(http::StatusCode::OK, completion("fb"), vec![]));
    assert_eq!(chat(&daemon).await.status, 200);
    assert!(shim.next_request().await.json()["nvext"]["token_data"].is_array());
    let fell_back = unified.next_request().await;
    assert!(fell_back.json()["nvext"].get("token_data").is_none());
    assert!(
        fell_back
            .headers
            .get("x-dynamo-worker-instance-id")
            .is_none()
    );

    // 3. Credit 0 and no token data, applied on reload: overlap no longer counts, so the two
    //    workers tie and rotate; the client's token data is still stripped.
    let kv_no_credit = "    enabled: true\n    overlap_score_credit: 0.0\n";
    reload(&daemon, &dir, &yaml(&etcd, &shim, &unified, kv_no_credit)).await;
    let mut seen_ids = Vec::new();
    for _ in 0..2 {
        shim.push(Reply::Json(http::StatusCode::OK, completion("ok"), vec![]));
        assert_eq!(chat(&daemon).await.status, 200);
        let seen = shim.next_request().await;
        seen_ids.push(pin(&seen, "x-dynamo-worker-instance-id").expect("pinned"));
        assert!(seen.json()["nvext"].get("token_data").is_none());
    }
    seen_ids.sort();
    assert_eq!(seen_ids, {
        let mut ids = vec![a, b];
        ids.sort();
        ids
    });
    assert_eq!(
        metric(
            &daemon,
            "continuum_dynamo_selection_total",
            &[("role", "decode"), ("reason", "round_robin_stale")]
        ),
        2.0
    );
    assert_eq!(selected("overlap") + selected("no_overlap"), 6.0);

    // 4. KV off: the load-based picker is back, and no KV result is counted.
    let kv_off = "    enabled: false\n";
    reload(&daemon, &dir, &yaml(&etcd, &shim, &unified, kv_off)).await;
    shim.push(Reply::Json(http::StatusCode::OK, completion("ok"), vec![]));
    assert_eq!(chat(&daemon).await.status, 200);
    let seen = shim.next_request().await;
    assert!(seen.json()["nvext"].get("token_data").is_none());
    assert_eq!(daemon.shim().expect("shim").picker().name(), "load_based");
    assert_eq!(selected("overlap") + selected("no_overlap"), 6.0);

    // 5. KV on again with a failing preparation: load-based selection, counted by reason.
    reload(&daemon, &dir, &yaml(&etcd, &shim, &unified, kv_on)).await;
    daemon
        .shim()
        .expect("shim")
        .set_kv_prep(Arc::new(WhitespacePrep {
            fail: Some(continuum_protocol::picker::KvUnavailable::PromptTooLarge),
        }));
    shim.push(Reply::Json(http::StatusCode::OK, completion("ok"), vec![]));
    assert_eq!(chat(&daemon).await.status, 200);
    let seen = shim.next_request().await;
    assert!(seen.json()["nvext"].get("token_data").is_none());
    assert_eq!(daemon.shim().expect("shim").picker().name(), "kv_aware");
    assert_eq!(selected("prompt_too_large"), 1.0);
    daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conditional_bypass_pins_only_the_decode_worker_on_the_unified_path() {
    let etcd = EtcdServer::start().await;
    let mut client = etcd.client().await;
    let prefill = put_worker(&mut client, "prefill", "prefill").await;
    let decode = put_worker(&mut client, "backend", "decode").await;
    let mut shim = FakeUpstream::start().await;
    let unified = FakeUpstream::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let kv = "    enabled: true\n    conditional_disaggregation:\n      enabled: true\n";
    let daemon = start(&yaml(&etcd, &shim, &unified, kv), &dir).await;
    wait_for_workers(&daemon, 2).await;

    // Nothing cached anywhere: an ordinary pair.
    shim.push(Reply::Json(http::StatusCode::OK, completion("ok"), vec![]));
    let sent = chat(&daemon).await;
    assert_eq!(sent.routing_path.as_deref(), Some("disaggregated"));
    let seen = shim.next_request().await;
    assert_eq!(pin(&seen, "x-dynamo-worker-instance-id"), Some(decode));
    assert_eq!(pin(&seen, "x-dynamo-prefill-instance-id"), Some(prefill));

    // The decode worker holds the prompt: it prefills locally.
    index_blocks(&daemon, decode, &text_hashes(PROMPT, 16)).await;
    shim.push(Reply::Json(http::StatusCode::OK, completion("ok"), vec![]));
    let sent = chat(&daemon).await;
    assert_eq!(sent.status, 200);
    assert_eq!(sent.routing_path.as_deref(), Some("unified"));
    let seen = shim.next_request().await;
    assert_eq!(pin(&seen, "x-dynamo-worker-instance-id"), Some(decode));
    let dynamo_headers: Vec<&str> = seen
        .headers
        .keys()
        .map(|k| k.as_str())
        .filter(|k| k.starts_with("x-dynamo-"))
        .collect();
    // The cards declare no data_parallel_size, so no rank header either.
    assert_eq!(dynamo_headers, ["x-dynamo-worker-instance-id"]);
    assert!(seen.headers.get("x-dynamo-prefill-instance-id").is_none());
    assert_eq!(
        metric(
            &daemon,
            "continuum_dynamo_kv_selection_total",
            &[("result", "bypass")]
        ),
        1.0
    );
    assert_eq!(
        metric(
            &daemon,
            "continuum_dynamo_selection_total",
            &[("role", "prefill"), ("reason", "conditional_bypass")]
        ),
        1.0
    );
    assert_eq!(
        metric(
            &daemon,
            "disaggregated_requests_total",
            &[("routing_path", "unified")]
        ),
        1.0
    );
    daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_data_is_not_sent_when_the_pools_replicas_rewrite_differently() {
    // Seed "nvext.token_data": not attached when the shim pool's replicas require different
    // body rewrites. The second replica adds a system prompt: the rendered tokens (with the
    // first replica's rewrite) fit neither replica's prompt for certain, so no copy carries them.
    let etcd = EtcdServer::start().await;
    let mut client = etcd.client().await;
    put_worker(&mut client, "backend", "aggregated").await;
    let mut shim = FakeUpstream::start().await;
    let mut shim2 = FakeUpstream::start().await;
    let unified = FakeUpstream::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let kv_on = "    enabled: true\n    send_token_data: true\n";
    let text = yaml(&etcd, &shim, &unified, kv_on)
        .replace(
            "  - name: unified\n",
            &format!(
                "  - name: shim2\n    type: openai\n    url: \"{}\"\n    models: [tiny]\n    \
                 global_prompts: [\"Answer briefly.\"]\n    health_check:\n      enabled: false\n\
                 \x20 - name: unified\n",
                shim2.url()
            ),
        )
        .replace("backends: [shim]", "backends: [shim, shim2]");
    let daemon = start(&text, &dir).await;
    wait_for_workers(&daemon, 1).await;
    for _ in 0..2 {
        shim.push(Reply::Json(http::StatusCode::OK, completion("ok"), vec![]));
        shim2.push(Reply::Json(http::StatusCode::OK, completion("ok"), vec![]));
        assert_eq!(chat(&daemon).await.status, 200);
        let seen = shim
            .try_request()
            .or_else(|| shim2.try_request())
            .expect("a shim replica got the request");
        assert!(seen.headers.get("x-dynamo-worker-instance-id").is_some());
        let body = seen.json();
        assert!(body["nvext"].get("token_data").is_none(), "{body}");
        assert_eq!(body["nvext"]["greed_sampling"], true);
    }
    // KV-aware selection itself still ran on the rendered prompt.
    let selected = |result| {
        metric(
            &daemon,
            "continuum_dynamo_kv_selection_total",
            &[("result", result)],
        )
    };
    assert_eq!(selected("overlap") + selected("no_overlap"), 2.0);
}

/// The control loop installs the picker, requests never do: the KV-aware picker is in place at
/// start, before any request; a refused reload keeps that very instance; an applied reload that
/// turns KV off brings the load-based picker back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_is_installed_by_reloads_and_a_refused_reload_keeps_it() {
    let etcd = EtcdServer::start().await;
    let shim = FakeUpstream::start().await;
    let unified = FakeUpstream::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = start(&yaml(&etcd, &shim, &unified, "    enabled: true\n"), &dir).await;
    let router = daemon.shim().expect("shim");
    let installed = router.picker();
    assert_eq!(installed.name(), "kv_aware", "installed at start");

    std::fs::write(dir.path().join("router.yaml"), "backends: [").expect("write config");
    assert!(daemon.reload().await.is_err(), "an invalid file is refused");
    assert!(
        Arc::ptr_eq(&installed, &router.picker()),
        "the picker stays"
    );

    let kv_off = yaml(&etcd, &shim, &unified, "    enabled: false\n");
    reload(&daemon, &dir, &kv_off).await;
    assert_eq!(router.picker().name(), "load_based");
    daemon.shutdown().await;
}
