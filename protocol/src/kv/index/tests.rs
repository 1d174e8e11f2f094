//! Unit tests of the radix index: ceilings, the identity gate, cursors, dump/replay, and a
//! differential proptest against the naive reference.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;
use crate::kv::cursors::CursorTable;
use crate::kv::events::{
    KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData, ResidencyDomain,
    RouterEvent, StorageTier, StoredBlock,
};
use crate::kv::reference::ReferenceIndex;

const W1: InstanceId = InstanceId(1);
const W2: InstanceId = InstanceId(2);
const R0: DpRank = DpRank(0);
const R1: DpRank = DpRank(1);

fn live(entries: &[(InstanceId, &[u32])]) -> BTreeMap<InstanceId, BTreeSet<DpRank>> {
    entries
        .iter()
        .map(|(w, ranks)| (*w, ranks.iter().map(|r| DpRank(*r)).collect()))
        .collect()
}

fn stored(parent: Option<u64>, blocks: &[(u64, u64)]) -> KvCacheEventData {
    KvCacheEventData::Stored(KvCacheStoreData {
        parent_hash: parent.map(ExternalBlockHash),
        start_position: None,
        blocks: blocks
            .iter()
            .map(|(b, t)| StoredBlock {
                block_hash: ExternalBlockHash(*b),
                tokens_hash: LocalBlockHash(*t),
                mm_extra_info: None,
            })
            .collect::<Vec<_>>()
            .into(),
    })
}

fn removed(hashes: &[u64]) -> KvCacheEventData {
    KvCacheEventData::Removed(KvCacheRemoveData {
        block_hashes: hashes
            .iter()
            .map(|h| ExternalBlockHash(*h))
            .collect::<Vec<_>>()
            .into(),
    })
}

fn ev(worker: InstanceId, rank: DpRank, id: u64, data: KvCacheEventData) -> RouterEvent {
    RouterEvent {
        worker_id: worker,
        storage_tier: StorageTier::Device,
        residency_domain: Some(ResidencyDomain::Worker),
        event: KvCacheEvent {
            event_id: id,
            data,
            dp_rank: rank,
        },
        session_id: None,
    }
}

fn q(hashes: &[u64]) -> Vec<LocalBlockHash> {
    hashes.iter().map(|h| LocalBlockHash(*h)).collect()
}

fn overlap(worker: InstanceId, rank: DpRank, blocks: u32) -> RankOverlap {
    RankOverlap {
        worker,
        dp_rank: rank,
        blocks,
    }
}

/// An index with W1 ranks {0, 1} and W2 rank {0} live, plus a per-rank event id counter.
struct Fixture {
    index: KvIndex,
    ids: BTreeMap<(InstanceId, DpRank), u64>,
}

impl Fixture {
    fn new(limits: KvIndexLimits) -> Self {
        let mut index = KvIndex::with_limits(limits, 42);
        index.set_live_and_retain(live(&[(W1, &[0, 1]), (W2, &[0])]));
        Self {
            index,
            ids: BTreeMap::new(),
        }
    }

    fn apply(&mut self, worker: InstanceId, rank: DpRank, data: KvCacheEventData) -> KvEventResult {
        let id = self.ids.entry((worker, rank)).or_insert(0);
        *id += 1;
        let result = self.index.apply(&ev(worker, rank, *id, data));
        self.index.check_invariants().unwrap();
        result
    }
}

#[test]
fn store_match_remove_and_clear() {
    let mut f = Fixture::new(KvIndexLimits::default());
    assert_eq!(
        f.apply(W1, R0, stored(None, &[(101, 1), (102, 2), (103, 3)])),
        KvEventResult::Applied
    );
    assert_eq!(
        f.apply(W2, R0, stored(None, &[(201, 1), (202, 2)])),
        KvEventResult::Applied
    );
    // W2 continues its chain from its own parent hash, diverging at depth 3.
    assert_eq!(
        f.apply(W2, R0, stored(Some(202), &[(203, 9)])),
        KvEventResult::Applied
    );
    assert_eq!(
        f.index.find_matches(&q(&[1, 2, 3, 4])),
        vec![overlap(W1, R0, 3), overlap(W2, R0, 2)]
    );
    assert_eq!(
        f.index.find_matches(&q(&[1, 2, 9])),
        vec![overlap(W1, R0, 2), overlap(W2, R0, 3)]
    );
    assert_eq!(f.index.find_matches(&q(&[2, 3])), vec![]);
    assert_eq!(f.index.find_matches(&[]), vec![]);
    assert_eq!(f.index.stats().nodes, 4);
    assert_eq!(f.index.stats().ownerships, 6);

    assert_eq!(
        f.apply(W1, R0, removed(&[103, 999])),
        KvEventResult::Applied
    );
    assert_eq!(
        f.index.find_matches(&q(&[1, 2, 3])),
        vec![overlap(W1, R0, 2), overlap(W2, R0, 2)]
    );
    assert_eq!(f.index.stats().nodes, 3);

    assert_eq!(
        f.apply(W2, R0, KvCacheEventData::Cleared),
        KvEventResult::Applied
    );
    assert_eq!(
        f.index.find_matches(&q(&[1, 2, 9])),
        vec![overlap(W1, R0, 2)]
    );
    assert_eq!(f.index.stats().nodes, 2);
}

