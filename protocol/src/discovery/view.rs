//! The materialised fleet of one namespace: workers and event publishers, and the operator-facing
//! JSON of a worker (`GET /admin/dynamo/workers`).
//!
//! Internal addresses (request-plane transports, publisher `tcp://` endpoints, bootstrap hosts)
//! and raw cards live here for the router's own use but have no serialised form: `Serialize`
//! writes only the documented admin fields.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::ser::SerializeStruct;
use serde::{Serialize, Serializer};

use super::keys::encode_segment;
use super::records::{Capacity, CardJson, DisaggregatedEndpoint, EventTopic, Role, TcpAddress};
use crate::ids::{DpRank, InstanceId, Namespace, PublisherId, WorkerKey};
use crate::kv::artifacts::CardArtifacts;
use crate::time::UnixMillis;

/// One routable (or operator-visible) worker: a `generate` endpoint joined with its card.
#[derive(Clone, Debug, PartialEq)]
pub struct Worker {
    pub key: WorkerKey,
    pub component: String,
    pub endpoint: String,
    pub role: Role,
    /// The card's `display_name` (else `name`); `None` without a readable card.
    pub model: Option<String>,
    /// `kv_cache_block_size`.
    pub block_size: Option<u32>,
    pub capacity: Capacity,
    /// `runtime_config.data_parallel_start_rank` as declared.
    pub dp_start_rank: Option<DpRank>,
    /// `runtime_config.data_parallel_size` as declared (`None` when absent, unlike a declared 1).
    pub dp_size: Option<u32>,
    pub disaggregated_endpoint: Option<DisaggregatedEndpoint>,
    /// The card's tokenizer / prompt-formatter / chat-template slots (paths may be internal
    /// addresses: never serialised).
    pub artifacts: Arc<CardArtifacts>,
    /// The full card, stored once at parse time (`None` without a card or when it exceeded
    /// `MAX_RETAINED_CARD_BYTES`). Never serialised.
    pub card: Option<CardJson>,
    /// Request-plane address from the Endpoint record. Internal, never serialised.
    pub(crate) transport: Option<String>,
    pub first_seen: UnixMillis,
    pub last_updated: UnixMillis,
}

impl Worker {
    /// A worker with no card data, for callers that build fleets by hand (tests, Pod sources).
    pub fn new(key: WorkerKey, component: impl Into<String>, role: Role, now: UnixMillis) -> Self {
        Self {
            key,
            component: component.into(),
            endpoint: "generate".to_owned(),
            role,
            model: None,
            block_size: None,
            capacity: Capacity::default(),
            dp_start_rank: None,
            dp_size: None,
            disaggregated_endpoint: None,
            artifacts: Arc::default(),
            card: None,
            transport: None,
            first_seen: now,
            last_updated: now,
        }
    }

    pub fn instance_id(&self) -> InstanceId {
        self.key.instance_id
    }

    pub fn namespace(&self) -> &Namespace {
        &self.key.namespace
    }

    /// The request-plane address the worker registered. Internal: never export it.
    pub fn transport(&self) -> Option<&str> {
        self.transport.as_deref()
    }

    /// Sets the request-plane address (sources other than etcd).
    pub fn with_transport(mut self, transport: impl Into<String>) -> Self {
        self.transport = Some(transport.into());
        self
    }

    /// Whether `rank` is one of the DP ranks this worker owns (`start .. start + size`, with the
    /// upstream defaults 0 and 1 when undeclared).
    pub fn owns_rank(&self, rank: DpRank) -> bool {
        let start = self.dp_start_rank.unwrap_or_default().0;
        let size = self.dp_size.unwrap_or(1);
        rank.0 >= start && u64::from(rank.0) < u64::from(start) + u64::from(size)
    }

    /// Equal apart from `first_seen` / `last_updated`. The typed fields are compared first, so
    /// the cards (compared by meaning, see [`CardJson`]) are only looked at when all else is
    /// equal.
    pub fn same_content(&self, other: &Worker) -> bool {
        self.key == other.key
            && self.component == other.component
            && self.endpoint == other.endpoint
            && self.role == other.role
            && self.model == other.model
            && self.block_size == other.block_size
            && self.capacity == other.capacity
            && self.dp_start_rank == other.dp_start_rank
            && self.dp_size == other.dp_size
            && self.disaggregated_endpoint == other.disaggregated_endpoint
            && (Arc::ptr_eq(&self.artifacts, &other.artifacts) || self.artifacts == other.artifacts)
            && self.transport == other.transport
            && self.card == other.card
    }

