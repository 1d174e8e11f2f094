//! The real supervision tree over OTLP: a child that fails is restarted by its supervisor, and
//! an operator restarts a subtree; the lifecycle spans arrive at a real OTLP/gRPC receiver on
//! loopback with the supervisor → actor.restart → new incarnation parent links.
//!
//! Its own test binary: it installs the global subscriber (ractor actors run on worker threads,
//! which a thread-local default would not see).

use crate::support;

use std::time::Duration;

use continuum_actors::lifecycle::ActorKind;
use continuum_actors::supervisor::{ChildContext, ChildSpec, spawn_root};
use continuum_actors::tree::ActorTree;
use continuum_router::telemetry::{self, LogFormat, TelemetryOptions};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use support::otlp::OtlpReceiver;
use tokio::sync::mpsc;
use tracing_subscriber::fmt::TestWriter;

struct Worker;

impl Actor for Worker {
    type Msg = ();
    type State = ();
    type Arguments = mpsc::UnboundedSender<ActorRef<()>>;

    async fn pre_start(
        &self,
        myself: ActorRef<()>,
        started: Self::Arguments,
    ) -> Result<(), ActorProcessingErr> {
        let _ = started.send(myself);
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<()>,
        _msg: (),
        _state: &mut (),
    ) -> Result<(), ActorProcessingErr> {
        Err("watch stream broke".into())
    }
}

fn worker(name: &str, kind: ActorKind, started: &mpsc::UnboundedSender<ActorRef<()>>) -> ChildSpec {
    let started = started.clone();
    ChildSpec::new(name, kind, move |ctx: ChildContext| {
        let started = started.clone();
        async move {
            Ok(Actor::spawn_linked(None, Worker, started, ctx.supervisor)
                .await?
                .0
                .get_cell())
        }
    })
}

async fn next(rx: &mut mpsc::UnboundedReceiver<ActorRef<()>>) -> ActorRef<()> {
    tokio::time::timeout(Duration::from_secs(30), rx.recv())
        .await
        .expect("started in time")
        .expect("sender alive")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarts_of_the_real_tree_arrive_with_parent_links() {
    // Installs the global subscriber: in a process of its own.
    if !support::process::own_process(
        module_path!(),
        "restarts_of_the_real_tree_arrive_with_parent_links",
    ) {
        return;
    }
    let receiver = OtlpReceiver::start().await.expect("bind loopback");
    // TestWriter: the log stays captured unless the test fails.
    let guard = telemetry::init_with_writer(
        &TelemetryOptions {
            log_format: LogFormat::Text,
            log_level: "info".to_owned(),
            service_name: "continuum-router-tree-test".to_owned(),
            otlp_endpoint: Some(receiver.endpoint()),
        },
        TestWriter::new(),
    )
    .expect("telemetry installs");

    let (tx, mut rx) = mpsc::unbounded_channel();
    let tree = ActorTree::default();
    let discovery = ChildSpec::supervisor(
        "discovery",
        ActorKind::DiscoverySupervisor,
        vec![worker("etcd:dynamo", ActorKind::Discovery, &tx)],
    );
    let (root, handle) = spawn_root(
        vec![worker("registry", ActorKind::Registry, &tx), discovery],
        tree.clone(),
        None,
    )
    .await
    .expect("root starts");
    let _registry = next(&mut rx).await;
    let etcd = next(&mut rx).await;

    // A failure: restarted after the 800 ms backoff.
    etcd.send_message(()).expect("alive");
    let _etcd2 = next(&mut rx).await;
    // An operator restart of the discovery subtree.
    tree.restart("root/discovery", Duration::from_secs(30))
        .await
        .expect("admin restart");
    let _etcd3 = next(&mut rx).await;

    // Stopping the tree ends every span, so all of them (root included) get exported.
    root.stop(None);
    handle.await.expect("root stops");
    guard.force_flush().await.ok();

    let spans = receiver
        .wait_for(
            |spans| {
                spans
                    .iter()
                    .any(|s| s.name() == "actor" && s.attr("actor.id").as_deref() == Some("root"))
                    && spans.iter().filter(|s| s.name() == "actor.restart").count() >= 2
            },
            Duration::from_secs(30),
        )
        .await
        .expect("lifecycle spans exported");

    let find = |name: &str, id: &str, incarnation: Option<i64>| {
        spans
            .iter()
            .find(|s| {
                s.name() == name
                    && s.attr("actor.id").as_deref() == Some(id)
                    && incarnation.is_none_or(|i| s.attr_i64("actor.incarnation") == Some(i))
            })
            .unwrap_or_else(|| panic!("span {name} {id} {incarnation:?} not exported"))
    };
    let root_span = find("actor", "root", None);
    let discovery1 = find("actor", "root/discovery", Some(1));
    let etcd1 = find("actor", "root/discovery/etcd:dynamo", Some(1));
    let etcd_restart = find("actor.restart", "root/discovery/etcd:dynamo", None);
    let etcd2 = find("actor", "root/discovery/etcd:dynamo", Some(2));
    let discovery_restart = find("actor.restart", "root/discovery", None);
    let discovery2 = find("actor", "root/discovery", Some(2));

    assert!(discovery1.is_child_of(root_span));
    assert!(
        etcd1.is_child_of(discovery1),
        "first incarnation under its supervisor"
    );
    assert!(
        etcd_restart.is_child_of(discovery1),
        "restart span under the supervisor"
    );
    assert!(
        etcd2.is_child_of(etcd_restart),
        "new incarnation under the restart span"
    );
    assert!(
        etcd_restart.linked_span_ids().contains(&etcd1.span_id()),
        "link to the failed one"
    );
    assert_eq!(
        etcd_restart.attr("actor.parent").as_deref(),
        Some("root/discovery")
    );
    assert!(etcd_restart.attr_i64("delay_ms").is_some_and(|d| d >= 800));
    assert!(etcd1.event_names().contains(&"actor.failed"));
    assert!(discovery_restart.is_child_of(root_span));
    assert!(discovery2.is_child_of(discovery_restart));
    assert_eq!(etcd1.trace_id(), etcd2.trace_id());
    guard.shutdown().await.ok();
}
