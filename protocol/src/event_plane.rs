//! Dynamo event-plane decoding: the four-frame ZMQ message, the msgpack `EventEnvelope`, and the
//! `kv_metrics` ActiveLoad payload (dynamo-wire.md §8–§9, Dynamo 1.4.2–1.6.1).
//!
//! ```text
//! [ topic ][ publisher_id: u64 BE ][ sequence: u64 BE ][ 0x01 | payload_len: u32 BE | envelope ]
//! ```
//!
//! Every way a message can be dropped is an [`EventPlaneError`] whose [`EventPlaneError::result`]
//! is a value of the closed [`LoadEventResult`] enum, the `result` label of
//! `continuum_dynamo_load_events_total`. Dropping a message never closes the subscription;
//! only transport violations ([`crate::zmtp::ZmtpError`]) do.

pub mod encode;
pub mod msgpack;

use thiserror::Error;

use crate::ids::{DpRank, InstanceId, PublisherId};
use crate::time::UnixMillis;
use crate::zmtp::{Delivery, Discard, ZmtpMessage};

use self::msgpack::{Container, MsgpackError, Reader};

/// The only frame-header version upstream writes.
pub const FRAME_VERSION: u8 = 1;
/// `version: u8 | payload_len: u32 BE`.
pub const FRAME_HEADER_LEN: usize = 5;
/// Raw topic of ActiveLoad samples (frame 0 and the envelope's `topic` in direct mode).
pub const KV_METRICS_TOPIC: &str = "kv_metrics";
/// Raw topic of RouterEvent batches.
pub const KV_EVENTS_TOPIC: &str = "kv-events";
/// Largest declared `kv_metrics` envelope; larger ones are `oversized`, refused before parsing.
pub const MAX_KV_METRICS_PAYLOAD: usize = 16 * 1024;
/// Largest declared `kv-events` envelope (the ZMTP frame ceiling minus the frame header).
pub const MAX_KV_EVENTS_PAYLOAD: usize = 1024 * 1024 - FRAME_HEADER_LEN;

/// The closed set of outcomes counted in `continuum_dynamo_load_events_total{result}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LoadEventResult {
    Applied,
    Malformed,
    UnknownVersion,
    TopicMismatch,
    Oversized,
    IdentityMismatch,
    OverCapacity,
    Duplicate,
    TransportRefused,
}

impl LoadEventResult {
    /// Every value, so the metric's series can be pre-registered.
    pub const ALL: [LoadEventResult; 9] = [
        Self::Applied,
        Self::Malformed,
        Self::UnknownVersion,
        Self::TopicMismatch,
        Self::Oversized,
        Self::IdentityMismatch,
        Self::OverCapacity,
        Self::Duplicate,
        Self::TransportRefused,
    ];

    /// The metric label value.
    /// The Prometheus label value (same as [`LoadEventResult::as_str`]).
    pub fn as_label(self) -> &'static str {
        self.as_str()
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Applied => "applied",
            Self::Malformed => "malformed",
            Self::UnknownVersion => "unknown_version",
            Self::TopicMismatch => "topic_mismatch",
            Self::Oversized => "oversized",
            Self::IdentityMismatch => "identity_mismatch",
            Self::OverCapacity => "over_capacity",
            Self::Duplicate => "duplicate",
            Self::TransportRefused => "transport_refused",
        }
    }
}

impl std::fmt::Display for LoadEventResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a topic was found to differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TopicSource {
    Frame,
    Envelope,
}

/// Why an event-plane message was dropped.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum EventPlaneError {
    #[error("message has {0} frames, not 4")]
    FrameCount(usize),
    #[error("id frame {frame} is {len} bytes, not 8")]
    IdFrameLength { frame: usize, len: usize },
    #[error("event frame is {0} bytes, shorter than its 5-byte header")]
    FrameTooShort(usize),
    #[error("event frame version {0} is not 1")]
    UnknownVersion(u8),
    #[error("{found_in:?} topic differs from the subscribed topic")]
    TopicMismatch { found_in: TopicSource },
    #[error("declared payload of {declared} bytes exceeds {limit}")]
    Oversized { declared: u64, limit: usize },
    #[error("the transport skipped an oversized message: {0:?}")]
    Skipped(Discard),
    #[error("declared payload of {declared} bytes but only {available} present")]
    PayloadTruncated { declared: usize, available: usize },
    #[error("invalid {what} msgpack: {error}")]
    Msgpack {
        what: &'static str,
        error: MsgpackError,
    },
    #[error("frame publisher {frame} differs from envelope publisher {envelope}")]
    PublisherMismatch {
        frame: PublisherId,
        envelope: PublisherId,
    },
    #[error("frame sequence {frame} differs from envelope sequence {envelope}")]
    SequenceMismatch { frame: u64, envelope: u64 },
    #[error("publisher {got} is not the discovered publisher {expected}")]
    UnexpectedPublisher {
        expected: PublisherId,
        got: PublisherId,
    },
}

