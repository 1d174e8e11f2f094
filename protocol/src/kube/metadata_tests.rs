//! One test per metadata-source rule, around the wire spec's Kubernetes example (worker-0).

use serde_json::{Value, json};

use super::*;

const EXAMPLES: &str = include_str!("testdata/discovery_examples_kube.json");

const ENDPOINT_KEY: &str = "v1/instances/dynamo/backend/generate/43710f49c0cff";
const CARD_KEY: &str = "v1/mdc/dynamo/backend/generate/43710f49c0cff";
const CHANNEL_KEY: &str = "v1/event_channels/namespace/dynamo/component/backend/endpoint/generate/topic/kv-events/160a4f48de0ca9";
const OWNER_UID: &str = "6f1c2a9e-3b7d-4c1e-9a51-0d2f7e8b4c33";

fn examples() -> Value {
    serde_json::from_str(EXAMPLES).expect("examples are JSON")
}

/// The wire spec's worker-0 resource, with the etcd example's card in place of the placeholder.
fn example_json() -> Value {
    let ex = examples();
    let mut dwm = ex["kubernetes_dwm_example"].clone();
    dwm["metadata"]["uid"] = json!("dwm-uid-0");
    let card = ex["etcd_examples"][1]["value"]["card_json"].clone();
    dwm["spec"]["data"]["model_cards"]["dynamo/backend/generate/43710f49c0cff"]["card_json"] = card;
    dwm
}

fn dwm(v: Value) -> DynamoWorkerMetadata {
    serde_json::from_value(v).expect("test resource decodes")
}

fn example() -> DynamoWorkerMetadata {
    dwm(example_json())
}

fn slice(name: &str, targets: &[(&str, &str, bool)]) -> EndpointSlice {
    let endpoints: Vec<Value> = targets
        .iter()
        .map(|(pod, uid, ready)| {
            json!({
                "addresses": ["10.244.1.17"],
                "conditions": {"ready": ready},
                "targetRef": {"kind": "Pod", "name": pod, "uid": uid}
            })
        })
        .collect();
    serde_json::from_value(json!({"metadata": {"name": name}, "endpoints": endpoints}))
        .expect("test slice decodes")
}

fn ready_slice() -> EndpointSlice {
    slice("backend-abc", &[("worker-0", OWNER_UID, true)])
}

fn state() -> MetadataState {
    MetadataState::new(MetadataConfig {
        namespaces: vec![Namespace::new("dynamo")],
    })
}

fn keys(events: &[SourceEvent]) -> Vec<String> {
    events
        .iter()
        .map(|e| match e {
            SourceEvent::Init => "Init".to_owned(),
            SourceEvent::InitDone => "InitDone".to_owned(),
            SourceEvent::InitApply { key, .. } => format!("InitApply {key}"),
            SourceEvent::Apply { key, .. } => format!("Apply {key}"),
            SourceEvent::Delete { key } => format!("Delete {key}"),
        })
        .collect()
}

fn fed_json(st: &MetadataState) -> BTreeMap<String, Value> {
    st.fed()
        .map(|(k, v)| (k.to_owned(), serde_json::from_slice(v).expect("fed JSON")))
        .collect()
}

fn ready_state() -> MetadataState {
    let mut st = state();
    st.apply_slice(&ready_slice());
    st.apply_resource(&example());
    st
}

