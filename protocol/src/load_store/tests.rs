//! Load store tests: one per rule, a replay of captured 1.6.1 traffic, and a model check.

use std::collections::BTreeMap;
use std::path::Path;

use proptest::prelude::*;

use super::*;
use crate::zmtp::{Discard, ZmtpLimits, ZmtpMessage, ZmtpSub};

const W1: InstanceId = InstanceId(0x10);
const W2: InstanceId = InstanceId(0x20);
const P1: PublisherId = PublisherId(1);
const P2: PublisherId = PublisherId(2);
const R0: DpRank = DpRank(0);
const R1: DpRank = DpRank(1);

fn sample(
    worker: InstanceId,
    rank: DpRank,
    publisher: PublisherId,
    seq: u64,
    at_ms: u64,
) -> LoadSample {
    LoadSample {
        load: ActiveLoad {
            worker_id: worker,
            dp_rank: rank,
            active_decode_blocks: None,
            active_prefill_tokens: None,
            kv_used_blocks: Some(seq),
        },
        publisher_id: publisher,
        sequence: seq,
        published_at: UnixMillis(1_700_000_000_000 + at_ms),
        received_at: Tick::from_millis(at_ms),
    }
}

fn store_with_live(live: &[InstanceId]) -> LoadStore {
    let mut store = LoadStore::new();
    assert!(store.set_live_and_retain(live.iter().copied()).is_empty());
    store
}

#[test]
fn only_live_workers_are_admitted() {
    let mut store = LoadStore::new();
    assert_eq!(
        store.apply(sample(W1, R0, P1, 1, 0)),
        LoadEventResult::IdentityMismatch
    );
    store.set_live_and_retain([W1]);
    assert!(store.is_live(W1) && !store.is_live(W2));
    assert_eq!(
        store.apply(sample(W1, R0, P1, 1, 0)),
        LoadEventResult::Applied
    );
    assert_eq!(
        store.apply(sample(W2, R0, P2, 1, 0)),
        LoadEventResult::IdentityMismatch
    );
    assert_eq!(store.len(), 1);
}

#[test]
fn last_heard_survives_dropped_samples_until_the_worker_leaves() {
    let mut store = store_with_live(&[W1, W2]);
    assert_eq!(store.last_arrival(W1), None);
    store.apply(sample(W1, R0, P1, 1, 5));
    store.apply(sample(W1, R1, P1, 2, 9));
    // A duplicate is no news.
    store.apply(sample(W1, R1, P1, 2, 12));
    assert_eq!(store.last_arrival(W1), Some(Tick::from_millis(9)));
    // A resubscription drops the samples, not the fact that they arrived.
    assert_eq!(store.drop_publisher(P1).len(), 2);
    assert!(store.latest(W1, R0).is_none());
    assert_eq!(store.last_arrival(W1), Some(Tick::from_millis(9)));
    assert_eq!(store.last_arrival(W2), None);
    store.set_live_and_retain([W2]);
    assert_eq!(store.last_arrival(W1), None);
}

#[test]
fn same_publisher_sequences_are_deduplicated_per_key() {
    let mut store = store_with_live(&[W1]);
    assert_eq!(
        store.apply(sample(W1, R0, P1, 5, 0)),
        LoadEventResult::Applied
    );
    assert_eq!(
        store.apply(sample(W1, R0, P1, 5, 1)),
        LoadEventResult::Duplicate
    );
    assert_eq!(
        store.apply(sample(W1, R0, P1, 4, 2)),
        LoadEventResult::Duplicate
    );
    // Ranks are separate keys: a lower sequence on another rank is fine.
    assert_eq!(
        store.apply(sample(W1, R1, P1, 3, 3)),
        LoadEventResult::Applied
    );
    assert_eq!(
        store.apply(sample(W1, R0, P1, 9, 4)),
        LoadEventResult::Applied
    );
    assert_eq!(store.latest(W1, R0).unwrap().sequence, 9);
    assert_eq!(
        store.latest(W1, R0).unwrap().received_at,
        Tick::from_millis(4)
    );
}

