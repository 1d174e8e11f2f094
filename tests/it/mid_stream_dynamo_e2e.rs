//! Mid-stream fallback against real NVIDIA Dynamo 1.6.1 (issue 31, `dynamo-e2e`): a worker that
//! dies mid-answer costs the client nothing.
//!
//! Fleet: etcd, one prefill mocker and decode mockers with a slow token rate; our router pins
//! every request to a prefill + decode pair through the `--router-mode direct` frontend (the
//! shim), and a second frontend over the same namespace in its own router mode (round-robin, with
//! Dynamo's own `--migration-limit` so a request it sends to the dead worker moves on) is the
//! unified fallback. [`STREAMS`] streams start at once, all on the one decode worker (the only
//! one when they start): plain HTTP SSE, the official `openai` SDK on chat completions, the
//! `anthropic` SDK on Messages (`tests/fixtures/ingress/mid_stream_sdks.py`), and plain HTTP on
//! the native `/v1/responses` passthrough (the shim is `responses_api: native`). Once every
//! stream has received text, a second decode worker joins and the first is SIGKILLed. The shim
//! frontend then ends each stream with an error chunk (on Responses: the message item's closing
//! events, then an error); the router continues each one on the fallback frontend (which decodes
//! on the survivor; a Responses stream's rest as chat completions). Proven: every client gets 200
//! and one complete, well-formed stream (one identity, one role, one final chunk, one `[DONE]` /
//! `message_stop`; on Responses one response id, increasing sequence numbers, one text item, one
//! terminal event whose output is the whole text; no error event), the SDKs consume theirs
//! without an exception, and the counters say each stream was cut by an error event and
//! continued. Nothing is timed: every wait is bounded and the assertions are about content and
//! counts.
#![cfg(feature = "dynamo-e2e")]

use std::time::Duration;

use continuum_router::daemon::Daemon;
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::mpsc;

use crate::support::dynamo::{DynamoStack, MODEL, Signal, StackOptions, Topology, WorkerRole};

/// Plain HTTP, `openai` SDK and `anthropic` SDK streams.
const PLAIN: usize = 8;
const OPENAI: usize = 6;
const ANTHROPIC: usize = 6;
/// Plain HTTP streams on the native `/v1/responses` passthrough (the shim is `responses_api:
/// native`; their continuation goes to the fallback frontend as chat completions).
const RESPONSES: usize = 4;
const STREAMS: usize = PLAIN + OPENAI + ANTHROPIC + RESPONSES;
/// Tokens per answer: at the slow rate below an answer takes ≈ 12 s or more, so it is
/// mid-answer when the worker dies (in three runs the kill came after 35–100 tokens).
const MAX_TOKENS: u64 = 400;
/// ≈ 30 ms per decoded token (the default speedup makes the mocker far faster than a client).
const SLOW_MOCKER: [&str; 8] = [
    "--speedup-ratio",
    "1",
    "--decode-speedup-ratio",
    "0.2",
    "--num-gpu-blocks-override",
    "1024",
    "--block-size",
    "16",
];
/// Bound on every wait of the test (start, first text, the streams' end).
const LIMIT: Duration = Duration::from_secs(120);

/// The retry budget is sized so that every stream may continue however long the fleet took to
/// start (`budget_min_per_s` 10: 100 continuations per 10 s window even once the armed streams
/// aged out of it): the budget's own rule is tested in `mid_stream.rs`.
fn config_yaml(stack: &DynamoStack, fallback: &str) -> String {
    format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\n\
         disaggregated_serving:\n  enabled: true\n  fallback_to_unified: false\n  \
         mid_stream_fallback:\n    enabled: true\n    max_attempts: 2\n    \
         inactivity_timeout: 20s\n    budget_ratio: 1.0\n    budget_min_per_s: 10.0\n\
         backends:\n  - name: dynamo-shim\n    type: openai\n    url: \"{shim}\"\n    \
         role: unified\n    models: [\"{MODEL}\"]\n    responses_api: native\n    health_check:\n      enabled: false\n  \
         - name: dynamo-fallback\n    type: openai\n    url: \"{fallback}\"\n    \
         role: unified\n    models: [\"{MODEL}\"]\n    health_check:\n      enabled: false\n\
         dynamo:\n  enabled: true\n  discovery:\n    etcd:\n      endpoints: [\"{etcd}\"]\n      \
         namespace: \"{ns}\"\n  load:\n    direct_allow_cidrs: [\"127.0.0.0/8\"]\n  \
         shim:\n    backends: [dynamo-shim]\n",
        shim = stack.frontend_url(),
        etcd = stack.etcd_endpoint(),
        ns = stack.namespace(),
    )
}

