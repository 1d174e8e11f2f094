//! The simulated Dynamo fleet: workers that register like Dynamo 1.6.1 does and publish their
//! load over real ZMQ PUB sockets.
//!
//! Each worker registers its `v1/instances`, `v1/mdc` and `kv_metrics` `v1/event_channels`
//! records (built by `protocol::discovery::registration`) into the in-memory discovery feed the
//! router's `source: simulated` reads, binds a loopback PUB socket, and every publish interval
//! sends one ActiveLoad per data-parallel rank. The load comes from the requests the simulated
//! frontend has booked on the worker: prompt tokens while a prefill runs, KV blocks while a
//! sequence decodes.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use continuum_actors::clock::now_unix;
use continuum_actors::memory_source::MemoryDiscovery;
use continuum_protocol::discovery::registration::{Registration, WorkerType};
use continuum_protocol::event_plane::ActiveLoad;
use continuum_protocol::event_plane::encode::encode_kv_metrics;
use continuum_protocol::ids::{DpRank, InstanceId, PublisherId};
use tokio::task::JoinHandle;
use tracing::info;

use crate::zmq_pub::PubSocket;

/// What one simulated worker is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerSpec {
    pub namespace: String,
    pub worker_type: WorkerType,
    pub model: String,
    pub data_parallel_size: u32,
    pub block_size: u32,
    pub total_kv_blocks: u64,
    pub max_num_batched_tokens: u64,
}

impl WorkerSpec {
    pub fn new(namespace: &str, worker_type: WorkerType, model: &str) -> Self {
        Self {
            namespace: namespace.to_owned(),
            worker_type,
            model: model.to_owned(),
            data_parallel_size: 1,
            block_size: 16,
            total_kv_blocks: 1024,
            max_num_batched_tokens: 8192,
        }
    }

    pub fn with_data_parallel_size(mut self, size: u32) -> Self {
        self.data_parallel_size = size.max(1);
        self
    }
}

/// The default demo fleet: namespace `demo` with 2 prefill and 2 decode workers (one of them
/// with 2 data-parallel ranks) serving `demo-disagg`, and namespace `demo-agg` with 2 aggregated
/// workers serving `demo-agg`.
pub fn default_fleet() -> Vec<WorkerSpec> {
    vec![
        WorkerSpec::new("demo", WorkerType::Prefill, "demo-disagg"),
        WorkerSpec::new("demo", WorkerType::Prefill, "demo-disagg"),
        WorkerSpec::new("demo", WorkerType::Decode, "demo-disagg"),
        WorkerSpec::new("demo", WorkerType::Decode, "demo-disagg").with_data_parallel_size(2),
        WorkerSpec::new("demo-agg", WorkerType::Aggregated, "demo-agg"),
        WorkerSpec::new("demo-agg", WorkerType::Aggregated, "demo-agg"),
    ]
}

/// In-flight work on one data-parallel rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankLoad {
    pub prefill_tokens: u64,
    pub decode_blocks: u64,
}

/// One simulated worker.
pub struct SimWorker {
    pub spec: WorkerSpec,
    pub instance_id: InstanceId,
    pub publisher_id: PublisherId,
    ranks: Mutex<Vec<RankLoad>>,
    socket: PubSocket,
}

impl std::fmt::Debug for SimWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimWorker")
            .field("instance_id", &self.instance_id)
            .field("spec", &self.spec)
            .finish_non_exhaustive()
    }
}

impl SimWorker {
    fn ranks(&self) -> MutexGuard<'_, Vec<RankLoad>> {
        self.ranks.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn worker_type(&self) -> WorkerType {
        self.spec.worker_type
    }

    /// Whether `rank` is one of this worker's data-parallel ranks.
    pub fn owns_rank(&self, rank: DpRank) -> bool {
        rank.0 < self.spec.data_parallel_size
    }

    /// The load a rank carries now.
    pub fn load(&self, rank: DpRank) -> RankLoad {
        self.ranks()
            .get(rank.0 as usize)
            .copied()
            .unwrap_or_default()
    }

    /// The ActiveLoad sample of a rank, as Dynamo publishes it.
    pub fn active_load(&self, rank: DpRank) -> ActiveLoad {
        let load = self.load(rank);
        ActiveLoad {
            worker_id: self.instance_id,
            dp_rank: rank,
            active_decode_blocks: Some(load.decode_blocks),
            active_prefill_tokens: Some(load.prefill_tokens),
            kv_used_blocks: Some(load.decode_blocks),
        }
    }

    /// The ZMQ PUB socket's address.
    pub fn pub_addr(&self) -> SocketAddr {
        self.socket.local_addr()
    }

    /// Subscribers holding a subscription on this worker's PUB socket, as it changes.
    pub fn subscribed(&self) -> tokio::sync::watch::Receiver<usize> {
        self.socket.subscribed()
    }

