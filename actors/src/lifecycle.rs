//! Actor lifecycle spans: the tracing shape every supervisor and actor of the tree shares.
//!
//! Each actor incarnation runs inside one span named `actor` (fields `actor.id`, `actor.kind`,
//! `actor.parent`, `actor.incarnation`) whose parent is its supervisor's span. Lifecycle
//! transitions are events on that span: `actor.started`, `actor.stopped{reason}` and
//! `actor.failed{error}` (an ERROR event, so the exported span gets an error status). Because
//! that span is exported only when it ends, each start also emits a short `actor.start` span
//! (child of, and linked to, the lifecycle span) that is exported while the actor runs.
//!
//! A restart is a span of its own, `actor.restart{attempt, delay_ms}`, child of the supervisor's
//! span and linked to the failed incarnation; the new incarnation's `actor` span is its child.
//! Over OTLP a restart therefore reads as: supervisor → actor.restart → new incarnation, by
//! parent span ids, with a span link back to the incarnation that failed.
//!
//! Spans end (and are exported) when their last clone drops: an actor's span when the actor
//! state holding it drops, a restart span when the supervisor drops the [`RestartSpan`] after
//! starting the new incarnation. Long-lived spans (the root, supervisors) are exported at
//! shutdown; a trace viewer shows their children with a pending parent until then.
//!
//! Usage from a supervisor (ractor):
//! ```text
//! let child = ActorSpan::start(&format!("discovery/{namespace}"), ActorKind::Discovery, Some(&self.span));
//! Actor::spawn_linked(None, DiscoveryActor, (child.clone(), args), myself.get_cell()).await?;
//! // in the child: pre_start/handle futures run `.instrument(child.span().clone())`,
//! // and post_start calls `child.started()`.
//! // on SupervisionEvent::ActorFailed:
//! child.failed(&error);
//! counters.actor_restart(child.kind()); // supervisor::metrics::SupervisorMetrics
//! let restart = self.span.restart(&child, attempt, delay);
//! tokio::time::sleep(delay).instrument(restart.span().clone()).await;
//! let child = restart.start_incarnation();
//! ```

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::trace::TraceContextExt as _;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use crate::label_enum;

label_enum! {
    /// The closed set of actor kinds in the supervision tree: the `actor` label of
    /// `continuum_actor_restarts_total` and the `actor.kind` span field. Instance ids (a
    /// namespace, a publisher) go into `actor.id`, never into a metric label.
    ActorKind {
        Root => "root",
        Registry => "registry",
        KvIndex => "kv_index",
        Picker => "picker",
        DiscoverySupervisor => "discovery_supervisor",
        Discovery => "discovery",
        SubscriptionSupervisor => "subscription_supervisor",
        Subscription => "subscription",
        SubscriptionFollower => "subscription_follower",
        BrokerSupervisor => "broker_supervisor",
        BrokerSession => "broker_session",
        KvPush => "kv_push",
        ReplicaSync => "replica_sync",
    }
}

/// The span of one actor incarnation, with the identity its children and restarts need.
/// Cloning shares the span; it ends when the last clone drops.
#[derive(Clone, Debug)]
pub struct ActorSpan {
    span: Span,
    id: Arc<str>,
    kind: ActorKind,
    incarnation: u32,
    /// The supervisor's `actor.id`, if any.
    parent: Option<Arc<str>>,
}

impl ActorSpan {
    /// Opens the span of an actor's first incarnation. With a `parent` (the supervisor's
    /// `ActorSpan`) the span is its child and `actor.parent` names it; without one the span
    /// takes the current span as parent (the daemon's top-level span for the root actor).
    pub fn start(id: &str, kind: ActorKind, parent: Option<&ActorSpan>) -> Self {
        let span = match parent {
            Some(parent) => tracing::info_span!(
                parent: &parent.span,
                "actor",
                actor.id = id,
                actor.kind = kind.as_label(),
                actor.parent = &*parent.id,
                actor.incarnation = 1_i64,
            ),
            None => tracing::info_span!(
                "actor",
                actor.id = id,
                actor.kind = kind.as_label(),
                actor.parent = tracing::field::Empty,
                actor.incarnation = 1_i64,
            ),
        };
        Self {
            span,
            id: Arc::from(id),
            kind,
            incarnation: 1,
            parent: parent.map(|p| Arc::clone(&p.id)),
        }
    }

