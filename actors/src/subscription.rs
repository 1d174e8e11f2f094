//! Load-signal subscriptions: one SubscriptionActor per `kv_metrics` publisher, kept in line with
//! the registry by a SubscriptionFollower, both under the `subscriptions` supervisor.
//!
//! SubscriptionActor — role: owns one publisher's bounded ZMTP SUB connection task: dial (under
//! the dial policy), fold every delivery through `protocol::load_store::LoadStream` into the
//! shared store, reconnect with full-jitter backoff 500 ms → 30 s whose floor resets only after a
//! 30 s session. Parent: the `subscriptions` supervisor. Messages in (from the follower):
//! `Redial(target)` (same publisher, new endpoint or component: end the session or backoff wait
//! and dial it now) and `Status` (the target it dials); the connection task owns the socket and
//! reports through the store's status table. Restart: on failure, by its
//! supervisor; the next connection drops the publisher's samples first (missed-messages rule).
//! Unreachable rule: when an established session ends and the next attempt is refused, reset or
//! times out, the workers this publisher delivered samples for are marked unreachable in the
//! store (`LoadStream::on_connect_failed`) until a session is established again.
//!
//! A stopped `kv_metrics` subscription (its publisher departed, changed or was left out by the
//! cap) drops the samples and gauge series its publisher contributed once its task has ended:
//! a worker without a subscription has no live gauge and reads as stale, never as a frozen
//! sample.
//!
//! SubscriptionFollower — role: on every registry generation, applies the live-worker gate to
//! the store (evicting samples and gauges of departed workers), plans the wanted subscriptions
//! (`protocol::subscription_plan::plan`: ≤ 1,024; publishers of registered workers first, then
//! running ones, then ascending publisher id), redials running subscriptions whose publisher
//! moved (`Redial`), and tells its supervisor to stop departed ones (concurrently) and start new
//! ones. A restarted follower asks its running siblings for their targets (`Status`) and adopts
//! those that answer. Publishers newly left out by the cap are
//! counted `over_capacity` (`load_events_total` for kv_metrics, `kv_events_total` for
//! kv-events), and a warning follows the number left out whenever it changes. Parent: the same
//! supervisor, whose dynamic children it manages. Messages in: `Reconcile` (from its generation
//! watcher).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use continuum_protocol::backoff::{Backoff, BackoffPolicy};
use continuum_protocol::discovery::records::EventTopic;
use continuum_protocol::ids::{InstanceId, Namespace, PublisherId, WorkerKey};
use continuum_protocol::load_store::{LoadStream, WorkerRank};
use continuum_protocol::subscription_plan::{self, MAX_SUBSCRIPTIONS, SubscriptionTarget};
use ipnet::IpNet;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort, call_t};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tracing::{Instrument, debug, info, warn};

use crate::clock::now_tick;
use crate::event_bus::EventBus;
use crate::kv_index::{SharedKvIndex, SubscriptionName};
use crate::lifecycle::ActorKind;
use crate::load::metrics::{
    LoadEventResult, LoadMetrics, SubscriptionState, SubscriptionTransport, WorkerLoadGauges,
};
use crate::load::{SharedLoadStore, SubscriptionStatus};
use crate::lock::Mutex;
use crate::metrics::Metrics;
use crate::registry::RegistryReader;
use crate::supervisor::{ChildContext, ChildSpec, SupervisorMsg};
use crate::zmtp_conn::{
    CONNECT_TIMEOUT, ConnEvent, ZmtpConnConfig, ZmtpConnError, parse_endpoint, run_session,
    run_session_over,
};
use continuum_protocol::event_plane::{StreamExpectation, decode_delivery};
use continuum_protocol::zmtp::ZmtpLimits;

/// A session must last this long before the reconnect backoff returns to its floor.
pub const SESSION_RESET_AFTER: Duration = Duration::from_secs(30);
/// The follower's name under its supervisor.
pub const FOLLOWER_NAME: &str = "follower";
/// How long a stop of departed subscriptions may take before the follower moves on.
pub const STOP_GRACE: Duration = Duration::from_secs(5);

