//! Which publishers a broker may dial: the `zmq_tcp` targets that DynamoWorkerMetadata in its
//! Kubernetes namespace advertises, sans-IO.
//!
//! continuum-event-broker answers a `subscribe` whose target is not in this set with
//! `stream_closed{reason: target_not_advertised}` and never dials it, so a router (or a bug in
//! one) cannot turn the broker into a TCP proxy to arbitrary cluster addresses.
//!
//! A target is advertised while at least one held resource carries, under
//! `spec.data.event_channels`, a direct-ZMQ `EventChannel` record whose key names one of the
//! broker's declared Dynamo namespaces, whose topic is the commanded topic and whose
//! `tcp://host:port` endpoint equals the target's host and port. Keys and values are read with
//! the discovery parsers ([`crate::discovery::keys::classify`],
//! [`crate::discovery::records::parse_record`]), so the broker and the router agree on what a
//! channel record means. Readiness (EndpointSlices) is not consulted: the broker's Role grants
//! get/list/watch on dynamoworkermetadatas only, and a target that is advertised but not ready
//! simply fails to connect (`connect_failed`).
//!
//! Bounds: [`MAX_HELD_OBJECTS`] resources and [`MAX_ADVERTS_PER_RESOURCE`] channels per resource;
//! anything beyond is ignored and counted in [`Step::ignored`].

use std::collections::{BTreeMap, BTreeSet};

use crate::discovery::EventTopic;
use crate::discovery::keys::{EVENT_CHANNELS_BUCKET, Keyspace, classify};
use crate::discovery::records::{Record, parse_record};
use crate::event_bus::message::ZmqTcpTarget;
use crate::ids::Namespace;
use crate::kube::MAX_HELD_OBJECTS;
use crate::kube::objects::DynamoWorkerMetadata;

/// At most this many channels count per resource (a worker has one per topic and dp rank).
pub const MAX_ADVERTS_PER_RESOURCE: usize = 1024;

/// One dialable publisher: namespace, host, port, topic.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Advert {
    pub namespace: Namespace,
    pub host: String,
    pub port: u16,
    pub topic: &'static str,
}

impl Advert {
    pub fn of(target: &ZmqTcpTarget, topic: EventTopic) -> Self {
        Self {
            namespace: target.namespace.clone(),
            host: target.host.clone(),
            port: target.port,
            topic: topic.as_str(),
        }
    }
}

/// What one input changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Step {
    /// Channel records or resources skipped: malformed, unsupported, past a bound.
    pub ignored: usize,
}

/// The advertised set of one broker.
#[derive(Clone, Debug)]
pub struct Advertised {
    namespaces: Vec<Namespace>,
    by_resource: BTreeMap<String, BTreeSet<Advert>>,
    counts: BTreeMap<Advert, usize>,
}

impl Advertised {
    /// An empty set for the broker's declared Dynamo namespaces.
    pub fn new(namespaces: Vec<Namespace>) -> Self {
        Self {
            namespaces,
            by_resource: BTreeMap::new(),
            counts: BTreeMap::new(),
        }
    }

    /// Whether `target` on `topic` may be dialled.
    pub fn allows(&self, target: &ZmqTcpTarget, topic: EventTopic) -> bool {
        self.counts.contains_key(&Advert::of(target, topic))
    }

