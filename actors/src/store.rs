//! A lock-free snapshot store: one writer, many readers (vector's ArcSwap tables, kube `Store`).
//!
//! Readers call [`SnapshotStore::snapshot`] on every request and get an `Arc` of an immutable
//! value; waiters watch the generation. The writer swaps the snapshot *before* bumping the
//! generation, so anyone who saw generation `n` reads a snapshot at least that new. Publishing a
//! value equal to the current one changes nothing, so idempotent resyncs do not bump it.

use std::sync::Arc;

use arc_swap::ArcSwap;
use tokio::sync::watch;

pub struct SnapshotStore<T> {
    current: ArcSwap<T>,
    generation: watch::Sender<u64>,
}

impl<T> std::fmt::Debug for SnapshotStore<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotStore")
            .field("generation", &*self.generation.borrow())
            .finish_non_exhaustive()
    }
}

impl<T> SnapshotStore<T> {
    pub fn new(initial: T) -> Arc<Self> {
        let (generation, _) = watch::channel(0);
        Arc::new(Self {
            current: ArcSwap::from_pointee(initial),
            generation,
        })
    }

    /// The current snapshot, lock-free.
    pub fn snapshot(&self) -> Arc<T> {
        self.current.load_full()
    }

    /// A receiver of the monotonic change generation. It holds a number, not a snapshot, so slow
    /// subscribers cannot pin old snapshots in memory.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    pub fn generation(&self) -> u64 {
        *self.generation.borrow()
    }

    /// Swaps in `next` and bumps the generation, unless `same(current, next)`.
    /// Returns whether anything changed. Only the store's single writer calls this.
    pub fn publish_unless(&self, next: T, same: impl FnOnce(&T, &T) -> bool) -> bool {
        if same(&self.current.load(), &next) {
            return false;
        }
        self.current.store(Arc::new(next));
        self.generation.send_modify(|g| *g += 1);
        true
    }
}

impl<T: PartialEq> SnapshotStore<T> {
    /// Swaps in `next` and bumps the generation, unless it equals the current snapshot.
    pub fn publish(&self, next: T) -> bool {
        self.publish_unless(next, |a, b| a == b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn equal_publishes_do_not_bump_and_swaps_precede_the_bump() {
        let store = SnapshotStore::new(vec![1]);
        let mut rx = store.subscribe();
        assert!(!store.publish(vec![1]));
        assert_eq!(store.generation(), 0);
        assert!(store.publish(vec![1, 2]));
        rx.changed().await.expect("sender alive");
        assert_eq!(*rx.borrow(), 1);
        assert_eq!(*store.snapshot(), vec![1, 2]);
    }
}
