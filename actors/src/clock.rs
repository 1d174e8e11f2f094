//! The actors' clock: monotonic ticks for `protocol`, from tokio's clock so paused-time tests
//! control it.

use std::sync::OnceLock;

use continuum_protocol::time::{Tick, UnixMillis};

static ORIGIN: OnceLock<tokio::time::Instant> = OnceLock::new();

/// Time since the first call in this process (tokio's clock, so `start_paused` tests drive it).
pub fn now_tick() -> Tick {
    let origin = *ORIGIN.get_or_init(tokio::time::Instant::now);
    Tick(tokio::time::Instant::now().saturating_duration_since(origin))
}

/// Wall-clock time for operator-facing timestamps.
pub fn now_unix() -> UnixMillis {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    UnixMillis(ms)
}
