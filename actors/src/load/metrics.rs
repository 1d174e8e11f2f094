//! The load-signal families: kv_metrics frames (`continuum_dynamo_load_events_total{result}`),
//! the subscriptions' states (`continuum_dynamo_{load,kv}_subscriptions{state, transport}`), each
//! worker rank's last sample (`continuum_dynamo_worker_{active_decode_blocks,
//! active_prefill_tokens,kv_used_blocks}{namespace, worker, dp_rank}`) and unreachable workers.
//!
//! The fleet-bounded labels (`namespace`, `worker`, `dp_rank`) take the protocol's typed ids; a
//! worker's series are removed when it departs ([`LoadMetrics::remove_worker`],
//! [`LoadMetrics::retain_workers`]).

use std::collections::{BTreeSet, HashMap};

pub use continuum_protocol::event_plane::LoadEventResult;
use continuum_protocol::ids::{DpRank, WorkerKey};
use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Registry};

use crate::label_enum;
use crate::lock::Mutex;
use crate::metrics::{Family, counter_vec, gauge_value, gauge_vec};

label_enum! {
    /// The `state` of `continuum_dynamo_{load,kv}_subscriptions{state, transport}`.
    SubscriptionState {
        Pending => "pending",
        Connecting => "connecting",
        Connected => "connected",
        Backoff => "backoff",
    }
}

label_enum! {
    /// The `transport` of `continuum_dynamo_{load,kv}_subscriptions{state, transport}`.
    SubscriptionTransport {
        Direct => "direct",
        Broker => "broker",
    }
}

/// One load sample's gauge values. `None` (a nil field upstream) exports no series.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerLoadGauges {
    pub active_decode_blocks: Option<u64>,
    pub active_prefill_tokens: Option<u64>,
    pub kv_used_blocks: Option<u64>,
}

/// The load-signal families. Closed-set series start at 0; per-worker ones appear with the fleet.
pub struct LoadMetrics {
    load_events: IntCounterVec,
    load_subscriptions: IntGaugeVec,
    kv_subscriptions: IntGaugeVec,
    worker_active_decode_blocks: IntGaugeVec,
    worker_active_prefill_tokens: IntGaugeVec,
    worker_kv_used_blocks: IntGaugeVec,
    unreachable_workers: IntGauge,
    workers_marked_unreachable: IntCounter,
    /// Which dp_ranks of a worker have gauge series, so a departed worker's series can all be
    /// removed (the Prometheus client has no "remove by partial labels").
    worker_ranks: Mutex<HashMap<WorkerKey, BTreeSet<DpRank>>>,
}

const WORKER_LABELS: &[&str] = &["namespace", "worker", "dp_rank"];

impl Family for LoadMetrics {
    fn register(r: &Registry) -> Result<Self, prometheus::Error> {
        let unreachable_workers = IntGauge::new(
            "continuum_dynamo_unreachable_workers",
            "Registered workers whose kv_metrics publisher was lost and refuses reconnects.",
        )?;
        r.register(Box::new(unreachable_workers.clone()))?;
        let workers_marked_unreachable = IntCounter::new(
            "continuum_dynamo_workers_marked_unreachable_total",
            "Times a registered worker was marked unreachable after its load publisher was lost.",
        )?;
        r.register(Box::new(workers_marked_unreachable.clone()))?;
        let metrics = Self {
            load_events: counter_vec(
                r,
                "continuum_dynamo_load_events_total",
                "kv_metrics frames applied or dropped, by result.",
                &["result"],
            )?,
            load_subscriptions: gauge_vec(
                r,
                "continuum_dynamo_load_subscriptions",
                "kv_metrics subscriptions by state and transport.",
                &["state", "transport"],
            )?,
            kv_subscriptions: gauge_vec(
                r,
                "continuum_dynamo_kv_subscriptions",
                "kv-events subscriptions by state and transport.",
                &["state", "transport"],
            )?,
            worker_active_decode_blocks: gauge_vec(
                r,
                "continuum_dynamo_worker_active_decode_blocks",
                "Last sampled active decode blocks of a worker rank.",
                WORKER_LABELS,
            )?,
            worker_active_prefill_tokens: gauge_vec(
                r,
                "continuum_dynamo_worker_active_prefill_tokens",
                "Last sampled active prefill tokens of a worker rank.",
                WORKER_LABELS,
            )?,
            worker_kv_used_blocks: gauge_vec(
                r,
                "continuum_dynamo_worker_kv_used_blocks",
                "Last sampled KV cache blocks in use on a worker rank.",
                WORKER_LABELS,
            )?,
            unreachable_workers,
            workers_marked_unreachable,
            worker_ranks: Mutex::new(HashMap::new()),
        };
        for result in LoadEventResult::ALL {
            metrics.load_events.with_label_values(&[result.as_label()]);
        }
        for state in SubscriptionState::ALL {
            for transport in SubscriptionTransport::ALL {
                let labels = [state.as_label(), transport.as_label()];
                metrics.load_subscriptions.with_label_values(&labels);
                metrics.kv_subscriptions.with_label_values(&labels);
            }
        }
        Ok(metrics)
    }
}

