//! `BrokerSessionActor`: one welcomed event-bus session.
//!
//! Role: owns the session's `ServerSession` (protocol), its control-channel response body, the
//! consumers waiting for commanded streams, and a cut switch per open data stream. It keeps the
//! session's row of the [`EventBus`] table current (stream count, draining) and removes it when
//! it stops.
//!
//! Parent: `BrokerSupervisor` (linked; a session is never restarted — its agent reconnects).
//! Messages in: control bytes from the request body (acknowledged, so a flooding agent is
//! back-pressured by HTTP/2 flow control), its own timer, `Open` from `EventBus`,
//! `AcceptStream` from the listener, `StreamDropped` from a `BusStream`, `Regrant` / `Close`
//! from reloads, superseding sessions and shutdown. Out: NDJSON lines on the response body,
//! `BusStream`s to consumers.

use std::collections::BTreeMap;

use bytes::Bytes;
use continuum_protocol::discovery::EventTopic;
use continuum_protocol::event_bus::hello::Refusal;
use continuum_protocol::event_bus::message::{
    ClientId, ErrorCode, Role, SessionId, StreamId, StreamTarget,
};
use continuum_protocol::event_bus::{
    Coverage, Grant, ServerEvent, ServerSession, SessionBounds, SubscribeError,
};
use futures::channel::{mpsc, oneshot as cut_channel};
use hyper::body::Incoming;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tracing::{Instrument as _, debug, info};

use super::coverage::CarriedGuard;
use super::metrics::StreamEnd;
use super::stream::{BusStream, OutboundPipe, StreamOrigin, outbound_pipe};
use super::{AuthBy, BusStreamError, EventBus, SessionRow};
use crate::clock::now_tick;
use crate::lifecycle::ActorSpan;
use crate::tree::{ActorPath, ActorState, ActorTree};

/// Control lines queued for the response body; an agent that lets more pile up does not read
/// its control channel and its session ends (`idle_timeout`).
pub(crate) const CONTROL_QUEUE: usize = 64;

pub enum SessionMsg {
    /// Bytes of the control request body; answer `ack` once handled.
    Input(Bytes, oneshot::Sender<()>),
    /// The control request body ended (or broke).
    InputEnded,
    /// The session's timer fired.
    Tick,
    /// `EventBus::open_stream`: command a stream and answer with it once opened.
    Open {
        target: StreamTarget,
        reply: oneshot::Sender<Result<BusStream, BusStreamError>>,
    },
    /// A data-stream request of this session: admit it (the body becomes the `BusStream`'s
    /// reads) and answer with the pipe its response body drains.
    AcceptStream {
        stream_id: StreamId,
        client_id: ClientId,
        version: u32,
        body: Incoming,
        reply: oneshot::Sender<Result<OutboundPipe, Refusal>>,
    },
    /// A consumer dropped its `BusStream`: unsubscribe.
    StreamDropped(StreamId),
    /// A reload changed the entry.
    Regrant(Grant),
    /// End the session with a `closed` line.
    Close(ErrorCode, Option<String>),
}

pub struct SessionArgs {
    pub(crate) bus: EventBus,
    pub(crate) session: ServerSession,
    pub(crate) control: mpsc::Sender<Bytes>,
    pub(crate) client_id: ClientId,
    pub(crate) role: Role,
    pub(crate) coverage: Coverage,
    pub(crate) auth: AuthBy,
    pub(crate) bounds: SessionBounds,
    pub(crate) tree: ActorTree,
    pub(crate) path: ActorPath,
    pub(crate) parent: ActorPath,
    pub(crate) span: ActorSpan,
}

type Opener = oneshot::Sender<Result<BusStream, BusStreamError>>;

pub struct BrokerSessionActor;

pub struct SessionState {
    bus: EventBus,
    session: ServerSession,
    session_id: SessionId,
    client_id: ClientId,
    control: Option<mpsc::Sender<Bytes>>,
    bounds: SessionBounds,
    /// Consumers waiting for commanded streams, with the topic of a subscription stream.
    openers: BTreeMap<StreamId, (Opener, Option<EventTopic>)>,
    cuts: BTreeMap<StreamId, cut_channel::Sender<()>>,
    timer: Option<JoinHandle<Result<(), ractor::MessagingErr<SessionMsg>>>>,
    published: (usize, bool),
    tree: ActorTree,
    path: ActorPath,
    span: ActorSpan,
    closed_code: Option<ErrorCode>,
}

