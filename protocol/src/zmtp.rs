//! A bounded ZMTP 3.x SUB client as a sans-IO state machine.
//!
//! Fleet-authored `tcp://ip:port` endpoints are untrusted, so this client checks every
//! wire-declared length against compiled-in ceilings ([`ZmtpLimits`]) before it allocates, and
//! its buffers grow on demand from [`INITIAL_FRAME_BUFFER`] bytes by powers of two.
//!
//! Scope (everything else is refused with a [`ZmtpError`], counted as
//! `continuum_dynamo_load_events_total{result="transport_refused"}`):
//! - ZMTP 3.x greeting with the NULL mechanism (we announce 3.0, so a 3.1 peer speaks 3.0 to us);
//! - one NULL handshake: we send READY with `Socket-Type: SUB`; the peer's READY must carry
//!   `Socket-Type` `PUB` or `XPUB`;
//! - the subscription is a ZMTP 3.0 single-frame message `0x01 + topic`;
//! - commands after the handshake: PING is answered with PONG (when the 64-byte write buffer has
//!   room, otherwise the PING is skipped: a peer that insists will close the connection and we
//!   reconnect), PONG and unknown commands are ignored; READY twice, a command inside a multipart
//!   message, or a command with the MORE flag is refused; ERROR closes with the peer's reason.
//!
//! Oversized data is not fatal: a frame above `max_frame_bytes` (but within `max_skip_bytes`), a
//! message with too many frames or too many bytes is skipped without buffering and surfaces as a
//! [`Delivery::Discarded`], which the event plane counts as `oversized` or `malformed`.
//!
//! Driving it: write [`ZmtpSub::poll_transmit`] bytes to the socket and report them with
//! [`ZmtpSub::advance_transmit`]; hand received bytes to [`ZmtpSub::handle_input`] (which stops
//! after each completed message) and drain [`ZmtpSub::poll_delivery`], or use [`ZmtpSub::feed`].

use std::mem;

pub mod publisher;

use thiserror::Error;

/// Bytes of a ZMTP 3 greeting.
pub const GREETING_LEN: usize = 64;
/// Initial capacity of the frame (message assembly) buffer.
pub const INITIAL_FRAME_BUFFER: usize = 512;
/// Initial capacity of the outgoing buffer (greeting, READY, subscription, PONG).
pub const WRITE_BUFFER: usize = 64;
/// Compile-time bound on frames per message (messages are assembled without a per-frame vector).
pub const MAX_FRAMES_PER_MESSAGE: usize = 16;
/// A subscription travels as one short frame: `0x01 + topic` must fit 255 bytes.
pub const MAX_TOPIC_BYTES: usize = 254;

const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;
const FLAG_RESERVED: u8 = !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND);
/// Property values in commands are bounded by `max_command_bytes` anyway; this caps PING contexts.
const MAX_PING_CONTEXT: usize = 16;

/// Compiled-in transport ceilings, checked before any allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ZmtpLimits {
    /// Largest frame body that is buffered. Larger frames are skipped (see `max_skip_bytes`).
    pub max_frame_bytes: usize,
    /// Frames per message; clamped to [`MAX_FRAMES_PER_MESSAGE`]. Extra frames discard the message.
    pub max_message_frames: usize,
    /// Sum of frame bodies of one message; a larger message is discarded.
    pub max_message_bytes: usize,
    /// A data frame declaring more than this is a transport violation (refused, reconnect)
    /// rather than a skipped message: skipping a 2^63-byte frame would never end.
    pub max_skip_bytes: u64,
    /// Largest command body (READY, PING, ERROR, ...).
    pub max_command_bytes: usize,
}

impl ZmtpLimits {
    /// `kv_metrics`: 16 KiB ActiveLoad envelope + the 5-byte frame header, a short topic and the
    /// two 8-byte id frames.
    pub const KV_METRICS: ZmtpLimits = ZmtpLimits {
        max_frame_bytes: 16 * 1024 + 5,
        max_message_frames: 4,
        max_message_bytes: 16 * 1024 + 5 + 16 + 256,
        max_skip_bytes: 1024 * 1024,
        max_command_bytes: 512,
    };