    /// The worker object of `GET /admin/dynamo/workers`.
    pub fn admin_json(&self) -> serde_json::Value {
        // Serialising a struct of strings, numbers and options into a Value cannot fail.
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }
}

/// Formats Unix milliseconds as RFC 3339 with second precision and a `+00:00` offset
/// (`2026-09-23T04:11:02+00:00`).
pub fn rfc3339(at: UnixMillis) -> String {
    let secs = i64::try_from(at.0 / 1000).unwrap_or(i64::MAX);
    let t = time::OffsetDateTime::from_unix_timestamp(secs)
        .unwrap_or_else(|_| time::PrimitiveDateTime::MAX.assume_utc());
    let format =
        time::macros::format_description!("[year]-[month]-[day]T[hour]:[minute]:[second]+00:00");
    t.format(&format)
        .unwrap_or_else(|_| "9999-12-31T23:59:59+00:00".to_owned())
}

struct AdminDisagg<'a>(&'a DisaggregatedEndpoint);

impl Serialize for AdminDisagg<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            DisaggregatedEndpoint::Path(p) => s.serialize_str(p),
            // The bootstrap host is a Pod address: only the port is shown.
            DisaggregatedEndpoint::Bootstrap { port, .. } => {
                let mut st = s.serialize_struct("Bootstrap", 1)?;
                st.serialize_field("bootstrap_port", port)?;
                st.end()
            }
        }
    }
}

impl Serialize for Worker {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("Worker", 14)?;
        st.serialize_field("instance_id", &self.key.instance_id.hex())?;
        st.serialize_field("namespace", self.key.namespace.as_str())?;
        st.serialize_field("worker_id", &self.key.instance_id.decimal())?;
        st.serialize_field("role", &self.role)?;
        st.serialize_field("model", &self.model)?;
        st.serialize_field("component", &self.component)?;
        st.serialize_field("endpoint", &self.endpoint)?;
        st.serialize_field("dp_start_rank", &self.dp_start_rank.map(|r| r.0))?;
        st.serialize_field("dp_size", &self.dp_size)?;
        st.serialize_field("block_size", &self.block_size)?;
        st.serialize_field("capacity", &self.capacity)?;
        st.serialize_field(
            "disaggregated_endpoint",
            &self.disaggregated_endpoint.as_ref().map(AdminDisagg),
        )?;
        st.serialize_field("first_seen", &rfc3339(self.first_seen))?;
        st.serialize_field("last_updated", &rfc3339(self.last_updated))?;
        st.end()
    }
}

/// A load (`kv_metrics`) or KV-event (`kv-events`) publisher to subscribe to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Publisher {
    pub namespace: Namespace,
    /// `None` for namespace-scoped channels.
    pub component: Option<String>,
    /// `None` for namespace- or component-scoped channels.
    pub endpoint: Option<String>,
    pub topic: EventTopic,
    pub publisher_id: PublisherId,
    /// The worker behind the publisher, when an EventSource names it (kv-events).
    pub worker: Option<WorkerKey>,
    /// The DP rank the EventSource names.
    pub dp_rank: Option<DpRank>,
    /// Internal `tcp://` endpoint; never serialised.
    pub(crate) address: TcpAddress,
}

impl Publisher {
    pub fn new(
        namespace: Namespace,
        topic: EventTopic,
        publisher_id: PublisherId,
        address: TcpAddress,
    ) -> Self {
        Self {
            namespace,
            component: None,
            endpoint: None,
            topic,
            publisher_id,
            worker: None,
            dp_rank: None,
            address,
        }
    }

    /// Where to dial. Internal: never log at info, never export.
    pub fn address(&self) -> &TcpAddress {
        &self.address
    }

    /// The dotted event-plane subject (`namespace.<ns>.component.<c>.endpoint.<e>.<topic>`,
    /// segments percent-encoded). Upstream uses it for NATS and broker routing only; the router
    /// keeps it for diagnostics, never as the ZMQ SUB filter (that is the bare topic).
    pub fn subject(&self) -> String {
        let mut subject = format!("namespace.{}", encode_segment(self.namespace.as_str()));
        if let Some(c) = &self.component {
            subject.push_str(".component.");
            subject.push_str(&encode_segment(c));
            if let Some(e) = &self.endpoint {
                subject.push_str(".endpoint.");
                subject.push_str(&encode_segment(e));
            }
        }
        subject.push('.');
        subject.push_str(&encode_segment(self.topic.as_str()));
        subject
    }
}