#[test]
fn a_new_publisher_replaces_the_held_sample_regardless_of_sequence() {
    let mut store = store_with_live(&[W1]);
    store.apply(sample(W1, R0, P1, 900, 0));
    assert_eq!(
        store.apply(sample(W1, R0, P2, 0, 1)),
        LoadEventResult::Applied
    );
    let held = store.latest(W1, R0).unwrap();
    assert_eq!((held.publisher_id, held.sequence), (P2, 0));
    // The old publisher no longer owns the key.
    assert!(store.drop_publisher(P1).is_empty());
    assert_eq!(store.drop_publisher(P2), vec![WorkerRank::new(W1, R0)]);
    assert!(store.is_empty());
}

#[test]
fn capacity_refuses_new_keys_but_not_updates() {
    let mut store = LoadStore::with_capacity(2);
    store.set_live_and_retain([W1, W2]);
    assert_eq!(
        store.apply(sample(W1, R0, P1, 1, 0)),
        LoadEventResult::Applied
    );
    assert_eq!(
        store.apply(sample(W1, R1, P1, 2, 0)),
        LoadEventResult::Applied
    );
    assert_eq!(
        store.apply(sample(W2, R0, P2, 1, 0)),
        LoadEventResult::OverCapacity
    );
    assert_eq!(
        store.apply(sample(W1, R1, P1, 3, 0)),
        LoadEventResult::Applied
    );
    assert_eq!(
        store.apply(sample(W1, R1, P2, 0, 0)),
        LoadEventResult::Applied
    );
    assert_eq!(LoadStore::new().capacity(), 65_536);
    assert_eq!(
        LoadStore::with_capacity(1 << 20).capacity(),
        LOAD_STORE_CAPACITY
    );
}

#[test]
fn fresh_returns_samples_only_within_max_age() {
    let mut store = store_with_live(&[W1]);
    store.apply(sample(W1, R0, P1, 1, 1_000));
    let max_age = Duration::from_millis(500);
    assert!(
        store
            .fresh(W1, R0, max_age, Tick::from_millis(1_500))
            .is_some()
    );
    assert!(
        store
            .fresh(W1, R0, max_age, Tick::from_millis(1_501))
            .is_none()
    );
    // A `now` before receipt counts as age zero.
    assert!(
        store
            .fresh(W1, R0, max_age, Tick::from_millis(10))
            .is_some()
    );
    assert!(
        store
            .fresh(W1, R1, max_age, Tick::from_millis(1_000))
            .is_none()
    );
    assert!(
        store.latest(W1, R0).is_some(),
        "stale samples are still held"
    );
}

#[test]
fn fresh_default_follows_the_reloadable_max_staleness() {
    let mut store = store_with_live(&[W1]);
    store.apply(sample(W1, R0, P1, 1, 0));
    assert_eq!(store.max_staleness(), Duration::from_secs(3));
    assert!(
        store
            .fresh_default(W1, R0, Tick::from_millis(3_000))
            .is_some()
    );
    assert!(
        store
            .fresh_default(W1, R0, Tick::from_millis(3_001))
            .is_none()
    );
    store.set_max_staleness(Duration::from_secs(10)).unwrap();
    assert!(
        store
            .fresh_default(W1, R0, Tick::from_millis(3_001))
            .is_some()
    );
    store.set_max_staleness(Duration::from_millis(100)).unwrap();
    assert!(
        store
            .fresh_default(W1, R0, Tick::from_millis(101))
            .is_none()
    );
    for bad in [
        Duration::from_millis(99),
        Duration::from_secs(301),
        Duration::ZERO,
    ] {
        assert_eq!(
            store.set_max_staleness(bad),
            Err(LoadStoreError::StalenessOutOfRange(bad))
        );
    }
    store.set_max_staleness(Duration::from_secs(300)).unwrap();
    assert_eq!(store.max_staleness(), Duration::from_secs(300));
}

