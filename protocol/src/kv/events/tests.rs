//! Byte-exact tests of the kv-events payload codec on every captured Dynamo 1.6.1 message and
//! every vector of `kv_events.json`, plus the batch bounds and an end-to-end hash → index check.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value as Json;

use super::*;
use crate::kv::hashing::{KV_HASH_SEED, local_block_hashes_any, salt_seed, sequence_hashes};
use crate::kv::index::{KvIndex, RankOverlap};

const CAPTURED: &str = include_str!("../../../tests/data/kv/captured_kv_events_1_6_1.jsonl");
const VECTORS: &str = include_str!("../../../tests/data/kv/kv_events.json");
const MOCKER: &str = include_str!("../../../tests/data/kv/mocker_observed_requests.json");

fn unhex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
        .collect()
}

/// Minimal frame-3 reading for the tests (the real decoder lives in the event-plane module):
/// version byte, u32 BE length, msgpack envelope map, its `payload` bin.
fn payload_of_frame3(frame: &[u8]) -> Vec<u8> {
    assert_eq!(frame[0], 1, "frame version");
    let len = u32::from_be_bytes(frame[1..5].try_into().unwrap()) as usize;
    assert_eq!(frame.len(), 5 + len, "frame length");
    let envelope = rmpv::decode::read_value(&mut &frame[5..]).unwrap();
    let rmpv::Value::Map(entries) = envelope else {
        panic!("envelope is not a map")
    };
    entries
        .into_iter()
        .find_map(|(k, v)| match (k.as_str(), v) {
            (Some("payload"), rmpv::Value::Binary(bytes)) => Some(bytes),
            _ => None,
        })
        .expect("envelope has a payload bin")
}

/// Decodes, compares with the JSON equivalent, and re-encodes to the same bytes.
fn check_round_trip(payload: &[u8], json: &Json, what: &str) -> Vec<RouterEvent> {
    let events = decode_router_events(payload).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(
        &serde_json::to_value(&events).unwrap(),
        json,
        "{what}: decoded content"
    );
    assert_eq!(
        encode_router_events(&events),
        payload,
        "{what}: re-encoded bytes"
    );
    events
}

#[test]
fn every_captured_1_6_1_message_decodes_and_round_trips() {
    let mut seen = 0;
    let mut by_worker: BTreeMap<InstanceId, Vec<RouterEvent>> = BTreeMap::new();
    for line in CAPTURED.lines() {
        let record: Json = serde_json::from_str(line).unwrap();
        let source = record["source"].as_str().unwrap();
        let payload = payload_of_frame3(&unhex(record["frame3_hex"].as_str().unwrap()));
        let events = check_round_trip(&payload, &record["payload_json"], source);
        for event in events {
            by_worker.entry(event.worker_id).or_default().push(event);
        }
        seen += 1;
    }
    assert_eq!(seen, 30, "25 agg + 5 disagg kv-events messages");
    // Replayed in capture order, every event applies: ids are contiguous per rank and every
    // parent is known.
    let mut index = KvIndex::new(5);
    index.set_live_and_retain(
        by_worker
            .keys()
            .map(|w| (*w, BTreeSet::from([DpRank(0)])))
            .collect(),
    );
    for line in CAPTURED.lines() {
        let record: Json = serde_json::from_str(line).unwrap();
        let payload = payload_of_frame3(&unhex(record["frame3_hex"].as_str().unwrap()));
        let counts = index.apply_batch(&decode_router_events(&payload).unwrap());
        assert_eq!(
            counts.get(KvEventResult::Applied),
            counts.total(),
            "{record}"
        );
    }
    index.check_invariants().unwrap();
    assert!(index.stats().ownerships > 0);
}

#[test]
fn vector_batch_and_single_events_round_trip() {
    let v: Json = serde_json::from_str(VECTORS).unwrap();
    let batch = unhex(v["batch_msgpack_hex"].as_str().unwrap());
    let events = check_round_trip(&batch, &v["batch_json_equivalent"], "batch");
    assert_eq!(events.len(), 4);
    assert!(matches!(events[3].event.data, KvCacheEventData::Cleared));
    assert_eq!(events[1].event.dp_rank, DpRank(0));
    for (key, index) in [
        ("removed_event_msgpack_hex_single_map", 2),
        ("cleared_event_msgpack_hex_single_map", 3),
    ] {
        let bytes = unhex(v[key].as_str().unwrap());
        let event: RouterEvent = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(event, events[index], "{key}");
        assert_eq!(rmp_serde::to_vec_named(&event).unwrap(), bytes, "{key}");
    }
}

