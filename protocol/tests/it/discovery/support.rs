//! Shared helpers: locating the in-repo fixtures, decoding etcd dumps, building records.

use std::path::PathBuf;

use continuum_protocol::discovery::{DiscoveryReducer, SourceEvent};
use continuum_protocol::ids::Namespace;
use continuum_protocol::time::UnixMillis;

/// The repository's fixture directory, `<repo root>/tests/fixtures` (see its READMEs for where
/// each capture came from and how to regenerate it).
pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

/// A JSON fixture by its path under [`fixtures_dir`].
pub fn read_json(relative: &str) -> serde_json::Value {
    let path = fixtures_dir().join(relative);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path:?}: {e}"))
}

/// Standard base64 (etcd's JSON gateway encoding of keys and values).
pub fn base64_decode(text: &str) -> Vec<u8> {
    fn val(c: u8) -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        }
    }
    let bytes: Vec<u8> = text.bytes().filter(|b| *b != b'=').collect();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let mut acc = 0u32;
        for (i, c) in chunk.iter().enumerate() {
            acc |= val(*c) << (18 - 6 * i);
        }
        let n = chunk.len() * 6 / 8;
        for i in 0..n {
            out.push((acc >> (16 - 8 * i)) as u8);
        }
    }
    out
}

/// The (key, value) pairs of an etcd range-get dump (`*.raw.json`), in dump order.
pub fn dump_kvs(name: &str) -> Vec<(String, Vec<u8>)> {
    let raw = read_json(&format!("dynamo-1.6.1/etcd/{name}.raw.json"));
    raw["kvs"]
        .as_array()
        .expect("kvs")
        .iter()
        .map(|kv| {
            let key = String::from_utf8(base64_decode(kv["key"].as_str().expect("key")))
                .expect("utf8 key");
            (key, base64_decode(kv["value"].as_str().expect("value")))
        })
        .collect()
}

/// Replays `kvs` as one resync.
pub fn resync(reducer: &mut DiscoveryReducer, kvs: &[(String, Vec<u8>)], now: UnixMillis) -> bool {
    reducer.apply(SourceEvent::Init, now);
    for (key, value) in kvs {
        reducer.apply(
            SourceEvent::InitApply {
                key: key.clone(),
                value: value.clone(),
            },
            now,
        );
    }
    reducer.apply(SourceEvent::InitDone, now)
}

pub fn ns(name: &str) -> Namespace {
    Namespace::new(name)
}

pub fn put(key: &str, value: &serde_json::Value) -> SourceEvent {
    SourceEvent::Apply {
        key: key.to_owned(),
        value: serde_json::to_vec(value).expect("json"),
    }
}

pub fn put_raw(key: &str, value: &[u8]) -> SourceEvent {
    SourceEvent::Apply {
        key: key.to_owned(),
        value: value.to_vec(),
    }
}

pub fn del(key: &str) -> SourceEvent {
    SourceEvent::Delete {
        key: key.to_owned(),
    }
}

pub fn endpoint_key(ns: &str, component: &str, endpoint: &str, id: u64) -> String {
    format!("v1/instances/{ns}/{component}/{endpoint}/{id:x}")
}

pub fn card_key(ns: &str, component: &str, endpoint: &str, id: u64) -> String {
    format!("v1/mdc/{ns}/{component}/{endpoint}/{id:x}")
}

pub fn channel_key(ns: &str, component: &str, topic: &str, publisher: u64) -> String {
    format!(
        "v1/event_channels/namespace/{ns}/component/{component}/endpoint/generate/topic/{topic}/{publisher:x}"
    )
}

pub fn source_key(ns: &str, component: &str, publisher: u64) -> String {
    format!(
        "v1/event_sources/namespace/{ns}/component/{component}/endpoint/generate/topic/kv-events/{publisher:x}"
    )
}

pub fn endpoint(ns: &str, component: &str, endpoint: &str, id: u64) -> serde_json::Value {
    serde_json::json!({
        "type": "Endpoint", "namespace": ns, "component": component, "endpoint": endpoint,
        "instance_id": id,
        "transport": {"tcp": format!("10.0.0.4:31000/{id:x}/{ns}/{component}/{endpoint}")},
        "device_type": "cuda", "request_plane_codec": "msgpack"
    })
}

pub fn card(ns: &str, component: &str, id: u64, worker_type: Option<&str>) -> serde_json::Value {
    serde_json::json!({
        "type": "Model", "namespace": ns, "component": component, "endpoint": "generate",
        "instance_id": id,
        "card_json": {
            "display_name": "Qwen/Qwen3-32B", "slug": "qwen_qwen3-32b",
            "worker_type": worker_type, "kv_cache_block_size": 64, "model_type": "Chat | Completions",
            "runtime_config": {
                "total_kv_blocks": 12000, "max_num_batched_tokens": 8192, "max_num_seqs": 256,
                "context_length": 32768, "data_parallel_start_rank": 0, "data_parallel_size": 1
            }
        }
    })
}

pub fn channel(
    ns: &str,
    component: &str,
    topic: &str,
    publisher: u64,
    port: u16,
) -> serde_json::Value {
    serde_json::json!({
        "type": "EventChannel",
        "scope": {"kind": "endpoint", "endpoint": {"namespace": ns, "component": component, "name": "generate"}},
        "topic": topic, "instance_id": publisher,
        "transport": {"kind": "Zmq", "config": {"endpoint": format!("tcp://10.0.0.7:{port}")}}
    })
}

pub fn source(
    ns: &str,
    component: &str,
    publisher: u64,
    worker: u64,
    dp_rank: u32,
) -> serde_json::Value {
    serde_json::json!({
        "type": "EventSource",
        "scope": {"kind": "endpoint", "endpoint": {"namespace": ns, "component": component, "name": "generate"}},
        "topic": "kv-events", "publisher_id": publisher,
        "metadata": {
            "kv_state_endpoint": {"namespace": ns, "component": component, "name": "generate"},
            "worker": {"worker_id": worker, "dp_rank": dp_rank}, "publisher_id": publisher
        }
    })
}
