//! The `kubernetes_pods` source against the fake API server: pagination, rollout, readiness
//! flaps, 410 during a watch, a stalled watch hitting the idle deadline, routine closes and
//! container-mode refusals.

use crate::support::fake_kube;

use std::time::Duration;

use continuum_actors::kube_source::{
    KubeConnect, KubeSourceConfig, PodUpdate, WatchTiming, run_pod_source,
};
use continuum_protocol::backoff::{BackoffPolicy, Jitter};
use continuum_protocol::ids::Namespace;
use continuum_protocol::kube::pods::{ModelMapping, PodSourceConfig};
use fake_kube::{FakeKube, Kind, worker_pod};
use serde_json::json;
use tokio::sync::mpsc;

fn config(fake: &FakeKube, timing: WatchTiming) -> KubeSourceConfig {
    KubeSourceConfig {
        connect: KubeConnect::Url(fake.url()),
        namespace: "dynamo".into(),
        backoff: BackoffPolicy {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(100),
            jitter: Jitter::None,
        },
        timing,
    }
}

fn pods_config() -> PodSourceConfig {
    PodSourceConfig {
        namespaces: vec![Namespace::new("dyn")],
        models: ModelMapping::Single("solar".into()),
    }
}

struct Source {
    rx: mpsc::Receiver<PodUpdate>,
    task: tokio::task::JoinHandle<()>,
    seen: Vec<PodUpdate>,
}

impl Drop for Source {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Source {
    fn start(fake: &FakeKube, timing: WatchTiming) -> Source {
        let (tx, rx) = mpsc::channel(64);
        let task = tokio::spawn(run_pod_source(config(fake, timing), pods_config(), tx));
        Source {
            rx,
            task,
            seen: Vec::new(),
        }
    }

    /// Receives until an update satisfies `pred`; returns it.
    async fn until(&mut self, what: &str, pred: impl Fn(&PodUpdate) -> bool) -> PodUpdate {
        let deadline = Duration::from_secs(20);
        loop {
            let update = tokio::time::timeout(deadline, self.rx.recv())
                .await
                .unwrap_or_else(|_| panic!("timed out waiting for {what}; saw {:?}", self.seen))
                .expect("source alive");
            self.seen.push(update.clone());
            if pred(&update) {
                return update;
            }
        }
    }