#[test]
fn removing_a_parent_truncates_the_walk_and_restoring_it_resumes() {
    let mut f = Fixture::new(KvIndexLimits::default());
    f.apply(W1, R0, stored(None, &[(1, 10), (2, 20), (3, 30)]));
    f.apply(W1, R0, removed(&[2]));
    // The rank keeps block 3 but no longer holds a contiguous path to it.
    assert_eq!(
        f.index.find_matches(&q(&[10, 20, 30])),
        vec![overlap(W1, R0, 1)]
    );
    assert_eq!(f.index.stats().nodes, 3);
    assert_eq!(f.index.stats().ownerships, 2);
    // A child of the removed block is now an orphan for this rank.
    assert_eq!(
        f.apply(W1, R0, stored(Some(2), &[(4, 40)])),
        KvEventResult::Orphan
    );
    // Re-storing the block brings the descendants back into the walk.
    f.apply(W1, R0, stored(Some(1), &[(2, 20)]));
    assert_eq!(
        f.index.find_matches(&q(&[10, 20, 30])),
        vec![overlap(W1, R0, 3)]
    );
    // Removing everything frees every node.
    f.apply(W1, R0, removed(&[1, 2, 3]));
    assert_eq!(f.index.stats().nodes, 0);
}

#[test]
fn two_engine_hashes_share_one_node_with_a_refcount() {
    let mut f = Fixture::new(KvIndexLimits::default());
    f.apply(W1, R0, stored(None, &[(1, 10)]));
    f.apply(W1, R0, stored(None, &[(2, 10)]));
    assert_eq!(f.index.stats().nodes, 1);
    assert_eq!(f.index.stats().ownerships, 2);
    f.apply(W1, R0, removed(&[1]));
    assert_eq!(f.index.find_matches(&q(&[10])), vec![overlap(W1, R0, 1)]);
    f.apply(W1, R0, removed(&[2]));
    assert_eq!(f.index.find_matches(&q(&[10])), vec![]);
    assert_eq!(f.index.stats().nodes, 0);
}

#[test]
fn reused_engine_hash_moves_the_claim_and_restore_is_idempotent() {
    let mut f = Fixture::new(KvIndexLimits::default());
    f.apply(W1, R0, stored(None, &[(1, 10)]));
    f.apply(W1, R0, stored(None, &[(1, 10)]));
    assert_eq!(f.index.stats().ownerships, 1);
    f.apply(W1, R0, stored(None, &[(1, 11)]));
    assert_eq!(f.index.find_matches(&q(&[10])), vec![]);
    assert_eq!(f.index.find_matches(&q(&[11])), vec![overlap(W1, R0, 1)]);
    assert_eq!(f.index.stats().nodes, 1);
}

#[test]
fn invalid_and_orphan_stores_change_nothing() {
    let mut f = Fixture::new(KvIndexLimits::default());
    assert_eq!(
        f.apply(W1, R0, stored(Some(5), &[(5, 10)])),
        KvEventResult::Malformed
    );
    assert_eq!(
        f.apply(W1, R0, stored(Some(77), &[(6, 10)])),
        KvEventResult::Orphan
    );
    // Another rank's hash is not a parent for this one.
    f.apply(W2, R0, stored(None, &[(77, 10)]));
    assert_eq!(
        f.apply(W1, R0, stored(Some(77), &[(6, 11)])),
        KvEventResult::Orphan
    );
    assert_eq!(f.index.stats().ownerships, 1);
}

