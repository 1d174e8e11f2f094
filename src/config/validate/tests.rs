//! One test per validation rule; each starts from a clean config and breaks one thing.

use std::collections::BTreeMap;
use std::path::PathBuf;

use super::*;
use crate::config::{Config, Diagnostic, Severity};

/// `super::validate` without the "compiled but inactive" warnings a slim build adds to every
/// config that enables Dynamo (`config::features`, tested there): the rules here are the same in
/// every build. Shadows the glob import for every test of this file.
fn validate(config: &Config) -> Vec<Diagnostic> {
    let mut found = super::validate(config);
    found.retain(|d| !crate::config::features::is_inactive_warning(d));
    found
}

const BASE_YAML: &str = r#"
disaggregated_serving: {enabled: true}
backends:
  - {name: shim-a, url: "http://shim-a:8000"}
  - {name: shim-b, url: "http://shim-b:8000"}
  - {name: shim-c, url: "http://shim-c:8000"}
dynamo:
  enabled: true
  discovery: {etcd: {endpoints: ["http://etcd:2379"]}}
  load: {direct_allow_cidrs: ["10.0.0.0/8"]}
  shim: {backends: [shim-a]}
"#;

fn base() -> Config {
    Config::from_yaml_str(BASE_YAML, &BTreeMap::new()).unwrap()
}

#[track_caller]
fn expect(config: &Config, severity: Severity, path: &str, needle: &str) -> Vec<Diagnostic> {
    let diagnostics = validate(config);
    assert!(
        diagnostics
            .iter()
            .any(|d| d.severity == severity && d.path == path && d.message.contains(needle)),
        "expected {severity} at {path} containing {needle:?}, got {diagnostics:#?}"
    );
    diagnostics
}

#[track_caller]
fn expect_error(config: &Config, path: &str, needle: &str) {
    expect(config, Severity::Error, path, needle);
}

#[track_caller]
fn expect_warning(config: &Config, path: &str, needle: &str) {
    expect(config, Severity::Warning, path, needle);
}

