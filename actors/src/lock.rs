//! The one place that touches `std::sync` locks (clippy's `disallowed-types` bans them elsewhere
//! in this crate), and the single-writer lease every shared state's writer is claimed through.
//!
//! - [`Mutex`] / [`RwLock`]: `std::sync` locks whose poisoning is handled once, here. A panic
//!   while a guard is held poisons the lock; every state behind these locks is a cache or a
//!   table that each write leaves consistent (no multi-step invariant spans a panic point), so the
//!   next holder takes the data as it is rather than propagating the panic to every reader.
//!   Critical sections never span an `.await`.
//! - [`Exclusive`] / [`Claim`]: a writer lease. The slot is cheap to clone (a child spec keeps one
//!   to hand to every incarnation of its actor); a [`Claim`] is not `Clone`, at most one exists at
//!   a time, and dropping it (the actor's state is dropped when the actor stops or fails) releases
//!   the slot for the next incarnation. This is how "one writer per shared state" is a type and a
//!   runtime fact rather than a comment.

#![allow(clippy::disallowed_types)]

use std::ops::Deref;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::Notify;

/// A mutex whose poisoning is ignored (see the module docs).
#[derive(Debug, Default)]
pub struct Mutex<T>(std::sync::Mutex<T>);

/// The guard of a [`Mutex`].
pub type MutexGuard<'a, T> = std::sync::MutexGuard<'a, T>;

impl<T> Mutex<T> {
    pub const fn new(value: T) -> Self {
        Self(std::sync::Mutex::new(value))
    }

    /// Locks, taking the data as it is if a previous holder panicked.
    pub fn lock(&self) -> MutexGuard<'_, T> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn into_inner(self) -> T {
        self.0.into_inner().unwrap_or_else(|p| p.into_inner())
    }
}

/// A reader-writer lock whose poisoning is ignored (see the module docs).
#[derive(Debug, Default)]
pub struct RwLock<T>(std::sync::RwLock<T>);

pub type RwLockReadGuard<'a, T> = std::sync::RwLockReadGuard<'a, T>;
pub type RwLockWriteGuard<'a, T> = std::sync::RwLockWriteGuard<'a, T>;

impl<T> RwLock<T> {
    pub const fn new(value: T) -> Self {
        Self(std::sync::RwLock::new(value))
    }

    pub fn read(&self) -> RwLockReadGuard<'_, T> {
        self.0.read().unwrap_or_else(|p| p.into_inner())
    }

    pub fn write(&self) -> RwLockWriteGuard<'_, T> {
        self.0.write().unwrap_or_else(|p| p.into_inner())
    }
}

/// How long a new incarnation waits for its predecessor's [`Claim`] to be dropped.
pub const CLAIM_TIMEOUT: Duration = Duration::from_secs(10);

struct Slot<T> {
    value: T,
    claimed: AtomicBool,
    released: Notify,
}

/// A single-writer slot: hands out at most one [`Claim`] at a time.
pub struct Exclusive<T> {
    slot: Arc<Slot<T>>,
}

impl<T> Clone for Exclusive<T> {
    fn clone(&self) -> Self {
        Self {
            slot: self.slot.clone(),
        }
    }
}

impl<T> std::fmt::Debug for Exclusive<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exclusive")
            .field("claimed", &self.slot.claimed.load(Ordering::Acquire))
            .finish_non_exhaustive()
    }
}

/// A claim was not released in time (the previous writer is still running).
#[derive(Debug, thiserror::Error)]
#[error("the writer is still held by another owner after {0:?}")]
pub struct ClaimTimeout(pub Duration);

impl<T> Exclusive<T> {
    pub fn new(value: T) -> Self {
        Self {
            slot: Arc::new(Slot {
                value,
                claimed: AtomicBool::new(false),
                released: Notify::new(),
            }),
        }
    }

    /// The claim, if no one holds it now.
    pub fn try_claim(&self) -> Option<Claim<T>> {
        self.slot
            .claimed
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
            .then(|| Claim {
                slot: self.slot.clone(),
            })
    }

    /// The claim, waiting at most `timeout` for the current holder to drop it (a restarted actor
    /// whose predecessor's state is still being dropped).
    pub async fn claim(&self, timeout: Duration) -> Result<Claim<T>, ClaimTimeout> {
        let wait = async {
            loop {
                let released = self.slot.released.notified();
                tokio::pin!(released);
                released.as_mut().enable();
                if let Some(claim) = self.try_claim() {
                    return claim;
                }
                released.await;
            }
        };
        tokio::time::timeout(timeout, wait)
            .await
            .map_err(|_| ClaimTimeout(timeout))
    }

    /// Whether a claim is held now.
    pub fn is_claimed(&self) -> bool {
        self.slot.claimed.load(Ordering::Acquire)
    }
}

/// The one writer of an [`Exclusive`] slot: not `Clone`; dropping it releases the slot.
pub struct Claim<T> {
    slot: Arc<Slot<T>>,
}

impl<T> std::fmt::Debug for Claim<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claim").finish_non_exhaustive()
    }
}

impl<T> Deref for Claim<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.slot.value
    }
}

impl<T> Drop for Claim<T> {
    fn drop(&mut self) {
        self.slot.claimed.store(false, Ordering::Release);
        self.slot.released.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_claim_at_a_time_and_a_dropped_claim_frees_the_slot() {
        let slot = Exclusive::new(7);
        let first = slot.try_claim().expect("free");
        assert_eq!(*first, 7);
        assert!(slot.try_claim().is_none(), "a second writer is refused");
        assert!(slot.is_claimed());
        let waiter = {
            let slot = slot.clone();
            tokio::spawn(async move { slot.claim(CLAIM_TIMEOUT).await.map(|c| *c) })
        };
        drop(first);
        assert_eq!(
            waiter
                .await
                .expect("joined")
                .expect("claimed after release"),
            7
        );
        assert!(!slot.is_claimed(), "the waiter's claim was dropped too");
    }

    #[tokio::test(start_paused = true)]
    async fn a_claim_that_is_never_released_times_out() {
        let slot = Exclusive::new(());
        let _held = slot.try_claim().expect("free");
        let refused = slot.claim(Duration::from_secs(1)).await;
        assert!(refused.is_err());
    }

    #[test]
    fn a_poisoned_mutex_still_locks() {
        let m = Arc::new(Mutex::new(1));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let _g = m2.lock();
            panic!("poison");
        })
        .join();
        *m.lock() += 1;
        assert_eq!(*m.lock(), 2);
    }
}
