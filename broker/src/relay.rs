//! One data stream: dial the publisher, open `POST /bus/v1/streams/{id}`, and copy raw ZMTP
//! bytes both ways until either side ends. The broker never parses the bytes: every ZMTP check
//! runs in the router.
//!
//! Bounds per stream and direction: publisher → router reads at most one chunk of
//! `min(stream_buffer_bytes, 16 KiB)` and queues at most one chunk for the request body, which
//! hyper sends only as the router's HTTP/2 window opens; router → publisher is bounded by this
//! connection's stream window ([`crate::tls::STREAM_WINDOW`]) and written through before the
//! next frame is read.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use continuum_protocol::event_bus::message::{StreamCloseReason, StreamId, ZmqTcpTarget};
use continuum_protocol::event_bus::{BusPath, SESSION_HEADER, VERSION_HEADER};
use http_body_util::{BodyExt as _, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::client::conn::http2::SendRequest;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use crate::metrics::Metrics;
use crate::tls::Body;

/// Dialling a publisher.
pub const PUBLISHER_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The router's answer to a data-stream request.
pub const STREAM_OPEN_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest chunk read from a publisher at once (one HTTP/2 frame).
pub const MAX_CHUNK: usize = 16 * 1024;

/// Opens one data stream (`POST /bus/v1/streams/{id}`) on a session: what a relay and a
/// kv-listener stream share.
pub struct StreamOpener {
    pub send: SendRequest<Body>,
    pub authority: String,
    pub token: Option<Arc<str>>,
    pub session_id: String,
    pub version: u32,
    pub stream_id: StreamId,
}

/// An open data stream: the request body's feed (one queued chunk) and the router's answer body.
pub struct OpenStream {
    pub to_router: mpsc::Sender<Bytes>,
    pub from_router: Incoming,
}

impl StreamOpener {
    /// Sends the request and waits (bounded by [`STREAM_OPEN_TIMEOUT`]) for the router's 200;
    /// anything else is the refusal to report.
    pub async fn open(self, content_type: Option<&'static str>) -> Result<OpenStream, RelayEnd> {
        let stream_id = self.stream_id;
        let refused = |reason, message: String| RelayEnd {
            stream_id,
            started: false,
            reason,
            message: Some(message),
        };
        let (to_router, rx) = mpsc::channel::<Bytes>(1);
        let mut request = http::Request::builder()
            .method(http::Method::POST)
            .uri(format!(
                "https://{}{}",
                self.authority,
                BusPath::stream(stream_id)
            ))
            .header(VERSION_HEADER, self.version.to_string())
            .header(SESSION_HEADER, &self.session_id);
        if let Some(content_type) = content_type {
            request = request.header(http::header::CONTENT_TYPE, content_type);
        }
        if let Some(token) = &self.token {
            request = request.header(http::header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let request = match request.body(channel_body(rx)) {
            Ok(request) => request,
            Err(error) => return Err(refused(StreamCloseReason::Internal, error.to_string())),
        };
        let mut send = self.send;
        let response =
            match tokio::time::timeout(STREAM_OPEN_TIMEOUT, send.send_request(request)).await {
                Ok(Ok(response)) => response,
                Ok(Err(error)) => {
                    return Err(refused(StreamCloseReason::StreamFailed, error.to_string()));
                }
                Err(_) => {
                    return Err(refused(
                        StreamCloseReason::StreamFailed,
                        "the router did not answer the data stream in time".into(),
                    ));
                }
            };
        if response.status() != http::StatusCode::OK {
            return Err(refused(
                StreamCloseReason::StreamFailed,
                format!(
                    "the router answered the data stream with {}",
                    response.status()
                ),
            ));
        }
        Ok(OpenStream {
            to_router,
            from_router: response.into_body(),
        })
    }
}

/// What a relay needs.
pub struct RelayArgs {
    pub opener: StreamOpener,
    pub target: ZmqTcpTarget,
    pub stream_buffer_bytes: usize,
    pub metrics: Metrics,
}

/// How a relay ended: `started` is false when nothing was relayed (a refusal).
#[derive(Debug)]
pub struct RelayEnd {
    pub stream_id: StreamId,
    pub started: bool,
    pub reason: StreamCloseReason,
    pub message: Option<String>,
}

/// A request body fed from a channel of at most one queued chunk.
pub fn channel_body(rx: mpsc::Receiver<Bytes>) -> Body {
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|bytes| (Ok::<_, Infallible>(Frame::data(bytes)), rx))
    });
    StreamBody::new(stream).boxed_unsync()
}

