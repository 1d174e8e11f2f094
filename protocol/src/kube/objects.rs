//! Minimal, tolerant serde views of the Kubernetes objects the sources read.
//!
//! `protocol` must not depend on `kube` or `k8s-openapi`, so these mirror only the fields the
//! classification rules look at. Unknown fields are ignored and `null` reads as empty, because
//! these are external input: a field the apiserver omits must never fail a whole list.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer};

fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// `metadata` of any object.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default, rename_all = "camelCase")]
pub struct ObjectMeta {
    #[serde(deserialize_with = "null_as_default")]
    pub name: String,
    #[serde(deserialize_with = "null_as_default")]
    pub uid: String,
    pub resource_version: Option<String>,
    #[serde(deserialize_with = "null_as_default")]
    pub labels: BTreeMap<String, String>,
    #[serde(deserialize_with = "null_as_default")]
    pub annotations: BTreeMap<String, String>,
    pub deletion_timestamp: Option<String>,
    #[serde(deserialize_with = "null_as_default")]
    pub owner_references: Vec<OwnerReference>,
}

/// One `metadata.ownerReferences` entry.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default, rename_all = "camelCase")]
pub struct OwnerReference {
    #[serde(deserialize_with = "null_as_default")]
    pub kind: String,
    #[serde(deserialize_with = "null_as_default")]
    pub name: String,
    #[serde(deserialize_with = "null_as_default")]
    pub uid: String,
}

/// A core/v1 Pod, reduced to what membership and readiness need.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct Pod {
    #[serde(deserialize_with = "null_as_default")]
    pub metadata: ObjectMeta,
    #[serde(deserialize_with = "null_as_default")]
    pub status: PodStatus,
}

/// `status` of a Pod.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct PodStatus {
    pub phase: Option<String>,
    #[serde(deserialize_with = "null_as_default")]
    pub conditions: Vec<PodCondition>,
}

/// One `status.conditions` entry.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct PodCondition {
    #[serde(rename = "type", deserialize_with = "null_as_default")]
    pub type_: String,
    #[serde(deserialize_with = "null_as_default")]
    pub status: String,
}

/// A discovery.k8s.io/v1 EndpointSlice, reduced to endpoint readiness and targets.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct EndpointSlice {
    #[serde(deserialize_with = "null_as_default")]
    pub metadata: ObjectMeta,
    #[serde(deserialize_with = "null_as_default")]
    pub endpoints: Vec<Endpoint>,
}

/// One endpoint of a slice.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default, rename_all = "camelCase")]
pub struct Endpoint {
    #[serde(deserialize_with = "null_as_default")]
    pub conditions: EndpointConditions,
    pub target_ref: Option<ObjectReference>,
}

/// `conditions` of an endpoint; `ready: null` means unknown, which upstream treats as not ready.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct EndpointConditions {
    pub ready: Option<bool>,
}

/// An endpoint's `targetRef`.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct ObjectReference {
    pub kind: Option<String>,
    #[serde(deserialize_with = "null_as_default")]
    pub name: String,
    pub uid: Option<String>,
}

/// A nvidia.com/v1alpha1 DynamoWorkerMetadata. `spec` stays raw: its shape is checked by
/// [`crate::kube::metadata`], which must count a non-object spec rather than fail to decode it.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(default)]
pub struct DynamoWorkerMetadata {
    #[serde(deserialize_with = "null_as_default")]
    pub metadata: ObjectMeta,
    pub spec: serde_json::Value,
}

impl Pod {
    /// Running, `Ready=True` and not being deleted.
    pub fn is_ready(&self) -> bool {
        self.metadata.deletion_timestamp.is_none()
            && self.status.phase.as_deref() == Some("Running")
            && self
                .status
                .conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nulls_and_missing_fields_read_as_empty() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "labels": null, "annotations": null, "ownerReferences": null},
            "status": {"conditions": null}
        }))
        .expect("tolerant");
        assert_eq!(pod.metadata.name, "p");
        assert!(pod.metadata.labels.is_empty());
        assert!(!pod.is_ready());
        let slice: EndpointSlice =
            serde_json::from_value(serde_json::json!({"metadata": null, "endpoints": null}))
                .expect("tolerant");
        assert!(slice.endpoints.is_empty());
    }
}
