//! The optional OTLP metrics push (`telemetry.otlp.metrics_interval`): every interval, the
//! families `/metrics` serves go to the trace collector as one OTLP/gRPC
//! `ExportMetricsServiceRequest`.
//!
//! The hot path keeps its native collectors (docs/performance.md, "Metrics": OpenTelemetry
//! instruments cost 771–857 ns per proxied request against 345–394 ns, over the 1 µs
//! budget): this task reads them off the request path, one `Registry::gather` per interval, and
//! converts them: a counter becomes a cumulative monotonic sum (its `_total` suffix dropped, as
//! OTLP names counters; a collector's Prometheus exporter adds it back), a gauge a gauge, a
//! histogram a cumulative explicit-bucket histogram, a summary a summary. `target_info` is the
//! resource, not a metric. Each export waits at most [`OTLP_EXPORT_TIMEOUT`]; an export that fails
//! or times out is counted (`continuum_otlp_metric_exports_total{result}`) and the next interval
//! sends the then-current values (cumulative, so nothing is lost but resolution).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use continuum_actors::label_enum;
use continuum_actors::metrics::{Family, Metrics, counter_vec};
use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_client::MetricsServiceClient;
use opentelemetry_proto::tonic::common::v1::{AnyValue, InstrumentationScope, KeyValue, any_value};
use opentelemetry_proto::tonic::metrics::v1::summary_data_point::ValueAtQuantile;
use opentelemetry_proto::tonic::metrics::v1::{
    AggregationTemporality, Gauge, Histogram, HistogramDataPoint, Metric, NumberDataPoint,
    ResourceMetrics, ScopeMetrics, Sum, Summary, SummaryDataPoint, metric, number_data_point,
};
use opentelemetry_proto::tonic::resource::v1::Resource;
use prometheus::IntCounterVec;
use prometheus::proto::{self as prom, MetricFamily, MetricType};
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use super::{OTLP_EXPORT_TIMEOUT, TelemetryError};

label_enum! {
    /// The `result` of `continuum_otlp_metric_exports_total{result}`.
    ExportResult {
        Ok => "ok",
        /// The collector answered with an error, or could not be reached.
        Error => "error",
        /// No answer within the export timeout.
        Timeout => "timeout",
    }
}

/// The push's own family.
pub struct MetricsPushMetrics {
    exports: IntCounterVec,
}

impl Family for MetricsPushMetrics {
    fn register(registry: &prometheus::Registry) -> Result<Self, prometheus::Error> {
        let exports = counter_vec(
            registry,
            "continuum_otlp_metric_exports_total",
            "OTLP metric exports (telemetry.otlp.metrics_interval), by result.",
            &["result"],
        )?;
        for result in ExportResult::ALL {
            exports.with_label_values(&[result.as_label()]);
        }
        Ok(Self { exports })
    }
}

impl MetricsPushMetrics {
    fn export(&self, result: ExportResult) {
        self.exports.with_label_values(&[result.as_label()]).inc();
    }
}

/// The scope the pushed metrics are exported under.
const SCOPE: &str = "continuum-router";

/// Starts the push: every `interval`, the families of `metrics` to the OTLP/gRPC collector at
/// `endpoint`. The first export is one interval after the start.
pub fn spawn(
    endpoint: &str,
    interval: Duration,
    metrics: &Metrics,
    service_name: &str,
) -> Result<JoinHandle<()>, TelemetryError> {
    let channel = tonic::transport::Endpoint::from_shared(endpoint.to_owned())
        .map_err(|error| TelemetryError::Exporter {
            endpoint: endpoint.to_owned(),
            message: error.to_string(),
        })?
        .connect_timeout(OTLP_EXPORT_TIMEOUT)
        .timeout(OTLP_EXPORT_TIMEOUT)
        .connect_lazy();
    let mut client = MetricsServiceClient::new(channel);
    let own =
        metrics
            .register::<MetricsPushMetrics>()
            .map_err(|error| TelemetryError::Exporter {
                endpoint: endpoint.to_owned(),
                message: error.to_string(),
            })?;
    let registry = metrics.registry().clone();
    let resource = resource(service_name);
    let start = unix_nanos();
    Ok(tokio::spawn(async move {
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            let request = export_request(&registry.gather(), &resource, start, unix_nanos());
            let result = match tokio::time::timeout(OTLP_EXPORT_TIMEOUT, client.export(request))
                .await
            {
                Ok(Ok(_)) => ExportResult::Ok,
                Ok(Err(status)) => {
                    warn!(code = ?status.code(), message = status.message(), "OTLP metric export failed.");
                    ExportResult::Error
                }
                Err(_) => {
                    warn!(timeout = ?OTLP_EXPORT_TIMEOUT, "OTLP metric export timed out.");
                    ExportResult::Timeout
                }
            };
            debug!(result = result.as_label(), "OTLP metric export.");
            own.export(result);
        }
    }))
}

