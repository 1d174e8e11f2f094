//! Router replicas sharing in-flight dispatches in front of real NVIDIA Dynamo 1.6.1 (issue 33,
//! `dynamo-e2e`): etcd, two aggregated `dynamo.mocker` workers registered by Dynamo itself, the
//! `--router-mode direct` frontend every replica pins through, three REAL router processes
//! (same config but `replica_id`) with `replica_sync` on and the settings recommended for replicas
//! (`dynamo.load.tie_break_window: 8`, `peer_slots: true`), and one real `nats-server`.
//!
//! Phases, each with concurrent client load spread round-robin over the live replicas:
//! 1. all three up: every request succeeds; every replica sees its two peers and has applied
//!    peer contributions;
//! 2. replica `a` SIGKILLed with requests of its own in flight: every request to `b` and `c`
//!    succeeds, and `a` (with its contributions) leaves both peers' views within its TTL;
//! 3. `nats-server` stopped: every request to `b` and `c` succeeds on local state; restarted on
//!    the same port: both reconnect, see each other again and apply each other's new
//!    contributions.
//!
//! Nothing is timed: every wait is bounded by the harness's limits; the figures (requests per
//! phase, time to expiry, time to resume) are printed for docs and issue notes. Harnesses:
//! `support::dynamo` and `support::replicas`.
#![cfg(all(feature = "dynamo-e2e", feature = "replica-sync"))]

use futures::future::join_all;
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::support::dynamo::{DynamoStack, MODEL, Topology};
use crate::support::replicas::{Nats, Replica, WAIT, sync_yaml};

/// Requests of the first phase (three replicas) and of each later phase (two replicas).
const FIRST: usize = 45;
const LATER: usize = 30;
/// Requests to `a` in flight when it is killed.
const DOOMED: usize = 12;

fn body(stack: &DynamoStack) -> String {
    format!(
        "disaggregated_serving:\n  enabled: true\n  fallback_to_unified: false\n\
         backends:\n  - name: dynamo-frontend\n    type: openai\n    url: \"{frontend}\"\n    \
         models: [\"{MODEL}\"]\n    health_check:\n      enabled: false\n\
         dynamo:\n  enabled: true\n  discovery:\n    etcd:\n      endpoints: [\"{etcd}\"]\n      \
         namespace: \"{ns}\"\n  load:\n    direct_allow_cidrs: [\"127.0.0.0/8\"]\n    \
         tie_break_window: 8\n    peer_slots: true\n  \
         shim:\n    backends: [dynamo-frontend]\n",
        frontend = stack.frontend_url(),
        etcd = stack.etcd_endpoint(),
        ns = stack.namespace(),
    )
}

fn request(i: usize, max_tokens: u64) -> Value {
    json!({"model": MODEL, "max_tokens": max_tokens, "messages": [{"role": "user",
           "content": format!("request {i}: {}", vec!["several words of prompt"; 8 + i % 5].join(" "))}]})
}

/// `n` concurrent requests spread round-robin over `replicas`; the statuses.
async fn burst(replicas: &[&Replica], n: usize, offset: usize) -> Vec<u16> {
    join_all((0..n).map(|i| {
        let r = replicas[i % replicas.len()];
        async move { r.chat_json(&request(offset + i, 8)).await }
    }))
    .await
}

fn assert_all_ok(phase: &str, statuses: &[u16]) {
    let ok = statuses.iter().filter(|&&s| s == 200).count();
    eprintln!(
        "replica sync e2e: {phase}: {} sent, {ok} ok",
        statuses.len()
    );
    assert_eq!(
        ok,
        statuses.len(),
        "{phase}: every request to a live replica succeeds: {statuses:?}"
    );
}

const APPLIED: &str = "continuum_replica_sync_contributions_applied_total";
const EXPIRED: &str = "continuum_replica_sync_contributions_expired_total";