/// How subscriptions reach publishers (`dynamo.load.transport`, `direct_allow_cidrs`).
#[derive(Clone, Debug)]
pub struct DialPolicy {
    pub transport: SubscriptionTransport,
    pub allow_cidrs: Option<Vec<IpNet>>,
    /// `dynamo.kv.enabled`: also subscribe to kv-events publishers.
    pub kv_events: bool,
    /// The event bus broker-transport subscriptions open their streams on; `None` keeps them
    /// pending (never a silent fallback to dialling directly).
    pub bus: Option<EventBus>,
}

/// A pending broker-transport subscription waits up to this long (uniformly random) after a
/// covering session appears, so a reconnecting broker is not hit by every subscription at once.
pub const PENDING_WAKE_JITTER: Duration = Duration::from_millis(500);

/// Reads the live dial policy (it changes on reload, which restarts the subtree).
pub type DialPolicySource = Arc<dyn Fn() -> DialPolicy + Send + Sync>;

pub struct SubscriptionActor;

pub struct SubscriptionArgs {
    pub name: String,
    pub target: SubscriptionTarget,
    pub policy: DialPolicy,
    pub store: SharedLoadStore,
    pub kv: SharedKvIndex,
    pub metrics: Option<Arc<LoadMetrics>>,
    pub span: tracing::Span,
}

/// What a SubscriptionActor is told by its follower.
pub enum SubscriptionMsg {
    /// Dial `target` now: it has this subscription's child name (topic, namespace, publisher)
    /// with a new endpoint or component. Ends the current session or backoff wait; the new
    /// session drops the publisher's samples first, as every new session does.
    Redial(SubscriptionTarget),
    /// The target this subscription dials (a restarted follower adopts running subscriptions).
    Status(RpcReplyPort<SubscriptionTarget>),
}

pub struct SubscriptionActorState {
    name: String,
    target: SubscriptionTarget,
    /// Hands a new target to the connection task.
    redial: watch::Sender<SubscriptionTarget>,
    store: SharedLoadStore,
    /// Set for a kv-events subscription: told when this subscription stops.
    kv: Option<SharedKvIndex>,
    /// Set for a kv_metrics subscription: whose samples and gauges go when it stops.
    load: Option<(PublisherId, Namespace, Option<Arc<LoadMetrics>>)>,
    task: JoinHandle<()>,
}

