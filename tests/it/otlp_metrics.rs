//! The OTLP metrics push (`telemetry.otlp.metrics_interval`) end to end: a daemon pushes the
//! families `/metrics` serves to a real OTLP/gRPC receiver on loopback, under the labels it
//! serves, and counts its exports; without the key nothing is pushed.

use crate::support::otlp::OtlpReceiver;

use std::time::Duration;

use continuum_actors::memory_source::MemoryDiscovery;
use continuum_router::config::{Config, ProcessEnv};
use continuum_router::daemon::{Daemon, RunOptions};
use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::metrics::v1::{metric, number_data_point};
use tokio::net::TcpListener;

const WAIT: Duration = Duration::from_secs(30);

async fn start(endpoint: &str, service: &str, interval: Option<&str>) -> Daemon {
    let push = interval.map_or(String::new(), |i| format!("\n    metrics_interval: {i}"));
    let text = format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\n\
         telemetry:\n  service_name: {service}\n  otlp:\n    endpoint: \"{endpoint}\"{push}\n"
    );
    let config = Config::from_yaml_str(&text, &ProcessEnv).expect("parses");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let options = RunOptions {
        config,
        config_path: None,
        demo: false,
    };
    Daemon::start_with_feed(options, listener, MemoryDiscovery::new())
        .await
        .expect("starts")
}

/// The value of gauge or sum `name`'s first point in `export` whose attributes include `label`.
fn value(export: &ExportMetricsServiceRequest, name: &str, label: (&str, &str)) -> Option<f64> {
    let scope = export.resource_metrics.first()?.scope_metrics.first()?;
    let metric = scope.metrics.iter().find(|m| m.name == name)?;
    let points = match metric.data.as_ref()? {
        metric::Data::Sum(sum) => &sum.data_points,
        metric::Data::Gauge(gauge) => &gauge.data_points,
        _ => return None,
    };
    points
        .iter()
        .find(|p| {
            p.attributes.iter().any(|kv| {
                kv.key == label.0
                    && matches!(
                        kv.value.as_ref().and_then(|v| v.value.as_ref()),
                        Some(opentelemetry_proto::tonic::common::v1::any_value::Value::StringValue(s)) if s == label.1
                    )
            })
        })
        .and_then(|p| match p.value {
            Some(number_data_point::Value::AsDouble(v)) => Some(v),
            Some(number_data_point::Value::AsInt(v)) => Some(v as f64),
            None => None,
        })
}

fn service_of(export: &ExportMetricsServiceRequest) -> String {
    export
        .resource_metrics
        .iter()
        .filter_map(|r| r.resource.as_ref())
        .flat_map(|r| &r.attributes)
        .find(|kv| kv.key == "service.name")
        .map(|kv| format!("{:?}", kv.value))
        .unwrap_or_default()
}

/// Two daemons share one collector: the one with `metrics_interval` pushes (its second export
/// carries the first one's success), the one without never does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_pushes_its_metrics_families_and_counts_the_exports() {
    let receiver = OtlpReceiver::start().await.expect("receiver");
    let quiet = start(&receiver.endpoint(), "otlp-metrics-off", None).await;
    let daemon = start(&receiver.endpoint(), "otlp-metrics-on", Some("1s")).await;
    let exports = receiver
        .wait_for_metrics(
            |exports| {
                exports.iter().any(|e| {
                    value(e, "continuum_otlp_metric_exports", ("result", "ok")) >= Some(1.0)
                })
            },
            WAIT,
        )
        .await
        .unwrap_or_else(|| panic!("no second export: {:?}", receiver.metric_exports().len()));
    assert!(exports.len() >= 2);
    for export in &exports {
        assert!(
            service_of(export).contains("otlp-metrics-on"),
            "only the daemon with metrics_interval pushes: {}",
            service_of(export)
        );
    }
    let last = exports.last().expect("an export");
    // The same family `/metrics` serves, under the same labels.
    let build = continuum_router::build_info::VERSION;
    assert_eq!(
        value(last, "continuum_router_build_info", ("version", build)),
        Some(1.0)
    );
    daemon.shutdown().await;
    quiet.shutdown().await;
}
