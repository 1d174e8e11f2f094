//! Relaying an upstream response: buffered (bounded, with a content length) or streamed as it
//! arrives (SSE; frames already waiting leave together), with a final SSE error event if the
//! upstream fails mid-stream.

use axum::body::Body;
use axum::http::{HeaderValue, Response, header};
use bytes::{Bytes, BytesMut};
use futures::{FutureExt, StreamExt};
use http_body_util::{BodyExt, BodyStream, Limited};
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
    B::Error: std::fmt::Display + std::error::Error + Send + Sync + 'static,
{
    let (mut parts, body) = upstream.into_parts();
    headers::response(&mut parts.headers);
    let bytes = Limited::new(body, MAX_BUFFERED_RESPONSE_BYTES)
        .collect()
        .await
        .map_err(|error| {
            warn!(backend, %error, "An upstream response body failed or exceeded its bound.");
            ApiError::BadGateway(format!("the upstream response failed: {error}"))
        })?
        .to_bytes();
    // `insert` replaces every value the upstream sent under that name: no `remove` first.
    parts
        .headers
        .insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
    Ok(Response::from_parts(parts, Body::from(bytes)))
}

/// Most bytes one relayed frame gathers from upstream frames that are already waiting.
pub const MAX_COALESCED_FRAME_BYTES: usize = 64 * 1024;

/// Scheduler passes the relay waits, with nothing new, before handing gathered bytes over: the
/// upstream client's connection task hands the next frame it already holds over after two
/// (observed on hyper 1.x with tokio's multi-thread scheduler: one to run the connection task,
/// one for the hand-over).
const IDLE_YIELDS: u32 = 2;

/// Passes upstream data frames on as they arrive, never waiting for more than is already there.
///
/// The upstream client hands a response body over one frame at a time (a zero-capacity channel
/// from its connection task), and the server writes every frame it is given with its own
/// `writev`. An SSE answer whose nine events arrived in one TCP read would leave as nine writes.
/// So after a frame the relay gathers whatever else is ready: it polls again, and when nothing is
/// ready it yields to the scheduler ([`IDLE_YIELDS`] times, letting the connection task decode
/// the next frame it already holds) before handing the gathered bytes over. A live token stream,
/// whose next event is not there yet, costs those scheduler passes per event; nothing is held
/// longer, and a gathered frame never exceeds [`MAX_COALESCED_FRAME_BYTES`].
pub fn streamed<B>(upstream: Response<B>, backend: &str) -> Response<Body>
where
    B: hyper::body::Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: std::fmt::Display + Send,
{
    let (mut parts, body) = upstream.into_parts();
    headers::response(&mut parts.headers);
    // The relayed length may differ (a closing error event), so the body goes chunked.
    parts.headers.remove(header::CONTENT_LENGTH);
    // The backend name rides in the stream's state: no per-chunk copy.
    let state = Some((BodyStream::new(body), backend.to_owned()));
    let stream = futures::stream::unfold(state, |state| async move {
        let (mut frames, backend) = state?;
        let mut gathered = Gathered::default();
        // The first frame: wait for it.
        while gathered.is_empty() {
            match frames.next().await {
                None => return None,
                Some(item) => {
                    if let Some(end) = gathered.take(item, &backend) {
                        return end.emit(gathered, None);
                    }
                }
            }
        }
        // Then whatever is ready, yielding to the scheduler (at most `IDLE_YIELDS` times in a
        // row) when nothing is.
        let mut idle_yields = 0;
        while gathered.len() < MAX_COALESCED_FRAME_BYTES {
            match frames.next().now_or_never() {
                Some(None) => return Ending::Finished.emit(gathered, None),
                Some(Some(item)) => {
                    if let Some(end) = gathered.take(item, &backend) {
                        return end.emit(gathered, None);
                    }
                    idle_yields = 0;
                }
                None if idle_yields == IDLE_YIELDS => break,
                None => {
                    tokio::task::yield_now().await;
                    idle_yields += 1;
                }
            }
        }
        Ending::Finished.emit(gathered, Some((frames, backend)))
    });
    Response::from_parts(parts, Body::from_stream(stream))
}

