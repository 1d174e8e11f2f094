//! KvPushActor: the router side of the kv_listener push role (docs/event-bus.md,
//! "continuum-kv-listener"). For every `kv_cache_index` source with `transport: event_bus` it
//! opens the backend's SSE stream through a [`KvEventStreamOpener`] (the [`EventBus`]'s
//! `open_announced_stream`), parses it with the bounded `protocol::event_bus::sse` parser and
//! hands each batch to the SAME [`SharedKvIndex`] the direct kv-events subscriptions feed (its
//! per-rank `event_id` cursors skip replays and clear a rank on a gap; a source down for
//! `CLEAR_DOWN_AFTER` loses its ranks).
//!
//! Resume: the id of the last applied SSE event is kept per backend in [`KvPushCursors`], outside
//! the actor, and sent as `last_event_id` on every reopen — after a session drop, a draining
//! agent (the router cuts its streams at once and the next open goes to another session) or a
//! restart of this actor. The same agent resumes exactly; another one answers with a `reset` and
//! its whole replay ring, whose already applied events the cursors skip.
//!
//! Waits: no live kv_listener session announces the backend → `pending`, woken by the session
//! table's watch (no polling); other failures back off 500 ms → 30 s with full jitter.
//!
//! Parent: root. Children: none (one task per source). Restart: transient; reloads restart it.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use continuum_protocol::backoff::{Backoff, BackoffPolicy, Jitter};
use continuum_protocol::event_bus::sse::MalformedReason;
use continuum_protocol::event_bus::sse::{SseItem, SseParser};
use continuum_protocol::kv::KvEventResult;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::io::{AsyncRead, AsyncReadExt as _};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use crate::event_bus::{BusStream, BusStreamError, EventBus, EventBusMetrics, SessionsView};
use crate::kv_index::{SharedKvIndex, SubscriptionName};
use crate::lifecycle::ActorKind;
use crate::lock::Mutex;
use crate::supervisor::{ChildContext, ChildSpec};

/// The actor's name under root.
pub const KV_PUSH_NAME: &str = "kv_push";
/// Reopen schedule after a failed open or an ended stream.
pub const REOPEN: BackoffPolicy = BackoffPolicy {
    initial: Duration::from_millis(500),
    max: Duration::from_secs(30),
    jitter: Jitter::Full,
};
/// A stream that lasted this long restores the reopen floor.
pub const REOPEN_RESET_AFTER: Duration = Duration::from_secs(30);
/// Bytes read from a stream at once.
const READ_CHUNK: usize = 16 * 1024;

/// Opens a backend's SSE KV-event stream, resuming after `last_event_id`.
pub trait KvEventStreamOpener: Clone + Send + Sync + 'static {
    type Stream: AsyncRead + Unpin + Send + 'static;
    fn open(
        &self,
        backend: &str,
        last_event_id: Option<u64>,
    ) -> impl Future<Output = Result<Self::Stream, BusStreamError>> + Send;
    /// A watch that changes whenever a session comes, goes or drains.
    fn sessions(&self) -> watch::Receiver<SessionsView>;
    fn metrics(&self) -> Option<EventBusMetrics>;
}

impl KvEventStreamOpener for EventBus {
    type Stream = BusStream;

    async fn open(
        &self,
        backend: &str,
        last_event_id: Option<u64>,
    ) -> Result<BusStream, BusStreamError> {
        self.open_announced_stream(backend, last_event_id).await
    }

    fn sessions(&self) -> watch::Receiver<SessionsView> {
        self.subscribe_sessions()
    }

    fn metrics(&self) -> Option<EventBusMetrics> {
        EventBus::metrics(self).cloned()
    }
}

/// The last applied SSE event id per backend; survives actor restarts and reloads.
#[derive(Clone, Debug, Default)]
pub struct KvPushCursors(Arc<Mutex<HashMap<String, u64>>>);

impl KvPushCursors {
    pub fn get(&self, backend: &str) -> Option<u64> {
        self.0.lock().get(backend).copied()
    }

    fn set(&self, backend: &str, id: u64) {
        self.0.lock().insert(backend.to_owned(), id);
    }
}

/// What the actor runs with.
#[derive(Clone)]
pub struct KvPushArgs<O: KvEventStreamOpener> {
    pub opener: O,
    pub kv: SharedKvIndex,
    /// The backends of the `transport: event_bus` sources.
    pub backends: Vec<String>,
    pub cursors: KvPushCursors,
}

pub struct KvPushActor<O>(std::marker::PhantomData<O>);

impl<O> KvPushActor<O> {
    pub fn new() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<O> Default for KvPushActor<O> {
    fn default() -> Self {
        Self::new()
    }
}

pub struct KvPushState {
    tasks: Vec<JoinHandle<()>>,
}

impl<O: KvEventStreamOpener> Actor for KvPushActor<O> {
    type Msg = ();
    type State = KvPushState;
    type Arguments = KvPushArgs<O>;

