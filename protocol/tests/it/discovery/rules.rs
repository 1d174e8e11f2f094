//! One test per reducer rule; each name states the rule.

use continuum_protocol::discovery::{
    CardJson, DiscoveryEventKind as Kind, DiscoveryReducer, Keyspace, MAX_RECORD_BYTES,
    MAX_RECORDS_PER_KEYSPACE, MAX_RETAINED_CARD_BYTES, Role, SourceEvent,
};
use continuum_protocol::ids::{InstanceId, PublisherId};
use continuum_protocol::time::UnixMillis;
use serde_json::json;

use super::support::*;

const T0: UnixMillis = UnixMillis(1_000);
const T1: UnixMillis = UnixMillis(2_000);

fn reducer() -> DiscoveryReducer {
    DiscoveryReducer::new(ns("dyn"))
}

fn worker_role(r: &DiscoveryReducer, id: u64) -> Option<Role> {
    r.view().worker(InstanceId(id)).map(|w| w.role)
}

/// Puts a generate endpoint for `component` and returns whether the view changed.
fn put_endpoint(r: &mut DiscoveryReducer, component: &str, id: u64) -> bool {
    r.apply(
        put(
            &endpoint_key("dyn", component, "generate", id),
            &endpoint("dyn", component, "generate", id),
        ),
        T0,
    )
}

fn put_card(r: &mut DiscoveryReducer, component: &str, id: u64, worker_type: Option<&str>) -> bool {
    r.apply(
        put(
            &card_key("dyn", component, "generate", id),
            &card("dyn", component, id, worker_type),
        ),
        T0,
    )
}

#[test]
fn ids_as_json_number_or_hex_string_join_the_same_worker() {
    let mut r = reducer();
    put_endpoint(&mut r, "decode", 0x1a7f2b);
    let mut c = card("dyn", "decode", 0, Some("decode"));
    c["instance_id"] = json!("1a7f2b");
    r.apply(
        put(&card_key("dyn", "decode", "generate", 0x1a7f2b), &c),
        T0,
    );
    let w = r.view().worker(InstanceId(0x1a7f2b)).expect("worker");
    assert_eq!(w.model.as_deref(), Some("Qwen/Qwen3-32B"));
}

#[test]
fn unknown_fields_are_ignored() {
    let mut r = reducer();
    let mut e = endpoint("dyn", "decode", "generate", 5);
    e["added_in_1_9"] = json!({"nested": [1, {"x": null}]});
    let mut c = card("dyn", "decode", 5, Some("decode"));
    c["card_json"]["runtime_config"]["brand_new"] = json!(true);
    r.apply(put(&endpoint_key("dyn", "decode", "generate", 5), &e), T0);
    r.apply(put(&card_key("dyn", "decode", "generate", 5), &c), T0);
    let w = r.view().worker(InstanceId(5)).expect("worker");
    assert_eq!(w.capacity.total_kv_blocks, Some(12000));
    assert!(r.take_counts().iter().all(|(k, _)| k == Kind::Put));
}

#[test]
fn unknown_worker_type_claims_no_role_and_the_component_decides() {
    let mut r = reducer();
    put_endpoint(&mut r, "backend", 1);
    put_card(&mut r, "backend", 1, Some("encode"));
    put_endpoint(&mut r, "prefill", 2);
    put_card(&mut r, "prefill", 2, Some("quantum"));
    assert_eq!(worker_role(&r, 1), Some(Role::Unknown));
    assert_eq!(worker_role(&r, 2), Some(Role::Prefill));
}

#[test]
fn unreadable_typed_card_subset_keeps_the_worker_and_the_raw_card() {
    let mut r = reducer();
    put_endpoint(&mut r, "decode", 3);
    // A card that is not an object has no typed subset; it is still kept verbatim.
    let value = br#"{"type":"Model","component":"decode","endpoint":"generate","instance_id":3,
        "card_json":["a future", {"card": "shape"}]}"#;
    r.apply(
        put_raw(&card_key("dyn", "decode", "generate", 3), value),
        T0,
    );
    let w = r.view().worker(InstanceId(3)).expect("worker");
    assert_eq!(w.role, Role::Decode, "the component still claims decode");
    assert_eq!(w.model, None);
    assert_eq!(
        w.card.as_ref().map(|c| c.value()),
        Some(json!(["a future", {"card": "shape"}]))
    );
    assert!(r.take_counts().iter().all(|(k, _)| k == Kind::Put));
}