    /// `kv-events`: RouterEvent batches up to 1 MiB per frame.
    pub const KV_EVENTS: ZmtpLimits = ZmtpLimits {
        max_frame_bytes: 1024 * 1024,
        max_message_frames: 4,
        max_message_bytes: 1024 * 1024 + 16 + 256,
        max_skip_bytes: 64 * 1024 * 1024,
        max_command_bytes: 512,
    };

    /// Brings every field into the range the state machine relies on.
    fn clamped(self) -> Self {
        let max_message_bytes = self.max_message_bytes.min(u32::MAX as usize);
        Self {
            max_frame_bytes: self.max_frame_bytes.min(max_message_bytes),
            max_message_frames: self.max_message_frames.clamp(1, MAX_FRAMES_PER_MESSAGE),
            max_message_bytes,
            max_skip_bytes: self.max_skip_bytes,
            max_command_bytes: self.max_command_bytes.clamp(64, max_message_bytes.max(64)),
        }
    }
}

/// A transport violation: the connection must be closed (and retried with backoff).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ZmtpError {
    #[error("subscription topic is {len} bytes, more than {MAX_TOPIC_BYTES}")]
    TopicTooLong { len: usize },
    #[error("peer greeting has no ZMTP 3 signature")]
    BadSignature,
    #[error("peer speaks ZMTP {major}.{minor}; only 3.x is supported")]
    UnsupportedVersion { major: u8, minor: u8 },
    #[error("peer security mechanism {mechanism:?} is not NULL")]
    UnsupportedMechanism { mechanism: String },
    #[error("frame flags {flags:#04x} set reserved bits")]
    ReservedFlags { flags: u8 },
    #[error("command frame has the MORE flag")]
    CommandWithMore,
    #[error("command declared {declared} bytes, more than {limit}")]
    CommandTooLarge { declared: u64, limit: usize },
    #[error("data frame declared {declared} bytes, more than the skip ceiling {limit}")]
    FrameTooLarge { declared: u64, limit: u64 },
    #[error("command arrived inside a multipart message")]
    CommandInsideMessage,
    #[error("data frame arrived before the handshake completed")]
    MessageBeforeReady,
    #[error("malformed {command} command")]
    MalformedCommand { command: &'static str },
    #[error("unexpected {name:?} command")]
    UnexpectedCommand { name: String },
    #[error("peer READY has no Socket-Type")]
    MissingSocketType,
    #[error("peer socket type {socket_type:?} is not PUB or XPUB")]
    WrongSocketType { socket_type: String },
    #[error("peer sent ERROR: {reason}")]
    PeerError { reason: String },
    #[error("connection already failed: {0}")]
    Failed(Box<ZmtpError>),
}

impl ZmtpError {
    /// The `continuum_dynamo_load_events_total{result}` label of every transport violation.
    pub const RESULT_LABEL: &'static str = "transport_refused";

    pub fn result_label(&self) -> &'static str {
        Self::RESULT_LABEL
    }
}

/// Why a message was skipped without being buffered. Not a transport violation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Discard {
    /// A frame declared more than `max_frame_bytes`.
    FrameTooLarge { declared: u64 },
    /// The message had more than `max_message_frames` frames.
    TooManyFrames,
    /// The frames together exceeded `max_message_bytes`.
    MessageTooLarge,
}

/// A complete multipart message: one contiguous buffer plus frame boundaries.
#[derive(Clone, PartialEq, Eq)]
pub struct ZmtpMessage {
    data: Vec<u8>,
    ends: [u32; MAX_FRAMES_PER_MESSAGE],
    count: u8,
}

impl std::fmt::Debug for ZmtpMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZmtpMessage")
            .field("frames", &self.frame_count())
            .field("bytes", &self.data.len())
            .finish()
    }
}

