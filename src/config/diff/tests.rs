//! Reload classes: one test per class and per discovery restart reason.

use std::collections::BTreeMap;

use super::*;
use crate::config::schema::*;

fn base() -> Config {
    Config::from_yaml_str(
        r#"
disaggregated_serving: {enabled: true}
backends:
  - {name: shim-a, url: "http://shim-a:8000"}
dynamo:
  enabled: true
  discovery:
    etcd:
      endpoints: ["http://etcd:2379"]
      namespaces: [prod, canary]
  shim:
    pools:
      - {namespace: prod, backends: [shim-a]}
"#,
        &BTreeMap::new(),
    )
    .unwrap()
}

fn pods() -> Config {
    let mut c = base();
    c.dynamo.discovery.source = DiscoverySource::KubernetesPods;
    c.dynamo.discovery.kubernetes.dynamo_namespaces = vec!["prod".into(), "canary".into()];
    c.dynamo.discovery.kubernetes.models = vec![
        ComponentModel {
            component: "w".into(),
            model: "m-prod".into(),
            dynamo_namespace: Some("prod".into()),
        },
        ComponentModel {
            component: "w".into(),
            model: "m-canary".into(),
            dynamo_namespace: Some("canary".into()),
        },
    ];
    c
}

fn reason(plan: &ReloadPlan) -> Option<RestartReason> {
    match &plan.discovery {
        Some(DiscoveryAction::Restart { reason, .. }) => Some(*reason),
        _ => None,
    }
}

#[test]
fn identical_configs_produce_an_empty_plan() {
    let plan = diff(&base(), &base());
    assert!(plan.is_empty());
    assert_eq!(plan, ReloadPlan::default());
}

#[test]
fn immediate_class_covers_staleness_shim_kv_keys_and_backends() {
    let old = base();
    let mut new = base();
    new.dynamo.load.max_staleness = HumanDuration::from_secs(5);
    new.dynamo.shim.model_map.insert("a".into(), "A".into());
    new.dynamo.kv.router_temperature = 0.5;
    new.dynamo.load.tie_break_window = 0.5;
    new.dynamo.load.peer_slots = true;
    new.api_keys.push(ApiKeyConfig {
        key: "k".into(),
        name: "n".into(),
        allowed_backends: None,
    });
    new.backends[0].url = "http://shim-a2:8000".into();
    let plan = diff(&old, &new);
    assert_eq!(plan.discovery, None);
    assert!(!plan.restart_subscriptions && !plan.event_bus && plan.needs_restart.is_empty());
    assert_eq!(
        plan.paths(ReloadClass::Immediate),
        vec![
            "api_keys",
            "backends[0].url",
            "dynamo.kv.router_temperature",
            "dynamo.load.max_staleness",
            "dynamo.load.peer_slots",
            "dynamo.load.tie_break_window",
            "dynamo.shim.model_map.a",
        ]
    );
}

#[test]
fn transport_and_cidrs_restart_only_subscriptions() {
    let old = base();
    let mut new = base();
    new.dynamo.load.transport = LoadTransport::Broker;
    new.dynamo.load.direct_allow_cidrs = Some(vec!["10.0.0.0/8".into()]);
    let plan = diff(&old, &new);
    assert!(plan.restart_subscriptions);
    assert_eq!(plan.discovery, None);
    assert_eq!(
        plan.paths(ReloadClass::RestartSubscriptions),
        vec!["dynamo.load.direct_allow_cidrs", "dynamo.load.transport"]
    );
}

#[test]
fn event_bus_changes_go_to_the_bus_supervisor() {
    let old = base();
    let mut new = base();
    new.dynamo.event_bus.max_sessions = 8;
    let plan = diff(&old, &new);
    assert!(plan.event_bus);
    assert_eq!(plan.discovery, None);
    assert_eq!(
        plan.paths(ReloadClass::EventBus),
        vec!["dynamo.event_bus.max_sessions"]
    );
}

