//! Golden fleet views of the four captured Dynamo 1.6.1 etcd dumps.
//!
//! Each `*.raw.json` range get is replayed as one resync; the resulting snapshot must equal the
//! checked-in `tests/golden/<dump>.view.json` (regenerate with `UPDATE_GOLDEN=1`, then verify by
//! hand against `*.decoded.json`). The hand-verified facts are also asserted directly below.

use std::path::PathBuf;

use continuum_protocol::discovery::{
    DiscoveryReducer, DynamoSnapshot, EventTopic, Role, SourceEvent, SourceKind, build_snapshot,
};
use continuum_protocol::ids::{InstanceId, PublisherId, WorkerKey};
use continuum_protocol::time::UnixMillis;

use super::support::{dump_kvs, fixtures_dir, ns, resync};

const NOW: UnixMillis = UnixMillis(1_790_136_662_000);

fn snapshot_of(dump: &str) -> DynamoSnapshot {
    let mut reducer = DiscoveryReducer::new(ns("dyntest"));
    assert!(
        resync(&mut reducer, &dump_kvs(dump), NOW),
        "{dump}: first resync changes the view"
    );
    build_snapshot(SourceKind::Etcd, &[ns("dyntest")], &[reducer.view()])
}

fn golden_json(snapshot: &DynamoSnapshot) -> serde_json::Value {
    let workers: Vec<_> = snapshot
        .workers()
        .iter()
        .map(|w| {
            let mut j = w.admin_json();
            j["has_card"] = serde_json::json!(w.card.is_some());
            j["transport"] = serde_json::json!(w.transport());
            j
        })
        .collect();
    let publishers: Vec<_> = snapshot
        .publishers()
        .iter()
        .map(|p| {
            let mut j = serde_json::to_value(p.as_ref()).expect("publisher json");
            j["address"] = serde_json::json!(p.address().authority());
            j
        })
        .collect();
    serde_json::json!({
        "source": snapshot.source().as_str(),
        "namespaces": snapshot.namespaces(),
        "workers": workers,
        "publishers": publishers,
        "load_publishers": snapshot.load_publisher_count(),
        "kv_event_publishers": snapshot.kv_event_publisher_count(),
    })
}

fn check_golden(dump: &str) -> DynamoSnapshot {
    let snapshot = snapshot_of(dump);
    let got = golden_json(&snapshot);
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/golden/{dump}.view.json"));
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        let text = serde_json::to_string_pretty(&got).expect("json") + "\n";
        std::fs::write(&path, text).expect("write golden");
    }
    let want: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}")),
    )
    .expect("golden json");
    assert_eq!(got, want, "{dump}: fleet view differs from {path:?}");
    snapshot
}

fn key(id: u64) -> WorkerKey {
    WorkerKey {
        namespace: ns("dyntest"),
        instance_id: InstanceId(id),
    }
}

#[test]
fn agg_two_workers_dump_gives_two_aggregated_workers_and_four_publishers() {
    let snap = check_golden("agg-2workers");
    assert_eq!(snap.workers().len(), 2);
    for id in [7_668_682_573_709_850_375, 7_668_682_573_709_850_383] {
        let w = snap.worker(&key(id)).expect("worker");
        assert_eq!(w.role, Role::Aggregated);
        assert_eq!(w.model.as_deref(), Some("tiny"));
        assert_eq!(w.component, "backend");
        assert_eq!(w.block_size, Some(16));
        assert_eq!(w.capacity.total_kv_blocks, Some(24));
        assert_eq!(w.capacity.max_num_batched_tokens, Some(8192));
        assert_eq!(w.capacity.max_num_seqs, Some(256));
        assert_eq!(w.capacity.context_length, Some(0));
        assert_eq!(w.dp_size, Some(1));
        assert!(w.card.is_some());
    }
    assert_eq!(snap.workers_for_model(&ns("dyntest"), "tiny").count(), 2);
    assert_eq!(snap.load_publisher_count(), 2);
    assert_eq!(snap.kv_event_publisher_count(), 2);
    let kv = snap
        .publisher(&ns("dyntest"), PublisherId(6_256_666_860_490_770))
        .expect("kv-events");
    assert_eq!(kv.topic, EventTopic::KvEvents);
    assert_eq!(kv.worker, Some(key(7_668_682_573_709_850_383)));
    assert_eq!(kv.address().authority(), "127.0.0.1:33513");
    let load = snap
        .publisher(&ns("dyntest"), PublisherId(7_491_445_273_990_429))
        .expect("kv_metrics");
    assert_eq!(load.topic, EventTopic::KvMetrics);
    assert_eq!(
        load.worker, None,
        "kv_metrics has no EventSource naming its worker"
    );
}

