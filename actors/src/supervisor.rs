//! A generic restarting supervisor: the building block of the supervision tree.
//!
//! Role: owns an ordered list of children (dependencies first), spawns them linked, restarts a
//! failed child after a backoff under an Erlang-style restart budget (`protocol::backoff`), and
//! escalates by failing itself when the budget is spent. It also restarts one child on an
//! operator's request (`RestartChild`, behind `POST /admin/subsystems/{id}/restart`), which stops
//! exactly that subtree and respawns it while every sibling keeps running.
//!
//! Parent: another `Supervisor`, or nobody (the root). Children: whatever its `ChildSpec`s spawn;
//! a child that is itself a supervisor forms a subtree.
//!
//! Messages in: `RestartChild`, `AddChild`, `RemoveChild` (dynamic children, e.g. one
//! subscription per publisher), `RespawnDue` (its own backoff timer). Out: supervision events to
//! its parent (ractor), rows in the `ActorTree`, lifecycle spans.
//!
//! Lifecycle spans: every incarnation of a child runs under an `actor` span whose parent is the
//! supervisor's span; a restart opens an `actor.restart` span under the supervisor's span, and the
//! new incarnation's span is its child, so a trace shows supervisor → restart → new incarnation.

pub mod metrics;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use continuum_protocol::backoff::{RestartBudget, RestartDecision};
use ractor::{
    Actor, ActorCell, ActorProcessingErr, ActorRef, RpcReplyPort, SpawnErr, SupervisionEvent,
};
use tracing::{Instrument, error, info, warn};

use self::metrics::SupervisorMetrics;
use crate::clock::now_tick;
use crate::lifecycle::{ActorKind, ActorSpan, RestartSpan};
use crate::metrics::Metrics;
use crate::tree::{ActorPath, ActorState, ActorTree, RestartError};

/// How long a stopping supervisor waits for its children.
pub const STOP_GRACE: Duration = Duration::from_secs(5);

/// What a child gets from its supervisor at spawn time.
#[derive(Clone)]
pub struct ChildContext {
    /// The supervisor to link to.
    pub supervisor: ActorCell,
    /// The child's own path in the tree.
    pub path: ActorPath,
    /// The child's lifecycle span; its futures run `.instrument(span.span().clone())`-ed.
    pub span: ActorSpan,
    /// The status table, for children that are supervisors themselves.
    pub tree: ActorTree,
    /// Process metrics, for children that count things.
    pub metrics: Option<Metrics>,
}

pub type SpawnFuture = Pin<Box<dyn Future<Output = Result<ActorCell, SpawnErr>> + Send>>;

/// How to (re)create one child.
#[derive(Clone)]
pub struct ChildSpec {
    /// The child's name under its supervisor (one path segment).
    pub name: String,
    /// The closed kind of the child.
    pub kind: ActorKind,
    pub spawn: Arc<dyn Fn(ChildContext) -> SpawnFuture + Send + Sync>,
}

impl std::fmt::Debug for ChildSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChildSpec")
            .field("name", &self.name)
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