#[test]
fn card_is_stored_once_and_shared_across_updates() {
    let mut r = reducer();
    put_endpoint(&mut r, "decode", 4);
    put_card(&mut r, "decode", 4, Some("decode"));
    let first = r
        .view()
        .worker(InstanceId(4))
        .and_then(|w| w.card.clone())
        .expect("card");
    let mut e = endpoint("dyn", "decode", "generate", 4);
    e["transport"] = json!({"tcp": "10.0.0.5:1/4/dyn/decode/generate"});
    assert!(r.apply(put(&endpoint_key("dyn", "decode", "generate", 4), &e), T1));
    let second = r
        .view()
        .worker(InstanceId(4))
        .and_then(|w| w.card.clone())
        .expect("card");
    assert!(
        CardJson::ptr_eq(&first, &second),
        "re-joining a worker must not copy its card"
    );
}

#[test]
fn a_card_rewritten_with_other_spacing_is_the_same_card() {
    let mut r = reducer();
    put_endpoint(&mut r, "decode", 5);
    put_card(&mut r, "decode", 5, Some("decode"));
    let key = card_key("dyn", "decode", "generate", 5);
    let pretty =
        serde_json::to_vec_pretty(&card("dyn", "decode", 5, Some("decode"))).expect("json");
    assert!(
        !r.apply(put_raw(&key, &pretty), T1),
        "the same card in other bytes changes no worker"
    );
    let w = r.view().worker(InstanceId(5)).expect("worker");
    assert_eq!(w.last_updated, T0);
    assert_eq!(
        w.card.as_ref().map(CardJson::value),
        Some(card("dyn", "decode", 5, Some("decode"))["card_json"].clone())
    );
}

#[test]
fn a_card_member_the_router_does_not_read_still_changes_the_worker() {
    let mut r = reducer();
    put_endpoint(&mut r, "decode", 6);
    put_card(&mut r, "decode", 6, Some("decode"));
    let mut c = card("dyn", "decode", 6, Some("decode"));
    c["card_json"]["slug"] = json!("another-slug");
    assert!(r.apply(put(&card_key("dyn", "decode", "generate", 6), &c), T1));
    let w = r.view().worker(InstanceId(6)).expect("worker");
    assert_eq!(w.last_updated, T1);
    assert_eq!(
        w.card.as_ref().map(|c| c.value()["slug"].clone()),
        Some(json!("another-slug"))
    );
}

#[test]
fn values_above_max_record_bytes_are_refused_before_parsing() {
    let mut r = reducer();
    put_endpoint(&mut r, "decode", 6);
    let mut huge = vec![b' '; MAX_RECORD_BYTES + 1];
    huge[0] = b'{';
    assert!(r.apply(
        put_raw(&endpoint_key("dyn", "decode", "generate", 6), &huge),
        T0
    ));
    assert!(
        r.view().worker(InstanceId(6)).is_none(),
        "the key's current value is refused"
    );
    assert_eq!(r.take_counts().get(Kind::Oversized), 1);
}

#[test]
fn cards_above_max_retained_card_bytes_keep_only_the_typed_subset() {
    let mut r = reducer();
    put_endpoint(&mut r, "decode", 7);
    let mut c = card("dyn", "decode", 7, Some("decode"));
    c["card_json"]["padding"] = json!("x".repeat(MAX_RETAINED_CARD_BYTES));
    r.apply(put(&card_key("dyn", "decode", "generate", 7), &c), T0);
    let w = r
        .view()
        .worker(InstanceId(7))
        .expect("worker still published");
    assert!(w.card.is_none());
    assert_eq!(w.capacity.total_kv_blocks, Some(12000));
    assert_eq!(w.block_size, Some(64));
    assert_eq!(r.take_counts().get(Kind::Oversized), 1);
}

#[test]
fn keyspace_capacity_refuses_new_keys_but_updates_held_ones_and_other_keyspaces() {
    let mut r = reducer();
    r.apply(SourceEvent::Init, T0);
    for id in 1..=MAX_RECORDS_PER_KEYSPACE as u64 {
        r.apply(
            SourceEvent::InitApply {
                key: endpoint_key("dyn", "decode", "generate", id),
                value: serde_json::to_vec(&endpoint("dyn", "decode", "generate", id))
                    .expect("json"),
            },
            T0,
        );
    }
    r.apply(SourceEvent::InitDone, T0);
    r.take_counts();
    let extra = MAX_RECORDS_PER_KEYSPACE as u64 + 1;
    assert!(!put_endpoint(&mut r, "decode", extra));
    assert!(!put_endpoint(&mut r, "decode", extra + 1));
    assert_eq!(r.held_keys(Keyspace::Instances), MAX_RECORDS_PER_KEYSPACE);
    assert_eq!(r.take_counts().get(Kind::OverCapacity), 2);
    // A held key still updates (heartbeats), and cards are a separate keyspace.
    let mut e = endpoint("dyn", "decode", "generate", 1);
    e["transport"] = json!({"tcp": "10.9.9.9:1/1/dyn/decode/generate"});
    assert!(r.apply(put(&endpoint_key("dyn", "decode", "generate", 1), &e), T1));
    assert!(put_card(&mut r, "decode", 1, Some("decode")));
    // Room again after a delete.
    r.apply(del(&endpoint_key("dyn", "decode", "generate", 2)), T1);
    assert!(put_endpoint(&mut r, "decode", extra));
}

