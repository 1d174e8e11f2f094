//! etcd key shapes of Dynamo discovery and the event-plane percent-encoding of key segments.
//!
//! Keys decide only the keyspace and the namespace of a record (the namespace always comes from
//! the watched prefix, never from a payload) plus fallbacks for channel scope and topic; the
//! identity used for joins is read from the value (see `records`).

use super::records::clip;
use crate::ids::{InstanceId, PublisherId};

/// Bucket prefix of Endpoint records.
pub const INSTANCES_BUCKET: &str = "v1/instances/";
/// Bucket prefix of Model records (cards).
pub const MDC_BUCKET: &str = "v1/mdc/";
/// Bucket prefix of EventChannel records.
pub const EVENT_CHANNELS_BUCKET: &str = "v1/event_channels/";
/// Bucket prefix of EventSource records.
pub const EVENT_SOURCES_BUCKET: &str = "v1/event_sources/";

/// One watched keyspace of a namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatchedPrefix {
    /// Short name for logs: `instances`, `mdc`, `event_channels`.
    pub kind: &'static str,
    /// The full key prefix, ending in `/` so `dyn` never matches `dyn2`.
    pub prefix: String,
}

impl WatchedPrefix {
    /// The first key past every key that starts with `prefix` (etcd's `range_end` for a prefix).
    /// Prefixes here always end in `/` (0x2f), so incrementing the last byte cannot overflow.
    pub fn range_end(&self) -> Vec<u8> {
        let mut end = self.prefix.as_bytes().to_vec();
        for i in (0..end.len()).rev() {
            if end[i] < 0xff {
                end[i] += 1;
                end.truncate(i + 1);
                return end;
            }
        }
        // All 0xff (never for our prefixes): etcd reads "\0" as "to the end of the keyspace".
        vec![0]
    }
}

/// The three prefixes of `namespace`, in the order the pass reads them.
///
/// Model cards come first, then endpoints, then event channels: a resync at a keyspace's
/// capacity admits records that join a partner already seen before orphans (the reducer's
/// bounded admission), so an endpoint whose card was read first outranks a flood of
/// endpoint-only keys with lower ids, and a channel whose worker was read first outranks a flood
/// of channels without one.
///
/// Endpoint and model keys carry the namespace raw; event-plane keys percent-encode every scope
/// segment (dynamo-wire §4.4), so a namespace such as `my.ns` lives under
/// `v1/event_channels/namespace/my%2Ens/`.
///
/// `v1/event_sources/` is deliberately not read: every kv-events record already names its
/// `worker_id` and `dp_rank` (dynamo-live §5), and an operator's read-only role granting the
/// seed's three prefixes must be enough for discovery to work.
pub fn watched_prefixes(namespace: &crate::ids::Namespace) -> [WatchedPrefix; 3] {
    let raw = namespace.as_str();
    let encoded = encode_segment(raw);
    [
        WatchedPrefix {
            kind: "mdc",
            prefix: format!("{MDC_BUCKET}{raw}/"),
        },
        WatchedPrefix {
            kind: "instances",
            prefix: format!("{INSTANCES_BUCKET}{raw}/"),
        },
        WatchedPrefix {
            kind: "event_channels",
            prefix: format!("{EVENT_CHANNELS_BUCKET}namespace/{encoded}/"),
        },
    ]
}

/// Why a key under a watched namespace could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("key has {found} segments after the bucket, expected {expected}")]
    Shape {
        expected: &'static str,
        found: usize,
    },
    #[error("key id segment {0:?} is not lowercase or uppercase hex")]
    Id(String),
    #[error("invalid percent escape in key segment {0:?}")]
    Escape(String),
    #[error("key segment {0:?} does not decode to UTF-8")]
    Utf8(String),
    #[error("event key scope path is not namespace[/component[/endpoint]]/topic")]
    Scope,
}

