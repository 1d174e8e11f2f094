//! The fleet page (`/admin/ui`) in a real browser: the demo runs in process, headless Chromium
//! is driven over the DevTools protocol (a small client over a websocket), the test signs in,
//! sees the workers, their live load and their models' admission queues change as demo traffic
//! flows (every request in flight makes its rank busy), restarts a subsystem through the page's
//! confirm step, renders a synthetic 1,000-worker fleet, and saves a screenshot to
//! `target/ui-artifacts/fleet.png`. Skips, saying so, where Chromium is absent.
//! Waits are in-page promises or replies under deadlines; nothing sleeps.
#![cfg(feature = "real-peers")]

use crate::support;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use base64::Engine;
use continuum_demo::DemoOptions;
use continuum_demo::shim::Pace;
use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};
use support::demo::Demo;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpListener;
use tokio::process::{Child, Command};
use tokio_tungstenite::tungstenite::Message;

const DEADLINE: Duration = Duration::from_secs(60);
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
const TOKEN: &str = "demo-admin-token";

fn chromium() -> Option<PathBuf> {
    let path = std::env::var_os("CONTINUUM_CHROMIUM")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/chromium"));
    path.exists().then_some(path)
}

async fn start_demo() -> Demo {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    Demo::start_with(
        DemoOptions {
            publish_interval: Duration::from_millis(50),
            // Slow enough that a request stays in flight across several of the page's polls.
            pace: Pace {
                prefill: Duration::from_millis(20),
                per_token: Duration::from_millis(40),
            },
            ..DemoOptions::default()
        },
        listener,
        // Any request in flight makes its rank busy, so the traffic below queues in admission
        // and the page shows the queues' depth (every queued request still goes, well within
        // max_wait).
        |config| {
            config.admission.busy_threshold.kv_usage = Some(0.001);
            config.admission.busy_threshold.prefill_tokens = Some(1);
        },
    )
    .await
    .expect("the demo starts")
}

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// A DevTools-protocol client for one page session: commands are answered in order of ids;
/// events in between are skipped.
struct Cdp {
    ws: Ws,
    next: u64,
    session: Option<String>,
}

