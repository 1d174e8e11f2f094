//! One discovery pass: connect, stream the range gets at one revision, then fold the watches.
//!
//! Only two RPC families are issued: range gets (`KvClient::get`) and watches
//! (`WatchClient::watch`). The pass keeps the `Client` only to hold the channel open.
//!
//! The snapshot is streamed: `Init` goes out once the first page arrived, each page's records
//! as that page arrives (the reducer parses page n while etcd serves page n + 1), `InitDone`
//! after the last page of the last prefix. A pass that fails after `Init` simply ends; the next
//! pass's `Init` makes the reducer discard the partial resync.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use continuum_protocol::discovery::SourceEvent;
use etcd_client::{
    Certificate, Client, ConnectOptions, EventType, GetOptions, GetResponse, Identity, KvClient,
    TlsOptions, WatchClient, WatchOptions, WatchResponse, WatchStream,
};
use futures::stream::{self, BoxStream, StreamExt};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::EtcdSourceError;
use super::config::{EtcdAuth, EtcdSourceConfig, EtcdTls};
use continuum_protocol::discovery::keys::WatchedPrefix;

/// Dial, optional Authenticate, the range gets and handing their records over share this bound;
/// so does opening the watches. The watch streams themselves are unbounded.
pub const SEED_TIMEOUT: Duration = Duration::from_secs(30);

/// Per-endpoint TCP (and TLS) dial bound, so a blackholed member leaves time for the next.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Keys per range-get page at first. A page of 2,048 typical cards is a few MB, far under the
/// decoding limit; a page above it halves the limit (down to one key) and is read again.
const PAGE_SIZE: i64 = 2048;

/// Largest gRPC message accepted: four times the reducer's 16 MiB record ceiling, so one page of
/// typical cards or one oversized record (which the reducer then refuses and counts) fits.
const MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// Largest PEM file read for TLS material; real bundles are a few KiB.
const MAX_PEM_BYTES: u64 = 1024 * 1024;

/// HTTP/2 keep-alive, as Dynamo's own etcd client uses: a silently dead peer ends the pass.
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(15);
const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// How a pass ended.
#[derive(Debug)]
pub struct PassOutcome {
    pub end: EtcdSourceError,
    /// How long every watch was open; zero when the pass never reached its watches.
    pub watched_for: Duration,
}

impl PassOutcome {
    fn early(end: EtcdSourceError) -> Self {
        Self {
            end,
            watched_for: Duration::ZERO,
        }
    }
}

/// The seeded state of a pass: the snapshot was handed over whole.
struct Seed {
    /// Held so the balanced channel's endpoint set stays alive while the watches run.
    _client: Client,
    endpoint: String,
    watch: WatchClient,
    revision: i64,
    records: usize,
}

/// A member that answered the first range page; nothing was emitted yet.
struct Opened {
    client: Client,
    watch: WatchClient,
    pager: Pager,
    first: GetResponse,
}

/// Runs one pass to its end. Events go to `events` in order; `connected` is true while every
/// watch is open.
pub async fn run_pass(
    cfg: &EtcdSourceConfig,
    endpoints: &[String],
    prefixes: &[WatchedPrefix],
    cursor: &AtomicUsize,
    events: &mpsc::Sender<SourceEvent>,
    connected: &watch::Sender<bool>,
) -> PassOutcome {
    let seeded =
        tokio::time::timeout(SEED_TIMEOUT, seed(cfg, endpoints, cursor, prefixes, events)).await;
    let seed = match seeded {
        Ok(Ok(seed)) => seed,
        Ok(Err(error)) => return PassOutcome::early(error),
        Err(_) => return PassOutcome::early(EtcdSourceError::SeedTimeout(SEED_TIMEOUT)),
    };
    let outcome = watch_phase(cfg, seed, prefixes, events, connected).await;
    // The member may be what failed: the next pass starts with the next one.
    cursor.fetch_add(1, Ordering::Relaxed);
    outcome
}

