//! Relaying an upstream response: buffered (bounded, with a content length) or streamed as it
//! arrives (SSE; frames already waiting leave together), with a final SSE error event if the
//! upstream fails mid-stream.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::http::{HeaderValue, Response, header};
use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::Frame;
use serde_json::json;
use tracing::warn;

use super::headers;
use crate::wire::error::ApiError;

/// Largest buffered (non-streaming) upstream response relayed.
pub const MAX_BUFFERED_RESPONSE_BYTES: usize = 64 * 1024 * 1024;

/// Collects the whole upstream body, then answers with an exact content length.
pub async fn buffered<B>(upstream: Response<B>, backend: &str) -> Result<Response<Body>, ApiError>
where
    B: hyper::body::Body<Data = Bytes>,
    B::Error: std::fmt::Display,
{
    let (mut parts, body) = upstream.into_parts();
    headers::response(&mut parts.headers);
    let bytes = collect_bounded(body, MAX_BUFFERED_RESPONSE_BYTES)
        .await
        .map_err(|error| {
            warn!(backend, %error, "An upstream response body failed or exceeded its bound.");
            ApiError::BadGateway(format!("the upstream response failed: {error}"))
        })?;
    // `insert` replaces every value the upstream sent under that name: no `remove` first.
    parts
        .headers
        .insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
    Ok(Response::from_parts(parts, Body::from(bytes)))
}

/// Why a body (a buffered answer, a request body) could not be collected within its bound.
#[derive(Debug, thiserror::Error)]
pub enum CollectError<E> {
    #[error("{0}")]
    Body(E),
    #[error("the body exceeds {0} bytes")]
    TooLarge(usize),
}

/// The whole body, refused once it would exceed `limit` bytes. A body of one data frame (nearly
/// every buffered answer: the connection pool hands over all of a body it read at once) is
/// taken as it came; more frames are gathered into one buffer. Trailers are dropped.
pub async fn collect_bounded<B>(body: B, limit: usize) -> Result<Bytes, CollectError<B::Error>>
where
    B: hyper::body::Body<Data = Bytes>,
{
    let mut body = std::pin::pin!(body);
    let mut gathered = Gathered::default();
    while let Some(frame) = body.as_mut().frame().await {
        let Ok(data) = frame.map_err(CollectError::Body)?.into_data() else {
            continue;
        };
        if data.len() > limit.saturating_sub(gathered.len()) {
            return Err(CollectError::TooLarge(limit));
        }
        if !data.is_empty() {
            gathered.push(data);
        }
    }
    Ok(gathered.into_bytes().unwrap_or_default())
}

/// Most bytes one relayed frame gathers from upstream frames that are already waiting.
pub const MAX_COALESCED_FRAME_BYTES: usize = 64 * 1024;

/// The first allocation of a gathered frame: a burst of a few dozen small SSE events fits
/// without growing it (growing copies what was gathered so far, once per doubling).
const GATHER_CAPACITY: usize = 4096;

/// Empty polls the relay makes, with bytes gathered, before handing them over. Each one wakes
/// the relay's own task again at once (`wake_by_ref`): the scheduler runs it after the tasks
/// already queued, among them the upstream client's connection task, which taking a frame woke to
/// decode the next one it holds (hyper's body channel holds one frame: the connection task
/// decodes the next only once the previous one is taken). Two, measured: with one, the bench's
/// nine-event burst left frame by frame (docs/performance.md, "Proxy vs nginx"). A body the
/// relay's own poll reads from the socket (the connection pool's, [`super::pool`]) has nothing
/// more to wait for once it is pending: [`streamed`] is given none for it.
pub const IDLE_POLLS: u32 = 2;