#[test]
fn set_live_and_retain_evicts_departed_workers() {
    let mut store = store_with_live(&[W1, W2]);
    store.apply(sample(W1, R0, P1, 1, 0));
    store.apply(sample(W1, R1, P1, 2, 0));
    store.apply(sample(W2, R0, P2, 1, 0));
    let evicted = store.set_live_and_retain([W2]);
    assert_eq!(
        evicted,
        vec![WorkerRank::new(W1, R0), WorkerRank::new(W1, R1)]
    );
    assert_eq!(store.len(), 1);
    assert!(
        store.drop_publisher(P1).is_empty(),
        "index cleaned on eviction"
    );
    assert_eq!(
        store.apply(sample(W1, R0, P1, 3, 0)),
        LoadEventResult::IdentityMismatch
    );
}

#[test]
fn drop_publisher_forgets_only_that_publisher() {
    let mut store = store_with_live(&[W1, W2]);
    store.apply(sample(W1, R0, P1, 1, 0));
    store.apply(sample(W1, R1, P1, 2, 0));
    store.apply(sample(W2, R0, P2, 1, 0));
    assert_eq!(
        store.drop_publisher(P1),
        vec![WorkerRank::new(W1, R0), WorkerRank::new(W1, R1)]
    );
    assert!(store.latest(W1, R0).is_none());
    assert!(store.latest(W2, R0).is_some());
    // After a drop, the same sequence is accepted again (a new stream).
    assert_eq!(
        store.apply(sample(W1, R0, P1, 1, 0)),
        LoadEventResult::Applied
    );
}

#[test]
fn quiet_means_never_published_or_no_backlog() {
    let mut store = store_with_live(&[W1]);
    assert!(store.is_quiet(W1, R0), "never published");
    let mut busy = sample(W1, R0, P1, 1, 0);
    busy.load.kv_used_blocks = Some(7);
    store.apply(busy);
    assert!(
        !store.is_quiet(W1, R0),
        "kv_used_blocks stands in for a nil active_decode_blocks"
    );
    assert_eq!(store.latest(W1, R0).unwrap().decode_backlog(), Some(7));
    let mut idle = sample(W1, R0, P1, 2, 0);
    idle.load.kv_used_blocks = Some(0);
    store.apply(idle);
    assert!(store.is_quiet(W1, R0));
    // active_decode_blocks wins over kv_used_blocks when present.
    let mut decode = sample(W1, R0, P1, 3, 0);
    decode.load.active_decode_blocks = Some(0);
    decode.load.kv_used_blocks = Some(50);
    store.apply(decode);
    assert!(store.is_quiet(W1, R0));
    let mut prefill = sample(W1, R0, P1, 4, 0);
    prefill.load.kv_used_blocks = None;
    prefill.load.active_prefill_tokens = Some(300);
    store.apply(prefill);
    assert!(!store.is_quiet(W1, R0));
    assert_eq!(store.latest(W1, R0).unwrap().prefill_backlog(), Some(300));
    // Staleness does not change quietness: a silent busy worker stays "silent under load".
    assert!(
        store
            .fresh_default(W1, R0, Tick::from_millis(60_000))
            .is_none()
    );
    assert!(!store.is_quiet(W1, R0));
    store.drop_publisher(P1);
    assert!(
        store.is_quiet(W1, R0),
        "dropped samples read as never published"
    );
}

