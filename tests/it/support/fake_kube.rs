//! A fake Kubernetes API server for the discovery tests: axum on 127.0.0.1:0 serving Pods,
//! EndpointSlices and the DynamoWorkerMetadata CRD the way kube-apiserver does.
//!
//! * lists honour `labelSelector`, `limit` and `continue` (pages come from one snapshot, and every
//!   page reports the first page's `resourceVersion`);
//! * watches (`watch=true`) replay history newer than `resourceVersion`, send a BOOKMARK, then
//!   stream newline-delimited JSON events over a chunked response kept open until
//!   `timeoutSeconds` elapses; a `resourceVersion` older than the compaction point gets a watch
//!   ERROR event carrying a 410 `Status`, as the real apiserver sends;
//! * a test-control API mutates objects and stalls, cuts or expires watches, and counts lists
//!   and watch opens so tests wait on them instead of sleeping.

#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};

/// The three collections the router reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Pods,
    EndpointSlices,
    Metadata,
}

impl Kind {
    fn from_path(path: &str) -> Option<Kind> {
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        match segments.as_slice() {
            ["api", "v1", "namespaces", _, "pods"] => Some(Kind::Pods),
            [
                "apis",
                "discovery.k8s.io",
                "v1",
                "namespaces",
                _,
                "endpointslices",
            ] => Some(Kind::EndpointSlices),
            [
                "apis",
                "nvidia.com",
                "v1alpha1",
                "namespaces",
                _,
                "dynamoworkermetadatas",
            ] => Some(Kind::Metadata),
            _ => None,
        }
    }

    fn api_version(self) -> &'static str {
        match self {
            Kind::Pods => "v1",
            Kind::EndpointSlices => "discovery.k8s.io/v1",
            Kind::Metadata => "nvidia.com/v1alpha1",
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Kind::Pods => "Pod",
            Kind::EndpointSlices => "EndpointSlice",
            Kind::Metadata => "DynamoWorkerMetadata",
        }
    }
}

/// How often each collection was listed (first pages only) and watched.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub lists: HashMap<Kind, u64>,
    pub pages: HashMap<Kind, u64>,
    pub watches: HashMap<Kind, u64>,
}

struct Watcher {
    kind: Kind,
    selector: Vec<Requirement>,
    tx: mpsc::UnboundedSender<Bytes>,
    stalled: bool,
}

struct Snapshot {
    version: u64,
    rest: Vec<Value>,
}

