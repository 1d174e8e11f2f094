//! KvIndexActor tests: batches through the actor, per-subscription cursor bounds, the 60 s clear
//! of a subscription that stays down (paused tokio time), restart re-attachment and hash parity.
//! Synchronised on call replies and registry generations, never on sleeps.

use std::time::Duration;

use continuum_protocol::discovery::SourceEvent;
use continuum_protocol::discovery::reducer::DiscoveryReducer;
use continuum_protocol::discovery::snapshot::SourceKind;
use continuum_protocol::ids::Namespace;
use continuum_protocol::kv::ExternalBlockHash;
use continuum_protocol::kv::events::{
    KvCacheEvent, KvCacheStoreData, StoredBlock, encode_router_events,
};
use continuum_protocol::time::UnixMillis;

use super::*;
use crate::registry::{RegistryActor, RegistryArgs, RegistryConfig, RegistryMsg, RegistryParts};

const W1: InstanceId = InstanceId(0x11);
const W2: InstanceId = InstanceId(0x22);

fn worker(id: u64, model: &str, dp_size: u32) -> Vec<(String, Vec<u8>)> {
    let runtime = serde_json::json!({"total_kv_blocks": 1024, "data_parallel_start_rank": 0,
        "data_parallel_size": dp_size});
    let endpoint = serde_json::json!({"type": "Endpoint", "namespace": "ns", "component": "backend",
        "endpoint": "generate", "instance_id": id, "transport": {"tcp": "127.0.0.1:1/x"}});
    let card = serde_json::json!({"type": "Model", "namespace": "ns", "component": "backend",
        "endpoint": "generate", "instance_id": id, "card_json": {"display_name": model,
        "worker_type": "aggregated", "kv_cache_block_size": 16, "runtime_config": runtime}});
    vec![
        (
            format!("v1/instances/ns/backend/generate/{id:x}"),
            serde_json::to_vec(&endpoint).expect("json"),
        ),
        (
            format!("v1/mdc/ns/backend/generate/{id:x}"),
            serde_json::to_vec(&card).expect("json"),
        ),
    ]
}

/// A registry publishing W1 (dp 4096) and W2 (dp 4096), both serving model "m".
async fn registry() -> (RegistryReader, ActorRef<RegistryMsg>) {
    let ns = Namespace::new("ns");
    let parts = RegistryParts::new(RegistryConfig {
        enabled: true,
        source: SourceKind::Etcd,
        namespaces: vec![ns.clone()],
    });
    let mut reducer = DiscoveryReducer::new(ns);
    reducer.apply(SourceEvent::Init, UnixMillis(0));
    for (key, value) in worker(W1.0, "m", 4096)
        .into_iter()
        .chain(worker(W2.0, "m", 4096))
    {
        reducer.apply(SourceEvent::InitApply { key, value }, UnixMillis(0));
    }
    reducer.apply(SourceEvent::InitDone, UnixMillis(0));
    parts.inbox.stage_view(reducer.view().clone());
    let registry = parts.reader;
    let mut generations = registry.subscribe();
    let (actor, _) = Actor::spawn(
        None,
        RegistryActor,
        RegistryArgs {
            writer: parts.writer,
            metrics: None,
        },
    )
    .await
    .expect("registry starts");
    generations
        .wait_for(|g| *g >= 1)
        .await
        .expect("registry publishes");
    assert_eq!(registry.snapshot().workers().len(), 2);
    (registry, actor)
}

async fn spawn(kv: &SharedKvIndex, registry: &RegistryReader) -> ActorRef<KvIndexMsg> {
    let (actor, _) = Actor::spawn(
        None,
        KvIndexActor,
        KvIndexArgs {
            kv: kv.clone(),
            registry: registry.clone(),
        },
    )
    .await
    .expect("kv index starts");
    actor
}

fn ev(worker: InstanceId, rank: u32, id: u64, data: KvCacheEventData) -> RouterEvent {
    RouterEvent {
        worker_id: worker,
        storage_tier: StorageTier::Device,
        residency_domain: Some(ResidencyDomain::Worker),
        event: KvCacheEvent {
            event_id: id,
            data,
            dp_rank: DpRank(rank),
        },
        session_id: None,
    }
}

fn stored(parent: Option<u64>, blocks: &[u64]) -> KvCacheEventData {
    KvCacheEventData::Stored(KvCacheStoreData {
        parent_hash: parent.map(ExternalBlockHash),
        start_position: None,
        blocks: blocks
            .iter()
            .map(|b| StoredBlock {
                block_hash: ExternalBlockHash(*b + 1_000),
                tokens_hash: LocalBlockHash(*b),
                mm_extra_info: None,
            })
            .collect::<Vec<_>>()
            .into(),
    })
}