#[test]
fn unreachable_marks_are_set_for_live_workers_and_cleared_by_life_or_departure() {
    let mut store = store_with_live(&[W1, W2]);
    let t = Tick::from_millis(100);
    assert_eq!(
        store.mark_unreachable(P1, [W1, InstanceId(0x99)], t),
        vec![W1]
    );
    assert_eq!(
        store.unreachable(W1),
        Some(Unreachable {
            publisher_id: P1,
            since: t
        })
    );
    // A second mark keeps the first one's time and publisher.
    assert!(
        store
            .mark_unreachable(P2, [W1], Tick::from_millis(200))
            .is_empty()
    );
    assert_eq!(store.unreachable(W1).unwrap().since, t);
    assert!(!store.is_unreachable(W2));
    // Another publisher reconnecting clears nothing; the marking one clears its marks.
    assert!(store.clear_unreachable(P2).is_empty());
    assert_eq!(store.clear_unreachable(P1), vec![W1]);
    assert_eq!(store.unreachable_count(), 0);
    // Any applied sample of the worker is proof of life.
    store.mark_unreachable(P1, [W1, W2], t);
    assert_eq!(
        store.apply(sample(W1, R1, P2, 1, 0)),
        LoadEventResult::Applied
    );
    assert!(!store.is_unreachable(W1) && store.is_unreachable(W2));
    // A refused sample is not.
    assert_eq!(
        store.apply(sample(W1, R1, P2, 1, 0)),
        LoadEventResult::Duplicate
    );
    store.mark_unreachable(P1, [W1], t);
    assert!(store.is_unreachable(W1));
    // Departure drops the mark with the samples.
    store.set_live_and_retain([W1]);
    assert!(!store.is_unreachable(W2) && store.is_unreachable(W1));
    store.set_live_and_retain([]);
    assert_eq!(store.unreachable_count(), 0);
}

// --- The subscription pipeline over captured bytes -------------------------------------------

const FIXTURES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/fixtures/dynamo-1.6.1/zmq/agg"
);

/// The captured agg-run kv_metrics messages of one publisher, in order.
fn agg_messages() -> (PublisherId, Vec<[Vec<u8>; 4]>) {
    let dir = Path::new(FIXTURES);
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter_map(|n| n.strip_suffix("-kv_metrics.frame0.bin").map(str::to_owned))
        .collect();
    names.sort();
    let mut by_publisher: BTreeMap<u64, Vec<[Vec<u8>; 4]>> = BTreeMap::new();
    for name in names {
        let read =
            |i: usize| std::fs::read(dir.join(format!("{name}-kv_metrics.frame{i}.bin"))).unwrap();
        let frames = [read(0), read(1), read(2), read(3)];
        let publisher = u64::from_be_bytes(frames[1].as_slice().try_into().unwrap());
        by_publisher.entry(publisher).or_default().push(frames);
    }
    let (publisher, messages) = by_publisher
        .into_iter()
        .max_by_key(|(_, m)| m.len())
        .unwrap();
    (PublisherId(publisher), messages)
}

fn wire_of(frames: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, frame) in frames.iter().enumerate() {
        let more = u8::from(i + 1 < frames.len());
        if frame.len() > 255 {
            out.push(more | 0x02);
            out.extend_from_slice(&(frame.len() as u64).to_be_bytes());
        } else {
            out.push(more);
            out.push(frame.len() as u8);
        }
        out.extend_from_slice(frame);
    }
    out
}

fn delivery(frames: &[Vec<u8>]) -> Delivery {
    Delivery::Message(ZmtpMessage::from_frames(frames).unwrap())
}

fn worker_of(frames: &[Vec<u8>; 4]) -> InstanceId {
    let envelope = crate::event_plane::decode_envelope(&frames[3][5..]).unwrap();
    crate::event_plane::decode_active_load(envelope.payload)
        .unwrap()
        .worker_id
}

