//! Event-plane decoding tests: every captured 1.6.1 frame, the spec vector, and each drop.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use proptest::prelude::*;
use serde::{Deserialize, Serialize};

use super::*;

const FIXTURES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/fixtures/dynamo-1.6.1/zmq"
);
const VECTOR: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/fixtures/vectors/active_load_frame.json"
);

/// Upstream's field order, encoded by rmp-serde: the reference for byte-exact comparisons.
#[derive(Serialize, Deserialize)]
struct RefActiveLoad {
    worker_id: u64,
    dp_rank: u32,
    active_decode_blocks: Option<u64>,
    active_prefill_tokens: Option<u64>,
    kv_used_blocks: Option<u64>,
}

#[derive(Serialize)]
struct RefEnvelope<'a> {
    publisher_id: u64,
    sequence: u64,
    published_at: u64,
    topic: &'a str,
    #[serde(with = "bin")]
    payload: &'a [u8],
}

/// Serialises a byte slice as msgpack bin, as upstream's `bytes::Bytes` payload does.
mod bin {
    pub fn serialize<S: serde::Serializer>(bytes: &&[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(bytes)
    }
}

fn reference(load: &ActiveLoad) -> RefActiveLoad {
    RefActiveLoad {
        worker_id: load.worker_id.0,
        dp_rank: load.dp_rank.0,
        active_decode_blocks: load.active_decode_blocks,
        active_prefill_tokens: load.active_prefill_tokens,
        kv_used_blocks: load.kv_used_blocks,
    }
}

fn encode_frames(envelope: &EventEnvelope<'_>) -> [Vec<u8>; 4] {
    let body = rmp_serde::to_vec_named(&RefEnvelope {
        publisher_id: envelope.publisher_id.0,
        sequence: envelope.sequence,
        published_at: envelope.published_at.0,
        topic: envelope.topic,
        payload: envelope.payload,
    })
    .unwrap();
    let mut frame = vec![FRAME_VERSION];
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend(body);
    [
        envelope.topic.as_bytes().to_vec(),
        envelope.publisher_id.0.to_be_bytes().to_vec(),
        envelope.sequence.to_be_bytes().to_vec(),
        frame,
    ]
}

struct Captured {
    name: String,
    frames: [Vec<u8>; 4],
}

impl Captured {
    fn message(&self) -> ZmtpMessage {
        ZmtpMessage::from_frames(&self.frames).unwrap()
    }
    fn publisher(&self) -> PublisherId {
        PublisherId(u64::from_be_bytes(
            self.frames[1].as_slice().try_into().unwrap(),
        ))
    }
}

/// Every captured message of `topic`, in capture order.
fn captured(topic: &str) -> Vec<Captured> {
    let mut out = Vec::new();
    for run in ["agg", "disagg"] {
        let dir = Path::new(FIXTURES).join(run);
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter_map(|n| n.strip_suffix(".frame0.bin").map(str::to_owned))
            .filter(|n| n.ends_with(&format!("-{topic}")))
            .collect();
        names.sort();
        for name in names {
            let read = |i: usize| -> Vec<u8> {
                std::fs::read(dir.join(format!("{name}.frame{i}.bin"))).unwrap()
            };
            out.push(Captured {
                name: format!("{run}/{name}"),
                frames: [read(0), read(1), read(2), read(3)],
            });
        }
    }
    out
}

/// Publisher ids registered for `topic` in the captured channel lists.
fn discovered(topic: &str) -> Vec<PublisherId> {
    let mut ids = Vec::new();
    for run in ["agg", "disagg"] {
        let path: PathBuf = Path::new(FIXTURES).join(run).join("channels.json");
        let channels: Vec<BTreeMap<String, serde_json::Value>> =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        for channel in channels {
            if channel["topic"] == topic {
                let key = channel["key"].as_str().unwrap();
                let hex = key.rsplit('/').next().unwrap();
                ids.push(PublisherId(u64::from_str_radix(hex, 16).unwrap()));
            }
        }
    }
    ids
}

#[test]
fn every_captured_kv_metrics_frame_decodes_and_reencodes_byte_exactly() {
    let messages = captured("kv_metrics");
    assert_eq!(messages.len(), 37 + 21, "fixture set changed");
    let publishers = discovered("kv_metrics");
    for captured in &messages {
        let message = captured.message();
        let publisher = captured.publisher();
        assert!(publishers.contains(&publisher), "{}", captured.name);
        let delivery = Delivery::Message(message.clone());
        let event = decode_kv_metrics(&delivery, publisher)
            .unwrap_or_else(|e| panic!("{}: {e}", captured.name));
        let envelope = decode_message(&message, StreamExpectation::kv_metrics(publisher)).unwrap();
        assert_eq!(event.sequence, envelope.sequence);
        // Live 1.6.1 workers: mocker-style samples, kv_used_blocks only.
        assert_eq!(event.load.active_decode_blocks, None, "{}", captured.name);
        assert_eq!(event.load.active_prefill_tokens, None);
        assert!(event.load.kv_used_blocks.is_some());
        // Byte-exact: rmp-serde re-encodes our decoded values into the captured bytes.
        let payload = rmp_serde::to_vec_named(&reference(&event.load)).unwrap();
        assert_eq!(payload, envelope.payload, "{}", captured.name);
        assert_eq!(
            encode_frames(&envelope),
            captured.frames,
            "{}",
            captured.name
        );
        // The wrong discovery record is an identity mismatch.
        let other = PublisherId(publisher.0 ^ 1);
        assert_eq!(
            decode_kv_metrics(&delivery, other).unwrap_err().result(),
            LoadEventResult::IdentityMismatch
        );
    }
    // Sequences of one publisher increase in capture order.
    let mut last: BTreeMap<PublisherId, u64> = BTreeMap::new();
    for captured in &messages {
        let seq = u64::from_be_bytes(captured.frames[2].as_slice().try_into().unwrap());
        if let Some(prev) = last.insert(captured.publisher(), seq) {
            assert!(seq > prev, "{}", captured.name);
        }
    }
}

#[test]
fn every_captured_kv_events_envelope_decodes() {
    let messages = captured("kv-events");
    assert_eq!(messages.len(), 25 + 5, "fixture set changed");
    let publishers = discovered("kv-events");
    for captured in &messages {
        let message = captured.message();
        let publisher = captured.publisher();
        assert!(publishers.contains(&publisher), "{}", captured.name);
        let envelope = decode_message(&message, StreamExpectation::kv_events(publisher))
            .unwrap_or_else(|e| panic!("{}: {e}", captured.name));
        assert_eq!(envelope.topic, KV_EVENTS_TOPIC);
        assert_eq!(
            encode_frames(&envelope),
            captured.frames,
            "{}",
            captured.name
        );
        // The payload is an array of RouterEvent (decoded in a later issue).
        let value = rmpv::decode::read_value(&mut &envelope.payload[..]).unwrap();
        assert!(value.is_array(), "{}", captured.name);
        // On a kv_metrics subscription the same bytes are a topic mismatch, not a failure.
        assert_eq!(
            decode_message(&message, StreamExpectation::kv_metrics(publisher))
                .unwrap_err()
                .result(),
            LoadEventResult::TopicMismatch
        );
    }
}

fn hex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn the_spec_vector_decodes_exactly() {
    let vector: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(VECTOR).unwrap()).unwrap();
    let frames: Vec<Vec<u8>> = vector["zmq_multipart"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| hex(f["hex"].as_str().unwrap()))
        .collect();
    let message = ZmtpMessage::from_frames(&frames).unwrap();
    let delivery = Delivery::Message(message);
    let event = decode_kv_metrics(&delivery, PublisherId(5249132588543811)).unwrap();
    assert_eq!(
        event,
        LoadEvent {
            publisher_id: PublisherId(5249132588543811),
            sequence: 7,
            published_at: UnixMillis(1760000000123),
            load: ActiveLoad {
                worker_id: InstanceId(7587888921470146835),
                dp_rank: DpRank(0),
                active_decode_blocks: None,
                active_prefill_tokens: None,
                kv_used_blocks: Some(42),
            },
        }
    );
    let envelope_bytes = hex(vector["envelope_msgpack_hex"].as_str().unwrap());
    let envelope = decode_envelope(&envelope_bytes).unwrap();
    assert_eq!(
        envelope.payload,
        hex(vector["payload_msgpack_hex"].as_str().unwrap())
    );
    let second = &vector["second_example"];
    let load = decode_active_load(&hex(second["payload_msgpack_hex"].as_str().unwrap())).unwrap();
    let json: RefActiveLoad = serde_json::from_value(second["active_load"].clone()).unwrap();
    assert_eq!(
        rmp_serde::to_vec_named(&reference(&load)).unwrap(),
        rmp_serde::to_vec_named(&json).unwrap()
    );
    assert_eq!(load.active_prefill_tokens, Some(300));
    assert_eq!(load.dp_rank, DpRank(1));
}

