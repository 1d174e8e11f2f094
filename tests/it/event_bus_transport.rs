//! `dynamo.load.transport: broker` end to end: the router's one ZMTP client reading real pyzmq
//! publishers (tests/it/support/zmq.rs) through the test broker of tests/it/event_bus.rs (the
//! protocol's `ClientSession` over real TLS 1.3 and HTTP/2), against the same publishers read
//! directly:
//! - the same kv_metrics and kv-events traffic (late sequences, foreign publisher ids, removals,
//!   gaps) read direct and through the bus gives identical load store and KV index state;
//! - a killed broker session moves the subscription to pending, the picker to
//!   `round_robin_stale`, and a second broker restores it (the time is printed, not asserted);
//! - a hostile broker (a flood of uncommanded streams, an oversized line, an unknown message
//!   type, bytes before the hello) costs only its own session: another broker's streams and a
//!   direct subscription keep delivering;
//! - a kv-events subscription cut off under broker transport loses its KV ranks after 60 s
//!   (tokio's paused clock once the subscription is pending, never a real wait);
//! - the `dynamo.load.transport` switch (a restart of the subscriptions subtree, as a reload
//!   does it) in both directions carries the kv-events cursors over: replays stay replays, the
//!   next event applies without a gap, and the index is never cleared.
#![cfg(feature = "real-peers")]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use continuum_actors::event_bus::EventBus;
use continuum_actors::kv_index::{KvIndexActor, KvIndexArgs, SharedKvIndex, kv_index_spec};
use continuum_actors::lifecycle::ActorKind;
use continuum_actors::load::SharedLoadStore;
use continuum_actors::load::SubscriptionTransport;
use continuum_actors::metrics::Metrics;
use continuum_actors::registry::{
    RegistryActor, RegistryArgs, RegistryConfig, RegistryMsg, RegistryParts, RegistryReader,
};
use continuum_actors::subscription::{
    DialPolicy, SubscriptionActor, SubscriptionArgs, SubscriptionMsg, follower_spec,
};
use continuum_actors::supervisor::{ChildSpec, spawn_root};
use continuum_actors::tree::ActorTree;
use continuum_protocol::discovery::EventTopic;
use continuum_protocol::discovery::SourceEvent;
use continuum_protocol::discovery::reducer::DiscoveryReducer;
use continuum_protocol::discovery::snapshot::SourceKind;
use continuum_protocol::event_bus::ClientEvent;
use continuum_protocol::event_bus::message::ErrorCode;
use continuum_protocol::event_plane::encode::{encode_frames, encode_kv_metrics};
use continuum_protocol::event_plane::{
    ActiveLoad, EventEnvelope, KV_EVENTS_TOPIC, LoadEventResult,
};
use continuum_protocol::ids::{DpRank, InstanceId, Namespace, PublisherId};
use continuum_protocol::kv::events::{
    KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData, ResidencyDomain,
    RouterEvent, StorageTier, StoredBlock, encode_router_events,
};
use continuum_protocol::kv::index::{KvIndexStats, RankOverlap};
use continuum_protocol::kv::{ExternalBlockHash, KvEventResult, LocalBlockHash};
use continuum_protocol::picker::candidates::StoreView;
use continuum_protocol::picker::{
    Candidate, CandidateRole, DynamoWorkerPicker as _, LoadBasedPicker, PickContext, PickOutcome,
    PickRequest, PickerState, SelectionReason,
};
use continuum_protocol::subscription_plan::SubscriptionTarget;
use continuum_protocol::time::UnixMillis;
use futures::StreamExt as _;
use http_body_util::BodyExt as _;
use ractor::{Actor, ActorRef};

use crate::event_bus::H2;
use crate::event_bus::{BROKERS, Conn, TestBroker, WAIT, h2, poll, refusal, start, token};
use crate::support::zmq::{Frames, Publisher};

const NS: &str = "dynamo";
const W7: InstanceId = InstanceId(7);
const W8: InstanceId = InstanceId(8);
/// The kv_metrics publisher's id (its event channel's instance id).
const METRICS_PUB: PublisherId = PublisherId(0x5eed);
/// The kv-events publisher's id.
const EVENTS_PUB: PublisherId = PublisherId(0xcafe);
/// A publisher id the subscriptions do not expect.
const FOREIGN_PUB: PublisherId = PublisherId(0xf0e1);
const MODEL: &str = "m";

// ---------------------------------------------------------------------------------------------
// The fleet: a registry with two workers and their event channels

fn record(key: String, value: serde_json::Value) -> (String, Vec<u8>) {
    (key, serde_json::to_vec(&value).expect("json"))
}

