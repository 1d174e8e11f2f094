//! The PickerActor under supervision: it rebuilds the candidate index per registry generation,
//! feeds load-store arrivals into the ledger, expires the ledger on its own timer (paused tokio
//! time, no sleeps), and an operator restart loses nothing the routing needs.

use std::sync::Arc;
use std::time::Duration;

use continuum_actors::clock::now_tick;
use continuum_actors::load::SharedLoadStore;
use continuum_actors::picker::{PickerActor, PickerArgs, PickerMsg, SharedPicker, picker_spec};
use continuum_actors::registry::{
    RegistryConfig, RegistryInbox, RegistryParts, RegistryReader, registry_spec,
};
use continuum_actors::supervisor::spawn_root;
use continuum_actors::tree::{ActorState, ActorTree};
use continuum_protocol::discovery::SourceEvent;
use continuum_protocol::discovery::reducer::DiscoveryReducer;
use continuum_protocol::discovery::snapshot::SourceKind;
use continuum_protocol::event_plane::{ActiveLoad, LoadEventResult};
use continuum_protocol::ids::{DpRank, InstanceId, Namespace, PublisherId, WorkerKey};
use continuum_protocol::load_store::LoadSample;
use continuum_protocol::picker::{
    DISPATCH_MAX_AGE, DispatchLeg, DynamoWorkerPicker, PickContext, PickOutcome,
};
use continuum_protocol::time::{Tick, UnixMillis};
use ractor::{Actor, call_t};

const NS: &str = "ns";

fn worker(id: u64) -> WorkerKey {
    WorkerKey {
        namespace: Namespace::new(NS),
        instance_id: InstanceId(id),
    }
}

fn dispatch(picker: &SharedPicker, load: &SharedLoadStore, id: u64, at: Tick) {
    let leg = DispatchLeg {
        worker: worker(id),
        rank: DpRank(0),
        prefill_tokens: 0,
        decode_blocks: 4,
        request_blocks: 4,
        stall_exempt: false,
    };
    // The lock order: the load store's guard, then the picker's state.
    load.with(|held| picker.with_state(held, |s| s.ledger.record_dispatch(&[leg], at)));
}

fn registry_parts() -> RegistryParts {
    RegistryParts::new(RegistryConfig {
        enabled: true,
        source: SourceKind::Etcd,
        namespaces: vec![Namespace::new(NS)],
    })
}

/// A reader of a registry no actor writes (it stays at generation 0).
fn registry() -> RegistryReader {
    registry_parts().reader
}

/// Waits (on the picker's pass counter, never on a timer) until `done` holds.
async fn until(picker: &SharedPicker, done: impl Fn(&SharedPicker) -> bool) {
    let mut passes = picker.subscribe_passes();
    tokio::time::timeout(Duration::from_secs(120), passes.wait_for(|_| done(picker)))
        .await
        .expect("the condition holds within the deadline")
        .expect("the picker handle is alive");
}

/// A picker that only names itself: stands in for the KV-aware picker.
struct Named;

impl DynamoWorkerPicker for Named {
    fn name(&self) -> &'static str {
        "named"
    }

    fn pick(&self, _ctx: &mut PickContext<'_>) -> PickOutcome {
        PickOutcome::NoCandidates(continuum_protocol::picker::NoCandidates::NoWorkerForModel)
    }
}

#[tokio::test(start_paused = true)]
async fn the_actor_expires_the_ledger_on_its_own_timer() {
    let picker = SharedPicker::new();
    let load = SharedLoadStore::new(None);
    let args = PickerArgs {
        picker: picker.clone(),
        registry: registry(),
        load: load.clone(),
    };
    let (actor, handle) = Actor::spawn(None, PickerActor, args).await.expect("spawn");
    let start = now_tick();
    dispatch(&picker, &load, 1, start);

    // No pick runs in this test: only the actor's timer can expire the dispatch.
    tokio::time::advance(DISPATCH_MAX_AGE - Duration::from_secs(1)).await;
    let passes_before = picker.status().expiry_passes;
    until(&picker, |p| p.status().expiry_passes > passes_before).await;
    assert_eq!(
        picker.status().ledger_dispatches,
        1,
        "still younger than 30 s"
    );

    tokio::time::advance(Duration::from_secs(2)).await;
    until(&picker, |p| p.status().ledger_dispatches == 0).await;
    assert!(now_tick().since(start) >= DISPATCH_MAX_AGE);
    let status: continuum_actors::picker::PickerStatus =
        call_t!(actor, PickerMsg::Status, 1_000).expect("status");
    assert_eq!((status.ledger_dispatches, status.unanswered_legs), (0, 0));

    actor.stop(None);
    handle.await.expect("stops");
}