/// Runs one relay to its end.
pub async fn relay(args: RelayArgs) -> RelayEnd {
    let stream_id = args.opener.stream_id;
    let refused = |reason, message: String| RelayEnd {
        stream_id,
        started: false,
        reason,
        message: Some(message),
    };
    let tcp = match tokio::time::timeout(
        PUBLISHER_CONNECT_TIMEOUT,
        TcpStream::connect((args.target.host.as_str(), args.target.port)),
    )
    .await
    {
        Ok(Ok(tcp)) => tcp,
        Ok(Err(error)) => {
            return refused(StreamCloseReason::ConnectFailed, error.to_string());
        }
        Err(_) => {
            return refused(
                StreamCloseReason::ConnectFailed,
                "publisher connect timed out".into(),
            );
        }
    };
    let _ = tcp.set_nodelay(true);

    let OpenStream {
        to_router: tx,
        from_router: mut body,
    } = match args.opener.open(None).await {
        Ok(stream) => stream,
        Err(refusal) => return refusal,
    };
    let guard = StreamGauge::start(&args.metrics);
    let (mut from_publisher, mut to_publisher) = tcp.into_split();
    let chunk = args.stream_buffer_bytes.clamp(1, MAX_CHUNK);
    let to_router_bytes = args.metrics.relayed_bytes.with_label_values(&["to_router"]);
    let to_publisher_bytes = args
        .metrics
        .relayed_bytes
        .with_label_values(&["to_publisher"]);
    let up = async {
        let mut buf = vec![0u8; chunk];
        loop {
            match from_publisher.read(&mut buf).await {
                Ok(0) => return (StreamCloseReason::PublisherClosed, None),
                Err(error) => return (StreamCloseReason::PublisherClosed, Some(error.to_string())),
                Ok(n) => {
                    if tx.send(Bytes::copy_from_slice(&buf[..n])).await.is_err() {
                        return (
                            StreamCloseReason::StreamFailed,
                            Some("the router ended the data stream".to_owned()),
                        );
                    }
                    to_router_bytes.inc_by(n as u64);
                }
            }
        }
    };
    let down = async {
        loop {
            match body.frame().await {
                None => {
                    return (
                        StreamCloseReason::StreamFailed,
                        Some("the router ended the data stream".to_owned()),
                    );
                }
                Some(Err(error)) => {
                    return (StreamCloseReason::StreamFailed, Some(error.to_string()));
                }
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    if let Err(error) = to_publisher.write_all(&data).await {
                        return (StreamCloseReason::PublisherClosed, Some(error.to_string()));
                    }
                    to_publisher_bytes.inc_by(data.len() as u64);
                }
            }
        }
    };
    let (reason, message) = tokio::select! {
        end = up => end,
        end = down => end,
    };
    drop(guard);
    RelayEnd {
        stream_id,
        started: true,
        reason,
        message,
    }
}

/// Counts a stream in the `streams` gauge from its start until it ends, however it ends (including
/// an abort on unsubscribe).
pub struct StreamGauge(Metrics);

impl StreamGauge {
    pub fn start(metrics: &Metrics) -> Self {
        metrics.streams.inc();
        Self(metrics.clone())
    }
}

impl Drop for StreamGauge {
    fn drop(&mut self) {
        self.0.streams.dec();
    }
}