/// Passes upstream data frames on as they arrive, never waiting for more than is already there.
///
/// The upstream client hands a response body over one frame at a time (a one-frame channel from
/// its connection task), and the server writes every frame it is given with its own `writev`. An
/// SSE answer whose nine events arrived in one TCP read would leave as nine writes. So after a
/// frame the relay ([`Relay`]) gathers whatever else is ready: it polls again, and when nothing
/// is ready it lets the scheduler run the connection task `idle_polls` times before handing the
/// gathered bytes over ([`IDLE_POLLS`] for a body another task hands over, none for one the
/// relay's own poll reads from its socket). A live token stream, whose next event is not there
/// yet, costs those scheduler passes per event; nothing is held longer, and a gathered frame
/// stops growing once it reaches [`MAX_COALESCED_FRAME_BYTES`].
pub fn streamed<B>(upstream: Response<B>, backend: &str, idle_polls: u32) -> Response<Body>
where
    B: hyper::body::Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: std::fmt::Display + Send,
{
    let (mut parts, body) = upstream.into_parts();
    headers::response(&mut parts.headers);
    // The relayed length may differ (a closing error event), so the body goes chunked.
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, Body::new(Relay::new(body, backend, idle_polls)))
}

/// The streamed relay's body: polls the upstream body directly (no stream adapters between the
/// two bodies) and hands over what it gathered.
struct Relay<B> {
    /// `None` once the upstream ended or failed.
    upstream: Option<B>,
    /// For the log line of a failure (in the body's state: no per-frame copy).
    backend: Box<str>,
    gathered: Gathered,
    /// Empty polls in a row since the last frame gathered.
    idle_polls: u32,
    /// Empty polls before gathered bytes are handed over.
    max_idle_polls: u32,
}

impl<B> Relay<B> {
    fn new(upstream: B, backend: &str, max_idle_polls: u32) -> Self {
        Self {
            upstream: Some(upstream),
            backend: backend.into(),
            gathered: Gathered::default(),
            idle_polls: 0,
            max_idle_polls,
        }
    }

    /// The gathered bytes as the next frame (`None` when nothing was gathered).
    fn hand_over(&mut self) -> Option<Result<Frame<Bytes>, Infallible>> {
        self.idle_polls = 0;
        std::mem::take(&mut self.gathered)
            .into_bytes()
            .map(|bytes| Ok(Frame::data(bytes)))
    }
}

impl<B> hyper::body::Body for Relay<B>
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = &mut *self;
        loop {
            let Some(upstream) = this.upstream.as_mut() else {
                return Poll::Ready(this.hand_over());
            };
            if this.gathered.len() >= MAX_COALESCED_FRAME_BYTES {
                return Poll::Ready(this.hand_over());
            }
            match Pin::new(upstream).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    // Trailers and empty frames carry nothing for the client.
                    if let Ok(data) = frame.into_data()
                        && !data.is_empty()
                    {
                        this.gathered.push(data);
                        this.idle_polls = 0;
                    }
                }
                Poll::Ready(None) => {
                    this.upstream = None;
                    return Poll::Ready(this.hand_over());
                }
                Poll::Ready(Some(Err(error))) => {
                    this.upstream = None;
                    warn!(backend = %this.backend, %error, "An upstream stream failed after it started.");
                    this.gathered.push(error_event(&error.to_string()));
                    return Poll::Ready(this.hand_over());
                }
                // Nothing gathered: wait for the upstream (its waker is registered).
                Poll::Pending if this.gathered.is_empty() => return Poll::Pending,
                Poll::Pending if this.idle_polls >= this.max_idle_polls => {
                    return Poll::Ready(this.hand_over());
                }
                Poll::Pending => {
                    this.idle_polls += 1;
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
            }
        }
    }

    /// True once the upstream ended and its last bytes are out: the server then ends the chunked
    /// body with the last frame's write.
    fn is_end_stream(&self) -> bool {
        self.upstream.is_none() && self.gathered.is_empty()
    }
}

/// Data frames gathered into one relayed frame.
#[derive(Default)]
struct Gathered {
    first: Option<Bytes>,
    more: Option<BytesMut>,
}

impl Gathered {
    fn is_empty(&self) -> bool {
        self.first.is_none()
    }

    fn len(&self) -> usize {
        match (&self.first, &self.more) {
            (_, Some(more)) => more.len(),
            (Some(first), None) => first.len(),
            (None, None) => 0,
        }
    }

    fn push(&mut self, data: Bytes) {
        match (&mut self.first, &mut self.more) {
            (None, _) => self.first = Some(data),
            (Some(_), Some(more)) => more.extend_from_slice(&data),
            (Some(first), None) => {
                let capacity = (first.len() + data.len()).max(GATHER_CAPACITY);
                let mut more = BytesMut::with_capacity(capacity);
                more.extend_from_slice(first);
                more.extend_from_slice(&data);
                self.more = Some(more);
            }
        }
    }

