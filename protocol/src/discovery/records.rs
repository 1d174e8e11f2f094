//! Tolerant parsing of Dynamo discovery values (`Endpoint`, `Model`, `EventChannel`,
//! `EventSource`) from untrusted bytes, for the N-2 wire window (1.4.2–1.6.1).
//!
//! Tolerant outside, strict inside: every member is optional, unknown members are ignored, ids
//! may be JSON numbers or hex strings, and a member of the wrong type reads as absent. What comes
//! out is a small internal record with no `Option` soup where a value is required for the record
//! to mean anything (an Endpoint without an `instance_id` is an error, not a default).

use std::fmt;
use std::sync::Arc;

use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Serialize, Serializer};
use serde_json::value::RawValue;

use super::keys::{Keyspace, ParsedKey};
use crate::ids::{DpRank, InstanceId, PublisherId};
use crate::kv::artifacts::{
    CardArtifacts, CheckedFile, FormatterKind, FormatterSlot, TokenizerSlot,
};

/// Raw values above this size are refused before parsing (an order of magnitude above etcd's
/// default 1.5 MiB `--max-request-bytes`).
pub const MAX_RECORD_BYTES: usize = 16 * 1024 * 1024;
/// The opaque model card is retained only up to this size; beyond it only the typed subset is
/// kept (the worker is still published).
pub const MAX_RETAINED_CARD_BYTES: usize = 1024 * 1024;
/// Distinct held keys per keyspace (instances, cards, channels and sources independently).
pub const MAX_RECORDS_PER_KEYSPACE: usize = 16_384;

/// Payload text quoted in errors and logs is cut to this many bytes: a fleet-authored string may
/// be megabytes long.
pub const MAX_QUOTED_BYTES: usize = 128;

/// `text` cut to [`MAX_QUOTED_BYTES`] on a character boundary, marked when cut.
pub fn clip(text: &str) -> String {
    if text.len() <= MAX_QUOTED_BYTES {
        return text.to_owned();
    }
    let mut end = MAX_QUOTED_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// Why a value was refused. Each error is one counted, logged drop of one record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("value of {0} bytes exceeds MAX_RECORD_BYTES")]
    Oversized(usize),
    #[error("value is not a JSON object: {0}")]
    Json(String),
    #[error("record type {found:?} under the {keyspace} keyspace, expected {expected}")]
    WrongType {
        keyspace: &'static str,
        expected: &'static str,
        found: String,
    },
    #[error("record has no usable instance_id")]
    MissingInstanceId,
    #[error("event record has no usable publisher id")]
    MissingPublisherId,
    #[error("event channel has no transport endpoint")]
    MissingEndpoint,
    #[error("event channel endpoint {0:?} is not tcp://host:port")]
    BadEndpoint(String),
    #[error("event channel transport {0:?} is not supported (only direct Zmq)")]
    UnsupportedTransport(String),
    #[error("event channel endpoint scheme of {0:?} is not supported (only tcp://)")]
    UnsupportedScheme(String),
    #[error("event scope kind {0:?} is not supported")]
    UnsupportedScope(String),
}

impl RecordError {
    /// True for records that are well formed but of a kind the router does not consume.
    pub fn is_unsupported(&self) -> bool {
        matches!(
            self,
            RecordError::UnsupportedTransport(_)
                | RecordError::UnsupportedScheme(_)
                | RecordError::UnsupportedScope(_)
        )
    }
}

/// A worker's role in a prefill/decode graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    Prefill,
    Decode,
    Aggregated,
    /// No usable claim: visible to operators, never routed to.
    Unknown,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Aggregated => "aggregated",
            Role::Unknown => "unknown",
        }
    }

    /// The role a component name implies (`prefill` / `decode`), if any.
    pub fn claimed_by_component(component: &str) -> Option<Role> {
        match component {
            "prefill" => Some(Role::Prefill),
            "decode" => Some(Role::Decode),
            _ => None,
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for Role {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// What a card says about the worker's role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CardClaim {
    /// `worker_type` (or, on legacy cards without it, the `Prefill` bit of `model_type`).
    Role(Role),
    /// An unrecognised `worker_type` (e.g. `encode` or a future value) or an unreadable card:
    /// no claim.
    Unrecognised,
}

/// Where a prefill worker takes bootstrap connections, as the card declares it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DisaggregatedEndpoint {
    /// The older string form (`"dynamo/decode/generate"`).
    Path(String),
    /// Dynamo 1.6.1: `{"bootstrap_host", "bootstrap_port"}`. The host is an internal address and
    /// is never exported.
    Bootstrap {
        host: Option<String>,
        port: Option<u16>,
    },
}

/// Capacity a card advertises (per DP rank for `total_kv_blocks`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Capacity {
    pub total_kv_blocks: Option<u64>,
    pub max_num_batched_tokens: Option<u64>,
    pub max_num_seqs: Option<u64>,
    pub context_length: Option<u64>,
}

/// The typed subset of a model card the router uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CardFields {
    /// `display_name`, else `name`.
    pub model: Option<String>,
    pub claim: CardClaim,
    pub block_size: Option<u32>,
    pub capacity: Capacity,
    pub dp_start_rank: Option<DpRank>,
    pub dp_size: Option<u32>,
    pub disaggregated_endpoint: Option<DisaggregatedEndpoint>,
    /// `dynamo_version`, `runtime_version`, `version` or `release`, for a debug log.
    pub release: Option<String>,
    /// The `tokenizer`, `prompt_formatter` and `chat_template_file` slots; an unusable slot is
    /// absent, never a failed record. Shared with the workers built from this card.
    pub artifacts: Arc<CardArtifacts>,
}

impl CardFields {
    fn unreadable() -> Self {
        Self {
            model: None,
            claim: CardClaim::Unrecognised,
            block_size: None,
            capacity: Capacity::default(),
            dp_start_rank: None,
            dp_size: None,
            disaggregated_endpoint: None,
            release: None,
            artifacts: Arc::default(),
        }
    }
}

/// A `tcp://host:port` publisher address. Internal: never serialised, never a metric label.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TcpAddress {
    /// Host without IPv6 brackets.
    pub host: String,
    pub port: u16,
}

impl TcpAddress {
    /// `host:port`, with brackets around IPv6 literals, ready for a resolver.
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// Parses a ZMQ endpoint. Non-tcp schemes are unsupported; anything else that is not a
    /// dialable `tcp://host:port` is malformed.
    pub fn parse(endpoint: &str) -> Result<Self, RecordError> {
        let Some(rest) = endpoint.strip_prefix("tcp://") else {
            return Err(if endpoint.contains("://") {
                RecordError::UnsupportedScheme(clip(endpoint))
            } else {
                RecordError::BadEndpoint(clip(endpoint))
            });
        };
        let bad = || RecordError::BadEndpoint(clip(endpoint));
        let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
            let (host, tail) = v6.split_once(']').ok_or_else(bad)?;
            (host, tail.strip_prefix(':').ok_or_else(bad)?)
        } else {
            let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
            if host.contains(':') {
                return Err(bad());
            }
            (host, port)
        };
        let host_ok = !host.is_empty()
            && host.len() <= 255
            && host.bytes().all(|b| {
                b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_' | b':' | b'%')
            });
        let port: u16 = port.parse().map_err(|_| bad())?;
        if !host_ok || port == 0 || !port_is_plain(rest) {
            return Err(bad());
        }
        Ok(Self {
            host: host.to_owned(),
            port,
        })
    }
}