impl ChildSpec {
    pub fn new<F, Fut>(name: impl Into<String>, kind: ActorKind, spawn: F) -> Self
    where
        F: Fn(ChildContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<ActorCell, SpawnErr>> + Send + 'static,
    {
        Self {
            name: name.into(),
            kind,
            spawn: Arc::new(move |ctx| Box::pin(spawn(ctx))),
        }
    }

    /// A child that is itself a `Supervisor` over `children`.
    pub fn supervisor(name: impl Into<String>, kind: ActorKind, children: Vec<ChildSpec>) -> Self {
        Self::supervisor_with(name, kind, move || children.clone())
    }

    /// A child `Supervisor` whose children are computed at every (re)spawn, so restarting the
    /// subtree picks up the live configuration (live watcher replacement on reload).
    pub fn supervisor_with<F>(name: impl Into<String>, kind: ActorKind, children: F) -> Self
    where
        F: Fn() -> Vec<ChildSpec> + Send + Sync + 'static,
    {
        let children = Arc::new(children);
        Self::new(name, kind, move |ctx: ChildContext| {
            let children = children();
            async move {
                let args = SupervisorArgs {
                    path: ctx.path.clone(),
                    kind,
                    children,
                    tree: ctx.tree.clone(),
                    span: ctx.span.clone(),
                    budget: BudgetSpec::default(),
                    metrics: ctx.metrics.clone(),
                };
                let (actor, _) =
                    Actor::spawn_linked(None, Supervisor, args, ctx.supervisor).await?;
                Ok(actor.get_cell())
            }
        })
    }
}

/// Restart intensity of one supervisor.
#[derive(Clone, Copy, Debug)]
pub struct BudgetSpec {
    pub max_restarts: usize,
    pub period: Duration,
    pub backoff: continuum_protocol::backoff::BackoffPolicy,
}

impl Default for BudgetSpec {
    fn default() -> Self {
        Self {
            max_restarts: RestartBudget::DEFAULT_MAX_RESTARTS,
            period: RestartBudget::DEFAULT_PERIOD,
            backoff: RestartBudget::DEFAULT_BACKOFF,
        }
    }
}

pub struct SupervisorArgs {
    pub path: ActorPath,
    pub kind: ActorKind,
    pub children: Vec<ChildSpec>,
    pub tree: ActorTree,
    /// This supervisor's own lifecycle span.
    pub span: ActorSpan,
    pub budget: BudgetSpec,
    pub metrics: Option<Metrics>,
}

pub enum SupervisorMsg {
    /// Operator restart of one child's subtree; answers once the new incarnation started.
    RestartChild(String, RpcReplyPort<Result<(), String>>),
    /// Start a dynamic child (answers after its `pre_start`).
    AddChild(ChildSpec, RpcReplyPort<Result<(), String>>),
    /// Stop and forget a dynamic child (answers once it stopped).
    RemoveChild(String, RpcReplyPort<()>),
    /// Names of the current children, in start order.
    ListChildren(RpcReplyPort<Vec<String>>),
    /// A backoff elapsed: respawn `name` if it is still incarnation `u64`.
    RespawnDue(String, u64),
}

pub struct Supervisor;

struct ChildSlot {
    spec: ChildSpec,
    cell: Option<ActorCell>,
    incarnation: u64,
    budget: RestartBudget,
    /// The open lifecycle span of the running incarnation; dropping it ends the span.
    span: Option<ActorSpan>,
    /// The last incarnation's span after it ended, for the restart span's link.
    last_span: Option<ActorSpan>,
    /// The restart in progress, held over the backoff, ended once the child runs again.
    pending_restart: Option<RestartSpan>,
    restarts: u32,
    /// Operator restart in progress: every caller that asked while it ran is answered here
    /// once the child respawned (overlapping requests join the restart in progress).
    admin_replies: Vec<RpcReplyPort<Result<(), String>>>,
    /// Being removed: answer here once stopped.
    remove_reply: Option<RpcReplyPort<()>>,
}

pub struct SupervisorState {
    path: ActorPath,
    tree: ActorTree,
    span: ActorSpan,
    budget: BudgetSpec,
    metrics: Option<Metrics>,
    counters: Option<Arc<SupervisorMetrics>>,
    children: Vec<ChildSlot>,
}

impl Actor for Supervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = SupervisorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: SupervisorArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let parent_path = parent_of(&args.path);
        // Its own supervisor registers the ref that can restart it.
        args.tree.starting(
            &args.path,
            args.kind.as_label(),
            parent_path.as_deref(),
            None,
        );
        let mut state = SupervisorState {
            path: args.path,
            tree: args.tree,
            span: args.span,
            budget: args.budget,
            counters: args.metrics.as_ref().and_then(Metrics::family),
            metrics: args.metrics,
            children: Vec::with_capacity(args.children.len()),
        };
        for spec in args.children {
            state.children.push(ChildSlot::new(spec, args.budget));
            let idx = state.children.len() - 1;
            // Dependencies start first: a child that cannot start fails this supervisor.
            state.spawn_child(&myself, idx).await?;
        }
        state.tree.set_state(&state.path, ActorState::Running);
        Ok(state)
    }

    async fn post_stop(
        &self,
        myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        // ractor does not stop linked children by itself.
        myself
            .stop_children_and_wait(Some("supervisor stopping".into()), Some(STOP_GRACE))
            .await;
        for slot in &mut state.children {
            if let Some(span) = slot.span.take() {
                span.stopped("supervisor stopping");
            }
            slot.pending_restart.take();
            slot.last_span.take();
        }
        state.tree.stopped_subtree(&state.path);
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SupervisorMsg::RestartChild(name, reply) => state.admin_restart(name, reply),
            SupervisorMsg::AddChild(spec, reply) => state.add_child(&myself, spec, reply).await,
            SupervisorMsg::RemoveChild(name, reply) => state.remove_child(name, reply),
            SupervisorMsg::ListChildren(reply) => state.list_children(reply),
            SupervisorMsg::RespawnDue(name, incarnation) => {
                state.respawn_due(&myself, &name, incarnation).await
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<Self::Msg>,
        event: SupervisionEvent,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match event {
            SupervisionEvent::ActorFailed(cell, err) => {
                state.child_failed(&myself, &cell, &err.to_string()).await
            }
            SupervisionEvent::ActorTerminated(cell, child_state, reason) => {
                // Drop the stopped incarnation's state before a successor can start, so the
                // writer it claimed (`lock::Claim`) is free for the next incarnation.
                drop(child_state);
                state.child_terminated(&myself, &cell, reason).await;
                Ok(())
            }
            SupervisionEvent::ActorStarted(_) | SupervisionEvent::ProcessGroupChanged(_) => Ok(()),
        }
    }
}