#[test]
fn idempotent_resync_returns_false_and_keeps_timestamps() {
    let mut r = reducer();
    let kvs = vec![
        (
            endpoint_key("dyn", "decode", "generate", 8),
            serde_json::to_vec(&endpoint("dyn", "decode", "generate", 8)).expect("json"),
        ),
        (
            card_key("dyn", "decode", "generate", 8),
            serde_json::to_vec(&card("dyn", "decode", 8, Some("decode"))).expect("json"),
        ),
    ];
    assert!(resync(&mut r, &kvs, T0));
    assert!(!resync(&mut r, &kvs, T1));
    let w = r.view().worker(InstanceId(8)).expect("worker");
    assert_eq!((w.first_seen, w.last_updated), (T0, T0));
    assert_eq!(r.take_counts().get(Kind::Resync), 2);
}

/// A source that streams its pages ends a failed pass after `Init` without `InitDone`; the next
/// pass's `Init` must discard the partial resync, not merge it.
#[test]
fn a_new_init_discards_a_partial_resync() {
    let mut r = reducer();
    put_endpoint(&mut r, "decode", 9);
    put_endpoint(&mut r, "decode", 10);
    let record = |id| SourceEvent::InitApply {
        key: endpoint_key("dyn", "decode", "generate", id),
        value: serde_json::to_vec(&endpoint("dyn", "decode", "generate", id)).expect("json"),
    };
    r.apply(SourceEvent::Init, T1);
    assert!(!r.apply(record(11), T1));
    // The pass failed mid-read; the next one starts over and does not hold 11.
    r.apply(SourceEvent::Init, T1);
    assert!(r.is_resyncing());
    assert!(!r.apply(record(10), T1));
    assert_eq!(
        r.view().workers().len(),
        2,
        "nothing changes before InitDone"
    );
    assert!(r.apply(SourceEvent::InitDone, T1));
    let ids: Vec<u64> = r.view().workers().map(|w| w.key.instance_id.0).collect();
    assert_eq!(
        ids,
        vec![10],
        "the partial resync's record is gone, so is 9"
    );
    assert!(r.is_synced() && !r.is_resyncing());
}

#[test]
fn resync_swaps_atomically_at_init_done() {
    let mut r = reducer();
    put_endpoint(&mut r, "decode", 9);
    put_endpoint(&mut r, "decode", 10);
    r.apply(SourceEvent::Init, T1);
    let kv = SourceEvent::InitApply {
        key: endpoint_key("dyn", "decode", "generate", 10),
        value: serde_json::to_vec(&endpoint("dyn", "decode", "generate", 10)).expect("json"),
    };
    assert!(!r.apply(kv, T1));
    assert_eq!(
        r.view().workers().len(),
        2,
        "nothing changes before InitDone"
    );
    assert!(r.apply(SourceEvent::InitDone, T1));
    assert!(
        r.view().worker(InstanceId(9)).is_none(),
        "held records not in the resync are gone"
    );
    assert!(r.view().worker(InstanceId(10)).is_some());
}

#[test]
fn first_seen_survives_resyncs_and_last_updated_follows_changes() {
    let mut r = reducer();
    put_endpoint(&mut r, "decode", 11);
    let kvs = vec![
        (
            endpoint_key("dyn", "decode", "generate", 11),
            serde_json::to_vec(&endpoint("dyn", "decode", "generate", 11)).expect("json"),
        ),
        (
            card_key("dyn", "decode", "generate", 11),
            serde_json::to_vec(&card("dyn", "decode", 11, Some("decode"))).expect("json"),
        ),
    ];
    assert!(resync(&mut r, &kvs, T1));
    let w = r.view().worker(InstanceId(11)).expect("worker");
    assert_eq!(w.first_seen, T0);
    assert_eq!(w.last_updated, T1);
}

#[test]
fn namespace_comes_from_the_key_never_from_the_payload() {
    let mut r = reducer();
    r.apply(
        put(
            &endpoint_key("dyn", "decode", "generate", 12),
            &endpoint("forged", "decode", "generate", 12),
        ),
        T0,
    );
    let w = r.view().worker(InstanceId(12)).expect("worker");
    assert_eq!(w.key.namespace, ns("dyn"));
}