/// Waits (bounded) until `r`'s `family` counter exceeds `floor`.
async fn counter_above(r: &Replica, family: &str, floor: f64) -> f64 {
    let deadline = Instant::now() + WAIT;
    loop {
        let value = r.metric(family).await;
        if value > floor {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "replica {}: {family} stayed at {value} (needs > {floor})",
            r.name
        );
        tokio::task::yield_now().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_over_nats_in_front_of_real_dynamo_and_survive_a_kill_and_a_nats_restart() {
    let started = Instant::now();
    let stack = DynamoStack::start(Topology::Agg).await;
    let mut nats = Nats::start().await;
    let body = body(&stack);
    let mut replicas: Vec<Replica> = ["a", "b", "c"]
        .into_iter()
        .map(|name| Replica::start(name, &format!("{body}{}", sync_yaml(name, &nats.url(), ""))))
        .collect();
    for r in &replicas {
        r.until(|v| {
            v["workers"].as_array().is_some_and(|w| w.len() == 2)
                && v["replica_sync"]["connected"] == true
                && Replica::peer_count(v) == 2
        })
        .await;
    }
    eprintln!(
        "replica sync e2e: stack and replicas ready in {:?}",
        started.elapsed()
    );

    // Phase 1: load over all three; each applies its two peers' in-flight dispatches.
    let all: Vec<&Replica> = replicas.iter().collect();
    assert_all_ok("three replicas", &burst(&all, FIRST, 0).await);
    for r in &replicas {
        let view = r.until(|v| Replica::peer_count(v) == 2).await;
        let others: Vec<&str> = ["a", "b", "c"]
            .into_iter()
            .filter(|n| *n != r.name)
            .collect();
        for other in others {
            assert!(Replica::peer(&view, other).is_some(), "{}: {view}", r.name);
        }
        let applied = counter_above(r, APPLIED, 0.0).await;
        eprintln!(
            "replica sync e2e: {} applied {applied} peer contributions",
            r.name
        );
    }

    // Phase 2: SIGKILL `a` with requests of its own in flight (held by its peers as its
    // contributions); `b` and `c` keep routing and forget `a` within its TTL.
    let expired_before = [
        replicas[1].metric(EXPIRED).await,
        replicas[2].metric(EXPIRED).await,
    ];
    // Spawned loops of requests, so `a` keeps dispatching while the watcher decides (the kill
    // fails what is in flight; a loop ends at its first failure).
    let url = format!("http://{}/v1/chat/completions", replicas[0].addr);
    let doomed: Vec<_> = (0..DOOMED)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move {
                let deadline = Instant::now() + WAIT + WAIT;
                let client = reqwest::Client::new();
                let mut sent = 0;
                while Instant::now() < deadline {
                    let body = request(1000 + i * 100 + sent, 8);
                    sent += 1;
                    let ok = client.post(&url).timeout(WAIT).json(&body).send().await;
                    if !ok.is_ok_and(|r| r.status().is_success()) {
                        break;
                    }
                }
                sent
            })
        })
        .collect();
    let watcher = async {
        // Kill once `b` holds some of `a`'s entries (bounded: kill anyway after the limit). `a`
        // may still publish an emptier snapshot before the kill lands, so the entries expired
        // are a figure, not an assertion; its leaving the peers' views is asserted.
        let deadline = Instant::now() + WAIT;
        while Instant::now() < deadline {
            if let Some(view) = replicas[1].workers_view().await
                && Replica::peer(&view, "a").is_some_and(|p| p["entries"].as_u64() > Some(0))
            {
                return true;
            }
            tokio::task::yield_now().await;
        }
        false
    };
    let watching = Instant::now();
    let held = watcher.await;
    replicas[0].kill();
    eprintln!(
        "replica sync e2e: watched {:?} before the kill",
        watching.elapsed()
    );
    let killed = Instant::now();
    let live: Vec<&Replica> = replicas[1..].iter().collect();
    let (statuses, expiry) = tokio::join!(burst(&live, LATER, 2000), async {
        for r in &live {
            r.until(|v| Replica::peer(v, "a").is_none()).await;
        }
        killed.elapsed()
    });
    assert_all_ok("after SIGKILL of a", &statuses);
    for r in &live {
        let view = r.until(|v| Replica::peer_count(v) == 1).await;
        let other = if r.name == "b" { "c" } else { "b" };
        assert!(Replica::peer(&view, other).is_some(), "{view}");
    }
    let expired = [
        live[0].metric(EXPIRED).await - expired_before[0],
        live[1].metric(EXPIRED).await - expired_before[1],
    ];
    eprintln!(
        "replica sync e2e: b showed entries of a just before the kill: {held}; a gone at b and \
         c after {expiry:?} (ttl 1s); entries of a's last snapshot expired at b, c: {expired:?}"
    );
    let mut to_a = 0;
    for task in doomed {
        to_a += task.await.unwrap_or(0);
    }
    eprintln!("replica sync e2e: {to_a} requests sent to a around its kill (not counted)");

    // Phase 3: stop nats-server: routing continues on local state; restart it: sharing resumes.
    nats.stop();
    for r in &live {
        r.until(|v| v["replica_sync"]["connected"] == false).await;
    }
    assert_all_ok("nats-server down", &burst(&live, LATER, 3000).await);
    let applied_before = [live[0].metric(APPLIED).await, live[1].metric(APPLIED).await];
    nats.restart().await;
    let restarted = Instant::now();
    for r in &live {
        let other = if r.name == "b" { "c" } else { "b" };
        r.until(|v| {
            v["replica_sync"]["connected"] == true
                && Replica::peer(v, other).is_some_and(|p| p["last_seen_ms"].as_u64() < Some(300))
        })
        .await;
    }
    let resumed = restarted.elapsed();
    assert_all_ok("nats-server restarted", &burst(&live, LATER, 4000).await);
    for (r, before) in live.iter().zip(applied_before) {
        counter_above(r, APPLIED, before).await;
    }
    eprintln!(
        "replica sync e2e: sharing resumed (both connected, each seeing the other) {resumed:?} \
         after the restart; test took {:?}",
        started.elapsed()
    );
}
