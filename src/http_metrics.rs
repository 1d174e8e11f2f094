//! The front door's HTTP families: `continuum_http_requests_total{route, status_class}` and
//! `continuum_http_request_duration_seconds{route}`. They live with the HTTP surface that counts
//! them (the actors crate knows nothing of routes); [`HttpMetrics::register`] adds them to the
//! daemon's one Prometheus registry (`continuum_actors::metrics::Metrics::registry`), so
//! `GET /metrics` renders them with every other family.

use std::time::Duration;

use std::sync::{Arc, OnceLock};

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry,
};

/// `continuum_http_request_duration_seconds` buckets: 5 ms to 2 min (LLM answers are slow).
const DURATION_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// The `route` label: matched routes only, never the raw path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum HttpRoute {
    ChatCompletions,
    Completions,
    Models,
    /// `/v1/messages` and `/anthropic/v1/messages`.
    Messages,
    /// `/v1/responses` and `/v1/responses/compact`.
    Responses,
    Health,
    Ready,
    Metrics,
    AdminDynamoWorkers,
    /// Any other admin route.
    Admin,
    /// No route matched (404 from the fallback).
    Unmatched,
}

impl HttpRoute {
    /// Every value, in declaration order.
    pub const ALL: &'static [HttpRoute] = &[
        HttpRoute::ChatCompletions,
        HttpRoute::Completions,
        HttpRoute::Models,
        HttpRoute::Messages,
        HttpRoute::Responses,
        HttpRoute::Health,
        HttpRoute::Ready,
        HttpRoute::Metrics,
        HttpRoute::AdminDynamoWorkers,
        HttpRoute::Admin,
        HttpRoute::Unmatched,
    ];

    /// The Prometheus label value.
    pub const fn as_label(self) -> &'static str {
        match self {
            HttpRoute::ChatCompletions => "chat_completions",
            HttpRoute::Completions => "completions",
            HttpRoute::Models => "models",
            HttpRoute::Messages => "messages",
            HttpRoute::Responses => "responses",
            HttpRoute::Health => "health",
            HttpRoute::Ready => "ready",
            HttpRoute::Metrics => "metrics",
            HttpRoute::AdminDynamoWorkers => "admin_dynamo_workers",
            HttpRoute::Admin => "admin",
            HttpRoute::Unmatched => "unmatched",
        }
    }
}

/// The `status_class` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum StatusClass {
    Informational,
    Success,
    Redirection,
    ClientError,
    ServerError,
}

impl StatusClass {
    /// Every value, in declaration order.
    pub const ALL: &'static [StatusClass] = &[
        StatusClass::Informational,
        StatusClass::Success,
        StatusClass::Redirection,
        StatusClass::ClientError,
        StatusClass::ServerError,
    ];

    /// The Prometheus label value.
    pub const fn as_label(self) -> &'static str {
        match self {
            StatusClass::Informational => "1xx",
            StatusClass::Success => "2xx",
            StatusClass::Redirection => "3xx",
            StatusClass::ClientError => "4xx",
            StatusClass::ServerError => "5xx",
        }
    }

    /// The class of an HTTP status code. Codes outside 100..=599 (which `http::StatusCode`
    /// allows up to 999) count as server errors: the router never emits them deliberately.
    pub const fn from_code(code: u16) -> Self {
        match code {
            100..=199 => Self::Informational,
            200..=299 => Self::Success,
            300..=399 => Self::Redirection,
            400..=499 => Self::ClientError,
            _ => Self::ServerError,
        }
    }
}

/// The two HTTP families, registered once per registry. Cheap to clone.
#[derive(Clone, Debug)]
pub struct HttpMetrics {
    duration: HistogramVec,
    /// Every `(route, status_class)` counter, resolved once at registration and indexed by
    /// [`series`]: counting a request does not hash label values.
    counters: Arc<[IntCounter]>,
    /// Each route's duration series, resolved at its first observation (a route that never
    /// observes a duration exposes no series, as before).
    durations: Arc<[OnceLock<Histogram>]>,
}

/// The index of `(route, class)` in [`HttpMetrics::counters`].
fn series(route: HttpRoute, class: StatusClass) -> usize {
    route as usize * StatusClass::ALL.len() + class as usize
}

