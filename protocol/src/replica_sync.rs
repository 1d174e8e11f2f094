//! Router replicas sharing their in-flight dispatches (`replica_sync`): the snapshot a replica
//! publishes, its bounded decoding, and the merge of peers' snapshots into the local
//! [`DispatchLedger`].
//!
//! A replica publishes its whole state (every rank it holds unanswered legs on, summed) rather
//! than deltas, so a snapshot is applied at most once and replaces the one before it: a peer's
//! contributions are one peer dispatch in the ledger ([`DispatchLedger::record_peer`]), withdrawn
//! and recorded again when its content changes, answered by samples like local legs meanwhile.
//! A peer is identified by its replica id and a boot epoch: a larger epoch is a restart (its old
//! contributions are replaced), a smaller one a late message from before it (dropped). A
//! snapshot whose content did not change since the one applied (a heartbeat: same `content_seq`)
//! only keeps the peer alive. A peer silent for its TTL is forgotten with its contributions.
//!
//! Pure state: every method takes the caller's `now`, nothing reads a clock.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::ids::{DpRank, InstanceId, Namespace, WorkerKey};
use crate::picker::ledger::{DispatchId, DispatchLedger, DispatchLeg, LocalContribution};
use crate::picker::tie_break::Place;
use crate::time::Tick;

/// The snapshot format's version (`v`).
pub const WIRE_VERSION: u8 = 1;
/// Largest snapshot payload decoded.
pub const MAX_SNAPSHOT_BYTES: usize = 1 << 20;
/// Longest replica id (a DNS name).
pub const MAX_REPLICA_ID_BYTES: usize = 253;
/// Namespaces one snapshot may name (as many as can be configured).
pub const MAX_NAMESPACES: usize = 16;
/// Longest namespace name in a snapshot.
pub const MAX_NAMESPACE_BYTES: usize = 256;
/// Shortest TTL a snapshot may ask for.
pub const MIN_TTL: Duration = Duration::from_millis(100);

/// One rank's contribution on the wire: namespace (index into [`Snapshot::namespaces`]),
/// instance id, dp rank, prefill tokens, decode blocks, unanswered requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry(pub u16, pub u64, pub u32, pub u64, pub u64, pub u32);

/// What one replica publishes (MessagePack, fields as an array).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    pub v: u8,
    pub replica: String,
    /// The replica's boot epoch (Unix nanoseconds at start): larger after a restart.
    pub epoch: u64,
    /// Increases with every message of one epoch.
    pub seq: u64,
    /// The `seq` of the message that first carried this content (equal to `seq` when it changed).
    pub content_seq: u64,
    /// How long the receivers keep the contributions without a newer message.
    pub ttl_ms: u32,
    /// Wall-clock send time (Unix milliseconds), for the sync-lag histogram only.
    pub sent_unix_ms: u64,
    pub namespaces: Vec<String>,
    pub entries: Vec<Entry>,
}

/// Why a snapshot was not decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("snapshot larger than {MAX_SNAPSHOT_BYTES} bytes")]
    Oversize,
    #[error("snapshot is not valid MessagePack of the expected shape")]
    Malformed,
    #[error("unknown snapshot version")]
    Version,
    #[error("snapshot fields out of bounds")]
    Bounds,
}

impl DecodeError {
    /// The `reason` label of `continuum_replica_sync_dropped_total`.
    pub fn as_label(self) -> &'static str {
        match self {
            Self::Oversize => "oversize",
            Self::Malformed | Self::Bounds => "malformed",
            Self::Version => "version",
        }
    }
}

impl Snapshot {
    /// Builds the snapshot of `local` (sorted by namespace, as the ledger gives it).
    pub fn from_local(header: Header<'_>, local: &[LocalContribution]) -> Self {
        let mut namespaces: Vec<String> = Vec::new();
        let mut entries = Vec::with_capacity(local.len());
        for c in local {
            let ns = match namespaces.iter().position(|n| n == c.namespace.as_str()) {
                Some(pos) => pos,
                None if namespaces.len() < MAX_NAMESPACES => {
                    namespaces.push(c.namespace.as_str().to_owned());
                    namespaces.len() - 1
                }
                None => continue,
            };
            // < MAX_NAMESPACES by construction.
            entries.push(Entry(
                ns as u16,
                c.instance.0,
                c.rank.0,
                c.prefill_tokens,
                c.decode_blocks,
                c.requests,
            ));
        }
        Self {
            v: WIRE_VERSION,
            replica: header.replica.to_owned(),
            epoch: header.epoch,
            seq: header.seq,
            content_seq: header.content_seq,
            ttl_ms: u32::try_from(header.ttl.as_millis()).unwrap_or(u32::MAX),
            sent_unix_ms: header.sent_unix_ms,
            namespaces,
            entries,
        }
    }

