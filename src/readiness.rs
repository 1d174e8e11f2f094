//! Readiness: `GET /ready` answers 503 until every configured discovery source finished its first
//! full pass.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

/// Sources that must complete a first pass before the router is ready.
#[derive(Clone, Debug)]
pub struct Readiness {
    pending: Arc<Mutex<BTreeSet<String>>>,
    ready: Arc<watch::Sender<bool>>,
}

impl Default for Readiness {
    fn default() -> Self {
        Self::new()
    }
}

impl Readiness {
    /// Ready until a source is required.
    pub fn new() -> Self {
        let (ready, _) = watch::channel(true);
        Self {
            pending: Arc::default(),
            ready: Arc::new(ready),
        }
    }

    fn update(&self, f: impl FnOnce(&mut BTreeSet<String>)) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut pending);
        let now_ready = pending.is_empty();
        self.ready
            .send_if_modified(|r| std::mem::replace(r, now_ready) != now_ready);
    }

    /// Replaces the set of sources that must complete a first pass.
    pub fn require_exactly(&self, sources: impl IntoIterator<Item = String>) {
        let sources: BTreeSet<String> = sources.into_iter().collect();
        self.update(|p| *p = sources);
    }

    /// `source` completed its first pass.
    pub fn mark_ready(&self, source: &str) {
        self.update(|p| {
            p.remove(source);
        });
    }

    pub fn is_ready(&self) -> bool {
        *self.ready.borrow()
    }

    /// Sources still pending, for the 503 body.
    pub fn pending(&self) -> Vec<String> {
        let pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        pending.iter().cloned().collect()
    }

    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.ready.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_when_every_required_source_reported() {
        let r = Readiness::new();
        assert!(r.is_ready());
        r.require_exactly(["etcd:a".to_string(), "etcd:b".to_string()]);
        assert!(!r.is_ready());
        r.mark_ready("etcd:a");
        assert!(!r.is_ready());
        assert_eq!(r.pending(), vec!["etcd:b".to_string()]);
        r.mark_ready("etcd:b");
        assert!(r.is_ready());
    }
}
