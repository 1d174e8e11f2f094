//! continuum-actors: thin ractor shells that own IO for continuum-router.
//!
//! Every decision is a call into `continuum-protocol`; actors own sockets, timers and mailboxes.
//!
//! Supervision tree (dependencies start first):
//!
//! ```text
//! root (Supervisor)
//! ├── registry            RegistryActor: single writer of the immutable fleet snapshot
//! ├── discovery           Supervisor
//! │   └── etcd:<ns>       DiscoveryActor per Dynamo namespace
//! ├── subscriptions       SubscriptionSupervisor
//! │   └── kv_metrics:<id> SubscriptionActor per publisher
//! └── picker              PickerActor
//! ```
//!
//! | module | what it holds |
//! |---|---|
//! | [`supervisor`] | the generic restarting supervisor and child specs |
//! | [`tree`] | the status table behind `GET /admin/subsystems` |
//! | [`store`] | the lock-free snapshot store (ArcSwap + generation watch) |
//! | [`clock`] | monotonic ticks and wall-clock time for `protocol` |
//! | [`kube_source`] | Kubernetes discovery watch shells (Pods; DynamoWorkerMetadata ⋈ EndpointSlice) |

pub mod clock;
pub mod kube_source;
pub mod store;
pub mod supervisor;
pub mod tree;
