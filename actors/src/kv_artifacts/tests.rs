//! Tests of the artifact registry with the real TinyLlama tokenizer (vendored from dynamo-llm
//! 1.6.1), local card paths, a loopback HTTP server and paused time for the retry.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::lock::Mutex;
use std::time::Duration;

use continuum_protocol::discovery::records::Role;
use continuum_protocol::discovery::snapshot::{DynamoSnapshot, SourceKind, build_snapshot};
use continuum_protocol::discovery::view::{NamespaceView, Worker};
use continuum_protocol::ids::{InstanceId, Namespace, WorkerKey};
use continuum_protocol::kv::artifacts::{
    CardArtifacts, CheckedFile, Checksum, FormatterKind, FormatterSlot, LOAD_RETRY_AFTER,
    MAX_ARTIFACT_BYTES, TokenizerSlot, Unavailable,
};
use continuum_protocol::time::UnixMillis;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;
use crate::metrics::Metrics;

fn fixture(file: &str) -> PathBuf {
    // Canonical: card paths with `..` segments are refused.
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/models/TinyLlama_v1.1")
        .canonicalize()
        .expect("fixture directory")
        .join(file)
}

fn bytes_of(file: &str) -> Vec<u8> {
    std::fs::read(fixture(file)).expect("fixture")
}

fn checked(path: &str, bytes: &[u8]) -> CheckedFile {
    CheckedFile {
        path: path.to_owned(),
        checksum: Checksum::of(bytes),
        size: Some(bytes.len() as u64),
    }
}

/// A TinyLlama card whose files live under `base` (a directory or URL prefix).
fn card(base: &str) -> CardArtifacts {
    CardArtifacts {
        tokenizer: Some(TokenizerSlot::HfTokenizerJson(checked(
            &format!("{base}/tokenizer.json"),
            &bytes_of("tokenizer.json"),
        ))),
        prompt_formatter: Some(FormatterSlot {
            kind: FormatterKind::TokenizerConfigJson,
            file: checked(
                &format!("{base}/tokenizer_config.json"),
                &bytes_of("tokenizer_config.json"),
            ),
            is_custom: false,
        }),
        chat_template_file: None,
    }
}

fn local_card() -> CardArtifacts {
    card(
        fixture("")
            .to_str()
            .expect("utf-8 path")
            .trim_end_matches('/'),
    )
}

fn all_pins() -> Vec<String> {
    vec![
        Checksum::of(&bytes_of("tokenizer.json")).to_string(),
        Checksum::of(&bytes_of("tokenizer_config.json")).to_string(),
    ]
}

fn worker(id: u64, artifacts: CardArtifacts) -> Worker {
    let mut w = Worker::new(
        WorkerKey {
            namespace: Namespace::new("ns"),
            instance_id: InstanceId(id),
        },
        "backend",
        Role::Aggregated,
        UnixMillis(0),
    );
    w.model = Some("tiny".to_owned());
    w.artifacts = Arc::new(artifacts);
    w
}

fn fleet(workers: Vec<Worker>) -> Arc<DynamoSnapshot> {
    let ns = Namespace::new("ns");
    let view = NamespaceView::from_parts(ns.clone(), workers, []);
    Arc::new(build_snapshot(
        SourceKind::Etcd,
        std::slice::from_ref(&ns),
        &[&view],
    ))
}

struct Setup {
    registry: ArtifactRegistry,
    metrics: Metrics,
    cache_dir: tempfile::TempDir,
}

fn setup(pins: Vec<String>, allow_http: bool, allow_hf: bool) -> Setup {
    let cache_dir = tempfile::tempdir().expect("tempdir");
    let metrics = Metrics::new("test").expect("metrics");
    let config = config(&pins, allow_http, allow_hf, cache_dir.path());
    Setup {
        registry: ArtifactRegistry::new(config, Some(metrics.clone())),
        metrics,
        cache_dir,
    }
}

