//! The Dynamo shim path through the daemon, against a real etcd holding the workers real Dynamo
//! 1.6.1 registered and fake OpenAI upstreams standing in for the direct-mode frontend and a
//! unified backend: decimal pins (and rank headers, since 1.6.1 cards declare
//! `data_parallel_size`) reach the shim, client pins never do; a failing shim falls back to
//! unified routing without pins, or answers `disaggregated_decode_failed`; a direct-mode prefill
//! refusal is a 503 without retry. Request-level refusals (real 1.6.1's 500 with its JSON error
//! body) leave the shim replica's breaker closed; gateway errors open it.
#![cfg(feature = "real-peers")]

use crate::support;

use continuum_router::daemon::Daemon;
use etcd_client::PutOptions;
use serde_json::{Value, json};
use support::etcd::{EtcdServer, captured_kvs};
use support::upstream::{FakeUpstream, Reply, completion};

async fn fleet() -> (EtcdServer, Vec<u64>) {
    let etcd = EtcdServer::start().await;
    let mut client = etcd.client().await;
    let kvs = captured_kvs("disagg-workers-only.raw.json");
    let lease = client.lease_grant(60, None).await.expect("lease").id();
    for kv in &kvs {
        client
            .put(
                kv.key.clone(),
                kv.value.clone(),
                Some(PutOptions::new().with_lease(lease)),
            )
            .await
            .expect("put");
    }
    let mut ids: Vec<u64> = kvs
        .iter()
        .filter(|kv| kv.key.starts_with("v1/instances/") && kv.key.contains("/generate/"))
        .map(|kv| kv.lease as u64)
        .collect();
    ids.sort();
    ids.dedup();
    (etcd, ids)
}

async fn daemon(
    etcd: &EtcdServer,
    shim: &FakeUpstream,
    unified: &FakeUpstream,
    fallback: bool,
) -> Daemon {
    let yaml = format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\n\
         disaggregated_serving:\n  enabled: true\n  fallback_to_unified: {fallback}\n\
         backends:\n  - name: shim\n    type: openai\n    url: \"{}\"\n    models: [tiny]\n    \
         health_check:\n      enabled: false\n  - name: unified\n    type: openai\n    url: \"{}\"\n    \
         models: [tiny]\n    health_check:\n      enabled: false\n\
         dynamo:\n  enabled: true\n  discovery:\n    etcd:\n      endpoints: [\"{}\"]\n      \
         namespace: dyntest\n  shim:\n    backends: [shim]\n",
        shim.url(),
        unified.url(),
        etcd.endpoint()
    );
    let daemon = support::daemon::start(&yaml).await;
    support::daemon::wait_for_workers(&daemon, 2).await;
    daemon
}

async fn chat(daemon: &Daemon) -> (u16, Value) {
    let resp = reqwest::Client::new()
        .post(format!("http://{}/v1/chat/completions", daemon.local_addr()))
        .header("x-dynamo-worker-instance-id", "1")
        .header("x-worker-instance-id", "1")
        .json(&json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                      "nvext": {"backend_instance_id": 1, "prefill_worker_id": 2, "decode_worker_id": 3}}))
        .send()
        .await
        .expect("send");
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pins_reach_the_shim_and_failures_follow_the_seed() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (etcd, ids) = fleet().await;
    let mut shim = FakeUpstream::start().await;
    let mut unified = FakeUpstream::start().await;
    let daemon = daemon(&etcd, &shim, &unified, true).await;

    // 1. Pinned: both decimal ids of the real workers, rank 0 headers, no client pins.
    shim.push(Reply::Json(http::StatusCode::OK, completion("ok"), vec![]));
    let (status, _) = chat(&daemon).await;
    assert_eq!(status, 200);
    let seen = shim.next_request().await;
    let header = |name: &str| {
        seen.headers
            .get(name)
            .map(|v| v.to_str().expect("ascii").to_string())
    };
    let mut pinned: Vec<u64> = [
        header("x-dynamo-worker-instance-id"),
        header("x-dynamo-prefill-instance-id"),
    ]
    .into_iter()
    .map(|v| v.expect("both pins").parse().expect("decimal"))
    .collect();
    pinned.sort();
    assert_eq!(pinned, ids, "the real workers' ids, in decimal");
    assert_eq!(header("x-dynamo-dp-rank").as_deref(), Some("0"));
    assert!(header("x-worker-instance-id").is_none());
    assert!(seen.json()["nvext"].get("backend_instance_id").is_none());

    // 2. A failing shim falls back to unified routing, without any pin.
    shim.push(Reply::status(500));
    unified.push(Reply::Json(
        http::StatusCode::OK,
        completion("fallback"),
        vec![],
    ));
    let (status, body) = chat(&daemon).await;
    assert_eq!(status, 200, "{body}");
    let _ = shim.next_request().await;
    let fell_back = unified.next_request().await;
    assert!(
        fell_back
            .headers
            .keys()
            .all(|k| !k.as_str().starts_with("x-dynamo-"))
    );
    let errors = daemon
        .metrics()
        .value("disaggregated_errors_total", &[("phase", "decode")])
        .unwrap_or(0.0);
    assert_eq!(errors, 1.0);

    // 3. A direct-mode prefill refusal is a 503 without retry or fallback.
    shim.push(Reply::Json(
        http::StatusCode::INTERNAL_SERVER_ERROR,
        json!({"message": "Prefill worker ID required in Direct routing mode but none found in request."}),
        vec![],
    ));
    let (status, body) = chat(&daemon).await;
    assert_eq!(status, 503);
    assert_eq!(
        body["error"]["code"],
        "disaggregated_prefill_decode_unavailable"
    );
    let _ = shim.next_request().await;
    assert!(
        unified.try_request().is_none(),
        "no fallback after a prefill refusal"
    );
    daemon.shutdown().await;

    // 4. Without fallback_to_unified a failing shim is disaggregated_decode_failed.
    let daemon = self::daemon(&etcd, &shim, &unified, false).await;
    shim.push(Reply::status(502));
    let (status, body) = chat(&daemon).await;
    assert_eq!(status, 502);
    assert_eq!(body["error"]["code"], "disaggregated_decode_failed");
    daemon.shutdown().await;
}

