//! Which event-plane publishers to subscribe to, as a pure function of the fleet snapshot.
//!
//! The load supervisor runs one subscription per discovered publisher. Fleet-authored records
//! must not exhaust file descriptors, so at most [`MAX_SUBSCRIPTIONS`] are admitted, in
//! ascending publisher id order (a stable, fleet-independent rule). A publisher whose record
//! changed (a new endpoint under the same id) is a different target, so the old subscription
//! stops and a new one starts.

use std::collections::BTreeMap;

use crate::discovery::records::EventTopic;
use crate::discovery::snapshot::DynamoSnapshot;
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

/// The wanted subscriptions of one `topic`, keyed by child name, capped at `cap` in ascending
/// publisher id order. Also returns how many publishers were left out by the cap.
pub fn plan(
    snapshot: &DynamoSnapshot,
    topic: EventTopic,
    cap: usize,
) -> (BTreeMap<String, SubscriptionTarget>, usize) {
    let mut targets: Vec<SubscriptionTarget> = snapshot
        .publishers()
        .iter()
        .filter(|p| p.topic == topic)
        .map(|p| SubscriptionTarget {
            topic,
            namespace: p.namespace.clone(),
            publisher_id: p.publisher_id,
            component: p.component.clone(),
            endpoint: format!("tcp://{}", p.address().authority()),
        })
        .collect();
    targets.sort_by(|a, b| (a.publisher_id, &a.namespace).cmp(&(b.publisher_id, &b.namespace)));
    let left_out = targets.len().saturating_sub(cap);
    targets.truncate(cap);
    let wanted = targets.into_iter().map(|t| (t.child_name(), t)).collect();
    (wanted, left_out)
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
        let key = format!(
            "v1/event_channels/namespace/{ns}/component/backend/endpoint/generate/topic/{topic}/{id:x}"
        );
        let value = serde_json::json!({
            "type": "EventChannel",
            "scope": {"kind": "endpoint", "endpoint": {"namespace": ns, "component": "backend", "name": "generate"}},
            "topic": topic,
            "instance_id": id,
            "transport": {"kind": "Zmq", "config": {"endpoint": format!("tcp://127.0.0.1:{port}")}}
        });
        (key, serde_json::to_vec(&value).expect("json"))
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
        let (wanted, left_out) = plan(&snap, EventTopic::KvMetrics, 2);
        let ids: Vec<u64> = wanted.values().map(|t| t.publisher_id.0).collect();
        assert_eq!(ids, vec![10, 20]);
        assert_eq!(left_out, 1);
        assert_eq!(wanted["kv_metrics:dyn:10"].endpoint, "tcp://127.0.0.1:1000");
        let (kv, _) = plan(&snap, EventTopic::KvEvents, MAX_SUBSCRIPTIONS);
        assert_eq!(kv.len(), 1);
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
        )
        .0;
        let after = plan(
            &snapshot(&[
                channel("dyn", "kv_metrics", 2, 2999),
                channel("dyn", "kv_metrics", 3, 3000),
            ]),
            EventTopic::KvMetrics,
            MAX_SUBSCRIPTIONS,
        )
        .0;
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
}