/// Opens the watches and folds them until the pass ends.
async fn watch_phase(
    cfg: &EtcdSourceConfig,
    seed: Seed,
    prefixes: &[WatchedPrefix],
    events: &mpsc::Sender<SourceEvent>,
    connected: &watch::Sender<bool>,
) -> PassOutcome {
    let Seed {
        _client,
        endpoint,
        mut watch,
        revision,
        records: record_count,
    } = seed;

    // The snapshot went out before the watches open: a slow consumer delays the watches, and
    // if etcd compacts past `revision` meanwhile the watch is refused and the next pass resyncs.
    let opened = tokio::time::timeout(
        SEED_TIMEOUT,
        open_watches(&mut watch, prefixes, revision.saturating_add(1)),
    )
    .await;
    let mut merged = match opened {
        Ok(Ok(merged)) => merged,
        Ok(Err(error)) => return PassOutcome::early(error),
        Err(_) => return PassOutcome::early(EtcdSourceError::WatchOpenTimeout(SEED_TIMEOUT)),
    };

    let started = Instant::now();
    connected.send_replace(true);
    info!(
        revision,
        records = record_count,
        endpoint = %endpoint,
        namespace = %cfg.namespace,
        "Connected to etcd, seeded discovery and opened the watches."
    );

    let end = loop {
        let item = tokio::select! {
            item = merged.next() => item,
            () = events.closed() => break EtcdSourceError::ConsumerGone,
        };
        let Some((index, item)) = item else {
            // Every stream ends with its own `None` marker first; this is unreachable in
            // practice but still a clean end.
            break EtcdSourceError::WatchClosed { prefix: "all" };
        };
        let kind = prefixes.get(index).map_or("unknown", |p| p.kind);
        let response = match item {
            Some(Ok(response)) => response,
            Some(Err(source)) => {
                break EtcdSourceError::Watch {
                    prefix: kind,
                    source,
                };
            }
            None => break EtcdSourceError::WatchClosed { prefix: kind },
        };
        match fold_response(kind, &response) {
            Ok(folded) => {
                if let Err(end) = send_all(events, folded).await {
                    break end;
                }
            }
            Err(end) => break end,
        }
    };
    PassOutcome {
        end,
        watched_for: started.elapsed(),
    }
}

/// Seeds from the first endpoint that answers a range page, starting at `cursor`, which then
/// points at it, and streams the snapshot from that member.
///
/// One endpoint per pass: etcd-client balances every RPC over all its endpoints, so one dead
/// member would fail a share of the range gets and watches of every pass. Trying members in
/// turn fails over at once instead. Failover stops once `Init` went out: a later failure ends
/// the pass, and the next one starts after the member that failed.
async fn seed(
    cfg: &EtcdSourceConfig,
    endpoints: &[String],
    cursor: &AtomicUsize,
    prefixes: &[WatchedPrefix],
    events: &mpsc::Sender<SourceEvent>,
) -> Result<Seed, EtcdSourceError> {
    let options = connect_options(cfg).await?;
    let (endpoint, opened) = open_first(endpoints, cursor, &options, prefixes).await?;
    let Opened {
        client,
        watch,
        mut pager,
        first,
    } = opened;
    let streamed = stream_snapshot(&mut pager, prefixes, first, events).await;
    let records = match streamed {
        Ok(records) => records,
        Err(error) => {
            cursor.fetch_add(1, Ordering::Relaxed);
            return Err(error);
        }
    };
    let revision = pager.revision.ok_or(EtcdSourceError::MissingHeader)?;
    Ok(Seed {
        _client: client,
        endpoint: endpoint.to_owned(),
        watch,
        revision,
        records,
    })
}

