//! One test per validation and reload rule.

use super::*;
use crate::kube::pods::ComponentModel;

fn ns(s: &str) -> Namespace {
    Namespace::new(s)
}

fn pods() -> KubeSettings {
    KubeSettings {
        source: KubeSourceKind::Pods,
        namespace: "dynamo".into(),
        dynamo_namespaces: DynamoNamespaces::One(ns("dynamo-solar-pro4")),
        models: Some(ModelMapping::Single("solar-pro4".into())),
        backoff_initial: Duration::from_millis(500),
        backoff_max: Duration::from_secs(30),
    }
}

fn entry(component: &str, model: &str, n: Option<&str>) -> ComponentModel {
    ComponentModel {
        component: component.into(),
        model: model.into(),
        dynamo_namespace: n.map(ns),
    }
}

fn errors(s: &KubeSettings) -> Vec<&'static str> {
    validate(s)
        .into_iter()
        .filter(|f| !f.warning)
        .map(|f| f.path)
        .collect()
}

#[test]
fn the_seed_example_is_valid() {
    assert!(validate(&pods()).is_empty());
    assert_eq!(
        pods().pod_config().map(|c| c.namespaces),
        Some(vec![ns("dynamo-solar-pro4")])
    );
}

#[test]
fn namespace_must_be_a_dns1123_label() {
    for bad in ["", "Dynamo", "-x", "x-", "a_b", &"a".repeat(64)] {
        let s = KubeSettings {
            namespace: bad.into(),
            ..pods()
        };
        assert_eq!(
            errors(&s),
            vec!["dynamo.discovery.kubernetes.namespace"],
            "{bad:?}"
        );
    }
    assert!(is_dns1123_label("kbm-g-np-kt-a"));
}

#[test]
fn dynamo_namespace_must_be_a_label_value() {
    let s = KubeSettings {
        dynamo_namespaces: DynamoNamespaces::One(ns("")),
        ..pods()
    };
    assert_eq!(
        errors(&s),
        vec!["dynamo.discovery.kubernetes.dynamo_namespace"]
    );
    assert!(is_label_value("Dyn.ns_1"));
    assert!(!is_label_value("with space"));
}

#[test]
fn dynamo_namespaces_need_1_to_16_unique_entries() {
    let many = |list: Vec<Namespace>| KubeSettings {
        dynamo_namespaces: DynamoNamespaces::Many(list),
        models: Some(ModelMapping::PerComponent(vec![entry("w", "m", Some("a"))])),
        ..pods()
    };
    assert!(errors(&many(vec![ns("a"), ns("b")])).is_empty());
    let too_many: Vec<Namespace> = (0..17).map(|i| ns(&format!("n{i}"))).collect();
    for list in [vec![], vec![ns("a"), ns("a")], too_many] {
        assert!(
            errors(&many(list.clone())).contains(&"dynamo.discovery.kubernetes.dynamo_namespaces"),
            "{list:?}"
        );
    }
}

#[test]
fn pods_need_exactly_one_model_form() {
    let none = KubeSettings {
        models: None,
        ..pods()
    };
    assert_eq!(errors(&none), vec!["dynamo.discovery.kubernetes.model"]);
    for bad in ["", "solar pro"] {
        let s = KubeSettings {
            models: Some(ModelMapping::Single(bad.into())),
            ..pods()
        };
        assert_eq!(
            errors(&s),
            vec!["dynamo.discovery.kubernetes.model"],
            "{bad:?}"
        );
    }
}

#[test]
fn models_need_1_to_256_unique_component_entries() {
    let with = |entries| KubeSettings {
        models: Some(ModelMapping::PerComponent(entries)),
        ..pods()
    };
    assert!(errors(&with(vec![entry("a", "m", None), entry("b", "n", None)])).is_empty());
    let too_many: Vec<_> = (0..257)
        .map(|i| entry(&format!("c{i}"), "m", None))
        .collect();
    for entries in [
        vec![],
        vec![entry("a", "m", None), entry("a", "n", None)],
        too_many,
    ] {
        assert_eq!(
            errors(&with(entries)),
            vec!["dynamo.discovery.kubernetes.models"]
        );
    }
}

