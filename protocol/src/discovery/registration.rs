//! The etcd records a Dynamo 1.6.1 worker registers, built for workers this project simulates
//! (`continuum-router demo`). Shapes follow the captures in `fixtures/dynamo-1.6.1/etcd`
//! (dynamo-live §4): an `Endpoint` under `v1/instances/`, a `Model` card under `v1/mdc/` and one
//! `EventChannel` per published topic under `v1/event_channels/` (segments percent-encoded).
//!
//! Only fields the capture carries are written; the card's file references (tokenizer, config,
//! chat template) are left out because a simulated worker has no files to point at.

use serde_json::{Value, json};

use super::keys::encode_segment;
use crate::ids::{InstanceId, PublisherId};

/// The serving role a simulated worker registers with (its card's `worker_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WorkerType {
    Prefill,
    Decode,
    Aggregated,
}

impl WorkerType {
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerType::Prefill => "prefill",
            WorkerType::Decode => "decode",
            WorkerType::Aggregated => "aggregated",
        }
    }

    /// The component Dynamo's launch scripts use: `prefill`, else `backend`.
    pub fn component(self) -> &'static str {
        match self {
            WorkerType::Prefill => "prefill",
            WorkerType::Decode | WorkerType::Aggregated => "backend",
        }
    }
}

/// What one worker registers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    pub namespace: String,
    pub worker_type: WorkerType,
    pub instance_id: InstanceId,
    /// The card's `display_name` and `slug`.
    pub model: String,
    pub block_size: u32,
    pub total_kv_blocks: u64,
    pub max_num_batched_tokens: u64,
    pub data_parallel_size: u32,
    /// `host:port` of the request plane the Endpoint record names.
    pub request_plane: String,
    /// The `kv_metrics` publisher and the `tcp://host:port` it binds.
    pub kv_metrics: (PublisherId, String),
}

impl Registration {
    fn component(&self) -> &'static str {
        self.worker_type.component()
    }

    /// `v1/instances/<ns>/<component>/generate/<id hex>` and its Endpoint value.
    pub fn endpoint_record(&self) -> (String, Vec<u8>) {
        let (ns, comp, id) = (&self.namespace, self.component(), self.instance_id);
        let key = format!("v1/instances/{ns}/{comp}/generate/{}", id.hex());
        let value = json!({
            "type": "Endpoint",
            "component": comp,
            "endpoint": "generate",
            "namespace": ns,
            "instance_id": id.0,
            "transport": {"tcp": format!("{}/{}/{ns}/{comp}/generate", self.request_plane, id.hex())},
            "device_type": "cuda",
            "request_plane_codec": "msgpack",
        });
        (key, to_bytes(&value))
    }

    /// `v1/mdc/<ns>/<component>/generate/<id hex>` and its Model card.
    pub fn model_record(&self) -> (String, Vec<u8>) {
        let (ns, comp, id) = (&self.namespace, self.component(), self.instance_id);
        let key = format!("v1/mdc/{ns}/{comp}/generate/{}", id.hex());
        let (model_type, needs) = match self.worker_type {
            WorkerType::Prefill => ("", json!([["decode"]])),
            WorkerType::Decode => ("Chat | Completions", json!([["prefill"]])),
            WorkerType::Aggregated => ("Chat | Completions", json!([])),
        };
        let value = json!({
            "type": "Model",
            "namespace": ns,
            "component": comp,
            "endpoint": "generate",
            "instance_id": id.0,
            "card_json": {
                "display_name": self.model,
                "slug": self.model,
                "source_path": format!("/demo/models/{}", self.model),
                "architectural_max_context_length": 4096,
                "context_length": 0,
                "kv_cache_block_size": self.block_size,
                "migration_limit": 0,
                "model_type": model_type,
                "model_input": "Tokens",
                "worker_type": self.worker_type.as_str(),
                "needs": needs,
                "runtime_config": {
                    "context_length": 0,
                    "total_kv_blocks": self.total_kv_blocks,
                    "max_num_seqs": 256,
                    "max_num_batched_tokens": self.max_num_batched_tokens,
                    "tool_call_parser": null,
                    "reasoning_parser": null,
                    "data_parallel_start_rank": 0,
                    "data_parallel_size": self.data_parallel_size,
                    "enable_local_indexer": false,
                    "kv_event_publishing_enabled": false,
                    "runtime_data": {"output_replay_consumer": true},
                    "enable_eagle": false,
                },
                "media_decoder": null,
                "media_fetcher": null,
            },
        });
        (key, to_bytes(&value))
    }

    /// The `kv_metrics` EventChannel key and value.
    pub fn kv_metrics_channel_record(&self) -> (String, Vec<u8>) {
        let (ns, comp) = (&self.namespace, self.component());
        let (publisher, endpoint) = &self.kv_metrics;
        let key = format!(
            "v1/event_channels/namespace/{}/component/{}/endpoint/generate/topic/kv_metrics/{:x}",
            encode_segment(ns),
            encode_segment(comp),
            publisher.0
        );
        let value = json!({
            "type": "EventChannel",
            "scope": {"kind": "endpoint", "endpoint": {"namespace": ns, "component": comp, "name": "generate"}},
            "topic": "kv_metrics",
            "instance_id": publisher.0,
            "transport": {"kind": "Zmq", "config": {"endpoint": endpoint}},
        });
        (key, to_bytes(&value))
    }

    /// Every record, in the order a 1.6.1 worker writes them (channel, instance, card).
    pub fn records(&self) -> Vec<(String, Vec<u8>)> {
        vec![
            self.kv_metrics_channel_record(),
            self.endpoint_record(),
            self.model_record(),
        ]
    }
}