impl ChildSlot {
    fn new(spec: ChildSpec, budget: BudgetSpec) -> Self {
        Self {
            spec,
            cell: None,
            incarnation: 0,
            budget: RestartBudget::new(budget.max_restarts, budget.period, budget.backoff),
            span: None,
            last_span: None,
            pending_restart: None,
            restarts: 0,
            admin_replies: Vec::new(),
            remove_reply: None,
        }
    }
}

impl SupervisorState {
    fn child_path(&self, name: &str) -> ActorPath {
        format!("{}/{}", self.path, name)
    }

    fn slot_of_cell(&self, cell: &ActorCell) -> Option<usize> {
        let id = cell.get_id();
        self.children
            .iter()
            .position(|c| c.cell.as_ref().is_some_and(|own| own.get_id() == id))
    }

    fn slot_of_name(&self, name: &str) -> Option<usize> {
        self.children.iter().position(|c| c.spec.name == name)
    }

    fn list_children(&self, reply: RpcReplyPort<Vec<String>>) {
        let _ = reply.send(self.children.iter().map(|c| c.spec.name.clone()).collect());
    }

    /// Spawns child `idx`: a new incarnation under the pending restart span, if any.
    async fn spawn_child(
        &mut self,
        myself: &ActorRef<SupervisorMsg>,
        idx: usize,
    ) -> Result<(), SpawnErr> {
        let path = self.child_path(&self.children[idx].spec.name);
        let kind = self.children[idx].spec.kind;
        let span = match &self.children[idx].pending_restart {
            Some(restart) => restart.start_incarnation(),
            None => ActorSpan::start(&path, kind, Some(&self.span)),
        };
        self.tree.starting(
            &path,
            kind.as_label(),
            Some(&self.path),
            Some(myself.get_cell()),
        );
        let ctx = ChildContext {
            supervisor: myself.get_cell(),
            path: path.clone(),
            span: span.clone(),
            tree: self.tree.clone(),
            metrics: self.metrics.clone(),
        };
        let spawn = self.children[idx].spec.spawn.clone();
        let result = spawn(ctx).instrument(span.span().clone()).await;
        let slot = &mut self.children[idx];
        // The restart (if any) ends with this attempt, whatever its outcome.
        slot.pending_restart.take();
        match result {
            Ok(cell) => {
                span.started();
                slot.cell = Some(cell);
                slot.incarnation += 1;
                slot.span = Some(span);
                self.tree.set_state(&path, ActorState::Running);
                Ok(())
            }
            Err(e) => {
                span.failed(&e);
                slot.last_span = Some(span);
                self.tree.failed(&path, &e.to_string(), ActorState::Failed);
                Err(e)
            }
        }
    }

    /// Opens the restart span of child `idx` (linked to its last incarnation) and counts it.
    fn begin_restart(&mut self, idx: usize, delay: Duration) {
        let path = self.child_path(&self.children[idx].spec.name);
        let slot = &mut self.children[idx];
        slot.restarts = slot.restarts.saturating_add(1);
        let failed = slot
            .last_span
            .take()
            .unwrap_or_else(|| ActorSpan::start(&path, slot.spec.kind, Some(&self.span)));
        slot.pending_restart = Some(self.span.restart(&failed, slot.restarts, delay));
        self.tree.restarted(&path);
        if let Some(metrics) = &self.counters {
            metrics.actor_restart(slot.spec.kind);
        }
    }

