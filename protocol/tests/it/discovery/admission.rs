//! Bounded admission at a keyspace's capacity during a resync: the fleet controls key order, so
//! the cap keeps records that join complete workers and workers admitted before, whatever the
//! order and whatever ids a flood of orphans carries.

use std::collections::BTreeSet;

use continuum_protocol::discovery::{
    DiscoveryEventKind as Kind, DiscoveryReducer, Keyspace, MAX_RECORDS_PER_KEYSPACE, SourceEvent,
};
use continuum_protocol::ids::{InstanceId, PublisherId};
use continuum_protocol::time::UnixMillis;
use proptest::prelude::*;

use super::support::*;

const T0: UnixMillis = UnixMillis(1_000);
const T1: UnixMillis = UnixMillis(2_000);

/// Real workers: ids above every junk id, so key order alone would rank them last.
const REAL: [u64; 3] = [0xffff_fff1, 0xffff_fff2, 0xffff_fff3];

fn kv(key: String, value: &serde_json::Value) -> (String, Vec<u8>) {
    (key, serde_json::to_vec(value).expect("json"))
}

fn real_endpoints() -> Vec<(String, Vec<u8>)> {
    REAL.iter()
        .map(|id| {
            kv(
                endpoint_key("dyn", "decode", "generate", *id),
                &endpoint("dyn", "decode", "generate", *id),
            )
        })
        .collect()
}

fn real_cards() -> Vec<(String, Vec<u8>)> {
    REAL.iter()
        .map(|id| {
            kv(
                card_key("dyn", "decode", "generate", *id),
                &card("dyn", "decode", *id, Some("decode")),
            )
        })
        .collect()
}

/// `n` endpoint-only keys with low ids (1..=n): orphans that sort before every real key.
fn junk_endpoints(n: u64) -> Vec<(String, Vec<u8>)> {
    (1..=n)
        .map(|id| {
            kv(
                endpoint_key("dyn", "decode", "generate", id),
                &endpoint("dyn", "decode", "generate", id),
            )
        })
        .collect()
}

fn sorted(mut kvs: Vec<(String, Vec<u8>)>) -> Vec<(String, Vec<u8>)> {
    kvs.sort();
    kvs
}

fn real_workers(r: &DiscoveryReducer) -> Vec<u64> {
    REAL.iter()
        .copied()
        .filter(|id| {
            r.view()
                .worker(InstanceId(*id))
                .is_some_and(|w| w.model.is_some())
        })
        .collect()
}

/// A reducer that admitted the real workers live, as before any reconnect.
fn admitted() -> DiscoveryReducer {
    let mut r = DiscoveryReducer::new(ns("dyn"));
    let mut kvs = real_endpoints();
    kvs.extend(real_cards());
    resync(&mut r, &kvs, T0);
    assert_eq!(real_workers(&r), REAL.to_vec());
    r.take_counts();
    r
}

#[test]
fn a_resync_flooded_with_20000_low_id_orphan_endpoints_keeps_the_admitted_workers() {
    let mut r = admitted();
    // The worst order for the real workers: every junk key first, their endpoints before their
    // cards (instances sort before mdc), as a range get over both prefixes in key order returns.
    let mut kvs = junk_endpoints(20_000);
    kvs.extend(real_endpoints());
    kvs.extend(real_cards());
    resync(&mut r, &sorted(kvs), T1);
    assert_eq!(
        real_workers(&r),
        REAL.to_vec(),
        "real workers survive the flood"
    );
    assert_eq!(r.held_keys(Keyspace::Instances), MAX_RECORDS_PER_KEYSPACE);
    let counts = r.take_counts();
    assert_eq!(
        counts.get(Kind::OverCapacity),
        20_000 + REAL.len() as u64 - MAX_RECORDS_PER_KEYSPACE as u64,
        "every record left out is counted once"
    );
    // The ones kept besides the real workers are the lowest junk keys (deterministic).
    assert!(r.view().worker(InstanceId(1)).is_some());
    let kept_junk = MAX_RECORDS_PER_KEYSPACE - REAL.len();
    let by_key: BTreeSet<String> = (1..=20_000u64)
        .map(|id| endpoint_key("dyn", "decode", "generate", id))
        .collect();
    let last_kept = by_key.iter().nth(kept_junk - 1).expect("kept");
    let first_out = by_key.iter().nth(kept_junk).expect("left out");
    let id_of = |key: &str| u64::from_str_radix(key.rsplit('/').next().expect("id"), 16);
    assert!(
        r.view()
            .worker(InstanceId(id_of(last_kept).expect("hex")))
            .is_some()
    );
    assert!(
        r.view()
            .worker(InstanceId(id_of(first_out).expect("hex")))
            .is_none()
    );
}

#[test]
fn a_first_sync_reading_cards_first_admits_complete_workers_over_a_low_id_flood() {
    // Nothing admitted before: the cards (read first, as the etcd source does) make the real
    // endpoints complete, which outranks endpoint-only keys with lower ids.
    let mut r = DiscoveryReducer::new(ns("dyn"));
    let mut kvs = real_cards();
    kvs.extend(sorted({
        let mut e = junk_endpoints(MAX_RECORDS_PER_KEYSPACE as u64 + 50);
        e.extend(real_endpoints());
        e
    }));
    resync(&mut r, &kvs, T0);
    assert_eq!(real_workers(&r), REAL.to_vec());
    assert_eq!(
        r.take_counts().get(Kind::OverCapacity),
        50 + REAL.len() as u64
    );
}