/// The vector's frames with one frame replaced.
fn vector_frames() -> [Vec<u8>; 4] {
    let vector: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(VECTOR).unwrap()).unwrap();
    let f = |i: usize| hex(vector["zmq_multipart"][i]["hex"].as_str().unwrap());
    [f(0), f(1), f(2), f(3)]
}

const PID: PublisherId = PublisherId(5249132588543811);

fn result_of(frames: &[Vec<u8>]) -> LoadEventResult {
    let delivery = Delivery::Message(ZmtpMessage::from_frames(frames).unwrap());
    match decode_kv_metrics(&delivery, PID) {
        Ok(_) => LoadEventResult::Applied,
        Err(error) => error.result(),
    }
}

fn with_envelope(edit: impl FnOnce(&mut RefEnvelopeOwned)) -> [Vec<u8>; 4] {
    let frames = vector_frames();
    let envelope = decode_envelope(&frames[3][5..]).unwrap();
    let mut owned = RefEnvelopeOwned {
        publisher_id: envelope.publisher_id.0,
        sequence: envelope.sequence,
        published_at: envelope.published_at.0,
        topic: envelope.topic.to_owned(),
        payload: envelope.payload.to_vec(),
    };
    edit(&mut owned);
    let r = RefEnvelope {
        publisher_id: owned.publisher_id,
        sequence: owned.sequence,
        published_at: owned.published_at,
        topic: &owned.topic,
        payload: &owned.payload,
    };
    let body = rmp_serde::to_vec_named(&r).unwrap();
    let mut frame = vec![1];
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend(body);
    [
        frames[0].clone(),
        frames[1].clone(),
        frames[2].clone(),
        frame,
    ]
}

