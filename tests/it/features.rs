//! Builds without a product feature (`dynamo`, `dynamo-kv`, `dynamo-event-bus`), shown on the
//! full build: `Daemon::start_with_features` runs fewer features than are compiled, through the
//! same composition points a slim binary compiles. Its keys are accepted with a "compiled but
//! inactive" warning (log and config diagnostic), its routes answer 404, nothing of it starts or
//! dials, and requests route normally. Each test has a full-feature contrast, so it can fail.
//! (A real slim build runs the unit tests under `cargo test --no-default-features --lib`.)

use crate::support::logs::Logs;
use crate::support::upstream::{FakeUpstream, Reply, completion};

use std::time::Duration;

use axum::http::StatusCode;
use continuum_actors::memory_source::MemoryDiscovery;
use continuum_router::build_info::Features;
use continuum_router::config::{Config, ProcessEnv, features};
use continuum_router::daemon::{Daemon, RunOptions};
use futures::FutureExt as _;
use serde_json::{Value, json};
use tokio::net::TcpListener;

const TOKEN: &str = "features-admin-token-0123456789";
const WAIT: Duration = Duration::from_secs(20);

/// Every section a feature gates switched on: discovery from an etcd at `etcd` (a listener the
/// test owns), KV, the event-bus listener on `bus`, and a unified backend at `backend`.
fn yaml(etcd: std::net::SocketAddr, bus: std::net::SocketAddr, backend: &str) -> String {
    format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\n\
         admin:\n  enabled: true\n  token: {TOKEN}\n\
         backends:\n  - name: a\n    type: openai\n    url: \"{backend}\"\n    models: [m]\n    \
         health_check: {{enabled: false}}\n\
         dynamo:\n  enabled: true\n  discovery:\n    etcd:\n      endpoints: [\"http://{etcd}\"]\n  \
         kv:\n    enabled: true\n  event_bus:\n    enabled: true\n    listen: \"{bus}\"\n"
    )
}

async fn start(config: Config, features: Features) -> Daemon {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let options = RunOptions {
        config,
        config_path: None,
        demo: false,
    };
    Daemon::start_with_features(options, listener, MemoryDiscovery::new(), features)
        .await
        .expect("daemon starts")
}

async fn admin(daemon: &Daemon, path: &str) -> (StatusCode, String) {
    let response = reqwest::Client::new()
        .get(format!("http://{}{path}", daemon.local_addr()))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("admin call");
    let status = StatusCode::from_u16(response.status().as_u16()).expect("status");
    (status, response.text().await.expect("body"))
}

async fn subsystems(daemon: &Daemon) -> Vec<String> {
    let (status, body) = admin(daemon, "/admin/subsystems").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let body: Value = serde_json::from_str(&body).expect("json");
    let mut ids: Vec<String> = body["subsystems"]
        .as_array()
        .expect("subsystems")
        .iter()
        .map(|s| s["id"].as_str().expect("id").to_owned())
        .collect();
    ids.sort();
    ids
}

/// A free loopback address nobody listens on (bound, then released), for the event-bus listener
/// the tests then prove unbound by a refused connect. It is on 127.0.0.3, where no other test
/// listens: a port released on 127.0.0.1 can be handed to another test's listener in the same
/// run before the connect, which then succeeds (seen once in a full run).
async fn free_port() -> std::net::SocketAddr {
    let probe = TcpListener::bind("127.0.0.3:0").await.expect("bind");
    probe.local_addr().expect("addr")
}

