//! Parse, interpolation, load, report, show and template tests for the config module.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::time::Duration;

use super::*;

fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn parse(yaml: &str) -> Result<Config, ConfigError> {
    Config::from_yaml_str(yaml, &env(&[]))
}

fn parse_paths(error: &ConfigError) -> Vec<&str> {
    error
        .diagnostics()
        .iter()
        .map(|d| d.path.as_str())
        .collect()
}

#[test]
fn empty_document_is_all_defaults() {
    let config = parse("").unwrap();
    assert_eq!(config, Config::default());
    assert_eq!(config.server.bind_address.to_string(), "127.0.0.1:8080");
    assert_eq!(
        config.dynamo.load.max_staleness.get(),
        Duration::from_secs(3)
    );
    assert!(config.dynamo.kv.allow_http_artifacts);
    assert!(!config.dynamo.kv.allow_hf_artifacts);
    assert_eq!(config.dynamo.discovery.namespace_names(), vec!["dynamo"]);
    assert_eq!(
        config.dynamo.event_bus.max_session_buffer_bytes,
        64 * 1024 * 1024
    );
}

#[test]
fn parses_the_reference_etcd_example_with_humantime_durations() {
    let config = parse(
        r#"
dynamo:
  enabled: true
  discovery:
    etcd:
      endpoints: ["http://etcd-0.dynamo.svc:2379", "etcd-1:2379", "[::1]:2379"]
      namespace: "dynamo"
      watch_reconnect_backoff: {initial: "250ms", max: "1m"}
  load:
    max_staleness: "3s"
    direct_allow_cidrs: ["10.0.0.0/8", "fd00::/8"]
  shim:
    backends: [dynamo-frontend]
    model_map:
      qwen3-32b: "Qwen/Qwen3-32B"
"#,
    )
    .unwrap();
    let etcd = &config.dynamo.discovery.etcd;
    assert_eq!(
        etcd.normalized_endpoints(),
        vec![
            "http://etcd-0.dynamo.svc:2379",
            "http://etcd-1:2379",
            "http://[::1]:2379"
        ]
    );
    assert_eq!(
        etcd.watch_reconnect_backoff.initial.get(),
        Duration::from_millis(250)
    );
    assert_eq!(
        etcd.watch_reconnect_backoff.max.get(),
        Duration::from_secs(60)
    );
    assert_eq!(config.dynamo.load.allow_cidrs().unwrap().len(), 2);
    assert_eq!(
        config.dynamo.shim.backends_for("dynamo"),
        ["dynamo-frontend"]
    );
}

#[test]
fn interpolates_env_vars_and_escapes() {
    let config = Config::from_yaml_str(
        r#"
admin: {enabled: true, token: "${TOKEN}"}
telemetry: {service_name: "router-${REGION}-$${literal}"}
"#,
        &env(&[("TOKEN", "s3cret-token-value"), ("REGION", "eu")]),
    )
    .unwrap();
    assert_eq!(config.admin.token.as_deref(), Some("s3cret-token-value"));
    assert_eq!(config.telemetry.service_name, "router-eu-${literal}");
}

#[test]
fn unset_env_var_is_an_error_naming_path_and_variable_for_every_occurrence() {
    let error = parse(
        r#"
admin: {token: "${NO_SUCH_TOKEN}"}
dynamo:
  discovery:
    etcd:
      endpoints: ["http://a:2379", "${ETCD_HOST}:2379"]
"#,
    )
    .unwrap_err();
    let diagnostics = error.diagnostics();
    assert_eq!(diagnostics.len(), 2, "{error}");
    assert_eq!(diagnostics[0].path, "admin.token");
    assert!(diagnostics[0].message.contains("NO_SUCH_TOKEN"));
    assert_eq!(diagnostics[1].path, "dynamo.discovery.etcd.endpoints[1]");
    assert!(diagnostics[1].message.contains("ETCD_HOST"));
}

