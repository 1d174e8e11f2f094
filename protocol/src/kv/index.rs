//! The bounded device-tier radix index (seed "Index structure and compiled-in bounds").
//!
//! Nodes live in an arena (`Vec` + free-slot bitset, `u32` indices, no pointers) and are keyed by
//! `tokens_hash` under their parent, starting from a root that stands for the empty prefix. Each
//! (worker, dp_rank) maps the engine's `block_hash` to a node; a node counts, per rank, how many
//! engine hashes name it (two engine hashes may name one `tokens_hash` node). A node lives while
//! some rank owns it or it has children.
//!
//! Semantics chosen where upstream (wire §10.4) leaves room:
//! * A store whose `parent_hash` the rank does not hold is dropped whole (`orphan`), as upstream
//!   drops it with "parent block not found".
//! * Removing a block removes only that rank's ownership of that node. The rank keeps its
//!   descendants (the engine still holds them until it says otherwise), but a prefix walk stops
//!   at the removed node, which is upstream's "truncated at the removed position"; re-storing the
//!   block restores the path. Nodes with neither owners nor children are freed at once.
//! * Each (worker, dp_rank) has an `event_id` cursor, kept per subscription in a
//!   [`CursorTable`] (the index keeps one of its own for [`KvIndex::apply`]): at or below it is a
//!   replay (skipped); a
//!   forward jump clears the rank's blocks, counts `gap`, and then applies the event. The first
//!   event of a rank sets the cursor wherever it is (the router may join mid-stream).
//! * Ceilings refuse the offending block and the rest of its store (`over_capacity`); blocks
//!   before it stay.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{BuildHasher, Hasher};

use super::cursors::{Admission, CursorTable};
use super::events::{KvCacheEventData, ResidencyDomain, RouterEvent, StorageTier, StoredBlock};
use super::{ExternalBlockHash, KvEventCounts, KvEventResult, LocalBlockHash};
use crate::ids::{DpRank, InstanceId};

mod block_table;
mod free_set;
mod owners;
mod runs;
use block_table::BlockTable;
use free_set::FreeSet;
use owners::{Owner, Owners, mask_slots};
use runs::Runs;

/// Radix nodes in the whole index (the root not counted).
pub const MAX_INDEX_BLOCKS: usize = 1_048_576;
/// Engine block hashes one (worker, dp_rank) may hold.
pub const MAX_BLOCKS_PER_RANK: usize = 262_144;
/// (rank, engine block hash) ownerships across the index.
pub const MAX_INDEX_OWNERSHIPS: usize = 8_388_608;
/// Ranks that may own one node.
pub const MAX_OWNERS_PER_NODE: usize = 4_096;

/// The ceilings in force. `Default` is the compiled-in consts; lower values are for tests and
/// small deployments, higher values are clamped to the consts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvIndexLimits {
    pub max_index_blocks: usize,
    pub max_blocks_per_rank: usize,
    pub max_index_ownerships: usize,
    pub max_owners_per_node: usize,
}

impl Default for KvIndexLimits {
    fn default() -> Self {
        Self {
            max_index_blocks: MAX_INDEX_BLOCKS,
            max_blocks_per_rank: MAX_BLOCKS_PER_RANK,
            max_index_ownerships: MAX_INDEX_OWNERSHIPS,
            max_owners_per_node: MAX_OWNERS_PER_NODE,
        }
    }
}

impl KvIndexLimits {
    fn clamped(self) -> Self {
        Self {
            max_index_blocks: self.max_index_blocks.min(MAX_INDEX_BLOCKS),
            max_blocks_per_rank: self.max_blocks_per_rank.min(MAX_BLOCKS_PER_RANK),
            max_index_ownerships: self.max_index_ownerships.min(MAX_INDEX_OWNERSHIPS),
            max_owners_per_node: self.max_owners_per_node.clamp(1, MAX_OWNERS_PER_NODE),
        }
    }
}

/// One rank's overlap with a request: its longest contiguous prefix, in blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RankOverlap {
    pub worker: InstanceId,
    pub dp_rank: DpRank,
    pub blocks: u32,
}

/// Sizes for gauges and the memory estimate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvIndexStats {
    pub nodes: usize,
    pub ranks: usize,
    pub ownerships: usize,
    /// Arena, edge table and rank maps, counted at their element sizes (a lower bound on the
    /// heap footprint; hash-table slack is not included).
    pub approx_bytes: usize,
}

/// Ownership paths: per rank, engine hash → `tokens_hash` path from the root. Two indexes with
/// equal paths answer every `find_matches` identically.
pub type OwnershipPaths =
    BTreeMap<(InstanceId, DpRank), BTreeMap<ExternalBlockHash, Vec<LocalBlockHash>>>;

type NodeIdx = u32;
const ROOT: NodeIdx = 0;
/// The `parent` of a freed arena entry (no node has this index).
const FREED: NodeIdx = NodeIdx::MAX;
type Slot = u32;
/// The arena may hold this fraction of the live nodes (plus [`ARENA_SLACK_MIN`]) in free slots
/// before allocation stops growing it (see [`Tree::arena_room`]).
const ARENA_SLACK_DIV: usize = 16;
/// Small under test, so that the tests' small indexes reach every allocation path.
const ARENA_SLACK_MIN: usize = if cfg!(test) { 2 } else { 1024 };
/// Words of the free-slot bitset (64 slots each) one search for a free run reads at most.
const RUN_SCAN_WORDS: usize = 1024;
/// The searches of one store read at most [`RUN_SCAN_WORDS`] plus this many words per stored
/// block (an O(1) bound per block); past that, the store's nodes take any free slot.
const RUN_SCAN_WORDS_PER_BLOCK: usize = 8;

/// Keys here are hashes chosen by the fleet, so the table hasher is keyed by a caller-supplied
/// seed (a folded 64×64→128 multiply, much cheaper than SipHash on these hot maps).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SeededBuild(u64);

pub(crate) struct FoldHasher(u64);

const FOLD_MUL: u64 = 0x9E37_79B9_7F4A_7C15;

fn fold(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ ((p >> 64) as u64)
}

impl BuildHasher for SeededBuild {
    type Hasher = FoldHasher;
    fn build_hasher(&self) -> FoldHasher {
        FoldHasher(self.0)
    }
}

