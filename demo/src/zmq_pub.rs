//! A bounded ZMQ PUB socket over tokio: what a simulated worker publishes `kv_metrics` on.
//!
//! The listener accepts at most [`MAX_PEERS`] subscribers. Each connection runs the sans-IO
//! [`ZmtpPub`] handshake and keeps its own subscriptions; [`PubSocket::send`] frames a message
//! once and offers it to every connection's queue of [`PEER_QUEUE`] messages. A subscriber whose
//! queue is full is dropped (libzmq drops messages at the high-water mark; dropping the peer
//! keeps memory bounded and lets it resync on reconnect, which the router treats as a possible
//! missed change). A write that stalls for [`WRITE_TIMEOUT`] also ends the connection.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use continuum_protocol::zmtp::publisher::{ZmtpPub, encode_message};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tracing::{debug, warn};

/// Most concurrent subscribers per socket.
pub const MAX_PEERS: usize = 64;
/// Messages queued per subscriber before it is dropped as too slow.
pub const PEER_QUEUE: usize = 256;
/// A single write may stall this long before the subscriber is dropped.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
const READ_BUFFER: usize = 1024;

/// One framed message: its topic (for subscription matching) and its wire bytes.
type Outgoing = Arc<(Vec<u8>, Vec<u8>)>;

struct Peer {
    tx: mpsc::Sender<Outgoing>,
    addr: SocketAddr,
}

/// A bound PUB socket. Dropping it stops accepting and closes every connection.
pub struct PubSocket {
    addr: SocketAddr,
    peers: Arc<Mutex<Vec<Peer>>>,
    /// Connections holding at least one subscription.
    subscribed: Arc<watch::Sender<usize>>,
    accept: JoinHandle<()>,
}

impl std::fmt::Debug for PubSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PubSocket")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

fn lock(peers: &Mutex<Vec<Peer>>) -> MutexGuard<'_, Vec<Peer>> {
    peers.lock().unwrap_or_else(|p| p.into_inner())
}

impl PubSocket {
    /// Binds `addr` (port 0 for an ephemeral port) and starts accepting subscribers.
    pub async fn bind(addr: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let peers = Arc::new(Mutex::new(Vec::new()));
        let subscribed = Arc::new(watch::channel(0).0);
        let accept = tokio::spawn(accept_loop(listener, peers.clone(), subscribed.clone()));
        Ok(Self {
            addr,
            peers,
            subscribed,
            accept,
        })
    }

    /// The bound address (what the EventChannel record advertises).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connected subscribers (handshake complete or not).
    pub fn peer_count(&self) -> usize {
        lock(&self.peers).len()
    }

    /// The number of connections holding at least one subscription, as it changes.
    pub fn subscribed(&self) -> watch::Receiver<usize> {
        self.subscribed.subscribe()
    }

    /// Offers one multipart message to every subscriber; slow subscribers are dropped.
    pub fn send<F: AsRef<[u8]>>(&self, frames: &[F]) {
        let Some(topic) = frames.first() else {
            return;
        };
        let mut wire = Vec::new();
        encode_message(frames, &mut wire);
        let message: Outgoing = Arc::new((topic.as_ref().to_vec(), wire));
        lock(&self.peers).retain(|peer| match peer.tx.try_send(message.clone()) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                warn!(peer = %peer.addr, "Dropped a ZMQ subscriber that fell behind.");
                false
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        });
    }
}

impl Drop for PubSocket {
    fn drop(&mut self) {
        self.accept.abort();
        // Closing every queue ends every connection task.
        lock(&self.peers).clear();
    }
}

async fn accept_loop(
    listener: TcpListener,
    peers: Arc<Mutex<Vec<Peer>>>,
    subscribed: Arc<watch::Sender<usize>>,
) {
    loop {
        let (stream, addr) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                warn!(%error, "A ZMQ PUB socket could not accept a connection.");
                continue;
            }
        };
        let (tx, rx) = mpsc::channel(PEER_QUEUE);
        {
            let mut peers = lock(&peers);
            peers.retain(|p| !p.tx.is_closed());
            if peers.len() >= MAX_PEERS {
                warn!(peer = %addr, "Refused a ZMQ subscriber: the socket has {MAX_PEERS} already.");
                continue;
            }
            peers.push(Peer { tx, addr });
        }
        let subscribed = subscribed.clone();
        tokio::spawn(async move {
            let mut counted = false;
            if let Err(error) = serve(stream, rx, &subscribed, &mut counted).await {
                debug!(peer = %addr, %error, "A ZMQ subscriber connection ended.");
            }
            if counted {
                subscribed.send_modify(|n| *n = n.saturating_sub(1));
            }
        });
    }
}

