//! The load-signal families' tests: closed label sets, pre-initialised series, worker gauges
//! that leave with their worker.

use std::collections::BTreeSet;

use continuum_protocol::ids::{InstanceId, Namespace};

use super::*;
use crate::metrics::testing::{check_closed, metrics};

fn worker(ns: &str, id: u64) -> WorkerKey {
    WorkerKey {
        namespace: Namespace::new(ns),
        instance_id: InstanceId(id),
    }
}

#[test]
fn labels_are_closed_and_spelled_as_the_seed() {
    check_closed(&LoadEventResult::ALL, LoadEventResult::as_label);
    check_closed(SubscriptionState::ALL, SubscriptionState::as_label);
    check_closed(SubscriptionTransport::ALL, SubscriptionTransport::as_label);
    let load: BTreeSet<_> = LoadEventResult::ALL.iter().map(|r| r.as_label()).collect();
    for result in [
        "malformed",
        "unknown_version",
        "topic_mismatch",
        "oversized",
        "identity_mismatch",
        "over_capacity",
        "transport_refused",
    ] {
        assert!(load.contains(result), "{result}");
    }
    let states: BTreeSet<_> = SubscriptionState::ALL
        .iter()
        .map(|s| s.as_label())
        .collect();
    assert_eq!(
        states,
        ["pending", "connecting", "connected", "backoff"]
            .into_iter()
            .collect()
    );
}

#[test]
fn closed_sets_start_at_zero_and_move_by_typed_labels() {
    let metrics = metrics();
    let load = metrics.register::<LoadMetrics>().expect("registers");
    let text = metrics.render();
    for family in [
        "continuum_dynamo_load_events_total",
        "continuum_dynamo_load_subscriptions",
        "continuum_dynamo_kv_subscriptions",
        "continuum_dynamo_unreachable_workers",
        "continuum_dynamo_workers_marked_unreachable_total",
    ] {
        assert!(text.contains(&format!("# TYPE {family} ")), "{family}");
    }
    assert!(
        text.contains(r#"continuum_dynamo_kv_subscriptions{state="backoff",transport="broker"} 0"#)
    );
    assert!(!text.contains("continuum_dynamo_worker_kv_used_blocks{"));
    load.load_events(LoadEventResult::Applied, 5);
    load.load_event(LoadEventResult::Applied);
    load.set_load_subscriptions(
        SubscriptionState::Connected,
        SubscriptionTransport::Direct,
        3,
    );
    load.set_kv_subscriptions(SubscriptionState::Backoff, SubscriptionTransport::Broker, 2);
    load.workers_marked_unreachable(2);
    load.set_unreachable_workers(1);
    let v = |family: &str, labels: &[(&str, &str)]| metrics.value(family, labels);
    assert_eq!(
        v(
            "continuum_dynamo_load_events_total",
            &[("result", "applied")]
        ),
        Some(6.0)
    );
    assert_eq!(
        v(
            "continuum_dynamo_load_subscriptions",
            &[("state", "connected"), ("transport", "direct")]
        ),
        Some(3.0)
    );
    assert_eq!(
        v(
            "continuum_dynamo_kv_subscriptions",
            &[("state", "backoff"), ("transport", "broker")]
        ),
        Some(2.0)
    );
    assert_eq!(
        v("continuum_dynamo_workers_marked_unreachable_total", &[]),
        Some(2.0)
    );
    assert_eq!(v("continuum_dynamo_unreachable_workers", &[]), Some(1.0));
}

#[test]
fn worker_gauges_export_present_fields_and_are_removed_on_departure() {
    let metrics = metrics();
    let load = metrics.register::<LoadMetrics>().expect("registers");
    let a = worker("dynamo", 0x1a7f2b);
    let b = worker("dynamo", 0xbeef);
    load.set_worker_load(
        &a,
        DpRank(0),
        WorkerLoadGauges {
            active_decode_blocks: Some(7),
            active_prefill_tokens: None,
            kv_used_blocks: Some(9),
        },
    );
    load.set_worker_load(
        &a,
        DpRank(1),
        WorkerLoadGauges {
            active_decode_blocks: Some(1),
            ..WorkerLoadGauges::default()
        },
    );
    load.set_worker_load(
        &b,
        DpRank(0),
        WorkerLoadGauges {
            kv_used_blocks: Some(u64::MAX),
            ..WorkerLoadGauges::default()
        },
    );
    let labels = |w: &str, r: &'static str| {
        [("namespace", "dynamo"), ("worker", w), ("dp_rank", r)].map(|(k, v)| (k, v.to_owned()))
    };
    let v = |family: &str, w: &str, r: &'static str| {
        let owned = labels(w, r);
        let pairs: Vec<(&str, &str)> = owned.iter().map(|(k, v)| (*k, v.as_str())).collect();
        metrics.value(family, &pairs)
    };
    assert_eq!(
        v(
            "continuum_dynamo_worker_active_decode_blocks",
            "1a7f2b",
            "0"
        ),
        Some(7.0)
    );
    assert_eq!(
        v("continuum_dynamo_worker_kv_used_blocks", "1a7f2b", "0"),
        Some(9.0)
    );
    // A nil field exports no series.
    assert_eq!(
        v(
            "continuum_dynamo_worker_active_prefill_tokens",
            "1a7f2b",
            "0"
        ),
        None
    );
    assert_eq!(
        v(
            "continuum_dynamo_worker_active_decode_blocks",
            "1a7f2b",
            "1"
        ),
        Some(1.0)
    );
    // u64 beyond i64 saturates instead of wrapping negative.
    assert_eq!(
        v("continuum_dynamo_worker_kv_used_blocks", "beef", "0"),
        Some(i64::MAX as f64)
    );

    // A later sample with the field now nil removes that series.
    load.set_worker_load(
        &a,
        DpRank(0),
        WorkerLoadGauges {
            active_decode_blocks: Some(8),
            ..WorkerLoadGauges::default()
        },
    );
    assert_eq!(
        v("continuum_dynamo_worker_kv_used_blocks", "1a7f2b", "0"),
        None
    );
    assert_eq!(
        v(
            "continuum_dynamo_worker_active_decode_blocks",
            "1a7f2b",
            "0"
        ),
        Some(8.0)
    );

    load.remove_worker(&a);
    assert_eq!(
        v(
            "continuum_dynamo_worker_active_decode_blocks",
            "1a7f2b",
            "0"
        ),
        None
    );
    assert_eq!(
        v(
            "continuum_dynamo_worker_active_decode_blocks",
            "1a7f2b",
            "1"
        ),
        None
    );
    assert_eq!(
        v("continuum_dynamo_worker_kv_used_blocks", "beef", "0"),
        Some(i64::MAX as f64)
    );

    load.retain_workers(|key| key != &b);
    assert!(!metrics.render().contains("worker=\"beef\""));
    // Removing an unknown worker is a no-op, not a panic.
    load.remove_worker(&worker("other", 1));
}
