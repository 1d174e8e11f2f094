//! Parity tracker tests: mocker-shaped stores (tokens_hash = LocalBlockHash, block_hash =
//! SequenceHash) decide predictions; bounds, expiry, the zero-parity window and model retention.

use super::*;
use crate::kv::ExternalBlockHash;
use crate::kv::hashing::{BlockSize, local_block_hashes, salt_seed, sequence_hashes};

const W: InstanceId = InstanceId(0xabc);
const R: DpRank = DpRank(0);

fn t(secs: u64) -> Tick {
    Tick(Duration::from_secs(secs))
}

/// What a 1.6.1 mocker worker stores for these tokens (wire §10.4).
fn mocker_blocks(local: &[LocalBlockHash]) -> Vec<StoredBlock> {
    local
        .iter()
        .zip(sequence_hashes(local))
        .map(|(l, s)| StoredBlock {
            block_hash: ExternalBlockHash(s.0),
            tokens_hash: *l,
            mm_extra_info: None,
        })
        .collect()
}

fn hashes(tokens: std::ops::Range<u32>, seed: u64) -> Vec<LocalBlockHash> {
    let tokens: Vec<u32> = tokens.collect();
    local_block_hashes(&tokens, BlockSize::new(16).expect("valid"), seed)
}

#[test]
fn predicted_tokens_hashes_stored_by_the_worker_match() {
    let mut p = ParityTracker::new();
    let local = hashes(0..160, salt_seed(None, None));
    // Two blocks were cached already: the prediction is the new part.
    assert!(p.record_prediction("m", W, R, &local[2..], t(0)));
    // An unrelated store on another rank does not decide it.
    assert!(
        p.on_stored(InstanceId(1), R, &mocker_blocks(&local))
            .is_empty()
    );
    // The worker stores the new blocks, split in two events (a batch boundary).
    let stored = mocker_blocks(&local);
    let out = p.on_stored(W, R, &stored[2..5]);
    assert_eq!(out.len(), 1);
    assert!(out[0].matched);
    assert_eq!(&*out[0].model, "m");
    assert_eq!(p.pending(), 0);
    let stats = p.stats("m").expect("tracked");
    assert_eq!((stats.checked, stats.matched), (1, 1));
    assert_eq!(stats.last_100_match_ratio(), Some(1.0));
}

#[test]
fn a_salted_prediction_never_matches_a_mocker_that_ignores_the_salt() {
    let mut p = ParityTracker::new();
    let salted = hashes(0..64, salt_seed(None, Some("tenant-a")));
    let unsalted = hashes(0..64, salt_seed(None, None));
    p.record_prediction("m", W, R, &salted, t(0));
    for i in 0..MISMATCH_AFTER_STORES - 1 {
        assert!(
            p.on_stored(W, R, &mocker_blocks(&unsalted)).is_empty(),
            "{i}"
        );
    }
    let out = p.on_stored(W, R, &mocker_blocks(&unsalted));
    assert_eq!(out.len(), 1);
    assert!(!out[0].matched);
    assert_eq!(p.stats("m").map(|s| s.matched), Some(0));
}

#[test]
fn out_of_order_blocks_are_a_mismatch_not_a_match() {
    let mut p = ParityTracker::new();
    let local = hashes(0..64, 1337);
    p.record_prediction("m", W, R, &local, t(0));
    let mut stored = mocker_blocks(&local);
    stored.swap(1, 2);
    for _ in 0..MISMATCH_AFTER_STORES {
        p.on_stored(W, R, &stored);
    }
    assert_eq!(p.stats("m").map(|s| (s.checked, s.matched)), Some((1, 0)));
}

#[test]
fn expiry_decides_only_when_the_rank_stored_something() {
    let mut p = ParityTracker::new();
    let a = hashes(0..32, 1337);
    let b = hashes(100..132, 1337);
    p.record_prediction("m", W, R, &a, t(0));
    p.record_prediction("m", W, DpRank(1), &a, t(0));
    p.on_stored(W, R, &mocker_blocks(&b));
    assert!(p.expire(t(59)).is_empty());
    let out = p.expire(t(60));
    assert_eq!(out.len(), 1);
    assert!(!out[0].matched);
    assert_eq!(p.drops().expired, 1);
    assert_eq!(p.pending(), 0);
}

#[test]
fn a_window_of_zero_parity_warns_once_and_rearms_after_a_match() {
    let mut p = ParityTracker::new();
    let a = hashes(0..32, 1337);
    let other = mocker_blocks(&hashes(500..532, 1337));
    let mut warnings = 0;
    for i in 0..(RESULT_WINDOW as u64 * 2) {
        p.record_prediction("m", W, R, &a, t(i));
        let out = p.expire(t(i + 60));
        assert!(out.is_empty());
        p.record_prediction("m", W, R, &a, t(i));
        p.on_stored(W, R, &other);
        warnings += p.expire(t(i + 60)).iter().filter(|o| o.zero_parity).count();
    }
    assert_eq!(warnings, 1);
    let stats = p.stats("m").expect("tracked");
    assert_eq!(stats.window, RESULT_WINDOW);
    assert_eq!(stats.last_100_match_ratio(), Some(0.0));
    p.record_prediction("m", W, R, &a, t(1_000));
    assert!(p.on_stored(W, R, &mocker_blocks(&a))[0].matched);
    let stats = p.stats("m").expect("tracked");
    assert_eq!(stats.window_matched, 1);
    assert_eq!(stats.checked, RESULT_WINDOW as u64 * 2 + 1);
}

#[test]
fn pending_predictions_are_bounded_oldest_first() {
    let mut p = ParityTracker::new();
    let a = hashes(0..16, 1337);
    for i in 0..MAX_PENDING_PER_RANK + 3 {
        p.record_prediction("m", W, R, &a, t(i as u64));
    }
    assert_eq!(p.pending(), MAX_PENDING_PER_RANK);
    assert_eq!(p.drops().dropped, 3);
    for w in 0..MAX_PENDING_PREDICTIONS as u64 {
        p.record_prediction("m", InstanceId(w), DpRank(9), &a, t(0));
    }
    assert_eq!(p.pending(), MAX_PENDING_PREDICTIONS);
    // The oldest (rank R's) went first.
    assert!(p.on_stored(W, R, &mocker_blocks(&a)).is_empty());
    let long: Vec<LocalBlockHash> = (0..1000).map(LocalBlockHash).collect();
    p.record_prediction("m", W, DpRank(3), &long, t(1));
    assert!(
        p.pending
            .values()
            .all(|x| x.hashes.len() <= MAX_PREDICTED_BLOCKS)
    );
    assert!(!p.record_prediction("m", W, R, &[], t(1)));
}

#[test]
fn models_are_bounded_and_leave_with_the_fleet() {
    let mut p = ParityTracker::new();
    let a = hashes(0..16, 1337);
    assert!(!p.record_prediction(&"x".repeat(MAX_MODEL_NAME_BYTES + 1), W, R, &a, t(0)));
    for m in 0..MAX_TRACKED_MODELS {
        assert!(p.record_prediction(&format!("m{m}"), W, DpRank(m as u32), &a, t(0)));
    }
    assert!(!p.record_prediction("one-more", W, R, &a, t(0)));
    let gone = p.retain_models(|m| m == "m0");
    assert_eq!(gone.len(), MAX_TRACKED_MODELS - 1);
    assert_eq!(p.pending(), 1);
    assert_eq!(p.all_stats().count(), 1);
    p.retain_ranks(|_, r| r != DpRank(0));
    assert_eq!(p.pending(), 0);
}
