//! An in-process OTLP/gRPC trace and metrics receiver on loopback, for tests that check exported
//! spans and pushed metrics (`metric_exports`, `wait_for_metrics`).
//!
//! `OtlpReceiver::start().await` serves `TraceService` on `127.0.0.1:0`; point the exporter at
//! `receiver.endpoint()`, flush, then `receiver.wait_for(|spans| ..., timeout)` — it wakes on
//! every received batch (a `watch` generation), never polls or sleeps.
//!
//! Subscriber scope: `tracing::subscriber::set_default` is thread-local, so it only sees spans
//! made on the test's own thread. When spans come from actors on tokio worker threads (the real
//! supervision tree), install the pipeline process-wide instead, once per test binary:
//! `let guard = telemetry::init(&options_with(receiver.endpoint()))?;` then
//! `guard.force_flush().await` before `wait_for`.
//!
//! Include it from a test crate without a `mod.rs`:
//! ```text
//! mod support {
//!     pub mod otlp;
//! }
//! ```
// Each test crate uses a different subset of the helpers.
#![allow(dead_code)]

use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{
    ExportMetricsServiceRequest, ExportMetricsServiceResponse,
};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, Span, span, status};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

/// One received span with the resource and scope it was exported under.
#[derive(Clone, Debug)]
pub struct ReceivedSpan {
    pub span: Span,
    pub resource: Vec<KeyValue>,
    pub scope: String,
}

/// A span id or trace id as lowercase hex, as trace viewers show them ("" when absent).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn find_attr<'a>(attributes: &'a [KeyValue], key: &str) -> Option<&'a any_value::Value> {
    attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|value: &AnyValue| value.value.as_ref())
}

fn as_text(value: &any_value::Value) -> String {
    match value {
        any_value::Value::StringValue(s) => s.clone(),
        any_value::Value::BoolValue(b) => b.to_string(),
        any_value::Value::IntValue(i) => i.to_string(),
        any_value::Value::DoubleValue(d) => d.to_string(),
        other => format!("{other:?}"),
    }
}

impl ReceivedSpan {
    pub fn name(&self) -> &str {
        &self.span.name
    }

    pub fn span_id(&self) -> String {
        hex(&self.span.span_id)
    }

    /// "" for a root span.
    pub fn parent_span_id(&self) -> String {
        hex(&self.span.parent_span_id)
    }

    pub fn trace_id(&self) -> String {
        hex(&self.span.trace_id)
    }

    pub fn is_child_of(&self, parent: &ReceivedSpan) -> bool {
        !self.span.parent_span_id.is_empty()
            && self.span.parent_span_id == parent.span.span_id
            && self.span.trace_id == parent.span.trace_id
    }

    /// An attribute's value as text (strings verbatim, numbers and bools formatted).
    pub fn attr(&self, key: &str) -> Option<String> {
        find_attr(&self.span.attributes, key).map(as_text)
    }

    pub fn attr_i64(&self, key: &str) -> Option<i64> {
        match find_attr(&self.span.attributes, key)? {
            any_value::Value::IntValue(i) => Some(*i),
            _ => None,
        }
    }

    /// A resource attribute (e.g. `service.name`) as text.
    pub fn resource_attr(&self, key: &str) -> Option<String> {
        find_attr(&self.resource, key).map(as_text)
    }

    pub fn event_names(&self) -> Vec<&str> {
        self.span.events.iter().map(|e| e.name.as_str()).collect()
    }

    pub fn event(&self, name: &str) -> Option<&span::Event> {
        self.span.events.iter().find(|e| e.name == name)
    }

    /// An attribute of the first event called `event`, as text.
    pub fn event_attr(&self, event: &str, key: &str) -> Option<String> {
        find_attr(&self.event(event)?.attributes, key).map(as_text)
    }

    /// The span ids this span links to, as hex.
    pub fn linked_span_ids(&self) -> Vec<String> {
        self.span.links.iter().map(|l| hex(&l.span_id)).collect()
    }

    pub fn status_code(&self) -> status::StatusCode {
        self.span
            .status
            .as_ref()
            .and_then(|s| status::StatusCode::try_from(s.code).ok())
            .unwrap_or(status::StatusCode::Unset)
    }

    /// True when the span is called `name` and every `(key, value)` attribute matches as text.
    pub fn matches(&self, name: &str, attrs: &[(&str, &str)]) -> bool {
        self.name() == name
            && attrs
                .iter()
                .all(|(key, value)| self.attr(key).as_deref() == Some(*value))
    }
}

/// Finds exactly one span called `name` with the given attributes.
pub fn one<'a>(spans: &'a [ReceivedSpan], name: &str, attrs: &[(&str, &str)]) -> &'a ReceivedSpan {
    let found: Vec<&ReceivedSpan> = spans.iter().filter(|s| s.matches(name, attrs)).collect();
    match found.as_slice() {
        [span] => span,
        _ => panic!(
            "expected exactly one span {name} {attrs:?}, found {}: {:#?}",
            found.len(),
            spans
                .iter()
                .map(|s| (
                    s.name(),
                    s.span_id(),
                    s.parent_span_id(),
                    &s.span.attributes
                ))
                .collect::<Vec<_>>()
        ),
    }
}

#[derive(Default)]
struct Shared {
    spans: Mutex<Vec<ReceivedSpan>>,
    metrics: Mutex<Vec<ExportMetricsServiceRequest>>,
}

