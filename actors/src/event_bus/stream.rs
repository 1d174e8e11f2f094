//! `BusStream`: one accepted data stream (`POST /bus/v1/streams/{id}`) as a byte stream.
//!
//! Reads are the request body (bytes the agent relays from the publisher or backend); writes go
//! to the response body (bytes for the publisher). The write side is a bounded pipe: at most
//! `stream_buffer_bytes` (payload plus 64 bytes per queued chunk, at least one frame) wait for
//! HTTP/2 flow control. Dropping the stream unsubscribes it in its session; the session ending
//! cuts it (reads and writes fail with `ConnectionAborted`).
//!
//! Cancel safety: every method keeps its state in the struct, so dropping a pending read or
//! write future loses nothing that was not already returned.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes};
use continuum_protocol::event_bus::SessionBounds;
use continuum_protocol::event_bus::bounds::MAX_FRAME_BYTES;
use continuum_protocol::event_bus::message::{ClientId, StreamId};
use futures::channel::{mpsc, oneshot};
use futures::{FutureExt as _, Sink as _};
use hyper::body::{Body as _, Incoming};
use ractor::ActorRef;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::metrics::{Direction, EventBusMetrics};
use super::session::SessionMsg;

/// Receives the bytes written to a [`BusStream`] (the data stream's response body).
pub type OutboundPipe = mpsc::Receiver<Bytes>;

/// The pipe between a [`BusStream`]'s writes and its response body: chunks of at most one
/// HTTP/2 frame, as many as fit `stream_buffer_bytes` (one at least).
pub(crate) fn outbound_pipe(bounds: &SessionBounds) -> (mpsc::Sender<Bytes>, OutboundPipe) {
    let per_chunk = SessionBounds::pipe_charge(MAX_FRAME_BYTES as usize);
    // A futures channel holds `buffer + 1` items with one sender.
    let buffer = (bounds.stream_buffer_bytes / per_chunk).saturating_sub(1);
    mpsc::channel(usize::try_from(buffer).unwrap_or(0))
}

/// Where a [`BusStream`] comes from: its session, id and broker.
pub(crate) struct StreamOrigin {
    pub(crate) stream_id: StreamId,
    pub(crate) session: ActorRef<SessionMsg>,
    pub(crate) broker: ClientId,
    pub(crate) carried: Option<super::coverage::CarriedGuard>,
    pub(crate) metrics: Option<EventBusMetrics>,
}

/// One data stream of an event-bus session.
pub struct BusStream {
    stream_id: StreamId,
    session: ActorRef<SessionMsg>,
    incoming: Incoming,
    pending: Bytes,
    read_eof: bool,
    outbound: mpsc::Sender<Bytes>,
    /// Fires (or is dropped) when the session cuts this stream.
    cut: oneshot::Receiver<()>,
    is_cut: bool,
    metrics: Option<EventBusMetrics>,
    broker: ClientId,
    /// Counts a subscription stream for its broker while it lives.
    _carried: Option<super::coverage::CarriedGuard>,
}

impl std::fmt::Debug for BusStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BusStream")
            .field("stream_id", &self.stream_id)
            .field("cut", &self.is_cut)
            .finish_non_exhaustive()
    }
}

impl BusStream {
    pub(crate) fn new(
        origin: StreamOrigin,
        incoming: Incoming,
        outbound: mpsc::Sender<Bytes>,
        cut: oneshot::Receiver<()>,
    ) -> Self {
        Self {
            stream_id: origin.stream_id,
            session: origin.session,
            broker: origin.broker,
            _carried: origin.carried,
            metrics: origin.metrics,
            incoming,
            pending: Bytes::new(),
            read_eof: false,
            outbound,
            cut,
            is_cut: false,
        }
    }

    /// The `brokers[].id` whose session carries this stream.
    pub fn broker(&self) -> &ClientId {
        &self.broker
    }

    /// The stream id in its session (for logs).
    pub fn stream_id(&self) -> StreamId {
        self.stream_id
    }

    fn poll_cut(&mut self, cx: &mut Context<'_>) -> bool {
        if !self.is_cut && self.cut.poll_unpin(cx).is_ready() {
            self.is_cut = true;
        }
        self.is_cut
    }
}

fn aborted() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "the event-bus session ended this stream",
    )
}

impl AsyncRead for BusStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if !this.pending.is_empty() {
                let n = this.pending.len().min(buf.remaining());
                buf.put_slice(&this.pending[..n]);
                this.pending.advance(n);
                if let Some(metrics) = &this.metrics {
                    metrics.relayed(Direction::ToRouter, n);
                }
                return Poll::Ready(Ok(()));
            }
            if this.read_eof {
                return Poll::Ready(Ok(()));
            }
            match Pin::new(&mut this.incoming).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        this.pending = data;
                    }
                }
                Poll::Ready(Some(Err(error))) => {
                    return Poll::Ready(Err(io::Error::new(io::ErrorKind::BrokenPipe, error)));
                }
                Poll::Ready(None) => this.read_eof = true,
                Poll::Pending => {
                    return if this.poll_cut(cx) {
                        Poll::Ready(Err(aborted()))
                    } else {
                        Poll::Pending
                    };
                }
            }
        }
    }
}

impl AsyncWrite for BusStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.poll_cut(cx) {
            return Poll::Ready(Err(aborted()));
        }
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let closed = || io::Error::new(io::ErrorKind::BrokenPipe, "the data stream is closed");
        ready!(Pin::new(&mut this.outbound).poll_ready(cx)).map_err(|_| closed())?;
        let n = buf.len().min(MAX_FRAME_BYTES as usize);
        Pin::new(&mut this.outbound)
            .start_send(Bytes::copy_from_slice(&buf[..n]))
            .map_err(|_| closed())?;
        if let Some(metrics) = &this.metrics {
            metrics.relayed(Direction::ToClient, n);
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.poll_cut(cx) {
            return Poll::Ready(Err(aborted()));
        }
        // Queued chunks are the response body's; HTTP/2 flow control drains them.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Ends the response body (END_STREAM) once the queued chunks are sent.
        self.get_mut().outbound.close_channel();
        Poll::Ready(Ok(()))
    }
}

impl Drop for BusStream {
    fn drop(&mut self) {
        // The session unsubscribes the stream; a session already gone needs nothing.
        let _ = self.session.cast(SessionMsg::StreamDropped(self.stream_id));
    }
}