#[test]
fn captured_traffic_flows_through_the_wire_state_machine_into_the_store() {
    let (publisher, messages) = agg_messages();
    assert!(messages.len() >= 10);
    let worker = worker_of(&messages[0]);
    let mut store = store_with_live(&[worker]);
    let mut stream = LoadStream::new(publisher);
    let mut sub = ZmtpSub::new(b"kv_metrics", ZmtpLimits::KV_METRICS).unwrap();
    let mut wire = GREETING_31.to_vec();
    wire.extend_from_slice(b"\x04\x19\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB");
    for message in &messages {
        wire.extend(wire_of(message));
    }
    assert!(stream.on_connected(&mut store).is_empty());
    let mut outcomes = Vec::new();
    for chunk in wire.chunks(2048) {
        sub.feed(chunk, |d| {
            outcomes.push(stream.on_delivery(&d, &mut store, Tick::from_millis(5)))
        })
        .unwrap();
    }
    assert_eq!(outcomes.len(), messages.len());
    assert!(
        outcomes
            .iter()
            .all(|o| o.result == LoadEventResult::Applied),
        "{outcomes:?}"
    );
    let last_seq = u64::from_be_bytes(messages.last().unwrap()[2].as_slice().try_into().unwrap());
    assert_eq!(stream.highest_applied(), Some(last_seq));
    assert_eq!(store.latest(worker, R0).unwrap().sequence, last_seq);

    // Replaying the stream on the same connection: every message is a duplicate.
    for message in &messages {
        let outcome = stream.on_delivery(&delivery(message), &mut store, Tick::from_millis(6));
        assert_eq!(outcome.result, LoadEventResult::Duplicate);
    }
    // A reconnect drops the publisher's samples and forgets the sequence.
    assert_eq!(
        stream.on_connected(&mut store),
        vec![WorkerRank::new(worker, R0)]
    );
    assert!(store.latest(worker, R0).is_none());
    let outcome = stream.on_delivery(&delivery(&messages[3]), &mut store, Tick::from_millis(7));
    assert_eq!(outcome.result, LoadEventResult::Applied);
    assert_eq!(outcome.gap, None);
    // Skipping two messages is a gap: held samples are dropped, then the new one applies.
    let outcome = stream.on_delivery(&delivery(&messages[6]), &mut store, Tick::from_millis(8));
    assert_eq!(outcome.result, LoadEventResult::Applied);
    assert!(outcome.gap.is_some());
    assert_eq!(outcome.dropped, vec![WorkerRank::new(worker, R0)]);
    assert_eq!(outcome.applied, Some(WorkerRank::new(worker, R0)));
    // A late (lower) sequence is a duplicate.
    let outcome = stream.on_delivery(&delivery(&messages[5]), &mut store, Tick::from_millis(9));
    assert_eq!(outcome.result, LoadEventResult::Duplicate);
    // Another publisher's frames on this subscription: identity mismatch, nothing changes.
    let mut foreign = LoadStream::new(PublisherId(publisher.0 + 1));
    let outcome = foreign.on_delivery(&delivery(&messages[7]), &mut store, Tick::from_millis(9));
    assert_eq!(outcome.result, LoadEventResult::IdentityMismatch);
    // Transport discards are counted.
    let outcome = stream.on_delivery(
        &Delivery::Discarded(Discard::FrameTooLarge { declared: 1 << 20 }),
        &mut store,
        Tick::from_millis(9),
    );
    assert_eq!(outcome.result, LoadEventResult::Oversized);
    // A worker that left the registry: identity mismatch, and the sequence is not consumed.
    store.set_live_and_retain([]);
    let outcome = stream.on_delivery(&delivery(&messages[8]), &mut store, Tick::from_millis(9));
    assert_eq!(outcome.result, LoadEventResult::IdentityMismatch);
    store.set_live_and_retain([worker]);
    let outcome = stream.on_delivery(&delivery(&messages[8]), &mut store, Tick::from_millis(9));
    assert_eq!(outcome.result, LoadEventResult::Applied);
}

/// A libzmq 4.3 greeting (3.1, NULL).
const GREETING_31: [u8; 64] = {
    let mut g = crate::zmtp::GREETING;
    g[11] = 1;
    g
};

