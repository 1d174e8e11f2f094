//! Which event-plane publishers to subscribe to, as a pure function of the fleet snapshot.
//!
//! The load supervisor runs one subscription per discovered publisher. Fleet-authored records
//! must not exhaust file descriptors, so at most [`MAX_SUBSCRIPTIONS`] are admitted. Publisher
//! ids are fleet-authored too, so the cap keeps what already works first: publishers of workers
//! in the registry before publishers no worker stands behind, then publishers already
//! subscribed before new ones, then ascending publisher id (a stable tie-break). A flood of
//! channels with low ids therefore never pushes out a live worker's subscription. A publisher
//! whose record changed (a new endpoint under the same id) is a different target, so the old
//! subscription stops and a new one starts.

use std::collections::{BTreeMap, BTreeSet};

use crate::discovery::records::EventTopic;
use crate::discovery::snapshot::DynamoSnapshot;
use crate::discovery::view::Publisher;
use crate::ids::{Namespace, PublisherId};

/// Active subscriptions per family are capped at this many sockets.
pub const MAX_SUBSCRIPTIONS: usize = 1024;

/// One publisher to subscribe to.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SubscriptionTarget {
    pub topic: EventTopic,
    pub namespace: Namespace,
    pub publisher_id: PublisherId,
    pub component: Option<String>,
    /// Internal `tcp://host:port`; never exported by the admin API or metrics.
    pub endpoint: String,
}

impl SubscriptionTarget {
    /// The child's name in the supervision tree: stable for one target, new for a changed one.
    pub fn child_name(&self) -> String {
        format!(
            "{}:{}:{}",
            self.topic.as_str(),
            self.namespace,
            self.publisher_id
        )
    }
}

/// The subscriptions of one topic the cap admits, and the publishers it leaves out.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Wanted subscriptions, keyed by child name.
    pub wanted: BTreeMap<String, SubscriptionTarget>,
    /// Child names of the publishers left out by the cap, sorted.
    pub left_out: Vec<String>,
}

/// The wanted subscriptions of one `topic`, capped at `cap`. `running` (the subscriptions that
/// run now, by child name) lets the cap keep them ahead of newcomers; see the module docs for
/// the admission order.
pub fn plan(
    snapshot: &DynamoSnapshot,
    topic: EventTopic,
    cap: usize,
    running: &BTreeMap<String, SubscriptionTarget>,
) -> Plan {
    let scopes: BTreeSet<(&Namespace, &str, &str)> = snapshot
        .workers()
        .iter()
        .map(|w| (&w.key.namespace, w.component.as_str(), w.endpoint.as_str()))
        .collect();
    let mut ranked: Vec<((bool, bool, PublisherId, Namespace), SubscriptionTarget)> = snapshot
        .publishers()
        .iter()
        .filter(|p| p.topic == topic)
        .map(|p| {
            let target = SubscriptionTarget {
                topic,
                namespace: p.namespace.clone(),
                publisher_id: p.publisher_id,
                component: p.component.clone(),
                endpoint: format!("tcp://{}", p.address().authority()),
            };
            let orphan = !serves_a_worker(snapshot, &scopes, p);
            let new = !running.contains_key(&target.child_name());
            ((orphan, new, p.publisher_id, p.namespace.clone()), target)
        })
        .collect();
    ranked.sort_by(|a, b| a.0.cmp(&b.0));
    let mut left_out: Vec<String> = ranked
        .iter()
        .skip(cap)
        .map(|(_, t)| t.child_name())
        .collect();
    left_out.sort_unstable();
    ranked.truncate(cap);
    let wanted = ranked
        .into_iter()
        .map(|(_, t)| (t.child_name(), t))
        .collect();
    Plan { wanted, left_out }
}

/// Whether a worker of the registry stands behind `publisher`. A publisher id is not a worker
/// id: a channel is tied to workers by its scope (Dynamo's publishers are endpoint-scoped on the
/// worker's serving endpoint), or by the worker its EventSource names (kv-events).
fn serves_a_worker(
    snapshot: &DynamoSnapshot,
    scopes: &BTreeSet<(&Namespace, &str, &str)>,
    publisher: &Publisher,
) -> bool {
    let ns = &publisher.namespace;
    let in_scope = match (
        publisher.component.as_deref(),
        publisher.endpoint.as_deref(),
    ) {
        (Some(c), Some(e)) => scopes.contains(&(ns, c, e)),
        (Some(c), None) => scopes
            .range((ns, c, "")..)
            .next()
            .is_some_and(|(n, held, _)| *n == ns && *held == c),
        (None, _) => scopes
            .range((ns, "", "")..)
            .next()
            .is_some_and(|(n, _, _)| *n == ns),
    };
    in_scope
        || publisher
            .worker
            .as_ref()
            .is_some_and(|w| snapshot.worker(w).is_some())
}