impl Hasher for FoldHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }
    #[inline]
    fn write_u64(&mut self, x: u64) {
        self.0 = fold(self.0 ^ x, FOLD_MUL);
    }
    #[inline]
    fn write_u32(&mut self, x: u32) {
        self.write_u64(u64::from(x));
    }
    #[inline]
    fn finish(&self) -> u64 {
        // One seeded fold per word already spreads every input bit over both halves.
        self.0
    }
}

type FastMap<K, V> = HashMap<K, V, SeededBuild>;

/// A node's walk fields, in a column of their own ([`Tree::links`], same index as the node):
/// a walk down a run (see [`Runs`]) reads only this column, and where a run ends the next
/// node's index is in the same stream.
#[derive(Clone, Copy, Debug)]
struct Link {
    tokens_hash: LocalBlockHash,
    parent: NodeIdx,
    /// The most recently created child still alive, or `ROOT` (none): most nodes form chains,
    /// so a walk usually finds its next node here without hashing.
    hint: NodeIdx,
}

/// Whether both owner sets hold the same slots in the same form: equal bitsets, or sorted
/// lists with the same slots (refcounts aside). The condition of a run, see [`Runs`]; a bitset
/// and a list never count as equal (only a missed run, never a wrong one). O(owners), which
/// an owner change on a list already costs.
#[inline]
fn same_owners(a: &Owners, b: &Owners) -> bool {
    match (a, b) {
        (Owners::Mask(a), Owners::Mask(b)) => a == b,
        (Owners::Many(a), Owners::Many(b)) => same_slots(a, b),
        _ => false,
    }
}

/// [`same_owners`] for two lists; out of line, so that the bitset case stays a compare.
#[inline(never)]
fn same_slots(a: &[Owner], b: &[Owner]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.slot == y.slot)
}

/// The rest of a node (its [`Link`] is in [`Tree::links`] at the same index).
#[derive(Debug)]
struct Node {
    children: u32,
    /// Whether this node's children are registered in the edge table. A node with at most one
    /// child keeps it in `hint` only (chains, the common case, then cost no edge-table insert
    /// or remove); the second child moves both into the table until the node is childless.
    /// The root is always in edge mode.
    edge_mode: bool,
    /// Sorted by slot, so `find_matches` intersects by merging.
    owners: Owners,
}

#[derive(Debug)]
struct Tree {
    nodes: Vec<Node>,
    /// Each node's [`Link`], 16 bytes: walking a run compares the request with this column
    /// alone.
    links: Vec<Link>,
    runs: Runs,
    free: FreeSet,
    live: usize,
    edges: FastMap<(NodeIdx, LocalBlockHash), NodeIdx>,
    /// What the store being applied may still read of the free set (see
    /// [`RUN_SCAN_WORDS_PER_BLOCK`]).
    scan_left: usize,
}

impl Tree {
    fn new(build: SeededBuild) -> Self {
        Self {
            nodes: vec![Node {
                children: 0,
                edge_mode: true,
                owners: Owners::default(),
            }],
            links: vec![Link {
                tokens_hash: LocalBlockHash(0),
                parent: ROOT,
                hint: ROOT,
            }],
            runs: Runs::default(),
            free: FreeSet::default(),
            live: 0,
            edges: HashMap::with_hasher(build),
            scan_left: 0,
        }
    }

    #[inline]
    fn child(&self, parent: NodeIdx, hash: LocalBlockHash) -> Option<NodeIdx> {
        // (parent, hash) names at most one live child, and a freed node's parent is `FREED`,
        // so a live node that says so is the answer. A stored chain usually sits at ascending
        // arena indices: trying the next index first makes a walk down a chain a stream of
        // addresses the CPU computes (and loads) ahead, instead of a chase through `hint`.
        let next = parent.wrapping_add(1);
        if let Some(l) = self.links.get(next as usize)
            && l.parent == parent
            && l.tokens_hash == hash
        {
            return Some(next);
        }
        // The hint is always a live child of `parent`.
        let hint = self.links[parent as usize].hint;
        if hint != ROOT && self.links[hint as usize].tokens_hash == hash {
            return Some(hint);
        }
        if !self.nodes[parent as usize].edge_mode {
            // Its only child (if any) is the hint.
            return None;
        }
        self.edges.get(&(parent, hash)).copied()
    }

    /// How long the arena may grow while free slots remain: the live nodes plus
    /// 1/[`ARENA_SLACK_DIV`] of them plus [`ARENA_SLACK_MIN`], never past `max_arena` (the
    /// ceiling on nodes plus the root).
    fn arena_room(&self, max_arena: usize) -> usize {
        (self.live + self.live / ARENA_SLACK_DIV + ARENA_SLACK_MIN).min(max_arena)
    }