#[tokio::test(start_paused = true)]
async fn load_store_notifications_answer_dispatches() {
    let picker = SharedPicker::new();
    let load = SharedLoadStore::new(None);
    load.with(|store| store.set_live_and_retain([InstanceId(1), InstanceId(2)]));
    let args = PickerArgs {
        picker: picker.clone(),
        registry: registry(),
        load: load.clone(),
    };
    let (actor, handle) = Actor::spawn(None, PickerActor, args).await.expect("spawn");
    let at = now_tick();
    dispatch(&picker, &load, 1, at);
    dispatch(&picker, &load, 2, at);
    assert_eq!(picker.status().unanswered_legs, 2);

    tokio::time::advance(Duration::from_millis(10)).await;
    let sample = LoadSample {
        load: ActiveLoad {
            worker_id: InstanceId(1),
            dp_rank: DpRank(0),
            active_decode_blocks: Some(3),
            active_prefill_tokens: None,
            kv_used_blocks: None,
        },
        publisher_id: PublisherId(9),
        sequence: 1,
        published_at: UnixMillis(0),
        received_at: now_tick(),
    };
    assert_eq!(
        load.with(|store| store.apply(sample)),
        LoadEventResult::Applied
    );
    load.notify();
    // Worker 1's sample answers its dispatch; worker 2 sent nothing, so its dispatch stays.
    until(&picker, |p| p.status().unanswered_legs == 1).await;
    let backlog = load.with(|held| {
        picker.with_state(held, |s| {
            s.ledger.backlog(&worker(2), DpRank(0), now_tick())
        })
    });
    assert_eq!(backlog.decode_blocks, 4);

    actor.stop(None);
    handle.await.expect("stops");
}

fn records(id: u64) -> Vec<(String, Vec<u8>)> {
    let endpoint = serde_json::json!({"type": "Endpoint", "namespace": NS, "component": "backend",
        "endpoint": "generate", "instance_id": id, "transport": {"tcp": "127.0.0.1:1/x"}});
    let card = serde_json::json!({"type": "Model", "namespace": NS, "component": "backend",
        "endpoint": "generate", "instance_id": id, "card_json": {"display_name": "m",
        "worker_type": "decode", "kv_cache_block_size": 16,
        "runtime_config": {"total_kv_blocks": 1024, "data_parallel_start_rank": 0,
                           "data_parallel_size": 2}}});
    vec![
        (
            format!("v1/instances/{NS}/backend/generate/{id:x}"),
            serde_json::to_vec(&endpoint).expect("json"),
        ),
        (
            format!("v1/mdc/{NS}/backend/generate/{id:x}"),
            serde_json::to_vec(&card).expect("json"),
        ),
    ]
}

/// Stages one worker (two dp ranks) and waits until the registry publishes it.
async fn publish_worker(inbox: &RegistryInbox, registry: &RegistryReader, id: u64) {
    let mut reducer = DiscoveryReducer::new(Namespace::new(NS));
    reducer.apply(SourceEvent::Init, UnixMillis(0));
    for (key, value) in records(id) {
        reducer.apply(SourceEvent::InitApply { key, value }, UnixMillis(0));
    }
    reducer.apply(SourceEvent::InitDone, UnixMillis(0));
    inbox.stage_view(reducer.view().clone());
    let mut generations = registry.subscribe();
    generations
        .wait_for(|g| *g >= 1)
        .await
        .expect("a generation is published");
}

#[tokio::test(start_paused = true)]
async fn a_restart_under_root_loses_nothing_the_routing_needs() {
    let RegistryParts {
        writer,
        inbox,
        reader: registry,
    } = registry_parts();
    let load = SharedLoadStore::new(None);
    let picker = SharedPicker::new();
    let tree = ActorTree::default();
    let (root, handle) = spawn_root(
        vec![
            registry_spec(writer),
            picker_spec(picker.clone(), registry.clone(), load.clone()),
        ],
        tree.clone(),
        None,
    )
    .await
    .expect("root starts");

    // A fleet of one worker with two dp ranks: the actor indexes the published generation.
    publish_worker(&inbox, &registry, 7).await;
    let generation = registry.generation();
    until(&picker, |p| p.status().index_generation == Some(generation)).await;
    assert_eq!(picker.status().candidate_ranks, 2);
    assert_eq!(picker.index().index.for_model("m").len(), 2);

    // State the routing needs: the installed picker, the ledger, the index.
    picker
        .writer()
        .expect("no other writer")
        .set_picker(Arc::new(Named));
    dispatch(&picker, &load, 7, now_tick());
    let before = picker.status();
    let row = tree.get("root/picker").expect("the picker is in the tree");
    assert_eq!((row.kind, row.state), ("picker", ActorState::Running));

    tree.restart("root/picker", Duration::from_secs(30))
        .await
        .expect("restart answered");
    // The new incarnation's pre_start passes (rebuild, arrivals, expiry) have run.
    until(&picker, |p| p.status().expiry_passes > before.expiry_passes).await;
    let after = picker.status();
    assert_eq!(tree.get("root/picker").expect("row").restarts, 1);
    assert_eq!(tree.get("root/registry").expect("row").restarts, 0);
    assert_eq!(after.name, "named");
    assert_eq!(after.ledger_dispatches, 1);
    assert_eq!(after.unanswered_legs, 1);
    assert_eq!(after.index_generation, Some(generation));
    assert_eq!(after.candidate_ranks, 2);
    // The generation did not change, so the restarted actor reused the index.
    assert_eq!(after.index_rebuilds, before.index_rebuilds);

    root.stop(None);
    handle.await.expect("root stops");
}