/// The response body of a real 1.6.1 refusal (a pin without its prefill id), from the transcript.
fn refusal_body() -> Value {
    let transcript = include_str!("../fixtures/dynamo-1.6.1/transcripts/02-decode-only-dec.txt");
    let line = transcript
        .lines()
        .find(|l| l.starts_with("{\"message\""))
        .expect("the transcript holds the response body");
    serde_json::from_str(line).expect("JSON error body")
}

/// Ten 1.6.1 refusals in a row (as stale pins during a rollout produce) each reach the shim
/// replica: its breaker stays closed, and the eleventh request is served. Before the fix every
/// 5xx counted, so the breaker of a healthy replica opened after five. Five 503s still open it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_leave_the_breaker_closed_and_gateway_errors_open_it() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (etcd, _) = fleet().await;
    let mut shim = FakeUpstream::start().await;
    let unified = FakeUpstream::start().await;
    let daemon = daemon(&etcd, &shim, &unified, false).await;
    let body = refusal_body();
    assert_eq!(body["code"], 500);

    let mut reached = 0;
    for _ in 0..10 {
        shim.push(Reply::Json(
            http::StatusCode::INTERNAL_SERVER_ERROR,
            body.clone(),
            vec![],
        ));
        let (status, answer) = chat(&daemon).await;
        assert_ne!(status, 200, "{answer}");
        if shim.try_request().is_some() {
            reached += 1;
        }
    }
    eprintln!("refusals that reached the shim replica: {reached} of 10");
    assert_eq!(reached, 10, "the breaker opened on refusals");
    shim.push(Reply::Json(http::StatusCode::OK, completion("ok"), vec![]));
    let (status, answer) = chat(&daemon).await;
    assert_eq!(status, 200, "{answer}");
    assert!(shim.try_request().is_some());

    // Gateway-class answers still open it: after five 503s the sixth request never reaches it.
    for _ in 0..5 {
        shim.push(Reply::status(503));
        let _ = chat(&daemon).await;
        assert!(shim.try_request().is_some());
    }
    let (status, _) = chat(&daemon).await;
    assert_ne!(status, 200);
    assert!(shim.try_request().is_none(), "the breaker is open");
    daemon.shutdown().await;
}

/// A direct-mode refusal in a streaming request's non-2xx head (the frontend's JSON 500) is the
/// seed's 503 on the chat route and on the Anthropic Messages and Responses ingresses, which send
/// through it; nothing falls back. Issue #35: it was 502 `disaggregated_decode_failed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_in_a_streaming_head_is_the_seed_503_on_every_ingress() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (etcd, _) = fleet().await;
    let mut shim = FakeUpstream::start().await;
    let mut unified = FakeUpstream::start().await;
    let daemon = daemon(&etcd, &shim, &unified, false).await;
    let client = reqwest::Client::new();
    let messages = json!([{"role": "user", "content": "hi"}]);
    for (path, body) in [
        (
            "/v1/chat/completions",
            json!({"model": "tiny", "stream": true, "messages": messages}),
        ),
        (
            "/v1/messages",
            json!({"model": "tiny", "stream": true, "max_tokens": 16, "messages": messages}),
        ),
        (
            "/v1/responses",
            json!({"model": "tiny", "stream": true, "input": "hi"}),
        ),
    ] {
        shim.push(Reply::Json(
            http::StatusCode::INTERNAL_SERVER_ERROR,
            json!({"message": "Prefill worker ID required in Direct routing mode but none found in request."}),
            vec![],
        ));
        let resp = client
            .post(format!("http://{}{path}", daemon.local_addr()))
            .json(&body)
            .send()
            .await
            .expect("send");
        let status = resp.status().as_u16();
        let answer: Value = resp.json().await.unwrap_or(Value::Null);
        assert_eq!(status, 503, "{path}: {answer}");
        let error = &answer["error"];
        let refused = error["code"] == "disaggregated_prefill_decode_unavailable"
            || error["message"]
                .as_str()
                .is_some_and(|m| m.ends_with("disaggregated_prefill_decode_unavailable"));
        assert!(refused, "{path}: {answer}");
        let _ = shim.next_request().await;
        assert!(unified.try_request().is_none(), "{path}: no fallback");
    }
    daemon.shutdown().await;
}