    async fn child_failed(
        &mut self,
        myself: &ActorRef<SupervisorMsg>,
        cell: &ActorCell,
        error: &str,
    ) -> Result<(), ActorProcessingErr> {
        let Some(idx) = self.slot_of_cell(cell) else {
            return Ok(());
        };
        let path = self.child_path(&self.children[idx].spec.name);
        let slot = &mut self.children[idx];
        slot.cell = None;
        if let Some(span) = slot.span.take() {
            span.failed(&error);
            slot.last_span = Some(span);
        }
        if let Some(reply) = slot.remove_reply.take() {
            self.children.remove(idx);
            self.tree.remove_subtree(&path);
            let _ = reply.send(());
            return Ok(());
        }
        if !slot.admin_replies.is_empty() {
            // It failed while stopping for an operator restart: the restart still happens now.
            self.finish_admin_restart(myself, idx).await;
            return Ok(());
        }
        match slot.budget.on_failure(now_tick()) {
            RestartDecision::Restart { after } => {
                self.tree.failed(&path, error, ActorState::Restarting);
                let incarnation = slot.incarnation;
                let name = slot.spec.name.clone();
                warn!(actor.id = %path, error, delay_ms = after.as_millis() as u64, "Restarting failed actor after backoff.");
                self.begin_restart(idx, after);
                if after.is_zero() {
                    self.respawn_due(myself, &name, incarnation).await;
                } else {
                    myself.send_after(after, move || SupervisorMsg::RespawnDue(name, incarnation));
                }
                Ok(())
            }
            RestartDecision::Escalate => {
                self.tree.failed(&path, error, ActorState::Failed);
                if let Some(metrics) = &self.counters {
                    metrics.restart_budget_exhausted(slot.spec.kind);
                }
                error!(actor.id = %path, supervisor = %self.path, "Restart budget spent; escalating.");
                // Stop the remaining children before failing, so the parent restarts a clean
                // subtree.
                myself
                    .stop_children_and_wait(Some("escalating".into()), Some(STOP_GRACE))
                    .await;
                Err(format!("child {path} exceeded its restart budget: {error}").into())
            }
        }
    }

    async fn child_terminated(
        &mut self,
        myself: &ActorRef<SupervisorMsg>,
        cell: &ActorCell,
        reason: Option<String>,
    ) {
        let Some(idx) = self.slot_of_cell(cell) else {
            return;
        };
        let path = self.child_path(&self.children[idx].spec.name);
        let slot = &mut self.children[idx];
        slot.cell = None;
        if let Some(span) = slot.span.take() {
            span.stopped(reason.as_deref().unwrap_or("stopped"));
            slot.last_span = Some(span);
        }
        if let Some(reply) = slot.remove_reply.take() {
            self.children.remove(idx);
            self.tree.remove_subtree(&path);
            let _ = reply.send(());
            return;
        }
        if !slot.admin_replies.is_empty() {
            self.finish_admin_restart(myself, idx).await;
            return;
        }
        // A child that ended its work by itself is not restarted.
        info!(actor.id = %path, "Actor ended its work; not restarting it.");
        self.tree.stopped_subtree(&path);
    }

    async fn respawn_due(
        &mut self,
        myself: &ActorRef<SupervisorMsg>,
        name: &str,
        incarnation: u64,
    ) {
        let Some(idx) = self.slot_of_name(name) else {
            return;
        };
        let slot = &self.children[idx];
        if slot.incarnation != incarnation || slot.cell.is_some() {
            return;
        }
        let path = self.child_path(name);
        if self.children[idx].pending_restart.is_none() {
            self.begin_restart(idx, Duration::ZERO);
        }
        if let Err(e) = self.spawn_child(myself, idx).await {
            // A failed start counts against the budget like any failure.
            match self.children[idx].budget.on_failure(now_tick()) {
                RestartDecision::Restart { after } => {
                    self.begin_restart(idx, after);
                    let name = name.to_string();
                    myself.send_after(after, move || SupervisorMsg::RespawnDue(name, incarnation));
                }
                RestartDecision::Escalate => {
                    error!(actor.id = %path, error = %e, "Actor cannot start and its budget is spent.");
                    if let Some(metrics) = &self.counters {
                        metrics.restart_budget_exhausted(self.children[idx].spec.kind);
                    }
                    myself.stop(Some(format!("child {path} cannot start")));
                }
            }
        }
    }

