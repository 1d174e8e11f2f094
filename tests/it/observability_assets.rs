//! The shipped observability and image assets, checked offline: the Grafana dashboard's
//! structure, every metric the dashboard and the alert rules read being a documented family,
//! the Dockerfile's runtime stage; and with `real-peers` (CI installs the tools) `promtool check
//! rules`, `promtool test rules` and `hadolint`. `tests/it/observability_prometheus.rs` runs every
//! expression against a real Prometheus scraping the demo.

use std::collections::BTreeSet;
use std::path::PathBuf;

use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The metric names (outside label braces) a PromQL expression reads, with the histogram
/// `_bucket`/`_sum`/`_count` suffix mapped to the family.
fn families(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = expr.as_bytes();
    let (mut i, mut depth, mut quoted) = (0, 0usize, false);
    while i < bytes.len() {
        let c = bytes[i] as char;
        if quoted {
            if c == '\\' {
                i += 1;
            } else if c == '"' {
                quoted = false;
            }
        } else if c == '"' {
            quoted = true;
        } else if c == '{' {
            depth += 1;
        } else if c == '}' {
            depth = depth.saturating_sub(1);
        } else if depth == 0 && (c.is_ascii_alphabetic() || c == '_') {
            let start = i;
            while i < bytes.len()
                && ((bytes[i] as char).is_ascii_alphanumeric() || bytes[i] == b'_')
            {
                i += 1;
            }
            let ident = &expr[start..i];
            if ident.starts_with("continuum_") || ident.starts_with("disaggregated_") {
                let family = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| ident.strip_suffix(s))
                    .filter(|f| f.ends_with("_seconds"))
                    .unwrap_or(ident);
                out.insert(family.to_string());
            }
            continue;
        }
        i += 1;
    }
    out
}

fn dashboard() -> Value {
    serde_json::from_str(&read("deploy/grafana/continuum-router.json")).expect("dashboard JSON")
}

/// Every `(panel title, expr)` of the dashboard.
fn dashboard_exprs(dashboard: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        if panel["type"] == "row" {
            continue;
        }
        let title = panel["title"].as_str().expect("title").to_string();
        for target in panel["targets"].as_array().expect("targets") {
            out.push((
                title.clone(),
                target["expr"].as_str().expect("expr").to_string(),
            ));
        }
    }
    out
}

/// Every `(alert, expr)` of the rule file.
fn alert_exprs() -> Vec<(String, String)> {
    let rules: Value =
        serde_saphyr::from_str(&read("deploy/prometheus/alerts.yaml")).expect("rules YAML");
    let mut out = Vec::new();
    for group in rules["groups"].as_array().expect("groups") {
        for rule in group["rules"].as_array().expect("rules") {
            out.push((
                rule["alert"].as_str().expect("alert name").to_string(),
                rule["expr"].as_str().expect("expr").to_string(),
            ));
        }
    }
    out
}

#[test]
fn the_dashboard_is_a_well_formed_grafana_dashboard() {
    let dashboard = dashboard();
    assert_eq!(dashboard["uid"], "continuum-router");
    assert!(dashboard["schemaVersion"].as_u64().is_some());
    let variables: Vec<&str> = dashboard["templating"]["list"]
        .as_array()
        .expect("templating")
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert_eq!(variables, ["datasource", "job"]);
    let mut ids = BTreeSet::new();
    let mut titles = BTreeSet::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        let id = panel["id"].as_u64().expect("numeric id");
        assert!(ids.insert(id), "panel id {id} twice");
        let grid = &panel["gridPos"];
        let (x, w) = (
            grid["x"].as_u64().expect("x"),
            grid["w"].as_u64().expect("w"),
        );
        assert!(x + w <= 24 && grid["h"].as_u64().expect("h") > 0, "{panel}");
        if panel["type"] == "row" {
            continue;
        }
        let title = panel["title"].as_str().expect("title");
        assert!(titles.insert(title.to_string()), "title {title:?} twice");
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "{title}");
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title} has no query");
        let mut refs = BTreeSet::new();
        for target in targets {
            let expr = target["expr"].as_str().expect("expr");
            assert!(
                !families(expr).is_empty(),
                "{title}: {expr} reads no router metric"
            );
            assert!(
                expr.contains("job=~\"$job\""),
                "{title}: {expr} ignores $job"
            );
            assert!(
                refs.insert(target["refId"].as_str().expect("refId")),
                "{title}"
            );
        }
    }
    // What the issue asks the dashboard to show.
    let all: String = dashboard_exprs(&dashboard)
        .into_iter()
        .map(|(_, e)| e)
        .collect();
    for family in [
        "continuum_dynamo_workers",
        "continuum_dynamo_load_subscriptions",
        "continuum_dynamo_kv_subscriptions",
        "continuum_dynamo_selection_total",
        "continuum_dynamo_worker_active_decode_blocks",
        "continuum_dynamo_kv_selection_total",
        "continuum_dynamo_kv_hash_parity_total",
        "continuum_http_requests_total",
        "continuum_http_request_duration_seconds_bucket",
    ] {
        assert!(all.contains(family), "no panel reads {family}");
    }
}

