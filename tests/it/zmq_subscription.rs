//! The bounded ZMTP SUB connection against real libzmq publishers (pyzmq, `real-peers`).
//!
//! A Python helper (`tests/it/support/zmq_publisher.py`, interpreter from `CONTINUUM_PYTHON`,
//! default `python3`, which needs pyzmq) binds XPUB/PUB/SUB sockets and replays captured Dynamo
//! 1.6.1 `kv_metrics` frames, sequence gaps, late sequences, foreign publisher ids and restarts.
//! XPUB reports each subscription, so tests wait for it instead of sleeping (slow joiners).
#![cfg(feature = "real-peers")]

use crate::support;

use std::path::Path;
use std::time::Duration;

use continuum_actors::zmtp_conn::{
    ConnEvent, IDLE_BUFFER_BYTES, ZmtpConn, ZmtpConnConfig, ZmtpConnError, run_session,
};
use continuum_protocol::event_plane::LoadEventResult;
use continuum_protocol::ids::{DpRank, InstanceId, PublisherId};
use continuum_protocol::load_store::{LoadStore, LoadStream, WorkerRank};
use continuum_protocol::time::Tick;
use continuum_protocol::zmtp::{Delivery, Discard, ZmtpError};
use support::zmq::{Frames, Publisher, make, to_hex};
use tokio::sync::mpsc;
use tokio::time::timeout;

const FIXTURES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/dynamo-1.6.1/zmq/agg"
);
/// Upper bound on any single wait; a hang fails the test instead of stalling CI.
const WAIT: Duration = Duration::from_secs(20);

/// The captured agg-run kv_metrics messages of its busiest publisher, in order.
fn captured() -> (PublisherId, InstanceId, Vec<Frames>) {
    let dir = Path::new(FIXTURES);
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter_map(|n| n.strip_suffix("-kv_metrics.frame0.bin").map(str::to_owned))
        .collect();
    names.sort();
    let mut all: Vec<Frames> = Vec::new();
    for name in names {
        let read =
            |i: usize| std::fs::read(dir.join(format!("{name}-kv_metrics.frame{i}.bin"))).unwrap();
        all.push([read(0), read(1), read(2), read(3)]);
    }
    let publisher_of = |m: &Frames| u64::from_be_bytes(m[1].as_slice().try_into().unwrap());
    let busiest = all
        .iter()
        .map(publisher_of)
        .max_by_key(|p| all.iter().filter(|m| publisher_of(m) == *p).count())
        .unwrap();
    let messages: Vec<Frames> = all
        .into_iter()
        .filter(|m| publisher_of(m) == busiest)
        .collect();
    // worker_id sits at a fixed offset in the captured payload: `a9 "worker_id" cf <u64>`.
    let frame = &messages[0][3];
    let at = frame
        .windows(10)
        .position(|w| w == b"\xa9worker_id")
        .unwrap()
        + 11;
    let worker = u64::from_be_bytes(frame[at..at + 8].try_into().unwrap());
    (PublisherId(busiest), InstanceId(worker), messages)
}

fn config(publisher: PublisherId, port: u16) -> ZmtpConnConfig {
    ZmtpConnConfig::kv_metrics(
        publisher,
        format!("tcp://127.0.0.1:{port}"),
        Some(vec!["127.0.0.0/8".parse().unwrap()]),
    )
}

async fn next_event(rx: &mut mpsc::Receiver<ConnEvent>) -> ConnEvent {
    timeout(WAIT, rx.recv())
        .await
        .expect("an event in time")
        .expect("session alive")
}

async fn next_delivery(rx: &mut mpsc::Receiver<ConnEvent>) -> Delivery {
    match next_event(rx).await {
        ConnEvent::Delivery(delivery) => delivery,
        other => panic!("expected a delivery, got {other:?}"),
    }
}

/// Starts a session and waits until the publisher has seen its subscription.
async fn subscribe(
    publisher: &mut Publisher,
    config: ZmtpConnConfig,
) -> (
    mpsc::Receiver<ConnEvent>,
    tokio::task::JoinHandle<Result<(), ZmtpConnError>>,
) {
    let (tx, mut rx) = mpsc::channel(64);
    let session = tokio::spawn(async move { run_session(&config, &tx).await });
    assert_eq!(
        publisher.await_subscriptions(1).await,
        vec![to_hex(b"\x01kv_metrics")]
    );
    assert!(matches!(
        next_event(&mut rx).await,
        ConnEvent::Connected { .. }
    ));
    (rx, session)
}