    /// Waits for a member set with exactly these Pod names.
    async fn members(&mut self, names: &[&str]) {
        let mut want: Vec<String> = names.iter().map(|s| (*s).to_owned()).collect();
        want.sort();
        self.until(&format!("members {want:?}"), |u| match u {
            PodUpdate::Data(members) => {
                let mut got: Vec<String> = members.iter().map(|m| m.pod_name.clone()).collect();
                got.sort();
                got == want
            }
            _ => false,
        })
        .await;
    }
}

fn fast() -> WatchTiming {
    WatchTiming {
        setup_timeout: Duration::from_secs(10),
        watch_timeout_secs: 290,
        idle_timeout: Duration::from_secs(60),
    }
}

#[tokio::test]
async fn lists_in_pages_of_500_and_watches_with_the_contract_parameters() {
    let fake = FakeKube::start().await;
    for i in 0..1203 {
        fake.apply(
            Kind::Pods,
            worker_pod(&format!("worker-{i:04}"), "dyn", true),
        );
    }
    // Not selected: another Dynamo namespace.
    fake.apply(Kind::Pods, worker_pod("elsewhere", "other", true));
    let mut source = Source::start(&fake, WatchTiming::default());
    let update = source
        .until("first member set", |u| matches!(u, PodUpdate::Data(_)))
        .await;
    let PodUpdate::Data(members) = update else {
        unreachable!()
    };
    assert_eq!(members.len(), 1203);
    assert!(members.iter().all(|m| m.model == "solar"));
    fake.wait_watches(Kind::Pods, 1).await;
    let counters = fake.counters();
    assert_eq!(counters.pages[&Kind::Pods], 3, "1203 Pods in pages of 500");
    let requests = fake.requests();
    let lists: Vec<_> = requests
        .iter()
        .filter(|r| !r.contains("watch=true"))
        .collect();
    assert!(lists.iter().all(|r| r.contains("limit=500")), "{lists:?}");
    assert!(lists[1].contains("continue=page-"), "{lists:?}");
    assert!(
        lists[0].contains("nvidia.com%2Fdynamo-namespace%3Ddyn"),
        "selector carries the namespace: {}",
        lists[0]
    );
    let watch = requests
        .iter()
        .find(|r| r.contains("watch=true"))
        .expect("a watch");
    assert!(watch.contains("timeoutSeconds=290"), "{watch}");
    assert!(watch.contains("resourceVersion="), "{watch}");
    assert!(watch.contains("allowWatchBookmarks=true"), "{watch}");
}

#[tokio::test]
async fn a_rollout_replaces_the_old_pod_with_the_new_one() {
    let fake = FakeKube::start().await;
    fake.apply(Kind::Pods, worker_pod("worker-old", "dyn", true));
    let mut source = Source::start(&fake, fast());
    source.members(&["worker-old"]).await;
    fake.wait_watches(Kind::Pods, 1).await;
    fake.apply(Kind::Pods, worker_pod("worker-new", "dyn", false));
    fake.apply(Kind::Pods, worker_pod("worker-new", "dyn", true));
    source.members(&["worker-new", "worker-old"]).await;
    fake.apply(Kind::Pods, worker_pod("worker-old", "dyn", false));
    source.members(&["worker-new"]).await;
    fake.delete(Kind::Pods, "worker-old");
    fake.apply(Kind::Pods, worker_pod("worker-new2", "dyn", true));
    source.members(&["worker-new", "worker-new2"]).await;
}

#[tokio::test]
async fn readiness_flaps_toggle_membership() {
    let fake = FakeKube::start().await;
    fake.apply(Kind::Pods, worker_pod("worker-0", "dyn", true));
    let mut source = Source::start(&fake, fast());
    source.members(&["worker-0"]).await;
    fake.wait_watches(Kind::Pods, 1).await;
    for _ in 0..3 {
        fake.apply(Kind::Pods, worker_pod("worker-0", "dyn", false));
        source.members(&[]).await;
        fake.apply(Kind::Pods, worker_pod("worker-0", "dyn", true));
        source.members(&["worker-0"]).await;
    }
    let mut deleting = worker_pod("worker-0", "dyn", true);
    deleting["metadata"]["deletionTimestamp"] = json!("2026-11-30T12:00:00Z");
    fake.apply(Kind::Pods, deleting);
    source.members(&[]).await;
}

#[tokio::test]
async fn a_410_during_the_watch_leads_to_a_full_relist() {
    let fake = FakeKube::start().await;
    fake.apply(Kind::Pods, worker_pod("worker-0", "dyn", true));
    let mut source = Source::start(&fake, fast());
    source.members(&["worker-0"]).await;
    source
        .until("connected", |u| *u == PodUpdate::Connected(true))
        .await;
    fake.wait_watches(Kind::Pods, 1).await;
    fake.stall(Kind::Pods);
    // Missed by the stalled watch: only the relist can reveal it.
    fake.apply(Kind::Pods, worker_pod("worker-1", "dyn", true));
    fake.expire(Kind::Pods);
    source
        .until("disconnected", |u| *u == PodUpdate::Connected(false))
        .await;
    source.members(&["worker-0", "worker-1"]).await;
    source
        .until("reconnected", |u| *u == PodUpdate::Connected(true))
        .await;
    assert_eq!(fake.counters().lists[&Kind::Pods], 2);
}

#[tokio::test]
async fn a_stalled_watch_hits_the_idle_deadline_and_relists() {
    let fake = FakeKube::start().await;
    fake.apply(Kind::Pods, worker_pod("worker-0", "dyn", true));
    let timing = WatchTiming {
        idle_timeout: Duration::from_millis(300),
        ..fast()
    };
    let mut source = Source::start(&fake, timing);
    source.members(&["worker-0"]).await;
    fake.wait_watches(Kind::Pods, 1).await;
    fake.stall(Kind::Pods);
    fake.apply(Kind::Pods, worker_pod("worker-0", "dyn", false));
    source
        .until("disconnected", |u| *u == PodUpdate::Connected(false))
        .await;
    source.members(&[]).await;
    assert!(fake.counters().lists[&Kind::Pods] >= 2);
}

#[tokio::test]
async fn an_early_eof_relists_and_drops_connected() {
    let fake = FakeKube::start().await;
    fake.apply(Kind::Pods, worker_pod("worker-0", "dyn", true));
    let mut source = Source::start(&fake, fast());
    source
        .until("connected", |u| *u == PodUpdate::Connected(true))
        .await;
    fake.wait_watches(Kind::Pods, 1).await;
    fake.cut(Kind::Pods);
    source
        .until("disconnected", |u| *u == PodUpdate::Connected(false))
        .await;
    source
        .until("reconnected", |u| *u == PodUpdate::Connected(true))
        .await;
    fake.wait_watches(Kind::Pods, 2).await;
}

#[tokio::test]
async fn routine_server_closes_relist_without_dropping_connected() {
    let fake = FakeKube::start().await;
    fake.apply(Kind::Pods, worker_pod("worker-0", "dyn", true));
    // The server closes each watch after 1 s; the backoff max (100 ms) is below that, so a
    // full-length session is routine.
    let timing = WatchTiming {
        watch_timeout_secs: 1,
        ..fast()
    };
    let mut source = Source::start(&fake, timing);
    source
        .until("connected", |u| *u == PodUpdate::Connected(true))
        .await;
    fake.wait_watches(Kind::Pods, 3).await;
    // Relists republish the member set; none of the routine closes reported a disconnect.
    while let Ok(update) = source.rx.try_recv() {
        source.seen.push(update);
    }
    assert!(
        !source.seen.contains(&PodUpdate::Connected(false)),
        "{:?}",
        source.seen
    );
    assert!(fake.counters().lists[&Kind::Pods] >= 3);
}

#[tokio::test]
async fn container_mode_pods_are_counted_once_as_refused() {
    let fake = FakeKube::start().await;
    let mut pod = worker_pod("worker-c", "dyn", true);
    pod["metadata"]["annotations"] = json!({"nvidia.com/dynamo-kube-discovery-mode": "container"});
    fake.apply(Kind::Pods, pod.clone());
    fake.apply(Kind::Pods, worker_pod("worker-0", "dyn", true));
    let mut source = Source::start(&fake, fast());
    source
        .until(
            "refused",
            |u| matches!(u, PodUpdate::Counted { kind: "refused", object } if object == "worker-c"),
        )
        .await;
    source.members(&["worker-0"]).await;
    fake.wait_watches(Kind::Pods, 1).await;
    // A modification of the same Pod is not counted again.
    pod["metadata"]["labels"]["extra"] = json!("x");
    fake.apply(Kind::Pods, pod);
    fake.apply(Kind::Pods, worker_pod("worker-1", "dyn", true));
    source.members(&["worker-0", "worker-1"]).await;
    let refused = source
        .seen
        .iter()
        .filter(|u| {
            matches!(
                u,
                PodUpdate::Counted {
                    kind: "refused",
                    ..
                }
            )
        })
        .count();
    assert_eq!(refused, 1);
}

#[tokio::test]
async fn a_hung_list_hits_the_setup_budget_and_the_pass_is_retried() {
    let fake = FakeKube::start().await;
    fake.apply(Kind::Pods, worker_pod("worker-0", "dyn", true));
    fake.hang_lists(Kind::Pods);
    let timing = WatchTiming {
        setup_timeout: Duration::from_millis(200),
        ..fast()
    };
    let mut source = Source::start(&fake, timing);
    // Two abandoned attempts prove the budget ended the first one.
    fake.wait_for(|c| c.lists.get(&Kind::Pods).copied().unwrap_or(0) >= 2)
        .await;
    fake.unhang_lists(Kind::Pods);
    source.members(&["worker-0"]).await;
    source
        .until("connected", |u| *u == PodUpdate::Connected(true))
        .await;
    assert!(
        !source.seen.contains(&PodUpdate::Connected(false)),
        "never connected, so never disconnected"
    );
}