    /// The tracing span: instrument the actor's futures with a clone of it.
    pub fn span(&self) -> &Span {
        &self.span
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn kind(&self) -> ActorKind {
        self.kind
    }

    /// 1 for the first incarnation, +1 per restart.
    pub fn incarnation(&self) -> u32 {
        self.incarnation
    }

    /// Records `actor.started`: `pre_start` succeeded and the actor takes messages.
    ///
    /// The event lives on the long-lived lifecycle span, which is exported only when it ends;
    /// so every start (and restart) also emits a short `actor.start` span, ended at once and
    /// exported with the next batch: a child of the lifecycle span, linked to it, carrying
    /// `actor.id`, `actor.kind`, `actor.parent` and `actor.incarnation`.
    pub fn started(&self) {
        tracing::info!(
            parent: &self.span,
            actor.id = &*self.id,
            actor.kind = self.kind.as_label(),
            "actor.started"
        );
        let start = tracing::info_span!(
            parent: &self.span,
            "actor.start",
            actor.id = &*self.id,
            actor.kind = self.kind.as_label(),
            actor.parent = tracing::field::Empty,
            actor.incarnation = i64::from(self.incarnation),
        );
        if let Some(parent) = &self.parent {
            start.record("actor.parent", &**parent);
        }
        let lifecycle = self.span.context().span().span_context().clone();
        if lifecycle.is_valid() {
            start.add_link(lifecycle);
        }
        drop(start);
    }

    /// Records `actor.stopped`: a clean stop (shutdown, a departed publisher), not a failure.
    pub fn stopped(&self, reason: &str) {
        tracing::info!(
            parent: &self.span,
            actor.id = &*self.id,
            actor.kind = self.kind.as_label(),
            reason,
            "actor.stopped"
        );
    }

    /// Records `actor.failed{error}` at ERROR on the incarnation's span, which marks the exported
    /// span as failed. The supervisor calls it on `SupervisionEvent::ActorFailed`.
    pub fn failed(&self, error: &dyn fmt::Display) {
        tracing::error!(
            parent: &self.span,
            actor.id = &*self.id,
            actor.kind = self.kind.as_label(),
            error = %error,
            "actor.failed"
        );
    }

    /// Opens the `actor.restart` span of a failed child under this (supervisor's) span. Hold the
    /// returned span over the backoff delay, then call [`RestartSpan::start_incarnation`].
    pub fn restart(&self, failed: &ActorSpan, attempt: u32, delay: Duration) -> RestartSpan {
        // tracing-opentelemetry exports unsigned fields as strings; i64 keeps them numeric.
        let delay_ms = i64::try_from(delay.as_millis()).unwrap_or(i64::MAX);
        let attempt = i64::from(attempt);
        let span = tracing::info_span!(
            parent: &self.span,
            "actor.restart",
            actor.id = &*failed.id,
            actor.kind = failed.kind.as_label(),
            actor.parent = &*self.id,
            attempt,
            delay_ms,
        );
        // The failed incarnation is not an ancestor of its successor; a link keeps the way back.
        // Without an OpenTelemetry layer the context is invalid and no link is added.
        let failed_context = failed.span.context().span().span_context().clone();
        if failed_context.is_valid() {
            span.add_link(failed_context);
        }
        RestartSpan {
            span,
            supervisor_id: Arc::clone(&self.id),
            id: Arc::clone(&failed.id),
            kind: failed.kind,
            next_incarnation: failed.incarnation.saturating_add(1),
        }
    }
}

/// A restart in progress: the span between a child's failure and its new incarnation.
#[derive(Debug)]
pub struct RestartSpan {
    span: Span,
    supervisor_id: Arc<str>,
    id: Arc<str>,
    kind: ActorKind,
    next_incarnation: u32,
}

impl RestartSpan {
    pub fn span(&self) -> &Span {
        &self.span
    }

    /// Opens the new incarnation's `actor` span as a child of this restart span.
    pub fn start_incarnation(&self) -> ActorSpan {
        let span = tracing::info_span!(
            parent: &self.span,
            "actor",
            actor.id = &*self.id,
            actor.kind = self.kind.as_label(),
            actor.parent = &*self.supervisor_id,
            actor.incarnation = i64::from(self.next_incarnation),
        );
        ActorSpan {
            span,
            id: Arc::clone(&self.id),
            kind: self.kind,
            incarnation: self.next_incarnation,
            parent: Some(Arc::clone(&self.supervisor_id)),
        }
    }
}

#[cfg(test)]
mod tests {
    use opentelemetry::trace::{SpanId, Status, TracerProvider as _};
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
    use tracing_subscriber::layer::SubscriberExt as _;

