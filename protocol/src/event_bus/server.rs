//! The router's end of one control session, sans-IO (events in, actions out).
//!
//! The listener authenticates the `POST /bus/v1/session` request and parses
//! `continuum-bus-version` before it builds a [`ServerSession`]; the session then:
//! 1. waits up to [`HELLO_TIMEOUT`] for the first line, which must be a hello passing
//!    [`Hello::validate`](super::message::Hello) against the credential's [`Grant`]. It reports
//!    [`ServerEvent::HelloAccepted`] or [`ServerEvent::Refused`] (answer the code's HTTP status
//!    with an [`ErrorBody`](super::ErrorBody); nothing was transmitted). After an accepted
//!    hello the listener consults its [`Admission`](super::admission::Admission) table and
//!    calls [`ServerSession::welcome`] (answer 200; the welcome line is the first transmit) or
//!    [`ServerSession::close`] (a refusal, e.g. 429 `too_many_sessions`);
//! 2. once live, numbers streams from 1 and commands them with [`ServerSession::subscribe`];
//!    [`ServerSession::accept_stream`] admits a data stream only for a commanded, unopened ID
//!    of this session, from the owning credential, at the negotiated version, exactly once;
//!    a commanded stream not opened within [`STREAM_OPEN_TIMEOUT`] is unsubscribed;
//! 3. sends `heartbeat` every `heartbeat_interval`, answers the client's heartbeats, and closes
//!    with `idle_timeout` when nothing arrives for `idle_timeout`;
//! 4. on `draining` stops placement (and unsubscribes every stream of a kv_listener, so its
//!    consumers fail over at once);
//! 5. ends with a `closed` line ([`ServerSession::close`]) or on protocol errors.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use thiserror::Error;

use super::MAX_LINE_BYTES;
use super::bounds::SessionBounds;
use super::hello::{AcceptedHello, Coverage, Grant, Refusal};
use super::message::{
    ClientId, Closed, ErrorCode, Message, SessionId, StreamCloseReason, StreamId, StreamTarget,
    Subscribe, Welcome,
};
use super::ndjson::LineDecoder;
use crate::time::Tick;

/// How long the router waits for the hello after accepting the session request.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a commanded stream may stay unopened.
pub const STREAM_OPEN_TIMEOUT: Duration = Duration::from_secs(30);

/// Per-session settings (from `dynamo.event_bus`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerConfig {
    pub hello_timeout: Duration,
    pub heartbeat_interval: Duration,
    pub idle_timeout: Duration,
    pub stream_open_timeout: Duration,
    pub bounds: SessionBounds,
    pub max_line_bytes: usize,
}

impl ServerConfig {
    pub fn new(
        heartbeat_interval: Duration,
        idle_timeout: Duration,
        bounds: SessionBounds,
    ) -> Self {
        Self {
            hello_timeout: HELLO_TIMEOUT,
            heartbeat_interval,
            idle_timeout,
            stream_open_timeout: STREAM_OPEN_TIMEOUT,
            bounds,
            max_line_bytes: MAX_LINE_BYTES,
        }
    }
}

/// What the listener must act on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServerEvent {
    /// The hello is valid: call [`ServerSession::welcome`] if admission allows, else
    /// [`ServerSession::close`] with the admission's refusal code.
    HelloAccepted(AcceptedHello),
    /// Answer the session request with the refusal's status and error body; the session is over.
    Refused(Refusal),
    /// A commanded data stream was accepted.
    StreamOpened(StreamId),
    /// The client closed a commanded stream, or the router unsubscribed it on `draining`.
    StreamClosed {
        stream_id: StreamId,
        reason: StreamCloseReason,
    },
    /// A commanded stream was not opened in time; it was unsubscribed.
    StreamOpenTimedOut(StreamId),
    /// The client announced it is draining: place nothing new on this session.
    Draining,
    /// The welcomed session ended; flush the transmit bytes, then end the response.
    Closed(ErrorCode),
}

