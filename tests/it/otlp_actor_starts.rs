//! Actor starts are visible in a trace backend while the actors run: a real daemon exports to a
//! real OTLP/gRPC receiver on loopback, and every actor of its tree has an `actor.start` span
//! there within 5 s of `/ready`, while none of them has stopped (the long-lived `actor` spans are
//! not exported yet). Before the fix the start was only an event on the lifecycle span, exported
//! when the actor ended (restart or shutdown; never after SIGKILL).
//!
//! Its own test binary: it installs the global subscriber.

use crate::support;

use std::collections::BTreeSet;
use std::time::Duration;

use continuum_router::telemetry::{self, LogFormat, TelemetryOptions};
use support::otlp::OtlpReceiver;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_actor_start_is_exported_while_the_tree_runs() {
    // Installs the global subscriber: in a process of its own.
    if !support::process::own_process(
        module_path!(),
        "every_actor_start_is_exported_while_the_tree_runs",
    ) {
        return;
    }
    let receiver = OtlpReceiver::start().await.expect("bind loopback");
    let guard = telemetry::init(&TelemetryOptions {
        log_format: LogFormat::Text,
        log_level: "info".to_owned(),
        service_name: "continuum-router-start-test".to_owned(),
        otlp_endpoint: Some(receiver.endpoint()),
    })
    .expect("telemetry installs");
    let daemon = support::daemon::start(
        "server:\n  bind_address: \"127.0.0.1:0\"\ndynamo:\n  enabled: false\n",
    )
    .await;
    let ready = reqwest::get(format!("http://{}/ready", daemon.local_addr()))
        .await
        .expect("ready");
    assert_eq!(ready.status(), 200);

    let actors: BTreeSet<String> = daemon.tree().list().into_iter().map(|a| a.id).collect();
    assert!(actors.len() >= 5, "{actors:?}");
    let started = |spans: &[support::otlp::ReceivedSpan]| -> BTreeSet<String> {
        spans
            .iter()
            .filter(|s| s.name() == "actor.start")
            .filter_map(|s| s.attr("actor.id"))
            .collect()
    };
    let spans = receiver
        .wait_for(
            |spans| actors.is_subset(&started(spans)),
            Duration::from_secs(5),
        )
        .await
        .unwrap_or_else(|timeout| {
            panic!(
                "actor starts missing within 5 s of /ready: {:?}",
                actors
                    .difference(&started(&timeout.spans))
                    .collect::<Vec<_>>()
            )
        });
    // Every actor still runs: no lifecycle span has ended, so none was exported.
    assert!(
        spans.iter().all(|s| s.name() != "actor"),
        "lifecycle spans are exported only when they end"
    );
    for actor in daemon.tree().list() {
        assert_eq!(format!("{:?}", actor.state), "Running", "{}", actor.id);
    }
    let picker = spans
        .iter()
        .find(|s| s.name() == "actor.start" && s.attr("actor.id").as_deref() == Some("root/picker"))
        .expect("picker start");
    assert_eq!(picker.attr("actor.parent").as_deref(), Some("root"));
    assert_eq!(picker.attr_i64("actor.incarnation"), Some(1));
    assert_eq!(
        picker.linked_span_ids(),
        vec![picker.parent_span_id()],
        "linked to (and child of) its lifecycle span"
    );

    daemon.shutdown().await;
    guard.shutdown().await.ok();
}
