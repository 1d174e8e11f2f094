//! The discovery and subscription subtrees' children, computed from the live config at every
//! spawn (so restarting a subtree applies the config), and the per-source settings they start
//! with: etcd, Dynamo's file store, Kubernetes metadata or Pods, the demo's simulated feed.

use super::*;

pub(super) fn source_kind(source: DiscoverySource) -> SourceKind {
    match source {
        // The simulated fleet writes etcd's records: everything after the source is etcd's path;
        // only the admin label says where the records came from.
        DiscoverySource::Etcd => SourceKind::Etcd,
        DiscoverySource::Simulated => SourceKind::Simulated,
        DiscoverySource::Kubernetes => SourceKind::Kubernetes,
        DiscoverySource::KubernetesPods => SourceKind::KubernetesPods,
        DiscoverySource::File => SourceKind::File,
    }
}

pub(super) fn registry_config(config: &Config) -> RegistryConfig {
    RegistryConfig {
        enabled: config.dynamo.enabled,
        source: source_kind(config.dynamo.discovery.source),
        namespaces: config.dynamo.discovery.namespaces(),
    }
}

/// The discovery sources that must finish a first pass before `/ready` answers 200.
pub(super) fn required_sources(config: &Config) -> Vec<String> {
    if !config.dynamo.enabled {
        return Vec::new();
    }
    config
        .dynamo
        .discovery
        .namespaces()
        .iter()
        .map(|ns| source_name(config.dynamo.discovery.source, ns))
        .collect()
}

/// The supervision-tree name (and readiness key) of one namespace's discovery actor.
pub(super) fn source_name(source: DiscoverySource, namespace: &Namespace) -> String {
    format!("{}:{namespace}", source_prefix(source))
}

pub(super) fn source_prefix(source: DiscoverySource) -> &'static str {
    match source {
        DiscoverySource::Etcd => "etcd",
        DiscoverySource::Kubernetes => "kubernetes",
        DiscoverySource::KubernetesPods => "kubernetes_pods",
        DiscoverySource::File => "file",
        DiscoverySource::Simulated => "simulated",
    }
}

/// The discovery subtree; its children are computed from the live config at every spawn, so
/// restarting it is the live watcher replacement. (Without `dynamo` nothing starts it or the
/// three below: `root_children`; compiled, never linked.)
#[cfg_attr(not(feature = "dynamo"), allow(dead_code))]
pub(super) fn discovery_spec(shared: &Shared) -> ChildSpec {
    let shared = shared.clone();
    ChildSpec::supervisor_with("discovery", ActorKind::DiscoverySupervisor, move || {
        discovery_children(&shared)
    })
}

/// The load subscriptions subtree: a follower that keeps one SubscriptionActor per publisher.
/// Restarting it applies a new dial policy (`load.transport`, `direct_allow_cidrs`).
#[cfg_attr(not(feature = "dynamo"), allow(dead_code))]
pub(super) fn subscriptions_spec(shared: &Shared) -> ChildSpec {
    let shared = shared.clone();
    ChildSpec::supervisor_with(
        "subscriptions",
        ActorKind::SubscriptionSupervisor,
        move || {
            let config = shared.config.clone();
            let bus = Some(shared.event_bus.clone());
            let policy = Arc::new(move || DialPolicy {
                bus: bus.clone(),
                ..dial_policy(&config.load())
            });
            vec![follower_spec(
                shared.registry.clone(),
                shared.load.clone(),
                shared.kv.clone(),
                policy,
            )]
        },
    )
}

#[cfg_attr(not(feature = "dynamo"), allow(dead_code))]
pub(super) fn dial_policy(config: &Config) -> DialPolicy {
    DialPolicy {
        transport: match config.dynamo.load.transport {
            LoadTransport::Direct => SubscriptionTransport::Direct,
            LoadTransport::Broker => SubscriptionTransport::Broker,
        },
        allow_cidrs: config.dynamo.load.allow_cidrs(),
        kv_events: config.dynamo.enabled && config.dynamo.kv.enabled,
        bus: None,
    }
}