#[test]
fn whole_value_reference_coerces_to_bool_or_number_only_where_needed() {
    let config = Config::from_yaml_str(
        r#"
dynamo:
  enabled: "${ENABLED}"
  event_bus: {max_sessions: "${SESSIONS}"}
  discovery:
    etcd:
      auth: {username: router, password: "${PW}"}
"#,
        &env(&[("ENABLED", "true"), ("SESSIONS", "8"), ("PW", "1234")]),
    )
    .unwrap();
    assert!(config.dynamo.enabled);
    assert_eq!(config.dynamo.event_bus.max_sessions, 8);
    assert_eq!(config.dynamo.discovery.etcd.auth.unwrap().password, "1234");
}

#[test]
fn yaml_1_1_booleans_and_numeric_looking_strings_stay_strings() {
    let config = parse(
        r#"
api_keys: [{key: 0755, name: n}]
backends: [{name: on, url: "http://a:1", models: [2024, 1_000, y]}]
dynamo:
  discovery: {etcd: {namespace: no}}
"#,
    )
    .unwrap();
    assert_eq!(config.api_keys[0].key, "0755");
    assert_eq!(config.api_keys[0].name, "n");
    assert_eq!(config.backends[0].name, "on");
    assert_eq!(config.backends[0].models, ["2024", "1_000", "y"]);
    assert_eq!(config.dynamo.discovery.etcd.namespace, "no");
    // Booleans take only YAML 1.2 spellings.
    let error = parse("dynamo: {enabled: yes}").unwrap_err();
    assert_eq!(parse_paths(&error), vec!["dynamo.enabled"]);
    // A wrong number keeps its own message rather than turning into a string error.
    let error = parse("dynamo: {event_bus: {max_sessions: -1}}").unwrap_err();
    assert!(error.diagnostics()[0].message.contains("-1"), "{error}");
}

#[test]
fn unknown_keys_are_errors_with_their_path_at_every_level() {
    let error = parse(
        r#"
srever: {}
server: {bind_adress: "127.0.0.1:1"}
backends:
  - {name: a, url: "http://a:1", healthcheck: {}}
dynamo:
  discovery:
    etcd:
      tls: {ca_cert: /ca.pem, client_crt: /c.pem}
  shim:
    pools:
      - {namespace: dynamo, backends: [a], extra: 1}
  event_bus:
    brokers:
      - {id: b, token_hash: x, namespace: [dynamo]}
"#,
    )
    .unwrap_err();
    let mut paths = parse_paths(&error);
    paths.sort_unstable();
    assert_eq!(
        paths,
        vec![
            "backends[0].healthcheck",
            "dynamo.discovery.etcd.tls.client_crt",
            "dynamo.event_bus.brokers[0].namespace",
            "dynamo.shim.pools[0].extra",
            "server.bind_adress",
            "srever",
        ],
        "{error}"
    );
    assert!(
        error
            .diagnostics()
            .iter()
            .all(|d| d.message == "unknown key")
    );
}

#[test]
fn type_errors_name_their_path() {
    let error = parse("dynamo:\n  load:\n    max_staleness: fast\n").unwrap_err();
    assert_eq!(parse_paths(&error), vec!["dynamo.load.max_staleness"]);
    assert!(error.diagnostics()[0].message.contains("invalid duration"));

    let error = parse("dynamo:\n  discovery:\n    source: consul\n").unwrap_err();
    assert_eq!(parse_paths(&error), vec!["dynamo.discovery.source"]);
}