#[test]
fn identity_gate_admits_only_live_declared_ranks() {
    let mut f = Fixture::new(KvIndexLimits::default());
    let w3 = InstanceId(3);
    assert_eq!(
        f.index.apply(&ev(w3, R0, 1, stored(None, &[(1, 1)]))),
        KvEventResult::IdentityMismatch
    );
    assert_eq!(
        f.index.apply(&ev(W2, R1, 1, stored(None, &[(1, 1)]))),
        KvEventResult::IdentityMismatch
    );
    f.apply(W1, R0, stored(None, &[(1, 1)]));
    f.apply(W1, R1, stored(None, &[(1, 1)]));
    f.apply(W2, R0, stored(None, &[(1, 1)]));
    assert_eq!(f.index.stats().ranks, 3);
    // W1 loses rank 1, W2 departs.
    assert_eq!(f.index.set_live_and_retain(live(&[(W1, &[0])])), 2);
    f.index.check_invariants().unwrap();
    assert_eq!(f.index.find_matches(&q(&[1])), vec![overlap(W1, R0, 1)]);
    assert_eq!(
        f.index.apply(&ev(W2, R0, 99, stored(None, &[(1, 1)]))),
        KvEventResult::IdentityMismatch
    );
    assert_eq!(f.index.stats().ownerships, 1);
    // clear_ranks drops blocks and the cursor: an old id is accepted again afterwards.
    assert_eq!(f.index.clear_ranks(&[(W1, R0), (W2, R0)]), 1);
    assert_eq!(f.index.stats().nodes, 0);
    assert_eq!(
        f.index.apply(&ev(W1, R0, 0, stored(None, &[(1, 1)]))),
        KvEventResult::Applied
    );
    assert_eq!(f.index.clear_worker(W1), 1);
    assert_eq!(f.index.stats().ranks, 0);
    f.index.check_invariants().unwrap();
}

#[test]
fn cursor_skips_replays_and_clears_on_gaps() {
    let mut index = KvIndex::new(7);
    index.set_live_and_retain(live(&[(W1, &[0])]));
    // The first event sets the cursor wherever the stream is.
    assert_eq!(
        index.apply(&ev(W1, R0, 41, stored(None, &[(1, 1), (2, 2)]))),
        KvEventResult::Applied
    );
    assert_eq!(
        index.apply(&ev(W1, R0, 41, KvCacheEventData::Cleared)),
        KvEventResult::Replay
    );
    assert_eq!(
        index.apply(&ev(W1, R0, 3, KvCacheEventData::Cleared)),
        KvEventResult::Replay
    );
    assert_eq!(index.find_matches(&q(&[1, 2])), vec![overlap(W1, R0, 2)]);
    // 42 is next; 44 skips 43: the rank is cleared, then the event applies.
    assert_eq!(
        index.apply(&ev(W1, R0, 42, stored(Some(2), &[(3, 3)]))),
        KvEventResult::Applied
    );
    assert_eq!(
        index.apply(&ev(W1, R0, 44, stored(None, &[(9, 9)]))),
        KvEventResult::Gap
    );
    assert_eq!(index.find_matches(&q(&[1, 2, 3])), vec![]);
    assert_eq!(index.find_matches(&q(&[9])), vec![overlap(W1, R0, 1)]);
    // A chain that continued from before the gap is now an orphan.
    assert_eq!(
        index.apply(&ev(W1, R0, 45, stored(Some(3), &[(4, 4)]))),
        KvEventResult::Orphan
    );
    assert_eq!(
        index.apply(&ev(W1, R0, u64::MAX, KvCacheEventData::Cleared)),
        KvEventResult::Gap
    );
    assert_eq!(
        index.apply(&ev(W1, R0, u64::MAX, KvCacheEventData::Cleared)),
        KvEventResult::Replay
    );
    index.check_invariants().unwrap();
}

