//! The Kubernetes deployment assets: Kustomize base and overlays (rendered with `kubectl kustomize`
//! when kubectl is installed, else checked file by file) and the Helm chart's values and templates
//! (helm is not installable here, so templates are checked after stripping template actions).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn yaml_docs(text: &str) -> Vec<Value> {
    serde_saphyr::from_multiple::<Value>(text)
        .unwrap_or_else(|e| panic!("invalid YAML: {e}\n{text}"))
        .into_iter()
        .filter(|v| !v.is_null())
        .collect()
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable dir").flatten() {
        let p = entry.path();
        if p.is_dir() {
            yaml_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "yaml") {
            out.push(p);
        }
    }
}

fn find<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == json!(kind))
        .unwrap_or_else(|| panic!("no {kind} in {docs:?}"))
}

fn reader_rule(group: &str, resource: &str) -> Value {
    json!({"apiGroups": [group], "resources": [resource], "verbs": ["get", "list", "watch"]})
}

#[test]
fn every_kustomize_file_is_valid_yaml() {
    let mut files = Vec::new();
    yaml_files(&root().join("deploy/kubernetes"), &mut files);
    assert_eq!(files.len(), 6, "{files:?}");
    for f in files {
        let text = std::fs::read_to_string(&f).expect("readable");
        assert!(!yaml_docs(&text).is_empty(), "{}", f.display());
    }
}

#[test]
fn the_base_service_account_mounts_no_token() {
    let docs = yaml_docs(&read("deploy/kubernetes/base/serviceaccount.yaml"));
    let sa = find(&docs, "ServiceAccount");
    assert_eq!(sa["metadata"]["name"], json!("continuum-router"));
    assert_eq!(sa["automountServiceAccountToken"], json!(false));
}