#[tokio::test]
async fn replays_captured_frames_gaps_late_sequences_foreign_ids_and_restarts() {
    let (pid, worker, messages) = captured();
    let key = WorkerRank::new(worker, DpRank(0));
    let mut publisher = Publisher::spawn().await;
    let port = publisher.bind("xpub", 0).await;
    let mut store = LoadStore::new();
    store.set_live_and_retain([worker]);
    let mut stream = LoadStream::new(pid);
    let now = Tick::from_millis(1);

    let (mut rx, session) = subscribe(&mut publisher, config(pid, port)).await;
    assert!(stream.on_connected(&mut store).is_empty());

    // The captured 1.6.1 stream, byte for byte: every message applies.
    publisher.send(&messages).await;
    for _ in &messages {
        let outcome = stream.on_delivery(&next_delivery(&mut rx).await, &mut store, now);
        assert_eq!(outcome.result, LoadEventResult::Applied, "{outcome:?}");
        assert_eq!(outcome.gap, None);
    }
    let last = stream.highest_applied().unwrap();

    // Late sequences (a replay) are duplicates; the held sample is unchanged.
    publisher.send(&messages[..3]).await;
    for _ in 0..3 {
        let outcome = stream.on_delivery(&next_delivery(&mut rx).await, &mut store, now);
        assert_eq!(outcome.result, LoadEventResult::Duplicate);
    }
    assert_eq!(store.latest(worker, DpRank(0)).unwrap().sequence, last);

    // A sequence gap drops the held sample before applying the new one.
    let busy = make(pid, last + 5, worker, 17);
    let foreign = make(PublisherId(pid.0 + 1), last + 6, worker, 0);
    let next = make(pid, last + 6, worker, 0);
    publisher.send(&[busy, foreign, next]).await;
    let outcome = stream.on_delivery(&next_delivery(&mut rx).await, &mut store, now);
    assert_eq!(outcome.result, LoadEventResult::Applied);
    assert_eq!(outcome.gap, Some(4));
    assert_eq!(outcome.dropped, vec![key]);
    assert!(!store.is_quiet(worker, DpRank(0)));
    // A foreign publisher id on this subscription is an identity mismatch.
    let outcome = stream.on_delivery(&next_delivery(&mut rx).await, &mut store, now);
    assert_eq!(outcome.result, LoadEventResult::IdentityMismatch);
    let outcome = stream.on_delivery(&next_delivery(&mut rx).await, &mut store, now);
    assert_eq!(outcome.result, LoadEventResult::Applied);
    assert_eq!(outcome.gap, None);
    assert!(store.is_quiet(worker, DpRank(0)));

    // An oversized envelope from a real publisher is skipped and counted; the stream goes on.
    let mut huge = make(pid, last + 7, worker, 3);
    huge[3].resize(40 * 1024, 0);
    publisher
        .send(&[huge, make(pid, last + 8, worker, 4)])
        .await;
    let delivery = next_delivery(&mut rx).await;
    assert!(matches!(
        delivery,
        Delivery::Discarded(Discard::FrameTooLarge { .. })
    ));
    let outcome = stream.on_delivery(&delivery, &mut store, now);
    assert_eq!(outcome.result, LoadEventResult::Oversized);
    let outcome = stream.on_delivery(&next_delivery(&mut rx).await, &mut store, now);
    assert_eq!(outcome.result, LoadEventResult::Applied);
    assert_eq!(outcome.gap, Some(1), "the skipped message counts as missed");

    // Publisher restart on the same port: the session ends, a new one connects, and the
    // missed-messages rule drops what this publisher had said.
    publisher.close().await;
    let ended = timeout(WAIT, session).await.unwrap().unwrap();
    assert!(matches!(ended, Err(ZmtpConnError::Closed)), "{ended:?}");
    assert_eq!(publisher.bind("xpub", port).await, port);
    let (mut rx, _session) = subscribe(&mut publisher, config(pid, port)).await;
    assert_eq!(stream.on_connected(&mut store), vec![key]);
    assert!(store.latest(worker, DpRank(0)).is_none());
    // The restarted stream begins again at a low sequence: accepted as the first of a stream.
    publisher.send(&[make(pid, 0, worker, 9)]).await;
    let outcome = stream.on_delivery(&next_delivery(&mut rx).await, &mut store, now);
    assert_eq!(outcome.result, LoadEventResult::Applied);
    // A new incarnation (new publisher id) replaces the held sample regardless of sequence.
    let new_pid = PublisherId(pid.0 ^ 0xffff);
    let mut restarted = LoadStream::new(new_pid);
    publisher.send(&[make(new_pid, 0, worker, 1)]).await;
    let delivery = next_delivery(&mut rx).await;
    assert_eq!(
        restarted.on_delivery(&delivery, &mut store, now).result,
        LoadEventResult::Applied
    );
    assert_eq!(
        store.latest(worker, DpRank(0)).unwrap().publisher_id,
        new_pid
    );
}

