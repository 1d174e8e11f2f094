//! The fleet of the mid-stream fallback tests (issue 31; `mid_stream` and `mid_stream_responses`):
//! two loopback fake upstreams behind `Router::serve`, b1 answering first (the round-robin
//! cursor of a fresh pool starts at it, and a continuation excludes it) and b2 the unified
//! fallback; the client's body read up to a marker and to its end; the fallback counter read.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{HeaderMap, Response, StatusCode};
use bytes::Bytes;
use continuum_actors::metrics::Metrics;
use continuum_router::config::schema::{
    BackendConfig, DisaggregatedServingConfig, MidStreamFallbackConfig,
};
use continuum_router::proxy::{OpenAiRoute, Proxy, ProxyOptions};
use continuum_router::route::{Caller, Router};
use http_body_util::BodyExt;
use serde_json::Value;
use tokio::sync::mpsc;

use super::upstream::{FakeUpstream, Reply};

/// Mid-stream fallback on, then `tune`d.
pub fn armed(tune: impl FnOnce(&mut MidStreamFallbackConfig)) -> MidStreamFallbackConfig {
    let mut config = MidStreamFallbackConfig {
        enabled: true,
        ..MidStreamFallbackConfig::default()
    };
    tune(&mut config);
    config
}

/// A proxy over `backends` with mid-stream fallback `config`.
pub fn proxy(
    backends: &[BackendConfig],
    metrics: Option<Metrics>,
    config: MidStreamFallbackConfig,
) -> Proxy {
    let proxy = Proxy::new(ProxyOptions::default(), metrics);
    proxy.set_backends(
        backends,
        &DisaggregatedServingConfig {
            mid_stream_fallback: config,
            ..DisaggregatedServingConfig::default()
        },
    );
    proxy
}

/// b1 and b2 behind a router, and the stream request each test sends.
pub struct Fleet {
    pub b1: FakeUpstream,
    pub b2: FakeUpstream,
    pub router: Router,
    pub metrics: Metrics,
    /// The route and body of [`Fleet::stream`], and the counter's `ingress` label for it.
    request: (OpenAiRoute, Value, &'static str),
}

impl Fleet {
    /// The upstreams started, configured by `backends(b1's url, b2's url)`, fallback `tune`d;
    /// [`Fleet::stream`] sends `body` on `route` (counted as `ingress`).
    pub async fn start(
        backends: impl FnOnce(&str, &str) -> Vec<BackendConfig>,
        tune: impl FnOnce(&mut MidStreamFallbackConfig),
        (route, body, ingress): (OpenAiRoute, Value, &'static str),
    ) -> Fleet {
        let (b1, b2) = (FakeUpstream::start().await, FakeUpstream::start().await);
        let metrics = Metrics::new(&format!("mid-stream-{ingress}")).expect("metrics");
        let backends = backends(&b1.url(), &b2.url());
        let proxy = proxy(&backends, Some(metrics.clone()), armed(tune));
        Fleet {
            b1,
            b2,
            router: Router::new(Arc::new(proxy)),
            metrics,
            request: (route, body, ingress),
        }
    }

    /// The test's stream request, answered 200.
    pub async fn stream(&self) -> Response<Body> {
        let (route, body, _) = &self.request;
        let resp = self
            .router
            .serve(
                *route,
                HeaderMap::new(),
                Caller::default(),
                Bytes::from(body.to_string()),
            )
            .await;
        assert_eq!(resp.status(), StatusCode::OK);
        resp
    }

    /// `continuum_mid_stream_fallback_total` of the stream's ingress.
    pub fn count(&self, reason: &str, result: &str) -> u64 {
        self.count_on(self.request.2, reason, result)
    }

    pub fn count_on(&self, ingress: &str, reason: &str, result: &str) -> u64 {
        let labels = [("ingress", ingress), ("reason", reason), ("result", result)];
        self.metrics
            .registry()
            .gather()
            .iter()
            .filter(|f| f.name() == "continuum_mid_stream_fallback_total")
            .flat_map(|f| f.get_metric())
            .filter(|m| {
                labels.iter().all(|(k, v)| {
                    m.get_label()
                        .iter()
                        .any(|l| l.name() == *k && l.value() == *v)
                })
            })
            .map(|m| m.get_counter().get_value() as u64)
            .sum()
    }
}

/// Reads the client body until `until` arrived (the original's events reached the client).
pub async fn read_until(body: &mut Body, until: &str) -> Vec<u8> {
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains(until) {
        let frame = body.frame().await.expect("frame").expect("ok");
        seen.extend_from_slice(&frame.into_data().expect("data"));
    }
    seen
}

/// The client's whole stream: what [`read_until`] saw and the rest.
pub async fn rest_of(seen: Vec<u8>, body: Body) -> Vec<u8> {
    let mut all = seen;
    all.extend_from_slice(&body.collect().await.expect("body").to_bytes());
    all
}

/// b1 streams what `send` sends, the client reads it up to `until`, then b1 is cut; returns
/// everything the client got.
pub async fn cut_once(
    f: &mut Fleet,
    send: impl FnOnce(&mpsc::UnboundedSender<Bytes>),
    until: &str,
) -> Vec<u8> {
    let (tx1, rx1) = mpsc::unbounded_channel();
    f.b1.push(Reply::SseThenCut(rx1));
    let resp = f.stream().await;
    f.b1.next_request().await;
    send(&tx1);
    let mut body = resp.into_body();
    let seen = read_until(&mut body, until).await;
    drop(tx1);
    rest_of(seen, body).await
}
