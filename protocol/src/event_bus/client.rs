//! The agent's end of one control session (continuum-event-broker, continuum-kv-listener),
//! sans-IO (events in, actions out).
//!
//! The agent opens `POST /bus/v1/session` with its credential and `continuum-bus-version`,
//! writes [`ClientSession::poll_transmit`] (the hello first) to the request body and feeds the
//! response body to [`ClientSession::handle_input`]. A non-2xx answer goes to
//! [`ClientSession::refused`]. The session:
//! 1. waits up to [`WELCOME_TIMEOUT`] for a welcome at a version the hello offered, with sane
//!    limits;
//! 2. answers each `subscribe` with [`ClientEvent::OpenStream`] (open
//!    `POST /bus/v1/streams/{stream_id}` and relay the target) or, when the target does not fit
//!    the hello, the client is draining or at its stream cap, a `stream_closed` line. Stream IDs
//!    must strictly increase, so no ID is ever opened twice;
//! 3. `unsubscribe` becomes [`ClientEvent::CloseStream`]; a relay that ends is reported with
//!    [`ClientSession::stream_closed`];
//! 4. sends `heartbeat` every welcomed `heartbeat_interval_ms`, acks the router's, and gives up
//!    with `idle_timeout` when nothing arrives for `idle_timeout_ms`;
//! 5. [`ClientSession::drain`] sends `draining` on shutdown.

use std::collections::{BTreeSet, VecDeque};
use std::time::Duration;

use thiserror::Error;

use super::MAX_LINE_BYTES;
use super::bounds::{MAX_STREAM_BUFFER_BYTES, MIN_STREAM_BUFFER_BYTES};
use super::message::{
    AnnouncedSourceTarget, DecodeError, ErrorBody, ErrorCode, Hello, Message, Role,
    StreamCloseReason, StreamClosed, StreamId, StreamTarget, Welcome, truncate_text,
};
use super::ndjson::LineDecoder;
use crate::ids::Namespace;
use crate::time::Tick;

/// How long the agent waits for the welcome after sending its hello.
pub const WELCOME_TIMEOUT: Duration = Duration::from_secs(10);

/// What the agent must act on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClientEvent {
    Welcomed(Welcome),
    /// Open the data stream for `stream_id` and relay `target` over it.
    OpenStream {
        stream_id: StreamId,
        target: StreamTarget,
    },
    /// The router unsubscribed: stop relaying and end the data stream.
    CloseStream(StreamId),
    /// The session is over (refused, closed by the router, or given up locally). End every
    /// data stream; reconnect with backoff unless the code is final for this credential.
    Closed {
        code: ErrorCode,
        message: Option<String>,
    },
}

/// A hello this client cannot send.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("invalid hello: {0}")]
pub struct InvalidHello(pub DecodeError);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    AwaitingWelcome { deadline: Tick },
    Live,
    Closed,
}

/// One control session as seen by the agent.
#[derive(Debug)]
pub struct ClientSession {
    role: Role,
    versions: Vec<u32>,
    namespaces: BTreeSet<Namespace>,
    backends: BTreeSet<String>,
    phase: Phase,
    welcome: Option<Welcome>,
    draining: bool,
    decoder: LineDecoder,
    open: BTreeSet<StreamId>,
    last_stream: StreamId,
    last_rx: Tick,
    next_heartbeat: Tick,
    heartbeat_seq: u64,
    transmit: Vec<u8>,
    events: VecDeque<ClientEvent>,
    /// Subscribes answered with `stream_closed` by the session itself (not yet taken).
    refusals: Vec<StreamCloseReason>,
}

impl ClientSession {
    /// Starts a session; the hello is the first transmit.
    pub fn new(hello: Hello, now: Tick) -> Result<Self, InvalidHello> {
        hello.check().map_err(InvalidHello)?;
        let mut session = Self {
            role: hello.role,
            versions: hello.versions.clone(),
            namespaces: hello.dynamo_namespaces.iter().cloned().collect(),
            backends: hello.sources.iter().map(|s| s.backend.clone()).collect(),
            phase: Phase::AwaitingWelcome {
                deadline: now.plus(WELCOME_TIMEOUT),
            },
            welcome: None,
            draining: false,
            decoder: LineDecoder::new(MAX_LINE_BYTES),
            open: BTreeSet::new(),
            last_stream: StreamId(0),
            last_rx: now,
            next_heartbeat: now,
            heartbeat_seq: 0,
            transmit: Vec::new(),
            events: VecDeque::new(),
            refusals: Vec::new(),
        };
        session.send(&Message::Hello(hello));
        Ok(session)
    }

    pub fn welcome(&self) -> Option<&Welcome> {
        self.welcome.as_ref()
    }

    pub fn is_live(&self) -> bool {
        self.phase == Phase::Live
    }