fn config(pins: &[String], allow_http: bool, allow_hf: bool, dir: &Path) -> ArtifactConfig {
    ArtifactConfig {
        policy: ArtifactPolicy {
            allow_http,
            allow_hf,
            hf_endpoint: DEFAULT_HF_ENDPOINT.to_owned(),
            pinned: pins.iter().filter_map(|p| Checksum::parse(p)).collect(),
        },
        cache_dir: dir.join("kv-artifacts"),
        hf_token: None,
    }
}

fn counted(metrics: &Metrics, result: &str) -> u64 {
    let needle = format!("continuum_dynamo_kv_artifacts_total{{result=\"{result}\"}} ");
    metrics
        .render()
        .lines()
        .find_map(|l| l.strip_prefix(&needle))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Waits (on the registry's generation, never a sleep) until `done` holds.
async fn until(registry: &ArtifactRegistry, done: impl Fn(&ArtifactRegistry) -> bool) {
    let mut generations = registry.subscribe();
    while !done(registry) {
        generations.changed().await.expect("registry alive");
    }
}

fn settled(r: &ArtifactRegistry) -> bool {
    !matches!(
        r.artifacts_for(&Namespace::new("ns"), "tiny"),
        Err(ArtifactUnavailable::Loading)
    )
}

fn tiny(r: &ArtifactRegistry) -> Result<Arc<ModelArtifacts>, ArtifactUnavailable> {
    r.artifacts_for(&Namespace::new("ns"), "tiny")
}

#[tokio::test]
async fn pinned_local_artifacts_load_a_real_tokenizer_and_cache_owner_only() {
    let s = setup(all_pins(), true, false);
    s.registry.observe(fleet(vec![
        worker(1, local_card()),
        worker(2, local_card()),
    ]));
    until(&s.registry, settled).await;
    let loaded = tiny(&s.registry).expect("loaded");
    let ids = loaded
        .tokenizer
        .encode("Hello world", false)
        .expect("encode")
        .get_ids()
        .to_vec();
    assert!(!ids.is_empty());
    assert_eq!(
        loaded.tokenizer.decode(&ids, true).expect("decode").trim(),
        "Hello world"
    );
    let Some(PromptFormatterSource::TokenizerConfigJson(config)) = &loaded.prompt_formatter else {
        panic!("prompt formatter: {:?}", loaded.prompt_formatter)
    };
    assert_eq!(&config[..], &bytes_of("tokenizer_config.json")[..]);
    assert!(loaded.chat_template_file.is_none());
    assert_eq!(
        s.registry
            .artifacts_for_model("tiny")
            .expect("all namespaces")
            .key,
        loaded.key
    );
    assert_eq!(counted(&s.metrics, "loaded"), 1);

    let blobs = s.cache_dir.path().join("kv-artifacts/blobs");
    let mode = |p: &Path| std::fs::metadata(p).expect("meta").permissions().mode() & 0o777;
    assert_eq!(mode(&blobs), 0o700);
    let blob = blobs.join(Checksum::of(&bytes_of("tokenizer.json")).hex());
    assert_eq!(mode(&blob), 0o600);
    assert_eq!(
        std::fs::read(&blob).expect("blob"),
        bytes_of("tokenizer.json")
    );
}

#[tokio::test]
async fn unpinned_artifacts_are_logged_once_per_model_and_never_read() {
    let tokenizer_only = vec![all_pins().remove(0)];
    let s = setup(tokenizer_only, true, false);
    for _ in 0..3 {
        s.registry.observe(fleet(vec![worker(1, local_card())]));
    }
    let formatter = Checksum::of(&bytes_of("tokenizer_config.json"));
    let err = tiny(&s.registry).expect_err("unpinned");
    assert_eq!(
        err,
        ArtifactUnavailable::Fleet(Unavailable::Unpinned(vec![formatter]))
    );
    assert_eq!(err.selection_label(), "artifact_unpinned");
    assert_eq!(
        counted(&s.metrics, "unpinned"),
        1,
        "once per model and checksum"
    );
    assert!(s.registry.loaded_keys().is_empty());
    let blobs = s.cache_dir.path().join("kv-artifacts/blobs");
    assert_eq!(
        std::fs::read_dir(&blobs).expect("dir").count(),
        0,
        "nothing fetched"
    );
}

#[tokio::test]
async fn a_fleet_that_disagrees_has_no_tokenizer() {
    let s = setup(all_pins(), true, false);
    let mut upgraded = local_card();
    if let Some(TokenizerSlot::HfTokenizerJson(f)) = &mut upgraded.tokenizer {
        f.checksum = Checksum::of(b"a newer tokenizer.json");
    }
    s.registry
        .observe(fleet(vec![worker(1, local_card()), worker(2, upgraded)]));
    let err = tiny(&s.registry).expect_err("disagreement");
    assert_eq!(
        err,
        ArtifactUnavailable::Fleet(Unavailable::Disagreement { keys: 2 })
    );
    assert_eq!(err.selection_label(), "tokenizer_unavailable");
    assert_eq!(
        s.registry
            .artifacts_for(&Namespace::new("other"), "tiny")
            .expect_err("no workers there"),
        ArtifactUnavailable::Fleet(Unavailable::NoWorkers)
    );
    // The upgrade finishes: the old worker leaves, the remaining one is agreed (and loads).
    s.registry.observe(fleet(vec![worker(1, local_card())]));
    until(&s.registry, settled).await;
    assert!(tiny(&s.registry).is_ok());
}

#[tokio::test]
async fn removing_a_pin_on_reload_drops_the_loaded_tokenizer() {
    let s = setup(all_pins(), true, false);
    s.registry.observe(fleet(vec![worker(1, local_card())]));
    until(&s.registry, settled).await;
    let key = tiny(&s.registry).expect("loaded").key;
    assert_eq!(s.registry.loaded_keys(), vec![key]);
    s.registry
        .reconfigure(config(&all_pins()[..1], true, false, s.cache_dir.path()));
    assert!(s.registry.loaded_keys().is_empty());
    assert!(matches!(
        tiny(&s.registry),
        Err(ArtifactUnavailable::Fleet(Unavailable::Unpinned(_)))
    ));
    // Pinned again: loads again (from the verified cache this time).
    s.registry
        .reconfigure(config(&all_pins(), true, false, s.cache_dir.path()));
    until(&s.registry, settled).await;
    assert!(tiny(&s.registry).is_ok());
    assert_eq!(counted(&s.metrics, "cache_hit"), 2);
}

#[tokio::test]
async fn a_tampered_cache_blob_is_evicted_and_fetched_again() {
    let s = setup(all_pins(), true, false);
    s.registry.observe(fleet(vec![worker(1, local_card())]));
    until(&s.registry, settled).await;
    assert!(tiny(&s.registry).is_ok());
    let blob = s
        .cache_dir
        .path()
        .join("kv-artifacts/blobs")
        .join(Checksum::of(&bytes_of("tokenizer.json")).hex());
    std::fs::write(&blob, b"{\"not\":\"the pinned tokenizer\"}").expect("tamper");

    // A fresh process over the same cache directory.
    let metrics = Metrics::new("test").expect("metrics");
    let again = ArtifactRegistry::new(
        config(&all_pins(), true, false, s.cache_dir.path()),
        Some(metrics.clone()),
    );
    again.observe(fleet(vec![worker(1, local_card())]));
    until(&again, settled).await;
    assert!(tiny(&again).is_ok());
    assert_eq!(counted(&metrics, "checksum_mismatch"), 1);
    assert_eq!(
        counted(&metrics, "cache_hit"),
        1,
        "only the formatter was intact"
    );
    assert_eq!(
        std::fs::read(&blob).expect("blob"),
        bytes_of("tokenizer.json")
    );
}

#[tokio::test(start_paused = true)]
async fn a_failed_load_is_retried_after_five_minutes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = dir.path().join("model");
    let s = setup(all_pins(), true, false);
    let card = card(base.to_str().expect("utf-8"));
    s.registry.observe(fleet(vec![worker(1, card.clone())]));
    until(&s.registry, settled).await;
    assert_eq!(
        tiny(&s.registry).expect_err("missing"),
        ArtifactUnavailable::Failed
    );
    assert_eq!(counted(&s.metrics, "fetch_failed"), 1);

    std::fs::create_dir(&base).expect("mkdir");
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture(file), base.join(file)).expect("copy");
    }
    // A new generation before the delay does not retry.
    tokio::time::advance(LOAD_RETRY_AFTER - Duration::from_secs(1)).await;
    s.registry.observe(fleet(vec![worker(1, card.clone())]));
    assert_eq!(
        tiny(&s.registry).expect_err("waiting"),
        ArtifactUnavailable::Failed
    );

    tokio::time::advance(Duration::from_secs(1)).await;
    until(&s.registry, |r| tiny(r).is_ok()).await;
    assert_eq!(counted(&s.metrics, "loaded"), 1);
}