impl ZmtpMessage {
    /// Builds a message from frames (tests, benches, replay). `None` above
    /// [`MAX_FRAMES_PER_MESSAGE`] frames or 4 GiB.
    pub fn from_frames<F: AsRef<[u8]>>(frames: &[F]) -> Option<Self> {
        if frames.len() > MAX_FRAMES_PER_MESSAGE {
            return None;
        }
        let total: usize = frames.iter().map(|f| f.as_ref().len()).sum();
        if total > u32::MAX as usize {
            return None;
        }
        let mut data = Vec::with_capacity(total);
        let mut ends = [0u32; MAX_FRAMES_PER_MESSAGE];
        for (i, frame) in frames.iter().enumerate() {
            data.extend_from_slice(frame.as_ref());
            ends[i] = data.len() as u32;
        }
        Some(Self {
            data,
            ends,
            count: frames.len() as u8,
        })
    }

    pub fn frame_count(&self) -> usize {
        usize::from(self.count)
    }

    /// Total body bytes of all frames.
    pub fn byte_len(&self) -> usize {
        self.data.len()
    }

    pub fn frame(&self, index: usize) -> Option<&[u8]> {
        if index >= self.frame_count() {
            return None;
        }
        let start = if index == 0 {
            0
        } else {
            self.ends[index - 1] as usize
        };
        self.data.get(start..self.ends[index] as usize)
    }

    pub fn frames(&self) -> impl Iterator<Item = &[u8]> + '_ {
        (0..self.frame_count()).filter_map(|i| self.frame(i))
    }
}

/// What the state machine hands to its caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Delivery {
    Message(ZmtpMessage),
    Discarded(Discard),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Collecting the peer's 64-byte greeting (into the frame buffer).
    Greeting,
    /// Greeting accepted, waiting for the peer's READY.
    Handshake,
    /// Subscribed; data frames flow.
    Open,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BodyMode {
    /// Appended to the message buffer as the next frame.
    Frame,
    /// Appended to the (empty) message buffer, processed as one command.
    Command,
    /// Counted down without buffering.
    Skip,
}

#[derive(Clone, Copy, Debug)]
enum Rx {
    /// Reading flags and size: `hdr[0]` is the flags byte, then 1 or 8 size bytes.
    Header { hdr: [u8; 9], have: u8 },
    Body {
        mode: BodyMode,
        more: bool,
        remaining: u64,
    },
}

const RX_HEADER: Rx = Rx::Header {
    hdr: [0; 9],
    have: 0,
};

/// The SUB side of one ZMTP connection.
#[derive(Debug)]
pub struct ZmtpSub {
    limits: ZmtpLimits,
    topic: Vec<u8>,
    phase: Phase,
    rx: Rx,
    /// Greeting bytes, then frame bodies of the message being assembled, or one command body.
    buf: Vec<u8>,
    ends: [u32; MAX_FRAMES_PER_MESSAGE],
    count: usize,
    /// Set while the rest of the current message is being skipped.
    discarding: Option<Discard>,
    pending: Option<Delivery>,
    out: Vec<u8>,
    failed: Option<ZmtpError>,
    peer_minor: u8,
    ignored_commands: u64,
    pings_answered: u64,
}

impl ZmtpSub {
    /// A client that will subscribe to `topic` once the handshake completes. Our greeting is
    /// queued for transmission immediately.
    pub fn new(topic: &[u8], limits: ZmtpLimits) -> Result<Self, ZmtpError> {
        if topic.len() > MAX_TOPIC_BYTES {
            return Err(ZmtpError::TopicTooLong { len: topic.len() });
        }
        let mut out = Vec::with_capacity(WRITE_BUFFER);
        out.extend_from_slice(&GREETING);
        Ok(Self {
            limits: limits.clamped(),
            topic: topic.to_vec(),
            phase: Phase::Greeting,
            rx: RX_HEADER,
            buf: Vec::with_capacity(INITIAL_FRAME_BUFFER),
            ends: [0; MAX_FRAMES_PER_MESSAGE],
            count: 0,
            discarding: None,
            pending: None,
            out,
            failed: None,
            peer_minor: 0,
            ignored_commands: 0,
            pings_answered: 0,
        })
    }