impl Actor for BrokerSessionActor {
    type Msg = SessionMsg;
    type State = SessionState;
    type Arguments = SessionArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: SessionArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let session_id = args.session.session_id();
        args.tree.starting(
            &args.path,
            crate::lifecycle::ActorKind::BrokerSession.as_label(),
            Some(&args.parent),
            None,
        );
        {
            let mut state = args.bus.lock();
            state.sessions.insert(
                session_id,
                SessionRow {
                    client_id: args.client_id.clone(),
                    role: args.role,
                    coverage: args.coverage.clone(),
                    auth: args.auth,
                    draining: false,
                    streams: 0,
                    max_streams: args.bounds.max_streams_per_session as usize,
                    actor: myself.clone(),
                },
            );
            args.bus.publish(&state);
        }
        args.tree.set_state(&args.path, ActorState::Running);
        args.span.started();
        info!(parent: args.span.span(), client_id = %args.client_id, role = args.role.as_str(), "Event bus session welcomed.");
        let mut state = SessionState {
            bus: args.bus,
            session: args.session,
            session_id,
            client_id: args.client_id,
            control: Some(args.control),
            bounds: args.bounds,
            openers: BTreeMap::new(),
            cuts: BTreeMap::new(),
            timer: None,
            published: (0, false),
            tree: args.tree,
            path: args.path,
            span: args.span,
            closed_code: None,
        };
        state.drive(&myself);
        Ok(state)
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let span = state.span.span().clone();
        async {
            let now = now_tick();
            match msg {
                SessionMsg::Input(bytes, ack) => {
                    state.session.handle_input(&bytes, now);
                    let _ = ack.send(());
                }
                SessionMsg::InputEnded => state.session.handle_end_of_input(),
                SessionMsg::Tick => state.session.handle_timeout(now),
                SessionMsg::Open { target, reply } => {
                    let topic = match &target {
                        StreamTarget::ZmqTcp { topic, .. } => Some(*topic),
                        StreamTarget::AnnouncedSource(_) => None,
                    };
                    match state.session.subscribe(target, now) {
                        Ok(stream_id) => {
                            state.openers.insert(stream_id, (reply, topic));
                        }
                        Err(error) => {
                            let _ = reply.send(Err(match error {
                                SubscribeError::NotLive => BusStreamError::SessionClosed,
                                SubscribeError::Draining => BusStreamError::Busy,
                                SubscribeError::TooManyStreams => BusStreamError::TooManyStreams,
                                SubscribeError::NotCovered => BusStreamError::NoSession,
                            }));
                        }
                    }
                }
                SessionMsg::AcceptStream {
                    stream_id,
                    client_id,
                    version,
                    body,
                    reply,
                } => state.accept_stream(&myself, stream_id, &client_id, version, body, reply),
                SessionMsg::StreamDropped(stream_id) => {
                    state.cuts.remove(&stream_id);
                    if state.session.unsubscribe(stream_id)
                        && let Some(metrics) = state.bus.metrics()
                    {
                        metrics.stream_closed(StreamEnd::Unsubscribed);
                    }
                }
                SessionMsg::Regrant(grant) => {
                    state.session.regrant(grant);
                }
                SessionMsg::Close(code, message) => state.session.close(code, message),
            }
            state.drive(&myself);
        }
        .instrument(span)
        .await;
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        if !state.session.is_closed() {
            // Stopped from outside (shutdown, listener restart): say so on the way out.
            state.session.close(
                ErrorCode::Shutdown,
                Some("the router's event bus is stopping".into()),
            );
            state.handle_events();
            state.flush();
        }
        if let Some(timer) = state.timer.take() {
            timer.abort();
        }
        for (_, (opener, _)) in std::mem::take(&mut state.openers) {
            let _ = opener.send(Err(BusStreamError::SessionClosed));
        }
        state.cuts.clear();
        state.control = None;
        {
            let mut table = state.bus.lock();
            table.sessions.remove(&state.session_id);
            table.admission.ended(&state.client_id, state.session_id);
            state.bus.publish(&table);
        }
        state.tree.remove_subtree(&state.path);
        let code = state.closed_code.unwrap_or(ErrorCode::Shutdown);
        info!(parent: state.span.span(), client_id = %state.client_id, code = code.as_str(), "Event bus session ended.");
        state.span.stopped(code.as_str());
        Ok(())
    }
}

