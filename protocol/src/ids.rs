//! Identifier newtypes. A bare `u64` never crosses a module boundary.
//!
//! Dynamo's instance id is an etcd lease id (or `hash_pod_name` on Kubernetes); the same number is
//! the worker id inside ActiveLoad and kv-events payloads. Upstream writes it as a JSON number in
//! values, as lowercase hex in key suffixes, and the direct-mode frontend wants it in decimal.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A worker's instance id (== its worker id in load and KV payloads).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct InstanceId(pub u64);

impl InstanceId {
    /// Lowercase hex without a prefix, as in etcd key suffixes and the admin API.
    pub fn hex(self) -> String {
        format!("{:x}", self.0)
    }

    /// Decimal, as the direct-mode frontend and `GET /health` want it.
    pub fn decimal(self) -> String {
        self.0.to_string()
    }

    /// Parses lowercase or uppercase hex, with or without `0x`.
    pub fn from_hex(text: &str) -> Option<Self> {
        let digits = text
            .strip_prefix("0x")
            .or_else(|| text.strip_prefix("0X"))
            .unwrap_or(text);
        if digits.is_empty() || digits.len() > 16 {
            return None;
        }
        u64::from_str_radix(digits, 16).ok().map(Self)
    }
}

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:x}", self.0)
    }
}

/// An event-plane publisher incarnation (`EventChannel.instance_id`), not a worker id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PublisherId(pub u64);

impl fmt::Display for PublisherId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A data-parallel rank of one worker.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct DpRank(pub u32);

impl fmt::Display for DpRank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A Dynamo namespace (`DYN_NAMESPACE`), always taken from the watched prefix or label.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Namespace(pub String);

impl Namespace {
    pub fn new(name: impl Into<String>) -> Self {
        Self(name.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A worker's identity across namespaces: upstream ids are unique only within one graph.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct WorkerKey {
    pub namespace: Namespace,
    pub instance_id: InstanceId,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_and_decimal_forms_round_trip() {
        let id = InstanceId(7_668_682_573_600_862_486);
        assert_eq!(id.hex(), "6a6ca22b96b53116");
        assert_eq!(id.decimal(), "7668682573600862486");
        assert_eq!(InstanceId::from_hex("6a6ca22b96b53116"), Some(id));
        assert_eq!(InstanceId::from_hex("0x6A6CA22B96B53116"), Some(id));
        assert_eq!(InstanceId::from_hex(""), None);
        assert_eq!(InstanceId::from_hex("10000000000000000"), None);
        assert_eq!(InstanceId::from_hex("xyz"), None);
    }
}