    pub fn limits(&self) -> ZmtpLimits {
        self.limits
    }

    /// True once the peer's READY was accepted and the subscription queued.
    pub fn is_open(&self) -> bool {
        self.phase == Phase::Open && self.failed.is_none()
    }

    /// The peer's ZMTP minor version (after the greeting).
    pub fn peer_minor_version(&self) -> u8 {
        self.peer_minor
    }

    /// Commands ignored after the handshake (unknown names, PONG, PINGs we had no room for).
    pub fn ignored_commands(&self) -> u64 {
        self.ignored_commands
    }

    pub fn pings_answered(&self) -> u64 {
        self.pings_answered
    }

    /// Heap bytes currently reserved by the frame and write buffers (and the topic, until the
    /// subscription is queued).
    pub fn buffer_bytes(&self) -> usize {
        self.buf.capacity() + self.out.capacity() + self.topic.capacity()
    }

    /// Bytes waiting to be written, if any.
    pub fn poll_transmit(&self) -> Option<&[u8]> {
        (!self.out.is_empty()).then_some(self.out.as_slice())
    }

    /// Marks `n` bytes of [`Self::poll_transmit`] as written.
    pub fn advance_transmit(&mut self, n: usize) {
        let n = n.min(self.out.len());
        self.out.drain(..n);
        if self.out.is_empty() && self.out.capacity() > WRITE_BUFFER {
            self.out.shrink_to(WRITE_BUFFER);
        }
    }

    /// Moves every pending outgoing byte into `dst`.
    pub fn take_outgoing(&mut self, dst: &mut Vec<u8>) {
        dst.extend_from_slice(&self.out);
        self.advance_transmit(self.out.len());
    }

    /// The next completed message or discard, if any.
    pub fn poll_delivery(&mut self) -> Option<Delivery> {
        self.pending.take()
    }

    /// The next completed message, skipping discards (convenience for tests).
    pub fn poll_message(&mut self) -> Option<ZmtpMessage> {
        match self.pending.take() {
            Some(Delivery::Message(message)) => Some(message),
            _ => None,
        }
    }

    /// Consumes a prefix of `bytes` and returns its length. Stops right after a message or discard
    /// completes, and consumes nothing while that delivery has not been polled, so at most one
    /// message is ever held: call [`Self::poll_delivery`] and call again with the rest.
    pub fn handle_input(&mut self, bytes: &[u8]) -> Result<usize, ZmtpError> {
        if let Some(error) = &self.failed {
            return Err(ZmtpError::Failed(Box::new(error.clone())));
        }
        if self.pending.is_some() {
            return Ok(0);
        }
        match self.consume(bytes) {
            Ok(n) => Ok(n),
            Err(error) => {
                self.failed = Some(error.clone());
                // A failed connection keeps no buffered message.
                self.buf = Vec::new();
                Err(error)
            }
        }
    }

    /// Consumes all of `bytes`, passing every delivery to `sink` as it completes.
    pub fn feed(
        &mut self,
        mut bytes: &[u8],
        mut sink: impl FnMut(Delivery),
    ) -> Result<(), ZmtpError> {
        loop {
            let n = self.handle_input(bytes)?;
            bytes = &bytes[n..];
            match self.poll_delivery() {
                Some(delivery) => sink(delivery),
                None if bytes.is_empty() => return Ok(()),
                None => {}
            }
        }
    }

    fn consume(&mut self, bytes: &[u8]) -> Result<usize, ZmtpError> {
        let mut at = 0;
        while at < bytes.len() && self.pending.is_none() {
            let rest = &bytes[at..];
            at += match self.phase {
                Phase::Greeting => self.consume_greeting(rest)?,
                Phase::Handshake | Phase::Open => self.consume_frame(rest)?,
            };
        }
        Ok(at)
    }