fn q(hashes: &[u64]) -> Vec<LocalBlockHash> {
    hashes.iter().map(|h| LocalBlockHash(*h)).collect()
}

fn name(s: &str) -> SubscriptionName {
    Arc::from(s)
}

/// Waits until the actor has processed everything sent before (its mailbox is FIFO), by a call.
async fn barrier(actor: &ActorRef<KvIndexMsg>) {
    let reply = actor
        .call(
            |reply| KvIndexMsg::ApplyBatch {
                subscription: name("barrier"),
                events: Vec::new(),
                reply,
            },
            Some(Duration::from_secs(5)),
        )
        .await;
    assert!(matches!(reply, Ok(ractor::rpc::CallResult::Success(_))));
}

fn metric(metrics: &Metrics, result: &str) -> f64 {
    metrics
        .value("continuum_dynamo_kv_events_total", &[("result", result)])
        .unwrap_or(0.0)
}

#[tokio::test(start_paused = true)]
async fn batches_apply_through_the_actor_and_reads_see_them() {
    let (registry, _reg) = registry().await;
    let metrics = Metrics::new("kv-test").expect("metrics");
    let kv = SharedKvIndex::new(Some(metrics.clone()));
    let actor = spawn(&kv, &registry).await;
    barrier(&actor).await;
    let a = name("kv_events:ns:11");
    let payload = encode_router_events(&[
        ev(W1, 0, 5, stored(None, &[1, 2, 3])),
        ev(W1, 0, 5, KvCacheEventData::Cleared),
        ev(InstanceId(0x99), 0, 0, stored(None, &[1])),
        ev(W2, 3, 0, stored(None, &[1, 2])),
    ]);
    kv.deliver(&a, &payload).await;
    assert_eq!(
        kv.overlaps(&q(&[1, 2, 3])),
        vec![
            RankOverlap {
                worker: W1,
                dp_rank: DpRank(0),
                blocks: 3
            },
            RankOverlap {
                worker: W2,
                dp_rank: DpRank(3),
                blocks: 2
            },
        ]
    );
    assert_eq!(kv.overlaps(&q(&[1])).len(), 2);
    let b16 = continuum_protocol::kv::hashing::BlockSize::new(16).expect("valid");
    let b32 = continuum_protocol::kv::hashing::BlockSize::new(32).expect("valid");
    let by_size = kv.overlaps_by_block_size(&[(b16, &q(&[1, 2])), (b32, &q(&[9]))]);
    assert_eq!(by_size[0].0, b16);
    assert_eq!(by_size[0].1.len(), 2);
    assert_eq!(by_size[1], (b32, vec![]));
    assert_eq!(metric(&metrics, "applied"), 2.0);
    assert_eq!(metric(&metrics, "replay"), 1.0);
    assert_eq!(metric(&metrics, "identity_mismatch"), 1.0);
    // A forward jump clears the rank, then applies.
    kv.deliver(
        &a,
        &encode_router_events(&[ev(W1, 0, 9, stored(None, &[7]))]),
    )
    .await;
    assert_eq!(metric(&metrics, "gap"), 1.0);
    assert_eq!(kv.overlaps(&q(&[1, 2, 3])).len(), 1);
    // Undecodable payloads are counted without reaching the actor.
    kv.deliver(&a, b"\xc1").await;
    assert_eq!(metric(&metrics, "malformed"), 1.0);
    assert_eq!(kv.cursors("kv_events:ns:11"), 2);
}