/// What to stop and what to start to go from `running` to `wanted`. A running child whose target
/// differs from the wanted one under the same name (a modified record) is stopped and started.
pub fn diff(
    running: &BTreeMap<String, SubscriptionTarget>,
    wanted: &BTreeMap<String, SubscriptionTarget>,
) -> (Vec<String>, Vec<SubscriptionTarget>) {
    let stop: Vec<String> = running
        .iter()
        .filter(|(name, target)| wanted.get(*name) != Some(target))
        .map(|(name, _)| name.clone())
        .collect();
    let start: Vec<SubscriptionTarget> = wanted
        .iter()
        .filter(|(name, target)| running.get(*name) != Some(target))
        .map(|(_, target)| target.clone())
        .collect();
    (stop, start)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::SourceEvent;
    use crate::discovery::reducer::DiscoveryReducer;
    use crate::discovery::snapshot::{SourceKind, build_snapshot};
    use crate::time::UnixMillis;

    fn channel(ns: &str, topic: &str, id: u64, port: u16) -> (String, Vec<u8>) {
        channel_in(ns, "backend", topic, id, port)
    }

    fn channel_in(ns: &str, component: &str, topic: &str, id: u64, port: u16) -> (String, Vec<u8>) {
        let key = format!(
            "v1/event_channels/namespace/{ns}/component/{component}/endpoint/generate/topic/{topic}/{id:x}"
        );
        let value = serde_json::json!({
            "type": "EventChannel",
            "scope": {"kind": "endpoint", "endpoint": {"namespace": ns, "component": component, "name": "generate"}},
            "topic": topic,
            "instance_id": id,
            "transport": {"kind": "Zmq", "config": {"endpoint": format!("tcp://127.0.0.1:{port}")}}
        });
        (key, serde_json::to_vec(&value).expect("json"))
    }

    fn endpoint(ns: &str, id: u64) -> (String, Vec<u8>) {
        let key = format!("v1/instances/{ns}/backend/generate/{id:x}");
        let value = serde_json::json!({
            "type": "Endpoint", "namespace": ns, "component": "backend", "endpoint": "generate",
            "instance_id": id,
            "transport": {"tcp": format!("10.0.0.4:31000/{id:x}/{ns}/backend/generate")}
        });
        (key, serde_json::to_vec(&value).expect("json"))
    }

    /// A worker (its generate endpoint) and its `kv_metrics` channel, whose publisher id differs
    /// from the worker id as in Dynamo.
    fn live_worker(id: u64) -> [(String, Vec<u8>); 2] {
        [
            endpoint("dyn", id + 0x1_0000_0000),
            channel("dyn", "kv_metrics", id, (id % 60_000) as u16 + 1),
        ]
    }

    fn snapshot(channels: &[(String, Vec<u8>)]) -> DynamoSnapshot {
        let ns = Namespace::new("dyn");
        let mut reducer = DiscoveryReducer::new(ns.clone());
        reducer.apply(SourceEvent::Init, UnixMillis(0));
        for (key, value) in channels {
            reducer.apply(
                SourceEvent::InitApply {
                    key: key.clone(),
                    value: value.clone(),
                },
                UnixMillis(0),
            );
        }
        reducer.apply(SourceEvent::InitDone, UnixMillis(0));
        build_snapshot(SourceKind::Etcd, &[ns], &[reducer.view().as_ref()])
    }

    #[test]
    fn one_target_per_publisher_of_the_topic_in_ascending_id_order_capped() {
        let snap = snapshot(&[
            channel("dyn", "kv_metrics", 30, 3000),
            channel("dyn", "kv_metrics", 10, 1000),
            channel("dyn", "kv-events", 25, 2000),
            channel("dyn", "kv_metrics", 20, 2001),
        ]);
        let Plan { wanted, left_out } = plan(&snap, EventTopic::KvMetrics, 2, &BTreeMap::new());
        let ids: Vec<u64> = wanted.values().map(|t| t.publisher_id.0).collect();
        assert_eq!(ids, vec![10, 20]);
        assert_eq!(left_out, vec!["kv_metrics:dyn:30".to_string()]);
        assert_eq!(wanted["kv_metrics:dyn:10"].endpoint, "tcp://127.0.0.1:1000");
        let kv = plan(
            &snap,
            EventTopic::KvEvents,
            MAX_SUBSCRIPTIONS,
            &BTreeMap::new(),
        );
        assert_eq!(kv.wanted.len(), 1);
    }

    #[test]
    fn a_modified_record_restarts_and_unchanged_ones_stay() {
        let before = plan(
            &snapshot(&[
                channel("dyn", "kv_metrics", 1, 1000),
                channel("dyn", "kv_metrics", 2, 2000),
            ]),
            EventTopic::KvMetrics,
            MAX_SUBSCRIPTIONS,
            &BTreeMap::new(),
        )
        .wanted;
        let after = plan(
            &snapshot(&[
                channel("dyn", "kv_metrics", 2, 2999),
                channel("dyn", "kv_metrics", 3, 3000),
            ]),
            EventTopic::KvMetrics,
            MAX_SUBSCRIPTIONS,
            &before,
        )
        .wanted;
        let (stop, start) = diff(&before, &after);
        assert_eq!(
            stop,
            vec![
                "kv_metrics:dyn:1".to_string(),
                "kv_metrics:dyn:2".to_string()
            ]
        );
        let started: Vec<u64> = start.iter().map(|t| t.publisher_id.0).collect();
        assert_eq!(started, vec![2, 3]);
        let (stop, start) = diff(&after, &after);
        assert!(stop.is_empty() && start.is_empty());
    }

    #[test]
    fn newcomers_with_lower_ids_never_push_out_running_subscriptions_at_the_cap() {
        // 1,100 live publishers at the 1,024 cap: the first plan takes the lowest ids.
        let fleet: Vec<(String, Vec<u8>)> = (10_000..11_100).flat_map(live_worker).collect();
        let first = plan(
            &snapshot(&fleet),
            EventTopic::KvMetrics,
            MAX_SUBSCRIPTIONS,
            &BTreeMap::new(),
        );
        assert_eq!(first.wanted.len(), MAX_SUBSCRIPTIONS);
        assert_eq!(first.left_out.len(), 1_100 - MAX_SUBSCRIPTIONS);
        // 100 newcomers with lower ids join: every running subscription stays, they wait.
        let mut grown = fleet.clone();
        grown.extend((1..=100).flat_map(live_worker));
        let second = plan(
            &snapshot(&grown),
            EventTopic::KvMetrics,
            MAX_SUBSCRIPTIONS,
            &first.wanted,
        );
        let (stop, start) = diff(&first.wanted, &second.wanted);
        assert!(
            stop.is_empty(),
            "{} running subscriptions pushed out",
            stop.len()
        );
        assert!(start.is_empty());
        assert_eq!(second.left_out.len(), 1_200 - MAX_SUBSCRIPTIONS);
        assert!(second.left_out.contains(&"kv_metrics:dyn:1".to_string()));
        // A departure frees a slot: the lowest id left out takes it.
        let shrunk: Vec<(String, Vec<u8>)> = grown
            .iter()
            .filter(|(k, _)| !k.ends_with(&format!("/{:x}", 10_000)))
            .cloned()
            .collect();
        let third = plan(
            &snapshot(&shrunk),
            EventTopic::KvMetrics,
            MAX_SUBSCRIPTIONS,
            &second.wanted,
        );
        let (stop, start) = diff(&second.wanted, &third.wanted);
        assert_eq!(stop, vec![format!("kv_metrics:dyn:{}", 10_000)]);
        let started: Vec<u64> = start.iter().map(|t| t.publisher_id.0).collect();
        assert_eq!(started, vec![1]);
    }

    #[test]
    fn hostile_channels_with_low_ids_never_push_out_live_workers_publishers() {
        // 1,500 channels no worker stands behind, with ids below every real one.
        let mut records: Vec<(String, Vec<u8>)> = (1..=1_500)
            .map(|id| channel_in("dyn", "ghost", "kv_metrics", id, 7000))
            .collect();
        records.extend((50_000..50_010).flat_map(live_worker));
        let fresh = plan(
            &snapshot(&records),
            EventTopic::KvMetrics,
            MAX_SUBSCRIPTIONS,
            &BTreeMap::new(),
        );
        for id in 50_000..50_010u64 {
            assert!(
                fresh.wanted.contains_key(&format!("kv_metrics:dyn:{id}")),
                "live worker {id} subscribed"
            );
        }
        assert_eq!(fresh.wanted.len(), MAX_SUBSCRIPTIONS);
        assert_eq!(fresh.left_out.len(), 1_510 - MAX_SUBSCRIPTIONS);
        // Deterministic: the same inputs give the same plan.
        assert_eq!(
            fresh,
            plan(
                &snapshot(&records),
                EventTopic::KvMetrics,
                MAX_SUBSCRIPTIONS,
                &BTreeMap::new()
            )
        );
    }
}