impl EventPlaneError {
    /// The counted outcome of this drop.
    pub fn result(&self) -> LoadEventResult {
        match self {
            Self::FrameCount(_)
            | Self::IdFrameLength { .. }
            | Self::FrameTooShort(_)
            | Self::PayloadTruncated { .. }
            | Self::Msgpack { .. }
            // Upstream's validating consumer requires both copies of the sequence to agree.
            | Self::SequenceMismatch { .. }
            | Self::Skipped(Discard::TooManyFrames) => LoadEventResult::Malformed,
            Self::UnknownVersion(_) => LoadEventResult::UnknownVersion,
            Self::TopicMismatch { .. } => LoadEventResult::TopicMismatch,
            Self::Oversized { .. }
            | Self::Skipped(Discard::FrameTooLarge { .. } | Discard::MessageTooLarge) => {
                LoadEventResult::Oversized
            }
            Self::PublisherMismatch { .. } | Self::UnexpectedPublisher { .. } => {
                LoadEventResult::IdentityMismatch
            }
        }
    }
}

/// What a subscription expects of every message on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamExpectation<'a> {
    /// The raw topic (`kv_metrics`, `kv-events`).
    pub topic: &'a str,
    /// The discovered EventChannel `instance_id`.
    pub publisher_id: PublisherId,
    /// Declared envelope sizes above this are `oversized`.
    pub max_payload: usize,
}

impl StreamExpectation<'static> {
    pub fn kv_metrics(publisher_id: PublisherId) -> Self {
        Self {
            topic: KV_METRICS_TOPIC,
            publisher_id,
            max_payload: MAX_KV_METRICS_PAYLOAD,
        }
    }

    pub fn kv_events(publisher_id: PublisherId) -> Self {
        Self {
            topic: KV_EVENTS_TOPIC,
            publisher_id,
            max_payload: MAX_KV_EVENTS_PAYLOAD,
        }
    }
}

/// A decoded `EventEnvelope`, borrowing its topic and payload from the message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventEnvelope<'a> {
    pub publisher_id: PublisherId,
    pub sequence: u64,
    /// The publisher's wall clock; informative only (staleness uses receipt time).
    pub published_at: UnixMillis,
    pub topic: &'a str,
    /// The msgpack payload (ActiveLoad, or an array of RouterEvent).
    pub payload: &'a [u8],
}

/// Decodes a transport delivery; a skipped message maps to `oversized` or `malformed`.
pub fn decode_delivery<'a>(
    delivery: &'a Delivery,
    expect: StreamExpectation<'_>,
) -> Result<EventEnvelope<'a>, EventPlaneError> {
    match delivery {
        Delivery::Message(message) => decode_message(message, expect),
        Delivery::Discarded(reason) => Err(EventPlaneError::Skipped(*reason)),
    }
}

/// Decodes and validates one four-frame message.
pub fn decode_message<'a>(
    message: &'a ZmtpMessage,
    expect: StreamExpectation<'_>,
) -> Result<EventEnvelope<'a>, EventPlaneError> {
    if message.frame_count() != 4 {
        return Err(EventPlaneError::FrameCount(message.frame_count()));
    }
    let frame = |i| message.frame(i).unwrap_or_default();
    decode_frames([frame(0), frame(1), frame(2), frame(3)], expect)
}

/// Decodes and validates the four frames, cheapest checks first; the envelope is parsed only
/// once its declared size is known to be within `expect.max_payload`.
pub fn decode_frames<'a>(
    frames: [&'a [u8]; 4],
    expect: StreamExpectation<'_>,
) -> Result<EventEnvelope<'a>, EventPlaneError> {
    let [topic, publisher, sequence, frame] = frames;
    if topic != expect.topic.as_bytes() {
        return Err(EventPlaneError::TopicMismatch {
            found_in: TopicSource::Frame,
        });
    }
    let frame_publisher = PublisherId(id_frame(1, publisher)?);
    let frame_sequence = id_frame(2, sequence)?;
    if frame.len() < FRAME_HEADER_LEN {
        return Err(EventPlaneError::FrameTooShort(frame.len()));
    }
    if frame[0] != FRAME_VERSION {
        return Err(EventPlaneError::UnknownVersion(frame[0]));
    }
    let declared = u32::from_be_bytes([frame[1], frame[2], frame[3], frame[4]]) as usize;
    if declared > expect.max_payload {
        return Err(EventPlaneError::Oversized {
            declared: declared as u64,
            limit: expect.max_payload,
        });
    }
    let body = &frame[FRAME_HEADER_LEN..];
    // Upstream copies exactly payload_len bytes, so trailing bytes are tolerated.
    let bytes = body
        .get(..declared)
        .ok_or(EventPlaneError::PayloadTruncated {
            declared,
            available: body.len(),
        })?;
    let envelope = decode_envelope(bytes)?;
    if envelope.topic != expect.topic {
        return Err(EventPlaneError::TopicMismatch {
            found_in: TopicSource::Envelope,
        });
    }
    if envelope.publisher_id != frame_publisher {
        return Err(EventPlaneError::PublisherMismatch {
            frame: frame_publisher,
            envelope: envelope.publisher_id,
        });
    }
    if envelope.publisher_id != expect.publisher_id {
        return Err(EventPlaneError::UnexpectedPublisher {
            expected: expect.publisher_id,
            got: envelope.publisher_id,
        });
    }
    if envelope.sequence != frame_sequence {
        return Err(EventPlaneError::SequenceMismatch {
            frame: frame_sequence,
            envelope: envelope.sequence,
        });
    }
    Ok(envelope)
}