    /// A child of `parent` owned by `owner`; `remaining` is how many blocks the store being
    /// applied still has (this one included), `max_arena` the arena's ceiling. The node is born
    /// owned, so its run bits are computed once, with its final owners.
    fn create(
        &mut self,
        parent: NodeIdx,
        hash: LocalBlockHash,
        owner: Slot,
        remaining: usize,
        max_arena: usize,
    ) -> NodeIdx {
        let mut owners = Owners::default();
        owners.add(owner);
        let node = Node {
            children: 0,
            edge_mode: false,
            owners,
        };
        let link = Link {
            tokens_hash: hash,
            parent,
            hint: ROOT,
        };
        // Where the node lands decides how fast walks are (see `FreeSet`): right after the
        // parent when that slot is free (or is the arena's end, while the arena may grow);
        // else at the start of a free run long enough for the rest of the store; else, while
        // the arena may grow, at its end; else at the start of the longest free run seen.
        let after = parent.wrapping_add(1);
        let len = self.nodes.len();
        let room = self.arena_room(max_arena);
        // (The root's next slot is no better than another: a new prompt looks for a run.)
        let reuse = if parent != ROOT && self.free.take_exact(after) {
            Some(after)
        } else if after as usize == len && len < room {
            None
        } else {
            let mut budget = self.scan_left.min(RUN_SCAN_WORDS);
            let before = budget;
            let found = self.free.take_run(remaining, &mut budget);
            self.scan_left -= before - budget;
            match found {
                Ok(slot) => Some(slot),
                Err(_) if len < room => None,
                Err(Some((slot, _))) => {
                    let taken = self.free.take_exact(slot);
                    debug_assert!(taken, "take_run names a free slot");
                    Some(slot)
                }
                // No free run in the scanned words: any free slot, else the arena's end
                // (then every slot is live, so the arena is below the ceiling).
                Err(None) => self.free.take_next(),
            }
        };
        let idx = match reuse {
            Some(idx) => {
                self.nodes[idx as usize] = node;
                self.links[idx as usize] = link;
                idx
            }
            None => {
                if len == self.nodes.capacity() {
                    // Grow by a sixteenth, not by doubling, and never past the ceiling: the
                    // arena's capacity stays within ~6% of its length.
                    let more = (len / 16).max(1024).min(max_arena - len);
                    self.nodes.reserve_exact(more);
                    self.links.reserve_exact(more);
                }
                // The ceiling (≤ 2^20 + 1 slots) keeps this far below u32::MAX.
                let idx = len as NodeIdx;
                self.nodes.push(node);
                self.links.push(link);
                idx
            }
        };
        let p = &self.nodes[parent as usize];
        if p.edge_mode {
            self.edges.insert((parent, hash), idx);
        } else if p.children == 1 {
            // A second child: register both.
            let only = self.links[parent as usize].hint;
            let only_hash = self.links[only as usize].tokens_hash;
            self.edges.insert((parent, only_hash), only);
            self.edges.insert((parent, hash), idx);
            self.nodes[parent as usize].edge_mode = true;
        }
        let p = &mut self.nodes[parent as usize];
        p.children += 1;
        self.links[parent as usize].hint = idx;
        self.live += 1;
        self.update_runs(idx);
        idx
    }

    /// Recomputes the run bits on both sides of `node` (see [`Runs`]).
    #[inline]
    fn update_runs(&mut self, node: NodeIdx) {
        if node > ROOT + 1 {
            self.update_run(node - 1);
        }
        self.update_run(node);
    }

    /// Clears the run bits on both sides of `node`, which is being freed: a freed node is
    /// nobody's child and, being childless, has no child at the next index either.
    #[inline]
    fn clear_runs(&mut self, node: NodeIdx) {
        if node > ROOT + 1 {
            self.runs.set(node - 1, false);
        }
        self.runs.set(node, false);
    }

    #[inline(always)]
    fn update_run(&mut self, i: NodeIdx) {
        let on = self.continues_run(i);
        self.runs.set(i, on);
    }

    /// What run bit `i` must be (see [`Runs`]): node `i + 1` is node `i`'s child with the same
    /// owners. False past the arena.
    #[inline(always)]
    fn continues_run(&self, i: NodeIdx) -> bool {
        i != ROOT
            && self
                .links
                .get(i as usize + 1)
                .is_some_and(|next| next.parent == i)
            && same_owners(
                &self.nodes[i as usize].owners,
                &self.nodes[i as usize + 1].owners,
            )
    }

    /// Loads these nodes (see [`BlockTable::warm`]). Changes nothing.
    fn warm(&self, nodes: &[NodeIdx]) {
        let mut acc = 0u32;
        for node in nodes {
            acc ^= self.nodes[*node as usize].children ^ self.links[*node as usize].parent;
        }
        std::hint::black_box(acc);
    }

    fn has_owner(&self, node: NodeIdx, slot: Slot) -> bool {
        self.nodes[node as usize].owners.contains(slot)
    }

    fn add_owner(&mut self, node: NodeIdx, slot: Slot) {
        self.nodes[node as usize].owners.add(slot);
        self.update_runs(node);
    }

    fn remove_owner(&mut self, node: NodeIdx, slot: Slot) {
        let n = &mut self.nodes[node as usize];
        n.owners.remove(slot);
        if n.children == 0 && n.owners.is_empty() {
            // Freed: `prune` clears its run bits.
            self.prune(node);
        } else {
            self.update_runs(node);
        }
    }

    /// Frees `node` and then its ancestors while they have neither owners nor children.
    fn prune(&mut self, mut node: NodeIdx) {
        while node != ROOT {
            let n = &self.nodes[node as usize];
            if n.children > 0 || !n.owners.is_empty() {
                return;
            }
            let Link {
                tokens_hash: hash,
                parent,
                ..
            } = self.links[node as usize];
            if self.nodes[parent as usize].edge_mode {
                self.edges.remove(&(parent, hash));
            }
            if self.links[parent as usize].hint == node {
                self.links[parent as usize].hint = ROOT;
            }
            let p = &mut self.nodes[parent as usize];
            p.children -= 1;
            if p.children == 0 && parent != ROOT {
                p.edge_mode = false;
            }
            self.links[node as usize].parent = FREED;
            self.clear_runs(node);
            self.free.insert(node);
            self.live -= 1;
            node = parent;
        }
    }

    fn path(&self, mut node: NodeIdx) -> Vec<LocalBlockHash> {
        let mut out = Vec::new();
        while node != ROOT {
            let link = self.links[node as usize];
            out.push(link.tokens_hash);
            node = link.parent;
        }
        out.reverse();
        out
    }

    fn depth(&self, mut node: NodeIdx) -> usize {
        let mut d = 0;
        while node != ROOT {
            node = self.links[node as usize].parent;
            d += 1;
        }
        d
    }
}

#[derive(Debug)]
struct RankState {
    worker: InstanceId,
    dp_rank: DpRank,
    blocks: BlockTable,
}

/// The device-tier KV index of one router. `Send`, single-writer; owned by the KV actor.
#[derive(Debug)]
pub struct KvIndex {
    limits: KvIndexLimits,
    build: SeededBuild,
    tree: Tree,
    ranks: Vec<Option<RankState>>,
    free_slots: Vec<Slot>,
    slot_of: FastMap<(InstanceId, DpRank), Slot>,
    live: BTreeMap<InstanceId, BTreeSet<DpRank>>,
    ownerships: usize,
    /// Cursors for [`Self::apply`] (one implicit stream).
    own_cursors: CursorTable,
    /// Reused by removals (no allocation per event once warm).
    scratch: Vec<NodeIdx>,
}

