//! Rendezvous (highest-random-weight) placement of streams on broker sessions.
//!
//! `weight(key, client_id)` is the first 8 bytes (big-endian) of
//! `SHA-256(len(key) || key || client_id)`, `len(key)` a big-endian `u64`. Every router replica
//! computes the same order, a joining broker only takes the keys it now wins (about 1/N), and
//! when the winner dies the next-ranked session takes over without moving anything else.

use sha2::{Digest, Sha256};

use super::message::{ClientId, ZmqTcpTarget};
use crate::discovery::EventTopic;

/// The rendezvous key of a ZMQ target: four length-prefixed fields, each a big-endian `u16`
/// length then the bytes: namespace, host, port (decimal ASCII), topic.
pub fn zmq_key(target: &ZmqTcpTarget, topic: EventTopic) -> Vec<u8> {
    let port = target.port.to_string();
    let fields: [&[u8]; 4] = [
        target.namespace.as_str().as_bytes(),
        target.host.as_bytes(),
        port.as_bytes(),
        topic.as_str().as_bytes(),
    ];
    let mut key = Vec::with_capacity(fields.iter().map(|f| f.len() + 2).sum());
    for field in fields {
        // Names are bounded to 253 bytes by decoding; saturate rather than wrap regardless.
        let len = u16::try_from(field.len()).unwrap_or(u16::MAX);
        key.extend_from_slice(&len.to_be_bytes());
        key.extend_from_slice(&field[..usize::from(len)]);
    }
    key
}

/// The 64-bit weight of `client_id` for `key`.
pub fn weight(key: &[u8], client_id: &ClientId) -> u64 {
    let mut hasher = Sha256::new();
    hasher.update((key.len() as u64).to_be_bytes());
    hasher.update(key);
    hasher.update(client_id.as_str().as_bytes());
    let digest = hasher.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

/// Indices of `candidates` from the highest weight down; equal weights (astronomically rare)
/// order by client id so the ranking is total and the same on every replica.
pub fn rank(key: &[u8], candidates: &[&ClientId]) -> Vec<usize> {
    let mut scored: Vec<(u64, &ClientId, usize)> = candidates
        .iter()
        .enumerate()
        .map(|(i, id)| (weight(key, id), *id, i))
        .collect();
    scored.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(b.1)));
    scored.into_iter().map(|(_, _, i)| i).collect()
}

/// The highest-ranked candidate for which `eligible` holds (live, non-draining, covering,
/// below its stream cap).
pub fn pick<T>(
    key: &[u8],
    candidates: &[T],
    client_id: impl Fn(&T) -> &ClientId,
    eligible: impl Fn(&T) -> bool,
) -> Option<usize> {
    candidates
        .iter()
        .enumerate()
        .filter(|(_, c)| eligible(c))
        .map(|(i, c)| (weight(key, client_id(c)), client_id(c), i))
        .max_by(|a, b| a.0.cmp(&b.0).then_with(|| b.1.cmp(a.1)))
        .map(|(_, _, i)| i)
}