fn id_frame(index: usize, bytes: &[u8]) -> Result<u64, EventPlaneError> {
    let array: [u8; 8] = bytes
        .try_into()
        .map_err(|_| EventPlaneError::IdFrameLength {
            frame: index,
            len: bytes.len(),
        })?;
    Ok(u64::from_be_bytes(array))
}

fn envelope_error(error: MsgpackError) -> EventPlaneError {
    EventPlaneError::Msgpack {
        what: "envelope",
        error,
    }
}

/// Decodes an `EventEnvelope` in its named-map form (what publishers write) or the positional
/// array form rmp-serde also accepts. Unknown map keys are skipped.
pub fn decode_envelope(bytes: &[u8]) -> Result<EventEnvelope<'_>, EventPlaneError> {
    decode_envelope_inner(&mut Reader::new(bytes)).map_err(envelope_error)
}

fn decode_envelope_inner<'a>(r: &mut Reader<'a>) -> Result<EventEnvelope<'a>, MsgpackError> {
    let mut publisher_id = None;
    let mut sequence = None;
    let mut published_at = None;
    let mut topic = None;
    let mut payload = None;
    match r.container()? {
        Container::Map(n) => {
            for _ in 0..n {
                match r.str_bytes()? {
                    b"publisher_id" => set(&mut publisher_id, r.uint()?, "publisher_id")?,
                    b"sequence" => set(&mut sequence, r.uint()?, "sequence")?,
                    b"published_at" => set(&mut published_at, r.uint()?, "published_at")?,
                    b"topic" => set(&mut topic, r.str()?, "topic")?,
                    b"payload" => set(&mut payload, r.bin()?, "payload")?,
                    _ => r.skip()?,
                }
            }
        }
        Container::Array(n) => {
            if n < 5 {
                return Err(MsgpackError::MissingField(ENVELOPE_FIELDS[n]));
            }
            publisher_id = Some(r.uint()?);
            sequence = Some(r.uint()?);
            published_at = Some(r.uint()?);
            topic = Some(r.str()?);
            payload = Some(r.bin()?);
            for _ in 5..n {
                r.skip()?;
            }
        }
    }
    Ok(EventEnvelope {
        publisher_id: PublisherId(publisher_id.ok_or(MsgpackError::MissingField("publisher_id"))?),
        sequence: sequence.ok_or(MsgpackError::MissingField("sequence"))?,
        published_at: UnixMillis(published_at.ok_or(MsgpackError::MissingField("published_at"))?),
        topic: topic.ok_or(MsgpackError::MissingField("topic"))?,
        payload: payload.ok_or(MsgpackError::MissingField("payload"))?,
    })
}

const ENVELOPE_FIELDS: [&str; 5] = [
    "publisher_id",
    "sequence",
    "published_at",
    "topic",
    "payload",
];

/// Duplicate keys are refused, as serde-derived upstream decoders do.
fn set<T>(slot: &mut Option<T>, value: T, name: &'static str) -> Result<(), MsgpackError> {
    if slot.replace(value).is_some() {
        return Err(MsgpackError::DuplicateField(name));
    }
    Ok(())
}

/// One `kv_metrics` sample (dynamo-wire.md §9.1). `None` is msgpack `nil` or a missing key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ActiveLoad {
    pub worker_id: InstanceId,
    pub dp_rank: DpRank,
    pub active_decode_blocks: Option<u64>,
    pub active_prefill_tokens: Option<u64>,
    pub kv_used_blocks: Option<u64>,
}