    use super::*;

    /// An attribute's value as text (OpenTelemetry string values compare by storage kind).
    fn attribute(span: &SpanData, key: &str) -> Option<String> {
        span.attributes
            .iter()
            .find(|kv| kv.key.as_str() == key)
            .map(|kv| kv.value.as_str().into_owned())
    }

    fn find<'a>(spans: &'a [SpanData], name: &str, kind: &str, incarnation: i64) -> &'a SpanData {
        spans
            .iter()
            .find(|s| {
                s.name == name
                    && attribute(s, "actor.kind").as_deref() == Some(kind)
                    && (name != "actor"
                        || attribute(s, "actor.incarnation") == Some(incarnation.to_string()))
            })
            .unwrap_or_else(|| panic!("no span {name} {kind} {incarnation} in {spans:#?}"))
    }

    /// Runs `body` under a scoped subscriber exporting to memory, and returns the ended spans.
    fn capture(body: impl FnOnce()) -> Vec<SpanData> {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("lifecycle-test")));
        tracing::subscriber::with_default(subscriber, body);
        provider.force_flush().expect("in-memory flush");
        exporter.get_finished_spans().expect("in-memory spans")
    }

    #[test]
    fn restart_chain_links_supervisor_restart_and_new_incarnation() {
        let spans = capture(|| {
            let supervisor = ActorSpan::start("discovery", ActorKind::DiscoverySupervisor, None);
            let child =
                ActorSpan::start("discovery/dynamo", ActorKind::Discovery, Some(&supervisor));
            child.started();
            child.failed(&"watch stream ended");
            let restart = supervisor.restart(&child, 1, Duration::from_millis(800));
            drop(child);
            let next = restart.start_incarnation();
            assert_eq!(next.incarnation(), 2);
            assert_eq!(next.id(), "discovery/dynamo");
            drop(restart);
            next.started();
            next.stopped("shutdown");
        });

        let supervisor = find(&spans, "actor", "discovery_supervisor", 1);
        let first = find(&spans, "actor", "discovery", 1);
        let restart = find(&spans, "actor.restart", "discovery", 1);
        let second = find(&spans, "actor", "discovery", 2);

        assert_eq!(supervisor.parent_span_id, SpanId::INVALID);
        assert_eq!(first.parent_span_id, supervisor.span_context.span_id());
        assert_eq!(restart.parent_span_id, supervisor.span_context.span_id());
        assert_eq!(second.parent_span_id, restart.span_context.span_id());
        assert_eq!(
            restart
                .links
                .links
                .first()
                .map(|l| l.span_context.span_id()),
            Some(first.span_context.span_id())
        );

        assert_eq!(attribute(restart, "attempt"), Some("1".to_owned()));
        // Numbers stay numbers in the export (unsigned tracing fields would become strings).
        for (span, key) in [
            (restart, "attempt"),
            (restart, "delay_ms"),
            (second, "actor.incarnation"),
        ] {
            let value = span
                .attributes
                .iter()
                .find(|kv| kv.key.as_str() == key)
                .map(|kv| &kv.value);
            assert!(
                matches!(value, Some(opentelemetry::Value::I64(_))),
                "{key}: {value:?}"
            );
        }
        assert_eq!(attribute(restart, "delay_ms"), Some("800".to_owned()));
        assert_eq!(
            attribute(first, "actor.parent"),
            Some("discovery".to_owned())
        );
        assert_eq!(
            attribute(second, "actor.parent"),
            Some("discovery".to_owned())
        );
        assert_eq!(
            attribute(second, "actor.id"),
            Some("discovery/dynamo".to_owned())
        );

        let events = |s: &SpanData| {
            s.events
                .iter()
                .map(|e| e.name.to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(events(first), ["actor.started", "actor.failed"]);
        assert!(
            matches!(first.status, Status::Error { .. }),
            "{:?}",
            first.status
        );
        assert_eq!(events(second), ["actor.started", "actor.stopped"]);
        assert_eq!(second.status, Status::Unset);
    }

    #[test]
    fn spans_without_an_otel_layer_are_harmless() {
        // No subscriber at all: every helper is a no-op and nothing panics.
        let supervisor = ActorSpan::start("root", ActorKind::Root, None);
        let child = ActorSpan::start("registry", ActorKind::Registry, Some(&supervisor));
        child.failed(&"boom");
        let restart = supervisor.restart(&child, u32::MAX, Duration::MAX);
        assert_eq!(restart.start_incarnation().incarnation(), 2);
    }
}