/// Which of the four watched keyspaces a record lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Keyspace {
    Instances,
    Cards,
    Channels,
    Sources,
}

impl Keyspace {
    pub const ALL: [Keyspace; 4] = [
        Keyspace::Instances,
        Keyspace::Cards,
        Keyspace::Channels,
        Keyspace::Sources,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Keyspace::Instances => "instances",
            Keyspace::Cards => "mdc",
            Keyspace::Channels => "event_channels",
            Keyspace::Sources => "event_sources",
        }
    }

    /// The record `type` tag expected under this keyspace.
    pub fn record_type(self) -> &'static str {
        match self {
            Keyspace::Instances => "Endpoint",
            Keyspace::Cards => "Model",
            Keyspace::Channels => "EventChannel",
            Keyspace::Sources => "EventSource",
        }
    }

    /// The etcd prefix to watch for `namespace` in this keyspace.
    pub fn prefix(self, namespace: &str) -> String {
        match self {
            Keyspace::Instances => format!("{INSTANCES_BUCKET}{namespace}/"),
            Keyspace::Cards => format!("{MDC_BUCKET}{namespace}/"),
            Keyspace::Channels => {
                format!(
                    "{EVENT_CHANNELS_BUCKET}namespace/{}/",
                    encode_segment(namespace)
                )
            }
            Keyspace::Sources => {
                format!(
                    "{EVENT_SOURCES_BUCKET}namespace/{}/",
                    encode_segment(namespace)
                )
            }
        }
    }
}

/// The scope segments of an event key, decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventKeyScope {
    pub namespace: String,
    pub component: Option<String>,
    pub endpoint: Option<String>,
}

/// What a key says, once its keyspace and namespace are known.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ParsedKey {
    /// `v1/instances/{ns}/{comp}/{ep}/{id:hex}` (segments raw).
    Instance {
        component: String,
        endpoint: String,
        instance_id: InstanceId,
    },
    /// `v1/mdc/{ns}/{comp}/{ep}/{id:hex}[/{model_suffix}]` (segments raw).
    Card {
        component: String,
        endpoint: String,
        instance_id: InstanceId,
        model_suffix: Option<String>,
    },
    /// `v1/event_channels/{scope_path}/topic/{enc(topic)}/{publisher_id:hex}`.
    Channel {
        scope: EventKeyScope,
        topic: String,
        publisher_id: PublisherId,
    },
    /// `v1/event_sources/{scope_path}/topic/{enc(topic)}/{publisher_id:hex}`.
    Source {
        scope: EventKeyScope,
        topic: String,
        publisher_id: PublisherId,
    },
}

impl ParsedKey {
    pub fn keyspace(&self) -> Keyspace {
        match self {
            ParsedKey::Instance { .. } => Keyspace::Instances,
            ParsedKey::Card { .. } => Keyspace::Cards,
            ParsedKey::Channel { .. } => Keyspace::Channels,
            ParsedKey::Source { .. } => Keyspace::Sources,
        }
    }
}

/// Reads `key` for a reducer watching `namespace`.
///
/// `None` when the key is outside the four buckets or belongs to another namespace (ignored by
/// design: a reducer serves one namespace). `Some(Err)` when the key is in this namespace's
/// keyspace but has a shape upstream never writes; the keyspace is returned so the caller can
/// count it and drop any value held under that key.
pub fn classify(namespace: &str, key: &str) -> Option<(Keyspace, Result<ParsedKey, KeyError>)> {
    if let Some(rest) = key.strip_prefix(INSTANCES_BUCKET) {
        let rest = strip_raw_namespace(rest, namespace)?;
        return Some((Keyspace::Instances, parse_instance(rest)));
    }
    if let Some(rest) = key.strip_prefix(MDC_BUCKET) {
        let rest = strip_raw_namespace(rest, namespace)?;
        return Some((Keyspace::Cards, parse_card(rest)));
    }
    if let Some(rest) = key.strip_prefix(EVENT_CHANNELS_BUCKET) {
        let rest = strip_encoded_namespace(rest, namespace)?;
        return Some((
            Keyspace::Channels,
            parse_event(namespace, rest).map(|(scope, topic, publisher_id)| ParsedKey::Channel {
                scope,
                topic,
                publisher_id,
            }),
        ));
    }
    if let Some(rest) = key.strip_prefix(EVENT_SOURCES_BUCKET) {
        let rest = strip_encoded_namespace(rest, namespace)?;
        return Some((
            Keyspace::Sources,
            parse_event(namespace, rest).map(|(scope, topic, publisher_id)| ParsedKey::Source {
                scope,
                topic,
                publisher_id,
            }),
        ));
    }
    None
}

