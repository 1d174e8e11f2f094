//! The merge's unit and property tests: applied once, replaced on restart, expired on TTL.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;

const TTL: Duration = Duration::from_secs(1);

fn limits() -> PeerLimits {
    PeerLimits {
        max_peers: 8,
        max_entries_per_peer: 64,
        ttl: TTL,
    }
}

fn ms(n: u64) -> Tick {
    Tick(Duration::from_millis(n))
}

/// A snapshot of `replica` with one entry per (instance, blocks) in namespace `ns`.
fn snap(replica: &str, epoch: u64, seq: u64, content_seq: u64, content: &[(u64, u64)]) -> Snapshot {
    let local: Vec<LocalContribution> = content
        .iter()
        .map(|&(instance, blocks)| LocalContribution {
            namespace: Namespace::new("ns"),
            instance: InstanceId(instance),
            rank: DpRank(0),
            prefill_tokens: blocks * 16,
            decode_blocks: blocks,
            requests: 1,
        })
        .collect();
    Snapshot::from_local(
        Header {
            replica,
            epoch,
            seq,
            content_seq,
            ttl: TTL,
            sent_unix_ms: 0,
        },
        &local,
    )
}

fn blocks(ledger: &DispatchLedger, instance: u64, now: Tick) -> u64 {
    let worker = WorkerKey {
        namespace: Namespace::new("ns"),
        instance_id: InstanceId(instance),
    };
    ledger.backlog(&worker, DpRank(0), now).decode_blocks
}

#[test]
fn a_snapshot_round_trips_and_hostile_bytes_are_refused() {
    let s = snap("router-a", 7, 3, 2, &[(1, 4), (2, 5)]);
    let bytes = s.encode();
    assert_eq!(Snapshot::decode(&bytes), Ok(s.clone()));
    assert_eq!(
        Snapshot::decode(&bytes[..bytes.len() - 1]),
        Err(DecodeError::Malformed)
    );
    assert_eq!(Snapshot::decode(b"\xc1"), Err(DecodeError::Malformed));
    let big = vec![0u8; MAX_SNAPSHOT_BYTES + 1];
    assert_eq!(Snapshot::decode(&big), Err(DecodeError::Oversize));
    let mut v2 = s.clone();
    v2.v = 2;
    assert_eq!(Snapshot::decode(&v2.encode()), Err(DecodeError::Version));
    let mut bad_ns = s.clone();
    bad_ns.entries.push(Entry(5, 1, 0, 1, 1, 1));
    assert_eq!(Snapshot::decode(&bad_ns.encode()), Err(DecodeError::Bounds));
    let mut no_id = s;
    no_id.replica.clear();
    assert_eq!(Snapshot::decode(&no_id.encode()), Err(DecodeError::Bounds));
}

#[test]
fn a_peer_is_applied_once_refreshed_by_heartbeats_and_expired_on_ttl() {
    let mut ledger = DispatchLedger::new();
    let mut table = PeerTable::new("me", limits());
    assert_eq!(
        table.offer(&snap("me", 1, 1, 1, &[(1, 9)]), ms(0), &mut ledger),
        Offer::Own
    );
    let first = snap("b", 1, 1, 1, &[(1, 4)]);
    assert!(matches!(
        table.offer(&first, ms(0), &mut ledger),
        Offer::Applied {
            entries: 1,
            new_epoch: true,
            ..
        }
    ));
    assert_eq!(
        table.offer(&first, ms(1), &mut ledger),
        Offer::Stale,
        "a duplicate"
    );
    assert_eq!(blocks(&ledger, 1, ms(1)), 4, "applied once");
    // A heartbeat (same content) moves the deadline only.
    let beat = snap("b", 1, 2, 1, &[(1, 4)]);
    assert_eq!(table.offer(&beat, ms(900), &mut ledger), Offer::Refreshed);
    assert_eq!(table.expire(ms(1500), &mut ledger), (0, 0));
    assert_eq!(blocks(&ledger, 1, ms(1500)), 4);
    assert_eq!(table.expire(ms(1900), &mut ledger), (1, 1));
    assert_eq!(blocks(&ledger, 1, ms(1900)), 0);
    assert!(table.is_empty());
}

