//! Routing through real NVIDIA Dynamo 1.6.1: our router discovers the workers, picks a prefill and
//! a decode rank per request, and sends it with decimal pins to a real
//! `dynamo.frontend --router-mode direct`, which refuses any disaggregated request that lacks
//! either pin. So every 200 below is a pin pair the frontend honoured. A client-sent
//! `x-dynamo-worker-instance-id` naming an unknown worker would make it answer 400: it never
//! reaches the frontend.
#![cfg(feature = "dynamo-e2e")]

use crate::support;

use std::time::Duration;

use futures::StreamExt;
use serde_json::json;
use support::dynamo::{DynamoStack, MODEL, Signal, Topology, WorkerRole};

const BUFFERED: usize = 500;
const STREAMING: usize = 100;
/// Requests after a decode worker was stopped with SIGTERM.
const AFTER_TERM: usize = 50;

fn config_yaml(stack: &DynamoStack) -> String {
    format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\n\
         disaggregated_serving:\n  enabled: true\n  fallback_to_unified: false\n\
         backends:\n  - name: dynamo-frontend\n    type: openai\n    url: \"{frontend}\"\n    \
         role: unified\n    models: [\"{MODEL}\"]\n    health_check:\n      enabled: false\n\
         dynamo:\n  enabled: true\n  discovery:\n    etcd:\n      endpoints: [\"{etcd}\"]\n      \
         namespace: \"{ns}\"\n  load:\n    direct_allow_cidrs: [\"127.0.0.0/8\"]\n  \
         shim:\n    backends: [dynamo-frontend]\n",
        frontend = stack.frontend_url(),
        etcd = stack.etcd_endpoint(),
        ns = stack.namespace(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_are_pinned_by_our_picker_and_served_by_the_real_frontend() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut stack = DynamoStack::start(Topology::Disagg).await;
    // Two decode workers, so one can leave mid-run.
    stack.add_worker(WorkerRole::Decode).await;
    let daemon = support::daemon::start(&config_yaml(&stack)).await;
    support::daemon::wait_for_workers(&daemon, 3).await;
    let registry = daemon.registry().clone();
    let mut generations = registry.subscribe();

    let url = format!("http://{}/v1/chat/completions", daemon.local_addr());
    let client = reqwest::Client::new();
    let body = |i: usize, stream: bool| {
        json!({"model": MODEL, "stream": stream, "max_tokens": 8,
               "messages": [{"role": "user", "content": format!("hello number {i}")}]})
    };
    for i in 0..BUFFERED {
        let mut req = client.post(&url).json(&body(i, false));
        if i % 10 == 0 {
            // A client pin naming an unknown worker: stripped, so the request still succeeds.
            req = req
                .header("x-dynamo-worker-instance-id", "12345")
                .header("x-prefill-instance-id", "12345");
        }
        let resp = req.send().await.expect("send");
        let status = resp.status();
        let path = resp
            .headers()
            .get("x-continuum-routing-path")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        assert!(
            resp.headers()
                .keys()
                .all(|k| !k.as_str().starts_with("x-dynamo-"))
        );
        let text = resp.text().await.expect("body");
        assert_eq!(status, 200, "request {i}: {text}");
        assert_eq!(path.as_deref(), Some("disaggregated"));
        let v: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert!(v["choices"][0]["message"].is_object(), "{text}");
    }
    for i in 0..STREAMING {
        let resp = client
            .post(&url)
            .json(&body(i, true))
            .send()
            .await
            .expect("send");
        assert_eq!(resp.status(), 200);
        let mut chunks = 0;
        let mut stream = resp.bytes_stream();
        let mut text = String::new();
        while let Some(chunk) = stream.next().await {
            text.push_str(&String::from_utf8_lossy(&chunk.expect("chunk")));
            chunks += 1;
        }
        assert!(
            chunks >= 1 && text.contains("data:") && text.contains("[DONE]"),
            "{text}"
        );
    }
    // A decode worker stops with SIGTERM: it leaves the view at once and routing continues on the
    // rest without a single error.
    let stopped = stack.stop_worker(WorkerRole::Decode, Signal::Term).await;
    tokio::time::timeout(Duration::from_secs(10), async {
        while registry
            .snapshot()
            .workers()
            .iter()
            .any(|w| w.instance_id().0 == stopped)
        {
            generations.changed().await.expect("registry alive");
        }
    })
    .await
    .expect("the stopped worker left the view");
    for i in 0..AFTER_TERM {
        let resp = client
            .post(&url)
            .json(&body(i, false))
            .send()
            .await
            .expect("send");
        assert_eq!(resp.status(), 200, "after SIGTERM, request {i}");
    }

    // The frontend's own log names the workers our picker pinned (decimal ids it resolved).
    let frontend_log =
        strip_ansi(&std::fs::read_to_string(stack.log_dir().join("frontend.log")).expect("log"));
    let selected: std::collections::BTreeSet<u64> = frontend_log
        .lines()
        .filter(|l| l.contains("Selected worker") && l.contains("router_mode=\"direct\""))
        .filter_map(|l| {
            l.split("worker_id=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect();
    let known: std::collections::BTreeSet<u64> =
        stack.workers().iter().map(|w| w.instance_id).collect();
    let sample: Vec<&str> = frontend_log
        .lines()
        .filter(|l| l.contains("worker"))
        .take(8)
        .collect();
    assert!(
        selected.len() >= 3,
        "prefill and both decode workers were pinned: {selected:?}\n{sample:#?}"
    );
    assert!(
        selected.is_subset(&known),
        "only real workers were selected: {selected:?}"
    );

    let metrics = daemon.metrics();
    let disagg = metrics
        .value(
            "disaggregated_requests_total",
            &[("routing_path", "disaggregated")],
        )
        .unwrap_or(0.0);
    assert_eq!(disagg as usize, BUFFERED + STREAMING + AFTER_TERM);
    let selections: f64 = ["load", "round_robin_stale", "round_robin"]
        .iter()
        .filter_map(|r| {
            metrics.value(
                "continuum_dynamo_selection_total",
                &[("role", "decode"), ("reason", r)],
            )
        })
        .sum();
    assert_eq!(selections as usize, BUFFERED + STREAMING + AFTER_TERM);
    let errors = metrics
        .value("disaggregated_errors_total", &[("phase", "decode")])
        .unwrap_or(0.0);
    assert_eq!(errors, 0.0, "no shim failure at all");
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
