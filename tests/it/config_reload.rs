//! Reload safety over real sockets: the reload guard refuses a file that would remove every
//! backend or the admin API unless it says so (`backends: []`, `admin.enabled: false`), on every
//! reload path (admin API with 409, file watch, SIGHUP), logged and counted in
//! `continuum_config_reload_refusals_total{reason}`; and SIGHUP reloads the real binary's config
//! while a streamed request is in flight, instead of killing the process.

use crate::support;

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use continuum_router::daemon::Daemon;
use serde_json::{Value, json};
use support::upstream::{FakeUpstream, Reply};

const TOKEN: &str = "reload-admin-token-0123";
const WAIT: Duration = Duration::from_secs(30);

fn full(models: &str) -> String {
    format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\nadmin:\n  enabled: true\n  token: {TOKEN}\n\
         backends:\n  - name: a\n    type: openai\n    url: \"http://127.0.0.1:9\"\n    \
         models: [{models}]\n    health_check: {{enabled: false}}\n"
    )
}

/// Replaces the file atomically (write + rename), as the docs tell operators to.
fn replace(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).expect("write");
    std::fs::rename(&tmp, path).expect("rename");
}

#[cfg(unix)]
/// A config path the file watch does not see changes of: a symlink whose target lives in
/// another directory (the watch follows the link's directory). Returns (link, target, dirs).
fn unwatched(
    text: &str,
) -> (
    std::path::PathBuf,
    std::path::PathBuf,
    [tempfile::TempDir; 2],
) {
    let watched = tempfile::tempdir().expect("tempdir");
    let elsewhere = tempfile::tempdir().expect("tempdir");
    let real = elsewhere.path().join("real.yaml");
    std::fs::write(&real, text).expect("write");
    let link = watched.path().join("config.yaml");
    std::os::unix::fs::symlink(&real, &link).expect("symlink");
    (link, real, [watched, elsewhere])
}

