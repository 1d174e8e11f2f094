//! An in-process discovery source: etcd-shaped records held in memory and streamed to the
//! discovery reducer exactly as the etcd source streams a range get and its watch.
//!
//! Role: `continuum-router demo` registers its simulated Dynamo workers here with the very
//! `v1/instances/…`, `v1/mdc/…` and `v1/event_channels/…` records Dynamo 1.6.1 writes to etcd, so
//! everything after the source (reducer, registry, subscriptions, picker) runs unchanged and no
//! etcd process is needed. It is a separate module from `etcd_source`, which stays read-only.
//!
//! A source for one namespace sees only keys under that namespace's three watched prefixes (the
//! same [`watched_prefixes`] the etcd source reads). Each pass starts with `Init`, one
//! `InitApply` per held record and `InitDone`, then follows changes as `Apply` / `Delete`. A
//! consumer that falls more than [`CHANGE_BUFFER`] changes behind starts a fresh pass, as an etcd
//! watch whose start revision was compacted would.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::lock::{Mutex, MutexGuard};

use continuum_protocol::discovery::SourceEvent;
use continuum_protocol::ids::Namespace;
use tokio::sync::{broadcast, mpsc, watch};
use tracing::{debug, warn};

use crate::etcd_source::{WatchedPrefix, watched_prefixes};

/// Changes buffered per consumer before it must resync.
pub const CHANGE_BUFFER: usize = 1024;
/// Most records the feed holds (the reducer's own per-keyspace bounds apply after it).
pub const MAX_RECORDS: usize = 16_384;

/// Why a record was not registered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MemoryDiscoveryError {
    #[error("the in-memory discovery feed already holds {MAX_RECORDS} records")]
    Full,
}

#[derive(Clone, Debug)]
enum Change {
    Registered { key: String, value: Vec<u8> },
    Withdrawn { key: String },
}

struct Inner {
    records: BTreeMap<String, Vec<u8>>,
    changes: broadcast::Sender<Change>,
}

/// The shared record set. Cloning shares it.
#[derive(Clone)]
pub struct MemoryDiscovery {
    inner: Arc<Mutex<Inner>>,
}

impl std::fmt::Debug for MemoryDiscovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryDiscovery")
            .field("records", &self.len())
            .finish()
    }
}

impl Default for MemoryDiscovery {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryDiscovery {
    pub fn new() -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner {
                records: BTreeMap::new(),
                changes: broadcast::channel(CHANGE_BUFFER).0,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock()
    }

    /// Registers (or replaces) one record, as a worker's etcd put would.
    pub fn register(
        &self,
        key: impl Into<String>,
        value: impl Into<Vec<u8>>,
    ) -> Result<(), MemoryDiscoveryError> {
        let (key, value) = (key.into(), value.into());
        let mut inner = self.lock();
        if inner.records.len() >= MAX_RECORDS && !inner.records.contains_key(&key) {
            return Err(MemoryDiscoveryError::Full);
        }
        inner.records.insert(key.clone(), value.clone());
        // No receiver is fine: sources that start later read the record set.
        let _ = inner.changes.send(Change::Registered { key, value });
        Ok(())
    }

    /// Withdraws one record, as a worker's shutdown (or lease expiry) would.
    pub fn withdraw(&self, key: &str) {
        let mut inner = self.lock();
        if inner.records.remove(key).is_some() {
            let _ = inner.changes.send(Change::Withdrawn {
                key: key.to_owned(),
            });
        }
    }

    pub fn len(&self) -> usize {
        self.lock().records.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The current records and a receiver of every later change, taken under one lock so no
    /// change falls between them.
    fn subscribe(&self) -> (Vec<(String, Vec<u8>)>, broadcast::Receiver<Change>) {
        let inner = self.lock();
        let records = inner
            .records
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        (records, inner.changes.subscribe())
    }
}

fn watched(prefixes: &[WatchedPrefix], key: &str) -> bool {
    prefixes.iter().any(|p| key.starts_with(&p.prefix))
}

/// Streams `namespace`'s records into `events` until the receiver is dropped. `connected` is
/// true while a pass follows changes.
pub async fn run_memory_source(
    feed: MemoryDiscovery,
    namespace: Namespace,
    events: mpsc::Sender<SourceEvent>,
    connected: watch::Sender<bool>,
) {
    let prefixes = watched_prefixes(&namespace);
    loop {
        let (records, mut changes) = feed.subscribe();
        let mut pass = vec![SourceEvent::Init];
        pass.extend(
            records
                .into_iter()
                .filter(|(key, _)| watched(&prefixes, key))
                .map(|(key, value)| SourceEvent::InitApply { key, value }),
        );
        pass.push(SourceEvent::InitDone);
        for event in pass {
            if events.send(event).await.is_err() {
                return;
            }
        }
        connected.send_replace(true);
        debug!(%namespace, "In-memory discovery pass complete; following changes.");
        loop {
            let event = match changes.recv().await {
                Ok(Change::Registered { key, value }) if watched(&prefixes, &key) => {
                    SourceEvent::Apply { key, value }
                }
                Ok(Change::Withdrawn { key }) if watched(&prefixes, &key) => {
                    SourceEvent::Delete { key }
                }
                Ok(_) => continue,
                Err(broadcast::error::RecvError::Lagged(missed)) => {
                    warn!(%namespace, missed, "In-memory discovery fell behind; starting a fresh pass.");
                    break;
                }
                // The sender lives in the feed, which this task holds: it cannot close.
                Err(broadcast::error::RecvError::Closed) => return,
            };
            if events.send(event).await.is_err() {
                connected.send_replace(false);
                return;
            }
        }
        connected.send_replace(false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn next(rx: &mut mpsc::Receiver<SourceEvent>) -> SourceEvent {
        rx.recv().await.expect("source alive")
    }

    #[tokio::test]
    async fn a_pass_holds_only_the_namespaces_records_then_follows_changes() {
        let feed = MemoryDiscovery::new();
        feed.register("v1/instances/demo/backend/generate/1", b"a".to_vec())
            .unwrap();
        feed.register("v1/instances/other/backend/generate/2", b"b".to_vec())
            .unwrap();
        let (tx, mut rx) = mpsc::channel(16);
        let (connected_tx, mut connected) = watch::channel(false);
        let task = tokio::spawn(run_memory_source(
            feed.clone(),
            Namespace::new("demo"),
            tx,
            connected_tx,
        ));
        assert_eq!(next(&mut rx).await, SourceEvent::Init);
        assert_eq!(
            next(&mut rx).await,
            SourceEvent::InitApply {
                key: "v1/instances/demo/backend/generate/1".into(),
                value: b"a".to_vec()
            }
        );
        assert_eq!(next(&mut rx).await, SourceEvent::InitDone);
        connected.wait_for(|c| *c).await.unwrap();

        feed.register("v1/mdc/other/backend/generate/2", b"x".to_vec())
            .unwrap();
        feed.register(
            "v1/event_channels/namespace/demo/component/backend/endpoint/generate/topic/kv_metrics/3",
            b"c".to_vec(),
        )
        .unwrap();
        feed.withdraw("v1/instances/demo/backend/generate/1");
        assert!(
            matches!(next(&mut rx).await, SourceEvent::Apply { key, .. } if key.contains("kv_metrics"))
        );
        assert_eq!(
            next(&mut rx).await,
            SourceEvent::Delete {
                key: "v1/instances/demo/backend/generate/1".into()
            }
        );
        drop(rx);
        feed.register("v1/instances/demo/backend/generate/9", b"z".to_vec())
            .unwrap();
        task.await.unwrap();
        assert!(!*connected.borrow());
    }
}
