//! Every Grafana panel expression and every alert expression against a real Prometheus
//! (Debian's `prometheus`) scraping the real `continuum-router demo` binary under traffic.
//!
//! The rule (docs/observability.md, "Dashboard and alerts"):
//! - every expression is accepted by Prometheus' query API (a malformed one fails at once);
//! - every dashboard expression returns at least one series;
//! - an alert expression is a condition that is false on a healthy demo, so it must instead be
//!   evaluated by Prometheus itself (the rule file is loaded: every rule reports health `ok`
//!   after an evaluation), and every series selector in it must return data;
//! - the one exception is `continuum_dynamo_kv_hash_parity_total`, whose per-model series exist
//!   only after KV-aware picks (the demo runs no tokenizer): for it the test checks the family
//!   and its `model`/`result` labels on the real metrics registry.
//!
//! Nothing sleeps: every wait polls on a 100 ms tick under a deadline.
#![cfg(feature = "real-peers")]

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use continuum_actors::kv_index::{KvIndexMetrics, KvParityResult};
use continuum_actors::metrics::Metrics;
use serde_json::{Value, json};

const DEADLINE: Duration = Duration::from_secs(90);
/// Families with no series until KV-aware picks happen (see the module docs).
const KV_TRAFFIC_ONLY: &[&str] = &["continuum_dynamo_kv_hash_parity_total"];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

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

fn prometheus_bin() -> String {
    std::env::var("CONTINUUM_PROMETHEUS").unwrap_or_else(|_| "prometheus".into())
}

/// The series selectors (`name{matchers}`) of a PromQL expression, for router families.
fn selectors(expr: &str) -> Vec<(String, String)> {
    let bytes = expr.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i] as char;
        if c == '"' {
            i += 1;
            while i < bytes.len() && bytes[i] != b'"' {
                i += if bytes[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            continue;
        }
        if c.is_ascii_alphabetic() || c == '_' {
            let start = i;
            while i < bytes.len()
                && ((bytes[i] as char).is_ascii_alphanumeric() || bytes[i] == b'_')
            {
                i += 1;
            }
            let name = &expr[start..i];
            if name.starts_with("continuum_") || name.starts_with("disaggregated_") {
                let mut selector = name.to_string();
                if bytes.get(i) == Some(&b'{') {
                    let end = expr[i..].find('}').map_or(expr.len(), |e| i + e + 1);
                    selector.push_str(&expr[i..end]);
                    i = end;
                }
                out.push((name.to_string(), selector));
            }
            continue;
        }
        i += 1;
    }
    out
}

/// RFC 3986 percent-encoding of everything but unreserved characters.
fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 3);
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

struct Prom {
    client: reqwest::Client,
    base: String,
}