    /// Distinct advertised targets.
    pub fn len(&self) -> usize {
        self.counts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    /// Resources held.
    pub fn resources(&self) -> usize {
        self.by_resource.len()
    }

    /// A full relist replaces everything.
    pub fn relist(&mut self, resources: &[DynamoWorkerMetadata]) -> Step {
        self.by_resource.clear();
        self.counts.clear();
        let mut step = Step::default();
        for resource in resources {
            step.ignored += self.apply(resource).ignored;
        }
        step
    }

    /// An added or modified resource.
    pub fn apply(&mut self, resource: &DynamoWorkerMetadata) -> Step {
        let name = resource.metadata.name.clone();
        if !self.by_resource.contains_key(&name) && self.by_resource.len() >= MAX_HELD_OBJECTS {
            return Step { ignored: 1 };
        }
        let (adverts, ignored) = self.adverts_of(resource);
        self.remove(&name);
        for advert in &adverts {
            *self.counts.entry(advert.clone()).or_default() += 1;
        }
        self.by_resource.insert(name, adverts);
        Step { ignored }
    }

    /// A deleted resource.
    pub fn delete(&mut self, name: &str) {
        self.remove(name);
    }

    fn remove(&mut self, name: &str) {
        for advert in self.by_resource.remove(name).unwrap_or_default() {
            if let Some(count) = self.counts.get_mut(&advert) {
                *count -= 1;
                if *count == 0 {
                    self.counts.remove(&advert);
                }
            }
        }
    }

    fn adverts_of(&self, resource: &DynamoWorkerMetadata) -> (BTreeSet<Advert>, usize) {
        let mut adverts = BTreeSet::new();
        let mut ignored = 0;
        let Some(channels) = resource
            .spec
            .get("data")
            .and_then(|d| d.get("event_channels"))
            .and_then(serde_json::Value::as_object)
        else {
            return (adverts, ignored);
        };
        for (suffix, value) in channels {
            if adverts.len() >= MAX_ADVERTS_PER_RESOURCE {
                ignored += 1;
                continue;
            }
            let key = format!("{EVENT_CHANNELS_BUCKET}{suffix}");
            let found = self.namespaces.iter().find_map(|namespace| {
                match classify(namespace.as_str(), &key) {
                    Some((Keyspace::Channels, Ok(parsed))) => Some((namespace, parsed)),
                    _ => None,
                }
            });
            let Some((namespace, parsed)) = found else {
                // Another Dynamo namespace's channel, or a malformed key: not ours to dial.
                continue;
            };
            let Ok(bytes) = serde_json::to_vec(value) else {
                ignored += 1;
                continue;
            };
            match parse_record(&parsed, &bytes) {
                Ok(Record::Channel(channel)) => {
                    adverts.insert(Advert {
                        namespace: namespace.clone(),
                        host: channel.address.host,
                        port: channel.address.port,
                        topic: channel.topic.as_str(),
                    });
                }
                Ok(_) => {}
                Err(_) => ignored += 1,
            }
        }
        (adverts, ignored)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn channel(
        ns: &str,
        topic: &str,
        publisher: u64,
        endpoint: &str,
    ) -> (String, serde_json::Value) {
        (
            format!(
                "namespace/{ns}/component/backend/endpoint/generate/topic/{topic}/{publisher:x}"
            ),
            json!({"type": "EventChannel", "scope": {"kind": "endpoint", "endpoint":
                   {"namespace": ns, "component": "backend", "name": "generate"}},
                   "topic": topic, "instance_id": publisher,
                   "transport": {"kind": "Zmq", "config": {"endpoint": endpoint}}}),
        )
    }

    fn resource(name: &str, channels: &[(String, serde_json::Value)]) -> DynamoWorkerMetadata {
        let map: serde_json::Map<String, serde_json::Value> = channels.iter().cloned().collect();
        serde_json::from_value(json!({
            "metadata": {"name": name, "uid": format!("uid-{name}")},
            "spec": {"data": {"event_channels": map}}
        }))
        .expect("resource")
    }

    fn target(ns: &str, host: &str, port: u16) -> ZmqTcpTarget {
        ZmqTcpTarget {
            namespace: Namespace::new(ns),
            host: host.into(),
            port,
        }
    }

    #[test]
    fn only_channels_of_declared_namespaces_topics_and_endpoints_are_advertised() {
        let mut set = Advertised::new(vec![Namespace::new("dynamo")]);
        let step = set.relist(&[resource(
            "worker-0",
            &[
                channel("dynamo", "kv_metrics", 1, "tcp://10.0.0.5:5557"),
                channel("dynamo", "kv-events", 2, "tcp://10.0.0.5:5558"),
                channel("other", "kv_metrics", 3, "tcp://10.0.0.9:5557"),
                channel("dynamo", "kv_metrics", 4, "ipc:///tmp/x"),
            ],
        )]);
        assert_eq!(step.ignored, 1, "the ipc endpoint is refused");
        assert!(set.allows(&target("dynamo", "10.0.0.5", 5557), EventTopic::KvMetrics));
        assert!(set.allows(&target("dynamo", "10.0.0.5", 5558), EventTopic::KvEvents));
        assert!(!set.allows(&target("dynamo", "10.0.0.5", 5557), EventTopic::KvEvents));
        assert!(!set.allows(&target("dynamo", "10.0.0.5", 5559), EventTopic::KvMetrics));
        assert!(!set.allows(&target("other", "10.0.0.9", 5557), EventTopic::KvMetrics));
        assert!(!set.allows(&target("dynamo", "10.0.0.9", 5557), EventTopic::KvMetrics));
        assert_eq!(set.len(), 2);
    }

    #[test]
    fn a_shared_target_leaves_with_its_last_resource_and_updates_replace() {
        let shared = channel("dynamo", "kv_metrics", 1, "tcp://10.0.0.5:5557");
        let mut set = Advertised::new(vec![Namespace::new("dynamo")]);
        set.apply(&resource("a", std::slice::from_ref(&shared)));
        set.apply(&resource("b", std::slice::from_ref(&shared)));
        let t = target("dynamo", "10.0.0.5", 5557);
        set.delete("a");
        assert!(set.allows(&t, EventTopic::KvMetrics));
        // b moves to another port: the old one is gone.
        set.apply(&resource(
            "b",
            &[channel("dynamo", "kv_metrics", 1, "tcp://10.0.0.5:6000")],
        ));
        assert!(!set.allows(&t, EventTopic::KvMetrics));
        assert!(set.allows(&target("dynamo", "10.0.0.5", 6000), EventTopic::KvMetrics));
        set.delete("b");
        assert!(set.is_empty());
        assert_eq!(set.resources(), 0);
    }

    #[test]
    fn hostile_specs_are_ignored_without_panicking() {
        let mut set = Advertised::new(vec![Namespace::new("dynamo")]);
        for spec in [
            json!(null),
            json!("text"),
            json!({"data": 7}),
            json!({"data": {"event_channels": [1, 2]}}),
            json!({"data": {"event_channels": {"namespace/dynamo/topic/kv_metrics/zz": 5}}}),
        ] {
            let r: DynamoWorkerMetadata =
                serde_json::from_value(json!({"metadata": {"name": "x"}, "spec": spec}))
                    .expect("tolerant");
            set.apply(&r);
        }
        assert!(set.is_empty());
        let many: Vec<_> = (0..(MAX_ADVERTS_PER_RESOURCE as u64 + 5))
            .map(|i| {
                channel(
                    "dynamo",
                    "kv_metrics",
                    i + 1,
                    &format!("tcp://10.0.0.5:{}", 1000 + i),
                )
            })
            .collect();
        let step = set.apply(&resource("big", &many));
        assert_eq!(step.ignored, 5);
        assert_eq!(set.len(), MAX_ADVERTS_PER_RESOURCE);
    }
}