#[test]
fn every_type_error_is_reported_not_just_the_first() {
    let error = parse(
        r#"
server: {bind_address: "not an address"}
backends:
  - {name: [a], url: "http://a:1"}
api_keys:
  - {name: no-key}
dynamo:
  enabled: maybe
  discovery: {etcd: {namespace: [x]}}
  load: {max_staleness: soon}
  bogus: 1
"#,
    )
    .unwrap_err();
    let mut paths = parse_paths(&error);
    paths.sort_unstable();
    assert_eq!(
        paths,
        vec![
            "api_keys[0]",
            "backends[0].name",
            "dynamo.bogus",
            "dynamo.discovery.etcd.namespace",
            "dynamo.enabled",
            "dynamo.load.max_staleness",
            "server.bind_address",
        ],
        "{error}"
    );
}

#[test]
fn duplicate_keys_and_bad_yaml_are_refused() {
    assert!(matches!(
        parse("server: {}\nserver: {}\n"),
        Err(ConfigError::Yaml(_))
    ));
    assert!(matches!(parse("server: [\n"), Err(ConfigError::Yaml(_))));
}

#[test]
fn load_reads_a_file_and_returns_warnings() {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    file.write_all(b"dynamo:\n  kv:\n    conditional_disaggregation: {enabled: true}\n")
        .unwrap();
    let loaded = Config::load(file.path()).unwrap();
    assert!(loaded.config.dynamo.kv.conditional_disaggregation.enabled);
    assert!(loaded.diagnostics.iter().all(|d| !d.is_error()));
    assert!(!loaded.diagnostics.is_empty());
}

#[test]
fn load_fails_with_every_diagnostic_when_validation_finds_errors() {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    file.write_all(
        b"dynamo:\n  enabled: true\n  load: {max_staleness: 1ms}\n  kv: {router_temperature: -1}\n",
    )
    .unwrap();
    let error = Config::load(file.path()).unwrap_err();
    let ConfigError::Invalid(diagnostics) = &error else {
        panic!("expected Invalid, got {error}");
    };
    let paths: Vec<&str> = diagnostics.iter().map(|d| d.path.as_str()).collect();
    assert!(paths.contains(&"dynamo.discovery.etcd.endpoints"));
    assert!(paths.contains(&"dynamo.load.max_staleness"));
    assert!(paths.contains(&"dynamo.kv.router_temperature"));
    assert!(
        diagnostics.iter().any(|d| !d.is_error()),
        "warnings are kept too"
    );
}

#[test]
fn load_refuses_missing_and_oversized_files() {
    let dir = tempfile::tempdir().unwrap();
    assert!(matches!(
        Config::load(&dir.path().join("absent.yaml")),
        Err(ConfigError::Io { .. })
    ));
    let big = dir.path().join("big.yaml");
    std::fs::write(&big, vec![b'#'; (MAX_CONFIG_BYTES + 1) as usize]).unwrap();
    assert!(matches!(
        Config::load(&big),
        Err(ConfigError::TooLarge { .. })
    ));
}

#[test]
fn validation_report_exit_codes_and_paths() {
    let path = std::path::Path::new("router.yaml");
    let ok = Config::from_yaml_str_validated("dynamo: {kv: {send_token_data: true}}", &env(&[]));
    let (text, code) = render_validation_report(path, &ok);
    assert_eq!(code, 0);
    assert!(
        text.contains("warning: dynamo.kv.send_token_data:"),
        "{text}"
    );
    assert!(text.contains("router.yaml: valid (1 warning)"), "{text}");

    let bad = Config::from_yaml_str_validated(
        "dynamo: {load: {max_staleness: 10m}, kv: {send_token_data: true}}",
        &env(&[]),
    );
    let (text, code) = render_validation_report(path, &bad);
    assert_eq!(code, 1);
    assert!(text.contains("error: dynamo.load.max_staleness:"), "{text}");
    assert!(
        text.contains("warning: dynamo.kv.send_token_data:"),
        "{text}"
    );
    assert!(text.contains("invalid (1 error, 1 warning)"), "{text}");

    let (text, code) = render_validation_report(
        path,
        &parse("nope: 1").map(|config| LoadedConfig {
            config,
            diagnostics: Vec::new(),
        }),
    );
    assert_eq!(code, 1);
    assert!(text.contains("error: nope: unknown key"), "{text}");
}