impl SessionState {
    fn accept_stream(
        &mut self,
        myself: &ActorRef<SessionMsg>,
        stream_id: StreamId,
        client_id: &ClientId,
        version: u32,
        body: Incoming,
        reply: oneshot::Sender<Result<OutboundPipe, Refusal>>,
    ) {
        if let Err(refusal) = self.session.accept_stream(stream_id, client_id, version) {
            let _ = reply.send(Err(refusal));
            return;
        }
        let (outbound, pipe) = outbound_pipe(&self.bounds);
        let (cut, cut_rx) = cut_channel::channel();
        self.cuts.insert(stream_id, cut);
        let opener = self.openers.remove(&stream_id);
        let carried = opener
            .as_ref()
            .and_then(|(_, topic)| *topic)
            .map(|topic| CarriedGuard::new(&self.bus, topic, self.client_id.clone()));
        let origin = StreamOrigin {
            stream_id,
            session: myself.clone(),
            broker: self.client_id.clone(),
            carried,
            metrics: self.bus.metrics().cloned(),
        };
        let stream = BusStream::new(origin, body, outbound, cut_rx);
        let _ = reply.send(Ok(pipe));
        match opener {
            // A consumer that gave up drops the stream here, which unsubscribes it.
            Some((opener, _)) => drop(opener.send(Ok(stream))),
            None => drop(stream),
        }
    }

    /// Acts on the session's events and transmits, updates the table row, re-arms the timer,
    /// and stops the actor once the session is over.
    fn drive(&mut self, myself: &ActorRef<SessionMsg>) {
        loop {
            self.handle_events();
            if self.flush() || self.session.is_closed() {
                break;
            }
            // The agent does not read its control channel: end the session.
            self.session.close(
                ErrorCode::IdleTimeout,
                Some("the agent does not read its control channel".into()),
            );
        }
        self.publish_row();
        if self.session.is_closed() {
            myself.stop(self.closed_code.map(|code| code.as_str().to_owned()));
            return;
        }
        if let Some(timer) = self.timer.take() {
            timer.abort();
        }
        if let Some(at) = self.session.poll_timeout() {
            let delay = at.0.saturating_sub(now_tick().0);
            self.timer = Some(myself.send_after(delay, || SessionMsg::Tick));
        }
    }

    fn handle_events(&mut self) {
        let metrics = self.bus.metrics().cloned();
        while let Some(event) = self.session.poll_event() {
            match event {
                ServerEvent::StreamClosed { stream_id, reason } => {
                    if let Some((opener, _)) = self.openers.remove(&stream_id) {
                        let _ = opener.send(Err(BusStreamError::Refused(reason)));
                    }
                    // Dropping the switch cuts an open stream (e.g. a kv_listener draining).
                    self.cuts.remove(&stream_id);
                    if let Some(metrics) = &metrics {
                        metrics.stream_closed(StreamEnd::Agent(reason));
                    }
                }
                ServerEvent::StreamOpenTimedOut(stream_id) => {
                    if let Some((opener, _)) = self.openers.remove(&stream_id) {
                        let _ = opener.send(Err(BusStreamError::OpenTimeout));
                    }
                    if let Some(metrics) = &metrics {
                        metrics.stream_closed(StreamEnd::OpenTimeout);
                    }
                }
                ServerEvent::Draining => {
                    debug!(client_id = %self.client_id, "Event bus session is draining.");
                }
                ServerEvent::Closed(code) => {
                    self.closed_code = Some(code);
                    if let Some(metrics) = &metrics {
                        metrics.session_closed(code);
                    }
                }
                // Handled by the listener before the session became an actor.
                ServerEvent::HelloAccepted(_)
                | ServerEvent::Refused(_)
                | ServerEvent::StreamOpened(_) => {}
            }
        }
        if self.session.is_closed() {
            for (_, (opener, _)) in std::mem::take(&mut self.openers) {
                let _ = opener.send(Err(BusStreamError::SessionClosed));
            }
            self.cuts.clear();
        }
    }

    /// Queues pending control lines; `false` when the agent let the queue fill up.
    fn flush(&mut self) -> bool {
        let Some(bytes) = self.session.poll_transmit() else {
            if self.session.is_closed() {
                // The last line is queued: ending the response body follows it.
                self.control = None;
            }
            return true;
        };
        let sent = match self.control.as_mut() {
            Some(control) => match control.try_send(Bytes::from(bytes)) {
                Ok(()) => true,
                // The response is gone (connection closed): the body end will follow.
                Err(error) if error.is_disconnected() => true,
                Err(_) => false,
            },
            None => true,
        };
        if self.session.is_closed() {
            self.control = None;
        }
        sent
    }

    fn publish_row(&mut self) {
        let now = (self.session.stream_count(), self.session.is_draining());
        if now == self.published {
            return;
        }
        self.published = now;
        let mut table = self.bus.lock();
        if let Some(row) = table.sessions.get_mut(&self.session_id) {
            row.streams = now.0;
            row.draining = now.1;
        }
        self.bus.publish(&table);
    }
}
