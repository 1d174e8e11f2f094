//! The status table of the supervision tree, read by `GET /admin/subsystems`.
//!
//! Supervisors are the only writers: they record every start, failure, restart and stop of their
//! children here. Readers get a consistent copy; the lock is never held across an await.

use std::collections::BTreeMap;
use std::sync::Arc;

use ractor::ActorCell;
use serde::Serialize;

use crate::lock::{Mutex, MutexGuard};

/// Where an actor sits in the tree: `root/discovery/etcd:dyntest`.
pub type ActorPath = String;

/// What an actor is doing, as operators see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ActorState {
    Starting,
    Running,
    /// Failed, waiting out its restart backoff.
    Restarting,
    /// Stopped on purpose (removed, or its work ended).
    Stopped,
    /// Failed and its supervisor's restart budget is spent.
    Failed,
}

/// One row of `GET /admin/subsystems`.
#[derive(Clone, Debug, Serialize)]
pub struct ActorStatus {
    pub id: ActorPath,
    pub kind: &'static str,
    pub parent: Option<ActorPath>,
    pub state: ActorState,
    pub restarts: u64,
    pub last_failure: Option<String>,
}

struct Entry {
    status: ActorStatus,
    /// The supervisor that can restart it (`ActorRef<SupervisorMsg>` as a cell).
    supervisor: Option<ActorCell>,
}

/// Errors of an admin restart.
#[derive(Debug, thiserror::Error)]
pub enum RestartError {
    #[error("no actor with id {0:?}")]
    Unknown(String),
    #[error("the root supervisor cannot be restarted; restart the process instead")]
    Root,
    #[error("the supervisor of {0:?} did not answer: {1}")]
    Unreachable(String, String),
    #[error("restart of {0:?} failed: {1}")]
    Failed(String, String),
}

/// Shared, cloneable handle on the status table.
#[derive(Clone, Default)]
pub struct ActorTree {
    inner: Arc<Mutex<BTreeMap<ActorPath, Entry>>>,
}

impl std::fmt::Debug for ActorTree {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActorTree").finish_non_exhaustive()
    }
}

impl ActorTree {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<ActorPath, Entry>> {
        // A poisoned table only means a writer panicked mid-update; the rows stay usable.
        self.inner.lock()
    }

    /// Records that `id` is (re)starting under `supervisor`; restart counts survive.
    pub(crate) fn starting(
        &self,
        id: &str,
        kind: &'static str,
        parent: Option<&str>,
        supervisor: Option<ActorCell>,
    ) {
        let mut map = self.lock();
        let entry = map.entry(id.to_string()).or_insert_with(|| Entry {
            status: ActorStatus {
                id: id.to_string(),
                kind,
                parent: parent.map(str::to_string),
                state: ActorState::Starting,
                restarts: 0,
                last_failure: None,
            },
            supervisor: None,
        });
        entry.status.state = ActorState::Starting;
        if supervisor.is_some() {
            entry.supervisor = supervisor;
        }
    }

    pub(crate) fn set_state(&self, id: &str, state: ActorState) {
        if let Some(e) = self.lock().get_mut(id) {
            e.status.state = state;
        }
    }

    pub(crate) fn failed(&self, id: &str, error: &str, state: ActorState) {
        if let Some(e) = self.lock().get_mut(id) {
            e.status.state = state;
            e.status.last_failure = Some(error.chars().take(512).collect());
        }
    }

    pub(crate) fn restarted(&self, id: &str) {
        if let Some(e) = self.lock().get_mut(id) {
            e.status.restarts += 1;
        }
    }

    /// Marks `id` and everything below it stopped.
    pub(crate) fn stopped_subtree(&self, id: &str) {
        let prefix = format!("{id}/");
        for (path, e) in self.lock().iter_mut() {
            if path == id || path.starts_with(&prefix) {
                e.status.state = ActorState::Stopped;
            }
        }
    }

    /// Forgets `id` and everything below it (a dynamic child that was removed).
    pub(crate) fn remove_subtree(&self, id: &str) {
        let prefix = format!("{id}/");
        self.lock()
            .retain(|path, _| path != id && !path.starts_with(&prefix));
    }

    /// Every actor of the tree, ordered by path.
    pub fn list(&self) -> Vec<ActorStatus> {
        self.lock().values().map(|e| e.status.clone()).collect()
    }

    pub fn get(&self, id: &str) -> Option<ActorStatus> {
        self.lock().get(id).map(|e| e.status.clone())
    }

    /// The name of `id` under its supervisor and that supervisor's cell, for an admin restart
    /// (`ActorTree::restart`, defined in `crate::supervisor` beside the message it sends, so
    /// this table does not import the supervisor that writes it).
    pub(crate) fn restart_target(&self, id: &str) -> Result<(String, ActorCell), RestartError> {
        let map = self.lock();
        let entry = map
            .get(id)
            .ok_or_else(|| RestartError::Unknown(id.to_string()))?;
        match (&entry.status.parent, &entry.supervisor) {
            (Some(parent), Some(supervisor)) => {
                let name = id.strip_prefix(&format!("{parent}/")).unwrap_or(id);
                Ok((name.to_string(), supervisor.clone()))
            }
            _ => Err(RestartError::Root),
        }
    }
}
