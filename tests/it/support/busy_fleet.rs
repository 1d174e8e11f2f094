//! A discovered fleet of decode workers whose load the caller writes, for the admission tests
//! (`tests/it/admission.rs`) and the admission bench (`benches/proxy_overhead.rs`, which includes
//! this file by path): an in-process registry fed one etcd-shaped view (Endpoint + Model records
//! per worker, one rank each), a shared load store holding the workers as live, and load samples
//! written into it as the subscriptions write them.
#![allow(dead_code)] // The test and the bench use different parts.

use std::sync::atomic::{AtomicU64, Ordering};

use continuum_actors::clock::now_tick;
use continuum_actors::load::SharedLoadStore;
use continuum_actors::registry::{
    RegistryActor, RegistryArgs, RegistryConfig, RegistryMsg, RegistryParts, RegistryReader,
};
use continuum_protocol::discovery::SourceEvent;
use continuum_protocol::discovery::reducer::DiscoveryReducer;
use continuum_protocol::discovery::snapshot::SourceKind;
use continuum_protocol::event_plane::ActiveLoad;
use continuum_protocol::ids::{DpRank, InstanceId, Namespace, PublisherId};
use continuum_protocol::load_store::LoadSample;
use continuum_protocol::time::UnixMillis;
use ractor::{Actor, ActorRef};
use serde_json::{Value, json};

/// Every worker's KV capacity, in blocks: a sample's used blocks are its percentage.
pub const TOTAL_KV_BLOCKS: u64 = 100;

/// The etcd records of decode worker `id` of `model` in `ns`.
fn records(ns: &str, model: &str, id: u64) -> Vec<(String, Value)> {
    vec![
        (
            format!("v1/instances/{ns}/backend/generate/{id:x}"),
            json!({"type": "Endpoint", "namespace": ns, "component": "backend",
                   "endpoint": "generate", "instance_id": id, "transport": {"tcp": "127.0.0.1:1/x"}}),
        ),
        (
            format!("v1/mdc/{ns}/backend/generate/{id:x}"),
            json!({"type": "Model", "namespace": ns, "component": "backend", "endpoint": "generate",
                   "instance_id": id, "card_json": {"display_name": model, "worker_type": "decode",
                   "kv_cache_block_size": 16, "runtime_config": {"total_kv_blocks": TOTAL_KV_BLOCKS,
                   "max_num_batched_tokens": 8192, "data_parallel_size": 1}}}),
        ),
    ]
}

/// The `dynamo` + shim YAML of a fleet in `ns` served by the one shim replica at `shim` (health
/// checks off), samples fresh for `max_staleness`, `admission` as a YAML flow map.
pub fn config_yaml(
    ns: &str,
    model: &str,
    shim: &str,
    max_staleness: &str,
    admission: &str,
) -> String {
    format!(
        "disaggregated_serving:\n  enabled: true\n\
         backends:\n  - name: shim\n    type: openai\n    url: \"{shim}\"\n    \
         models: [{model}]\n    health_check:\n      enabled: false\n\
         dynamo:\n  enabled: true\n  load: {{max_staleness: {max_staleness}}}\n  discovery:\n    etcd:\n      \
         endpoints: [\"http://127.0.0.1:1\"]\n      namespace: {ns}\n  shim:\n    backends: [shim]\n\
         admission: {admission}\n"
    )
}

/// The fleet: its registry's reader and the load store.
pub struct BusyFleet {
    pub reader: RegistryReader,
    pub load: SharedLoadStore,
    workers: Vec<u64>,
    sequence: AtomicU64,
    _registry: ActorRef<RegistryMsg>,
}

impl BusyFleet {
    /// The decode workers `workers` (instance ids) of `model` in `ns`, discovered once the call
    /// returns.
    pub async fn start(ns: &str, model: &str, workers: &[u64]) -> Self {
        let namespace = Namespace::new(ns);
        let parts = RegistryParts::new(RegistryConfig {
            enabled: true,
            source: SourceKind::Etcd,
            namespaces: vec![namespace.clone()],
        });
        let reader = parts.reader.clone();
        let args = RegistryArgs {
            writer: parts.writer,
            metrics: None,
        };
        let (registry, _) = Actor::spawn(None, RegistryActor, args)
            .await
            .expect("registry");
        let mut reducer = DiscoveryReducer::new(namespace);
        reducer.apply(SourceEvent::Init, UnixMillis(0));
        for &id in workers {
            for (key, value) in records(ns, model, id) {
                let value = serde_json::to_vec(&value).expect("json");
                reducer.apply(SourceEvent::InitApply { key, value }, UnixMillis(0));
            }
        }
        reducer.apply(SourceEvent::InitDone, UnixMillis(0));
        parts.inbox.stage_view(reducer.view().clone());
        reader
            .subscribe()
            .wait_for(|g| *g >= 1)
            .await
            .expect("published");
        let load = SharedLoadStore::new(None);
        load.with(|store| store.set_live_and_retain(workers.iter().copied().map(InstanceId)));
        BusyFleet {
            reader,
            load,
            workers: workers.to_vec(),
            sequence: AtomicU64::new(1),
            _registry: registry,
        }
    }

    /// Publishes one fresh sample per worker: `used(i)` active decode blocks of
    /// [`TOTAL_KV_BLOCKS`] for the `i`-th worker; wakes the store's waiters.
    pub fn publish(&self, used: impl Fn(usize) -> u64) {
        let sequence = self.sequence.fetch_add(1, Ordering::SeqCst);
        self.load.with(|store| {
            for (i, &id) in self.workers.iter().enumerate() {
                store.apply(LoadSample {
                    load: ActiveLoad {
                        worker_id: InstanceId(id),
                        dp_rank: DpRank(0),
                        active_decode_blocks: Some(used(i)),
                        active_prefill_tokens: None,
                        kv_used_blocks: Some(used(i)),
                    },
                    publisher_id: PublisherId(id),
                    sequence,
                    published_at: UnixMillis(0),
                    received_at: now_tick(),
                });
            }
        });
        self.load.notify();
    }
}