/// Why a subscriber connection ended.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error("socket error: {0}")]
    Io(#[from] std::io::Error),
    #[error("ZMTP violation: {0}")]
    Zmtp(#[from] continuum_protocol::zmtp::publisher::ZmtpPubError),
    #[error("a write stalled for {WRITE_TIMEOUT:?}")]
    Stalled,
    #[error("the peer closed the connection")]
    Closed,
}

async fn write(stream: &mut TcpStream, bytes: &[u8]) -> Result<(), PeerError> {
    tokio::time::timeout(WRITE_TIMEOUT, stream.write_all(bytes))
        .await
        .map_err(|_| PeerError::Stalled)??;
    Ok(())
}

async fn serve(
    mut stream: TcpStream,
    mut rx: mpsc::Receiver<Outgoing>,
    subscribed: &watch::Sender<usize>,
    counted: &mut bool,
) -> Result<(), PeerError> {
    let _ = stream.set_nodelay(true);
    let mut zmtp = ZmtpPub::new();
    let mut buf = [0u8; READ_BUFFER];
    let mut out = Vec::with_capacity(64);
    loop {
        zmtp.take_outgoing(&mut out);
        if !out.is_empty() {
            write(&mut stream, &out).await?;
            out.clear();
        }
        tokio::select! {
            read = stream.read(&mut buf) => {
                let n = read?;
                if n == 0 {
                    return Err(PeerError::Closed);
                }
                zmtp.handle_input(&buf[..n])?;
                let has = !zmtp.subscriptions().is_empty();
                if has != *counted {
                    *counted = has;
                    subscribed.send_modify(|n| if has { *n += 1 } else { *n = n.saturating_sub(1) });
                }
            }
            message = rx.recv() => {
                // The socket was dropped (or dropped this peer as too slow).
                let Some(message) = message else { return Ok(()) };
                if zmtp.matches(&message.0) {
                    write(&mut stream, &message.1).await?;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use continuum_protocol::event_plane::encode::encode_kv_metrics;
    use continuum_protocol::event_plane::{ActiveLoad, decode_kv_metrics};
    use continuum_protocol::ids::{DpRank, InstanceId, PublisherId};
    use continuum_protocol::time::UnixMillis;
    use continuum_protocol::zmtp::{ZmtpLimits, ZmtpSub};

    #[tokio::test]
    async fn a_sub_over_tcp_receives_what_is_published_after_it_subscribed() {
        let socket = PubSocket::bind("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let mut stream = TcpStream::connect(socket.local_addr()).await.unwrap();
        let mut sub = ZmtpSub::new(b"kv_metrics", ZmtpLimits::KV_METRICS).unwrap();
        let publisher = PublisherId(77);
        let load = ActiveLoad {
            worker_id: InstanceId(5),
            dp_rank: DpRank(0),
            active_decode_blocks: Some(3),
            active_prefill_tokens: Some(0),
            kv_used_blocks: Some(3),
        };
        let mut buf = [0u8; 2048];
        let mut subscribed = socket.subscribed();
        let delivered = tokio::time::timeout(Duration::from_secs(10), async {
            // Handshake until our subscription is on the wire.
            loop {
                let mut out = Vec::new();
                sub.take_outgoing(&mut out);
                stream.write_all(&out).await.unwrap();
                if sub.is_open() && sub.poll_transmit().is_none() {
                    break;
                }
                let n = stream.read(&mut buf).await.unwrap();
                assert!(n > 0, "publisher closed");
                sub.feed(&buf[..n], |_| panic!("no data before subscribing"))
                    .unwrap();
            }
            subscribed.wait_for(|n| *n == 1).await.unwrap();
            socket.send(&encode_kv_metrics(publisher, 0, UnixMillis(1), &load));
            loop {
                let n = stream.read(&mut buf).await.unwrap();
                assert!(n > 0, "publisher closed");
                let mut got = Vec::new();
                sub.feed(&buf[..n], |d| got.push(d)).unwrap();
                if let Some(delivery) = got.into_iter().next() {
                    return decode_kv_metrics(&delivery, publisher).unwrap();
                }
            }
        })
        .await
        .expect("a message within 10 s");
        assert_eq!(delivered.load, load);
        assert_eq!(socket.peer_count(), 1);
    }

    #[tokio::test]
    async fn a_subscriber_that_stops_reading_is_dropped_not_buffered() {
        let socket = PubSocket::bind("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let mut stream = TcpStream::connect(socket.local_addr()).await.unwrap();
        let mut sub = ZmtpSub::new(b"big", ZmtpLimits::KV_METRICS).unwrap();
        let mut buf = [0u8; 256];
        loop {
            let mut out = Vec::new();
            sub.take_outgoing(&mut out);
            stream.write_all(&out).await.unwrap();
            if sub.is_open() && sub.poll_transmit().is_none() {
                break;
            }
            let n = stream.read(&mut buf).await.unwrap();
            sub.feed(&buf[..n], |_| {}).unwrap();
        }
        socket.subscribed().wait_for(|n| *n == 1).await.unwrap();
        // The subscriber never reads again: the kernel buffers fill, then its queue, then it is
        // dropped. Bounded: at most this many 64 KiB messages are ever offered.
        let frame = vec![0u8; 64 * 1024];
        let mut sent = 0;
        while socket.peer_count() == 1 {
            assert!(sent < 20_000, "the slow subscriber was never dropped");
            socket.send(&[b"big".as_slice(), &frame]);
            sent += 1;
            tokio::task::yield_now().await;
        }
        assert!(sent > PEER_QUEUE);
    }
}
