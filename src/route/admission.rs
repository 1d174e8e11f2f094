//! The admission queue's waiting (`admission`): a request whose model has every eligible worker
//! over its busy threshold waits in the model's bounded queue until a fresh load sample shows
//! room, or is refused `fleet_busy` (503 with `Retry-After`).
//!
//! The rule and the queue's state are `continuum_protocol::admission`; this module owns the
//! per-model queues of one router replica and the waiting: a waiter re-checks when the load store
//! changes, when the request ahead of it leaves, and at least every [`RECHECK`] (a sample that
//! ages out frees its rank without any update; a reload may change the bounds). Only the head of
//! a queue asks the fleet. Every wait ends by `admission.queue.max_wait` (read at each re-check,
//! so a reload applies to waiting requests). A request whose client goes away is dropped with
//! its future; its [`Waiter`] leaves the queue in `Drop`, counted. The queue's order (priority
//! classes per API key with aging, deficit round robin between keys of a class) is the
//! protocol's `WaitQueue`; a waiter only asks whether it is the head.
//!
//! Metrics (closed label sets): `continuum_admission_queue_depth{model}` (Dynamo model names the
//! fleet serves), `continuum_admission_wait_seconds{outcome, class}` (dispatched, shed,
//! abandoned), `continuum_admission_shed_total{reason, class}` (queue_full, max_wait) and
//! `continuum_admission_abandoned_total`; `class` is the request's priority class (high, normal,
//! low), not the class aging raised it to.

use std::collections::HashMap;
use std::pin::pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use continuum_actors::clock::now_tick;
use continuum_protocol::admission::{
    Busy, Fleet, Order, Shed, Step, Ticket, WaitQueue, Waiting, step,
};
use continuum_protocol::time::Tick;
use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry,
};
use tokio::sync::{Notify, watch};

use crate::config::admission::{Bounds, Class};

/// Longest a waiter goes without re-checking the fleet.
pub const RECHECK: Duration = Duration::from_millis(250);

/// One model's queue and the wake-up its waiters share.
#[derive(Default)]
struct ModelQueue {
    queue: WaitQueue,
    wake: Arc<Notify>,
}

#[derive(Clone)]
struct Counters {
    depth: IntGaugeVec,
    wait: HistogramVec,
    shed: IntCounterVec,
    abandoned: IntCounter,
}

/// How a queued request ended (the `outcome` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Dispatched,
    Shed,
    Abandoned,
}

impl Outcome {
    const fn as_label(self) -> &'static str {
        match self {
            Outcome::Dispatched => "dispatched",
            Outcome::Shed => "shed",
            Outcome::Abandoned => "abandoned",
        }
    }
}

/// The per-model wait queues of one router replica.
#[derive(Default)]
pub struct Admission {
    queues: Mutex<HashMap<Arc<str>, ModelQueue>>,
    counters: Option<Counters>,
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission").finish_non_exhaustive()
    }
}