/// Blocks whose slots are loaded ahead of use at a time: enough misses in flight to fill the
/// memory pipeline, few enough that the first are still cached when used.
const WARM_CHUNK: usize = 64;

/// How many leading `links` carry the `tokens_hash` of `hashes` at the same position. Eight at
/// a time without an early exit inside a chunk (branch-free, so the compiler can compare them
/// in vector registers), then one at a time in the chunk that differs and after the last chunk.
#[inline]
fn matching_prefix(links: &[Link], hashes: &[LocalBlockHash]) -> usize {
    const CHUNK: usize = 8;
    let mut matched = 0;
    for (have, want) in links.chunks_exact(CHUNK).zip(hashes.chunks_exact(CHUNK)) {
        let differ = have
            .iter()
            .zip(want)
            .fold(false, |d, (l, w)| d | (l.tokens_hash != *w));
        if differ {
            break;
        }
        matched += CHUNK;
    }
    matched
        + links[matched..]
            .iter()
            .zip(&hashes[matched..])
            .take_while(|(have, want)| have.tokens_hash == **want)
            .count()
}

/// Why a store stopped early.
enum Refusal {
    OverCapacity,
}

impl KvIndex {
    /// An index with the compiled-in ceilings. `hash_seed` keys the internal hash tables; pass a
    /// random value in production so fleet-chosen hashes cannot aim at collisions.
    pub fn new(hash_seed: u64) -> Self {
        Self::with_limits(KvIndexLimits::default(), hash_seed)
    }

    pub fn with_limits(limits: KvIndexLimits, hash_seed: u64) -> Self {
        let build = SeededBuild(hash_seed);
        Self {
            limits: limits.clamped(),
            build,
            tree: Tree::new(build),
            ranks: Vec::new(),
            free_slots: Vec::new(),
            slot_of: HashMap::with_hasher(build),
            live: BTreeMap::new(),
            ownerships: 0,
            own_cursors: CursorTable::new(),
            scratch: Vec::new(),
        }
    }

    pub fn limits(&self) -> KvIndexLimits {
        self.limits
    }

    /// Replaces the live identity gate: events are admitted only for these workers and the
    /// dp_ranks their cards declare. Ranks no longer declared lose their blocks and cursors.
    /// Returns how many ranks were dropped.
    pub fn set_live_and_retain(&mut self, live: BTreeMap<InstanceId, BTreeSet<DpRank>>) -> usize {
        let departed: Vec<(InstanceId, DpRank)> = self
            .slot_of
            .keys()
            .filter(|(w, r)| !live.get(w).is_some_and(|ranks| ranks.contains(r)))
            .copied()
            .collect();
        self.live = live;
        for key in &departed {
            self.drop_rank(*key);
        }
        departed.len()
    }