#[test]
fn subscriptions_keep_their_own_cursors_and_a_full_table_refuses_new_ranks() {
    let mut index = KvIndex::new(7);
    index.set_live_and_retain(live(&[(W1, &[0, 1]), (W2, &[0])]));
    let mut old = CursorTable::new();
    let mut new = CursorTable::with_limit(1);
    assert_eq!(
        index.apply_from(&mut old, &ev(W1, R0, 900, stored(None, &[(1, 1)]))),
        KvEventResult::Applied
    );
    // A new publisher incarnation of the same rank restarts at 0: not a replay on its table.
    assert_eq!(
        index.apply_from(&mut new, &ev(W1, R0, 0, stored(Some(1), &[(2, 2)]))),
        KvEventResult::Applied
    );
    assert_eq!(index.find_matches(&q(&[1, 2])), vec![overlap(W1, R0, 2)]);
    // Its table holds one cursor: another rank is refused and changes nothing.
    assert_eq!(
        index.apply_from(&mut new, &ev(W1, R1, 0, stored(None, &[(3, 3)]))),
        KvEventResult::OverCapacity
    );
    assert_eq!(index.find_matches(&q(&[3])), vec![]);
    // Gaps are per table too.
    assert_eq!(
        index.apply_from(&mut new, &ev(W1, R0, 2, KvCacheEventData::Cleared)),
        KvEventResult::Gap
    );
    assert_eq!(
        index.apply_from(&mut old, &ev(W1, R0, 901, stored(None, &[(5, 5)]))),
        KvEventResult::Applied
    );
    index.check_invariants().unwrap();
}

#[test]
fn lower_tiers_and_cache_owner_events_advance_the_cursor_only() {
    let mut index = KvIndex::new(7);
    index.set_live_and_retain(live(&[(W1, &[0])]));
    let mut host = ev(W1, R0, 1, stored(None, &[(1, 1)]));
    host.storage_tier = StorageTier::HostPinned;
    assert_eq!(index.apply(&host), KvEventResult::OtherTier);
    let mut owner = ev(W1, R0, 2, stored(None, &[(1, 1)]));
    owner.residency_domain = Some(ResidencyDomain::CacheOwner);
    assert_eq!(index.apply(&owner), KvEventResult::CacheOwner);
    let mut bad = ev(W1, R0, 3, stored(None, &[(1, 1)]));
    bad.residency_domain = Some(ResidencyDomain::Unknown);
    assert_eq!(index.apply(&bad), KvEventResult::Malformed);
    let mut legacy = ev(W1, R0, 4, stored(None, &[(1, 1)]));
    legacy.residency_domain = None;
    assert_eq!(index.apply(&legacy), KvEventResult::Applied);
    assert_eq!(index.find_matches(&q(&[1])), vec![overlap(W1, R0, 1)]);
    assert_eq!(index.stats().ownerships, 1);
}

fn small(blocks: usize, per_rank: usize, ownerships: usize, owners: usize) -> KvIndexLimits {
    KvIndexLimits {
        max_index_blocks: blocks,
        max_blocks_per_rank: per_rank,
        max_index_ownerships: ownerships,
        max_owners_per_node: owners,
    }
}

#[test]
fn default_limits_are_the_compiled_ceilings_and_cannot_be_raised() {
    assert_eq!(MAX_INDEX_BLOCKS, 1_048_576);
    assert_eq!(MAX_BLOCKS_PER_RANK, 262_144);
    assert_eq!(MAX_INDEX_OWNERSHIPS, 8_388_608);
    assert_eq!(MAX_OWNERS_PER_NODE, 4_096);
    let index = KvIndex::new(0);
    assert_eq!(index.limits(), KvIndexLimits::default());
    let raised = KvIndex::with_limits(small(usize::MAX, usize::MAX, usize::MAX, usize::MAX), 0);
    assert_eq!(raised.limits(), KvIndexLimits::default());
    let zero_owners = KvIndex::with_limits(small(1, 1, 1, 0), 0);
    assert_eq!(zero_owners.limits().max_owners_per_node, 1);
}

#[test]
fn node_ceiling_refuses_new_nodes_but_not_shared_ones() {
    let mut f = Fixture::new(small(3, 100, 100, 100));
    assert_eq!(
        f.apply(
            W1,
            R0,
            stored(None, &[(1, 1), (2, 2), (3, 3), (4, 4), (5, 5)])
        ),
        KvEventResult::OverCapacity
    );
    assert_eq!(f.index.stats().nodes, 3);
    assert_eq!(
        f.index.find_matches(&q(&[1, 2, 3, 4])),
        vec![overlap(W1, R0, 3)]
    );
    // Joining existing nodes needs no new node.
    assert_eq!(
        f.apply(W2, R0, stored(None, &[(1, 1), (2, 2)])),
        KvEventResult::Applied
    );
    assert_eq!(
        f.apply(W2, R0, stored(None, &[(9, 9)])),
        KvEventResult::OverCapacity
    );
    // Freeing a node makes room again.
    f.apply(W1, R0, removed(&[3]));
    assert_eq!(
        f.apply(W2, R0, stored(None, &[(9, 9)])),
        KvEventResult::Applied
    );
}

