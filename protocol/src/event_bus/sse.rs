//! The kv_listener push stream (docs/event-bus.md, "continuum-kv-listener"): the SSE bytes a
//! `continuum-kv-listener` writes on an `announced_source` data stream, and the router's bounded
//! parser for them. Sans-IO: the agent calls [`encode_kv_events`] / [`encode_reset`], the router
//! feeds whatever bytes arrive into [`SseParser::push`] and takes [`SseItem`]s.
//!
//! ```text
//! id: 1099511627777
//! event: kv_events
//! data: {"events":[{"worker_id":…,"event":{"event_id":…,"data":{"stored":{…}},"dp_rank":0}}]}
//!
//! event: reset
//! data: {"reason":"evicted","oldest_event_id":1099511627800}
//!
//! ```
//!
//! Every byte is untrusted: a line (and so an event) is at most [`MAX_SSE_EVENT_BYTES`]; a longer
//! one is skipped up to the blank line that ends its event and reported once as
//! [`SseItem::Oversized`]; an event that does not decode is [`SseItem::Malformed`]. Nothing here
//! panics or buffers past the bound.

use serde::{Deserialize, Serialize};

use crate::kv::events::{
    Bounded, KvEventsError, MAX_BLOCKS_PER_BATCH, MAX_EVENTS_PER_BATCH, RouterEvent,
};

/// Largest SSE line, and so largest event, the router accepts (a full 8,192-block batch in JSON
/// is about 0.6 MiB).
pub const MAX_SSE_EVENT_BYTES: usize = 2 * 1024 * 1024;
/// The SSE `event:` of a batch of KV events.
pub const KV_EVENTS_EVENT: &str = "kv_events";
/// The SSE `event:` the agent sends when it cannot resume exactly after `last_event_id`.
pub const RESET_EVENT: &str = "reset";
/// Bits of an event id that count events; the bits above are the agent incarnation's epoch.
pub const EPOCH_SHIFT: u32 = 40;

/// Splits an event id into (epoch, sequence).
pub fn split_event_id(id: u64) -> (u64, u64) {
    (id >> EPOCH_SHIFT, id & ((1u64 << EPOCH_SHIFT) - 1))
}

/// Joins an epoch (24 bits used) and a sequence (40 bits) into an event id.
pub fn event_id(epoch: u64, sequence: u64) -> u64 {
    ((epoch & 0xff_ffff) << EPOCH_SHIFT) | (sequence & ((1u64 << EPOCH_SHIFT) - 1))
}

/// Why the agent could not resume exactly after the router's `last_event_id`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResetReason {
    /// The id is this incarnation's, but the replay ring no longer holds what follows it.
    Evicted,
    /// The id belongs to another agent or an earlier incarnation (or is ahead of this one).
    UnknownEpoch,
    /// The stream fell a whole ring behind the source while it was being served.
    Lagged,
    /// A reason this build does not know.
    #[serde(other)]
    Unknown,
}

impl ResetReason {
    pub const ALL: [ResetReason; 4] = [
        ResetReason::Evicted,
        ResetReason::UnknownEpoch,
        ResetReason::Lagged,
        ResetReason::Unknown,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ResetReason::Evicted => "evicted",
            ResetReason::UnknownEpoch => "unknown_epoch",
            ResetReason::Lagged => "lagged",
            ResetReason::Unknown => "unknown",
        }
    }
}

#[derive(Serialize)]
struct KvEventsOut<'a> {
    events: &'a [RouterEvent],
}

#[derive(Deserialize)]
struct KvEventsIn {
    events: Bounded<RouterEvent, MAX_EVENTS_PER_BATCH>,
}

/// `data` of a reset event.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reset {
    pub reason: ResetReason,
    /// The first id the agent serves after the reset (absent when its ring is empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_event_id: Option<u64>,
}