    /// MessagePack bytes.
    pub fn encode(&self) -> Vec<u8> {
        // Plain data with string keys only: serialising cannot fail.
        rmp_serde::to_vec(self).unwrap_or_default()
    }

    /// Decodes and checks untrusted bytes: size first, then shape, version and bounds.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        if bytes.len() > MAX_SNAPSHOT_BYTES {
            return Err(DecodeError::Oversize);
        }
        let snap: Snapshot = rmp_serde::from_slice(bytes).map_err(|_| DecodeError::Malformed)?;
        if snap.v != WIRE_VERSION {
            return Err(DecodeError::Version);
        }
        let ok = (1..=MAX_REPLICA_ID_BYTES).contains(&snap.replica.len())
            && snap.namespaces.len() <= MAX_NAMESPACES
            && snap
                .namespaces
                .iter()
                .all(|n| (1..=MAX_NAMESPACE_BYTES).contains(&n.len()))
            && snap
                .entries
                .iter()
                .all(|e| usize::from(e.0) < snap.namespaces.len())
            && snap.content_seq <= snap.seq;
        if ok {
            Ok(snap)
        } else {
            Err(DecodeError::Bounds)
        }
    }

    /// The content of this snapshot (entries, namespaces) equals `other`'s.
    pub fn same_content(&self, other: &Snapshot) -> bool {
        self.namespaces == other.namespaces && self.entries == other.entries
    }
}

/// The fields of a snapshot besides its content.
#[derive(Clone, Copy, Debug)]
pub struct Header<'a> {
    pub replica: &'a str,
    pub epoch: u64,
    pub seq: u64,
    pub content_seq: u64,
    pub ttl: Duration,
    pub sent_unix_ms: u64,
}

/// Bounds of the peer table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerLimits {
    /// Peers held at most; a snapshot from one more is dropped until one expires.
    pub max_peers: usize,
    /// Entries applied per peer snapshot; the rest are dropped (counted).
    pub max_entries_per_peer: usize,
    /// Longest a peer's contributions are kept without a newer message (a snapshot's own
    /// `ttl_ms` may only shorten it, down to [`MIN_TTL`]).
    pub ttl: Duration,
}

/// What became of one offered snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offer {
    /// Our own snapshot, echoed back by the bus.
    Own,
    /// Older than (or the same message as) one already seen from that peer.
    Stale,
    /// A new peer while [`PeerLimits::max_peers`] are held.
    TooManyPeers,
    /// Same content as applied: only the peer's deadline moved.
    Refreshed,
    /// The peer's contributions were replaced by this snapshot's.
    Applied {
        /// Entries applied.
        entries: usize,
        /// Entries over [`PeerLimits::max_entries_per_peer`], left out.
        truncated: usize,
        /// Entries of the previous snapshot replaced.
        replaced: usize,
        /// The peer restarted (a larger epoch) or was not known.
        new_epoch: bool,
    },
}

#[derive(Clone, Debug)]
struct Peer {
    epoch: u64,
    seq: u64,
    content_seq: u64,
    deadline: Tick,
    /// The peer dispatch holding its contributions in the ledger.
    applied: Option<DispatchId>,
    entries: usize,
    last_seen: Tick,
}

/// What the admin view shows of one peer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PeerInfo {
    pub replica: String,
    pub epoch: u64,
    pub seq: u64,
    /// Ranks its applied snapshot contributes to.
    pub entries: usize,
    /// Milliseconds since its last message.
    pub last_seen_ms: u64,
}

/// The peers heard from and what of theirs is in the ledger. See the module docs.
#[derive(Debug)]
pub struct PeerTable {
    own: String,
    limits: PeerLimits,
    peers: BTreeMap<String, Peer>,
}