/// The first member, from `cursor` on, that connects and serves the first range page.
async fn open_first<'a>(
    endpoints: &'a [String],
    cursor: &AtomicUsize,
    options: &ConnectOptions,
    prefixes: &[WatchedPrefix],
) -> Result<(&'a str, Opened), EtcdSourceError> {
    let start = cursor.load(Ordering::Relaxed);
    let mut last_error =
        EtcdSourceError::Connect(etcd_client::Error::InvalidArgs("no endpoints".to_owned()));
    for attempt in 0..endpoints.len() {
        let index = (start + attempt) % endpoints.len();
        let endpoint = &endpoints[index];
        match open(endpoint, options.clone(), prefixes).await {
            Ok(opened) => {
                cursor.store(index, Ordering::Relaxed);
                return Ok((endpoint, opened));
            }
            Err(error) => {
                if endpoints.len() > 1 {
                    warn!(%error, endpoint = %endpoint, "etcd endpoint failed; trying the next one.");
                }
                last_error = error;
            }
        }
    }
    Err(last_error)
}

async fn connect_options(cfg: &EtcdSourceConfig) -> Result<ConnectOptions, EtcdSourceError> {
    let mut options = ConnectOptions::new()
        .with_keep_alive(KEEP_ALIVE_INTERVAL, KEEP_ALIVE_TIMEOUT)
        .with_connect_timeout(CONNECT_TIMEOUT);
    if let Some(EtcdAuth { username, password }) = &cfg.auth {
        options = options.with_user(username.clone(), password.clone());
    }
    if let Some(tls) = &cfg.tls {
        options = options.with_tls(tls_options(tls).await?);
    }
    Ok(options)
}

async fn open(
    endpoint: &str,
    options: ConnectOptions,
    prefixes: &[WatchedPrefix],
) -> Result<Opened, EtcdSourceError> {
    // With credentials this runs the Authenticate RPC; otherwise the dial is lazy and the
    // first range get below makes it.
    let client = Client::connect([endpoint], Some(options))
        .await
        .map_err(EtcdSourceError::Connect)?;
    let kv = client
        .kv_client()
        .max_decoding_message_size(MAX_MESSAGE_BYTES);
    let watch = client
        .watch_client()
        .max_decoding_message_size(MAX_MESSAGE_BYTES);
    let mut pager = Pager {
        kv,
        revision: None,
        limit: PAGE_SIZE,
    };
    // No prefix means no revision to start the watches from: the same end as a headerless page.
    let head = prefixes.first().ok_or(EtcdSourceError::MissingHeader)?;
    let first = pager.page(head, head.prefix.as_bytes().to_vec()).await?;
    Ok(Opened {
        client,
        watch,
        pager,
        first,
    })
}

/// Emits `Init`, every record of every prefix page by page as the pages arrive, then
/// `InitDone`; returns how many records went out.
///
/// The first page fixed the revision; every later page and prefix is read at that same
/// revision, so the snapshot is one consistent cut of all prefixes and one watch start
/// (`revision + 1`) is gapless and duplicate-free for every prefix. If that revision is
/// compacted mid-read, the page fails and so does the pass.
///
/// One page is read ahead: while page n is handed over (as fast as the reducer folds it),
/// etcd already serves page n + 1, so etcd's serving and the router's folding overlap instead
/// of taking turns. At most two pages are held at once (each under the decoding limit).
async fn stream_snapshot(
    pager: &mut Pager,
    prefixes: &[WatchedPrefix],
    first: GetResponse,
    events: &mpsc::Sender<SourceEvent>,
) -> Result<usize, EtcdSourceError> {
    send(events, SourceEvent::Init).await?;
    let mut records = 0;
    let mut at = 0;
    let mut response = first;
    while let Some(prefix) = prefixes.get(at) {
        // The read after this page: the rest of this prefix, else the next prefix from its
        // start, else none.
        let ahead = match next_from(&response) {
            Some(from) => Some((at, from)),
            None => prefixes
                .get(at + 1)
                .map(|next| (at + 1, next.prefix.as_bytes().to_vec())),
        };
        let read_ahead = async {
            match ahead {
                Some((index, from)) => Some((index, pager.page(&prefixes[index], from).await)),
                None => None,
            }
        };
        let (handed, read) = tokio::join!(hand_over(prefix.kind, response, events), read_ahead);
        records += handed?;
        match read {
            Some((index, page)) => {
                at = index;
                response = page?;
            }
            None => break,
        }
    }
    send(events, SourceEvent::InitDone).await?;
    Ok(records)
}