/// One `kv_events` SSE event (ends with the blank line).
pub fn encode_kv_events(id: u64, events: &[RouterEvent]) -> Vec<u8> {
    let mut out = format!("id: {id}\nevent: {KV_EVENTS_EVENT}\ndata: ").into_bytes();
    // Plain structs of integers and strings: serialising into a Vec cannot fail.
    serde_json::to_writer(&mut out, &KvEventsOut { events })
        .expect("RouterEvent serialises to JSON");
    out.extend_from_slice(b"\n\n");
    out
}

/// One `reset` SSE event.
pub fn encode_reset(reset: &Reset) -> Vec<u8> {
    let mut out = format!("event: {RESET_EVENT}\ndata: ").into_bytes();
    serde_json::to_writer(&mut out, reset).expect("a reset serialises to JSON");
    out.extend_from_slice(b"\n\n");
    out
}

/// Decodes a `kv_events` data field under the same bounds as the msgpack path.
pub fn decode_kv_events(data: &[u8]) -> Result<Vec<RouterEvent>, KvEventsError> {
    let batch: KvEventsIn = serde_json::from_slice(data).map_err(|error| {
        let text = error.to_string();
        if text.contains("continuum-kv-over-capacity") {
            KvEventsError::OverCapacity
        } else {
            KvEventsError::Malformed(text)
        }
    })?;
    let blocks: usize = batch
        .events
        .0
        .iter()
        .map(|e| e.event.data.block_count())
        .sum();
    if blocks > MAX_BLOCKS_PER_BATCH {
        return Err(KvEventsError::OverCapacity);
    }
    Ok(batch.events.0)
}

/// What the parser yields, in stream order.
#[derive(Debug, PartialEq, Eq)]
pub enum SseItem {
    /// A decoded batch and the event's id (`None`: the event carried no `id:`).
    KvEvents {
        id: Option<u64>,
        events: Vec<RouterEvent>,
    },
    /// The agent could not resume exactly.
    Reset(Reset),
    /// An event over [`MAX_SSE_EVENT_BYTES`], skipped whole.
    Oversized,
    /// An event with a bad id, an unknown type, or data that does not decode (over the batch
    /// bounds counts here too, as [`KvEventsError::OverCapacity`]).
    Malformed(MalformedReason),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MalformedReason {
    BadId,
    UnknownEvent,
    BadData,
    OverCapacity,
}

/// The bounded incremental SSE parser (WHATWG event-stream framing: `\n`, `\r\n` or `\r` line
/// ends, `field: value` with one optional space, `:` comments, a blank line dispatches).
#[derive(Debug)]
pub struct SseParser {
    line: Vec<u8>,
    /// The previous byte was `\r`: a following `\n` belongs to the same line end.
    after_cr: bool,
    /// Skipping the rest of an oversized event.
    skipping: bool,
    /// The current line overflowed (its end is not a blank line).
    overflowed: bool,
    id: Option<Option<u64>>,
    event: Option<Vec<u8>>,
    data: Vec<u8>,
    has_data: bool,
    bad_id: bool,
    max: usize,
    items: std::collections::VecDeque<SseItem>,
}

impl Default for SseParser {
    fn default() -> Self {
        Self::new(MAX_SSE_EVENT_BYTES)
    }
}

impl SseParser {
    /// A parser whose lines and events are at most `max` bytes.
    pub fn new(max: usize) -> Self {
        Self {
            line: Vec::new(),
            after_cr: false,
            skipping: false,
            overflowed: false,
            id: None,
            event: None,
            data: Vec::new(),
            has_data: false,
            bad_id: false,
            max,
            items: Default::default(),
        }
    }

    /// Bytes buffered now (at most about twice the bound: one line and one event's data).
    pub fn buffered(&self) -> usize {
        self.line.len() + self.data.len()
    }

