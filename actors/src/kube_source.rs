//! The Kubernetes discovery watch shells: `kubernetes_pods` (Pods) and `kubernetes` (the
//! DynamoWorkerMetadata ⋈ EndpointSlice metadata source).
//!
//! A third shell, [`run_worker_metadata_source`], watches DynamoWorkerMetadata alone and hands
//! the raw resources on (continuum-event-broker's advertised publishers: its Role grants
//! get/list/watch on that one resource).
//!
//! Each is one long-running async function meant to run in a task its discovery actor spawns in
//! `pre_start` and aborts in `post_stop`; it owns the client, the lists and the watches, and hands
//! every decision to `continuum_protocol::kube` ([`PodSet`], [`MetadataState`]). Output goes over a
//! tokio mpsc as [`KubeUpdate`]s: the Pod member set after each change, or the metadata source's
//! [`SourceEvent`]s for the etcd reducer, plus `connected` transitions and counts.
//!
//! Watch lifecycle (seed "List, watch, and relist"), implemented with raw `Api::list` /
//! `Api::watch` from kube-client rather than kube-runtime's `watcher`, whose internal resume and
//! backoff would fight these rules:
//! * each pass builds a client on the blocking pool (in-cluster first, then `KUBECONFIG` /
//!   `~/.kube/config` with exec plugins forced to `interactiveMode: Never`); a build abandoned by
//!   the setup timeout is awaited by the next pass rather than spawned twice;
//! * connect, paginated lists (Pods 500, DynamoWorkerMetadata 32, EndpointSlices 500, up to
//!   16,384 objects) and watch-open share one 30 s budget;
//! * watches ask for `timeoutSeconds=290` and each has its own 320 s per-event idle deadline;
//! * ANY termination (410 Gone, EOF, transport error, idle deadline, routine close) leads to a full
//!   relist after the shared backoff; the backoff resets after a session of at least
//!   min(backoff max, 290 s); a routine close (clean end after that long) neither raises the
//!   backoff nor drops `connected`.

mod watch;

use std::time::Duration;

use continuum_protocol::backoff::{BackoffPolicy, Jitter};
use continuum_protocol::discovery::SourceEvent;
use continuum_protocol::kube::metadata::{MetadataConfig, MetadataState};
use continuum_protocol::kube::pods::{PodMember, PodSet, PodSourceConfig};
use tokio::sync::mpsc;

pub use watch::ClientSource;

/// Where the client connects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KubeConnect {
    /// In-cluster service account first, then `KUBECONFIG` / `~/.kube/config`.
    Infer,
    /// A plain URL with no credentials (tests against a loopback fake API server).
    Url(String),
}

/// The watch timings; [`WatchTiming::default`] is the production contract.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WatchTiming {
    /// Budget shared by client build, lists and watch-open.
    pub setup_timeout: Duration,
    /// `timeoutSeconds` asked of the server.
    pub watch_timeout_secs: u32,
    /// Longest silence tolerated on one watch before it counts as stalled.
    pub idle_timeout: Duration,
}

impl Default for WatchTiming {
    fn default() -> Self {
        Self {
            setup_timeout: Duration::from_secs(30),
            watch_timeout_secs: 290,
            idle_timeout: Duration::from_secs(320),
        }
    }
}

/// What both sources need beyond their own rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubeSourceConfig {
    pub connect: KubeConnect,
    /// The Kubernetes namespace of the fleet.
    pub namespace: String,
    /// `watch_reconnect_backoff`; jitter is ignored (discovery waits exactly the step).
    pub backoff: BackoffPolicy,
    pub timing: WatchTiming,
}

impl KubeSourceConfig {
    /// The default discovery backoff, 500 ms → 30 s without jitter.
    pub const DEFAULT_BACKOFF: BackoffPolicy = BackoffPolicy {
        initial: Duration::from_millis(500),
        max: Duration::from_secs(30),
        jitter: Jitter::None,
    };

    /// A session at least this long resets the backoff to its floor.
    pub fn reset_after(&self) -> Duration {
        self.backoff.max.min(Duration::from_secs(u64::from(
            self.timing.watch_timeout_secs,
        )))
    }
}

/// What a source reports to its owner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KubeUpdate<T> {
    /// Pods: the full member set after a change. Metadata: reducer events, in order.
    Data(T),
    /// `continuum_dynamo_discovery_connected` changed.
    Connected(bool),
    /// Increment `continuum_dynamo_discovery_events_total{kind}` (`refused`, `duplicate`,
    /// `mismatch`, `malformed`); `object` names the Pod or resource for the log line.
    Counted { kind: &'static str, object: String },
}

/// Updates of the `kubernetes_pods` source.
pub type PodUpdate = KubeUpdate<Vec<PodMember>>;
/// Updates of the `kubernetes` metadata source.
pub type MetadataUpdate = KubeUpdate<Vec<SourceEvent>>;

/// One change of the DynamoWorkerMetadata collection, in watch order.
#[derive(Clone, Debug, PartialEq)]
pub enum WorkerMetadataChange {
    /// A full relist (at start and after every watch termination): replaces everything.
    Relisted(Vec<continuum_protocol::kube::objects::DynamoWorkerMetadata>),
    Applied(Box<continuum_protocol::kube::objects::DynamoWorkerMetadata>),
    Deleted(String),
}

/// Updates of [`run_worker_metadata_source`].
pub type WorkerMetadataUpdate = KubeUpdate<WorkerMetadataChange>;

/// Errors of one pass; every one ends in a relist after the backoff.
#[derive(Debug, thiserror::Error)]
pub enum KubeSourceError {
    #[error("no Kubernetes configuration: in-cluster: {in_cluster}; kubeconfig: {kubeconfig}")]
    NoConfig {
        in_cluster: String,
        kubeconfig: String,
    },
    #[error("invalid API server URL {url}: {reason}")]
    BadUrl { url: String, reason: String },
    #[error("Kubernetes client: {0}")]
    Client(#[from] kube::Error),
    #[error("client build task failed: {0}")]
    Join(String),
    #[error("connect, list and watch-open took longer than {0:?}")]
    SetupTimeout(Duration),
    #[error("watch ended with 410 Gone")]
    Gone,
    #[error("watch error {code}: {message}")]
    WatchStatus { code: u16, message: String },
    #[error("watch of {0} was silent past the idle deadline")]
    Stalled(&'static str),
    #[error("watch of {0} ended early")]
    EarlyEof(&'static str),
}

/// Runs the `kubernetes_pods` source until `tx` is closed.
pub async fn run_pod_source(
    config: KubeSourceConfig,
    pods: PodSourceConfig,
    tx: mpsc::Sender<PodUpdate>,
) {
    let set = PodSet::new(pods);
    watch::run_pods(config, set, tx).await;
}

/// Runs the `kubernetes` metadata source until `tx` is closed.
pub async fn run_metadata_source(
    config: KubeSourceConfig,
    metadata: MetadataConfig,
    tx: mpsc::Sender<MetadataUpdate>,
) {
    let state = MetadataState::new(metadata);
    watch::run_metadata(config, state, tx).await;
}

/// Watches DynamoWorkerMetadata in `config.namespace` (get/list/watch, nothing else) until `tx`
/// is closed, with the same pass loop as the discovery sources.
pub async fn run_worker_metadata_source(
    config: KubeSourceConfig,
    tx: mpsc::Sender<WorkerMetadataUpdate>,
) {
    watch::run_worker_metadata(config, tx).await;
}