#[test]
fn per_rank_ceiling_refuses_that_rank_only() {
    let mut f = Fixture::new(small(100, 2, 100, 100));
    assert_eq!(
        f.apply(W1, R0, stored(None, &[(1, 1), (2, 2), (3, 3)])),
        KvEventResult::OverCapacity
    );
    assert_eq!(f.index.stats().ownerships, 2);
    // Re-storing a held hash is not a new ownership.
    assert_eq!(
        f.apply(W1, R0, stored(None, &[(1, 1)])),
        KvEventResult::Applied
    );
    assert_eq!(
        f.apply(W1, R1, stored(None, &[(1, 1), (2, 2)])),
        KvEventResult::Applied
    );
}

#[test]
fn ownership_ceiling_counts_across_ranks() {
    let mut f = Fixture::new(small(100, 100, 3, 100));
    f.apply(W1, R0, stored(None, &[(1, 1), (2, 2)]));
    assert_eq!(
        f.apply(W2, R0, stored(None, &[(1, 1), (2, 2)])),
        KvEventResult::OverCapacity
    );
    assert_eq!(f.index.stats().ownerships, 3);
    assert_eq!(
        f.index.find_matches(&q(&[1, 2])),
        vec![overlap(W1, R0, 2), overlap(W2, R0, 1)]
    );
}

#[test]
fn owners_per_node_ceiling() {
    let mut f = Fixture::new(small(100, 100, 100, 2));
    f.apply(W1, R0, stored(None, &[(1, 1)]));
    f.apply(W1, R1, stored(None, &[(1, 1)]));
    assert_eq!(
        f.apply(W2, R0, stored(None, &[(1, 1)])),
        KvEventResult::OverCapacity
    );
    // A second engine hash of an existing owner is still admitted.
    assert_eq!(
        f.apply(W1, R0, stored(None, &[(5, 1)])),
        KvEventResult::Applied
    );
    assert_eq!(f.index.stats().ownerships, 3);
}

#[test]
fn dump_rebuilds_an_equal_index_including_holes() {
    let mut f = Fixture::new(KvIndexLimits::default());
    f.apply(W1, R0, stored(None, &[(1, 10), (2, 20), (3, 30), (4, 40)]));
    f.apply(W1, R0, stored(Some(2), &[(5, 50)]));
    f.apply(W1, R0, stored(None, &[(6, 10)]));
    f.apply(W1, R0, removed(&[2, 3]));
    f.apply(W2, R0, stored(None, &[(u64::MAX, 10), (u64::MAX - 1, 20)]));
    f.apply(W2, R0, stored(Some(u64::MAX - 1), &[(7, 30)]));
    f.apply(W2, R0, removed(&[u64::MAX - 1]));
    f.apply(W1, R1, stored(None, &[(8, 11)]));
    let dump = f.index.dump();
    let mut replayed = KvIndex::new(99);
    replayed.set_live_and_retain(live(&[(W1, &[0, 1]), (W2, &[0])]));
    let counts = replayed.apply_batch(&dump);
    assert_eq!(counts.get(KvEventResult::Applied), dump.len() as u64);
    replayed.check_invariants().unwrap();
    assert_eq!(replayed.ownership_paths(), f.index.ownership_paths());
    assert_eq!(replayed.stats().nodes, f.index.stats().nodes);
    for query in [&[10, 20, 30, 40][..], &[10, 50], &[10, 20, 30], &[11]] {
        assert_eq!(
            replayed.find_matches(&q(query)),
            f.index.find_matches(&q(query))
        );
    }
}

#[test]
fn index_is_send() {
    fn assert_send<T: Send>() {}
    assert_send::<KvIndex>();
}

// ---- differential proptest against the naive reference ----

#[derive(Clone, Debug)]
enum Op {
    Event {
        worker: u8,
        rank: u8,
        id_step: i8,
        device: bool,
        data: Data,
    },
    SetLive(u8),
    ClearRank(u8, u8),
}

#[derive(Clone, Debug)]
enum Data {
    Stored(Option<u8>, Vec<(u8, u8)>),
    Removed(Vec<u8>),
    Cleared,
}