/// The index has one writer: the running actor holds it, and a request that reads a generation
/// the actor has not indexed derives that generation's index for itself without publishing it.
#[tokio::test(start_paused = true)]
async fn only_the_actor_publishes_the_index_and_a_request_ahead_of_it_derives_its_own() {
    let RegistryParts {
        writer,
        inbox,
        reader: registry,
    } = registry_parts();
    let picker = SharedPicker::new();
    let (root, handle) = spawn_root(vec![registry_spec(writer)], ActorTree::default(), None)
        .await
        .expect("root starts");
    publish_worker(&inbox, &registry, 7).await;

    // No picker actor runs: the request derives the generation's index and stores nothing.
    let derived = picker.index_for(&registry);
    assert_eq!(derived.generation, registry.generation());
    assert_eq!(derived.index.for_model("m").len(), 2);
    let status = picker.status();
    assert_eq!(status.index_generation, None, "a request never publishes");
    assert_eq!(
        (status.index_rebuilds, status.index_derived_by_requests),
        (0, 1)
    );

    // The actor claims the writer and publishes; while it runs no one else can write.
    let args = PickerArgs {
        picker: picker.clone(),
        registry: registry.clone(),
        load: SharedLoadStore::new(None),
    };
    let (actor, actor_handle) = Actor::spawn(None, PickerActor, args).await.expect("spawn");
    assert!(
        picker.index_writer().is_none(),
        "the actor holds the writer"
    );
    until(&picker, |p| {
        p.status().index_generation == Some(registry.generation())
    })
    .await;
    assert!(Arc::ptr_eq(&picker.index_for(&registry), &picker.index()));
    assert_eq!(picker.status().index_derived_by_requests, 1);
    actor.stop(None);
    actor_handle.await.expect("stops");
    assert!(picker.index_writer().is_some(), "a stopped actor frees it");

    root.stop(None);
    handle.await.expect("root stops");
}

/// Feeding arrivals keeps each model layout's load-store slots current, so a decision finds them
/// resolved: slots move only when a rank gains or loses its sample.
#[test]
fn feeding_arrivals_resolves_the_layouts_slots_when_a_rank_gains_a_sample() {
    let ns = Namespace::new(NS);
    let mut reducer = DiscoveryReducer::new(ns.clone());
    reducer.apply(SourceEvent::Init, UnixMillis(0));
    for (key, value) in records(1) {
        reducer.apply(SourceEvent::InitApply { key, value }, UnixMillis(0));
    }
    reducer.apply(SourceEvent::InitDone, UnixMillis(0));
    let snapshot = continuum_protocol::discovery::snapshot::build_snapshot(
        SourceKind::Etcd,
        &[ns],
        &[reducer.view().as_ref()],
    );
    let picker = SharedPicker::new();
    let writer = picker.index_writer().expect("no actor holds the index");
    let held = writer.rebuild(1, &snapshot);
    let layout = held.index.layout_for("m").expect("a layout per model");
    assert_eq!(layout.len(), 2, "one row per dp rank");

    let store = SharedLoadStore::new(None);
    store.with(|s| s.set_live_and_retain([InstanceId(1)]));
    let sample = |rank: u32, sequence: u64| LoadSample {
        load: ActiveLoad {
            worker_id: InstanceId(1),
            dp_rank: DpRank(rank),
            active_decode_blocks: Some(3),
            active_prefill_tokens: None,
            kv_used_blocks: None,
        },
        publisher_id: PublisherId(9),
        sequence,
        published_at: UnixMillis(0),
        received_at: now_tick(),
    };
    let resolutions = |picker: &SharedPicker| {
        store.with(|held| picker.with_state(held, |s| s.slots.resolutions()))
    };
    store.with(|s| s.apply(sample(0, 1)));
    picker.feed_arrivals(&store);
    assert_eq!(resolutions(&picker), 1);
    // A replaced sample keeps its slot: nothing to resolve.
    store.with(|s| s.apply(sample(0, 2)));
    picker.feed_arrivals(&store);
    assert_eq!(resolutions(&picker), 1);
    // Rank 1's first sample gives it a slot: resolved on the next feed, not by the decision.
    store.with(|s| s.apply(sample(1, 3)));
    picker.feed_arrivals(&store);
    assert_eq!(resolutions(&picker), 2);
    let (slots, expected) = store.with(|held| {
        let slots = picker.with_state(held, |s| s.slots.slots(layout, held).to_vec());
        let expected = vec![
            held.slot(InstanceId(1), DpRank(0)).expect("held"),
            held.slot(InstanceId(1), DpRank(1)).expect("held"),
        ];
        (slots, expected)
    });
    assert_eq!(slots, expected);
    assert_eq!(resolutions(&picker), 2, "the decision found them current");
}
