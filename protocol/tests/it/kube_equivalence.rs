//! The Kubernetes metadata source yields the same fleet view as etcd: a real Dynamo 1.6.1 dump,
//! its workers re-identified by `hash_pod_name` of their Pod names (as on Kubernetes), is fed once
//! as etcd records and once wrapped as DynamoWorkerMetadata resources made ready by an
//! EndpointSlice; both go through the same reducer and must materialise identical views.

use crate::discovery::support;

use std::collections::BTreeMap;

use continuum_protocol::discovery::SourceEvent;
use continuum_protocol::discovery::reducer::DiscoveryReducer;
use continuum_protocol::ids::Namespace;
use continuum_protocol::kube::hash_pod_name;
use continuum_protocol::kube::metadata::{MetadataConfig, MetadataState};
use continuum_protocol::time::UnixMillis;
use serde_json::{Value, json};

const NS: &str = "dyntest";

/// (key, value) of the dump with worker ids replaced by hash_pod_name ids; also the Pod names.
fn reidentified(dump: &str) -> (Vec<(String, Value)>, BTreeMap<u64, String>) {
    let decoded = support::read_json(&format!("dynamo-1.6.1/etcd/{dump}.decoded.json"));
    let kvs = decoded["kvs"].as_array().expect("kvs");
    // One Pod per worker lease, named by role.
    let mut pods: BTreeMap<u64, String> = BTreeMap::new();
    for kv in kvs {
        let key = kv["key"].as_str().expect("key");
        if let Some(rest) = key.strip_prefix(&format!("v1/instances/{NS}/")) {
            let component = rest.split('/').next().expect("component");
            let lease = kv["lease_dec"].as_u64().expect("lease");
            let n = pods.len();
            pods.entry(lease)
                .or_insert_with(|| format!("{component}-{n}"));
        }
    }
    let remap: BTreeMap<u64, u64> = pods
        .iter()
        .map(|(old, pod)| (*old, hash_pod_name(pod).0))
        .collect();
    let records = kvs
        .iter()
        .filter_map(|kv| {
            let mut key = kv["key"].as_str()?.to_owned();
            let mut value = kv["value_json"].clone();
            if key.starts_with("v1/event_sources/") {
                return None;
            }
            for (old, new) in &remap {
                key = key.replace(&format!("/{old:x}"), &format!("/{new:x}"));
                if value["instance_id"].as_u64() == Some(*old) {
                    value["instance_id"] = json!(new);
                }
            }
            Some((key, value))
        })
        .collect();
    let pods = pods
        .into_iter()
        .map(|(old, pod)| (remap[&old], pod))
        .collect();
    (records, pods)
}

fn reduce(events: Vec<SourceEvent>) -> DiscoveryReducer {
    let mut reducer = DiscoveryReducer::new(Namespace::new(NS));
    for event in events {
        reducer.apply(event, UnixMillis(1_000));
    }
    reducer
}

fn resync(records: &[(String, Value)]) -> Vec<SourceEvent> {
    let mut events = vec![SourceEvent::Init];
    events.extend(records.iter().map(|(key, value)| SourceEvent::InitApply {
        key: key.clone(),
        value: serde_json::to_vec(value).expect("json"),
    }));
    events.push(SourceEvent::InitDone);
    events
}

/// Wraps each worker's records as a DynamoWorkerMetadata named after its Pod, plus one
/// EndpointSlice marking every Pod ready.
fn as_kubernetes(records: &[(String, Value)], pods: &BTreeMap<u64, String>) -> (Vec<Value>, Value) {
    let mut resources = Vec::new();
    let mut endpoints = Vec::new();
    for (id, pod) in pods {
        let hex = format!("/{id:x}");
        let mut data = json!({"endpoints": {}, "model_cards": {}, "event_channels": {}});
        for (key, value) in records {
            let (bucket, suffix) = if let Some(s) = key.strip_prefix("v1/instances/") {
                ("endpoints", s)
            } else if let Some(s) = key.strip_prefix("v1/mdc/") {
                ("model_cards", s)
            } else if let Some(s) = key.strip_prefix("v1/event_channels/") {
                ("event_channels", s)
            } else {
                continue;
            };
            let belongs = if bucket == "event_channels" {
                // Channels are keyed by publisher id: they belong to the worker of their scope's
                // component in these single-worker-per-component fleets.
                let component = value["scope"]["endpoint"]["component"]
                    .as_str()
                    .unwrap_or("");
                pod.starts_with(component)
            } else {
                key.ends_with(&hex)
            };
            if belongs {
                data[bucket][suffix] = value.clone();
            }
        }
        let uid = format!("pod-uid-{pod}");
        resources.push(json!({
            "metadata": {"name": pod, "uid": format!("dwm-uid-{pod}"),
                         "ownerReferences": [{"kind": "Pod", "name": pod, "uid": uid}]},
            "spec": {"data": data}
        }));
        endpoints.push(
            json!({"addresses": ["10.0.0.1"], "conditions": {"ready": true},
                              "targetRef": {"kind": "Pod", "name": pod, "uid": uid}}),
        );
    }
    (
        resources,
        json!({"metadata": {"name": "workers-abc"}, "endpoints": endpoints}),
    )
}

fn check(dump: &str) {
    let (records, pods) = reidentified(dump);
    assert!(pods.len() >= 2, "{dump}: workers found");
    let from_etcd = reduce(resync(&records));

    let (resources, slice) = as_kubernetes(&records, &pods);
    let resources: Vec<_> = resources
        .into_iter()
        .map(|r| serde_json::from_value(r).expect("resource"))
        .collect();
    let slices = vec![serde_json::from_value(slice).expect("slice")];
    let mut state = MetadataState::new(MetadataConfig {
        namespaces: vec![Namespace::new(NS)],
    });
    let step = state.relist(&resources, &slices);
    assert!(step.notes.is_empty(), "{dump}: {:?}", step.notes);
    let from_kube = reduce(step.events);

    let etcd_view = from_etcd.view();
    let kube_view = from_kube.view();
    assert!(etcd_view.workers().len() >= 2, "{dump}: a fleet");
    assert!(
        etcd_view.same_content(kube_view),
        "{dump}: views differ\netcd: {:#?}\nkube: {:#?}",
        etcd_view
            .workers()
            .map(|w| w.admin_json())
            .collect::<Vec<_>>(),
        kube_view
            .workers()
            .map(|w| w.admin_json())
            .collect::<Vec<_>>()
    );
    let publishers = |v: &continuum_protocol::discovery::view::NamespaceView| {
        v.publishers()
            .map(|p| (p.publisher_id, p.topic))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        publishers(etcd_view),
        publishers(kube_view),
        "{dump}: publishers"
    );
}

#[test]
fn disaggregated_fleet_is_the_same_through_kubernetes_metadata() {
    check("disagg-workers-only");
}

#[test]
fn aggregated_fleet_is_the_same_through_kubernetes_metadata() {
    check("agg-2workers");
}
