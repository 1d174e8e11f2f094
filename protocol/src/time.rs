//! Caller-supplied time. `protocol` reads no clock (see `protocol/clippy.toml`).

use std::time::Duration;

/// A monotonic instant: time since an arbitrary origin chosen by the caller (the process start in
/// production, zero in tests). Used for staleness, backoff and ageing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Tick(pub Duration);

impl Tick {
    pub const ZERO: Tick = Tick(Duration::ZERO);

    pub fn from_millis(ms: u64) -> Self {
        Self(Duration::from_millis(ms))
    }

    /// Time elapsed since `earlier`, zero if `earlier` is in the future.
    #[inline]
    pub fn since(self, earlier: Tick) -> Duration {
        self.0.saturating_sub(earlier.0)
    }

    #[inline]
    pub fn plus(self, d: Duration) -> Tick {
        Tick(self.0.saturating_add(d))
    }
}

/// Wall-clock time as Unix milliseconds, for operator-facing timestamps (`first_seen`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct UnixMillis(pub u64);