#[tokio::test(start_paused = true)]
async fn a_subscriptions_cursor_table_is_bounded_at_4096_ranks() {
    let (registry, _reg) = registry().await;
    let metrics = Metrics::new("kv-test").expect("metrics");
    let kv = SharedKvIndex::new(Some(metrics.clone()));
    let actor = spawn(&kv, &registry).await;
    barrier(&actor).await;
    let a = name("a");
    let mut events: Vec<RouterEvent> = (0..4096)
        .map(|r| ev(W1, r, 0, KvCacheEventData::Cleared))
        .collect();
    events.push(ev(W2, 0, 0, stored(None, &[1])));
    for chunk in events.chunks(128) {
        kv.deliver(&a, &encode_router_events(chunk)).await;
    }
    assert_eq!(kv.cursors("a"), 4096);
    assert_eq!(metric(&metrics, "over_capacity"), 1.0);
    assert!(kv.overlaps(&q(&[1])).is_empty());
    // Another subscription has its own table.
    kv.deliver(
        &name("b"),
        &encode_router_events(&[ev(W2, 0, 0, stored(None, &[1]))]),
    )
    .await;
    assert_eq!(kv.overlaps(&q(&[1])).len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_subscription_down_for_60_s_loses_its_ranks_and_one_back_in_time_keeps_them() {
    let (registry, _reg) = registry().await;
    let kv = SharedKvIndex::new(None);
    let actor = spawn(&kv, &registry).await;
    barrier(&actor).await;
    let (a, b) = (name("a"), name("b"));
    kv.subscription_state(&a, true);
    kv.subscription_state(&b, true);
    kv.deliver(
        &a,
        &encode_router_events(&[ev(W1, 0, 0, stored(None, &[1]))]),
    )
    .await;
    kv.deliver(
        &b,
        &encode_router_events(&[ev(W2, 0, 0, stored(None, &[1]))]),
    )
    .await;
    assert_eq!(kv.overlaps(&q(&[1])).len(), 2);

    kv.subscription_state(&a, false);
    kv.subscription_state(&b, false);
    barrier(&actor).await;
    tokio::time::advance(Duration::from_secs(30)).await;
    kv.subscription_state(&b, true);
    barrier(&actor).await;
    tokio::time::advance(Duration::from_secs(29)).await;
    barrier(&actor).await;
    assert_eq!(kv.overlaps(&q(&[1])).len(), 2, "not yet 60 s");
    tokio::time::advance(Duration::from_secs(2)).await;
    // The timer task fires, then its message queues before the next barrier's.
    tokio::task::yield_now().await;
    barrier(&actor).await;
    assert_eq!(
        kv.overlaps(&q(&[1])),
        vec![RankOverlap {
            worker: W2,
            dp_rank: DpRank(0),
            blocks: 1
        }]
    );
    assert_eq!(kv.cursors("a"), 0);
    assert_eq!(kv.cursors("b"), 1);
}

#[tokio::test(start_paused = true)]
async fn a_restarted_actor_reattaches_to_the_index_and_refusals_while_down_are_counted() {
    let (registry, _reg) = registry().await;
    let metrics = Metrics::new("kv-test").expect("metrics");
    let kv = SharedKvIndex::new(Some(metrics.clone()));
    let actor = spawn(&kv, &registry).await;
    barrier(&actor).await;
    let a = name("a");
    kv.deliver(
        &a,
        &encode_router_events(&[ev(W1, 0, 0, stored(None, &[1, 2]))]),
    )
    .await;
    actor.stop_and_wait(None, None).await.expect("stops");

    // No actor: the batch is refused and counted, the index still answers reads.
    kv.deliver(
        &a,
        &encode_router_events(&[ev(W1, 0, 1, stored(Some(1002), &[3]))]),
    )
    .await;
    assert_eq!(metric(&metrics, "over_capacity"), 1.0);
    assert_eq!(kv.overlaps(&q(&[1, 2, 3]))[0].blocks, 2);

    let actor = spawn(&kv, &registry).await;
    barrier(&actor).await;
    // The cursor survived the restart, so the lost event reads as a gap and the rank rebuilds.
    kv.deliver(
        &a,
        &encode_router_events(&[ev(W1, 0, 2, stored(None, &[1]))]),
    )
    .await;
    assert_eq!(metric(&metrics, "gap"), 1.0);
    assert_eq!(kv.overlaps(&q(&[1, 2, 3]))[0].blocks, 1);
}

#[tokio::test(start_paused = true)]
async fn hash_parity_is_decided_by_the_ranks_stores_and_counted_per_model() {
    let (registry, _reg) = registry().await;
    let metrics = Metrics::new("kv-test").expect("metrics");
    let kv = SharedKvIndex::new(Some(metrics.clone()));
    let actor = spawn(&kv, &registry).await;
    barrier(&actor).await;
    kv.record_prediction("m", W1, DpRank(0), &q(&[5, 6]));
    kv.deliver(
        &name("a"),
        &encode_router_events(&[ev(W1, 0, 0, stored(None, &[4, 5, 6]))]),
    )
    .await;
    let parity = kv.parity("m").expect("tracked");
    assert_eq!((parity.checked, parity.matched), (1, 1));
    assert_eq!(
        metrics.value(
            "continuum_dynamo_kv_hash_parity_total",
            &[("model", "m"), ("result", "match")]
        ),
        Some(1.0)
    );
    assert_eq!(kv.parity_all().len(), 1);
}