#[test]
fn bind_address_and_telemetry_need_a_restart() {
    let old = base();
    let mut new = base();
    new.server.bind_address = "127.0.0.1:9090".parse().unwrap();
    new.telemetry.log_level = "debug".into();
    let plan = diff(&old, &new);
    assert_eq!(
        plan.needs_restart,
        vec!["server.bind_address", "telemetry.log_level"]
    );
}

#[test]
fn enabling_discovery_restarts_with_reason_enabled_and_disabling_stops() {
    let mut off = base();
    off.dynamo.enabled = false;
    assert_eq!(reason(&diff(&off, &base())), Some(RestartReason::Enabled));
    assert_eq!(diff(&base(), &off).discovery, Some(DiscoveryAction::Stop));
}

#[test]
fn discovery_edits_while_disabled_have_no_effect() {
    let mut old = base();
    old.dynamo.enabled = false;
    let mut new = old.clone();
    new.dynamo.discovery.etcd.endpoints = vec!["http://other:2379".into()];
    let plan = diff(&old, &new);
    assert_eq!(plan.discovery, None);
    assert_eq!(
        plan.paths(ReloadClass::NoEffect),
        vec!["dynamo.discovery.etcd.endpoints[0]"]
    );
}

#[test]
fn source_switch_restarts_with_reason_source() {
    let mut new = base();
    new.dynamo.discovery.source = DiscoverySource::Kubernetes;
    assert_eq!(reason(&diff(&base(), &new)), Some(RestartReason::Source));
}

#[test]
fn disjoint_namespace_change_restarts_with_reason_namespace() {
    let mut old = base();
    old.dynamo.discovery.etcd.namespaces.clear();
    let mut new = old.clone();
    new.dynamo.discovery.etcd.namespace = "other".into();
    assert_eq!(reason(&diff(&old, &new)), Some(RestartReason::Namespace));
}

#[test]
fn kubernetes_namespace_change_restarts_with_reason_namespace() {
    let old = pods();
    let mut new = pods();
    new.dynamo.discovery.kubernetes.namespace = "fleet-2".into();
    assert_eq!(reason(&diff(&old, &new)), Some(RestartReason::Namespace));
}

#[test]
fn endpoints_tls_or_auth_change_restarts_with_reason_connection() {
    let mut new = base();
    new.dynamo.discovery.etcd.endpoints = vec!["http://etcd-2:2379".into()];
    assert_eq!(
        reason(&diff(&base(), &new)),
        Some(RestartReason::Connection)
    );
    let mut new = base();
    new.dynamo.discovery.etcd.auth = Some(EtcdAuthConfig {
        username: "u".into(),
        password: "p".into(),
    });
    assert_eq!(
        reason(&diff(&base(), &new)),
        Some(RestartReason::Connection)
    );
}

#[test]
fn bare_and_http_endpoint_spellings_are_the_same_connection() {
    let mut new = base();
    new.dynamo.discovery.etcd.endpoints = vec!["etcd:2379".into()];
    assert_eq!(diff(&base(), &new).discovery, None);
}

#[test]
fn backoff_only_change_keeps_the_snapshot() {
    let mut new = base();
    new.dynamo.discovery.etcd.watch_reconnect_backoff.max = HumanDuration::from_secs(60);
    let plan = diff(&base(), &new);
    assert_eq!(
        plan.discovery,
        Some(DiscoveryAction::Restart {
            reason: RestartReason::Backoff,
            keep_snapshot: true,
            removed_namespaces: Vec::new(),
            added_namespaces: Vec::new(),
        })
    );
    assert_eq!(
        plan.paths(ReloadClass::Discovery),
        vec!["dynamo.discovery.etcd.watch_reconnect_backoff.max"]
    );
}

#[test]
fn backoff_with_connection_change_does_not_keep_the_snapshot() {
    let mut new = base();
    new.dynamo.discovery.etcd.watch_reconnect_backoff.max = HumanDuration::from_secs(60);
    new.dynamo.discovery.etcd.endpoints = vec!["http://etcd-2:2379".into()];
    let plan = diff(&base(), &new);
    assert_eq!(reason(&plan), Some(RestartReason::Connection));
    assert!(matches!(
        plan.discovery,
        Some(DiscoveryAction::Restart {
            keep_snapshot: false,
            ..
        })
    ));
}

