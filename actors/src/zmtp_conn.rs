//! One bounded ZMTP SUB connection over a byte stream — a `tokio::net::TcpStream` dialled
//! directly, or an event-bus `BusStream` (`dynamo.load.transport: broker`) — driving the
//! sans-IO [`continuum_protocol::zmtp::ZmtpSub`] state machine. The same handshake, frame and
//! message ceilings and decoding run over either.
//!
//! Not an actor: the subscription actor (or load supervisor) owns the reconnect loop and backoff,
//! and runs one [`run_session`] per connection attempt in a task, receiving [`ConnEvent`]s on a
//! bounded `tokio::sync::mpsc` channel (which is also the backpressure: a full channel stops
//! reads, so at most one decoded message waits in this task).
//!
//! Bounds: a 2 KiB read buffer, the state machine's 64-byte write buffer and 512-byte
//! grow-on-demand frame buffer ([`IDLE_BUFFER_BYTES`] per idle subscription), and a
//! [`CONNECT_TIMEOUT`] budget that covers name resolution, the TCP connect and the ZMTP
//! handshake, so a stalled greeting cannot hold a task forever.
//!
//! Dial policy: the endpoint is resolved once, and only a resolved socket address inside
//! `direct_allow_cidrs` (when set) is dialled, so DNS cannot change the address between the policy
//! check and the connection.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use continuum_protocol::event_plane::LoadEventResult;
use continuum_protocol::ids::PublisherId;
use continuum_protocol::zmtp::{
    Delivery, INITIAL_FRAME_BUFFER, WRITE_BUFFER, ZmtpError, ZmtpLimits, ZmtpSub,
};
use ipnet::IpNet;
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::time::{Instant, timeout_at};
use tracing::debug;

/// Read buffer per connection.
pub const READ_BUFFER: usize = 2 * 1024;
/// Budget for resolving, connecting and completing the ZMTP handshake.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on closing an event-bus stream ([`run_session_over`]): ending our side, then reading
/// until the broker ends its own; the stream is dropped when this runs out.
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(1);
/// Buffer bytes an idle subscription holds: read + frame + write buffers (2,624).
pub const IDLE_BUFFER_BYTES: usize = READ_BUFFER + INITIAL_FRAME_BUFFER + WRITE_BUFFER;

/// What to connect to and how.
#[derive(Clone, Debug)]
pub struct ZmtpConnConfig {
    /// The discovered publisher (for logs; identity is checked by the event-plane decoder).
    pub publisher_id: PublisherId,
    /// `tcp://host:port` as announced in the EventChannel record.
    pub endpoint: String,
    /// The raw topic to subscribe to (`kv_metrics`, `kv-events`).
    pub topic: Vec<u8>,
    pub limits: ZmtpLimits,
    /// `dynamo.load.direct_allow_cidrs`; `None` allows any address (the historical behaviour).
    pub allow_cidrs: Option<Vec<IpNet>>,
    /// [`CONNECT_TIMEOUT`] in production; shorter in tests.
    pub connect_timeout: Duration,
}

impl ZmtpConnConfig {
    /// A `kv_metrics` subscription with production bounds.
    pub fn kv_metrics(
        publisher_id: PublisherId,
        endpoint: impl Into<String>,
        allow_cidrs: Option<Vec<IpNet>>,
    ) -> Self {
        Self {
            publisher_id,
            endpoint: endpoint.into(),
            topic: b"kv_metrics".to_vec(),
            limits: ZmtpLimits::KV_METRICS,
            allow_cidrs,
            connect_timeout: CONNECT_TIMEOUT,
        }
    }
}