    /// Respawns child `idx` after an operator-requested stop and answers every waiting caller
    /// with the one outcome.
    async fn finish_admin_restart(&mut self, myself: &ActorRef<SupervisorMsg>, idx: usize) {
        let replies = std::mem::take(&mut self.children[idx].admin_replies);
        self.begin_restart(idx, Duration::ZERO);
        let result = self
            .spawn_child(myself, idx)
            .await
            .map_err(|e| e.to_string());
        for reply in replies {
            let _ = reply.send(result.clone());
        }
    }

    fn admin_restart(&mut self, name: String, reply: RpcReplyPort<Result<(), String>>) {
        let Some(idx) = self.slot_of_name(&name) else {
            let _ = reply.send(Err(format!("{} has no child {name:?}", self.path)));
            return;
        };
        let path = self.child_path(&name);
        let slot = &mut self.children[idx];
        match &slot.cell {
            Some(_) if !slot.admin_replies.is_empty() => {
                // A restart of this child is already under way: this caller gets its outcome.
                info!(actor.id = %path, "Operator restart joins the one in progress.");
                slot.admin_replies.push(reply);
            }
            Some(cell) => {
                info!(actor.id = %path, "Operator requested a restart.");
                slot.admin_replies.push(reply);
                cell.stop(Some("admin restart".into()));
            }
            None => {
                let _ = reply.send(Err(format!(
                    "{path} is not running; it restarts on its own schedule"
                )));
            }
        }
    }

    async fn add_child(
        &mut self,
        myself: &ActorRef<SupervisorMsg>,
        spec: ChildSpec,
        reply: RpcReplyPort<Result<(), String>>,
    ) {
        if self.slot_of_name(&spec.name).is_some() {
            let _ = reply.send(Err(format!(
                "{} already has a child {:?}",
                self.path, spec.name
            )));
            return;
        }
        self.children.push(ChildSlot::new(spec, self.budget));
        let idx = self.children.len() - 1;
        let result = self.spawn_child(myself, idx).await;
        if result.is_err() {
            let path = self.child_path(&self.children[idx].spec.name);
            self.children.remove(idx);
            self.tree.remove_subtree(&path);
        }
        let _ = reply.send(result.map_err(|e| e.to_string()));
    }

    fn remove_child(&mut self, name: String, reply: RpcReplyPort<()>) {
        let Some(idx) = self.slot_of_name(&name) else {
            let _ = reply.send(());
            return;
        };
        let path = self.child_path(&name);
        match self.children[idx].cell.clone() {
            Some(cell) => {
                self.children[idx].remove_reply = Some(reply);
                cell.stop(Some("removed".into()));
            }
            None => {
                self.children.remove(idx);
                self.tree.remove_subtree(&path);
                let _ = reply.send(());
            }
        }
    }
}

fn parent_of(path: &str) -> Option<String> {
    path.rsplit_once('/').map(|(p, _)| p.to_string())
}

impl ActorTree {
    /// Restarts exactly the subtree rooted at `id`; the rest of the tree keeps running.
    /// Resolves once the new incarnation has started.
    pub async fn restart(&self, id: &str, timeout: Duration) -> Result<(), RestartError> {
        let (name, cell) = self.restart_target(id)?;
        let supervisor = ActorRef::<SupervisorMsg>::from(cell);
        let millis = timeout.as_millis().min(u64::MAX as u128) as u64;
        let answer = ractor::call_t!(supervisor, SupervisorMsg::RestartChild, millis, name)
            .map_err(|e| RestartError::Unreachable(id.to_string(), e.to_string()))?;
        answer.map_err(|e| RestartError::Failed(id.to_string(), e))
    }
}

/// Spawns a root supervisor (no parent) over `children`.
pub async fn spawn_root(
    children: Vec<ChildSpec>,
    tree: ActorTree,
    metrics: Option<Metrics>,
) -> Result<(ActorRef<SupervisorMsg>, tokio::task::JoinHandle<()>), SpawnErr> {
    let span = ActorSpan::start("root", ActorKind::Root, None);
    let args = SupervisorArgs {
        path: "root".into(),
        kind: ActorKind::Root,
        children,
        tree,
        span: span.clone(),
        budget: BudgetSpec::default(),
        metrics,
    };
    let spawned = Actor::spawn(None, Supervisor, args).await;
    if spawned.is_ok() {
        span.started();
    }
    spawned
}