#[test]
fn adding_and_removing_namespaces_prunes_with_reason_namespaces() {
    let mut new = base();
    new.dynamo.discovery.etcd.namespaces = vec!["prod".into(), "staging".into()];
    assert_eq!(
        diff(&base(), &new).discovery,
        Some(DiscoveryAction::Restart {
            reason: RestartReason::Namespaces,
            keep_snapshot: false,
            removed_namespaces: vec!["canary".into()],
            added_namespaces: vec!["staging".into()],
        })
    );
}

#[test]
fn kubernetes_pods_namespace_removal_with_kept_models_unchanged_is_namespaces() {
    let old = pods();
    let mut new = pods();
    new.dynamo.discovery.kubernetes.dynamo_namespaces = vec!["prod".into()];
    new.dynamo.discovery.kubernetes.models.pop();
    assert_eq!(reason(&diff(&old, &new)), Some(RestartReason::Namespaces));
}

#[test]
fn kubernetes_pods_namespace_change_with_kept_model_edit_is_other() {
    let old = pods();
    let mut new = pods();
    new.dynamo.discovery.kubernetes.dynamo_namespaces = vec!["prod".into()];
    new.dynamo.discovery.kubernetes.models.pop();
    new.dynamo.discovery.kubernetes.models[0].model = "m-prod-2".into();
    assert_eq!(reason(&diff(&old, &new)), Some(RestartReason::Other));
}

#[test]
fn kubernetes_pods_model_edit_is_other() {
    let old = pods();
    let mut new = pods();
    new.dynamo.discovery.kubernetes.models[1].model = "m-canary-2".into();
    assert_eq!(reason(&diff(&old, &new)), Some(RestartReason::Other));
}

#[test]
fn kubernetes_source_model_edit_is_a_no_op() {
    let mut old = pods();
    old.dynamo.discovery.source = DiscoverySource::Kubernetes;
    let mut new = old.clone();
    new.dynamo.discovery.kubernetes.models[1].model = "m-canary-2".into();
    new.dynamo.discovery.kubernetes.model = Some("x".into());
    let plan = diff(&old, &new);
    assert_eq!(plan.discovery, None);
    assert_eq!(
        plan.paths(ReloadClass::NoEffect),
        vec![
            "dynamo.discovery.kubernetes.model",
            "dynamo.discovery.kubernetes.models[1].model",
        ]
    );
}

#[test]
fn reordering_namespaces_changes_the_primary_and_is_other() {
    let mut new = base();
    new.dynamo.discovery.etcd.namespaces = vec!["canary".into(), "prod".into()];
    assert_eq!(reason(&diff(&base(), &new)), Some(RestartReason::Other));
}

#[test]
fn inactive_source_settings_have_no_effect() {
    let mut new = base();
    new.dynamo.discovery.kubernetes.namespace = "elsewhere".into();
    let plan = diff(&base(), &new);
    assert_eq!(plan.discovery, None);
    assert_eq!(
        plan.paths(ReloadClass::NoEffect),
        vec!["dynamo.discovery.kubernetes.namespace"]
    );
}

#[test]
fn reason_labels_match_the_metric_values() {
    let labels: Vec<&str> = [
        RestartReason::Enabled,
        RestartReason::Namespace,
        RestartReason::Connection,
        RestartReason::Backoff,
        RestartReason::Source,
        RestartReason::Namespaces,
        RestartReason::Other,
    ]
    .iter()
    .map(|reason| reason.as_str())
    .collect();
    assert_eq!(
        labels,
        [
            "enabled",
            "namespace",
            "connection",
            "backoff",
            "source",
            "namespaces",
            "other"
        ]
    );
}

fn file_store() -> Config {
    let mut c = base();
    c.dynamo.discovery.source = DiscoverySource::File;
    c.dynamo.discovery.file.namespaces = vec!["prod".into(), "canary".into()];
    c
}