struct RefEnvelopeOwned {
    publisher_id: u64,
    sequence: u64,
    published_at: u64,
    topic: String,
    payload: Vec<u8>,
}

#[test]
fn every_drop_maps_to_its_result_label() {
    use LoadEventResult::*;
    let good = vector_frames();
    assert_eq!(result_of(&good), Applied);
    // Frame count.
    assert_eq!(result_of(&good[..3]), Malformed);
    let mut five = good.to_vec();
    five.push(Vec::new());
    assert_eq!(result_of(&five), Malformed);
    // Topic frame.
    let mut f = good.clone();
    f[0] = b"kv_metricsX".to_vec();
    assert_eq!(result_of(&f), TopicMismatch);
    // Id frames.
    let mut f = good.clone();
    f[1].pop();
    assert_eq!(result_of(&f), Malformed);
    let mut f = good.clone();
    f[2].push(0);
    assert_eq!(result_of(&f), Malformed);
    // Frame header.
    let mut f = good.clone();
    f[3].truncate(4);
    assert_eq!(result_of(&f), Malformed);
    let mut f = good.clone();
    f[3][0] = 2;
    assert_eq!(result_of(&f), UnknownVersion);
    let mut f = good.clone();
    f[3][1..5].copy_from_slice(&(16 * 1024 + 1u32).to_be_bytes());
    assert_eq!(result_of(&f), Oversized);
    let mut f = good.clone();
    f[3][1..5].copy_from_slice(&u32::MAX.to_be_bytes());
    assert_eq!(result_of(&f), Oversized);
    let mut f = good.clone();
    f[3].pop();
    assert_eq!(result_of(&f), Malformed, "truncated payload");
    let mut f = good.clone();
    f[3].extend_from_slice(b"trailing");
    assert_eq!(
        result_of(&f),
        Applied,
        "upstream copies exactly payload_len bytes"
    );
    // Envelope.
    let mut f = good.clone();
    f[3][5] = 0xc1;
    assert_eq!(result_of(&f), Malformed);
    assert_eq!(
        result_of(&with_envelope(|e| e.topic = "kv-events".into())),
        TopicMismatch
    );
    assert_eq!(
        result_of(&with_envelope(|e| e.publisher_id += 1)),
        IdentityMismatch
    );
    assert_eq!(result_of(&with_envelope(|e| e.sequence += 1)), Malformed);
    assert_eq!(
        result_of(&with_envelope(|e| e.payload = vec![0x81, 0xa1, b'x', 1])),
        Malformed
    );
    assert_eq!(
        result_of(&with_envelope(|e| e.payload = vec![0x91, 0xff])),
        Malformed
    );
    // Frame and envelope agree on another publisher: not the discovery record.
    let mut f = with_envelope(|e| e.publisher_id = 99);
    f[1] = 99u64.to_be_bytes().to_vec();
    assert_eq!(result_of(&f), IdentityMismatch);
    // Transport discards.
    for (discard, expected) in [
        (Discard::FrameTooLarge { declared: 1 << 20 }, Oversized),
        (Discard::MessageTooLarge, Oversized),
        (Discard::TooManyFrames, Malformed),
    ] {
        let error = decode_kv_metrics(&Delivery::Discarded(discard), PID).unwrap_err();
        assert_eq!(error.result(), expected);
    }
    // Labels.
    let labels: Vec<&str> = LoadEventResult::ALL.iter().map(|r| r.as_str()).collect();
    assert_eq!(
        labels,
        [
            "applied",
            "malformed",
            "unknown_version",
            "topic_mismatch",
            "oversized",
            "identity_mismatch",
            "over_capacity",
            "duplicate",
            "transport_refused"
        ]
    );
    assert_eq!(
        crate::zmtp::ZmtpError::RESULT_LABEL,
        TransportRefused.as_str()
    );
}

