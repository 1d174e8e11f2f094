//! A loopback fake OpenAI upstream: scripted replies (buffered JSON, paced SSE, 5xx/4xx, dropped
//! connections) and a record of every request it received, delivered over channels.

#![allow(dead_code)]

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::http::{HeaderMap, Request, Response, StatusCode};
use bytes::Bytes;
use continuum_router::config::schema::{
    BackendConfig, BackendRole, BackendType, HealthCheckConfig,
};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// A unified OpenAI backend `name` at `url` serving `models`, health checks off: how the tests
/// configure a fake upstream.
pub fn backend_config(name: &str, url: &str, models: &[&str]) -> BackendConfig {
    BackendConfig {
        name: name.into(),
        kind: BackendType::Openai,
        url: url.into(),
        role: BackendRole::Unified,
        models: models.iter().map(|m| m.to_string()).collect(),
        internal: false,
        enabled: true,
        health_check: HealthCheckConfig {
            enabled: false,
            ..HealthCheckConfig::default()
        },
        tls: Default::default(),
        global_prompts: Vec::new(),
        requires_single_leading_system: false,
        responses_api: Default::default(),
        responses_only_models: Vec::new(),
    }
}

/// One scripted answer to an API request (health probes are answered from `health`).
pub enum Reply {
    /// Status, JSON body and extra response headers.
    Json(StatusCode, Value, Vec<(&'static str, &'static str)>),
    /// `200 text/event-stream`, one chunk per received item; ends when the sender is dropped.
    Sse(mpsc::UnboundedReceiver<Bytes>),
    /// Like `Sse`, but the connection is cut (no terminating chunk) when the sender is dropped.
    SseThenCut(mpsc::UnboundedReceiver<Bytes>),
    /// Close the connection without any response.
    DropBeforeHeaders,
}

impl Reply {
    pub fn status(status: u16) -> Self {
        let status = StatusCode::from_u16(status).expect("valid status");
        Reply::Json(
            status,
            json!({"error": {"message": "scripted", "code": status.as_u16()}}),
            vec![],
        )
    }
}

/// A request as the upstream saw it.
#[derive(Clone, Debug)]
pub struct Recorded {
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// For health probes: the status answered.
    pub answered: StatusCode,
}

impl Recorded {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).expect("the proxy forwards JSON")
    }
}

struct Script {
    queue: VecDeque<Reply>,
    health: StatusCode,
}

pub struct FakeUpstream {
    pub addr: SocketAddr,
    script: Arc<Mutex<Script>>,
    api: mpsc::UnboundedReceiver<Recorded>,
    health: mpsc::UnboundedReceiver<Recorded>,
    task: JoinHandle<()>,
}

/// The default buffered answer.
pub fn completion(text: &str) -> Value {
    json!({"id": "chatcmpl-1", "object": "chat.completion", "model": "m",
           "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                        "finish_reason": "stop"}]})
}

impl FakeUpstream {
    pub async fn start() -> Self {
        Self::start_with_health(StatusCode::OK).await
    }

    pub async fn start_with_health(health: StatusCode) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("addr");
        let script = Arc::new(Mutex::new(Script {
            queue: VecDeque::new(),
            health,
        }));
        let (api_tx, api) = mpsc::unbounded_channel();
        let (health_tx, health) = mpsc::unbounded_channel();
        let shared = script.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let script = shared.clone();
                let (api_tx, health_tx) = (api_tx.clone(), health_tx.clone());
                tokio::spawn(async move {
                    let service = service_fn(move |req: Request<Incoming>| {
                        handle(req, script.clone(), api_tx.clone(), health_tx.clone())
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Self {
            addr,
            script,
            api,
            health,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Queues a reply for the next API request (FIFO); with none queued, a 200 completion.
    pub fn push(&self, reply: Reply) {
        self.script.lock().expect("script").queue.push_back(reply);
    }

    pub fn set_health(&self, status: StatusCode) {
        self.script.lock().expect("script").health = status;
    }

    pub async fn next_request(&mut self) -> Recorded {
        self.api.recv().await.expect("upstream running")
    }

    /// The API requests received so far without waiting.
    pub fn try_request(&mut self) -> Option<Recorded> {
        self.api.try_recv().ok()
    }

    pub async fn next_probe(&mut self) -> Recorded {
        self.health.recv().await.expect("upstream running")
    }
}

impl Drop for FakeUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn handle(
    req: Request<Incoming>,
    script: Arc<Mutex<Script>>,
    api: mpsc::UnboundedSender<Recorded>,
    health: mpsc::UnboundedSender<Recorded>,
) -> Result<Response<Body>, std::io::Error> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let path = parts.uri.path().to_owned();
    if path == "/health" {
        let answered = script.lock().expect("script").health;
        let _ = health.send(Recorded {
            path,
            headers: parts.headers,
            body,
            answered,
        });
        return Ok(Response::builder()
            .status(answered)
            .body(Body::from("{}"))
            .expect("response"));
    }
    let reply = script.lock().expect("script").queue.pop_front();
    let recorded = Recorded {
        path,
        headers: parts.headers,
        body,
        answered: StatusCode::OK,
    };
    let _ = api.send(recorded);
    let reply = reply.unwrap_or_else(|| Reply::Json(StatusCode::OK, completion("hi"), vec![]));
    match reply {
        Reply::Json(status, value, headers) => {
            let mut builder = Response::builder()
                .status(status)
                .header("content-type", "application/json");
            for (k, v) in headers {
                builder = builder.header(k, v);
            }
            Ok(builder
                .body(Body::from(value.to_string()))
                .expect("response"))
        }
        Reply::Sse(rx) => Ok(sse(rx, false)),
        Reply::SseThenCut(rx) => Ok(sse(rx, true)),
        Reply::DropBeforeHeaders => Err(std::io::Error::other("scripted drop")),
    }
}

fn sse(rx: mpsc::UnboundedReceiver<Bytes>, cut: bool) -> Response<Body> {
    let stream = futures::stream::unfold((rx, false), move |(mut rx, done)| async move {
        if done {
            return None;
        }
        match rx.recv().await {
            Some(chunk) => Some((Ok::<Bytes, std::io::Error>(chunk), (rx, false))),
            None if cut => Some((Err(std::io::Error::other("scripted cut")), (rx, true))),
            None => None,
        }
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(stream))
        .expect("response")
}

/// A loopback port with nothing listening (connection refused).
pub async fn closed_port() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    drop(listener);
    addr
}