#[tokio::test]
async fn an_oversized_card_size_is_refused_before_any_read() {
    let s = setup(all_pins(), true, false);
    let mut big = local_card();
    if let Some(TokenizerSlot::HfTokenizerJson(f)) = &mut big.tokenizer {
        f.size = Some(MAX_ARTIFACT_BYTES + 1);
    }
    s.registry.observe(fleet(vec![worker(1, big)]));
    until(&s.registry, settled).await;
    assert_eq!(
        tiny(&s.registry).expect_err("refused"),
        ArtifactUnavailable::Failed
    );
    assert_eq!(counted(&s.metrics, "oversized"), 1);
}

/// One canned response per path, and every request head seen.
#[derive(Clone, Default)]
struct Loopback {
    routes: Arc<Mutex<BTreeMap<String, Vec<u8>>>>,
    /// Paths answered with a Content-Length past the artifact bound (and no body).
    huge: Arc<Mutex<Vec<String>>>,
    seen: Arc<Mutex<Vec<String>>>,
}

impl Loopback {
    async fn start(self) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let this = self.clone();
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16_384 {
                        match conn.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let head = String::from_utf8_lossy(&head).into_owned();
                    let path = head.split(' ').nth(1).unwrap_or_default().to_owned();
                    this.seen.lock().push(head);
                    let body = this.routes.lock().get(&path).cloned();
                    let huge = this.huge.lock().contains(&path);
                    let response = match body {
                        _ if huge => format!(
                            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                            MAX_ARTIFACT_BYTES + 1
                        )
                        .into_bytes(),
                        Some(body) => {
                            let mut r = format!(
                                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                                body.len()
                            )
                            .into_bytes();
                            r.extend_from_slice(&body);
                            r
                        }
                        None => b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".to_vec(),
                    };
                    let _ = conn.write_all(&response).await;
                });
            }
        });
        format!("http://{addr}")
    }

    fn serve_fixture(&self, prefix: &str) {
        let mut routes = self.routes.lock();
        for file in ["tokenizer.json", "tokenizer_config.json"] {
            routes.insert(format!("{prefix}/{file}"), bytes_of(file));
        }
    }

    fn requests(&self) -> Vec<String> {
        self.seen.lock().clone()
    }
}

