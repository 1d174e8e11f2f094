//! The backend pool: `type: openai` backends with active health checks and a circuit breaker each.
//!
//! Health checks are plain tokio tasks, one per enabled backend with `health_check.enabled`, owned
//! by the pool: [`BackendPool::shutdown`] (and dropping the pool) aborts them, and a reload aborts
//! only the tasks of removed or changed backends. Health and breaker decisions are the pure state
//! machines of `continuum_protocol::breaker`; the tasks only probe and fold results in.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use arc_swap::ArcSwap;
use axum::http::{Method, Request, Response, Uri};
use bytes::Bytes;
use continuum_protocol::breaker::{
    Admission, Breaker, BreakerConfig, BreakerState, HealthThresholds, HealthTracker,
    HealthTransition,
};
use continuum_protocol::time::Tick;
use http_body_util::Full;
use rustls::pki_types::CertificateDer;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use super::headers::Outbound;
use super::pool::ConnPool;
use super::relay::collect_bounded;
use super::upstream::{Target, Upstream, UpstreamBody, UpstreamError};
use crate::config::schema::{BackendConfig, BackendRole, HealthCheckConfig};

/// Caller-supplied monotonic clock (tests drive it by hand).
pub type Clock = Arc<dyn Fn() -> Tick + Send + Sync>;

/// Largest health-check response body read (the rest is discarded with the connection).
const MAX_HEALTH_BODY_BYTES: usize = 64 * 1024;
/// Shortest probe interval honoured, so a zero interval cannot spin.
const MIN_HEALTH_INTERVAL: Duration = Duration::from_millis(1);

/// Health and breaker state of one backend; survives reloads that leave the backend unchanged.
#[derive(Debug)]
struct BackendState {
    healthy: AtomicBool,
    health: Mutex<HealthTracker>,
    breaker: Mutex<Breaker>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The guarded state machines are updated by single assignments: a panic elsewhere leaves
    // them consistent.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One configured backend replica.
#[derive(Debug)]
pub struct Backend {
    config: BackendConfig,
    target: Result<Target, String>,
    state: Arc<BackendState>,
    /// The client that dials this backend: the pool's shared one, or one of its own that also
    /// trusts the backend's `tls.ca_cert`. Health checks use it too.
    upstream: Upstream,
    /// The request path's HTTP/1.1 connection pool for a plain-`http` backend (kept across a
    /// reload while the URL is unchanged); HTTPS backends are dialled through `upstream`.
    conns: Option<ConnPool>,
    /// The certificates of `tls.ca_cert` as read at the last reload (empty without one).
    trusted: Vec<CertificateDer<'static>>,
}

impl Backend {
    pub fn name(&self) -> &str {
        &self.config.name
    }

    pub fn config(&self) -> &BackendConfig {
        &self.config
    }

    pub fn target(&self) -> Result<&Target, &str> {
        self.target.as_ref().map_err(String::as_str)
    }

    /// The client that dials this backend (and runs its health checks).
    pub fn upstream(&self) -> &Upstream {
        &self.upstream
    }

    /// Sends a request of the request path (`POST`, these headers and body) to `uri` on this
    /// backend (its connection pool for plain `http`, which encodes the headers straight into
    /// the written request; else its client), waiting at most `head_timeout` for the response
    /// head.
    pub async fn send(
        &self,
        uri: Uri,
        headers: &Outbound<'_>,
        body: Bytes,
        head_timeout: Duration,
    ) -> Result<Response<UpstreamBody>, UpstreamError> {
        match &self.conns {
            Some(pool) => {
                let path = uri.path_and_query().map_or("/", |p| p.as_str());
                Ok(pool
                    .send(&Method::POST, path, headers.fields(), &body, head_timeout)
                    .await?
                    .map(UpstreamBody::Pooled))
            }
            None => {
                let mut req = Request::new(Full::new(body));
                *req.method_mut() = Method::POST;
                *req.uri_mut() = uri;
                *req.headers_mut() = headers.to_map();
                Ok(self
                    .upstream
                    .send(req, head_timeout)
                    .await?
                    .map(UpstreamBody::Client))
            }
        }
    }

    pub fn is_healthy(&self) -> bool {
        self.state.healthy.load(Ordering::Acquire)
    }

    pub fn breaker_state(&self) -> BreakerState {
        lock(&self.state.breaker).state()
    }

    /// Whether this backend serves `model` (an empty `models` list serves any).
    pub fn serves(&self, model: &str) -> bool {
        self.config.models.is_empty() || self.config.models.iter().any(|m| m == model)
    }

    fn usable(&self, now: Tick) -> bool {
        self.target.is_ok() && self.is_healthy() && lock(&self.state.breaker).would_admit(now)
    }

    pub fn admit(&self, now: Tick) -> Admission {
        lock(&self.state.breaker).admit(now)
    }

    pub fn record_success(&self) {
        lock(&self.state.breaker).on_success();
    }