#[cfg_attr(not(feature = "dynamo"), allow(dead_code))]
pub(super) fn discovery_children(shared: &Shared) -> Vec<ChildSpec> {
    let config = shared.config.load();
    let dynamo = &config.dynamo;
    if !dynamo.enabled {
        return Vec::new();
    }
    let kind = dynamo.discovery.source;
    dynamo
        .discovery
        .namespaces()
        .into_iter()
        .map(|namespace| {
            let source = match kind {
                DiscoverySource::Kubernetes => SourceSpec::KubeMetadata {
                    kube: kube_source_config(&config),
                    namespace: namespace.clone(),
                },
                DiscoverySource::KubernetesPods => SourceSpec::KubePods {
                    kube: kube_source_config(&config),
                    pods: pod_source_config(&config, &namespace),
                    namespace: namespace.clone(),
                },
                DiscoverySource::Simulated => SourceSpec::Memory {
                    feed: shared.simulated.clone(),
                    namespace: namespace.clone(),
                },
                DiscoverySource::File => {
                    SourceSpec::File(file_source_config(&config, namespace.clone()))
                }
                _ => SourceSpec::Etcd(etcd_source_config(&config, namespace.clone())),
            };
            let shared = shared.clone();
            ChildSpec::new(
                source_name(kind, &namespace),
                ActorKind::Discovery,
                move |ctx: ChildContext| {
                    let readiness = shared.readiness.clone();
                    let args = DiscoveryArgs {
                        source: source.clone(),
                        registry_actor: shared.mailbox.clone(),
                        metrics: ctx.metrics.clone(),
                        on_first_pass: Arc::new(move |ns: &Namespace| {
                            readiness.mark_ready(&source_name(kind, ns))
                        }),
                        span: ctx.span.clone(),
                    };
                    async move {
                        let (actor, _) =
                            Actor::spawn_linked(None, DiscoveryActor, args, ctx.supervisor).await?;
                        Ok(actor.get_cell())
                    }
                },
            )
        })
        .collect()
}

/// What the Pod source needs for one Dynamo namespace: membership and model mapping.
pub fn pod_source_config(config: &Config, namespace: &Namespace) -> PodSourceConfig {
    let kube = &config.dynamo.discovery.kubernetes;
    let models = match &kube.model {
        Some(model) => ModelMapping::Single(model.clone()),
        None => ModelMapping::PerComponent(
            kube.models
                .iter()
                .map(|m| PodComponentModel {
                    component: m.component.clone(),
                    model: m.model.clone(),
                    dynamo_namespace: m.dynamo_namespace.clone().map(Namespace::new),
                })
                .collect(),
        ),
    };
    PodSourceConfig {
        namespaces: vec![namespace.clone()],
        models,
    }
}

/// The Kubernetes sources' settings: in-cluster credentials, then KUBECONFIG.
pub fn kube_source_config(config: &Config) -> KubeSourceConfig {
    let kube = &config.dynamo.discovery.kubernetes;
    KubeSourceConfig {
        connect: KubeConnect::Infer,
        namespace: kube.namespace.clone(),
        backoff: BackoffPolicy {
            initial: kube.watch_reconnect_backoff.initial.get(),
            max: kube.watch_reconnect_backoff.max.get(),
            jitter: Jitter::None,
        },
        timing: WatchTiming::default(),
    }
}

/// Maps the YAML file section onto the file-store source's settings.
pub fn file_source_config(config: &Config, namespace: Namespace) -> FileSourceConfig {
    let file = &config.dynamo.discovery.file;
    FileSourceConfig {
        root: file.root.clone().unwrap_or_else(default_file_root),
        namespace,
        rescan_interval: file.rescan_interval.get(),
        ttl: file.ttl.get(),
    }
}

/// Maps the YAML etcd section onto the source's plain connection settings.
pub fn etcd_source_config(config: &Config, namespace: Namespace) -> EtcdSourceConfig {
    let etcd = &config.dynamo.discovery.etcd;
    let backoff = etcd.watch_reconnect_backoff;
    EtcdSourceConfig {
        endpoints: etcd.normalized_endpoints(),
        namespace,
        tls: etcd.tls.as_ref().map(|t| EtcdTls {
            ca_cert: t.ca_cert.clone(),
            client_cert: t.client_cert.clone(),
            client_key: t.client_key.clone(),
            server_name: t.server_name.clone(),
        }),
        auth: etcd.auth.as_ref().map(|a| EtcdAuth {
            username: a.username.clone(),
            password: a.password.clone(),
        }),
        backoff: BackoffPolicy {
            initial: backoff.initial.get(),
            max: backoff.max.get(),
            jitter: Jitter::None,
        },
    }
}