impl LoadMetrics {
    pub fn load_event(&self, result: LoadEventResult) {
        self.load_events(result, 1);
    }

    pub fn load_events(&self, result: LoadEventResult, count: u64) {
        self.load_events
            .with_label_values(&[result.as_label()])
            .inc_by(count);
    }

    pub fn set_load_subscriptions(
        &self,
        state: SubscriptionState,
        transport: SubscriptionTransport,
        count: u64,
    ) {
        self.load_subscriptions
            .with_label_values(&[state.as_label(), transport.as_label()])
            .set(gauge_value(count));
    }

    pub fn set_kv_subscriptions(
        &self,
        state: SubscriptionState,
        transport: SubscriptionTransport,
        count: u64,
    ) {
        self.kv_subscriptions
            .with_label_values(&[state.as_label(), transport.as_label()])
            .set(gauge_value(count));
    }

    /// Workers currently marked unreachable in the load store.
    pub fn set_unreachable_workers(&self, count: u64) {
        self.unreachable_workers.set(gauge_value(count));
    }

    /// `count` workers were just marked unreachable.
    pub fn workers_marked_unreachable(&self, count: u64) {
        self.workers_marked_unreachable.inc_by(count);
    }

    /// Exports one (worker, dp_rank) sample. A `None` field removes that gauge's series.
    pub fn set_worker_load(&self, worker: &WorkerKey, dp_rank: DpRank, load: WorkerLoadGauges) {
        let namespace = worker.namespace.as_str();
        let hex = worker.instance_id.hex();
        let rank = dp_rank.to_string();
        let labels = [namespace, hex.as_str(), rank.as_str()];
        for (vec, value) in [
            (&self.worker_active_decode_blocks, load.active_decode_blocks),
            (
                &self.worker_active_prefill_tokens,
                load.active_prefill_tokens,
            ),
            (&self.worker_kv_used_blocks, load.kv_used_blocks),
        ] {
            match value {
                Some(value) => vec.with_label_values(&labels).set(gauge_value(value)),
                None => {
                    let _ = vec.remove_label_values(&labels);
                }
            }
        }
        self.worker_ranks
            .lock()
            .entry(worker.clone())
            .or_default()
            .insert(dp_rank);
    }

    /// Removes every gauge series of a departed worker, all ranks.
    pub fn remove_worker(&self, worker: &WorkerKey) {
        let ranks = self.worker_ranks.lock().remove(worker);
        if let Some(ranks) = ranks {
            self.remove_worker_series(worker, &ranks);
        }
    }

    /// Keeps the gauge series of workers for which `live` holds and removes the rest (the
    /// metrics half of the load store's `set_live_and_retain`).
    pub fn retain_workers(&self, mut live: impl FnMut(&WorkerKey) -> bool) {
        let departed: Vec<(WorkerKey, BTreeSet<DpRank>)> = {
            let mut ranks = self.worker_ranks.lock();
            let gone: Vec<WorkerKey> = ranks.keys().filter(|k| !live(k)).cloned().collect();
            gone.into_iter()
                .filter_map(|key| ranks.remove_entry(&key))
                .collect()
        };
        for (worker, ranks) in departed {
            self.remove_worker_series(&worker, &ranks);
        }
    }

    fn remove_worker_series(&self, worker: &WorkerKey, ranks: &BTreeSet<DpRank>) {
        let namespace = worker.namespace.as_str();
        let hex = worker.instance_id.hex();
        for rank in ranks {
            let rank = rank.to_string();
            let labels = [namespace, hex.as_str(), rank.as_str()];
            for vec in [
                &self.worker_active_decode_blocks,
                &self.worker_active_prefill_tokens,
                &self.worker_kv_used_blocks,
            ] {
                // A nil field never had a series; nothing to remove then.
                let _ = vec.remove_label_values(&labels);
            }
        }
    }
}

#[cfg(test)]
mod tests;
