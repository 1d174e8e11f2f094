//! Kubernetes discovery, sans-IO: instance ids from Pod names, the `kubernetes_pods` membership
//! rules, and the `kubernetes` metadata source's join of DynamoWorkerMetadata with EndpointSlice
//! readiness into etcd-style [`crate::discovery::SourceEvent`]s.
//!
//! The watch shell lives in `continuum-actors` (`kube_source`); this crate never sees the `kube`
//! crate: objects arrive as the minimal serde views in [`objects`].
//!
//! | module | what it holds |
//! |---|---|
//! | [`hash`] | `hash_pod_name` (SipHash-1-3, 53 bits) |
//! | [`labels`] | operator label names and selector strings |
//! | [`objects`] | tolerant serde views of Pod, EndpointSlice, DynamoWorkerMetadata |
//! | [`pods`] | `kubernetes_pods` classification and the bounded `PodSet` |
//! | [`metadata`] | the metadata source's held resources, readiness join and incremental diffs |

pub mod hash;
pub mod labels;
pub mod metadata;
pub mod objects;
pub mod pod_view;
pub mod pods;

pub use hash::{hash_container_name, hash_pod_name};

/// At most this many Pods, metadata resources or EndpointSlices are held per source.
pub const MAX_HELD_OBJECTS: usize = 16_384;

/// Page sizes of the relists.
pub const POD_PAGE: u32 = 500;
pub const METADATA_PAGE: u32 = 32;
pub const ENDPOINT_SLICE_PAGE: u32 = 500;

/// Which signals a source's workers can have (reported by `GET /admin/dynamo/workers`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Signals {
    pub load: bool,
    pub capacity: bool,
}
