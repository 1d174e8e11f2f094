//! Hash parity across the ingresses (`real-peers`): with `global_prompts` and
//! `requires_single_leading_system` on the shim replica and KV-aware selection on, the same
//! conversation sent as `/v1/chat/completions`, `/v1/messages` and `/v1/responses` reaches the
//! direct-mode frontend stand-in with the same rewritten body, and the tokens the KV-aware picker
//! rendered (sent as `nvext.token_data`) are exactly the tokens of that body: the picker hashed
//! the prompt the frontend sees. The overlap (indexed for the rewritten prompt only) picks the
//! worker on all three ingresses, with a fresh pin per request.
#![cfg(feature = "real-peers")]

use std::sync::Arc;
use std::time::Duration;

use crate::support::etcd::EtcdServer;
use crate::support::kv_prep::{WhitespacePrep, index_blocks, text_hashes, tokens_of};
use crate::support::upstream::{FakeUpstream, Reply, completion};
use continuum_router::config::Config;
use continuum_router::daemon::{Daemon, RunOptions};
use etcd_client::{Client, PutOptions};
use serde_json::{Value, json};
use tokio::net::TcpListener;

const NS: &str = "kvparity";
const GLOBAL: &str = "You are served by continuum. Answer in one short sentence please.";
const SYSTEM: &str = "Be precise and brief.";
const PROMPT: &str = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi \
    omicron pi rho sigma tau upsilon phi chi psi omega one two three four five six seven eight";

fn yaml(etcd: &EtcdServer, shim: &FakeUpstream) -> String {
    format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\n\
         disaggregated_serving:\n  enabled: true\n  fallback_to_unified: false\n\
         backends:\n  - name: shim\n    type: openai\n    url: \"{}\"\n    models: [tiny]\n    \
         global_prompts: [\"{GLOBAL}\"]\n    requires_single_leading_system: true\n    \
         health_check:\n      enabled: false\n\
         dynamo:\n  enabled: true\n  discovery:\n    etcd:\n      endpoints: [\"{}\"]\n      \
         namespace: {NS}\n  shim:\n    backends: [shim]\n  kv:\n    enabled: true\n    \
         send_token_data: true\n",
        shim.url(),
        etcd.endpoint()
    )
}

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

/// The conversation on each ingress: a system prompt and one user turn, with a client pin.
fn requests() -> [(&'static str, Value); 3] {
    [
        (
            "/v1/chat/completions",
            json!({ "model": "tiny", "max_tokens": 16, "messages": [
                { "role": "user", "content": PROMPT },
                { "role": "system", "content": SYSTEM } ] }),
        ),
        (
            "/v1/messages",
            json!({ "model": "tiny", "max_tokens": 16, "system": SYSTEM,
                    "messages": [{ "role": "user", "content": PROMPT }] }),
        ),
        (
            "/v1/responses",
            json!({ "model": "tiny", "max_output_tokens": 16, "instructions": SYSTEM,
                    "input": PROMPT }),
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_ingress_renders_the_prompt_the_frontend_sees() {
    let etcd = EtcdServer::start().await;
    let mut client = etcd.client().await;
    let _a = put_worker(&mut client, "backend", "aggregated").await;
    let b = put_worker(&mut client, "backend", "aggregated").await;
    let mut shim = FakeUpstream::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = start(&yaml(&etcd, &shim), &dir).await;
    wait_for_workers(&daemon, 2).await;
    // Only the rewritten prompt (global prompt and system merged first) overlaps on B.
    let rewritten = format!("{GLOBAL}\n\n{SYSTEM} {PROMPT}");
    let hashes = text_hashes(&rewritten, 16);
    assert!(hashes.len() >= 2);
    index_blocks(&daemon, b, &hashes).await;

    let http = reqwest::Client::new();
    let mut bodies = Vec::new();
    for (path, body) in requests() {
        shim.push(Reply::Json(http::StatusCode::OK, completion("ok"), vec![]));
        let resp = http
            .post(format!("http://{}{path}", daemon.local_addr()))
            .header("x-dynamo-worker-instance-id", "1")
            .json(&body)
            .send()
            .await
            .expect("send");
        assert_eq!(resp.status(), 200, "{path}: {:?}", resp.text().await);
        let seen = shim.next_request().await;
        assert_eq!(seen.path, "/v1/chat/completions", "{path}");
        assert_eq!(
            pin(&seen, "x-dynamo-worker-instance-id"),
            Some(b),
            "{path}: the overlap picks B"
        );
        let mut sent = seen.json();
        let token_data = sent["nvext"]["token_data"].clone();
        sent.as_object_mut().expect("object").remove("nvext");
        assert_eq!(
            sent["messages"],
            json!([
                { "role": "system", "content": format!("{GLOBAL}\n\n{SYSTEM}") },
                { "role": "user", "content": PROMPT },
            ]),
            "{path}: the frontend sees the rewritten conversation"
        );
        let rendered: Vec<Value> = tokens_of(&sent).into_iter().map(Value::from).collect();
        assert_eq!(
            token_data,
            Value::from(rendered),
            "{path}: the picker rendered exactly what the frontend receives"
        );
        bodies.push(sent["messages"].clone());
    }
    assert!(bodies.windows(2).all(|w| w[0] == w[1]));
    assert_eq!(
        daemon
            .metrics()
            .value(
                "continuum_dynamo_kv_selection_total",
                &[("result", "overlap")]
            )
            .unwrap_or(0.0),
        3.0
    );
    daemon.shutdown().await;
}

fn pin(seen: &crate::support::upstream::Recorded, name: &str) -> Option<u64> {
    seen.headers
        .get(name)
        .map(|v| v.to_str().expect("ascii").parse().expect("decimal"))
}