/// Decodes an ActiveLoad from its named-map form or its positional-array form
/// (`[worker_id, dp_rank, active_decode_blocks, active_prefill_tokens, kv_used_blocks]`; trailing
/// elements may be missing, extra ones are skipped). `worker_id` is required, `dp_rank`
/// defaults to 0.
pub fn decode_active_load(bytes: &[u8]) -> Result<ActiveLoad, EventPlaneError> {
    decode_active_load_inner(&mut Reader::new(bytes)).map_err(|error| EventPlaneError::Msgpack {
        what: "ActiveLoad",
        error,
    })
}

fn decode_active_load_inner(r: &mut Reader<'_>) -> Result<ActiveLoad, MsgpackError> {
    let mut worker_id = None;
    let mut dp_rank = None;
    let mut decode = None;
    let mut prefill = None;
    let mut used = None;
    match r.container()? {
        Container::Map(n) => {
            for _ in 0..n {
                match r.str_bytes()? {
                    b"worker_id" => set(&mut worker_id, r.uint()?, "worker_id")?,
                    b"dp_rank" => set(&mut dp_rank, r.uint()?, "dp_rank")?,
                    b"active_decode_blocks" => {
                        set(&mut decode, r.opt_uint()?, "active_decode_blocks")?
                    }
                    b"active_prefill_tokens" => {
                        set(&mut prefill, r.opt_uint()?, "active_prefill_tokens")?
                    }
                    b"kv_used_blocks" => set(&mut used, r.opt_uint()?, "kv_used_blocks")?,
                    _ => r.skip()?,
                }
            }
        }
        Container::Array(n) => {
            if n == 0 {
                return Err(MsgpackError::MissingField("worker_id"));
            }
            worker_id = Some(r.uint()?);
            if n > 1 {
                dp_rank = Some(r.uint()?);
            }
            if n > 2 {
                decode = Some(r.opt_uint()?);
            }
            if n > 3 {
                prefill = Some(r.opt_uint()?);
            }
            if n > 4 {
                used = Some(r.opt_uint()?);
            }
            for _ in 5..n {
                r.skip()?;
            }
        }
    }
    let dp_rank = dp_rank.unwrap_or(0);
    Ok(ActiveLoad {
        worker_id: InstanceId(worker_id.ok_or(MsgpackError::MissingField("worker_id"))?),
        dp_rank: DpRank(
            u32::try_from(dp_rank).map_err(|_| MsgpackError::IntegerOverflow(dp_rank))?,
        ),
        active_decode_blocks: decode.flatten(),
        active_prefill_tokens: prefill.flatten(),
        kv_used_blocks: used.flatten(),
    })
}

/// A validated `kv_metrics` message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadEvent {
    pub publisher_id: PublisherId,
    pub sequence: u64,
    pub published_at: UnixMillis,
    pub load: ActiveLoad,
}

/// Decodes a `kv_metrics` delivery from the discovered publisher `publisher_id`.
pub fn decode_kv_metrics(
    delivery: &Delivery,
    publisher_id: PublisherId,
) -> Result<LoadEvent, EventPlaneError> {
    let envelope = decode_delivery(delivery, StreamExpectation::kv_metrics(publisher_id))?;
    Ok(LoadEvent {
        publisher_id: envelope.publisher_id,
        sequence: envelope.sequence,
        published_at: envelope.published_at,
        load: decode_active_load(envelope.payload)?,
    })
}

/// What one sequence number means on an ordered stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SequenceCheck {
    /// The first message applied since (re)connecting; the stream joined mid-way.
    First,
    /// Exactly one above the highest applied sequence.
    Next,
    /// Above the highest applied sequence with `missed` numbers in between: a change may have
    /// been lost, so samples held from this publisher must be dropped before applying.
    Gap { missed: u64 },
    /// At or below the highest applied sequence: drop as `duplicate`.
    Duplicate,
}

/// Per-subscription dedup by sequence on one ordered TCP stream. Reset on every (re)connect.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamSequence {
    highest_applied: Option<u64>,
}

impl StreamSequence {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn highest_applied(&self) -> Option<u64> {
        self.highest_applied
    }

    /// Classifies `sequence` without recording it.
    pub fn check(&self, sequence: u64) -> SequenceCheck {
        match self.highest_applied {
            None => SequenceCheck::First,
            Some(highest) if sequence <= highest => SequenceCheck::Duplicate,
            Some(highest) if sequence == highest + 1 => SequenceCheck::Next,
            Some(highest) => SequenceCheck::Gap {
                missed: sequence - highest - 1,
            },
        }
    }

    /// Records that `sequence` was applied (never lowers the mark).
    pub fn record_applied(&mut self, sequence: u64) {
        self.highest_applied = Some(self.highest_applied.map_or(sequence, |h| h.max(sequence)));
    }

    /// Forgets the stream (a new connection).
    pub fn reset(&mut self) {
        self.highest_applied = None;
    }
}

#[cfg(test)]
mod tests;
