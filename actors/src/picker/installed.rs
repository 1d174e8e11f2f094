//! What the pickers read per config, published as one immutable snapshot ([`Installed`]) by one
//! writer ([`PickerWriter`]), and the guard that ends a dispatch when its response does
//! ([`InFlight`]).
//!
//! The kube-runtime reflector model: the writer is not `Clone` and is claimed from the picker's
//! `lock::Exclusive` slot (at most one exists at a time); readers (`SharedPicker` clones) load the
//! published `Arc` without a lock. The writer publishes when the config changes (at start and on
//! every applied reload, `ShimRouter::reconfigure`) and when a plug-in installs a picker
//! (`set_picker`); a request only reads. A reload that is refused never reaches the writer, so
//! the previous picker stays.

use std::sync::Arc;

use continuum_protocol::ids::Namespace;
use continuum_protocol::picker::ledger::DispatchId;
use continuum_protocol::picker::{
    DynamoWorkerPicker, KvAwarePicker, KvPickParams, LoadBasedPicker, TieBreak,
};

use super::SharedPicker;
use crate::lock::Claim;

/// What one config asks of the pickers, derived once per config (not per request).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PickerConfig {
    /// The `dynamo.kv` parameters a `KvAwarePicker` is built from (`None`: KV-aware selection is
    /// off, and the installed picker is not managed by `dynamo.kv`).
    pub kv: Option<KvPickParams>,
    /// This replica's tie-break among near-equal ranks (`dynamo.load.tie_break_window`, seeded
    /// by the replica id).
    pub tie_break: TieBreak,
    /// The namespaces whose shim pool may receive `nvext.token_data`.
    pub token_data: Vec<Namespace>,
}

/// The installed picker and the config it was installed under: one immutable snapshot.
pub struct Installed {
    pub picker: Arc<dyn DynamoWorkerPicker>,
    /// `config.kv` is what `picker` was built from when `dynamo.kv` manages it.
    pub config: PickerConfig,
}

impl std::fmt::Debug for Installed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Installed")
            .field("picker", &self.picker.name())
            .field("config", &self.config)
            .finish()
    }
}

impl Default for Installed {
    /// The default `LoadBasedPicker`, tie-break off, no `nvext.token_data`.
    fn default() -> Self {
        Self {
            picker: Arc::new(LoadBasedPicker::new()),
            config: PickerConfig::default(),
        }
    }
}

/// The one writer of [`Installed`]: not `Clone`; dropping it frees the slot for another.
pub struct PickerWriter {
    picker: SharedPicker,
    _claim: Claim<()>,
}

impl std::fmt::Debug for PickerWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PickerWriter").finish_non_exhaustive()
    }
}

impl PickerWriter {
    pub(super) fn new(picker: SharedPicker, claim: Claim<()>) -> Self {
        Self {
            picker,
            _claim: claim,
        }
    }

    /// Publishes `config`: the `KvAwarePicker` built from `config.kv` when it differs from what
    /// the installed picker was built from, the `LoadBasedPicker` back when KV was turned off,
    /// and the installed picker kept otherwise (a picker set by [`Self::set_picker`] stays until
    /// `dynamo.kv` changes).
    pub fn publish(&self, config: PickerConfig) {
        let held = self.picker.installed();
        let picker: Arc<dyn DynamoWorkerPicker> = if held.config.kv == config.kv {
            held.picker.clone()
        } else {
            match config.kv {
                Some(params) => Arc::new(KvAwarePicker::new(params)),
                None => Arc::new(LoadBasedPicker::new()),
            }
        };
        self.picker.store(Installed { picker, config });
    }

    /// Replaces the active picker (`set_picker()`; a plug-in picker installs here), under the
    /// config already published. The ledger and cursors carry over: they describe the fleet, not
    /// the picker.
    pub fn set_picker(&self, picker: Arc<dyn DynamoWorkerPicker>) {
        let config = self.picker.installed().config.clone();
        self.picker.store(Installed { picker, config });
    }
}

/// One pinned dispatch whose response has not ended: dropping it ends the dispatch in the ledger
/// (tower's `load::PendingRequests` handle). A request that ended (answered, refused, failed or
/// cancelled) may never have reached an engine, so it no longer marks its worker stalled; its
/// backlog stays until a sample answers it or it ages out.
pub struct InFlight {
    picker: SharedPicker,
    id: DispatchId,
}