    fn consume_greeting(&mut self, bytes: &[u8]) -> Result<usize, ZmtpError> {
        let take = (GREETING_LEN - self.buf.len()).min(bytes.len());
        self.buf.extend_from_slice(&bytes[..take]);
        // Reject a non-ZMTP peer as soon as its signature is visible.
        if self.buf.first().is_some_and(|b| *b != 0xFF)
            || self.buf.get(9).is_some_and(|b| *b != 0x7F)
        {
            return Err(ZmtpError::BadSignature);
        }
        // Judged once both version bytes are here, so the error names the same version however
        // the greeting was split (a fuzzing finding: `0.0` byte by byte, `0.254` whole).
        if let Some(&[major, minor]) = self.buf.get(10..12).map(<[u8]>::as_ref)
            && major < 3
        {
            return Err(ZmtpError::UnsupportedVersion { major, minor });
        }
        if self.buf.len() == GREETING_LEN {
            let mechanism = &self.buf[12..32];
            let name_len = mechanism.iter().position(|b| *b == 0).unwrap_or(20);
            if &mechanism[..name_len] != b"NULL" || mechanism[name_len..].iter().any(|b| *b != 0) {
                return Err(ZmtpError::UnsupportedMechanism {
                    mechanism: String::from_utf8_lossy(&mechanism[..name_len]).into_owned(),
                });
            }
            self.peer_minor = self.buf[11];
            // as-server (byte 32) is meaningless for NULL; the filler is ignored.
            self.buf.clear();
            self.phase = Phase::Handshake;
            self.out.extend_from_slice(&READY_SUB);
        }
        Ok(take)
    }

    fn consume_frame(&mut self, bytes: &[u8]) -> Result<usize, ZmtpError> {
        match self.rx {
            Rx::Header { mut hdr, mut have } => {
                // Read the flags byte first, so we know how many size bytes follow.
                let want = if have == 0 {
                    1
                } else if hdr[0] & FLAG_LONG == 0 {
                    2 - usize::from(have)
                } else {
                    9 - usize::from(have)
                };
                let take = want.min(bytes.len());
                hdr[usize::from(have)..usize::from(have) + take].copy_from_slice(&bytes[..take]);
                have += take as u8;
                self.rx = Rx::Header { hdr, have };
                if have == 1 && hdr[0] & FLAG_RESERVED != 0 {
                    return Err(ZmtpError::ReservedFlags { flags: hdr[0] });
                }
                let need = if hdr[0] & FLAG_LONG == 0 { 2 } else { 9 };
                if usize::from(have) == need {
                    let size = if need == 2 {
                        u64::from(hdr[1])
                    } else {
                        u64::from_be_bytes([
                            hdr[1], hdr[2], hdr[3], hdr[4], hdr[5], hdr[6], hdr[7], hdr[8],
                        ])
                    };
                    self.start_body(hdr[0], size)?;
                }
                Ok(take)
            }
            Rx::Body {
                mode,
                more,
                remaining,
            } => {
                let take = usize::try_from(remaining)
                    .unwrap_or(usize::MAX)
                    .min(bytes.len());
                if mode != BodyMode::Skip {
                    // Capacity was reserved in start_body, within the ceilings.
                    self.buf.extend_from_slice(&bytes[..take]);
                }
                let remaining = remaining - take as u64;
                self.rx = Rx::Body {
                    mode,
                    more,
                    remaining,
                };
                if remaining == 0 {
                    self.finish_body(mode, more)?;
                }
                Ok(take)
            }
        }
    }

