//! The SubscriptionActor's messages act: `Redial` moves the connection to the new endpoint at
//! once (no backoff wait), `Status` answers the target it dials, and a redial to another
//! publisher is refused. Two local TCP listeners stand in for the publishers (a dial is an
//! accepted connection); synchronised on accepts and replies, never on sleeps.

use std::time::Duration;

use continuum_actors::kv_index::SharedKvIndex;
use continuum_actors::load::SharedLoadStore;
use continuum_actors::load::SubscriptionTransport;
use continuum_actors::subscription::{
    DialPolicy, SubscriptionActor, SubscriptionArgs, SubscriptionMsg,
};
use continuum_protocol::discovery::records::EventTopic;
use continuum_protocol::ids::{Namespace, PublisherId};
use continuum_protocol::subscription_plan::SubscriptionTarget;
use ractor::{Actor, call_t};
use tokio::net::TcpListener;

fn target(port: u16, component: &str) -> SubscriptionTarget {
    SubscriptionTarget {
        topic: EventTopic::KvMetrics,
        namespace: Namespace::new("ns"),
        publisher_id: PublisherId(7),
        component: Some(component.into()),
        endpoint: format!("tcp://127.0.0.1:{port}"),
    }
}

/// Waits for one dial on `listener`; the accepted socket is kept open (the session waits for a
/// greeting that never comes, so only a redial can end it before its timeout).
async fn dialed(listener: &TcpListener) -> tokio::net::TcpStream {
    tokio::time::timeout(Duration::from_secs(30), listener.accept())
        .await
        .expect("dialed within the deadline")
        .expect("accept")
        .0
}

#[tokio::test]
async fn redial_moves_to_the_new_endpoint_and_status_reports_it() {
    let first = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let second = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let (a, b) = (
        first.local_addr().expect("addr").port(),
        second.local_addr().expect("addr").port(),
    );
    let store = SharedLoadStore::new(None);
    let old = target(a, "backend");
    let args = SubscriptionArgs {
        name: old.child_name(),
        target: old.clone(),
        policy: DialPolicy {
            transport: SubscriptionTransport::Direct,
            allow_cidrs: None,
            kv_events: false,
            bus: None,
        },
        store: store.clone(),
        kv: SharedKvIndex::new(None),
        metrics: None,
        span: tracing::Span::none(),
    };
    let (actor, handle) = Actor::spawn(None, SubscriptionActor, args)
        .await
        .expect("spawn");
    let _held = dialed(&first).await;
    let status = call_t!(actor, SubscriptionMsg::Status, 5_000).expect("status");
    assert_eq!(status, old);

    // Another publisher's target is refused: the subscription keeps its own.
    let mut other = target(b, "backend");
    other.publisher_id = PublisherId(8);
    actor
        .cast(SubscriptionMsg::Redial(other))
        .expect("actor alive");
    let status = call_t!(actor, SubscriptionMsg::Status, 5_000).expect("status");
    assert_eq!(status, old);

    // Same publisher, new endpoint and component: the session on `first` ends and `second`
    // is dialed now, while the first socket is still open (no backoff, no session timeout).
    let new = target(b, "decode");
    actor
        .cast(SubscriptionMsg::Redial(new.clone()))
        .expect("actor alive");
    let _held2 = dialed(&second).await;
    let status = call_t!(actor, SubscriptionMsg::Status, 5_000).expect("status");
    assert_eq!(status, new);
    let row = store
        .subscriptions()
        .into_iter()
        .find(|s| s.publisher_id == "7")
        .expect("the status row");
    assert_eq!(row.component.as_deref(), Some("decode"));

    actor.stop(None);
    handle.await.expect("stops");
    assert!(
        store.subscriptions().is_empty(),
        "a stopped subscription leaves the status table"
    );
}
