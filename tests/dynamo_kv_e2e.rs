//! kv-events from real NVIDIA Dynamo 1.6.1 into our bounded index: with `dynamo.kv.enabled`, the
//! daemon subscribes to every aggregated mocker's kv-events publisher; requests routed through
//! it make the workers store blocks, and the stored events land in the index as `applied`.
#![cfg(feature = "dynamo-e2e")]

mod support {
    pub mod daemon;
    pub mod dynamo;
    pub mod etcd;
}

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