#[test]
fn keys_of_another_namespace_are_ignored() {
    let mut r = reducer();
    assert!(!r.apply(
        put(
            &endpoint_key("other", "decode", "generate", 13),
            &endpoint("dyn", "decode", "generate", 13)
        ),
        T0
    ));
    assert!(!r.apply(
        put(
            &endpoint_key("dyn2", "decode", "generate", 13),
            &endpoint("dyn", "decode", "generate", 13)
        ),
        T0
    ));
    assert!(!r.apply(del(&endpoint_key("other", "decode", "generate", 13)), T0));
    assert!(r.view().workers().len() == 0);
    assert!(r.take_counts().is_empty());
}

#[test]
fn cards_join_on_component_endpoint_and_instance() {
    let mut r = reducer();
    put_endpoint(&mut r, "decode", 14);
    put_card(&mut r, "other", 14, Some("decode"));
    assert_eq!(
        r.view()
            .worker(InstanceId(14))
            .and_then(|w| w.model.clone()),
        None
    );
    put_card(&mut r, "decode", 14, Some("decode"));
    assert!(
        r.view()
            .worker(InstanceId(14))
            .and_then(|w| w.model.clone())
            .is_some()
    );
}

#[test]
fn legacy_cards_join_on_instance_alone_and_scoped_cards_take_precedence() {
    let mut r = reducer();
    put_endpoint(&mut r, "backend", 15);
    let mut legacy = card("dyn", "", 15, Some("aggregated"));
    legacy["endpoint"] = json!("");
    legacy["card_json"]["display_name"] = json!("legacy-model");
    r.apply(put("v1/mdc/dyn/x/y/f", &legacy), T0);
    let model = |r: &DiscoveryReducer| {
        r.view()
            .worker(InstanceId(15))
            .and_then(|w| w.model.clone())
    };
    assert_eq!(model(&r).as_deref(), Some("legacy-model"));
    put_card(&mut r, "backend", 15, Some("aggregated"));
    assert_eq!(model(&r).as_deref(), Some("Qwen/Qwen3-32B"));
    r.apply(del(&card_key("dyn", "backend", "generate", 15)), T1);
    assert_eq!(model(&r).as_deref(), Some("legacy-model"));
}

#[test]
fn lora_cards_never_join() {
    let mut r = reducer();
    put_endpoint(&mut r, "decode", 16);
    let mut lora = card("dyn", "decode", 16, Some("decode"));
    lora["model_suffix"] = json!("customer-1");
    r.apply(
        put(
            &format!("{}/customer-1", card_key("dyn", "decode", "generate", 16)),
            &lora,
        ),
        T0,
    );
    let mut lora_no_key_suffix = lora.clone();
    lora_no_key_suffix["card_json"]["display_name"] = json!("lora");
    r.apply(
        put(
            &card_key("dyn", "decode", "generate", 16),
            &lora_no_key_suffix,
        ),
        T0,
    );
    assert_eq!(
        r.view()
            .worker(InstanceId(16))
            .and_then(|w| w.model.clone()),
        None
    );
    assert_eq!(r.held_keys(Keyspace::Cards), 0);
}

#[test]
fn only_generate_endpoints_become_workers() {
    let mut r = reducer();
    for ep in [
        "load_metrics",
        "clear_kv_blocks",
        "worker_kv_query_source_8520bd755cfc6",
    ] {
        assert!(!r.apply(
            put(
                &endpoint_key("dyn", "prefill", ep, 17),
                &endpoint("dyn", "prefill", ep, 17)
            ),
            T0
        ));
    }
    assert_eq!(r.view().workers().len(), 0);
    assert!(
        r.take_counts().iter().all(|(k, _)| k == Kind::Put),
        "skipped silently"
    );
}

#[test]
fn component_and_card_disagreement_excludes_the_worker_and_is_counted_once() {
    let mut r = reducer();
    put_endpoint(&mut r, "prefill", 18);
    assert_eq!(
        worker_role(&r, 18),
        Some(Role::Prefill),
        "no card: the component's role"
    );
    put_card(&mut r, "prefill", 18, Some("decode"));
    assert_eq!(worker_role(&r, 18), None);
    put_endpoint(&mut r, "prefill", 18);
    let mut e = endpoint("dyn", "prefill", "generate", 18);
    e["device_type"] = json!("cpu");
    r.apply(put(&endpoint_key("dyn", "prefill", "generate", 18), &e), T0);
    assert_eq!(r.take_counts().get(Kind::RoleConflict), 1);
    put_card(&mut r, "prefill", 18, Some("prefill"));
    assert_eq!(worker_role(&r, 18), Some(Role::Prefill));
}

