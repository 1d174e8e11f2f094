//! `source: kubernetes` end to end inside the actors: a DiscoveryActor runs the metadata source
//! against the fake API server and the RegistryActor publishes the same kind of fleet snapshot
//! etcd yields; readiness flaps of the EndpointSlice add and remove the worker. `kubernetes_pods`:
//! ready labelled Pods become card-less workers with no load or capacity signals.

use crate::support::fake_kube;

use std::sync::Arc;
use std::time::Duration;

use continuum_actors::discovery::{DiscoveryActor, DiscoveryArgs, SourceSpec};
use continuum_actors::kube_source::{KubeConnect, KubeSourceConfig, WatchTiming};
use continuum_actors::lifecycle::{ActorKind, ActorSpan};
use continuum_actors::registry::{
    RegistryActor, RegistryArgs, RegistryConfig, RegistryParts, RegistryReader,
};
use continuum_protocol::backoff::{BackoffPolicy, Jitter};
use continuum_protocol::discovery::records::Role;
use continuum_protocol::discovery::snapshot::{DynamoSnapshot, SourceKind};
use continuum_protocol::ids::Namespace;
use continuum_protocol::kube::hash_pod_name;
use continuum_protocol::kube::pods::{ModelMapping, PodSourceConfig};
use fake_kube::{EXAMPLE_POD_UID, FakeKube, Kind, endpoint_slice, example_metadata, worker_pod};
use ractor::Actor;

async fn wait_for(registry: &RegistryReader, what: &str, done: impl Fn(&DynamoSnapshot) -> bool) {
    let mut generations = registry.subscribe();
    tokio::time::timeout(Duration::from_secs(20), async {
        while !done(&registry.snapshot()) {
            generations.changed().await.expect("registry alive");
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what} in time"));
}

fn backoff() -> BackoffPolicy {
    BackoffPolicy {
        initial: Duration::from_millis(10),
        max: Duration::from_millis(100),
        jitter: Jitter::None,
    }
}

fn kube(fake: &FakeKube, namespace: &str) -> KubeSourceConfig {
    KubeSourceConfig {
        connect: KubeConnect::Url(fake.url()),
        namespace: namespace.into(),
        backoff: backoff(),
        timing: WatchTiming::default(),
    }
}

/// A registry actor and one discovery actor over `source`, wired as the daemon wires them.
async fn spawn_discovery(
    kind: SourceKind,
    source: SourceSpec,
    on_first_pass: Arc<dyn Fn(&Namespace) + Send + Sync>,
) -> (
    RegistryReader,
    ractor::ActorRef<continuum_actors::registry::RegistryMsg>,
    ractor::ActorRef<continuum_actors::discovery::DiscoveryMsg>,
) {
    let namespace = source.namespace().clone();
    let RegistryParts {
        writer,
        inbox: mailbox,
        reader: registry,
    } = RegistryParts::new(RegistryConfig {
        enabled: true,
        source: kind,
        namespaces: vec![namespace.clone()],
    });
    let (registry_actor, _) = Actor::spawn(
        None,
        RegistryActor,
        RegistryArgs {
            writer,
            metrics: None,
        },
    )
    .await
    .expect("registry");
    let span = ActorSpan::start(
        &format!("{}:{namespace}", kind.as_str()),
        ActorKind::Discovery,
        None,
    );
    let (discovery, _) = Actor::spawn(
        None,
        DiscoveryActor,
        DiscoveryArgs {
            source,
            registry_actor: mailbox,
            metrics: None,
            on_first_pass,
            span,
        },
    )
    .await
    .expect("discovery");
    (registry, registry_actor, discovery)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_source_feeds_the_registry_through_the_shared_reducer() {
    let fake = FakeKube::start().await;
    fake.apply(Kind::Metadata, example_metadata());
    fake.apply(
        Kind::EndpointSlices,
        endpoint_slice("backend-abc", &[("worker-0", EXAMPLE_POD_UID, true)]),
    );
    let namespace = Namespace::new("dynamo");
    let (first_pass, mut passed) = tokio::sync::mpsc::unbounded_channel();
    let source = SourceSpec::KubeMetadata {
        kube: kube(&fake, "llm-prod"),
        namespace: namespace.clone(),
    };
    let (registry, registry_actor, discovery) = spawn_discovery(
        SourceKind::Kubernetes,
        source,
        Arc::new(move |ns: &Namespace| {
            let _ = first_pass.send(ns.clone());
        }),
    )
    .await;

    wait_for(&registry, "worker-0 published", |s| s.workers().len() == 1).await;
    assert_eq!(
        passed.recv().await,
        Some(namespace.clone()),
        "first pass reported"
    );
    let snapshot = registry.snapshot();
    let worker = &snapshot.workers()[0];
    assert_eq!(worker.instance_id(), hash_pod_name("worker-0"));
    assert_eq!(snapshot.source().as_str(), "kubernetes");
    assert!(snapshot.signals().load && snapshot.signals().capacity);
    assert_ne!(worker.role, Role::Unknown);
    assert!(worker.model.is_some(), "the card's model");

    // The Pod turns not ready: its records leave; ready again: they return.
    fake.apply(
        Kind::EndpointSlices,
        endpoint_slice("backend-abc", &[("worker-0", EXAMPLE_POD_UID, false)]),
    );
    wait_for(&registry, "not-ready worker removed", |s| {
        s.workers().is_empty()
    })
    .await;
    fake.apply(
        Kind::EndpointSlices,
        endpoint_slice("backend-abc", &[("worker-0", EXAMPLE_POD_UID, true)]),
    );
    wait_for(&registry, "ready again", |s| s.workers().len() == 1).await;
    discovery.stop(None);
    registry_actor.stop(None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_source_publishes_ready_pods_without_signals() {
    let fake = FakeKube::start().await;
    fake.apply(Kind::Pods, worker_pod("worker-0", "dyn", true));
    fake.apply(Kind::Pods, worker_pod("worker-1", "dyn", false));
    let namespace = Namespace::new("dyn");
    let source = SourceSpec::KubePods {
        kube: kube(&fake, "dynamo"),
        pods: PodSourceConfig {
            namespaces: vec![namespace.clone()],
            models: ModelMapping::Single("solar".into()),
        },
        namespace: namespace.clone(),
    };
    let (registry, registry_actor, discovery) = spawn_discovery(
        SourceKind::KubernetesPods,
        source,
        Arc::new(|_: &Namespace| {}),
    )
    .await;

    wait_for(&registry, "the ready Pod", |s| s.workers().len() == 1).await;
    let snapshot = registry.snapshot();
    let worker = &snapshot.workers()[0];
    assert_eq!(worker.instance_id(), hash_pod_name("worker-0"));
    assert_eq!(worker.model.as_deref(), Some("solar"));
    assert_eq!(worker.role, Role::Aggregated);
    assert!(!snapshot.signals().load && !snapshot.signals().capacity);
    let first_seen = worker.first_seen;

    // Another Pod turns ready; the first keeps its first_seen.
    fake.apply(Kind::Pods, worker_pod("worker-1", "dyn", true));
    wait_for(&registry, "both ready Pods", |s| s.workers().len() == 2).await;
    let snapshot = registry.snapshot();
    let again = snapshot
        .workers()
        .iter()
        .find(|w| w.instance_id() == hash_pod_name("worker-0"))
        .expect("worker-0");
    assert_eq!(again.first_seen, first_seen);
    fake.delete(Kind::Pods, "worker-0");
    wait_for(&registry, "deleted Pod removed", |s| s.workers().len() == 1).await;
    discovery.stop(None);
    registry_actor.stop(None);
}