impl PeerTable {
    /// A table for the replica `own` (its own snapshots are ignored).
    pub fn new(own: impl Into<String>, limits: PeerLimits) -> Self {
        Self {
            own: own.into(),
            limits,
            peers: BTreeMap::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.peers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.peers.is_empty()
    }

    /// Offers a decoded snapshot received at `now`; applies it to `ledger` when it is newer
    /// content from a live peer.
    pub fn offer(&mut self, snap: &Snapshot, now: Tick, ledger: &mut DispatchLedger) -> Offer {
        if snap.replica == self.own {
            return Offer::Own;
        }
        let ttl = Duration::from_millis(u64::from(snap.ttl_ms)).clamp(MIN_TTL, self.limits.ttl);
        if let Some(p) = self.peers.get_mut(&snap.replica) {
            if snap.epoch < p.epoch || (snap.epoch == p.epoch && snap.seq <= p.seq) {
                return Offer::Stale;
            }
            if snap.epoch == p.epoch && snap.content_seq == p.content_seq {
                p.seq = snap.seq;
                p.deadline = now.plus(ttl);
                p.last_seen = now;
                return Offer::Refreshed;
            }
        } else if self.peers.len() >= self.limits.max_peers {
            return Offer::TooManyPeers;
        }
        let previous = self.peers.remove(&snap.replica);
        let new_epoch = previous.as_ref().is_none_or(|p| snap.epoch > p.epoch);
        let replaced = previous.as_ref().map_or(0, |p| p.entries);
        if let Some(id) = previous.and_then(|p| p.applied) {
            ledger.withdraw(id);
        }
        let take = snap.entries.len().min(self.limits.max_entries_per_peer);
        let legs: Vec<DispatchLeg> = snap.entries[..take]
            .iter()
            .filter_map(|e| {
                Some(DispatchLeg {
                    worker: WorkerKey {
                        namespace: Namespace::new(snap.namespaces.get(usize::from(e.0))?.as_str()),
                        instance_id: InstanceId(e.1),
                    },
                    rank: DpRank(e.2),
                    prefill_tokens: e.3,
                    decode_blocks: e.4,
                    request_blocks: 0,
                    stall_exempt: true,
                })
            })
            .collect();
        let applied = (!legs.is_empty()).then(|| ledger.record_peer(&legs, now));
        let entries = legs.len();
        self.peers.insert(
            snap.replica.clone(),
            Peer {
                epoch: snap.epoch,
                seq: snap.seq,
                content_seq: snap.content_seq,
                deadline: now.plus(ttl),
                applied,
                entries,
                last_seen: now,
            },
        );
        ledger.set_place(self.place());
        Offer::Applied {
            entries,
            truncated: snap.entries.len() - take,
            replaced,
            new_epoch,
        }
    }

    /// Forgets the peers whose deadline passed at `now` and withdraws their contributions;
    /// returns (peers expired, entries expired).
    pub fn expire(&mut self, now: Tick, ledger: &mut DispatchLedger) -> (usize, usize) {
        let mut out = (0, 0);
        self.peers.retain(|_, p| {
            if now < p.deadline {
                return true;
            }
            if let Some(id) = p.applied {
                ledger.withdraw(id);
            }
            out.0 += 1;
            out.1 += p.entries;
            false
        });
        ledger.set_place(self.place());
        out
    }

    /// This replica's place among itself and its live peers, ordered by replica id: every
    /// replica hearing the same peers holds a distinct index (`dynamo.load.peer_slots`).
    pub fn place(&self) -> Place {
        let below = self
            .peers
            .keys()
            .take_while(|k| k.as_str() < self.own.as_str())
            .count();
        Place::new(below, self.peers.len() + 1)
    }

    /// Forgets every peer and withdraws their contributions.
    pub fn clear(&mut self, ledger: &mut DispatchLedger) {
        for p in std::mem::take(&mut self.peers).into_values() {
            if let Some(id) = p.applied {
                ledger.withdraw(id);
            }
        }
        ledger.set_place(Place::ALONE);
    }

    /// The peers, by replica id.
    pub fn peers(&self, now: Tick) -> Vec<PeerInfo> {
        self.peers
            .iter()
            .map(|(replica, p)| PeerInfo {
                replica: replica.clone(),
                epoch: p.epoch,
                seq: p.seq,
                entries: p.entries,
                last_seen_ms: u64::try_from(now.since(p.last_seen).as_millis()).unwrap_or(u64::MAX),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
