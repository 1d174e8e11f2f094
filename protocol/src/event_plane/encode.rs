//! Encoding of `kv_metrics` messages as Dynamo 1.6.1 publishers write them, for publishers this
//! project runs itself (the demo's simulated workers).
//!
//! The bytes match what upstream's rmp-serde produces: named maps in field order, the smallest
//! msgpack integer form, `nil` for absent load fields, the payload as msgpack `bin`.

use super::{ActiveLoad, EventEnvelope, FRAME_VERSION, KV_METRICS_TOPIC};
use crate::ids::PublisherId;
use crate::time::UnixMillis;

fn uint(out: &mut Vec<u8>, n: u64) {
    match n {
        0..=0x7f => out.push(n as u8),
        0x80..=0xff => out.extend_from_slice(&[0xcc, n as u8]),
        0x100..=0xffff => {
            out.push(0xcd);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        0x1_0000..=0xffff_ffff => {
            out.push(0xce);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
        _ => {
            out.push(0xcf);
            out.extend_from_slice(&n.to_be_bytes());
        }
    }
}

fn opt_uint(out: &mut Vec<u8>, n: Option<u64>) {
    match n {
        Some(n) => uint(out, n),
        None => out.push(0xc0),
    }
}

fn str(out: &mut Vec<u8>, s: &str) {
    let len = s.len();
    if len < 32 {
        out.push(0xa0 | len as u8);
    } else if len <= 0xff {
        out.extend_from_slice(&[0xd9, len as u8]);
    } else if len <= 0xffff {
        out.push(0xda);
        out.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        out.push(0xdb);
        out.extend_from_slice(&(len as u32).to_be_bytes());
    }
    out.extend_from_slice(s.as_bytes());
}

fn bin(out: &mut Vec<u8>, b: &[u8]) {
    let len = b.len();
    if len <= 0xff {
        out.extend_from_slice(&[0xc4, len as u8]);
    } else if len <= 0xffff {
        out.push(0xc5);
        out.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        out.push(0xc6);
        out.extend_from_slice(&(len as u32).to_be_bytes());
    }
    out.extend_from_slice(b);
}

/// An ActiveLoad as a named msgpack map in upstream field order.
pub fn encode_active_load(load: &ActiveLoad) -> Vec<u8> {
    let mut out = Vec::with_capacity(96);
    out.push(0x85);
    str(&mut out, "worker_id");
    uint(&mut out, load.worker_id.0);
    str(&mut out, "dp_rank");
    uint(&mut out, u64::from(load.dp_rank.0));
    str(&mut out, "active_decode_blocks");
    opt_uint(&mut out, load.active_decode_blocks);
    str(&mut out, "active_prefill_tokens");
    opt_uint(&mut out, load.active_prefill_tokens);
    str(&mut out, "kv_used_blocks");
    opt_uint(&mut out, load.kv_used_blocks);
    out
}

/// An EventEnvelope as a named msgpack map in upstream field order.
pub fn encode_envelope(envelope: &EventEnvelope<'_>) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + envelope.payload.len());
    out.push(0x85);
    str(&mut out, "publisher_id");
    uint(&mut out, envelope.publisher_id.0);
    str(&mut out, "sequence");
    uint(&mut out, envelope.sequence);
    str(&mut out, "published_at");
    uint(&mut out, envelope.published_at.0);
    str(&mut out, "topic");
    str(&mut out, envelope.topic);
    str(&mut out, "payload");
    bin(&mut out, envelope.payload);
    out
}

/// The four frames of one event-plane message.
pub fn encode_frames(envelope: &EventEnvelope<'_>) -> [Vec<u8>; 4] {
    let body = encode_envelope(envelope);
    let mut frame = Vec::with_capacity(5 + body.len());
    frame.push(FRAME_VERSION);
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend(body);
    [
        envelope.topic.as_bytes().to_vec(),
        envelope.publisher_id.0.to_be_bytes().to_vec(),
        envelope.sequence.to_be_bytes().to_vec(),
        frame,
    ]
}

/// One `kv_metrics` message from `publisher_id`.
pub fn encode_kv_metrics(
    publisher_id: PublisherId,
    sequence: u64,
    published_at: UnixMillis,
    load: &ActiveLoad,
) -> [Vec<u8>; 4] {
    let payload = encode_active_load(load);
    encode_frames(&EventEnvelope {
        publisher_id,
        sequence,
        published_at,
        topic: KV_METRICS_TOPIC,
        payload: &payload,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event_plane::{StreamExpectation, decode_active_load, decode_frames};
    use crate::ids::{DpRank, InstanceId};

    /// frame3 of a captured Dynamo 1.6.1 prefill `kv_metrics` message (dynamo-live.md §5).
    const CAPTURED_FRAME3: &str = "01000000ac85ac7075626c69736865725f6964cf000c15e2ee040a70a873657175656e636500ac7075626c69736865645f6174cf000001a22b99df84a5746f706963aa6b765f6d657472696373a77061796c6f6164c45a85a9776f726b65725f6964cf6a6ca22b96b53108a764705f72616e6b00b46163746976655f6465636f64655f626c6f636b73c0b56163746976655f70726566696c6c5f746f6b656e73c0ae6b765f757365645f626c6f636b7300";

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn re_encoding_a_captured_message_gives_the_same_bytes() {
        let frame3 = unhex(CAPTURED_FRAME3);
        let publisher = PublisherId(3_401_764_120_562_288);
        let frames = [
            b"kv_metrics".as_slice(),
            &publisher.0.to_be_bytes(),
            &0u64.to_be_bytes(),
            &frame3,
        ];
        let envelope = decode_frames(frames, StreamExpectation::kv_metrics(publisher)).unwrap();
        let load = decode_active_load(envelope.payload).unwrap();
        let encoded = encode_kv_metrics(publisher, envelope.sequence, envelope.published_at, &load);
        assert_eq!(encoded[3], frame3);
        assert_eq!(encoded[0], b"kv_metrics");
        assert_eq!(encoded[1], publisher.0.to_be_bytes());
    }

    #[test]
    fn every_integer_width_round_trips() {
        for n in [
            0u64,
            0x7f,
            0x80,
            0xff,
            0x100,
            0xffff,
            0x1_0000,
            u32::MAX as u64,
            u64::MAX,
        ] {
            let load = ActiveLoad {
                worker_id: InstanceId(n),
                dp_rank: DpRank(3),
                active_decode_blocks: Some(n),
                active_prefill_tokens: None,
                kv_used_blocks: Some(n / 2),
            };
            assert_eq!(
                decode_active_load(&encode_active_load(&load)).unwrap(),
                load
            );
        }
    }
}