#[test]
fn positional_arrays_nil_and_unknown_keys_are_accepted() {
    let load = RefActiveLoad {
        worker_id: 7,
        dp_rank: 3,
        active_decode_blocks: Some(10),
        active_prefill_tokens: None,
        kv_used_blocks: Some(12),
    };
    let named = decode_active_load(&rmp_serde::to_vec_named(&load).unwrap()).unwrap();
    let positional = decode_active_load(&rmp_serde::to_vec(&load).unwrap()).unwrap();
    assert_eq!(named, positional);
    assert_eq!(named.dp_rank, DpRank(3));
    assert_eq!(named.active_prefill_tokens, None);
    // Missing keys: dp_rank 0, options None; unknown keys skipped; short arrays.
    let sparse = [
        0x82, 0xa9, b'w', b'o', b'r', b'k', b'e', b'r', b'_', b'i', b'd', 0x05, 0xa3, b'n', b'e',
        b'w', 0x92, 0xc0, 0xa0,
    ];
    let load = decode_active_load(&sparse).unwrap();
    assert_eq!(
        (load.worker_id, load.dp_rank, load.kv_used_blocks),
        (InstanceId(5), DpRank(0), None)
    );
    assert_eq!(
        decode_active_load(&[0x92, 0x05, 0x01]).unwrap().dp_rank,
        DpRank(1)
    );
    assert!(decode_active_load(&[0x90]).is_err());
    assert!(
        decode_active_load(&[0x80]).is_err(),
        "worker_id is required"
    );
    assert!(
        decode_active_load(&[0x92, 0x05, 0xcf, 1, 0, 0, 0, 0, 0, 0, 0]).is_err(),
        "dp_rank > u32"
    );
    // A positional envelope.
    let envelope = rmp_serde::to_vec(&(
        1u64,
        2u64,
        3u64,
        "kv_metrics",
        serde_bytes_like(&[0x91, 0x05]),
    ))
    .unwrap();
    let decoded = decode_envelope(&envelope).unwrap();
    assert_eq!(
        (decoded.publisher_id, decoded.sequence, decoded.payload),
        (PublisherId(1), 2, &[0x91, 0x05][..])
    );
    assert!(decode_envelope(&[0x93, 1, 2, 3]).is_err());
}

