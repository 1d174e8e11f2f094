//! The real trace pipeline end to end: tracing → tracing-opentelemetry → OTLP/gRPC → a receiver
//! on loopback, checking that an actor restart arrives as supervisor → restart → new incarnation.
//!
//! The actor tree is simulated with the `continuum_actors::lifecycle` helpers on plain spans;
//! a test driving the real ractor supervision tree can reuse `support::otlp` the same way.
//! Multi-thread runtime: the SDK's batch processor blocks its own thread on the tonic channel,
//! whose connection task must keep running on the runtime meanwhile.

use crate::support;

use std::time::{Duration, Instant};

use continuum_actors::lifecycle::{ActorKind, ActorSpan};
use continuum_router::telemetry::{self, LogFormat, TelemetryOptions};
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use support::otlp::{OtlpReceiver, one};
use tracing_subscriber::fmt::TestWriter;

const WAIT: Duration = Duration::from_secs(20);

fn options(endpoint: String) -> TelemetryOptions {
    TelemetryOptions {
        log_format: LogFormat::Text,
        // The lifecycle spans are at info; the debug span below must be filtered out of export.
        log_level: "info".to_owned(),
        service_name: "continuum-router-otlp-test".to_owned(),
        otlp_endpoint: Some(endpoint),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actor_restart_arrives_as_supervisor_restart_incarnation_chain() {
    let receiver = OtlpReceiver::start().await.expect("bind loopback");
    let (subscriber, guard) =
        telemetry::subscriber_with_writer(&options(receiver.endpoint()), TestWriter::new())
            .expect("telemetry layers");

    {
        // Scoped to this thread: spans are created and ended here, before the flush below.
        let _default = tracing::subscriber::set_default(subscriber);
        let root = ActorSpan::start("root", ActorKind::Root, None);
        let supervisor = ActorSpan::start("discovery", ActorKind::DiscoverySupervisor, Some(&root));
        let child = ActorSpan::start("discovery/dynamo", ActorKind::Discovery, Some(&supervisor));
        child.started();
        child.failed(&"etcd watch stream ended");
        let restart = supervisor.restart(&child, 1, Duration::from_millis(800));
        drop(child);
        let next = restart.start_incarnation();
        drop(restart);
        next.started();
        tracing::debug_span!(parent: next.span(), "hidden.debug.span").in_scope(|| {});
        next.stopped("shutdown");
        drop(next);
        supervisor.stopped("shutdown");
        drop(supervisor);
        drop(root);
    }
    guard.force_flush().await.expect("flush to the receiver");

    let spans = receiver
        .wait_for(
            |spans| {
                spans
                    .iter()
                    .filter(|s| s.name().starts_with("actor"))
                    .count()
                    >= 5
            },
            WAIT,
        )
        .await
        .expect("five lifecycle spans");

    let root = one(&spans, "actor", &[("actor.kind", "root")]);
    let supervisor = one(&spans, "actor", &[("actor.kind", "discovery_supervisor")]);
    let first = one(
        &spans,
        "actor",
        &[("actor.kind", "discovery"), ("actor.incarnation", "1")],
    );
    let restart = one(&spans, "actor.restart", &[("actor.id", "discovery/dynamo")]);
    let second = one(
        &spans,
        "actor",
        &[("actor.kind", "discovery"), ("actor.incarnation", "2")],
    );

    // Parent/child by span ids: root → supervisor → {first incarnation, restart → second}.
    assert_eq!(root.parent_span_id(), "", "the root actor starts the trace");
    assert!(supervisor.is_child_of(root));
    assert!(first.is_child_of(supervisor));
    assert!(restart.is_child_of(supervisor));
    assert!(second.is_child_of(restart));
    assert!(!second.is_child_of(first));
    assert_eq!(restart.linked_span_ids(), vec![first.span_id()]);
    for span in [root, supervisor, first, restart, second] {
        assert_eq!(span.trace_id(), root.trace_id(), "one trace");
        assert_eq!(
            span.resource_attr("service.name").as_deref(),
            Some("continuum-router-otlp-test")
        );
    }

    // Attributes.
    assert_eq!(supervisor.attr("actor.parent").as_deref(), Some("root"));
    assert_eq!(first.attr("actor.id").as_deref(), Some("discovery/dynamo"));
    assert_eq!(first.attr("actor.parent").as_deref(), Some("discovery"));
    assert_eq!(second.attr("actor.parent").as_deref(), Some("discovery"));
    assert_eq!(restart.attr("actor.kind").as_deref(), Some("discovery"));
    assert_eq!(restart.attr_i64("attempt"), Some(1));
    assert_eq!(restart.attr_i64("delay_ms"), Some(800));

    // Lifecycle events and status.
    assert_eq!(first.event_names(), ["actor.started", "actor.failed"]);
    assert_eq!(
        first.event_attr("actor.failed", "error").as_deref(),
        Some("etcd watch stream ended")
    );
    assert_eq!(first.status_code(), StatusCode::Error);
    assert_eq!(second.event_names(), ["actor.started", "actor.stopped"]);
    assert_eq!(
        second.event_attr("actor.stopped", "reason").as_deref(),
        Some("shutdown")
    );
    assert_eq!(second.status_code(), StatusCode::Unset);

    // The flush above completed the export, so the filtered debug span would be here by now.
    assert!(
        spans.iter().all(|s| s.name() != "hidden.debug.span"),
        "the log filter also filters export"
    );

    guard.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_collector_neither_fails_nor_blocks() {
    // A port that was free a moment ago: connections to it are refused.
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("addr")
    };
    let (subscriber, guard) =
        telemetry::subscriber_with_writer(&options(format!("http://{closed}")), TestWriter::new())
            .expect("lazy exporter builds");
    {
        let _default = tracing::subscriber::set_default(subscriber);
        let actor = ActorSpan::start("root", ActorKind::Root, None);
        actor.started();
    }
    let started = Instant::now();
    // Both must return within the bound; their Result only reports the failed export.
    let flushed = tokio::time::timeout(WAIT, guard.force_flush()).await;
    assert!(flushed.is_ok(), "force_flush returned within {WAIT:?}");
    let shut = tokio::time::timeout(WAIT, guard.shutdown()).await;
    assert!(shut.is_ok(), "shutdown returned within {WAIT:?}");
    eprintln!(
        "no-collector flush + shutdown took {:?} (flush {:?}, shutdown {:?})",
        started.elapsed(),
        flushed.ok(),
        shut.ok()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_endpoint_no_exporter_is_built() {
    let options = TelemetryOptions {
        otlp_endpoint: None,
        ..TelemetryOptions::default()
    };
    let (_subscriber, guard) = telemetry::subscriber(&options).expect("log-only layers");
    assert!(guard.tracer_provider().is_none());
    guard.shutdown().await.expect("nothing to flush");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_endpoint_is_a_config_error() {
    let error = telemetry::subscriber(&options("not a uri at all".to_owned()))
        .err()
        .expect("refused");
    assert!(
        matches!(error, telemetry::TelemetryError::Exporter { .. }),
        "{error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_installs_the_global_subscriber_once() {
    // Installs the global subscriber: in a process of its own.
    if !support::process::own_process(module_path!(), "init_installs_the_global_subscriber_once") {
        return;
    }
    // The only test here that touches the global subscriber; the others scope theirs.
    let options = TelemetryOptions::default();
    let guard = telemetry::init_with_writer(&options, TestWriter::new()).expect("first install");
    let again = telemetry::init_with_writer(&options, TestWriter::new())
        .expect_err("second install refused");
    assert!(
        matches!(again, telemetry::TelemetryError::AlreadyInstalled(_)),
        "{again}"
    );
    guard.shutdown().await.expect("log-only shutdown");
}
