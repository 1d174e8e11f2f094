//! A deterministic stand-in for the KV prompt preparation hook, for tests only: message and prompt
//! text split on whitespace, each word's FNV-1a hash as its token id, hashed per block size with
//! Dynamo's base seed. Never a production code path.
#![allow(dead_code)]

use std::sync::Arc;

use continuum_protocol::ids::{DpRank, InstanceId};
use continuum_protocol::kv::events::{
    Bounded, KvCacheEvent, KvCacheEventData, KvCacheStoreData, RouterEvent, StorageTier,
    StoredBlock,
};
use continuum_protocol::kv::hashing::{KV_HASH_SEED, local_block_hashes};
use continuum_protocol::kv::{ExternalBlockHash, LocalBlockHash, encode_router_events};
use continuum_protocol::picker::KvUnavailable;
use continuum_router::daemon::Daemon;
use continuum_router::kv::{KvPrepRequest, KvPromptPrep, PreparedPrompt};
use futures::future::BoxFuture;
use serde_json::Value;

/// Tokenizes by whitespace; `fail` makes every preparation fail with that reason.
#[derive(Clone, Debug, Default)]
pub struct WhitespacePrep {
    pub fail: Option<KvUnavailable>,
}

/// The token id of one word: 32-bit FNV-1a.
pub fn word_token(word: &str) -> u32 {
    word.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

/// The tokens of a chat or completions body, as [`WhitespacePrep`] renders it.
pub fn tokens_of(body: &Value) -> Vec<u32> {
    let mut texts: Vec<&str> = Vec::new();
    if let Some(messages) = body.get("messages").and_then(Value::as_array) {
        texts.extend(
            messages
                .iter()
                .filter_map(|m| m.get("content").and_then(Value::as_str)),
        );
    }
    if let Some(prompt) = body.get("prompt").and_then(Value::as_str) {
        texts.push(prompt);
    }
    texts
        .iter()
        .flat_map(|t| t.split_whitespace())
        .map(word_token)
        .collect()
}

/// The LocalBlockHashes of `text`'s complete blocks of `block_size` tokens.
pub fn text_hashes(text: &str, block_size: u32) -> Vec<LocalBlockHash> {
    let tokens: Vec<u32> = text.split_whitespace().map(word_token).collect();
    let bs = continuum_protocol::kv::hashing::BlockSize::new(block_size).expect("valid size");
    local_block_hashes(&tokens, bs, KV_HASH_SEED)
}

impl KvPromptPrep for WhitespacePrep {
    fn prepare<'a>(
        &'a self,
        request: KvPrepRequest<'a>,
    ) -> BoxFuture<'a, Result<PreparedPrompt, KvUnavailable>> {
        Box::pin(async move {
            if let Some(failure) = self.fail {
                return Err(failure);
            }
            let tokens = tokens_of(request.body);
            let hashes = request
                .block_sizes
                .iter()
                .map(|bs| (*bs, local_block_hashes(&tokens, *bs, KV_HASH_SEED)))
                .collect();
            Ok(PreparedPrompt {
                isl: tokens.len(),
                tokens: Arc::from(tokens),
                hashes,
            })
        })
    }
}

/// Stores `hashes` as one root-anchored chain on `worker`, after opening the live-worker gate for
/// the current fleet (the subscription follower does the same on its next generation).
pub async fn index_blocks(daemon: &Daemon, worker: u64, hashes: &[LocalBlockHash]) {
    daemon.kv_index().reconcile().await;
    let blocks = hashes
        .iter()
        .enumerate()
        .map(|(i, h)| StoredBlock {
            block_hash: ExternalBlockHash(worker.wrapping_mul(1000) + i as u64),
            tokens_hash: *h,
            mm_extra_info: None,
        })
        .collect();
    let event = RouterEvent {
        worker_id: InstanceId(worker),
        storage_tier: StorageTier::Device,
        residency_domain: None,
        event: KvCacheEvent {
            event_id: 1,
            data: KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: None,
                start_position: None,
                blocks: Bounded(blocks),
            }),
            dp_rank: DpRank(0),
        },
        session_id: None,
    };
    let subscription: std::sync::Arc<str> = std::sync::Arc::from(format!("test-{worker}"));
    daemon
        .kv_index()
        .deliver(&subscription, &encode_router_events(&[event]))
        .await;
    let matches = daemon.kv_index().overlaps(hashes);
    assert_eq!(matches.len(), 1, "the index holds the chain: {matches:?}");
    assert_eq!(matches[0].blocks as usize, hashes.len());
}
