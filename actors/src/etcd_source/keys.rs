//! The etcd prefixes one Dynamo namespace lives under (dynamo-wire §4), as the source watches them.

use continuum_protocol::ids::Namespace;

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
pub fn watched_prefixes(namespace: &Namespace) -> [WatchedPrefix; 3] {
    let raw = namespace.as_str();
    let encoded = encode_segment(raw);
    [
        WatchedPrefix {
            kind: "mdc",
            prefix: format!("v1/mdc/{raw}/"),
        },
        WatchedPrefix {
            kind: "instances",
            prefix: format!("v1/instances/{raw}/"),
        },
        WatchedPrefix {
            kind: "event_channels",
            prefix: format!("v1/event_channels/namespace/{encoded}/"),
        },
    ]
}

/// Dynamo's event-plane segment encoding: ASCII alphanumerics, `-` and `_` are kept, every other
/// UTF-8 byte becomes `%XX` with uppercase hex.
pub fn encode_segment(segment: &str) -> String {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = String::with_capacity(segment.len());
    for &byte in segment.as_bytes() {
        if byte.is_ascii_alphanumeric() || byte == b'-' || byte == b'_' {
            out.push(char::from(byte));
        } else {
            out.push('%');
            out.push(char::from(HEX[usize::from(byte >> 4)]));
            out.push(char::from(HEX[usize::from(byte & 0x0f)]));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_encoding_matches_the_wire_vectors() {
        for (input, want) in [
            ("kv-events", "kv-events"),
            ("kv_metrics", "kv_metrics"),
            ("my.ns", "my%2Ens"),
            ("a/b", "a%2Fb"),
            ("ns with space", "ns%20with%20space"),
            ("ñ", "%C3%B1"),
            ("%", "%25"),
        ] {
            assert_eq!(encode_segment(input), want, "input {input:?}");
        }
    }

    #[test]
    fn prefixes_match_the_keys_dynamo_writes() {
        let got = watched_prefixes(&Namespace::new("dyntest"));
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
        let dotted = watched_prefixes(&Namespace::new("my.ns"));
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
