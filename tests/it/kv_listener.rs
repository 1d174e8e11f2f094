//! The kv_listener push role end to end with the REAL `continuum-kv-listener` binary: a worker's
//! kv-events publisher (pyzmq XPUB), one router subscribing to it directly, and one router whose
//! only KV-event source is `dynamo.kv.kv_cache_index.sources[{backend, transport: event_bus}]`
//! (its own kv-events subscriptions stay pending under `transport: broker` with no broker), fed
//! by agents over the event-bus listener.
//!
//! * the KV index (blocks per rank and every `kv_events_total` result) through the agent equals
//!   the direct subscription's, across stores, a removal, a repeated event id and a gap;
//! * the agent's session is cut (the router's listener restarts on the same port): the agent
//!   redials, the router resumes with `last_event_id` and the agent resumes exactly — every
//!   batch is applied once (SSE `applied` = batches sent, no `reset`), including those
//!   published while the session was down;
//! * the first agent drains (SIGTERM): the router unsubscribes at once and reopens on a second
//!   agent, which answers the foreign `last_event_id` with a `reset` and its ring; the index
//!   still equals the direct one, and batches after the drain arrive through the second agent.
//!
//! * `--allow-cidr` (the router's `direct_allow_cidrs` rule): a source whose name resolves only
//!   outside the list is never dialled and counts `transport_refused`; inside it, it is dialled.
//!
//! * hostile SSE (an event over 2 MiB, a bad id, an unknown type, data that is not a batch) from
//!   a kv_listener session (the event-bus test agent) is counted and skipped; the consumer keeps
//!   reading, applies the next valid event and reopens with its id as `last_event_id`.
#![cfg(feature = "real-peers")]

use crate::dynamo_broker_tunnel::{
    WAIT, kv_message, kv_publisher_id, poll, register, removed, router_yaml_kv, sha256_hex, stored,
    token, with_kv_events, worker,
};
use crate::support;

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use continuum_router::daemon::Daemon;
use support::broker::probe_address;
use support::bus_pki::{Pki, pki};
use tokio::process::{Child, Command};

const LISTENER_A: &str = "kv-listener-a";
const LISTENER_B: &str = "kv-listener-b";
const BACKEND: &str = "vllm-1";

/// A free loopback port (bound and released), so the listener can restart on the same one.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

fn push_router_yaml(root: &Path, pki: &Pki, port: u16) -> String {
    let mut yaml = router_yaml_kv(root, Some((pki, &[])), true);
    yaml = yaml.replace(
        "listen: \"127.0.0.1:0\"",
        &format!("listen: \"127.0.0.1:{port}\""),
    );
    for id in [LISTENER_A, LISTENER_B] {
        let digest = sha256_hex(token(id).as_bytes());
        yaml.push_str(&format!(
            "      - id: {id}\n        role: kv_listener\n        token_hash: \"sha256:{digest}\"\n        \
             backends: [{BACKEND}]\n"
        ));
    }
    yaml.replace(
        "  kv:\n    enabled: true\n",
        &format!(
            "  kv:\n    enabled: true\n    kv_cache_index:\n      sources:\n        - backend: {BACKEND}\n          \
             transport: event_bus\n"
        ),
    )
}

struct Agent {
    child: Child,
    probe: SocketAddr,
    _token: tempfile::NamedTempFile,
}

impl Agent {
    async fn spawn(id: &str, bus: SocketAddr, pki: &Pki, source: &str) -> Agent {
        Self::spawn_with(id, bus, pki, source, &[]).await
    }

