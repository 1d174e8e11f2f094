//! The `kubernetes` metadata source against the fake API server: the DynamoWorkerMetadata ⋈
//! EndpointSlice join as etcd-style reducer events, pagination in pages of 32, a 410 on one
//! watch relisting both, and a stalled slice watch caught by its own idle deadline.

use crate::support::fake_kube;

use std::time::Duration;

use continuum_actors::kube_source::{
    KubeConnect, KubeSourceConfig, MetadataUpdate, WatchTiming, run_metadata_source,
};
use continuum_protocol::backoff::{BackoffPolicy, Jitter};
use continuum_protocol::discovery::SourceEvent;
use continuum_protocol::ids::Namespace;
use continuum_protocol::kube::metadata::MetadataConfig;
use fake_kube::{EXAMPLE_POD_UID, FakeKube, Kind, endpoint_slice, example_metadata};
use serde_json::json;
use tokio::sync::mpsc;

const ENDPOINT_KEY: &str = "v1/instances/dynamo/backend/generate/43710f49c0cff";
const CARD_KEY: &str = "v1/mdc/dynamo/backend/generate/43710f49c0cff";
const CHANNEL_KEY: &str = "v1/event_channels/namespace/dynamo/component/backend/endpoint/generate/topic/kv-events/160a4f48de0ca9";

struct Source {
    rx: mpsc::Receiver<MetadataUpdate>,
    task: tokio::task::JoinHandle<()>,
    seen: Vec<MetadataUpdate>,
}

impl Drop for Source {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Source {
    fn start(fake: &FakeKube, timing: WatchTiming) -> Source {
        let (tx, rx) = mpsc::channel(64);
        let config = KubeSourceConfig {
            connect: KubeConnect::Url(fake.url()),
            namespace: "llm-prod".into(),
            backoff: BackoffPolicy {
                initial: Duration::from_millis(10),
                max: Duration::from_millis(100),
                jitter: Jitter::None,
            },
            timing,
        };
        let metadata = MetadataConfig {
            namespaces: vec![Namespace::new("dynamo")],
        };
        let task = tokio::spawn(run_metadata_source(config, metadata, tx));
        Source {
            rx,
            task,
            seen: Vec::new(),
        }
    }