impl HttpMetrics {
    /// Registers both families in `registry`, every `(route, status_class)` series at 0.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let requests = IntCounterVec::new(
            Opts::new(
                "continuum_http_requests_total",
                "HTTP requests answered, by matched route and status class.",
            ),
            &["route", "status_class"],
        )?;
        let duration = HistogramVec::new(
            HistogramOpts::new(
                "continuum_http_request_duration_seconds",
                "Time from request to response headers on the OpenAI routes, by route.",
            )
            .buckets(DURATION_BUCKETS.to_vec()),
            &["route"],
        )?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(duration.clone()))?;
        let mut counters = Vec::with_capacity(HttpRoute::ALL.len() * StatusClass::ALL.len());
        for route in HttpRoute::ALL {
            for class in StatusClass::ALL {
                debug_assert_eq!(counters.len(), series(*route, *class));
                counters.push(requests.with_label_values(&[route.as_label(), class.as_label()]));
            }
        }
        let durations = HttpRoute::ALL.iter().map(|_| OnceLock::new()).collect();
        Ok(Self {
            duration,
            counters: counters.into(),
            durations,
        })
    }

    /// Counts one answered request of `route`.
    pub fn request(&self, route: HttpRoute, status: u16) {
        self.counters[series(route, StatusClass::from_code(status))].inc();
    }

    /// [`HttpMetrics::request`] plus the time to response headers.
    pub fn request_timed(&self, route: HttpRoute, status: u16, elapsed: Duration) {
        self.request(route, status);
        self.durations[route as usize]
            .get_or_init(|| self.duration.with_label_values(&[route.as_label()]))
            .observe(elapsed.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use prometheus::{Encoder, TextEncoder};

    use super::*;

    fn render(registry: &Registry) -> String {
        let mut buffer = Vec::new();
        TextEncoder::new()
            .encode(&registry.gather(), &mut buffer)
            .expect("encode");
        String::from_utf8(buffer).expect("utf-8")
    }

    #[test]
    fn labels_are_a_closed_set_spelled_once() {
        let routes: BTreeSet<_> = HttpRoute::ALL.iter().map(|r| r.as_label()).collect();
        assert_eq!(routes.len(), HttpRoute::ALL.len());
        let classes: BTreeSet<_> = StatusClass::ALL.iter().map(|c| c.as_label()).collect();
        assert_eq!(classes.len(), StatusClass::ALL.len());
        assert_eq!(StatusClass::from_code(204), StatusClass::Success);
        assert_eq!(StatusClass::from_code(429), StatusClass::ClientError);
        assert_eq!(StatusClass::from_code(503), StatusClass::ServerError);
        assert_eq!(StatusClass::from_code(999), StatusClass::ServerError);
        assert_eq!(StatusClass::from_code(101), StatusClass::Informational);
        // The resolved series are indexed by the enums' order.
        for (i, route) in HttpRoute::ALL.iter().enumerate() {
            assert_eq!(*route as usize, i);
        }
        for (i, class) in StatusClass::ALL.iter().enumerate() {
            assert_eq!(*class as usize, i);
        }
    }

    #[test]
    fn both_families_export_preinitialised_and_count_by_class() {
        let registry = Registry::new();
        let http = HttpMetrics::register(&registry).expect("register");
        let text = render(&registry);
        assert!(text.contains("# TYPE continuum_http_requests_total counter"));
        assert!(
            text.contains(r#"continuum_http_requests_total{route="health",status_class="5xx"} 0"#)
        );
        http.request(HttpRoute::ChatCompletions, 503);
        http.request_timed(HttpRoute::ChatCompletions, 200, Duration::from_millis(30));
        let text = render(&registry);
        assert!(text.contains(
            r#"continuum_http_requests_total{route="chat_completions",status_class="5xx"} 1"#
        ));
        assert!(text.contains(
            r#"continuum_http_requests_total{route="chat_completions",status_class="2xx"} 1"#
        ));
        assert!(text.contains(
            r#"continuum_http_request_duration_seconds_bucket{route="chat_completions",le="0.05"} 1"#
        ));
        assert!(text.contains(
            r#"continuum_http_request_duration_seconds_bucket{route="chat_completions",le="0.025"} 0"#
        ));
        assert!(
            HttpMetrics::register(&registry).is_err(),
            "a registry takes the families once"
        );
    }
}