/// The key the page after `response` starts from, if etcd holds more of its prefix.
fn next_from(response: &GetResponse) -> Option<Vec<u8>> {
    let last = response.kvs().last().filter(|_| response.more())?;
    let mut from = last.key().to_vec();
    from.push(0);
    Some(from)
}

/// Sends one page's records as `InitApply`; returns how many went out.
async fn hand_over(
    kind: &'static str,
    mut response: GetResponse,
    events: &mpsc::Sender<SourceEvent>,
) -> Result<usize, EtcdSourceError> {
    let mut sent = 0;
    for kv in response.take_kvs() {
        let (key, value) = kv.into_key_value();
        if let Some(key) = utf8_key(kind, key) {
            send(events, SourceEvent::InitApply { key, value }).await?;
            sent += 1;
        }
    }
    Ok(sent)
}

/// Range pages of one pass: all at the first page's revision, `limit` keys at most.
struct Pager {
    kv: KvClient,
    /// Fixed by the first page's header.
    revision: Option<i64>,
    limit: i64,
}

impl Pager {
    /// One page of `prefix` from `from`. A page above the decoding limit is read again with
    /// half the limit (and the rest of the pass keeps the smaller one); one key that alone
    /// exceeds it fails the pass.
    async fn page(
        &mut self,
        prefix: &WatchedPrefix,
        from: Vec<u8>,
    ) -> Result<GetResponse, EtcdSourceError> {
        loop {
            let mut options = GetOptions::new()
                .with_range(prefix.range_end())
                .with_limit(self.limit);
            if let Some(at) = self.revision {
                options = options.with_revision(at);
            }
            match self.kv.get(from.clone(), Some(options)).await {
                Ok(response) => return self.pinned(response),
                Err(source) if self.limit > 1 && is_message_too_large(&source) => {
                    self.limit /= 2;
                    debug!(
                        prefix = prefix.kind,
                        limit = self.limit,
                        "An etcd range page exceeded the decoding limit; halved the page."
                    );
                }
                Err(source) => {
                    return Err(EtcdSourceError::Range {
                        prefix: prefix.kind,
                        source,
                    });
                }
            }
        }
    }

    /// Fixes the revision from the first page's header.
    fn pinned(&mut self, response: GetResponse) -> Result<GetResponse, EtcdSourceError> {
        if self.revision.is_none() {
            let header = response.header().ok_or(EtcdSourceError::MissingHeader)?;
            self.revision = Some(header.revision());
        }
        Ok(response)
    }
}

/// True for tonic's refusal of a response above `max_decoding_message_size`. Matched on the
/// message: its status code (`OutOfRange`) is also etcd's "future revision".
fn is_message_too_large(error: &etcd_client::Error) -> bool {
    matches!(error, etcd_client::Error::GRpcStatus(status)
        if status.message().contains("decoded message length too large"))
}

async fn tls_options(tls: &EtcdTls) -> Result<TlsOptions, EtcdSourceError> {
    let mut options = TlsOptions::new();
    if let Some(ca) = &tls.ca_cert {
        options = options.ca_certificate(Certificate::from_pem(read_pem(ca).await?));
    }
    if let (Some(cert), Some(key)) = (&tls.client_cert, &tls.client_key) {
        options = options.identity(Identity::from_pem(
            read_pem(cert).await?,
            read_pem(key).await?,
        ));
    }
    if let Some(name) = &tls.server_name {
        options = options.domain_name(name.clone());
    }
    Ok(options)
}

