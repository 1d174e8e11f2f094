//! The etcd-record and percent-encoding cases of `tests/fixtures/vectors/discovery_examples.json`,
//! and the discovery records of one live 1.6.1 mocker (`mocker_observed.json`).

use continuum_protocol::discovery::keys::{ParsedKey, classify};
use continuum_protocol::discovery::{
    DiscoveryEventKind, DiscoveryReducer, EventTopic, Role, SourceEvent, decode_segment,
    encode_segment,
};
use continuum_protocol::ids::{DpRank, InstanceId, PublisherId, WorkerKey};
use continuum_protocol::time::UnixMillis;

use super::support::{ns, put, read_json};

fn examples() -> serde_json::Value {
    read_json("vectors/discovery_examples.json")
}

#[test]
fn percent_encoding_vectors_round_trip() {
    let ex = examples();
    let cases = ex["event_segment_percent_encoding"]
        .as_array()
        .expect("cases");
    assert!(cases.len() >= 10);
    for case in cases {
        let input = case["in"].as_str().expect("in");
        let output = case["out"].as_str().expect("out");
        assert_eq!(encode_segment(input), output, "encode {input:?}");
        assert_eq!(
            decode_segment(output).as_deref(),
            Ok(input),
            "decode {output:?}"
        );
    }
}

#[test]
fn event_scope_path_prefixes_parse_to_their_scopes() {
    let ex = examples();
    for case in ex["event_scope_examples"].as_array().expect("cases") {
        let scope = &case["scope"];
        let (namespace, component, endpoint) = match scope["kind"].as_str().expect("kind") {
            "namespace" => (scope["name"].as_str().expect("name"), None, None),
            "component" => (
                scope["namespace"].as_str().expect("ns"),
                scope["component"].as_str(),
                None,
            ),
            _ => (
                scope["endpoint"]["namespace"].as_str().expect("ns"),
                scope["endpoint"]["component"].as_str(),
                scope["endpoint"]["name"].as_str(),
            ),
        };
        let key = format!(
            "v1/event_channels/{}/topic/kv-events/1",
            case["path_prefix"].as_str().expect("path")
        );
        let Some((_, Ok(ParsedKey::Channel { scope: got, .. }))) = classify(namespace, &key) else {
            panic!("{key} did not parse for namespace {namespace}");
        };
        assert_eq!(got.namespace, namespace);
        assert_eq!(got.component.as_deref(), component, "{key}");
        assert_eq!(got.endpoint.as_deref(), endpoint, "{key}");
    }
}

#[test]
fn etcd_examples_give_one_aggregated_worker_and_two_publishers() {
    let ex = examples();
    let mut reducer = DiscoveryReducer::new(ns("dynamo"));
    reducer.apply(SourceEvent::Init, UnixMillis(1));
    for e in ex["etcd_examples"].as_array().expect("examples") {
        let key = e["key"].as_str().expect("key").to_owned();
        let value = serde_json::to_vec(&e["value"]).expect("json");
        reducer.apply(SourceEvent::InitApply { key, value }, UnixMillis(1));
    }
    assert!(reducer.apply(SourceEvent::InitDone, UnixMillis(1)));
    let view = reducer.view();
    assert_eq!(
        view.workers().len(),
        1,
        "the LoRA card never joins nor adds a worker"
    );
    let w = view
        .worker(InstanceId(7_587_888_921_470_146_835))
        .expect("worker");
    assert_eq!(w.role, Role::Aggregated);
    assert_eq!(w.model.as_deref(), Some("Qwen/Qwen3-0.6B"));
    assert_eq!(w.block_size, Some(16));
    assert_eq!(w.capacity.total_kv_blocks, Some(16_384));
    assert_eq!(w.capacity.context_length, Some(40_960));
    assert_eq!(view.publishers().len(), 2);
    let kv = view
        .publisher(PublisherId(6_203_785_128_840_361))
        .expect("kv-events");
    assert_eq!(kv.topic, EventTopic::KvEvents);
    assert_eq!(
        kv.worker,
        Some(WorkerKey {
            namespace: ns("dynamo"),
            instance_id: InstanceId(7_587_888_921_470_146_835)
        })
    );
    assert_eq!(kv.dp_rank, Some(DpRank(0)));
    assert_eq!(kv.address().authority(), "10.0.0.5:45731");
    assert_eq!(
        kv.subject(),
        ex["event_scope_examples"][2]["subject_for_kv_events"]
            .as_str()
            .expect("subject")
    );
    let load = view
        .publisher(PublisherId(5_249_132_588_543_811))
        .expect("kv_metrics");
    assert_eq!(load.topic, EventTopic::KvMetrics);
    assert!(
        reducer
            .take_counts()
            .iter()
            .all(|(k, _)| k == DiscoveryEventKind::Resync)
    );
}