/// A value rmp-serde writes as msgpack bin.
fn serde_bytes_like(bytes: &[u8]) -> BinRef<'_> {
    BinRef(bytes)
}

struct BinRef<'a>(&'a [u8]);

impl Serialize for BinRef<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(self.0)
    }
}

#[test]
fn stream_sequence_flags_duplicates_and_gaps() {
    let mut seq = StreamSequence::new();
    assert_eq!(seq.check(41), SequenceCheck::First);
    seq.record_applied(41);
    assert_eq!(seq.check(41), SequenceCheck::Duplicate);
    assert_eq!(seq.check(3), SequenceCheck::Duplicate);
    assert_eq!(seq.check(42), SequenceCheck::Next);
    assert_eq!(seq.check(45), SequenceCheck::Gap { missed: 3 });
    seq.record_applied(45);
    seq.record_applied(44);
    assert_eq!(seq.highest_applied(), Some(45), "the mark never goes down");
    seq.reset();
    assert_eq!(seq.check(0), SequenceCheck::First);
    seq.record_applied(u64::MAX);
    assert_eq!(seq.check(u64::MAX), SequenceCheck::Duplicate);
}

proptest! {
    #[test]
    fn arbitrary_frames_never_panic(
        topic in proptest::collection::vec(any::<u8>(), 0..12),
        ids in proptest::collection::vec(any::<u8>(), 0..20),
        frame in proptest::collection::vec(any::<u8>(), 0..300),
    ) {
        let (a, b) = ids.split_at(ids.len() / 2);
        let _ = decode_frames([&topic, a, b, &frame], StreamExpectation::kv_metrics(PID));
        let _ = decode_envelope(&frame);
        let _ = decode_active_load(&frame);
    }

    #[test]
    fn mutated_vector_frames_never_panic(index in 0usize..200, byte in any::<u8>(), cut in 0usize..200) {
        let mut frames = vector_frames();
        let frame = &mut frames[3];
        let i = index % frame.len();
        frame[i] = byte;
        frame.truncate(frame.len() - cut.min(frame.len()));
        let _ = result_of(&frames);
    }

    #[test]
    fn active_loads_round_trip_in_both_encodings(
        worker_id in any::<u64>(), dp_rank in any::<u32>(),
        decode in proptest::option::of(any::<u64>()),
        prefill in proptest::option::of(any::<u64>()),
        used in proptest::option::of(any::<u64>()),
    ) {
        let load = RefActiveLoad { worker_id, dp_rank, active_decode_blocks: decode, active_prefill_tokens: prefill, kv_used_blocks: used };
        let expected = ActiveLoad { worker_id: InstanceId(worker_id), dp_rank: DpRank(dp_rank), active_decode_blocks: decode, active_prefill_tokens: prefill, kv_used_blocks: used };
        prop_assert_eq!(decode_active_load(&rmp_serde::to_vec_named(&load).unwrap()).unwrap(), expected);
        prop_assert_eq!(decode_active_load(&rmp_serde::to_vec(&load).unwrap()).unwrap(), expected);
    }
}