/// Why [`ServerSession::subscribe`] placed nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum SubscribeError {
    #[error("the session is not welcomed or already closed")]
    NotLive,
    #[error("the client is draining")]
    Draining,
    #[error("the session already carries max_streams_per_session streams")]
    TooManyStreams,
    #[error("the session does not cover the target")]
    NotCovered,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    AwaitingHello {
        deadline: Tick,
    },
    /// The hello passed validation; waiting for the listener's admission decision.
    Validated {
        deadline: Tick,
    },
    Live,
    Closed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StreamPhase {
    Commanded { deadline: Tick },
    Open,
}

/// One control session as seen by the router.
#[derive(Debug)]
pub struct ServerSession {
    grant: Grant,
    header_version: u32,
    session_id: SessionId,
    config: ServerConfig,
    phase: Phase,
    accepted: Option<AcceptedHello>,
    draining: bool,
    decoder: LineDecoder,
    streams: BTreeMap<StreamId, StreamPhase>,
    next_stream: u64,
    last_rx: Tick,
    next_heartbeat: Tick,
    heartbeat_seq: u64,
    transmit: Vec<u8>,
    events: VecDeque<ServerEvent>,
}

impl ServerSession {
    /// `grant` is the authenticated credential's entry, `header_version` the parsed
    /// `continuum-bus-version`, `session_id` drawn from a CSPRNG by the caller.
    pub fn new(
        grant: Grant,
        header_version: u32,
        session_id: SessionId,
        config: ServerConfig,
        now: Tick,
    ) -> Self {
        Self {
            grant,
            header_version,
            session_id,
            decoder: LineDecoder::new(config.max_line_bytes),
            phase: Phase::AwaitingHello {
                deadline: now.plus(config.hello_timeout),
            },
            config,
            accepted: None,
            draining: false,
            streams: BTreeMap::new(),
            next_stream: 1,
            last_rx: now,
            next_heartbeat: now,
            heartbeat_seq: 0,
            transmit: Vec::new(),
            events: VecDeque::new(),
        }
    }

    pub fn session_id(&self) -> SessionId {
        self.session_id
    }

    pub fn grant(&self) -> &Grant {
        &self.grant
    }

    /// The validated hello (once accepted).
    pub fn accepted(&self) -> Option<&AcceptedHello> {
        self.accepted.as_ref()
    }

    pub fn is_live(&self) -> bool {
        self.phase == Phase::Live
    }

    pub fn is_closed(&self) -> bool {
        self.phase == Phase::Closed
    }

    pub fn is_draining(&self) -> bool {
        self.draining
    }

    /// Streams commanded or open now.
    pub fn stream_count(&self) -> usize {
        self.streams.len()
    }

    /// Whether a new stream for `target` may be placed here now.
    pub fn can_place(&self, target: &StreamTarget) -> bool {
        self.check_placement(target).is_ok()
    }

