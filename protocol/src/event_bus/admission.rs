//! Session admission across the whole listener: one pre-hello handshake per credential, one
//! live session per `brokers[]` entry (a newer one supersedes), at most `max_sessions`
//! welcomed sessions.
//!
//! The listener calls [`Admission::begin_handshake`] once a session request authenticated,
//! [`Admission::admit`] when its [`ServerSession`](super::ServerSession) reports
//! `Welcomed`, [`Admission::abandon_handshake`] when it was refused or the connection dropped
//! before the hello, and [`Admission::ended`] when a welcomed session closed.

use std::collections::{BTreeMap, BTreeSet};

use super::hello::Refusal;
use super::message::{ClientId, ErrorCode, SessionId};

/// The listener-wide session table (one writer: the listener supervisor).
#[derive(Clone, Debug)]
pub struct Admission {
    max_sessions: usize,
    handshaking: BTreeSet<ClientId>,
    live: BTreeMap<ClientId, SessionId>,
}

impl Admission {
    pub fn new(max_sessions: u32) -> Self {
        Self {
            max_sessions: max_sessions as usize,
            handshaking: BTreeSet::new(),
            live: BTreeMap::new(),
        }
    }

    /// A reload changed `max_sessions`: live sessions stay; new ones wait for room.
    pub fn set_max_sessions(&mut self, max_sessions: u32) {
        self.max_sessions = max_sessions as usize;
    }

    /// Welcomed sessions now.
    pub fn live_count(&self) -> usize {
        self.live.len()
    }

    /// The live session of `id`, if any.
    pub fn live_session(&self, id: &ClientId) -> Option<SessionId> {
        self.live.get(id).copied()
    }

    /// An authenticated session request wants to send its hello: 429 `too_many_sessions` while
    /// another handshake of the same credential is pending, so one stalled client occupies
    /// at most one pre-hello slot.
    pub fn begin_handshake(&mut self, id: &ClientId) -> Result<(), Refusal> {
        if !self.handshaking.insert(id.clone()) {
            return Err(Refusal::new(
                ErrorCode::TooManySessions,
                "another handshake of this credential is in progress",
            ));
        }
        Ok(())
    }

    /// The handshake ended without a welcome (refused, timed out, disconnected).
    pub fn abandon_handshake(&mut self, id: &ClientId) {
        self.handshaking.remove(id);
    }

    /// The hello of `id` was accepted as `session`. Returns the session it supersedes (close
    /// it with `session_superseded`), or 429 `too_many_sessions` when `max_sessions` other
    /// entries hold live sessions.
    pub fn admit(
        &mut self,
        id: &ClientId,
        session: SessionId,
    ) -> Result<Option<SessionId>, Refusal> {
        self.handshaking.remove(id);
        if !self.live.contains_key(id) && self.live.len() >= self.max_sessions {
            return Err(Refusal::new(
                ErrorCode::TooManySessions,
                format!("{} sessions are live (max_sessions)", self.live.len()),
            ));
        }
        Ok(self.live.insert(id.clone(), session))
    }

    /// A welcomed session closed; a no-op when a newer session already replaced it.
    pub fn ended(&mut self, id: &ClientId, session: SessionId) {
        if self.live.get(id) == Some(&session) {
            self.live.remove(id);
        }
    }
}