impl Serialize for Publisher {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("Publisher", 7)?;
        st.serialize_field("family", &self.topic)?;
        st.serialize_field("publisher_id", &self.publisher_id.to_string())?;
        st.serialize_field("namespace", self.namespace.as_str())?;
        st.serialize_field("component", &self.component)?;
        st.serialize_field("endpoint", &self.endpoint)?;
        st.serialize_field("worker", &self.worker.as_ref().map(|w| w.instance_id.hex()))?;
        st.serialize_field("dp_rank", &self.dp_rank.map(|r| r.0))?;
        st.end()
    }
}

/// The materialised fleet of one namespace, as a reducer last published it.
#[derive(Clone, Debug, PartialEq)]
pub struct NamespaceView {
    pub(crate) namespace: Namespace,
    pub(crate) workers: BTreeMap<InstanceId, Arc<Worker>>,
    pub(crate) publishers: BTreeMap<PublisherId, Arc<Publisher>>,
}

impl NamespaceView {
    pub fn new(namespace: Namespace) -> Self {
        Self {
            namespace,
            workers: BTreeMap::new(),
            publishers: BTreeMap::new(),
        }
    }

    /// A view from hand-built parts (sources other than etcd, tests). Entries of another
    /// namespace are dropped.
    pub fn from_parts(
        namespace: Namespace,
        workers: impl IntoIterator<Item = Worker>,
        publishers: impl IntoIterator<Item = Publisher>,
    ) -> Self {
        let workers = workers
            .into_iter()
            .filter(|w| w.key.namespace == namespace)
            .map(|w| (w.key.instance_id, Arc::new(w)))
            .collect();
        let publishers = publishers
            .into_iter()
            .filter(|p| p.namespace == namespace)
            .map(|p| (p.publisher_id, Arc::new(p)))
            .collect();
        Self {
            namespace,
            workers,
            publishers,
        }
    }

    pub fn namespace(&self) -> &Namespace {
        &self.namespace
    }

    /// Workers by instance id.
    pub fn workers(&self) -> impl ExactSizeIterator<Item = &Arc<Worker>> {
        self.workers.values()
    }

    pub fn worker(&self, id: InstanceId) -> Option<&Arc<Worker>> {
        self.workers.get(&id)
    }

    /// Publishers by publisher id.
    pub fn publishers(&self) -> impl ExactSizeIterator<Item = &Arc<Publisher>> {
        self.publishers.values()
    }

    pub fn publisher(&self, id: PublisherId) -> Option<&Arc<Publisher>> {
        self.publishers.get(&id)
    }

    /// Equal apart from worker timestamps.
    pub fn same_content(&self, other: &NamespaceView) -> bool {
        self.namespace == other.namespace
            && self.publishers == other.publishers
            && self.workers.len() == other.workers.len()
            && self
                .workers
                .iter()
                .zip(other.workers.iter())
                .all(|((a, wa), (b, wb))| a == b && wa.same_content(wb))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_format_as_rfc3339_seconds_utc() {
        assert_eq!(rfc3339(UnixMillis(0)), "1970-01-01T00:00:00+00:00");
        assert_eq!(
            rfc3339(UnixMillis(1_790_136_662_999)),
            "2026-09-23T04:11:02+00:00"
        );
        assert_eq!(rfc3339(UnixMillis(u64::MAX)), "9999-12-31T23:59:59+00:00");
    }

    #[test]
    fn owned_ranks_follow_start_and_size_with_upstream_defaults() {
        let key = WorkerKey {
            namespace: Namespace::new("d"),
            instance_id: InstanceId(1),
        };
        let mut w = Worker::new(key, "decode", Role::Decode, UnixMillis(0));
        assert!(w.owns_rank(DpRank(0)));
        assert!(!w.owns_rank(DpRank(1)));
        w.dp_start_rank = Some(DpRank(2));
        w.dp_size = Some(4);
        assert!(!w.owns_rank(DpRank(1)));
        assert!(w.owns_rank(DpRank(5)));
        assert!(!w.owns_rank(DpRank(6)));
        w.dp_start_rank = Some(DpRank(u32::MAX));
        assert!(w.owns_rank(DpRank(u32::MAX)));
    }
}
