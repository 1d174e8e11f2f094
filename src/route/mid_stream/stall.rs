//! The inactivity timeout of an armed stream, checked lazily (issue 31's CPU goal): no clock
//! read and no timer change per relayed event.

use std::pin::Pin;
use std::task::{Poll, Waker};
use std::time::Duration;

use tokio::time::{Instant, Sleep};

/// Inactivity slices per timeout (see [`Stall`]).
const STALL_SLICES: u32 = 8;

/// The inactivity timeout, checked lazily: no clock read and no timer change per event. The
/// timer ticks every `timeout / STALL_SLICES` while the stream waits; a tick with no upstream
/// frame since the previous one counts as quiet, and [`STALL_SLICES`] quiet ticks in a row are a
/// stall. A stall is so never declared before `timeout` without a frame, and at most one slice
/// after it. The timer is polled (its waker registered) only after it was reset or when the
/// waker changed, and is read (`is_elapsed`, one atomic load) on every other wait.
pub(super) struct Stall {
    sleep: Pin<Box<Sleep>>,
    slice: Duration,
    /// A frame (or the wait's start) since the last tick.
    seen: bool,
    /// Quiet ticks in a row.
    quiet: u32,
    /// The waker the timer holds (`None`: it holds none or another one).
    waker: Option<Waker>,
}

impl Stall {
    pub(super) fn new(timeout: Duration) -> Self {
        let slice = timeout / STALL_SLICES;
        Self {
            sleep: Box::pin(tokio::time::sleep(slice)),
            slice,
            seen: true,
            quiet: 0,
            waker: None,
        }
    }

    /// A frame came: the stream is not stalled.
    pub(super) fn frame(&mut self) {
        self.seen = true;
    }

    /// A new wait (after a continuation started): counts from now.
    pub(super) fn restart(&mut self) {
        self.seen = true;
        self.quiet = 0;
    }

    /// Called while the upstream is pending: `Ready` once the stream counts as stalled.
    pub(super) fn poll(&mut self, cx: &mut std::task::Context<'_>) -> Poll<()> {
        loop {
            let holds_waker = self.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker()));
            if holds_waker && !self.sleep.is_elapsed() {
                return Poll::Pending;
            }
            if self.sleep.as_mut().poll(cx).is_pending() {
                if !holds_waker {
                    self.waker = Some(cx.waker().clone());
                }
                return Poll::Pending;
            }
            // A slice ended.
            self.quiet = if self.seen { 0 } else { self.quiet + 1 };
            self.seen = false;
            if self.quiet >= STALL_SLICES {
                self.restart();
                return Poll::Ready(());
            }
            self.sleep.as_mut().reset(Instant::now() + self.slice);
            // A reset timer holds no waker until it is polled.
            self.waker = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lazy inactivity check: frames keep a stream alive however long it runs; silence is a
    /// stall after the timeout, never before it, and at most one slice (plus the polling step)
    /// after it (paused clock: the numbers are the logic's, not the machine's speed).
    #[tokio::test(start_paused = true)]
    async fn a_stall_is_declared_after_the_timeout_and_never_before() {
        let timeout = Duration::from_secs(8);
        let step = Duration::from_millis(100);
        let mut stall = Stall::new(timeout);
        let waker = futures::task::noop_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        for _ in 0..40 {
            assert!(stall.poll(&mut cx).is_pending(), "a frame every 3 s");
            tokio::time::advance(Duration::from_secs(3)).await;
            stall.frame();
        }
        let silent = until_stalled(&mut stall, &mut cx, step).await;
        assert!(silent >= timeout, "{silent:?}");
        assert!(
            silent <= timeout + timeout / STALL_SLICES + step,
            "{silent:?}"
        );
        // After a stall (and a continuation) the count starts again.
        let again = until_stalled(&mut stall, &mut cx, step).await;
        assert!(again >= timeout, "{again:?}");
    }

    /// Polls `stall` every `step` of the paused clock until it reports the stall (at most
    /// 10 000 steps); returns how long that took.
    async fn until_stalled(
        stall: &mut Stall,
        cx: &mut std::task::Context<'_>,
        step: Duration,
    ) -> Duration {
        let start = Instant::now();
        for _ in 0..10_000 {
            if stall.poll(cx).is_ready() {
                return start.elapsed();
            }
            tokio::time::advance(step).await;
        }
        panic!("no stall after {:?}", start.elapsed());
    }
}