/// `kubectl kustomize <overlay>` when kubectl is installed (it renders offline).
fn kustomize(overlay: &str) -> Option<Vec<Value>> {
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(root().join("deploy/kubernetes/overlays").join(overlay))
        .output()
        .ok()?;
    assert!(
        out.status.success(),
        "kubectl kustomize {overlay} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(yaml_docs(&String::from_utf8(out.stdout).expect("UTF-8")))
}

#[test]
fn the_pod_discovery_overlay_grants_only_pod_reads_in_the_fleet_namespace() {
    let role_docs = yaml_docs(&read(
        "deploy/kubernetes/overlays/dynamo-pod-discovery/role.yaml",
    ));
    let role = find(&role_docs, "Role");
    assert_eq!(
        role["metadata"]["name"],
        json!("continuum-router-dynamo-pod-reader")
    );
    assert_eq!(role["metadata"]["namespace"], json!("dynamo"));
    assert_eq!(role["rules"], json!([reader_rule("", "pods")]));
    let Some(docs) = kustomize("dynamo-pod-discovery") else {
        return;
    };
    assert_eq!(
        find(&docs, "Role")["rules"],
        json!([reader_rule("", "pods")])
    );
    assert_eq!(
        find(&docs, "ServiceAccount")["automountServiceAccountToken"],
        json!(true)
    );
    let binding = find(&docs, "RoleBinding");
    assert_eq!(
        binding["roleRef"]["name"],
        json!("continuum-router-dynamo-pod-reader")
    );
    assert_eq!(
        binding["subjects"],
        json!([{"kind": "ServiceAccount", "name": "continuum-router", "namespace": "continuum-router"}])
    );
}

#[test]
fn the_metadata_overlay_adds_worker_metadata_and_endpoint_slices() {
    let patch = read("deploy/kubernetes/overlays/dynamo-metadata-discovery/kustomization.yaml");
    assert!(patch.contains("dynamoworkermetadatas") && patch.contains("endpointslices"));
    let Some(docs) = kustomize("dynamo-metadata-discovery") else {
        return;
    };
    assert_eq!(
        find(&docs, "Role")["rules"],
        json!([
            reader_rule("", "pods"),
            reader_rule("nvidia.com", "dynamoworkermetadatas"),
            reader_rule("discovery.k8s.io", "endpointslices"),
        ])
    );
    assert_eq!(
        find(&docs, "ServiceAccount")["automountServiceAccountToken"],
        json!(true)
    );
}

const CHART: &str = "deploy/helm/continuum-router";

#[test]
fn the_chart_metadata_and_defaults() {
    let chart = &yaml_docs(&read(&format!("{CHART}/Chart.yaml")))[0];
    assert_eq!(chart["apiVersion"], json!("v2"));
    assert_eq!(chart["name"], json!("continuum-router"));
    let values = &yaml_docs(&read(&format!("{CHART}/values.yaml")))[0];
    assert_eq!(
        values["dynamoPodDiscovery"],
        json!({"enabled": false, "namespace": "dynamo", "metadata": false,
               "apiServerPorts": [443, 6443]})
    );
    assert_eq!(
        values["networkPolicy"],
        json!({"enabled": false, "additionalEgress": []})
    );
}

/// A template with its actions removed: control lines dropped (so every branch is kept) and
/// inline expressions replaced by a placeholder. What is left must be valid YAML.
fn stripped(template: &str) -> Vec<Value> {
    let mut out = String::new();
    for line in template.lines() {
        if line.trim_start().starts_with("{{") {
            continue;
        }
        let mut rest = line;
        while let Some(start) = rest.find("{{") {
            out.push_str(&rest[..start]);
            out.push_str("placeholder");
            rest = rest[start..]
                .find("}}")
                .map_or("", |end| &rest[start + end + 2..]);
        }
        out.push_str(rest);
        out.push('\n');
    }
    yaml_docs(&out)
}

#[test]
fn the_chart_rbac_is_gated_and_lists_the_reader_rules() {
    let text = read(&format!("{CHART}/templates/dynamo-pod-discovery-rbac.yaml"));
    assert!(text.starts_with("{{- if .Values.dynamoPodDiscovery.enabled }}"));
    assert!(text.contains("{{- if .Values.dynamoPodDiscovery.metadata }}"));
    assert_eq!(
        text.matches("namespace: {{ .Values.dynamoPodDiscovery.namespace }}")
            .count(),
        2,
        "Role and RoleBinding live in the fleet's namespace"
    );
    let docs = stripped(&text);
    let role = find(&docs, "Role");
    assert_eq!(
        role["metadata"]["name"],
        json!("continuum-router-dynamo-pod-reader")
    );
    assert_eq!(
        role["rules"],
        json!([
            reader_rule("", "pods"),
            reader_rule("nvidia.com", "dynamoworkermetadatas"),
            reader_rule("discovery.k8s.io", "endpointslices"),
        ])
    );
    // Only the two metadata rules sit inside the `metadata` gate.
    let gated = text
        .split("{{- if .Values.dynamoPodDiscovery.metadata }}")
        .nth(1)
        .and_then(|t| t.split("{{- end }}").next())
        .expect("metadata block");
    assert!(!gated.contains("pods") && gated.contains("endpointslices"));
    assert_eq!(find(&docs, "RoleBinding")["roleRef"]["kind"], json!("Role"));
}

#[test]
fn the_chart_mounts_the_token_only_for_discovery() {
    for file in ["serviceaccount.yaml", "deployment.yaml"] {
        let text = read(&format!("{CHART}/templates/{file}"));
        assert!(
            text.contains("automountServiceAccountToken: {{ .Values.dynamoPodDiscovery.enabled }}"),
            "{file}"
        );
        assert!(!stripped(&text).is_empty(), "{file}");
    }
}

#[test]
fn the_chart_network_policy_opens_the_api_server_ports() {
    let text = read(&format!("{CHART}/templates/networkpolicy.yaml"));
    assert!(text.starts_with("{{- if .Values.networkPolicy.enabled }}"));
    assert!(text.contains(
        "{{- if and .Values.dynamoPodDiscovery.enabled .Values.dynamoPodDiscovery.apiServerPorts }}"
    ));
    assert!(text.contains("{{- range .Values.dynamoPodDiscovery.apiServerPorts }}"));
    assert!(text.contains("{{- with .Values.networkPolicy.additionalEgress }}"));
    let docs = stripped(&text);
    let policy = find(&docs, "NetworkPolicy");
    assert_eq!(policy["spec"]["policyTypes"], json!(["Egress"]));
    let egress = policy["spec"]["egress"].as_array().expect("egress rules");
    assert_eq!(egress.len(), 2, "DNS plus the API server ports");
}