impl Cdp {
    async fn call(&mut self, method: &str, params: Value) -> Value {
        self.next += 1;
        let id = self.next;
        let mut msg = json!({"id": id, "method": method, "params": params});
        if let Some(session) = &self.session {
            msg["sessionId"] = json!(session);
        }
        self.ws
            .send(Message::text(msg.to_string()))
            .await
            .expect("send to Chromium");
        let reply = tokio::time::timeout(CALL_TIMEOUT, async {
            loop {
                let frame = self
                    .ws
                    .next()
                    .await
                    .expect("Chromium closed the DevTools socket")
                    .expect("a DevTools frame");
                let Message::Text(text) = frame else { continue };
                let value: Value = serde_json::from_str(&text).expect("DevTools JSON");
                if value["id"] == json!(id) {
                    return value;
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("Chromium did not answer {method} in time"));
        assert!(reply.get("error").is_none(), "{method}: {reply}");
        reply["result"].clone()
    }

    /// Evaluates `expr` in the page (promises awaited) and returns its JSON value.
    async fn eval(&mut self, expr: &str) -> Value {
        let result = self
            .call(
                "Runtime.evaluate",
                json!({"expression": expr, "returnByValue": true, "awaitPromise": true}),
            )
            .await;
        assert!(
            result.get("exceptionDetails").is_none(),
            "page exception in {expr}: {result}"
        );
        result["result"]["value"].clone()
    }

    /// Waits until `expr` is truthy in the page; returns its value. The page polls itself
    /// (an in-page timer per 2-second round), the test only bounds the whole wait.
    async fn wait_for(&mut self, expr: &str, what: &str) -> Value {
        let round = format!(
            "new Promise((resolve) => {{ const t0 = Date.now(); (function f() {{ \
             let v; try {{ v = ({expr}); }} catch (e) {{ v = null; }} \
             if (v) resolve(v); else if (Date.now() - t0 > 2000) resolve(null); \
             else setTimeout(f, 50); }})(); }})"
        );
        let start = Instant::now();
        loop {
            let v = self.eval(&round).await;
            if !(v.is_null() || v == json!(false)) {
                return v;
            }
            assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        }
    }

    async fn screenshot(&mut self, to: &std::path::Path) {
        let shot = self
            .call("Page.captureScreenshot", json!({"format": "png"}))
            .await;
        let png = base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().expect("screenshot data"))
            .expect("base64 PNG");
        std::fs::create_dir_all(to.parent().expect("a parent")).expect("artifact dir");
        std::fs::write(to, png).expect("write the screenshot");
    }
}

/// Starts headless Chromium and returns it with the browser's DevTools websocket URL.
async fn launch(bin: &std::path::Path, profile: &std::path::Path) -> (Child, String) {
    let mut child = Command::new(bin)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--window-size=1400,1100",
            "--remote-debugging-port=0",
            "about:blank",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn chromium");
    let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
    let url = tokio::time::timeout(DEADLINE, async {
        while let Some(line) = lines.next_line().await.expect("chromium stderr") {
            if let Some(url) = line.strip_prefix("DevTools listening on ") {
                return url.trim().to_owned();
            }
        }
        panic!("chromium exited before printing its DevTools URL");
    })
    .await
    .expect("chromium prints its DevTools URL");
    // Keep draining stderr so Chromium never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, url)
}

/// Sends slow streaming chat requests, `width` at a time, until `stop`.
fn traffic(url: String, stop: Arc<AtomicBool>, width: usize) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let client = reqwest::Client::new();
        let mut sent = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let batch = (0..width).map(|i| {
                let model = if i % 2 == 0 { "demo-disagg" } else { "demo-agg" };
                let body = json!({
                    "model": model,
                    "messages": [{"role": "user", "content": format!("fleet page {i} {}", "load ".repeat(40))}],
                    "max_tokens": 24,
                    "stream": true,
                });
                let client = client.clone();
                let url = url.clone();
                async move {
                    let resp = client
                        .post(format!("{url}/v1/chat/completions"))
                        .json(&body)
                        .send()
                        .await
                        .expect("the router answers");
                    assert_eq!(resp.status(), 200);
                    resp.text().await.expect("a body");
                }
            });
            futures::future::join_all(batch).await;
            sent += width as u64;
        }
        sent
    })
}

/// The shell loads without a token and carries a strict CSP; the data it reads does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_shell_is_public_with_a_strict_csp_and_its_data_needs_the_token() {
    let demo = start_demo().await;
    let url = demo.url();
    let client = reqwest::Client::new();
    for (path, kind) in [
        ("/admin/ui", "text/html"),
        ("/admin/ui/app.js", "text/javascript"),
        ("/admin/ui/app.css", "text/css"),
    ] {
        let resp = client.get(format!("{url}{path}")).send().await.unwrap();
        assert_eq!(resp.status(), 200, "{path}");
        let headers = resp.headers().clone();
        assert!(headers["content-type"].to_str().unwrap().starts_with(kind));
        let csp = headers["content-security-policy"].to_str().unwrap();
        assert!(csp.contains("default-src 'none'") && csp.contains("script-src 'self'"));
        assert!(!csp.contains("unsafe-inline"), "{csp}");
        assert_eq!(headers["x-content-type-options"], "nosniff");
    }
    let html = client
        .get(format!("{url}/admin/ui"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        !html.contains("<script>") && !html.contains(" style="),
        "no inline script or style"
    );
    let denied = client
        .get(format!("{url}/admin/fleet/summary"))
        .send()
        .await
        .unwrap();
    assert_eq!(denied.status(), 401);
    let summary = fleet_summary(&client, &url).await;
    assert!(summary["selections"].is_object(), "{summary}");
    assert!(summary["kv_hash_parity"].is_object(), "{summary}");
    assert!(summary["kv_blocks"].is_array(), "{summary}");
    assert!(summary["queue_depth"].is_object(), "{summary}");
    assert_eq!(
        summary["mid_stream_fallback"],
        json!({"attempts": 0, "continued": 0, "failed": 0})
    );
    // The mid-stream counters, summed over ingress and reason.
    let metrics = demo.daemon().metrics();
    record_mid_stream_cuts(metrics);
    let summary = fleet_summary(&client, &url).await;
    assert_eq!(
        summary["mid_stream_fallback"],
        json!({"attempts": 3, "continued": 2, "failed": 1})
    );
    demo.shutdown().await;
}

