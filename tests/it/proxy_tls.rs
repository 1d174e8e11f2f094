//! HTTPS backends through the real `front_door::router` against a local TLS upstream (tokio-rustls
//! and hyper, HTTP/2 or HTTP/1.1 by ALPN) whose certificate is signed by a CA generated at test time
//! with the openssl CLI: the CA configured in `backends[].tls.ca_cert` is trusted, the webpki roots
//! alone are not, a certificate for another host name is refused, and h2 is used when offered.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use axum::body::Body;
use axum::http::{Request, Response, StatusCode, Version};
use continuum_actors::metrics::Metrics;
use continuum_actors::tree::ActorTree;
use continuum_protocol::breaker::{BreakerConfig, BreakerState};
use continuum_protocol::time::Tick;
use continuum_router::config::schema::{
    BackendConfig, BackendRole, BackendTlsConfig, BackendType, DisaggregatedServingConfig,
    HealthCheckConfig, HumanDuration,
};
use continuum_router::front_door::{self, AppState, LiveSettings};
use continuum_router::proxy::{Proxy, ProxyOptions};
use continuum_router::readiness::Readiness;
use continuum_router::route::Router;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tower::ServiceExt;

use crate::support::bus_pki;

/// A CA and two server certificates it signed: one for `localhost`/127.0.0.1, one for another
/// host name only.
struct Pki {
    _dir: tempfile::TempDir,
    ca: PathBuf,
    good: (PathBuf, PathBuf),
    wrong_name: (PathBuf, PathBuf),
}

fn pki() -> Pki {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = bus_pki::ca(dir.path(), "continuum-test-ca");
    let server = |name, san| bus_pki::leaf(dir.path(), name, san, "serverAuth");
    let good = server("good", "DNS:localhost,IP:127.0.0.1");
    let wrong_name = server("wrong", "DNS:wrong.example");
    Pki {
        ca,
        good,
        wrong_name,
        _dir: dir,
    }
}

/// What the TLS upstream saw of one API request.
struct Seen {
    version: Version,
    path: String,
}

/// A TLS upstream answering `/v1/chat/completions` (buffered, or SSE with `"stream": true`) and
/// `/health` (both recorded); `alpn` lists the protocols it accepts.
struct TlsUpstream {
    addr: SocketAddr,
    seen: mpsc::UnboundedReceiver<Seen>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TlsUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn tls_upstream(cert: &(PathBuf, PathBuf), alpn: &[&[u8]]) -> TlsUpstream {
    let chain = CertificateDer::pem_file_iter(&cert.0)
        .expect("cert file")
        .collect::<Result<Vec<_>, _>>()
        .expect("cert pem");
    let key = PrivateKeyDer::from_pem_file(&cert.1).expect("key pem");
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_no_client_auth()
    .with_single_cert(chain, key)
    .expect("server config");
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, seen) = mpsc::unbounded_channel();
    let task = tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, tx) = (acceptor.clone(), tx.clone());
            tokio::spawn(async move {
                // A refused handshake (the client distrusts the certificate) ends here.
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let service = service_fn(move |req: Request<Incoming>| answer(req, tx.clone()));
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    TlsUpstream { addr, seen, task }
}

async fn answer(
    req: Request<Incoming>,
    seen: mpsc::UnboundedSender<Seen>,
) -> Result<Response<Body>, Infallible> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let _ = seen.send(Seen {
        version: parts.version,
        path: parts.uri.path().to_owned(),
    });
    if parts.uri.path() == "/health" {
        return Ok(Response::new(Body::from("{}")));
    }
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    if request["stream"] == json!(true) {
        let events = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"tls\"}}]}\n\n\
                      data: [DONE]\n\n";
        return Ok(Response::builder()
            .header("content-type", "text/event-stream")
            .body(Body::from(events))
            .expect("response"));
    }
    let completion = json!({"id": "chatcmpl-tls", "object": "chat.completion", "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "over tls"},
                     "finish_reason": "stop"}]});
    Ok(Response::builder()
        .header("content-type", "application/json")
        .body(Body::from(completion.to_string()))
        .expect("response"))
}

