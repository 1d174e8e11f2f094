//! Single-node discovery through Dynamo's file store, with real NVIDIA Dynamo 1.6.1 and no etcd
//! process at all: `dynamo.mocker` workers and a `dynamo.frontend --router-mode direct` all run
//! with `--discovery-backend file` on one `DYN_FILE_KV` directory, and our router reads that
//! directory (`dynamo.discovery.source: file`) with `deploy/examples/single-node-file/router.yaml`.
//!
//! Proven: the router discovers every worker and its `kv_metrics` publisher from the files, pins
//! each request to a prefill and a decode worker that the real frontend resolves from the same
//! files (every 200 is a pin pair it honoured; its log names only real workers), and a SIGKILLed
//! worker, whose files nobody deletes at once, leaves the view once its files are older than the
//! 10 s TTL, after which every request is served by the rest.
#![cfg(feature = "dynamo-e2e")]

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use continuum_protocol::discovery::snapshot::SourceKind;
use continuum_router::config::Config;
use continuum_router::daemon::{Daemon, RunOptions};
use serde_json::json;
use support::dynamo::{
    Discovery, DynamoStack, FILE_TTL, MODEL, Signal, StackOptions, Topology, WorkerRole,
};
use tokio::net::TcpListener;
use tokio::time::Instant;

/// Requests while all three workers are up.
const BEFORE: usize = 100;
/// Requests after the killed worker left the view.
const AFTER: usize = 50;

/// The single-node example config, its `${...}` variables filled from the stack.
const EXAMPLE: &str = include_str!("../../deploy/examples/single-node-file/router.yaml");
const ADMIN_TOKEN: &str = "file-e2e-admin-token";
const CLIENT_KEY: &str = "sk-file-e2e-client";

/// A daemon on a free loopback port running [`EXAMPLE`] against `stack`.
async fn start_router(stack: &DynamoStack) -> Daemon {
    let env: BTreeMap<String, String> = [
        ("ROUTER_BIND", "127.0.0.1:0".to_owned()),
        ("ROUTER_ADMIN_TOKEN", ADMIN_TOKEN.to_owned()),
        ("CLIENT_API_KEY", CLIENT_KEY.to_owned()),
        ("DYN_FILE_KV", stack.file_root().display().to_string()),
        ("DYNAMO_NAMESPACE", stack.namespace().to_owned()),
        ("DYNAMO_FRONTEND_URL", stack.frontend_url()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    let loaded = Config::from_yaml_str_validated(EXAMPLE, &env).expect("the example is valid");
    assert_eq!(
        loaded.config.dynamo.discovery.source,
        continuum_router::config::DiscoverySource::File
    );
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    Daemon::start(
        RunOptions {
            config: loaded.config,
            config_path: None,
            demo: false,
        },
        listener,
    )
    .await
    .expect("daemon starts")
}

async fn send_all(url: &str, n: usize, phase: &str) {
    let client = reqwest::Client::new();
    for i in 0..n {
        let resp = client
            .post(url)
            .bearer_auth(CLIENT_KEY)
            .json(&json!({"model": MODEL, "max_tokens": 8,
                          "messages": [{"role": "user", "content": format!("{phase} {i}")}]}))
            .send()
            .await
            .expect("send");
        let status = resp.status();
        let path = resp
            .headers()
            .get("x-continuum-routing-path")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let text = resp.text().await.expect("body");
        assert_eq!(status, 200, "{phase} request {i}: {text}");
        assert_eq!(
            path.as_deref(),
            Some("disaggregated"),
            "{phase} request {i}"
        );
        let v: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert!(v["choices"][0]["message"].is_object(), "{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_store_fleet_is_discovered_pinned_and_expired_without_etcd() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut stack = DynamoStack::start_with(StackOptions {
        discovery: Discovery::File,
        ..StackOptions::new(Topology::Disagg)
    })
    .await;
    // A second decode worker, so one can die mid-run.
    stack.add_worker(WorkerRole::Decode).await;
    assert!(!stack.has_etcd(), "no etcd process in this stack");
    let daemon = start_router(&stack).await;
    let registry = daemon.registry().clone();
    support::daemon::wait_for(
        &registry,
        Duration::from_secs(30),
        "three workers and their kv_metrics publishers from the file store",
        |s| s.workers().len() == 3 && s.load_publisher_count() >= 3,
    )
    .await;
    let snapshot = registry.snapshot();
    assert_eq!(snapshot.source(), SourceKind::File);
    let discovered: BTreeSet<u64> = snapshot
        .workers()
        .iter()
        .map(|w| w.instance_id().0)
        .collect();
    let started: BTreeSet<u64> = stack.workers().iter().map(|w| w.instance_id).collect();
    assert_eq!(discovered, started);

    let url = format!("http://{}/v1/chat/completions", daemon.local_addr());
    send_all(&url, BEFORE, "before").await;

    // SIGKILL: the worker cannot remove its files; they stop being touched and expire.
    let killed_at = Instant::now();
    let killed = stack.stop_worker(WorkerRole::Decode, Signal::Kill).await;
    support::daemon::wait_for(
        &registry,
        FILE_TTL + Duration::from_secs(30),
        "the killed worker leaves the view after the file TTL",
        |s| s.workers().iter().all(|w| w.instance_id().0 != killed),
    )
    .await;
    eprintln!(
        "killed worker {killed} left the view {} ms after SIGKILL (file TTL {} s)",
        killed_at.elapsed().as_millis(),
        FILE_TTL.as_secs()
    );
    assert_eq!(registry.snapshot().workers().len(), 2);
    send_all(&url, AFTER, "after").await;

    // The frontend's own log names the workers our picker pinned (decimal ids it resolved).
    let frontend_log =
        strip_ansi(&std::fs::read_to_string(stack.log_dir().join("frontend.log")).expect("log"));
    let selected: BTreeSet<u64> = frontend_log
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
    assert!(
        selected.len() >= 2 && selected.is_subset(&started),
        "only real workers were pinned: {selected:?} of {started:?}"
    );
    let metrics = daemon.metrics();
    let disagg = metrics
        .value(
            "disaggregated_requests_total",
            &[("routing_path", "disaggregated")],
        )
        .unwrap_or(0.0);
    assert_eq!(disagg as usize, BEFORE + AFTER);
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