/// `u16::from_str` accepts a leading `+`; upstream never writes one.
fn port_is_plain(rest: &str) -> bool {
    rest.rsplit_once(':')
        .is_some_and(|(_, p)| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
}

/// The event-plane topics the router consumes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EventTopic {
    /// `kv_metrics`: ActiveLoad samples.
    KvMetrics,
    /// `kv-events`: RouterEvent batches.
    KvEvents,
}

impl EventTopic {
    pub fn as_str(self) -> &'static str {
        match self {
            EventTopic::KvMetrics => "kv_metrics",
            EventTopic::KvEvents => "kv-events",
        }
    }

    /// `None` for topics the router does not consume (skipped silently).
    pub fn parse(topic: &str) -> Option<Self> {
        match topic {
            "kv_metrics" => Some(EventTopic::KvMetrics),
            "kv-events" => Some(EventTopic::KvEvents),
            _ => None,
        }
    }
}

impl fmt::Display for EventTopic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for EventTopic {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// A `generate` Endpoint record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointRecord {
    pub component: String,
    pub endpoint: String,
    pub instance_id: InstanceId,
    /// Request-plane address (internal, never exported).
    pub transport: Option<String>,
}

/// A base-model Model record (LoRA cards are skipped before this point).
#[derive(Clone, Debug, PartialEq)]
pub struct CardRecord {
    pub component: String,
    pub endpoint: String,
    pub instance_id: InstanceId,
    pub fields: CardFields,
    /// The card verbatim, unless it exceeded [`MAX_RETAINED_CARD_BYTES`].
    pub card: Option<CardJson>,
    /// The opaque card was dropped for size.
    pub card_trimmed: bool,
}

impl CardRecord {
    /// Legacy cards leave both component and endpoint empty and join on instance id alone.
    pub fn is_legacy(&self) -> bool {
        self.component.is_empty() && self.endpoint.is_empty()
    }
}

/// A model card kept verbatim: the JSON text of its `card_json` member as the fleet wrote it,
/// valid JSON by construction (it is only ever cut from a parsed record) and at most
/// [`MAX_RETAINED_CARD_BYTES`]. Cloning shares the text.
///
/// Equality is by meaning, as for a parsed card: the same text, or texts that parse to equal
/// JSON values (a card re-serialised with other spacing is the same card). Only the texts of
/// two different cards are ever parsed, and only when they are compared.
#[derive(Clone, Debug)]
pub struct CardJson(Arc<str>);

impl CardJson {
    /// The card's text, verbatim.
    pub fn text(&self) -> &str {
        &self.0
    }

    /// The card as a JSON value (parsed on each call: for operators and tests, never on a hot
    /// path).
    pub fn value(&self) -> serde_json::Value {
        // Valid JSON by construction; `Null` only if that were ever broken.
        serde_json::from_str(&self.0).unwrap_or(serde_json::Value::Null)
    }

    /// Whether both hold the same text allocation (a card shared, not copied).
    pub fn ptr_eq(a: &CardJson, b: &CardJson) -> bool {
        Arc::ptr_eq(&a.0, &b.0)
    }
}

impl PartialEq for CardJson {
    fn eq(&self, other: &CardJson) -> bool {
        CardJson::ptr_eq(self, other) || self.0 == other.0 || self.value() == other.value()
    }
}

/// A direct-ZMQ EventChannel for a consumed topic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChannelRecord {
    pub component: Option<String>,
    pub endpoint: Option<String>,
    pub topic: EventTopic,
    pub publisher_id: PublisherId,
    pub address: TcpAddress,
}

/// An EventSource naming the worker and rank behind a publisher.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceRecord {
    pub publisher_id: PublisherId,
    pub worker_id: InstanceId,
    pub dp_rank: Option<DpRank>,
}

/// Records skipped on purpose, without a count or a log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Skip {
    /// Endpoints other than `generate` (`load_metrics`, `worker_kv_query_source_*`, ...).
    NotGenerate,
    /// A LoRA adapter card (non-empty `model_suffix`): never joins.
    LoraCard,
    /// A topic the router does not consume (`active_sequences_events`, ...).
    OtherTopic,
    /// An EventSource that names no worker.
    NoWorker,
}

/// One parsed value.
#[derive(Clone, Debug, PartialEq)]
pub enum Record {
    Endpoint(EndpointRecord),
    Card(CardRecord),
    Channel(ChannelRecord),
    Source(SourceRecord),
    Skipped(Skip),
}

/// Cards remembered by [`CardMemo`].
pub const CARD_MEMO_ENTRIES: usize = 8;
/// Cards above this size are never remembered, so the memo keeps at most
/// `CARD_MEMO_ENTRIES × CARD_MEMO_MAX_BYTES` of card text alive beyond its records.
pub const CARD_MEMO_MAX_BYTES: usize = 64 * 1024;

/// The cards parsed last, by text. The workers of one deployment publish the same card (the
/// record around it names the instance), so a resync reads each distinct card once and every
/// worker shares its text and typed subset instead of holding a copy. A few entries, compared by
/// bytes (length first); a card not found is parsed as always and replaces the oldest entry.
#[derive(Debug, Default)]
pub struct CardMemo {
    recent: std::collections::VecDeque<(CardJson, CardFields)>,
}

/// How many `"card_json"` spellings [`CardMemo::spot`] looks behind in one record.
const CARD_MEMBER_TRIES: usize = 4;

impl CardMemo {
    /// A remembered card whose text follows a `"card_json":` in `value`, with its offset: a
    /// candidate for [`parse_known_card`] to prove, found by bytes alone.
    fn spot(&self, value: &[u8]) -> Option<(usize, (CardJson, CardFields))> {
        if self.recent.is_empty() {
            return None;
        }
        let is_space = |b: &u8| matches!(b, b' ' | b'\t' | b'\n' | b'\r');
        let skip_space = |at: usize| {
            at + value[at..]
                .iter()
                .position(|b| !is_space(b))
                .unwrap_or(value.len() - at)
        };
        for found in memchr::memmem::find_iter(value, b"\"card_json\"").take(CARD_MEMBER_TRIES) {
            let colon = skip_space(found + b"\"card_json\"".len());
            if value.get(colon) != Some(&b':') {
                continue;
            }
            let at = skip_space(colon + 1);
            let rest = &value[at..];
            if let Some((card, fields)) = self
                .recent
                .iter()
                .find(|(card, _)| rest.starts_with(card.text().as_bytes()))
            {
                return Some((at, (card.clone(), fields.clone())));
            }
        }
        None
    }

    fn find(&self, text: &str) -> Option<(CardJson, CardFields)> {
        self.recent
            .iter()
            .find(|(card, _)| card.text() == text)
            .map(|(card, fields)| (card.clone(), fields.clone()))
    }

    /// Remembers objects only: [`parse_known_card`]'s proof needs a value that ends where its
    /// text ends, which a number (`5` of `56`) does not.
    fn remember(&mut self, card: &CardJson, fields: &CardFields) {
        if card.text().len() > CARD_MEMO_MAX_BYTES || !card.text().starts_with('{') {
            return;
        }
        if self.recent.len() == CARD_MEMO_ENTRIES {
            self.recent.pop_front();
        }
        self.recent.push_back((card.clone(), fields.clone()));
    }
}

/// Parses `value`, held under `key` (already classified) in `keyspace`.
pub fn parse_record(key: &ParsedKey, value: &[u8]) -> Result<Record, RecordError> {
    parse_record_with(key, value, &mut CardMemo::default())
}