    pub fn record_failure(&self, now: Tick) {
        if lock(&self.state.breaker).on_failure(now) {
            warn!(backend = %self.config.name, "Opened the circuit breaker of a backend.");
        }
    }
}

/// The outcome of choosing replicas for one request.
#[derive(Debug)]
pub enum Selection {
    /// Usable replicas in round-robin order: the first is the choice, the rest the retry order.
    Candidates(Vec<Arc<Backend>>),
    /// No backend the caller may use serves the model.
    NoneServes,
    /// Backends serve it, but every one is unhealthy, breaker-open or undialable.
    NoneUsable,
}

/// Which backends a selection may consider.
#[derive(Clone, Copy, Debug, Default)]
pub struct Scope<'a> {
    /// The API key's `allowed_backends` (empty = all).
    pub allowed: &'a [String],
    /// Restrict to these names (a shim pool); `None` = every unified backend.
    pub only: Option<&'a [String]>,
}

struct Checker {
    /// The settings the task was started with (URL, health check, trusted CA certificates); a
    /// change restarts it, so the task always probes with the backend's current client.
    key: (String, HealthCheckConfig, Vec<CertificateDer<'static>>),
    task: JoinHandle<()>,
}

/// The configured backends, swapped whole on reload.
pub struct BackendPool {
    backends: ArcSwap<Vec<Arc<Backend>>>,
    cursor: AtomicUsize,
    checkers: Mutex<HashMap<String, Checker>>,
    upstream: Upstream,
    clock: Clock,
    breaker: BreakerConfig,
}

impl BackendPool {
    pub fn new(upstream: Upstream, clock: Clock, breaker: BreakerConfig) -> Self {
        Self {
            backends: ArcSwap::from_pointee(Vec::new()),
            cursor: AtomicUsize::new(0),
            checkers: Mutex::new(HashMap::new()),
            upstream,
            clock,
            breaker,
        }
    }

    pub fn now(&self) -> Tick {
        (self.clock)()
    }

    /// The current backends, in configuration order.
    pub fn backends(&self) -> Arc<Vec<Arc<Backend>>> {
        self.backends.load_full()
    }

    pub fn get(&self, name: &str) -> Option<Arc<Backend>> {
        self.backends
            .load()
            .iter()
            .find(|b| b.name() == name)
            .cloned()
    }

    /// Replaces the backend set. A backend whose name, URL and health-check settings are
    /// unchanged keeps its health, breaker and probe task; others start fresh (healthy, closed).
    /// Must run inside a tokio runtime (it spawns probe tasks).
    pub fn reconfigure(&self, configs: &[BackendConfig]) {
        let old = self.backends.load_full();
        let mut checkers = lock(&self.checkers);
        let mut next = Vec::with_capacity(configs.len());
        for config in configs {
            let same = old.iter().find(|b| {
                b.config.name == config.name
                    && b.config.url == config.url
                    && b.config.health_check == config.health_check
            });
            let state = match same {
                Some(b) => b.state.clone(),
                None => Arc::new(BackendState {
                    healthy: AtomicBool::new(true),
                    health: Mutex::new(HealthTracker::new(thresholds(&config.health_check))),
                    breaker: Mutex::new(Breaker::new(self.breaker)),
                }),
            };
            let (target, upstream, trusted) = match self.client_for(config, &old) {
                Ok((upstream, trusted)) => (
                    Target::parse(&config.url).map_err(|e| e.to_string()),
                    upstream,
                    trusted,
                ),
                Err(error) => (Err(error), self.upstream.clone(), Vec::new()),
            };
            if let Err(error) = &target {
                warn!(backend = %config.name, %error, "A backend cannot be dialled; it is never selected.");
            }
            // Pooled connections survive a reload that keeps the backend's URL.
            let conns = match old
                .iter()
                .find(|b| b.config.name == config.name && b.config.url == config.url)
            {
                Some(kept) if target.is_ok() => kept.conns.clone(),
                _ => target.as_ref().ok().and_then(|t| upstream.conn_pool(t)),
            };
            next.push(Arc::new(Backend {
                config: config.clone(),
                target,
                state,
                upstream,
                conns,
                trusted,
            }));
        }
        // Probe tasks follow the new set.
        let wanted: HashMap<&str, &Arc<Backend>> = next
            .iter()
            .filter(|b| b.config.enabled && b.config.health_check.enabled && b.target.is_ok())
            .map(|b| (b.name(), b))
            .collect();
        checkers.retain(|name, checker| {
            let keep = wanted.get(name.as_str()).is_some_and(|b| {
                checker.key
                    == (
                        b.config.url.clone(),
                        b.config.health_check.clone(),
                        b.trusted.clone(),
                    )
                    && same_state(&old, &next, name)
            });
            if !keep {
                checker.task.abort();
            }
            keep
        });
        for (name, backend) in wanted {
            if checkers.contains_key(name) {
                continue;
            }
            let task = tokio::spawn(probe_loop(backend.upstream.clone(), backend.clone()));
            checkers.insert(
                name.to_owned(),
                Checker {
                    key: (
                        backend.config.url.clone(),
                        backend.config.health_check.clone(),
                        backend.trusted.clone(),
                    ),
                    task,
                },
            );
        }
        self.backends.store(Arc::new(next));
    }