impl Admission {
    /// Queues counted in `registry` when given (a second registration in the same registry
    /// leaves them uncounted).
    pub fn new(registry: Option<&Registry>) -> Self {
        Self {
            queues: Mutex::default(),
            counters: registry.and_then(|r| register(r).ok()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<Arc<str>, ModelQueue>> {
        self.queues.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Requests waiting for `model`.
    pub fn depth(&self, model: &str) -> usize {
        self.lock().get(model).map_or(0, |m| m.queue.len())
    }

    /// Admits one request of `model` (a Dynamo model name) whose fleet is `first` now: at once,
    /// after waiting in its place (`who`: class, key, cost), or refused. `fleet` is asked again
    /// while the request heads the queue, `config` at every re-check, and `changes` wakes the
    /// waiter on every load-store update.
    pub async fn admit(
        &self,
        model: &Arc<str>,
        first: Fleet,
        who: Waiting,
        config: impl Fn() -> Bounds,
        fleet: impl Fn() -> Fleet,
        mut changes: watch::Receiver<u64>,
    ) -> Result<(), Busy> {
        let bounds = config();
        let class = Class::of_rank(who.class);
        let joined = {
            let mut queues = self.lock();
            let waiting = queues.get(model).map_or(0, |m| m.queue.len());
            match step(first, waiting, bounds.max_depth) {
                Step::Go => return Ok(()),
                Step::Shed(reason) => Err(reason),
                Step::Wait => {
                    let entry = queues.entry(model.clone()).or_default();
                    let now = now_tick();
                    entry
                        .queue
                        .join(now, usize::MAX, who)
                        .map(|ticket| (ticket, now, entry.wake.clone(), entry.queue.len()))
                }
            }
        };
        let (ticket, since, wake, depth) = match joined {
            Ok(joined) => joined,
            Err(reason) => return Err(self.shed(model, class, reason, &bounds, None)),
        };
        self.set_depth(model, depth);
        let mut waiter = Waiter {
            admission: self,
            model,
            ticket,
            since,
            class,
            ended: false,
        };
        loop {
            let mut woken = pin!(wake.notified());
            woken.as_mut().enable();
            changes.borrow_and_update();
            let bounds = config();
            let (head, waited) = waiter.position(&bounds.order);
            let max_wait = bounds.max_wait;
            if waited >= max_wait {
                waiter.ended = true;
                let waited = self.leave(model, ticket, false);
                return Err(self.shed(model, class, Shed::MaxWait, &bounds, waited));
            }
            if head && fleet() != Fleet::Busy {
                waiter.ended = true;
                let waited = self.leave(model, ticket, true);
                self.observe(Outcome::Dispatched, class, waited);
                return Ok(());
            }
            let pause = (max_wait - waited).min(RECHECK);
            tokio::select! {
                () = woken => {}
                () = changed(&mut changes) => {}
                () = tokio::time::sleep(pause) => {}
            }
        }
    }

    /// Removes `ticket` from `model`'s queue (`served`: dispatched): its wait, and wakes the
    /// waiters behind it.
    fn leave(&self, model: &Arc<str>, ticket: Ticket, served: bool) -> Option<Duration> {
        let mut queues = self.lock();
        let entry = queues.get_mut(model)?;
        let waited = entry.queue.leave(ticket, now_tick(), served);
        let depth = entry.queue.len();
        entry.wake.notify_waiters();
        if depth == 0 {
            queues.remove(model);
        }
        drop(queues);
        self.set_depth(model, depth);
        waited
    }

    /// Counts a refusal and builds it: retry after `max_wait` (by then every request now waiting
    /// has left the queue).
    fn shed(
        &self,
        model: &str,
        class: Class,
        reason: Shed,
        bounds: &Bounds,
        waited: Option<Duration>,
    ) -> Busy {
        if let Some(c) = &self.counters {
            c.shed
                .with_label_values(&[reason.as_label(), class.name()])
                .inc();
        }
        if waited.is_some() {
            self.observe(Outcome::Shed, class, waited);
        }
        Busy {
            reason,
            model: model.to_owned(),
            retry_after: bounds.max_wait,
        }
    }

    fn observe(&self, outcome: Outcome, class: Class, waited: Option<Duration>) {
        if let (Some(c), Some(waited)) = (&self.counters, waited) {
            c.wait
                .with_label_values(&[outcome.as_label(), class.name()])
                .observe(waited.as_secs_f64());
        }
    }

    fn set_depth(&self, model: &str, depth: usize) {
        if let Some(c) = &self.counters {
            c.depth
                .with_label_values(&[model])
                .set(i64::try_from(depth).unwrap_or(i64::MAX));
        }
    }
}

/// Waits for the next load-store update; forever once the store is gone (the timers still run).
async fn changed(changes: &mut watch::Receiver<u64>) {
    if changes.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// A queued request. Dropped before it ended (the client went away and its future with it), it
/// leaves the queue at once and is counted in `continuum_admission_abandoned_total`.
struct Waiter<'a> {
    admission: &'a Admission,
    model: &'a Arc<str>,
    ticket: Ticket,
    since: Tick,
    class: Class,
    ended: bool,
}

impl Waiter<'_> {
    /// Whether it heads its queue, and how long it has waited (O(1) while the queue's last pick
    /// holds).
    fn position(&self, order: &Order) -> (bool, Duration) {
        let mut queues = self.admission.lock();
        let Some(entry) = queues.get_mut(self.model) else {
            return (false, Duration::MAX);
        };
        let now = now_tick();
        let head = entry.queue.head(now, order) == Some(self.ticket);
        (head, now.since(self.since))
    }
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        let waited = self.admission.leave(self.model, self.ticket, false);
        if let Some(c) = &self.admission.counters {
            c.abandoned.inc();
        }
        self.admission
            .observe(Outcome::Abandoned, self.class, waited);
    }
}

fn register(registry: &Registry) -> Result<Counters, prometheus::Error> {
    let depth = IntGaugeVec::new(
        Opts::new(
            "continuum_admission_queue_depth",
            "Requests waiting in the admission queue because every eligible worker of the model is busy, by Dynamo model name.",
        ),
        &["model"],
    )?;
    let wait = HistogramVec::new(
        HistogramOpts::new(
            "continuum_admission_wait_seconds",
            "Time requests waited in the admission queue, by how the wait ended (dispatched, shed, abandoned) and the request's priority class (high, normal, low).",
        )
        .buckets(vec![
            0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
        ]),
        &["outcome", "class"],
    )?;
    let shed = IntCounterVec::new(
        Opts::new(
            "continuum_admission_shed_total",
            "Requests refused fleet_busy (503) because every eligible worker was busy: the model's queue was full (queue_full) or the request waited admission.queue.max_wait (max_wait), by the request's priority class (high, normal, low).",
        ),
        &["reason", "class"],
    )?;
    let abandoned = IntCounter::new(
        "continuum_admission_abandoned_total",
        "Queued requests whose client went away while they waited (they left the queue at once).",
    )?;
    registry.register(Box::new(depth.clone()))?;
    registry.register(Box::new(wait.clone()))?;
    registry.register(Box::new(shed.clone()))?;
    registry.register(Box::new(abandoned.clone()))?;
    Ok(Counters {
        depth,
        wait,
        shed,
        abandoned,
    })
}