    /// Feeds bytes; complete events become items.
    pub fn push(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.after_cr {
                self.after_cr = false;
                if bytes[0] == b'\n' {
                    bytes = &bytes[1..];
                    continue;
                }
            }
            match bytes.iter().position(|b| *b == b'\n' || *b == b'\r') {
                Some(end) => {
                    self.extend_line(&bytes[..end]);
                    self.after_cr = bytes[end] == b'\r';
                    bytes = &bytes[end + 1..];
                    self.end_line();
                }
                None => {
                    self.extend_line(bytes);
                    bytes = &[];
                }
            }
        }
    }

    /// The next parsed item.
    pub fn next_item(&mut self) -> Option<SseItem> {
        self.items.pop_front()
    }

    fn extend_line(&mut self, part: &[u8]) {
        if self.skipping {
            return;
        }
        if self.line.len() + part.len() > self.max {
            self.overflowed = true;
            self.start_skipping();
            return;
        }
        self.line.extend_from_slice(part);
    }

    fn start_skipping(&mut self) {
        self.skipping = true;
        self.line = Vec::new();
        self.reset_event();
        self.items.push_back(SseItem::Oversized);
    }

    fn reset_event(&mut self) {
        self.id = None;
        self.event = None;
        self.data = Vec::new();
        self.has_data = false;
        self.bad_id = false;
    }

