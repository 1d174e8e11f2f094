//! Byte bounds of one session, derived from `max_session_buffer_bytes` and
//! `max_streams_per_session`.
//!
//! Each data stream holds four per-direction reservations of `stream_buffer_bytes`: the HTTP/2
//! receive window, the frame being received, the outbound pipe (payload plus
//! [`QUEUE_ITEM_OVERHEAD`] per queued chunk) and the HTTP/2 send buffer. So
//! `stream_buffer_bytes = max_session_buffer_bytes / (4 * max_streams_per_session)`, clamped to
//! 16 KiB..=1 MiB, and the HTTP/2 connection window is `max_session_buffer_bytes`.

use thiserror::Error;

/// Smallest per-direction stream buffer (one maximum-size HTTP/2 frame at the default
/// `SETTINGS_MAX_FRAME_SIZE`).
pub const MIN_STREAM_BUFFER_BYTES: u64 = 16 * 1024;
/// Largest per-direction stream buffer.
pub const MAX_STREAM_BUFFER_BYTES: u64 = 1024 * 1024;
/// Reservations per data stream (receive window, current frame, outbound pipe, send buffer).
pub const RESERVATIONS_PER_STREAM: u64 = 4;
/// Streams per session the config accepts at most.
pub const MAX_STREAMS_PER_SESSION: u32 = 65_536;
/// HTTP/2 flow-control windows are at most 2^31 - 1 bytes (RFC 9113 §6.9.1).
pub const MAX_HTTP2_WINDOW: u64 = (1 << 31) - 1;
/// HTTP/2 frames carry at most this much payload (the protocol default; never raised, so the
/// "current frame" reservation is exact).
pub const MAX_FRAME_BYTES: u32 = 16 * 1024;
/// Bytes charged per queued chunk of the outbound pipe on top of its payload.
pub const QUEUE_ITEM_OVERHEAD: u64 = 64;
/// Floor of the connection cap: `max(4 * max_sessions, 16)`.
pub const MIN_CONNECTIONS: u64 = 16;

/// A configuration the listener refuses to run with.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum BoundsError {
    #[error("max_streams_per_session must be in 1..={MAX_STREAMS_PER_SESSION}")]
    Streams,
    #[error(
        "max_session_buffer_bytes {given} is below max_streams_per_session * 64 KiB = {floor} \
         (four 16 KiB reservations per stream)"
    )]
    BelowFloor { given: u64, floor: u64 },
    #[error(
        "max_session_buffer_bytes {given} exceeds the largest HTTP/2 connection window \
         {MAX_HTTP2_WINDOW}"
    )]
    AboveWindow { given: u64 },
}

/// The derived per-session and per-stream byte bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionBounds {
    pub max_session_buffer_bytes: u64,
    pub max_streams_per_session: u32,
    /// Per-direction buffer of one data stream.
    pub stream_buffer_bytes: u64,
}

impl SessionBounds {
    pub fn new(
        max_session_buffer_bytes: u64,
        max_streams_per_session: u32,
    ) -> Result<Self, BoundsError> {
        if max_streams_per_session == 0 || max_streams_per_session > MAX_STREAMS_PER_SESSION {
            return Err(BoundsError::Streams);
        }
        let floor =
            u64::from(max_streams_per_session) * RESERVATIONS_PER_STREAM * MIN_STREAM_BUFFER_BYTES;
        if max_session_buffer_bytes < floor {
            return Err(BoundsError::BelowFloor {
                given: max_session_buffer_bytes,
                floor,
            });
        }
        if max_session_buffer_bytes > MAX_HTTP2_WINDOW {
            return Err(BoundsError::AboveWindow {
                given: max_session_buffer_bytes,
            });
        }
        Ok(Self {
            max_session_buffer_bytes,
            max_streams_per_session,
            stream_buffer_bytes: stream_buffer_bytes(
                max_session_buffer_bytes,
                max_streams_per_session,
            ),
        })
    }

    /// HTTP/2 initial stream window (each direction of a data stream).
    pub fn stream_window(&self) -> u32 {
        to_window(self.stream_buffer_bytes)
    }

    /// HTTP/2 connection window: the whole session budget.
    pub fn connection_window(&self) -> u32 {
        to_window(self.max_session_buffer_bytes)
    }

    /// Bytes a pipe chunk of `payload` bytes is charged.
    pub fn pipe_charge(payload: usize) -> u64 {
        payload as u64 + QUEUE_ITEM_OVERHEAD
    }

    /// Whether a chunk of `payload` bytes fits a pipe already holding `charged` bytes. An
    /// empty pipe always accepts one frame-sized chunk so a stream can make progress.
    pub fn pipe_admits(&self, charged: u64, payload: usize) -> bool {
        charged == 0 && payload <= MAX_FRAME_BYTES as usize
            || charged + Self::pipe_charge(payload) <= self.stream_buffer_bytes
    }

    /// Worst-case bytes all streams of one session hold:
    /// `4 * max_streams * stream_buffer_bytes`, never above `max_session_buffer_bytes`
    /// unless the 16 KiB floor of the clamp raised the per-stream buffer (rejected by
    /// [`SessionBounds::new`]).
    pub fn worst_case_bytes(&self) -> u64 {
        RESERVATIONS_PER_STREAM * u64::from(self.max_streams_per_session) * self.stream_buffer_bytes
    }
}

/// `max_session_buffer_bytes / (4 * max_streams_per_session)` clamped to 16 KiB..=1 MiB.
pub fn stream_buffer_bytes(max_session_buffer_bytes: u64, max_streams_per_session: u32) -> u64 {
    let reservations = RESERVATIONS_PER_STREAM * u64::from(max_streams_per_session.max(1));
    (max_session_buffer_bytes / reservations)
        .clamp(MIN_STREAM_BUFFER_BYTES, MAX_STREAM_BUFFER_BYTES)
}

/// Concurrent TCP connections the listener admits: `4 * max_sessions`, at least 16.
pub fn max_connections(max_sessions: u32) -> u64 {
    (4 * u64::from(max_sessions)).max(MIN_CONNECTIONS)
}

fn to_window(bytes: u64) -> u32 {
    u32::try_from(bytes.min(MAX_HTTP2_WINDOW)).unwrap_or(u32::MAX >> 1)
}