    /// Feeds bytes of the request body.
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
                    self.fail(error.to_string());
                    return;
                }
            }
        }
    }

    /// The client ended the request body.
    pub fn handle_end_of_input(&mut self) {
        match self.phase {
            Phase::AwaitingHello { .. } | Phase::Validated { .. } => self.refuse(Refusal::new(
                ErrorCode::InvalidHello,
                "the request body ended before the welcome",
            )),
            Phase::Live => self.finish(ErrorCode::PeerClosed),
            Phase::Closed => {}
        }
    }

    /// Advances timers; call at [`ServerSession::poll_timeout`] (earlier is harmless).
    pub fn handle_timeout(&mut self, now: Tick) {
        match self.phase {
            Phase::AwaitingHello { deadline } | Phase::Validated { deadline } => {
                if now >= deadline {
                    self.refuse(Refusal::new(
                        ErrorCode::HelloTimeout,
                        "no hello within the handshake deadline",
                    ));
                }
            }
            Phase::Live => {
                if now >= self.last_rx.plus(self.config.idle_timeout) {
                    self.close(ErrorCode::IdleTimeout, None);
                    return;
                }
                let expired: Vec<StreamId> = self
                    .streams
                    .iter()
                    .filter(|(_, phase)| {
                        matches!(phase, StreamPhase::Commanded { deadline } if now >= *deadline)
                    })
                    .map(|(id, _)| *id)
                    .collect();
                for stream_id in expired {
                    self.streams.remove(&stream_id);
                    self.send(&Message::Unsubscribe { stream_id });
                    self.events
                        .push_back(ServerEvent::StreamOpenTimedOut(stream_id));
                }
                if now >= self.next_heartbeat {
                    self.heartbeat_seq += 1;
                    self.send(&Message::Heartbeat {
                        seq: self.heartbeat_seq,
                    });
                    self.next_heartbeat = now.plus(self.config.heartbeat_interval);
                }
            }
            Phase::Closed => {}
        }
    }

    /// The earliest instant [`ServerSession::handle_timeout`] has work to do.
    pub fn poll_timeout(&self) -> Option<Tick> {
        match self.phase {
            Phase::AwaitingHello { deadline } | Phase::Validated { deadline } => Some(deadline),
            Phase::Live => {
                let idle = self.last_rx.plus(self.config.idle_timeout);
                let open = self.streams.values().filter_map(|phase| match phase {
                    StreamPhase::Commanded { deadline } => Some(*deadline),
                    StreamPhase::Open => None,
                });
                open.chain([idle, self.next_heartbeat]).min()
            }
            Phase::Closed => None,
        }
    }

    /// Admission allowed the accepted hello: the session goes live and the welcome line is the
    /// first transmit. `false` (and nothing happens) unless a hello was accepted and is
    /// awaiting this decision.
    pub fn welcome(&mut self, now: Tick) -> bool {
        let (Phase::Validated { .. }, Some(accepted)) = (self.phase, self.accepted.as_ref()) else {
            return false;
        };
        let bounds = self.config.bounds;
        let welcome = Welcome {
            session_id: self.session_id,
            version: accepted.version,
            heartbeat_interval_ms: duration_ms(self.config.heartbeat_interval),
            idle_timeout_ms: duration_ms(self.config.idle_timeout),
            max_streams: bounds.max_streams_per_session,
            stream_buffer_bytes: bounds.stream_buffer_bytes,
            max_line_bytes: self.config.max_line_bytes as u64,
        };
        self.send(&Message::Welcome(welcome));
        self.phase = Phase::Live;
        self.last_rx = now;
        self.next_heartbeat = now.plus(self.config.heartbeat_interval);
        true
    }

    /// A reload changed the credential's entry: the session keeps running only if its role,
    /// id and declared namespaces or announced backends still fit the new grant; otherwise it
    /// closes with `forbidden`. Returns whether it still runs.
    pub fn regrant(&mut self, grant: Grant) -> bool {
        let fits = self.accepted.as_ref().is_none_or(|accepted| {
            accepted.role == grant.role
                && accepted.client_id == grant.id
                && match &accepted.coverage {
                    Coverage::Namespaces(set) => {
                        grant.namespaces.is_empty() || set.is_subset(&grant.namespaces)
                    }
                    Coverage::Backends(set) => set.is_subset(&grant.backends),
                }
        });
        self.grant = grant;
        if !fits {
            self.close(
                ErrorCode::Forbidden,
                Some("the credential's grant no longer covers this session".to_owned()),
            );
        }
        !self.is_closed()
    }

    /// Commands a new stream; the returned ID is the only one [`ServerSession::accept_stream`]
    /// will admit for it.
    pub fn subscribe(
        &mut self,
        target: StreamTarget,
        now: Tick,
    ) -> Result<StreamId, SubscribeError> {
        self.check_placement(&target)?;
        let stream_id = StreamId(self.next_stream);
        self.next_stream += 1;
        self.streams.insert(
            stream_id,
            StreamPhase::Commanded {
                deadline: now.plus(self.config.stream_open_timeout),
            },
        );
        self.send(&Message::Subscribe(Subscribe { stream_id, target }));
        Ok(stream_id)
    }

    /// Stops a stream (its consumer went away). `false` if it was not commanded or open.
    pub fn unsubscribe(&mut self, stream_id: StreamId) -> bool {
        if self.phase != Phase::Live || self.streams.remove(&stream_id).is_none() {
            return false;
        }
        self.send(&Message::Unsubscribe { stream_id });
        true
    }

    /// Admits a `POST /bus/v1/streams/{stream_id}` request of this session: 403 `forbidden`
    /// for another credential, 400 `unsupported_protocol_version` for another version,
    /// 409 `duplicate_stream` when it is already open, 404 `unknown_stream` otherwise unless
    /// it was commanded and not yet opened.
    pub fn accept_stream(
        &mut self,
        stream_id: StreamId,
        client_id: &ClientId,
        version: u32,
    ) -> Result<(), Refusal> {
        let Some(accepted) = self.accepted.as_ref().filter(|_| self.phase == Phase::Live) else {
            return Err(Refusal::new(
                ErrorCode::UnknownStream,
                "the session is not live",
            ));
        };
        if *client_id != accepted.client_id {
            return Err(Refusal::new(
                ErrorCode::Forbidden,
                "the stream belongs to another credential's session",
            ));
        }
        if version != accepted.version {
            return Err(Refusal::new(
                ErrorCode::UnsupportedProtocolVersion,
                format!(
                    "data streams of this session speak version {}",
                    accepted.version
                ),
            ));
        }
        match self.streams.get_mut(&stream_id) {
            Some(phase @ StreamPhase::Commanded { .. }) => {
                *phase = StreamPhase::Open;
                self.events.push_back(ServerEvent::StreamOpened(stream_id));
                Ok(())
            }
            Some(StreamPhase::Open) => Err(Refusal::new(
                ErrorCode::DuplicateStream,
                "the stream is already open",
            )),
            None => Err(Refusal::new(
                ErrorCode::UnknownStream,
                "no such commanded stream in this session",
            )),
        }
    }

    /// An accepted data stream ended (either side). `false` if it was not open.
    pub fn stream_ended(&mut self, stream_id: StreamId) -> bool {
        if self.streams.get(&stream_id) == Some(&StreamPhase::Open) {
            self.streams.remove(&stream_id);
            true
        } else {
            false
        }
    }

    /// Ends the session: before the welcome as a refusal, after it with a `closed` line
    /// (superseded, revoked, forbidden after a reload, shutdown, idle).
    pub fn close(&mut self, code: ErrorCode, message: Option<String>) {
        match self.phase {
            Phase::AwaitingHello { .. } | Phase::Validated { .. } => {
                self.refuse(Refusal::new(code, message.unwrap_or_default()));
            }
            Phase::Live => {
                self.send(&Message::Closed(Closed {
                    code,
                    message: message.map(|mut m| {
                        super::message::truncate_text(&mut m);
                        m
                    }),
                }));
                self.finish(code);
            }
            Phase::Closed => {}
        }
    }

    /// Bytes to write to the response body, in order.
    pub fn poll_transmit(&mut self) -> Option<Vec<u8>> {
        (!self.transmit.is_empty()).then(|| std::mem::take(&mut self.transmit))
    }

    pub fn poll_event(&mut self) -> Option<ServerEvent> {
        self.events.pop_front()
    }

    fn check_placement(&self, target: &StreamTarget) -> Result<(), SubscribeError> {
        let accepted = match (&self.phase, &self.accepted) {
            (Phase::Live, Some(accepted)) => accepted,
            _ => return Err(SubscribeError::NotLive),
        };
        if self.draining {
            return Err(SubscribeError::Draining);
        }
        if target.role() != accepted.role || !accepted.coverage.covers(target) {
            return Err(SubscribeError::NotCovered);
        }
        if self.streams.len() >= self.config.bounds.max_streams_per_session as usize {
            return Err(SubscribeError::TooManyStreams);
        }
        Ok(())
    }

    fn handle_line(&mut self, line: &[u8], now: Tick) {
        let message = match Message::decode(line) {
            Ok(message) => message,
            Err(error) => return self.fail(error.to_string()),
        };
        match self.phase {
            Phase::AwaitingHello { .. } => self.handle_hello(message),
            Phase::Validated { .. } => self.refuse(Refusal::new(
                ErrorCode::InvalidHello,
                format!("a client waits for the welcome; got {}", message.kind()),
            )),
            Phase::Live => {
                self.last_rx = now;
                self.handle_live(message);
            }
            Phase::Closed => {}
        }
    }

    fn handle_hello(&mut self, message: Message) {
        let Message::Hello(hello) = message else {
            return self.refuse(Refusal::new(
                ErrorCode::InvalidHello,
                format!(
                    "the first control line must be a hello, not {}",
                    message.kind()
                ),
            ));
        };
        let Phase::AwaitingHello { deadline } = self.phase else {
            return;
        };
        match hello.validate(&self.grant, self.header_version) {
            Ok(accepted) => {
                self.phase = Phase::Validated { deadline };
                self.accepted = Some(accepted.clone());
                self.events.push_back(ServerEvent::HelloAccepted(accepted));
            }
            Err(refusal) => self.refuse(refusal),
        }
    }

    fn handle_live(&mut self, message: Message) {
        match message {
            Message::StreamClosed(closed) => {
                if self.streams.remove(&closed.stream_id).is_some() {
                    self.events.push_back(ServerEvent::StreamClosed {
                        stream_id: closed.stream_id,
                        reason: closed.reason,
                    });
                }
                // Otherwise it crossed our unsubscribe, or the stream already ended: no news.
            }
            Message::Draining => self.handle_draining(),
            Message::Heartbeat { seq } => self.send(&Message::HeartbeatAck { seq }),
            Message::HeartbeatAck { .. } => {}
            other @ (Message::Hello(_)
            | Message::Welcome(_)
            | Message::Subscribe(_)
            | Message::Unsubscribe { .. }
            | Message::Closed(_)) => {
                self.fail(format!("a client does not send {}", other.kind()));
            }
        }
    }

    fn handle_draining(&mut self) {
        if self.draining {
            return;
        }
        self.draining = true;
        self.events.push_back(ServerEvent::Draining);
        let is_listener = self
            .accepted
            .as_ref()
            .is_some_and(|a| a.role == super::message::Role::KvListener);
        if is_listener {
            for stream_id in std::mem::take(&mut self.streams).into_keys() {
                self.send(&Message::Unsubscribe { stream_id });
                self.events.push_back(ServerEvent::StreamClosed {
                    stream_id,
                    reason: StreamCloseReason::Draining,
                });
            }
        }
    }

    /// A framing or decoding error: before the welcome a refusal, after it `protocol_error`.
    fn fail(&mut self, message: String) {
        match self.phase {
            Phase::AwaitingHello { .. } | Phase::Validated { .. } => {
                self.refuse(Refusal::new(ErrorCode::InvalidHello, message));
            }
            Phase::Live => self.close(ErrorCode::ProtocolError, Some(message)),
            Phase::Closed => {}
        }
    }

    fn refuse(&mut self, refusal: Refusal) {
        self.phase = Phase::Closed;
        self.streams.clear();
        self.events.push_back(ServerEvent::Refused(refusal));
    }

    fn finish(&mut self, code: ErrorCode) {
        self.phase = Phase::Closed;
        self.streams.clear();
        self.events.push_back(ServerEvent::Closed(code));
    }

    fn send(&mut self, message: &Message) {
        self.transmit.extend_from_slice(&message.encode());
    }
}

fn duration_ms(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}
