//! The official `openai` and `anthropic` SDKs against the admission queue's refusal: every worker
//! busy and `admission.queue.max_depth: 0`, so a request is refused at once with `503 fleet_busy`
//! and `Retry-After: 1`. Each SDK raises its typed error for it (`InternalServerError`; openai's
//! code `fleet_busy`, anthropic's error type `overloaded_error`), and with its built-in retry
//! enabled the retry succeeds once a load sample shows room
//! (`tests/fixtures/ingress/fleet_busy_sdks.py`, on the real clock; the script and the test
//! take turns over stdin/stdout, so the fleet changes only between the script's calls).
#![cfg(feature = "real-peers")]

use std::process::Stdio;
use std::time::Duration;

use crate::admission::{BUSY, Harness, MODEL, config, until};
use crate::support::upstream::{FakeUpstream, Reply};
use axum::http::StatusCode;
use continuum_router::front_door;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

const LINE_TIMEOUT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_sdks_get_typed_fleet_busy_errors_and_their_retry_succeeds() {
    let mut shim = FakeUpstream::start().await;
    let ok = json!({"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": MODEL,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}});
    // The three retried calls: chat, Responses, Messages.
    for _ in 0..3 {
        shim.push(Reply::Json(StatusCode::OK, ok.clone(), vec![]));
    }
    let h = Harness::new(config(
        &shim.url(),
        "{busy_threshold: {kv_usage: 0.8}, queue: {max_depth: 0, max_wait: 1s}}",
    ))
    .await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let app = front_door::router(h.state.clone());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let shed = || h.metric(r#"continuum_admission_shed_total{class="normal",reason="queue_full"}"#);

    let python = std::env::var("CONTINUUM_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/ingress/fleet_busy_sdks.py"
    );
    let mut child = tokio::process::Command::new(&python)
        .args([script, &base, MODEL])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {python} (set CONTINUUM_PYTHON): {e}"));
    let mut stdin = child.stdin.take().expect("stdin");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let (mut refusals, mut retries) = (0, 0);
    loop {
        let line = tokio::time::timeout(LINE_TIMEOUT, lines.next_line())
            .await
            .expect("the SDK script answers within a minute")
            .expect("the script's stdout");
        let Some(line) = line else {
            let out = child.wait_with_output().await.expect("the script's exit");
            panic!(
                "the SDK script failed (needs anthropic + openai in {python}):\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        match line.trim() {
            "busy" => {
                h.publish(BUSY);
                refusals += 1;
                stdin.write_all(b"go\n").await.expect("to the script");
            }
            "retrying" => {
                // The retrying call's first attempt is refused; then the fleet has room, and the
                // SDK's retry (after `retry-after-ms`) is dispatched.
                let before = shed();
                stdin.write_all(b"go\n").await.expect("to the script");
                until("the retrying call's first refusal", || shed() > before).await;
                h.publish([0, 0]);
                retries += 1;
            }
            "OK" => break,
            other => panic!("unexpected line from the SDK script: {other}"),
        }
    }
    let status = tokio::time::timeout(LINE_TIMEOUT, child.wait())
        .await
        .expect("the script exits")
        .expect("its status");
    assert!(status.success(), "{status}");
    assert_eq!((refusals, retries), (3, 3));
    // Each typed error and each retried call's first attempt was a counted refusal; the three
    // retries reached the shim.
    assert!(shed() >= 6.0, "{}", shed());
    for _ in 0..3 {
        tokio::time::timeout(Duration::from_secs(10), shim.next_request())
            .await
            .expect("every retried call reached the shim");
    }
}