    pub fn is_closed(&self) -> bool {
        self.phase == Phase::Closed
    }

    /// Streams the agent relays now.
    pub fn open_streams(&self) -> impl Iterator<Item = StreamId> + '_ {
        self.open.iter().copied()
    }

    /// Feeds bytes of the response body.
    pub fn handle_input(&mut self, mut input: &[u8], now: Tick) {
        while !input.is_empty() && self.phase != Phase::Closed {
            match self.decoder.decode(input) {
                Ok((consumed, line)) => {
                    input = &input[consumed..];
                    if let Some(line) = line {
                        self.handle_line(&line, now);
                    }
                }
                Err(error) => {
                    return self.finish(ErrorCode::ProtocolError, Some(error.to_string()));
                }
            }
        }
    }

    /// The router ended the response body.
    pub fn handle_end_of_input(&mut self) {
        self.finish(ErrorCode::PeerClosed, None);
    }

    /// The session request was answered with a non-2xx `status` and `body`.
    pub fn refused(&mut self, status: u16, body: &[u8]) {
        let (code, message) = match ErrorBody::decode(body) {
            Some(body) => (body.error.code, Some(body.error.message)),
            None => (ErrorCode::Unknown, Some(format!("HTTP status {status}"))),
        };
        self.finish(code, message);
    }

    /// Advances timers; call at [`ClientSession::poll_timeout`].
    pub fn handle_timeout(&mut self, now: Tick) {
        match self.phase {
            Phase::AwaitingWelcome { deadline } => {
                if now >= deadline {
                    self.finish(
                        ErrorCode::HelloTimeout,
                        Some("no welcome in time".to_owned()),
                    );
                }
            }
            Phase::Live => {
                let Some(welcome) = &self.welcome else { return };
                let idle = Duration::from_millis(welcome.idle_timeout_ms);
                let interval = Duration::from_millis(welcome.heartbeat_interval_ms);
                if now >= self.last_rx.plus(idle) {
                    return self.finish(ErrorCode::IdleTimeout, None);
                }
                if now >= self.next_heartbeat {
                    self.heartbeat_seq += 1;
                    self.send(&Message::Heartbeat {
                        seq: self.heartbeat_seq,
                    });
                    self.next_heartbeat = now.plus(interval);
                }
            }
            Phase::Closed => {}
        }
    }

    pub fn poll_timeout(&self) -> Option<Tick> {
        match self.phase {
            Phase::AwaitingWelcome { deadline } => Some(deadline),
            Phase::Live => {
                let welcome = self.welcome.as_ref()?;
                let idle = self
                    .last_rx
                    .plus(Duration::from_millis(welcome.idle_timeout_ms));
                Some(idle.min(self.next_heartbeat))
            }
            Phase::Closed => None,
        }
    }

    /// A relay ended or failed to start; tells the router. `false` if it was not open.
    pub fn stream_closed(
        &mut self,
        stream_id: StreamId,
        reason: StreamCloseReason,
        message: Option<String>,
    ) -> bool {
        if self.phase != Phase::Live || !self.open.remove(&stream_id) {
            return false;
        }
        self.send_stream_closed(stream_id, reason, message);
        true
    }

    /// Announces shutdown: the router places nothing new here; later subscribes are refused
    /// with `draining`. Open streams keep running until the router unsubscribes them or the
    /// agent ends them.
    pub fn drain(&mut self) {
        if self.draining || self.phase == Phase::Closed {
            return;
        }
        self.draining = true;
        if self.phase == Phase::Live {
            self.send(&Message::Draining);
        }
    }

    /// Bytes to write to the request body, in order.
    pub fn poll_transmit(&mut self) -> Option<Vec<u8>> {
        (!self.transmit.is_empty()).then(|| std::mem::take(&mut self.transmit))
    }

    pub fn poll_event(&mut self) -> Option<ClientEvent> {
        self.events.pop_front()
    }

    /// The reasons of the subscribes this session refused on its own (target outside the
    /// hello, draining, at the stream cap) since the last call, for the agent's counters.
    pub fn take_refusals(&mut self) -> Vec<StreamCloseReason> {
        std::mem::take(&mut self.refusals)
    }

    fn handle_line(&mut self, line: &[u8], now: Tick) {
        let message = match Message::decode(line) {
            Ok(message) => message,
            Err(error) => return self.finish(ErrorCode::ProtocolError, Some(error.to_string())),
        };
        self.last_rx = now;
        match self.phase {
            Phase::AwaitingWelcome { .. } => self.handle_welcome(message, now),
            Phase::Live => self.handle_live(message),
            Phase::Closed => {}
        }
    }

    fn handle_welcome(&mut self, message: Message, now: Tick) {
        let welcome = match message {
            Message::Welcome(welcome) => welcome,
            Message::Closed(closed) => return self.finish(closed.code, closed.message),
            other => {
                let text = format!("expected a welcome, got {}", other.kind());
                return self.finish(ErrorCode::ProtocolError, Some(text));
            }
        };
        if let Err(problem) = self.check_welcome(&welcome) {
            return self.finish(ErrorCode::ProtocolError, Some(problem.to_owned()));
        }
        self.phase = Phase::Live;
        self.next_heartbeat = now.plus(Duration::from_millis(welcome.heartbeat_interval_ms));
        self.welcome = Some(welcome.clone());
        self.events.push_back(ClientEvent::Welcomed(welcome));
        if self.draining {
            self.send(&Message::Draining);
        }
    }

    fn check_welcome(&self, welcome: &Welcome) -> Result<(), &'static str> {
        if !self.versions.contains(&welcome.version) {
            return Err("welcome names a version the hello did not offer");
        }
        if welcome.heartbeat_interval_ms == 0
            || welcome.idle_timeout_ms <= welcome.heartbeat_interval_ms
        {
            return Err("welcome timers are not 0 < heartbeat_interval_ms < idle_timeout_ms");
        }
        if welcome.max_streams == 0 {
            return Err("welcome max_streams is 0");
        }
        if !(MIN_STREAM_BUFFER_BYTES..=MAX_STREAM_BUFFER_BYTES)
            .contains(&welcome.stream_buffer_bytes)
        {
            return Err("welcome stream_buffer_bytes is outside 16 KiB..=1 MiB");
        }
        Ok(())
    }

    fn handle_live(&mut self, message: Message) {
        match message {
            Message::Subscribe(subscribe) => {
                let stream_id = subscribe.stream_id;
                if stream_id <= self.last_stream {
                    let text = format!("stream_id {stream_id} is not above {}", self.last_stream);
                    return self.finish(ErrorCode::ProtocolError, Some(text));
                }
                self.last_stream = stream_id;
                match self.admit(&subscribe.target) {
                    Ok(()) => {
                        self.open.insert(stream_id);
                        self.events.push_back(ClientEvent::OpenStream {
                            stream_id,
                            target: subscribe.target,
                        });
                    }
                    Err(reason) => {
                        self.refusals.push(reason);
                        self.send_stream_closed(stream_id, reason, None);
                    }
                }
            }
            Message::Unsubscribe { stream_id } => {
                if self.open.remove(&stream_id) {
                    self.events.push_back(ClientEvent::CloseStream(stream_id));
                }
            }
            Message::Heartbeat { seq } => self.send(&Message::HeartbeatAck { seq }),
            Message::HeartbeatAck { .. } => {}
            Message::Closed(closed) => self.finish(closed.code, closed.message),
            other @ (Message::Hello(_)
            | Message::Welcome(_)
            | Message::StreamClosed(_)
            | Message::Draining) => {
                let text = format!("a router does not send {} here", other.kind());
                self.finish(ErrorCode::ProtocolError, Some(text));
            }
        }
    }

    /// Whether a commanded target fits this client's hello and state.
    fn admit(&self, target: &StreamTarget) -> Result<(), StreamCloseReason> {
        if self.draining {
            return Err(StreamCloseReason::Draining);
        }
        match (self.role, target) {
            (Role::Broker, StreamTarget::ZmqTcp { target, .. }) => {
                if !self.namespaces.contains(&target.namespace) {
                    return Err(StreamCloseReason::InvalidTarget);
                }
            }
            (
                Role::KvListener,
                StreamTarget::AnnouncedSource(AnnouncedSourceTarget { backend, .. }),
            ) => {
                if !self.backends.contains(backend) {
                    return Err(StreamCloseReason::TargetNotAdvertised);
                }
            }
            _ => return Err(StreamCloseReason::InvalidTarget),
        }
        let cap = self.welcome.as_ref().map_or(0, |w| w.max_streams as usize);
        if self.open.len() >= cap {
            return Err(StreamCloseReason::StreamLimit);
        }
        Ok(())
    }

    fn send_stream_closed(
        &mut self,
        stream_id: StreamId,
        reason: StreamCloseReason,
        message: Option<String>,
    ) {
        let message = message.map(|mut m| {
            truncate_text(&mut m);
            m
        });
        self.send(&Message::StreamClosed(StreamClosed {
            stream_id,
            reason,
            message,
        }));
    }

    fn finish(&mut self, code: ErrorCode, message: Option<String>) {
        if self.phase == Phase::Closed {
            return;
        }
        self.phase = Phase::Closed;
        self.open.clear();
        let message = message.map(|mut m| {
            truncate_text(&mut m);
            m
        });
        self.events.push_back(ClientEvent::Closed { code, message });
    }

    fn send(&mut self, message: &Message) {
        self.transmit.extend_from_slice(&message.encode());
    }
}