    fn into_bytes(self) -> Option<Bytes> {
        match (self.first, self.more) {
            (_, Some(more)) => Some(more.freeze()),
            (first, None) => first,
        }
    }
}

/// An OpenAI-style error as a final SSE event.
fn error_event(message: &str) -> Bytes {
    let body = json!({"error": {"message": format!("the upstream stream failed: {message}"),
                                "type": "bad_gateway", "code": "bad_gateway"}});
    Bytes::from(format!("data: {body}\n\n"))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::StreamExt;
    use http_body_util::StreamBody;

    use super::*;

    type Item = Result<Frame<Bytes>, std::io::Error>;

    fn upstream(
        items: Vec<Item>,
    ) -> Response<StreamBody<futures::stream::Iter<std::vec::IntoIter<Item>>>> {
        Response::new(StreamBody::new(futures::stream::iter(items)))
    }

    async fn relayed_frames(resp: Response<Body>) -> Vec<Bytes> {
        let mut frames = resp.into_body().into_data_stream();
        let mut out = Vec::new();
        while let Some(frame) = frames.next().await {
            out.push(frame.expect("the relay never fails"));
        }
        out
    }

    fn event(i: usize) -> Item {
        Ok(Frame::data(Bytes::from(format!("data: {{\"i\":{i}}}\n\n"))))
    }

    #[tokio::test]
    async fn a_buffered_body_is_collected_whole_and_refused_beyond_its_bound() {
        let items = || -> Vec<Item> {
            vec![
                event(0),
                Ok(Frame::trailers(Default::default())),
                Ok(Frame::data(Bytes::new())),
                event(1),
            ]
        };
        let whole = "data: {\"i\":0}\n\ndata: {\"i\":1}\n\n";
        let body = upstream(items()).into_body();
        let bytes = collect_bounded(body, whole.len()).await.expect("within");
        assert_eq!(bytes, whole);
        let body = upstream(items()).into_body();
        let refused = collect_bounded(body, whole.len() - 1).await;
        assert!(matches!(refused, Err(CollectError::TooLarge(_))));
        let one = upstream(vec![event(7)]).into_body();
        assert_eq!(
            collect_bounded(one, 64).await.expect("one"),
            "data: {\"i\":7}\n\n"
        );
        let empty = upstream(vec![]).into_body();
        assert_eq!(collect_bounded(empty, 0).await.expect("empty"), "");
        let failing = upstream(vec![event(0), Err(std::io::Error::other("reset"))]).into_body();
        let failed = collect_bounded(failing, 64).await;
        assert!(matches!(failed, Err(CollectError::Body(ref e)) if e.to_string() == "reset"));

        let resp = buffered(upstream(items()), "b").await.expect("buffered");
        assert_eq!(
            resp.headers()[header::CONTENT_LENGTH],
            whole.len().to_string()
        );
    }

    #[tokio::test]
    async fn frames_that_are_already_there_leave_as_one() {
        let items: Vec<Item> = (0..9)
            .map(event)
            .chain([Ok(Frame::data(Bytes::from_static(b"data: [DONE]\n\n")))])
            .collect();
        let frames = relayed_frames(streamed(upstream(items), "b", IDLE_POLLS)).await;
        assert_eq!(frames.len(), 1, "{frames:?}");
        let text = String::from_utf8(frames[0].to_vec()).unwrap();
        assert!(text.starts_with("data: {\"i\":0}\n\n") && text.ends_with("data: [DONE]\n\n"));
        assert_eq!(text.matches("data: ").count(), 10);
    }

    #[tokio::test]
    async fn a_gathered_frame_stays_within_its_bound() {
        let chunk = Bytes::from(vec![b'x'; 1000]);
        let items: Vec<Item> = (0..200).map(|_| Ok(Frame::data(chunk.clone()))).collect();
        let frames = relayed_frames(streamed(upstream(items), "b", IDLE_POLLS)).await;
        assert!(frames.len() >= 3, "{} frames", frames.len());
        assert!(
            frames
                .iter()
                .all(|f| f.len() < MAX_COALESCED_FRAME_BYTES + 1000)
        );
        assert_eq!(frames.iter().map(Bytes::len).sum::<usize>(), 200_000);
    }

    #[tokio::test]
    async fn a_failure_after_gathered_frames_ends_with_the_error_event() {
        let items: Vec<Item> = vec![
            event(0),
            event(1),
            Err(std::io::Error::other("reset")),
            event(2),
        ];
        let frames = relayed_frames(streamed(upstream(items), "b", IDLE_POLLS)).await;
        assert_eq!(frames.len(), 1, "{frames:?}");
        let text = String::from_utf8(frames[0].to_vec()).unwrap();
        assert!(
            text.starts_with("data: {\"i\":0}\n\ndata: {\"i\":1}\n\n"),
            "{text}"
        );
        assert!(
            text.contains("the upstream stream failed: reset") && !text.contains("\"i\":2"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn trailers_and_empty_frames_are_dropped() {
        let items: Vec<Item> = vec![
            Ok(Frame::data(Bytes::new())),
            event(0),
            Ok(Frame::trailers(Default::default())),
        ];
        let frames = relayed_frames(streamed(upstream(items), "b", IDLE_POLLS)).await;
        assert_eq!(frames, vec![Bytes::from_static(b"data: {\"i\":0}\n\n")]);
    }

    /// A body fed by a channel: frames arrive when the test sends them.
    fn fed() -> (
        tokio::sync::mpsc::UnboundedSender<Item>,
        Response<StreamBody<tokio_stream::wrappers::UnboundedReceiverStream<Item>>>,
    ) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let body = StreamBody::new(tokio_stream::wrappers::UnboundedReceiverStream::new(rx));
        (tx, Response::new(body))
    }

    /// An event that arrives alone goes out at once: the relay does not wait for a next one.
    /// (Paused time: were the relay to wait, the runtime would jump to the hour's end and the
    /// `timeout` would fail the test; nothing here depends on how long anything takes.)
    #[tokio::test(start_paused = true)]
    async fn a_lone_event_is_not_held_back_waiting_for_more() {
        for idle_polls in [IDLE_POLLS, 0] {
            lone_events_go_out_at_once(idle_polls).await;
        }
    }

    async fn lone_events_go_out_at_once(idle_polls: u32) {
        let (tx, resp) = fed();
        let mut body = streamed(resp, "b", idle_polls).into_body();
        let hour = Duration::from_secs(3600);
        for i in 0..3 {
            tx.send(event(i)).expect("relay alive");
            let frame = tokio::time::timeout(hour, body.frame())
                .await
                .expect("the event goes out while the upstream stays open")
                .expect("a frame")
                .expect("the relay never fails");
            assert_eq!(
                frame.into_data().expect("data"),
                format!("data: {{\"i\":{i}}}\n\n")
            );
        }
        drop(tx);
        let end = tokio::time::timeout(hour, body.frame())
            .await
            .expect("the end");
        assert!(end.is_none());
    }

    /// Without empty polls (a body read by the relay's own poll), what is ready is still
    /// gathered into one frame, and handed over as soon as the upstream is pending.
    #[tokio::test(start_paused = true)]
    async fn without_empty_polls_what_is_ready_still_leaves_as_one() {
        let (tx, resp) = fed();
        let mut body = streamed(resp, "b", 0).into_body();
        let hour = Duration::from_secs(3600);
        for i in 0..4 {
            tx.send(event(i)).expect("relay alive");
        }
        let frame = tokio::time::timeout(hour, body.frame())
            .await
            .expect("handed over while the upstream stays open")
            .expect("a frame")
            .expect("the relay never fails");
        assert_eq!(frame.into_data().expect("data").len(), 4 * 15);
    }

    /// The last gathered frame says the body ends with it, so the server writes the chunked
    /// body's end with it instead of polling once more.
    #[tokio::test]
    async fn the_last_frame_ends_the_body() {
        let items: Vec<Item> = (0..3).map(event).collect();
        let mut body = streamed(upstream(items), "b", IDLE_POLLS).into_body();
        assert!(!hyper::body::Body::is_end_stream(&body));
        let frame = body.frame().await.expect("a frame").expect("data");
        assert_eq!(frame.into_data().expect("data").len(), 3 * 15);
        assert!(hyper::body::Body::is_end_stream(&body));
        assert!(body.frame().await.is_none());
    }
}