fn worker(id: u64) -> Vec<(String, Vec<u8>)> {
    let runtime = serde_json::json!({"total_kv_blocks": 100, "data_parallel_start_rank": 0,
        "data_parallel_size": 1});
    vec![
        record(
            format!("v1/instances/{NS}/backend/generate/{id:x}"),
            serde_json::json!({"type": "Endpoint", "namespace": NS, "component": "backend",
                "endpoint": "generate", "instance_id": id,
                "transport": {"tcp": "127.0.0.1:1/x"}}),
        ),
        record(
            format!("v1/mdc/{NS}/backend/generate/{id:x}"),
            serde_json::json!({"type": "Model", "namespace": NS, "component": "backend",
                "endpoint": "generate", "instance_id": id, "card_json": {"display_name": MODEL,
                "worker_type": "aggregated", "kv_cache_block_size": 16,
                "runtime_config": runtime}}),
        ),
    ]
}

fn channel(topic: &str, publisher: PublisherId, port: u16) -> (String, Vec<u8>) {
    record(
        format!(
            "v1/event_channels/namespace/{NS}/component/backend/endpoint/generate/topic/{topic}/{:x}",
            publisher.0
        ),
        serde_json::json!({"type": "EventChannel",
            "scope": {"kind": "endpoint", "endpoint": {"namespace": NS, "component": "backend",
                "name": "generate"}},
            "topic": topic, "instance_id": publisher.0,
            "transport": {"kind": "Zmq", "config": {"endpoint": format!("tcp://127.0.0.1:{port}")}}}),
    )
}

/// A registry publishing W7 and W8 (one dp rank each, model `m`) and the given event channels:
/// the KV index's live-worker gate and the subscription follower's plan.
async fn registry(channels: Vec<(String, Vec<u8>)>) -> (RegistryReader, ActorRef<RegistryMsg>) {
    let ns = Namespace::new(NS);
    let parts = RegistryParts::new(RegistryConfig {
        enabled: true,
        source: SourceKind::Etcd,
        namespaces: vec![ns.clone()],
    });
    let mut reducer = DiscoveryReducer::new(ns);
    reducer.apply(SourceEvent::Init, UnixMillis(0));
    for (key, value) in worker(W7.0).into_iter().chain(worker(W8.0)).chain(channels) {
        reducer.apply(SourceEvent::InitApply { key, value }, UnixMillis(0));
    }
    reducer.apply(SourceEvent::InitDone, UnixMillis(0));
    parts.inbox.stage_view(reducer.view().clone());
    let reader = parts.reader;
    let mut generations = reader.subscribe();
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
    tokio::time::timeout(WAIT, generations.wait_for(|g| *g >= 1))
        .await
        .expect("registry publishes in time")
        .expect("registry alive");
    assert_eq!(reader.snapshot().workers().len(), 2);
    (reader, actor)
}

/// A KV index with its actor running against `registry`'s live-worker gate.
async fn kv_index(registry: &RegistryReader, metrics: &Metrics) -> SharedKvIndex {
    let kv = SharedKvIndex::new(Some(metrics.clone()));
    let (_actor, _) = Actor::spawn(
        None,
        KvIndexActor,
        KvIndexArgs {
            kv: kv.clone(),
            registry: registry.clone(),
        },
    )
    .await
    .expect("kv index starts");
    kv.reconcile().await;
    kv
}

fn live_store(metrics: Option<Metrics>) -> SharedLoadStore {
    let store = SharedLoadStore::new(metrics);
    store.with(|s| s.set_live_and_retain([W7, W8]));
    store
}

fn target(topic: EventTopic, publisher: PublisherId, port: u16) -> SubscriptionTarget {
    SubscriptionTarget {
        topic,
        namespace: Namespace::new(NS),
        publisher_id: publisher,
        component: None,
        endpoint: format!("tcp://127.0.0.1:{port}"),
    }
}

/// One SubscriptionActor, direct (no bus) or through `bus`.
async fn subscribe(
    target: SubscriptionTarget,
    bus: Option<&EventBus>,
    store: &SharedLoadStore,
    kv: &SharedKvIndex,
    metrics: &Metrics,
) -> ActorRef<SubscriptionMsg> {
    let args = SubscriptionArgs {
        name: target.child_name(),
        target,
        policy: DialPolicy {
            transport: if bus.is_some() {
                SubscriptionTransport::Broker
            } else {
                SubscriptionTransport::Direct
            },
            allow_cidrs: None,
            kv_events: true,
            bus: bus.cloned(),
        },
        store: store.clone(),
        kv: kv.clone(),
        metrics: metrics.family(),
        span: tracing::Span::none(),
    };
    let (actor, _) = Actor::spawn(None, SubscriptionActor, args)
        .await
        .expect("subscription starts");
    actor
}

/// `(state, broker)` of the subscription of `family` in `store`'s status table.
fn status(store: &SharedLoadStore, family: &str) -> Option<(&'static str, Option<String>)> {
    store
        .subscriptions()
        .into_iter()
        .find(|s| s.family == family)
        .map(|s| (s.state, s.broker))
}

