//! What one proxied request's metric updates cost: the native Prometheus collectors the router
//! uses today against `opentelemetry` SDK instruments read by the `opentelemetry-prometheus`
//! exporter (issue 30 item 3: the instruments may replace the collectors only if that costs
//! ≤ 1 µs per proxied request).
//!
//! One "request" is what a KV-routed request on the Dynamo shim path updates with the default
//! config (admission off):
//!
//! - `continuum_http_requests_total{route, status_class}` (+1) and
//!   `continuum_http_request_duration_seconds{route}` (one observation);
//! - `disaggregated_requests_total{routing_path}` (+1);
//! - `continuum_dynamo_selection_total{role, reason}` (+1 for decode, +1 for prefill);
//! - `continuum_dynamo_kv_selection_total{result}` (+1).
//!
//! With `admission` configured (a `busy_threshold` set; off by default) a request also observes
//! `continuum_admission_wait_seconds{outcome, class}` once: the second figure.
//!
//! `native` makes the calls the router makes (the HTTP counter and histogram resolved once, the
//! others through `with_label_values`); `otel` makes the same updates through `Counter::add` and
//! `Histogram::record` with static `KeyValue` attributes on an `SdkMeterProvider` whose reader is
//! the Prometheus exporter (the SDK has no bound instruments: every update looks its attribute
//! set up). Both export into a registry that is scraped once before timing, so every series
//! exists. Single thread; plain timed loops, the median of `RUNS` runs of `BATCH` requests each,
//! no criterion.
//!
//! `cargo bench -p continuum-actors --no-default-features --bench metrics`

use std::hint::black_box;
use std::sync::OnceLock;
use std::time::Instant;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram, MeterProvider as _};
use opentelemetry_sdk::metrics::SdkMeterProvider;
use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry, TextEncoder,
};

const RUNS: usize = 51;
const BATCH: u32 = 20_000;
const BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
/// The labels one request carries: (route, status_class), routing_path, the two selection
/// reasons, the KV result.
const ROUTE: &str = "chat_completions";
const CLASS: &str = "2xx";
const PATH: &str = "disaggregated";
const DECODE_REASON: &str = "kv_overlap";
const PREFILL_REASON: &str = "load_based";
const KV_RESULT: &str = "overlap";

struct Native {
    http_requests: IntCounter,
    http_duration_vec: HistogramVec,
    http_duration: OnceLock<prometheus::Histogram>,
    disaggregated: IntCounterVec,
    selection: IntCounterVec,
    kv_selection: IntCounterVec,
    admission_wait: HistogramVec,
}

impl Native {
    fn new(registry: &Registry) -> Self {
        let requests = IntCounterVec::new(
            Opts::new("continuum_http_requests_total", "h"),
            &["route", "status_class"],
        )
        .expect("family");
        let duration = HistogramVec::new(
            HistogramOpts::new("continuum_http_request_duration_seconds", "h")
                .buckets(BUCKETS.to_vec()),
            &["route"],
        )
        .expect("family");
        let disaggregated = IntCounterVec::new(
            Opts::new("disaggregated_requests_total", "h"),
            &["routing_path"],
        )
        .expect("family");
        let selection = IntCounterVec::new(
            Opts::new("continuum_dynamo_selection_total", "h"),
            &["role", "reason"],
        )
        .expect("family");
        let kv_selection = IntCounterVec::new(
            Opts::new("continuum_dynamo_kv_selection_total", "h"),
            &["result"],
        )
        .expect("family");
        let admission_wait = HistogramVec::new(
            HistogramOpts::new("continuum_admission_wait_seconds", "h").buckets(BUCKETS.to_vec()),
            &["outcome", "class"],
        )
        .expect("family");
        for family in [&requests, &disaggregated, &selection, &kv_selection] {
            registry.register(Box::new(family.clone())).expect("once");
        }
        for family in [&duration, &admission_wait] {
            registry.register(Box::new(family.clone())).expect("once");
        }
        Self {
            http_requests: requests.with_label_values(&[ROUTE, CLASS]),
            http_duration_vec: duration,
            http_duration: OnceLock::new(),
            disaggregated,
            selection,
            kv_selection,
            admission_wait,
        }
    }

    fn admitted(&self, waited: f64) {
        self.admission_wait
            .with_label_values(&["dispatched", "default"])
            .observe(waited);
    }

    fn request(&self, elapsed: f64) {
        self.http_requests.inc();
        self.http_duration
            .get_or_init(|| self.http_duration_vec.with_label_values(&[ROUTE]))
            .observe(elapsed);
        self.disaggregated.with_label_values(&[PATH]).inc();
        self.selection
            .with_label_values(&["decode", DECODE_REASON])
            .inc();
        self.selection
            .with_label_values(&["prefill", PREFILL_REASON])
            .inc();
        self.kv_selection.with_label_values(&[KV_RESULT]).inc();
    }
}

