//! Unreachable ranks sit out while a reachable rank can serve the same phase.
//!
//! A SIGKILLed worker stays registered until its lease expires (30 s in Dynamo 1.6.1); its load
//! publisher dies at once, and the load store marks it unreachable (see `load_store`). This filter
//! runs before any picker, so every picker (load-based or KV-aware) inherits the rule, and it
//! never changes which roles a namespace holds (so the Mixed-namespaces rules and prefill/decode
//! pairing stay exactly as without it):
//!
//! 1. A namespace is *healthy* when a reachable rank can serve its decode phase (decode workers
//!    in a namespace with prefill and decode workers, else decode and aggregated workers) and, in a
//!    namespace with prefill and decode workers, a reachable prefill rank exists. When some
//!    eligible namespace is healthy, the others' candidates are left out entirely.
//! 2. Within each kept namespace, a phase's unreachable ranks are left out when the phase has a
//!    reachable rank (decode and aggregated workers share the decode phase unless the aggregated
//!    ones sit out). A phase whose ranks are all unreachable keeps them all: the picker then
//!    rotates among them exactly as it would without marks (nothing better exists).
//!
//! When no candidate is unreachable the filter returns `None` and the caller passes its slice
//! unchanged (no allocation on the request path).

use super::{Candidate, CandidateRole, PickRequest};

#[derive(Clone, Copy, Debug, Default)]
struct RoleCount {
    total: u32,
    reachable: u32,
}

impl RoleCount {
    fn add(&mut self, reachable: bool) {
        self.total += 1;
        self.reachable += u32::from(reachable);
    }

    fn present(self) -> bool {
        self.total > 0
    }