#[tokio::test]
async fn plain_pub_sockets_are_accepted() {
    let (pid, worker, messages) = captured();
    let mut publisher = Publisher::spawn().await;
    let port = publisher.bind("pub", 0).await;
    let (tx, mut rx) = mpsc::channel(64);
    let cfg = config(pid, port);
    let _session = tokio::spawn(async move { run_session(&cfg, &tx).await });
    assert!(matches!(
        next_event(&mut rx).await,
        ConnEvent::Connected { .. }
    ));
    // PUB cannot tell us when our subscription is in place: republish until the first arrives.
    let mut store = LoadStore::new();
    store.set_live_and_retain([worker]);
    let mut stream = LoadStream::new(pid);
    let mut first = None;
    for _ in 0..200 {
        publisher.send(&messages[..1]).await;
        if let Ok(Some(event)) = timeout(Duration::from_millis(50), rx.recv()).await {
            first = Some(event);
            break;
        }
    }
    let Some(ConnEvent::Delivery(delivery)) = first else {
        panic!("no message through a PUB socket")
    };
    let outcome = stream.on_delivery(&delivery, &mut store, Tick::ZERO);
    assert_eq!(outcome.result, LoadEventResult::Applied);
}

#[tokio::test]
async fn a_real_sub_peer_is_refused() {
    let mut peer = Publisher::spawn().await;
    let port = peer.bind("sub", 0).await;
    let error = ZmtpConn::connect(&config(PublisherId(1), port))
        .await
        .unwrap_err();
    assert!(
        matches!(
            &error,
            ZmtpConnError::Protocol(ZmtpError::WrongSocketType { socket_type }) if socket_type == "SUB"
        ),
        "{error}"
    );
    assert_eq!(
        error.counted_result(),
        Some(LoadEventResult::TransportRefused)
    );
}

fn rss_bytes() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: usize = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

/// 1,024 idle subscriptions to one publisher: buffer bytes by construction, RSS as measured.
#[tokio::test]
async fn idle_subscriptions_stay_small() {
    const N: usize = 1024;
    let mut publisher = Publisher::spawn().await;
    let port = publisher.bind("xpub", 0).await;
    let before = rss_bytes();
    let mut conns = Vec::with_capacity(N);
    for i in 0..N {
        conns.push(
            ZmtpConn::connect(&config(PublisherId(i as u64), port))
                .await
                .unwrap(),
        );
    }
    assert_eq!(publisher.await_subscriptions(N).await.len(), N);
    let buffers: usize = conns.iter().map(ZmtpConn::buffer_bytes).sum();
    let after = rss_bytes();
    let per_subscription = after.saturating_sub(before) / N;
    println!(
        "{N} idle subscriptions: buffers {buffers} B ({} B each), RSS +{} KiB ({per_subscription} B each)",
        buffers / N,
        after.saturating_sub(before) / 1024
    );
    assert_eq!(buffers, N * IDLE_BUFFER_BYTES);
    // The RSS delta includes the socket objects and allocator slack, not only our buffers.
    assert!(
        per_subscription < 16 * 1024,
        "{per_subscription} B per subscription"
    );
}
