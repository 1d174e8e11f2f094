//! Worker failures and fleet transitions with real NVIDIA Dynamo 1.6.1 (etcd, `dynamo.mocker`
//! workers, `dynamo.frontend --router-mode direct`) behind our router.
//!
//! 1. SIGKILL within the lease: a killed worker stays in etcd (and in our view) until its 30 s
//!    lease expires. Its `kv_metrics` publisher dies at once, so our subscription loses its
//!    session, the reconnect is refused, and the worker is marked unreachable; the picker then
//!    leaves it out. Guarantee proven: once the router reports the mark (polled through the load
//!    store's change signal, confirmed in `GET /admin/dynamo/workers`), every request succeeds and
//!    none is pinned to the killed worker (the frontend's own log names every worker it was asked
//!    for), and the worker leaves the view when its lease expires. Requests sent between the kill
//!    and the mark (≈ 0.3–1 s: the reconnect backoff) are NOT covered: they may be pinned to the
//!    dead worker and fail at the frontend.
//! 2. The Dynamo 1.5.0 transition: aggregated workers join a namespace that serves the model with
//!    prefill and decode workers. While the pool is there every request stays a prefill+decode
//!    pair (aggregated workers sit out); once the prefill and decode workers have left (SIGTERM),
//!    requests sent after the view updated go to the aggregated workers, without client errors.
#![cfg(feature = "dynamo-e2e")]

use crate::support;

use std::collections::BTreeSet;
use std::time::Duration;

use continuum_protocol::ids::{DpRank, InstanceId};
use continuum_router::daemon::Daemon;
use serde_json::{Value, json};
use support::dynamo::{DynamoStack, LEASE_TTL, MODEL, Signal, Topology, WorkerRole};
use tokio::time::Instant;

const TOKEN: &str = "failover-admin-token";
/// Requests after the killed worker was marked unreachable.
const AFTER_KILL: usize = 100;
/// Requests per phase of the aggregated transition.
const PER_PHASE: usize = 40;
/// Most warm-up requests before every worker has published a load sample.
const WARM_UP_LIMIT: usize = 200;