#[test]
fn nats_and_broker_channels_are_unsupported() {
    let ex = examples();
    let mut reducer = DiscoveryReducer::new(ns("dynamo"));
    for (i, value) in ex["other_event_channel_transports"]
        .as_array()
        .expect("channels")
        .iter()
        .enumerate()
    {
        let key = format!(
            "v1/event_channels/namespace/dynamo/component/backend/endpoint/generate/topic/kv-events/{i}"
        );
        assert!(!reducer.apply(put(&key, value), UnixMillis(1)));
    }
    assert_eq!(reducer.view().publishers().len(), 0);
    assert_eq!(
        reducer.take_counts().get(DiscoveryEventKind::Unsupported),
        2
    );
}

#[test]
fn prefill_card_differences_give_a_prefill_worker_with_a_bootstrap_port() {
    let ex = examples();
    let diff = &ex["prefill_card_differences"];
    let base = &ex["etcd_examples"][1]["value"];
    let mut card = base.clone();
    card["component"] = "prefill".into();
    card["card_json"]["worker_type"] = diff["worker_type"].clone();
    card["card_json"]["needs"] = diff["needs"].clone();
    card["card_json"]["model_type"] = diff["model_type"].clone();
    card["card_json"]["runtime_config"]["disaggregated_endpoint"] =
        diff["runtime_config.disaggregated_endpoint"].clone();
    let mut endpoint = ex["etcd_examples"][0]["value"].clone();
    endpoint["component"] = "prefill".into();
    let mut reducer = DiscoveryReducer::new(ns("dynamo"));
    reducer.apply(
        put(
            "v1/instances/dynamo/prefill/generate/694d98c58f599913",
            &endpoint,
        ),
        UnixMillis(1),
    );
    reducer.apply(
        put("v1/mdc/dynamo/prefill/generate/694d98c58f599913", &card),
        UnixMillis(1),
    );
    let w = reducer
        .view()
        .worker(InstanceId(7_587_888_921_470_146_835))
        .expect("worker")
        .clone();
    assert_eq!(w.role, Role::Prefill);
    let admin = w.admin_json();
    assert_eq!(
        admin["disaggregated_endpoint"],
        serde_json::json!({"bootstrap_port": 41000})
    );
    assert!(
        !admin.to_string().contains("10.0.0.6"),
        "bootstrap host is internal"
    );
}

#[test]
fn kubernetes_metadata_records_reduce_like_etcd_records() {
    let ex = examples();
    let data = &ex["kubernetes_dwm_example"]["spec"]["data"];
    let mut reducer = DiscoveryReducer::new(ns("dynamo"));
    reducer.apply(SourceEvent::Init, UnixMillis(1));
    for (map, bucket) in [
        ("endpoints", "v1/instances"),
        ("model_cards", "v1/mdc"),
        ("event_channels", "v1/event_channels"),
        ("event_sources", "v1/event_sources"),
    ] {
        for (suffix, value) in data[map].as_object().expect("map") {
            reducer.apply(
                SourceEvent::InitApply {
                    key: format!("{bucket}/{suffix}"),
                    value: serde_json::to_vec(value).expect("json"),
                },
                UnixMillis(1),
            );
        }
    }
    reducer.apply(SourceEvent::InitDone, UnixMillis(1));
    let id = InstanceId(
        ex["kubernetes_instance_id"]["instance_id"]
            .as_u64()
            .expect("id"),
    );
    assert_eq!(
        id.hex(),
        ex["kubernetes_instance_id"]["hex"].as_str().expect("hex")
    );
    let w = reducer.view().worker(id).expect("worker");
    // The example's card_json is a placeholder string: the typed subset is unreadable, the raw
    // card is kept verbatim and the backend component claims no role.
    assert_eq!(w.role, Role::Unknown);
    assert!(matches!(
        w.card.as_ref().map(|c| c.value()),
        Some(serde_json::Value::String(_))
    ));
    let p = reducer
        .view()
        .publisher(PublisherId(6_203_785_128_840_361))
        .expect("publisher");
    assert_eq!(p.worker.as_ref().map(|k| k.instance_id), Some(id));
}

#[test]
fn live_mocker_records_give_one_aggregated_worker() {
    let observed = read_json("vectors/mocker_observed.json");
    let mut reducer = DiscoveryReducer::new(ns("dynamo"));
    for r in observed["file_backend_records_of_one_mocker"]["records"]
        .as_array()
        .expect("records")
    {
        reducer.apply(
            put(r["decoded_key"].as_str().expect("key"), &r["value"]),
            UnixMillis(1),
        );
    }
    let view = reducer.view();
    assert_eq!(view.workers().len(), 1);
    let w = view
        .worker(InstanceId(2_408_177_061_458_911_194))
        .expect("worker");
    assert_eq!(w.role, Role::Aggregated);
    assert_eq!(w.model.as_deref(), Some("tiny"));
    assert_eq!(w.capacity.total_kv_blocks, Some(256));
    assert_eq!(view.publishers().len(), 2, "kv-events and kv_metrics only");
    assert_eq!(reducer.take_counts().get(DiscoveryEventKind::Put), 8);
}
