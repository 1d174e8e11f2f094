//! The PUB side of one ZMTP 3.x connection as a sans-IO state machine, for publishers this
//! project runs itself (the demo's simulated Dynamo workers).
//!
//! Scope mirrors [`super::ZmtpSub`]: a ZMTP 3.x greeting with the NULL mechanism (we announce
//! 3.0, so a 3.1 peer speaks 3.0 to us), one READY exchange (`Socket-Type: PUB` out; the peer's
//! must be `SUB` or `XSUB`), then subscriptions as ZMTP 3.0 messages (`0x01 + prefix`,
//! `0x00 + prefix` to cancel) or ZMTP 3.1 `SUBSCRIBE` / `CANCEL` commands. PING is answered
//! with PONG. Everything a subscriber sends is small, so every incoming frame is bounded by
//! [`MAX_INPUT_FRAME`] before it is buffered, and a peer holds at most [`MAX_SUBSCRIPTIONS`].
//!
//! Outgoing data is framed by [`encode_message`]; whether a message goes to this peer at all is
//! [`ZmtpPub::matches`] (prefix match, as libzmq does).

use thiserror::Error;

use super::{FLAG_COMMAND, FLAG_LONG, FLAG_MORE, FLAG_RESERVED, GREETING, GREETING_LEN};

/// Largest frame a subscriber may send (a subscription, READY, PING, ERROR).
pub const MAX_INPUT_FRAME: usize = 512;
/// Most subscriptions one peer may hold; more closes the connection.
pub const MAX_SUBSCRIPTIONS: usize = 64;
/// PONG echoes at most this much of a PING's context.
const MAX_PING_CONTEXT: usize = 16;

/// Our READY command: `Socket-Type: PUB`, nothing else.
pub const READY_PUB: [u8; 27] = *b"\x04\x19\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB";