/// `rest` minus `{ns}/` when the raw first segment is `namespace`.
fn strip_raw_namespace<'a>(rest: &'a str, namespace: &str) -> Option<&'a str> {
    let (ns, tail) = rest.split_once('/')?;
    (ns == namespace).then_some(tail)
}

/// `rest` minus `namespace/{enc(ns)}/` when the decoded segment is `namespace`; the remainder
/// starts at the optional component part.
fn strip_encoded_namespace<'a>(rest: &'a str, namespace: &str) -> Option<&'a str> {
    let rest = rest.strip_prefix("namespace/")?;
    let (ns, tail) = rest.split_once('/')?;
    match decode_segment(ns) {
        Ok(decoded) if decoded == namespace => Some(tail),
        _ => None,
    }
}

fn hex_id(segment: &str) -> Result<u64, KeyError> {
    // Upstream writes `{:x}`; any case is accepted, a `0x` prefix is not something it writes.
    if segment.is_empty() || segment.len() > 16 || !segment.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(KeyError::Id(clip(segment)));
    }
    u64::from_str_radix(segment, 16).map_err(|_| KeyError::Id(clip(segment)))
}

fn parse_instance(rest: &str) -> Result<ParsedKey, KeyError> {
    let parts: Vec<&str> = rest.split('/').collect();
    if parts.len() != 3 {
        return Err(KeyError::Shape {
            expected: "4",
            found: parts.len() + 1,
        });
    }
    Ok(ParsedKey::Instance {
        component: parts[0].to_owned(),
        endpoint: parts[1].to_owned(),
        instance_id: InstanceId(hex_id(parts[2])?),
    })
}

fn parse_card(rest: &str) -> Result<ParsedKey, KeyError> {
    let parts: Vec<&str> = rest.split('/').collect();
    if parts.len() != 3 && parts.len() != 4 {
        return Err(KeyError::Shape {
            expected: "4 or 5",
            found: parts.len() + 1,
        });
    }
    Ok(ParsedKey::Card {
        component: parts[0].to_owned(),
        endpoint: parts[1].to_owned(),
        instance_id: InstanceId(hex_id(parts[2])?),
        model_suffix: parts.get(3).map(|s| (*s).to_owned()),
    })
}

/// Parses `[component/{c}/[endpoint/{e}/]]topic/{t}/{id}` after the namespace segment.
fn parse_event(
    namespace: &str,
    rest: &str,
) -> Result<(EventKeyScope, String, PublisherId), KeyError> {
    let parts: Vec<&str> = rest.split('/').collect();
    let mut scope = EventKeyScope {
        namespace: namespace.to_owned(),
        component: None,
        endpoint: None,
    };
    let mut i = 0;
    if parts.get(i) == Some(&"component") {
        scope.component = Some(decode_segment(parts.get(i + 1).ok_or(KeyError::Scope)?)?);
        i += 2;
        if parts.get(i) == Some(&"endpoint") {
            scope.endpoint = Some(decode_segment(parts.get(i + 1).ok_or(KeyError::Scope)?)?);
            i += 2;
        }
    }
    if parts.get(i) != Some(&"topic") || parts.len() != i + 3 {
        return Err(KeyError::Scope);
    }
    let topic = decode_segment(parts[i + 1])?;
    let publisher_id = PublisherId(hex_id(parts[i + 2])?);
    Ok((scope, topic, publisher_id))
}