/// [`parse_record`], reading a card from `memo` when it was parsed lately.
pub fn parse_record_with(
    key: &ParsedKey,
    value: &[u8],
    memo: &mut CardMemo,
) -> Result<Record, RecordError> {
    if value.len() > MAX_RECORD_BYTES {
        return Err(RecordError::Oversized(value.len()));
    }
    let keyspace = key.keyspace();
    if keyspace == Keyspace::Cards
        && let Some(record) = parse_known_card(key, value, memo)
    {
        return Ok(record);
    }
    let raw: RawRecord<'_> =
        serde_json::from_slice(value).map_err(|e| RecordError::Json(clip(&e.to_string())))?;
    check_type(&raw, keyspace)?;
    match keyspace {
        Keyspace::Instances => parse_endpoint(raw),
        Keyspace::Cards => parse_card(key, raw, memo, None),
        Keyspace::Channels => parse_channel(key, raw),
        Keyspace::Sources => parse_source(raw),
    }
}

/// The text standing in for a remembered card in [`parse_known_card`]: a complete JSON value
/// one byte long.
const CARD_STAND_IN: &[u8] = b"0";

/// A Model record whose card is one [`CardMemo`] remembers, read without scanning the card
/// again: `None` when no remembered card sits as the record's `card_json` value, or when that
/// is not proven (the caller then parses the record in full, which decides every error).
///
/// A candidate is a remembered card's text found right after a `"card_json":` in the bytes.
/// The record is parsed with that text replaced by `0`, and the candidate is proven when the
/// parsed `card_json` is exactly that `0` at exactly that offset: the bytes before it are the
/// record's own, so the parser reaches the offset in the same state, as the value of the
/// top-level `card_json`; there the original holds a complete JSON object (the card was
/// validated at the same place when it was remembered, so also within the same nesting
/// limit), which ends where its text ends, as the `0` does (a `0` that the next bytes would
/// continue, as in `0.5`, is not exactly `0` and is refused); after it both parse the same
/// bytes. So the original parses exactly as the stand-in did, with the remembered card as its
/// `card_json`: the record the full parse would give, without reading the card's text.
fn parse_known_card(key: &ParsedKey, value: &[u8], memo: &mut CardMemo) -> Option<Record> {
    let (at, known) = memo.spot(value)?;
    let text_len = known.0.text().len();
    let mut stand_in = Vec::with_capacity(value.len() - text_len + CARD_STAND_IN.len());
    stand_in.extend_from_slice(&value[..at]);
    stand_in.extend_from_slice(CARD_STAND_IN);
    stand_in.extend_from_slice(&value[at + text_len..]);
    let raw: RawRecord<'_> = serde_json::from_slice(&stand_in).ok()?;
    let found = raw.card_json?.get().as_bytes();
    if found != CARD_STAND_IN || found.as_ptr() != stand_in[at..].as_ptr() {
        return None;
    }
    check_type(&raw, Keyspace::Cards).ok()?;
    parse_card(key, raw, memo, Some(known)).ok()
}

/// A record's own `type`, when it has one, must be its keyspace's.
fn check_type(raw: &RawRecord<'_>, keyspace: Keyspace) -> Result<(), RecordError> {
    if let Some(found) = raw.kind.as_ref() {
        let found = found.as_str().unwrap_or("<non-string>");
        if found != keyspace.record_type() {
            return Err(RecordError::WrongType {
                keyspace: keyspace.as_str(),
                expected: keyspace.record_type(),
                found: clip(found),
            });
        }
    }
    Ok(())
}

fn text(field: Option<&Scalar>) -> String {
    field
        .and_then(Scalar::as_str)
        .unwrap_or_default()
        .to_owned()
}

fn parse_endpoint(raw: RawRecord<'_>) -> Result<Record, RecordError> {
    let endpoint = text(raw.endpoint.as_ref());
    if endpoint != "generate" {
        return Ok(Record::Skipped(Skip::NotGenerate));
    }
    let instance_id = raw
        .instance_id
        .as_ref()
        .and_then(Scalar::as_id)
        .ok_or(RecordError::MissingInstanceId)?;
    let transport = match raw.transport {
        Some(Obj::Valid(t)) => t.tcp.or(t.nats_tcp).and_then(|s| s.into_string()),
        _ => None,
    };
    Ok(Record::Endpoint(EndpointRecord {
        component: text(raw.component.as_ref()),
        endpoint,
        instance_id: InstanceId(instance_id),
        transport,
    }))
}

/// `known`: the card, already found in `memo` by [`parse_known_card`] (`raw.card_json` then
/// holds its stand-in).
fn parse_card(
    key: &ParsedKey,
    raw: RawRecord<'_>,
    memo: &mut CardMemo,
    known: Option<(CardJson, CardFields)>,
) -> Result<Record, RecordError> {
    let suffix_in_value = raw
        .model_suffix
        .as_ref()
        .and_then(Scalar::as_str)
        .is_some_and(|s| !s.is_empty());
    let suffix_in_key =
        matches!(key, ParsedKey::Card { model_suffix: Some(s), .. } if !s.is_empty());
    if suffix_in_value || suffix_in_key {
        return Ok(Record::Skipped(Skip::LoraCard));
    }
    let instance_id = raw
        .instance_id
        .as_ref()
        .and_then(Scalar::as_id)
        .ok_or(RecordError::MissingInstanceId)?;
    let (fields, card, card_trimmed) = match (known, raw.card_json) {
        (Some((card, fields)), _) => (fields, Some(card), false),
        (None, None) => (CardFields::unreadable(), None, false),
        (None, Some(raw_card)) => {
            // The text was validated as JSON when the record was read; the typed subset is read
            // straight from it, and no generic tree of the card is ever built.
            let text = raw_card.get();
            let read = || {
                serde_json::from_str::<RawCard>(text)
                    .map(RawCard::into_fields)
                    .unwrap_or_else(|_| CardFields::unreadable())
            };
            if text.len() > MAX_RETAINED_CARD_BYTES {
                (read(), None, true)
            } else if let Some((card, fields)) = memo.find(text) {
                (fields, Some(card), false)
            } else {
                let card = CardJson(Arc::from(text));
                let fields = read();
                memo.remember(&card, &fields);
                (fields, Some(card), false)
            }
        }
    };
    Ok(Record::Card(CardRecord {
        component: text(raw.component.as_ref()),
        endpoint: text(raw.endpoint.as_ref()),
        instance_id: InstanceId(instance_id),
        fields,
        card,
        card_trimmed,
    }))
}