/// A violation by the subscriber: the connection must be closed.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ZmtpPubError {
    #[error("peer greeting has no ZMTP 3 signature")]
    BadSignature,
    #[error("peer speaks ZMTP {major}.{minor}; only 3.x is supported")]
    UnsupportedVersion { major: u8, minor: u8 },
    #[error("peer security mechanism {mechanism:?} is not NULL")]
    UnsupportedMechanism { mechanism: String },
    #[error("frame flags {flags:#04x} set reserved bits")]
    ReservedFlags { flags: u8 },
    #[error("peer frame declared {declared} bytes, more than {MAX_INPUT_FRAME}")]
    FrameTooLarge { declared: u64 },
    #[error("command frame has the MORE flag")]
    CommandWithMore,
    #[error("malformed {command} command")]
    MalformedCommand { command: &'static str },
    #[error("peer READY has no Socket-Type")]
    MissingSocketType,
    #[error("peer socket type {socket_type:?} is not SUB or XSUB")]
    WrongSocketType { socket_type: String },
    #[error("data frame arrived before the handshake completed")]
    MessageBeforeReady,
    #[error("peer sent READY twice")]
    ReadyTwice,
    #[error("peer holds more than {MAX_SUBSCRIPTIONS} subscriptions")]
    TooManySubscriptions,
    #[error("peer sent ERROR: {reason}")]
    PeerError { reason: String },
    #[error("connection already failed: {0}")]
    Failed(Box<ZmtpPubError>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Greeting,
    Handshake,
    Open,
}

/// The PUB side of one ZMTP connection.
#[derive(Debug)]
pub struct ZmtpPub {
    phase: Phase,
    /// The greeting, or one frame (header and body) being assembled; bounded by
    /// `9 + MAX_INPUT_FRAME`.
    buf: Vec<u8>,
    out: Vec<u8>,
    subscriptions: Vec<Vec<u8>>,
    /// The previous data frame had MORE: this frame continues a message we ignore.
    in_message: bool,
    failed: Option<ZmtpPubError>,
    peer_minor: u8,
}

impl Default for ZmtpPub {
    fn default() -> Self {
        Self::new()
    }
}

impl ZmtpPub {
    /// A publisher side whose greeting is queued at once; READY follows the peer's greeting.
    pub fn new() -> Self {
        Self {
            phase: Phase::Greeting,
            buf: Vec::with_capacity(GREETING_LEN),
            out: GREETING.to_vec(),
            subscriptions: Vec::new(),
            in_message: false,
            failed: None,
            peer_minor: 0,
        }
    }

    /// True once the peer's READY was accepted.
    pub fn is_open(&self) -> bool {
        self.phase == Phase::Open && self.failed.is_none()
    }

    /// The peer's ZMTP minor version (after the greeting).
    pub fn peer_minor_version(&self) -> u8 {
        self.peer_minor
    }

    /// The prefixes the peer subscribed to, in arrival order (repeats kept, as libzmq counts).
    pub fn subscriptions(&self) -> &[Vec<u8>] {
        &self.subscriptions
    }

    /// Whether a message whose first frame is `topic` goes to this peer.
    pub fn matches(&self, topic: &[u8]) -> bool {
        self.is_open() && self.subscriptions.iter().any(|s| topic.starts_with(s))
    }

    /// Bytes waiting to be written, if any.
    pub fn poll_transmit(&self) -> Option<&[u8]> {
        (!self.out.is_empty()).then_some(self.out.as_slice())
    }

    /// Marks `n` bytes of [`Self::poll_transmit`] as written.
    pub fn advance_transmit(&mut self, n: usize) {
        let n = n.min(self.out.len());
        self.out.drain(..n);
    }

    /// Moves every pending outgoing byte into `dst`.
    pub fn take_outgoing(&mut self, dst: &mut Vec<u8>) {
        dst.append(&mut self.out);
    }

    /// Consumes all of `bytes`. After an error every later call fails too.
    pub fn handle_input(&mut self, mut bytes: &[u8]) -> Result<(), ZmtpPubError> {
        if let Some(error) = &self.failed {
            return Err(ZmtpPubError::Failed(Box::new(error.clone())));
        }
        while !bytes.is_empty() {
            let want = match self.want() {
                Ok(want) => want,
                Err(error) => return Err(self.fail(error)),
            };
            let take = (want - self.buf.len()).min(bytes.len());
            self.buf.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if let Err(error) = self.step() {
                return Err(self.fail(error));
            }
        }
        Ok(())
    }

    fn fail(&mut self, error: ZmtpPubError) -> ZmtpPubError {
        self.failed = Some(error.clone());
        self.buf = Vec::new();
        error
    }

    /// Total bytes the unit being assembled needs, as far as its header tells.
    fn want(&self) -> Result<usize, ZmtpPubError> {
        if self.phase == Phase::Greeting {
            return Ok(GREETING_LEN);
        }
        let Some(&flags) = self.buf.first() else {
            return Ok(1);
        };
        if flags & FLAG_RESERVED != 0 {
            return Err(ZmtpPubError::ReservedFlags { flags });
        }
        let header = if flags & FLAG_LONG == 0 { 2 } else { 9 };
        if self.buf.len() < header {
            return Ok(header);
        }
        let size = declared_size(&self.buf[..header]);
        if size > MAX_INPUT_FRAME as u64 {
            return Err(ZmtpPubError::FrameTooLarge { declared: size });
        }
        Ok(header + size as usize)
    }

    /// Checks what arrived so far; acts on a complete greeting or frame.
    fn step(&mut self) -> Result<(), ZmtpPubError> {
        if self.phase == Phase::Greeting {
            check_greeting_prefix(&self.buf)?;
            if self.buf.len() == GREETING_LEN {
                self.peer_minor = check_greeting(&self.buf)?;
                self.buf.clear();
                self.phase = Phase::Handshake;
                self.out.extend_from_slice(&READY_PUB);
            }
            return Ok(());
        }
        // `want` validates the header; a frame is complete when the buffer reaches it.
        let want = self.want()?;
        if self.buf.len() < want {
            return Ok(());
        }
        let flags = self.buf[0];
        let header = if flags & FLAG_LONG == 0 { 2 } else { 9 };
        let body = std::mem::take(&mut self.buf);
        let result = self.frame(flags, &body[header..]);
        // Keep the (small) allocation for the next frame.
        self.buf = body;
        self.buf.clear();
        result
    }

    fn frame(&mut self, flags: u8, body: &[u8]) -> Result<(), ZmtpPubError> {
        if flags & FLAG_COMMAND != 0 {
            if flags & FLAG_MORE != 0 {
                return Err(ZmtpPubError::CommandWithMore);
            }
            return self.command(body);
        }
        if self.phase != Phase::Open {
            return Err(ZmtpPubError::MessageBeforeReady);
        }
        let first = !self.in_message;
        self.in_message = flags & FLAG_MORE != 0;
        // A subscriber's message is one frame; later frames of a multipart message carry nothing
        // a publisher acts on.
        if !first {
            return Ok(());
        }
        match body.split_first() {
            Some((1, prefix)) => self.subscribe(prefix),
            Some((0, prefix)) => {
                self.cancel(prefix);
                Ok(())
            }
            // Anything else a SUB may send upstream is ignored, as libzmq's PUB does.
            _ => Ok(()),
        }
    }

    fn command(&mut self, body: &[u8]) -> Result<(), ZmtpPubError> {
        let (name, data) = split_command(body)?;
        match (self.phase, name) {
            (Phase::Handshake, b"READY") => {
                check_peer_ready(data)?;
                self.phase = Phase::Open;
                Ok(())
            }
            (Phase::Open, b"READY") => Err(ZmtpPubError::ReadyTwice),
            (_, b"ERROR") => {
                let reason = data
                    .split_first()
                    .map(|(len, rest)| &rest[..usize::from(*len).min(rest.len())])
                    .unwrap_or_default();
                Err(ZmtpPubError::PeerError {
                    reason: String::from_utf8_lossy(reason).into_owned(),
                })
            }
            (Phase::Open, b"SUBSCRIBE") => self.subscribe(data),
            (Phase::Open, b"CANCEL") => {
                self.cancel(data);
                Ok(())
            }
            (Phase::Open, b"PING") => {
                // PING: 2-byte TTL, then a context the PONG echoes.
                let context = data.get(2..).unwrap_or_default();
                let context = &context[..context.len().min(MAX_PING_CONTEXT)];
                let mut pong = vec![4u8];
                pong.extend_from_slice(b"PONG");
                pong.extend_from_slice(context);
                encode_frame(FLAG_COMMAND, &pong, &mut self.out);
                Ok(())
            }
            (Phase::Handshake, _) => Err(ZmtpPubError::MalformedCommand { command: "READY" }),
            // PONG and commands we do not know are ignored.
            _ => Ok(()),
        }
    }

    fn subscribe(&mut self, prefix: &[u8]) -> Result<(), ZmtpPubError> {
        if self.subscriptions.len() >= MAX_SUBSCRIPTIONS {
            return Err(ZmtpPubError::TooManySubscriptions);
        }
        self.subscriptions.push(prefix.to_vec());
        Ok(())
    }

    fn cancel(&mut self, prefix: &[u8]) {
        if let Some(i) = self.subscriptions.iter().position(|s| s == prefix) {
            self.subscriptions.remove(i);
        }
    }
}

fn declared_size(header: &[u8]) -> u64 {
    if header.len() == 2 {
        u64::from(header[1])
    } else {
        let mut size = [0u8; 8];
        size.copy_from_slice(&header[1..9]);
        u64::from_be_bytes(size)
    }
}

/// Rejects a non-ZMTP peer as soon as its signature is visible.
fn check_greeting_prefix(buf: &[u8]) -> Result<(), ZmtpPubError> {
    if buf.first().is_some_and(|b| *b != 0xFF) || buf.get(9).is_some_and(|b| *b != 0x7F) {
        return Err(ZmtpPubError::BadSignature);
    }
    // Judged once both version bytes are here, so the error is the same however the greeting
    // was split.
    if let Some(&[major, minor]) = buf.get(10..12)
        && major < 3
    {
        return Err(ZmtpPubError::UnsupportedVersion { major, minor });
    }
    Ok(())
}

/// Validates a complete greeting; returns the peer's minor version.
fn check_greeting(buf: &[u8]) -> Result<u8, ZmtpPubError> {
    let mechanism = &buf[12..32];
    let name_len = mechanism.iter().position(|b| *b == 0).unwrap_or(20);
    if &mechanism[..name_len] != b"NULL" || mechanism[name_len..].iter().any(|b| *b != 0) {
        return Err(ZmtpPubError::UnsupportedMechanism {
            mechanism: String::from_utf8_lossy(&mechanism[..name_len]).into_owned(),
        });
    }
    Ok(buf[11])
}

fn split_command(body: &[u8]) -> Result<(&[u8], &[u8]), ZmtpPubError> {
    const MALFORMED: ZmtpPubError = ZmtpPubError::MalformedCommand { command: "command" };
    let (&len, rest) = body.split_first().ok_or(MALFORMED)?;
    let len = usize::from(len);
    let name = rest.get(..len).ok_or(MALFORMED)?;
    Ok((name, &rest[len..]))
}

/// Validates a READY command's metadata: `Socket-Type` must be SUB or XSUB.
fn check_peer_ready(props: &[u8]) -> Result<(), ZmtpPubError> {
    let socket_type = super::ready_socket_type(props)
        .map_err(|()| ZmtpPubError::MalformedCommand { command: "READY" })?;
    match socket_type {
        None => Err(ZmtpPubError::MissingSocketType),
        Some(b"SUB" | b"XSUB") => Ok(()),
        Some(other) => Err(ZmtpPubError::WrongSocketType {
            socket_type: String::from_utf8_lossy(other).into_owned(),
        }),
    }
}

fn encode_frame(flags: u8, body: &[u8], out: &mut Vec<u8>) {
    if body.len() > 255 {
        out.push(flags | FLAG_LONG);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        out.push(flags);
        out.push(body.len() as u8);
    }
    out.extend_from_slice(body);
}

/// Appends a multipart data message (MORE on every frame but the last) to `out`.
pub fn encode_message<F: AsRef<[u8]>>(frames: &[F], out: &mut Vec<u8>) {
    let last = frames.len().saturating_sub(1);
    for (i, frame) in frames.iter().enumerate() {
        let flags = if i < last { FLAG_MORE } else { 0 };
        encode_frame(flags, frame.as_ref(), out);
    }
}

#[cfg(test)]
mod tests {
    use super::super::{ZmtpLimits, ZmtpSub};
    use super::*;
    use crate::event_plane::encode::encode_kv_metrics;
    use crate::event_plane::{ActiveLoad, decode_kv_metrics};
    use crate::ids::{DpRank, InstanceId, PublisherId};
    use crate::time::UnixMillis;

    /// Moves bytes both ways until neither side has anything to say.
    fn exchange(sub: &mut ZmtpSub, publisher: &mut ZmtpPub) {
        for _ in 0..16 {
            let mut to_pub = Vec::new();
            sub.take_outgoing(&mut to_pub);
            let mut to_sub = Vec::new();
            publisher.take_outgoing(&mut to_sub);
            if to_pub.is_empty() && to_sub.is_empty() {
                return;
            }
            publisher.handle_input(&to_pub).expect("publisher accepts");
            sub.feed(&to_sub, |_| panic!("no data yet"))
                .expect("subscriber accepts");
        }
        panic!("the handshake did not settle");
    }

    #[test]
    fn the_projects_sub_completes_the_handshake_and_receives_a_kv_metrics_message() {
        let mut sub = ZmtpSub::new(b"kv_metrics", ZmtpLimits::KV_METRICS).unwrap();
        let mut publisher = ZmtpPub::new();
        exchange(&mut sub, &mut publisher);
        assert!(sub.is_open());
        assert!(publisher.is_open());
        assert_eq!(publisher.subscriptions(), &[b"kv_metrics".to_vec()]);
        assert!(publisher.matches(b"kv_metrics"));
        assert!(!publisher.matches(b"kv-events"));

        let load = ActiveLoad {
            worker_id: InstanceId(7_668_682_573_600_862_486),
            dp_rank: DpRank(1),
            active_decode_blocks: Some(12),
            active_prefill_tokens: Some(300),
            kv_used_blocks: Some(14),
        };
        let publisher_id = PublisherId(4_017_100_110_235_465);
        let frames = encode_kv_metrics(publisher_id, 7, UnixMillis(1_796_028_060_991), &load);
        let mut wire = Vec::new();
        encode_message(&frames, &mut wire);
        let mut got = Vec::new();
        sub.feed(&wire, |d| got.push(d)).unwrap();
        assert_eq!(got.len(), 1);
        let event = decode_kv_metrics(&got[0], publisher_id).unwrap();
        assert_eq!(event.sequence, 7);
        assert_eq!(event.load, load);
    }

    #[test]
    fn bytes_arriving_one_at_a_time_give_the_same_handshake() {
        let mut sub = ZmtpSub::new(b"kv", ZmtpLimits::KV_METRICS).unwrap();
        let mut publisher = ZmtpPub::new();
        for _ in 0..8 {
            let mut to_pub = Vec::new();
            sub.take_outgoing(&mut to_pub);
            for b in &to_pub {
                publisher.handle_input(std::slice::from_ref(b)).unwrap();
            }
            let mut to_sub = Vec::new();
            publisher.take_outgoing(&mut to_sub);
            sub.feed(&to_sub, |_| {}).unwrap();
        }
        assert!(publisher.is_open());
        assert!(publisher.matches(b"kv_metrics"));
    }

    fn open_publisher() -> ZmtpPub {
        let mut publisher = ZmtpPub::new();
        let mut greeting = GREETING.to_vec();
        greeting[11] = 1;
        publisher.handle_input(&greeting).unwrap();
        publisher
            .handle_input(b"\x04\x19\x05READY\x0bSocket-Type\x00\x00\x00\x03SUB")
            .unwrap();
        assert!(publisher.is_open());
        publisher
    }

    #[test]
    fn zmtp_3_1_subscribe_and_cancel_commands_and_ping_are_understood() {
        let mut publisher = open_publisher();
        let mut input = Vec::new();
        encode_frame(FLAG_COMMAND, b"\x09SUBSCRIBEkv_", &mut input);
        encode_frame(FLAG_COMMAND, b"\x04PING\x00\x0actx", &mut input);
        publisher.handle_input(&input).unwrap();
        assert!(publisher.matches(b"kv_metrics"));
        let mut out = Vec::new();
        publisher.take_outgoing(&mut out);
        assert!(out.ends_with(b"\x04\x08\x04PONGctx"), "{out:?}");
        let mut cancel = Vec::new();
        encode_frame(FLAG_COMMAND, b"\x06CANCELkv_", &mut cancel);
        publisher.handle_input(&cancel).unwrap();
        assert!(!publisher.matches(b"kv_metrics"));
    }

    #[test]
    fn violations_close_the_connection() {
        let mut bad = ZmtpPub::new();
        assert_eq!(
            bad.handle_input(b"GET / HTTP/1.1\r\n"),
            Err(ZmtpPubError::BadSignature)
        );
        assert!(matches!(
            bad.handle_input(b"x"),
            Err(ZmtpPubError::Failed(_))
        ));

        let mut publisher = ZmtpPub::new();
        publisher.handle_input(&GREETING).unwrap();
        assert_eq!(
            publisher.handle_input(b"\x04\x19\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB"),
            Err(ZmtpPubError::WrongSocketType {
                socket_type: "PUB".into()
            })
        );

        let mut publisher = open_publisher();
        let mut huge = vec![FLAG_LONG];
        huge.extend_from_slice(&u64::MAX.to_be_bytes());
        assert_eq!(
            publisher.handle_input(&huge),
            Err(ZmtpPubError::FrameTooLarge { declared: u64::MAX })
        );

        let mut publisher = open_publisher();
        let mut many = Vec::new();
        for i in 0..=MAX_SUBSCRIPTIONS {
            encode_frame(0, &[1, i as u8], &mut many);
        }
        assert_eq!(
            publisher.handle_input(&many),
            Err(ZmtpPubError::TooManySubscriptions)
        );

        let mut publisher = ZmtpPub::new();
        publisher.handle_input(&GREETING).unwrap();
        assert_eq!(
            publisher.handle_input(b"\x00\x03\x01kv"),
            Err(ZmtpPubError::MessageBeforeReady)
        );
    }

    #[test]
    fn long_frames_use_the_8_byte_size() {
        let mut out = Vec::new();
        encode_message(&[vec![7u8; 300], vec![1, 2]], &mut out);
        assert_eq!(out[0], FLAG_MORE | FLAG_LONG);
        assert_eq!(&out[1..9], &300u64.to_be_bytes());
        assert_eq!(&out[309..], &[0, 2, 1, 2]);
    }
}