fn config_yaml(stack: &DynamoStack) -> String {
    format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\nadmin:\n  enabled: true\n  token: \"{TOKEN}\"\n\
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

/// Waits on load-store changes and registry generations (never on time) until `done` holds.
async fn until(daemon: &Daemon, limit: Duration, what: &str, done: impl Fn(&Daemon) -> bool) {
    let mut changes = daemon.load_store().subscribe();
    let mut generations = daemon.registry().subscribe();
    tokio::time::timeout(limit, async {
        while !done(daemon) {
            tokio::select! {
                r = changes.changed() => r.expect("store alive"),
                r = generations.changed() => r.expect("registry alive"),
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what} within {limit:?}"));
}

async fn admin_workers(daemon: &Daemon) -> Vec<Value> {
    let view: Value = reqwest::Client::new()
        .get(format!(
            "http://{}/admin/dynamo/workers",
            daemon.local_addr()
        ))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("admin")
        .json()
        .await
        .expect("json");
    view["workers"].as_array().cloned().unwrap_or_default()
}

/// One buffered chat completion through the router: (status, routing path, body).
async fn chat(client: &reqwest::Client, daemon: &Daemon, i: usize) -> (u16, String, String) {
    let resp = client
        .post(format!(
            "http://{}/v1/chat/completions",
            daemon.local_addr()
        ))
        .json(&json!({"model": MODEL, "max_tokens": 8,
                      "messages": [{"role": "user", "content": format!("failover {i}")}]}))
        .send()
        .await
        .expect("send");
    let status = resp.status().as_u16();
    let path = resp
        .headers()
        .get("x-continuum-routing-path")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    (status, path, resp.text().await.expect("body"))
}

/// The frontend's log from byte `from` on.
fn frontend_log(stack: &DynamoStack, from: usize) -> String {
    let raw = std::fs::read(stack.log_dir().join("frontend.log")).unwrap_or_default();
    strip_ansi(&String::from_utf8_lossy(&raw[from.min(raw.len())..]))
}

fn frontend_log_len(stack: &DynamoStack) -> usize {
    std::fs::metadata(stack.log_dir().join("frontend.log")).map_or(0, |m| m.len() as usize)
}

/// Worker ids the direct-mode frontend was asked for (`Selected worker ... worker_id=<decimal>`).
fn selected(log: &str) -> Vec<u64> {
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

fn has_sample(daemon: &Daemon, id: u64) -> bool {
    daemon
        .load_store()
        .latest(InstanceId(id), DpRank(0))
        .is_some()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_worker_is_left_out_until_its_lease_expires() {
    let mut stack = DynamoStack::start(Topology::Disagg).await;
    stack.add_worker(WorkerRole::Decode).await;
    let daemon = support::daemon::start(&config_yaml(&stack)).await;
    support::daemon::wait_for_workers(&daemon, 3).await;
    let client = reqwest::Client::new();

    // Warm up until every worker has published a load sample: the subscription learns which
    // worker its publisher serves from the samples (kv_metrics records carry only a publisher id).
    let ids: Vec<u64> = stack.workers().iter().map(|w| w.instance_id).collect();
    let mut sent = 0;
    while !ids.iter().all(|id| has_sample(&daemon, *id)) {
        assert!(sent < WARM_UP_LIMIT, "every worker published a sample");
        let (status, _, text) = chat(&client, &daemon, sent).await;
        assert_eq!(status, 200, "warm-up {sent}: {text}");
        sent += 1;
    }

    let killed = stack.stop_worker(WorkerRole::Decode, Signal::Kill).await;
    let kill_at = Instant::now();
    until(&daemon, Duration::from_secs(15), "unreachable mark", |d| {
        d.load_store().unreachable(InstanceId(killed)).is_some()
    })
    .await;
    let to_mark = kill_at.elapsed();
    let killed_id = killed.to_string();
    let row = admin_workers(&daemon)
        .await
        .into_iter()
        .find(|w| w["worker_id"] == killed_id.as_str())
        .expect("the killed worker is still registered within its lease");
    assert_eq!(row["reachable"], false, "{row}");

    let log_from = frontend_log_len(&stack);
    for i in 0..AFTER_KILL {
        let (status, path, text) = chat(&client, &daemon, i).await;
        assert_eq!(status, 200, "after SIGKILL, request {i}: {text}");
        assert_eq!(path, "disaggregated");
    }
    let after = selected(&frontend_log(&stack, log_from));
    // Each request names its prefill and its decode worker.
    assert_eq!(
        after.len(),
        2 * AFTER_KILL,
        "every pin reached the frontend"
    );
    assert!(
        !after.contains(&killed),
        "no request was pinned to the killed worker"
    );
    let survivors: BTreeSet<u64> = after.iter().copied().collect();
    assert_eq!(
        survivors.len(),
        2,
        "the prefill and the surviving decode worker"
    );
    let errors = daemon
        .metrics()
        .value("disaggregated_errors_total", &[("phase", "decode")])
        .unwrap_or(0.0);
    assert_eq!(errors, 0.0, "no shim failure");
    assert_eq!(
        daemon
            .metrics()
            .value("continuum_dynamo_workers_marked_unreachable_total", &[]),
        Some(1.0)
    );

    // The lease expires: the worker leaves the view, and its mark with it.
    until(
        &daemon,
        LEASE_TTL + Duration::from_secs(15),
        "the killed worker's lease expired",
        |d| {
            // The registry publishes first; the follower then drops the mark with the samples.
            d.registry()
                .snapshot()
                .workers()
                .iter()
                .all(|w| w.instance_id().0 != killed)
                && d.load_store().unreachable(InstanceId(killed)).is_none()
        },
    )
    .await;
    let to_leave = kill_at.elapsed();
    assert_eq!(
        daemon
            .metrics()
            .value("continuum_dynamo_unreachable_workers", &[]),
        Some(0.0)
    );
    println!(
        "SIGKILL: unreachable mark after {to_mark:?}, left the view after {to_leave:?} \
         ({sent} warm-up requests, {AFTER_KILL} requests after the mark, none pinned to it)"
    );
    daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregated_workers_take_over_only_after_the_disaggregated_pool_drains() {
    // Captures warnings through the global subscriber: in a process of its own.
    if !support::process::own_process(
        module_path!(),
        "aggregated_workers_take_over_only_after_the_disaggregated_pool_drains",
    ) {
        return;
    }
    capture_warnings();
    let mut stack = DynamoStack::start(Topology::Disagg).await;
    let daemon = support::daemon::start(&config_yaml(&stack)).await;
    support::daemon::wait_for_workers(&daemon, 2).await;
    let pool: BTreeSet<u64> = stack.workers().iter().map(|w| w.instance_id).collect();
    let agg: BTreeSet<u64> = [
        stack.add_worker(WorkerRole::Aggregated).await,
        stack.add_worker(WorkerRole::Aggregated).await,
    ]
    .into_iter()
    .collect();
    support::daemon::wait_for_workers(&daemon, 4).await;
    let client = reqwest::Client::new();

    // Mixed namespace: our router keeps pairing prefill and decode workers (aggregated workers sit
    // out) and the registry warns once. Real 1.6.1 cannot serve this fleet consistently, just as
    // the seed says of 1.5.0: its frontend logs "Adding worker set to model" once per
    // (component, worker type), picks one set per request and refuses a pin from the other, so a
    // share of these pinned pairs comes back as `400 Invalid request` (13, 16 and 17 of 40 served
    // in three runs). Aggregated-only pins sent straight to the frontend fail the same way (8 of
    // 40 answered `500`, "Prefill worker ID required"). That is outside the router's reach: the
    // assertions here are about what the router pinned, and operators must let the pool drain
    // before aggregated workers of the same model join the namespace.
    let log_from = frontend_log_len(&stack);
    let mut served = 0;
    for i in 0..PER_PHASE {
        let (status, path, text) = chat(&client, &daemon, i).await;
        if status == 200 {
            served += 1;
            assert_eq!(path, "disaggregated", "request {i}");
        } else {
            assert!(
                status == 502 && text.contains("shim answered 400"),
                "a mixed-fleet failure is the frontend refusing a pin, request {i}: {status} {text}"
            );
        }
    }
    let mixed: BTreeSet<u64> = selected(&frontend_log(&stack, log_from))
        .into_iter()
        .collect();
    assert!(
        mixed.is_subset(&pool) && served > 0,
        "only the prefill and decode workers were pinned: {mixed:?} (pool {pool:?})"
    );
    let metrics = daemon.metrics();
    let no_prefill = |m: &continuum_actors::metrics::Metrics| {
        m.value(
            "continuum_dynamo_selection_total",
            &[("role", "prefill"), ("reason", "no_prefill_pool")],
        )
        .unwrap_or(0.0)
    };
    assert_eq!(
        no_prefill(metrics),
        0.0,
        "every mixed-fleet pick was a pair"
    );
    let namespace = stack.namespace().to_owned();
    let warnings = || {
        LOGS.lock()
            .expect("log buffer")
            .lines()
            .filter(|l| l.contains(&namespace) && l.contains("beside a prefill/decode pool"))
            .count()
    };
    assert_eq!(warnings(), 1, "the mixed namespace is reported once");
    println!("mixed fleet: {served} of {PER_PHASE} pinned pairs served by the 1.6.1 frontend");
    let errors_before = metrics
        .value("disaggregated_errors_total", &[("phase", "decode")])
        .unwrap_or(0.0);

    // The pool drains (decode first, so no view ever holds a decode worker without prefill).
    stack.stop_worker(WorkerRole::Decode, Signal::Term).await;
    stack.stop_worker(WorkerRole::Prefill, Signal::Term).await;
    support::daemon::wait_for(
        daemon.registry(),
        Duration::from_secs(20),
        "only aggregated workers in the view",
        |s| s.workers().iter().all(|w| agg.contains(&w.instance_id().0)),
    )
    .await;
    let log_from = frontend_log_len(&stack);
    for i in 0..PER_PHASE {
        let (status, path, text) = chat(&client, &daemon, i).await;
        assert_eq!(status, 200, "after the pool drained, request {i}: {text}");
        assert_eq!(path, "aggregated", "request {i}");
    }
    let after: BTreeSet<u64> = selected(&frontend_log(&stack, log_from))
        .into_iter()
        .collect();
    assert_eq!(after, agg, "both aggregated workers took over");
    let errors = metrics
        .value("disaggregated_errors_total", &[("phase", "decode")])
        .unwrap_or(0.0);
    assert_eq!(
        errors, errors_before,
        "no shim failure after the view updated"
    );
    assert_eq!(no_prefill(metrics) as usize, PER_PHASE);
    assert_eq!(warnings(), 1, "draining the pool does not warn again");
    daemon.shutdown().await;
}

/// Log lines of the whole test process (the daemon under test installs no subscriber itself).
static LOGS: std::sync::Mutex<String> = std::sync::Mutex::new(String::new());

struct LogSink;

impl std::io::Write for LogSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        LOGS.lock()
            .expect("log buffer")
            .push_str(&String::from_utf8_lossy(buf));
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn capture_warnings() {
    let _ = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer(|| LogSink)
        .try_init();
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