#[test]
fn show_effective_masks_secrets_and_keeps_certificates_readable() {
    let config = parse(
        r#"
admin: {enabled: true, token: "admin-token-0123456789"}
api_keys: [{key: "sk-client-secret", name: client}]
dynamo:
  discovery:
    etcd:
      endpoints: ["https://etcd:2379"]
      tls: {ca_cert: /etc/etcd/ca.pem, client_cert: /etc/etcd/client.pem, client_key: /etc/etcd/client-key.pem}
      auth: {username: router, password: "etcd-password"}
  event_bus:
    tls: {cert: /bus/tls.crt, key: /bus/tls.key}
    brokers:
      - id: broker-a
        token_hash: "sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
"#,
    )
    .unwrap();
    let shown = show_effective(&config);
    for secret in [
        "admin-token-0123456789",
        "sk-client-secret",
        "etcd-password",
        "client-key.pem",
        "/bus/tls.key",
        "aaaaaaaa",
    ] {
        assert!(!shown.contains(secret), "{secret} leaked:\n{shown}");
    }
    for visible in [
        "/etc/etcd/ca.pem",
        "/etc/etcd/client.pem",
        "/bus/tls.crt",
        "router",
    ] {
        assert!(shown.contains(visible), "{visible} missing:\n{shown}");
    }
    // Defaults are filled in.
    assert!(shown.contains("max_staleness: 3s"), "{shown}");
    assert!(shown.contains("bind_address: 127.0.0.1:8080"), "{shown}");
    // The masked output is itself a parseable config with the same shape.
    let reparsed = parse(&shown).unwrap();
    assert_eq!(reparsed.dynamo.load, config.dynamo.load);
    assert_eq!(reparsed.admin.token.as_deref(), Some(mask::MASK));
}

#[test]
fn demo_config_is_valid_and_loopback_only() {
    let demo = Config::demo();
    assert_eq!(demo.server.bind_address.to_string(), "127.0.0.1:8080");
    let parsed = Config::from_yaml_str_validated(Config::demo_yaml(), &env(&[])).unwrap();
    assert_eq!(parsed.config, demo);
    assert!(validate(&demo).iter().all(|d| !d.is_error()));
}

#[test]
fn the_demo_routes_through_simulated_discovery_without_etcd_endpoints() {
    let demo = Config::demo();
    assert!(demo.dynamo.enabled && demo.disaggregated_serving.enabled);
    assert_eq!(demo.dynamo.discovery.source, DiscoverySource::Simulated);
    assert!(demo.dynamo.discovery.etcd.endpoints.is_empty());
    assert_eq!(
        demo.dynamo.discovery.namespace_names(),
        vec!["demo".to_string(), "demo-agg".to_string()]
    );
    let diagnostics = validate(&demo);
    assert!(
        diagnostics
            .iter()
            .any(|d| d.path == "dynamo.discovery.source" && d.message.contains("demo")),
        "{diagnostics:#?}"
    );
    // Every shim pool names a configured backend that serves the namespace's model.
    for pool in &demo.dynamo.shim.pools {
        for name in &pool.backends {
            assert!(demo.backend(name).is_some(), "{name}");
        }
    }
}

fn template_env() -> BTreeMap<String, String> {
    env(&[
        ("ROUTER_ADMIN_TOKEN", "admin-token-0123456789abcdef"),
        ("CLIENT_API_KEY", "sk-client-0123456789"),
        (
            "BROKER_A_TOKEN_SHA256",
            "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
        ),
        (
            "KV_LISTENER_A_TOKEN_SHA256",
            "fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210",
        ),
    ])
}