#[test]
fn other_components_let_the_card_decide_and_claim_nothing_without_one() {
    let mut r = reducer();
    put_endpoint(&mut r, "backend", 19);
    assert_eq!(
        worker_role(&r, 19),
        Some(Role::Unknown),
        "no card, no component claim"
    );
    put_card(&mut r, "backend", 19, Some("decode"));
    assert_eq!(worker_role(&r, 19), Some(Role::Decode));
    put_card(&mut r, "backend", 19, Some("aggregated"));
    assert_eq!(
        worker_role(&r, 19),
        Some(Role::Aggregated),
        "1.6.1 agg workers write aggregated"
    );
    put_card(&mut r, "backend", 19, None);
    assert_eq!(
        worker_role(&r, 19),
        Some(Role::Aggregated),
        "legacy card without worker_type"
    );
    let mut legacy_prefill = card("dyn", "backend", 19, None);
    legacy_prefill["card_json"]["model_type"] = json!("Chat | Prefill");
    r.apply(
        put(&card_key("dyn", "backend", "generate", 19), &legacy_prefill),
        T0,
    );
    assert_eq!(
        worker_role(&r, 19),
        Some(Role::Prefill),
        "legacy Prefill bit"
    );
}

#[test]
fn duplicate_generate_instance_ids_give_no_worker_until_the_extra_is_deleted() {
    let mut r = reducer();
    put_endpoint(&mut r, "decode", 20);
    put_endpoint(&mut r, "prefill", 20);
    assert!(r.view().worker(InstanceId(20)).is_none());
    put_endpoint(&mut r, "prefill", 20);
    assert_eq!(
        r.take_counts().get(Kind::Duplicate),
        1,
        "one log and count per key set"
    );
    r.apply(del(&endpoint_key("dyn", "prefill", "generate", 20)), T1);
    assert_eq!(
        worker_role(&r, 20),
        Some(Role::Decode),
        "the survivor is used again"
    );
}