#[test]
fn vector_complete_zmq_message() {
    let v: Json = serde_json::from_str(VECTORS).unwrap();
    let m = &v["complete_zmq_message"];
    let frames: Vec<Vec<u8>> = m["zmq_multipart_hex"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| unhex(f.as_str().unwrap()))
        .collect();
    assert_eq!(frames[0], b"kv-events");
    let payload = payload_of_frame3(&frames[3]);
    assert_eq!(payload, unhex(m["payload_msgpack_hex"].as_str().unwrap()));
    assert_eq!(
        frames[3][5..],
        unhex(m["envelope_msgpack_hex"].as_str().unwrap())
    );
    check_round_trip(&payload, &m["payload_json_equivalent"], "complete message");
}

#[test]
fn vector_decoder_acceptance_checks() {
    let v: Json = serde_json::from_str(VECTORS).unwrap();
    let cases = v["decoder_acceptance_checks"].as_array().unwrap();
    assert_eq!(cases.len(), 4);
    for case in cases {
        let name = case["case"].as_str().unwrap();
        let bytes = rmp_serde::to_vec_named(&case["json"]).unwrap();
        let decoded = decode_router_events(&bytes);
        assert_eq!(
            decoded.is_ok(),
            case["must_decode"].as_bool().unwrap(),
            "{name}: {decoded:?}"
        );
        match decoded {
            Ok(events) => {
                assert_eq!(events[0].worker_id, InstanceId(7), "{name}");
                assert_eq!(events[0].event.event_id, 5, "{name}");
                assert_eq!(events[0].storage_tier, StorageTier::Device, "{name}");
                assert_eq!(events[0].event.dp_rank, DpRank(0), "{name}");
            }
            Err(error) => assert_eq!(error.result(), KvEventResult::Malformed, "{name}"),
        }
    }
}

fn removed_event(id: u64, hashes: usize) -> RouterEvent {
    RouterEvent {
        worker_id: InstanceId(1),
        storage_tier: StorageTier::Device,
        residency_domain: Some(ResidencyDomain::Worker),
        event: KvCacheEvent {
            event_id: id,
            data: KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: (0..hashes as u64)
                    .map(ExternalBlockHash)
                    .collect::<Vec<_>>()
                    .into(),
            }),
            dp_rank: DpRank(0),
        },
        session_id: None,
    }
}

#[test]
fn batch_bounds_are_refused_as_over_capacity() {
    let at_limit: Vec<_> = (0..128).map(|i| removed_event(i, 64)).collect();
    assert_eq!(
        decode_router_events(&encode_router_events(&at_limit))
            .unwrap()
            .len(),
        128
    );
    let too_many: Vec<_> = (0..129).map(|i| removed_event(i, 1)).collect();
    let refusal = decode_router_events(&encode_router_events(&too_many)).unwrap_err();
    assert_eq!(refusal.result(), KvEventResult::OverCapacity);

    let one_big = vec![removed_event(0, 8_193)];
    assert_eq!(
        decode_router_events(&encode_router_events(&one_big))
            .unwrap_err()
            .result(),
        KvEventResult::OverCapacity
    );
    let exactly = vec![removed_event(0, 4_096), removed_event(1, 4_096)];
    assert!(decode_router_events(&encode_router_events(&exactly)).is_ok());
    let split_over = vec![removed_event(0, 4_096), removed_event(1, 4_097)];
    assert_eq!(
        decode_router_events(&encode_router_events(&split_over))
            .unwrap_err()
            .result(),
        KvEventResult::OverCapacity
    );
}