// --- Model check -----------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Op {
    Apply {
        worker: u8,
        rank: u8,
        publisher: u8,
        seq: u8,
    },
    DropPublisher(u8),
    SetLive(Vec<u8>),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..4, 0u8..2, 0u8..3, 0u8..8)
            .prop_map(|(worker, rank, publisher, seq)| Op::Apply { worker, rank, publisher, seq }),
        1 => (0u8..3).prop_map(Op::DropPublisher),
        1 => proptest::collection::vec(0u8..4, 0..4).prop_map(Op::SetLive),
    ]
}

proptest! {
    /// The store against a naive model: a list of (key, publisher, seq) with linear scans.
    #[test]
    fn store_matches_a_naive_model(ops in proptest::collection::vec(op(), 0..60)) {
        let capacity = 5;
        let mut store = LoadStore::with_capacity(capacity);
        let mut live: Vec<u8> = Vec::new();
        let mut model: Vec<(u8, u8, u8, u8)> = Vec::new();
        for op in ops {
            match op {
                Op::Apply { worker, rank, publisher, seq } => {
                    let got = store.apply(sample(
                        InstanceId(u64::from(worker)), DpRank(u32::from(rank)),
                        PublisherId(u64::from(publisher)), u64::from(seq), 0));
                    let position = model.iter().position(|m| (m.0, m.1) == (worker, rank));
                    let expected = if !live.contains(&worker) {
                        LoadEventResult::IdentityMismatch
                    } else if let Some(i) = position {
                        if model[i].2 == publisher && seq <= model[i].3 {
                            LoadEventResult::Duplicate
                        } else {
                            model[i] = (worker, rank, publisher, seq);
                            LoadEventResult::Applied
                        }
                    } else if model.len() >= capacity {
                        LoadEventResult::OverCapacity
                    } else {
                        model.push((worker, rank, publisher, seq));
                        LoadEventResult::Applied
                    };
                    prop_assert_eq!(got, expected);
                }
                Op::DropPublisher(publisher) => {
                    let got = store.drop_publisher(PublisherId(u64::from(publisher)));
                    let mut expected: Vec<WorkerRank> = model.iter()
                        .filter(|m| m.2 == publisher)
                        .map(|m| WorkerRank::new(InstanceId(u64::from(m.0)), DpRank(u32::from(m.1))))
                        .collect();
                    expected.sort();
                    model.retain(|m| m.2 != publisher);
                    prop_assert_eq!(got, expected);
                }
                Op::SetLive(workers) => {
                    live = workers.clone();
                    let got = store.set_live_and_retain(workers.iter().map(|w| InstanceId(u64::from(*w))));
                    let mut expected: Vec<WorkerRank> = model.iter()
                        .filter(|m| !live.contains(&m.0))
                        .map(|m| WorkerRank::new(InstanceId(u64::from(m.0)), DpRank(u32::from(m.1))))
                        .collect();
                    expected.sort();
                    model.retain(|m| live.contains(&m.0));
                    prop_assert_eq!(got, expected);
                }
            }
            prop_assert_eq!(store.len(), model.len());
            for m in &model {
                let held = store.latest(InstanceId(u64::from(m.0)), DpRank(u32::from(m.1))).unwrap();
                prop_assert_eq!((held.publisher_id.0, held.sequence), (u64::from(m.2), u64::from(m.3)));
            }
        }
    }
}