fn parse_channel(key: &ParsedKey, raw: RawRecord<'_>) -> Result<Record, RecordError> {
    let ParsedKey::Channel {
        scope: key_scope,
        topic: key_topic,
        ..
    } = key
    else {
        return Err(RecordError::Json(
            "channel value under a non-channel key".into(),
        ));
    };
    // Broker registrations are flagged whatever their topic: they mean publishers in this
    // namespace do not register direct channels.
    let transport = match raw.transport {
        Some(Obj::Valid(t)) => Some(t),
        Some(Obj::Invalid) | None => None,
    };
    let kind = transport
        .as_ref()
        .and_then(|t| t.kind.as_ref())
        .and_then(Scalar::as_str)
        .map(str::to_owned);
    if kind.as_deref() == Some("ZmqBroker") {
        return Err(RecordError::UnsupportedTransport("ZmqBroker".into()));
    }
    let topic_text = raw
        .topic
        .as_ref()
        .and_then(Scalar::as_str)
        .unwrap_or(key_topic.as_str());
    let Some(topic) = EventTopic::parse(topic_text) else {
        return Ok(Record::Skipped(Skip::OtherTopic));
    };
    let (component, endpoint) = match raw.scope {
        Some(Obj::Valid(scope)) => scope.component_endpoint()?,
        Some(Obj::Invalid) => return Err(RecordError::UnsupportedScope("<non-object>".into())),
        None => match raw.component.as_ref().and_then(Scalar::as_str) {
            // Legacy (v1.2) shape: `namespace` + `component`, empty component = namespace scope.
            Some("") => (None, None),
            Some(c) => (Some(c.to_owned()), None),
            None => (key_scope.component.clone(), key_scope.endpoint.clone()),
        },
    };
    let publisher_id = raw
        .instance_id
        .as_ref()
        .and_then(Scalar::as_id)
        .ok_or(RecordError::MissingPublisherId)?;
    let Some(transport) = transport else {
        return Err(RecordError::MissingEndpoint);
    };
    match kind.as_deref() {
        Some("Zmq") => {}
        Some(other) => return Err(RecordError::UnsupportedTransport(clip(other))),
        None => return Err(RecordError::MissingEndpoint),
    }
    let endpoint_text = match transport.config {
        Some(Obj::Valid(config)) => config.endpoint.and_then(Scalar::into_string),
        _ => None,
    }
    .ok_or(RecordError::MissingEndpoint)?;
    let address = TcpAddress::parse(&endpoint_text)?;
    Ok(Record::Channel(ChannelRecord {
        component,
        endpoint,
        topic,
        publisher_id: PublisherId(publisher_id),
        address,
    }))
}

fn parse_source(raw: RawRecord<'_>) -> Result<Record, RecordError> {
    let meta = match raw.metadata {
        Some(Obj::Valid(meta)) => Some(meta),
        _ => None,
    };
    let publisher_id = raw
        .publisher_id
        .as_ref()
        .and_then(Scalar::as_id)
        .or_else(|| meta.as_ref()?.publisher_id.as_ref()?.as_id())
        .ok_or(RecordError::MissingPublisherId)?;
    let worker = match meta.and_then(|m| m.worker) {
        Some(Obj::Valid(w)) => w,
        _ => return Ok(Record::Skipped(Skip::NoWorker)),
    };
    let Some(worker_id) = worker.worker_id.as_ref().and_then(Scalar::as_id) else {
        return Ok(Record::Skipped(Skip::NoWorker));
    };
    Ok(Record::Source(SourceRecord {
        publisher_id: PublisherId(publisher_id),
        worker_id: InstanceId(worker_id),
        dp_rank: worker.dp_rank.as_ref().and_then(Scalar::as_u32).map(DpRank),
    }))
}

// ---------------------------------------------------------------------------------------------
// Lenient serde shapes. Every leaf is a `Scalar` and every nested object an `Obj`, so a member of
// the wrong type reads as absent instead of failing the record.

/// Any JSON leaf; containers are skipped without being built.
#[derive(Clone, Debug, PartialEq)]
enum Scalar {
    Str(String),
    U64(u64),
    Neg(i64),
    F64(f64),
    Bool(bool),
    Null,
    Other,
}

impl Scalar {
    fn as_str(&self) -> Option<&str> {
        match self {
            Scalar::Str(s) => Some(s),
            _ => None,
        }
    }

    fn into_string(self) -> Option<String> {
        match self {
            Scalar::Str(s) => Some(s),
            _ => None,
        }
    }

    fn as_u64(&self) -> Option<u64> {
        match self {
            Scalar::U64(v) => Some(*v),
            _ => None,
        }
    }

    fn as_u32(&self) -> Option<u32> {
        self.as_u64().and_then(|v| u32::try_from(v).ok())
    }

    /// Ids: a JSON number, or a hex string (with or without `0x`).
    fn as_id(&self) -> Option<u64> {
        match self {
            Scalar::U64(v) => Some(*v),
            Scalar::Str(s) => InstanceId::from_hex(s).map(|id| id.0),
            _ => None,
        }
    }
}

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ScalarVisitor)
    }
}

struct ScalarVisitor;