impl Prom {
    /// `/api/v1/query`: `Err` for a query Prometheus refuses, else the result vector.
    async fn query(&self, expr: &str) -> Result<Vec<Value>, String> {
        let response = self
            .client
            .get(format!(
                "{}/api/v1/query?query={}",
                self.base,
                percent_encode(expr)
            ))
            .send()
            .await
            .map_err(|e| format!("transport: {e}"))?;
        let body: Value = response.json().await.map_err(|e| format!("body: {e}"))?;
        if body["status"] != "success" {
            return Err(format!("{expr}: {body}"));
        }
        Ok(body["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    /// Polls until `expr` returns data; panics on a refused query or at the deadline.
    async fn until_data(&self, what: &str, expr: &str) -> Vec<Value> {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        loop {
            tick.tick().await;
            match self.query(expr).await {
                Ok(result) if !result.is_empty() => return result,
                Ok(_) if tokio::time::Instant::now() < deadline => {}
                Ok(_) => panic!("{what}: {expr} returned no data within {DEADLINE:?}"),
                Err(error) => panic!("{what}: Prometheus refused the query: {error}"),
            }
        }
    }
}

async fn until_ok(client: &reqwest::Client, url: &str) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tick.tick().await;
        match client.get(url).send().await {
            Ok(r) if r.status().is_success() => return,
            _ if tokio::time::Instant::now() < deadline => {}
            other => panic!("{url} never answered 2xx: {other:?}"),
        }
    }
}

/// Chat completions to both demo models until `stop` flips (keeps rates and histograms fed).
fn drive_traffic(
    base: String,
    stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let client = reqwest::Client::new();
        let mut sent = 0u64;
        while !*stop.borrow() {
            for model in ["demo-disagg", "demo-agg", "no-such-model"] {
                let _ = client
                    .post(format!("{base}/v1/chat/completions"))
                    .json(&json!({
                        "model": model,
                        "messages": [{"role": "user", "content": format!("request {sent}")}],
                        "max_tokens": 4,
                    }))
                    .send()
                    .await
                    .and_then(|r| r.error_for_status());
                sent += 1;
            }
        }
        sent
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_and_alert_expression_reads_live_series_from_the_demo() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::new();
    let router_port = free_port();
    let _demo = Child(
        Command::new(env!("CARGO_BIN_EXE_continuum-router"))
            .args(["demo", "--bind", &format!("127.0.0.1:{router_port}")])
            .args(["--publish-interval", "100ms"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start continuum-router demo"),
    );
    let router = format!("http://127.0.0.1:{router_port}");
    until_ok(&client, &format!("{router}/ready")).await;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let traffic = drive_traffic(router.clone(), stop_rx);

    let dir = tempfile::tempdir().expect("tempdir");
    let prom_port = free_port();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n\
             rule_files: [{rules:?}]\n\
             scrape_configs:\n  - job_name: router\n    static_configs:\n      - targets: [\"127.0.0.1:{router_port}\"]\n",
            rules = root().join("deploy/prometheus/alerts.yaml").display().to_string()
        ),
    )
    .expect("prometheus.yml");
    let _prometheus = Child(
        Command::new(prometheus_bin())
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start prometheus (Debian package `prometheus`)"),
    );
    let prom = Prom {
        client: client.clone(),
        base: format!("http://127.0.0.1:{prom_port}"),
    };
    until_ok(&client, &format!("{}/-/ready", prom.base)).await;
    // The scrape itself is healthy.
    let up = prom.until_data("scrape", r#"up{job="router"} == 1"#).await;
    assert_eq!(up.len(), 1);

    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("deploy/grafana/continuum-router.json"))
            .expect("read"),
    )
    .expect("dashboard JSON");
    let rules: Value = serde_saphyr::from_str(
        &std::fs::read_to_string(root().join("deploy/prometheus/alerts.yaml")).expect("read"),
    )
    .expect("rules YAML");

    let mut checked_selectors = BTreeSet::new();
    let mut exempt = BTreeSet::new();
    let mut panels = 0;
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let title = panel["title"].as_str().expect("title");
            let expr = target["expr"].as_str().expect("expr").replace("$job", ".+");
            let families: BTreeSet<String> = selectors(&expr).into_iter().map(|(n, _)| n).collect();
            if families
                .iter()
                .any(|f| KV_TRAFFIC_ONLY.contains(&f.as_str()))
            {
                prom.query(&expr)
                    .await
                    .unwrap_or_else(|e| panic!("{title}: Prometheus refused the query: {e}"));
                exempt.extend(families);
            } else {
                let result = prom.until_data(title, &expr).await;
                assert!(!result.is_empty());
            }
            panels += 1;
        }
    }
    assert!(panels >= 20, "{panels} panel queries");

    let mut alerts = Vec::new();
    for group in rules["groups"].as_array().expect("groups") {
        for rule in group["rules"].as_array().expect("rules") {
            let name = rule["alert"].as_str().expect("alert").to_string();
            let expr = rule["expr"].as_str().expect("expr").to_string();
            prom.query(&expr)
                .await
                .unwrap_or_else(|e| panic!("{name}: Prometheus refused the expression: {e}"));
            for (family, selector) in selectors(&expr) {
                if KV_TRAFFIC_ONLY.contains(&family.as_str()) {
                    exempt.insert(family);
                } else if checked_selectors.insert(selector.clone()) {
                    prom.until_data(&name, &selector).await;
                }
            }
            alerts.push(name);
        }
    }
    assert!(alerts.len() >= 6, "{alerts:?}");

    // Prometheus evaluated every loaded rule without error.
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tick.tick().await;
        let body: Value = client
            .get(format!("{}/api/v1/rules", prom.base))
            .send()
            .await
            .expect("rules API")
            .json()
            .await
            .expect("JSON");
        let loaded: Vec<&Value> = body["data"]["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().into_iter().flatten())
            .collect();
        let evaluated = loaded.len() == alerts.len()
            && loaded.iter().all(|r| {
                r["health"] == "ok"
                    && r["lastEvaluation"]
                        .as_str()
                        .is_some_and(|t| !t.starts_with("0001"))
            });
        if evaluated {
            break;
        }
        if let Some(bad) = loaded.iter().find(|r| r["health"] == "err") {
            panic!("a rule failed to evaluate: {bad}");
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "rules not all evaluated: {body}"
        );
    }
    // On a healthy demo none of the alerts fires.
    let firing = prom
        .query("ALERTS{alertstate=\"firing\"}")
        .await
        .expect("ALERTS");
    assert!(firing.is_empty(), "{firing:?}");

    // The KV-traffic-only family and the labels the expressions use, on the real registry.
    assert_eq!(
        exempt,
        BTreeSet::from(["continuum_dynamo_kv_hash_parity_total".to_string()])
    );
    let metrics = Metrics::new("probe").expect("metrics");
    metrics
        .register::<KvIndexMetrics>()
        .expect("the KV index's families")
        .kv_hash_parity("probe-model", KvParityResult::Match);
    assert!(
        metrics.render().contains(
            r#"continuum_dynamo_kv_hash_parity_total{model="probe-model",result="match"} 1"#
        ),
        "{}",
        metrics.render()
    );

    let _ = stop_tx.send(true);
    let sent = traffic.await.expect("traffic task");
    assert!(sent > 0);
}
