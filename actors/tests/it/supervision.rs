//! Supervision tree behaviour: failure restarts with backoff, operator restarts of one subtree,
//! escalation when the budget is spent. Synchronised on start notifications, never on sleeps.

use std::time::Duration;

use continuum_actors::lifecycle::ActorKind;
use continuum_actors::metrics::Metrics;
use continuum_actors::supervisor::{ChildContext, ChildSpec, spawn_root};
use continuum_actors::tree::{ActorState, ActorTree};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::mpsc;

/// A child that reports each start and fails (or panics) when told.
struct Probe;

enum ProbeMsg {
    Fail,
    Panic,
}

impl Actor for Probe {
    type Msg = ProbeMsg;
    type State = ();
    type Arguments = (String, mpsc::UnboundedSender<(String, ActorRef<ProbeMsg>)>);

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        (name, started): Self::Arguments,
    ) -> Result<(), ActorProcessingErr> {
        let _ = started.send((name, myself));
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        _state: &mut (),
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ProbeMsg::Fail => Err("probe told to fail".into()),
            ProbeMsg::Panic => panic!("probe told to panic"),
        }
    }
}

fn probe(name: &str, started: &mpsc::UnboundedSender<(String, ActorRef<ProbeMsg>)>) -> ChildSpec {
    let started = started.clone();
    let label = name.to_string();
    ChildSpec::new(name, ActorKind::Registry, move |ctx: ChildContext| {
        let args = (label.clone(), started.clone());
        async move {
            let (actor, _) = Actor::spawn_linked(None, Probe, args, ctx.supervisor).await?;
            Ok(actor.get_cell())
        }
    })
}

async fn next_start(
    rx: &mut mpsc::UnboundedReceiver<(String, ActorRef<ProbeMsg>)>,
) -> (String, ActorRef<ProbeMsg>) {
    tokio::time::timeout(Duration::from_secs(60), rx.recv())
        .await
        .expect("a start within the deadline")
        .expect("sender alive")
}

/// Makes child `a` fail with `how`: it restarts once after its backoff, its sibling is never
/// touched, the tree stops cleanly. The failure `a`'s row recorded.
async fn fail_one_child(how: ProbeMsg) -> String {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let tree = ActorTree::default();
    let (root, handle) = spawn_root(vec![probe("a", &tx), probe("b", &tx)], tree.clone(), None)
        .await
        .expect("root starts");
    let (_, a) = next_start(&mut rx).await;
    let (_, b) = next_start(&mut rx).await;

    a.send_message(how).expect("a alive");
    let (name, a2) = next_start(&mut rx).await;
    assert_eq!(name, "a");
    assert_ne!(a.get_id(), a2.get_id());
    let row = tree.get("root/a").expect("row for a");
    assert_eq!(row.restarts, 1);
    assert_eq!(row.state, ActorState::Running);
    // The sibling was never touched.
    assert_eq!(tree.get("root/b").expect("row").restarts, 0);
    assert!(b.get_status() == ractor::ActorStatus::Running);

    root.stop(None);
    handle.await.expect("root stops");
    assert!(tree.list().iter().all(|r| r.state == ActorState::Stopped));
    row.last_failure.expect("the failure is recorded")
}

#[tokio::test(start_paused = true)]
async fn failed_child_restarts_after_backoff_and_is_counted() {
    assert_eq!(fail_one_child(ProbeMsg::Fail).await, "probe told to fail");
}

/// The release profile unwinds (docs/deviations.md, section 3): a panic in an actor's handler is
/// caught by ractor, reported to the supervisor as a failure and restarted like any other, and
/// the process (the sibling, the root) keeps running.
#[tokio::test(start_paused = true)]
async fn a_panicking_child_is_caught_and_restarted_and_the_release_profile_unwinds() {
    let manifest = include_str!("../../../Cargo.toml");
    let profiles: Vec<&str> = manifest
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter(|l| l.replace(' ', "").starts_with("panic="))
        .collect();
    assert!(
        profiles.is_empty(),
        "a profile sets panic (abort would bypass supervision): {profiles:?}"
    );
    let failure = fail_one_child(ProbeMsg::Panic).await;
    assert!(failure.contains("probe told to panic"), "{failure}");
}

#[tokio::test(start_paused = true)]
async fn admin_restart_replaces_exactly_one_subtree() {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let tree = ActorTree::default();
    let sub = ChildSpec::supervisor(
        "discovery",
        ActorKind::DiscoverySupervisor,
        vec![probe("ns-a", &tx), probe("ns-b", &tx)],
    );
    let (root, handle) = spawn_root(vec![probe("registry", &tx), sub], tree.clone(), None)
        .await
        .expect("root starts");
    let mut first = std::collections::HashMap::new();
    for _ in 0..3 {
        let (name, actor) = next_start(&mut rx).await;
        first.insert(name, actor);
    }
    let ids: Vec<_> = tree.list().into_iter().map(|r| r.id).collect();
    assert_eq!(
        ids,
        [
            "root",
            "root/discovery",
            "root/discovery/ns-a",
            "root/discovery/ns-b",
            "root/registry"
        ]
    );

    tree.restart("root/discovery", Duration::from_secs(30))
        .await
        .expect("restart answered");
    let mut again = std::collections::HashMap::new();
    for _ in 0..2 {
        let (name, actor) = next_start(&mut rx).await;
        again.insert(name, actor);
    }
    assert!(again.contains_key("ns-a") && again.contains_key("ns-b"));
    assert_ne!(again["ns-a"].get_id(), first["ns-a"].get_id());
    // The registry kept running through it.
    assert_eq!(first["registry"].get_status(), ractor::ActorStatus::Running);
    assert_eq!(tree.get("root/discovery").expect("row").restarts, 1);
    assert_eq!(tree.get("root/registry").expect("row").restarts, 0);
    assert!(matches!(
        tree.restart("root", Duration::from_secs(1)).await,
        Err(continuum_actors::tree::RestartError::Root)
    ));
    assert!(
        tree.restart("root/nope", Duration::from_secs(1))
            .await
            .is_err()
    );

    root.stop(None);
    handle.await.expect("root stops");
}

#[tokio::test(start_paused = true)]
async fn spent_budget_escalates_to_the_parent() {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let tree = ActorTree::default();
    let sub = ChildSpec::supervisor(
        "flaky",
        ActorKind::DiscoverySupervisor,
        vec![probe("x", &tx)],
    );
    let metrics = Metrics::new("supervision-test").expect("metrics");
    let (root, handle) = spawn_root(vec![sub], tree.clone(), Some(metrics.clone()))
        .await
        .expect("root starts");
    let (_, mut x) = next_start(&mut rx).await;
    // Five restarts are allowed per minute; the sixth failure escalates to `flaky`, which fails,
    // so root restarts the whole `flaky` subtree.
    for _ in 0..6 {
        x.send_message(ProbeMsg::Fail).expect("x alive");
        x = next_start(&mut rx).await.1;
    }
    let flaky = tree.get("root/flaky").expect("row");
    assert_eq!(flaky.restarts, 1, "the subtree was restarted by root");
    assert!(
        flaky
            .last_failure
            .expect("failure recorded")
            .contains("restart budget")
    );
    // `flaky` spent x's budget once; root's budget for `flaky` is untouched.
    let exhausted = |actor: &str| {
        metrics.value(
            "continuum_actor_restart_budget_exhausted_total",
            &[("actor", actor)],
        )
    };
    assert_eq!(exhausted("registry"), Some(1.0));
    assert_eq!(exhausted("discovery_supervisor"), Some(0.0));

    root.stop(None);
    handle.await.expect("root stops");
}