#[test]
fn a_restart_replaces_and_late_messages_of_the_old_epoch_are_dropped() {
    let mut ledger = DispatchLedger::new();
    let mut table = PeerTable::new("me", limits());
    table.offer(&snap("b", 1, 5, 5, &[(1, 4), (2, 2)]), ms(0), &mut ledger);
    let restarted = snap("b", 2, 1, 1, &[(2, 3)]);
    assert!(matches!(
        table.offer(&restarted, ms(10), &mut ledger),
        Offer::Applied {
            entries: 1,
            replaced: 2,
            new_epoch: true,
            ..
        }
    ));
    assert_eq!(
        (blocks(&ledger, 1, ms(10)), blocks(&ledger, 2, ms(10))),
        (0, 3)
    );
    let late = snap("b", 1, 6, 6, &[(1, 8)]);
    assert_eq!(table.offer(&late, ms(11), &mut ledger), Offer::Stale);
    assert_eq!(blocks(&ledger, 1, ms(11)), 0);
    // Newer content of the same epoch replaces.
    table.offer(&snap("b", 2, 2, 2, &[]), ms(12), &mut ledger);
    assert_eq!(blocks(&ledger, 2, ms(12)), 0);
    assert_eq!(table.peers(ms(12))[0].entries, 0);
}

/// `dynamo.load.peer_slots`: the ledger holds this replica's place among the live peers by
/// replica id, so replicas hearing the same peers hold distinct indices; a peer's expiry or the
/// table's clearing shrinks it back.
#[test]
fn the_ledger_holds_the_place_among_live_peers() {
    let ids = ["router-b", "router-a", "router-c"];
    let mut ledgers: Vec<DispatchLedger> = ids.iter().map(|_| DispatchLedger::new()).collect();
    let mut tables: Vec<PeerTable> = ids.iter().map(|id| PeerTable::new(*id, limits())).collect();
    for (table, ledger) in tables.iter_mut().zip(&mut ledgers) {
        assert_eq!(ledger.place(), Place::ALONE);
        for peer in ids {
            // Heartbeats carry no entries: the place still counts the peer.
            table.offer(&snap(peer, 1, 1, 1, &[]), ms(0), ledger);
        }
    }
    let places: Vec<Place> = ledgers.iter().map(DispatchLedger::place).collect();
    assert_eq!(
        places,
        [Place::new(1, 3), Place::new(0, 3), Place::new(2, 3)],
        "ordered by id: a, b, c"
    );
    // router-a's and router-c's snapshots stop reaching router-b: it is alone again.
    let (table, ledger) = (&mut tables[0], &mut ledgers[0]);
    table.offer(&snap("router-a", 1, 2, 1, &[]), ms(500), ledger);
    table.expire(ms(1200), ledger);
    assert_eq!(ledger.place(), Place::new(1, 2), "router-c expired");
    table.clear(ledger);
    assert_eq!(ledger.place(), Place::ALONE);
    ledgers[1].withdraw_peers();
    assert_eq!(ledgers[1].place(), Place::ALONE, "the sync stopped");
}

#[test]
fn peers_and_entries_are_bounded() {
    let mut ledger = DispatchLedger::new();
    let mut table = PeerTable::new(
        "me",
        PeerLimits {
            max_peers: 2,
            max_entries_per_peer: 2,
            ttl: TTL,
        },
    );
    let many = snap("a", 1, 1, 1, &[(1, 1), (2, 1), (3, 1)]);
    assert!(matches!(
        table.offer(&many, ms(0), &mut ledger),
        Offer::Applied {
            entries: 2,
            truncated: 1,
            ..
        }
    ));
    table.offer(&snap("b", 1, 1, 1, &[]), ms(0), &mut ledger);
    assert_eq!(
        table.offer(&snap("c", 1, 1, 1, &[]), ms(0), &mut ledger),
        Offer::TooManyPeers
    );
    table.clear(&mut ledger);
    assert_eq!(ledger.peer_legs(), 0);
    assert!(ledger.is_empty());
}