    /// Decides, from the declared size alone, whether and where the body is buffered.
    fn start_body(&mut self, flags: u8, size: u64) -> Result<(), ZmtpError> {
        let more = flags & FLAG_MORE != 0;
        let mode = if flags & FLAG_COMMAND != 0 {
            if more {
                return Err(ZmtpError::CommandWithMore);
            }
            if self.count > 0 || self.discarding.is_some() {
                return Err(ZmtpError::CommandInsideMessage);
            }
            if size > self.limits.max_command_bytes as u64 {
                return Err(ZmtpError::CommandTooLarge {
                    declared: size,
                    limit: self.limits.max_command_bytes,
                });
            }
            self.reserve(size as usize);
            BodyMode::Command
        } else {
            if self.phase != Phase::Open {
                return Err(ZmtpError::MessageBeforeReady);
            }
            if size > self.limits.max_frame_bytes as u64 && size > self.limits.max_skip_bytes {
                return Err(ZmtpError::FrameTooLarge {
                    declared: size,
                    limit: self.limits.max_skip_bytes,
                });
            }
            if self.discarding.is_some() {
                BodyMode::Skip
            } else if size > self.limits.max_frame_bytes as u64 {
                self.discard(Discard::FrameTooLarge { declared: size });
                BodyMode::Skip
            } else if self.count == self.limits.max_message_frames {
                self.discard(Discard::TooManyFrames);
                BodyMode::Skip
            } else if self.buf.len() as u64 + size > self.limits.max_message_bytes as u64 {
                self.discard(Discard::MessageTooLarge);
                BodyMode::Skip
            } else {
                self.reserve(size as usize);
                BodyMode::Frame
            }
        };
        self.rx = Rx::Body {
            mode,
            more,
            remaining: size,
        };
        if size == 0 {
            self.finish_body(mode, more)?;
        }
        Ok(())
    }

    /// Grows the buffer by powers of two so that `extra` more bytes fit. Callers have checked
    /// `len + extra` against the ceilings.
    fn reserve(&mut self, extra: usize) {
        let needed = self.buf.len() + extra;
        if needed > self.buf.capacity() {
            let target = needed
                .next_power_of_two()
                .min(self.limits.max_message_bytes)
                .max(needed);
            self.buf.reserve_exact(target - self.buf.len());
        }
    }

    fn discard(&mut self, reason: Discard) {
        self.discarding = Some(reason);
        self.reset_buffer();
    }

    fn reset_buffer(&mut self) {
        self.buf.clear();
        self.count = 0;
        if self.buf.capacity() > INITIAL_FRAME_BUFFER {
            self.buf.shrink_to(INITIAL_FRAME_BUFFER);
        }
    }

    fn finish_body(&mut self, mode: BodyMode, more: bool) -> Result<(), ZmtpError> {
        self.rx = RX_HEADER;
        match mode {
            BodyMode::Command => {
                let result = self.handle_command();
                self.buf.clear();
                result
            }
            BodyMode::Frame => {
                self.ends[self.count] = self.buf.len() as u32;
                self.count += 1;
                if !more {
                    self.deliver_message();
                }
                Ok(())
            }
            BodyMode::Skip => {
                if !more && let Some(reason) = self.discarding.take() {
                    self.pending = Some(Delivery::Discarded(reason));
                }
                Ok(())
            }
        }
    }

    fn deliver_message(&mut self) {
        // Small messages are copied out so the assembly buffer keeps its 512 bytes; large ones
        // take the buffer itself and a fresh one starts at the initial size.
        let data = if self.buf.len() <= INITIAL_FRAME_BUFFER {
            let data = self.buf.clone();
            self.buf.clear();
            data
        } else {
            mem::replace(&mut self.buf, Vec::with_capacity(INITIAL_FRAME_BUFFER))
        };
        let message = ZmtpMessage {
            data,
            ends: self.ends,
            count: self.count as u8,
        };
        self.count = 0;
        self.pending = Some(Delivery::Message(message));
    }