    /// Books work on a rank until the returned guard is dropped.
    pub fn book(self: &Arc<Self>, rank: DpRank, load: RankLoad) -> Booking {
        if let Some(slot) = self.ranks().get_mut(rank.0 as usize) {
            slot.prefill_tokens += load.prefill_tokens;
            slot.decode_blocks += load.decode_blocks;
        }
        Booking {
            worker: self.clone(),
            rank,
            load,
        }
    }

    fn publish(&self, sequence: &mut u64) {
        for rank in 0..self.spec.data_parallel_size {
            let load = self.active_load(DpRank(rank));
            let frames = encode_kv_metrics(self.publisher_id, *sequence, now_unix(), &load);
            *sequence += 1;
            self.socket.send(&frames);
        }
    }
}

/// Work booked on a rank; released on drop (the request finished, failed or was cancelled).
pub struct Booking {
    worker: Arc<SimWorker>,
    rank: DpRank,
    load: RankLoad,
}

impl Drop for Booking {
    fn drop(&mut self) {
        if let Some(slot) = self.worker.ranks().get_mut(self.rank.0 as usize) {
            slot.prefill_tokens = slot.prefill_tokens.saturating_sub(self.load.prefill_tokens);
            slot.decode_blocks = slot.decode_blocks.saturating_sub(self.load.decode_blocks);
        }
    }
}

/// The running fleet. Dropping it stops publishing and closes the PUB sockets.
pub struct Fleet {
    workers: Vec<Arc<SimWorker>>,
    feed: MemoryDiscovery,
    publishers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("workers", &self.workers.len())
            .finish_non_exhaustive()
    }
}

/// Deterministic ids shaped like Dynamo's (lease ids are large; publisher ids about 2^52).
fn ids(index: usize) -> (InstanceId, PublisherId) {
    let i = index as u64;
    (
        InstanceId(0x6a6c_a22b_96b5_3100 + 0x10 * i),
        PublisherId(0x000c_15e2_ee04_0a00 + i),
    )
}

impl Fleet {
    /// Binds every worker's PUB socket, registers its records into a new feed and starts
    /// publishing every `interval`. `request_plane` is the `host:port` the Endpoint records name
    /// (the simulated frontend of the worker's namespace).
    pub async fn start(
        specs: Vec<WorkerSpec>,
        request_plane: impl Fn(&str) -> String,
        interval: Duration,
    ) -> std::io::Result<Fleet> {
        let feed = MemoryDiscovery::new();
        let mut workers = Vec::with_capacity(specs.len());
        for (index, spec) in specs.into_iter().enumerate() {
            let (instance_id, publisher_id) = ids(index);
            let socket = PubSocket::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
            let registration = Registration {
                namespace: spec.namespace.clone(),
                worker_type: spec.worker_type,
                instance_id,
                model: spec.model.clone(),
                block_size: spec.block_size,
                total_kv_blocks: spec.total_kv_blocks,
                max_num_batched_tokens: spec.max_num_batched_tokens,
                data_parallel_size: spec.data_parallel_size,
                request_plane: request_plane(&spec.namespace),
                kv_metrics: (publisher_id, format!("tcp://{}", socket.local_addr())),
            };
            for (key, value) in registration.records() {
                feed.register(key, value)
                    .map_err(|e| std::io::Error::other(e.to_string()))?;
            }
            info!(
                namespace = %spec.namespace,
                role = spec.worker_type.as_str(),
                worker_id = instance_id.0,
                dp_size = spec.data_parallel_size,
                kv_metrics = %socket.local_addr(),
                "Simulated worker registered."
            );
            workers.push(Arc::new(SimWorker {
                ranks: Mutex::new(vec![RankLoad::default(); spec.data_parallel_size as usize]),
                spec,
                instance_id,
                publisher_id,
                socket,
            }));
        }
        let publishers = workers
            .iter()
            .map(|worker| {
                let worker = worker.clone();
                tokio::spawn(async move {
                    let mut ticker = tokio::time::interval(interval);
                    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    let mut sequence = 0;
                    loop {
                        ticker.tick().await;
                        worker.publish(&mut sequence);
                    }
                })
            })
            .collect();
        Ok(Fleet {
            workers,
            feed,
            publishers,
        })
    }

    /// The discovery feed the router reads.
    pub fn feed(&self) -> MemoryDiscovery {
        self.feed.clone()
    }

    pub fn workers(&self) -> &[Arc<SimWorker>] {
        &self.workers
    }

    pub fn worker(&self, id: InstanceId) -> Option<&Arc<SimWorker>> {
        self.workers.iter().find(|w| w.instance_id == id)
    }

    /// Workers of a namespace.
    pub fn in_namespace<'a>(
        &'a self,
        namespace: &'a str,
    ) -> impl Iterator<Item = &'a Arc<SimWorker>> {
        self.workers
            .iter()
            .filter(move |w| w.spec.namespace == namespace)
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for task in &self.publishers {
            task.abort();
        }
    }
}