#[tokio::test]
async fn without_dynamo_the_keys_warn_the_routes_404_nothing_starts_and_requests_route_unified() {
    let etcd = TcpListener::bind("127.0.0.1:0").await.expect("fake etcd");
    let bus = free_port().await;
    let mut backend = FakeUpstream::start().await;
    let text = yaml(etcd.local_addr().expect("addr"), bus, &backend.url());
    let config = Config::from_yaml_str(&text, &ProcessEnv).expect("parses");

    // The config diagnostic: one warning per gated section, each naming its feature.
    let warnings = features::inactive(&config, Features::NONE);
    let paths: Vec<&str> = warnings.iter().map(|d| d.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "dynamo.enabled",
            "dynamo.kv.enabled",
            "dynamo.event_bus.enabled"
        ]
    );
    assert!(warnings.iter().all(features::is_inactive_warning));

    // The log: the daemon says so at startup.
    // (Logs: this thread's default subscriber; the current-thread test runtime polls the
    // daemon's startup here.)
    let captured = Logs::default();
    let guard = captured.install();
    let daemon = start(config, Features::NONE).await;
    drop(guard);
    let log = captured.text();
    for path in paths {
        assert!(
            log.lines().any(|l| l.contains("WARN")
                && l.contains("compiled but inactive")
                && l.contains(path)),
            "no startup warning for {path}:\n{log}"
        );
    }

    // Routes: the Dynamo ones answer 404, the rest of the admin API and readiness answer.
    for path in ["/admin/dynamo/workers", "/admin/fleet/summary", "/admin/ui"] {
        assert_eq!(
            admin(&daemon, path).await.0,
            StatusCode::NOT_FOUND,
            "{path}"
        );
    }
    let (status, readback) = admin(&daemon, "/admin/config").await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        readback.contains("\ndynamo:\n  enabled: true\n"),
        "the readback keeps the file's keys as written:\n{readback}"
    );
    let ready = reqwest::get(format!("http://{}/ready", daemon.local_addr()))
        .await
        .expect("GET /ready");
    assert_eq!(ready.status(), 200, "no discovery source to wait for");

    // Nothing started: only the registry (the request path's empty fleet) runs.
    assert_eq!(subsystems(&daemon).await, ["root", "root/registry"]);
    assert!(
        tokio::net::TcpStream::connect(bus).await.is_err(),
        "the event-bus listener is not bound"
    );

    // Requests route normally (unified, no pins) to the configured backend.
    backend.push(Reply::Json(StatusCode::OK, completion("unified"), vec![]));
    let response = reqwest::Client::new()
        .post(format!(
            "http://{}/v1/chat/completions",
            daemon.local_addr()
        ))
        .json(&json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .expect("chat completion");
    assert_eq!(response.status(), 200);
    let seen = backend.next_request().await;
    assert_eq!(seen.path, "/v1/chat/completions");
    assert!(
        seen.headers
            .keys()
            .all(|k| !k.as_str().starts_with("x-dynamo-")),
        "{:?}",
        seen.headers
    );
    // By now a discovery watcher would have dialled; none exists, and etcd saw no connection.
    assert!(etcd.accept().now_or_never().is_none(), "etcd was dialled");
    daemon.shutdown().await;
}

/// The contrast: the same config on the full feature set starts discovery (it dials the fake
/// etcd), the KV index, the subscriptions and the event bus, and serves `/admin/dynamo/workers`.
#[tokio::test]
async fn with_every_feature_the_same_config_starts_everything() {
    let etcd = TcpListener::bind("127.0.0.1:0").await.expect("fake etcd");
    let backend = FakeUpstream::start().await;
    // The listener has no TLS files: it starts (the subtree exists) and refuses to serve.
    let text = yaml(
        etcd.local_addr().expect("addr"),
        free_port().await,
        &backend.url(),
    );
    let config = Config::from_yaml_str(&text, &ProcessEnv).expect("parses");
    assert!(features::inactive(&config, Features::COMPILED).is_empty());
    let daemon = start(config, Features::COMPILED).await;
    let running = subsystems(&daemon).await;
    for id in [
        "root/discovery",
        "root/kv_index",
        "root/picker",
        "root/subscriptions",
        "root/event_bus",
    ] {
        assert!(running.iter().any(|r| r == id), "{id} in {running:?}");
    }
    assert_eq!(
        admin(&daemon, "/admin/dynamo/workers").await.0,
        StatusCode::OK
    );
    tokio::time::timeout(WAIT, etcd.accept())
        .await
        .expect("discovery dials etcd")
        .expect("accept");
    daemon.shutdown().await;
}

/// `dynamo` without `dynamo-kv` and `dynamo-event-bus`: discovery and the Dynamo routes run; no
/// KV index, no event bus, and the two sections warn.
#[tokio::test]
async fn dynamo_alone_runs_discovery_without_the_kv_index_or_the_event_bus() {
    let etcd = TcpListener::bind("127.0.0.1:0").await.expect("fake etcd");
    let bus = free_port().await;
    let backend = FakeUpstream::start().await;
    let text = yaml(etcd.local_addr().expect("addr"), bus, &backend.url());
    let config = Config::from_yaml_str(&text, &ProcessEnv).expect("parses");
    let dynamo_only = Features {
        dynamo: true,
        dynamo_kv: false,
        dynamo_event_bus: false,
    };
    let paths: Vec<String> = features::inactive(&config, dynamo_only)
        .into_iter()
        .map(|d| d.path)
        .collect();
    assert_eq!(paths, ["dynamo.kv.enabled", "dynamo.event_bus.enabled"]);
    let daemon = start(config, dynamo_only).await;
    let running = subsystems(&daemon).await;
    assert!(running.iter().any(|r| r == "root/discovery"), "{running:?}");
    assert!(
        running.iter().any(|r| r == "root/subscriptions"),
        "{running:?}"
    );
    for id in ["root/kv_index", "root/event_bus"] {
        assert!(!running.iter().any(|r| r == id), "{id} in {running:?}");
    }
    assert!(tokio::net::TcpStream::connect(bus).await.is_err());
    assert_eq!(
        admin(&daemon, "/admin/dynamo/workers").await.0,
        StatusCode::OK
    );
    tokio::time::timeout(WAIT, etcd.accept())
        .await
        .expect("discovery dials etcd")
        .expect("accept");
    daemon.shutdown().await;
}