    /// The client for `config`: the shared one, or (with `tls.ca_cert`) one that also trusts that
    /// CA, kept from `old` when the backend's URL and TLS settings are unchanged (so its pooled
    /// connections survive a reload). The CA file is read again here, so a reload picks up a
    /// rotated file.
    fn client_for(
        &self,
        config: &BackendConfig,
        old: &[Arc<Backend>],
    ) -> Result<(Upstream, Vec<CertificateDer<'static>>), String> {
        let Some(ca) = &config.tls.ca_cert else {
            return Ok((self.upstream.clone(), Vec::new()));
        };
        let roots = super::upstream::read_ca_file(ca)?;
        if let Some(kept) = old.iter().find(|b| {
            b.config.name == config.name
                && b.config.url == config.url
                && b.config.tls == config.tls
                && b.target.is_ok()
                && b.trusted == roots
        }) {
            return Ok((kept.upstream.clone(), roots));
        }
        let upstream = self.upstream.trusting(&roots)?;
        Ok((upstream, roots))
    }

    /// Usable replicas for `model` within `scope`, rotated by the pool's round-robin cursor.
    /// Standard routing considers enabled, non-internal backends of role `unified`.
    pub fn select(&self, model: &str, scope: Scope<'_>) -> Selection {
        let now = self.now();
        let backends = self.backends.load();
        let serving: Vec<&Arc<Backend>> = backends
            .iter()
            .filter(|b| {
                let c = &b.config;
                c.enabled
                    && !c.internal
                    && c.role == BackendRole::Unified
                    && b.serves(model)
                    && (scope.allowed.is_empty() || scope.allowed.contains(&c.name))
                    && scope.only.is_none_or(|only| only.contains(&c.name))
            })
            .collect();
        if serving.is_empty() {
            return Selection::NoneServes;
        }
        let usable: Vec<Arc<Backend>> = serving
            .into_iter()
            .filter(|b| b.usable(now))
            .cloned()
            .collect();
        if usable.is_empty() {
            return Selection::NoneUsable;
        }
        let start = self.cursor.fetch_add(1, Ordering::Relaxed) % usable.len();
        let mut ordered = usable;
        ordered.rotate_left(start);
        Selection::Candidates(ordered)
    }

    /// Aborts every probe task.
    pub fn shutdown(&self) {
        for (_, checker) in lock(&self.checkers).drain() {
            checker.task.abort();
        }
    }
}

impl Drop for BackendPool {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn same_state(old: &[Arc<Backend>], next: &[Arc<Backend>], name: &str) -> bool {
    let find = |set: &[Arc<Backend>]| {
        set.iter()
            .find(|b| b.name() == name)
            .map(|b| b.state.clone())
    };
    matches!((find(old), find(next)), (Some(a), Some(b)) if Arc::ptr_eq(&a, &b))
}

fn thresholds(hc: &HealthCheckConfig) -> HealthThresholds {
    HealthThresholds {
        unhealthy: hc.unhealthy_threshold,
        healthy: hc.healthy_threshold,
    }
}

/// Probes one backend forever: GET `health_check.path`, 2xx within the timeout passes.
async fn probe_loop(upstream: Upstream, backend: Arc<Backend>) {
    let hc = backend.config.health_check.clone();
    let Ok(target) = backend.target.clone() else {
        return;
    };
    let uri = match target.uri(&hc.path) {
        Ok(uri) => uri,
        Err(error) => {
            warn!(backend = %backend.name(), %error, "The health-check path is not a valid URI; not probing.");
            return;
        }
    };
    let mut interval = tokio::time::interval(hc.interval.0.max(MIN_HEALTH_INTERVAL));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        let passed = probe(&upstream, &uri, hc.timeout.0).await;
        let transition = lock(&backend.state.health).record(passed);
        match transition {
            Some(HealthTransition::BecameUnhealthy) => {
                backend.state.healthy.store(false, Ordering::Release);
                warn!(backend = %backend.name(), "Marked a backend unhealthy after failed health checks.");
            }
            Some(HealthTransition::BecameHealthy) => {
                backend.state.healthy.store(true, Ordering::Release);
                info!(backend = %backend.name(), "Marked a backend healthy again.");
            }
            None => {}
        }
    }
}

async fn probe(upstream: &Upstream, uri: &axum::http::Uri, timeout: Duration) -> bool {
    let Ok(req) = Request::builder()
        .method(Method::GET)
        .uri(uri.clone())
        .body(Full::new(Bytes::new()))
    else {
        return false;
    };
    let exchange = async {
        let resp = upstream.send(req, timeout).await.ok()?;
        let ok = resp.status().is_success();
        // Drain a bounded body so the pooled connection can be reused.
        collect_bounded(resp.into_body(), MAX_HEALTH_BODY_BYTES)
            .await
            .ok()?;
        Some(ok)
    };
    matches!(
        tokio::time::timeout(timeout, exchange).await,
        Ok(Some(true))
    )
}