/// Why a connection ended or never started.
#[derive(Debug, Error)]
pub enum ZmtpConnError {
    #[error("endpoint {0:?} is not tcp://host:port")]
    BadEndpoint(String),
    #[error("resolving {host} failed: {source}")]
    Resolve { host: String, source: io::Error },
    #[error("{host} resolved to no address")]
    NoAddress { host: String },
    #[error("no resolved address of {host} ({addresses:?}) is inside direct_allow_cidrs")]
    NotAllowed {
        host: String,
        addresses: Vec<IpAddr>,
    },
    #[error("connecting to {address} failed: {source}")]
    Connect {
        address: SocketAddr,
        source: io::Error,
    },
    #[error("connect budget of {0:?} ran out before the TCP connection")]
    ConnectTimeout(Duration),
    #[error("connect budget of {0:?} ran out during the ZMTP handshake")]
    HandshakeTimeout(Duration),
    #[error("socket error: {0}")]
    Io(#[from] io::Error),
    #[error("publisher closed the connection")]
    Closed,
    #[error("transport violation: {0}")]
    Protocol(#[from] ZmtpError),
    /// The event bus gave no stream (no covering session, refused, timed out); the reason is
    /// the bus's own error text, never the agent's free-text message.
    #[error("event bus: {0}")]
    Broker(String),
}

impl ZmtpConnError {
    /// The load-events result to count, if this failure is one: protocol violations, a peer
    /// that stalls the handshake, and dial-policy refusals are `transport_refused`; ordinary
    /// network failures are only retried.
    pub fn counted_result(&self) -> Option<LoadEventResult> {
        match self {
            Self::Protocol(_) | Self::HandshakeTimeout(_) | Self::NotAllowed { .. } => {
                Some(LoadEventResult::TransportRefused)
            }
            _ => None,
        }
    }
}

impl ZmtpConnError {
    /// Whether this failure says nothing answers at the endpoint: refused, reset, unreachable, a
    /// timeout, or a peer that closed before the handshake finished. After an established session
    /// was lost, such a failure means the publisher (and its worker process) is gone. Policy and
    /// protocol failures (a bad endpoint, DNS, `direct_allow_cidrs`, a violation) do not.
    pub fn is_unreachable(&self) -> bool {
        matches!(
            self,
            Self::Connect { .. }
                | Self::ConnectTimeout(_)
                | Self::HandshakeTimeout(_)
                | Self::Io(_)
                | Self::Closed
        )
    }
}

/// What a session sends to its sink, in stream order.
#[derive(Debug)]
pub enum ConnEvent {
    /// The handshake completed and the subscription was sent: a new ordered stream starts, so
    /// the receiver applies the missed-messages rule (`LoadStream::on_connected`).
    Connected {
        publisher_id: PublisherId,
        peer: SocketAddr,
    },
    /// A message, or a message the transport skipped for its size.
    Delivery(Delivery),
}

/// An established, subscribed connection over `S` (TCP unless said otherwise).
#[derive(Debug)]
pub struct ZmtpConn<S = TcpStream> {
    publisher_id: PublisherId,
    stream: S,
    peer: SocketAddr,
    sub: ZmtpSub,
    read_buf: Box<[u8]>,
    /// Bytes read during the handshake but not yet consumed.
    unread: (usize, usize),
}

/// Splits `tcp://host:port` (or `host:port`) into host and port; IPv6 literals in brackets.
pub fn parse_endpoint(endpoint: &str) -> Option<(String, u16)> {
    let rest = endpoint.strip_prefix("tcp://").unwrap_or(endpoint);
    let (host, port) = rest.rsplit_once(':')?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if host.is_empty() || host.contains('/') {
        return None;
    }
    Some((host.to_owned(), port.parse().ok()?))
}

/// Most entries of a dial allowlist (`dynamo.load.direct_allow_cidrs`, the kv-listener's
/// `--allow-cidr`).
pub const MAX_ALLOW_CIDRS: usize = 64;

/// Parses a dial allowlist as the router's `dynamo.load.direct_allow_cidrs` is validated: one
/// to [`MAX_ALLOW_CIDRS`] IPv4 or IPv6 CIDRs (an empty list would refuse every publisher; leave
/// the setting out instead).
pub fn parse_allow_cidrs(cidrs: &[String]) -> Result<Vec<IpNet>, String> {
    if cidrs.is_empty() {
        return Err(
            "an empty CIDR list refuses every publisher; list CIDRs or leave it out".into(),
        );
    }
    if cidrs.len() > MAX_ALLOW_CIDRS {
        return Err(format!(
            "{} CIDRs given; at most {MAX_ALLOW_CIDRS} are accepted",
            cidrs.len()
        ));
    }
    cidrs
        .iter()
        .map(|cidr| {
            cidr.trim()
                .parse::<IpNet>()
                .map_err(|_| format!("{cidr:?} is not an IPv4 or IPv6 CIDR (like 10.0.0.0/8)"))
        })
        .collect()
}

/// The addresses the dial policy allows, in resolution order.
pub fn allowed_addresses(
    addresses: &[SocketAddr],
    allow_cidrs: Option<&[IpNet]>,
) -> Vec<SocketAddr> {
    addresses
        .iter()
        .filter(|a| allow_cidrs.is_none_or(|nets| nets.iter().any(|n| n.contains(&a.ip()))))
        .copied()
        .collect()
}

impl ZmtpConn<TcpStream> {
    /// Resolves once, dials an allowed address and completes the handshake, all within
    /// `config.connect_timeout`.
    pub async fn connect(config: &ZmtpConnConfig) -> Result<Self, ZmtpConnError> {
        let deadline = Instant::now() + config.connect_timeout;
        let (host, port) = parse_endpoint(&config.endpoint)
            .ok_or_else(|| ZmtpConnError::BadEndpoint(config.endpoint.clone()))?;
        let sub = ZmtpSub::new(&config.topic, config.limits)?;
        let budget = config.connect_timeout;
        let resolved: Vec<SocketAddr> = match host.parse::<IpAddr>() {
            Ok(ip) => vec![SocketAddr::new(ip, port)],
            Err(_) => timeout_at(deadline, tokio::net::lookup_host((host.as_str(), port)))
                .await
                .map_err(|_| ZmtpConnError::ConnectTimeout(budget))?
                .map_err(|source| ZmtpConnError::Resolve {
                    host: host.clone(),
                    source,
                })?
                .collect(),
        };
        if resolved.is_empty() {
            return Err(ZmtpConnError::NoAddress { host });
        }
        let allowed = allowed_addresses(&resolved, config.allow_cidrs.as_deref());
        if allowed.is_empty() {
            return Err(ZmtpConnError::NotAllowed {
                host,
                addresses: resolved.iter().map(SocketAddr::ip).collect(),
            });
        }
        let mut last_error = None;
        let mut connected = None;
        for address in allowed {
            match timeout_at(deadline, TcpStream::connect(address)).await {
                Err(_) => return Err(ZmtpConnError::ConnectTimeout(budget)),
                Ok(Ok(stream)) => {
                    connected = Some((stream, address));
                    break;
                }
                Ok(Err(source)) => last_error = Some(ZmtpConnError::Connect { address, source }),
            }
        }
        let Some((stream, peer)) = connected else {
            return Err(last_error.unwrap_or(ZmtpConnError::NoAddress { host }));
        };
        stream.set_nodelay(true)?;
        ZmtpConn::over(stream, peer, config, sub, deadline).await
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> ZmtpConn<S> {
    /// Completes the handshake over an already connected `stream` by `deadline`.
    async fn over(
        stream: S,
        peer: SocketAddr,
        config: &ZmtpConnConfig,
        sub: ZmtpSub,
        deadline: Instant,
    ) -> Result<Self, ZmtpConnError> {
        let mut conn = Self {
            publisher_id: config.publisher_id,
            stream,
            peer,
            sub,
            read_buf: vec![0u8; READ_BUFFER].into_boxed_slice(),
            unread: (0, 0),
        };
        timeout_at(deadline, conn.handshake())
            .await
            .map_err(|_| ZmtpConnError::HandshakeTimeout(config.connect_timeout))??;
        debug!(publisher_id = %conn.publisher_id, %peer, "Subscribed to event-plane publisher.");
        Ok(conn)
    }

    /// Runs the handshake over an already connected `stream` (an event-bus stream) within
    /// `config.connect_timeout`; `peer` is the publisher's announced address.
    pub async fn handshake_over(
        stream: S,
        peer: SocketAddr,
        config: &ZmtpConnConfig,
    ) -> Result<Self, ZmtpConnError> {
        let deadline = Instant::now() + config.connect_timeout;
        let sub = ZmtpSub::new(&config.topic, config.limits)?;
        Self::over(stream, peer, config, sub, deadline).await
    }

    async fn handshake(&mut self) -> Result<(), ZmtpConnError> {
        loop {
            self.flush().await?;
            if self.sub.is_open() {
                return Ok(());
            }
            let n = self.stream.read(&mut self.read_buf).await?;
            if n == 0 {
                return Err(ZmtpConnError::Closed);
            }
            // Data frames cannot complete before the handshake, so nothing is delivered here.
            let consumed = self.sub.handle_input(&self.read_buf[..n])?;
            self.unread = (consumed, n);
        }
    }

    async fn flush(&mut self) -> Result<(), ZmtpConnError> {
        while let Some(bytes) = self.sub.poll_transmit() {
            let n = self.stream.write(bytes).await?;
            if n == 0 {
                return Err(ZmtpConnError::Closed);
            }
            self.sub.advance_transmit(n);
        }
        Ok(())
    }

    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// Heap bytes of the read, frame and write buffers (2,624 when idle).
    pub fn buffer_bytes(&self) -> usize {
        self.read_buf.len() + self.sub.buffer_bytes()
    }

    /// Reads until the peer closes or violates the protocol, sending every delivery to `sink`.
    /// Returns `Ok(())` when the sink's receiver is gone (the subscription was stopped).
    pub async fn run(&mut self, sink: &mpsc::Sender<ConnEvent>) -> Result<(), ZmtpConnError> {
        let (mut at, mut end) = self.unread;
        loop {
            while at < end {
                at += self.sub.handle_input(&self.read_buf[at..end])?;
                if let Some(delivery) = self.sub.poll_delivery()
                    && sink.send(ConnEvent::Delivery(delivery)).await.is_err()
                {
                    return Ok(());
                }
            }
            // PONGs queued by PINGs.
            self.flush().await?;
            let n = tokio::select! {
                read = self.stream.read(&mut self.read_buf) => read?,
                () = sink.closed() => return Ok(()),
            };
            if n == 0 {
                return Err(ZmtpConnError::Closed);
            }
            (at, end) = (0, n);
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> ZmtpConn<S> {
    /// Closes the stream in order within [`CLOSE_TIMEOUT`]: ends our side (an event-bus stream's
    /// END_STREAM), then discards what still arrives until the peer ends its side or fails.
    /// Either way the stream is dropped after.
    async fn close(mut self) {
        let closing = async {
            if self.stream.shutdown().await.is_err() {
                return;
            }
            while let Ok(n) = self.stream.read(&mut self.read_buf).await {
                if n == 0 {
                    return;
                }
            }
        };
        if tokio::time::timeout(CLOSE_TIMEOUT, closing).await.is_err() {
            debug!(publisher_id = %self.publisher_id, "The stream did not close in time; dropped it.");
        }
    }
}

/// One connection attempt: connect, announce [`ConnEvent::Connected`], then stream deliveries.
pub async fn run_session(
    config: &ZmtpConnConfig,
    sink: &mpsc::Sender<ConnEvent>,
) -> Result<(), ZmtpConnError> {
    let mut conn = ZmtpConn::connect(config).await?;
    announce_and_run(&mut conn, config, sink).await
}

/// [`run_session`] over a stream that is already connected (an event-bus `BusStream`); when the
/// session ends the stream is closed in order, bounded by [`CLOSE_TIMEOUT`].
pub async fn run_session_over<S: AsyncRead + AsyncWrite + Unpin>(
    stream: S,
    peer: SocketAddr,
    config: &ZmtpConnConfig,
    sink: &mpsc::Sender<ConnEvent>,
) -> Result<(), ZmtpConnError> {
    let mut conn = ZmtpConn::handshake_over(stream, peer, config).await?;
    let result = announce_and_run(&mut conn, config, sink).await;
    conn.close().await;
    result
}

async fn announce_and_run<S: AsyncRead + AsyncWrite + Unpin>(
    conn: &mut ZmtpConn<S>,
    config: &ZmtpConnConfig,
    sink: &mpsc::Sender<ConnEvent>,
) -> Result<(), ZmtpConnError> {
    let connected = ConnEvent::Connected {
        publisher_id: config.publisher_id,
        peer: conn.peer(),
    };
    if sink.send(connected).await.is_err() {
        return Ok(());
    }
    conn.run(sink).await
}

#[cfg(test)]
mod tests;
