//! `continuum_replica_sync_*`: the replica sync's families (docs/observability.md). Closed label
//! sets only: a peer's replica id never becomes a label.

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

use crate::label_enum;

label_enum! {
    /// The `reason` of `continuum_replica_sync_dropped_total`.
    SyncDrop {
        /// A received snapshot over the size bound.
        Oversize => "oversize",
        /// A received snapshot that is not valid MessagePack of the snapshot's shape, or out of
        /// bounds.
        Malformed => "malformed",
        /// A received snapshot of an unknown format version.
        Version => "version",
        /// A received snapshot older than (or the same as) one already seen from its peer.
        Stale => "stale",
        /// A snapshot of one more peer than `max_peers`.
        MaxPeers => "max_peers",
        /// Entries of a peer's snapshot past `max_entries_per_peer` (counted per entry).
        MaxEntries => "max_entries",
        /// Local ranks past `max_entries_per_peer` left out of our own snapshot (per entry).
        LocalTruncated => "local_truncated",
        /// A snapshot we could not hand to the NATS client (disconnected and its buffer full,
        /// or it timed out).
        PublishFailed => "publish_failed",
        /// Messages the NATS client dropped because we read too slowly (slow consumer events).
        SlowConsumer => "slow_consumer",
    }
}

/// Handles on the replica-sync families (cheap to clone). Registered in every build (at 0 without
/// the `replica-sync` feature, whose actor is the only writer).
#[derive(Clone, Debug)]
#[cfg_attr(not(feature = "replica-sync"), allow(dead_code))]
pub struct ReplicaSyncMetrics {
    pub(crate) peers: IntGauge,
    pub(crate) connected: IntGauge,
    pub(crate) applied: IntCounter,
    pub(crate) expired: IntCounter,
    pub(crate) lag: Histogram,
    pub(crate) bytes_sent: IntCounter,
    pub(crate) snapshots_sent: IntCounter,
    pub(crate) snapshots_received: IntCounter,
    dropped: IntCounterVec,
}

impl ReplicaSyncMetrics {
    /// Registers every family in `registry`, closed-set series at 0.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let gauge = |name: &str, help: &str| -> Result<IntGauge, prometheus::Error> {
            let g = IntGauge::new(name, help)?;
            registry.register(Box::new(g.clone()))?;
            Ok(g)
        };
        let counter = |name: &str, help: &str| -> Result<IntCounter, prometheus::Error> {
            let c = IntCounter::new(name, help)?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        let lag = Histogram::with_opts(
            HistogramOpts::new(
                "continuum_replica_sync_lag_seconds",
                "From a peer publishing a changed snapshot to this replica applying it (wall clocks).",
            )
            .buckets(vec![0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]),
        )?;
        registry.register(Box::new(lag.clone()))?;
        let dropped = IntCounterVec::new(
            Opts::new(
                "continuum_replica_sync_dropped_total",
                "Snapshots or entries the replica sync dropped, by reason.",
            ),
            &["reason"],
        )?;
        registry.register(Box::new(dropped.clone()))?;
        for reason in SyncDrop::ALL {
            dropped.with_label_values(&[reason.as_label()]);
        }
        Ok(Self {
            peers: gauge(
                "continuum_replica_sync_peers",
                "Peer replicas whose snapshots are held (heard from within their TTL).",
            )?,
            connected: gauge(
                "continuum_replica_sync_connected",
                "1 while the replica sync's NATS connection is up.",
            )?,
            applied: counter(
                "continuum_replica_sync_contributions_applied_total",
                "Peer contributions (one rank's in-flight sums) applied to the ledger.",
            )?,
            expired: counter(
                "continuum_replica_sync_contributions_expired_total",
                "Peer contributions withdrawn because their replica fell silent for its TTL.",
            )?,
            lag,
            bytes_sent: counter(
                "continuum_replica_sync_bytes_sent_total",
                "Snapshot payload bytes published.",
            )?,
            snapshots_sent: counter(
                "continuum_replica_sync_snapshots_sent_total",
                "Snapshots published (changes and heartbeats).",
            )?,
            snapshots_received: counter(
                "continuum_replica_sync_snapshots_received_total",
                "Snapshots received from the subject (our own echo excluded).",
            )?,
            dropped,
        })
    }

    pub fn dropped(&self, reason: SyncDrop, n: u64) {
        self.dropped
            .with_label_values(&[reason.as_label()])
            .inc_by(n);
    }
}