#[test]
fn every_metric_the_dashboard_and_alerts_read_is_documented() {
    let docs = read("docs/observability.md");
    let mut exprs = dashboard_exprs(&dashboard());
    exprs.extend(alert_exprs());
    assert!(exprs.len() > 20);
    for (what, expr) in exprs {
        for family in families(&expr) {
            assert!(
                docs.contains(&format!("| `{family}` |")),
                "{what}: {family} is not in docs/observability.md's metric table"
            );
        }
    }
    // The extractor itself: label values and names inside braces are not families.
    assert_eq!(
        families(
            r#"sum(rate(continuum_http_request_duration_seconds_bucket{route="continuum_x"}[5m])) / disaggregated_errors_total"#
        ),
        BTreeSet::from([
            "continuum_http_request_duration_seconds".to_string(),
            "disaggregated_errors_total".to_string()
        ])
    );
}

#[test]
fn the_alerts_cover_the_issue_list() {
    let names: Vec<String> = alert_exprs().into_iter().map(|(n, _)| n).collect();
    for name in [
        "ContinuumDiscoveryDisconnected",
        "ContinuumNoFreshLoadSamples",
        "ContinuumKvHashParityZero",
        "ContinuumLoadSubscriptionsPending",
        "ContinuumKvSubscriptionsPending",
        "ContinuumRestartBudgetExhausted",
    ] {
        assert!(names.iter().any(|n| n == name), "missing alert {name}");
    }
}

/// The Dockerfile's instructions, continuation lines joined.
fn dockerfile() -> Vec<(String, String)> {
    let text = read("Dockerfile");
    let mut out = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(head) = line.strip_suffix('\\') {
            current.push_str(head);
            current.push(' ');
            continue;
        }
        current.push_str(line);
        let (op, args) = current.split_once(' ').unwrap_or((&current, ""));
        out.push((op.to_ascii_uppercase(), args.trim().to_string()));
        current.clear();
    }
    out
}

#[test]
fn the_image_runs_the_release_binary_as_non_root_without_a_shell() {
    let steps = dockerfile();
    let stages: Vec<usize> = steps
        .iter()
        .enumerate()
        .filter(|(_, (op, _))| op == "FROM")
        .map(|(i, _)| i)
        .collect();
    assert_eq!(stages.len(), 2, "a build stage and a runtime stage");
    let build = &steps[stages[0]..stages[1]];
    assert!(build.iter().any(|(op, args)| op == "RUN"
        && args.contains("cargo build --release --locked --bin continuum-router")));
    let runtime = &steps[stages[1]..];
    // Distroless: no shell, no package manager; `nonroot` variant.
    let base = &runtime[0].1;
    assert!(
        base.starts_with("gcr.io/distroless/cc-debian12:nonroot"),
        "{base}"
    );
    // No instruction of the runtime stage needs a shell.
    for (op, args) in runtime {
        assert!(
            op != "RUN" && op != "SHELL",
            "{op} {args} needs a shell at runtime"
        );
        if op == "ENTRYPOINT" || op == "CMD" || op == "HEALTHCHECK" {
            assert!(args.starts_with('['), "{op} must use the exec form: {args}");
        }
    }
    let user = runtime
        .iter()
        .rev()
        .find(|(op, _)| op == "USER")
        .map(|(_, args)| args.clone())
        .expect("USER");
    let uid: u32 = user
        .split(':')
        .next()
        .and_then(|u| u.parse().ok())
        .expect("numeric uid");
    assert_ne!(uid, 0, "runs as root");
    let entry = runtime
        .iter()
        .find(|(op, _)| op == "ENTRYPOINT")
        .expect("ENTRYPOINT");
    assert_eq!(entry.1, r#"["/usr/local/bin/continuum-router"]"#);
    // The build context keeps out what the release build does not read.
    let ignore = read(".dockerignore");
    assert!(ignore.lines().any(|l| l.trim() == "target/"));
}

/// A tool CI installs (scripts/test.sh): required under `real-peers`.
#[cfg(feature = "real-peers")]
fn tool(name: &str) -> String {
    let env = format!("CONTINUUM_{}", name.to_ascii_uppercase());
    if let Ok(path) = std::env::var(&env) {
        return path;
    }
    let found = std::process::Command::new("sh")
        .args(["-c", &format!("command -v {name}")])
        .output()
        .expect("sh");
    let path = String::from_utf8_lossy(&found.stdout).trim().to_string();
    assert!(
        !path.is_empty(),
        "{name} is not installed (scripts/test.sh installs it; or set {env})"
    );
    path
}

#[cfg(feature = "real-peers")]
fn run(program: &str, args: &[&str]) -> String {
    let out = std::process::Command::new(program)
        .args(args)
        .current_dir(root())
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{program} {args:?} failed:\n{text}");
    text
}

#[cfg(feature = "real-peers")]
#[test]
fn promtool_accepts_the_rules_and_their_unit_tests_pass() {
    let promtool = tool("promtool");
    let checked = run(
        &promtool,
        &["check", "rules", "deploy/prometheus/alerts.yaml"],
    );
    assert!(
        checked.contains(&format!("SUCCESS: {} rules found", alert_exprs().len())),
        "{checked}"
    );
    let tested = run(
        &promtool,
        &["test", "rules", "deploy/prometheus/alerts.test.yaml"],
    );
    assert!(tested.contains("SUCCESS"), "{tested}");
    // Every alert has at least one firing case in the unit tests.
    let tests = read("deploy/prometheus/alerts.test.yaml");
    for (alert, _) in alert_exprs() {
        assert!(
            tests.contains(&format!(
                "alertname: {alert}\n        exp_alerts:\n          - exp_labels"
            )),
            "{alert} never fires in alerts.test.yaml"
        );
    }
}

#[cfg(feature = "real-peers")]
#[test]
fn hadolint_passes_the_dockerfile() {
    let hadolint = tool("hadolint");
    run(&hadolint, &["--failure-threshold", "info", "Dockerfile"]);
}
