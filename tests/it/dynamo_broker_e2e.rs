//! Real NVIDIA Dynamo 1.6.1 through the event-bus tunnel (issue #13 items 5 and 6): the same
//! KV-aware multi-turn workload runs once with `dynamo.load.transport: direct` and once with
//! `transport: broker` and the REAL `continuum-event-broker` binary between the router and the
//! workers, each on a fresh stack (etcd, two aggregated `dynamo.mocker` workers with kv-events,
//! a `dynamo.frontend --router-mode direct`), so both runs start from empty worker caches.
//!
//! * Every request succeeds in both runs.
//! * KV-aware reuse is the same: the workers' own prefix-cache hits (`cached_tokens`) and prompt
//!   tokens, the `overlap` selections, and which conversations shared a worker.
//! * Hash parity is the same: as many predictions checked, every one matched.
//! * Under `transport: broker` every kv_metrics and kv-events subscription is `connected` over
//!   transport `broker` through the one broker, the load store holds a sample of each worker, and
//!   the broker relays the four streams.
//! * `scripts/dynamo-broker-live-check.sh` (item 6), run on loopback against the tunnelled stack
//!   (`--router-url`, `--broker-metrics-url`, a two-second window with chat traffic meanwhile)
//!   passes its steps (step 3 needs a cluster and is skipped): every subscription connected over
//!   the broker, one session and four streams on the broker, no decode selection on stale load;
//!   run against the direct run's router it fails step 1, so the check can fail.
//!
//! How the broker learns the publishers (the choice this test makes): the broker authorizes
//! dials only to targets that DynamoWorkerMetadata in its Kubernetes namespace advertise. Dynamo's
//! own Kubernetes discovery (`DYN_DISCOVERY_BACKEND=kubernetes`, upstream
//! `lib/runtime/src/discovery/kube/crd.rs`) has each worker create its DynamoWorkerMetadata by
//! server-side apply (a `PATCH`), owned by its Pod (`POD_NAME`, `POD_NAMESPACE`, `POD_UID`
//! injected by the operator), and peers wait on the Pods' EndpointSlices; running the mockers
//! that way needs an API server that accepts writes, owner references and EndpointSlice
//! readiness, and the fake Kubernetes API only serves lists and watches. So the workers keep
//! registering in etcd (the harness the other real-Dynamo tests use, and the router discovers
//! them there: `dynamo.discovery.source` may be etcd under a broker), and the test mirrors each
//! real worker's advertised event channels, read back from etcd exactly as the worker wrote
//! them (key suffix and JSON value, grouped by the worker's lease == instance id), into one
//! DynamoWorkerMetadata per worker under `spec.data.event_channels`, which is what Dynamo's
//! Kubernetes discovery would have written for that worker. The broker therefore dials the very
//! `tcp://127.0.0.1:<port>` endpoints the real mockers bound, and relays their real frames.
#![cfg(feature = "dynamo-e2e")]

use crate::support;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use continuum_router::daemon::Daemon;
use etcd_client::GetOptions;
use serde_json::{Value, json};
use support::broker::{Broker, BrokerArgs};
use support::bus_pki::{Pki, pki};
use support::dynamo::{DynamoStack, MODEL, Topology};
use support::fake_kube::{FakeKube, Kind};

const ADMIN_TOKEN: &str = "broker-e2e-admin";
const BROKER_ID: &str = "broker-a.dynamo";
const BROKER_TOKEN: &str = "broker-e2e-bearer-token";
/// The Kubernetes namespace the broker watches.
const KUBE_NS: &str = "dynamo";
const WAIT: Duration = Duration::from_secs(60);

/// Conversations per run (odd, so a plain rotation over two workers cannot look sticky).
const CONVERSATIONS: usize = 5;
const TURNS: usize = 4;
/// Conversation `c` belongs to tenant `c % TENANTS` (one long system prompt each).
const TENANTS: usize = 2;
const SYSTEM_WORDS: usize = 300;
const TURN_WORDS: usize = 90;
/// The assistant turn each history carries instead of the mocker's (random) answer, so both runs
/// send byte-identical prompts.
const ASSISTANT: &str = "noted, please continue";