fn check_disagg(dump: &str) {
    let snap = check_golden(dump);
    assert_eq!(snap.workers().len(), 2, "{dump}");
    let decode = snap
        .worker(&key(7_668_682_573_600_862_486))
        .expect("decode");
    assert_eq!(decode.role, Role::Decode, "component backend, card decode");
    assert_eq!(decode.component, "backend");
    let prefill = snap
        .worker(&key(7_668_682_573_600_862_472))
        .expect("prefill");
    assert_eq!(prefill.role, Role::Prefill);
    for w in [decode, prefill] {
        assert_eq!(w.model.as_deref(), Some("tiny"));
        assert_eq!(w.capacity.total_kv_blocks, Some(1024));
        assert_eq!(w.block_size, Some(16));
    }
    assert_eq!(snap.load_publisher_count(), 2);
    assert_eq!(snap.kv_event_publisher_count(), 1);
    let kv = snap
        .publisher(&ns("dyntest"), PublisherId(2_342_010_624_528_326))
        .expect("kv-events");
    assert_eq!(kv.worker, Some(key(7_668_682_573_600_862_472)));
    assert_eq!(kv.component.as_deref(), Some("prefill"));
    assert!(continuum_protocol::discovery::mixed_models(&snap).is_empty());
}

#[test]
fn disagg_workers_only_dump_gives_one_prefill_and_one_decode() {
    check_disagg("disagg-workers-only");
}

#[test]
fn disagg_with_frontend_dump_gives_the_same_fleet() {
    check_disagg("disagg-with-frontend");
}

#[test]
fn disagg_after_requests_dump_gives_the_same_fleet() {
    check_disagg("disagg-after-requests");
}

#[test]
fn replaying_a_dump_twice_is_an_idempotent_resync() {
    let kvs = dump_kvs("agg-2workers");
    let mut reducer = DiscoveryReducer::new(ns("dyntest"));
    assert!(resync(&mut reducer, &kvs, NOW));
    let before = reducer.view().clone();
    assert!(!resync(&mut reducer, &kvs, UnixMillis(NOW.0 + 60_000)));
    assert_eq!(**reducer.view(), *before, "timestamps kept too");
}

#[test]
fn graceful_shutdown_deletes_empty_the_fleet() {
    let mut reducer = DiscoveryReducer::new(ns("dyntest"));
    resync(&mut reducer, &dump_kvs("disagg-workers-only"), NOW);
    let path = fixtures_dir().join("dynamo-1.6.1/etcd/watch-during-shutdown.txt");
    let text = std::fs::read_to_string(&path).expect("watch transcript");
    let mut lines = text.lines();
    let mut deletes = 0;
    while let Some(line) = lines.next() {
        if line.trim() == "DELETE" {
            let key = lines.next().expect("key after DELETE").trim().to_owned();
            reducer.apply(SourceEvent::Delete { key }, NOW);
            deletes += 1;
        }
    }
    assert_eq!(deletes, 12);
    assert_eq!(reducer.view().workers().len(), 0);
    assert_eq!(reducer.view().publishers().len(), 0);
}