#[test]
fn models_must_name_a_watched_namespace_when_several_are_watched() {
    let s = KubeSettings {
        dynamo_namespaces: DynamoNamespaces::Many(vec![ns("a"), ns("b")]),
        models: Some(ModelMapping::PerComponent(vec![
            entry("w", "m", None),
            entry("x", "m", Some("zzz")),
        ])),
        ..pods()
    };
    assert_eq!(
        errors(&s),
        vec![
            "dynamo.discovery.kubernetes.models",
            "dynamo.discovery.kubernetes.models"
        ]
    );
}

#[test]
fn model_under_the_metadata_source_is_only_a_warning() {
    let s = KubeSettings {
        source: KubeSourceKind::Metadata,
        ..pods()
    };
    let findings = validate(&s);
    assert_eq!(findings.len(), 1);
    assert!(findings[0].warning);
    assert!(s.pod_config().is_none());
}

#[test]
fn switching_source_resets_with_reason_source() {
    let new = KubeSettings {
        source: KubeSourceKind::Metadata,
        ..pods()
    };
    assert_eq!(
        reload_action(&pods(), &new),
        ReloadAction::Reset { reason: "source" }
    );
}

#[test]
fn editing_namespace_or_dynamo_namespace_resets_with_reason_namespace() {
    let a = KubeSettings {
        namespace: "other".into(),
        ..pods()
    };
    let b = KubeSettings {
        dynamo_namespaces: DynamoNamespaces::One(ns("other")),
        ..pods()
    };
    for new in [a, b] {
        assert_eq!(
            reload_action(&pods(), &new),
            ReloadAction::Reset {
                reason: "namespace"
            }
        );
    }
}

#[test]
fn editing_models_resets_with_reason_other_under_pods_only() {
    let new = KubeSettings {
        models: Some(ModelMapping::Single("solar-pro5".into())),
        ..pods()
    };
    assert_eq!(
        reload_action(&pods(), &new),
        ReloadAction::Reset { reason: "other" }
    );
    let old_meta = KubeSettings {
        source: KubeSourceKind::Metadata,
        ..pods()
    };
    let new_meta = KubeSettings {
        source: KubeSourceKind::Metadata,
        ..new
    };
    assert_eq!(reload_action(&old_meta, &new_meta), ReloadAction::Keep);
}

#[test]
fn editing_dynamo_namespaces_with_kept_models_prunes_removed_namespaces() {
    let list = |names: &[&str], models: Vec<ComponentModel>| KubeSettings {
        dynamo_namespaces: DynamoNamespaces::Many(names.iter().map(|n| ns(n)).collect()),
        models: Some(ModelMapping::PerComponent(models)),
        ..pods()
    };
    let old = list(
        &["a", "b"],
        vec![entry("w", "m", Some("a")), entry("w", "n", Some("b"))],
    );
    let new = list(
        &["a", "c"],
        vec![entry("w", "m", Some("a")), entry("w", "o", Some("c"))],
    );
    assert_eq!(
        reload_action(&old, &new),
        ReloadAction::Prune {
            removed: vec![ns("b")]
        }
    );
    // A kept namespace whose models changed is a full reset.
    let changed = list(
        &["a", "c"],
        vec![entry("w", "z", Some("a")), entry("w", "o", Some("c"))],
    );
    assert_eq!(
        reload_action(&old, &changed),
        ReloadAction::Reset { reason: "other" }
    );
}

#[test]
fn a_backoff_edit_restarts_keeping_the_snapshot() {
    let new = KubeSettings {
        backoff_max: Duration::from_secs(60),
        ..pods()
    };
    assert_eq!(
        reload_action(&pods(), &new),
        ReloadAction::Restart { reason: "backoff" }
    );
    assert_eq!(reload_action(&pods(), &pods()), ReloadAction::Keep);
}