async fn read_pem(path: &Path) -> Result<Vec<u8>, EtcdSourceError> {
    let tls_error = |source| EtcdSourceError::ReadTls {
        path: path.to_owned(),
        source,
    };
    let len = tokio::fs::metadata(path).await.map_err(tls_error)?.len();
    if len > MAX_PEM_BYTES {
        return Err(EtcdSourceError::TlsFileTooLarge {
            path: path.to_owned(),
            len,
        });
    }
    tokio::fs::read(path).await.map_err(tls_error)
}

/// Tagged watch responses; each stream ends with a `None` so its end is visible.
type Merged = BoxStream<'static, (usize, Option<Result<WatchResponse, etcd_client::Error>>)>;

async fn open_watches(
    client: &mut WatchClient,
    prefixes: &[WatchedPrefix],
    start_revision: i64,
) -> Result<Merged, EtcdSourceError> {
    let mut tagged = Vec::with_capacity(prefixes.len());
    for (index, prefix) in prefixes.iter().enumerate() {
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(start_revision);
        let mut stream: WatchStream = client
            .watch(prefix.prefix.clone(), Some(options))
            .await
            .map_err(|source| EtcdSourceError::Watch {
                prefix: prefix.kind,
                source,
            })?;
        // etcd acknowledges a watch with a `created` response; a refused start revision
        // (compacted) shows up as a cancel right after it and is folded like any other.
        let first = stream
            .message()
            .await
            .map_err(|source| EtcdSourceError::Watch {
                prefix: prefix.kind,
                source,
            })?
            .ok_or(EtcdSourceError::WatchClosed {
                prefix: prefix.kind,
            })?;
        fold_response(prefix.kind, &first)?;
        debug!(
            prefix = %prefix.prefix,
            watch_id = first.watch_id(),
            start_revision,
            "Opened an etcd watch."
        );
        let rest = stream
            .map(move |item| (index, Some(item)))
            .chain(stream::once(async move { (index, None) }));
        // The first response may already carry events; keep them in order.
        let head = stream::once(async move { (index, Some(Ok(first))) });
        tagged.push(head.chain(rest).boxed());
    }
    Ok(stream::select_all(tagged).boxed())
}

/// Turns one watch response into source events, or the reason the pass must end.
pub fn fold_response(
    kind: &'static str,
    response: &WatchResponse,
) -> Result<Vec<SourceEvent>, EtcdSourceError> {
    let compact_revision = response.compact_revision();
    if compact_revision != 0 {
        return Err(EtcdSourceError::Compacted {
            prefix: kind,
            compact_revision,
        });
    }
    if response.canceled() {
        return Err(EtcdSourceError::WatchCanceled {
            prefix: kind,
            reason: response.cancel_reason().to_owned(),
        });
    }
    let mut out = Vec::with_capacity(response.events().len());
    for event in response.events() {
        let Some(kv) = event.kv() else {
            continue;
        };
        let Some(key) = utf8_key(kind, kv.key().to_vec()) else {
            continue;
        };
        out.push(match event.event_type() {
            EventType::Put => SourceEvent::Apply {
                key,
                value: kv.value().to_vec(),
            },
            EventType::Delete => SourceEvent::Delete { key },
        });
    }
    Ok(out)
}

fn utf8_key(kind: &'static str, key: Vec<u8>) -> Option<String> {
    match String::from_utf8(key) {
        Ok(key) => Some(key),
        Err(error) => {
            // Dynamo writes ASCII keys; anything else is not a Dynamo record.
            warn!(
                prefix = kind,
                key_len = error.as_bytes().len(),
                "Skipped an etcd key that is not UTF-8."
            );
            None
        }
    }
}

async fn send_all(
    events: &mpsc::Sender<SourceEvent>,
    folded: Vec<SourceEvent>,
) -> Result<(), EtcdSourceError> {
    for event in folded {
        send(events, event).await?;
    }
    Ok(())
}

async fn send(
    events: &mpsc::Sender<SourceEvent>,
    event: SourceEvent,
) -> Result<(), EtcdSourceError> {
    events
        .send(event)
        .await
        .map_err(|_| EtcdSourceError::ConsumerGone)
}