fn backend(url: &str, ca: Option<&Path>, health: bool) -> BackendConfig {
    BackendConfig {
        name: "tls-b".into(),
        kind: BackendType::Openai,
        url: url.into(),
        role: BackendRole::Unified,
        models: vec!["m".into()],
        internal: false,
        enabled: true,
        health_check: HealthCheckConfig {
            enabled: health,
            interval: HumanDuration::from_secs(3600),
            ..HealthCheckConfig::default()
        },
        tls: BackendTlsConfig {
            ca_cert: ca.map(Path::to_path_buf),
        },
        global_prompts: Vec::new(),
        requires_single_leading_system: false,
        responses_api: Default::default(),
        responses_only_models: Vec::new(),
    }
}

fn harness(backend: BackendConfig, breaker: BreakerConfig) -> (AppState, Arc<Proxy>) {
    let clock = Arc::new(AtomicU64::new(0));
    let options = ProxyOptions {
        breaker,
        clock: Arc::new(move || Tick::from_millis(clock.load(Ordering::SeqCst))),
        ..ProxyOptions::default()
    };
    let metrics = Metrics::new("proxy-tls-test").expect("metrics");
    let proxy = Arc::new(Proxy::new(options, Some(metrics)));
    proxy.set_backends(&[backend], &DisaggregatedServingConfig::default());
    let (control, _rx) = mpsc::channel(1);
    let state = AppState {
        live: Arc::new(ArcSwap::from_pointee(LiveSettings::default())),
        readiness: Readiness::new(),
        metrics: Arc::new(String::new),
        tree: ActorTree::default(),
        control,
        dynamo_workers: Arc::new(|| json!({})),
        fleet_summary: Arc::new(|| json!({})),
        fleet_models: Arc::new(|_: &[String]| Vec::new()),
        route: Arc::new(Router::new(proxy.clone())),
    };
    (state, proxy)
}

async fn chat(state: &AppState, stream: bool) -> Response<Body> {
    let body = json!({"model": "m", "stream": stream,
                      "messages": [{"role": "user", "content": "hello"}]});
    let req = Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .expect("request");
    front_door::router(state.clone())
        .oneshot(req)
        .await
        .expect("infallible")
}

async fn text(resp: Response<Body>) -> String {
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    String::from_utf8_lossy(&bytes).into_owned()
}

async fn next_seen(up: &mut TlsUpstream) -> Seen {
    tokio::time::timeout(Duration::from_secs(10), up.seen.recv())
        .await
        .expect("the upstream saw a request in time")
        .expect("upstream running")
}

/// Buffered and SSE chat completions through the router to an https backend whose CA is
/// configured; returns the HTTP versions the upstream saw.
async fn relays_over_tls(alpn: &[&[u8]]) -> Vec<Version> {
    let pki = pki();
    let mut up = tls_upstream(&pki.good, alpn).await;
    let url = format!("https://localhost:{}/v1", up.addr.port());
    let (state, _proxy) = harness(
        backend(&url, Some(&pki.ca), false),
        BreakerConfig::default(),
    );

    let resp = chat(&state, false).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let body: Value = serde_json::from_str(&text(resp).await).expect("json");
    assert_eq!(body["choices"][0]["message"]["content"], "over tls");
    let first = next_seen(&mut up).await;
    assert_eq!(first.path, "/v1/chat/completions");

    let resp = chat(&state, true).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let events = text(resp).await;
    assert!(events.contains("\"content\":\"tls\""), "{events}");
    assert!(events.contains("data: [DONE]"), "{events}");
    let second = next_seen(&mut up).await;
    vec![first.version, second.version]
}