#[test]
fn a_ready_resource_feeds_exactly_the_etcd_records() {
    // Events come in key order, as an etcd range read returns them.
    let mut st = state();
    assert!(st.apply_slice(&ready_slice()).events.is_empty());
    let step = st.apply_resource(&example());
    assert!(step.notes.is_empty(), "{:?}", step.notes);
    assert_eq!(
        keys(&step.events),
        vec![
            format!("Apply {CHANNEL_KEY}"),
            format!("Apply {ENDPOINT_KEY}"),
            format!("Apply {CARD_KEY}"),
        ]
    );
    let fed = fed_json(&st);
    let data = &example_json()["spec"]["data"];
    assert_eq!(
        fed[ENDPOINT_KEY],
        data["endpoints"]["dynamo/backend/generate/43710f49c0cff"]
    );
    assert_eq!(
        fed[CARD_KEY],
        data["model_cards"]["dynamo/backend/generate/43710f49c0cff"]
    );
    // The channel value is what etcd holds: the legacy namespace/component members are gone.
    let mut channel = data["event_channels"]
        ["namespace/dynamo/component/backend/endpoint/generate/topic/kv-events/160a4f48de0ca9"]
        .clone();
    let obj = channel.as_object_mut().expect("object");
    obj.remove("namespace");
    obj.remove("component");
    assert_eq!(fed[CHANNEL_KEY], channel);
    // Same shape as the etcd example's channel record (ids and addresses aside).
    let etcd_channel = &examples()["etcd_examples"][3]["value"];
    let mut a: Vec<_> = fed[CHANNEL_KEY].as_object().expect("o").keys().collect();
    let mut b: Vec<_> = etcd_channel.as_object().expect("o").keys().collect();
    a.sort();
    b.sort();
    assert_eq!(a, b);
    // event_sources are not fed.
    assert!(st.fed().all(|(k, _)| !k.starts_with("v1/event_sources/")));
}

#[test]
fn the_example_resource_name_hashes_to_its_record_ids() {
    let ex = examples();
    let pod = ex["kubernetes_instance_id"]["pod"].as_str().expect("pod");
    let id = ex["kubernetes_instance_id"]["instance_id"]
        .as_u64()
        .expect("id");
    assert_eq!(hash_pod_name(pod), InstanceId(id));
}

#[test]
fn resources_wait_for_a_ready_endpoint() {
    let mut st = state();
    assert!(st.apply_resource(&example()).events.is_empty());
    let up = st.apply_slice(&ready_slice());
    assert_eq!(up.events.len(), 3);
    let down = st.apply_slice(&slice("backend-abc", &[("worker-0", OWNER_UID, false)]));
    assert_eq!(
        keys(&down.events),
        vec![
            format!("Delete {CHANNEL_KEY}"),
            format!("Delete {ENDPOINT_KEY}"),
            format!("Delete {CARD_KEY}"),
        ]
    );
    assert_eq!(st.fed().count(), 0);
}

#[test]
fn a_slice_deletion_removes_readiness() {
    let mut st = ready_state();
    assert_eq!(st.delete_slice("backend-abc").events.len(), 3);
    assert_eq!(st.fed().count(), 0);
}

#[test]
fn endpoints_for_another_pod_name_do_not_count() {
    let mut st = state();
    st.apply_slice(&slice("s", &[("worker-1", OWNER_UID, true)]));
    assert!(st.apply_resource(&example()).events.is_empty());
}

#[test]
fn a_new_pod_incarnation_does_not_inherit_old_metadata() {
    let mut st = state();
    st.apply_slice(&slice("s", &[("worker-0", "new-pod-uid", true)]));
    assert!(st.apply_resource(&example()).events.is_empty());
    // The matching incarnation's endpoint makes it live.
    let step = st.apply_slice(&slice("s", &[("worker-0", OWNER_UID, true)]));
    assert_eq!(step.events.len(), 3);
}

#[test]
fn endpoint_updates_toggle_only_affected_resources() {
    let mut st = ready_state();
    // Another unrelated endpoint joins the same slice: nothing for worker-0 changes.
    let step = st.apply_slice(&slice(
        "backend-abc",
        &[("worker-0", OWNER_UID, true), ("worker-9", "u9", true)],
    ));
    assert!(step.events.is_empty());
}

