//! One request's Dynamo routing decision as a pure function: everything between "these are the
//! facts" and "pin these ranks on this path". The daemon's `route::dynamo` gathers the inputs
//! (config, replica health, the candidate index, the KV overlaps) and calls [`decide`] once, inside
//! the load-store and picker-state locks; it then only performs the outcome (metrics, the parity
//! prediction, headers).
//!
//! The steps, in order:
//! 1. **Eligible namespaces**: the watched namespaces with a permitted, usable shim replica. None:
//!    [`Skip::NoEligibleNamespace`].
//! 2. **Candidates**: none for the model: [`Skip::NoCandidates`].
//! 3. **Reachability gate**: ranks whose load publisher was lost sit out while a reachable rank
//!    serves the phase ([`reachable_candidates`]); no allocation when nothing is unreachable.
//! 4. **Pick**: the installed picker, with the KV input when KV-aware selection applies (the prompt
//!    size is the rendered length, else the caller's estimate). No pick: [`Skip::NoPick`].
//! 5. **Routing path class**: a conditional-disaggregation bypass is [`PathClass::Unified`] (the
//!    decode worker prefills locally), a prefill pin [`PathClass::Disaggregated`], else
//!    [`PathClass::Aggregated`].
//! 6. **Parity target**: with a prepared prompt, the rank that prefills (the decode rank on a
//!    bypass or without a prefill pin) should soon store the prompt's blocks past the overlap it
//!    already held, at its declared block size.

use std::time::Duration;

use tracing::debug;

use super::candidates::StoreView;
use super::dense::DenseRanks;
use super::reachability::reachable_candidates;
use super::{
    Candidate, DynamoWorkerPicker, KvPickInput, KvPickOutcome, KvSelectionResult, KvUnavailable,
    NoCandidates, Pick, PickContext, PickOutcome, PickRequest, PickerState,
};
use crate::ids::{DpRank, InstanceId, Namespace};
use crate::load_store::LoadStore;
use crate::time::Tick;

/// The facts one decision reads.
pub struct DecisionInput<'a> {
    /// The Dynamo display name (client model id after `shim.model_map`).
    pub model: &'a str,
    /// Every watched namespace, with whether a shim replica the caller may use is healthy and
    /// enabled there.
    pub namespaces: Vec<(Namespace, bool)>,
    /// The model's candidate ranks (snapshot order).
    pub candidates: &'a [Candidate],
    /// `candidates`' dense layout when the caller holds one for this generation; used when the
    /// reachability gate keeps every rank.
    pub layout: Option<&'a DenseRanks>,
    /// The tokenizer-free prompt-size estimate; called only when a pick runs without a rendered
    /// prompt length.
    pub estimate_prompt_tokens: &'a dyn Fn() -> u64,
    /// The discovery source carries load signals.
    pub load_signals: bool,
    /// `None`: KV-aware selection is off. `Some(Err)`: it is on but the prompt could not be
    /// prepared. `Some(Ok)`: the rendered prompt's length and overlaps.
    pub kv: Option<Result<KvPickInput<'a>, KvUnavailable>>,
    pub now: Tick,
    /// `dynamo.load.max_staleness`: how long a load sample counts as fresh.
    pub max_age: Duration,
}

/// How the request travels, the `routing_path` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathClass {
    /// No pins (standard routing, or a conditional-disaggregation bypass: decode prefills locally).
    Unified,
    /// A decode and a prefill pin.
    Disaggregated,
    /// A decode pin only (an aggregated worker, or no prefill pool in the namespace).
    Aggregated,
}

/// Where the request's prompt blocks should soon appear (KV hash parity).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParityTarget {
    pub worker: InstanceId,
    pub dp_rank: DpRank,
    /// The prefilling rank's declared block size.
    pub block_size: u32,
    /// Blocks of the prompt the rank already held at that size (clamp to the prompt's length).
    pub held_blocks: u64,
}

/// A pick to dispatch.
#[derive(Clone, Debug, PartialEq)]
pub struct Routed {
    pub pick: Pick,
    pub path: PathClass,
    /// What KV-aware selection made of the request (`None` when KV is off).
    pub kv: Option<KvSelectionResult>,
    pub parity: Option<ParityTarget>,
}

/// Why the Dynamo path does not apply: the request routes normally.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Skip {
    /// No watched namespace has a usable shim replica the caller may use.
    NoEligibleNamespace,
    /// No worker serves the model.
    NoCandidates,
    /// The picker found nothing to pick among the eligible namespaces.
    NoPick(NoCandidates),
}