#[tokio::test]
async fn an_https_backend_with_its_ca_configured_negotiates_h2_when_offered() {
    let versions = relays_over_tls(&[b"h2", b"http/1.1"]).await;
    assert_eq!(versions, vec![Version::HTTP_2, Version::HTTP_2]);
}

#[tokio::test]
async fn an_https_backend_without_h2_is_spoken_to_over_http_1_1() {
    let versions = relays_over_tls(&[b"http/1.1"]).await;
    assert_eq!(versions, vec![Version::HTTP_11, Version::HTTP_11]);
}

/// A refused handshake is a connect failure: 502 in the existing error shape, the rustls reason
/// in the message, and a breaker failure.
async fn refused(backend: BackendConfig, reason: &str) {
    let breaker = BreakerConfig {
        failure_threshold: 1,
        ..BreakerConfig::default()
    };
    let (state, proxy) = harness(backend, breaker);
    let resp = chat(&state, false).await;
    assert_eq!(resp.status(), StatusCode::BAD_GATEWAY);
    let body: Value = serde_json::from_str(&text(resp).await).expect("json error body");
    assert_eq!(body["error"]["code"], "bad_gateway", "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("invalid peer certificate") && message.contains(reason),
        "{message}"
    );
    let b = proxy.pool().get("tls-b").expect("backend");
    assert!(matches!(b.breaker_state(), BreakerState::Open { .. }));
}

#[tokio::test]
async fn an_unknown_ca_is_refused_with_the_rustls_reason() {
    let pki = pki();
    let up = tls_upstream(&pki.good, &[b"h2", b"http/1.1"]).await;
    // The webpki roots only: the test CA is unknown.
    let url = format!("https://localhost:{}", up.addr.port());
    refused(backend(&url, None, false), "UnknownIssuer").await;
}

#[tokio::test]
async fn a_certificate_for_another_host_name_is_refused() {
    let pki = pki();
    let up = tls_upstream(&pki.wrong_name, &[b"http/1.1"]).await;
    let url = format!("https://localhost:{}", up.addr.port());
    refused(
        backend(&url, Some(&pki.ca), false),
        "not valid for name \"localhost\"",
    )
    .await;
}

#[tokio::test]
async fn health_checks_of_an_https_backend_use_its_ca() {
    let pki = pki();
    let mut up = tls_upstream(&pki.good, &[b"h2", b"http/1.1"]).await;
    let url = format!("https://127.0.0.1:{}", up.addr.port());
    let (_state, proxy) = harness(backend(&url, Some(&pki.ca), true), BreakerConfig::default());
    let b = proxy.pool().get("tls-b").expect("backend");
    assert!(b.target().is_ok(), "{:?}", b.target().err());
    // The first probe runs at once; the upstream only sees it after the TLS handshake with the
    // backend's CA succeeded (an IP-address host name, checked against the IP SAN).
    let probe = next_seen(&mut up).await;
    assert_eq!(probe.path, "/health");
}

#[tokio::test]
async fn a_reload_that_adds_the_ca_makes_the_backend_reachable() {
    let pki = pki();
    let mut up = tls_upstream(&pki.good, &[b"h2", b"http/1.1"]).await;
    let url = format!("https://localhost:{}", up.addr.port());
    let (state, proxy) = harness(backend(&url, None, false), BreakerConfig::default());
    assert_eq!(chat(&state, false).await.status(), StatusCode::BAD_GATEWAY);

    proxy.set_backends(
        &[backend(&url, Some(&pki.ca), false)],
        &DisaggregatedServingConfig::default(),
    );
    let resp = chat(&state, false).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(next_seen(&mut up).await.path, "/v1/chat/completions");

    // And removing it again distrusts the upstream (a fresh handshake on the shared client).
    proxy.set_backends(
        &[backend(&url, None, false)],
        &DisaggregatedServingConfig::default(),
    );
    assert_eq!(chat(&state, false).await.status(), StatusCode::BAD_GATEWAY);
}