struct Otel {
    _provider: SdkMeterProvider,
    http_requests: Counter<u64>,
    http_duration: Histogram<f64>,
    disaggregated: Counter<u64>,
    selection: Counter<u64>,
    kv_selection: Counter<u64>,
    admission_wait: Histogram<f64>,
}

impl Otel {
    fn new(registry: &Registry) -> Self {
        let exporter = opentelemetry_prometheus::exporter()
            .with_registry(registry.clone())
            .scope_info_enabled(false)
            .without_target_info()
            .build()
            .expect("exporter");
        let provider = SdkMeterProvider::builder().with_reader(exporter).build();
        let meter = provider.meter("continuum-router");
        Self {
            http_requests: meter.u64_counter("continuum_http_requests").build(),
            http_duration: meter
                .f64_histogram("continuum_http_request_duration_seconds")
                .with_boundaries(BUCKETS.to_vec())
                .build(),
            disaggregated: meter.u64_counter("disaggregated_requests").build(),
            selection: meter.u64_counter("continuum_dynamo_selection").build(),
            kv_selection: meter.u64_counter("continuum_dynamo_kv_selection").build(),
            admission_wait: meter
                .f64_histogram("continuum_admission_wait_seconds")
                .with_boundaries(BUCKETS.to_vec())
                .build(),
            _provider: provider,
        }
    }

    fn admitted(&self, waited: f64) {
        self.admission_wait.record(
            waited,
            &[
                KeyValue::new("outcome", "dispatched"),
                KeyValue::new("class", "default"),
            ],
        );
    }

    fn request(&self, elapsed: f64) {
        self.http_requests.add(
            1,
            &[
                KeyValue::new("route", ROUTE),
                KeyValue::new("status_class", CLASS),
            ],
        );
        self.http_duration
            .record(elapsed, &[KeyValue::new("route", ROUTE)]);
        self.disaggregated
            .add(1, &[KeyValue::new("routing_path", PATH)]);
        self.selection.add(
            1,
            &[
                KeyValue::new("role", "decode"),
                KeyValue::new("reason", DECODE_REASON),
            ],
        );
        self.selection.add(
            1,
            &[
                KeyValue::new("role", "prefill"),
                KeyValue::new("reason", PREFILL_REASON),
            ],
        );
        self.kv_selection
            .add(1, &[KeyValue::new("result", KV_RESULT)]);
    }
}

fn scrape(registry: &Registry) -> usize {
    let mut text = String::new();
    TextEncoder::new()
        .encode_utf8(&registry.gather(), &mut text)
        .expect("encode");
    text.len()
}

/// The median ns per request over `RUNS` runs of `BATCH` requests.
fn time(request: impl Fn(f64)) -> f64 {
    // Warm up: every series exists and the caches are hot.
    for i in 0..BATCH {
        request(black_box(f64::from(i % 100) * 0.001));
    }
    let mut runs: Vec<f64> = (0..RUNS)
        .map(|_| {
            let start = Instant::now();
            for i in 0..BATCH {
                request(black_box(f64::from(i % 100) * 0.001));
            }
            start.elapsed().as_nanos() as f64 / f64::from(BATCH)
        })
        .collect();
    runs.sort_by(f64::total_cmp);
    runs[RUNS / 2]
}

fn main() {
    let native_registry = Registry::new();
    let native = Native::new(&native_registry);
    native.request(0.01);
    native.admitted(0.01);
    let otel_registry = Registry::new();
    let otel = Otel::new(&otel_registry);
    otel.request(0.01);
    otel.admitted(0.01);
    // Both exports carry the six series (a scrape before timing, as a running router has).
    assert!(scrape(&native_registry) > 0 && scrape(&otel_registry) > 0);

    // Alternate so drift on a shared machine hits both alike; report the best of three medians.
    let (mut native_ns, mut otel_ns) = (f64::MAX, f64::MAX);
    let (mut native_adm, mut otel_adm) = (f64::MAX, f64::MAX);
    for _ in 0..3 {
        native_ns = native_ns.min(time(|e| native.request(e)));
        otel_ns = otel_ns.min(time(|e| otel.request(e)));
        native_adm = native_adm.min(time(|e| {
            native.request(e);
            native.admitted(e);
        }));
        otel_adm = otel_adm.min(time(|e| {
            otel.request(e);
            otel.admitted(e);
        }));
    }
    report(
        "one proxied request, admission off (6 updates: 5 counters, 1 histogram)",
        native_ns,
        otel_ns,
    );
    report(
        "one proxied request, admission on (7 updates: 5 counters, 2 histograms)",
        native_adm,
        otel_adm,
    );
}

fn report(what: &str, native_ns: f64, otel_ns: f64) {
    println!("metric updates of {what}");
    println!("  native prometheus collectors   {native_ns:>8.1} ns/request");
    println!("  opentelemetry instruments      {otel_ns:>8.1} ns/request (goal: <= 1,000 ns)");
    println!(
        "  opentelemetry - native         {:>8.1} ns/request",
        otel_ns - native_ns
    );
}