    fn any_reachable(self) -> bool {
        self.reachable > 0
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct NamespaceRoles {
    prefill: RoleCount,
    decode: RoleCount,
    aggregated: RoleCount,
}

impl NamespaceRoles {
    fn role(&mut self, role: CandidateRole) -> &mut RoleCount {
        match role {
            CandidateRole::Prefill => &mut self.prefill,
            CandidateRole::Decode => &mut self.decode,
            CandidateRole::Aggregated => &mut self.aggregated,
        }
    }

    /// Whether a reachable rank serves the same phase as `role` here: decode and aggregated
    /// workers share the decode phase unless the aggregated ones sit out.
    fn phase_reachable(&self, role: CandidateRole) -> bool {
        match role {
            CandidateRole::Prefill => self.prefill.any_reachable(),
            CandidateRole::Decode | CandidateRole::Aggregated if !self.paired() => {
                self.decode.any_reachable() || self.aggregated.any_reachable()
            }
            CandidateRole::Decode => self.decode.any_reachable(),
            CandidateRole::Aggregated => self.aggregated.any_reachable(),
        }
    }

    /// Prefill and decode workers: aggregated ones sit out and every decode needs a prefill.
    fn paired(&self) -> bool {
        self.prefill.present() && self.decode.present()
    }

    fn healthy(&self) -> bool {
        if self.paired() {
            self.decode.any_reachable() && self.prefill.any_reachable()
        } else {
            self.decode.any_reachable() || self.aggregated.any_reachable()
        }
    }
}

/// The candidates without the unreachable ranks the rule leaves out, or `None` when it leaves out
/// nothing. `unreachable` tells whether a candidate's worker is marked. Candidates that do not
/// serve the request's model in an eligible namespace pass through untouched.
pub fn reachable_candidates(
    candidates: &[Candidate],
    req: &PickRequest<'_>,
    unreachable: impl Fn(&Candidate) -> bool,
) -> Option<Vec<Candidate>> {
    let namespaces = req.eligible_namespaces;
    let mut roles = vec![NamespaceRoles::default(); namespaces.len()];
    // Per candidate: its eligible namespace (if it serves the model there) and reachability.
    let mut seen: Vec<(Option<usize>, bool)> = Vec::with_capacity(candidates.len());
    let mut any_unreachable = false;
    for c in candidates {
        let ns = (c.model.as_ref() == req.model)
            .then(|| namespaces.iter().position(|n| *n == c.worker.namespace))
            .flatten();
        let reachable = ns.is_none() || !unreachable(c);
        if let Some(ns) = ns {
            roles[ns].role(c.role).add(reachable);
            any_unreachable |= !reachable;
        }
        seen.push((ns, reachable));
    }
    if !any_unreachable {
        return None;
    }
    let some_healthy = roles.iter().any(NamespaceRoles::healthy);
    let kept: Vec<Candidate> = candidates
        .iter()
        .zip(&seen)
        .filter(|(c, (ns, reachable))| {
            let Some(ns) = *ns else { return true };
            let r = &roles[ns];
            if some_healthy && !r.healthy() {
                return false;
            }
            *reachable || !r.phase_reachable(c.role)
        })
        .map(|(c, _)| c.clone())
        .collect();
    (kept.len() != candidates.len()).then_some(kept)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::sync::Arc;

    use super::*;
    use crate::ids::{InstanceId, Namespace, WorkerKey};

    fn candidate(ns: &str, id: u64, role: CandidateRole) -> Candidate {
        Candidate {
            worker: WorkerKey {
                namespace: Namespace::new(ns),
                instance_id: InstanceId(id),
            },
            role,
            model: Arc::from("m"),
            dp_rank: None,
            rank_declared: false,
            block_size: Some(16),
            total_kv_blocks: Some(1024),
            max_num_batched_tokens: Some(8192),
        }
    }

    use CandidateRole::{Aggregated as A, Decode as D, Prefill as P};

    /// The ids kept (or all of them when the filter returns `None`), for `dead` unreachable.
    fn check(fleet: &[(&str, u64, CandidateRole)], dead: &[u64], expected: &[u64]) {
        let candidates: Vec<Candidate> = fleet
            .iter()
            .map(|(ns, id, role)| candidate(ns, *id, *role))
            .collect();
        let namespaces = [Namespace::new("a"), Namespace::new("b")];
        let req = PickRequest {
            model: "m",
            eligible_namespaces: &namespaces,
            estimated_prompt_tokens: 10,
            load_signals: true,
        };
        let dead: BTreeSet<u64> = dead.iter().copied().collect();
        let out = reachable_candidates(&candidates, &req, |c| {
            dead.contains(&c.worker.instance_id.0)
        });
        let kept: Vec<u64> = out
            .as_deref()
            .unwrap_or(&candidates)
            .iter()
            .map(|c| c.worker.instance_id.0)
            .collect();
        assert_eq!(kept, expected, "fleet {fleet:?}, dead {dead:?}");
        if out.is_some() {
            assert_ne!(
                kept.len(),
                candidates.len(),
                "Some only when something is left out"
            );
        }
    }

    #[test]
    fn nothing_marked_passes_the_slice_through() {
        check(&[("a", 1, P), ("a", 2, D)], &[], &[1, 2]);
    }

    #[test]
    fn an_unreachable_decode_rank_sits_out_beside_a_reachable_one() {
        check(&[("a", 1, P), ("a", 2, D), ("a", 3, D)], &[2], &[1, 3]);
        check(&[("a", 1, P), ("a", 2, P), ("a", 3, D)], &[1], &[2, 3]);
    }

    #[test]
    fn a_role_with_no_reachable_rank_keeps_them_all() {
        // Nothing better exists: the picker rotates as without marks.
        check(
            &[("a", 1, P), ("a", 2, D), ("a", 3, D)],
            &[2, 3],
            &[1, 2, 3],
        );
        check(&[("a", 1, P), ("a", 2, D)], &[1], &[1, 2]);
    }

    #[test]
    fn roles_never_change_so_aggregated_workers_keep_sitting_out() {
        // Beside prefill and decode workers, aggregated ones are not decode candidates: marking
        // every decode worker must not turn the namespace into an aggregated one.
        check(&[("a", 1, P), ("a", 2, D), ("a", 3, A)], &[2], &[1, 2, 3]);
        // A reachable aggregated worker is a decode candidate in an aggregated namespace.
        check(&[("a", 1, D), ("a", 2, A)], &[1], &[2]);
        check(&[("a", 2, A), ("a", 3, A)], &[3], &[2]);
    }

    #[test]
    fn a_namespace_that_cannot_serve_a_phase_gives_way_to_a_healthy_one() {
        let fleet = [("a", 1, P), ("a", 2, D), ("b", 3, P), ("b", 4, D)];
        check(&fleet, &[2], &[3, 4]);
        check(&fleet, &[1], &[3, 4]);
        // Both namespaces impaired: each keeps its roles, only reachable ranks where possible.
        check(&fleet, &[1, 4], &[1, 2, 3, 4]);
        check(
            &[("a", 1, P), ("a", 2, D), ("a", 5, D), ("b", 3, A)],
            &[1, 2],
            &[3],
        );
    }

    #[test]
    fn other_models_and_namespaces_pass_through() {
        let mut candidates = vec![
            candidate("a", 1, D),
            candidate("a", 2, D),
            candidate("z", 3, D),
        ];
        candidates[0].model = Arc::from("other");
        let namespaces = [Namespace::new("a")];
        let req = PickRequest {
            model: "m",
            eligible_namespaces: &namespaces,
            estimated_prompt_tokens: 10,
            load_signals: true,
        };
        // Marks outside the request's model and namespaces are not consulted.
        assert!(reachable_candidates(&candidates, &req, |c| c.worker.instance_id.0 != 2).is_none());
    }
}
