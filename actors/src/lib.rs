//! continuum-actors: thin ractor shells that own IO for continuum-router.
//!
//! Every decision is a call into `continuum-protocol`; actors own sockets, timers and mailboxes.
//!
//! The supervision tree these actors form, as the daemon starts it (`daemon::root_children` in
//! the root crate; dependencies first; docs/ARCHITECTURE.md, "Supervision tree", draws it with
//! its restart rules, and a test checks that drawing against `GET /admin/subsystems`):
//!
//! ```text
//! root                       Supervisor
//! ├── registry               RegistryActor: single writer of the fleet snapshot
//! ├── kv_index               KvIndexActor: single writer of the bounded KV index (dynamo-kv)
//! ├── picker                 PickerActor: candidate index per generation, ledger arrivals, expiry
//! ├── discovery              Supervisor
//! │   └── <source>:<ns>      DiscoveryActor per Dynamo namespace
//! ├── subscriptions          Supervisor
//! │   ├── follower           SubscriptionFollower: follows registry generations, adds/removes
//! │   ├── kv_metrics:<ns>:<id> SubscriptionActor per kv_metrics publisher
//! │   └── kv-events:<ns>:<id>  SubscriptionActor per kv-events publisher (feeds kv_index)
//! ├── event_bus              BrokerSupervisor: the event-bus listener (dynamo-event-bus)
//! │   └── session:<sess>     BrokerSessionActor per welcomed session
//! └── kv_push                KvPushActor: kv_listener SSE streams feeding kv_index
//! ```
//!
//! `discovery` and `subscriptions` are the generic [`supervisor::Supervisor`] (their
//! [`lifecycle::ActorKind`] labels them `DiscoverySupervisor` and `SubscriptionSupervisor`);
//! `kv_index` and `kv_push` start only with the `dynamo-kv` feature, `event_bus` with
//! `dynamo-event-bus`.
//!
//! | module | what it holds |
//! |---|---|
//! | [`supervisor`] | the generic restarting supervisor and child specs |
//! | [`tree`] | the status table behind `GET /admin/subsystems` |
//! | [`store`] | the lock-free snapshot store (ArcSwap + generation watch) |
//! | [`lock`] | the only `std::sync` locks (poisoning handled once) and the single-writer lease |
//! | [`clock`] | monotonic ticks and wall-clock time for `protocol` |
//! | [`metrics`] | the exposition: one registry, the meter provider, `/metrics` text; each subsystem's `metrics` submodule owns its families |
//! | [`lifecycle`] | actor lifecycle spans (start, stop, failure, restart) |
//! | [`registry`] | RegistryActor (claims the `RegistryWriter`), the `RegistryInbox` inputs and the `RegistryReader` reader |
//! | [`kv_index`] | KvIndexActor (claims the `KvIndexWriter`) and the `SharedKvIndex` reader/feeder (reads, parity, subscription cursors) |
//! | [`discovery`] | DiscoveryActor: one per namespace, source → reducer → registry |
//! | [`etcd_source`] | the read-only etcd get-then-watch source |
//! | [`file_source`] | the read-only Dynamo file-store source (directory scans, inotify, mtime TTL) |
//! | [`memory_source`] | in-process etcd-shaped records (the demo's simulated fleet) |
//! | [`zmtp_conn`] | one bounded ZMTP SUB connection over TCP |
//! | [`subscription`] | SubscriptionActor per publisher and the follower of registry generations |
//! | [`load`] | the shared load store and the subscription status table |
//! | [`kv_artifacts`] | tokenizer artifacts: card slots → pinned, verified, cached, loaded tokenizers |
//! | [`picker`] | PickerActor and the `SharedPicker` handle (installed picker, index, ledger) |
//! | [`kv_push`] | KvPushActor: `transport: event_bus` kv_cache_index sources read through `open_announced_stream` into the KV index |
//! | [`event_bus`] | the event-bus listener, BrokerSupervisor, BrokerSessionActor, the `EventBus` command API and `BusStream` |
//! | [`kube_source`] | Kubernetes discovery watch shells (Pods; DynamoWorkerMetadata ⋈ EndpointSlice) |

// Test code is exempt from the 120-line limit; product code is linted in the non-test build.
#![cfg_attr(test, allow(clippy::too_many_lines, reason = "test code is exempt"))]

pub mod clock;
pub mod discovery;
pub mod etcd_source;
pub mod event_bus;
pub mod file_source;
pub mod kube_source;
#[cfg(feature = "kv-artifacts")]
pub mod kv_artifacts;
/// Without the feature only the artifacts' metric family is compiled (registered at 0).
#[cfg(not(feature = "kv-artifacts"))]
pub mod kv_artifacts {
    pub mod metrics;
    pub use self::metrics::{KvArtifactMetrics, KvArtifactResult};
}
pub mod kv_index;
pub mod kv_push;
pub mod lifecycle;
pub mod load;
pub mod lock;
pub mod memory_source;
pub mod metrics;
pub mod picker;
pub mod registry;
pub mod replica_sync;
pub mod store;
pub mod subscription;
pub mod supervisor;
pub mod tree;
pub mod zmtp_conn;

/// Registers every family of this crate in `metrics` (closed-set series at 0), so `/metrics`
/// shows them from the first scrape whichever subsystems run. The daemon calls it once at
/// startup; a subsystem started later finds its family already there.
pub fn register_metric_families(metrics: &metrics::Metrics) -> Result<(), metrics::MetricsError> {
    metrics.register::<discovery::metrics::DiscoveryMetrics>()?;
    metrics.register::<registry::metrics::RegistryMetrics>()?;
    metrics.register::<load::metrics::LoadMetrics>()?;
    metrics.register::<kv_index::metrics::KvIndexMetrics>()?;
    metrics.register::<kv_artifacts::metrics::KvArtifactMetrics>()?;
    metrics.register::<supervisor::metrics::SupervisorMetrics>()?;
    metrics.register::<event_bus::metrics::EventBusMetrics>()?;
    Ok(())
}