/// Waits for a new subscriber on an XPUB `publisher`, skipping the unsubscriptions libzmq reports
/// for subscribers that went away.
async fn await_subscribe(publisher: &mut Publisher) {
    loop {
        let subscriptions = publisher.await_subscriptions(1).await;
        if subscriptions.iter().any(|s| s.starts_with("01")) {
            return;
        }
    }
}

async fn wait_state(store: &SharedLoadStore, family: &str, state: &str) {
    poll(&format!("the {family} subscription is {state}"), || {
        (status(store, family).map(|s| s.0) == Some(state)).then_some(())
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// Frames

fn load(worker: InstanceId, decode: u64) -> ActiveLoad {
    ActiveLoad {
        worker_id: worker,
        dp_rank: DpRank(0),
        active_decode_blocks: Some(decode),
        active_prefill_tokens: Some(0),
        kv_used_blocks: Some(decode),
    }
}

fn metrics_frame(publisher: PublisherId, sequence: u64, worker: InstanceId, decode: u64) -> Frames {
    encode_kv_metrics(
        publisher,
        sequence,
        UnixMillis(1_000 + sequence),
        &load(worker, decode),
    )
}

fn ev(worker: InstanceId, id: u64, data: KvCacheEventData) -> RouterEvent {
    RouterEvent {
        worker_id: worker,
        storage_tier: StorageTier::Device,
        residency_domain: Some(ResidencyDomain::Worker),
        event: KvCacheEvent {
            event_id: id,
            data,
            dp_rank: DpRank(0),
        },
        session_id: None,
    }
}

/// Blocks whose tokens hash is `b` and whose block hash is `b + 1000`.
fn stored(parent: Option<u64>, blocks: &[u64]) -> KvCacheEventData {
    KvCacheEventData::Stored(KvCacheStoreData {
        parent_hash: parent.map(|p| ExternalBlockHash(p + 1_000)),
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

fn removed(blocks: &[u64]) -> KvCacheEventData {
    KvCacheEventData::Removed(KvCacheRemoveData {
        block_hashes: blocks
            .iter()
            .map(|b| ExternalBlockHash(*b + 1_000))
            .collect::<Vec<_>>()
            .into(),
    })
}

fn events_frame(publisher: PublisherId, sequence: u64, events: &[RouterEvent]) -> Frames {
    let payload = encode_router_events(events);
    encode_frames(&EventEnvelope {
        publisher_id: publisher,
        sequence,
        published_at: UnixMillis(1_000 + sequence),
        topic: KV_EVENTS_TOPIC,
        payload: &payload,
    })
}

fn q(hashes: &[u64]) -> Vec<LocalBlockHash> {
    hashes.iter().map(|h| LocalBlockHash(*h)).collect()
}

/// Leading blocks of `hashes` that `worker` holds.
fn overlap(kv: &SharedKvIndex, worker: InstanceId, hashes: &[u64]) -> u32 {
    kv.overlaps(&q(hashes))
        .into_iter()
        .find(|o| o.worker == worker)
        .map_or(0, |o| o.blocks)
}

// ---------------------------------------------------------------------------------------------
// State as the router keeps it

/// Everything the load store and the KV index hold, minus receipt times.
#[derive(Debug, PartialEq)]
struct RouterState {
    samples: Vec<(InstanceId, DpRank, ActiveLoad, PublisherId, u64, UnixMillis)>,
    ranks: Vec<(InstanceId, DpRank, usize)>,
    stats: KvIndexStats,
    overlaps: Vec<Vec<RankOverlap>>,
    load_results: Vec<(&'static str, f64)>,
    kv_results: Vec<(&'static str, f64)>,
}

const QUERIES: &[&[u64]] = &[&[1, 2, 3, 4], &[1, 2, 3, 10], &[1, 2, 9], &[20, 21], &[5]];

fn router_state(store: &SharedLoadStore, kv: &SharedKvIndex, metrics: &Metrics) -> RouterState {
    let mut samples: Vec<_> = store.with(|s| {
        s.iter()
            .map(|(_, x)| {
                (
                    x.load.worker_id,
                    x.load.dp_rank,
                    x.load,
                    x.publisher_id,
                    x.sequence,
                    x.published_at,
                )
            })
            .collect()
    });
    samples.sort_by_key(|s| (s.0, s.1));
    let mut ranks = kv.rank_blocks();
    ranks.sort();
    let value =
        |family: &str, label: &str| metrics.value(family, &[("result", label)]).unwrap_or(0.0);
    RouterState {
        samples,
        ranks,
        stats: kv.stats(),
        overlaps: QUERIES.iter().map(|h| kv.overlaps(&q(h))).collect(),
        load_results: LoadEventResult::ALL
            .iter()
            .map(|r| {
                let label = r.as_label();
                (label, value("continuum_dynamo_load_events_total", label))
            })
            .collect(),
        kv_results: KvEventResult::ALL
            .iter()
            .map(|r| {
                let label = r.as_label();
                (label, value("continuum_dynamo_kv_events_total", label))
            })
            .collect(),
    }
}

fn result_count(results: &[(&'static str, f64)], label: &str) -> f64 {
    results
        .iter()
        .find(|(l, _)| *l == label)
        .map_or(0.0, |(_, n)| *n)
}

// ---------------------------------------------------------------------------------------------
// Tests

#[tokio::test]
async fn direct_and_broker_transport_give_identical_load_store_and_kv_index_state() {
    let h = start(64).await;
    let mut metrics_pub = Publisher::spawn().await;
    let metrics_port = metrics_pub.bind("xpub", 0).await;
    let mut events_pub = Publisher::spawn().await;
    let events_port = events_pub.bind("xpub", 0).await;
    let (registry, _registry) = registry(vec![]).await;

    // Two routers' worth of state: one reads the publishers directly, one through the bus.
    let direct_metrics = Metrics::new("transport-direct").expect("metrics");
    let bus_metrics = Metrics::new("transport-broker").expect("metrics");
    let direct = (live_store(None), kv_index(&registry, &direct_metrics).await);
    let bused = (live_store(None), kv_index(&registry, &bus_metrics).await);
    let m_target = target(EventTopic::KvMetrics, METRICS_PUB, metrics_port);
    let e_target = target(EventTopic::KvEvents, EVENTS_PUB, events_port);
    let mut actors = Vec::new();
    for t in [&m_target, &e_target] {
        actors.push(subscribe(t.clone(), None, &direct.0, &direct.1, &direct_metrics).await);
        actors.push(subscribe(t.clone(), Some(&h.bus), &bused.0, &bused.1, &bus_metrics).await);
    }
    let mut broker = TestBroker::as_broker(&h, BROKERS[0]).await;
    broker.relay_next().await;
    broker.relay_next().await;
    // Both readers of each publisher are subscribed before anything is published.
    assert_eq!(metrics_pub.await_subscriptions(2).await.len(), 2);
    assert_eq!(events_pub.await_subscriptions(2).await.len(), 2);
    for (store, _) in [&direct, &bused] {
        wait_state(store, "kv_metrics", "connected").await;
        wait_state(store, "kv-events", "connected").await;
    }
    assert_eq!(
        status(&bused.0, "kv_metrics").and_then(|s| s.1).as_deref(),
        Some(BROKERS[0])
    );
    assert_eq!(status(&direct.0, "kv_metrics").and_then(|s| s.1), None);

    // kv_metrics: applied, a late sequence, a foreign publisher id, a gap (drops W8's sample),
    // a late sequence after the gap, then the marker (W8 at 77).
    metrics_pub
        .send(&[
            metrics_frame(METRICS_PUB, 0, W7, 1),
            metrics_frame(METRICS_PUB, 1, W8, 2),
            metrics_frame(METRICS_PUB, 1, W7, 3),
            metrics_frame(FOREIGN_PUB, 2, W7, 4),
            metrics_frame(METRICS_PUB, 5, W7, 5),
            metrics_frame(METRICS_PUB, 3, W8, 6),
            metrics_frame(METRICS_PUB, 6, W8, 77),
        ])
        .await;
    // kv-events: stores, a replay, a removal, a foreign publisher id, a late envelope sequence,
    // a gap on W8 (clears its rank, then applies), then the marker (W7 stores block 10).
    events_pub
        .send(&[
            events_frame(
                EVENTS_PUB,
                0,
                &[
                    ev(W7, 1, stored(None, &[1, 2, 3])),
                    ev(W8, 1, stored(None, &[1, 2])),
                ],
            ),
            events_frame(EVENTS_PUB, 1, &[ev(W7, 2, stored(Some(3), &[4]))]),
            events_frame(EVENTS_PUB, 2, &[ev(W7, 2, stored(Some(3), &[4]))]),
            events_frame(EVENTS_PUB, 3, &[ev(W7, 3, removed(&[4]))]),
            events_frame(FOREIGN_PUB, 4, &[ev(W7, 4, stored(None, &[20, 21]))]),
            events_frame(EVENTS_PUB, 2, &[ev(W8, 2, stored(Some(2), &[5]))]),
            events_frame(EVENTS_PUB, 5, &[ev(W8, 9, stored(Some(2), &[9]))]),
            events_frame(EVENTS_PUB, 6, &[ev(W7, 4, stored(Some(3), &[10]))]),
        ])
        .await;
    for (store, kv) in [&direct, &bused] {
        poll("both markers arrive", || {
            let metrics_done = store
                .latest(W8, DpRank(0))
                .is_some_and(|s| s.load.active_decode_blocks == Some(77));
            (metrics_done && overlap(kv, W7, &[1, 2, 3, 10]) == 4).then_some(())
        })
        .await;
    }

    let direct_state = router_state(&direct.0, &direct.1, &direct_metrics);
    let bus_state = router_state(&bused.0, &bused.1, &bus_metrics);
    assert_eq!(direct_state, bus_state);
    // The script reached every rule it meant to (so the equality is not between two empties).
    let load = &direct_state.load_results;
    assert_eq!(result_count(load, "applied"), 4.0, "{load:?}");
    assert_eq!(result_count(load, "duplicate"), 2.0, "{load:?}");
    assert_eq!(result_count(load, "identity_mismatch"), 1.0, "{load:?}");
    let kv = &direct_state.kv_results;
    assert!(result_count(kv, "replay") >= 1.0, "{kv:?}");
    assert!(result_count(kv, "gap") >= 1.0, "{kv:?}");
    assert!(result_count(kv, "identity_mismatch") >= 1.0, "{kv:?}");
    assert_eq!(direct_state.samples.len(), 2);
    assert_eq!(
        overlap(&direct.1, W7, &[1, 2, 3, 4]),
        3,
        "block 4 was removed"
    );
    assert_eq!(
        overlap(&direct.1, W8, &[1, 2, 9]),
        0,
        "the gap cleared W8's [1, 2]"
    );
    assert_eq!(
        overlap(&direct.1, W7, &[20, 21]),
        0,
        "the foreign batch was refused"
    );
    for actor in actors {
        actor.stop(None);
    }
}

fn candidates() -> Vec<Candidate> {
    [W7, W8]
        .into_iter()
        .map(|id| Candidate {
            worker: continuum_protocol::ids::WorkerKey {
                namespace: Namespace::new(NS),
                instance_id: id,
            },
            role: CandidateRole::Decode,
            model: MODEL.into(),
            dp_rank: Some(DpRank(0)),
            rank_declared: true,
            block_size: Some(16),
            total_kv_blocks: Some(100),
            max_num_batched_tokens: Some(1000),
        })
        .collect()
}

/// The decode reason of one load-based pick over `store`, samples fresh for `max_age`.
fn decode_reason(
    store: &SharedLoadStore,
    picker: &mut PickerState,
    max_age: Duration,
) -> SelectionReason {
    let candidates = candidates();
    let namespaces = [Namespace::new(NS)];
    let request = PickRequest {
        model: MODEL,
        eligible_namespaces: &namespaces,
        estimated_prompt_tokens: 32,
        load_signals: true,
    };
    let now = continuum_actors::clock::now_tick();
    store.with(|s| {
        let view = StoreView {
            store: s,
            now,
            max_age,
        };
        match LoadBasedPicker.pick(&mut PickContext::new(
            &request,
            &candidates,
            &view,
            picker,
            now,
        )) {
            PickOutcome::Picked(pick) => pick.reasons.decode,
            PickOutcome::NoCandidates(why) => panic!("no candidates: {why:?}"),
        }
    })
}

#[tokio::test]
async fn a_killed_broker_session_goes_pending_round_robin_stale_and_a_second_broker_restores_it() {
    // Samples count as fresh this long (dynamo.load.max_staleness, shortened for the test).
    const FRESH: Duration = Duration::from_millis(300);
    let h = start(64).await;
    let mut publisher = Publisher::spawn().await;
    let port = publisher.bind("xpub", 0).await;
    let metrics = Metrics::new("transport-kill").expect("metrics");
    let store = live_store(None);
    let (registry, _registry) = registry(vec![]).await;
    let kv = kv_index(&registry, &metrics).await;
    let _actor = subscribe(
        target(EventTopic::KvMetrics, METRICS_PUB, port),
        Some(&h.bus),
        &store,
        &kv,
        &metrics,
    )
    .await;
    let mut picker = PickerState::new();
    let mut sequence = 0;
    let mut publish = async |publisher: &mut Publisher| {
        publisher
            .send(&[
                metrics_frame(METRICS_PUB, sequence, W7, 3),
                metrics_frame(METRICS_PUB, sequence + 1, W8, 5),
            ])
            .await;
        sequence += 2;
    };

    let a = {
        let mut a = TestBroker::as_broker(&h, BROKERS[0]).await;
        a.relay_next().await;
        a
    };
    publisher.await_subscriptions(1).await;
    wait_state(&store, "kv_metrics", "connected").await;
    // Fresh samples: the picker decides on load.
    let deadline = Instant::now() + WAIT;
    while decode_reason(&store, &mut picker, FRESH) != SelectionReason::Load {
        assert!(Instant::now() < deadline, "load decides within {WAIT:?}");
        publish(&mut publisher).await;
    }

    // The broker session is killed: the subscription goes pending (never direct), its samples
    // age out and the picker falls back to round_robin_stale.
    drop(a);
    wait_state(&store, "kv_metrics", "pending").await;
    let deadline = Instant::now() + WAIT;
    while decode_reason(&store, &mut picker, FRESH) != SelectionReason::RoundRobinStale {
        assert!(
            Instant::now() < deadline,
            "round_robin_stale within {WAIT:?}"
        );
        publish(&mut publisher).await;
    }
    assert_eq!(
        status(&store, "kv_metrics").map(|s| s.0),
        Some("pending"),
        "nothing reconnects while no broker covers the namespace"
    );

    // A second broker connects: the subscription wakes (0-500 ms jitter), is placed on it and
    // load selection is restored.
    let restored_from = Instant::now();
    let mut b = TestBroker::as_broker(&h, BROKERS[1]).await;
    b.relay_next().await;
    let deadline = Instant::now() + WAIT;
    while decode_reason(&store, &mut picker, FRESH) != SelectionReason::Load {
        assert!(Instant::now() < deadline, "load restored within {WAIT:?}");
        publish(&mut publisher).await;
    }
    let restored = restored_from.elapsed();
    println!(
        "broker failover: second broker welcomed -> load selection restored in {} ms (goal < 1000 ms)",
        restored.as_millis()
    );
    assert_eq!(
        status(&store, "kv_metrics"),
        Some(("connected", Some(BROKERS[1].to_string())))
    );
}

#[tokio::test]
async fn a_hostile_broker_costs_only_its_own_session() {
    let h = start(64).await;
    let mut publisher = Publisher::spawn().await;
    let port = publisher.bind("xpub", 0).await;
    let metrics = Metrics::new("transport-hostile").expect("metrics");
    let (registry, _registry) = registry(vec![]).await;
    let kv = kv_index(&registry, &metrics).await;
    let direct = live_store(None);
    let bused = live_store(None);
    let t = target(EventTopic::KvMetrics, METRICS_PUB, port);
    let _direct = subscribe(t.clone(), None, &direct, &kv, &metrics).await;
    let _bused = subscribe(t, Some(&h.bus), &bused, &kv, &metrics).await;
    let mut good = TestBroker::as_broker(&h, BROKERS[2]).await;
    good.relay_next().await;
    publisher.await_subscriptions(2).await;
    wait_state(&direct, "kv_metrics", "connected").await;
    wait_state(&bused, "kv_metrics", "connected").await;

    // Both readers keep receiving: a fresh value reaches both stores.
    let mut sequence = 0;
    let mut both_deliver = async |publisher: &mut Publisher, what: &str| {
        let value = 1_000 + sequence;
        let deadline = Instant::now() + WAIT;
        loop {
            publisher
                .send(&[metrics_frame(METRICS_PUB, sequence, W7, value)])
                .await;
            sequence += 1;
            let seen = |store: &SharedLoadStore| {
                store
                    .latest(W7, DpRank(0))
                    .is_some_and(|s| s.load.active_decode_blocks == Some(value))
            };
            if seen(&direct) && seen(&bused) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "both readers deliver after {what}"
            );
            tokio::task::yield_now().await;
        }
    };
    both_deliver(&mut publisher, "the start").await;

    // A flood of streams it was never commanded to open: each is refused, nothing else moves.
    let mut hostile = TestBroker::as_broker(&h, BROKERS[0]).await;
    let session = hostile.welcome.session_id.to_string();
    let bearer = format!("Bearer {}", token(BROKERS[0]));
    let flood = 1_000u64;
    let refused: Vec<(u16, ErrorCode)> = futures::stream::iter(1..=flood)
        .map(|id| {
            let mut conn = Conn {
                send: hostile.conn.send.clone(),
            };
            let (session, bearer) = (session.clone(), bearer.clone());
            async move {
                let headers = [
                    (
                        continuum_protocol::event_bus::SESSION_HEADER,
                        session.as_str(),
                    ),
                    (continuum_protocol::event_bus::VERSION_HEADER, "1"),
                    ("authorization", bearer.as_str()),
                ];
                let empty = http_body_util::Empty::<Bytes>::new()
                    .map_err(|e| match e {})
                    .boxed_unsync();
                let response = conn
                    .post("POST", &format!("/bus/v1/streams/{id}"), &headers, empty)
                    .await;
                refusal(response).await
            }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    assert_eq!(refused.len() as u64, flood);
    assert!(
        refused
            .iter()
            .all(|r| *r == (404, ErrorCode::UnknownStream)),
        "every uncommanded stream is 404 unknown_stream"
    );
    both_deliver(&mut publisher, "a flood of uncommanded streams").await;

    // An over-long control line ends that session only.
    hostile.send_raw(vec![b'x'; 70 * 1024]).await;
    match hostile.next_event().await {
        ClientEvent::Closed { code, .. } => assert_eq!(code, ErrorCode::ProtocolError),
        other => panic!("expected protocol_error, got {other:?}"),
    }
    both_deliver(&mut publisher, "an oversized line").await;

    // An unknown message type after the welcome.
    let mut unknown = TestBroker::as_broker(&h, BROKERS[1]).await;
    unknown
        .send_raw(b"{\"type\":\"subscribe_everything\"}\n".to_vec())
        .await;
    match unknown.next_event().await {
        ClientEvent::Closed { code, .. } => assert_eq!(code, ErrorCode::ProtocolError),
        other => panic!("expected protocol_error, got {other:?}"),
    }
    both_deliver(&mut publisher, "an unknown message type").await;

    // Bytes before the hello: refused before any session exists.
    let mut raw = h2(&h, H2).await;
    let (response, _body) = raw
        .session(
            Some(&token(BROKERS[3])),
            Some("1"),
            Bytes::from_static(b"\x00\x01 not a hello\n"),
        )
        .await;
    assert_eq!(refusal(response).await, (400, ErrorCode::InvalidHello));
    both_deliver(&mut publisher, "bytes before the hello").await;

    // The good broker's session and stream were never touched.
    h.wait_sessions(1).await;
    assert_eq!(
        status(&bused, "kv_metrics"),
        Some(("connected", Some(BROKERS[2].to_string())))
    );
    let view = h.bus.subscribe_sessions();
    let sessions: Vec<(String, usize)> = view
        .borrow()
        .sessions
        .iter()
        .map(|s| (s.client_id.to_string(), s.streams))
        .collect();
    assert_eq!(sessions, vec![(BROKERS[2].to_string(), 1)]);
    assert_eq!(
        h.metrics.value(
            "continuum_dynamo_event_bus_sessions_closed_total",
            &[("code", "protocol_error")]
        ),
        Some(2.0)
    );
    // Still a live session: it is commanded for a new stream and serves it.
    let bus = h.bus.clone();
    let consumer = tokio::spawn(async move {
        bus.open_stream(crate::event_bus::target(), EventTopic::KvEvents)
            .await
    });
    let ClientEvent::OpenStream { stream_id, .. } = good.next_event().await else {
        panic!("the good broker is commanded");
    };
    let _data = good
        .open_data_stream(stream_id, None)
        .await
        .expect("accepted");
    assert!(
        tokio::time::timeout(WAIT, consumer)
            .await
            .expect("in time")
            .expect("task")
            .is_ok()
    );
}

#[tokio::test]
async fn a_cut_off_kv_events_subscription_under_broker_transport_loses_its_ranks_after_60_s() {
    let h = start(64).await;
    let mut publisher = Publisher::spawn().await;
    let port = publisher.bind("xpub", 0).await;
    let metrics = Metrics::new("transport-ageing").expect("metrics");
    let (registry, _registry) = registry(vec![]).await;
    let kv = kv_index(&registry, &metrics).await;
    let store = live_store(None);
    let _actor = subscribe(
        target(EventTopic::KvEvents, EVENTS_PUB, port),
        Some(&h.bus),
        &store,
        &kv,
        &metrics,
    )
    .await;
    let mut a = TestBroker::as_broker(&h, BROKERS[0]).await;
    a.relay_next().await;
    publisher.await_subscriptions(1).await;
    wait_state(&store, "kv-events", "connected").await;
    publisher
        .send(&[events_frame(
            EVENTS_PUB,
            0,
            &[ev(W7, 1, stored(None, &[1, 2, 3]))],
        )])
        .await;
    poll("the ranks are indexed through the bus", || {
        (overlap(&kv, W7, &[1, 2, 3]) == 3).then_some(())
    })
    .await;

    // The only broker goes: the subscription is pending.
    drop(a);
    wait_state(&store, "kv-events", "pending").await;
    // From here on, virtual time: nothing else runs a timer that matters (no session is left,
    // the subscription waits on the session table).
    tokio::time::pause();
    tokio::time::advance(Duration::from_secs(50)).await;
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert_eq!(
        overlap(&kv, W7, &[1, 2, 3]),
        3,
        "kept while down for less than 60 s"
    );
    tokio::time::advance(Duration::from_secs(11)).await;
    poll("the cut-off subscription's ranks are cleared", || {
        kv.rank_blocks().is_empty().then_some(())
    })
    .await;
    assert_eq!(
        kv.cursors(&target(EventTopic::KvEvents, EVENTS_PUB, port).child_name()),
        0
    );
    assert_eq!(status(&store, "kv-events").map(|s| s.0), Some("pending"));
}

#[tokio::test]
async fn switching_the_transport_both_ways_carries_kv_events_cursors_over() {
    let h = start(64).await;
    let mut publisher = Publisher::spawn().await;
    let port = publisher.bind("xpub", 0).await;
    let metrics = Metrics::new("transport-switch").expect("metrics");
    let (registry, _registry) = registry(vec![channel("kv-events", EVENTS_PUB, port)]).await;
    let kv = SharedKvIndex::new(Some(metrics.clone()));
    let store = live_store(None);
    // The daemon's subscriptions subtree: a follower whose dial policy is read at every spawn,
    // so a restart of `root/subscriptions` is the reload's transport switch.
    let transport = Arc::new(Mutex::new(SubscriptionTransport::Direct));
    let subscriptions = {
        let (registry, store, kv, bus) =
            (registry.clone(), store.clone(), kv.clone(), h.bus.clone());
        let transport = transport.clone();
        ChildSpec::supervisor_with(
            "subscriptions",
            ActorKind::SubscriptionSupervisor,
            move || {
                let (transport, bus) = (transport.clone(), bus.clone());
                let policy = Arc::new(move || DialPolicy {
                    transport: *transport.lock().expect("transport"),
                    allow_cidrs: None,
                    kv_events: true,
                    bus: Some(bus.clone()),
                });
                vec![follower_spec(
                    registry.clone(),
                    store.clone(),
                    kv.clone(),
                    policy,
                )]
            },
        )
    };
    let tree = ActorTree::default();
    let (root, _) = spawn_root(
        vec![kv_index_spec(kv.clone(), registry.clone()), subscriptions],
        tree.clone(),
        None,
    )
    .await
    .expect("root starts");
    let count = |label: &str| {
        metrics
            .value("continuum_dynamo_kv_events_total", &[("result", label)])
            .unwrap_or(0.0)
    };
    let transport_of = |store: &SharedLoadStore| {
        store
            .subscriptions()
            .into_iter()
            .find(|s| s.family == "kv-events")
            .map(|s| (s.state, s.transport))
    };

    // Direct: events 1 (W7 stores 1, 2, 3).
    publisher.await_subscriptions(1).await;
    poll("connected directly", || {
        (transport_of(&store) == Some(("connected", "direct"))).then_some(())
    })
    .await;
    publisher
        .send(&[events_frame(
            EVENTS_PUB,
            0,
            &[ev(W7, 1, stored(None, &[1, 2, 3]))],
        )])
        .await;
    poll("event 1 applied", || {
        (overlap(&kv, W7, &[1, 2, 3]) == 3).then_some(())
    })
    .await;

    // Direct -> broker: the subscriptions restart; nothing else does, and the index stays.
    *transport.lock().expect("transport") = SubscriptionTransport::Broker;
    tree.restart("root/subscriptions", WAIT)
        .await
        .expect("restart");
    assert_eq!(
        overlap(&kv, W7, &[1, 2, 3]),
        3,
        "the switch keeps the index"
    );
    let mut a = TestBroker::as_broker(&h, BROKERS[0]).await;
    a.relay_next().await;
    await_subscribe(&mut publisher).await;
    poll("connected through the bus", || {
        (transport_of(&store) == Some(("connected", "broker"))).then_some(())
    })
    .await;
    // Event 1 again is a replay (the cursor came along); event 2 follows without a gap.
    publisher
        .send(&[
            events_frame(EVENTS_PUB, 1, &[ev(W7, 1, stored(None, &[1, 2, 3]))]),
            events_frame(EVENTS_PUB, 2, &[ev(W7, 2, stored(Some(3), &[4]))]),
        ])
        .await;
    poll("event 2 applied through the bus", || {
        (overlap(&kv, W7, &[1, 2, 3, 4]) == 4).then_some(())
    })
    .await;
    assert_eq!((count("replay"), count("gap")), (1.0, 0.0));

    // Broker -> direct: the same again the other way.
    *transport.lock().expect("transport") = SubscriptionTransport::Direct;
    tree.restart("root/subscriptions", WAIT)
        .await
        .expect("restart");
    await_subscribe(&mut publisher).await;
    poll("connected directly again", || {
        (transport_of(&store) == Some(("connected", "direct"))).then_some(())
    })
    .await;
    publisher
        .send(&[
            events_frame(EVENTS_PUB, 3, &[ev(W7, 2, stored(Some(3), &[4]))]),
            events_frame(EVENTS_PUB, 4, &[ev(W7, 3, stored(Some(4), &[5]))]),
        ])
        .await;
    poll("event 3 applied directly", || {
        (overlap(&kv, W7, &[1, 2, 3, 4, 5]) == 5).then_some(())
    })
    .await;
    assert_eq!((count("replay"), count("gap")), (2.0, 0.0));
    assert_eq!(count("applied"), 3.0);
    root.stop(None);
}
