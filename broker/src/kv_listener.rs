//! The kv_listener push role (`continuum-kv-listener`): per announced source, a kv-events
//! subscription to the backend's event-plane ZMQ publisher (the bounded ZMTP client the router
//! uses, `continuum_actors::zmtp_conn`), a replay ring of numbered SSE events, and the data
//! streams the router commands with `announced_source` targets.
//!
//! Event ids are `epoch << 40 | sequence` (`protocol::event_bus::sse`): the epoch is drawn at
//! start, so an id of another agent or an earlier incarnation is told apart from this one's. A
//! subscribe with `last_event_id` of this epoch that the ring still covers resumes exactly after
//! it; otherwise the stream starts with a `reset` event and the whole ring (the router's per-rank
//! `event_id` cursors skip what it already applied and clear a rank whose events are missing).
//! Without `last_event_id` the stream starts at the oldest batch the ring holds.
//!
//! Bounds: the ring holds at most `--replay-events` batches per source (each at most one decoded
//! kv-events message, ≤ 8,192 blocks); a stream holds one queued chunk towards the router (hyper
//! sends as the router's window opens) and reads the ring under a short lock.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use continuum_actors::zmtp_conn::{CONNECT_TIMEOUT, ConnEvent, ZmtpConnConfig, run_session};
use continuum_protocol::backoff::Backoff;
use continuum_protocol::event_bus::message::{StreamCloseReason, StreamId};
use continuum_protocol::event_bus::sse::{
    Reset, ResetReason, encode_kv_events, encode_reset, event_id, split_event_id,
};
use continuum_protocol::event_plane::{StreamExpectation, decode_delivery};
use continuum_protocol::kv::events::{KvEventsError, decode_router_events};
use continuum_protocol::zmtp::ZmtpLimits;
use http_body_util::BodyExt as _;
use ipnet::IpNet;
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};

use crate::config::KvSource;
use crate::metrics::Metrics;
use crate::relay::{OpenStream, RelayEnd, StreamGauge, StreamOpener};

/// One source's numbered batches.
#[derive(Debug)]
struct Ring {
    /// (event id, the rendered SSE event).
    events: VecDeque<(u64, Bytes)>,
    capacity: usize,
    next_sequence: u64,
}

/// One announced source: its ring, and a watch of the newest id (0: none yet).
#[derive(Debug)]
pub struct Feed {
    pub backend: String,
    epoch: u64,
    ring: Mutex<Ring>,
    head: watch::Sender<u64>,
}

/// Where a served stream starts.
#[derive(Debug, PartialEq, Eq)]
pub enum Start {
    /// Resume exactly after `last_event_id` (the next id to send).
    Exact(u64),
    /// No `last_event_id`: from the oldest batch held.
    Fresh,
    /// A reset first, then from the oldest batch held.
    Reset(ResetReason),
}

impl Feed {
    pub fn new(backend: String, epoch: u64, capacity: usize) -> Self {
        Self {
            backend,
            epoch,
            ring: Mutex::new(Ring {
                events: VecDeque::with_capacity(capacity.min(1024)),
                capacity,
                next_sequence: 1,
            }),
            head: watch::channel(0).0,
        }
    }

    /// Numbers and keeps one batch (the oldest leaves a full ring).
    pub fn push(&self, events: &[continuum_protocol::kv::events::RouterEvent]) -> u64 {
        let Ok(mut ring) = self.ring.lock() else {
            return 0;
        };
        let id = event_id(self.epoch, ring.next_sequence);
        ring.next_sequence += 1;
        if ring.events.len() == ring.capacity {
            ring.events.pop_front();
        }
        ring.events
            .push_back((id, Bytes::from(encode_kv_events(id, events))));
        drop(ring);
        self.head.send_replace(id);
        id
    }

    /// Where a stream subscribed with `last_event_id` starts.
    pub fn start(&self, last_event_id: Option<u64>) -> Start {
        let Some(last) = last_event_id else {
            return Start::Fresh;
        };
        let Ok(ring) = self.ring.lock() else {
            return Start::Reset(ResetReason::Evicted);
        };
        let (epoch, sequence) = split_event_id(last);
        if epoch != self.epoch & 0xff_ffff || sequence >= ring.next_sequence {
            return Start::Reset(ResetReason::UnknownEpoch);
        }
        let oldest = ring
            .events
            .front()
            .map_or(ring.next_sequence, |(id, _)| split_event_id(*id).1);
        // Exact when the ring holds everything after `last` (or nothing came after it).
        if sequence + 1 >= oldest {
            Start::Exact(last + 1)
        } else {
            Start::Reset(ResetReason::Evicted)
        }
    }