fn data_strategy() -> impl Strategy<Value = Data> {
    prop_oneof![
        6 => (
            proptest::option::weighted(0.6, 0u8..12),
            proptest::collection::vec((0u8..12, 0u8..3), 1..5)
        )
            .prop_map(|(p, b)| Data::Stored(p, b)),
        3 => proptest::collection::vec(0u8..12, 1..4).prop_map(Data::Removed),
        1 => Just(Data::Cleared),
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        30 => (
            0u8..3,
            0u8..2,
            prop_oneof![12 => Just(1i8), 1 => Just(0i8), 1 => Just(-1i8), 1 => Just(3i8)],
            proptest::bool::weighted(0.9),
            data_strategy()
        )
            .prop_map(|(worker, rank, id_step, device, data)| Op::Event {
                worker,
                rank,
                id_step,
                device,
                data,
            }),
        1 => (0u8..8).prop_map(Op::SetLive),
        1 => (0u8..3, 0u8..2).prop_map(|(w, r)| Op::ClearRank(w, r)),
    ]
}

/// Live-set masks: bit 0 = W1 rank 1 declared, bit 1 = W2 live, bit 2 = W3 live. W1 rank 0 is
/// always live; worker 3 never is unless bit 2 is set.
fn live_from_mask(mask: u8) -> BTreeMap<InstanceId, BTreeSet<DpRank>> {
    let mut out = BTreeMap::new();
    let w1: BTreeSet<DpRank> = if mask & 1 != 0 {
        [R0, R1].into()
    } else {
        [R0].into()
    };
    out.insert(W1, w1);
    if mask & 2 != 0 {
        out.insert(W2, [R0, R1].into());
    }
    if mask & 4 != 0 {
        out.insert(InstanceId(3), [R0].into());
    }
    out
}