#[derive(Default)]
struct Inner {
    version: u64,
    compacted: u64,
    objects: BTreeMap<(Kind, String), Value>,
    history: Vec<(u64, Kind, &'static str, Value)>,
    watchers: Vec<Watcher>,
    snapshots: HashMap<String, Snapshot>,
    next_token: u64,
    requests: Vec<String>,
    /// Collections whose list requests never get an answer (a hung API server).
    hung: Vec<Kind>,
}

/// The running fake. Dropping it stops the server.
pub struct FakeKube {
    pub addr: SocketAddr,
    inner: Arc<Mutex<Inner>>,
    counters: watch::Receiver<Counters>,
    server: tokio::task::JoinHandle<()>,
}

#[derive(Clone)]
struct AppState {
    inner: Arc<Mutex<Inner>>,
    counters: Arc<watch::Sender<Counters>>,
}

impl Drop for FakeKube {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl FakeKube {
    pub async fn start() -> FakeKube {
        let inner = Arc::new(Mutex::new(Inner {
            version: 1,
            ..Inner::default()
        }));
        let (counters_tx, counters) = watch::channel(Counters::default());
        let app = Router::new().fallback(handle).with_state(AppState {
            inner: inner.clone(),
            counters: Arc::new(counters_tx),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FakeKube {
            addr,
            inner,
            counters,
            server,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().expect("fake kube lock")
    }

    /// Creates or replaces an object (ADDED or MODIFIED to watchers).
    pub fn apply(&self, kind: Kind, mut object: Value) {
        let mut inner = self.lock();
        inner.version += 1;
        let version = inner.version;
        let name = object["metadata"]["name"]
            .as_str()
            .expect("object has a name")
            .to_owned();
        object["apiVersion"] = json!(kind.api_version());
        object["kind"] = json!(kind.kind());
        object["metadata"]["resourceVersion"] = json!(version.to_string());
        if object["metadata"]["uid"].is_null() {
            object["metadata"]["uid"] = json!(format!("uid-{name}"));
        }
        let kind_of_event = if inner.objects.insert((kind, name), object.clone()).is_some() {
            "MODIFIED"
        } else {
            "ADDED"
        };
        inner.publish(version, kind, kind_of_event, object);
    }

    /// Deletes an object (DELETED to watchers).
    pub fn delete(&self, kind: Kind, name: &str) {
        let mut inner = self.lock();
        let Some(mut object) = inner.objects.remove(&(kind, name.to_owned())) else {
            return;
        };
        inner.version += 1;
        let version = inner.version;
        object["metadata"]["resourceVersion"] = json!(version.to_string());
        inner.publish(version, kind, "DELETED", object);
    }

    /// Current watches of `kind` stop receiving events but stay open (a half-open connection).
    pub fn stall(&self, kind: Kind) {
        for w in self.lock().watchers.iter_mut().filter(|w| w.kind == kind) {
            w.stalled = true;
        }
    }

    /// Current watches of `kind` end with EOF.
    pub fn cut(&self, kind: Kind) {
        self.lock().watchers.retain(|w| w.kind != kind);
    }

    /// History is compacted: current watches of `kind` get an ERROR 410 event and close, and any
    /// watch from an older resourceVersion is refused the same way.
    pub fn expire(&self, kind: Kind) {
        let mut inner = self.lock();
        inner.compacted = inner.version;
        let line = gone_line(0, inner.compacted);
        inner.watchers.retain(|w| {
            if w.kind == kind {
                let _ = w.tx.send(line.clone());
                false
            } else {
                true
            }
        });
    }

    /// Sends a BOOKMARK at the current resourceVersion to watches of `kind`.
    pub fn bookmark(&self, kind: Kind) {
        let inner = self.lock();
        let line = bookmark_line(kind, inner.version);
        for w in inner
            .watchers
            .iter()
            .filter(|w| w.kind == kind && !w.stalled)
        {
            let _ = w.tx.send(line.clone());
        }
    }

    /// List requests for `kind` are counted but never answered, until `unhang`.
    pub fn hang_lists(&self, kind: Kind) {
        self.lock().hung.push(kind);
    }

    pub fn unhang_lists(&self, kind: Kind) {
        self.lock().hung.retain(|k| *k != kind);
    }

    /// Every request as `path?query`, in arrival order.
    pub fn requests(&self) -> Vec<String> {
        self.lock().requests.clone()
    }

    pub fn counters(&self) -> Counters {
        self.counters.borrow().clone()
    }

    /// Waits until `pred` holds for the counters.
    pub async fn wait_for(&self, pred: impl Fn(&Counters) -> bool) -> Counters {
        let mut rx = self.counters.clone();
        let got = tokio::time::timeout(Duration::from_secs(20), rx.wait_for(|c| pred(c)))
            .await
            .expect("fake kube counters reached the expected state in time")
            .expect("fake kube alive");
        got.clone()
    }

    /// Waits until `kind` has been watched at least `n` times.
    pub async fn wait_watches(&self, kind: Kind, n: u64) {
        self.wait_for(|c| c.watches.get(&kind).copied().unwrap_or(0) >= n)
            .await;
    }
}

impl Inner {
    fn publish(&mut self, version: u64, kind: Kind, event: &'static str, object: Value) {
        let line = event_line(event, &object);
        for w in self
            .watchers
            .iter()
            .filter(|w| w.kind == kind && !w.stalled)
        {
            if matches(&w.selector, &object) {
                let _ = w.tx.send(line.clone());
            }
        }
        self.history.push((version, kind, event, object));
    }
}

fn event_line(event: &str, object: &Value) -> Bytes {
    let mut text = json!({"type": event, "object": object}).to_string();
    text.push('\n');
    Bytes::from(text)
}

fn bookmark_line(kind: Kind, version: u64) -> Bytes {
    event_line(
        "BOOKMARK",
        &json!({"apiVersion": kind.api_version(), "kind": kind.kind(),
                "metadata": {"resourceVersion": version.to_string()}}),
    )
}

fn gone_line(asked: u64, compacted: u64) -> Bytes {
    event_line(
        "ERROR",
        &json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": format!("too old resource version: {asked} ({compacted})"),
                "reason": "Expired", "code": 410}),
    )
}

/// One label-selector requirement: `k=v`, `k==v`, `k!=v` or `k in (a,b)`.
#[derive(Clone, Debug)]
enum Requirement {
    Eq(String, String),
    NotEq(String, String),
    In(String, Vec<String>),
}

fn parse_selector(text: &str) -> Vec<Requirement> {
    let mut parts = Vec::new();
    let mut depth = 0;
    let mut current = String::new();
    for c in text.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(std::mem::take(&mut current));
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    parts.push(current);
    parts
        .into_iter()
        .map(|p| p.trim().to_owned())
        .filter(|p| !p.is_empty())
        .map(|p| {
            if let Some((k, v)) = p.split_once(" in ") {
                let values = v
                    .trim()
                    .trim_start_matches('(')
                    .trim_end_matches(')')
                    .split(',')
                    .map(|s| s.trim().to_owned())
                    .collect();
                Requirement::In(k.trim().to_owned(), values)
            } else if let Some((k, v)) = p.split_once("!=") {
                Requirement::NotEq(k.trim().to_owned(), v.trim().to_owned())
            } else if let Some((k, v)) = p.split_once("==").or_else(|| p.split_once('=')) {
                Requirement::Eq(k.trim().to_owned(), v.trim().to_owned())
            } else {
                panic!("fake kube: unsupported selector {p:?}")
            }
        })
        .collect()
}

fn matches(selector: &[Requirement], object: &Value) -> bool {
    let label = |k: &str| object["metadata"]["labels"][k].as_str().map(str::to_owned);
    selector.iter().all(|r| match r {
        Requirement::Eq(k, v) => label(k).as_deref() == Some(v.as_str()),
        Requirement::NotEq(k, v) => label(k).as_deref() != Some(v.as_str()),
        Requirement::In(k, vs) => label(k).is_some_and(|l| vs.contains(&l)),
    })
}

fn decode_component(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn query_map(uri: &Uri) -> HashMap<String, String> {
    uri.query()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode_component(k), decode_component(v))
        })
        .collect()
}

async fn handle(State(app): State<AppState>, uri: Uri) -> Response {
    let path = uri.path().to_owned();
    let query = query_map(&uri);
    app.inner.lock().expect("fake kube lock").requests.push(
        uri.path_and_query()
            .map(|p| p.to_string())
            .unwrap_or_default(),
    );
    let Some(kind) = Kind::from_path(&path) else {
        return (StatusCode::NOT_FOUND, format!("fake kube: no route {path}")).into_response();
    };
    let selector = parse_selector(query.get("labelSelector").map_or("", String::as_str));
    if query.get("watch").map(String::as_str) == Some("true") {
        watch_response(&app, kind, selector, &query)
    } else if app
        .inner
        .lock()
        .expect("fake kube lock")
        .hung
        .contains(&kind)
    {
        app.counters
            .send_modify(|c| *c.lists.entry(kind).or_default() += 1);
        std::future::pending::<Response>().await
    } else {
        list_response(&app, kind, &selector, &query)
    }
}

fn list_response(
    app: &AppState,
    kind: Kind,
    selector: &[Requirement],
    query: &HashMap<String, String>,
) -> Response {
    let limit: usize = query
        .get("limit")
        .and_then(|l| l.parse().ok())
        .filter(|l| *l > 0)
        .unwrap_or(usize::MAX);
    let mut inner = app.inner.lock().expect("fake kube lock");
    let (version, mut items) = match query.get("continue").filter(|c| !c.is_empty()) {
        Some(token) => match inner.snapshots.remove(token) {
            Some(snapshot) => (snapshot.version, snapshot.rest),
            None => {
                return (StatusCode::GONE, "fake kube: unknown continue token").into_response();
            }
        },
        None => {
            app.counters
                .send_modify(|c| *c.lists.entry(kind).or_default() += 1);
            let items: Vec<Value> = inner
                .objects
                .iter()
                .filter(|((k, _), o)| *k == kind && matches(selector, o))
                .map(|(_, o)| o.clone())
                .collect();
            (inner.version, items)
        }
    };
    app.counters
        .send_modify(|c| *c.pages.entry(kind).or_default() += 1);
    let rest = if items.len() > limit {
        items.split_off(limit)
    } else {
        Vec::new()
    };
    let mut metadata = json!({"resourceVersion": version.to_string()});
    if !rest.is_empty() {
        inner.next_token += 1;
        let token = format!("page-{}", inner.next_token);
        metadata["continue"] = json!(token);
        metadata["remainingItemCount"] = json!(rest.len());
        inner.snapshots.insert(token, Snapshot { version, rest });
    }
    let body = json!({
        "apiVersion": kind.api_version(),
        "kind": format!("{}List", kind.kind()),
        "metadata": metadata,
        "items": items,
    });
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn watch_response(
    app: &AppState,
    kind: Kind,
    selector: Vec<Requirement>,
    query: &HashMap<String, String>,
) -> Response {
    let from: u64 = query
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let timeout = query
        .get("timeoutSeconds")
        .and_then(|t| t.parse().ok())
        .map_or(Duration::from_secs(1800), Duration::from_secs);
    let (tx, mut rx) = mpsc::unbounded_channel::<Bytes>();
    {
        let mut inner = app.inner.lock().expect("fake kube lock");
        if from < inner.compacted {
            let _ = tx.send(gone_line(from, inner.compacted));
        } else {
            for (version, k, event, object) in &inner.history {
                if *k == kind && *version > from && matches(&selector, object) {
                    let _ = tx.send(event_line(event, object));
                }
            }
            let _ = tx.send(bookmark_line(kind, inner.version));
            inner.watchers.push(Watcher {
                kind,
                selector,
                tx,
                stalled: false,
            });
        }
    }
    app.counters
        .send_modify(|c| *c.watches.entry(kind).or_default() += 1);
    // The server closes the watch after timeoutSeconds, as kube-apiserver does.
    let (body_tx, body_rx) = mpsc::unbounded_channel::<Bytes>();
    tokio::spawn(async move {
        let forward = async {
            while let Some(line) = rx.recv().await {
                if body_tx.send(line).is_err() {
                    break;
                }
            }
        };
        let _ = tokio::time::timeout(timeout, forward).await;
    });
    let stream = futures::stream::unfold(body_rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|line| (Ok::<_, std::convert::Infallible>(line), rx))
    });
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        Body::from_stream(stream),
    )
        .into_response()
}

