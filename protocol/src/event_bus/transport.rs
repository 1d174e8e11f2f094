//! Listener connection rules that need no socket: the first-byte check, the plaintext refusal,
//! and the per-connection deadlines (`auth_timeout`, the 30 s close after the last request).

use std::time::Duration;

use super::message::{ErrorBody, ErrorCode};
use crate::time::Tick;

/// A TLS handshake must finish within this.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// HTTP/2 keepalive PING interval.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(20);
/// A connection must have a 2xx session or stream request accepted within this after the
/// handshake.
pub const AUTH_TIMEOUT: Duration = Duration::from_secs(10);
/// A connection closes this long after its last accepted request ended.
pub const CONNECTION_LINGER: Duration = Duration::from_secs(30);
/// A listener that failed to start retries after this.
pub const STARTUP_RETRY: Duration = Duration::from_secs(30);

/// The first byte of a TLS record carrying a handshake.
const TLS_HANDSHAKE: u8 = 0x16;

/// What the first byte of a connection says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FirstByte {
    /// `0x16`: proceed with the TLS handshake.
    Tls,
    /// An ASCII letter (likely plaintext HTTP): write [`plaintext_refusal`], then close.
    PlaintextLetter,
    /// Anything else: close without writing (`tls_required`).
    Other,
}

pub fn classify_first_byte(byte: u8) -> FirstByte {
    match byte {
        TLS_HANDSHAKE => FirstByte::Tls,
        b if b.is_ascii_alphabetic() => FirstByte::PlaintextLetter,
        _ => FirstByte::Other,
    }
}

/// The best-effort plaintext answer to a non-TLS client: `HTTP/1.1 403` with the
/// `tls_required` error body, `Connection: close`.
pub fn plaintext_refusal() -> Vec<u8> {
    let body = ErrorBody::new(
        ErrorCode::TlsRequired,
        "the event bus listener speaks TLS 1.3 with HTTP/2 only",
    )
    .encode();
    let mut response = format!(
        "HTTP/1.1 403 Forbidden\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    response.extend_from_slice(&body);
    response
}

/// The deadlines of one TLS connection after its handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionTimers {
    /// Until the first accepted request: when `auth_timeout` fires.
    auth_deadline: Option<Tick>,
    /// Accepted requests still running.
    in_flight: u32,
    /// When the last accepted request ended (linger starts), if none is running.
    idle_since: Option<Tick>,
}

impl ConnectionTimers {
    /// The TLS handshake finished at `now`.
    pub fn new(now: Tick) -> Self {
        Self {
            auth_deadline: Some(now.plus(AUTH_TIMEOUT)),
            in_flight: 0,
            idle_since: None,
        }
    }

    /// A session or stream request was answered 2xx.
    pub fn request_accepted(&mut self) {
        self.auth_deadline = None;
        self.in_flight = self.in_flight.saturating_add(1);
        self.idle_since = None;
    }

    /// An accepted request ended at `now`.
    pub fn request_ended(&mut self, now: Tick) {
        self.in_flight = self.in_flight.saturating_sub(1);
        if self.in_flight == 0 && self.auth_deadline.is_none() {
            self.idle_since = Some(now);
        }
    }

    /// When the connection must be closed, and why (`None`: not while requests run).
    pub fn deadline(&self) -> Option<(Tick, ErrorCode)> {
        if let Some(deadline) = self.auth_deadline {
            return Some((deadline, ErrorCode::AuthTimeout));
        }
        self.idle_since
            .map(|since| (since.plus(CONNECTION_LINGER), ErrorCode::IdleTimeout))
    }

    /// Whether the connection must be closed at `now`, and why.
    pub fn expired(&self, now: Tick) -> Option<ErrorCode> {
        self.deadline()
            .and_then(|(deadline, code)| (now >= deadline).then_some(code))
    }
}