/// Dynamo's event-key encoding: ASCII alphanumerics, `-` and `_` pass; every other byte becomes
/// `%` and two uppercase hex digits.
pub fn encode_segment(text: &str) -> String {
    percent_encode(text, is_segment_byte)
}

/// Reverses [`encode_segment`]. Escapes must be complete (`%` + two hex digits, either case), the
/// result valid UTF-8, and no byte the encoder would have escaped may appear raw: one name has
/// exactly one key spelling.
pub fn decode_segment(segment: &str) -> Result<String, KeyError> {
    percent_decode(segment, is_segment_byte)
}

fn is_segment_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'-' || b == b'_'
}

const HEX_UPPER: &[u8; 16] = b"0123456789ABCDEF";

/// Percent-encoding as Dynamo writes it: bytes for which `keep` holds pass, every other byte
/// becomes `%` and two uppercase hex digits. Event-key segments keep alphanumerics, `-` and `_`;
/// file-store names keep alphanumerics only.
pub(crate) fn percent_encode(text: &str, keep: fn(u8) -> bool) -> String {
    let mut out = String::with_capacity(text.len());
    for &b in text.as_bytes() {
        if keep(b) {
            out.push(char::from(b));
        } else {
            out.push('%');
            out.push(char::from(HEX_UPPER[usize::from(b >> 4)]));
            out.push(char::from(HEX_UPPER[usize::from(b & 0x0f)]));
        }
    }
    out
}

