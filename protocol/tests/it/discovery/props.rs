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
        // Both agree with a naive reading of the rules over the final key set.
        prop_assert_eq!(summarise(&incremental), reference(&kvs));
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

type Summary = (
    BTreeMap<u64, (String, Option<String>, bool)>,
    BTreeMap<u64, (String, Option<u64>)>,
);

fn summarise(r: &DiscoveryReducer) -> Summary {
    let workers = r
        .view()
        .workers()
        .map(|w| {
            (
                w.key.instance_id.0,
                (
                    w.role.as_str().to_owned(),
                    w.model.clone(),
                    w.card.is_some(),
                ),
            )
        })
        .collect();
    let publishers = r
        .view()
        .publishers()
        .map(|p| {
            (
                p.publisher_id.0,
                (
                    p.topic.as_str().to_owned(),
                    p.worker.as_ref().map(|k| k.instance_id.0),
                ),
            )
        })
        .collect();
    (workers, publishers)
}

/// The rules of the seed read naively over the final key set of namespace `p` (only the shapes
/// the pool generates).
fn reference(kvs: &[(String, Vec<u8>)]) -> Summary {
    use serde_json::Value;
    let mut endpoints: BTreeMap<u64, Vec<String>> = BTreeMap::new();
    let mut scoped: BTreeMap<(u64, String, String), Vec<Value>> = BTreeMap::new();
    let mut legacy: BTreeMap<u64, Vec<Value>> = BTreeMap::new();
    let mut channels: BTreeMap<u64, Vec<String>> = BTreeMap::new();
    let mut sources: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    for (key, value) in kvs {
        let Ok(v) = serde_json::from_slice::<Value>(value) else {
            continue;
        };
        if !v.is_object() {
            continue;
        }
        if key.starts_with("v1/instances/p/") {
            if v["endpoint"] == "generate" {
                endpoints
                    .entry(v["instance_id"].as_u64().expect("id"))
                    .or_default()
                    .push(v["component"].as_str().expect("component").to_owned());
            }
        } else if key.starts_with("v1/mdc/p/") {
            if key.split('/').count() == 7 || v.get("model_suffix").is_some() {
                continue;
            }
            let id = v["instance_id"].as_u64().expect("id");
            let comp = v["component"].as_str().unwrap_or_default().to_owned();
            let ep = v["endpoint"].as_str().unwrap_or_default().to_owned();
            if comp.is_empty() && ep.is_empty() {
                legacy.entry(id).or_default().push(v["card_json"].clone());
            } else {
                scoped
                    .entry((id, comp, ep))
                    .or_default()
                    .push(v["card_json"].clone());
            }
        } else if key.starts_with("v1/event_channels/namespace/p/") {
            let topic = v["topic"].as_str().expect("topic");
            if (topic == "kv_metrics" || topic == "kv-events") && v["transport"]["kind"] == "Zmq" {
                channels
                    .entry(v["instance_id"].as_u64().expect("id"))
                    .or_default()
                    .push(topic.to_owned());
            }
        } else if key.starts_with("v1/event_sources/namespace/p/") {
            sources
                .entry(v["publisher_id"].as_u64().expect("id"))
                .or_default()
                .push(
                    v["metadata"]["worker"]["worker_id"]
                        .as_u64()
                        .expect("worker"),
                );
        }
    }
    let mut workers = BTreeMap::new();
    for (id, comps) in &endpoints {
        let [comp] = comps.as_slice() else { continue };
        let card = match scoped.get(&(*id, comp.clone(), "generate".to_owned())) {
            Some(cards) => (cards.len() == 1).then(|| cards[0].clone()),
            None => legacy
                .get(id)
                .and_then(|cards| (cards.len() == 1).then(|| cards[0].clone())),
        };
        let by_comp = match comp.as_str() {
            "prefill" | "decode" => Some(comp.clone()),
            _ => None,
        };
        let by_card = card.as_ref().and_then(|c| match &c["worker_type"] {
            Value::Null => Some(
                if c["model_type"].as_str().unwrap_or("").contains("Prefill") {
                    "prefill".to_owned()
                } else {
                    "aggregated".to_owned()
                },
            ),
            Value::String(t) if ["prefill", "decode", "aggregated"].contains(&t.as_str()) => {
                Some(t.clone())
            }
            _ => None,
        });
        let role = match (by_comp, by_card) {
            (Some(a), Some(b)) if a != b => continue,
            (Some(a), _) => a,
            (None, Some(b)) => b,
            (None, None) => "unknown".to_owned(),
        };
        let model = card
            .as_ref()
            .and_then(|c| c["display_name"].as_str().map(str::to_owned));
        workers.insert(*id, (role, model, card.is_some()));
    }
    let mut publishers = BTreeMap::new();
    for (id, topics) in &channels {
        let [topic] = topics.as_slice() else { continue };
        let worker = sources.get(id).and_then(|w| (w.len() == 1).then(|| w[0]));
        publishers.insert(*id, (topic.clone(), worker));
    }
    (workers, publishers)
}