fn all_queries() -> Vec<Vec<LocalBlockHash>> {
    let mut out = Vec::new();
    for a in 0..3u64 {
        out.push(q(&[a]));
        for b in 0..3u64 {
            out.push(q(&[a, b]));
            for c in 0..3u64 {
                out.push(q(&[a, b, c, 0, 1]));
            }
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn index_agrees_with_reference(ops in proptest::collection::vec(op_strategy(), 1..60)) {
        let mut index = KvIndex::new(0xC0FFEE);
        let mut reference = ReferenceIndex::new();
        index.set_live_and_retain(live_from_mask(3));
        reference.set_live_and_retain(live_from_mask(3));
        let mut ids: BTreeMap<(u8, u8), u64> = BTreeMap::new();
        let queries = all_queries();
        for op in ops {
            match op {
                Op::Event { worker, rank, id_step, device, data } => {
                    let last = ids.entry((worker, rank)).or_insert(5);
                    *last = last.saturating_add_signed(i64::from(id_step));
                    let data = match data {
                        Data::Stored(p, b) => stored(
                            p.map(u64::from),
                            &b.iter().map(|(x, y)| (u64::from(*x), u64::from(*y))).collect::<Vec<_>>(),
                        ),
                        Data::Removed(h) => removed(&h.iter().map(|x| u64::from(*x)).collect::<Vec<_>>()),
                        Data::Cleared => KvCacheEventData::Cleared,
                    };
                    let mut e = ev(InstanceId(u64::from(worker) + 1), DpRank(u32::from(rank)), *last, data);
                    if !device {
                        e.storage_tier = StorageTier::Disk;
                    }
                    prop_assert_eq!(index.apply(&e), reference.apply(&e));
                }
                Op::SetLive(mask) => {
                    index.set_live_and_retain(live_from_mask(mask));
                    reference.set_live_and_retain(live_from_mask(mask));
                }
                Op::ClearRank(w, r) => {
                    let key = [(InstanceId(u64::from(w) + 1), DpRank(u32::from(r)))];
                    index.clear_ranks(&key);
                    reference.clear_ranks(&key);
                }
            }
            prop_assert_eq!(index.check_invariants(), Ok(()));
            for query in &queries {
                prop_assert_eq!(index.find_matches(query), reference.find_matches(query));
            }
        }
        prop_assert_eq!(index.ownership_paths(), reference.ownership_paths());
        // dump → replay → the same content.
        let mut replayed = KvIndex::new(1);
        replayed.set_live_and_retain(live_from_mask(7));
        let counts = replayed.apply_batch(&index.dump());
        prop_assert_eq!(counts.get(KvEventResult::Applied), counts.total());
        prop_assert_eq!(replayed.check_invariants(), Ok(()));
        prop_assert_eq!(replayed.ownership_paths(), index.ownership_paths());
        for query in &queries {
            prop_assert_eq!(replayed.find_matches(query), index.find_matches(query));
        }
    }

    #[test]
    fn ceilings_hold_under_random_load(ops in proptest::collection::vec(op_strategy(), 1..80)) {
        let limits = small(6, 5, 9, 2);
        let mut index = KvIndex::with_limits(limits, 3);
        index.set_live_and_retain(live_from_mask(7));
        let mut id = 0;
        for op in ops {
            if let Op::Event { worker, rank, data, .. } = op {
                id += 1;
                let data = match data {
                    Data::Stored(p, b) => stored(
                        p.map(u64::from),
                        &b.iter().map(|(x, y)| (u64::from(*x), u64::from(*y) + u64::from(*x) % 4)).collect::<Vec<_>>(),
                    ),
                    Data::Removed(h) => removed(&h.iter().map(|x| u64::from(*x)).collect::<Vec<_>>()),
                    Data::Cleared => KvCacheEventData::Cleared,
                };
                // One shared id counter means every other rank sees gaps: fine, also exercised.
                index.apply(&ev(InstanceId(u64::from(worker) + 1), DpRank(u32::from(rank)), id, data));
            }
            prop_assert_eq!(index.check_invariants(), Ok(()));
            let stats = index.stats();
            prop_assert!(stats.nodes <= limits.max_index_blocks);
            prop_assert!(stats.ownerships <= limits.max_index_ownerships);
            for ((_, _), paths) in index.ownership_paths() {
                prop_assert!(paths.len() <= limits.max_blocks_per_rank);
            }
        }
    }
}

#[test]
fn rank_blocks_counts_each_ranks_blocks_in_order() {
    let mut f = Fixture::new(KvIndexLimits::default());
    f.apply(W2, R0, stored(None, &[(201, 1), (202, 2)]));
    f.apply(W1, R0, stored(None, &[(101, 1), (102, 2), (103, 3)]));
    f.apply(W1, R1, stored(None, &[(111, 1)]));
    f.apply(W1, R0, removed(&[103]));
    assert_eq!(
        f.index.rank_blocks(),
        vec![(W1, R0, 2), (W1, R1, 1), (W2, R0, 2)]
    );
    f.index.clear_worker(W1);
    let left: Vec<_> = f
        .index
        .rank_blocks()
        .into_iter()
        .filter(|&(_, _, n)| n > 0)
        .collect();
    assert_eq!(left, vec![(W2, R0, 2)]);
}

#[test]
fn a_store_lands_in_a_free_run_long_enough_for_it() {
    let mut f = Fixture::new(KvIndexLimits::default());
    // 64 one-block prompts fill arena slots 1..=64 in order.
    for i in 0..64 {
        f.apply(W1, R0, stored(None, &[(1_000 + i, 10_000 + i)]));
    }
    // Every other one is evicted (single free slots), then 16 in a row (a free run).
    let mut gone: Vec<u64> = (0..32).map(|i| 1_000 + 2 * i).collect();
    gone.extend((40..56).map(|i| 1_000 + i));
    f.apply(W1, R0, removed(&gone));
    // A 12-block prompt takes the run, not the first single slots the cursor meets.
    let blocks: Vec<(u64, u64)> = (0..12).map(|i| (2_000 + i, 20_000 + i)).collect();
    f.apply(W2, R0, stored(None, &blocks));
    let prompt = q(&(0..12).map(|i| 20_000 + i).collect::<Vec<_>>());
    assert_eq!(f.index.find_matches(&prompt), vec![overlap(W2, R0, 12)]);
    assert_eq!(f.index.arena_jumps(&prompt), 0);
    // A 30-block one fits no run: it grows the arena only by the allowed slack, then takes
    // the longest runs it finds; every block is still indexed.
    let blocks: Vec<(u64, u64)> = (0..30).map(|i| (3_000 + i, 30_000 + i)).collect();
    f.apply(W1, R1, stored(None, &blocks));
    let prompt = q(&(0..30).map(|i| 30_000 + i).collect::<Vec<_>>());
    assert_eq!(f.index.find_matches(&prompt), vec![overlap(W1, R1, 30)]);
    assert!(f.index.arena_jumps(&prompt) > 0);
}

#[test]
fn an_extension_continues_its_chain_in_the_arena() {
    let mut f = Fixture::new(KvIndexLimits::default());
    let first: Vec<(u64, u64)> = (0..8).map(|i| (100 + i, 1_000 + i)).collect();
    f.apply(W1, R0, stored(None, &first));
    // Another prompt takes the slots right after the first one's tail.
    f.apply(W2, R0, stored(None, &[(200, 2_000), (201, 2_001)]));
    // The next turn extends the first prompt: the slot after its parent is taken, so the
    // extension starts a new run; its own blocks stay consecutive.
    let turn: Vec<(u64, u64)> = (8..20).map(|i| (100 + i, 1_000 + i)).collect();
    f.apply(W1, R0, stored(Some(107), &turn));
    let prompt = q(&(0..20).map(|i| 1_000 + i).collect::<Vec<_>>());
    assert_eq!(f.index.find_matches(&prompt), vec![overlap(W1, R0, 20)]);
    assert_eq!(f.index.arena_jumps(&prompt), 1);
}

#[test]
fn matching_prefix_finds_the_first_difference_in_and_after_chunks() {
    for len in 0..20usize {
        let hashes: Vec<LocalBlockHash> = (0..len as u64).map(LocalBlockHash).collect();
        let links: Vec<Link> = hashes
            .iter()
            .map(|h| Link {
                tokens_hash: *h,
                parent: ROOT,
                hint: ROOT,
            })
            .collect();
        assert_eq!(matching_prefix(&links, &hashes), len);
        for at in 0..len {
            let mut other = links.clone();
            other[at].tokens_hash = LocalBlockHash(u64::MAX);
            assert_eq!(
                matching_prefix(&other, &hashes),
                at,
                "len {len}, differs at {at}"
            );
        }
    }
}

#[test]
fn a_node_takes_forty_bytes_in_two_columns() {
    // Four links per 64-byte line: a walk down a run streams 16 bytes per block.
    assert_eq!(std::mem::size_of::<Link>(), 16);
    assert_eq!(std::mem::size_of::<Node>(), 24);
}

#[test]
fn a_chain_owned_past_slot_63_is_walked_as_a_run() {
    // 70 workers: slots 64..69 keep their nodes' owners in sorted lists.
    let workers: Vec<InstanceId> = (1..=70).map(InstanceId).collect();
    let mut index = KvIndex::new(9);
    index.set_live_and_retain(workers.iter().map(|w| (*w, BTreeSet::from([R0]))).collect());
    let blocks: Vec<(u64, u64)> = (0..12).map(|i| (100 + i, 1_000 + i)).collect();
    for w in &workers {
        assert_eq!(
            index.apply(&ev(*w, R0, 1, stored(None, &blocks))),
            KvEventResult::Applied
        );
    }
    index.check_invariants().unwrap();
    let prompt = q(&(0..12).map(|i| 1_000 + i).collect::<Vec<_>>());
    let at = |index: &KvIndex, depth: usize| {
        let mut n = ROOT;
        for hash in &prompt[..=depth] {
            n = index.tree.child(n, *hash).expect("stored");
        }
        n
    };
    let node = |depth: usize| at(&index, depth);
    // The chain's nodes hold list owners, and each continues the previous one's run.
    assert!(matches!(
        index.tree.nodes[node(0) as usize].owners,
        Owners::Many(_)
    ));
    for depth in 0..11 {
        assert_eq!(node(depth + 1), node(depth) + 1);
        assert!(index.tree.runs.get(node(depth)));
    }
    // The last worker drops block 5: the run breaks there, and it leaves the walk at 5.
    let last = *workers.last().expect("70 workers");
    assert_eq!(
        index.apply(&ev(last, R0, 2, removed(&[105]))),
        KvEventResult::Applied
    );
    index.check_invariants().unwrap();
    assert!(!index.tree.runs.get(at(&index, 4)));
    assert!(!index.tree.runs.get(at(&index, 5)));
    assert!(index.tree.runs.get(at(&index, 6)));
    let mut want: Vec<RankOverlap> = workers.iter().map(|w| overlap(*w, R0, 12)).collect();
    want.last_mut().expect("70 workers").blocks = 5;
    assert_eq!(index.find_matches(&prompt), want);
    // A prefix ending inside the run.
    let short: Vec<RankOverlap> = workers.iter().map(|w| overlap(*w, R0, 3)).collect();
    assert_eq!(index.find_matches(&prompt[..3]), short);
}
