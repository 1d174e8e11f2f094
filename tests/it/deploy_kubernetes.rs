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
    assert_eq!(files.len(), 25, "{files:?}");
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

// ---- The router config, probes, ports and security context of both packagings. ----

const BIN: &str = env!("CARGO_BIN_EXE_continuum-router");
/// Values for every secret variable the packaged configs read.
const SECRET_ENV: &[(&str, &str)] = &[
    ("ROUTER_ADMIN_TOKEN", "an-admin-token-of-at-least-32-chars"),
    ("CLIENT_API_KEY", "client-key"),
    ("ETCD_PASSWORD", "etcd-password"),
];
/// Where both packagings mount Secrets; config paths below it must be mounted.
const SECRET_ROOT: &str = "/etc/continuum-router-secrets/";

/// `continuum-router config validate` on `text` with the secret variables set: must exit 0.
fn assert_config_validates(what: &str, text: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("router.yaml");
    std::fs::write(&path, text).expect("write config");
    let mut command = Command::new(BIN);
    command.args(["config", "validate", "--config"]).arg(&path);
    for (name, value) in SECRET_ENV {
        command.env(name, value);
    }
    let out = command.output().expect("run config validate");
    assert!(
        out.status.success(),
        "{what}: config validate failed:\n{}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The `${NAME}` references in `text` (`$${` is a literal).
fn env_refs(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("${") {
        let escaped = at > 0 && rest.as_bytes()[at - 1] == b'$';
        let tail = &rest[at + 2..];
        let end = tail.find('}').unwrap_or(tail.len());
        if !escaped {
            out.push(tail[..end].to_string());
        }
        rest = &tail[end..];
    }
    out.sort();
    out.dedup();
    out
}

/// Every string in `value` that names a file under [`SECRET_ROOT`].
fn secret_paths(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::String(s) if s.starts_with(SECRET_ROOT) => out.push(s.clone()),
        Value::Array(items) => items.iter().for_each(|v| secret_paths(v, out)),
        Value::Object(map) => map.values().for_each(|v| secret_paths(v, out)),
        _ => {}
    }
}

fn port_of(address: &str) -> u64 {
    address
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {address:?}"))
}

/// What a rendered Deployment must hold, given the router config it mounts.
fn assert_hardened_deployment(what: &str, deployment: &Value, config: &Value) {
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(
        pod["securityContext"]["runAsNonRoot"],
        json!(true),
        "{what}"
    );
    assert_ne!(pod["securityContext"]["runAsUser"], json!(0), "{what}");
    let container = &pod["containers"][0];
    let security = &container["securityContext"];
    assert_eq!(security["readOnlyRootFilesystem"], json!(true), "{what}");
    assert_eq!(security["allowPrivilegeEscalation"], json!(false), "{what}");
    assert_eq!(security["capabilities"]["drop"], json!(["ALL"]), "{what}");
    assert!(container["resources"]["requests"].is_object(), "{what}");
    assert_eq!(
        container["livenessProbe"]["httpGet"],
        json!({"path": "/health", "port": "http"}),
        "{what}"
    );
    assert_eq!(
        container["readinessProbe"]["httpGet"],
        json!({"path": "/ready", "port": "http"}),
        "{what}"
    );
    let ports = container["ports"].as_array().expect("ports");
    let port = |name: &str| {
        ports
            .iter()
            .find(|p| p["name"] == json!(name))
            .map(|p| p["containerPort"].as_u64().expect("numeric containerPort"))
    };
    let bind = config["server"]["bind_address"]
        .as_str()
        .expect("bind_address");
    assert!(
        !bind.starts_with("127."),
        "{what}: a Pod must not bind loopback"
    );
    assert_eq!(port("http"), Some(port_of(bind)), "{what}");
    let bus = &config["dynamo"]["event_bus"];
    if bus["enabled"] == json!(true) {
        let listen = bus["listen"].as_str().unwrap_or("0.0.0.0:7443");
        assert_eq!(port("bus"), Some(port_of(listen)), "{what}");
    } else {
        assert_eq!(port("bus"), None, "{what}");
    }
    // Every secret variable of the config comes from a Secret, and every secret file is mounted.
    let text = serde_json::to_string(config).expect("JSON");
    let env: Vec<&str> = container["env"]
        .as_array()
        .map(|e| e.iter().filter_map(|v| v["name"].as_str()).collect())
        .unwrap_or_default();
    for var in env_refs(&text) {
        assert!(env.contains(&var.as_str()), "{what}: ${{{var}}} is not set");
    }
    let mounts: Vec<&str> = container["volumeMounts"]
        .as_array()
        .expect("mounts")
        .iter()
        .filter_map(|m| m["mountPath"].as_str())
        .collect();
    let mut files = Vec::new();
    secret_paths(config, &mut files);
    for file in files {
        assert!(
            mounts.iter().any(|m| file.starts_with(&format!("{m}/"))),
            "{what}: {file} is not under a mounted Secret ({mounts:?})"
        );
    }
    assert!(mounts.contains(&"/etc/continuum-router"), "{what}");
    // The KV artifact cache must be writable on a read-only root fs.
    let cache = config["dynamo"]["kv"]["artifact_cache_dir"]
        .as_str()
        .unwrap_or("/var/cache/continuum-router/kv-artifacts");
    assert!(
        mounts
            .iter()
            .any(|m| *m != "/etc/continuum-router" && cache.starts_with(m)),
        "{what}: {cache} is not on a writable volume"
    );
}

#[test]
fn every_kustomization_renders_a_hardened_router_with_a_valid_config() {
    let cases = [
        ("base", "deploy/kubernetes/base", "etcd", false),
        (
            "pod discovery",
            "deploy/kubernetes/overlays/dynamo-pod-discovery",
            "kubernetes_pods",
            false,
        ),
        (
            "metadata discovery",
            "deploy/kubernetes/overlays/dynamo-metadata-discovery",
            "kubernetes",
            false,
        ),
        (
            "event bus",
            "deploy/kubernetes/overlays/event-bus",
            "etcd",
            true,
        ),
    ];
    for (what, dir, source, bus) in cases {
        let Some(out) = Command::new("kubectl")
            .arg("kustomize")
            .arg(root().join(dir))
            .output()
            .ok()
        else {
            return;
        };
        assert!(
            out.status.success(),
            "{what}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let docs = yaml_docs(&String::from_utf8(out.stdout).expect("UTF-8"));
        let map = find(&docs, "ConfigMap");
        let text = map["data"]["router.yaml"].as_str().expect("router.yaml");
        assert_config_validates(what, text);
        let config = &yaml_docs(text)[0];
        assert_eq!(
            config["dynamo"]["discovery"]["source"],
            json!(source),
            "{what}"
        );
        assert_eq!(
            config["dynamo"]["event_bus"]["enabled"] == json!(true),
            bus,
            "{what}"
        );
        let deployment = find(&docs, "Deployment");
        assert_hardened_deployment(what, deployment, config);
        let volumes = deployment["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .expect("volumes");
        let config_volume = volumes
            .iter()
            .find(|v| v["name"] == json!("config"))
            .expect("config volume");
        assert_eq!(
            config_volume["configMap"]["name"], map["metadata"]["name"],
            "{what}: the Deployment mounts the generated ConfigMap"
        );
        let service = find(&docs, "Service");
        let service_ports: Vec<&Value> = service["spec"]["ports"]
            .as_array()
            .expect("ports")
            .iter()
            .collect();
        assert!(
            service_ports
                .iter()
                .any(|p| p["targetPort"] == json!("http")),
            "{what}"
        );
        assert_eq!(
            service_ports
                .iter()
                .any(|p| p["targetPort"] == json!("bus")),
            bus,
            "{what}"
        );
        let pdb = find(&docs, "PodDisruptionBudget");
        assert_eq!(
            pdb["spec"]["selector"]["matchLabels"], deployment["spec"]["selector"]["matchLabels"],
            "{what}"
        );
    }
}

/// Helm's values merge: maps merge key by key, `null` deletes, anything else replaces.
fn merge(base: &mut Value, over: &Value) {
    match (base, over) {
        (Value::Object(base), Value::Object(over)) => {
            for (key, value) in over {
                if value.is_null() {
                    base.remove(key);
                } else if let Some(slot) = base.get_mut(key) {
                    merge(slot, value);
                } else {
                    base.insert(key.clone(), value.clone());
                }
            }
        }
        (base, over) => *base = over.clone(),
    }
}

/// The chart's values, alone and merged with each `ci/*-values.yaml`.
fn chart_value_sets() -> Vec<(String, Value)> {
    let defaults = yaml_docs(&read(&format!("{CHART}/values.yaml"))).remove(0);
    let mut sets = vec![("values.yaml".to_string(), defaults.clone())];
    let mut files: Vec<_> = std::fs::read_dir(root().join(CHART).join("ci"))
        .expect("ci values")
        .flatten()
        .map(|e| e.path())
        .collect();
    files.sort();
    assert!(files.len() >= 3, "{files:?}");
    for file in files {
        let over = yaml_docs(&std::fs::read_to_string(&file).expect("read")).remove(0);
        let mut merged = defaults.clone();
        merge(&mut merged, &over);
        sets.push((
            file.file_name().expect("name").to_string_lossy().into(),
            merged,
        ));
    }
    sets
}

/// The Deployment the chart renders for `values`, built the way the templates build it (the
/// templates are checked against this shape below; helm itself is not installable here).
fn chart_deployment(values: &Value) -> Value {
    let secrets = &values["secrets"];
    let mut env = vec![json!({"name": "POD_NAME"})];
    if secrets["adminToken"]["secretName"]
        .as_str()
        .is_some_and(|s| !s.is_empty())
    {
        env.push(json!({"name": "ROUTER_ADMIN_TOKEN"}));
    }
    for key in secrets["apiKeys"].as_array().into_iter().flatten() {
        env.push(json!({"name": key["env"]}));
    }
    if secrets["etcd"]["passwordSecretName"]
        .as_str()
        .is_some_and(|s| !s.is_empty())
    {
        env.push(json!({"name": "ETCD_PASSWORD"}));
    }
    let config = &values["config"];
    let mut ports = vec![
        json!({"name": "http", "containerPort": port_of(config["server"]["bind_address"].as_str().unwrap_or("127.0.0.1:8080"))}),
    ];
    let bus = &config["dynamo"]["event_bus"];
    if bus["enabled"] == json!(true) {
        ports.push(json!({"name": "bus", "containerPort": port_of(bus["listen"].as_str().unwrap_or("0.0.0.0:7443"))}));
    }
    let mut mounts = vec![
        json!({"mountPath": "/etc/continuum-router"}),
        json!({"mountPath": "/var/cache/continuum-router"}),
        json!({"mountPath": "/tmp"}),
    ];
    if secrets["etcd"]["tlsSecretName"]
        .as_str()
        .is_some_and(|s| !s.is_empty())
    {
        mounts.push(json!({"mountPath": "/etc/continuum-router-secrets/etcd-tls"}));
    }
    if secrets["eventBusTls"]["secretName"]
        .as_str()
        .is_some_and(|s| !s.is_empty())
    {
        mounts.push(json!({"mountPath": "/etc/continuum-router-secrets/bus-tls"}));
    }
    for (key, path) in [
        (
            "credentialsSecretName",
            "/etc/continuum-router-secrets/nats-creds",
        ),
        ("tlsSecretName", "/etc/continuum-router-secrets/nats-tls"),
    ] {
        if secrets["nats"][key].as_str().is_some_and(|s| !s.is_empty()) {
            mounts.push(json!({"mountPath": path}));
        }
    }
    let probe = |p: &Value| json!({"httpGet": {"path": p["path"], "port": "http"}});
    json!({"spec": {"template": {"spec": {
        "securityContext": values["podSecurityContext"],
        "containers": [{
            "securityContext": values["securityContext"],
            "resources": values["resources"],
            "livenessProbe": probe(&values["probes"]["liveness"]),
            "readinessProbe": probe(&values["probes"]["readiness"]),
            "ports": ports,
            "env": env,
            "volumeMounts": mounts,
        }],
    }}}})
}

#[test]
fn the_chart_runs_several_replicas_sharing_in_flight_state_over_nats() {
    let (_, values) = chart_value_sets()
        .into_iter()
        .find(|(name, _)| name == "replica-sync-values.yaml")
        .expect("the replica-sync value set");
    assert_eq!(values["replicaCount"], json!(3));
    assert_eq!(values["config"]["replica_sync"]["enabled"], json!(true));
    assert!(
        read(&format!("{CHART}/templates/deployment.yaml"))
            .contains("replicas: {{ .Values.replicaCount }}")
    );
    let deployment = chart_deployment(&values);
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    assert!(
        container["env"]
            .as_array()
            .is_some_and(|e| e.iter().any(|v| v["name"] == "POD_NAME")),
        "each replica's id is its Pod name"
    );
    let mounts = container["volumeMounts"].to_string();
    for path in [
        "/etc/continuum-router-secrets/nats-creds",
        "/etc/continuum-router-secrets/nats-tls",
    ] {
        assert!(mounts.contains(path), "{path} in {mounts}");
    }
}

#[test]
fn every_chart_value_set_renders_a_valid_config_and_a_hardened_router() {
    for (what, values) in chart_value_sets() {
        let config = &values["config"];
        let text = serde_saphyr::to_string(config).expect("YAML");
        assert_config_validates(&what, &text);
        assert_hardened_deployment(&what, &chart_deployment(&values), config);
    }
}

#[test]
fn the_chart_templates_build_what_the_checks_assume() {
    let configmap = read(&format!("{CHART}/templates/configmap.yaml"));
    assert!(configmap.contains("router.yaml: |\n    {{- toYaml .Values.config | nindent 4 }}"));
    let deployment = read(&format!("{CHART}/templates/deployment.yaml"));
    for needle in [
        "- /etc/continuum-router/router.yaml",
        "containerPort: {{ include \"continuum-router.httpPort\" . }}",
        "{{- if include \"continuum-router.busEnabled\" . }}\n            - name: bus\n              containerPort: {{ include \"continuum-router.busPort\" . }}",
        "{{- if .secretName }}\n            - name: ROUTER_ADMIN_TOKEN",
        "{{- range .Values.secrets.apiKeys }}\n            - name: {{ .env }}",
        "{{- if .Values.secrets.etcd.passwordSecretName }}\n            - name: ETCD_PASSWORD",
        "path: {{ .Values.probes.liveness.path }}\n              port: http",
        "path: {{ .Values.probes.readiness.path }}\n              port: http",
        "{{- toYaml .Values.podSecurityContext | nindent 8 }}",
        "{{- toYaml .Values.securityContext | nindent 12 }}",
        "{{- toYaml .Values.resources | nindent 12 }}",
        "mountPath: /etc/continuum-router\n",
        "mountPath: /var/cache/continuum-router\n",
        "{{- if .Values.secrets.etcd.tlsSecretName }}\n            - name: etcd-tls\n              mountPath: /etc/continuum-router-secrets/etcd-tls",
        "{{- if .Values.secrets.eventBusTls.secretName }}\n            - name: bus-tls\n              mountPath: /etc/continuum-router-secrets/bus-tls",
        "{{- if .Values.secrets.nats.credentialsSecretName }}\n            - name: nats-creds\n              mountPath: /etc/continuum-router-secrets/nats-creds",
        "{{- if .Values.secrets.nats.tlsSecretName }}\n            - name: nats-tls\n              mountPath: /etc/continuum-router-secrets/nats-tls",
        "- name: POD_NAME\n              valueFrom:\n                fieldRef:\n                  fieldPath: metadata.name",
    ] {
        assert!(
            deployment.contains(needle),
            "deployment.yaml lacks {needle:?}"
        );
    }
    let helpers = read(&format!("{CHART}/templates/_helpers.tpl"));
    assert!(helpers.contains(r#"dig "dynamo" "event_bus" "enabled" false .Values.config"#));
    assert!(helpers.contains(
        r#"dig "dynamo" "event_bus" "listen" "0.0.0.0:7443" .Values.config | splitList ":" | last"#
    ));
    assert!(helpers.contains(
        r#"dig "server" "bind_address" "127.0.0.1:8080" .Values.config | splitList ":" | last"#
    ));
    let service = read(&format!("{CHART}/templates/service.yaml"));
    assert!(service.contains("{{- if include \"continuum-router.busEnabled\" . }}"));
    let docs = stripped(&service);
    let ports = find(&docs, "Service")["spec"]["ports"]
        .as_array()
        .expect("ports")
        .clone();
    assert_eq!(ports.len(), 2, "http and the gated bus port");
    let pdb = read(&format!("{CHART}/templates/poddisruptionbudget.yaml"));
    assert!(pdb.starts_with("{{- if .Values.podDisruptionBudget.enabled }}"));
    assert!(!stripped(&pdb).is_empty());
    let monitor = read(&format!("{CHART}/templates/servicemonitor.yaml"));
    assert!(monitor.starts_with("{{- if .Values.serviceMonitor.enabled }}"));
    let docs = stripped(&monitor);
    assert_eq!(
        find(&docs, "ServiceMonitor")["spec"]["endpoints"][0]["path"],
        json!("/metrics")
    );
    for file in ["configmap.yaml", "deployment.yaml"] {
        assert!(
            !stripped(&read(&format!("{CHART}/templates/{file}"))).is_empty(),
            "{file}"
        );
    }
    // Every block action is closed (what helm would refuse to parse first).
    for entry in std::fs::read_dir(root().join(CHART).join("templates")).expect("templates") {
        let path = entry.expect("entry").path();
        let text = std::fs::read_to_string(&path).expect("read");
        let (open, close) = template_blocks(&text);
        assert_eq!(
            open,
            close,
            "{}: {open} blocks opened, {close} ended",
            path.display()
        );
    }
    assert_eq!(
        template_blocks("{{- if a }}{{ with b }}x{{ end }}{{- end -}}"),
        (2, 2)
    );
    assert_eq!(
        template_blocks("{{ if a }}{{ else if b }}{{ end }}"),
        (1, 1)
    );
    assert_eq!(template_blocks("{{- range .x }}"), (1, 0));
}

/// `(blocks opened, blocks ended)` in a Go template: `if`, `range`, `with`, `define`, `block`
/// open one (`else if` does not), `end` closes one. Comments are skipped.
fn template_blocks(text: &str) -> (usize, usize) {
    let (mut open, mut close) = (0, 0);
    let mut rest = text;
    while let Some(start) = rest.find("{{") {
        let after = &rest[start + 2..];
        let end = after.find("}}").unwrap_or(after.len());
        let action = after[..end].trim_start_matches('-').trim();
        let word = action.split_whitespace().next().unwrap_or("");
        if !action.starts_with("/*") {
            match word {
                "if" | "range" | "with" | "define" | "block" => open += 1,
                "end" => close += 1,
                _ => {}
            }
        }
        rest = &after[end..];
    }
    (open, close)
}

/// The subset of JSON Schema `values.schema.json` uses: type, properties, required,
/// additionalProperties (false), items, enum, minimum, maximum, minLength, pattern (prefix `^/`
/// and the env-name pattern only).
fn schema_errors(schema: &Value, value: &Value, path: &str, out: &mut Vec<String>) {
    let type_ok = |t: &str| match t {
        "object" => value.is_object(),
        "array" => value.is_array(),
        "string" => value.is_string(),
        "boolean" => value.is_boolean(),
        "integer" => value.is_i64() || value.is_u64(),
        "number" => value.is_number(),
        _ => false,
    };
    match &schema["type"] {
        Value::String(t) if !type_ok(t) => out.push(format!("{path}: not {t}")),
        Value::Array(ts) if !ts.iter().any(|t| type_ok(t.as_str().unwrap_or(""))) => {
            out.push(format!("{path}: not one of {ts:?}"))
        }
        _ => {}
    }
    if let Some(options) = schema["enum"].as_array()
        && !options.contains(value)
    {
        out.push(format!("{path}: {value} not in {options:?}"));
    }
    if let (Some(min), Some(v)) = (schema["minimum"].as_f64(), value.as_f64())
        && v < min
    {
        out.push(format!("{path}: below {min}"));
    }
    if let (Some(max), Some(v)) = (schema["maximum"].as_f64(), value.as_f64())
        && v > max
    {
        out.push(format!("{path}: above {max}"));
    }
    if let (Some(min), Some(s)) = (schema["minLength"].as_u64(), value.as_str())
        && (s.len() as u64) < min
    {
        out.push(format!("{path}: shorter than {min}"));
    }
    if let (Some(pattern), Some(s)) = (schema["pattern"].as_str(), value.as_str()) {
        let ok = match pattern {
            "^/" => s.starts_with('/'),
            "^[A-Za-z_][A-Za-z0-9_]*$" => {
                s.chars()
                    .next()
                    .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                    && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            }
            other => panic!("pattern {other:?} is not supported by this check"),
        };
        if !ok {
            out.push(format!("{path}: {s:?} does not match {pattern}"));
        }
    }
    if let Some(map) = value.as_object() {
        let props = schema["properties"].as_object();
        for required in schema["required"].as_array().into_iter().flatten() {
            if !map.contains_key(required.as_str().unwrap_or("")) {
                out.push(format!("{path}: missing {required}"));
            }
        }
        for (key, v) in map {
            match props.and_then(|p| p.get(key)) {
                Some(sub) => schema_errors(sub, v, &format!("{path}.{key}"), out),
                None if schema["additionalProperties"] == json!(false) => {
                    out.push(format!("{path}.{key}: not in the schema"))
                }
                None => {}
            }
        }
    }
    if let (Some(items), Some(array)) = (schema.get("items"), value.as_array()) {
        for (i, v) in array.iter().enumerate() {
            schema_errors(items, v, &format!("{path}[{i}]"), out);
        }
    }
}

#[test]
fn every_chart_value_set_matches_values_schema_json() {
    let schema: Value =
        serde_json::from_str(&read(&format!("{CHART}/values.schema.json"))).expect("JSON schema");
    for (what, values) in chart_value_sets() {
        let mut errors = Vec::new();
        schema_errors(&schema, &values, "", &mut errors);
        assert!(errors.is_empty(), "{what}: {errors:#?}");
    }
    // The check can fail: a typo'd key and a wrong type are caught.
    let mut bad = chart_value_sets().remove(0).1;
    bad["replicaCuont"] = json!(2);
    bad["service"]["port"] = json!("8080");
    let mut errors = Vec::new();
    schema_errors(&schema, &bad, "", &mut errors);
    assert_eq!(errors.len(), 2, "{errors:?}");
}

/// A free loopback port (bound, then released for the child process).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

struct Child(std::process::Child);
impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn every_probe_and_scrape_path_is_served_by_the_binary() {
    // The paths both packagings point at: chart values, rendered Kustomize Deployments, the
    // ServiceMonitor.
    let mut paths = vec!["/metrics".to_string()];
    for (_, values) in chart_value_sets() {
        for probe in ["liveness", "readiness"] {
            paths.push(
                values["probes"][probe]["path"]
                    .as_str()
                    .expect("path")
                    .into(),
            );
        }
    }
    let text = read("deploy/kubernetes/base/deployment.yaml");
    for probe in ["livenessProbe", "readinessProbe"] {
        let docs = yaml_docs(&text);
        let container = &find(&docs, "Deployment")["spec"]["template"]["spec"]["containers"][0];
        paths.push(
            container[probe]["httpGet"]["path"]
                .as_str()
                .expect("path")
                .into(),
        );
    }
    paths.sort();
    paths.dedup();
    assert_eq!(paths, ["/health", "/metrics", "/ready"]);

    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("router.yaml");
    let port = free_port();
    std::fs::write(
        &config,
        format!("server: {{bind_address: \"127.0.0.1:{port}\"}}\n"),
    )
    .expect("write");
    let _child = Child(
        Command::new(BIN)
            .arg("--config")
            .arg(&config)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start the router"),
    );
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    // Poll (a tick, not a sleep) until the child listens, under a deadline.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(50));
    loop {
        tick.tick().await;
        match client.get(format!("{base}/health")).send().await {
            Ok(r) if r.status().is_success() => break,
            _ if tokio::time::Instant::now() < deadline => {}
            other => panic!("the router never answered /health: {other:?}"),
        }
    }
    for path in &paths {
        let response = client
            .get(format!("{base}{path}"))
            .send()
            .await
            .expect("GET");
        assert!(
            response.status().is_success(),
            "{path}: {}",
            response.status()
        );
        if path == "/metrics" {
            let body = response.text().await.expect("body");
            assert!(body.contains("continuum_router_build_info{"), "{body}");
        }
    }
    // And an unknown path is not silently served.
    let missing = client
        .get(format!("{base}/healthz"))
        .send()
        .await
        .expect("GET");
    assert_eq!(missing.status().as_u16(), 404);
}

// ---------------------------------------------------------------------------------------------
// continuum-event-broker: deploy/kubernetes/event-broker and deploy/helm/continuum-event-broker

const BROKER_CHART: &str = "deploy/helm/continuum-event-broker";

/// The broker's probe paths as its binary serves them (broker/src/http.rs).
const BROKER_PROBES: [&str; 2] = ["/health", "/ready"];

/// The chart's view of a template for one `role`: the branches of `{{- if eq .Values.role "R" }}`
/// … `{{- else }}` … `{{- end }}` that the role does not take are dropped (other control lines
/// are left for [`stripped`]).
fn for_role(template: &str, role: &str) -> String {
    // Per open block: whether it is a role block, and whether its current branch is kept.
    let mut blocks: Vec<(bool, bool)> = Vec::new();
    let mut out = String::new();
    for line in template.lines() {
        let t = line.trim_start();
        let keep = blocks.iter().all(|&(_, keep)| keep);
        if let Some(rest) = t.strip_prefix("{{- if eq .Values.role \"") {
            let wanted = rest.split('"').next().unwrap_or_default();
            blocks.push((true, wanted == role));
            continue;
        }
        if t.starts_with("{{- if") || t.starts_with("{{- with") || t.starts_with("{{- range") {
            blocks.push((false, true));
        } else if t.starts_with("{{- else") {
            if let Some(last) = blocks.last_mut().filter(|b| b.0) {
                last.1 = !last.1;
                continue;
            }
        } else if t.starts_with("{{- end") && blocks.pop().is_some_and(|b| b.0) {
            continue;
        }
        if keep {
            out.push_str(line);
            out.push('\n');
        }
    }
    assert!(blocks.is_empty(), "unbalanced template blocks");
    out
}

/// The `--flags` of a container's args.
fn flags_of(container: &Value) -> Vec<String> {
    container["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .filter(|a| a.starts_with("--"))
        .map(str::to_owned)
        .collect()
}

/// Every flag a manifest passes is one `binary --help` lists.
fn assert_flags_known(what: &str, binary: &str, flags: &[String]) {
    let out = Command::new(binary)
        .arg("--help")
        .output()
        .expect("the agent binary runs");
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in flags {
        assert!(
            help.contains(&format!("{flag} ")),
            "{what}: {binary} has no {flag}"
        );
    }
}

/// What both the Kustomize and the Helm renderings must hold for the broker. A template's
/// `toYaml` blocks are stripped, so the chart's security contexts, resources and probe paths are
/// checked in `values` (given for the chart).
fn assert_broker_deployment(what: &str, deployment: &Value, values: Option<&Value>) {
    let pod = &deployment["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    assert_eq!(pod["automountServiceAccountToken"], json!(true), "{what}");
    assert_agent_deployment(
        what,
        deployment,
        values,
        "continuum-event-broker",
        &["--dynamo-namespace"],
    );
    assert_eq!(
        c["env"][0]["valueFrom"]["fieldRef"]["fieldPath"],
        json!("metadata.namespace"),
        "{what}"
    );
    assert_flags_known(
        what,
        env!("CARGO_BIN_EXE_continuum-event-broker"),
        &flags_of(c),
    );
}

/// What every agent's Deployment holds: the binary, hardening, probes on the `--listen` port,
/// and the session flags plus the role's `flags`.
fn assert_agent_deployment(
    what: &str,
    deployment: &Value,
    values: Option<&Value>,
    binary: &str,
    role_flags: &[&str],
) {
    let pod = &deployment["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let (pod_sc, sc, resources, liveness, readiness) = match values {
        Some(v) => (
            &v["podSecurityContext"],
            &v["securityContext"],
            &v["resources"],
            &v["probes"]["liveness"]["path"],
            &v["probes"]["readiness"]["path"],
        ),
        None => (
            &pod["securityContext"],
            &c["securityContext"],
            &c["resources"],
            &c["livenessProbe"]["httpGet"]["path"],
            &c["readinessProbe"]["httpGet"]["path"],
        ),
    };
    assert_eq!(pod_sc["runAsNonRoot"], json!(true), "{what}");
    assert_eq!(
        c["command"],
        json!([format!("/usr/local/bin/{binary}")]),
        "{what}"
    );
    assert_eq!(liveness, &json!(BROKER_PROBES[0]), "{what}");
    assert_eq!(readiness, &json!(BROKER_PROBES[1]), "{what}");
    assert_eq!(
        c["livenessProbe"]["httpGet"]["port"],
        json!("metrics"),
        "{what}"
    );
    assert_eq!(
        c["readinessProbe"]["httpGet"]["port"],
        json!("metrics"),
        "{what}"
    );
    assert_eq!(c["ports"][0]["name"], json!("metrics"), "{what}");
    assert_eq!(sc["allowPrivilegeEscalation"], json!(false), "{what}");
    assert_eq!(sc["readOnlyRootFilesystem"], json!(true), "{what}");
    assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]), "{what}");
    assert!(resources["limits"]["memory"].is_string(), "{what}");
    let args: Vec<String> = c["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().map_or_else(|| a.to_string(), str::to_owned))
        .collect();
    for flag in [
        "--bus-url",
        "--client-id",
        "--token-file",
        "--ca-file",
        "--listen",
    ]
    .iter()
    .chain(role_flags)
    {
        assert!(args.iter().any(|a| a == flag), "{what}: {flag} in {args:?}");
    }
    // The metrics port the probes use is the one --listen binds.
    let listen = args
        .iter()
        .skip_while(|a| *a != "--listen")
        .nth(1)
        .expect("--listen value");
    let port = match values {
        Some(v) => v["broker"]["metricsPort"].to_string(),
        None => c["ports"][0]["containerPort"].to_string(),
    };
    assert!(
        listen.ends_with(&format!(":{port}")) || listen.ends_with(":placeholder"),
        "{what}: {listen} vs {port}"
    );
}

fn assert_broker_rbac(what: &str, docs: &[Value]) {
    let role = find(docs, "Role");
    assert_eq!(
        role["rules"],
        json!([reader_rule("nvidia.com", "dynamoworkermetadatas")]),
        "{what}: get/list/watch on dynamoworkermetadatas only"
    );
    assert!(
        docs.iter().all(|d| d["kind"] != json!("ClusterRole")),
        "{what}: no cluster-wide grant"
    );
    let binding = find(docs, "RoleBinding");
    assert_eq!(binding["roleRef"]["kind"], json!("Role"), "{what}");
}

fn assert_broker_network_policy(what: &str, docs: &[Value]) {
    let policy = find(docs, "NetworkPolicy");
    let egress = policy["spec"]["egress"].as_array().expect("egress");
    let ports: Vec<&Value> = egress
        .iter()
        .flat_map(|rule| rule["ports"].as_array().into_iter().flatten())
        .collect();
    assert!(
        ports.iter().any(|p| p["endPort"] == json!(65535)),
        "{what}: publisher ports"
    );
    assert!(ports.iter().any(|p| p["port"] == json!(53)), "{what}: DNS");
    assert!(
        egress
            .iter()
            .any(|r| r["to"][0]["ipBlock"]["cidr"].is_string()),
        "{what}: the bus"
    );
}

/// An agent's Kustomize directory rendered with `kubectl kustomize`, or (without kubectl) its
/// `files` themselves.
fn agent_kustomization(dir: &str, files: &[&str]) -> Vec<Value> {
    match Command::new("kubectl")
        .arg("kustomize")
        .arg(root().join(dir))
        .output()
    {
        Ok(out) => {
            assert!(
                out.status.success(),
                "kubectl kustomize {dir}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            yaml_docs(&String::from_utf8(out.stdout).expect("UTF-8"))
        }
        Err(_) => files
            .iter()
            .flat_map(|f| yaml_docs(&read(&format!("{dir}/{f}.yaml"))))
            .collect(),
    }
}

#[test]
fn the_event_broker_kustomization_is_least_privilege_and_hardened() {
    let dir = "deploy/kubernetes/event-broker";
    let docs = agent_kustomization(
        dir,
        &[
            "serviceaccount",
            "role",
            "secret",
            "deployment",
            "networkpolicy",
        ],
    );
    assert_broker_rbac(dir, &docs);
    assert_broker_deployment(dir, find(&docs, "Deployment"), None);
    assert_broker_network_policy(dir, &docs);
    let secret = find(&docs, "Secret");
    assert!(
        secret["stringData"]["token"].is_string() || secret["data"]["token"].is_string(),
        "the token Secret"
    );
    let sa = find(&docs, "ServiceAccount");
    assert_eq!(sa["automountServiceAccountToken"], json!(false));
}

#[test]
fn the_event_broker_chart_renders_the_same_shape() {
    let chart = &yaml_docs(&read(&format!("{BROKER_CHART}/Chart.yaml")))[0];
    assert_eq!(chart["name"], json!("continuum-event-broker"));
    let values = &yaml_docs(&read(&format!("{BROKER_CHART}/values.yaml")))[0];
    assert_eq!(
        values["probes"]["liveness"]["path"],
        json!(BROKER_PROBES[0])
    );
    assert_eq!(
        values["probes"]["readiness"]["path"],
        json!(BROKER_PROBES[1])
    );
    let template = |name: &str| {
        stripped(&for_role(
            &read(&format!("{BROKER_CHART}/templates/{name}")),
            "broker",
        ))
    };
    assert_broker_rbac("chart", &template("role.yaml"));
    assert_broker_deployment(
        "chart",
        find(&template("deployment.yaml"), "Deployment"),
        Some(values),
    );
    assert_broker_network_policy("chart", &template("networkpolicy.yaml"));
    for name in ["serviceaccount.yaml", "secret.yaml", "configmap.yaml"] {
        assert!(!template(name).is_empty(), "{name}");
    }
}

/// The kv_listener's egress: the bus, the publishers and DNS; no API server ports (the rule for
/// any destination is DNS only).
fn assert_kv_listener_egress(what: &str, docs: &[Value]) {
    let policy = find(docs, "NetworkPolicy");
    let egress = policy["spec"]["egress"].as_array().expect("egress");
    assert_eq!(egress.len(), 3, "{what}: {egress:?}");
    assert!(
        egress
            .iter()
            .filter(|r| r["to"].is_null())
            .all(|r| r["ports"][0]["port"] == json!(53)),
        "{what}: the API server rule (any destination) is the broker's only: {egress:?}"
    );
}

#[test]
fn the_event_broker_chart_runs_the_kv_listener_without_kubernetes_access() {
    let values = &yaml_docs(&read(&format!("{BROKER_CHART}/values.yaml")))[0];
    assert_eq!(values["role"], json!("broker"), "the default role");
    assert_eq!(values["kvListener"]["replayEvents"], json!(4096));
    assert_eq!(
        values["kvListener"]["allowCidrs"],
        json!([]),
        "unset by default, as the router's direct_allow_cidrs"
    );
    let template = |name: &str| {
        stripped(&for_role(
            &read(&format!("{BROKER_CHART}/templates/{name}")),
            "kv_listener",
        ))
    };
    let docs = template("deployment.yaml");
    let deployment = find(&docs, "Deployment");
    assert_agent_deployment(
        "kv_listener chart",
        deployment,
        Some(values),
        "continuum-kv-listener",
        &["--source", "--replay-events", "--allow-cidr"],
    );
    let pod = &deployment["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    assert_eq!(pod["automountServiceAccountToken"], json!(false));
    assert_eq!(c["name"], json!("continuum-kv-listener"));
    let flags = flags_of(c);
    assert!(
        !flags.iter().any(|f| f == "--dynamo-namespace"),
        "{flags:?}"
    );
    assert!(
        c["env"]
            .as_array()
            .expect("env")
            .iter()
            .all(|e| e["name"] != json!("CONTINUUM_BROKER_KUBERNETES_NAMESPACE")),
        "no Kubernetes namespace for the kv_listener"
    );
    assert_flags_known(
        "kv_listener chart",
        env!("CARGO_BIN_EXE_continuum-kv-listener"),
        &flags,
    );
    assert!(
        template("role.yaml").is_empty(),
        "no Role or RoleBinding for the kv_listener"
    );
    assert_kv_listener_egress("kv_listener chart", &template("networkpolicy.yaml"));
    // A role the chart does not know, or a kv_listener without sources, fails the render.
    let helpers = read(&format!("{BROKER_CHART}/templates/_helpers.tpl"));
    assert!(helpers.contains("(has .Values.role (list \"broker\" \"kv_listener\"))"));
    assert!(helpers.contains("not .Values.kvListener.sources"));
    assert!(
        read(&format!("{BROKER_CHART}/templates/deployment.yaml"))
            .starts_with("{{- include \"continuum-event-broker.checkRole\" . }}")
    );
}

// ---------------------------------------------------------------------------------------------
// continuum-kv-listener: deploy/kubernetes/kv-listener (the chart is the broker's, role
// kv_listener, above)

#[test]
fn the_kv_listener_kustomization_is_hardened_and_reads_no_kubernetes_api() {
    let dir = "deploy/kubernetes/kv-listener";
    let docs = agent_kustomization(
        dir,
        &["serviceaccount", "secret", "deployment", "networkpolicy"],
    );
    let deployment = find(&docs, "Deployment");
    assert_agent_deployment(
        dir,
        deployment,
        None,
        "continuum-kv-listener",
        &["--source", "--replay-events", "--allow-cidr"],
    );
    let pod = &deployment["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    assert_eq!(pod["automountServiceAccountToken"], json!(false), "{dir}");
    let flags = flags_of(c);
    assert!(
        !flags.iter().any(|f| f == "--dynamo-namespace"),
        "{flags:?}"
    );
    assert_flags_known(dir, env!("CARGO_BIN_EXE_continuum-kv-listener"), &flags);
    // The example's settings are ones the binary accepts (its --allow-cidr holds its --source).
    let args: Vec<&str> = c["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let value = |flag: &str| {
        args.iter()
            .skip_while(|a| **a != flag)
            .nth(1)
            .copied()
            .unwrap_or_else(|| panic!("{flag} value"))
    };
    let cidrs: Vec<String> = value("--allow-cidr")
        .split(',')
        .map(str::to_owned)
        .collect();
    assert!(continuum_actors::zmtp_conn::parse_allow_cidrs(&cidrs).is_ok());
    assert!(
        continuum_event_broker::config::KvSource::parse(value("--source")).is_ok(),
        "{dir}: --source"
    );
    // No API access at all: no Role, no binding, no token mounted.
    for kind in ["Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"] {
        assert!(
            docs.iter().all(|d| d["kind"] != json!(kind)),
            "{dir}: no {kind}"
        );
    }
    let sa = find(&docs, "ServiceAccount");
    assert_eq!(sa["automountServiceAccountToken"], json!(false));
    assert_eq!(
        pod["serviceAccountName"], sa["metadata"]["name"],
        "{dir}: its own ServiceAccount"
    );
    assert_kv_listener_egress(dir, &docs);
    assert_broker_network_policy(dir, &docs);
    let secret = find(&docs, "Secret");
    assert!(
        secret["stringData"]["token"].is_string() || secret["data"]["token"].is_string(),
        "the token Secret"
    );
    let volumes = pod["volumes"].as_array().expect("volumes");
    assert!(
        volumes
            .iter()
            .any(|v| v["secret"]["secretName"] == secret["metadata"]["name"]),
        "{dir}: the Deployment mounts the token Secret"
    );
}