#[test]
fn container_mode_resources_are_refused_once() {
    let mut st = state();
    st.apply_slice(&slice("s", &[("worker-0", OWNER_UID, true)]));
    let mut v = example_json();
    v["metadata"]["name"] = json!("worker-0-engine-0");
    let step = st.apply_resource(&dwm(v.clone()));
    assert!(step.events.is_empty());
    assert_eq!(step.notes.len(), 1);
    assert_eq!(step.notes[0].kind, NoteKind::Refused);
    assert!(st.apply_resource(&dwm(v)).notes.is_empty(), "counted once");
}

#[test]
fn a_key_id_mismatch_refuses_the_whole_resource_once() {
    let mut st = state();
    st.apply_slice(&ready_slice());
    let mut v = example_json();
    let endpoints = v["spec"]["data"]["endpoints"].as_object_mut().expect("map");
    let record = endpoints
        .remove("dynamo/backend/generate/43710f49c0cff")
        .expect("record");
    endpoints.insert("dynamo/backend/generate/15e9c1a30c211e".into(), record);
    let step = st.apply_resource(&dwm(v.clone()));
    assert!(step.events.is_empty(), "nothing of the resource is fed");
    assert_eq!(step.notes.len(), 1);
    assert_eq!(step.notes[0].kind, NoteKind::Mismatch);
    assert!(st.apply_resource(&dwm(v)).notes.is_empty(), "counted once");
}

#[test]
fn a_value_id_mismatch_on_a_card_refuses_the_resource() {
    let mut st = ready_state();
    let mut v = example_json();
    v["spec"]["data"]["model_cards"]["dynamo/backend/generate/43710f49c0cff"]["instance_id"] =
        json!(7);
    let step = st.apply_resource(&dwm(v));
    assert_eq!(step.notes[0].kind, NoteKind::Mismatch);
    // The previously fed records leave.
    assert_eq!(step.events.len(), 3);
    assert_eq!(st.fed().count(), 0);
}

#[test]
fn event_channels_are_exempt_from_the_id_check() {
    let mut st = ready_state();
    let mut v = example_json();
    v["spec"]["data"]["event_channels"]["namespace/dynamo/component/backend/endpoint/generate/topic/kv-events/160a4f48de0ca9"]
        ["instance_id"] = json!(99);
    let step = st.apply_resource(&dwm(v));
    assert!(step.notes.is_empty());
    assert_eq!(keys(&step.events), vec![format!("Apply {CHANNEL_KEY}")]);
}

#[test]
fn updates_refeed_only_modified_records() {
    let mut st = ready_state();
    let mut v = example_json();
    v["spec"]["data"]["endpoints"]["dynamo/backend/generate/43710f49c0cff"]["transport"] =
        json!({"tcp": "10.244.1.18:37113/43710f49c0cff/dynamo/backend/generate"});
    let step = st.apply_resource(&dwm(v));
    assert_eq!(keys(&step.events), vec![format!("Apply {ENDPOINT_KEY}")]);
    // An identical re-apply changes nothing.
    let mut v = example_json();
    v["spec"]["data"]["endpoints"]["dynamo/backend/generate/43710f49c0cff"]["transport"] =
        json!({"tcp": "10.244.1.18:37113/43710f49c0cff/dynamo/backend/generate"});
    assert!(st.apply_resource(&dwm(v.clone())).events.is_empty());
    // Removing a record deletes just that key.
    v["spec"]["data"]["event_channels"] = Value::Null;
    assert_eq!(
        keys(&st.apply_resource(&dwm(v)).events),
        vec![format!("Delete {CHANNEL_KEY}")]
    );
}

#[test]
fn deleting_a_resource_removes_its_keys() {
    let mut st = ready_state();
    assert_eq!(st.delete_resource("worker-0").events.len(), 3);
    assert_eq!(st.fed().count(), 0);
    assert_eq!(st.resource_count(), 0);
    assert_eq!(st.held_bytes(), 0);
}