/// Words the tiny tokenizer was trained on (scripts/make_tiny_model.py).
const WORDS: [&str; 16] = [
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "router",
    "routes", "requests", "to", "workers", "cache",
];

/// `n` words from a seeded xorshift: deterministic text, distinct per seed.
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

fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `blake3:<hex>` of a file, as a worker card names it.
fn blake3_pin(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    format!("blake3:{}", blake3::hash(&bytes).to_hex())
}

/// The router: etcd discovery, KV-aware selection with the tokenizer pinned, and either direct
/// dials or the event-bus listener with one broker entry.
fn router_yaml(stack: &DynamoStack, cache: &Path, bus: Option<&Pki>) -> String {
    let pins = ["tokenizer.json", "tokenizer_config.json"]
        .iter()
        .map(|f| format!("\"{}\"", blake3_pin(&stack.model_dir().join(f))))
        .collect::<Vec<_>>()
        .join(", ");
    let mut yaml = format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\n\
         admin:\n  enabled: true\n  token: \"{ADMIN_TOKEN}\"\n\
         disaggregated_serving:\n  enabled: true\n  fallback_to_unified: false\n\
         backends:\n  - name: dynamo-frontend\n    type: openai\n    url: \"{frontend}\"\n    \
         models: [\"{MODEL}\"]\n    health_check:\n      enabled: false\n\
         dynamo:\n  enabled: true\n  discovery:\n    etcd:\n      endpoints: [\"{etcd}\"]\n      \
         namespace: \"{ns}\"\n  shim:\n    backends: [dynamo-frontend]\n  kv:\n    enabled: true\n    \
         pinned_artifacts: [{pins}]\n    artifact_cache_dir: \"{cache}\"\n",
        frontend = stack.frontend_url(),
        etcd = stack.etcd_endpoint(),
        ns = stack.namespace(),
        cache = cache.display(),
    );
    match bus {
        None => yaml.push_str(
            "  load:\n    transport: direct\n    direct_allow_cidrs: [\"127.0.0.0/8\"]\n",
        ),
        Some(pki) => yaml.push_str(&format!(
            "  load:\n    transport: broker\n  event_bus:\n    enabled: true\n    \
             listen: \"127.0.0.1:0\"\n    tls:\n      cert: {:?}\n      key: {:?}\n    \
             brokers:\n      - id: {BROKER_ID}\n        token_hash: \"sha256:{}\"\n        \
             namespaces: [{}]\n",
            pki.server.0,
            pki.server.1,
            sha256_hex(BROKER_TOKEN.as_bytes()),
            stack.namespace(),
        )),
    }
    yaml
}

/// Mirrors every worker's event channels from etcd into one DynamoWorkerMetadata per worker
/// (see the module doc); returns how many channels were advertised.
async fn mirror_channels_into_kube(stack: &DynamoStack, kube: &FakeKube) -> usize {
    let mut client = stack.etcd().client().await;
    let prefix = format!("v1/event_channels/namespace/{}/", stack.namespace());
    let response = client
        .get(prefix.as_str(), Some(GetOptions::new().with_prefix()))
        .await
        .expect("etcd get");
    let mut by_worker: BTreeMap<i64, serde_json::Map<String, Value>> = BTreeMap::new();
    for kv in response.kvs() {
        let key = String::from_utf8_lossy(kv.key()).into_owned();
        let suffix = key
            .strip_prefix("v1/event_channels/")
            .expect("a channel key")
            .to_owned();
        let value: Value = serde_json::from_slice(kv.value()).expect("a JSON channel record");
        by_worker
            .entry(kv.lease())
            .or_default()
            .insert(suffix, value);
    }
    let running: Vec<u64> = stack.workers().iter().map(|w| w.instance_id).collect();
    let mut advertised = 0;
    for (lease, channels) in by_worker {
        assert!(
            u64::try_from(lease).is_ok_and(|id| running.contains(&id)),
            "channel lease {lease:x} is one of the workers {running:?}"
        );
        advertised += channels.len();
        kube.apply(
            Kind::Metadata,
            json!({
                "metadata": {"name": format!("worker-{lease:x}"), "namespace": KUBE_NS},
                "spec": {"data": {"event_channels": channels}}
            }),
        );
    }
    advertised
}