#[tokio::test]
async fn http_sources_load_when_allowed_and_are_skipped_when_not() {
    let server = Loopback::default();
    server.serve_fixture("/v1/metadata/ns/backend/generate/tiny/base");
    let url = server.clone().start().await;
    let http_card = card(&format!("{url}/v1/metadata/ns/backend/generate/tiny/base"));

    let refused = setup(all_pins(), false, false);
    refused
        .registry
        .observe(fleet(vec![worker(1, http_card.clone())]));
    until(&refused.registry, settled).await;
    assert_eq!(
        tiny(&refused.registry).expect_err("disallowed"),
        ArtifactUnavailable::Failed
    );
    assert_eq!(counted(&refused.metrics, "disallowed"), 1);
    assert!(server.requests().is_empty(), "nothing was requested");

    let allowed = setup(all_pins(), true, false);
    allowed.registry.observe(fleet(vec![worker(1, http_card)]));
    until(&allowed.registry, settled).await;
    let loaded = tiny(&allowed.registry).expect("loaded over http");
    assert!(
        !loaded
            .tokenizer
            .encode("hi", false)
            .expect("encode")
            .get_ids()
            .is_empty()
    );
    let requests = server.requests();
    assert_eq!(requests.len(), 2);
    assert!(
        requests
            .iter()
            .all(|r| !r.to_ascii_lowercase().contains("authorization"))
    );
}