/// A second worker (worker-1) contributing the same channel key with its own value.
fn second_worker(channel_endpoint: &str) -> DynamoWorkerMetadata {
    let mut v = example_json();
    v["metadata"]["name"] = json!("worker-1");
    v["metadata"]["uid"] = json!("dwm-uid-1");
    v["metadata"]["ownerReferences"][0]["name"] = json!("worker-1");
    v["metadata"]["ownerReferences"][0]["uid"] = json!("pod-uid-1");
    let data = &mut v["spec"]["data"];
    data["endpoints"] = Value::Null;
    data["model_cards"] = json!({});
    data["event_channels"]["namespace/dynamo/component/backend/endpoint/generate/topic/kv-events/160a4f48de0ca9"]
        ["transport"]["config"]["endpoint"] = json!(channel_endpoint);
    dwm(v)
}

#[test]
fn shared_channel_keys_leave_with_their_last_contributor() {
    let mut st = ready_state();
    st.apply_slice(&slice("other", &[("worker-1", "pod-uid-1", true)]));
    let same = second_worker("tcp://10.244.1.17:45731");
    assert!(
        st.apply_resource(&same).events.is_empty(),
        "same value already fed"
    );
    let step = st.delete_resource("worker-0");
    assert_eq!(
        keys(&step.events),
        vec![
            format!("Delete {ENDPOINT_KEY}"),
            format!("Delete {CARD_KEY}")
        ]
    );
    assert_eq!(
        keys(&st.delete_resource("worker-1").events),
        vec![format!("Delete {CHANNEL_KEY}")]
    );
}

#[test]
fn a_surviving_contributors_value_is_reput() {
    let mut st = ready_state();
    st.apply_slice(&slice("other", &[("worker-1", "pod-uid-1", true)]));
    let other = second_worker("tcp://10.244.9.9:1");
    // The newest writer's value is fed.
    assert_eq!(
        keys(&st.apply_resource(&other).events),
        vec![format!("Apply {CHANNEL_KEY}")]
    );
    let step = st.delete_resource("worker-1");
    assert_eq!(keys(&step.events), vec![format!("Apply {CHANNEL_KEY}")]);
    let fed = fed_json(&st);
    assert_eq!(
        fed[CHANNEL_KEY]["transport"]["config"]["endpoint"],
        json!("tcp://10.244.1.17:45731")
    );
}

#[test]
fn malformed_updates_keep_the_last_valid_records_and_count_once() {
    let mut st = ready_state();
    let before = fed_json(&st);
    for bad in [
        json!("bogus"),
        json!({"data": 5}),
        json!({"data": {"endpoints": []}}),
    ] {
        let mut v = example_json();
        v["spec"] = bad;
        let step = st.apply_resource(&dwm(v));
        assert!(step.events.is_empty());
        assert!(step.notes.len() <= 1);
    }
    assert_eq!(fed_json(&st), before);
    // Counted once across the three malformed updates.
    let mut st = ready_state();
    let mut total = 0;
    for _ in 0..3 {
        let mut v = example_json();
        v["spec"] = json!(null);
        total += st.apply_resource(&dwm(v)).notes.len();
    }
    assert_eq!(total, 1);
    // A valid update afterwards is fed normally.
    assert!(
        st.apply_resource(&example()).events.is_empty(),
        "records unchanged"
    );
}

#[test]
fn a_malformed_new_uid_does_not_inherit_records() {
    let mut st = ready_state();
    let mut v = example_json();
    v["metadata"]["uid"] = json!("another-incarnation");
    v["spec"] = json!([]);
    let step = st.apply_resource(&dwm(v));
    assert_eq!(step.notes.len(), 1);
    assert_eq!(step.events.len(), 3, "old incarnation's records leave");
}

#[test]
fn null_maps_are_empty() {
    let mut st = state();
    st.apply_slice(&ready_slice());
    let mut v = example_json();
    v["spec"]["data"] = json!({"endpoints": null, "model_cards": null, "event_channels": null,
                               "event_sources": null});
    let step = st.apply_resource(&dwm(v));
    assert!(step.notes.is_empty());
    assert!(step.events.is_empty());
}