/// What one run measured.
#[derive(Debug, PartialEq)]
struct Outcome {
    prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`: the mockers' own prefix-cache hits.
    cached_tokens: u64,
    /// `continuum_dynamo_kv_selection_total{result="overlap"}`.
    overlap: u64,
    parity_checked: u64,
    parity_matched: u64,
    /// Per conversation, the worker of each turn, relabelled by first appearance (`0` is the
    /// worker the first conversation started on), so runs on different stacks compare.
    placements: Vec<String>,
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

fn metric(daemon: &Daemon, family: &str, labels: &[(&str, &str)]) -> f64 {
    daemon.metrics().value(family, labels).unwrap_or(0.0)
}

/// Waits until the router is ready for KV-aware routing over `transport`: both workers
/// discovered, the tokenizer loaded, and the kv_metrics and kv-events subscriptions of both
/// workers connected.
async fn wait_ready(daemon: &Daemon, transport: &str) {
    support::daemon::wait_for_workers(daemon, 2).await;
    poll_until(WAIT, "tokenizer loaded and subscriptions connected", || {
        metric(
            daemon,
            "continuum_dynamo_kv_artifacts_total",
            &[("result", "loaded")],
        ) >= 1.0
            && metric(
                daemon,
                "continuum_dynamo_kv_subscriptions",
                &[("state", "connected"), ("transport", transport)],
            ) >= 2.0
            && metric(
                daemon,
                "continuum_dynamo_load_subscriptions",
                &[("state", "connected"), ("transport", transport)],
            ) >= 2.0
    })
    .await;
}

/// The multi-turn workload, turn by turn over the conversations; each response waits until the
/// router's parity predictions are decided (the worker's kv-events reached the index), so the
/// next decision sees what the last request stored.
async fn run_workload(daemon: &Daemon, stack: &DynamoStack) -> Outcome {
    let url = format!("http://{}/v1/chat/completions", daemon.local_addr());
    let client = reqwest::Client::new();
    let systems: Vec<String> = (0..TENANTS as u64)
        .map(|t| {
            format!(
                "{} (tenant {t} system prompt)",
                words(100 + t, SYSTEM_WORDS)
            )
        })
        .collect();
    let mut histories: Vec<Vec<Value>> = (0..CONVERSATIONS)
        .map(|c| vec![json!({"role": "system", "content": systems[c % TENANTS]})])
        .collect();
    let (mut prompt_tokens, mut cached_tokens) = (0, 0);
    let mut request_ids: Vec<Vec<String>> = vec![Vec::new(); CONVERSATIONS];
    for turn in 0..TURNS {
        for (c, history) in histories.iter_mut().enumerate() {
            let seed = 500 + (c * TURNS + turn) as u64;
            history.push(json!({"role": "user",
                "content": format!("conversation {c} turn {turn}: {}", words(seed, TURN_WORDS))}));
            let body = json!({"model": MODEL, "max_tokens": 4, "messages": history});
            let resp = client.post(&url).json(&body).send().await.expect("send");
            assert_eq!(resp.status(), 200, "conversation {c} turn {turn}");
            let answer: Value = resp.json().await.expect("json answer");
            prompt_tokens += answer["usage"]["prompt_tokens"]
                .as_u64()
                .expect("prompt_tokens");
            cached_tokens += answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
            let id = answer["id"].as_str().unwrap_or_default();
            request_ids[c].push(id.trim_start_matches("chatcmpl-").to_owned());
            history.push(json!({"role": "assistant", "content": ASSISTANT}));
            let index = daemon.kv_index();
            poll_until(
                Duration::from_secs(10),
                "parity predictions decided",
                || index.parity_pending() == 0,
            )
            .await;
        }
    }
    let view = admin_workers(daemon).await;
    let parity = &view["kv_hash_parity"][MODEL];
    Outcome {
        prompt_tokens,
        cached_tokens,
        overlap: metric(
            daemon,
            "continuum_dynamo_kv_selection_total",
            &[("result", "overlap")],
        ) as u64,
        parity_checked: parity["checked"].as_u64().unwrap_or(0),
        parity_matched: parity["matched"].as_u64().unwrap_or(0),
        placements: placements(stack, &request_ids),
    }
}

/// Which worker ran each request (the mockers log the request id), relabelled by first
/// appearance; `?` when no worker log names the request.
fn placements(stack: &DynamoStack, request_ids: &[Vec<String>]) -> Vec<String> {
    let logs: Vec<String> = stack
        .workers()
        .iter()
        .map(|w| std::fs::read_to_string(&w.log).unwrap_or_default())
        .collect();
    let mut labels: Vec<usize> = Vec::new();
    request_ids
        .iter()
        .map(|ids| {
            ids.iter()
                .map(|id| {
                    let Some(worker) = logs
                        .iter()
                        .position(|log| !id.is_empty() && log.contains(id.as_str()))
                    else {
                        return '?';
                    };
                    let label = labels.iter().position(|w| *w == worker).unwrap_or_else(|| {
                        labels.push(worker);
                        labels.len() - 1
                    });
                    char::from(b'0' + label as u8)
                })
                .collect()
        })
        .collect()
}

async fn admin_workers(daemon: &Daemon) -> Value {
    reqwest::Client::new()
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
        .expect("json view")
}

/// Runs scripts/dynamo-broker-live-check.sh on loopback with a two-second window; returns
/// (exit code, stdout). With `traffic`, chat requests go through the router (each must succeed)
/// until the script exits, so its step 2 sees decode selections.
async fn live_check(daemon: &Daemon, broker: Option<&Broker>, traffic: bool) -> (i32, String) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/dynamo-broker-live-check.sh");
    let mut command = tokio::process::Command::new("bash");
    command
        .arg(&script)
        .args(["--router-url", &format!("http://{}", daemon.local_addr())])
        .args(["--window", "2", "--max-staleness-ms", "3000"])
        .env("ROUTER_ADMIN_TOKEN", ADMIN_TOKEN)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    if let Some(broker) = broker {
        command.args(["--broker-metrics-url", &broker.probe_url()]);
    }
    let child = command.spawn().expect("bash runs the live check");
    let output = child.wait_with_output();
    tokio::pin!(output);
    let url = format!("http://{}/v1/chat/completions", daemon.local_addr());
    let client = reqwest::Client::new();
    let mut sent = 0u64;
    let output = tokio::time::timeout(WAIT, async {
        loop {
            let (n, client, url) = (sent, &client, &url);
            let request = async move {
                let body = json!({"model": MODEL, "max_tokens": 2, "messages": [
                    {"role": "user", "content": format!("live check {n}: {}", words(n, 20))}]});
                let resp = client
                    .post(url.as_str())
                    .json(&body)
                    .send()
                    .await
                    .expect("send");
                assert_eq!(resp.status(), 200, "live-check traffic request {n}");
                let _ = resp.bytes().await;
            };
            tokio::select! {
                out = &mut output => break out,
                () = request, if traffic => sent += 1,
            }
        }
    })
    .await
    .expect("the live check finishes")
    .expect("the live check's output");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    println!(
        "live check ({}, {sent} requests sent meanwhile):\n{stdout}{}",
        if broker.is_some() { "broker" } else { "direct" },
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.code().unwrap_or(-1), stdout)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_dynamo_through_one_broker_routes_like_a_direct_dial() {
    let dir = tempfile::tempdir().expect("tempdir");

    // Run 1: direct dials.
    let direct = {
        let stack = DynamoStack::start(Topology::Agg).await;
        let daemon =
            support::daemon::start(&router_yaml(&stack, &dir.path().join("cache-direct"), None))
                .await;
        wait_ready(&daemon, "direct").await;
        let outcome = run_workload(&daemon, &stack).await;
        let (code, out) = live_check(&daemon, None, false).await;
        assert_eq!(code, 1, "the live check fails without a broker:\n{out}");
        assert!(
            out.contains("FAIL: 0/4 subscriptions connected over transport broker"),
            "{out}"
        );
        daemon.shutdown().await;
        outcome
    };

    // Run 2: a fresh stack, the same workload through one real broker.
    let pki = pki();
    let kube = FakeKube::start().await;
    let stack = DynamoStack::start(Topology::Agg).await;
    let advertised = mirror_channels_into_kube(&stack, &kube).await;
    // Agg workers publish kv_metrics, kv-events, forward-pass-metrics, active_sequences_events.
    assert!(advertised >= 4, "{advertised} channels advertised");
    let daemon = support::daemon::start(&router_yaml(
        &stack,
        &dir.path().join("cache-broker"),
        Some(&pki),
    ))
    .await;
    let mut ticks = tokio::time::interval(Duration::from_millis(20));
    let bus: SocketAddr = loop {
        if let Some(addr) = daemon.event_bus().local_addr() {
            break addr;
        }
        ticks.tick().await;
    };
    let broker = Broker::spawn(BrokerArgs {
        id: BROKER_ID,
        token: BROKER_TOKEN,
        bus,
        ca: &pki.ca,
        dynamo_namespace: stack.namespace(),
        kubernetes_namespace: KUBE_NS,
        kube: &kube,
    })
    .await;
    wait_ready(&daemon, "broker").await;
    let tunnelled = run_workload(&daemon, &stack).await;

    println!("broker e2e: direct {direct:?}");
    println!("broker e2e: broker {tunnelled:?}");
    assert!(direct.overlap > 0, "KV-aware picks saw overlap: {direct:?}");
    assert!(direct.parity_checked > 0, "{direct:?}");
    assert_eq!(direct.parity_matched, direct.parity_checked, "{direct:?}");
    assert!(
        direct.cached_tokens > 0,
        "the workers reused prefixes: {direct:?}"
    );
    assert_eq!(
        tunnelled, direct,
        "the same reuse, overlap, parity and placements through the broker"
    );

    // Every subscription is connected through the one broker, and the load store holds a sample
    // of each worker that came through it.
    let subscriptions = daemon.load_store().subscriptions();
    assert_eq!(subscriptions.len(), 4, "{subscriptions:?}");
    for s in &subscriptions {
        assert_eq!(
            (s.state, s.transport, s.broker.as_deref()),
            ("connected", "broker", Some(BROKER_ID)),
            "{s:?}"
        );
    }
    for worker in stack.workers() {
        let id = continuum_protocol::ids::InstanceId(worker.instance_id);
        assert!(
            daemon
                .load_store()
                .latest(id, continuum_protocol::ids::DpRank(0))
                .is_some(),
            "a load sample of worker {} through the broker",
            worker.instance_id
        );
    }
    let view = admin_workers(&daemon).await;
    let rows = view["subscriptions"].as_array().expect("subscriptions");
    assert!(
        rows.len() == 4
            && rows
                .iter()
                .all(|r| r["transport"] == "broker" && r["state"] == "connected"),
        "{view}"
    );
    assert_eq!(broker.value("continuum_event_broker_streams").await, 4.0);
    assert_eq!(broker.value("continuum_event_broker_sessions").await, 1.0);
    assert!(
        broker
            .value("continuum_event_broker_relayed_bytes_total{direction=\"to_router\"}")
            .await
            > 0.0
    );

    // Item 6: the live check passes on loopback against the tunnelled stack.
    let (code, out) = live_check(&daemon, Some(&broker), true).await;
    assert_eq!(code, 0, "the live check passes:\n{out}");
    assert!(
        out.contains("decode selections: ") && out.contains("round_robin_stale=0 "),
        "the traffic's decode selections were all on fresh samples: {out}"
    );
    assert!(
        out.contains("ok:   4/4 subscriptions connected over transport broker"),
        "{out}"
    );
    assert!(out.contains("sessions=1 streams=4"), "{out}");
    daemon.shutdown().await;
}
