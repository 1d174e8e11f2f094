//! `/health` (liveness: the process serves), `/ready` (a welcomed session to the router and a
//! listed DynamoWorkerMetadata watch) and `/metrics` (Prometheus text).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::metrics::{Agent, Metrics};

#[derive(Clone)]
struct Probe {
    metrics: Metrics,
    ready: Arc<AtomicBool>,
    agent: Agent,
}

pub fn router(metrics: Metrics, ready: Arc<AtomicBool>, agent: Agent) -> Router {
    Router::new()
        .route("/health", get(|| async { "ok\n" }))
        .route("/ready", get(ready_probe))
        .route("/metrics", get(render))
        .with_state(Probe {
            metrics,
            ready,
            agent,
        })
}

async fn ready_probe(State(probe): State<Probe>) -> impl IntoResponse {
    // A broker needs its DynamoWorkerMetadata watch; a kv-listener a connected source.
    let (fed, missing) = match probe.agent {
        Agent::Broker => (
            probe.metrics.kubernetes_connected.get() == 1,
            "not ready: no welcomed session or no DynamoWorkerMetadata watch\n",
        ),
        Agent::KvListener => (
            probe.metrics.sources_connected.get() > 0,
            "not ready: no welcomed session or no connected source\n",
        ),
    };
    if probe.ready.load(Ordering::Relaxed) && fed {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, missing)
    }
}

async fn render(State(probe): State<Probe>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        probe.metrics.render(),
    )
}