#[test]
fn records_of_unwatched_namespaces_are_filtered() {
    let mut st = MetadataState::new(MetadataConfig {
        namespaces: vec![Namespace::new("other")],
    });
    st.apply_slice(&ready_slice());
    let step = st.apply_resource(&example());
    assert!(step.notes.is_empty());
    assert!(step.events.is_empty());
}

#[test]
fn channel_namespaces_match_in_encoded_form() {
    assert_eq!(encode_segment("my.ns"), "my%2Ens");
    assert_eq!(encode_segment("ñ"), "%C3%B1");
    let st = MetadataState::new(MetadataConfig {
        namespaces: vec![Namespace::new("my.ns")],
    });
    assert!(st.watches_scoped("namespace/my%2Ens/topic/kv-events/1"));
    assert!(!st.watches_scoped("namespace/my.ns/topic/kv-events/1"));
}

#[test]
fn oversized_cards_are_trimmed_to_their_typed_subset() {
    let mut st = state();
    st.apply_slice(&ready_slice());
    let mut v = example_json();
    let card =
        &mut v["spec"]["data"]["model_cards"]["dynamo/backend/generate/43710f49c0cff"]["card_json"];
    card["user_data"] = json!("x".repeat(MAX_CARD_BYTES + 1));
    st.apply_resource(&dwm(v));
    let fed = fed_json(&st);
    let trimmed = &fed[CARD_KEY]["card_json"];
    assert!(trimmed.get("user_data").is_none());
    assert!(trimmed.get("tokenizer").is_none());
    assert_eq!(trimmed["display_name"], json!("Qwen/Qwen3-0.6B"));
    assert_eq!(trimmed["kv_cache_block_size"], json!(16));
    assert_eq!(trimmed["runtime_config"]["total_kv_blocks"], json!(16384));
    assert!(st.held_bytes() < MAX_CARD_BYTES);
}

#[test]
fn the_object_ceiling_refuses_new_resources_once() {
    let mut st = MetadataState::with_bounds(
        MetadataConfig {
            namespaces: vec![Namespace::new("dynamo")],
        },
        1,
        MAX_HELD_BYTES,
    );
    st.apply_resource(&example());
    let extra = second_worker("tcp://x:1");
    let step = st.apply_resource(&extra);
    assert_eq!(step.notes.len(), 1);
    assert_eq!(step.notes[0].kind, NoteKind::Malformed);
    assert!(st.apply_resource(&extra).notes.is_empty());
    assert_eq!(st.resource_count(), 1);
}

#[test]
fn the_byte_ceiling_keeps_the_last_valid_records() {
    let mut st = MetadataState::with_bounds(
        MetadataConfig {
            namespaces: vec![Namespace::new("dynamo")],
        },
        MAX_HELD_OBJECTS,
        4096,
    );
    st.apply_slice(&ready_slice());
    st.apply_resource(&example());
    let held = st.held_bytes();
    assert!(held > 0 && held <= 4096);
    let mut v = example_json();
    v["spec"]["data"]["endpoints"]["dynamo/backend/generate/43710f49c0cff"]["padding"] =
        json!("y".repeat(4096));
    let step = st.apply_resource(&dwm(v));
    assert_eq!(step.notes[0].kind, NoteKind::Malformed);
    assert!(step.events.is_empty());
    assert_eq!(st.held_bytes(), held);
}

#[test]
fn a_relist_is_an_etcd_resync() {
    let mut st = state();
    let step = st.relist(&[example()], &[ready_slice()]);
    assert_eq!(
        keys(&step.events),
        vec![
            "Init".to_owned(),
            format!("InitApply {CHANNEL_KEY}"),
            format!("InitApply {ENDPOINT_KEY}"),
            format!("InitApply {CARD_KEY}"),
            "InitDone".to_owned(),
        ]
    );
    // A relist without the slice empties the fed set.
    let step = st.relist(&[example()], &[]);
    assert_eq!(keys(&step.events), vec!["Init", "InitDone"]);
}