    /// [`Agent::spawn`] with more flags.
    async fn spawn_with(
        id: &str,
        bus: SocketAddr,
        pki: &Pki,
        source: &str,
        flags: &[&str],
    ) -> Agent {
        let token_file = tempfile::NamedTempFile::new().expect("token file");
        std::fs::write(token_file.path(), format!("{}\n", token(id))).expect("write token");
        let mut child = Command::new(env!("CARGO_BIN_EXE_continuum-kv-listener"))
            .args(["--bus-url", &format!("https://{bus}")])
            .args(["--client-id", id])
            .arg("--token-file")
            .arg(token_file.path())
            .arg("--ca-file")
            .arg(&pki.ca)
            .args(["--source", source])
            .args(flags)
            .args(["--listen", "127.0.0.1:0"])
            .env("RUST_LOG", "info,continuum_event_broker=debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("the continuum-kv-listener binary starts");
        let probe = probe_address(&mut child, id, WAIT).await;
        Agent {
            child,
            probe,
            _token: token_file,
        }
    }

    /// One series of the agent's `/metrics` (0 when absent).
    async fn value(&self, series: &str) -> f64 {
        let text = reqwest::get(format!("http://{}/metrics", self.probe))
            .await
            .expect("agent /metrics")
            .text()
            .await
            .expect("metrics text");
        text.lines()
            .find_map(|line| {
                line.strip_prefix(series)
                    .and_then(|rest| rest.strip_prefix(' '))
                    .and_then(|v| v.trim().parse::<f64>().ok())
            })
            .unwrap_or(0.0)
    }
}

fn kv_counts(d: &Daemon) -> Vec<(&'static str, f64)> {
    continuum_actors::kv_index::metrics::KvEventResult::ALL
        .iter()
        .map(|r| {
            let v = d
                .metrics()
                .value(
                    "continuum_dynamo_kv_events_total",
                    &[("result", r.as_label())],
                )
                .unwrap_or(0.0);
            (r.as_label(), v)
        })
        .collect()
}

fn kv_count(d: &Daemon, result: &str) -> f64 {
    kv_counts(d)
        .into_iter()
        .find(|(r, _)| *r == result)
        .map_or(0.0, |(_, v)| v)
}

fn blocks(
    d: &Daemon,
) -> Vec<(
    continuum_protocol::ids::InstanceId,
    continuum_protocol::ids::DpRank,
    usize,
)> {
    let mut b = d.kv_index().rank_blocks();
    b.sort();
    b
}

fn sse(d: &Daemon, result: &str) -> f64 {
    d.metrics()
        .value(
            "continuum_dynamo_kv_listener_sse_events_total",
            &[("result", result)],
        )
        .unwrap_or(0.0)
}

fn sources(d: &Daemon, state: &str) -> f64 {
    d.metrics()
        .value("continuum_dynamo_kv_listener_sources", &[("state", state)])
        .unwrap_or(0.0)
}

/// Waits until both routers applied the same events into the same index, with at least `min`
/// events counted.
async fn same_index(direct: &Daemon, push: &Daemon, min: f64, what: &str) {
    let applied = |d: &Daemon| kv_count(d, "applied");
    let total = |d: &Daemon| kv_counts(d).iter().map(|(_, v)| v).sum::<f64>();
    let deadline = std::time::Instant::now() + WAIT;
    let mut ticks = tokio::time::interval(Duration::from_millis(50));
    loop {
        if total(direct) >= min
            && applied(push) == applied(direct)
            && blocks(push) == blocks(direct)
        {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what} within {WAIT:?}: direct {:?} {:?}, push {:?} {:?}, sse applied {}",
            kv_counts(direct),
            blocks(direct),
            kv_counts(push),
            blocks(push),
            sse(push, "applied"),
        );
        ticks.tick().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_index_through_the_agent_equals_direct_and_resumes_after_a_session_drop_and_a_drain() {
    let pki = pki();
    let store = tempfile::tempdir().expect("store");
    let mut w = with_kv_events(worker(60).await).await;
    register(store.path(), &w);
    let kv_port = w.kv.as_ref().expect("kv publisher").1;
    let source = format!(
        "{BACKEND}={}@tcp://127.0.0.1:{kv_port}",
        kv_publisher_id(&w).0
    );
    let direct = support::daemon::start(&router_yaml_kv(store.path(), None, true)).await;
    let port = free_port();
    let push = support::daemon::start(&push_router_yaml(store.path(), &pki, port)).await;
    let bus: SocketAddr = poll("the bus listens", async || push.event_bus().local_addr()).await;
    assert_eq!(bus.port(), port);
    let agent_a = Agent::spawn(LISTENER_A, bus, &pki, &source).await;
    {
        let (kv, _) = w.kv.as_mut().expect("kv publisher");
        assert_eq!(kv.await_subscriptions(2).await.len(), 2, "direct + agent");
    }
    poll("the pushed source is connected", async || {
        (sources(&push, "connected") == 1.0).then_some(())
    })
    .await;
    support::daemon::wait_for_workers(&push, 1).await;
    support::daemon::wait_for_workers(&direct, 1).await;
    // The KV index's live-worker gate follows registry generations on its own; have both apply
    // the current one now so the first batches pass it.
    push.kv_index().reconcile().await;
    direct.kv_index().reconcile().await;

    // Phase 1: stores, a removal, a repeated event id, a gap, stores after it.
    let mut sent = 0.0;
    let mut seq = 0;
    let mut send =
        async |w: &mut crate::dynamo_broker_tunnel::Worker,
               events: Vec<Vec<(u64, continuum_protocol::kv::events::KvCacheEventData)>>| {
            let messages: Vec<_> = events
                .into_iter()
                .map(|e| {
                    seq += 1;
                    kv_message(w, seq, e)
                })
                .collect();
            let n = messages.len() as f64;
            w.kv.as_mut().expect("kv").0.send(&messages).await;
            n
        };
    sent += send(
        &mut w,
        vec![
            vec![(1, stored(None, &[11, 12, 13]))],
            vec![(2, stored(Some(13), &[14, 15]))],
            vec![(3, removed(&[15]))],
            vec![(3, removed(&[14]))],
            vec![(9, stored(None, &[21, 22]))],
        ],
    )
    .await;
    same_index(&direct, &push, 5.0, "phase 1: the same index").await;
    poll("phase 1: every batch read once", async || {
        (sse(&push, "applied") == sent).then_some(())
    })
    .await;
    assert_eq!(
        kv_counts(&direct),
        kv_counts(&push),
        "the same event counts"
    );
    assert!(!blocks(&push).is_empty());

    // Phase 2: the session drops (the listener restarts on the same port); events published
    // while it is down are held by the agent's ring and arrive exactly once after the resume.
    push.tree()
        .restart("root/event_bus", Duration::from_secs(10))
        .await
        .expect("the listener restarts");
    sent += send(
        &mut w,
        vec![
            vec![(10, stored(Some(22), &[23]))],
            vec![(11, stored(Some(23), &[24, 25]))],
            vec![(12, removed(&[25]))],
        ],
    )
    .await;
    same_index(
        &direct,
        &push,
        8.0,
        "phase 2: the same index after the resume",
    )
    .await;
    poll("phase 2: every batch read once", async || {
        (sse(&push, "applied") == sent).then_some(())
    })
    .await;
    assert_eq!(sse(&push, "reset"), 0.0, "an exact resume, no reset");
    assert_eq!(
        kv_count(&push, "replay"),
        kv_count(&direct, "replay"),
        "nothing replayed beyond what the publisher repeated"
    );
    assert!(
        agent_a
            .value("continuum_kv_listener_stream_starts_total{result=\"exact\"}")
            .await
            >= 1.0,
        "the agent resumed after last_event_id"
    );

    // Phase 3: a second agent; the first drains; the router moves to the second at once.
    let agent_b = Agent::spawn(LISTENER_B, bus, &pki, &source).await;
    {
        let (kv, _) = w.kv.as_mut().expect("kv publisher");
        // XPUB_VERBOSE reports each new subscriber: the second agent's.
        assert_eq!(kv.await_subscriptions(1).await.len(), 1);
    }
    poll("both agents have sessions", async || {
        (push.event_bus().session_count() == 2).then_some(())
    })
    .await;
    sent += send(&mut w, vec![vec![(13, stored(Some(24), &[26]))]]).await;
    same_index(&direct, &push, 9.0, "phase 3: the same index").await;
    let _ = sent;
    let mut agent_a = agent_a;
    let pid = agent_a.child.id().expect("pid").to_string();
    let status = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill -TERM");
    assert!(status.success());
    poll("the router reads from the second agent", async || {
        (agent_b.value("continuum_kv_listener_streams").await == 1.0).then_some(())
    })
    .await;
    assert_eq!(
        agent_b
            .value("continuum_kv_listener_stream_starts_total{result=\"unknown_epoch\"}")
            .await,
        1.0,
        "the second agent could not resume the first one's id and said so"
    );
    send(
        &mut w,
        vec![
            vec![(14, stored(Some(26), &[27]))],
            vec![(15, removed(&[27, 26]))],
        ],
    )
    .await;
    same_index(
        &direct,
        &push,
        11.0,
        "phase 3: the same index after the failover",
    )
    .await;
    assert!(sse(&push, "reset") >= 1.0);
    let exit = tokio::time::timeout(Duration::from_secs(10), agent_a.child.wait())
        .await
        .expect("the drained agent exits within 10 s")
        .expect("exit status");
    assert!(exit.success(), "clean exit: {exit:?}");
    assert_eq!(kv_count(&push, "gap"), kv_count(&direct, "gap"));
    push.shutdown().await;
    direct.shutdown().await;
}

/// Hostile SSE from a kv_listener session (the event-bus test agent over real TLS 1.3 and
/// HTTP/2, writing raw bytes): an event over 2 MiB, a bad id, an unknown event type and data
/// that is not a batch are counted and skipped; the consumer keeps reading, applies the valid
/// event after them, and reopens with its id as `last_event_id` once the stream ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_oversized_sse_is_counted_and_refused_and_the_stream_goes_on() {
    use crate::event_bus::{TestBroker, start, token as bus_token};
    use continuum_actors::kv_push::{KvPushActor, KvPushArgs, KvPushCursors};
    use continuum_protocol::event_bus::ClientEvent;
    use continuum_protocol::event_bus::message::{
        AnnouncedSource, ClientId, Hello, Role, StreamTarget,
    };
    use continuum_protocol::event_bus::sse::encode_kv_events;
    use futures::SinkExt as _;

    let h = start(64).await;
    let hello = Hello {
        role: Role::KvListener,
        client_id: ClientId::new("kv-listener-a"),
        versions: vec![1],
        dynamo_namespaces: vec![],
        sources: vec![AnnouncedSource {
            backend: BACKEND.into(),
        }],
    };
    let mut agent = TestBroker::connect(&h, hello, Some(bus_token("kv-listener-a")), None)
        .await
        .expect("kv_listener welcomed");
    let kv = continuum_actors::kv_index::SharedKvIndex::new(Some(h.metrics.clone()));
    let cursors = KvPushCursors::default();
    let (actor, task) = ractor::Actor::spawn(
        None,
        KvPushActor::<continuum_actors::event_bus::EventBus>::new(),
        KvPushArgs {
            opener: h.bus.clone(),
            kv,
            backends: vec![BACKEND.into()],
            cursors: cursors.clone(),
        },
    )
    .await
    .expect("KvPushActor starts");
    let ClientEvent::OpenStream { stream_id, target } = agent.next_event().await else {
        panic!("the kv_listener is commanded");
    };
    let StreamTarget::AnnouncedSource(source) = target else {
        panic!("an announced_source target");
    };
    assert_eq!(source.last_event_id, None, "nothing applied yet");
    let (mut to_router, _from_router) = agent
        .open_data_stream(stream_id, None)
        .await
        .expect("accepted");
    let sse_count = |result: &str| {
        h.metrics
            .value(
                "continuum_dynamo_kv_listener_sse_events_total",
                &[("result", result)],
            )
            .unwrap_or(0.0)
    };
    let mut hostile = b"id: 1\nevent: kv_events\ndata: ".to_vec();
    hostile.extend(std::iter::repeat_n(b'x', 3 * 1024 * 1024));
    hostile.extend_from_slice(b"\n\n");
    hostile.extend_from_slice(b"id: 99999999999999999999999\nevent: kv_events\ndata: {}\n\n");
    hostile.extend_from_slice(b"id: 3\nevent: surprise\ndata: {}\n\n");
    hostile.extend_from_slice(b"id: 4\nevent: kv_events\ndata: {\"events\":\"no\"}\n\n");
    hostile.extend(encode_kv_events(7, &[]));
    for chunk in hostile.chunks(16 * 1024) {
        to_router
            .send(bytes::Bytes::copy_from_slice(chunk))
            .await
            .expect("the router reads on");
    }
    poll("every event counted", async || {
        (sse_count("oversized") == 1.0
            && sse_count("malformed") == 3.0
            && sse_count("applied") == 1.0)
            .then_some(())
    })
    .await;
    assert_eq!(
        cursors.get(BACKEND),
        Some(7),
        "the valid event's id is the cursor"
    );

    // The agent ends the stream: the consumer reopens, resuming after id 7.
    drop(to_router);
    let next = loop {
        match agent.next_event().await {
            ClientEvent::OpenStream { target, .. } => break target,
            _ => continue,
        }
    };
    let StreamTarget::AnnouncedSource(source) = next else {
        panic!("an announced_source target");
    };
    assert_eq!(source.last_event_id, Some(7));
    actor.stop(None);
    let _ = task.await;
}

/// The agent's dials follow the router's `direct_allow_cidrs` rule: `localhost` resolves to
/// loopback, which `--allow-cidr 10.0.0.0/8` leaves out, so the publisher port is never dialled
/// and the refusal is counted; with loopback allowed, the same source is dialled.
#[tokio::test]
async fn the_agent_dials_its_sources_only_inside_allow_cidr() {
    // The agent's /metrics is read with reqwest (rustls): this test may run alone.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let pki = pki();
    // No router is needed: the sources are read whether or not a session is up.
    let bus: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
    let publisher = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("publisher port");
    let port = publisher.local_addr().expect("addr").port();
    let source = format!("{BACKEND}=7@tcp://localhost:{port}");
    let refused = r#"continuum_kv_listener_source_events_total{result="transport_refused"}"#;

    let outside = Agent::spawn_with(
        LISTENER_A,
        bus,
        &pki,
        &source,
        &["--allow-cidr", "10.0.0.0/8"],
    )
    .await;
    poll(
        "the dial outside --allow-cidr is refused and counted",
        async || (outside.value(refused).await >= 1.0).then_some(()),
    )
    .await;
    assert!(
        tokio::time::timeout(Duration::ZERO, publisher.accept())
            .await
            .is_err(),
        "nothing dialled the publisher"
    );
    drop(outside);

    let inside = Agent::spawn_with(
        LISTENER_B,
        bus,
        &pki,
        &source,
        &["--allow-cidr", "127.0.0.0/8,::1/128"],
    )
    .await;
    tokio::time::timeout(WAIT, publisher.accept())
        .await
        .expect("the allowed source is dialled")
        .expect("accept");
    assert_eq!(inside.value(refused).await, 0.0);
}
