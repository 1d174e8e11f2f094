//! `ReplicaSyncActor`: one task that keeps a NATS connection (async-nats: its own reconnects,
//! here with full jitter under a ceiling; subscriptions resume on reconnect), publishes this
//! replica's snapshot and merges its peers' into the ledger. See the module docs of
//! `replica_sync`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::{Client, ConnectOptions, Event};
use continuum_protocol::replica_sync::{
    DecodeError, Header, Offer, PeerLimits, PeerTable, Snapshot,
};
use futures::StreamExt as _;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use super::{ReplicaSyncMetrics, ReplicaSyncStatus, ReplicaSyncView, SyncDrop};
use crate::clock::now_tick;
use crate::lifecycle::ActorKind;
use crate::picker::SharedPicker;
use crate::supervisor::{ChildContext, ChildSpec};

/// The actor's name under root.
pub const REPLICA_SYNC_NAME: &str = "replica_sync";
/// First reconnect delay (doubled per attempt up to the configured ceiling, full jitter).
const RECONNECT_FLOOR: Duration = Duration::from_millis(100);
/// Messages the NATS client buffers for us before it counts a slow consumer.
const SUBSCRIPTION_CAPACITY: usize = 4096;
/// Outbound commands the NATS client buffers (a few seconds of snapshots while reconnecting).
const CLIENT_CAPACITY: usize = 512;
/// Secret files read at most.
const MAX_SECRET_BYTES: u64 = 64 * 1024;

/// How the connection authenticates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NatsAuth {
    None,
    /// A `.creds` file (JWT + nkey seed).
    Credentials(PathBuf),
    UserPassword {
        user: String,
        password_file: PathBuf,
    },
    Token(PathBuf),
}

/// Everything the task runs with (from `replica_sync` in the config).
#[derive(Clone, Debug)]
pub struct ReplicaSyncSettings {
    pub replica_id: String,
    pub subject: String,
    pub url: String,
    pub connect_timeout: Duration,
    pub reconnect_max_delay: Duration,
    pub tls_ca: Option<PathBuf>,
    pub tls_client: Option<(PathBuf, PathBuf)>,
    pub tls_required: bool,
    pub auth: NatsAuth,
    pub publish_interval: Duration,
    pub heartbeat_interval: Duration,
    pub limits: PeerLimits,
}

/// What the actor starts with; `settings: None` (sync disabled) starts nothing.
#[derive(Clone)]
pub struct ReplicaSyncArgs {
    pub settings: Option<ReplicaSyncSettings>,
    pub picker: SharedPicker,
    pub metrics: Option<ReplicaSyncMetrics>,
    pub view: ReplicaSyncView,
}

pub struct ReplicaSyncActor;

pub struct ReplicaSyncState {
    task: Option<JoinHandle<()>>,
    args: ReplicaSyncArgs,
}

impl Actor for ReplicaSyncActor {
    type Msg = ();
    type State = ReplicaSyncState;
    type Arguments = ReplicaSyncArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<()>,
        args: ReplicaSyncArgs,
    ) -> Result<ReplicaSyncState, ActorProcessingErr> {
        // A previous incarnation's peers are unknown to this one: start from local state only.
        args.picker.with_ledger(|l| l.withdraw_peers());
        args.view.set(ReplicaSyncStatus::default());
        let task = args.settings.clone().map(|settings| {
            info!(replica = %settings.replica_id, subject = %settings.subject, url = %settings.url, "Sharing in-flight dispatches with peer replicas.");
            tokio::spawn(run(settings, args.clone()))
        });
        Ok(ReplicaSyncState { task, args })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<()>,
        state: &mut ReplicaSyncState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(task) = state.task.take() {
            task.abort();
            let _ = task.await;
        }
        state.args.picker.with_ledger(|l| l.withdraw_peers());
        state.args.view.set(ReplicaSyncStatus::default());
        if let Some(m) = &state.args.metrics {
            m.peers.set(0);
            m.connected.set(0);
        }
        Ok(())
    }
}

/// The child spec under root: `settings()` is read at every (re)spawn.
pub fn replica_sync_spec(
    picker: SharedPicker,
    metrics: Option<ReplicaSyncMetrics>,
    view: ReplicaSyncView,
    settings: impl Fn() -> Option<ReplicaSyncSettings> + Send + Sync + 'static,
) -> ChildSpec {
    let settings = Arc::new(settings);
    ChildSpec::new(
        REPLICA_SYNC_NAME,
        ActorKind::ReplicaSync,
        move |ctx: ChildContext| {
            let args = ReplicaSyncArgs {
                settings: settings(),
                picker: picker.clone(),
                metrics: metrics.clone(),
                view: view.clone(),
            };
            async move {
                let (actor, _) =
                    Actor::spawn_linked(None, ReplicaSyncActor, args, ctx.supervisor).await?;
                Ok(actor.get_cell())
            }
        },
    )
}