impl<'de> Visitor<'de> for ScalarVisitor {
    type Value = Scalar;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Scalar, E> {
        Ok(Scalar::Bool(v))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Scalar, E> {
        Ok(Scalar::U64(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Scalar, E> {
        Ok(u64::try_from(v).map_or(Scalar::Neg(v), Scalar::U64))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Scalar, E> {
        Ok(Scalar::F64(v))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Scalar, E> {
        Ok(Scalar::Str(v.to_owned()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Scalar, E> {
        Ok(Scalar::Str(v))
    }
    fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<Scalar, E> {
        Ok(Scalar::Other)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Scalar, E> {
        Ok(Scalar::Null)
    }
    fn visit_none<E: de::Error>(self) -> Result<Scalar, E> {
        Ok(Scalar::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Scalar, D::Error> {
        Scalar::deserialize(d)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Scalar, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Scalar::Other)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Scalar, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Scalar::Other)
    }
}

/// A nested object, or `Invalid` when the member is not an object.
#[derive(Debug)]
enum Obj<T> {
    Valid(T),
    Invalid,
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Obj<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ObjVisitor<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for ObjVisitor<T> {
            type Value = Obj<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Obj<T>, A::Error> {
                T::deserialize(de::value::MapAccessDeserializer::new(map)).map(Obj::Valid)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Obj<T>, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Obj::Invalid)
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Obj<T>, E> {
                Ok(Obj::Invalid)
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Obj<T>, E> {
                Ok(Obj::Invalid)
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Obj<T>, E> {
                Ok(Obj::Invalid)
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Obj<T>, E> {
                Ok(Obj::Invalid)
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Obj<T>, E> {
                Ok(Obj::Invalid)
            }
            fn visit_unit<E: de::Error>(self) -> Result<Obj<T>, E> {
                Ok(Obj::Invalid)
            }
        }
        d.deserialize_any(ObjVisitor(std::marker::PhantomData))
    }
}

#[derive(serde::Deserialize)]
struct RawRecord<'a> {
    #[serde(rename = "type")]
    kind: Option<Scalar>,
    component: Option<Scalar>,
    endpoint: Option<Scalar>,
    instance_id: Option<Scalar>,
    transport: Option<Obj<RawTransport>>,
    #[serde(borrow)]
    card_json: Option<&'a RawValue>,
    model_suffix: Option<Scalar>,
    scope: Option<Obj<RawScope>>,
    topic: Option<Scalar>,
    publisher_id: Option<Scalar>,
    metadata: Option<Obj<RawSourceMeta>>,
}

#[derive(serde::Deserialize)]
struct RawTransport {
    tcp: Option<Scalar>,
    nats_tcp: Option<Scalar>,
    kind: Option<Scalar>,
    config: Option<Obj<RawTransportConfig>>,
}

#[derive(serde::Deserialize)]
struct RawTransportConfig {
    endpoint: Option<Scalar>,
}

#[derive(serde::Deserialize)]
struct RawScope {
    kind: Option<Scalar>,
    component: Option<Scalar>,
    endpoint: Option<Obj<RawScopeEndpoint>>,
}

impl RawScope {
    fn component_endpoint(self) -> Result<(Option<String>, Option<String>), RecordError> {
        let kind = self
            .kind
            .as_ref()
            .and_then(Scalar::as_str)
            .unwrap_or("<missing>");
        match kind {
            "namespace" => Ok((None, None)),
            "component" => Ok((self.component.and_then(Scalar::into_string), None)),
            "endpoint" => match self.endpoint {
                Some(Obj::Valid(ep)) => Ok((
                    ep.component.and_then(Scalar::into_string),
                    ep.name.and_then(Scalar::into_string),
                )),
                _ => Err(RecordError::UnsupportedScope(
                    "endpoint without endpoint".into(),
                )),
            },
            other => Err(RecordError::UnsupportedScope(clip(other))),
        }
    }
}

#[derive(serde::Deserialize)]
struct RawScopeEndpoint {
    component: Option<Scalar>,
    name: Option<Scalar>,
}

#[derive(serde::Deserialize)]
struct RawSourceMeta {
    worker: Option<Obj<RawSourceWorker>>,
    publisher_id: Option<Scalar>,
}

#[derive(serde::Deserialize)]
struct RawSourceWorker {
    worker_id: Option<Scalar>,
    dp_rank: Option<Scalar>,
}

#[derive(serde::Deserialize)]
struct RawCard {
    display_name: Option<Scalar>,
    name: Option<Scalar>,
    worker_type: Option<Scalar>,
    model_type: Option<Scalar>,
    kv_cache_block_size: Option<Scalar>,
    context_length: Option<Scalar>,
    runtime_config: Option<Obj<RawRuntimeConfig>>,
    dynamo_version: Option<Scalar>,
    runtime_version: Option<Scalar>,
    version: Option<Scalar>,
    release: Option<Scalar>,
    tokenizer: Option<Obj<RawTokenizerSlot>>,
    prompt_formatter: Option<Obj<RawFormatterSlot>>,
    chat_template_file: Option<Obj<RawFormatterSlot>>,
}

/// `{"hf_tokenizer_json": CheckedFile}` | `{"tik_token_model": CheckedFile}` (externally tagged).
#[derive(serde::Deserialize)]
struct RawTokenizerSlot {
    hf_tokenizer_json: Option<Obj<RawCheckedFile>>,
    tik_token_model: Option<Obj<RawCheckedFile>>,
}

/// PromptFormatterArtifact (externally tagged, snake_case).
#[derive(serde::Deserialize)]
struct RawFormatterSlot {
    hf_tokenizer_config_json: Option<Obj<RawCheckedFile>>,
    #[serde(alias = "hf_chat_template_jinja")]
    hf_chat_template: Option<Obj<RawTemplateFile>>,
    hf_chat_template_json: Option<Obj<RawTemplateFile>>,
}

#[derive(serde::Deserialize)]
struct RawTemplateFile {
    is_custom: Option<Scalar>,
    file: Option<Obj<RawCheckedFile>>,
}

#[derive(serde::Deserialize)]
struct RawCheckedFile {
    path: Option<Scalar>,
    checksum: Option<Scalar>,
    size: Option<Scalar>,
}

impl RawCheckedFile {
    fn checked(self) -> Option<CheckedFile> {
        let size = match self.size {
            None | Some(Scalar::Null) => None,
            // A size of the wrong type makes the slot unusable rather than unbounded.
            Some(s) => Some(s.as_u64()?),
        };
        CheckedFile::from_parts(self.path?.as_str()?, self.checksum?.as_str()?, size)
    }
}

fn valid<T>(obj: Option<Obj<T>>) -> Option<T> {
    match obj {
        Some(Obj::Valid(v)) => Some(v),
        _ => None,
    }
}

impl RawTokenizerSlot {
    /// Exactly one recognised variant, else absent.
    fn slot(self) -> Option<TokenizerSlot> {
        match (self.hf_tokenizer_json, self.tik_token_model) {
            (Some(f), None) => valid(Some(f))?
                .checked()
                .map(TokenizerSlot::HfTokenizerJson),
            (None, Some(f)) => valid(Some(f))?.checked().map(TokenizerSlot::TikTokenModel),
            _ => None,
        }
    }
}

impl RawFormatterSlot {
    /// Exactly one recognised variant, else absent.
    fn slot(self) -> Option<FormatterSlot> {
        let template = |t: Obj<RawTemplateFile>, kind| {
            let t = valid(Some(t))?;
            let is_custom = match t.is_custom {
                None | Some(Scalar::Null) => false,
                Some(Scalar::Bool(b)) => b,
                Some(_) => return None,
            };
            Some(FormatterSlot {
                kind,
                file: valid(t.file)?.checked()?,
                is_custom,
            })
        };
        match (
            self.hf_tokenizer_config_json,
            self.hf_chat_template,
            self.hf_chat_template_json,
        ) {
            (Some(f), None, None) => Some(FormatterSlot {
                kind: FormatterKind::TokenizerConfigJson,
                file: valid(Some(f))?.checked()?,
                is_custom: false,
            }),
            (None, Some(t), None) => template(t, FormatterKind::ChatTemplateJinja),
            (None, None, Some(t)) => template(t, FormatterKind::ChatTemplateJson),
            _ => None,
        }
    }
}

#[derive(serde::Deserialize)]
struct RawRuntimeConfig {
    total_kv_blocks: Option<Scalar>,
    max_num_batched_tokens: Option<Scalar>,
    max_num_seqs: Option<Scalar>,
    context_length: Option<Scalar>,
    data_parallel_start_rank: Option<Scalar>,
    data_parallel_size: Option<Scalar>,
    disaggregated_endpoint: Option<RawDisagg>,
}

enum RawDisagg {
    Path(String),
    Bootstrap {
        host: Option<String>,
        port: Option<u16>,
    },
    Invalid,
}

impl<'de> Deserialize<'de> for RawDisagg {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        struct Bootstrap {
            bootstrap_host: Option<Scalar>,
            bootstrap_port: Option<Scalar>,
        }
        // `Obj` gives objects; a string is the older path form.
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawDisagg;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or an object")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawDisagg, E> {
                Ok(RawDisagg::Path(v.to_owned()))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<RawDisagg, A::Error> {
                let b = Bootstrap::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(RawDisagg::Bootstrap {
                    host: b.bootstrap_host.and_then(Scalar::into_string),
                    port: b
                        .bootstrap_port
                        .and_then(|p| p.as_u64())
                        .and_then(|p| u16::try_from(p).ok()),
                })
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<RawDisagg, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(RawDisagg::Invalid)
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<RawDisagg, E> {
                Ok(RawDisagg::Invalid)
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<RawDisagg, E> {
                Ok(RawDisagg::Invalid)
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<RawDisagg, E> {
                Ok(RawDisagg::Invalid)
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<RawDisagg, E> {
                Ok(RawDisagg::Invalid)
            }
            fn visit_unit<E: de::Error>(self) -> Result<RawDisagg, E> {
                Ok(RawDisagg::Invalid)
            }
        }
        d.deserialize_any(V)
    }
}

impl RawCard {
    fn into_fields(self) -> CardFields {
        let claim = match self.worker_type.as_ref() {
            None | Some(Scalar::Null) => {
                // Legacy card without worker_type: the Prefill bit of model_type, else aggregated.
                let prefill = self
                    .model_type
                    .as_ref()
                    .and_then(Scalar::as_str)
                    .is_some_and(|t| t.split('|').any(|flag| flag.trim() == "Prefill"));
                CardClaim::Role(if prefill {
                    Role::Prefill
                } else {
                    Role::Aggregated
                })
            }
            Some(Scalar::Str(t)) => match t.as_str() {
                "prefill" => CardClaim::Role(Role::Prefill),
                "decode" => CardClaim::Role(Role::Decode),
                "aggregated" => CardClaim::Role(Role::Aggregated),
                _ => CardClaim::Unrecognised,
            },
            Some(_) => CardClaim::Unrecognised,
        };
        let rc = match self.runtime_config {
            Some(Obj::Valid(rc)) => Some(rc),
            _ => None,
        };
        let rc_u64 = |f: fn(&RawRuntimeConfig) -> &Option<Scalar>| {
            rc.as_ref()
                .and_then(|rc| f(rc).as_ref())
                .and_then(Scalar::as_u64)
        };
        let context_length = rc_u64(|rc| &rc.context_length)
            .or_else(|| self.context_length.as_ref().and_then(Scalar::as_u64));
        let capacity = Capacity {
            total_kv_blocks: rc_u64(|rc| &rc.total_kv_blocks),
            max_num_batched_tokens: rc_u64(|rc| &rc.max_num_batched_tokens),
            max_num_seqs: rc_u64(|rc| &rc.max_num_seqs),
            context_length,
        };
        let dp_start_rank = rc_u64(|rc| &rc.data_parallel_start_rank)
            .and_then(|v| u32::try_from(v).ok())
            .map(DpRank);
        let dp_size = rc_u64(|rc| &rc.data_parallel_size).and_then(|v| u32::try_from(v).ok());
        let disaggregated_endpoint = match rc.and_then(|rc| rc.disaggregated_endpoint) {
            Some(RawDisagg::Path(p)) => Some(DisaggregatedEndpoint::Path(p)),
            Some(RawDisagg::Bootstrap { host, port }) => {
                Some(DisaggregatedEndpoint::Bootstrap { host, port })
            }
            Some(RawDisagg::Invalid) | None => None,
        };
        let model = self
            .display_name
            .and_then(Scalar::into_string)
            .or_else(|| self.name.and_then(Scalar::into_string));
        let release = [
            self.dynamo_version,
            self.runtime_version,
            self.version,
            self.release,
        ]
        .into_iter()
        .flatten()
        .find_map(Scalar::into_string);
        let artifacts = Arc::new(CardArtifacts {
            tokenizer: valid(self.tokenizer).and_then(RawTokenizerSlot::slot),
            prompt_formatter: valid(self.prompt_formatter).and_then(RawFormatterSlot::slot),
            chat_template_file: valid(self.chat_template_file).and_then(RawFormatterSlot::slot),
        });
        CardFields {
            model,
            claim,
            block_size: self.kv_cache_block_size.as_ref().and_then(Scalar::as_u32),
            capacity,
            dp_start_rank,
            dp_size,
            disaggregated_endpoint,
            release,
            artifacts,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::keys::classify;

    fn parse(key: &str, value: &str) -> Result<Record, RecordError> {
        let (_, parsed) = classify("dynamo", key).expect("key in namespace");
        parse_record(&parsed.expect("key shape"), value.as_bytes())
    }

    const EP_KEY: &str = "v1/instances/dynamo/backend/generate/1a";
    const CARD_KEY: &str = "v1/mdc/dynamo/backend/generate/1a";
    const CH_KEY: &str =
        "v1/event_channels/namespace/dynamo/component/backend/endpoint/generate/topic/kv_metrics/5";

    fn memo_card(memo: &mut CardMemo, id: u64, card_json: &str) -> CardRecord {
        let key = format!("v1/mdc/dynamo/backend/generate/{id:x}");
        let (_, parsed) = classify("dynamo", &key).expect("key in namespace");
        let value = format!(
            r#"{{"type":"Model","component":"backend","endpoint":"generate","instance_id":{id},"card_json":{card_json}}}"#
        );
        match parse_record_with(&parsed.expect("key shape"), value.as_bytes(), memo) {
            Ok(Record::Card(card)) => card,
            other => panic!("expected a card, got {other:?}"),
        }
    }

    #[test]
    fn workers_publishing_the_same_card_share_it() {
        let mut memo = CardMemo::default();
        let text =
            r#"{"display_name":"m","worker_type":"decode","runtime_config":{"total_kv_blocks":7}}"#;
        let a = memo_card(&mut memo, 1, text);
        let b = memo_card(&mut memo, 2, text);
        let (Some(card_a), Some(card_b)) = (&a.card, &b.card) else {
            panic!("cards retained")
        };
        assert!(CardJson::ptr_eq(card_a, card_b), "one text for both");
        assert_eq!(a.fields, b.fields);
        assert_eq!(b.instance_id, InstanceId(2), "the record's own id");
        assert_eq!(b.fields.capacity.total_kv_blocks, Some(7));
        // Another card is parsed on its own, and a memo never changes what a card reads as.
        let other = memo_card(&mut memo, 3, &text.replace(":7}", ":8}"));
        assert_eq!(other.fields.capacity.total_kv_blocks, Some(8));
        assert!(!CardJson::ptr_eq(
            card_a,
            other.card.as_ref().expect("card")
        ));
        let fresh = memo_card(&mut CardMemo::default(), 2, text);
        assert_eq!(fresh, b);
    }

    /// The card every [`remembered_card_cases`] record may carry, remembered first.
    const KNOWN: &str =
        r#"{"display_name":"m","worker_type":"decode","runtime_config":{"total_kv_blocks":7}}"#;

    /// Parses `value` under a card key twice: with a memo that remembers [`KNOWN`] and with a
    /// fresh one (the full parse). Returns both and the memo's copy of the card.
    fn parse_both(
        value: &str,
    ) -> (
        Result<Record, RecordError>,
        Result<Record, RecordError>,
        CardJson,
    ) {
        let mut memo = CardMemo::default();
        let known = memo_card(&mut memo, 9, KNOWN).card.expect("retained");
        let (_, parsed) = classify("dynamo", CARD_KEY).expect("key in namespace");
        let parsed = parsed.expect("key shape");
        let with_memo = parse_record_with(&parsed, value.as_bytes(), &mut memo);
        (with_memo, parse_record(&parsed, value.as_bytes()), known)
    }

    #[test]
    fn a_remembered_card_is_read_without_its_text_as_the_full_parse_reads_it() {
        let head = r#""type":"Model","component":"backend","endpoint":"generate","instance_id":26"#;
        // Shared: the record's card is the remembered one, however the record is spelled.
        for value in [
            format!(r#"{{{head},"card_json":{KNOWN}}}"#),
            format!(r#"{{"card_json":{KNOWN},{head}}}"#),
            format!("{{ {head} ,\n \"card_json\"\t:\r\n {KNOWN}\n}}\n"),
            format!(r#"{{{head},"card_json":{KNOWN},"extra":{{"card_json":[1,2]}}}}"#),
        ] {
            let (with_memo, full, known) = parse_both(&value);
            assert_eq!(with_memo, full, "{value}");
            let Ok(Record::Card(card)) = with_memo else {
                panic!("a card: {value}")
            };
            assert!(
                CardJson::ptr_eq(card.card.as_ref().expect("card"), &known),
                "{value}"
            );
            assert_eq!(card.instance_id, InstanceId(26));
        }
        // Not proven, or not a record: whatever the memo path gives is what the full parse
        // gives, errors included.
        let other = r#"{"display_name":"other"}"#;
        for value in [
            // The remembered text in a nested member before the real one.
            format!(r#"{{{head},"meta":{{"card_json":{KNOWN}}},"card_json":{other}}}"#),
            format!(r#"{{{head},"meta":{{"card_json":{KNOWN}}},"card_json":{KNOWN}}}"#),
            format!(r#"{{{head},"meta":{{"card_json":{KNOWN}}}}}"#),
            // ... before a real card that is the stand-in's own text.
            format!(r#"{{{head},"meta":{{"card_json":{KNOWN}}},"card_json":0}}"#),
            // Bytes after the card that a stand-in number would take as its own.
            format!(r#"{{{head},"card_json":{KNOWN}.5}}"#),
            format!(r#"{{{head},"card_json":{KNOWN}e5}}"#),
            format!(r#"{{{head},"card_json":{KNOWN}0}}"#),
            // A longer object that starts like the card is not the card.
            format!(
                r#"{{{head},"card_json":{}}}"#,
                KNOWN.replace(":7}}", ":7},\"x\":1}")
            ),
            format!(r#"{{{head},"card_json":{KNOWN},"card_json":{KNOWN}}}"#),
            format!(r#"{{{head},"card_json":{KNOWN}}}trailing"#),
            format!(r#"{{{head},"card_json":{KNOWN}"#),
            format!(r#"{{"type":"Endpoint","instance_id":26,"card_json":{KNOWN}}}"#),
            format!(r#"{{"type":"Model","card_json":{KNOWN}}}"#),
            format!(r#"{{{head},"model_suffix":"lora","card_json":{KNOWN}}}"#),
            format!(r#"[{{"card_json":{KNOWN}}}]"#),
        ] {
            let (with_memo, full, _) = parse_both(&value);
            assert_eq!(with_memo, full, "{value}");
        }
    }

    proptest::proptest! {
        /// Members in any order, any JSON whitespace, decoys naming `card_json` elsewhere: a
        /// memo never changes what a record reads as.
        #[test]
        fn a_card_memo_never_changes_a_record(
            order in proptest::strategy::Strategy::prop_shuffle(proptest::sample::subsequence(vec![0usize, 1, 2, 3, 4, 5], 0..=6)),
            spaces in proptest::collection::vec(proptest::sample::select(vec!["", " ", "\n", "\t ", "\r\n"]), 8),
            card in proptest::sample::select(vec![KNOWN, r#"{"display_name":"other"}"#, "0", "null"]),
        ) {
            let members = [
                r#""type":"Model""#.to_owned(),
                r#""instance_id":26"#.to_owned(),
                r#""component":"backend""#.to_owned(),
                format!(r#""card_json"{}:{}{card}"#, spaces[0], spaces[1]),
                format!(r#""meta":{{"card_json":{KNOWN}}}"#),
                format!(r#""note":"card_json{}""#, spaces[2]),
            ];
            let body: Vec<String> = order.iter().map(|&i| members[i].clone()).collect();
            let value = format!("{}{{{}{}}}{}", spaces[3], spaces[4], body.join(&format!(",{}", spaces[5])), spaces[6]);
            let (with_memo, full, _) = parse_both(&value);
            proptest::prop_assert_eq!(with_memo, full, "{}", value);
        }
    }

    #[test]
    fn the_card_memo_is_bounded_in_entries_and_size() {
        let mut memo = CardMemo::default();
        for n in 0..3 * CARD_MEMO_ENTRIES as u64 {
            memo_card(&mut memo, n + 1, &format!(r#"{{"display_name":"m{n}"}}"#));
            assert!(memo.recent.len() <= CARD_MEMO_ENTRIES);
        }
        let big = format!(
            r#"{{"display_name":"{}"}}"#,
            "x".repeat(CARD_MEMO_MAX_BYTES)
        );
        let a = memo_card(&mut memo, 1, &big);
        let b = memo_card(&mut memo, 2, &big);
        assert!(
            !CardJson::ptr_eq(
                a.card.as_ref().expect("retained"),
                b.card.as_ref().expect("retained")
            ),
            "a card above CARD_MEMO_MAX_BYTES is never remembered"
        );
        assert!(
            memo.recent
                .iter()
                .all(|(card, _)| card.text().len() <= CARD_MEMO_MAX_BYTES)
        );
    }

    #[test]
    fn ids_as_number_or_hex_string_normalise() {
        let a = parse(
            EP_KEY,
            r#"{"type":"Endpoint","endpoint":"generate","instance_id":26}"#,
        );
        let b = parse(
            EP_KEY,
            r#"{"type":"Endpoint","endpoint":"generate","instance_id":"1a"}"#,
        );
        let c = parse(EP_KEY, r#"{"endpoint":"generate","instance_id":"0x1A"}"#);
        assert_eq!(a, b);
        assert_eq!(a, c);
        let Ok(Record::Endpoint(ep)) = a else {
            panic!("expected an endpoint, got {a:?}")
        };
        assert_eq!(ep.instance_id, InstanceId(26));
    }

    #[test]
    fn unknown_fields_are_ignored_and_wrong_types_read_as_absent() {
        let got = parse(
            CARD_KEY,
            r#"{"type":"Model","component":"backend","endpoint":"generate","instance_id":26,
                "future":{"x":[1,2]},"card_json":{"display_name":7,"kv_cache_block_size":"16",
                "worker_type":"decode","runtime_config":{"total_kv_blocks":-3,"max_num_seqs":4}}}"#,
        );
        let Ok(Record::Card(card)) = got else {
            panic!("expected a card, got {got:?}")
        };
        assert_eq!(card.fields.model, None);
        assert_eq!(card.fields.block_size, None);
        assert_eq!(card.fields.claim, CardClaim::Role(Role::Decode));
        assert_eq!(card.fields.capacity.total_kv_blocks, None);
        assert_eq!(card.fields.capacity.max_num_seqs, Some(4));
        assert!(card.card.is_some());
    }

    #[test]
    fn endpoint_without_instance_id_is_malformed() {
        assert_eq!(
            parse(EP_KEY, r#"{"type":"Endpoint","endpoint":"generate"}"#),
            Err(RecordError::MissingInstanceId)
        );
        assert!(matches!(
            parse(EP_KEY, "not json"),
            Err(RecordError::Json(_))
        ));
        assert!(matches!(parse(EP_KEY, "[1,2]"), Err(RecordError::Json(_))));
        assert!(matches!(
            parse(
                EP_KEY,
                r#"{"type":"Model","endpoint":"generate","instance_id":1}"#
            ),
            Err(RecordError::WrongType { .. })
        ));
    }

    #[test]
    fn tcp_addresses_parse_and_refuse_what_cannot_be_dialled() {
        let ok = TcpAddress::parse("tcp://10.0.0.7:41000").expect("valid");
        assert_eq!(ok.authority(), "10.0.0.7:41000");
        let v6 = TcpAddress::parse("tcp://[fd00::1]:5").expect("valid v6");
        assert_eq!(v6.host, "fd00::1");
        assert_eq!(v6.authority(), "[fd00::1]:5");
        for bad in [
            "tcp://host",
            "tcp://:5",
            "tcp://h:0",
            "tcp://h:+5",
            "tcp://h:70000",
            "tcp://fd00::1:5",
            "tcp://h:5/x",
            "10.0.0.1:5",
        ] {
            assert!(
                matches!(TcpAddress::parse(bad), Err(RecordError::BadEndpoint(_))),
                "{bad}"
            );
        }
        let long = format!("tcp://{}:1", "é".repeat(500));
        let Err(RecordError::BadEndpoint(quoted)) = TcpAddress::parse(&long) else {
            panic!("a long host is not dialable");
        };
        assert!(quoted.len() <= MAX_QUOTED_BYTES + '…'.len_utf8());
        assert!(matches!(
            TcpAddress::parse("ipc:///tmp/x"),
            Err(RecordError::UnsupportedScheme(_))
        ));
    }

    #[test]
    fn legacy_channel_shape_is_accepted() {
        let got = parse(
            CH_KEY,
            r#"{"type":"EventChannel","namespace":"dynamo","component":"decode","topic":"kv_metrics",
                "instance_id":5,"transport":{"kind":"Zmq","config":{"endpoint":"tcp://h:1"}}}"#,
        );
        let Ok(Record::Channel(ch)) = got else {
            panic!("expected a channel, got {got:?}")
        };
        assert_eq!(ch.component.as_deref(), Some("decode"));
        assert_eq!(ch.endpoint, None);
    }

    /// The Model record a live 1.6.1 mocker wrote (fixtures/dynamo-1.6.1/etcd/agg-2workers).
    const CAPTURED_CARD: &str = r#"{"type":"Model","namespace":"dyntest","component":"backend","endpoint":"generate","instance_id":7668682573709850375,"card_json":{"display_name":"tiny","slug":"tiny","source_path":"/tmp/dyn-run/tiny-model","model_info":{"hf_config_json":{"path":"/tmp/dyn-run/tiny-model/config.json","checksum":"blake3:be5d00bb40cff7daca254c6c672b60cea0c40a225a0ee586b4f8ff1819948e0f","size":410}},"tokenizer":{"hf_tokenizer_json":{"path":"/tmp/dyn-run/tiny-model/tokenizer.json","checksum":"blake3:c80fd372ff970f94088dd4c6303bd7ab7d768e6190aa1ca90b1f1a4d69076d36","size":246992}},"prompt_formatter":{"hf_tokenizer_config_json":{"path":"/tmp/dyn-run/tiny-model/tokenizer_config.json","checksum":"blake3:e51a93f143506009a56fe8d7f22c5c4edebcdebc62327bfc728beee87e567c26","size":1313}},"gen_config":{"hf_generation_config_json":{"path":"/tmp/dyn-run/tiny-model/generation_config.json","checksum":"blake3:c0fac042c16028c74dc19fb0fe69f12b3ee1c0f89a0d62b307e033ea13bc1776","size":44}},"architectural_max_context_length":4096,"context_length":0,"kv_cache_block_size":16,"migration_limit":0,"model_type":"Chat | Completions","model_input":"Tokens","worker_type":"aggregated","needs":[],"runtime_config":{"context_length":0,"total_kv_blocks":24,"max_num_seqs":256,"max_num_batched_tokens":8192,"data_parallel_start_rank":0,"data_parallel_size":1,"enable_local_indexer":true,"kv_event_publishing_enabled":true,"enable_eagle":false},"media_decoder":null,"media_fetcher":null}}"#;

    fn artifacts_of(card_json: &str) -> CardArtifacts {
        let value = format!(r#"{{"instance_id":26,"card_json":{card_json}}}"#);
        match parse(CARD_KEY, &value) {
            Ok(Record::Card(card)) => (*card.fields.artifacts).clone(),
            other => panic!("expected a card, got {other:?}"),
        }
    }

    #[test]
    fn captured_card_keeps_its_artifact_slots() {
        let got = parse(
            "v1/mdc/dynamo/backend/generate/6a6ca22b9d343707",
            CAPTURED_CARD,
        );
        let Ok(Record::Card(card)) = got else {
            panic!("expected a card, got {got:?}")
        };
        let a = &card.fields.artifacts;
        let Some(TokenizerSlot::HfTokenizerJson(tok)) = &a.tokenizer else {
            panic!("tokenizer slot: {a:?}")
        };
        assert_eq!(tok.path, "/tmp/dyn-run/tiny-model/tokenizer.json");
        assert_eq!(
            tok.checksum.to_string(),
            "blake3:c80fd372ff970f94088dd4c6303bd7ab7d768e6190aa1ca90b1f1a4d69076d36"
        );
        assert_eq!(tok.size, Some(246_992));
        let fmt = a.prompt_formatter.as_ref().expect("prompt_formatter");
        assert_eq!(fmt.kind, FormatterKind::TokenizerConfigJson);
        assert_eq!(fmt.file.size, Some(1313));
        assert_eq!(a.chat_template_file, None);
    }

    #[test]
    fn artifact_slot_variants_parse_and_bad_slots_read_as_absent() {
        let ck = format!("blake3:{}", "ab".repeat(32));
        let a = artifacts_of(&format!(
            r#"{{"tokenizer":{{"tik_token_model":{{"path":"hf://o/m/t.model","checksum":"{ck}"}}}},
                "prompt_formatter":{{"hf_chat_template_jinja":{{"is_custom":true,
                    "file":{{"path":"/m/chat_template.jinja","checksum":"{ck}","size":null}}}}}},
                "chat_template_file":{{"hf_chat_template_json":{{"is_custom":false,
                    "file":{{"path":"/m/chat_template.json","checksum":"{ck}","size":7}}}}}}}}"#
        ));
        assert!(
            matches!(a.tokenizer, Some(TokenizerSlot::TikTokenModel(ref f)) if f.size.is_none())
        );
        let pf = a.prompt_formatter.expect("jinja alias");
        assert_eq!(pf.kind, FormatterKind::ChatTemplateJinja);
        assert!(pf.is_custom);
        let ct = a.chat_template_file.expect("template json");
        assert_eq!(ct.kind, FormatterKind::ChatTemplateJson);
        assert_eq!(ct.file.size, Some(7));

        let long = "x".repeat(5000);
        for bad in [
            r#"{"tokenizer":null}"#.to_owned(),
            r#"{"tokenizer":"tokenizer.json"}"#.to_owned(),
            r#"{"tokenizer":{"hf_tokenizer_json":{"path":"/m/t","checksum":"blake3:00"}}}"#
                .to_owned(),
            format!(
                r#"{{"tokenizer":{{"hf_tokenizer_json":{{"path":"/m/t","checksum":"{ck}","size":-1}}}}}}"#
            ),
            format!(
                r#"{{"tokenizer":{{"hf_tokenizer_json":{{"path":"/m/t","checksum":"{ck}","size":"5"}}}}}}"#
            ),
            format!(r#"{{"tokenizer":{{"hf_tokenizer_json":{{"path":7,"checksum":"{ck}"}}}}}}"#),
            format!(
                r#"{{"tokenizer":{{"hf_tokenizer_json":{{"path":"/{long}","checksum":"{ck}"}}}}}}"#
            ),
            format!(
                r#"{{"tokenizer":{{"hf_tokenizer_json":{{"path":"/a","checksum":"{ck}"}},"tik_token_model":{{"path":"/b","checksum":"{ck}"}}}}}}"#
            ),
            format!(r#"{{"tokenizer":{{"future_kind":{{"path":"/a","checksum":"{ck}"}}}}}}"#),
            format!(
                r#"{{"prompt_formatter":{{"hf_chat_template":{{"is_custom":"yes","file":{{"path":"/a","checksum":"{ck}"}}}}}}}}"#
            ),
            r#"{"prompt_formatter":[1],"chat_template_file":{"hf_chat_template":{}}}"#.to_owned(),
        ] {
            let card = format!(r#"{{"display_name":"m",{}"#, &bad[1..]);
            let got = artifacts_of(&card);
            assert_eq!(got, CardArtifacts::default(), "{bad}");
            // The rest of the card still reads.
            let value = format!(r#"{{"instance_id":26,"card_json":{card}}}"#);
            let Ok(Record::Card(rec)) = parse(CARD_KEY, &value) else {
                panic!("record failed for {bad}")
            };
            assert_eq!(rec.fields.model.as_deref(), Some("m"), "{bad}");
        }
    }

    #[test]
    fn legacy_card_without_worker_type_reads_the_prefill_bit() {
        let got = parse(
            CARD_KEY,
            r#"{"instance_id":26,"card_json":{"model_type":"Chat|Prefill"}}"#,
        );
        let Ok(Record::Card(card)) = got else {
            panic!("expected a card, got {got:?}")
        };
        assert_eq!(card.fields.claim, CardClaim::Role(Role::Prefill));
        assert!(card.is_legacy());
    }
}