impl Actor for SubscriptionActor {
    type Msg = SubscriptionMsg;
    type State = SubscriptionActorState;
    type Arguments = SubscriptionArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<SubscriptionMsg>,
        args: SubscriptionArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let name = args.name.clone();
        let target = args.target.clone();
        let (redial, redials) = watch::channel(target.clone());
        let store = args.store.clone();
        let span = args.span.clone();
        let kv = (args.target.topic == EventTopic::KvEvents).then(|| args.kv.clone());
        let load = (args.target.topic == EventTopic::KvMetrics).then(|| {
            (
                args.target.publisher_id,
                args.target.namespace.clone(),
                args.metrics.clone(),
            )
        });
        let task = tokio::spawn(run_subscription(args, redials).instrument(span));
        Ok(SubscriptionActorState {
            name,
            target,
            redial,
            store,
            kv,
            load,
            task,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<SubscriptionMsg>,
        msg: SubscriptionMsg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SubscriptionMsg::Redial(target) => {
                if target.child_name() == state.name {
                    info!(subscription = %state.name, "Redialing the publisher's new endpoint.");
                    state.target = target.clone();
                    // `send` marks the value changed even when equal: a redial of the same
                    // target is a reconnect now.
                    let _ = state.redial.send(target);
                } else {
                    warn!(subscription = %state.name, other = %target.child_name(), "Refused a redial to another publisher.");
                }
            }
            SubscriptionMsg::Status(reply) => {
                let _ = reply.send(state.target.clone());
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<SubscriptionMsg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        state.task.abort();
        // Wait for the task to end, so no delivery lands after its samples are dropped.
        let _ = (&mut state.task).await;
        state.store.remove_status(&state.name);
        if let Some((publisher, namespace, metrics)) = &state.load {
            let dropped = state.store.with(|s| s.drop_publisher(*publisher));
            clear_gauges(metrics, namespace, &dropped);
            state.store.notify();
            if !dropped.is_empty() {
                debug!(subscription = %state.name, dropped = dropped.len(), "Subscription stopped: dropped its samples and gauges.");
            }
        }
        if let Some(kv) = &state.kv {
            // Its ranks are cleared if no subscription of the same name is back within 60 s.
            kv.subscription_state(&SubscriptionName::from(state.name.as_str()), false);
        }
        Ok(())
    }
}

/// Reports a subscription's state into the status table.
struct Reporter {
    name: String,
    store: SharedLoadStore,
    template: SubscriptionStatus,
}

impl Reporter {
    /// Transport broker: which broker carries the connected stream (`None` otherwise).
    fn set_broker(&mut self, broker: Option<String>) {
        self.template.broker = broker;
    }

    fn report(&self, state: SubscriptionState) {
        let mut status = self.template.clone();
        status.state = state.as_label();
        status.state_kind = state;
        self.store.set_status(&self.name, status);
    }
}

/// The connection settings of one target.
fn conn_config(target: &SubscriptionTarget, policy: &DialPolicy) -> ZmtpConnConfig {
    if target.topic == EventTopic::KvEvents {
        ZmtpConnConfig {
            publisher_id: target.publisher_id,
            endpoint: target.endpoint.clone(),
            topic: b"kv-events".to_vec(),
            limits: ZmtpLimits::KV_EVENTS,
            allow_cidrs: policy.allow_cidrs.clone(),
            connect_timeout: CONNECT_TIMEOUT,
        }
    } else {
        ZmtpConnConfig::kv_metrics(
            target.publisher_id,
            target.endpoint.clone(),
            policy.allow_cidrs.clone(),
        )
    }
}

/// The connection loop of one subscription: connect, fold, back off, repeat; a redial (a new
/// target from the actor) ends the session or the backoff wait and dials the new target now.
#[expect(clippy::too_many_lines, reason = "on tests/it/tidy/long_functions.txt")]
async fn run_subscription(
    args: SubscriptionArgs,
    mut redials: watch::Receiver<SubscriptionTarget>,
) {
    let SubscriptionArgs {
        name,
        mut target,
        policy,
        store,
        kv,
        metrics,
        ..
    } = args;
    let kv_events = target.topic == EventTopic::KvEvents;
    let kv_name = SubscriptionName::from(name.as_str());
    let mut reporter = Reporter {
        name: name.clone(),
        store: store.clone(),
        template: SubscriptionStatus {
            family: target.topic.as_str(),
            publisher_id: target.publisher_id.0.to_string(),
            namespace: target.namespace.to_string(),
            component: target.component.clone(),
            state: SubscriptionState::Connecting.as_label(),
            transport: policy.transport.as_label(),
            broker: None,
            state_kind: SubscriptionState::Connecting,
            transport_kind: policy.transport,
        },
    };
    let bus = match (policy.transport, &policy.bus) {
        (SubscriptionTransport::Broker, None) => {
            // Broker mode without an event bus: stay pending (workers read as having no fresh
            // sample) and never fall back to dialing directly.
            reporter.report(SubscriptionState::Pending);
            if kv_events {
                kv.subscription_state(&kv_name, false);
            }
            warn!(subscription = %name, "load.transport is broker but no event bus is available; the subscription stays pending.");
            std::future::pending::<()>().await;
            return;
        }
        (SubscriptionTransport::Broker, Some(bus)) => Some(bus.clone()),
        (SubscriptionTransport::Direct, _) => None,
    };
    let mut backoff = Backoff::new(BackoffPolicy::SUBSCRIPTION);
    let mut stream = LoadStream::new(target.publisher_id);
    let mut jitter = Jitter::seeded(target.publisher_id.0);
    // Counted in the broker coverage gauges while this subscription runs.
    let mut interest = bus
        .as_ref()
        .map(|bus| bus.interest(target.topic, target.namespace.clone()));
    loop {
        if let Some(bus) = &bus
            && !bus.covers(&target.namespace)
        {
            // Pending: no live broker session covers the namespace. Wait on the session table
            // (no polling), then spread the wake-up.
            reporter.report(SubscriptionState::Pending);
            if let Some(interest) = interest.as_mut() {
                interest.set_pending(true);
            }
            if kv_events {
                kv.subscription_state(&kv_name, false);
            }
            let mut sessions = bus.subscribe_sessions();
            while !bus.covers(&target.namespace) {
                if sessions.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
            if let Some(interest) = interest.as_mut() {
                interest.set_pending(false);
            }
            tokio::time::sleep(PENDING_WAKE_JITTER.mul_f64(jitter.unit())).await;
        }
        reporter.report(SubscriptionState::Connecting);
        let started = tokio::time::Instant::now();
        let (tx, mut rx) = mpsc::channel::<ConnEvent>(64);
        let cfg = conn_config(&target, &policy);
        let carrier: Arc<Mutex<Option<String>>> = Arc::default();
        let mut session = match &bus {
            Some(bus) => {
                let bus = bus.clone();
                let namespace = target.namespace.clone();
                let topic = target.topic;
                let carrier = carrier.clone();
                tokio::spawn(async move {
                    run_bus_session(&bus, namespace, topic, &cfg, &tx, &carrier).await
                })
            }
            None => tokio::spawn(async move { run_session(&cfg, &tx).await }),
        };
        let mut established = false;
        let mut redialed = false;
        loop {
            let event = tokio::select! {
                event = rx.recv() => match event {
                    Some(event) => event,
                    None => break,
                },
                changed = redials.changed() => {
                    if changed.is_err() {
                        // The actor is gone (it aborts this task as it stops).
                        session.abort();
                        return;
                    }
                    redialed = true;
                    session.abort();
                    break;
                }
            };
            if matches!(event, ConnEvent::Connected { .. }) {
                established = true;
                let broker = carrier.lock().take();
                reporter.set_broker(broker);
            }
            let mut fold = Fold {
                name: &name,
                target: &target,
                kv_events,
                kv: &kv,
                kv_name: &kv_name,
                store: &store,
                metrics: &metrics,
                reporter: &reporter,
                stream: &mut stream,
            };
            fold.event(event).await;
        }
        let outcome = (&mut session).await;
        // The broker session carrying this stream ended (the bus cut it): reconnect at the
        // backoff floor, placed on the next-ranked covering broker (or pending if none).
        let carrier_lost = bus.is_some()
            && established
            && matches!(&outcome, Ok(Err(ZmtpConnError::Io(error)))
                if error.kind() == std::io::ErrorKind::ConnectionAborted);
        if carrier_lost {
            backoff.reset();
        }
        if !kv_events {
            note_reachability(&name, &mut stream, &store, &metrics, established, &outcome);
        }
        let ended = match outcome {
            Ok(Ok(())) => "closed".to_string(),
            Ok(Err(error)) => {
                if let (Some(metrics), Some(result)) = (&metrics, error.counted_result()) {
                    if kv_events {
                        kv.count_envelope(result);
                    } else {
                        metrics.load_event(result);
                    }
                }
                error.to_string()
            }
            Err(join) => join.to_string(),
        };
        if kv_events {
            kv.subscription_state(&kv_name, false);
        }
        reporter.set_broker(None);
        if !redialed {
            let delay =
                backoff.session_ended(started.elapsed(), SESSION_RESET_AFTER, jitter.unit());
            reporter.report(SubscriptionState::Backoff);
            debug!(subscription = %name, reason = %ended, delay_ms = delay.as_millis() as u64, "Subscription session ended; reconnecting after backoff.");
            tokio::select! {
                () = tokio::time::sleep(delay) => continue,
                changed = redials.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
            }
        }
        // Redialed: dial the new target now.
        target = redials.borrow_and_update().clone();
        reporter.template.component = target.component.clone();
    }
}

/// What folding one connection event reads and updates: the kv-events stream goes to the KV
/// index, a kv_metrics stream to the load store (and its gauges).
struct Fold<'a> {
    name: &'a str,
    target: &'a SubscriptionTarget,
    kv_events: bool,
    kv: &'a SharedKvIndex,
    kv_name: &'a SubscriptionName,
    store: &'a SharedLoadStore,
    metrics: &'a Option<Arc<LoadMetrics>>,
    reporter: &'a Reporter,
    stream: &'a mut LoadStream,
}

impl Fold<'_> {
    async fn event(&mut self, event: ConnEvent) {
        match event {
            ConnEvent::Connected { .. } if self.kv_events => {
                // kv-events gaps are caught by this subscription's per-rank event_id cursors.
                self.reporter.report(SubscriptionState::Connected);
                self.kv.subscription_state(self.kv_name, true);
            }
            ConnEvent::Delivery(delivery) if self.kv_events => {
                match decode_delivery(
                    &delivery,
                    StreamExpectation::kv_events(self.target.publisher_id),
                ) {
                    Ok(envelope) => self.kv.deliver(self.kv_name, envelope.payload).await,
                    Err(error) => self.kv.count_envelope(error.result()),
                }
            }
            ConnEvent::Connected { .. } => {
                self.reporter.report(SubscriptionState::Connected);
                let (dropped, unreachable) = self
                    .store
                    .with(|s| (self.stream.on_connected(s), s.unreachable_count()));
                clear_gauges(self.metrics, &self.target.namespace, &dropped);
                if let Some(metrics) = self.metrics {
                    metrics.set_unreachable_workers(unreachable as u64);
                }
                self.store.notify();
                debug!(subscription = %self.name, dropped = dropped.len(), "Subscribed; dropped samples that may have missed changes.");
            }
            ConnEvent::Delivery(delivery) => {
                let now = now_tick();
                let (outcome, sample) = self.store.with(|s| {
                    let outcome = self.stream.on_delivery(&delivery, s, now);
                    let sample = outcome
                        .applied
                        .and_then(|k| s.latest(k.worker_id, k.dp_rank).cloned());
                    (outcome, sample)
                });
                // A gap drops the publisher's samples, then the frame that revealed it is
                // applied: clear the dropped series first so the one just set stays.
                clear_gauges(self.metrics, &self.target.namespace, &outcome.dropped);
                if let Some(metrics) = self.metrics {
                    metrics.load_event(outcome.result);
                    if let Some(sample) = sample {
                        let key = WorkerKey {
                            namespace: self.target.namespace.clone(),
                            instance_id: sample.load.worker_id,
                        };
                        metrics.set_worker_load(
                            &key,
                            sample.load.dp_rank,
                            WorkerLoadGauges {
                                active_decode_blocks: sample.load.active_decode_blocks,
                                active_prefill_tokens: sample.load.active_prefill_tokens,
                                kv_used_blocks: sample.load.kv_used_blocks,
                            },
                        );
                    }
                }
                if let Some(missed) = outcome.gap {
                    debug!(subscription = %self.name, missed, "Sequence gap: dropped this publisher's samples.");
                }
                self.store.notify();
            }
        }
    }
}

/// One attempt over the event bus: a data stream from the highest-ranked covering broker
/// session, then the same ZMTP session as over TCP.
async fn run_bus_session(
    bus: &EventBus,
    namespace: Namespace,
    topic: EventTopic,
    config: &ZmtpConnConfig,
    sink: &mpsc::Sender<ConnEvent>,
    carrier: &Mutex<Option<String>>,
) -> Result<(), ZmtpConnError> {
    let (host, port) = parse_endpoint(&config.endpoint)
        .ok_or_else(|| ZmtpConnError::BadEndpoint(config.endpoint.clone()))?;
    // The announced address (unspecified when the endpoint names a host, not an IP).
    let peer = host.parse::<std::net::IpAddr>().map_or_else(
        |_| std::net::SocketAddr::from(([0, 0, 0, 0], port)),
        |ip| std::net::SocketAddr::new(ip, port),
    );
    let target = continuum_protocol::event_bus::ZmqTcpTarget {
        namespace,
        host,
        port,
    };
    let stream = bus
        .open_stream(target, topic)
        .await
        .map_err(|error| ZmtpConnError::Broker(error.to_string()))?;
    *carrier.lock() = Some(stream.broker().to_string());
    run_session_over(stream, peer, config, sink).await
}

/// Feeds one finished attempt to the unreachable rule: an established session that ended is
/// lost; an attempt that never got a session failed (and, after a lost session, marks the
/// publisher's workers unreachable).
fn note_reachability(
    name: &str,
    stream: &mut LoadStream,
    store: &SharedLoadStore,
    metrics: &Option<Arc<LoadMetrics>>,
    established: bool,
    outcome: &Result<Result<(), ZmtpConnError>, tokio::task::JoinError>,
) {
    if established {
        stream.on_session_lost();
        return;
    }
    let Ok(Err(error)) = outcome else {
        return;
    };
    if !error.is_unreachable() {
        return;
    }
    let now = now_tick();
    let (marked, unreachable) = store.with(|s| {
        let marked = stream.on_connect_failed(s, now);
        (marked, s.unreachable_count())
    });
    if marked.is_empty() {
        return;
    }
    if let Some(metrics) = metrics {
        metrics.workers_marked_unreachable(marked.len() as u64);
        metrics.set_unreachable_workers(unreachable as u64);
    }
    store.notify();
    for worker in &marked {
        warn!(subscription = %name, worker_id = %worker, %error, "Load publisher lost and refusing reconnects; the worker is unreachable until it answers again or leaves the registry.");
    }
}

fn clear_gauges(metrics: &Option<Arc<LoadMetrics>>, namespace: &Namespace, ranks: &[WorkerRank]) {
    let Some(metrics) = metrics else {
        return;
    };
    for rank in ranks {
        let key = WorkerKey {
            namespace: namespace.clone(),
            instance_id: rank.worker_id,
        };
        metrics.set_worker_load(&key, rank.dp_rank, WorkerLoadGauges::default());
    }
}

/// A small xorshift source for backoff jitter: reconnect storms only need decorrelation.
struct Jitter(u64);

impl Jitter {
    fn seeded(seed: u64) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos() as u64)
            .unwrap_or(0);
        Self((seed ^ nanos.rotate_left(17)) | 1)
    }

    fn unit(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

pub struct SubscriptionFollower;

/// The running subscriptions' mailboxes by child name: each incarnation registers itself as it
/// spawns. Shared by every follower incarnation, so a restarted follower can ask its siblings.
pub type Mailboxes = Arc<Mutex<BTreeMap<String, ActorRef<SubscriptionMsg>>>>;

pub struct FollowerArgs {
    pub supervisor: ActorRef<SupervisorMsg>,
    pub mailboxes: Mailboxes,
    pub registry: RegistryReader,
    pub store: SharedLoadStore,
    pub kv: SharedKvIndex,
    pub policy: DialPolicySource,
    pub metrics: Option<Metrics>,
}

pub enum FollowerMsg {
    /// The registry published a new generation.
    Reconcile,
}

pub struct FollowerState {
    args: FollowerArgs,
    policy: DialPolicy,
    running: BTreeMap<String, SubscriptionTarget>,
    watcher: JoinHandle<()>,
    /// Publishers the cap left out at the last reconcile (child names).
    left_out: BTreeSet<String>,
    /// Whether leftovers of a previous follower incarnation were cleared.
    adopted: bool,
    /// The registry snapshot (its `seq`) reconciled last, so the next one can be patched.
    applied: Option<u64>,
    /// A subscription failed to start at the last reconcile: plan again on the next one.
    retry: bool,
}

impl Actor for SubscriptionFollower {
    type Msg = FollowerMsg;
    type State = FollowerState;
    type Arguments = FollowerArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<FollowerMsg>,
        args: FollowerArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let mut generations = args.registry.subscribe();
        let watcher = tokio::spawn(async move {
            loop {
                generations.borrow_and_update();
                if myself.cast(FollowerMsg::Reconcile).is_err() {
                    return;
                }
                if generations.changed().await.is_err() {
                    return;
                }
            }
        });
        let policy = (args.policy)();
        Ok(FollowerState {
            args,
            policy,
            running: BTreeMap::new(),
            watcher,
            left_out: BTreeSet::new(),
            adopted: false,
            applied: None,
            retry: false,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<FollowerMsg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        state.watcher.abort();
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<FollowerMsg>,
        msg: FollowerMsg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            FollowerMsg::Reconcile => state.reconcile().await,
        }
        Ok(())
    }
}

impl FollowerState {
    /// The load-signal families, when the daemon counts.
    fn load_metrics(&self) -> Option<Arc<LoadMetrics>> {
        self.args.metrics.as_ref().and_then(Metrics::family)
    }

    async fn reconcile(&mut self) {
        if !self.adopted {
            self.adopted = true;
            self.adopt().await;
        }
        let snapshot = self.args.registry.snapshot();
        // A snapshot patched from the one reconciled last names what changed: the live gate
        // moves only when workers joined or left, the plan only when publishers or a worker's
        // scope changed (a card refresh of one of 16,384 workers costs O(change), not O(fleet)).
        let changes = snapshot.changes();
        let patch = self.applied.is_some_and(|seq| changes.patches(seq));
        self.applied = Some(snapshot.seq());
        if !patch || changes.membership_changed() {
            // The live-worker gate and eviction, atomically with respect to writers.
            let live: BTreeSet<InstanceId> = snapshot
                .workers()
                .iter()
                .map(|w| w.key.instance_id)
                .collect();
            let unreachable = self.args.store.with(|s| {
                s.set_live_and_retain(live.iter().copied());
                s.unreachable_count()
            });
            if let Some(metrics) = self.load_metrics() {
                metrics.retain_workers(|key| snapshot.worker(key).is_some());
                metrics.set_unreachable_workers(unreachable as u64);
            }
            self.args.store.notify();
        }
        if self.policy.kv_events {
            // The KV index's writer applies the same gate before any new subscription delivers.
            self.args.kv.reconcile().await;
        }
        let scopes_changed = changes
            .changed
            .iter()
            .any(|(a, b)| a.component != b.component || a.endpoint != b.endpoint);
        if patch
            && !self.retry
            && !changes.publishers
            && !changes.membership_changed()
            && !scopes_changed
        {
            return;
        }
        self.retry = false;
        let plan = subscription_plan::plan(
            &snapshot,
            EventTopic::KvMetrics,
            MAX_SUBSCRIPTIONS,
            &self.running,
        );
        let mut wanted = plan.wanted;
        let mut left_out: BTreeSet<String> = plan.left_out.into_iter().collect();
        if self.policy.kv_events {
            let kv = subscription_plan::plan(
                &snapshot,
                EventTopic::KvEvents,
                MAX_SUBSCRIPTIONS,
                &self.running,
            );
            wanted.extend(kv.wanted);
            left_out.extend(kv.left_out);
        }
        self.note_left_out(left_out);
        let (mut stop, mut start) = subscription_plan::diff(&self.running, &wanted);
        // A target whose child name stays (same publisher, new endpoint or component) is
        // redialed in place rather than stopped and started.
        start.retain(|target| {
            let name = target.child_name();
            if !stop.contains(&name) || !self.redial(&name, target) {
                return true;
            }
            stop.retain(|n| *n != name);
            self.running.insert(name, target.clone());
            false
        });
        self.stop_all(&stop).await;
        for target in start {
            let name = target.child_name();
            let spec = self.spec(&name, target.clone());
            match call_t!(self.args.supervisor, SupervisorMsg::AddChild, 10_000, spec) {
                Ok(Ok(())) => {
                    self.running.insert(name, target);
                }
                Ok(Err(error)) => {
                    self.retry = true;
                    warn!(subscription = %name, %error, "Could not start a subscription.")
                }
                Err(error) => {
                    self.retry = true;
                    warn!(subscription = %name, %error, "Could not start a subscription.")
                }
            }
        }
        if !self.running.is_empty() {
            debug!(
                subscriptions = self.running.len(),
                "Subscriptions follow the registry."
            );
        }
    }

    /// Counts publishers newly left out by the cap and logs whenever the number changes.
    fn note_left_out(&mut self, left_out: BTreeSet<String>) {
        let kv_events_prefix = format!("{}:", EventTopic::KvEvents.as_str());
        let (mut load, mut kv) = (0u64, 0u64);
        for name in left_out.difference(&self.left_out) {
            if name.starts_with(&kv_events_prefix) {
                kv += 1;
            } else {
                load += 1;
            }
        }
        if let Some(metrics) = self.load_metrics()
            && load > 0
        {
            metrics.load_events(LoadEventResult::OverCapacity, load);
        }
        for _ in 0..kv {
            self.args.kv.count_envelope(LoadEventResult::OverCapacity);
        }
        if left_out.len() != self.left_out.len() {
            if left_out.is_empty() {
                info!(
                    cap = MAX_SUBSCRIPTIONS,
                    "Every event-plane publisher is subscribed again."
                );
            } else {
                warn!(
                    left_out = left_out.len(),
                    cap = MAX_SUBSCRIPTIONS,
                    "More event-plane publishers than the subscription cap; those left out have no live load signal (registered workers' publishers and running subscriptions are kept first)."
                );
            }
        }
        self.left_out = left_out;
    }

    /// Tells a running subscription to dial `target`; false if it cannot be reached.
    fn redial(&self, name: &str, target: &SubscriptionTarget) -> bool {
        let Some(actor) = self.args.mailboxes.lock().get(name).cloned() else {
            return false;
        };
        actor.cast(SubscriptionMsg::Redial(target.clone())).is_ok()
    }

    /// A restarted follower asks each running sibling for its target and adopts those that
    /// answer; the others are stopped (the next reconcile starts what is still wanted).
    async fn adopt(&mut self) {
        let Ok(names) = call_t!(self.args.supervisor, SupervisorMsg::ListChildren, 5_000) else {
            return;
        };
        let mut orphans = Vec::new();
        for name in names.into_iter().filter(|n| n != FOLLOWER_NAME) {
            let actor = self.args.mailboxes.lock().get(&name).cloned();
            let answer = match actor {
                Some(actor) => call_t!(actor, SubscriptionMsg::Status, 1_000).ok(),
                None => None,
            };
            match answer {
                Some(target) if target.child_name() == name => {
                    self.running.insert(name, target);
                }
                _ => orphans.push(name),
            }
        }
        if !self.running.is_empty() {
            info!(
                adopted = self.running.len(),
                "The subscription follower adopted the running subscriptions."
            );
        }
        self.stop_all(&orphans).await;
    }

    /// Stops subscriptions concurrently, each within [`STOP_GRACE`].
    async fn stop_all(&mut self, names: &[String]) {
        let stops = names.iter().map(|name| {
            let supervisor = self.args.supervisor.clone();
            let name = name.clone();
            async move {
                let result = call_t!(supervisor, SupervisorMsg::RemoveChild, STOP_GRACE.as_millis() as u64, name.clone());
                if let Err(error) = result {
                    warn!(subscription = %name, %error, "A subscription did not stop within its grace period.");
                }
                name
            }
        });
        for name in futures::future::join_all(stops).await {
            self.args.mailboxes.lock().remove(&name);
            if let Some(target) = self.running.remove(&name) {
                info!(subscription = %name, publisher_id = target.publisher_id.0, "Stopped a subscription.");
            }
        }
    }

    fn spec(&self, name: &str, target: SubscriptionTarget) -> ChildSpec {
        let policy = self.policy.clone();
        let store = self.args.store.clone();
        let kv = self.args.kv.clone();
        let metrics = self.load_metrics();
        let mailboxes = self.args.mailboxes.clone();
        let name = name.to_string();
        ChildSpec::new(
            name.clone(),
            ActorKind::Subscription,
            move |ctx: ChildContext| {
                let args = SubscriptionArgs {
                    name: name.clone(),
                    target: target.clone(),
                    policy: policy.clone(),
                    store: store.clone(),
                    kv: kv.clone(),
                    metrics: metrics.clone(),
                    span: ctx.span.span().clone(),
                };
                let mailboxes = mailboxes.clone();
                let name = name.clone();
                async move {
                    let (actor, _) =
                        Actor::spawn_linked(None, SubscriptionActor, args, ctx.supervisor).await?;
                    let cell = actor.get_cell();
                    mailboxes.lock().insert(name, actor);
                    Ok(cell)
                }
            },
        )
    }
}

/// The follower's child spec; its parent supervisor is the one whose children it manages.
pub fn follower_spec(
    registry: RegistryReader,
    store: SharedLoadStore,
    kv: SharedKvIndex,
    policy: DialPolicySource,
) -> ChildSpec {
    let mailboxes = Mailboxes::default();
    ChildSpec::new(
        FOLLOWER_NAME,
        ActorKind::SubscriptionFollower,
        move |ctx: ChildContext| {
            let args = FollowerArgs {
                supervisor: ActorRef::from(ctx.supervisor.clone()),
                mailboxes: mailboxes.clone(),
                registry: registry.clone(),
                store: store.clone(),
                kv: kv.clone(),
                policy: policy.clone(),
                metrics: ctx.metrics.clone(),
            };
            async move {
                let (actor, _) =
                    Actor::spawn_linked(None, SubscriptionFollower, args, ctx.supervisor).await?;
                Ok(actor.get_cell())
            }
        },
    )
}