#[derive(Clone)]
struct Service {
    shared: Arc<Shared>,
    generation: watch::Sender<u64>,
}

#[tonic::async_trait]
impl MetricsService for Service {
    async fn export(
        &self,
        request: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        self.shared
            .metrics
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(request.into_inner());
        self.generation.send_modify(|g| *g += 1);
        Ok(tonic::Response::new(ExportMetricsServiceResponse {
            partial_success: None,
        }))
    }
}

#[tonic::async_trait]
impl TraceService for Service {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let received = flatten(request.into_inner().resource_spans);
        self.shared
            .spans
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(received);
        // Publish after the spans are stored, so a waiter woken by this generation sees them.
        self.generation.send_modify(|g| *g += 1);
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

fn flatten(resource_spans: Vec<ResourceSpans>) -> Vec<ReceivedSpan> {
    let mut out = Vec::new();
    for rs in resource_spans {
        let resource = rs.resource.map(|r| r.attributes).unwrap_or_default();
        for ss in rs.scope_spans {
            let scope = ss.scope.map(|s| s.name).unwrap_or_default();
            for span in ss.spans {
                out.push(ReceivedSpan {
                    span,
                    resource: resource.clone(),
                    scope: scope.clone(),
                });
            }
        }
    }
    out
}

/// `wait_for` gave up; carries what had arrived, for the failure message.
pub struct WaitTimeout {
    pub spans: Vec<ReceivedSpan>,
}

impl fmt::Debug for WaitTimeout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let summary: Vec<(String, String, String)> = self
            .spans
            .iter()
            .map(|s| (s.name().to_owned(), s.span_id(), s.parent_span_id()))
            .collect();
        write!(
            f,
            "timed out; {} spans arrived (name, id, parent): {summary:?}",
            self.spans.len()
        )
    }
}

/// The receiver; stops serving when dropped.
pub struct OtlpReceiver {
    addr: SocketAddr,
    shared: Arc<Shared>,
    generation: watch::Receiver<u64>,
    stop: Option<oneshot::Sender<()>>,
    server: JoinHandle<Result<(), tonic::transport::Error>>,
}

impl OtlpReceiver {
    /// Binds 127.0.0.1:0 and serves OTLP/gRPC traces until dropped.
    pub async fn start() -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::default());
        let (generation_tx, generation) = watch::channel(0_u64);
        let (stop, stopped) = oneshot::channel::<()>();
        let service = Service {
            shared: Arc::clone(&shared),
            generation: generation_tx,
        };
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(service.clone()))
                .add_service(MetricsServiceServer::new(service))
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(listener),
                    async {
                        let _ = stopped.await;
                    },
                ),
        );
        Ok(Self {
            addr,
            shared,
            generation,
            stop: Some(stop),
            server,
        })
    }

    /// `http://127.0.0.1:PORT`, the form `telemetry.otlp.endpoint` takes.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Every span received so far, in arrival order.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.shared
            .spans
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Every metrics export received so far, in arrival order.
    pub fn metric_exports(&self) -> Vec<ExportMetricsServiceRequest> {
        self.shared
            .metrics
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Waits until `done(all metrics exports so far)` holds, re-checking on every export.
    pub async fn wait_for_metrics(
        &self,
        done: impl Fn(&[ExportMetricsServiceRequest]) -> bool,
        timeout: Duration,
    ) -> Option<Vec<ExportMetricsServiceRequest>> {
        let mut generation = self.generation.clone();
        tokio::time::timeout(timeout, async {
            loop {
                let exports = self.metric_exports();
                if done(&exports) {
                    return exports;
                }
                if generation.changed().await.is_err() {
                    return self.metric_exports();
                }
            }
        })
        .await
        .ok()
    }

    /// Waits until `done(all spans so far)` holds, re-checking on every received batch.
    pub async fn wait_for(
        &self,
        done: impl Fn(&[ReceivedSpan]) -> bool,
        timeout: Duration,
    ) -> Result<Vec<ReceivedSpan>, WaitTimeout> {
        let mut generation = self.generation.clone();
        let waited = tokio::time::timeout(timeout, async {
            loop {
                // Mark the current generation seen *before* reading, so a batch stored after the
                // read wakes `changed()` below.
                generation.borrow_and_update();
                let spans = self.spans();
                if done(&spans) {
                    return spans;
                }
                if generation.changed().await.is_err() {
                    // The server is gone; nothing more can arrive.
                    return self.spans();
                }
            }
        })
        .await;
        match waited {
            Ok(spans) if done(&spans) => Ok(spans),
            Ok(spans) => Err(WaitTimeout { spans }),
            Err(_) => Err(WaitTimeout {
                spans: self.spans(),
            }),
        }
    }

    /// Waits until at least `count` spans satisfy `matches`; returns all spans received.
    pub async fn wait_for_spans(
        &self,
        count: usize,
        matches: impl Fn(&ReceivedSpan) -> bool,
        timeout: Duration,
    ) -> Result<Vec<ReceivedSpan>, WaitTimeout> {
        self.wait_for(
            |spans| spans.iter().filter(|s| matches(s)).count() >= count,
            timeout,
        )
        .await
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        // A graceful stop waits for open exporter connections; the test is over, so don't.
        self.server.abort();
    }
}