fn unix_nanos() -> u64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    u64::try_from(since.as_nanos()).unwrap_or(u64::MAX)
}

fn text(key: &str, value: &str) -> KeyValue {
    KeyValue {
        key: key.to_owned(),
        value: Some(AnyValue {
            value: Some(any_value::Value::StringValue(value.to_owned())),
        }),
        ..KeyValue::default()
    }
}

fn resource(service_name: &str) -> Resource {
    Resource {
        attributes: vec![
            text("service.name", service_name),
            text("service.version", env!("CARGO_PKG_VERSION")),
        ],
        ..Resource::default()
    }
}

/// One export of `families`: counters cumulative since `start`, every point stamped `now`.
pub fn export_request(
    families: &[MetricFamily],
    resource: &Resource,
    start: u64,
    now: u64,
) -> ExportMetricsServiceRequest {
    let metrics = families
        .iter()
        .filter(|family| family.name() != "target_info")
        .filter_map(|family| convert(family, start, now))
        .collect();
    ExportMetricsServiceRequest {
        resource_metrics: vec![ResourceMetrics {
            resource: Some(resource.clone()),
            scope_metrics: vec![ScopeMetrics {
                scope: Some(InstrumentationScope {
                    name: SCOPE.to_owned(),
                    version: env!("CARGO_PKG_VERSION").to_owned(),
                    ..InstrumentationScope::default()
                }),
                metrics,
                schema_url: String::new(),
            }],
            schema_url: String::new(),
        }],
    }
}

fn attributes(metric: &prom::Metric) -> Vec<KeyValue> {
    metric
        .get_label()
        .iter()
        .map(|pair| text(pair.name(), pair.value()))
        .collect()
}

fn number(metric: &prom::Metric, value: f64, start: u64, now: u64) -> NumberDataPoint {
    NumberDataPoint {
        attributes: attributes(metric),
        start_time_unix_nano: start,
        time_unix_nano: now,
        value: Some(number_data_point::Value::AsDouble(value)),
        ..NumberDataPoint::default()
    }
}

/// One family as an OTLP metric (`None`: untyped, or no series).
fn convert(family: &MetricFamily, start: u64, now: u64) -> Option<Metric> {
    let series = family.get_metric();
    if series.is_empty() {
        return None;
    }
    let cumulative = AggregationTemporality::Cumulative as i32;
    let mut name = family.name();
    let data = match family.get_field_type() {
        MetricType::COUNTER => {
            name = name.strip_suffix("_total").unwrap_or(name);
            metric::Data::Sum(Sum {
                data_points: series
                    .iter()
                    .map(|m| number(m, m.get_counter().get_value(), start, now))
                    .collect(),
                aggregation_temporality: cumulative,
                is_monotonic: true,
            })
        }
        MetricType::GAUGE => metric::Data::Gauge(Gauge {
            data_points: series
                .iter()
                .map(|m| number(m, m.get_gauge().get_value(), start, now))
                .collect(),
        }),
        MetricType::HISTOGRAM => metric::Data::Histogram(Histogram {
            data_points: series.iter().map(|m| histogram(m, start, now)).collect(),
            aggregation_temporality: cumulative,
        }),
        MetricType::SUMMARY => metric::Data::Summary(Summary {
            data_points: series.iter().map(|m| summary(m, start, now)).collect(),
        }),
        MetricType::UNTYPED => return None,
    };
    Some(Metric {
        name: name.to_owned(),
        description: family.help().to_owned(),
        data: Some(data),
        ..Metric::default()
    })
}