async fn poll_until(what: &str, mut done: impl AsyncFnMut() -> bool) {
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    tokio::time::timeout(WAIT, async {
        loop {
            tick.tick().await;
            if done().await {
                return;
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what} within {WAIT:?}"));
}

fn refusals(daemon: &Daemon, reason: &str) -> f64 {
    daemon
        .metrics()
        .value(
            "continuum_config_reload_refusals_total",
            &[("reason", reason)],
        )
        .expect("pre-initialised series")
}

async fn models(base: &str) -> Vec<String> {
    let body: Value = reqwest::get(format!("{base}/v1/models"))
        .await
        .expect("models")
        .json()
        .await
        .expect("json");
    body["data"]
        .as_array()
        .expect("list")
        .iter()
        .map(|m| m["id"].as_str().expect("id").to_owned())
        .collect()
}

async fn reload(base: &str) -> (u16, Value) {
    let resp = reqwest::Client::new()
        .post(format!("{base}/admin/config/reload"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("reload");
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reload_api_refuses_partial_files_and_accepts_explicit_ones() {
    // Only the API reloads here (the file watch would count refusals of its own).
    let running = full("model-a");
    let (link, path, _dirs) = unwatched(&running);
    let daemon = support::daemon::start_file(&link).await;
    let base = format!("http://{}", daemon.local_addr());

    // The first two lines of the file: no backends, admin lost.
    let partial: String = running.lines().take(2).map(|l| format!("{l}\n")).collect();
    for (text, reason) in [
        (partial.as_str(), "removes_all_backends"),
        ("", "removes_all_backends"),
        (
            "backends:\n  - {name: a, type: openai, url: \"http://127.0.0.1:9\", models: [model-a]}\n",
            "disables_admin",
        ),
    ] {
        replace(&path, text);
        let before = refusals(&daemon, reason);
        let (status, body) = reload(&base).await;
        assert_eq!(status, 409, "{text:?}: {body}");
        assert_eq!(refusals(&daemon, reason), before + 1.0, "{text:?}");
        assert_eq!(models(&base).await, ["model-a"], "the running config stays");
    }
    assert_eq!(refusals(&daemon, "removes_all_backends"), 2.0);
    assert_eq!(refusals(&daemon, "disables_admin"), 1.0);

    // Written explicitly, both are applied.
    replace(
        &path,
        &format!("admin:\n  enabled: true\n  token: {TOKEN}\nbackends: []\n"),
    );
    let (status, body) = reload(&base).await;
    assert_eq!(status, 200, "{body}");
    assert!(models(&base).await.is_empty());
    replace(
        &path,
        "admin:\n  enabled: false\nbackends:\n  - {name: a, type: openai, url: \"http://127.0.0.1:9\", models: [model-c]}\n",
    );
    let (status, body) = reload(&base).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(models(&base).await, ["model-c"]);
    assert_eq!(reload(&base).await.0, 403, "admin is off, as written");
    daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_file_watch_refuses_a_partial_file_and_applies_the_complete_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("config.yaml");
    let running = full("model-a");
    std::fs::write(&path, &running).expect("write");
    let daemon = support::daemon::start_file(&path).await;
    let base = format!("http://{}", daemon.local_addr());

    // A non-atomic writer caught after its first two lines.
    let partial: String = running.lines().take(2).map(|l| format!("{l}\n")).collect();
    std::fs::write(&path, &partial).expect("write");
    poll_until("the watch refuses the partial file", async || {
        refusals(&daemon, "removes_all_backends") >= 1.0
    })
    .await;
    assert_eq!(models(&base).await, ["model-a"], "the running config stays");

    replace(&path, &full("model-a, model-b"));
    poll_until("the watch applies the complete file", async || {
        models(&base).await == ["model-a", "model-b"]
    })
    .await;
    daemon.shutdown().await;
}

/// The real binary: SIGHUP reloads the config file (reached through a symlink whose target
/// lives in another directory, so the file watch cannot be what reloads it) while a streamed
/// request is in flight; the process lives, the stream completes, the new config applies, and
/// the guard refuses a partial file on this path too. Before the fix SIGHUP killed the process
/// (exit by signal 1) and the stream was cut.
#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_binary_without_losing_an_in_flight_stream() {
    // This test builds its own client; it must not rely on a sibling test having installed the
    // process's rustls provider first.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let upstream = FakeUpstream::start().await;
    let (chunks, rx) = tokio::sync::mpsc::unbounded_channel::<Bytes>();
    upstream.push(Reply::Sse(rx));

    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        probe.local_addr().expect("addr").port()
    };
    let config = |models: &str| {
        format!(
            "server:\n  bind_address: \"127.0.0.1:{port}\"\nadmin:\n  enabled: true\n  token: {TOKEN}\n\
             backends:\n  - name: a\n    type: openai\n    url: \"{}\"\n    models: [{models}]\n    \
             health_check: {{enabled: false}}\n",
            upstream.url()
        )
    };
    let (link, real, _dirs) = unwatched(&config("model-a"));

    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_continuum-router"))
        .arg("--config")
        .arg(&link)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the binary");
    let pid = child.id().expect("pid").to_string();
    let base = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::new();
    poll_until("the binary serves", async || {
        client
            .get(format!("{base}/health"))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
    })
    .await;

    // A streamed request, mid-flight.
    let mut stream = client
        .post(format!("{base}/v1/chat/completions"))
        .json(&json!({"model": "model-a", "stream": true,
                      "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .expect("stream head");
    assert_eq!(stream.status(), 200);
    chunks
        .send(Bytes::from_static(b"data: {\"n\":1}\n\n"))
        .expect("upstream stream");
    let first = tokio::time::timeout(WAIT, stream.chunk())
        .await
        .expect("first chunk in time")
        .expect("chunk")
        .expect("not ended");
    assert!(first.starts_with(b"data: {\"n\":1}"));

    std::fs::write(&real, config("model-a, model-b")).expect("rewrite");
    let hup = |pid: &str| {
        let status = std::process::Command::new("kill")
            .args(["-HUP", pid])
            .status()
            .expect("kill -HUP");
        assert!(status.success());
    };
    hup(&pid);
    poll_until("SIGHUP applies the new config", async || {
        assert!(
            child.try_wait().expect("status").is_none(),
            "SIGHUP killed the process"
        );
        client
            .get(format!("{base}/v1/models"))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
            && models(&base).await == ["model-a", "model-b"]
    })
    .await;

    // The in-flight stream completes.
    chunks
        .send(Bytes::from_static(b"data: [DONE]\n\n"))
        .expect("upstream stream");
    drop(chunks);
    let mut rest = Vec::new();
    while let Some(chunk) = tokio::time::timeout(WAIT, stream.chunk())
        .await
        .expect("stream progresses")
        .expect("stream intact")
    {
        rest.extend_from_slice(&chunk);
    }
    assert!(
        String::from_utf8_lossy(&rest).contains("[DONE]"),
        "{:?}",
        String::from_utf8_lossy(&rest)
    );

    // The guard applies to SIGHUP too: a partial file is refused and counted.
    std::fs::write(&real, "server:\n  bind_address: \"127.0.0.1:0\"\n").expect("partial");
    hup(&pid);
    poll_until("SIGHUP refuses the partial file", async || {
        let text = client
            .get(format!("{base}/metrics"))
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("text");
        text.contains("continuum_config_reload_refusals_total{reason=\"removes_all_backends\"} 1")
    })
    .await;
    assert_eq!(models(&base).await, ["model-a", "model-b"]);
    assert!(child.try_wait().expect("status").is_none());

    let status = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill -TERM");
    assert!(status.success());
    let exit = tokio::time::timeout(WAIT, child.wait())
        .await
        .expect("exits after SIGTERM")
        .expect("status");
    assert!(exit.success(), "{exit:?}");
}