#[test]
fn relists_do_not_recount_unchanged_refusals() {
    let mut st = state();
    let mut v = example_json();
    v["metadata"]["name"] = json!("worker-0-engine-0");
    let refused = dwm(v);
    assert_eq!(
        st.relist(std::slice::from_ref(&refused), &[]).notes.len(),
        1
    );
    assert!(
        st.relist(std::slice::from_ref(&refused), &[])
            .notes
            .is_empty()
    );
}

#[test]
fn a_malformed_spec_at_relist_keeps_the_last_valid_records() {
    let mut st = state();
    st.relist(&[example()], &[ready_slice()]);
    let mut v = example_json();
    v["spec"] = json!({"data": "not a map"});
    let step = st.relist(&[dwm(v)], &[ready_slice()]);
    assert_eq!(step.notes.len(), 1);
    assert_eq!(step.notes[0].kind, NoteKind::Malformed);
    assert_eq!(step.events.len(), 5, "{:?}", keys(&step.events));
}

#[test]
fn the_slice_ceiling_is_counted_once() {
    let mut st = MetadataState::with_bounds(
        MetadataConfig {
            namespaces: vec![Namespace::new("dynamo")],
        },
        1,
        MAX_HELD_BYTES,
    );
    st.apply_slice(&ready_slice());
    let extra = slice("extra", &[("worker-1", "u1", true)]);
    assert_eq!(st.apply_slice(&extra).notes.len(), 1);
    assert!(st.apply_slice(&extra).notes.is_empty());
    // The held slice still works.
    assert_eq!(st.apply_resource(&example()).events.len(), 3);
}

/// Differential check: replaying the emitted events into a map (as the reducer would hold
/// them) always matches both the state's own fed set and a naive recomputation from scratch.
mod differential {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    const NAMES: [&str; 2] = ["worker-0", "worker-1"];
    const SHARED: &str = "namespace/dynamo/component/backend/endpoint/generate/topic/kv-events/abc";