/// Prometheus buckets are cumulative with finite upper bounds (`+Inf` is the sample count);
/// OTLP's are per bucket, with one more bucket than bounds.
fn histogram(metric: &prom::Metric, start: u64, now: u64) -> HistogramDataPoint {
    let h = metric.get_histogram();
    let count = h.get_sample_count();
    let finite: Vec<_> = h
        .get_bucket()
        .iter()
        .filter(|b| b.upper_bound().is_finite())
        .collect();
    let mut bucket_counts = Vec::with_capacity(finite.len() + 1);
    let mut below = 0u64;
    for bucket in &finite {
        let cumulative = bucket.cumulative_count().max(below);
        bucket_counts.push(cumulative - below);
        below = cumulative;
    }
    bucket_counts.push(count.saturating_sub(below));
    HistogramDataPoint {
        attributes: attributes(metric),
        start_time_unix_nano: start,
        time_unix_nano: now,
        count,
        sum: Some(h.get_sample_sum()),
        bucket_counts,
        explicit_bounds: finite.iter().map(|b| b.upper_bound()).collect(),
        ..HistogramDataPoint::default()
    }
}

fn summary(metric: &prom::Metric, start: u64, now: u64) -> SummaryDataPoint {
    let s = metric.get_summary();
    SummaryDataPoint {
        attributes: attributes(metric),
        start_time_unix_nano: start,
        time_unix_nano: now,
        count: s.sample_count(),
        sum: s.sample_sum(),
        quantile_values: s
            .get_quantile()
            .iter()
            .map(|q| ValueAtQuantile {
                quantile: q.quantile(),
                value: q.value(),
            })
            .collect(),
        ..SummaryDataPoint::default()
    }
}

#[cfg(test)]
mod tests {
    use prometheus::{HistogramOpts, HistogramVec, Registry};

    use super::*;

    fn families() -> Vec<MetricFamily> {
        let registry = Registry::new();
        let requests =
            counter_vec(&registry, "t_requests_total", "Requests.", &["code"]).expect("counter");
        requests.with_label_values(&["200"]).inc_by(3);
        let gauge = continuum_actors::metrics::gauge_vec(&registry, "t_open", "Open.", &["pool"])
            .expect("gauge");
        gauge.with_label_values(&["a"]).set(-2);
        let latency = HistogramVec::new(
            HistogramOpts::new("t_seconds", "Latency.").buckets(vec![0.1, 1.0]),
            &[],
        )
        .expect("histogram");
        registry
            .register(Box::new(latency.clone()))
            .expect("registers");
        for v in [0.05, 0.5, 0.7, 5.0] {
            latency.with_label_values(&[] as &[&str]).observe(v);
        }
        let info = continuum_actors::metrics::gauge_vec(&registry, "target_info", "Info.", &["k"])
            .expect("gauge");
        info.with_label_values(&["v"]).set(1);
        registry.gather()
    }

    fn find<'a>(request: &'a ExportMetricsServiceRequest, name: &str) -> Option<&'a Metric> {
        request.resource_metrics[0].scope_metrics[0]
            .metrics
            .iter()
            .find(|m| m.name == name)
    }

    #[test]
    fn families_become_otlp_metrics_with_the_same_series() {
        let request = export_request(&families(), &resource("svc"), 10, 20);
        let resource = request.resource_metrics[0]
            .resource
            .as_ref()
            .expect("resource");
        assert_eq!(resource.attributes[0], text("service.name", "svc"));
        assert!(
            find(&request, "target_info").is_none(),
            "the resource, not a metric"
        );

        let Some(metric::Data::Sum(sum)) =
            find(&request, "t_requests").and_then(|m| m.data.clone())
        else {
            panic!("a counter is a sum named without _total");
        };
        assert!(sum.is_monotonic);
        assert_eq!(
            sum.aggregation_temporality,
            AggregationTemporality::Cumulative as i32
        );
        let point = &sum.data_points[0];
        assert_eq!(point.attributes, vec![text("code", "200")]);
        assert_eq!((point.start_time_unix_nano, point.time_unix_nano), (10, 20));
        assert_eq!(point.value, Some(number_data_point::Value::AsDouble(3.0)));

        let Some(metric::Data::Gauge(gauge)) =
            find(&request, "t_open").and_then(|m| m.data.clone())
        else {
            panic!("a gauge");
        };
        assert_eq!(
            gauge.data_points[0].value,
            Some(number_data_point::Value::AsDouble(-2.0))
        );

        let Some(metric::Data::Histogram(histogram)) =
            find(&request, "t_seconds").and_then(|m| m.data.clone())
        else {
            panic!("a histogram");
        };
        let point = &histogram.data_points[0];
        assert_eq!(point.explicit_bounds, vec![0.1, 1.0]);
        // Per bucket: ≤ 0.1, (0.1, 1], (1, +Inf).
        assert_eq!(point.bucket_counts, vec![1, 2, 1]);
        assert_eq!((point.count, point.sum), (4, Some(6.25)));
    }
}