    fn handle_command(&mut self) -> Result<(), ZmtpError> {
        let body = self.buf.as_slice();
        let (&name_len, rest) = body
            .split_first()
            .ok_or(ZmtpError::MalformedCommand { command: "unnamed" })?;
        let name_len = usize::from(name_len);
        if rest.len() < name_len {
            return Err(ZmtpError::MalformedCommand { command: "unnamed" });
        }
        let (name, data) = rest.split_at(name_len);
        match (self.phase, name) {
            (_, b"ERROR") => {
                let reason = data
                    .split_first()
                    .and_then(|(len, text)| text.get(..usize::from(*len)))
                    .unwrap_or_default();
                Err(ZmtpError::PeerError {
                    reason: String::from_utf8_lossy(reason).into_owned(),
                })
            }
            (Phase::Handshake, b"READY") => {
                check_peer_ready(data)?;
                self.phase = Phase::Open;
                self.out.push(0x00);
                self.out.push((self.topic.len() + 1) as u8);
                self.out.push(0x01);
                self.out.extend_from_slice(&self.topic);
                // Only needed for the subscription: an idle connection keeps just its buffers.
                self.topic = Vec::new();
                Ok(())
            }
            (Phase::Open, b"PING") => {
                if data.len() < 2 {
                    return Err(ZmtpError::MalformedCommand { command: "PING" });
                }
                let context = &data[2..];
                let context = &context[..context.len().min(MAX_PING_CONTEXT)];
                if self.out.len() + 7 + context.len() <= WRITE_BUFFER {
                    self.out.push(FLAG_COMMAND);
                    self.out.push((5 + context.len()) as u8);
                    self.out.push(4);
                    self.out.extend_from_slice(b"PONG");
                    self.out.extend_from_slice(context);
                    self.pings_answered += 1;
                } else {
                    self.ignored_commands += 1;
                }
                Ok(())
            }
            (Phase::Open, b"READY") | (Phase::Handshake, _) => Err(ZmtpError::UnexpectedCommand {
                name: String::from_utf8_lossy(name).into_owned(),
            }),
            (_, _) => {
                // PONG, SUBSCRIBE/CANCEL sent by a confused publisher, or a future command.
                self.ignored_commands += 1;
                Ok(())
            }
        }
    }
}

/// The `Socket-Type` property of a READY command's metadata (`Ok(None)` when absent); `Err` when
/// a property's lengths run past the command. Both ends of our ZMTP use it.
pub(crate) fn ready_socket_type(mut props: &[u8]) -> Result<Option<&[u8]>, ()> {
    let mut socket_type = None;
    while !props.is_empty() {
        let (&name_len, rest) = props.split_first().ok_or(())?;
        let name_len = usize::from(name_len);
        let name = rest.get(..name_len).ok_or(())?;
        let rest = &rest[name_len..];
        let len_bytes: [u8; 4] = rest.get(..4).ok_or(())?.try_into().map_err(|_| ())?;
        let value_len = u32::from_be_bytes(len_bytes) as usize;
        let rest = &rest[4..];
        let value = rest.get(..value_len).ok_or(())?;
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            socket_type = Some(value);
        }
        props = &rest[value_len..];
    }
    Ok(socket_type)
}

/// Validates a READY command's metadata: `Socket-Type` must be PUB or XPUB.
fn check_peer_ready(props: &[u8]) -> Result<(), ZmtpError> {
    let socket_type =
        ready_socket_type(props).map_err(|()| ZmtpError::MalformedCommand { command: "READY" })?;
    match socket_type {
        None => Err(ZmtpError::MissingSocketType),
        Some(b"PUB" | b"XPUB") => Ok(()),
        Some(other) => Err(ZmtpError::WrongSocketType {
            socket_type: String::from_utf8_lossy(other).into_owned(),
        }),
    }
}

/// Our greeting: signature, version 3.0, NULL mechanism, as-server 0, zero filler.
pub const GREETING: [u8; GREETING_LEN] = {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 0;
    g[12] = b'N';
    g[13] = b'U';
    g[14] = b'L';
    g[15] = b'L';
    g
};

/// Our READY command: `Socket-Type: SUB`, nothing else.
pub const READY_SUB: [u8; 27] = *b"\x04\x19\x05READY\x0bSocket-Type\x00\x00\x00\x03SUB";

#[cfg(test)]
mod tests;