/// `/admin/fleet/summary` with the admin token.
async fn fleet_summary(client: &reqwest::Client, url: &str) -> Value {
    client
        .get(format!("{url}/admin/fleet/summary"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Two continued cuts and one whose fallback failed, on two ingresses and reasons.
fn record_mid_stream_cuts(metrics: &continuum_actors::metrics::Metrics) {
    use continuum_router::route::mid_stream::metrics::{
        MidStreamIngress, MidStreamMetrics, MidStreamReason, MidStreamResult,
    };
    let mid_stream = metrics
        .register::<MidStreamMetrics>()
        .expect("the mid-stream families");
    for _ in 0..2 {
        mid_stream.fallback(
            MidStreamIngress::ChatCompletions,
            MidStreamReason::ErrorEvent,
            MidStreamResult::Continued,
            0,
        );
    }
    mid_stream.fallback(
        MidStreamIngress::Completions,
        MidStreamReason::Stalled,
        MidStreamResult::FallbackFailed,
        0,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_page_shows_live_load_and_restarts_a_subsystem_in_chromium() {
    let Some(bin) = chromium() else {
        eprintln!(
            "SKIPPED: Chromium not found at /usr/bin/chromium (or $CONTINUUM_CHROMIUM); \
             install Debian's `chromium` package to run the fleet page's browser test."
        );
        return;
    };
    let demo = start_demo().await;
    assert!(
        demo.wait_discovered(DEADLINE).await,
        "the fleet is discovered"
    );
    let url = demo.url();
    let profile = tempfile::tempdir().expect("profile dir");
    let (mut child, ws_url) = launch(&bin, profile.path()).await;
    let (ws, _) = tokio_tungstenite::connect_async(ws_url.as_str())
        .await
        .expect("DevTools websocket");
    let mut cdp = Cdp {
        ws,
        next: 0,
        session: None,
    };
    let target = cdp
        .call("Target.createTarget", json!({"url": "about:blank"}))
        .await;
    let attached = cdp
        .call(
            "Target.attachToTarget",
            json!({"targetId": target["targetId"], "flatten": true}),
        )
        .await;
    cdp.session = Some(
        attached["sessionId"]
            .as_str()
            .expect("a session")
            .to_owned(),
    );
    cdp.call("Page.enable", json!({})).await;
    cdp.call(
        "Emulation.setDeviceMetricsOverride",
        json!({"width": 1400, "height": 1100, "deviceScaleFactor": 1, "mobile": false}),
    )
    .await;

    // The login form loads without a token.
    cdp.call("Page.navigate", json!({"url": format!("{url}/admin/ui")}))
        .await;
    cdp.wait_for(
        "document.readyState === 'complete' && !document.getElementById('login').hidden \
         && document.getElementById('app').hidden",
        "the login form",
    )
    .await;
    // A wrong token is refused and not kept.
    cdp.eval(
        "document.getElementById('token').value = 'not-the-token'; \
         document.getElementById('login-button').click(); true",
    )
    .await;
    cdp.wait_for(
        "document.getElementById('login-error').textContent.includes('refused')",
        "the refusal",
    )
    .await;
    assert_eq!(
        cdp.eval("sessionStorage.getItem('continuum.admin.token')")
            .await,
        Value::Null
    );
    // The right one signs in; the token lives in session storage, not the URL.
    cdp.eval(&format!(
        "document.getElementById('token').value = '{TOKEN}'; \
         document.getElementById('login-button').click(); true"
    ))
    .await;
    cdp.wait_for(
        "!document.getElementById('app').hidden \
         && document.querySelectorAll('tr[data-worker]').length === 6 \
         && document.querySelectorAll('.rank').length === 7",
        "six workers and seven ranks on the page",
    )
    .await;
    assert_eq!(
        cdp.eval("sessionStorage.getItem('continuum.admin.token')")
            .await,
        json!(TOKEN)
    );
    let href = cdp.eval("location.href").await;
    assert!(!href.as_str().unwrap().contains(TOKEN), "{href}");
    let groups = cdp
        .eval("Array.from(document.querySelectorAll('details.group')).map(d => d.dataset.group)")
        .await;
    assert_eq!(
        groups,
        json!(["demo · decode", "demo · prefill", "demo-agg · aggregated"])
    );
    let subs = cdp
        .eval("document.querySelector('[data-subs]').dataset.subs")
        .await;
    assert_eq!(subs, json!("kv_metrics · connected · direct"));

    // Traffic raises the live load the page shows and the selection counters it plots.
    let idle = cdp
        .eval("Number(document.getElementById('ov-selections').textContent)")
        .await;
    let stop = Arc::new(AtomicBool::new(false));
    let load = traffic(url.clone(), stop.clone(), 8);
    let busy = cdp
        .wait_for(
            "(() => { const r = Array.from(document.querySelectorAll('.rank')) \
             .filter(e => Number(e.dataset.decode) > 0 || Number(e.dataset.prefill) > 0); \
             return r.length > 0 ? r.map(e => e.dataset.rank + '=' + e.dataset.decode + '/' + e.dataset.prefill) : null; })()",
            "a rank with live load on the page",
        )
        .await;
    let counted = cdp
        .wait_for(
            &format!(
                "(() => {{ const n = Number(document.getElementById('ov-selections').textContent); \
                 return n > {idle} ? n : null; }})()"
            ),
            "selections counted on the page",
        )
        .await;
    cdp.wait_for(
        "Array.from(document.querySelectorAll('.spark[data-key^=\"sel|\"] .sub')) \
         .some(e => !e.textContent.startsWith(' · 0 last poll, 0 in'))",
        "a selection sparkline with picks",
    )
    .await;
    // Every worker busy: requests wait in their model's admission queue, and the page shows it.
    let queued = cdp
        .wait_for(
            "(() => { const q = Array.from(document.querySelectorAll('tr[data-queue]')) \
             .filter(e => Number(e.dataset.depth) > 0); \
             return q.length > 0 ? q.map(e => e.dataset.queue + '=' + e.dataset.depth) : null; })()",
            "a model's admission queue depth on the page",
        )
        .await;
    assert!(
        queued.as_array().unwrap().iter().all(|q| {
            let q = q.as_str().unwrap();
            q.starts_with("demo-agg=") || q.starts_with("demo-disagg=")
        }),
        "{queued}"
    );
    let renders_before = cdp.eval("window.continuumFleet.renders()").await;
    // A few more polls under load, so the screenshot's sparklines have a history.
    cdp.wait_for(
        &format!("window.continuumFleet.renders() >= {renders_before} + 3"),
        "three more polls",
    )
    .await;
    let artifacts = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"))
        .join("ui-artifacts");
    cdp.screenshot(&artifacts.join("fleet.png")).await;
    stop.store(true, Ordering::Relaxed);
    let sent = load.await.expect("traffic task");
    // When the traffic stops, the load on the page falls back to zero (it changed, live).
    cdp.wait_for(
        "document.querySelectorAll('.rank').length === 7 && Array.from(document.querySelectorAll('.rank')) \
         .every(e => Number(e.dataset.decode) === 0 && Number(e.dataset.prefill) === 0)",
        "the load falling back to idle on the page",
    )
    .await;
    let renders_after = cdp.eval("window.continuumFleet.renders()").await;
    assert!(renders_after.as_u64() > renders_before.as_u64());

    // The mid-stream fallback counters: zero, then the cuts the router counted.
    cdp.wait_for(
        "document.getElementById('mid-stream').dataset.attempts === '0'",
        "the mid-stream counters at zero",
    )
    .await;
    record_mid_stream_cuts(demo.daemon().metrics());
    let shown = cdp
        .wait_for(
            "(() => { const m = document.getElementById('mid-stream').dataset; \
             return m.attempts === '3' ? [m.attempts, m.continued, m.failed, \
             document.getElementById('ms-failed').textContent] : null; })()",
            "the mid-stream cuts on the page",
        )
        .await;
    assert_eq!(shown, json!(["3", "2", "1", "1"]));

    // A restart asks for confirmation first, then restarts and the count shows it.
    let picker = "[data-subsystem=\"root/picker\"]";
    cdp.wait_for(
        &format!("document.querySelector('{picker} button.restart')"),
        "a restart button",
    )
    .await;
    cdp.eval(&format!(
        "document.querySelector('{picker} button.restart').click(); true"
    ))
    .await;
    cdp.wait_for(
        &format!("document.querySelector('{picker} button.confirm-restart')"),
        "the confirm step",
    )
    .await;
    let before: Value = reqwest::Client::new()
        .get(format!("{url}/admin/subsystems"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let restarts = |v: &Value| {
        v["subsystems"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["id"] == "root/picker")
            .map(|s| s["restarts"].as_u64().unwrap())
            .unwrap()
    };
    assert_eq!(restarts(&before), 0, "nothing restarts before the confirm");
    cdp.eval(&format!(
        "document.querySelector('{picker} button.confirm-restart').click(); true"
    ))
    .await;
    cdp.wait_for(
        "document.getElementById('restart-result').textContent === 'restarted root/picker'",
        "the restart result",
    )
    .await;
    cdp.wait_for(
        &format!("Number(document.querySelector('{picker}').dataset.restarts) >= 1"),
        "the restart count on the page",
    )
    .await;

    // 1,000 workers: groups start collapsed, an opened group renders 100 rows at a time.
    let synthetic = cdp
        .eval(
            "(() => { window.continuumFleet.pause(); \
             const workers = [], load = []; \
             for (let i = 0; i < 1000; i++) { \
               const id = (0x100000 + i).toString(16); \
               workers.push({instance_id: id, worker_id: String(i), namespace: 'ns' + (i % 4), \
                 role: Math.floor(i / 4) % 2 ? 'decode' : 'prefill', model: 'm' + (i % 4), dp_start_rank: 0, dp_size: 2, \
                 block_size: 16, capacity: {total_kv_blocks: 1024, max_num_seqs: 256}, reachable: i % 97 !== 0}); \
               load.push({instance_id: id, dp_rank: 0, active_decode_blocks: i % 50, active_prefill_tokens: 0, kv_used_blocks: i % 900}); \
             } \
             const t0 = performance.now(); \
             window.continuumFleet.renderFleet({enabled: true, workers, load, subscriptions: []}, {kv_blocks: []}); \
             const ms = performance.now() - t0; \
             return {ms, groups: document.querySelectorAll('details.group').length, \
               open: document.querySelectorAll('details.group[open]').length, \
               rows: document.querySelectorAll('tr[data-worker]').length, \
               count: document.getElementById('worker-count').textContent}; })()",
        )
        .await;
    assert_eq!(synthetic["groups"], 8, "{synthetic}");
    assert_eq!(synthetic["open"], 0, "{synthetic}");
    assert_eq!(synthetic["rows"], 0, "{synthetic}");
    assert_eq!(synthetic["count"], "(1000 in 8 groups)");
    let queues = cdp
        .eval(
            "(() => { window.continuumFleet.renderQueues({queue_depth: {'m1': 7, 'm0': 0}}); \
             return Array.from(document.querySelectorAll('tr[data-queue]')) \
               .filter(e => e.dataset.queue.startsWith('m')) \
               .map(e => e.dataset.queue + '=' + e.dataset.depth); })()",
        )
        .await;
    assert_eq!(
        queues,
        json!(["m0=0", "m1=7"]),
        "queue rows sorted by model"
    );
    cdp.eval("document.querySelector('details.group').open = true; true")
        .await;
    cdp.wait_for(
        "document.querySelectorAll('tr[data-worker]').length === 100 && document.querySelector('button.more')",
        "the first 100 rows of an opened group",
    )
    .await;
    let more = cdp
        .eval("document.querySelector('button.more').click(); document.querySelectorAll('tr[data-worker]').length")
        .await;
    assert_eq!(
        more, 125,
        "the group of 125 shows all its rows after one 'show more'"
    );
    cdp.screenshot(&artifacts.join("fleet-1000.png")).await;
    eprintln!(
        "fleet page: live load seen {busy}, selections {idle} -> {counted}, {sent} requests sent, \
         1,000-worker render {:.1} ms; screenshots in {}",
        synthetic["ms"].as_f64().unwrap_or(f64::NAN),
        artifacts.display()
    );

    child.kill().await.expect("stop chromium");
    demo.shutdown().await;
}
