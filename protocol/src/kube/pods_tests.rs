//! One test per `kubernetes_pods` rule (seed "Kubernetes Pod source").

use serde_json::json;

use super::*;
use crate::kube::objects::Pod;

fn ns(s: &str) -> Namespace {
    Namespace::new(s)
}

fn single(model: &str) -> PodSourceConfig {
    PodSourceConfig {
        namespaces: vec![ns("dyn")],
        models: ModelMapping::Single(model.to_owned()),
    }
}

/// A ready, discovery-labelled worker Pod; `edit` adjusts the JSON before decoding.
fn pod(name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> Pod {
    let mut v = json!({
        "metadata": {
            "name": name,
            "uid": format!("uid-{name}"),
            "labels": {
                "nvidia.com/dynamo-discovery-backend": "kubernetes",
                "nvidia.com/dynamo-discovery-enabled": "true",
                "nvidia.com/dynamo-namespace": "dyn",
                "nvidia.com/dynamo-component": "VllmWorker",
                "nvidia.com/dynamo-component-type": "decode"
            }
        },
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    });
    edit(&mut v);
    serde_json::from_value(v).expect("test pod decodes")
}

fn set_label(v: &mut serde_json::Value, k: &str, val: &str) {
    v["metadata"]["labels"][k] = json!(val);
}

fn member(class: PodClass) -> PodMember {
    match class {
        PodClass::Member(m) => m,
        other => panic!("expected a member, got {other:?}"),
    }
}

#[test]
fn ready_decode_pod_is_a_member_with_the_hashed_id() {
    let m = member(classify_pod(&pod("worker-0", |_| {}), &single("m")));
    assert_eq!(m.instance_id, InstanceId(1_186_445_869_714_687));
    assert_eq!(m.namespace, ns("dyn"));
    assert_eq!(m.role, PodRole::Decode);
    assert_eq!(m.model, "m");
    assert_eq!(m.component.as_deref(), Some("VllmWorker"));
}

#[test]
fn component_type_prefill_is_prefill() {
    let p = pod("p", |v| set_label(v, labels::COMPONENT_TYPE, "prefill"));
    assert_eq!(
        member(classify_pod(&p, &single("m"))).role,
        PodRole::Prefill
    );
}

#[test]
fn worker_type_reads_the_sub_component_type() {
    let cfg = single("m");
    let p = pod("p", |v| {
        set_label(v, labels::COMPONENT_TYPE, "worker");
        set_label(v, labels::SUB_COMPONENT_TYPE, "prefill");
    });
    assert_eq!(member(classify_pod(&p, &cfg)).role, PodRole::Prefill);
    let d = pod("d", |v| {
        set_label(v, labels::COMPONENT_TYPE, "worker");
        set_label(v, labels::SUB_COMPONENT_TYPE, "decode");
    });
    assert_eq!(member(classify_pod(&d, &cfg)).role, PodRole::Decode);
}

#[test]
fn worker_type_without_a_sub_type_is_aggregated() {
    let p = pod("p", |v| set_label(v, labels::COMPONENT_TYPE, "worker"));
    assert_eq!(
        member(classify_pod(&p, &single("m"))).role,
        PodRole::Aggregated
    );
}

#[test]
fn non_worker_component_types_are_skipped() {
    for t in ["frontend", "planner", "epp", "default"] {
        let p = pod("p", |v| set_label(v, labels::COMPONENT_TYPE, t));
        assert_eq!(
            classify_pod(&p, &single("m")),
            PodClass::Skip(SkipReason::NotWorker(t.to_owned())),
            "{t}"
        );
    }
}

#[test]
fn readiness_needs_running_ready_true_and_no_deletion() {
    let cfg = single("m");
    let pending = pod("p", |v| v["status"]["phase"] = json!("Pending"));
    let unready = pod("p", |v| {
        v["status"]["conditions"][0]["status"] = json!("False")
    });
    let deleting = pod("p", |v| {
        v["metadata"]["deletionTimestamp"] = json!("2026-11-30T00:00:00Z");
    });
    let no_conditions = pod("p", |v| v["status"]["conditions"] = json!([]));
    for p in [pending, unready, deleting, no_conditions] {
        assert_eq!(classify_pod(&p, &cfg), PodClass::Skip(SkipReason::NotReady));
    }
}

#[test]
fn pods_without_the_discovery_labels_or_in_another_namespace_are_not_selected() {
    let cfg = single("m");
    let off = pod("p", |v| set_label(v, labels::DISCOVERY_ENABLED, "false"));
    let other = pod("p", |v| set_label(v, labels::DYNAMO_NAMESPACE, "other"));
    let unlabelled = pod("p", |v| {
        v["metadata"]["labels"]
            .as_object_mut()
            .expect("labels")
            .remove(labels::DYNAMO_NAMESPACE);
    });
    for p in [off, other, unlabelled] {
        assert_eq!(
            classify_pod(&p, &cfg),
            PodClass::Skip(SkipReason::NotSelected)
        );
    }
}

#[test]
fn container_mode_pods_are_refused() {
    let p = pod("p", |v| {
        v["metadata"]["annotations"] =
            json!({"nvidia.com/dynamo-kube-discovery-mode": "container"});
    });
    assert_eq!(
        classify_pod(&p, &single("m")),
        PodClass::Refused(RefuseReason::ContainerMode)
    );
}

fn per_component() -> PodSourceConfig {
    PodSourceConfig {
        namespaces: vec![ns("dyn"), ns("canary")],
        models: ModelMapping::PerComponent(vec![
            ComponentModel {
                component: "VllmWorker-decodeheavy".into(),
                model: "solar-pro4".into(),
                dynamo_namespace: Some(ns("dyn")),
            },
            ComponentModel {
                component: "VllmWorker-prefillheavy".into(),
                model: "solar-pro4-longcontext".into(),
                dynamo_namespace: Some(ns("dyn")),
            },
        ]),
    }
}

#[test]
fn models_map_components_exactly_and_case_sensitively() {
    let cfg = per_component();
    let p = pod("p", |v| {
        set_label(v, labels::COMPONENT, "VllmWorker-prefillheavy")
    });
    assert_eq!(
        member(classify_pod(&p, &cfg)).model,
        "solar-pro4-longcontext"
    );
    let wrong_case = pod("p", |v| {
        set_label(v, labels::COMPONENT, "vllmworker-prefillheavy")
    });
    assert_eq!(
        classify_pod(&wrong_case, &cfg),
        PodClass::Held {
            component: Some("vllmworker-prefillheavy".into())
        }
    );
}

#[test]
fn models_entries_are_scoped_to_their_dynamo_namespace() {
    let p = pod("p", |v| {
        set_label(v, labels::COMPONENT, "VllmWorker-decodeheavy");
        set_label(v, labels::DYNAMO_NAMESPACE, "canary");
    });
    assert!(matches!(
        classify_pod(&p, &per_component()),
        PodClass::Held { .. }
    ));
}

#[test]
fn pods_without_a_component_label_are_held_under_models() {
    let p = pod("p", |v| {
        v["metadata"]["labels"]
            .as_object_mut()
            .expect("labels")
            .remove(labels::COMPONENT);
    });
    assert_eq!(
        classify_pod(&p, &per_component()),
        PodClass::Held { component: None }
    );
}

#[test]
fn pod_set_publishes_members_and_follows_deletes() {
    let mut set = PodSet::new(single("m"));
    let notes = set.replace_all([&pod("worker-0", |_| {}), &pod("worker-1", |_| {})]);
    assert!(notes.is_empty());
    assert_eq!(set.members().len(), 2);
    set.delete("worker-0");
    let names: Vec<_> = set.members().into_iter().map(|m| m.pod_name).collect();
    assert_eq!(names, vec!["worker-1"]);
}

#[test]
fn pod_set_rollout_swaps_old_for_new() {
    let mut set = PodSet::new(single("m"));
    set.replace_all([&pod("old", |_| {})]);
    set.apply(&pod("new", |_| {}));
    set.apply(&pod("old", |v| {
        v["status"]["conditions"][0]["status"] = json!("False")
    }));
    let names: Vec<_> = set.members().into_iter().map(|m| m.pod_name).collect();
    assert_eq!(names, vec!["new"]);
}

#[test]
fn colliding_ready_pods_are_both_refused_as_duplicates() {
    fn same_id(_: &str) -> InstanceId {
        InstanceId(42)
    }
    let mut set = PodSet::new(single("m")).with_id_fn(same_id);
    assert!(set.apply(&pod("a", |_| {})).is_empty());
    assert_eq!(set.members().len(), 1);
    let notes = set.apply(&pod("b", |_| {}));
    assert_eq!(notes.len(), 2, "{notes:?}");
    assert!(notes.iter().all(|n| matches!(n, PodNote::Duplicate { .. })));
    assert!(set.members().is_empty());
    // Re-applying the same state reports nothing new.
    assert!(set.apply(&pod("b", |_| {})).is_empty());
    // One of them going unready resolves the collision.
    set.apply(&pod("b", |v| v["status"]["phase"] = json!("Failed")));
    let names: Vec<_> = set.members().into_iter().map(|m| m.pod_name).collect();
    assert_eq!(names, vec!["a"]);
}

#[test]
fn refusals_are_reported_once_per_pod_incarnation() {
    let mut set = PodSet::new(single("m"));
    let container = |uid: &str| {
        let uid = uid.to_owned();
        pod("c", move |v| {
            v["metadata"]["uid"] = json!(uid);
            v["metadata"]["annotations"] =
                json!({"nvidia.com/dynamo-kube-discovery-mode": "container"});
        })
    };
    assert_eq!(set.apply(&container("u1")).len(), 1);
    assert!(set.apply(&container("u1")).is_empty());
    assert!(set.replace_all([&container("u1")]).is_empty());
    // A new incarnation is a new refusal.
    assert_eq!(set.apply(&container("u2")).len(), 1);
    assert!(set.members().is_empty());
}

#[test]
fn held_pods_are_noted_once_and_not_published() {
    let mut set = PodSet::new(per_component());
    let p = pod("p", |v| set_label(v, labels::COMPONENT, "Unlisted"));
    assert_eq!(
        set.apply(&p),
        vec![PodNote::Held {
            pod: "p".into(),
            component: Some("Unlisted".into())
        }]
    );
    assert!(set.apply(&p).is_empty());
    assert!(set.members().is_empty());
    assert_eq!(set.len(), 1);
}

#[test]
fn the_pod_ceiling_refuses_new_pods_once() {
    let mut set = PodSet::with_capacity(single("m"), 2);
    set.replace_all([&pod("a", |_| {}), &pod("b", |_| {})]);
    assert_eq!(
        set.apply(&pod("c", |_| {})),
        vec![PodNote::Overflow { pod: "c".into() }]
    );
    assert!(set.apply(&pod("c", |_| {})).is_empty());
    // Updates of held Pods still pass at the ceiling.
    assert!(set.apply(&pod("a", |_| {})).is_empty());
    assert_eq!(set.len(), 2);
    assert_eq!(set.members().len(), 2);
}

#[test]
fn the_default_ceiling_is_16384() {
    assert_eq!(MAX_HELD_OBJECTS, 16_384);
}