    async fn pre_start(
        &self,
        _myself: ActorRef<()>,
        args: KvPushArgs<O>,
    ) -> Result<KvPushState, ActorProcessingErr> {
        let tasks = args
            .backends
            .iter()
            .map(|backend| tokio::spawn(run_source(args.clone(), backend.clone())))
            .collect();
        Ok(KvPushState { tasks })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<()>,
        state: &mut KvPushState,
    ) -> Result<(), ActorProcessingErr> {
        for task in state.tasks.drain(..) {
            task.abort();
        }
        Ok(())
    }
}

/// The child spec under root: `backends()` is read at every (re)spawn, so a restart picks up
/// the live configuration.
pub fn kv_push_spec<O: KvEventStreamOpener>(
    opener: O,
    kv: SharedKvIndex,
    cursors: KvPushCursors,
    backends: impl Fn() -> Vec<String> + Send + Sync + 'static,
) -> ChildSpec {
    let backends = Arc::new(backends);
    ChildSpec::new(KV_PUSH_NAME, ActorKind::KvPush, move |ctx: ChildContext| {
        let args = KvPushArgs {
            opener: opener.clone(),
            kv: kv.clone(),
            backends: backends(),
            cursors: cursors.clone(),
        };
        async move {
            let (actor, _) =
                Actor::spawn_linked(None, KvPushActor::<O>::new(), args, ctx.supervisor).await?;
            Ok(actor.get_cell())
        }
    })
}

/// Tracks one source's state gauge.
struct State {
    metrics: Option<EventBusMetrics>,
    now: Option<&'static str>,
}

impl State {
    fn set(&mut self, to: &'static str) {
        if self.now == Some(to) {
            return;
        }
        if let Some(metrics) = &self.metrics {
            metrics.kv_listener_source_state(self.now, Some(to));
        }
        self.now = Some(to);
    }
}

impl Drop for State {
    fn drop(&mut self) {
        if let Some(metrics) = &self.metrics {
            metrics.kv_listener_source_state(self.now, None);
        }
    }
}

/// The kv-index subscription name of a pushed source.
pub fn subscription_name(backend: &str) -> SubscriptionName {
    Arc::from(format!("kv_listener:{backend}"))
}

async fn run_source<O: KvEventStreamOpener>(args: KvPushArgs<O>, backend: String) {
    let name = subscription_name(&backend);
    let metrics = args.opener.metrics();
    let mut state = State {
        metrics: metrics.clone(),
        now: None,
    };
    let mut sessions = args.opener.sessions();
    let mut backoff = Backoff::new(REOPEN);
    loop {
        state.set("connecting");
        sessions.borrow_and_update();
        let last = args.cursors.get(&backend);
        let lasted = match args.opener.open(&backend, last).await {
            Ok(stream) => {
                state.set("connected");
                // The live-worker gate applies the current fleet before the first batch.
                args.kv.reconcile().await;
                args.kv.subscription_state(&name, true);
                info!(%backend, last_event_id = ?last, "Reading the backend's KV events through the event bus.");
                let started = tokio::time::Instant::now();
                let end = read_stream(stream, &args, &backend, &name, metrics.as_ref()).await;
                args.kv.subscription_state(&name, false);
                debug!(%backend, ?end, "A kv_listener stream ended.");
                // Cut by the router: the agent is draining or its session ended. Reopen at
                // once (another session, or pending); the drained one takes no new streams.
                if matches!(&end, Err(e) if e.kind() == std::io::ErrorKind::ConnectionAborted) {
                    continue;
                }
                started.elapsed()
            }
            Err(BusStreamError::NoSession | BusStreamError::Busy) => {
                state.set("pending");
                args.kv.subscription_state(&name, false);
                // Wait for the session table to change (a welcome, an end, a drain).
                if sessions.changed().await.is_err() {
                    return;
                }
                continue;
            }
            Err(error) => {
                warn!(%backend, %error, "Cannot open the backend's kv_listener stream.");
                args.kv.subscription_state(&name, false);
                Duration::ZERO
            }
        };
        state.set("backoff");
        let delay = backoff.session_ended(lasted, REOPEN_RESET_AFTER, unit());
        tokio::time::sleep(delay).await;
    }
}

/// Reads one stream to its end; returns why it ended.
async fn read_stream<O: KvEventStreamOpener>(
    mut stream: O::Stream,
    args: &KvPushArgs<O>,
    backend: &str,
    name: &SubscriptionName,
    metrics: Option<&EventBusMetrics>,
) -> std::io::Result<()> {
    let mut parser = SseParser::default();
    let mut buf = vec![0u8; READ_CHUNK];
    let count = |result: &str| {
        if let Some(metrics) = metrics {
            metrics.kv_listener_sse(result);
        }
    };
    loop {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        parser.push(&buf[..n]);
        while let Some(item) = parser.next_item() {
            match item {
                SseItem::KvEvents { id, events } => {
                    count("applied");
                    args.kv.deliver_events(name, events).await;
                    if let Some(id) = id {
                        args.cursors.set(backend, id);
                    }
                }
                SseItem::Reset(reset) => {
                    count("reset");
                    info!(%backend, reason = reset.reason.as_str(), "The kv_listener could not resume exactly; its per-rank cursors skip what was applied and clear ranks with gaps.");
                }
                SseItem::Oversized => {
                    count("oversized");
                    args.kv.count_refused(KvEventResult::Oversized);
                }
                SseItem::Malformed(reason) => {
                    count("malformed");
                    args.kv.count_refused(match reason {
                        MalformedReason::OverCapacity => KvEventResult::OverCapacity,
                        _ => KvEventResult::Malformed,
                    });
                }
            }
        }
    }
}

/// A uniform draw in `[0, 1)` (the jitter's randomness; not security relevant).
fn unit() -> f64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    f64::from(nanos % 1_000_000) / 1_000_000.0
}
