//! Properties: any interleaving of puts and deletes over a key pool converges to the view a
//! fresh reducer builds from the final key set as one resync; arbitrary bytes never panic.

use std::collections::BTreeMap;

use continuum_protocol::discovery::{DiscoveryReducer, SourceEvent};
use continuum_protocol::time::UnixMillis;
use proptest::prelude::*;
use serde_json::json;

use super::support::*;

/// Keys covering every keyspace and the identities that can collide.
fn key_pool() -> Vec<String> {
    let mut keys = Vec::new();
    for id in 1..=3u64 {
        for comp in ["prefill", "decode", "backend"] {
            keys.push(endpoint_key("p", comp, "generate", id));
            keys.push(card_key("p", comp, "generate", id));
        }
        keys.push(endpoint_key("p", "backend", "load_metrics", id));
        keys.push(format!(
            "{}/lora-a",
            card_key("p", "backend", "generate", id)
        ));
        keys.push(card_key("p", "legacy", "x", id));
    }
    for publisher in 1..=4u64 {
        keys.push(channel_key("p", "decode", "kv_metrics", publisher));
        keys.push(channel_key("p", "prefill", "kv-events", publisher));
        keys.push(source_key("p", "prefill", publisher));
    }
    keys.push(endpoint_key("q", "decode", "generate", 1));
    keys
}

/// A value for `key`: `choice` picks among plausible, conflicting and broken values.
fn value_for(key: &str, choice: u8) -> Vec<u8> {
    let id = (u64::from(choice) % 3) + 1;
    let comp = ["prefill", "decode", "backend"][usize::from(choice / 3) % 3];
    let value = if key.starts_with("v1/instances/") {
        match choice % 5 {
            0 => return b"{broken".to_vec(),
            1 => endpoint("p", comp, "load_metrics", id),
            _ => endpoint("p", comp, "generate", id),
        }
    } else if key.starts_with("v1/mdc/") {
        match choice % 6 {
            0 => return b"[]".to_vec(),
            1 => {
                let mut c = card("p", "", id, Some("aggregated"));
                c["endpoint"] = json!("");
                c
            }
            2 => card("p", comp, id, None),
            3 => card("p", comp, id, Some("decode")),
            4 => {
                let mut c = card("p", comp, id, Some("prefill"));
                c["model_suffix"] = json!("lora-a");
                c
            }
            _ => card(
                "p",
                comp,
                id,
                Some(["prefill", "decode", "aggregated", "encode"][usize::from(choice / 6) % 4]),
            ),
        }
    } else if key.starts_with("v1/event_sources/") {
        source(
            "p",
            "prefill",
            id,
            u64::from(choice % 4) + 1,
            u32::from(choice % 2),
        )
    } else {
        let topic = if key.contains("kv_metrics") {
            "kv_metrics"
        } else {
            "kv-events"
        };
        match choice % 5 {
            0 => {
                let mut c = channel("p", comp, topic, id, 1);
                c["transport"] = json!({"kind": "Nats", "config": {}});
                c
            }
            1 => channel("p", comp, "active_sequences_events", id, 2),
            _ => channel("p", comp, topic, id, 40_000 + u16::from(choice)),
        }
    };
    serde_json::to_vec(&value).expect("json")
}

#[derive(Clone, Debug)]
enum Op {
    Put(usize, u8),
    Delete(usize),
    Resync,
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    let n = key_pool().len();
    prop::collection::vec(
        prop_oneof![
            6 => (0..n, any::<u8>()).prop_map(|(k, v)| Op::Put(k, v)),
            3 => (0..n).prop_map(Op::Delete),
            1 => Just(Op::Resync),
        ],
        0..120,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn any_interleaving_converges_to_the_view_of_the_final_key_set(ops in ops(), reverse in any::<bool>()) {
        let keys = key_pool();
        let now = UnixMillis(7);
        let mut incremental = DiscoveryReducer::new(ns("p"));
        let mut state: BTreeMap<String, Vec<u8>> = BTreeMap::new();
        for op in ops {
            match op {
                Op::Put(k, v) => {
                    let value = value_for(&keys[k], v);
                    state.insert(keys[k].clone(), value.clone());
                    incremental.apply(SourceEvent::Apply { key: keys[k].clone(), value }, now);
                }
                Op::Delete(k) => {
                    state.remove(&keys[k]);
                    incremental.apply(SourceEvent::Delete { key: keys[k].clone() }, now);
                }
                Op::Resync => {
                    let kvs: Vec<_> = state.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
                    resync(&mut incremental, &kvs, now);
                }
            }
        }
        let mut kvs: Vec<_> = state.into_iter().collect();
        if reverse {
            kvs.reverse();
        }
        let mut fresh = DiscoveryReducer::new(ns("p"));
        resync(&mut fresh, &kvs, now);
        prop_assert_eq!(&**incremental.view(), &**fresh.view());
        // And resyncing the incremental reducer to the same set changes nothing.
        prop_assert!(!resync(&mut incremental, &kvs, UnixMillis(8)));
    }

    #[test]
    fn arbitrary_bytes_never_panic_and_never_make_workers(
        values in prop::collection::vec((0usize..40, prop::collection::vec(any::<u8>(), 0..64)), 0..40)
    ) {
        let keys = key_pool();
        let mut r = DiscoveryReducer::new(ns("p"));
        for (k, value) in values {
            r.apply(SourceEvent::Apply { key: keys[k % keys.len()].clone(), value }, UnixMillis(1));
        }
        prop_assert_eq!(r.view().workers().len(), 0);
    }
}