/// Reads a secret file (bounded), trailing newline trimmed.
async fn read_secret(path: &PathBuf) -> std::io::Result<String> {
    use tokio::io::AsyncReadExt as _;
    let file = tokio::fs::File::open(path).await?;
    let mut text = String::new();
    file.take(MAX_SECRET_BYTES)
        .read_to_string(&mut text)
        .await?;
    Ok(text.trim_end_matches(['\r', '\n']).to_owned())
}

/// The client's options: authentication, TLS, timeouts, jittered reconnects, events counted.
async fn options(
    s: &ReplicaSyncSettings,
    metrics: Option<ReplicaSyncMetrics>,
) -> std::io::Result<ConnectOptions> {
    let mut o = match &s.auth {
        NatsAuth::Credentials(path) => ConnectOptions::with_credentials_file(path).await?,
        NatsAuth::UserPassword {
            user,
            password_file,
        } => {
            ConnectOptions::with_user_and_password(user.clone(), read_secret(password_file).await?)
        }
        NatsAuth::Token(path) => ConnectOptions::with_token(read_secret(path).await?),
        NatsAuth::None => ConnectOptions::new(),
    };
    if let Some(ca) = &s.tls_ca {
        o = o.add_root_certificates(ca.clone());
    }
    if let Some((cert, key)) = &s.tls_client {
        o = o.add_client_certificate(cert.clone(), key.clone());
    }
    let ceiling = s.reconnect_max_delay;
    Ok(o.require_tls(s.tls_required)
        .name(&s.replica_id)
        .connection_timeout(s.connect_timeout)
        .retry_on_initial_connect()
        .max_reconnects(None)
        .no_echo()
        .subscription_capacity(SUBSCRIPTION_CAPACITY)
        .client_capacity(CLIENT_CAPACITY)
        .reconnect_delay_callback(move |attempts| {
            let exp = RECONNECT_FLOOR.saturating_mul(1 << attempts.min(16) as u32);
            exp.min(ceiling).mul_f64(unit())
        })
        .event_callback(move |event| {
            let metrics = metrics.clone();
            async move {
                match event {
                    Event::SlowConsumer(_) => {
                        if let Some(m) = &metrics {
                            m.dropped(SyncDrop::SlowConsumer, 1);
                        }
                    }
                    Event::Connected => info!("Replica sync connected to NATS."),
                    Event::Disconnected => warn!(
                        "Replica sync lost its NATS connection; routing continues on local state."
                    ),
                    other => debug!(event = %other, "Replica sync NATS event."),
                }
            }
        }))
}

/// The publishing side's state.
struct Publisher {
    epoch: u64,
    seq: u64,
    content_seq: u64,
    last: Option<Snapshot>,
    last_sent: Option<tokio::time::Instant>,
}

async fn run(s: ReplicaSyncSettings, args: ReplicaSyncArgs) {
    let metrics = args.metrics.clone();
    let mut delay = RECONNECT_FLOOR;
    let client = loop {
        match options(&s, metrics.clone()).await {
            Ok(o) => match o.connect(s.url.as_str()).await {
                Ok(client) => break client,
                Err(error) => warn!(%error, "Replica sync cannot start its NATS client."),
            },
            Err(error) => warn!(%error, "Replica sync cannot read its NATS credentials."),
        }
        // Full-jitter exponential backoff between connection attempts (tokio time): nothing to
        // wait on but the clock, and replicas restarted together must not redial in step.
        tokio::time::sleep(delay.mul_f64(unit())).await;
        delay = (delay * 2).min(s.reconnect_max_delay);
    };
    let mut publisher = Publisher {
        epoch: unix_nanos(),
        seq: 0,
        content_seq: 0,
        last: None,
        last_sent: None,
    };
    let mut table = PeerTable::new(s.replica_id.clone(), s.limits);
    let mut tick = tokio::time::interval(s.publish_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        let mut subscriber = match client.subscribe(s.subject.clone()).await {
            Ok(sub) => sub,
            Err(error) => {
                warn!(%error, "Replica sync cannot subscribe; retrying.");
                // Jittered pause before re-subscribing (tokio time): the client reconnects on its
                // own; this only spaces the retries of a refused subscription.
                tokio::time::sleep(s.reconnect_max_delay.mul_f64(unit())).await;
                continue;
            }
        };
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    publish(&s, &args, &client, &mut publisher).await;
                    let now = now_tick();
                    let (_, expired) = args.picker.with_ledger(|l| table.expire(now, l));
                    if let Some(m) = &metrics {
                        m.expired.inc_by(expired as u64);
                        m.peers.set(table.len() as i64);
                        m.connected.set(i64::from(connected(&client)));
                    }
                    report(&s, &args, &client, &publisher, &table);
                }
                message = subscriber.next() => match message {
                    Some(message) => receive(&args, &mut table, &message.payload),
                    None => break,
                },
            }
        }
    }
}