/// Data frames gathered into one relayed frame.
#[derive(Default)]
struct Gathered {
    first: Option<Bytes>,
    more: Option<BytesMut>,
}

/// Why gathering stopped early.
enum Ending {
    /// The gathered bytes go out (and the stream goes on or ends, as the caller says).
    Finished,
    /// The upstream failed: the gathered bytes, then a closing error event.
    Failed(Bytes),
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

    /// Takes one upstream item; `Some` when the stream ends with it.
    fn take(
        &mut self,
        item: Result<hyper::body::Frame<Bytes>, impl std::fmt::Display>,
        backend: &str,
    ) -> Option<Ending> {
        match item {
            Ok(frame) => {
                // Trailers and empty frames carry nothing for the client.
                if let Ok(data) = frame.into_data()
                    && !data.is_empty()
                {
                    self.push(data);
                }
                None
            }
            Err(error) => {
                warn!(backend, %error, "An upstream stream failed after it started.");
                Some(Ending::Failed(error_event(&error.to_string())))
            }
        }
    }

    fn push(&mut self, data: Bytes) {
        match (&mut self.first, &mut self.more) {
            (None, _) => self.first = Some(data),
            (Some(_), Some(more)) => more.extend_from_slice(&data),
            (Some(first), None) => {
                let mut more = BytesMut::with_capacity(first.len() + data.len());
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

type RelayState<B> = Option<(BodyStream<B>, String)>;

impl Ending {
    /// The next relayed frame (gathered bytes, a closing error event, or both) and the state
    /// after it: `next` goes on, `None` ends the stream once this frame is out.
    fn emit<B>(
        self,
        gathered: Gathered,
        next: RelayState<B>,
    ) -> Option<(Result<Bytes, std::convert::Infallible>, RelayState<B>)> {
        let data = gathered.into_bytes();
        let bytes = match (self, data) {
            (Ending::Finished, Some(data)) => data,
            (Ending::Finished, None) => return None,
            (Ending::Failed(event), None) => event,
            (Ending::Failed(event), Some(data)) => {
                let mut both = BytesMut::with_capacity(data.len() + event.len());
                both.extend_from_slice(&data);
                both.extend_from_slice(&event);
                both.freeze()
            }
        };
        Some((Ok(bytes), next))
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
    use super::*;
    use http_body_util::StreamBody;
    use hyper::body::Frame;

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
    async fn frames_that_are_already_there_leave_as_one() {
        let items: Vec<Item> = (0..9)
            .map(event)
            .chain([Ok(Frame::data(Bytes::from_static(b"data: [DONE]\n\n")))])
            .collect();
        let frames = relayed_frames(streamed(upstream(items), "b")).await;
        assert_eq!(frames.len(), 1, "{frames:?}");
        let text = String::from_utf8(frames[0].to_vec()).unwrap();
        assert!(text.starts_with("data: {\"i\":0}\n\n") && text.ends_with("data: [DONE]\n\n"));
        assert_eq!(text.matches("data: ").count(), 10);
    }

    #[tokio::test]
    async fn a_gathered_frame_stays_within_its_bound() {
        let chunk = Bytes::from(vec![b'x'; 1000]);
        let items: Vec<Item> = (0..200).map(|_| Ok(Frame::data(chunk.clone()))).collect();
        let frames = relayed_frames(streamed(upstream(items), "b")).await;
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
        let frames = relayed_frames(streamed(upstream(items), "b")).await;
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
        let frames = relayed_frames(streamed(upstream(items), "b")).await;
        assert_eq!(frames, vec![Bytes::from_static(b"data: {\"i\":0}\n\n")]);
    }
}