/// What a plain HTTP client saw of one stream.
#[derive(Debug, Default)]
struct Plain {
    status: u16,
    events: usize,
    text: String,
    ids: Vec<(Value, Value, Value)>,
    roles: usize,
    finals: Vec<String>,
    dones: usize,
    errors: Vec<String>,
    /// Events after `[DONE]`, or whose `data` is not one JSON object.
    malformed: Vec<String>,
}

impl Plain {
    fn event(&mut self, event: &str) {
        self.events += 1;
        let Some(data) = event.strip_prefix("data: ") else {
            self.malformed.push(event.to_owned());
            return;
        };
        if self.dones > 0 {
            self.malformed.push(event.to_owned());
        }
        if data == "[DONE]" {
            self.dones += 1;
            return;
        }
        let Ok(chunk) = serde_json::from_str::<Value>(data) else {
            self.malformed.push(event.to_owned());
            return;
        };
        if chunk.get("error").is_some() {
            self.errors.push(data.to_owned());
            return;
        }
        let identity = (
            chunk["id"].clone(),
            chunk["model"].clone(),
            chunk["created"].clone(),
        );
        if !self.ids.contains(&identity) {
            self.ids.push(identity);
        }
        for choice in chunk["choices"].as_array().into_iter().flatten() {
            let delta = &choice["delta"];
            if delta.get("role").is_some_and(|r| !r.is_null()) {
                self.roles += 1;
            }
            self.text.push_str(delta["content"].as_str().unwrap_or(""));
            if let Some(reason) = choice["finish_reason"].as_str() {
                self.finals.push(reason.to_owned());
            }
        }
    }

    fn assert_well_formed(&self, i: usize) {
        assert_eq!(self.status, 200, "plain stream {i}");
        assert!(
            self.errors.is_empty(),
            "plain stream {i}: {:?}",
            self.errors
        );
        assert!(
            self.malformed.is_empty(),
            "plain stream {i}: {:?}",
            self.malformed
        );
        assert_eq!(self.ids.len(), 1, "plain stream {i}: one identity");
        assert_eq!(self.roles, 1, "plain stream {i}: one role delta");
        assert_eq!(self.finals, ["length"], "plain stream {i}: one final chunk");
        assert_eq!(self.dones, 1, "plain stream {i}: one [DONE]");
        assert!(!self.text.is_empty(), "plain stream {i}: text");
    }
}