#[test]
fn seed_templates_validate_without_errors() {
    for (name, text) in [
        (
            "dynamo-direct-shim.yaml",
            include_str!("../../docs/shared/llm-skills/config-templates/dynamo-direct-shim.yaml"),
        ),
        (
            "dynamo-kv-aware.yaml",
            include_str!("../../docs/shared/llm-skills/config-templates/dynamo-kv-aware.yaml"),
        ),
        (
            "dynamo-event-bus.yaml",
            include_str!("../../docs/shared/llm-skills/config-templates/dynamo-event-bus.yaml"),
        ),
    ] {
        let loaded = Config::from_yaml_str_validated(text, &template_env())
            .unwrap_or_else(|error| panic!("{name}: {error}"));
        assert!(loaded.config.dynamo.enabled, "{name}");
        assert!(loaded.config.disaggregated_serving.enabled, "{name}");
    }
}

#[test]
fn masked_readback_round_trips_through_restore_masked() {
    let live = parse(
        r#"
admin: {enabled: true, token: "admin-token-0123456789"}
api_keys: [{key: "sk-1", name: one}]
dynamo:
  discovery:
    etcd:
      endpoints: ["https://etcd:2379"]
      tls: {client_cert: /c.pem, client_key: /k.pem}
      auth: {username: router, password: "pw"}
  event_bus:
    tls: {cert: /bus.crt, key: /bus.key}
    brokers: [{id: b, token_hash: "sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"}]
"#,
    )
    .unwrap();
    let mut imported = parse(&show_effective(&live)).unwrap();
    assert_ne!(imported, live);
    mask::restore_masked(&mut imported, &live);
    assert_eq!(imported, live);
}

/// Every leaf key of a fully populated config, with list indices written as `[]`.
fn leaf_paths(value: &serde_json::Value, prefix: String, out: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(map) if !(prefix.ends_with("model_map")) => {
            for (key, item) in map {
                let path = if prefix.is_empty() {
                    key.clone()
                } else {
                    format!("{prefix}.{key}")
                };
                leaf_paths(item, path, out);
            }
        }
        serde_json::Value::Array(items)
            if items.iter().all(|item| item.is_object()) && !items.is_empty() =>
        {
            for item in items {
                leaf_paths(item, format!("{prefix}[]"), out);
            }
        }
        _ => out.push(prefix),
    }
}

#[test]
fn configuration_doc_lists_every_key() {
    let doc = include_str!("../../docs/configuration.md");
    let full = parse(
        r#"
admin: {token: t}
api_keys: [{key: k, name: n, allowed_backends: [a]}]
backends: [{name: a, url: "http://a:1"}]
telemetry: {otlp: {endpoint: "http://c:4317"}}
dynamo:
  discovery:
    etcd:
      tls: {ca_cert: /a, client_cert: /b, client_key: /c, server_name: s}
      auth: {username: u, password: p}
    kubernetes:
      model: m
      models: [{component: c, model: m, dynamo_namespace: d}]
  load: {direct_allow_cidrs: ["10.0.0.0/8"]}
  shim: {pools: [{namespace: n, backends: [a]}]}
  kv:
    conditional_disaggregation: {decode_busy_threshold: 0.5}
    kv_cache_index: {sources: [{backend: a, transport: event_bus}]}
  event_bus:
    tls: {cert: /a, key: /b, client_ca: /c}
    brokers: [{id: b, token_hash: h, namespaces: [n], backends: [a]}]
"#,
    )
    .unwrap();
    let mut paths = Vec::new();
    leaf_paths(
        &serde_json::to_value(&full).unwrap(),
        String::new(),
        &mut paths,
    );
    paths.sort();
    paths.dedup();
    let missing: Vec<&String> = paths
        .iter()
        .filter(|path| {
            let short = path.replace("dynamo.discovery.", "…");
            !doc.contains(&format!("`{path}`")) && !doc.contains(&format!("`{short}`"))
        })
        .collect();
    assert!(
        missing.is_empty(),
        "docs/configuration.md lacks {missing:#?}"
    );
}

