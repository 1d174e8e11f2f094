//! `BrokerSupervisor`: the event-bus subtree under root (`root/event_bus`).
//!
//! Role: runs the listener task (bind, retry every 30 s on failure, accept, serve) while it
//! lives, and is the linked parent of every `BrokerSessionActor`. A session that fails is not
//! restarted (its agent reconnects); its row leaves the table either way. Restarting this
//! subtree through `POST /admin/subsystems/root/event_bus/restart` (or a reload that changes
//! the listen address, TLS files, `enabled` or the byte bounds) closes every session with
//! `shutdown` and binds anew; the [`EventBus`] handle, its admission table and revocation ring
//! survive.
//!
//! Parent: the root `Supervisor`. Messages in: none of its own; supervision events of its
//! sessions. Out: rows in the `ActorTree` (its own through root; one per session), lifecycle
//! spans.

use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use tokio::task::JoinHandle;
use tracing::{Instrument as _, warn};

use super::EventBus;
use super::listener::{self, SessionSpawner};
use crate::lifecycle::{ActorKind, ActorSpan};
use crate::supervisor::{ChildContext, ChildSpec};
use crate::tree::{ActorPath, ActorTree};

/// How long a stopping supervisor waits for its sessions to send `closed`.
const SESSION_STOP_GRACE: Duration = Duration::from_secs(2);
/// How long a stopping supervisor waits for its aborted listener task to drop the socket.
const LISTENER_STOP_GRACE: Duration = Duration::from_secs(5);

/// The `root/event_bus` child: a `BrokerSupervisor` over `bus`.
pub fn event_bus_spec(bus: EventBus) -> ChildSpec {
    ChildSpec::new(
        "event_bus",
        ActorKind::BrokerSupervisor,
        move |ctx: ChildContext| {
            let args = SupervisorArgs {
                bus: bus.clone(),
                path: ctx.path.clone(),
                tree: ctx.tree.clone(),
                span: ctx.span.clone(),
            };
            async move {
                let (actor, _) =
                    Actor::spawn_linked(None, BrokerSupervisor, args, ctx.supervisor).await?;
                Ok(actor.get_cell())
            }
        },
    )
}

pub struct SupervisorArgs {
    pub bus: EventBus,
    pub path: ActorPath,
    pub tree: ActorTree,
    pub span: ActorSpan,
}

pub struct BrokerSupervisor;

pub struct BrokerSupervisorState {
    bus: EventBus,
    listener: JoinHandle<()>,
}

impl Actor for BrokerSupervisor {
    type Msg = ();
    type State = BrokerSupervisorState;
    type Arguments = SupervisorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: SupervisorArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let spawner = SessionSpawner {
            supervisor: myself.get_cell(),
            tree: args.tree,
            path: args.path,
            span: args.span.clone(),
        };
        let listener = tokio::spawn(
            listener::run(args.bus.clone(), spawner).instrument(args.span.span().clone()),
        );
        Ok(BrokerSupervisorState {
            bus: args.bus,
            listener,
        })
    }

    async fn post_stop(
        &self,
        myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        // Sessions send `closed {shutdown}` from their post_stop; then the connections go.
        myself
            .stop_children_and_wait(Some("event bus stopping".into()), Some(SESSION_STOP_GRACE))
            .await;
        state.listener.abort();
        // Abort only schedules the cancellation: wait until the task (and its listening socket)
        // is dropped, so a restarted supervisor binds the same port at once instead of failing
        // with "address in use" and retrying 30 s later.
        let _ = tokio::time::timeout(LISTENER_STOP_GRACE, &mut state.listener).await;
        state.bus.set_running(None);
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<Self::Msg>,
        event: SupervisionEvent,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        if let SupervisionEvent::ActorFailed(cell, error) = event {
            // A failed session's post_stop may not have run: drop its row here.
            warn!(%error, "An event bus session failed; its agent will reconnect.");
            let id = cell.get_id();
            let mut table = state.bus.lock();
            let gone: Vec<_> = table
                .sessions
                .iter()
                .filter(|(_, row)| row.actor.get_id() == id)
                .map(|(sid, row)| (*sid, row.client_id.clone()))
                .collect();
            for (sid, client_id) in gone {
                table.sessions.remove(&sid);
                table.admission.ended(&client_id, sid);
            }
            state.bus.publish(&table);
        }
        Ok(())
    }
}