fn connected(client: &Client) -> bool {
    client.connection_state() == async_nats::connection::State::Connected
}

/// Samples the ledger and publishes when the content changed or a heartbeat is due.
async fn publish(
    s: &ReplicaSyncSettings,
    args: &ReplicaSyncArgs,
    client: &Client,
    p: &mut Publisher,
) {
    let now = now_tick();
    let max = s.limits.max_entries_per_peer;
    let (local, truncated) = args.picker.with_ledger(|l| l.local_contributions(now, max));
    if truncated && let Some(m) = &args.metrics {
        m.dropped(SyncDrop::LocalTruncated, 1);
    }
    let header = |seq, content_seq| Header {
        replica: &s.replica_id,
        epoch: p.epoch,
        seq,
        content_seq,
        ttl: s.limits.ttl,
        sent_unix_ms: unix_nanos() / 1_000_000,
    };
    let candidate = Snapshot::from_local(header(p.seq + 1, p.seq + 1), &local);
    let changed = p
        .last
        .as_ref()
        .is_none_or(|last| !last.same_content(&candidate));
    let beat_due = p
        .last_sent
        .is_none_or(|at| at.elapsed() >= s.heartbeat_interval);
    if !changed && !beat_due {
        return;
    }
    p.seq += 1;
    let mut snap = candidate;
    if changed {
        p.content_seq = p.seq;
    }
    snap.content_seq = p.content_seq;
    let bytes = snap.encode();
    let len = bytes.len() as u64;
    let sent = tokio::time::timeout(
        s.publish_interval.max(Duration::from_millis(50)),
        client.publish(s.subject.clone(), bytes.into()),
    )
    .await;
    if let Some(m) = &args.metrics {
        if matches!(sent, Ok(Ok(()))) {
            m.bytes_sent.inc_by(len);
            m.snapshots_sent.inc();
        } else {
            m.dropped(SyncDrop::PublishFailed, 1);
        }
    }
    p.last = Some(snap);
    p.last_sent = Some(tokio::time::Instant::now());
}

/// Decodes one peer snapshot and merges it into the ledger.
fn receive(args: &ReplicaSyncArgs, table: &mut PeerTable, payload: &[u8]) {
    let m = args.metrics.as_ref();
    let snap = match Snapshot::decode(payload) {
        Ok(snap) => snap,
        Err(error) => {
            if let Some(m) = m {
                m.dropped(
                    match error {
                        DecodeError::Oversize => SyncDrop::Oversize,
                        DecodeError::Version => SyncDrop::Version,
                        DecodeError::Malformed | DecodeError::Bounds => SyncDrop::Malformed,
                    },
                    1,
                );
            }
            return;
        }
    };
    let now = now_tick();
    let offer = args.picker.with_ledger(|l| table.offer(&snap, now, l));
    let Some(m) = m else { return };
    if offer != Offer::Own {
        m.snapshots_received.inc();
    }
    match offer {
        Offer::Applied {
            entries, truncated, ..
        } => {
            m.applied.inc_by(entries as u64);
            m.dropped(SyncDrop::MaxEntries, truncated as u64);
            let lag_ms = (unix_nanos() / 1_000_000).saturating_sub(snap.sent_unix_ms);
            m.lag.observe(lag_ms as f64 / 1000.0);
        }
        Offer::Stale => m.dropped(SyncDrop::Stale, 1),
        Offer::TooManyPeers => m.dropped(SyncDrop::MaxPeers, 1),
        Offer::Own | Offer::Refreshed => {}
    }
    m.peers.set(table.len() as i64);
}

fn report(
    s: &ReplicaSyncSettings,
    args: &ReplicaSyncArgs,
    client: &Client,
    p: &Publisher,
    table: &PeerTable,
) {
    let now = now_tick();
    args.view.set(ReplicaSyncStatus {
        enabled: true,
        replica_id: s.replica_id.clone(),
        subject: s.subject.clone(),
        connected: connected(client),
        epoch: p.epoch,
        seq: p.seq,
        published_entries: p.last.as_ref().map_or(0, |l| l.entries.len()),
        peer_legs: args.picker.with_ledger(|l| l.peer_legs()),
        peers: table.peers(now),
    });
}

fn unix_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// A draw in `[0, 1)` for the jitter (not security relevant).
fn unit() -> f64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    f64::from(nanos % 1_000_000) / 1_000_000.0
}