/// Warnings the reducer logs while `body` runs, one JSON object per event.
fn warnings(body: impl FnOnce()) -> Vec<serde_json::Value> {
    #[derive(Clone, Default)]
    struct Sink(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Sink {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let sink = Sink::default();
    let writer = sink.clone();
    let subscriber = tracing_subscriber::fmt()
        .json()
        .with_max_level(tracing::Level::WARN)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, body);
    let text = String::from_utf8(sink.0.lock().unwrap().clone()).expect("UTF-8 logs");
    text.lines()
        .map(|line| serde_json::from_str(line).expect("one JSON event per line"))
        .collect()
}

/// Spec "Duplicate identities": the warning names the record kind, the identity, the conflict
/// count and at most four keys; each distinct conflicting key set is logged once (a repeated
/// put or an identical resync logs nothing).
#[test]
fn a_duplicate_warning_names_kind_identity_count_and_at_most_four_keys_once_per_key_set() {
    let mut r = reducer();
    let components = ["c0", "c1", "c2", "c3", "c4", "c5"];
    let logged = warnings(|| {
        for c in components {
            put_endpoint(&mut r, c, 20);
        }
    });
    // One warning per distinct key set: 2, 3, 4, 5 and 6 keys.
    assert_eq!(logged.len(), 5, "{logged:#?}");
    let last = &logged[4]["fields"];
    assert_eq!(
        last["message"],
        "Refused discovery records that claim one identity."
    );
    assert_eq!(last["namespace"], "dyn");
    assert_eq!(last["record"], "generate endpoint");
    assert_eq!(last["identity"], format!("instance {}", InstanceId(20)));
    assert_eq!(last["conflicts"], 6);
    let keys = last["keys"].as_str().expect("keys");
    let named: Vec<&str> = components
        .iter()
        .filter(|c| keys.contains(&format!("/{c}/generate/")))
        .copied()
        .collect();
    assert_eq!(named.len(), 4, "at most four keys: {keys}");
    assert_eq!(r.take_counts().get(Kind::Duplicate), 5);

    // The same key set again: a repeated put, then an identical resync.
    let again = warnings(|| {
        put_endpoint(&mut r, "c3", 20);
        r.apply(SourceEvent::Init, T1);
        for c in components {
            r.apply(
                SourceEvent::InitApply {
                    key: endpoint_key("dyn", c, "generate", 20),
                    value: serde_json::to_vec(&endpoint("dyn", c, "generate", 20)).unwrap(),
                },
                T1,
            );
        }
        r.apply(SourceEvent::InitDone, T1);
    });
    assert!(again.is_empty(), "logged once per key set: {again:#?}");
    assert_eq!(r.take_counts().get(Kind::Duplicate), 0);

    // A new key set (one extra deleted) is a new warning; the last one leaving ends them.
    let shrunk = warnings(|| {
        r.apply(del(&endpoint_key("dyn", "c5", "generate", 20)), T1);
    });
    assert_eq!(shrunk.len(), 1, "{shrunk:#?}");
    assert_eq!(shrunk[0]["fields"]["conflicts"], 5);
}

#[test]
fn duplicate_base_cards_leave_the_worker_without_a_card() {
    let mut r = reducer();
    put_endpoint(&mut r, "decode", 21);
    put_card(&mut r, "decode", 21, Some("decode"));
    r.apply(
        put(
            "v1/mdc/dyn/forged/generate/15",
            &card("dyn", "decode", 21, Some("decode")),
        ),
        T0,
    );
    let w = r.view().worker(InstanceId(21)).expect("never excluded");
    assert!(w.card.is_none() && w.model.is_none());
    assert_eq!(w.role, Role::Decode);
    assert_eq!(r.take_counts().get(Kind::Duplicate), 1);
    r.apply(del("v1/mdc/dyn/forged/generate/15"), T1);
    assert!(
        r.view()
            .worker(InstanceId(21))
            .and_then(|w| w.card.clone())
            .is_some()
    );
}

#[test]
fn duplicate_publisher_ids_are_both_refused() {
    let mut r = reducer();
    r.apply(
        put(
            &channel_key("dyn", "decode", "kv_metrics", 30),
            &channel("dyn", "decode", "kv_metrics", 30, 41000),
        ),
        T0,
    );
    assert!(r.view().publisher(PublisherId(30)).is_some());
    r.apply(
        put(
            &channel_key("dyn", "prefill", "kv_metrics", 31),
            &channel("dyn", "prefill", "kv_metrics", 30, 41001),
        ),
        T0,
    );
    assert!(r.view().publisher(PublisherId(30)).is_none());
    assert_eq!(r.take_counts().get(Kind::Duplicate), 1);
    r.apply(del(&channel_key("dyn", "prefill", "kv_metrics", 31)), T1);
    assert!(r.view().publisher(PublisherId(30)).is_some());
}

#[test]
fn one_bad_record_never_affects_the_others() {
    let mut r = reducer();
    put_endpoint(&mut r, "decode", 22);
    r.apply(
        put_raw(&endpoint_key("dyn", "decode", "generate", 23), b"{not json"),
        T0,
    );
    r.apply(
        put(
            &endpoint_key("dyn", "decode", "generate", 24),
            &json!({"type": "Endpoint", "endpoint": "generate"}),
        ),
        T0,
    );
    r.apply(put_raw("v1/instances/dyn/too/short", b"{}"), T0);
    put_endpoint(&mut r, "prefill", 25);
    assert!(r.view().worker(InstanceId(22)).is_some());
    assert!(r.view().worker(InstanceId(25)).is_some());
    assert_eq!(r.view().workers().len(), 2);
    assert_eq!(r.take_counts().get(Kind::Malformed), 3);
}

#[test]
fn a_malformed_update_drops_the_keys_previous_value() {
    let mut r = reducer();
    put_endpoint(&mut r, "decode", 26);
    assert!(r.apply(
        put_raw(&endpoint_key("dyn", "decode", "generate", 26), b"[]"),
        T1
    ));
    assert!(r.view().worker(InstanceId(26)).is_none());
}

#[test]
fn only_direct_zmq_tcp_channels_become_publishers() {
    let mut r = reducer();
    let key = |p: u64| channel_key("dyn", "decode", "kv_metrics", p);
    let base = channel("dyn", "decode", "kv_metrics", 40, 41000);
    let mut broker = base.clone();
    broker["transport"] =
        json!({"kind": "ZmqBroker", "config": {"xsub_endpoints": [], "xpub_endpoints": []}});
    let mut nats = base.clone();
    nats["transport"] = json!({"kind": "Nats", "config": {"subject_prefix": "namespace.dyn"}});
    let mut unknown_kind = base.clone();
    unknown_kind["transport"]["kind"] = json!("Quic");
    let mut unknown_scope = base.clone();
    unknown_scope["scope"] = json!({"kind": "galaxy"});
    let mut ipc = base.clone();
    ipc["transport"]["config"]["endpoint"] = json!("ipc:///tmp/pub");
    for (i, v) in [broker, nats, unknown_kind, unknown_scope, ipc]
        .iter()
        .enumerate()
    {
        let mut v = v.clone();
        v["instance_id"] = json!(41 + i as u64);
        r.apply(put(&key(41 + i as u64), &v), T0);
    }
    let mut no_id = base.clone();
    no_id.as_object_mut().expect("object").remove("instance_id");
    let mut bad_endpoint = base.clone();
    bad_endpoint["transport"]["config"]["endpoint"] = json!("tcp://no-port");
    bad_endpoint["instance_id"] = json!(51);
    r.apply(put(&key(50), &no_id), T0);
    r.apply(put(&key(51), &bad_endpoint), T0);
    let mut other_topic = base.clone();
    other_topic["topic"] = json!("active_sequences_events");
    other_topic["instance_id"] = json!(52);
    r.apply(
        put(
            &channel_key("dyn", "decode", "active_sequences_events", 52),
            &other_topic,
        ),
        T0,
    );
    r.apply(put(&key(40), &base), T0);
    assert_eq!(r.view().publishers().len(), 1);
    let counts = r.take_counts();
    assert_eq!(counts.get(Kind::Unsupported), 5);
    assert_eq!(counts.get(Kind::Malformed), 2);
}

#[test]
fn kv_events_and_kv_metrics_topics_are_kept_with_percent_decoded_scopes() {
    let mut r = DiscoveryReducer::new(ns("my.ns"));
    let key = "v1/event_channels/namespace/my%2Ens/component/dec%2Fode/endpoint/generate/topic/kv-events/3c";
    let mut v = channel("my.ns", "dec/ode", "kv-events", 60, 41000);
    v.as_object_mut().expect("object").remove("scope");
    r.apply(put(key, &v), T0);
    let p = r.view().publisher(PublisherId(60)).expect("publisher");
    assert_eq!(
        p.component.as_deref(),
        Some("dec/ode"),
        "scope from the decoded key"
    );
    assert_eq!(p.topic.as_str(), "kv-events");
}

#[test]
fn event_sources_name_the_worker_behind_a_kv_events_publisher() {
    let mut r = reducer();
    r.apply(
        put(
            &channel_key("dyn", "prefill", "kv-events", 70),
            &channel("dyn", "prefill", "kv-events", 70, 41000),
        ),
        T0,
    );
    assert_eq!(
        r.view()
            .publisher(PublisherId(70))
            .and_then(|p| p.worker.clone()),
        None
    );
    assert!(r.apply(
        put(
            &source_key("dyn", "prefill", 70),
            &source("dyn", "prefill", 70, 0x77, 1)
        ),
        T0
    ));
    let p = r.view().publisher(PublisherId(70)).expect("publisher");
    assert_eq!(
        p.worker.as_ref().map(|k| k.instance_id),
        Some(InstanceId(0x77))
    );
    assert_eq!(p.dp_rank.map(|d| d.0), Some(1));
}

#[test]
fn take_counts_drains_puts_and_deletes() {
    let mut r = reducer();
    put_endpoint(&mut r, "decode", 80);
    r.apply(del(&endpoint_key("dyn", "decode", "generate", 80)), T0);
    let counts = r.take_counts();
    assert_eq!((counts.get(Kind::Put), counts.get(Kind::Delete)), (1, 1));
    assert!(r.take_counts().is_empty());
}

#[test]
fn admin_json_is_exactly_the_seed_worker_object() {
    let mut r = reducer();
    let id = 0x1a7f2b;
    let mut c = card("dyn", "decode", id, Some("decode"));
    c["card_json"]["runtime_config"]["data_parallel_start_rank"] = json!(2);
    c["card_json"]["runtime_config"]["data_parallel_size"] = json!(4);
    c["card_json"]["runtime_config"]["disaggregated_endpoint"] = json!("dynamo/prefill/generate");
    c["card_json"]["runtime_config"]["max_num_seqs"] = json!(128);
    let first = UnixMillis(1_790_136_662_000);
    let later = UnixMillis(1_790_137_188_000);
    r.apply(
        put(
            &endpoint_key("dyn", "decode", "generate", id),
            &endpoint("dyn", "decode", "generate", id),
        ),
        first,
    );
    r.apply(put(&card_key("dyn", "decode", "generate", id), &c), first);
    c["card_json"]["runtime_config"]["max_num_seqs"] = json!(256);
    r.apply(put(&card_key("dyn", "decode", "generate", id), &c), later);
    let got = r
        .view()
        .worker(InstanceId(id))
        .expect("worker")
        .admin_json();
    let want = json!({
        "instance_id": "1a7f2b",
        "namespace": "dyn",
        "worker_id": "1736491",
        "role": "decode",
        "model": "Qwen/Qwen3-32B",
        "component": "decode",
        "endpoint": "generate",
        "dp_start_rank": 2,
        "dp_size": 4,
        "block_size": 64,
        "capacity": {
            "total_kv_blocks": 12000,
            "max_num_batched_tokens": 8192,
            "max_num_seqs": 256,
            "context_length": 32768
        },
        "disaggregated_endpoint": "dynamo/prefill/generate",
        "first_seen": "2026-09-23T04:11:02+00:00",
        "last_updated": "2026-09-23T04:19:48+00:00"
    });
    assert_eq!(got, want);
    let text = serde_json::to_string(r.view().worker(InstanceId(id)).expect("worker").as_ref())
        .expect("json");
    assert!(
        !text.contains("10.0.0.4"),
        "transport never serialised: {text}"
    );
    assert!(!text.contains("slug"), "raw card never serialised: {text}");
}

#[test]
fn publishers_never_serialise_their_tcp_endpoint() {
    let mut r = reducer();
    r.apply(
        put(
            &channel_key("dyn", "decode", "kv_metrics", 90),
            &channel("dyn", "decode", "kv_metrics", 90, 41999),
        ),
        T0,
    );
    let p = r.view().publisher(PublisherId(90)).expect("publisher");
    let text = serde_json::to_string(p.as_ref()).expect("json");
    assert!(
        !text.contains("41999") && !text.contains("10.0.0.7"),
        "{text}"
    );
    assert_eq!(p.address().authority(), "10.0.0.7:41999");
}

#[test]
fn watch_events_during_a_resync_survive_the_swap() {
    let mut r = reducer();
    put_endpoint(&mut r, "decode", 100);
    r.apply(SourceEvent::Init, T1);
    for id in [101, 102] {
        r.apply(
            SourceEvent::InitApply {
                key: endpoint_key("dyn", "decode", "generate", id),
                value: serde_json::to_vec(&endpoint("dyn", "decode", "generate", id))
                    .expect("json"),
            },
            T1,
        );
    }
    assert!(r.apply(
        put(
            &endpoint_key("dyn", "prefill", "generate", 103),
            &endpoint("dyn", "prefill", "generate", 103)
        ),
        T1
    ));
    r.apply(del(&endpoint_key("dyn", "decode", "generate", 102)), T1);
    assert!(r.is_resyncing());
    r.apply(SourceEvent::InitDone, T1);
    let ids: Vec<u64> = r.view().workers().map(|w| w.key.instance_id.0).collect();
    assert_eq!(ids, vec![101, 103]);
    assert!(r.is_synced() && !r.is_resyncing());
}

/// Counts the events whose message contains `needle` (a minimal tracing layer).
struct CountEvents {
    needle: &'static str,
    seen: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for CountEvents {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Message<'a>(&'a str, bool);
        impl tracing::field::Visit for Message<'_> {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" && format!("{value:?}").contains(self.0) {
                    self.1 = true;
                }
            }
        }
        let mut message = Message(self.needle, false);
        event.record(&mut message);
        if message.1 {
            self.seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

#[test]
fn a_cards_release_string_is_logged_once_per_instance() {
    use tracing_subscriber::layer::SubscriberExt as _;
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let subscriber = tracing_subscriber::registry().with(CountEvents {
        needle: "release string",
        seen: seen.clone(),
    });
    tracing::subscriber::with_default(subscriber, || {
        let mut r = reducer();
        put_endpoint(&mut r, "decode", 8);
        let key = card_key("dyn", "decode", "generate", 8);
        let mut c = card("dyn", "decode", 8, Some("decode"));
        c["card_json"]["dynamo_version"] = json!("1.6.1");
        r.apply(put(&key, &c), T0);
        // Re-parses of the instance's card (another member, other spacing) log nothing more.
        c["card_json"]["slug"] = json!("another-slug");
        r.apply(put(&key, &c), T1);
        let pretty = serde_json::to_vec_pretty(&c).expect("json");
        r.apply(put_raw(&key, &pretty), T1);
        assert_eq!(seen.load(std::sync::atomic::Ordering::Relaxed), 1);
        // Another instance with the same card is logged once too.
        put_endpoint(&mut r, "decode", 9);
        let mut other = c.clone();
        other["instance_id"] = json!(9);
        r.apply(put(&card_key("dyn", "decode", "generate", 9), &other), T1);
        other["card_json"]["slug"] = json!("a-third-slug");
        r.apply(put(&card_key("dyn", "decode", "generate", 9), &other), T1);
    });
    assert_eq!(seen.load(std::sync::atomic::Ordering::Relaxed), 2);
}