fn to_bytes(value: &Value) -> Vec<u8> {
    // Serialising a Value built from strings and numbers cannot fail.
    serde_json::to_vec(value).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::records::{EventTopic, Role};
    use crate::discovery::{DiscoveryReducer, SourceEvent};
    use crate::ids::{DpRank, Namespace};
    use crate::time::UnixMillis;

    fn registration(worker_type: WorkerType, id: u64, dp: u32) -> Registration {
        Registration {
            namespace: "demo.ns".into(),
            worker_type,
            instance_id: InstanceId(id),
            model: "demo-disagg".into(),
            block_size: 16,
            total_kv_blocks: 1024,
            max_num_batched_tokens: 8192,
            data_parallel_size: dp,
            request_plane: "127.0.0.1:9000".into(),
            kv_metrics: (PublisherId(id + 1), "tcp://127.0.0.1:4000".into()),
        }
    }

    #[test]
    fn the_reducer_reads_the_records_as_a_prefill_decode_fleet() {
        let mut reducer = DiscoveryReducer::new(Namespace::new("demo.ns"));
        let mut events = vec![SourceEvent::Init];
        for r in [
            registration(WorkerType::Prefill, 0x6a6c_a22b_0000_0010, 1),
            registration(WorkerType::Decode, 0x6a6c_a22b_0000_0020, 2),
        ] {
            events.extend(
                r.records()
                    .into_iter()
                    .map(|(key, value)| SourceEvent::InitApply { key, value }),
            );
        }
        events.push(SourceEvent::InitDone);
        for event in events {
            reducer.apply(event, UnixMillis(1));
        }
        assert!(
            reducer
                .take_counts()
                .iter()
                .all(|(kind, _)| { matches!(kind, crate::discovery::DiscoveryEventKind::Resync) })
        );
        let view = reducer.view();
        assert_eq!(view.workers().len(), 2);
        let decode = view
            .workers()
            .find(|w| w.role == Role::Decode)
            .expect("a decode worker");
        assert_eq!(decode.model.as_deref(), Some("demo-disagg"));
        assert_eq!(decode.dp_size, Some(2));
        assert_eq!(decode.block_size, Some(16));
        assert!(decode.owns_rank(DpRank(1)));
        assert!(view.workers().any(|w| w.role == Role::Prefill));
        let publishers: Vec<_> = view
            .publishers()
            .filter(|p| p.topic == EventTopic::KvMetrics)
            .collect();
        assert_eq!(publishers.len(), 2);
        assert_eq!(publishers[0].address().authority(), "127.0.0.1:4000");
    }
}