    /// [`Self::set_live_and_retain`] for some workers only: each gets the rank set given (an
    /// empty set: no longer live), the others keep theirs. Ranks no longer declared lose their
    /// blocks and cursors; they are returned. O(workers given), not O(fleet).
    pub fn patch_live(
        &mut self,
        workers: BTreeMap<InstanceId, BTreeSet<DpRank>>,
    ) -> Vec<(InstanceId, DpRank)> {
        let mut departed = Vec::new();
        for (worker, ranks) in workers {
            let before = if ranks.is_empty() {
                self.live.remove(&worker)
            } else {
                self.live.insert(worker, ranks.clone())
            };
            departed.extend(
                before
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|r| !ranks.contains(r))
                    .map(|r| (worker, r)),
            );
        }
        for key in &departed {
            self.drop_rank(*key);
        }
        departed
    }

    /// Drops the blocks and cursors of these ranks (a subscription disconnected or pending too
    /// long; the caller decides when). Returns the number of engine blocks dropped.
    pub fn clear_ranks(&mut self, ranks: &[(InstanceId, DpRank)]) -> usize {
        ranks.iter().map(|key| self.drop_rank(*key)).sum()
    }

    /// [`Self::clear_ranks`] for every rank of one worker.
    pub fn clear_worker(&mut self, worker: InstanceId) -> usize {
        let keys: Vec<_> = self
            .slot_of
            .keys()
            .filter(|(w, _)| *w == worker)
            .copied()
            .collect();
        self.clear_ranks(&keys)
    }

    /// Applies a decoded batch in order and counts each event's result.
    pub fn apply_batch(&mut self, events: &[RouterEvent]) -> KvEventCounts {
        let mut counts = KvEventCounts::default();
        for event in events {
            counts.add(self.apply(event));
        }
        counts
    }

    /// Applies one RouterEvent: identity gate, then the rank's cursor, then tier and domain,
    /// then the operation.
    ///
    /// The cursors used are the index's own table, for a single event stream (tests, benches,
    /// replays of a dump); subscriptions pass their own table to [`Self::apply_from`].
    pub fn apply(&mut self, event: &RouterEvent) -> KvEventResult {
        let mut cursors = std::mem::take(&mut self.own_cursors);
        let result = self.apply_from(&mut cursors, event);
        self.own_cursors = cursors;
        result
    }

    /// [`Self::apply`] with one subscription's cursor table: at or below the rank's cursor is a
    /// replay, a forward jump clears the rank (`gap`) before applying, a new rank past the
    /// table's bound is refused (`over_capacity`).
    pub fn apply_from(&mut self, cursors: &mut CursorTable, event: &RouterEvent) -> KvEventResult {
        let key = (event.worker_id, event.event.dp_rank);
        if !self.is_live(key.0, key.1) {
            return KvEventResult::IdentityMismatch;
        }
        let gap = match cursors.admit(key.0, key.1, event.event.event_id) {
            Admission::Replay => return KvEventResult::Replay,
            Admission::OverCapacity => return KvEventResult::OverCapacity,
            Admission::First | Admission::InOrder => false,
            Admission::Gap { .. } => true,
        };
        let slot = self.slot_for(key);
        if gap {
            self.clear_slot(slot);
        }
        let result = match event.residency_domain {
            Some(ResidencyDomain::Unknown) => KvEventResult::Malformed,
            Some(ResidencyDomain::CacheOwner) => KvEventResult::CacheOwner,
            None | Some(ResidencyDomain::Worker) if event.storage_tier != StorageTier::Device => {
                KvEventResult::OtherTier
            }
            None | Some(ResidencyDomain::Worker) => match &event.event.data {
                KvCacheEventData::Stored(store) => {
                    self.store(slot, store.parent_hash, &store.blocks)
                }
                KvCacheEventData::Removed(remove) => {
                    self.remove_blocks(slot, &remove.block_hashes);
                    KvEventResult::Applied
                }
                KvCacheEventData::Cleared => {
                    self.clear_slot(slot);
                    KvEventResult::Applied
                }
            },
        };
        if gap { KvEventResult::Gap } else { result }
    }

    /// Whether the identity gate admits this rank.
    pub fn is_live(&self, worker: InstanceId, dp_rank: DpRank) -> bool {
        self.live
            .get(&worker)
            .is_some_and(|ranks| ranks.contains(&dp_rank))
    }

    /// Per rank, the number of leading `hashes` it holds contiguously from the root. Ranks with
    /// no overlap are omitted; the result is sorted by (worker, dp_rank).
    pub fn find_matches(&self, hashes: &[LocalBlockHash]) -> Vec<RankOverlap> {
        let mut scores: Vec<(Slot, u32)> = Vec::new();
        // The ranks still matching: a bitset while every node on the walk so far had bitset
        // owners (one `&` per step), else a sorted list merged with each node's owners.
        let mut mask = 0u64;
        let mut list_mode = false;
        let mut active: Vec<Slot> = Vec::new();
        let mut next: Vec<Slot> = Vec::new();
        let mut node = ROOT;
        let mut depth = 0u32;
        let mut i = 0;
        let mut lookahead = 0u64;
        while let Some(hash) = hashes.get(i) {
            let Some(child) = self.tree.child(node, *hash) else {
                break;
            };
            let owners = &self.tree.nodes[child as usize].owners;
            match owners {
                Owners::Mask(m) if !list_mode => {
                    if i == 0 {
                        mask = *m;
                    } else {
                        // Leavers score `depth`.
                        scores.extend(mask_slots(mask & !m).map(|s| (s, depth)));
                        mask &= m;
                    }
                }
                _ if i == 0 => {
                    list_mode = true;
                    active.extend(owners.iter().map(|o| o.slot));
                }
                _ => {
                    if !list_mode {
                        list_mode = true;
                        active.extend(mask_slots(mask));
                    }
                    if owners.len() == active.len()
                        && owners.iter().zip(&active).all(|(o, s)| o.slot == *s)
                    {
                        // The same ranks hold this block too: nobody leaves (the common case
                        // on a shared prefix, so it skips the merge).
                    } else {
                        // Merge the sorted active set with the sorted owners; leavers score
                        // `depth`.
                        next.clear();
                        let mut o = owners.iter().peekable();
                        for slot in &active {
                            while o.next_if(|x| x.slot < *slot).is_some() {}
                            if o.next_if(|x| x.slot == *slot).is_some() {
                                next.push(*slot);
                            } else {
                                scores.push((*slot, depth));
                            }
                        }
                        std::mem::swap(&mut active, &mut next);
                    }
                }
            }
            if (list_mode && active.is_empty()) || (!list_mode && mask == 0) {
                break;
            }
            depth += 1;
            node = child;
            // Down a run (consecutive arena indices, each the previous one's child with the
            // same owners, see `Runs`) nobody leaves: the ranks still matching (`mask` or
            // `active`) are ⊆ this node's owners, which every node of the run has. A step
            // only compares hashes, in the `tokens` column.
            loop {
                let rest = hashes.len() - (i + 1);
                let run = self.tree.runs.ones_from(node, rest);
                if run == 0 {
                    break;
                }
                let from = node as usize + 1;
                // Where the run ends the walk usually goes on at that node's hint, at
                // another place in the arena: load it now, so those misses overlap the
                // comparisons below instead of following them.
                let hint = self.tree.links[from + run - 1].hint as usize;
                lookahead ^= self.tree.links[hint].tokens_hash.0
                    ^ u64::from(self.tree.nodes[hint].children)
                    ^ u64::from(self.tree.runs.get(hint as NodeIdx));
                let matched = matching_prefix(
                    &self.tree.links[from..from + run],
                    &hashes[i + 1..i + 1 + run],
                );
                node += matched as NodeIdx;
                depth += matched as u32;
                i += matched;
                if matched < run {
                    break;
                }
            }
            i += 1;
        }
        std::hint::black_box(lookahead);
        if list_mode {
            scores.extend(active.iter().map(|s| (*s, depth)));
        } else {
            scores.extend(mask_slots(mask).map(|s| (s, depth)));
        }
        let mut out: Vec<RankOverlap> = scores
            .into_iter()
            .filter(|(_, blocks)| *blocks > 0)
            .filter_map(|(slot, blocks)| {
                self.ranks[slot as usize].as_ref().map(|r| RankOverlap {
                    worker: r.worker,
                    dp_rank: r.dp_rank,
                    blocks,
                })
            })
            .collect();
        out.sort_unstable();
        out
    }

    /// How many times a walk down `hashes` (as far as the tree holds them) moves to a node that
    /// is not the next arena slot: each is a likely cache miss on `find_matches`' critical path,
    /// where the steps in between stream. For benches and tests of the layout; O(prefix).
    pub fn arena_jumps(&self, hashes: &[LocalBlockHash]) -> usize {
        let mut jumps = 0;
        let mut node = ROOT;
        for hash in hashes {
            let Some(child) = self.tree.child(node, *hash) else {
                break;
            };
            if node != ROOT && child != node + 1 {
                jumps += 1;
            }
            node = child;
        }
        jumps
    }

    pub fn stats(&self) -> KvIndexStats {
        let owner_entries: usize = self
            .tree
            .nodes
            .iter()
            .map(|n| n.owners.heap_entries())
            .sum();
        let rank_entries: usize = self
            .ranks
            .iter()
            .flatten()
            .map(|r| r.blocks.capacity())
            .sum();
        let approx_bytes = self.tree.nodes.capacity() * std::mem::size_of::<Node>()
            + owner_entries * std::mem::size_of::<Owner>()
            + self.tree.edges.capacity()
                * (std::mem::size_of::<((NodeIdx, LocalBlockHash), NodeIdx)>() + 1)
            + rank_entries * BlockTable::SLOT_BYTES
            + self.ranks.capacity() * std::mem::size_of::<Option<RankState>>()
            + self.tree.links.capacity() * std::mem::size_of::<Link>()
            + (self.tree.free.capacity_words() + self.tree.runs.capacity_words()) * 8;
        KvIndexStats {
            nodes: self.tree.live,
            ranks: self.slot_of.len(),
            ownerships: self.ownerships,
            approx_bytes,
        }
    }

    /// Blocks indexed per rank, sorted by (worker, dp_rank); ranks without blocks included.
    /// O(ranks): reads each rank's table length, never walks the tree.
    pub fn rank_blocks(&self) -> Vec<(InstanceId, DpRank, usize)> {
        let mut out: Vec<(InstanceId, DpRank, usize)> = self
            .ranks
            .iter()
            .flatten()
            .map(|r| (r.worker, r.dp_rank, r.blocks.len()))
            .collect();
        out.sort_unstable_by_key(|&(worker, rank, _)| (worker, rank));
        out
    }

    /// The index's content as ownership paths (see [`OwnershipPaths`]); ranks without blocks
    /// are omitted. For tests and debugging: it walks every block.
    pub fn ownership_paths(&self) -> OwnershipPaths {
        let mut out = OwnershipPaths::new();
        for rank in self.ranks.iter().flatten() {
            if rank.blocks.is_empty() {
                continue;
            }
            let paths = rank
                .blocks
                .iter()
                .map(|(hash, node)| (ExternalBlockHash(hash), self.tree.path(node)))
                .collect();
            out.insert((rank.worker, rank.dp_rank), paths);
        }
        out
    }

    /// RouterEvents that rebuild this index's blocks in an index with the same live set (event
    /// ids are fresh per rank, starting at 0; cursors are not part of a dump). A rank that holds
    /// a block without its parent gets its missing ancestors stored under synthetic engine
    /// hashes, which a final `removed` event of that rank takes away again.
    pub fn dump(&self) -> Vec<RouterEvent> {
        let mut out = Vec::new();
        let mut keys: Vec<(InstanceId, DpRank, Slot)> = self
            .slot_of
            .iter()
            .map(|((w, r), s)| (*w, *r, *s))
            .collect();
        keys.sort_unstable();
        for (_, _, slot) in keys {
            if let Some(rank) = &self.ranks[slot as usize] {
                self.dump_rank(rank, &mut out);
            }
        }
        out
    }

    fn dump_rank(&self, rank: &RankState, out: &mut Vec<RouterEvent>) {
        use super::events::{KvCacheEvent, KvCacheRemoveData, KvCacheStoreData};
        if rank.blocks.is_empty() {
            return;
        }
        // Node → the engine hashes naming it, nodes ordered by depth so parents come first.
        let mut by_node: BTreeMap<NodeIdx, Vec<ExternalBlockHash>> = BTreeMap::new();
        for (hash, node) in rank.blocks.iter() {
            by_node
                .entry(node)
                .or_default()
                .push(ExternalBlockHash(hash));
        }
        let mut order: Vec<(usize, NodeIdx)> =
            by_node.keys().map(|n| (self.tree.depth(*n), *n)).collect();
        order.sort_unstable();
        for hashes in by_node.values_mut() {
            hashes.sort_unstable();
        }
        let mut synthetic: BTreeMap<NodeIdx, ExternalBlockHash> = BTreeMap::new();
        let mut next_synthetic = u64::MAX;
        let mut event_id = 0u64;
        let mut push = |data: KvCacheEventData, out: &mut Vec<RouterEvent>| {
            out.push(RouterEvent {
                worker_id: rank.worker,
                storage_tier: StorageTier::Device,
                residency_domain: Some(ResidencyDomain::Worker),
                event: KvCacheEvent {
                    event_id,
                    data,
                    dp_rank: rank.dp_rank,
                },
                session_id: None,
            });
            event_id += 1;
        };
        let block = |hash: ExternalBlockHash, node: NodeIdx| StoredBlock {
            block_hash: hash,
            tokens_hash: self.tree.links[node as usize].tokens_hash,
            mm_extra_info: None,
        };
        for (_, node) in order {
            let parent = self.tree.links[node as usize].parent;
            // The engine hash this rank can name the parent by, synthesising missing ancestors.
            let mut missing = Vec::new();
            let mut anchor = parent;
            let anchor_hash = loop {
                if anchor == ROOT {
                    break None;
                }
                if let Some(hashes) = by_node.get(&anchor) {
                    break Some(hashes[0]);
                }
                if let Some(hash) = synthetic.get(&anchor) {
                    break Some(*hash);
                }
                missing.push(anchor);
                anchor = self.tree.links[anchor as usize].parent;
            };
            let mut parent_hash = anchor_hash;
            if !missing.is_empty() {
                missing.reverse();
                let mut blocks = Vec::with_capacity(missing.len());
                for m in &missing {
                    while rank.blocks.contains_key(next_synthetic) {
                        next_synthetic -= 1;
                    }
                    let hash = ExternalBlockHash(next_synthetic);
                    next_synthetic -= 1;
                    synthetic.insert(*m, hash);
                    blocks.push(block(hash, *m));
                }
                push(
                    KvCacheEventData::Stored(KvCacheStoreData {
                        parent_hash,
                        start_position: None,
                        blocks: blocks.into(),
                    }),
                    out,
                );
                parent_hash = synthetic.get(&parent).copied();
            }
            for hash in &by_node[&node] {
                push(
                    KvCacheEventData::Stored(KvCacheStoreData {
                        parent_hash,
                        start_position: None,
                        blocks: vec![block(*hash, node)].into(),
                    }),
                    out,
                );
            }
        }
        if !synthetic.is_empty() {
            let mut hashes: Vec<ExternalBlockHash> = synthetic.into_values().collect();
            hashes.sort_unstable();
            push(
                KvCacheEventData::Removed(KvCacheRemoveData {
                    block_hashes: hashes.into(),
                }),
                out,
            );
        }
    }

    /// Structural invariants (for tests): edges, child counts, owner refcounts and the
    /// ownership total all agree with the rank maps; no node is both ownerless and childless.
    pub fn check_invariants(&self) -> Result<(), String> {
        let free = self.check_arena()?;
        self.check_nodes(&free)?;
        self.check_ownership(&free)
    }

    /// The free set names distinct slots of the arena, the arena stays under its ceiling, and
    /// every node has its link. Returns the free set.
    fn check_arena(&self) -> Result<BTreeSet<NodeIdx>, String> {
        let free: BTreeSet<NodeIdx> = self.tree.free.iter().collect();
        if free.len() != self.tree.free.len()
            || free
                .last()
                .is_some_and(|f| *f as usize >= self.tree.nodes.len())
        {
            return Err(format!(
                "free set of {} holds {} slots, up to {:?}",
                self.tree.free.len(),
                free.len(),
                free.last()
            ));
        }
        if self.tree.nodes.len() > self.limits.max_index_blocks + 1 {
            return Err(format!(
                "arena of {} slots past the ceiling of {} nodes",
                self.tree.nodes.len(),
                self.limits.max_index_blocks
            ));
        }
        if self.tree.links.len() != self.tree.nodes.len() {
            return Err(format!(
                "{} links for {} nodes",
                self.tree.links.len(),
                self.tree.nodes.len()
            ));
        }
        Ok(free)
    }

    /// Every live node: its parent's edge or hint names it, its hint names a child, it is owned
    /// or a parent, its owners are sorted and bounded; the live and edge counts, the run bits and
    /// the child counts agree.
    fn check_nodes(&self, free: &BTreeSet<NodeIdx>) -> Result<(), String> {
        let mut children = vec![0u32; self.tree.nodes.len()];
        let mut live = 0;
        let mut edged = 0;
        for (i, node) in self.tree.nodes.iter().enumerate().skip(1) {
            let link = self.tree.links[i];
            if free.contains(&(i as NodeIdx)) {
                if link.parent != FREED {
                    return Err(format!("freed node {i} still names parent {}", link.parent));
                }
                continue;
            }
            if link.parent == FREED {
                return Err(format!("node {i} names no parent but is not free"));
            }
            live += 1;
            children[link.parent as usize] += 1;
            let parent = &self.tree.nodes[link.parent as usize];
            if parent.edge_mode {
                edged += 1;
                if self.tree.edges.get(&(link.parent, link.tokens_hash)) != Some(&(i as NodeIdx)) {
                    return Err(format!("node {i} is missing its edge"));
                }
            } else if self.tree.links[link.parent as usize].hint != i as NodeIdx
                || parent.children != 1
            {
                return Err(format!(
                    "node {i} is neither an edge nor its parent's only child"
                ));
            }
            if link.hint != ROOT
                && (free.contains(&link.hint)
                    || self.tree.links[link.hint as usize].parent != i as NodeIdx)
            {
                return Err(format!(
                    "node {i} hints at {} which is not its child",
                    link.hint
                ));
            }
            if node.children == 0 && node.owners.is_empty() {
                return Err(format!("node {i} is neither owned nor a parent"));
            }
            if node.owners.len() > self.limits.max_owners_per_node {
                return Err(format!("node {i} has {} owners", node.owners.len()));
            }
            let slots: Vec<Slot> = node.owners.iter().map(|o| o.slot).collect();
            if !slots.windows(2).all(|w| w[0] < w[1]) {
                return Err(format!("node {i} owners are not sorted"));
            }
        }
        if live != self.tree.live || self.tree.edges.len() != edged {
            return Err(format!(
                "live {} / counted {live} / edges {} / edged {edged}",
                self.tree.live,
                self.tree.edges.len()
            ));
        }
        for i in 0..self.tree.nodes.len() + 64 {
            let i = i as NodeIdx;
            let want = self.tree.continues_run(i);
            if self.tree.runs.get(i) != want {
                return Err(format!("run bit of node {i} is not {want}"));
            }
        }
        for (i, node) in self.tree.nodes.iter().enumerate() {
            if !free.contains(&(i as NodeIdx)) && node.children != children[i] {
                return Err(format!("node {i} child count {}", node.children));
            }
        }
        Ok(())
    }

    /// The ranks' block tables and the nodes' owner entries hold the same references, and the
    /// ownership total counts them.
    fn check_ownership(&self, free: &BTreeSet<NodeIdx>) -> Result<(), String> {
        let mut refs: BTreeMap<(NodeIdx, Slot), u32> = BTreeMap::new();
        let mut total = 0;
        for (slot, rank) in self.ranks.iter().enumerate() {
            let Some(rank) = rank else { continue };
            if self.slot_of.get(&(rank.worker, rank.dp_rank)) != Some(&(slot as Slot)) {
                return Err(format!("slot {slot} is not registered"));
            }
            total += rank.blocks.len();
            for node in rank.blocks.values() {
                if free.contains(&node) || node == ROOT {
                    return Err(format!("slot {slot} maps to dead node {node}"));
                }
                *refs.entry((node, slot as Slot)).or_default() += 1;
            }
        }
        if total != self.ownerships {
            return Err(format!("ownerships {} != {total}", self.ownerships));
        }
        let mut seen = 0;
        for (i, node) in self.tree.nodes.iter().enumerate() {
            if free.contains(&(i as NodeIdx)) {
                continue;
            }
            for owner in node.owners.iter() {
                seen += 1;
                if refs.get(&(i as NodeIdx, owner.slot)) != Some(&owner.refs) {
                    return Err(format!("node {i} slot {} refs {}", owner.slot, owner.refs));
                }
            }
        }
        if seen != refs.len() {
            return Err(format!("owner entries {seen} != {}", refs.len()));
        }
        Ok(())
    }

    fn rank_mut(&mut self, slot: Slot) -> &mut RankState {
        self.ranks[slot as usize]
            .as_mut()
            .expect("slot_of only names occupied slots")
    }

    fn slot_for(&mut self, key: (InstanceId, DpRank)) -> Slot {
        if let Some(slot) = self.slot_of.get(&key) {
            return *slot;
        }
        let state = RankState {
            worker: key.0,
            dp_rank: key.1,
            blocks: BlockTable::new(self.build.0),
        };
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.ranks[slot as usize] = Some(state);
                slot
            }
            None => {
                // Ranks are bounded by the live set the registry declares.
                self.ranks.push(Some(state));
                (self.ranks.len() - 1) as Slot
            }
        };
        self.slot_of.insert(key, slot);
        slot
    }

    fn drop_rank(&mut self, key: (InstanceId, DpRank)) -> usize {
        self.own_cursors.forget(key.0, key.1);
        let Some(slot) = self.slot_of.remove(&key) else {
            return 0;
        };
        let dropped = self.clear_slot(slot);
        self.ranks[slot as usize] = None;
        self.free_slots.push(slot);
        dropped
    }

    fn clear_slot(&mut self, slot: Slot) -> usize {
        let empty = BlockTable::new(self.build.0);
        let blocks = std::mem::replace(&mut self.rank_mut(slot).blocks, empty);
        let dropped = blocks.len();
        self.ownerships -= dropped;
        for node in blocks.values() {
            self.tree.remove_owner(node, slot);
        }
        dropped
    }

    /// Removes the rank's claims in two passes: first every hash from the rank's table, then
    /// every claimed node's ownership. The end state equals removing one block at a time (the
    /// table and the tree are independent and each pass keeps the event's order), while each
    /// pass touches one structure, with its loads issued ahead of use.
    fn remove_blocks(&mut self, slot: Slot, hashes: &[ExternalBlockHash]) {
        let Self {
            tree,
            ranks,
            ownerships,
            scratch,
            ..
        } = self;
        let rank = ranks[slot as usize]
            .as_mut()
            .expect("slot_of only names occupied slots");
        scratch.clear();
        for chunk in hashes.chunks(WARM_CHUNK) {
            rank.blocks.warm(chunk.iter().map(|h| h.0));
            scratch.extend(chunk.iter().filter_map(|h| rank.blocks.remove(h.0)));
        }
        *ownerships -= scratch.len();
        for chunk in scratch.chunks(WARM_CHUNK) {
            tree.warm(chunk);
            for node in chunk {
                tree.remove_owner(*node, slot);
            }
        }
    }

    fn store(
        &mut self,
        slot: Slot,
        parent_hash: Option<ExternalBlockHash>,
        blocks: &[StoredBlock],
    ) -> KvEventResult {
        if parent_hash.is_some_and(|p| blocks.iter().any(|b| b.block_hash == p)) {
            return KvEventResult::Malformed;
        }
        self.tree.scan_left = RUN_SCAN_WORDS + RUN_SCAN_WORDS_PER_BLOCK * blocks.len();
        let rank = self.rank_mut(slot);
        let mut parent = match parent_hash {
            None => ROOT,
            Some(hash) => match rank.blocks.get(hash.0) {
                Some(node) => node,
                None => return KvEventResult::Orphan,
            },
        };
        // Most stored blocks are new to the rank: load their table slots up front so the
        // misses overlap (a long store warms chunk by chunk, so the early slots stay cached).
        rank.blocks
            .warm(blocks.iter().take(WARM_CHUNK).map(|b| b.block_hash.0));
        // Whether `parent` was created by this store's previous block: then it has no child
        // yet, and the block's node is new too (most of a store extends a chain this way).
        let mut fresh = false;
        for (i, block) in blocks.iter().enumerate() {
            if i % WARM_CHUNK == 0 && i > 0 {
                self.rank_mut(slot)
                    .blocks
                    .warm(blocks[i..].iter().take(WARM_CHUNK).map(|b| b.block_hash.0));
            }
            match self.attach(slot, parent, fresh, block, blocks.len() - i) {
                Ok((node, created)) => {
                    parent = node;
                    fresh = created;
                }
                Err(Refusal::OverCapacity) => return KvEventResult::OverCapacity,
            }
        }
        KvEventResult::Applied
    }

    /// Attaches one stored block under `parent`; returns its node and whether the node was
    /// created. `fresh_parent`: `parent` was created by the previous block of this store, so
    /// it has no child and the tree need not be asked for one.
    fn attach(
        &mut self,
        slot: Slot,
        parent: NodeIdx,
        fresh_parent: bool,
        block: &StoredBlock,
        remaining: usize,
    ) -> Result<(NodeIdx, bool), Refusal> {
        let Self {
            tree,
            ranks,
            limits,
            ownerships,
            ..
        } = self;
        let rank = ranks[slot as usize]
            .as_mut()
            .expect("slot_of only names occupied slots");
        let child = if fresh_parent {
            debug_assert_eq!(tree.nodes[parent as usize].children, 0);
            None
        } else {
            tree.child(parent, block.tokens_hash)
        };
        let rank_blocks = rank.blocks.len();
        // One probe serves the check and the insert (it makes room first, so the slot stays
        // valid).
        let probe = rank.blocks.probe(block.block_hash.0);
        let existing = probe.ok().map(|at| rank.blocks.node_at(at));
        if existing.is_some() && existing == child {
            // Idempotent re-store of a block the rank already holds here.
            return Ok((child.unwrap_or(ROOT), false));
        }
        if existing.is_none()
            && (rank_blocks >= limits.max_blocks_per_rank
                || *ownerships >= limits.max_index_ownerships)
        {
            return Err(Refusal::OverCapacity);
        }
        let (node, created) = match child {
            Some(node) => {
                if !tree.has_owner(node, slot)
                    && tree.nodes[node as usize].owners.len() >= limits.max_owners_per_node
                {
                    return Err(Refusal::OverCapacity);
                }
                tree.add_owner(node, slot);
                (node, false)
            }
            None => {
                if tree.live >= limits.max_index_blocks {
                    return Err(Refusal::OverCapacity);
                }
                let node = tree.create(
                    parent,
                    block.tokens_hash,
                    slot,
                    remaining,
                    limits.max_index_blocks + 1,
                );
                (node, true)
            }
        };
        match probe {
            Ok(at) => {
                // The engine reused a hash for another block: move this rank's claim.
                let old = rank.blocks.set(at, node);
                tree.remove_owner(old, slot);
            }
            Err(at) => {
                rank.blocks.fill(at, block.block_hash.0, node);
                *ownerships += 1;
            }
        }
        Ok((node, created))
    }
}

#[cfg(test)]
mod tests;