#[track_caller]
fn expect_clean_at(config: &Config, path: &str) {
    let diagnostics = validate(config);
    assert!(
        diagnostics.iter().all(|d| d.path != path),
        "expected nothing at {path}, got {diagnostics:#?}"
    );
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

fn hex64(c: char) -> String {
    std::iter::repeat_n(c, 64).collect()
}

#[test]
fn base_config_has_no_diagnostics() {
    assert_eq!(validate(&base()), Vec::new());
}

#[test]
fn all_diagnostics_are_collected_not_just_the_first() {
    let mut c = base();
    c.dynamo.discovery.etcd.endpoints = strings(&["user@a:1", "b:2?", "c:3#"]);
    c.dynamo.load.max_staleness = HumanDuration::from_millis(1);
    let errors: Vec<_> = validate(&c).into_iter().filter(|d| d.is_error()).collect();
    assert_eq!(errors.len(), 4, "{errors:#?}");
}

// ---- front door, backends, telemetry ----

#[test]
fn admin_enabled_requires_a_token() {
    let mut c = base();
    c.admin.enabled = true;
    expect_error(&c, "admin.token", "no admin token");
}

#[test]
fn short_admin_token_warns() {
    let mut c = base();
    c.admin.enabled = true;
    c.admin.token = Some("short".to_owned());
    expect_warning(&c, "admin.token", "shorter than 16");
}

#[test]
fn api_key_must_be_non_empty_and_unique() {
    let mut c = base();
    c.api_keys = vec![
        ApiKeyConfig {
            key: String::new(),
            name: "a".into(),
            allowed_backends: None,
        },
        ApiKeyConfig {
            key: "k".into(),
            name: "b".into(),
            allowed_backends: None,
        },
        ApiKeyConfig {
            key: "k".into(),
            name: "c".into(),
            allowed_backends: None,
        },
    ];
    expect_error(&c, "api_keys[0].key", "must not be empty");
    expect_error(&c, "api_keys[2].key", "listed twice");
}

#[test]
fn api_key_name_must_be_non_empty_and_unique() {
    let mut c = base();
    c.api_keys = vec![
        ApiKeyConfig {
            key: "k1".into(),
            name: " ".into(),
            allowed_backends: None,
        },
        ApiKeyConfig {
            key: "k2".into(),
            name: "n".into(),
            allowed_backends: None,
        },
        ApiKeyConfig {
            key: "k3".into(),
            name: "n".into(),
            allowed_backends: None,
        },
    ];
    expect_error(&c, "api_keys[0].name", "must not be empty");
    expect_error(&c, "api_keys[2].name", "used twice");
}

#[test]
fn api_key_allowed_backends_must_exist() {
    let mut c = base();
    c.api_keys = vec![ApiKeyConfig {
        key: "k".into(),
        name: "n".into(),
        allowed_backends: Some(strings(&["shim-a", "ghost"])),
    }];
    expect_error(&c, "api_keys[0].allowed_backends[1]", "not defined");
}

#[test]
fn public_bind_without_api_keys_warns() {
    let mut c = base();
    c.server.bind_address = "0.0.0.0:8080".parse().unwrap();
    expect_warning(&c, "server.bind_address", "no api_keys");
}

#[test]
fn server_timeouts_and_connection_cap_are_bounded() {
    let c = base();
    for key in [
        "server.header_read_timeout",
        "server.body_read_timeout",
        "server.idle_timeout",
        "server.send_timeout",
        "server.max_connections",
    ] {
        expect_clean_at(&c, key);
    }
    let mut c = base();
    c.server.header_read_timeout = HumanDuration::from_millis(0);
    c.server.body_read_timeout = HumanDuration::from_millis(99);
    c.server.idle_timeout = HumanDuration::from_secs(3601);
    c.server.send_timeout = HumanDuration::from_millis(50);
    c.server.max_connections = 0;
    expect_error(&c, "server.header_read_timeout", "between 100ms and 1h");
    expect_error(&c, "server.body_read_timeout", "between 100ms and 1h");
    expect_error(&c, "server.idle_timeout", "between 100ms and 1h");
    expect_error(&c, "server.send_timeout", "between 100ms and 1h");
    expect_error(&c, "server.max_connections", "between 1 and 1000000");
    c.server.max_connections = 1_000_001;
    expect_error(&c, "server.max_connections", "between 1 and 1000000");
}

#[test]
fn backend_name_must_be_valid_and_unique() {
    let mut c = base();
    c.backends[1].name = "bad name".into();
    c.backends[2].name = "shim-a".into();
    expect_error(&c, "backends[1].name", "[A-Za-z0-9._-]");
    expect_error(&c, "backends[2].name", "used twice");
}

#[test]
fn backend_url_must_be_http_without_credentials_query_or_fragment() {
    let mut c = base();
    c.backends[0].url = "ftp://x".into();
    c.backends[1].url = "http://user:pw@x:1".into();
    c.backends[2].url = "http://x:1/v1?q".into();
    expect_error(&c, "backends[0].url", "http:// or https://");
    expect_error(&c, "backends[1].url", "credentials");
    expect_error(&c, "backends[2].url", "query");
    let mut ok = base();
    ok.backends[0].url = "https://shim.example.com/prefix".into();
    expect_clean_at(&ok, "backends[0].url");
}

/// A PEM file holding one real CA certificate (a webpki root).
fn ca_pem_file() -> tempfile::NamedTempFile {
    use base64::Engine as _;
    use std::io::Write as _;
    let der = &webpki_root_certs::TLS_SERVER_ROOT_CERTS[0];
    let b64 = base64::engine::general_purpose::STANDARD.encode(der.as_ref());
    let mut pem = String::from("-----BEGIN CERTIFICATE-----\n");
    for line in b64.as_bytes().chunks(64) {
        pem.push_str(std::str::from_utf8(line).unwrap());
        pem.push('\n');
    }
    pem.push_str("-----END CERTIFICATE-----\n");
    let mut file = tempfile::NamedTempFile::new().unwrap();
    file.write_all(pem.as_bytes()).unwrap();
    file
}

fn file_with(contents: &str) -> tempfile::NamedTempFile {
    use std::io::Write as _;
    let mut file = tempfile::NamedTempFile::new().unwrap();
    file.write_all(contents.as_bytes()).unwrap();
    file
}

#[test]
fn backend_tls_ca_cert_is_read_and_parsed_at_validation() {
    let ca = ca_pem_file();
    let mut ok = base();
    ok.backends[0].url = "https://shim.example.com".into();
    ok.backends[0].tls.ca_cert = Some(ca.path().to_path_buf());
    expect_clean_at(&ok, "backends[0].tls.ca_cert");

    let mut c = ok.clone();
    c.backends[0].tls.ca_cert = Some(PathBuf::from("/nonexistent/continuum-ca.pem"));
    expect_error(&c, "backends[0].tls.ca_cert", "cannot read");

    let garbage = file_with("not a certificate at all\n");
    c.backends[0].tls.ca_cert = Some(garbage.path().to_path_buf());
    expect_error(&c, "backends[0].tls.ca_cert", "no PEM CERTIFICATE");

    let empty = file_with("");
    c.backends[0].tls.ca_cert = Some(empty.path().to_path_buf());
    expect_error(&c, "backends[0].tls.ca_cert", "no PEM CERTIFICATE");

    let broken = file_with("-----BEGIN CERTIFICATE-----\n@@@@\n-----END CERTIFICATE-----\n");
    c.backends[0].tls.ca_cert = Some(broken.path().to_path_buf());
    expect_error(&c, "backends[0].tls.ca_cert", "not valid PEM");

    let not_a_ca = file_with("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n");
    c.backends[0].tls.ca_cert = Some(not_a_ca.path().to_path_buf());
    expect_error(&c, "backends[0].tls.ca_cert", "not a usable CA");

    let mut plain = ok.clone();
    plain.backends[0].url = "http://shim:8000".into();
    expect_error(&plain, "backends[0].tls.ca_cert", "https:// backends only");
}

#[test]
fn backend_models_must_be_non_empty_and_unique() {
    let mut c = base();
    c.backends[0].models = strings(&["m", "", "m"]);
    expect_error(&c, "backends[0].models[1]", "must not be empty");
    expect_error(&c, "backends[0].models[2]", "listed twice");
}

#[test]
fn health_check_timings_must_be_positive_and_timeout_within_interval() {
    let mut c = base();
    c.backends[0].health_check.interval = HumanDuration::from_secs(0);
    c.backends[1].health_check.timeout = HumanDuration::from_secs(0);
    c.backends[2].health_check.timeout = HumanDuration::from_secs(20);
    expect_error(&c, "backends[0].health_check.interval", "greater than 0");
    expect_error(&c, "backends[1].health_check.timeout", "greater than 0");
    expect_error(
        &c,
        "backends[2].health_check.timeout",
        "must not exceed interval",
    );
}

#[test]
fn health_check_thresholds_must_be_at_least_one() {
    let mut c = base();
    c.backends[0].health_check.unhealthy_threshold = 0;
    c.backends[0].health_check.healthy_threshold = 0;
    expect_error(
        &c,
        "backends[0].health_check.unhealthy_threshold",
        "at least 1",
    );
    expect_error(
        &c,
        "backends[0].health_check.healthy_threshold",
        "at least 1",
    );
}

#[test]
fn health_check_path_must_be_absolute() {
    let mut c = base();
    c.backends[0].health_check.path = "health".into();
    expect_error(&c, "backends[0].health_check.path", "start with '/'");
}

#[test]
fn telemetry_log_level_must_be_a_valid_filter() {
    let mut c = base();
    c.telemetry.log_level = "info,[[[".into();
    expect_error(&c, "telemetry.log_level", "not a valid log filter");
}

/// Fuzz finding (`config_yaml`): tracing_subscriber's directive parser slices a span filter by
/// character position and panicked on non-ASCII text; validation refuses it before parsing.
#[test]
fn telemetry_log_level_refuses_non_ascii_before_the_parser_sees_it() {
    let mut c = base();
    c.telemetry.log_level = "a[\u{e9}]".into();
    expect_error(&c, "telemetry.log_level", "only ASCII characters");
}

#[test]
fn telemetry_service_name_must_be_non_empty() {
    let mut c = base();
    c.telemetry.service_name = String::new();
    expect_error(&c, "telemetry.service_name", "must not be empty");
}

#[test]
fn telemetry_otlp_endpoint_must_be_host_port_url() {
    let mut c = base();
    c.telemetry.otlp = Some(OtlpConfig {
        endpoint: "localhost:4317".into(),
        metrics_interval: None,
    });
    expect_error(&c, "telemetry.otlp.endpoint", "http:// or https://");
    c.telemetry.otlp = Some(OtlpConfig {
        endpoint: "http://127.0.0.1:4317".into(),
        metrics_interval: None,
    });
    expect_clean_at(&c, "telemetry.otlp.endpoint");
}

#[test]
fn telemetry_otlp_metrics_interval_is_between_1s_and_1h() {
    let mut c = base();
    let with = |interval: HumanDuration| {
        Some(OtlpConfig {
            endpoint: "http://127.0.0.1:4317".into(),
            metrics_interval: Some(interval),
        })
    };
    c.telemetry.otlp = with(HumanDuration::from_millis(999));
    expect_error(&c, "telemetry.otlp.metrics_interval", "between 1s and 1h");
    c.telemetry.otlp = with(HumanDuration::from_secs(3601));
    expect_error(&c, "telemetry.otlp.metrics_interval", "between 1s and 1h");
    c.telemetry.otlp = with(HumanDuration::from_secs(15));
    expect_clean_at(&c, "telemetry.otlp.metrics_interval");
}

// ---- etcd endpoints ----

#[test]
fn etcd_endpoints_required_when_enabled() {
    let mut c = base();
    c.dynamo.discovery.etcd.endpoints.clear();
    expect_error(&c, "dynamo.discovery.etcd.endpoints", "at least one");
    c.dynamo.enabled = false;
    expect_clean_at(&c, "dynamo.discovery.etcd.endpoints");
}

#[test]
fn etcd_endpoints_at_most_sixteen() {
    let mut c = base();
    c.dynamo.discovery.etcd.endpoints = (0..17).map(|i| format!("etcd-{i}:2379")).collect();
    expect_error(&c, "dynamo.discovery.etcd.endpoints", "at most 16");
}

#[test]
fn etcd_endpoint_must_not_embed_credentials() {
    let mut c = base();
    c.dynamo.discovery.etcd.endpoints =
        strings(&["http://a:2379", "http://user:pass@b:2379", "user@c:2379"]);
    expect_error(&c, "dynamo.discovery.etcd.endpoints[1]", "credentials");
    expect_error(&c, "dynamo.discovery.etcd.endpoints[2]", "credentials");
}

#[test]
fn etcd_endpoint_must_not_have_query_even_empty() {
    let mut c = base();
    c.dynamo.discovery.etcd.endpoints = strings(&["http://a:2379?", "b:2379?x=1"]);
    expect_error(&c, "dynamo.discovery.etcd.endpoints[0]", "query");
    expect_error(&c, "dynamo.discovery.etcd.endpoints[1]", "query");
}

#[test]
fn etcd_endpoint_must_not_have_fragment_even_empty() {
    let mut c = base();
    c.dynamo.discovery.etcd.endpoints = strings(&["http://a:2379#"]);
    expect_error(&c, "dynamo.discovery.etcd.endpoints[0]", "fragment");
}

#[test]
fn etcd_endpoint_must_not_have_path_even_trailing_slash() {
    let mut c = base();
    c.dynamo.discovery.etcd.endpoints = strings(&["http://a:2379/", "http://b:2379/v3"]);
    expect_error(&c, "dynamo.discovery.etcd.endpoints[0]", "path");
    expect_error(&c, "dynamo.discovery.etcd.endpoints[1]", "path");
}

#[test]
fn etcd_endpoint_needs_host_port_and_known_scheme() {
    let mut c = base();
    c.dynamo.discovery.etcd.endpoints =
        strings(&["etcd", "grpc://a:1", "a:0", "::1:2379", ":2379", "a b:1"]);
    expect_error(&c, "dynamo.discovery.etcd.endpoints[0]", "needs a port");
    expect_error(
        &c,
        "dynamo.discovery.etcd.endpoints[1]",
        "http:// or https://",
    );
    expect_error(&c, "dynamo.discovery.etcd.endpoints[2]", "valid port");
    expect_error(&c, "dynamo.discovery.etcd.endpoints[3]", "bracketed");
    expect_error(
        &c,
        "dynamo.discovery.etcd.endpoints[4]",
        "host must not be empty",
    );
    expect_error(&c, "dynamo.discovery.etcd.endpoints[5]", "whitespace");
}

#[test]
fn etcd_endpoint_accepts_ipv6_and_normalises_bare_host_port_to_http() {
    let mut c = base();
    c.dynamo.discovery.etcd.endpoints =
        strings(&["[::1]:2379", "etcd-0:2379", "http://[fd00::5]:2379"]);
    assert!(
        validate(&c)
            .iter()
            .all(|d| !d.path.starts_with("dynamo.discovery.etcd"))
    );
    assert_eq!(
        c.dynamo.discovery.etcd.normalized_endpoints(),
        strings(&[
            "http://[::1]:2379",
            "http://etcd-0:2379",
            "http://[fd00::5]:2379"
        ])
    );
    let parsed = check_endpoint("[::1]:2379").unwrap();
    assert_eq!(parsed.ip, Some("::1".parse().unwrap()));
    assert_eq!(parsed.port, 2379);
    assert!(!parsed.https);
}

#[test]
fn duplicate_etcd_endpoint_warns() {
    let mut c = base();
    c.dynamo.discovery.etcd.endpoints = strings(&["etcd:2379", "http://etcd:2379"]);
    expect_warning(&c, "dynamo.discovery.etcd.endpoints[1]", "listed twice");
}

#[test]
fn public_etcd_endpoint_with_direct_transport_warns() {
    let mut c = base();
    c.dynamo.discovery.etcd.endpoints = strings(&["http://8.8.8.8:2379"]);
    expect_warning(
        &c,
        "dynamo.discovery.etcd.endpoints[0]",
        "inside the cluster",
    );
    c.dynamo.load.transport = LoadTransport::Broker;
    expect_clean_at(&c, "dynamo.discovery.etcd.endpoints[0]");
}

// ---- scheme consistency, TLS, auth ----

#[test]
fn etcd_endpoints_must_not_mix_http_and_https() {
    let mut c = base();
    c.dynamo.discovery.etcd.endpoints = strings(&["https://a:2379", "http://b:2379"]);
    expect_error(
        &c,
        "dynamo.discovery.etcd.endpoints",
        "mix http:// and https://",
    );
}

#[test]
fn http_endpoints_cannot_combine_with_tls_block() {
    let mut c = base();
    c.dynamo.discovery.etcd.endpoints = strings(&["etcd:2379"]);
    c.dynamo.discovery.etcd.tls = Some(EtcdTlsConfig {
        ca_cert: Some(PathBuf::from("/ca.pem")),
        ..EtcdTlsConfig::default()
    });
    expect_error(&c, "dynamo.discovery.etcd.tls", "http://");
    c.dynamo.discovery.etcd.endpoints = strings(&["https://etcd:2379"]);
    expect_clean_at(&c, "dynamo.discovery.etcd.tls");
}

#[test]
fn tls_client_cert_and_key_must_be_set_together() {
    let mut c = base();
    c.dynamo.discovery.etcd.endpoints = strings(&["https://etcd:2379"]);
    c.dynamo.discovery.etcd.tls = Some(EtcdTlsConfig {
        client_cert: Some(PathBuf::from("/c.pem")),
        ..EtcdTlsConfig::default()
    });
    expect_error(
        &c,
        "dynamo.discovery.etcd.tls.client_key",
        "set both or neither",
    );
    c.dynamo.discovery.etcd.tls = Some(EtcdTlsConfig {
        client_key: Some(PathBuf::from("/k.pem")),
        ..EtcdTlsConfig::default()
    });
    expect_error(
        &c,
        "dynamo.discovery.etcd.tls.client_cert",
        "set both or neither",
    );
}

#[test]
fn tls_paths_and_server_name_must_be_non_empty() {
    let mut c = base();
    c.dynamo.discovery.etcd.endpoints = strings(&["https://etcd:2379"]);
    c.dynamo.discovery.etcd.tls = Some(EtcdTlsConfig {
        ca_cert: Some(PathBuf::new()),
        server_name: Some(" ".into()),
        ..EtcdTlsConfig::default()
    });
    expect_error(&c, "dynamo.discovery.etcd.tls.ca_cert", "must not be empty");
    expect_error(
        &c,
        "dynamo.discovery.etcd.tls.server_name",
        "must not be empty",
    );
}

#[test]
fn auth_over_plaintext_warns() {
    let mut c = base();
    c.dynamo.discovery.etcd.auth = Some(EtcdAuthConfig {
        username: "router".into(),
        password: "pw".into(),
    });
    expect_warning(&c, "dynamo.discovery.etcd.auth", "cleartext");
    c.dynamo.discovery.etcd.endpoints = strings(&["https://etcd:2379"]);
    c.dynamo.discovery.etcd.tls = Some(EtcdTlsConfig::default());
    expect_clean_at(&c, "dynamo.discovery.etcd.auth");
}

#[test]
fn auth_username_and_password_must_be_non_empty() {
    let mut c = base();
    c.dynamo.discovery.etcd.auth = Some(EtcdAuthConfig {
        username: String::new(),
        password: String::new(),
    });
    expect_error(
        &c,
        "dynamo.discovery.etcd.auth.username",
        "must not be empty",
    );
    expect_error(
        &c,
        "dynamo.discovery.etcd.auth.password",
        "must not be empty",
    );
}

// ---- namespaces ----

#[test]
fn namespace_must_be_non_empty_without_slash_whitespace_or_control_chars() {
    for (bad, needle) in [
        ("", "must not be empty"),
        ("a/b", "'/'"),
        ("a b", "whitespace"),
        ("a\u{1}b", "control"),
    ] {
        let mut c = base();
        c.dynamo.discovery.etcd.namespace = bad.to_owned();
        expect_error(&c, "dynamo.discovery.etcd.namespace", needle);
    }
}

#[test]
fn namespaces_at_most_sixteen() {
    let mut c = base();
    c.dynamo.discovery.etcd.namespaces = (0..17).map(|i| format!("ns{i}")).collect();
    expect_error(&c, "dynamo.discovery.etcd.namespaces", "at most 16");
}

#[test]
fn namespaces_must_be_unique_and_well_formed() {
    let mut c = base();
    c.dynamo.discovery.etcd.namespaces = strings(&["a", "b/c", "a"]);
    expect_error(&c, "dynamo.discovery.etcd.namespaces[1]", "'/'");
    expect_error(&c, "dynamo.discovery.etcd.namespaces[2]", "listed twice");
}

#[test]
fn namespaces_exclusive_with_non_default_namespace() {
    let mut c = base();
    c.dynamo.discovery.etcd.namespace = "prod".into();
    c.dynamo.discovery.etcd.namespaces = strings(&["prod"]);
    expect_error(&c, "dynamo.discovery.etcd.namespaces", "mutually exclusive");
    c.dynamo.discovery.etcd.namespace = "dynamo".into();
    expect_clean_at(&c, "dynamo.discovery.etcd.namespaces");
}

#[test]
fn several_namespaces_require_shim_pools() {
    let mut c = base();
    c.dynamo.discovery.etcd.namespaces = strings(&["prod", "canary"]);
    expect_error(
        &c,
        "dynamo.shim.pools",
        "shim.pools (one pool per namespace) is required",
    );
}

fn two_namespace_pools() -> Config {
    let mut c = base();
    c.dynamo.discovery.etcd.namespaces = strings(&["prod", "canary"]);
    c.dynamo.shim.backends.clear();
    c.dynamo.shim.pools = vec![
        ShimPool {
            namespace: "prod".into(),
            backends: strings(&["shim-a"]),
        },
        ShimPool {
            namespace: "canary".into(),
            backends: strings(&["shim-b"]),
        },
    ];
    c
}

#[test]
fn event_bus_sources_without_the_listener_warn() {
    let mut c = bus();
    c.dynamo.event_bus.enabled = false;
    expect_warning(
        &c,
        "dynamo.kv.kv_cache_index.sources[0].transport",
        "dynamo.event_bus.enabled is false",
    );
}

#[test]
fn event_bus_source_no_kv_listener_grants_warns() {
    let mut c = bus();
    c.dynamo.kv.kv_cache_index.sources[0].backend = "shim-a".into();
    expect_warning(
        &c,
        "dynamo.kv.kv_cache_index.sources[0].backend",
        "no dynamo.event_bus.brokers[] entry with role kv_listener grants",
    );
    // ... and the grant no source reads is the third advisory.
    expect_warning(
        &c,
        "dynamo.event_bus.brokers[1].backends[0]",
        "no dynamo.kv.kv_cache_index.sources[] entry",
    );
}

#[test]
fn kv_cache_index_sources_are_named_once() {
    let mut c = bus();
    let first = c.dynamo.kv.kv_cache_index.sources[0].clone();
    c.dynamo.kv.kv_cache_index.sources.push(first);
    expect_error(
        &c,
        "dynamo.kv.kv_cache_index.sources[1].backend",
        "listed twice",
    );
    c.dynamo.kv.kv_cache_index.sources[1].backend = "has space".into();
    expect_error(&c, "dynamo.kv.kv_cache_index.sources[1].backend", "");
}

#[test]
fn multi_namespace_pools_are_valid_when_complete() {
    assert_eq!(validate(&two_namespace_pools()), Vec::new());
}

#[test]
fn each_namespace_has_exactly_one_pool() {
    let mut c = two_namespace_pools();
    c.dynamo.shim.pools[1].namespace = "prod".into();
    expect_error(&c, "dynamo.shim.pools[1].namespace", "already has a pool");
    expect_error(&c, "dynamo.shim.pools", "\"canary\" has no shim pool");
    c.dynamo.shim.pools[1].namespace = "staging".into();
    expect_error(
        &c,
        "dynamo.shim.pools[1].namespace",
        "not a configured Dynamo namespace",
    );
}

#[test]
fn backend_belongs_to_at_most_one_pool() {
    let mut c = two_namespace_pools();
    c.dynamo.shim.pools[1].backends = strings(&["shim-b", "shim-a"]);
    expect_error(&c, "dynamo.shim.pools[1].backends[1]", "at most one pool");
}

#[test]
fn pool_needs_a_backend() {
    let mut c = two_namespace_pools();
    c.dynamo.shim.pools[0].backends.clear();
    expect_error(&c, "dynamo.shim.pools[0].backends", "at least one backend");
}

#[test]
fn shim_backends_and_pools_are_exclusive() {
    let mut c = two_namespace_pools();
    c.dynamo.shim.backends = strings(&["shim-c"]);
    expect_error(&c, "dynamo.shim.pools", "not both");
}

// ---- timings ----

#[test]
fn backoff_max_must_be_at_least_initial() {
    let mut c = base();
    c.dynamo.discovery.etcd.watch_reconnect_backoff = BackoffConfig {
        initial: HumanDuration::from_secs(5),
        max: HumanDuration::from_secs(1),
    };
    expect_error(
        &c,
        "dynamo.discovery.etcd.watch_reconnect_backoff.max",
        ">= initial",
    );
    let mut c = base();
    c.dynamo.discovery.kubernetes.watch_reconnect_backoff.max = HumanDuration::from_millis(100);
    expect_error(
        &c,
        "dynamo.discovery.kubernetes.watch_reconnect_backoff.max",
        ">= initial",
    );
}

#[test]
fn backoff_initial_must_be_positive() {
    let mut c = base();
    c.dynamo.discovery.etcd.watch_reconnect_backoff.initial = HumanDuration::from_secs(0);
    expect_error(
        &c,
        "dynamo.discovery.etcd.watch_reconnect_backoff.initial",
        "greater than 0",
    );
}

#[test]
fn max_staleness_between_100ms_and_5m() {
    for (value, bad) in [(99, true), (100, false), (300_000, false), (300_001, true)] {
        let mut c = base();
        c.dynamo.load.max_staleness = HumanDuration::from_millis(value);
        if bad {
            expect_error(&c, "dynamo.load.max_staleness", "100ms..=5m");
        } else {
            expect_clean_at(&c, "dynamo.load.max_staleness");
        }
    }
}

// ---- shim limits ----

#[test]
fn shim_backends_at_most_sixty_four() {
    let mut c = base();
    c.backends = (0..65)
        .map(|i| BackendConfig {
            name: format!("shim-{i}"),
            ..base().backends[0].clone()
        })
        .collect();
    c.dynamo.shim.backends = (0..65).map(|i| format!("shim-{i}")).collect();
    expect_error(&c, "dynamo.shim.backends", "at most 64");
}

#[test]
fn shim_backends_must_be_unique() {
    let mut c = base();
    c.dynamo.shim.backends = strings(&["shim-a", "shim-a"]);
    expect_error(&c, "dynamo.shim.backends[1]", "listed twice");
}

#[test]
fn shim_backends_must_exist_in_backends() {
    let mut c = base();
    c.dynamo.shim.backends = strings(&["shim-a", "ghost"]);
    expect_error(&c, "dynamo.shim.backends[1]", "not defined in backends[]");
}

#[test]
fn model_map_at_most_1024_pairs() {
    let mut c = base();
    c.dynamo.shim.model_map = (0..1025)
        .map(|i| (format!("m{i}"), format!("M{i}")))
        .collect();
    expect_error(&c, "dynamo.shim.model_map", "at most 1024");
}

#[test]
fn model_map_keys_and_values_must_be_non_empty() {
    let mut c = base();
    c.dynamo.shim.model_map = [
        (String::new(), "x".to_owned()),
        ("y".to_owned(), String::new()),
    ]
    .into_iter()
    .collect();
    expect_error(&c, "dynamo.shim.model_map", "keys must not be empty");
    expect_error(&c, "dynamo.shim.model_map.y", "values must not be empty");
}

#[test]
fn shim_pool_while_dynamo_or_disaggregation_disabled_warns() {
    let mut c = base();
    c.disaggregated_serving.enabled = false;
    expect_warning(&c, "dynamo.shim.backends", "is false");
    let mut c = base();
    c.dynamo.enabled = false;
    expect_warning(&c, "dynamo.shim.backends", "is false");
}

#[test]
fn shim_replica_internal_or_disabled_warns() {
    let mut c = base();
    c.backends[0].internal = true;
    expect_warning(&c, "dynamo.shim.backends[0]", "internal: true");
    let mut c = base();
    c.backends[0].enabled = false;
    expect_warning(&c, "dynamo.shim.backends[0]", "enabled: false");
}

#[test]
fn backend_roles_other_than_unified_are_rejected() {
    for role in [BackendRole::Prefill, BackendRole::Decode] {
        let mut c = base();
        c.backends[0].role = role;
        expect_error(&c, "backends[0].role", "only role unified is routed");
    }
}

#[test]
fn dynamo_enabled_without_shim_replica_warns() {
    let mut c = base();
    c.dynamo.shim.backends.clear();
    expect_warning(&c, "dynamo.shim.backends", "no shim replica");
}

// ---- direct dial CIDRs ----

#[test]
fn direct_allow_cidrs_at_most_sixty_four() {
    let mut c = base();
    c.dynamo.load.direct_allow_cidrs = Some((0..65).map(|i| format!("10.{i}.0.0/16")).collect());
    expect_error(&c, "dynamo.load.direct_allow_cidrs", "at most 64");
}

#[test]
fn direct_allow_cidrs_must_parse_as_v4_or_v6() {
    let mut c = base();
    c.dynamo.load.direct_allow_cidrs =
        Some(strings(&["10.0.0.0/8", "fd00::/8", "10.0.0.0/33", "pods"]));
    expect_error(
        &c,
        "dynamo.load.direct_allow_cidrs[2]",
        "not an IPv4 or IPv6 CIDR",
    );
    expect_error(
        &c,
        "dynamo.load.direct_allow_cidrs[3]",
        "not an IPv4 or IPv6 CIDR",
    );
    expect_clean_at(&c, "dynamo.load.direct_allow_cidrs[1]");
}

#[test]
fn unset_direct_allow_cidrs_warns_suggesting_pod_cidrs() {
    let mut c = base();
    c.dynamo.load.direct_allow_cidrs = None;
    expect_warning(&c, "dynamo.load.direct_allow_cidrs", "worker Pod CIDRs");
    c.dynamo.load.transport = LoadTransport::Broker;
    expect_clean_at(&c, "dynamo.load.direct_allow_cidrs");
}

#[test]
fn empty_direct_allow_cidrs_warns() {
    let mut c = base();
    c.dynamo.load.direct_allow_cidrs = Some(Vec::new());
    expect_warning(&c, "dynamo.load.direct_allow_cidrs", "dial no publisher");
}

// ---- Kubernetes sources ----

fn pods() -> Config {
    let mut c = base();
    c.dynamo.discovery.source = DiscoverySource::KubernetesPods;
    c.dynamo.discovery.kubernetes.namespace = "fleet".into();
    c.dynamo.discovery.kubernetes.dynamo_namespace = "dynamo-solar".into();
    c.dynamo.discovery.kubernetes.model = Some("solar-pro4".into());
    c
}

#[test]
fn kubernetes_pods_gives_no_load_or_capacity_signals_warning() {
    let diagnostics = expect(
        &pods(),
        Severity::Warning,
        "dynamo.discovery.source",
        "no load or capacity",
    );
    assert!(
        diagnostics.iter().all(|d| !d.is_error()),
        "{diagnostics:#?}"
    );
}

#[test]
fn kubernetes_namespace_must_be_dns1123_label() {
    for bad in ["Fleet", "-fleet", "fleet_1", "", &"a".repeat(64)] {
        let mut c = pods();
        c.dynamo.discovery.kubernetes.namespace = bad.to_owned();
        expect_error(&c, "dynamo.discovery.kubernetes.namespace", "DNS-1123");
    }
}

#[test]
fn dynamo_namespace_must_be_non_empty_label_value() {
    for bad in ["", "has space", "-edge", "a/b", &"a".repeat(64)] {
        let mut c = pods();
        c.dynamo.discovery.kubernetes.dynamo_namespace = bad.to_owned();
        expect(
            &c,
            Severity::Error,
            "dynamo.discovery.kubernetes.dynamo_namespace",
            "",
        );
    }
    let mut ok = pods();
    ok.dynamo.discovery.kubernetes.dynamo_namespace = "Kbm.G_np-1".into();
    expect_clean_at(&ok, "dynamo.discovery.kubernetes.dynamo_namespace");
}

#[test]
fn dynamo_namespaces_follow_namespace_list_rules() {
    let mut c = pods();
    c.dynamo.discovery.kubernetes.dynamo_namespace = "solo".into();
    c.dynamo.discovery.kubernetes.dynamo_namespaces = strings(&["a", "a", "bad value"]);
    expect_error(
        &c,
        "dynamo.discovery.kubernetes.dynamo_namespaces",
        "mutually exclusive",
    );
    expect_error(
        &c,
        "dynamo.discovery.kubernetes.dynamo_namespaces[1]",
        "listed twice",
    );
    expect_error(
        &c,
        "dynamo.discovery.kubernetes.dynamo_namespaces[2]",
        "whitespace",
    );
}

#[test]
fn kubernetes_pods_needs_exactly_one_of_model_or_models() {
    let mut c = pods();
    c.dynamo.discovery.kubernetes.model = None;
    expect_error(
        &c,
        "dynamo.discovery.kubernetes.model",
        "needs kubernetes.model",
    );
    let mut c = pods();
    c.dynamo.discovery.kubernetes.models = vec![ComponentModel {
        component: "worker".into(),
        model: "m".into(),
        dynamo_namespace: None,
    }];
    expect_error(&c, "dynamo.discovery.kubernetes.models", "not both");
}

#[test]
fn kubernetes_pods_model_non_empty_without_whitespace() {
    let mut c = pods();
    c.dynamo.discovery.kubernetes.model = Some("solar pro".into());
    expect_error(&c, "dynamo.discovery.kubernetes.model", "no whitespace");
    c.dynamo.discovery.kubernetes.model = Some(String::new());
    expect_error(&c, "dynamo.discovery.kubernetes.model", "non-empty");
}

fn pods_with_models(n: usize) -> Config {
    let mut c = pods();
    c.dynamo.discovery.kubernetes.model = None;
    c.dynamo.discovery.kubernetes.models = (0..n)
        .map(|i| ComponentModel {
            component: format!("worker-{i}"),
            model: format!("model-{i}"),
            dynamo_namespace: None,
        })
        .collect();
    c
}

#[test]
fn kubernetes_models_one_to_256_unique_components() {
    expect_error(
        &pods_with_models(257),
        "dynamo.discovery.kubernetes.models",
        "at most 256",
    );
    let mut c = pods_with_models(2);
    c.dynamo.discovery.kubernetes.models[1].component = "worker-0".into();
    expect_error(
        &c,
        "dynamo.discovery.kubernetes.models[1].component",
        "listed twice",
    );
    assert!(
        validate(&pods_with_models(256))
            .iter()
            .all(|d| !d.is_error())
    );
}

#[test]
fn kubernetes_models_entries_need_label_component_and_model_without_whitespace() {
    let mut c = pods_with_models(1);
    c.dynamo.discovery.kubernetes.models[0].component = String::new();
    c.dynamo.discovery.kubernetes.models[0].model = "two words".into();
    expect_error(
        &c,
        "dynamo.discovery.kubernetes.models[0].component",
        "label value",
    );
    expect_error(
        &c,
        "dynamo.discovery.kubernetes.models[0].model",
        "no whitespace",
    );
}

#[test]
fn kubernetes_models_need_dynamo_namespace_with_several_namespaces() {
    let mut c = pods_with_models(1);
    c.dynamo.discovery.kubernetes.dynamo_namespace = "dynamo".into();
    c.dynamo.discovery.kubernetes.dynamo_namespaces = strings(&["prod", "canary"]);
    c.dynamo.shim.backends.clear();
    c.dynamo.shim.pools = vec![
        ShimPool {
            namespace: "prod".into(),
            backends: strings(&["shim-a"]),
        },
        ShimPool {
            namespace: "canary".into(),
            backends: strings(&["shim-b"]),
        },
    ];
    expect_error(
        &c,
        "dynamo.discovery.kubernetes.models[0].dynamo_namespace",
        "must name",
    );
    c.dynamo.discovery.kubernetes.models[0].dynamo_namespace = Some("staging".into());
    expect_error(
        &c,
        "dynamo.discovery.kubernetes.models[0].dynamo_namespace",
        "not one of the configured",
    );
    c.dynamo.discovery.kubernetes.models[0].dynamo_namespace = Some("prod".into());
    assert!(
        validate(&c).iter().all(|d| !d.is_error()),
        "{:#?}",
        validate(&c)
    );
}

#[test]
fn kubernetes_source_with_model_warns_ignored() {
    let mut c = pods();
    c.dynamo.discovery.source = DiscoverySource::Kubernetes;
    let diagnostics = expect(
        &c,
        Severity::Warning,
        "dynamo.discovery.kubernetes.model",
        "ignored",
    );
    assert!(
        diagnostics.iter().all(|d| !d.is_error()),
        "{diagnostics:#?}"
    );
}

// ---- kv ----

#[test]
fn conditional_disaggregation_enabled_warns() {
    let mut c = base();
    c.dynamo.kv.conditional_disaggregation.enabled = true;
    expect_warning(&c, "dynamo.kv.conditional_disaggregation.enabled", "1.5.x");
}

#[test]
fn decode_busy_threshold_is_a_fraction() {
    let mut c = base();
    c.dynamo.kv.conditional_disaggregation.decode_busy_threshold = Some(1.5);
    expect_error(
        &c,
        "dynamo.kv.conditional_disaggregation.decode_busy_threshold",
        "0.0..=1.0",
    );
}

#[test]
fn pinned_artifacts_must_be_blake3_lowercase_hex() {
    let mut c = base();
    c.dynamo.kv.pinned_artifacts = vec![
        format!("blake3:{}", hex64('a')),
        format!("blake3:{}", hex64('A')),
        format!("sha256:{}", hex64('a')),
        "blake3:abc".into(),
    ];
    expect_clean_at(&c, "dynamo.kv.pinned_artifacts[0]");
    for i in 1..=3 {
        expect_error(
            &c,
            &format!("dynamo.kv.pinned_artifacts[{i}]"),
            "blake3:<64 lowercase hex>",
        );
    }
}

#[test]
fn duplicate_pinned_artifact_warns() {
    let mut c = base();
    c.dynamo.kv.pinned_artifacts = vec![format!("blake3:{}", hex64('b')); 2];
    expect_warning(&c, "dynamo.kv.pinned_artifacts[1]", "listed twice");
}

#[test]
fn tie_break_window_is_finite_and_at_most_16() {
    let mut c = base();
    for ok in [0.0, 0.25, 16.0] {
        c.dynamo.load.tie_break_window = ok;
        assert!(
            !validate(&c)
                .iter()
                .any(|d| d.path == "dynamo.load.tie_break_window"),
            "{ok}"
        );
    }
    for bad in [-0.1, 16.5, f64::NAN, f64::INFINITY] {
        c.dynamo.load.tie_break_window = bad;
        expect_error(&c, "dynamo.load.tie_break_window", "0..=16");
    }
}

#[test]
fn peer_slots_warn_without_a_window_or_replica_sync() {
    let mut c = base();
    let on_path = |c: &Config| {
        validate(c)
            .into_iter()
            .filter(|d| d.path == "dynamo.load.peer_slots")
            .count()
    };
    assert_eq!(on_path(&c), 0, "off: nothing to say");
    c.dynamo.load.peer_slots = true;
    expect_warning(&c, "dynamo.load.peer_slots", "tie_break_window");
    expect_warning(&c, "dynamo.load.peer_slots", "replica_sync");
    c.dynamo.load.tie_break_window = 2.0;
    assert_eq!(on_path(&c), 1, "still without replica_sync");
}

#[test]
fn router_temperature_must_be_non_negative() {
    let mut c = base();
    c.dynamo.kv.router_temperature = -0.1;
    expect_error(&c, "dynamo.kv.router_temperature", ">= 0");
    c.dynamo.kv.router_temperature = f64::NAN;
    expect_error(&c, "dynamo.kv.router_temperature", "finite");
}

#[test]
fn overlap_credit_and_prefill_scale_must_be_non_negative() {
    let mut c = base();
    c.dynamo.kv.overlap_score_credit = -1.0;
    c.dynamo.kv.prefill_load_scale = f64::INFINITY;
    expect_error(&c, "dynamo.kv.overlap_score_credit", ">= 0");
    expect_error(&c, "dynamo.kv.prefill_load_scale", ">= 0");
}

#[test]
fn artifact_cache_dir_must_be_non_empty() {
    let mut c = base();
    c.dynamo.kv.artifact_cache_dir = PathBuf::new();
    expect_error(&c, "dynamo.kv.artifact_cache_dir", "must not be empty");
}

#[test]
fn kv_enabled_without_pins_warns() {
    let mut c = base();
    c.dynamo.kv.enabled = true;
    expect_warning(&c, "dynamo.kv.pinned_artifacts", "no artifact is pinned");
}

#[test]
fn kv_enabled_while_dynamo_disabled_warns() {
    let mut c = base();
    c.dynamo.enabled = false;
    c.dynamo.kv.enabled = true;
    expect_warning(&c, "dynamo.kv.enabled", "dynamo.enabled is false");
}

#[test]
fn send_token_data_without_kv_warns() {
    let mut c = base();
    c.dynamo.kv.send_token_data = true;
    expect_warning(&c, "dynamo.kv.send_token_data", "kv.enabled is false");
}

// ---- event bus ----

fn bus() -> Config {
    let mut c = base();
    c.dynamo.load.transport = LoadTransport::Broker;
    let bus = &mut c.dynamo.event_bus;
    bus.enabled = true;
    bus.tls = Some(EventBusTlsConfig {
        cert: Some("/tls.crt".into()),
        key: Some("/tls.key".into()),
        client_ca: None,
    });
    bus.brokers = vec![
        BrokerConfig {
            id: "broker-a.dynamo".into(),
            role: BrokerRole::Broker,
            token_hash: Some(format!("sha256:{}", hex64('1'))),
            namespaces: strings(&["dynamo"]),
            backends: Vec::new(),
        },
        BrokerConfig {
            id: "kv-listener-a".into(),
            role: BrokerRole::KvListener,
            token_hash: Some(format!("sha256:{}", hex64('2'))),
            namespaces: Vec::new(),
            backends: strings(&["shim-b"]),
        },
    ];
    c.dynamo.kv.kv_cache_index.sources = vec![KvCacheIndexSource {
        backend: "shim-b".into(),
        transport: KvSourceTransport::EventBus,
    }];
    c
}

#[test]
fn event_bus_base_is_clean() {
    assert_eq!(validate(&bus()), Vec::new());
}

#[test]
fn event_bus_listen_must_not_collide_with_server_bind_address() {
    let mut c = bus();
    c.dynamo.event_bus.listen = "0.0.0.0:8080".parse().unwrap();
    expect_error(
        &c,
        "dynamo.event_bus.listen",
        "collides with server.bind_address",
    );
    c.dynamo.event_bus.listen = "127.0.0.2:8080".parse().unwrap();
    expect_clean_at(&c, "dynamo.event_bus.listen");
}

#[test]
fn event_bus_requires_tls_cert_and_key_when_enabled() {
    let mut c = bus();
    c.dynamo.event_bus.tls = None;
    expect_error(&c, "dynamo.event_bus.tls", "TLS-only");
    let mut c = bus();
    c.dynamo.event_bus.tls.as_mut().unwrap().key = None;
    expect_error(&c, "dynamo.event_bus.tls.key", "required");
    let mut c = bus();
    c.dynamo.event_bus.tls.as_mut().unwrap().cert = None;
    expect_error(&c, "dynamo.event_bus.tls.cert", "required");
}

#[test]
fn broker_token_hash_must_be_sha256_lowercase_hex() {
    let mut c = bus();
    c.dynamo.event_bus.brokers[0].token_hash = Some("plaintext-token".into());
    expect_error(
        &c,
        "dynamo.event_bus.brokers[0].token_hash",
        "sha256:<64 lowercase hex>",
    );
    c.dynamo.event_bus.brokers[0].token_hash = Some(format!("sha256:{}", hex64('F')));
    expect_error(
        &c,
        "dynamo.event_bus.brokers[0].token_hash",
        "sha256:<64 lowercase hex>",
    );
}

#[test]
fn broker_entry_needs_a_credential() {
    let mut c = bus();
    c.dynamo.event_bus.brokers[0].token_hash = None;
    expect_error(
        &c,
        "dynamo.event_bus.brokers[0].token_hash",
        "no credential",
    );
    c.dynamo.event_bus.tls.as_mut().unwrap().client_ca = Some("/ca.crt".into());
    expect_clean_at(&c, "dynamo.event_bus.brokers[0].token_hash");
}

#[test]
fn kv_listener_needs_backends_and_no_namespaces() {
    let mut c = bus();
    c.dynamo.event_bus.brokers[1].backends.clear();
    c.dynamo.event_bus.brokers[1].namespaces = strings(&["dynamo"]);
    expect_error(
        &c,
        "dynamo.event_bus.brokers[1].backends",
        "at least one granted backend",
    );
    expect_error(
        &c,
        "dynamo.event_bus.brokers[1].namespaces",
        "not namespaces",
    );
}

#[test]
fn kv_listener_unknown_backend_warns() {
    let mut c = bus();
    c.dynamo.event_bus.brokers[1].backends = strings(&["ghost"]);
    expect_warning(&c, "dynamo.event_bus.brokers[1].backends[0]", "not defined");
}

#[test]
fn broker_role_cannot_take_backend_grants() {
    let mut c = bus();
    c.dynamo.event_bus.brokers[0].backends = strings(&["shim-a"]);
    expect_error(
        &c,
        "dynamo.event_bus.brokers[0].backends",
        "role kv_listener",
    );
}

#[test]
fn broker_with_empty_namespaces_warns() {
    let mut c = bus();
    c.dynamo.event_bus.brokers[0].namespaces.clear();
    expect_warning(
        &c,
        "dynamo.event_bus.brokers[0].namespaces",
        "any Dynamo namespace",
    );
}

#[test]
fn broker_namespace_not_configured_warns() {
    let mut c = bus();
    c.dynamo.event_bus.brokers[0].namespaces = strings(&["other"]);
    expect_warning(
        &c,
        "dynamo.event_bus.brokers[0].namespaces[0]",
        "not a configured",
    );
}

#[test]
fn broker_ids_must_be_unique() {
    let mut c = bus();
    c.dynamo.event_bus.brokers[1].id = "broker-a.dynamo".into();
    expect_error(&c, "dynamo.event_bus.brokers[1].id", "used twice");
}

#[test]
fn broker_id_must_be_lowercase_dns_name_without_wildcard() {
    for bad in ["Broker-A", "*.dynamo", "", "a..b"] {
        let mut c = bus();
        c.dynamo.event_bus.brokers[0].id = bad.to_owned();
        expect_error(&c, "dynamo.event_bus.brokers[0].id", "lowercase DNS name");
    }
}

#[test]
fn brokers_at_most_256() {
    let mut c = bus();
    let template = c.dynamo.event_bus.brokers[0].clone();
    c.dynamo.event_bus.brokers = (0..257)
        .map(|i| BrokerConfig {
            id: format!("b{i}"),
            ..template.clone()
        })
        .collect();
    expect_error(&c, "dynamo.event_bus.brokers", "at most 256");
}

#[test]
fn session_buffer_at_least_streams_times_64_kib() {
    let mut c = bus();
    c.dynamo.event_bus.max_streams_per_session = 1024;
    c.dynamo.event_bus.max_session_buffer_bytes = 1024 * 64 * 1024 - 1;
    expect_error(&c, "dynamo.event_bus.max_session_buffer_bytes", "64 KiB");
    c.dynamo.event_bus.max_session_buffer_bytes = 1024 * 64 * 1024;
    expect_clean_at(&c, "dynamo.event_bus.max_session_buffer_bytes");
    // The session budget is the HTTP/2 connection window: at most 2^31 - 1.
    c.dynamo.event_bus.max_streams_per_session = 1;
    c.dynamo.event_bus.max_session_buffer_bytes = (1 << 31) - 1;
    expect_clean_at(&c, "dynamo.event_bus.max_session_buffer_bytes");
    c.dynamo.event_bus.max_session_buffer_bytes = 1 << 31;
    expect_error(
        &c,
        "dynamo.event_bus.max_session_buffer_bytes",
        "HTTP/2 connection window",
    );
}

#[test]
fn max_sessions_and_streams_must_be_in_range() {
    let mut c = bus();
    c.dynamo.event_bus.max_sessions = 0;
    c.dynamo.event_bus.max_streams_per_session = 0;
    expect_error(&c, "dynamo.event_bus.max_sessions", "1..=");
    expect_error(&c, "dynamo.event_bus.max_streams_per_session", "1..=");
}

#[test]
fn idle_timeout_must_exceed_positive_heartbeat_interval() {
    let mut c = bus();
    c.dynamo.event_bus.heartbeat_interval = HumanDuration::from_secs(30);
    expect_error(
        &c,
        "dynamo.event_bus.idle_timeout",
        "must exceed heartbeat_interval",
    );
    c.dynamo.event_bus.heartbeat_interval = HumanDuration::from_secs(0);
    expect_error(&c, "dynamo.event_bus.heartbeat_interval", "greater than 0");
}

#[test]
fn enabled_event_bus_without_brokers_warns() {
    let mut c = bus();
    c.dynamo.event_bus.brokers.clear();
    expect_warning(&c, "dynamo.event_bus.brokers", "no brokers");
}

#[test]
fn event_bus_enabled_while_dynamo_disabled_warns() {
    let mut c = bus();
    c.dynamo.enabled = false;
    expect_warning(&c, "dynamo.event_bus.enabled", "dynamo.enabled is false");
}

#[test]
fn broker_transport_without_event_bus_is_an_error() {
    let mut c = bus();
    c.dynamo.event_bus.enabled = false;
    expect_error(
        &c,
        "dynamo.load.transport",
        "dynamo.event_bus.enabled is false",
    );
    // Never a silent fallback: the same config with the bus enabled is clean there, and
    // transport direct needs no bus.
    c.dynamo.event_bus.enabled = true;
    expect_clean_at(&c, "dynamo.load.transport");
    c.dynamo.event_bus.enabled = false;
    c.dynamo.load.transport = LoadTransport::Direct;
    expect_clean_at(&c, "dynamo.load.transport");
}

#[test]
fn errors_sort_before_warnings() {
    let mut c = base();
    c.dynamo.kv.send_token_data = true;
    c.dynamo.load.max_staleness = HumanDuration::from_millis(1);
    let diagnostics = validate(&c);
    assert!(diagnostics[0].is_error());
    assert!(!diagnostics.last().unwrap().is_error());
}

const FILE_YAML: &str = r#"
disaggregated_serving: {enabled: true}
backends:
  - {name: shim-a, url: "http://shim-a:8000"}
dynamo:
  enabled: true
  discovery:
    source: file
    file: {root: /tmp/dynamo_store_kv, namespace: dyntest}
  load: {direct_allow_cidrs: ["127.0.0.0/8"]}
  shim: {backends: [shim-a]}
"#;

fn file_store() -> Config {
    Config::from_yaml_str(FILE_YAML, &BTreeMap::new()).unwrap()
}

#[test]
fn file_source_needs_no_etcd_and_reads_its_own_namespace() {
    let c = file_store();
    assert_eq!(
        validate(&c)
            .iter()
            .filter(|d| d.severity == Severity::Error)
            .count(),
        0,
        "{:#?}",
        validate(&c)
    );
    assert_eq!(c.dynamo.discovery.namespace_names(), ["dyntest"]);
    let mut bad = file_store();
    bad.dynamo.discovery.file.namespace = "a/b".into();
    expect_error(&bad, "dynamo.discovery.file.namespace", "");
}

#[test]
fn file_source_bounds_root_ttl_and_rescan() {
    let mut c = file_store();
    c.dynamo.discovery.file.root = Some(PathBuf::new());
    expect_error(&c, "dynamo.discovery.file.root", "must not be empty");
    let mut c = file_store();
    c.dynamo.discovery.file.ttl = HumanDuration::from_secs(0);
    expect_error(&c, "dynamo.discovery.file.ttl", "greater than 0");
    let mut c = file_store();
    c.dynamo.discovery.file.rescan_interval = HumanDuration::from_millis(1);
    expect_error(&c, "dynamo.discovery.file.rescan_interval", "at least 10ms");
    let mut c = file_store();
    c.dynamo.discovery.file.rescan_interval = HumanDuration::from_secs(30);
    expect_warning(
        &c,
        "dynamo.discovery.file.rescan_interval",
        "longer than ttl",
    );
    expect_clean_at(&file_store(), "dynamo.discovery.file.rescan_interval");
}

#[test]
fn global_prompts_are_bounded_and_replicas_should_rewrite_alike() {
    let mut c = base();
    c.backends[0].global_prompts = strings(&["ok", "  "]);
    expect_error(&c, "backends[0].global_prompts[1]", "must not be empty");
    c.backends[0].global_prompts = vec!["x".repeat(MAX_GLOBAL_PROMPT_BYTES + 1)];
    expect_error(&c, "backends[0].global_prompts[0]", "at most");
    c.backends[0].global_prompts = vec!["p".to_owned(); MAX_GLOBAL_PROMPTS + 1];
    expect_error(&c, "backends[0].global_prompts", "at most");

    let mut c = base();
    c.backends[0].global_prompts = strings(&["be brief"]);
    c.backends[0].requires_single_leading_system = true;
    expect_clean_at(&c, "backends[0].global_prompts");
    c.dynamo.shim.backends = strings(&["shim-a", "shim-b"]);
    expect_warning(
        &c,
        "dynamo.shim.backends",
        "renders with the first replica's",
    );
    c.backends[1].global_prompts = strings(&["be brief"]);
    c.backends[1].requires_single_leading_system = true;
    expect_clean_at(&c, "dynamo.shim.backends");
}

#[test]
fn responses_api_parses_converted_and_native() {
    let yaml = BASE_YAML.replace(
        r#"{name: shim-b, url: "http://shim-b:8000"}"#,
        r#"{name: shim-b, url: "http://shim-b:8000", responses_api: native}"#,
    );
    let c = Config::from_yaml_str(&yaml, &BTreeMap::new()).unwrap();
    assert_eq!(c.backends[0].responses_api, ResponsesApi::Converted);
    assert_eq!(c.backends[1].responses_api, ResponsesApi::Native);
    let bad = BASE_YAML.replace(
        r#"{name: shim-b, url: "http://shim-b:8000"}"#,
        r#"{name: shim-b, url: "http://shim-b:8000", responses_api: sometimes}"#,
    );
    assert!(Config::from_yaml_str(&bad, &BTreeMap::new()).is_err());
}

#[test]
fn responses_only_models_are_served_models_of_a_native_backend() {
    let mut c = base();
    c.backends[1].responses_only_models = strings(&["m"]);
    expect_error(
        &c,
        "backends[1].responses_only_models",
        "needs responses_api: native",
    );
    c.backends[1].responses_api = ResponsesApi::Native;
    expect_clean_at(&c, "backends[1].responses_only_models");
    c.backends[1].models = strings(&["other"]);
    expect_error(
        &c,
        "backends[1].responses_only_models[0]",
        "not in this backend's models",
    );
    c.backends[1].models = strings(&["other", "m"]);
    c.backends[1].responses_only_models = strings(&["m", "m", " "]);
    expect_error(&c, "backends[1].responses_only_models[1]", "listed twice");
    expect_error(
        &c,
        "backends[1].responses_only_models[2]",
        "must not be empty",
    );
}