#[test]
fn hostile_declared_lengths_are_refused_without_allocating_them() {
    // array32 claiming 4 billion events, with nothing behind it.
    assert!(matches!(
        decode_router_events(&[0xdd, 0xff, 0xff, 0xff, 0xff]),
        Err(KvEventsError::OverCapacity)
    ));
    // One event whose removed list claims 2^32 - 1 hashes.
    let mut bytes = encode_router_events(&[removed_event(0, 1)]);
    // The payload ends `... 91 00 a7 "dp_rank" 00`: a one-element list holding hash 0.
    let pos = bytes.len() - 11;
    assert_eq!(
        bytes[pos..pos + 3],
        [0x91, 0x00, 0xa7],
        "removed list header"
    );
    bytes.splice(pos..pos + 1, [0xdd, 0xff, 0xff, 0xff, 0xff]);
    assert!(matches!(
        decode_router_events(&bytes),
        Err(KvEventsError::OverCapacity)
    ));
    // A plausible length that the bytes do not back is malformed.
    assert!(matches!(
        decode_router_events(&[0x92, 0x80]),
        Err(KvEventsError::Malformed(_))
    ));
    for garbage in [&[][..], &[0xc1], &[0x81, 0xa1, b'x', 0x01], b"not msgpack"] {
        assert_eq!(
            decode_router_events(garbage).unwrap_err().result(),
            KvEventResult::Malformed
        );
    }
}

#[test]
fn tolerated_members_and_unknown_tiers() {
    let json = serde_json::json!([{
        "worker_id": 9u64,
        "storage_tier": "tape",
        "residency_domain": "cache_owner",
        "state_source": {"owner": [1, 2, 3]},
        "session_id": "s-1",
        "future_member": {"x": 1},
        "event": {"event_id": 3, "dp_rank": 2, "data": {"stored": {
            "parent_hash": 5u64, "start_position": 7,
            "blocks": [{"block_hash": 1u64, "tokens_hash": 2u64, "mm_extra_info":
                {"mm_objects": [{"mm_hash": 11u64, "offsets": [[0, 4]]}]}}]}}}
    }]);
    let events = decode_router_events(&rmp_serde::to_vec_named(&json).unwrap()).unwrap();
    let e = &events[0];
    assert_eq!(e.storage_tier, StorageTier::Unknown);
    assert_eq!(e.residency_domain, Some(ResidencyDomain::CacheOwner));
    assert_eq!(e.session_id.as_deref(), Some("s-1"));
    assert_eq!(e.event.dp_rank, DpRank(2));
    let KvCacheEventData::Stored(store) = &e.event.data else {
        panic!("stored")
    };
    assert_eq!(store.start_position, Some(7));
    let mm = store.blocks[0].mm_extra_info.as_ref().unwrap();
    assert_eq!(mm.mm_objects[0].mm_hash, 11);
    assert_eq!(&mm.mm_objects[0].offsets[..], &[(0, 4)]);
}

#[test]
fn mocker_prompts_hash_to_the_blocks_the_mocker_announced() {
    let m: Json = serde_json::from_str(MOCKER).unwrap();
    let worker = InstanceId(m["worker_instance_id"].as_u64().unwrap());
    let mut index = KvIndex::new(11);
    index.set_live_and_retain(BTreeMap::from([(worker, BTreeSet::from([DpRank(0)]))]));
    let u64s = |v: &Json| -> Vec<u64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().parse().unwrap())
            .collect()
    };
    for (i, request) in m["requests"].as_array().unwrap().iter().enumerate() {
        let tokens: Vec<u32> = request["prompt_token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let expected = request
            .get("expected_tokens_hash")
            .unwrap_or(&request["expected_tokens_hash_without_salt"]);
        // The mocker runs with block size 4 and ignores cache_salt.
        let local = local_block_hashes_any(&tokens, 4, KV_HASH_SEED);
        assert_eq!(
            local.iter().map(|h| h.0).collect::<Vec<_>>(),
            u64s(expected)
        );
        let seq = sequence_hashes(&local);
        assert_eq!(
            seq.iter().map(|h| h.0).collect::<Vec<_>>(),
            u64s(&request["expected_block_hash_mocker"])
        );
        let payload = payload_of_frame3(&unhex(
            request["kv_events_message"]["frame3_hex"].as_str().unwrap(),
        ));
        let events = decode_router_events(&payload).unwrap();
        assert_eq!(encode_router_events(&events), payload);
        assert_eq!(
            index.apply_batch(&events).get(KvEventResult::Applied),
            events.len() as u64
        );
        assert_eq!(
            index.find_matches(&local),
            vec![RankOverlap {
                worker,
                dp_rank: DpRank(0),
                blocks: local.len() as u32
            }],
            "request {i}"
        );
        if i == 1 {
            // Hashed with the salt, as upstream's router would, the request misses.
            let salted = local_block_hashes_any(&tokens, 4, salt_seed(None, Some("tenant-a")));
            assert_eq!(index.find_matches(&salted), vec![]);
        }
    }
}