#[derive(Clone, Debug)]
enum Op {
    /// Peer publishes its current content, changed to this one (or not).
    Publish {
        peer: usize,
        content: Option<Vec<(u64, u64)>>,
    },
    /// One message sent earlier reaches us (again, or late).
    Deliver(usize),
    /// The peer restarts: a new epoch, its seq from 1.
    Restart(usize),
    Advance(u64),
}

fn arb_op() -> impl Strategy<Value = Op> {
    let content = proptest::collection::vec((0u64..4, 1u64..6), 0..4);
    prop_oneof![
        (0usize..3, proptest::option::of(content))
            .prop_map(|(peer, content)| Op::Publish { peer, content }),
        (0usize..64).prop_map(Op::Deliver),
        (0usize..3).prop_map(Op::Restart),
        (0u64..400).prop_map(Op::Advance),
    ]
}

#[derive(Default, Clone)]
struct Publisher {
    epoch: u64,
    seq: u64,
    content_seq: u64,
    content: Vec<(u64, u64)>,
}

proptest! {
    /// Whatever the order, duplication and timing of deliveries: every instance's backlog in the
    /// ledger is the sum, over the peers heard from within their TTL, of the newest snapshot
    /// (by epoch, then seq) received from each — applied once, replaced on restart, expired.
    #[test]
    fn the_ledger_holds_exactly_each_live_peers_newest_snapshot(
        ops in proptest::collection::vec(arb_op(), 1..80)
    ) {
        let names = ["a", "b", "c"];
        let mut pubs = vec![Publisher { epoch: 1, ..Publisher::default() }; 3];
        let mut sent: Vec<Snapshot> = Vec::new();
        let mut ledger = DispatchLedger::new();
        let mut table = PeerTable::new("me", limits());
        // Reference: per peer, the newest accepted message and its deadline.
        let mut known: BTreeMap<&str, (u64, u64, Vec<Entry>, Tick)> = BTreeMap::new();
        let mut now = ms(0);
        for op in ops {
            match op {
                Op::Publish { peer, content } => {
                    let p = &mut pubs[peer];
                    p.seq += 1;
                    if let Some(c) = content {
                        let mut c = c;
                        c.sort_unstable();
                        c.dedup_by_key(|e| e.0);
                        if c != p.content || p.content_seq == 0 {
                            p.content = c;
                            p.content_seq = p.seq;
                        }
                    }
                    if p.content_seq == 0 {
                        p.content_seq = p.seq;
                    }
                    sent.push(snap(names[peer], p.epoch, p.seq, p.content_seq, &p.content));
                }
                Op::Deliver(i) => {
                    if sent.is_empty() {
                        continue;
                    }
                    let s = &sent[i % sent.len()];
                    table.expire(now, &mut ledger);
                    known.retain(|_, k| now < k.3);
                    table.offer(s, now, &mut ledger);
                    let newer = known
                        .get(s.replica.as_str())
                        .is_none_or(|k| (s.epoch, s.seq) > (k.0, k.1));
                    if newer {
                        let name = names.iter().find(|n| **n == s.replica).copied().unwrap_or("?");
                        known.insert(name, (s.epoch, s.seq, s.entries.clone(), now.plus(TTL)));
                    }
                }
                Op::Restart(peer) => {
                    let p = &mut pubs[peer];
                    *p = Publisher { epoch: p.epoch + 1, ..Publisher::default() };
                }
                Op::Advance(d) => now = now.plus(Duration::from_millis(d)),
            }
            table.expire(now, &mut ledger);
            known.retain(|_, k| now < k.3);
            for instance in 0..4u64 {
                let want: u64 = known
                    .values()
                    .flat_map(|k| k.2.iter())
                    .filter(|e| e.1 == instance)
                    .map(|e| e.4)
                    .sum();
                prop_assert_eq!(blocks(&ledger, instance, now), want, "instance {}", instance);
            }
            prop_assert_eq!(table.len(), known.len());
            prop_assert!(ledger.local_contributions(now, 100).0.is_empty(), "peers are never republished");
        }
    }
}