/// The decision: route through a shim with these pins, or skip the Dynamo path.
#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    Route(Routed),
    Skip(Skip),
}

/// Decides one request (the steps in the module doc). `state` is the picker's mutable state; the
/// caller has already brought its ledger up to date with `store`.
pub fn decide(
    mut input: DecisionInput<'_>,
    picker: &dyn DynamoWorkerPicker,
    store: &LoadStore,
    state: &mut PickerState,
) -> Decision {
    let eligible: Vec<Namespace> = std::mem::take(&mut input.namespaces)
        .into_iter()
        .filter_map(|(namespace, usable)| usable.then_some(namespace))
        .collect();
    if eligible.is_empty() {
        return Decision::Skip(Skip::NoEligibleNamespace);
    }
    let all = input.candidates;
    if all.is_empty() {
        return Decision::Skip(Skip::NoCandidates);
    }
    let estimated_prompt_tokens = match &input.kv {
        Some(Ok(kv)) => kv.isl,
        _ => (input.estimate_prompt_tokens)(),
    };
    let request = PickRequest {
        model: input.model,
        eligible_namespaces: &eligible,
        estimated_prompt_tokens,
        load_signals: input.load_signals,
    };
    let outcome = gated_pick(&request, all, &input, picker, store, state);
    let bypass = outcome.is_bypass();
    let pick = match outcome.outcome {
        PickOutcome::Picked(pick) => pick,
        PickOutcome::NoCandidates(why) => return Decision::Skip(Skip::NoPick(why)),
    };
    let path = if bypass {
        PathClass::Unified
    } else if pick.prefill.is_some() {
        PathClass::Disaggregated
    } else {
        PathClass::Aggregated
    };
    let parity = match &input.kv {
        Some(Ok(kv)) => parity_target(&pick, bypass, all, kv),
        _ => None,
    };
    Decision::Route(Routed {
        pick,
        path,
        kv: outcome.kv,
        parity,
    })
}

/// Steps 3 and 4: the reachability gate, then the installed picker (with the KV input when
/// KV-aware selection applies).
fn gated_pick(
    request: &PickRequest<'_>,
    all: &[Candidate],
    input: &DecisionInput<'_>,
    picker: &dyn DynamoWorkerPicker,
    store: &LoadStore,
    state: &mut PickerState,
) -> KvPickOutcome {
    let kept = (store.unreachable_count() > 0)
        .then(|| reachable_candidates(all, request, |c| store.is_unreachable(c.worker.instance_id)))
        .flatten();
    if let Some(kept) = &kept {
        debug!(
            model = input.model,
            left_out = all.len() - kept.len(),
            "Unreachable workers sit out this selection."
        );
    }
    let view = StoreView {
        store,
        now: input.now,
        max_age: input.max_age,
    };
    let mut ctx = match (&kept, input.layout) {
        (Some(kept), _) => PickContext::new(request, kept, &view, state, input.now),
        (None, Some(layout)) => {
            PickContext::new(request, all, &view, state, input.now).with_layout(layout)
        }
        (None, None) => PickContext::new(request, all, &view, state, input.now),
    };
    match &input.kv {
        Some(kv) => picker.pick_kv(&mut ctx, kv.as_ref().map_err(|why| *why)),
        None => KvPickOutcome {
            outcome: picker.pick(&mut ctx),
            kv: None,
        },
    }
}

/// The prefilling rank of `pick`, at its declared block size, with the overlap it held.
fn parity_target(
    pick: &Pick,
    bypass: bool,
    candidates: &[Candidate],
    kv: &KvPickInput<'_>,
) -> Option<ParityTarget> {
    let prefiller = match (&pick.prefill, bypass) {
        (Some(prefill), false) => prefill,
        _ => &pick.decode,
    };
    let block_size = candidates
        .iter()
        .find(|c| c.worker == prefiller.worker && c.dp_rank == prefiller.dp_rank)
        .and_then(|c| c.block_size)?;
    let dp_rank = prefiller.dp_rank.unwrap_or_default();
    let worker = prefiller.worker.instance_id;
    let held_blocks = kv
        .overlaps
        .iter()
        .find(|o| o.block_size.get() == block_size)
        .map_or(0, |o| o.of(worker, dp_rank));
    Some(ParityTarget {
        worker,
        dp_rank,
        block_size,
        held_blocks,
    })
}

#[cfg(test)]
mod tests;