    /// Events with id ≥ `from`, at most `max` of them; `Err(oldest)` when `from` left the ring.
    fn read_from(&self, from: u64, max: usize) -> Result<Vec<(u64, Bytes)>, Option<u64>> {
        let Ok(ring) = self.ring.lock() else {
            return Ok(vec![]);
        };
        let oldest = ring.events.front().map(|(id, _)| *id);
        if let Some(oldest) = oldest
            && from < oldest
            && from != 0
        {
            return Err(Some(oldest));
        }
        // Ids increase along the ring: skip what is older than `from`.
        let skip = ring.events.partition_point(|(id, _)| *id < from);
        Ok(ring.events.iter().skip(skip).take(max).cloned().collect())
    }

    fn oldest(&self) -> Option<u64> {
        self.ring
            .lock()
            .ok()
            .and_then(|r| r.events.front().map(|(id, _)| *id))
    }
}

/// Every announced source's feed, by backend.
pub type Feeds = BTreeMap<String, Arc<Feed>>;

/// A random 24-bit epoch from the TLS stack's CSPRNG (the clock if that fails).
pub fn draw_epoch() -> u64 {
    let mut bytes = [0u8; 8];
    if rustls::crypto::ring::default_provider()
        .secure_random
        .fill(&mut bytes)
        .is_err()
    {
        return std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
            & 0xff_ffff;
    }
    u64::from_be_bytes(bytes) & 0xff_ffff
}

/// Starts one kv-events subscription per source; they run until aborted. `allow_cidrs`
/// (`--allow-cidr`) is the router's `direct_allow_cidrs` dial rule: the same ZMTP client resolves
/// each source once and dials only an allowed address.
pub fn spawn_sources(
    sources: &[KvSource],
    allow_cidrs: Option<&Vec<IpNet>>,
    feeds: &Feeds,
    metrics: Metrics,
) -> Vec<tokio::task::JoinHandle<()>> {
    if allow_cidrs.is_none() {
        warn!(
            "No --allow-cidr: the sources' publishers are dialled at any address they resolve to; \
             list the worker Pod CIDRs."
        );
    }
    sources
        .iter()
        .filter_map(|source| {
            let feed = feeds.get(&source.backend)?.clone();
            let config = source_config(source, allow_cidrs.cloned());
            let (source, metrics) = (source.clone(), metrics.clone());
            Some(tokio::spawn(run_source(source, config, feed, metrics)))
        })
        .collect()
}

/// One source's kv-events subscription, with production bounds and the dial allowlist.
pub fn source_config(source: &KvSource, allow_cidrs: Option<Vec<IpNet>>) -> ZmtpConnConfig {
    ZmtpConnConfig {
        publisher_id: source.publisher_id,
        endpoint: source.endpoint.clone(),
        topic: b"kv-events".to_vec(),
        limits: ZmtpLimits::KV_EVENTS,
        allow_cidrs,
        connect_timeout: CONNECT_TIMEOUT,
    }
}

async fn run_source(source: KvSource, config: ZmtpConnConfig, feed: Arc<Feed>, metrics: Metrics) {
    let mut backoff = Backoff::new(crate::agent::REDIAL);
    loop {
        let (tx, mut rx) = mpsc::channel(1);
        let session = {
            let config = config.clone();
            tokio::spawn(async move { run_session(&config, &tx).await })
        };
        let mut connected_at = None;
        while let Some(event) = rx.recv().await {
            match event {
                ConnEvent::Connected { .. } => {
                    info!(backend = %source.backend, endpoint = %source.endpoint, "Reading the source's kv-events.");
                    metrics.sources_connected.inc();
                    connected_at = Some(tokio::time::Instant::now());
                }
                ConnEvent::Delivery(delivery) => {
                    let result = match decode_delivery(
                        &delivery,
                        StreamExpectation::kv_events(source.publisher_id),
                    ) {
                        Ok(envelope) => match decode_router_events(envelope.payload) {
                            Ok(events) => {
                                feed.push(&events);
                                "accepted"
                            }
                            Err(KvEventsError::OverCapacity) => "over_capacity",
                            Err(KvEventsError::Malformed(_)) => "malformed",
                        },
                        Err(error) => match error.result() {
                            continuum_protocol::event_plane::LoadEventResult::Oversized => {
                                "oversized"
                            }
                            _ => "malformed",
                        },
                    };
                    metrics.source_events.with_label_values(&[result]).inc();
                }
            }
        }
        let ended = session.await;
        if connected_at.is_some() {
            metrics.sources_connected.dec();
        }
        if let Ok(Err(error)) = ended {
            // Policy refusals and protocol violations count, as the router counts its own.
            if error.counted_result().is_some() {
                metrics
                    .source_events
                    .with_label_values(&["transport_refused"])
                    .inc();
            }
            warn!(backend = %source.backend, %error, "The source's kv-events subscription ended.");
        }
        let lasted = connected_at.map_or(Duration::ZERO, |at| at.elapsed());
        let delay = backoff.session_ended(lasted, crate::agent::REDIAL_RESET_AFTER, 0.5);
        tokio::time::sleep(delay).await;
    }
}

