//! Label and annotation names the Dynamo operator writes (wire §13.4), and the selectors built
//! from them.

use crate::ids::Namespace;

/// RFC 1123 label (a Kubernetes namespace name): 1–63 of `[a-z0-9-]`, alphanumeric at both ends.
/// The one copy of this rule: config validation uses it too.
pub fn is_dns1123_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
}

/// A non-empty Kubernetes label value: 1–63 of `[A-Za-z0-9-_.]`, alphanumeric at both ends.
pub fn is_label_value(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
}

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
    fn kubernetes_name_rules() {
        for bad in ["", "Dynamo", "-x", "x-", "a_b", &"a".repeat(64)] {
            assert!(!is_dns1123_label(bad), "{bad:?}");
        }
        assert!(is_dns1123_label("kbm-g-np-kt-a"));
        assert!(is_dns1123_label(&"a".repeat(63)));
        for bad in ["", "with space", "-x", "x.", &"a".repeat(64)] {
            assert!(!is_label_value(bad), "{bad:?}");
        }
        assert!(is_label_value("Dyn.ns_1"));
    }

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
