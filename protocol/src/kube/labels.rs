//! Label and annotation names the Dynamo operator writes (wire §13.4), and the selectors built
//! from them.

use crate::ids::Namespace;

pub const DISCOVERY_BACKEND: &str = "nvidia.com/dynamo-discovery-backend";
pub const DISCOVERY_ENABLED: &str = "nvidia.com/dynamo-discovery-enabled";
pub const DYNAMO_NAMESPACE: &str = "nvidia.com/dynamo-namespace";
pub const COMPONENT: &str = "nvidia.com/dynamo-component";
pub const COMPONENT_TYPE: &str = "nvidia.com/dynamo-component-type";
pub const SUB_COMPONENT_TYPE: &str = "nvidia.com/dynamo-sub-component-type";
/// `container` marks upstream's per-container discovery mode, which this router refuses.
pub const DISCOVERY_MODE_ANNOTATION: &str = "nvidia.com/dynamo-kube-discovery-mode";

/// Selects the EndpointSlices (and Pods) of Kubernetes-discovery-enabled Dynamo components.
pub const DISCOVERY_SELECTOR: &str =
    "nvidia.com/dynamo-discovery-backend=kubernetes,nvidia.com/dynamo-discovery-enabled=true";

/// The Pod selector of the `kubernetes_pods` source: the discovery labels plus
/// `nvidia.com/dynamo-namespace=<ns>`, or `in (a,b)` when several namespaces are watched.
pub fn pod_selector(namespaces: &[Namespace]) -> String {
    match namespaces {
        [] => DISCOVERY_SELECTOR.to_owned(),
        [one] => format!("{DISCOVERY_SELECTOR},{DYNAMO_NAMESPACE}={}", one.as_str()),
        many => {
            let list: Vec<&str> = many.iter().map(Namespace::as_str).collect();
            format!(
                "{DISCOVERY_SELECTOR},{DYNAMO_NAMESPACE} in ({})",
                list.join(",")
            )
        }
    }
}

/// The EndpointSlice selector of the metadata source (wire §13.5).
pub fn endpoint_slice_selector() -> &'static str {
    DISCOVERY_SELECTOR
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_namespace_uses_equality() {
        assert_eq!(
            pod_selector(&[Namespace::new("dynamo-solar-pro4")]),
            "nvidia.com/dynamo-discovery-backend=kubernetes,nvidia.com/dynamo-discovery-enabled=true,\
             nvidia.com/dynamo-namespace=dynamo-solar-pro4"
        );
    }

    #[test]
    fn several_namespaces_use_set_membership() {
        assert_eq!(
            pod_selector(&[Namespace::new("a"), Namespace::new("b")]),
            "nvidia.com/dynamo-discovery-backend=kubernetes,nvidia.com/dynamo-discovery-enabled=true,\
             nvidia.com/dynamo-namespace in (a,b)"
        );
    }

    #[test]
    fn slices_use_the_discovery_labels_only() {
        assert_eq!(
            endpoint_slice_selector(),
            "nvidia.com/dynamo-discovery-backend=kubernetes,nvidia.com/dynamo-discovery-enabled=true"
        );
    }
}