// -- object builders ---------------------------------------------------------------------------

const EXAMPLES: &str =
    include_str!("../../../protocol/src/kube/testdata/discovery_examples_kube.json");

/// The wire spec's worker-0 DynamoWorkerMetadata, with the etcd example's card in place of the
/// placeholder string.
pub fn example_metadata() -> Value {
    let ex: Value = serde_json::from_str(EXAMPLES).expect("examples are JSON");
    let mut dwm = ex["kubernetes_dwm_example"].clone();
    dwm["metadata"]["uid"] = json!("dwm-uid-worker-0");
    dwm["spec"]["data"]["model_cards"]["dynamo/backend/generate/43710f49c0cff"]["card_json"] =
        ex["etcd_examples"][1]["value"]["card_json"].clone();
    dwm
}

/// The owner Pod uid of [`example_metadata`].
pub const EXAMPLE_POD_UID: &str = "6f1c2a9e-3b7d-4c1e-9a51-0d2f7e8b4c33";

/// A discovery-labelled worker Pod in Dynamo namespace `dynamo_ns`.
pub fn worker_pod(name: &str, dynamo_ns: &str, ready: bool) -> Value {
    json!({
        "metadata": {
            "name": name,
            "namespace": "dynamo",
            "uid": format!("uid-{name}"),
            "labels": {
                "nvidia.com/dynamo-discovery-backend": "kubernetes",
                "nvidia.com/dynamo-discovery-enabled": "true",
                "nvidia.com/dynamo-namespace": dynamo_ns,
                "nvidia.com/dynamo-component": "VllmWorker",
                "nvidia.com/dynamo-component-type": "worker"
            }
        },
        "spec": {"containers": [{"name": "main", "image": "worker"}]},
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]
        }
    })
}

/// An EndpointSlice of the discovery-labelled Service with one endpoint per (pod, uid, ready).
pub fn endpoint_slice(name: &str, targets: &[(&str, &str, bool)]) -> Value {
    let endpoints: Vec<Value> = targets
        .iter()
        .map(|(pod, uid, ready)| {
            json!({
                "addresses": ["10.244.1.17"],
                "conditions": {"ready": ready},
                "targetRef": {"kind": "Pod", "name": pod, "namespace": "dynamo", "uid": uid}
            })
        })
        .collect();
    json!({
        "metadata": {
            "name": name,
            "namespace": "dynamo",
            "labels": {
                "nvidia.com/dynamo-discovery-backend": "kubernetes",
                "nvidia.com/dynamo-discovery-enabled": "true",
                "kubernetes.io/service-name": "backend"
            }
        },
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "system", "port": 9090, "protocol": "TCP"}]
    })
}