#[test]
fn file_store_edits_restart_by_what_changed() {
    let mut new = file_store();
    new.dynamo.discovery.file.root = Some("/var/lib/dynamo_store_kv".into());
    assert_eq!(
        reason(&diff(&file_store(), &new)),
        Some(RestartReason::Connection)
    );
    let mut new = file_store();
    new.dynamo.discovery.file.ttl = HumanDuration::from_secs(20);
    let plan = diff(&file_store(), &new);
    assert_eq!(
        plan.discovery,
        Some(DiscoveryAction::Restart {
            reason: RestartReason::Other,
            keep_snapshot: true,
            removed_namespaces: Vec::new(),
            added_namespaces: Vec::new(),
        })
    );
    assert_eq!(
        plan.paths(ReloadClass::Discovery),
        vec!["dynamo.discovery.file.ttl"]
    );
    let mut new = file_store();
    new.dynamo.discovery.file.namespaces = vec!["prod".into()];
    assert_eq!(
        reason(&diff(&file_store(), &new)),
        Some(RestartReason::Namespaces)
    );
}

#[test]
fn file_store_edits_under_another_source_have_no_effect() {
    let mut new = base();
    new.dynamo.discovery.file.root = Some("/elsewhere".into());
    let plan = diff(&base(), &new);
    assert_eq!(plan.discovery, None);
    assert_eq!(
        plan.paths(ReloadClass::NoEffect),
        vec!["dynamo.discovery.file.root"]
    );
}

/// Startup is `apply(diff(empty, config))`: from the empty config, every start action of the
/// daemon is in the plan (discovery starts with reason `enabled`, the kv-events subscriptions and
/// the artifact loader start, every set key is listed), and the empty config diffs to nothing.
#[test]
fn the_empty_config_diffs_to_every_start_action() {
    let empty = Config::default();
    assert!(diff(&empty, &Config::default()).is_empty());

    let mut config = base();
    config.dynamo.kv.enabled = true;
    config.dynamo.kv.pinned_artifacts = vec!["m".into()];
    config.dynamo.load.transport = LoadTransport::Broker;
    config.server.max_connections = config.server.max_connections.saturating_add(1);
    let plan = diff(&empty, &config);
    assert_eq!(
        plan.discovery,
        Some(DiscoveryAction::Restart {
            reason: RestartReason::Enabled,
            keep_snapshot: false,
            removed_namespaces: Vec::new(),
            added_namespaces: Vec::new(),
        }),
        "discovery starts"
    );
    assert!(
        plan.restart_subscriptions,
        "the dial policy is the config's"
    );
    assert!(plan.kv_artifacts, "the artifact loader starts");
    for key in [
        "dynamo.enabled",
        "dynamo.kv.enabled",
        "dynamo.kv.pinned_artifacts",
        "dynamo.load.transport",
        "backends",
        "disaggregated_serving.enabled",
        "dynamo.discovery.etcd.namespaces",
    ] {
        assert!(
            plan.changes.iter().any(|c| c.path == key),
            "{key} in {:?}",
            plan.changes
        );
    }
    assert!(
        plan.needs_restart
            .iter()
            .any(|k| k == "server.max_connections")
    );

    // KV indexing alone: the kv-events subscriptions follow `dynamo.enabled` and `kv.enabled`.
    let mut kv_only = Config::default();
    kv_only.dynamo.kv.enabled = true;
    let plan = diff(&empty, &kv_only);
    assert!(
        plan.restart_subscriptions,
        "kv.enabled is a dial-policy key"
    );
    assert!(!plan.kv_artifacts, "no loader while dynamo is off");
    let mut on = kv_only.clone();
    on.dynamo.enabled = true;
    let plan = diff(&kv_only, &on);
    assert!(plan.restart_subscriptions && plan.kv_artifacts);
    assert_eq!(
        plan.paths(ReloadClass::RestartSubscriptions),
        Vec::<&str>::new()
    );
}
