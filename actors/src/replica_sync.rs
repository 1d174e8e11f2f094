//! Router replicas sharing their in-flight dispatches over NATS (`replica_sync`).
//!
//! Every replica samples its own ledger ([`SharedPicker::local_contributions`]) every
//! `publish_interval` off the request path, publishes a whole-state snapshot when it changed (a
//! heartbeat every `heartbeat_interval` when not), and folds its peers' snapshots into the same
//! ledger through `continuum_protocol::replica_sync::PeerTable`: the picker then sees peers'
//! unanswered dispatches as backlog, exactly as its own. The request path pays nothing: no
//! channel, no counter, only the picker's lock, taken for one sample and one merge per message.
//!
//! - `metrics`: the `continuum_replica_sync_*` families (always registered);
//! - [`ReplicaSyncView`]: what the admin view and the fleet page show (peers, connection);
//! - `actor` (Cargo feature `replica-sync`): `ReplicaSyncActor` and its NATS client task.
//!
//! Parent: root. Children: none (one task). Restart: transient; a `replica_sync` reload restarts
//! it. Start and stop withdraw every peer contribution from the ledger.

use std::sync::Arc;

use arc_swap::ArcSwap;
use continuum_protocol::replica_sync::PeerInfo;
use serde::Serialize;

#[cfg(feature = "replica-sync")]
mod actor;
mod metrics;

#[cfg(feature = "replica-sync")]
pub use actor::{
    NatsAuth, REPLICA_SYNC_NAME, ReplicaSyncActor, ReplicaSyncArgs, ReplicaSyncSettings,
    replica_sync_spec,
};
pub use metrics::{ReplicaSyncMetrics, SyncDrop};

/// What `GET /admin/dynamo/workers` (`replica_sync`) and the fleet page show.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ReplicaSyncStatus {
    pub enabled: bool,
    pub replica_id: String,
    pub subject: String,
    pub connected: bool,
    /// This replica's boot epoch and last published sequence.
    pub epoch: u64,
    pub seq: u64,
    /// Ranks our last published snapshot carried.
    pub published_entries: usize,
    /// Peer legs held in the ledger now.
    pub peer_legs: usize,
    pub peers: Vec<PeerInfo>,
}

/// The replica sync's last published status, written by its task, read lock-free.
#[derive(Clone, Debug, Default)]
pub struct ReplicaSyncView(Arc<ArcSwap<ReplicaSyncStatus>>);

impl ReplicaSyncView {
    pub fn get(&self) -> Arc<ReplicaSyncStatus> {
        self.0.load_full()
    }

    pub fn set(&self, status: ReplicaSyncStatus) {
        self.0.store(Arc::new(status));
    }
}
