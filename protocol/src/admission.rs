//! Admission when the fleet is busy: the busy rule over load samples, and the bounded per-model
//! wait queue's state.
//!
//! **Busy.** A rank is busy when one of the configured thresholds is reached
//! ([`BusyThreshold`]): its decode backlog (`active_decode_blocks`, else `kv_used_blocks`, plus the
//! blocks of dispatches the worker has not answered with a sample yet) over its card's
//! `total_kv_blocks` at or above `kv_usage`, or its `active_prefill_tokens` (plus unanswered
//! prefill tokens) at or above `prefill_tokens`. Only a fresh sample can make a rank busy: a rank
//! without one (never published, aged out, or idle and silent) has room, so a lost publisher
//! never holds requests back. A model is busy ([`Fleet::Busy`]) when it has decode-capable ranks
//! (decode or aggregated) in the eligible namespaces and every one of them is busy.
//!
//! **Queue.** [`WaitQueue`] is one model's queue, bounded by `max_depth`: priority classes with
//! aging, deficit round robin between keys inside a class ([`queue`]). [`step`] is the rule for an
//! arriving request: it goes at once only when nobody waits and the model is not busy; otherwise
//! it joins the queue, or is shed when the queue is full. A waiting request goes when it is at the
//! head ([`WaitQueue::head`]) and the model has room, and is shed when it has waited `max_wait`.
//! Nothing here reads a clock: `now` is an argument.

pub mod queue;
#[cfg(test)]
mod tests;

use std::time::Duration;

pub use queue::{CLASSES, DEFAULT_QUANTUM, Order, Ticket, WaitQueue, Waiting};

use crate::ids::Namespace;
use crate::load_store::LoadStore;
use crate::picker::candidates::sample_state;
use crate::picker::ledger::DispatchLedger;
use crate::picker::{Candidate, CandidateRole, SampleState};
use crate::time::Tick;

/// The documented error code of a request refused because the fleet is busy (503).
pub const FLEET_BUSY_CODE: &str = "fleet_busy";

/// When a rank counts as busy; an unset threshold never binds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BusyThreshold {
    /// Fraction of the rank's `total_kv_blocks` held by its decode backlog (0 < x ≤ 1).
    pub kv_usage: Option<f64>,
    /// Prefill backlog in tokens.
    pub prefill_tokens: Option<u64>,
}

impl BusyThreshold {
    /// Whether any threshold is set (admission applies at all).
    pub fn is_set(&self) -> bool {
        self.kv_usage.is_some() || self.prefill_tokens.is_some()
    }
}

/// One rank's load as admission reads it: a fresh sample's backlog plus the ledger's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankLoad {
    /// `None`: no fresh sample (the rank has room).
    pub decode_blocks: Option<u64>,
    pub prefill_tokens: Option<u64>,
    pub total_kv_blocks: Option<u64>,
}

impl RankLoad {
    /// Whether a threshold is reached.
    pub fn is_busy(&self, threshold: &BusyThreshold) -> bool {
        let kv = match (threshold.kv_usage, self.decode_blocks, self.total_kv_blocks) {
            (Some(limit), Some(used), Some(total)) if total > 0 => {
                // used / total >= limit, without dividing.
                used as f64 >= limit * total as f64
            }
            _ => false,
        };
        let prefill = match (threshold.prefill_tokens, self.prefill_tokens) {
            (Some(limit), Some(tokens)) => tokens >= limit,
            _ => false,
        };
        kv || prefill
    }
}

/// Whether a model can take a request now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fleet {
    /// A decode-capable rank has room (or no threshold is set).
    Room,
    /// Every decode-capable rank is busy.
    Busy,
    /// No decode-capable rank in the eligible namespaces: admission does not apply.
    Unknown,
}

/// The load of `candidate` at `now`: its fresh sample (if any) plus its unanswered dispatches.
pub fn rank_load(
    candidate: &Candidate,
    store: &LoadStore,
    ledger: &DispatchLedger,
    now: Tick,
    max_age: Duration,
) -> RankLoad {
    let rank = candidate.rank();
    let sample = store.latest(candidate.worker.instance_id, rank);
    let SampleState::Fresh {
        active_decode_blocks,
        active_prefill_tokens,
        kv_used_blocks,
    } = sample_state(sample, now, max_age)
    else {
        return RankLoad {
            total_kv_blocks: candidate.total_kv_blocks,
            ..RankLoad::default()
        };
    };
    let pending = ledger.backlog(&candidate.worker, rank, now);
    let decode = active_decode_blocks.or(kv_used_blocks).unwrap_or(0);
    let prefill = active_prefill_tokens.unwrap_or(0);
    RankLoad {
        decode_blocks: Some(decode.saturating_add(pending.decode_blocks)),
        prefill_tokens: Some(prefill.saturating_add(pending.prefill_tokens)),
        total_kv_blocks: candidate.total_kv_blocks,
    }
}

/// Whether the model of `candidates` can take a request: [`Fleet::Busy`] when every
/// decode-capable rank in `eligible` namespaces is busy (see the module doc).
pub fn fleet(
    threshold: &BusyThreshold,
    candidates: &[Candidate],
    eligible: &[Namespace],
    mut load: impl FnMut(&Candidate) -> RankLoad,
) -> Fleet {
    if !threshold.is_set() {
        return Fleet::Room;
    }
    let mut seen = false;
    for candidate in candidates {
        if candidate.role == CandidateRole::Prefill
            || !eligible.contains(&candidate.worker.namespace)
        {
            continue;
        }
        seen = true;
        if !load(candidate).is_busy(threshold) {
            return Fleet::Room;
        }
    }
    if seen { Fleet::Busy } else { Fleet::Unknown }
}

/// Why a request was refused with `fleet_busy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Shed {
    /// The model's queue held `max_depth` requests.
    QueueFull,
    /// The request waited `max_wait`.
    MaxWait,
}

impl Shed {
    /// The `reason` label of `continuum_admission_shed_total`.
    pub const fn as_label(self) -> &'static str {
        match self {
            Shed::QueueFull => "queue_full",
            Shed::MaxWait => "max_wait",
        }
    }
}

/// A refusal: why, for which model, and when to retry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Busy {
    pub reason: Shed,
    /// The Dynamo model name (served by the fleet).
    pub model: String,
    pub retry_after: Duration,
}

impl Busy {
    /// `Retry-After` in whole seconds, at least 1.
    pub fn retry_after_secs(&self) -> u64 {
        let ms = self.retry_after.as_millis();
        u64::try_from(ms.div_ceil(1000)).unwrap_or(u64::MAX).max(1)
    }
}

/// What an arriving request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Dispatch now.
    Go,
    /// Join the queue.
    Wait,
    /// Refuse.
    Shed(Shed),
}

/// The rule for an arriving request: it goes at once only when nobody waits for the model and the
/// model is not busy (a new request never overtakes a waiting one); else it waits while the queue
/// holds fewer than `max_depth`; else it is shed.
pub fn step(fleet: Fleet, waiting: usize, max_depth: usize) -> Step {
    match (fleet, waiting) {
        (Fleet::Room | Fleet::Unknown, 0) => Step::Go,
        _ if waiting < max_depth => Step::Wait,
        _ => Step::Shed(Shed::QueueFull),
    }
}
