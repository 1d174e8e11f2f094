//! Discovery: the event vocabulary every source speaks, the pure per-namespace reducer that folds
//! it into a fleet view, and the immutable fleet snapshot readers share.
//!
//! etcd passes, Kubernetes metadata relists and the scripted test sources all reduce to this
//! stream of keyed raw values. A resync is the startup path: `Init`, then `InitApply` for every
//! record of the fresh range gets, then `InitDone`, at which the reducer swaps its held set
//! atomically. `Apply` and `Delete` are the watch events that follow.
//!
//! | module | what it holds |
//! |---|---|
//! | [`keys`] | etcd key shapes, keyspaces, Dynamo's event-segment percent-encoding |
//! | [`file_store`] | Dynamo's file store: file names to keys, mtime liveness, bounded admission, scan diffs |
//! | [`registration`] | the records a 1.6.1 worker registers, for simulated workers |
//! | [`records`] | tolerant parsing of Endpoint / Model / EventChannel / EventSource values, bounds |
//! | [`reducer`] | [`DiscoveryReducer`]: held records, joins, duplicate refusal, counts |
//! | [`view`] | [`Worker`], [`Publisher`], [`NamespaceView`] and the admin JSON of a worker |
//! | [`snapshot`] | [`DynamoSnapshot`], [`build_snapshot`], the mixed-namespace detector |

pub mod file_store;
pub mod keys;
pub mod records;
pub mod reducer;
pub mod registration;
pub mod snapshot;
pub mod view;

pub use keys::{Keyspace, decode_segment, encode_segment};
pub use records::{
    Capacity, CardJson, DisaggregatedEndpoint, EventTopic, MAX_RECORD_BYTES,
    MAX_RECORDS_PER_KEYSPACE, MAX_RETAINED_CARD_BYTES, Role, TcpAddress,
};
pub use reducer::{DiscoveryReducer, ViewChanges};
pub use snapshot::{
    DynamoSnapshot, FleetChanges, MAX_MIXED_SHOWN, MixedModel, MixedReport, NamespaceUpdate,
    RoleCounts, Signals, SourceKind, build_snapshot, mixed_models, newly_mixed,
};
pub use view::{NamespaceView, Publisher, Worker, rfc3339};

/// One event from a discovery source. Keys are full etcd-style keys (`v1/instances/<ns>/...`);
/// values are raw, untrusted bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceEvent {
    /// A full resync starts; records until `InitDone` replace everything held.
    Init,
    /// One record of the resync.
    InitApply { key: String, value: Vec<u8> },
    /// The resync is complete: swap.
    InitDone,
    /// A watch put.
    Apply { key: String, value: Vec<u8> },
    /// A watch delete (including lease expiry).
    Delete { key: String },
}

/// The closed label set of `continuum_dynamo_discovery_events_total{kind}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DiscoveryEventKind {
    /// A watch put in a watched namespace.
    Put,
    /// A watch delete in a watched namespace.
    Delete,
    /// A completed resync (`InitDone`).
    Resync,
    /// A value or key that cannot be read (non-JSON, missing id, bad endpoint, bad key shape).
    Malformed,
    /// A value above `MAX_RECORD_BYTES`, or a card above `MAX_RETAINED_CARD_BYTES` (trimmed).
    Oversized,
    /// A new key refused because its keyspace holds `MAX_RECORDS_PER_KEYSPACE` keys.
    OverCapacity,
    /// A newly seen set of records claiming one identity (refused together).
    Duplicate,
    /// A well-formed channel the router does not consume (broker, NATS, unknown kinds).
    Unsupported,
    /// Refused by a source (Kubernetes container mode); not emitted by the reducer.
    Refused,
    /// Path and value ids disagree (Kubernetes metadata); not emitted by the reducer.
    Mismatch,
    /// The supervisor replaced a watcher; not emitted by the reducer.
    Restart,
    /// Component and card claim different roles: the worker is excluded.
    RoleConflict,
}

impl DiscoveryEventKind {
    pub const ALL: [DiscoveryEventKind; 12] = [
        DiscoveryEventKind::Put,
        DiscoveryEventKind::Delete,
        DiscoveryEventKind::Resync,
        DiscoveryEventKind::Malformed,
        DiscoveryEventKind::Oversized,
        DiscoveryEventKind::OverCapacity,
        DiscoveryEventKind::Duplicate,
        DiscoveryEventKind::Unsupported,
        DiscoveryEventKind::Refused,
        DiscoveryEventKind::Mismatch,
        DiscoveryEventKind::Restart,
        DiscoveryEventKind::RoleConflict,
    ];

    /// The Prometheus label value.
    pub fn as_label(self) -> &'static str {
        match self {
            DiscoveryEventKind::Put => "put",
            DiscoveryEventKind::Delete => "delete",
            DiscoveryEventKind::Resync => "resync",
            DiscoveryEventKind::Malformed => "malformed",
            DiscoveryEventKind::Oversized => "oversized",
            DiscoveryEventKind::OverCapacity => "over_capacity",
            DiscoveryEventKind::Duplicate => "duplicate",
            DiscoveryEventKind::Unsupported => "unsupported",
            DiscoveryEventKind::Refused => "refused",
            DiscoveryEventKind::Mismatch => "mismatch",
            DiscoveryEventKind::Restart => "restart",
            DiscoveryEventKind::RoleConflict => "role_conflict",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Counts per [`DiscoveryEventKind`], accumulated by a reducer and drained by its owner.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiscoveryCounts([u64; 12]);

impl DiscoveryCounts {
    pub fn add(&mut self, kind: DiscoveryEventKind, n: u64) {
        let slot = &mut self.0[kind.index()];
        *slot = slot.saturating_add(n);
    }

    pub fn get(&self, kind: DiscoveryEventKind) -> u64 {
        self.0[kind.index()]
    }

    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|n| *n == 0)
    }

    /// Non-zero counts in label order.
    pub fn iter(&self) -> impl Iterator<Item = (DiscoveryEventKind, u64)> + '_ {
        DiscoveryEventKind::ALL
            .into_iter()
            .map(|k| (k, self.get(k)))
            .filter(|(_, n)| *n > 0)
    }

    /// Adds every count of `other`.
    pub fn merge(&mut self, other: &DiscoveryCounts) {
        for (k, n) in other.iter() {
            self.add(k, n);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_are_a_closed_set_with_distinct_labels() {
        let mut labels: Vec<_> = DiscoveryEventKind::ALL
            .iter()
            .map(|k| k.as_label())
            .collect();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), DiscoveryEventKind::ALL.len());
        for (i, k) in DiscoveryEventKind::ALL.iter().enumerate() {
            assert_eq!(k.index(), i);
        }
    }

    #[test]
    fn counts_iterate_only_non_zero_kinds() {
        let mut c = DiscoveryCounts::default();
        c.add(DiscoveryEventKind::Duplicate, 2);
        c.add(DiscoveryEventKind::Put, 1);
        let got: Vec<_> = c.iter().collect();
        assert_eq!(
            got,
            vec![
                (DiscoveryEventKind::Put, 1),
                (DiscoveryEventKind::Duplicate, 2)
            ]
        );
    }
}