#[test]
fn a_lost_session_whose_reconnect_fails_marks_the_publishers_workers() {
    let (publisher, messages) = agg_messages();
    let worker = worker_of(&messages[0]);
    let mut store = store_with_live(&[worker, W2]);
    let mut stream = LoadStream::new(publisher);
    let t = Tick::from_millis(10);
    // Never connected: a failing dial says nothing about the worker.
    assert_eq!(stream.link(), Link::NeverUp);
    stream.on_session_lost();
    assert!(stream.on_connect_failed(&mut store, t).is_empty());
    // Connected, but nothing delivered yet: the publisher's worker is unknown.
    stream.on_connected(&mut store);
    assert_eq!(stream.link(), Link::Up);
    stream.on_session_lost();
    assert_eq!(stream.link(), Link::Lost);
    assert!(stream.on_connect_failed(&mut store, t).is_empty());
    // A session that delivered a sample, then lost and refused: the worker is marked, once.
    stream.on_connected(&mut store);
    let outcome = stream.on_delivery(&delivery(&messages[0]), &mut store, t);
    assert_eq!(outcome.result, LoadEventResult::Applied);
    assert_eq!(stream.workers().collect::<Vec<_>>(), vec![worker]);
    // A failed attempt while the session is up cannot happen; it marks nothing.
    assert!(stream.on_connect_failed(&mut store, t).is_empty());
    stream.on_session_lost();
    assert_eq!(stream.on_connect_failed(&mut store, t), vec![worker]);
    assert!(store.is_unreachable(worker) && !store.is_unreachable(W2));
    assert!(
        stream
            .on_connect_failed(&mut store, Tick::from_millis(20))
            .is_empty()
    );
    assert_eq!(store.unreachable(worker).unwrap().since, t);
    // The sample is kept (it aged on its own), and the next established session clears the mark
    // and drops the sample as after any reconnect; the publisher still maps to its worker.
    assert!(store.latest(worker, R0).is_some());
    stream.on_connected(&mut store);
    assert!(!store.is_unreachable(worker));
    assert!(store.latest(worker, R0).is_none());
    stream.on_session_lost();
    assert_eq!(stream.on_connect_failed(&mut store, t), vec![worker]);
}

#[test]
fn a_publisher_remembers_a_bounded_number_of_workers() {
    let publisher = PublisherId(7);
    let live: Vec<InstanceId> = (1..=(MAX_WORKERS_PER_PUBLISHER as u64 + 10))
        .map(InstanceId)
        .collect();
    let mut store = store_with_live(&live);
    let mut stream = LoadStream::new(publisher);
    stream.on_connected(&mut store);
    for (seq, worker) in live.iter().enumerate() {
        let payload = kv_metrics_frames(publisher, seq as u64, *worker);
        let outcome = stream.on_delivery(&delivery(&payload), &mut store, Tick::from_millis(1));
        assert_eq!(outcome.result, LoadEventResult::Applied);
    }
    assert_eq!(stream.workers().count(), MAX_WORKERS_PER_PUBLISHER);
    stream.on_session_lost();
    let marked = stream.on_connect_failed(&mut store, Tick::from_millis(2));
    assert_eq!(marked.len(), MAX_WORKERS_PER_PUBLISHER);
}

/// One `kv_metrics` message as 1.6.1 frames it (named msgpack maps, upstream field order).
fn kv_metrics_frames(publisher: PublisherId, sequence: u64, worker: InstanceId) -> [Vec<u8>; 4] {
    #[derive(serde::Serialize)]
    struct Load {
        worker_id: u64,
        dp_rank: u32,
        active_decode_blocks: Option<u64>,
        active_prefill_tokens: Option<u64>,
        kv_used_blocks: Option<u64>,
    }
    #[derive(serde::Serialize)]
    struct Envelope<'a> {
        publisher_id: u64,
        sequence: u64,
        published_at: u64,
        topic: &'a str,
        #[serde(with = "serde_bytes_as_bin")]
        payload: &'a [u8],
    }
    mod serde_bytes_as_bin {
        pub fn serialize<S: serde::Serializer>(b: &&[u8], s: S) -> Result<S::Ok, S::Error> {
            s.serialize_bytes(b)
        }
    }
    let payload = rmp_serde::to_vec_named(&Load {
        worker_id: worker.0,
        dp_rank: 0,
        active_decode_blocks: None,
        active_prefill_tokens: None,
        kv_used_blocks: Some(0),
    })
    .unwrap();
    let body = rmp_serde::to_vec_named(&Envelope {
        publisher_id: publisher.0,
        sequence,
        published_at: 1,
        topic: "kv_metrics",
        payload: &payload,
    })
    .unwrap();
    let mut frame = vec![1u8];
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend(body);
    [
        b"kv_metrics".to_vec(),
        publisher.0.to_be_bytes().to_vec(),
        sequence.to_be_bytes().to_vec(),
        frame,
    ]
}