/// What serving one stream needs.
pub struct ServeArgs {
    pub opener: StreamOpener,
    pub feed: Arc<Feed>,
    pub last_event_id: Option<u64>,
    pub metrics: Metrics,
}

/// Batches copied out of the ring per wake-up.
const READ_BATCH: usize = 64;

/// Opens `POST /bus/v1/streams/{id}` and writes the feed as SSE until unsubscribed.
pub async fn serve(args: ServeArgs) -> RelayEnd {
    let stream_id = args.opener.stream_id;
    let start = args.feed.start(args.last_event_id);
    let OpenStream {
        to_router: tx,
        from_router: mut body,
    } = match args.opener.open(Some("text/event-stream")).await {
        Ok(stream) => stream,
        Err(refusal) => return refusal,
    };
    let label = match &start {
        Start::Exact(_) => "exact",
        Start::Fresh => "fresh",
        Start::Reset(reason) => reason.as_str(),
    };
    args.metrics.stream_starts.with_label_values(&[label]).inc();
    debug!(stream = %stream_id, backend = %args.feed.backend, start = label, "Serving a kv-events stream.");
    let _guard = StreamGauge::start(&args.metrics);
    let bytes_out = args.metrics.relayed_bytes.with_label_values(&["to_router"]);
    let feed = args.feed;
    let mut head = feed.head.subscribe();
    let mut next = match start {
        Start::Exact(next) => next,
        Start::Fresh => 0,
        Start::Reset(reason) => {
            let reset = Reset {
                reason,
                oldest_event_id: feed.oldest(),
            };
            if tx.send(Bytes::from(encode_reset(&reset))).await.is_err() {
                return ended(stream_id);
            }
            0
        }
    };
    let write = async {
        loop {
            head.borrow_and_update();
            match feed.read_from(next, READ_BATCH) {
                Ok(batch) if batch.is_empty() => {
                    if head.changed().await.is_err() {
                        return;
                    }
                }
                Ok(batch) => {
                    for (id, bytes) in batch {
                        let n = bytes.len() as u64;
                        if tx.send(bytes).await.is_err() {
                            return;
                        }
                        bytes_out.inc_by(n);
                        next = id + 1;
                    }
                }
                Err(oldest) => {
                    let reset = Reset {
                        reason: ResetReason::Lagged,
                        oldest_event_id: oldest,
                    };
                    if tx.send(Bytes::from(encode_reset(&reset))).await.is_err() {
                        return;
                    }
                    next = oldest.unwrap_or(0);
                }
            }
        }
    };
    // The router sends nothing on this stream; its end (or an error) ends the serving.
    let read = async { while let Some(Ok(_)) = body.frame().await {} };
    tokio::select! {
        () = write => {}
        () = read => {}
    }
    ended(stream_id)
}

fn ended(stream_id: StreamId) -> RelayEnd {
    RelayEnd {
        stream_id,
        started: true,
        reason: StreamCloseReason::StreamFailed,
        message: Some("the router ended the data stream".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resumes_exactly_inside_the_ring_and_resets_outside_it() {
        let feed = Feed::new("vllm-1".into(), 0x1234, 16);
        assert_eq!(feed.start(None), Start::Fresh);
        assert_eq!(
            feed.start(Some(event_id(0x1234, 0))),
            Start::Exact(event_id(0x1234, 1)),
            "nothing yet: id 0 of this epoch resumes at the first"
        );
        let ids: Vec<u64> = (0..20).map(|_| feed.push(&[])).collect();
        // The ring holds the last 16: sequences 5..=20.
        assert_eq!(feed.start(Some(ids[3])), Start::Exact(ids[4]));
        assert_eq!(feed.start(Some(ids[2])), Start::Reset(ResetReason::Evicted));
        assert_eq!(feed.start(Some(ids[19])), Start::Exact(ids[19] + 1));
        assert_eq!(
            feed.start(Some(ids[19] + 1)),
            Start::Reset(ResetReason::UnknownEpoch),
            "an id ahead of this incarnation"
        );
        assert_eq!(
            feed.start(Some(event_id(0x4321, 7))),
            Start::Reset(ResetReason::UnknownEpoch)
        );
        let got = feed.read_from(ids[10], 3).expect("in the ring");
        assert_eq!(
            got.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
            ids[10..13]
        );
        assert_eq!(feed.read_from(ids[1], 3), Err(Some(ids[4])));
        assert_eq!(feed.read_from(0, 1).expect("fresh")[0].0, ids[4]);
    }
}