/// Reverses [`percent_encode`] with the same `keep`: escapes must be complete (either hex case),
/// the result UTF-8, and no byte outside `keep` may appear raw, so one text has exactly one
/// spelling.
pub(crate) fn percent_decode(text: &str, keep: fn(u8) -> bool) -> Result<String, KeyError> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hi = bytes.get(i + 1).and_then(|b| char::from(*b).to_digit(16));
            let lo = bytes.get(i + 2).and_then(|b| char::from(*b).to_digit(16));
            match (hi, lo) {
                // Two hex digits are at most 0xff. An escape of a byte the encoder keeps raw
                // (`%44` for `D`) is refused, so one key has one encoding (a fuzzing finding,
                // `discovery` target: `…%44` and `…D` were two file names of one key).
                (Some(hi), Some(lo)) => match u8::try_from(hi * 16 + lo) {
                    Ok(byte) if !keep(byte) => {
                        out.push(byte);
                        i += 3;
                    }
                    _ => return Err(KeyError::Escape(clip(text))),
                },
                _ => return Err(KeyError::Escape(clip(text))),
            }
        } else if keep(bytes[i]) {
            out.push(bytes[i]);
            i += 1;
        } else {
            return Err(KeyError::Escape(clip(text)));
        }
    }
    String::from_utf8(out).map_err(|_| KeyError::Utf8(clip(text)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoding_round_trips_and_rejects_bad_escapes() {
        assert_eq!(encode_segment("my.ns"), "my%2Ens");
        assert_eq!(decode_segment("my%2ens").as_deref(), Ok("my.ns"));
        assert!(decode_segment("bad%2").is_err());
        assert!(decode_segment("bad%zz").is_err());
        assert!(decode_segment("%FF").is_err());
        assert!(decode_segment("raw.dot").is_err());
        // An escaped byte that is kept raw has one spelling: raw.
        assert!(decode_segment("my%41").is_err());
        assert_eq!(decode_segment("myA").as_deref(), Ok("myA"));
    }

    #[test]
    fn keys_of_other_namespaces_and_buckets_are_ignored() {
        assert_eq!(
            classify("dyn", "v1/instances/dynamo/backend/generate/1"),
            None
        );
        assert_eq!(classify("dyn", "v1/other/dyn/backend/generate/1"), None);
        assert_eq!(
            classify(
                "my.ns",
                "v1/event_channels/namespace/my.ns/component/b/topic/kv_metrics/1"
            ),
            None,
            "an unencoded dot is not the encoded namespace"
        );
    }

    #[test]
    fn event_keys_at_every_scope_parse() {
        let got = classify(
            "my.ns",
            "v1/event_channels/namespace/my%2Ens/component/b/endpoint/generate/topic/kv-events/ff",
        );
        assert_eq!(
            got,
            Some((
                Keyspace::Channels,
                Ok(ParsedKey::Channel {
                    scope: EventKeyScope {
                        namespace: "my.ns".into(),
                        component: Some("b".into()),
                        endpoint: Some("generate".into()),
                    },
                    topic: "kv-events".into(),
                    publisher_id: PublisherId(255),
                })
            ))
        );
        let ns_scoped = classify("d", "v1/event_sources/namespace/d/topic/kv_metrics/a");
        assert!(matches!(ns_scoped, Some((Keyspace::Sources, Ok(_)))));
        let broken = classify(
            "d",
            "v1/event_channels/namespace/d/component/b/kv_metrics/a",
        );
        assert!(matches!(
            broken,
            Some((Keyspace::Channels, Err(KeyError::Scope)))
        ));
    }

    #[test]
    fn instance_and_card_key_shapes_are_checked() {
        assert!(matches!(
            classify("d", "v1/instances/d/c/generate"),
            Some((Keyspace::Instances, Err(KeyError::Shape { .. })))
        ));
        assert!(matches!(
            classify("d", "v1/instances/d/c/generate/xyz"),
            Some((Keyspace::Instances, Err(KeyError::Id(_))))
        ));
        assert!(matches!(
            classify("d", "v1/mdc/d/c/generate/1a/lora-1"),
            Some((
                Keyspace::Cards,
                Ok(ParsedKey::Card {
                    model_suffix: Some(_),
                    ..
                })
            ))
        ));
    }

    #[test]
    fn prefixes_follow_the_encoding_of_each_bucket() {
        assert_eq!(Keyspace::Instances.prefix("a.b"), "v1/instances/a.b/");
        assert_eq!(
            Keyspace::Channels.prefix("a.b"),
            "v1/event_channels/namespace/a%2Eb/"
        );
    }

    #[test]
    fn prefixes_match_the_keys_dynamo_writes() {
        let got = watched_prefixes(&crate::ids::Namespace::new("dyntest"));
        let prefixes: Vec<&str> = got.iter().map(|p| p.prefix.as_str()).collect();
        assert_eq!(
            prefixes,
            [
                "v1/mdc/dyntest/",
                "v1/instances/dyntest/",
                "v1/event_channels/namespace/dyntest/",
            ]
        );
        // A captured 1.6.1 key falls under its prefix.
        assert!(
            "v1/event_channels/namespace/dyntest/component/prefill/endpoint/generate/topic/kv-events/8520bd755cfc6"
                .starts_with(prefixes[2])
        );
        let dotted = watched_prefixes(&crate::ids::Namespace::new("my.ns"));
        assert_eq!(dotted[1].prefix, "v1/instances/my.ns/");
        assert_eq!(dotted[2].prefix, "v1/event_channels/namespace/my%2Ens/");
    }

    #[test]
    fn range_end_is_the_prefix_with_its_last_byte_incremented() {
        let p = WatchedPrefix {
            kind: "instances",
            prefix: "v1/instances/dyn/".into(),
        };
        assert_eq!(p.range_end(), b"v1/instances/dyn0".to_vec());
        assert!(b"v1/instances/dyn/zzz".as_slice() < p.range_end().as_slice());
        assert!(b"v1/instances/dyn2/a".as_slice() > p.range_end().as_slice());
    }
}