#[test]
fn live_puts_at_capacity_still_refuse_new_keys() {
    // Outside a resync the held set is what already works: a new key is refused, never evicting.
    let mut r = admitted();
    let mut kvs = junk_endpoints(MAX_RECORDS_PER_KEYSPACE as u64 - REAL.len() as u64);
    kvs.extend(real_endpoints());
    kvs.extend(real_cards());
    resync(&mut r, &kvs, T1);
    r.take_counts();
    let extra = 0xe000_0000;
    r.apply(
        put(
            &card_key("dyn", "decode", "generate", extra),
            &card("dyn", "decode", extra, Some("decode")),
        ),
        T1,
    );
    assert!(!r.apply(
        put(
            &endpoint_key("dyn", "decode", "generate", extra),
            &endpoint("dyn", "decode", "generate", extra),
        ),
        T1,
    ));
    assert_eq!(r.take_counts().get(Kind::OverCapacity), 1);
    assert_eq!(real_workers(&r), REAL.to_vec());
}

#[test]
fn hostile_channels_with_low_ids_do_not_push_out_live_workers_channels() {
    let real_channels: Vec<(String, Vec<u8>)> = REAL
        .iter()
        .map(|id| {
            kv(
                channel_key("dyn", "decode", "kv_metrics", *id),
                &channel("dyn", "decode", "kv_metrics", *id, 5000),
            )
        })
        .collect();
    // A channel's id is a publisher id, not a worker id: its scope ties it to workers. The
    // flood is scoped on a component no worker serves.
    let mut r = DiscoveryReducer::new(ns("dyn"));
    let mut kvs = real_cards();
    kvs.extend(real_endpoints());
    let mut channels: Vec<(String, Vec<u8>)> = (1..=MAX_RECORDS_PER_KEYSPACE as u64 + 10)
        .map(|id| {
            kv(
                channel_key("dyn", "ghost", "kv_metrics", id),
                &channel("dyn", "ghost", "kv_metrics", id, 6000),
            )
        })
        .collect();
    channels.extend(real_channels);
    kvs.extend(sorted(channels));
    resync(&mut r, &kvs, T0);
    for id in REAL {
        assert!(
            r.view().publisher(PublisherId(id)).is_some(),
            "channel of live worker {id:x} kept"
        );
    }
    assert_eq!(r.held_keys(Keyspace::Channels), MAX_RECORDS_PER_KEYSPACE);
}

fn shuffled(kvs: &[(String, Vec<u8>)], seed: u64) -> Vec<(String, Vec<u8>)> {
    // Fisher–Yates with a splitmix64 stream: a deterministic permutation per seed.
    let mut out = kvs.to_vec();
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    for i in (1..out.len()).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        out.swap(i, j);
    }
    out
}

proptest! {
    // Each case folds ~16k records; a few orders are enough to catch order dependence.
    #![proptest_config(ProptestConfig::with_cases(4))]

    /// Whatever order a resync delivers a flood of low-id orphans in, the previously admitted
    /// workers stay and the kept set is the same (deterministic).
    #[test]
    fn any_order_of_a_flooded_resync_keeps_admitted_workers_and_the_same_view(seed in any::<u64>()) {
        let mut kvs = junk_endpoints(MAX_RECORDS_PER_KEYSPACE as u64 + 40);
        kvs.extend(real_endpoints());
        kvs.extend(real_cards());
        let mut in_key_order = admitted();
        resync(&mut in_key_order, &sorted(kvs.clone()), T1);
        let mut shuffled_order = admitted();
        resync(&mut shuffled_order, &shuffled(&kvs, seed), T1);
        prop_assert_eq!(real_workers(&shuffled_order), REAL.to_vec());
        let ids = |r: &DiscoveryReducer| -> Vec<InstanceId> {
            r.view().workers().map(|w| w.key.instance_id).collect()
        };
        prop_assert_eq!(ids(&in_key_order), ids(&shuffled_order));
        prop_assert_eq!(
            in_key_order.take_counts().get(Kind::OverCapacity),
            shuffled_order.take_counts().get(Kind::OverCapacity)
        );
    }
}

#[test]
fn a_watch_put_inside_a_resync_goes_through_the_same_admission() {
    let mut r = admitted();
    r.apply(SourceEvent::Init, T1);
    for (key, value) in sorted(junk_endpoints(MAX_RECORDS_PER_KEYSPACE as u64)) {
        r.apply(SourceEvent::InitApply { key, value }, T1);
    }
    // The real records arrive as watch puts while the resync is still open.
    for (key, value) in real_cards().into_iter().chain(real_endpoints()) {
        r.apply(SourceEvent::Apply { key, value }, T1);
    }
    r.apply(SourceEvent::InitDone, T1);
    assert_eq!(real_workers(&r), REAL.to_vec());
}