#[test]
fn slots_are_stable_while_held_reused_when_freed_and_the_epoch_says_when_they_move() {
    let mut store = store_with_live(&[W1, W2]);
    let epoch = store.slot_epoch();
    assert_eq!(store.slot(W1, R0), None);
    store.apply(sample(W1, R0, P1, 1, 0));
    let first = store.slot_epoch();
    assert_ne!(first, epoch, "a key gained a slot");
    let slot = store.slot(W1, R0).expect("held");
    // Replacing the held sample keeps its slot and the epoch.
    store.apply(sample(W1, R0, P1, 2, 5));
    assert_eq!(store.slot_epoch(), first);
    assert_eq!(store.slot(W1, R0), Some(slot));
    assert_eq!(store.at_slot(slot).map(|s| s.sequence), Some(2));
    assert_eq!(store.latest(W1, R0).map(|s| s.sequence), Some(2));
    store.apply(sample(W2, R1, P2, 1, 0));
    let w2 = store.slot(W2, R1).expect("held");
    assert_ne!(w2, slot);
    // Dropping a publisher frees its slots (the epoch moves) and a new key reuses one.
    let before = store.slot_epoch();
    store.drop_publisher(P1);
    assert_ne!(store.slot_epoch(), before);
    assert_eq!(store.at_slot(slot), None, "a freed slot reads as empty");
    assert_eq!(store.slot(W1, R0), None);
    store.apply(sample(W1, R1, P1, 3, 10));
    assert_eq!(store.slot(W1, R1), Some(slot), "the freed slot is reused");
    assert_eq!(store.iter().count(), 2);
    // Evicting a worker frees its slot too.
    let before = store.slot_epoch();
    store.set_live_and_retain([W1]);
    assert_ne!(store.slot_epoch(), before);
    assert_eq!(store.at_slot(w2), None);
    assert_eq!(store.len(), 1);
    // Two stores never share an epoch.
    assert_ne!(LoadStore::new().slot_epoch(), LoadStore::new().slot_epoch());
}

#[test]
fn the_change_log_lists_written_slots_until_it_is_overrun() {
    let mut store = store_with_live(&[W1, W2]);
    let start = store.changes();
    store.apply(sample(W1, R0, P1, 1, 0));
    store.apply(sample(W2, R0, P2, 1, 0));
    let (w1, w2) = (
        store.slot(W1, R0).expect("held"),
        store.slot(W2, R0).expect("held"),
    );
    // A duplicate writes nothing.
    store.apply(sample(W1, R0, P1, 1, 0));
    store.apply(sample(W1, R0, P1, 2, 5));
    let written: Vec<u32> = store.changed_since(start).expect("logged").collect();
    assert_eq!(written, vec![w1, w2, w1]);
    let seen = store.changes();
    assert_eq!(store.changed_since(seen).expect("logged").count(), 0);
    assert!(
        store.changed_since(seen + 1).is_none(),
        "a reader ahead re-reads"
    );
    // A removal is a write too.
    store.drop_publisher(P2);
    let written: Vec<u32> = store.changed_since(seen).expect("logged").collect();
    assert_eq!(written, vec![w2]);
    // Past CHANGE_LOG writes the log no longer reaches back.
    let seen = store.changes();
    for sequence in 3..3 + CHANGE_LOG as u64 {
        store.apply(sample(W1, R0, P1, sequence, 5));
    }
    assert_eq!(
        store
            .changed_since(seen)
            .expect("exactly CHANGE_LOG behind")
            .count(),
        CHANGE_LOG
    );
    store.apply(sample(W1, R0, P1, 3 + CHANGE_LOG as u64, 5));
    assert!(store.changed_since(seen).is_none());
}