#[test]
fn configuration_doc_full_example_is_valid() {
    let doc = include_str!("../../docs/configuration.md");
    let example = doc
        .split("## Full example")
        .nth(1)
        .and_then(|rest| rest.split("```yaml\n").nth(1))
        .and_then(|rest| rest.split("```").next())
        .unwrap();
    Config::from_yaml_str_validated(example, &template_env()).unwrap();
}

#[test]
fn event_bus_derived_limits_follow_the_reference() {
    let mut bus = EventBusConfig::default();
    assert_eq!(bus.stream_buffer_bytes(), 16 * 1024);
    assert_eq!(bus.max_connections(), 256);
    bus.max_streams_per_session = 1;
    assert_eq!(bus.stream_buffer_bytes(), 1024 * 1024);
    bus.max_sessions = 2;
    assert_eq!(bus.max_connections(), 16);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

    /// External input never panics the parser, the interpolator or the validators.
    #[test]
    fn arbitrary_text_never_panics(text in "[ -~\n\t:{}\\[\\]$]{0,200}") {
        if let Ok(config) = parse(&text) {
            let _ = validate(&config);
            let _ = show_effective(&config);
        }
        let _ = validate::check_endpoint(&text);
        let _ = interpolate::expand(&text, &env(&[("A", "x")]));
    }

    #[test]
    fn arbitrary_endpoint_lists_validate_without_panicking(
        endpoints in proptest::collection::vec("[a-z0-9:/@?#\\[\\].-]{0,24}", 0..20),
    ) {
        let mut config = Config::default();
        config.dynamo.enabled = true;
        config.dynamo.discovery.etcd.endpoints = endpoints;
        let _ = validate(&config);
    }
}

#[test]
fn a_type_error_echoes_the_offending_value() {
    let error = parse("server: {bind_address: \"localhost:8080\"}\n").unwrap_err();
    let diagnostic = &error.diagnostics()[0];
    assert_eq!(diagnostic.path, "server.bind_address");
    assert!(
        diagnostic.message.contains("(got \"localhost:8080\")"),
        "{error}"
    );
    // A value serde already quotes is not repeated.
    let error = parse("dynamo:\n  discovery:\n    source: consul\n").unwrap_err();
    assert_eq!(error.to_string().matches("consul").count(), 1, "{error}");
}

#[test]
fn secrets_and_long_values_are_not_echoed_whole() {
    let token = [PathSeg::Key("admin".into()), PathSeg::Key("token".into())];
    assert_eq!(echo_value(&token, &Value::from("hunter2")), None);
    let password = [PathSeg::Key("auth".into()), PathSeg::Key("password".into())];
    assert_eq!(echo_value(&password, &Value::from(1234)), None);
    let bind = [PathSeg::Key("bind_address".into())];
    let long = echo_value(&bind, &Value::from("x".repeat(500))).expect("echoed");
    assert!(long.len() < 100, "{long}");
    assert_eq!(echo_value(&bind, &Value::Array(vec![])), None);
}

#[test]
fn a_syntax_error_found_late_names_the_line_of_the_mistake() {
    let error = parse("a: 1\nb: [1, 2\n\n# note\nc: 3\n").unwrap_err();
    let text = error.to_string();
    assert!(
        text.contains("the mistake is likely at the end of line 2: \"b: [1, 2\""),
        "{text}"
    );
    let error = parse("server: {bind_address: x\nadmin: {}\n").unwrap_err();
    assert!(text_of(&error).contains("end of line 1"), "{error}");
    // Errors found where they are get no hint.
    let error = parse("server:\n  bind_address: \"127.0.0.1:8080\nadmin: {}\n").unwrap_err();
    assert!(text_of(&error).contains("line 2"), "{error}");
    assert!(!text_of(&error).contains("hint:"), "{error}");
}

fn text_of(error: &ConfigError) -> String {
    error.to_string()
}