#[tokio::test]
async fn wrong_bytes_from_a_source_are_refused_as_a_checksum_mismatch() {
    let server = Loopback::default();
    server.serve_fixture("/m");
    server
        .routes
        .lock()
        .insert("/m/tokenizer.json".into(), b"{}".to_vec());
    let url = server.clone().start().await;
    let mut http_card = card(&format!("{url}/m"));
    if let Some(TokenizerSlot::HfTokenizerJson(f)) = &mut http_card.tokenizer {
        f.size = None; // a legacy card: only the checksum catches it
    }
    let s = setup(all_pins(), true, false);
    s.registry.observe(fleet(vec![worker(1, http_card)]));
    until(&s.registry, settled).await;
    assert_eq!(
        tiny(&s.registry).expect_err("mismatch"),
        ArtifactUnavailable::Failed
    );
    assert_eq!(counted(&s.metrics, "checksum_mismatch"), 1);
}

#[tokio::test]
async fn hf_sources_need_allow_hf_and_send_the_token_to_the_hub_only() {
    let server = Loopback::default();
    server.serve_fixture("/TinyLlama/TinyLlama_v1.1/resolve/main");
    let endpoint = server.clone().start().await;
    let hf_card = card("hf://TinyLlama/TinyLlama_v1.1");

    let refused = setup(all_pins(), true, false);
    refused
        .registry
        .observe(fleet(vec![worker(1, hf_card.clone())]));
    until(&refused.registry, settled).await;
    assert_eq!(
        tiny(&refused.registry).expect_err("disallowed"),
        ArtifactUnavailable::Failed
    );
    assert_eq!(counted(&refused.metrics, "disallowed"), 1);
    assert!(server.requests().is_empty());

    let dir = tempfile::tempdir().expect("tempdir");
    let mut hub = config(&all_pins(), true, true, dir.path());
    hub.policy.hf_endpoint = endpoint;
    hub.hf_token = Some("hf_test_token".into());
    let registry = ArtifactRegistry::new(hub, None);
    registry.observe(fleet(vec![worker(1, hf_card)]));
    until(&registry, settled).await;
    assert!(tiny(&registry).is_ok());
    let requests = server.requests();
    assert_eq!(requests.len(), 2);
    for r in &requests {
        assert!(
            r.starts_with("GET /TinyLlama/TinyLlama_v1.1/resolve/main/"),
            "{r}"
        );
        assert!(
            r.to_ascii_lowercase()
                .contains("authorization: bearer hf_test_token"),
            "{r}"
        );
    }
}

#[tokio::test]
async fn an_announced_body_past_the_bound_is_refused_before_reading() {
    let server = Loopback::default();
    server.serve_fixture("/m");
    server.huge.lock().push("/m/tokenizer.json".into());
    let url = server.clone().start().await;
    let mut legacy = card(&format!("{url}/m"));
    if let Some(TokenizerSlot::HfTokenizerJson(f)) = &mut legacy.tokenizer {
        f.size = None; // no card size: the announced length is the first bound
    }
    let s = setup(all_pins(), true, false);
    s.registry.observe(fleet(vec![worker(1, legacy)]));
    until(&s.registry, settled).await;
    assert_eq!(
        tiny(&s.registry).expect_err("too large"),
        ArtifactUnavailable::Failed
    );
    assert_eq!(counted(&s.metrics, "oversized"), 1);
}