/// One plain HTTP SSE stream; says `first` once its first text arrived.
async fn plain_stream(base: String, i: usize, first: mpsc::Sender<String>) -> Plain {
    let body = json!({"model": MODEL, "stream": true, "max_tokens": MAX_TOKENS,
                      "messages": [{"role": "user", "content": format!("a story about cache {i}")}]});
    let resp = reqwest::Client::new()
        .post(format!("{base}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .expect("send");
    let mut seen = Plain {
        status: resp.status().as_u16(),
        ..Plain::default()
    };
    let mut bytes = resp.bytes_stream();
    let mut pending: Vec<u8> = Vec::new();
    let mut announced = false;
    while let Some(chunk) = bytes.next().await {
        pending.extend_from_slice(&chunk.expect("the stream reads to its end without an error"));
        while let Some(at) = pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = pending.drain(..at + 2).collect();
            let event = String::from_utf8(event).expect("whole UTF-8 events");
            seen.event(event.trim_end_matches('\n'));
        }
        if !announced && !seen.text.is_empty() {
            announced = true;
            let _ = first.send(format!("plain {i}")).await;
        }
    }
    assert!(pending.is_empty(), "plain stream {i}: a partial last event");
    seen
}

/// What a plain HTTP client saw of one native Responses stream.
#[derive(Debug, Default)]
struct Native {
    status: u16,
    events: usize,
    text: String,
    seqs: Vec<u64>,
    ids: Vec<Value>,
    /// (item_id, output_index, content_index) of the text deltas.
    items: Vec<(Value, Value, Value)>,
    /// `response.completed` / `response.incomplete` / `response.failed` / `error` events.
    terminals: Vec<String>,
    final_text: String,
    malformed: Vec<String>,
    /// The event types, consecutive repeats folded (for the failure messages).
    kinds: Vec<String>,
}

impl Native {
    fn event(&mut self, event: &str) {
        self.events += 1;
        let data = event.lines().find_map(|l| l.strip_prefix("data: "));
        if data == Some("[DONE]") {
            return;
        }
        let Some(Ok(v)) = data.map(serde_json::from_str::<Value>) else {
            self.malformed.push(event.to_owned());
            return;
        };
        let kind = v["type"].as_str().unwrap_or("").to_owned();
        if self.kinds.last() != Some(&kind) {
            self.kinds.push(kind.clone());
        }
        if !self.terminals.is_empty() || v.get("error").is_some_and(|e| !e.is_null()) {
            self.malformed.push(event.to_owned());
        }
        self.seqs.extend(v["sequence_number"].as_u64());
        if let Some(id) = v.get("response").map(|r| r["id"].clone())
            && !self.ids.contains(&id)
        {
            self.ids.push(id);
        }
        if kind == "response.output_text.delta" {
            self.text += v["delta"].as_str().unwrap_or("");
            let at = (
                v["item_id"].clone(),
                v["output_index"].clone(),
                v["content_index"].clone(),
            );
            if !self.items.contains(&at) {
                self.items.push(at);
            }
        }
        if [
            "response.completed",
            "response.incomplete",
            "response.failed",
            "error",
        ]
        .contains(&kind.as_str())
        {
            let output = v["response"]["output"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let texts = output
                .iter()
                .flat_map(|o| o["content"].as_array().cloned().unwrap_or_default());
            self.final_text = texts
                .filter_map(|c| c["text"].as_str().map(str::to_owned))
                .collect();
            self.terminals.push(kind);
        }
    }

    fn assert_well_formed(&self, i: usize) {
        assert_eq!(self.status, 200, "responses stream {i}");
        assert!(
            self.malformed.is_empty(),
            "responses stream {i}: {:?}",
            self.malformed
        );
        assert!(
            self.seqs.windows(2).all(|w| w[0] < w[1]),
            "responses stream {i}: sequence numbers {:?}",
            self.seqs
        );
        assert_eq!(self.ids.len(), 1, "responses stream {i}: one response id");
        assert_eq!(
            self.items.len(),
            1,
            "responses stream {i}: one text item: {:?} in {:?}",
            self.items,
            self.kinds
        );
        assert_eq!(
            self.terminals.len(),
            1,
            "responses stream {i}: {:?}",
            self.terminals
        );
        assert!(
            ["response.completed", "response.incomplete"].contains(&self.terminals[0].as_str()),
            "responses stream {i}: {:?}",
            self.terminals
        );
        assert!(!self.text.is_empty(), "responses stream {i}: text");
        assert_eq!(
            self.final_text, self.text,
            "responses stream {i}: the final output"
        );
    }
}

/// One plain HTTP native Responses stream; says `first` once its first text arrived.
async fn responses_stream(base: String, i: usize, first: mpsc::Sender<String>) -> Native {
    let body = json!({"model": MODEL, "stream": true, "max_output_tokens": MAX_TOKENS,
                      "input": format!("a story about block {i}")});
    let resp = reqwest::Client::new()
        .post(format!("{base}/v1/responses"))
        .json(&body)
        .send()
        .await
        .expect("send");
    let mut seen = Native {
        status: resp.status().as_u16(),
        ..Native::default()
    };
    let mut bytes = resp.bytes_stream();
    let mut pending: Vec<u8> = Vec::new();
    let mut announced = false;
    while let Some(chunk) = bytes.next().await {
        pending.extend_from_slice(&chunk.expect("the stream reads to its end without an error"));
        while let Some(at) = pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = pending.drain(..at + 2).collect();
            let event = String::from_utf8(event).expect("whole UTF-8 events");
            seen.event(event.trim_end_matches('\n'));
        }
        if !announced && !seen.text.is_empty() {
            announced = true;
            let _ = first.send(format!("responses {i}")).await;
        }
    }
    assert!(
        pending.is_empty(),
        "responses stream {i}: a partial last event"
    );
    seen
}

/// The SDK script's run: its `FIRST` lines go to `first`; returns its whole stdout and status.
async fn sdk_streams(base: String, first: mpsc::Sender<String>) -> (bool, String) {
    let python = std::env::var("CONTINUUM_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/ingress/mid_stream_sdks.py"
    );
    let mut child = tokio::process::Command::new(&python)
        .arg(script)
        .arg(&base)
        .arg(OPENAI.to_string())
        .arg(ANTHROPIC.to_string())
        .arg(MAX_TOKENS.to_string())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {python} (set CONTINUUM_PYTHON): {e}"));
    let mut lines = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
    let mut out = String::new();
    while let Some(line) = lines.next_line().await.expect("read the script's stdout") {
        if let Some(who) = line.strip_prefix("FIRST ") {
            let _ = first.send(who.to_owned()).await;
        }
        out.push_str(&line);
        out.push('\n');
    }
    let status = child.wait().await.expect("the script exits");
    (status.success() && out.trim_end().ends_with("OK"), out)
}

fn mid_stream_count(daemon: &Daemon, ingress: &str, reason: &str, result: &str) -> u64 {
    daemon
        .metrics()
        .value(
            "continuum_mid_stream_fallback_total",
            &[("ingress", ingress), ("reason", reason), ("result", result)],
        )
        .unwrap_or(0.0) as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_decode_worker_mid_answer_every_client_gets_one_whole_stream() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut options = StackOptions::new(Topology::Disagg);
    options.mocker_args = SLOW_MOCKER.iter().map(|s| (*s).to_owned()).collect();
    let mut stack = DynamoStack::start_with(options).await;
    let fallback = stack
        .add_frontend(
            "fallback-frontend",
            &["--router-mode", "round-robin", "--migration-limit", "3"],
        )
        .await;
    let daemon = crate::support::daemon::start(&config_yaml(&stack, &fallback)).await;
    crate::support::daemon::wait_for_workers(&daemon, 2).await;
    let doomed = stack.worker_ids(WorkerRole::Decode)[0];
    let base = format!("http://{}", daemon.local_addr());

    let (first_tx, mut first_rx) = mpsc::channel(STREAMS);
    let plain: Vec<_> = (0..PLAIN)
        .map(|i| tokio::spawn(plain_stream(base.clone(), i, first_tx.clone())))
        .collect();
    let natives: Vec<_> = (0..RESPONSES)
        .map(|i| tokio::spawn(responses_stream(base.clone(), i, first_tx.clone())))
        .collect();
    let sdks = tokio::spawn(sdk_streams(base.clone(), first_tx.clone()));
    drop(first_tx);
    let mut started = Vec::new();
    tokio::time::timeout(LIMIT, async {
        while started.len() < STREAMS {
            let who = first_rx
                .recv()
                .await
                .expect("a stream ended before its first text");
            started.push(who);
        }
    })
    .await
    .unwrap_or_else(|_| panic!("every stream's first text within {LIMIT:?}: {started:?}"));

    // A survivor joins (the fallback frontend decodes on it), then the serving worker dies.
    let survivor = stack.add_worker(WorkerRole::Decode).await;
    let killed = stack.stop_worker(WorkerRole::Decode, Signal::Kill).await;
    assert_eq!(killed, doomed, "the worker that served every stream");

    let (mut texts, mut events) = (0, 0);
    for (i, handle) in plain.into_iter().enumerate() {
        let seen = tokio::time::timeout(LIMIT, handle)
            .await
            .unwrap_or_else(|_| panic!("plain stream {i} ends within {LIMIT:?}"))
            .expect("plain stream task");
        seen.assert_well_formed(i);
        texts += seen.text.len();
        events += seen.events;
    }
    let mut native_events = 0;
    for (i, handle) in natives.into_iter().enumerate() {
        let seen = tokio::time::timeout(LIMIT, handle)
            .await
            .unwrap_or_else(|_| panic!("responses stream {i} ends within {LIMIT:?}"))
            .expect("responses stream task");
        seen.assert_well_formed(i);
        native_events += seen.events;
    }
    let (ok, out) = tokio::time::timeout(LIMIT, sdks)
        .await
        .expect("the SDK streams end in time")
        .expect("SDK task");
    assert!(ok, "every SDK stream is whole:\n{out}");
    let sdk_done = out.lines().filter(|l| l.starts_with("DONE ")).count();
    assert_eq!(sdk_done, OPENAI + ANTHROPIC, "{out}");

    let continued = mid_stream_count(&daemon, "chat_completions", "error_event", "continued");
    let native_cuts: Vec<(&str, u64)> = ["closed", "stalled", "error_event"]
        .into_iter()
        .map(|r| (r, mid_stream_count(&daemon, "responses", r, "continued")))
        .collect();
    let native_continued: u64 = native_cuts.iter().map(|(_, n)| n).sum();
    let family = daemon
        .metrics()
        .registry()
        .gather()
        .into_iter()
        .find(|f| f.name() == "continuum_mid_stream_fallback_total");
    let all: u64 = family
        .iter()
        .flat_map(|f| f.get_metric())
        .map(|m| m.get_counter().get_value() as u64)
        .sum();
    let resent = daemon
        .metrics()
        .value("continuum_mid_stream_fallback_tokens_resent_total", &[])
        .unwrap_or(0.0);
    assert_eq!(
        continued,
        (PLAIN + OPENAI + ANTHROPIC) as u64,
        "every chat stream was cut by the shim's error chunk and continued"
    );
    assert_eq!(
        native_continued, RESPONSES as u64,
        "every native Responses stream was continued: {native_cuts:?}"
    );
    assert_eq!(all, continued + native_continued, "no other cut or result");
    assert!(resent > 0.0, "tokens re-sent are counted");
    println!(
        "SIGKILL of decode worker {killed} mid-answer (survivor {survivor}): {STREAMS} streams \
         ({PLAIN} plain HTTP, {OPENAI} openai SDK, {ANTHROPIC} anthropic SDK, {RESPONSES} native \
         Responses), {continued} chat + {native_continued} Responses ({native_cuts:?}) cut and \
         continued on the fallback frontend, {STREAMS} whole streams with status 200; plain \
         clients read {events} events, {texts} bytes of text, Responses clients {native_events} \
         events; {resent} tokens re-sent"
    );
    daemon.shutdown().await;
}