    /// Receives reducer event batches until one satisfies `pred`.
    async fn events(
        &mut self,
        what: &str,
        pred: impl Fn(&[SourceEvent]) -> bool,
    ) -> Vec<SourceEvent> {
        loop {
            let update = tokio::time::timeout(Duration::from_secs(20), self.rx.recv())
                .await
                .unwrap_or_else(|_| panic!("timed out waiting for {what}; saw {:?}", self.seen))
                .expect("source alive");
            self.seen.push(update.clone());
            if let MetadataUpdate::Data(events) = update
                && pred(&events)
            {
                return events;
            }
        }
    }
}

fn summary(events: &[SourceEvent]) -> Vec<String> {
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

fn is_resync(events: &[SourceEvent]) -> bool {
    events.first() == Some(&SourceEvent::Init)
}

fn timing() -> WatchTiming {
    WatchTiming {
        setup_timeout: Duration::from_secs(10),
        watch_timeout_secs: 290,
        idle_timeout: Duration::from_secs(60),
    }
}

#[tokio::test]
async fn ready_metadata_is_fed_as_an_etcd_resync_then_diffs() {
    let fake = FakeKube::start().await;
    fake.apply(Kind::Metadata, example_metadata());
    fake.apply(
        Kind::EndpointSlices,
        endpoint_slice("backend-abc", &[("worker-0", EXAMPLE_POD_UID, true)]),
    );
    let mut source = Source::start(&fake, timing());
    let resync = source.events("resync", is_resync).await;
    assert_eq!(
        summary(&resync),
        vec![
            "Init".to_owned(),
            format!("InitApply {CHANNEL_KEY}"),
            format!("InitApply {ENDPOINT_KEY}"),
            format!("InitApply {CARD_KEY}"),
            "InitDone".to_owned(),
        ]
    );
    let SourceEvent::InitApply { value, .. } = &resync[2] else {
        unreachable!()
    };
    let endpoint: serde_json::Value = serde_json::from_slice(value).expect("JSON value");
    assert_eq!(endpoint["instance_id"], json!(1_186_445_869_714_687_u64));
    // `connected` rises once the resync is out.
    assert_eq!(
        source.rx.recv().await,
        Some(MetadataUpdate::Connected(true))
    );
    fake.wait_watches(Kind::Metadata, 1).await;
    fake.wait_watches(Kind::EndpointSlices, 1).await;

    // Readiness drops: every key leaves.
    fake.apply(
        Kind::EndpointSlices,
        endpoint_slice("backend-abc", &[("worker-0", EXAMPLE_POD_UID, false)]),
    );
    let down = source.events("deletes", |e| !is_resync(e)).await;
    assert_eq!(
        summary(&down),
        vec![
            format!("Delete {CHANNEL_KEY}"),
            format!("Delete {ENDPOINT_KEY}"),
            format!("Delete {CARD_KEY}"),
        ]
    );
    // Ready again, then a resource update re-feeds only the modified record.
    fake.apply(
        Kind::EndpointSlices,
        endpoint_slice("backend-abc", &[("worker-0", EXAMPLE_POD_UID, true)]),
    );
    assert_eq!(source.events("re-adds", |e| !is_resync(e)).await.len(), 3);
    let mut changed = example_metadata();
    changed["spec"]["data"]["endpoints"]["dynamo/backend/generate/43710f49c0cff"]["transport"] =
        json!({"tcp": "10.244.1.18:37113/43710f49c0cff/dynamo/backend/generate"});
    fake.apply(Kind::Metadata, changed);
    let update = source.events("update", |e| !is_resync(e)).await;
    assert_eq!(summary(&update), vec![format!("Apply {ENDPOINT_KEY}")]);
    fake.delete(Kind::Metadata, "worker-0");
    let gone = source.events("delete", |e| !is_resync(e)).await;
    assert_eq!(gone.len(), 3);
}

#[tokio::test]
async fn metadata_is_listed_in_pages_of_32_and_slices_in_pages_of_500() {
    let fake = FakeKube::start().await;
    for i in 0..70 {
        let mut dwm = example_metadata();
        let name = format!("worker-{i}");
        dwm["metadata"]["name"] = json!(name);
        dwm["metadata"]["uid"] = json!(format!("dwm-{i}"));
        dwm["metadata"]["ownerReferences"][0]["name"] = json!(name);
        dwm["spec"]["data"] = json!({"endpoints": null});
        fake.apply(Kind::Metadata, dwm);
    }
    let mut source = Source::start(&fake, timing());
    source.events("resync", is_resync).await;
    let counters = fake.counters();
    assert_eq!(
        counters.pages[&Kind::Metadata],
        3,
        "70 resources in pages of 32"
    );
    let requests = fake.requests();
    assert!(
        requests
            .iter()
            .filter(|r| r.contains("dynamoworkermetadatas") && !r.contains("watch=true"))
            .all(|r| r.contains("limit=32")),
        "{requests:?}"
    );
    let slices: Vec<_> = requests
        .iter()
        .filter(|r| r.contains("endpointslices"))
        .collect();
    assert!(slices[0].contains("limit=500"), "{slices:?}");
    assert!(
        slices[0].contains("nvidia.com%2Fdynamo-discovery-backend%3Dkubernetes"),
        "{slices:?}"
    );
    // The resource watch has no label selector.
    assert!(
        requests
            .iter()
            .filter(|r| r.contains("dynamoworkermetadatas"))
            .all(|r| !r.contains("labelSelector")),
        "{requests:?}"
    );
}

#[tokio::test]
async fn a_410_on_the_resource_watch_relists_both_kinds() {
    let fake = FakeKube::start().await;
    fake.apply(Kind::Metadata, example_metadata());
    let mut source = Source::start(&fake, timing());
    let first = source.events("first resync", is_resync).await;
    assert_eq!(summary(&first), vec!["Init", "InitDone"], "not ready yet");
    fake.wait_watches(Kind::Metadata, 1).await;
    fake.wait_watches(Kind::EndpointSlices, 1).await;
    // The slice watch misses the readiness change; only the relist after the 410 shows it.
    fake.stall(Kind::EndpointSlices);
    fake.apply(
        Kind::EndpointSlices,
        endpoint_slice("backend-abc", &[("worker-0", EXAMPLE_POD_UID, true)]),
    );
    fake.expire(Kind::Metadata);
    let second = source.events("second resync", is_resync).await;
    assert_eq!(second.len(), 5, "{:?}", summary(&second));
    assert!(source.seen.contains(&MetadataUpdate::Connected(false)));
    let counters = fake.counters();
    assert_eq!(counters.lists[&Kind::Metadata], 2);
    assert_eq!(counters.lists[&Kind::EndpointSlices], 2);
}

#[tokio::test]
async fn a_stalled_slice_watch_hits_its_own_idle_deadline_while_resources_flow() {
    let fake = FakeKube::start().await;
    fake.apply(Kind::Metadata, example_metadata());
    fake.apply(
        Kind::EndpointSlices,
        endpoint_slice("backend-abc", &[("worker-0", EXAMPLE_POD_UID, true)]),
    );
    let mut source = Source::start(
        &fake,
        WatchTiming {
            idle_timeout: Duration::from_millis(300),
            ..timing()
        },
    );
    source
        .events("first resync", |e| is_resync(e) && e.len() == 5)
        .await;
    fake.wait_watches(Kind::Metadata, 1).await;
    fake.wait_watches(Kind::EndpointSlices, 1).await;
    fake.stall(Kind::EndpointSlices);
    // Keep the resource watch busy: each update is answered by one Apply. Its deadline keeps
    // moving, so only the slice watch's own deadline can end the session.
    let mut updates = 0u32;
    loop {
        updates += 1;
        let mut changed = example_metadata();
        changed["spec"]["data"]["endpoints"]["dynamo/backend/generate/43710f49c0cff"]["transport"] =
            json!({"tcp": format!("10.244.1.17:{updates}/43710f49c0cff")});
        fake.apply(Kind::Metadata, changed);
        let batch = source.events("an update or a resync", |_| true).await;
        if is_resync(&batch) {
            break;
        }
        assert_eq!(summary(&batch), vec![format!("Apply {ENDPOINT_KEY}")]);
    }
    assert!(
        updates > 1,
        "the resource watch was active while the slice watch stalled"
    );
    assert!(source.seen.contains(&MetadataUpdate::Connected(false)));
    assert!(fake.counters().lists[&Kind::EndpointSlices] >= 2);
}

#[tokio::test]
async fn container_mode_and_mismatched_resources_are_counted_once() {
    let fake = FakeKube::start().await;
    let mut container = example_metadata();
    container["metadata"]["name"] = json!("worker-0-engine-0");
    container["metadata"]["uid"] = json!("dwm-engine");
    fake.apply(Kind::Metadata, container.clone());
    let mut mismatch = example_metadata();
    mismatch["metadata"]["name"] = json!("worker-1");
    mismatch["metadata"]["uid"] = json!("dwm-1");
    mismatch["metadata"]["ownerReferences"][0]["name"] = json!("worker-1");
    fake.apply(Kind::Metadata, mismatch);
    let mut source = Source::start(&fake, timing());
    source.events("resync", is_resync).await;
    fake.wait_watches(Kind::Metadata, 1).await;
    container["metadata"]["labels"] = json!({"touched": "yes"});
    fake.apply(Kind::Metadata, container);
    fake.apply(Kind::Metadata, example_metadata());
    fake.apply(
        Kind::EndpointSlices,
        endpoint_slice("backend-abc", &[("worker-0", EXAMPLE_POD_UID, true)]),
    );
    source.events("worker-0 fed", |e| e.len() == 3).await;
    let counted: Vec<_> = source
        .seen
        .iter()
        .filter_map(|u| match u {
            MetadataUpdate::Counted { kind, object } => Some((*kind, object.as_str())),
            _ => None,
        })
        .collect();
    assert_eq!(
        counted,
        vec![("refused", "worker-0-engine-0"), ("mismatch", "worker-1")]
    );
}