    #[derive(Clone, Debug)]
    enum Op {
        /// Apply resource `name` with spec variant 0..5 (3 = null data maps, 4 = malformed).
        Resource(usize, u8),
        Delete(usize),
        /// Slice `s{slice}` with per-worker readiness.
        Slice(usize, [bool; 2]),
        DeleteSlice(usize),
        Relist,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..2usize, 0..5u8).prop_map(|(n, v)| Op::Resource(n, v)),
            (0..2usize).prop_map(Op::Delete),
            (0..2usize, any::<[bool; 2]>()).prop_map(|(s, r)| Op::Slice(s, r)),
            (0..2usize).prop_map(Op::DeleteSlice),
            Just(Op::Relist),
        ]
    }

    fn resource(name: &str, variant: u8) -> DynamoWorkerMetadata {
        let id = hash_pod_name(name);
        let spec = match variant {
            3 => json!({"data": {"endpoints": null, "model_cards": null, "event_channels": null}}),
            4 => json!("malformed"),
            v => {
                let mut data = json!({
                    "endpoints": {format!("dynamo/backend/generate/{}", id.hex()): {
                        "type": "Endpoint", "namespace": "dynamo", "component": "backend",
                        "endpoint": "generate", "instance_id": id.0,
                        "transport": {"tcp": format!("10.0.0.{v}:1")}
                    }},
                    "event_channels": {SHARED: {"type": "EventChannel", "topic": "kv-events",
                        "instance_id": 7, "transport": {"kind": "Zmq",
                        "config": {"endpoint": format!("tcp://10.0.0.{v}:2")}}}}
                });
                if v == 2 {
                    data["event_channels"] = json!({});
                }
                json!({"data": data})
            }
        };
        dwm(json!({
            "metadata": {"name": name, "uid": format!("dwm-{name}"),
                "ownerReferences": [{"kind": "Pod", "name": name, "uid": format!("pod-{name}")}]},
            "spec": spec
        }))
    }

    fn slice_of(index: usize, ready: [bool; 2]) -> EndpointSlice {
        let targets: Vec<(String, String, bool)> = NAMES
            .iter()
            .zip(ready)
            .map(|(n, r)| ((*n).to_owned(), format!("pod-{n}"), r))
            .collect();
        let borrowed: Vec<(&str, &str, bool)> = targets
            .iter()
            .map(|(n, u, r)| (n.as_str(), u.as_str(), *r))
            .collect();
        slice(&format!("s{index}"), &borrowed)
    }

    /// The reducer's view: a map, with resyncs swapped in at InitDone.
    #[derive(Default)]
    struct Replay {
        held: BTreeMap<String, Vec<u8>>,
        staging: Option<BTreeMap<String, Vec<u8>>>,
    }

    impl Replay {
        fn feed(&mut self, events: &[SourceEvent]) {
            for e in events {
                match e {
                    SourceEvent::Init => self.staging = Some(BTreeMap::new()),
                    SourceEvent::InitApply { key, value } => {
                        self.staging
                            .as_mut()
                            .expect("InitApply inside a resync")
                            .insert(key.clone(), value.clone());
                    }
                    SourceEvent::InitDone => {
                        self.held = self.staging.take().expect("InitDone after Init");
                    }
                    SourceEvent::Apply { key, value } => {
                        self.held.insert(key.clone(), value.clone());
                    }
                    SourceEvent::Delete { key } => {
                        assert!(
                            self.held.remove(key).is_some(),
                            "Delete of an unknown key {key}"
                        );
                    }
                }
            }
        }
    }

    proptest! {
        #[test]
        fn incremental_events_match_a_naive_recomputation(ops in prop::collection::vec(op(), 1..40)) {
            let mut st = state();
            let mut replay = Replay::default();
            // Naive model: last valid variant per resource, readiness per slice.
            let mut objects: BTreeMap<usize, u8> = BTreeMap::new();
            let mut valid: BTreeMap<usize, u8> = BTreeMap::new();
            let mut slices: BTreeMap<usize, [bool; 2]> = BTreeMap::new();
            for op in ops {
                let step = match op {
                    Op::Resource(n, v) => {
                        objects.insert(n, v);
                        if v != 4 {
                            valid.insert(n, v);
                        }
                        st.apply_resource(&resource(NAMES[n], v))
                    }
                    Op::Delete(n) => {
                        objects.remove(&n);
                        valid.remove(&n);
                        st.delete_resource(NAMES[n])
                    }
                    Op::Slice(s, r) => {
                        slices.insert(s, r);
                        st.apply_slice(&slice_of(s, r))
                    }
                    Op::DeleteSlice(s) => {
                        slices.remove(&s);
                        st.delete_slice(&format!("s{s}"))
                    }
                    Op::Relist => {
                        let rs: Vec<_> =
                            objects.iter().map(|(n, v)| resource(NAMES[*n], *v)).collect();
                        let ss: Vec<_> = slices.iter().map(|(s, r)| slice_of(*s, *r)).collect();
                        st.relist(&rs, &ss)
                    }
                };
                replay.feed(&step.events);
                let fed: BTreeMap<String, Vec<u8>> =
                    st.fed().map(|(k, v)| (k.to_owned(), v.to_vec())).collect();
                prop_assert_eq!(&replay.held, &fed);

                let mut expected = BTreeSet::new();
                for (n, v) in &valid {
                    let ready = slices.values().any(|r| r[*n]);
                    if !ready || !objects.contains_key(n) {
                        continue;
                    }
                    if *v < 3 {
                        let id = hash_pod_name(NAMES[*n]).hex();
                        expected.insert(format!("v1/instances/dynamo/backend/generate/{id}"));
                        if *v != 2 {
                            expected.insert(format!("v1/event_channels/{SHARED}"));
                        }
                    }
                }
                let got: BTreeSet<String> = fed.keys().cloned().collect();
                prop_assert_eq!(got, expected);
            }
        }
    }
}