    fn end_line(&mut self) {
        let line = std::mem::take(&mut self.line);
        if std::mem::replace(&mut self.overflowed, false) {
            return;
        }
        if line.is_empty() {
            if self.skipping {
                self.skipping = false;
            } else {
                self.dispatch();
            }
            return;
        }
        if self.skipping || line[0] == b':' {
            return;
        }
        let (field, value) = match line.iter().position(|b| *b == b':') {
            Some(colon) => {
                let value = &line[colon + 1..];
                (&line[..colon], value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (&line[..], &[][..]),
        };
        match field {
            b"data" => {
                if self.data.len() + value.len() + 1 > self.max {
                    return self.start_skipping();
                }
                if self.has_data {
                    self.data.push(b'\n');
                }
                self.data.extend_from_slice(value);
                self.has_data = true;
            }
            b"event" => self.event = Some(value.to_vec()),
            b"id" => {
                let parsed = std::str::from_utf8(value)
                    .ok()
                    .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                    .and_then(|s| s.parse::<u64>().ok());
                match parsed {
                    Some(id) => self.id = Some(Some(id)),
                    None => self.bad_id = true,
                }
            }
            // `retry` and unknown fields are ignored, as the SSE spec says.
            _ => {}
        }
    }

    fn dispatch(&mut self) {
        let (id, event, data, has_data, bad_id) = (
            self.id.take().flatten(),
            self.event.take(),
            std::mem::take(&mut self.data),
            std::mem::replace(&mut self.has_data, false),
            std::mem::replace(&mut self.bad_id, false),
        );
        if !has_data && event.is_none() && id.is_none() && !bad_id {
            return;
        }
        let item = if bad_id {
            SseItem::Malformed(MalformedReason::BadId)
        } else {
            match event.as_deref() {
                Some(b"kv_events") => match decode_kv_events(&data) {
                    Ok(events) => SseItem::KvEvents { id, events },
                    Err(KvEventsError::OverCapacity) => {
                        SseItem::Malformed(MalformedReason::OverCapacity)
                    }
                    Err(KvEventsError::Malformed(_)) => {
                        SseItem::Malformed(MalformedReason::BadData)
                    }
                },
                Some(b"reset") => match serde_json::from_slice::<Reset>(&data) {
                    Ok(reset) => SseItem::Reset(reset),
                    Err(_) => SseItem::Malformed(MalformedReason::BadData),
                },
                _ => SseItem::Malformed(MalformedReason::UnknownEvent),
            }
        };
        self.items.push_back(item);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{DpRank, InstanceId};
    use crate::kv::events::{
        KvCacheEvent, KvCacheEventData, KvCacheStoreData, StorageTier, StoredBlock,
    };
    use crate::kv::{ExternalBlockHash, LocalBlockHash};

    fn batch(event_id: u64, blocks: usize) -> Vec<RouterEvent> {
        vec![RouterEvent {
            worker_id: InstanceId(7),
            storage_tier: StorageTier::Device,
            residency_domain: None,
            event: KvCacheEvent {
                event_id,
                data: KvCacheEventData::Stored(KvCacheStoreData {
                    parent_hash: None,
                    start_position: None,
                    blocks: Bounded(
                        (0..blocks as u64)
                            .map(|h| StoredBlock {
                                block_hash: ExternalBlockHash(h),
                                tokens_hash: LocalBlockHash(u64::MAX - h),
                                mm_extra_info: None,
                            })
                            .collect(),
                    ),
                }),
                dp_rank: DpRank(0),
            },
            session_id: None,
        }]
    }

    fn items(parser: &mut SseParser) -> Vec<SseItem> {
        std::iter::from_fn(|| parser.next_item()).collect()
    }

    #[test]
    fn encoded_events_parse_back_byte_by_byte_and_with_every_line_end() {
        let id = event_id(0xabcdef, 42);
        assert_eq!(split_event_id(id), (0xabcdef, 42));
        let mut stream = encode_kv_events(id, &batch(5, 3));
        stream.extend(encode_reset(&Reset {
            reason: ResetReason::Evicted,
            oldest_event_id: Some(9),
        }));
        stream.extend_from_slice(b": keepalive\n\n");
        let expected = vec![
            SseItem::KvEvents {
                id: Some(id),
                events: batch(5, 3),
            },
            SseItem::Reset(Reset {
                reason: ResetReason::Evicted,
                oldest_event_id: Some(9),
            }),
        ];
        let mut parser = SseParser::default();
        for b in &stream {
            parser.push(std::slice::from_ref(b));
        }
        assert_eq!(items(&mut parser), expected);
        for end in [&b"\r\n"[..], b"\r"] {
            let text = String::from_utf8(stream.clone()).unwrap();
            let converted = text.replace('\n', std::str::from_utf8(end).unwrap());
            let mut parser = SseParser::default();
            parser.push(converted.as_bytes());
            assert_eq!(items(&mut parser), expected, "{end:?}");
        }
    }

    #[test]
    fn oversized_and_malformed_events_are_reported_and_skipped_within_the_bound() {
        let mut parser = SseParser::new(256);
        let mut stream = b"id: 1\nevent: kv_events\ndata: ".to_vec();
        stream.extend(std::iter::repeat_n(b'x', 10_000));
        stream.extend_from_slice(b"\nid: 2\n\n");
        stream.extend_from_slice(b"id: -3\nevent: kv_events\ndata: {}\n\n");
        stream.extend_from_slice(b"id: 4\nevent: nope\ndata: {}\n\n");
        stream.extend_from_slice(b"id: 5\nevent: kv_events\ndata: {\"events\":[1]}\n\n");
        stream.extend(encode_kv_events(6, &batch(6, 1)));
        for chunk in stream.chunks(7) {
            parser.push(chunk);
            assert!(parser.buffered() <= 2 * 256);
        }
        assert_eq!(
            items(&mut parser),
            vec![
                SseItem::Oversized,
                SseItem::Malformed(MalformedReason::BadId),
                SseItem::Malformed(MalformedReason::UnknownEvent),
                SseItem::Malformed(MalformedReason::BadData),
                SseItem::KvEvents {
                    id: Some(6),
                    events: batch(6, 1)
                },
            ]
        );
        let mut parser = SseParser::default();
        parser.push(&encode_kv_events(1, &batch(1, MAX_BLOCKS_PER_BATCH + 1)));
        assert_eq!(
            items(&mut parser),
            vec![SseItem::Malformed(MalformedReason::OverCapacity)]
        );
    }
}