impl std::fmt::Debug for InFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InFlight").field("id", &self.id).finish()
    }
}

impl InFlight {
    pub(super) fn new(picker: SharedPicker, id: DispatchId) -> Self {
        Self { picker, id }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.picker.request_ended(self.id);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use continuum_protocol::ids::{DpRank, InstanceId, WorkerKey};
    use continuum_protocol::picker::{DispatchLeg, NoCandidates, PickContext, PickOutcome};
    use continuum_protocol::time::Tick;

    use super::*;

    struct Named;

    impl DynamoWorkerPicker for Named {
        fn name(&self) -> &'static str {
            "named"
        }

        fn pick(&self, _ctx: &mut PickContext<'_>) -> PickOutcome {
            PickOutcome::NoCandidates(NoCandidates::NoWorkerForModel)
        }
    }

    fn kv_on(temperature: f64) -> PickerConfig {
        PickerConfig {
            kv: Some(KvPickParams {
                router_temperature: temperature,
                ..KvPickParams::default()
            }),
            ..PickerConfig::default()
        }
    }

    #[test]
    fn one_writer_at_a_time_and_readers_see_what_it_published() {
        let shared = SharedPicker::new();
        let writer = shared.writer().expect("unclaimed");
        assert!(shared.writer().is_none(), "a second writer is refused");
        assert_eq!(shared.installed().picker.name(), "load_based");
        let tie = TieBreak {
            window: 2.0,
            seed: 7,
            peer_slots: false,
        };
        writer.publish(PickerConfig {
            tie_break: tie,
            ..kv_on(0.0)
        });
        let installed = shared.installed();
        assert_eq!(installed.picker.name(), "kv_aware");
        assert_eq!(installed.config.tie_break, tie);
        drop(writer);
        assert!(shared.writer().is_some(), "a dropped writer frees the slot");
    }

    #[test]
    fn a_picker_is_rebuilt_only_when_dynamo_kv_changes() {
        let shared = SharedPicker::new();
        let writer = shared.writer().expect("unclaimed");
        // KV off, unchanged: a plug-in picker stays.
        writer.set_picker(Arc::new(Named));
        writer.publish(PickerConfig::default());
        assert_eq!(shared.picker().name(), "named");
        // KV on: the KV-aware picker; the same parameters again keep that very instance.
        writer.publish(kv_on(0.0));
        let first = shared.picker();
        assert_eq!(first.name(), "kv_aware");
        writer.publish(PickerConfig {
            token_data: vec![Namespace::new("ns")],
            ..kv_on(0.0)
        });
        assert!(Arc::ptr_eq(&first, &shared.picker()));
        assert_eq!(shared.installed().config.token_data, [Namespace::new("ns")]);
        // Changed parameters rebuild it; KV off brings the load-based picker back.
        writer.publish(kv_on(0.5));
        assert!(!Arc::ptr_eq(&first, &shared.picker()));
        writer.publish(PickerConfig::default());
        assert_eq!(shared.picker().name(), "load_based");
    }

    #[test]
    fn a_dropped_in_flight_guard_ends_its_dispatch() {
        let shared = SharedPicker::new();
        let worker = WorkerKey {
            namespace: Namespace::new("ns"),
            instance_id: InstanceId(1),
        };
        let leg = DispatchLeg {
            worker: worker.clone(),
            rank: DpRank(0),
            prefill_tokens: 0,
            decode_blocks: 5,
            request_blocks: 5,
            stall_exempt: false,
        };
        let at = |secs| Tick(Duration::from_secs(secs));
        let ids: Vec<DispatchId> = (0..2)
            .map(|_| shared.with_ledger(|l| l.record_dispatch(std::slice::from_ref(&leg), at(0))))
            .collect();
        let guards: Vec<InFlight> = ids.iter().map(|&id| shared.in_flight(id)).collect();
        let stalled = || shared.with_ledger(|l| l.backlog(&worker, DpRank(0), at(6)));
        assert!(stalled().stalled, "in flight for 6 s: may be stalled");
        drop(guards);
        let after = stalled();
        assert!(!after.stalled, "ended requests mark no stall");
        assert_eq!(
            after.decode_blocks, 10,
            "their backlog stays until answered"
        );
    }
}
