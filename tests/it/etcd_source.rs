//! The etcd discovery source against a real etcd: resync, watch, leases, compaction, restart,
//! a read-only role and mutual TLS.
//!
//! Needs `etcd` (Debian `etcd-server`) and, for the TLS test, the `openssl` CLI.
#![cfg(feature = "real-peers")]

use crate::support;

use std::collections::BTreeMap;
use std::time::Duration;

use continuum_actors::etcd_source::{EtcdAuth, EtcdSource, EtcdSourceConfig, EtcdTls};
use continuum_protocol::backoff::{BackoffPolicy, Jitter};
use continuum_protocol::discovery::SourceEvent;
use continuum_protocol::ids::Namespace;
use etcd_client::{Client, CompactionOptions, LeaseGrantOptions, Permission, PutOptions};
use support::etcd::{CapturedKv, EtcdServer, captured_kvs};
use support::logs::Logs;
use support::paused::settle;
use tokio::sync::mpsc;

/// Longest wait for one event. Lease expiry (TTL 2 s, checked every 500 ms) is the slowest.
const EVENT_TIMEOUT: Duration = Duration::from_secs(30);
const NS: &str = "dyntest";

fn config(server: &EtcdServer) -> EtcdSourceConfig {
    EtcdSourceConfig {
        // Small steps so reconnects in these tests take milliseconds.
        backoff: BackoffPolicy {
            initial: Duration::from_millis(20),
            max: Duration::from_millis(200),
            jitter: Jitter::None,
        },
        ..EtcdSourceConfig::new(vec![server.endpoint()], Namespace::new(NS))
    }
}

async fn next(rx: &mut mpsc::Receiver<SourceEvent>) -> SourceEvent {
    tokio::time::timeout(EVENT_TIMEOUT, rx.recv())
        .await
        .expect("a discovery event within the timeout")
        .expect("the source is running")
}

/// Reads one full resync (the `Init` must be next) and returns its records.
async fn resync(rx: &mut mpsc::Receiver<SourceEvent>) -> BTreeMap<String, Vec<u8>> {
    assert_eq!(next(rx).await, SourceEvent::Init);
    rest_of_resync(rx).await
}

async fn rest_of_resync(rx: &mut mpsc::Receiver<SourceEvent>) -> BTreeMap<String, Vec<u8>> {
    let mut records = BTreeMap::new();
    loop {
        match next(rx).await {
            SourceEvent::InitApply { key, value } => {
                assert!(
                    records.insert(key, value).is_none(),
                    "a key twice in one resync"
                );
            }
            SourceEvent::InitDone => return records,
            other => panic!("unexpected {other:?} inside a resync"),
        }
    }
}

fn as_map<'a>(kvs: impl IntoIterator<Item = &'a CapturedKv>) -> BTreeMap<String, Vec<u8>> {
    kvs.into_iter()
        .map(|kv| (kv.key.clone(), kv.value.clone()))
        .collect()
}

/// Writes captured keys the way a 1.6.1 worker does: each attached to its process lease.
async fn write_like_dynamo(client: &mut Client, kvs: &[CapturedKv]) {
    let mut granted = Vec::new();
    for kv in kvs {
        if !granted.contains(&kv.lease) {
            // TTL 30 s as in 1.6.1; a second batch of the same worker reuses its lease.
            let granted_now = client
                .lease_grant(30, Some(LeaseGrantOptions::new().with_id(kv.lease)))
                .await;
            if let Err(error) = granted_now {
                assert!(
                    error.to_string().contains("lease already exists"),
                    "grant the worker lease: {error}"
                );
            }
            granted.push(kv.lease);
        }
        client
            .put(
                kv.key.clone(),
                kv.value.clone(),
                Some(PutOptions::new().with_lease(kv.lease)),
            )
            .await
            .expect("put a captured key");
    }
}

#[tokio::test]
async fn records_written_as_dynamo_writes_them_arrive_as_resync_then_watch_events() {
    let server = EtcdServer::start().await;
    let mut admin = server.client().await;
    let captured = captured_kvs("disagg-workers-only.raw.json");
    assert_eq!(captured.len(), 12);
    // The decode worker ("backend") registers before the router starts, the prefill after.
    let (decode, prefill): (Vec<_>, Vec<_>) = captured
        .iter()
        .cloned()
        .partition(|kv| kv.key.contains("/backend/"));
    write_like_dynamo(&mut admin, &decode).await;
    // Keys of another namespace and of the unwatched event_sources bucket stay invisible.
    admin
        .put("v1/instances/dyntest2/backend/generate/1", "{}", None)
        .await
        .unwrap();
    admin
        .put("v1/instances/dyntes/backend/generate/1", "{}", None)
        .await
        .unwrap();

    let (tx, mut rx) = mpsc::channel(64);
    let source = EtcdSource::spawn(config(&server), tx).unwrap();
    assert_eq!(resync(&mut rx).await, as_map(&decode));
    let mut connected = source.connected();
    connected.wait_for(|c| *c).await.unwrap();

    write_like_dynamo(&mut admin, &prefill).await;
    let mut applied = Vec::new();
    let watched_prefill: Vec<_> = prefill
        .iter()
        .filter(|kv| !kv.key.starts_with("v1/event_sources/"))
        .collect();
    for _ in 0..watched_prefill.len() {
        match next(&mut rx).await {
            SourceEvent::Apply { key, value } => applied.push((key, value)),
            other => panic!("expected an Apply, got {other:?}"),
        }
    }
    // Per prefix, watch events keep etcd's order; across prefixes they interleave.
    for bucket in ["v1/instances/", "v1/mdc/", "v1/event_channels/"] {
        let got: Vec<_> = applied
            .iter()
            .filter(|(k, _)| k.starts_with(bucket))
            .cloned()
            .collect();
        let want: Vec<_> = watched_prefill
            .iter()
            .filter(|kv| kv.key.starts_with(bucket))
            .map(|kv| (kv.key.clone(), kv.value.clone()))
            .collect();
        assert_eq!(got, want, "bucket {bucket}");
    }

    // An update and an explicit delete, as a graceful worker shutdown starts.
    let endpoint = &watched_prefill
        .iter()
        .find(|kv| kv.key.starts_with("v1/instances/"))
        .unwrap()
        .key;
    admin
        .put(endpoint.clone(), "{\"updated\":true}", None)
        .await
        .unwrap();
    assert_eq!(
        next(&mut rx).await,
        SourceEvent::Apply {
            key: endpoint.clone(),
            value: b"{\"updated\":true}".to_vec()
        }
    );
    admin.delete(endpoint.clone(), None).await.unwrap();
    assert_eq!(
        next(&mut rx).await,
        SourceEvent::Delete {
            key: endpoint.clone()
        }
    );

    // Revoking the decode worker's lease removes all of its keys.
    admin.lease_revoke(decode[0].lease).await.unwrap();
    let mut deleted = Vec::new();
    for _ in 0..decode.len() {
        match next(&mut rx).await {
            SourceEvent::Delete { key } => deleted.push(key),
            other => panic!("expected a Delete, got {other:?}"),
        }
    }
    deleted.sort();
    assert_eq!(deleted, as_map(&decode).into_keys().collect::<Vec<_>>());
    assert!(*source.connected().borrow(), "the pass never ended");
    source.stop().await;
}

#[tokio::test]
async fn lease_expiry_arrives_as_delete() {
    let server = EtcdServer::start().await;
    let mut admin = server.client().await;
    let (tx, mut rx) = mpsc::channel(64);
    let source = EtcdSource::spawn(config(&server), tx).unwrap();
    assert!(resync(&mut rx).await.is_empty());
    source.connected().wait_for(|c| *c).await.unwrap();

    // A worker that dies without cleaning up: its lease is never kept alive.
    let lease = admin.lease_grant(2, None).await.unwrap().id();
    let key = format!("v1/instances/{NS}/backend/generate/{lease:x}");
    admin
        .put(
            key.clone(),
            "{\"type\":\"Endpoint\"}",
            Some(PutOptions::new().with_lease(lease)),
        )
        .await
        .unwrap();
    assert!(matches!(next(&mut rx).await, SourceEvent::Apply { key: k, .. } if k == key));
    assert_eq!(next(&mut rx).await, SourceEvent::Delete { key });
    source.stop().await;
}

/// Puts `{}` under `prefix` followed by each id; returns etcd's revision after the last.
async fn put_keys(admin: &mut Client, prefix: &str, ids: std::ops::Range<u32>) -> i64 {
    let mut revision = 0;
    for i in ids {
        let put = admin.put(format!("{prefix}{i}"), "{}", None).await.unwrap();
        revision = put.header().unwrap().revision();
    }
    revision
}

/// Compacts everything up to `revision`, physically.
async fn compact(admin: &mut Client, revision: i64) {
    admin
        .compact(revision, Some(CompactionOptions::new().with_physical()))
        .await
        .unwrap();
}

/// After a compaction ended a pass (having logged `why`): the next pass resyncs the five keys
/// under `prefix`, then watches normally (the delete of `{prefix}0` arrives).
async fn recovered(
    rx: &mut mpsc::Receiver<SourceEvent>,
    logs: &Logs,
    source: &EtcdSource,
    admin: &mut Client,
    prefix: &str,
    why: &str,
) {
    let second = resync(rx).await;
    assert_eq!(
        second.len(),
        5,
        "the resync after compaction holds every key"
    );
    assert!(logs.text().contains(why), "logs: {}", logs.text());
    source.connected().wait_for(|c| *c).await.unwrap();
    admin.delete(format!("{prefix}0"), None).await.unwrap();
    assert_eq!(
        next(rx).await,
        SourceEvent::Delete {
            key: format!("{prefix}0")
        }
    );
}

/// Three records under the event-channel prefix (the last one the source reads, so its one page
/// is the snapshot's last), and a source whose consumer read `Init` and two of them: on a
/// capacity-1 channel the third fills it and the source, every page read at revision R, blocks
/// handing over `InitDone`, before any watch is opened. The prefix, the source, its receiver and
/// the two records read.
async fn stalled_before_init_done(
    server: &EtcdServer,
    admin: &mut Client,
) -> (
    String,
    EtcdSource,
    mpsc::Receiver<SourceEvent>,
    BTreeMap<String, Vec<u8>>,
) {
    let channels = format!("v1/event_channels/namespace/{NS}/t/");
    put_keys(admin, &channels, 0..3).await;
    let (tx, mut rx) = mpsc::channel(1);
    let source = EtcdSource::spawn(config(server), tx).unwrap();
    assert_eq!(next(&mut rx).await, SourceEvent::Init);
    let mut first = BTreeMap::new();
    for _ in 0..2 {
        match next(&mut rx).await {
            SourceEvent::InitApply { key, value } => first.insert(key, value),
            other => panic!("expected a record, got {other:?}"),
        };
    }
    (channels, source, rx, first)
}

#[tokio::test]
async fn a_compacted_watch_start_is_recovered_by_a_full_resync() {
    let logs = Logs::default();
    let _guard = logs.install();
    let server = EtcdServer::start().await;
    let mut admin = server.client().await;
    let (channels, source, mut rx, mut first) = stalled_before_init_done(&server, &mut admin).await;
    let now = put_keys(&mut admin, &channels, 3..5).await;
    // Compact to the current revision: R + 1 is gone by the time the watch asks for it.
    compact(&mut admin, now).await;

    first.extend(rest_of_resync(&mut rx).await);
    assert_eq!(first.len(), 3);
    recovered(
        &mut rx,
        &logs,
        &source,
        &mut admin,
        &channels,
        "was compacted",
    )
    .await;
    source.stop().await;
}

#[tokio::test]
async fn a_compaction_during_the_paged_read_is_recovered_by_a_full_resync() {
    let logs = Logs::default();
    let _guard = logs.install();
    let server = EtcdServer::start().await;
    let mut admin = server.client().await;
    // The first prefix the source reads: the later prefixes are read at R after these.
    let cards = format!("v1/mdc/{NS}/c/generate/");
    put_keys(&mut admin, &cards, 0..3).await;
    // Capacity 1: once `Init` and the first record are read, the second fills the channel and
    // the source blocks handing over the third, `Init` out. The source reads one page ahead, so
    // the next prefix's page may already be read at R; the prefixes after it are not.
    let (tx, mut rx) = mpsc::channel(1);
    let source = EtcdSource::spawn(config(&server), tx).unwrap();
    assert_eq!(next(&mut rx).await, SourceEvent::Init);
    assert!(matches!(next(&mut rx).await, SourceEvent::InitApply { .. }));
    let now = put_keys(&mut admin, &cards, 3..5).await;
    compact(&mut admin, now).await;

    // The rest of the first page, then the pass ends on the next page at the compacted R:
    // no `InitDone`, and the next pass opens with `Init` (the reducer discards the partial one).
    for _ in 0..2 {
        assert!(matches!(next(&mut rx).await, SourceEvent::InitApply { .. }));
    }
    let why = "required revision has been compacted";
    recovered(&mut rx, &logs, &source, &mut admin, &cards, why).await;
    source.stop().await;
}

/// Spec "Get-then-watch and resync", *Seed timeout*: connect and seed share a fixed 30 s bound.
/// A consumer that stops reading mid-resync stalls the pass while etcd keeps answering (its
/// HTTP/2 keep-alive pings too); on tokio's paused clock the pass is still seeding at 29 s and
/// ends at 30 s with the seed timeout, and the next pass resyncs every record.
#[tokio::test]
async fn a_pass_stalled_while_seeding_ends_at_the_30_s_seed_timeout() {
    let logs = Logs::default();
    let _guard = logs.install();
    let server = EtcdServer::start().await;
    let mut admin = server.client().await;
    // Blocked inside the seed phase.
    let (_, source, mut rx, _) = stalled_before_init_done(&server, &mut admin).await;
    let timed_out = format!(
        "connecting and seeding took longer than {:?}",
        continuum_actors::etcd_source::SEED_TIMEOUT
    );
    assert_eq!(
        continuum_actors::etcd_source::SEED_TIMEOUT,
        Duration::from_secs(30)
    );
    tokio::time::pause();
    settle().await;
    tokio::time::advance(Duration::from_secs(29)).await;
    settle().await;
    assert!(
        !logs.text().contains(&timed_out),
        "still seeding at 29 s: {}",
        logs.text()
    );
    assert!(!*source.connected().borrow());
    tokio::time::advance(Duration::from_secs(2)).await;
    settle().await;
    assert!(logs.text().contains(&timed_out), "logs: {}", logs.text());
    tokio::time::resume();

    // The stalled pass's last record, then a fresh pass: a full resync, then the watches.
    assert!(matches!(next(&mut rx).await, SourceEvent::InitApply { .. }));
    assert_eq!(resync(&mut rx).await.len(), 3);
    source.connected().wait_for(|c| *c).await.unwrap();
    source.stop().await;
}

#[tokio::test]
async fn an_etcd_restart_is_recovered_by_a_full_resync() {
    let mut server = EtcdServer::start().await;
    let captured = captured_kvs("disagg-workers-only.raw.json");
    let mut admin = server.client().await;
    write_like_dynamo(&mut admin, &captured).await;
    drop(admin);
    let watched: Vec<_> = captured
        .iter()
        .filter(|kv| !kv.key.starts_with("v1/event_sources/"))
        .cloned()
        .collect();

    let (tx, mut rx) = mpsc::channel(64);
    let source = EtcdSource::spawn(config(&server), tx).unwrap();
    assert_eq!(resync(&mut rx).await, as_map(&watched));
    let mut connected = source.connected();
    connected.wait_for(|c| *c).await.unwrap();

    server.restart().await;
    // Nothing else happens meanwhile, so the next event must open a fresh resync.
    // Same data dir and port: the records (and their leases) survive the restart.
    assert_eq!(resync(&mut rx).await, as_map(&watched));
    connected.wait_for(|c| *c).await.unwrap();
    let mut admin = server.client().await;
    admin
        .put(format!("v1/mdc/{NS}/x/generate/1"), "{}", None)
        .await
        .unwrap();
    assert_eq!(
        next(&mut rx).await,
        SourceEvent::Apply {
            key: format!("v1/mdc/{NS}/x/generate/1"),
            value: b"{}".to_vec()
        }
    );
    source.stop().await;
}

#[tokio::test]
async fn a_read_only_role_is_enough_and_no_permission_error_is_ever_seen() {
    let logs = Logs::default();
    let _guard = logs.install();
    let mut server = EtcdServer::start().await;
    server.enable_auth("root-secret").await;
    let mut admin = server.client().await;
    admin.role_add("router").await.unwrap();
    for prefix in [
        format!("v1/instances/{NS}/"),
        format!("v1/mdc/{NS}/"),
        format!("v1/event_channels/namespace/{NS}/"),
    ] {
        admin
            .role_grant_permission("router", Permission::read(prefix).with_prefix())
            .await
            .unwrap();
    }
    admin
        .user_add("router", "router-secret", None)
        .await
        .unwrap();
    admin.user_grant_role("router", "router").await.unwrap();

    // The role really is read-only and narrow.
    let mut router = server.client_as("router", "router-secret").await;
    let denied = router
        .put(format!("v1/instances/{NS}/x/generate/1"), "{}", None)
        .await
        .expect_err("router cannot write");
    assert!(denied.to_string().contains("permission denied"), "{denied}");
    let denied = router
        .get("v1/other/", None)
        .await
        .expect_err("router cannot read elsewhere");
    assert!(denied.to_string().contains("permission denied"), "{denied}");
    assert!(router.get(format!("v1/mdc/{NS}/"), None).await.is_ok());

    let captured = captured_kvs("disagg-workers-only.raw.json");
    let watched: Vec<_> = captured
        .iter()
        .filter(|kv| !kv.key.starts_with("v1/event_sources/"))
        .cloned()
        .collect();
    let (before, after) = watched.split_at(6);
    write_like_dynamo(&mut admin, before).await;

    let mut cfg = config(&server);
    cfg.auth = Some(EtcdAuth {
        username: "router".into(),
        password: "router-secret".into(),
    });
    let (tx, mut rx) = mpsc::channel(64);
    let source = EtcdSource::spawn(cfg, tx).unwrap();
    assert_eq!(resync(&mut rx).await, as_map(before));
    source.connected().wait_for(|c| *c).await.unwrap();
    write_like_dynamo(&mut admin, after).await;
    let mut applied = BTreeMap::new();
    for _ in 0..after.len() {
        match next(&mut rx).await {
            SourceEvent::Apply { key, value } => {
                applied.insert(key, value);
            }
            other => panic!("expected an Apply, got {other:?}"),
        }
    }
    assert_eq!(applied, as_map(after));
    admin.delete(after[0].key.clone(), None).await.unwrap();
    assert_eq!(
        next(&mut rx).await,
        SourceEvent::Delete {
            key: after[0].key.clone()
        }
    );
    assert!(*source.connected().borrow());
    source.stop().await;

    let text = logs.text().to_lowercase();
    assert!(!text.contains("permission"), "logs: {text}");
    assert!(!text.contains("pass ended"), "logs: {text}");
    assert!(
        text.contains("auth over plaintext"),
        "the plaintext warning is logged: {text}"
    );
}

#[tokio::test]
async fn discovery_works_over_mutual_tls() {
    let server = EtcdServer::start_tls().await;
    assert!(server.endpoint().starts_with("https://"));
    let files = server.tls_files().unwrap().clone();
    let mut admin = server.client().await;
    admin
        .put(format!("v1/instances/{NS}/b/generate/1"), "{\"a\":1}", None)
        .await
        .unwrap();

    // The server insists on a client certificate: a client without one is refused.
    let no_identity =
        etcd_client::ConnectOptions::new().with_tls(etcd_client::TlsOptions::new().ca_certificate(
            etcd_client::Certificate::from_pem(std::fs::read(&files.ca_cert).unwrap()),
        ));
    let mut anonymous = Client::connect([server.endpoint()], Some(no_identity))
        .await
        .unwrap();
    assert!(anonymous.get("v1/", None).await.is_err());

    let mut cfg = config(&server);
    cfg.tls = Some(EtcdTls {
        ca_cert: Some(files.ca_cert.clone()),
        client_cert: Some(files.client_cert.clone()),
        client_key: Some(files.client_key.clone()),
        server_name: Some("localhost".into()),
    });
    let (tx, mut rx) = mpsc::channel(64);
    let source = EtcdSource::spawn(cfg, tx).unwrap();
    let records = resync(&mut rx).await;
    assert_eq!(
        records,
        BTreeMap::from([(
            format!("v1/instances/{NS}/b/generate/1"),
            b"{\"a\":1}".to_vec()
        )])
    );
    source.connected().wait_for(|c| *c).await.unwrap();
    admin
        .put(format!("v1/event_channels/namespace/{NS}/t/1"), "{}", None)
        .await
        .unwrap();
    assert_eq!(
        next(&mut rx).await,
        SourceEvent::Apply {
            key: format!("v1/event_channels/namespace/{NS}/t/1"),
            value: b"{}".to_vec()
        }
    );
    source.stop().await;
}

#[tokio::test]
async fn a_dead_endpoint_beside_a_live_one_does_not_stop_discovery() {
    let logs = Logs::default();
    let _guard = logs.install();
    let server = EtcdServer::start().await;
    let mut admin = server.client().await;
    admin
        .put(format!("v1/instances/{NS}/b/generate/1"), "{}", None)
        .await
        .unwrap();
    // A loopback port nobody listens on: connections are refused at once.
    let dead = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", listener.local_addr().unwrap())
    };
    let mut cfg = config(&server);
    cfg.endpoints = vec![dead, server.endpoint()];
    let (tx, mut rx) = mpsc::channel(64);
    let source = EtcdSource::spawn(cfg, tx).unwrap();
    assert_eq!(resync(&mut rx).await.len(), 1);
    tokio::time::timeout(EVENT_TIMEOUT, source.connected().wait_for(|c| *c))
        .await
        .expect("watches open")
        .unwrap();
    for i in 0..20 {
        admin
            .put(format!("v1/mdc/{NS}/b/generate/{i}"), "{}", None)
            .await
            .unwrap();
        assert!(matches!(next(&mut rx).await, SourceEvent::Apply { .. }));
    }
    source.stop().await;
    // The dead member was tried first and skipped within the same pass.
    let text = logs.text();
    assert!(text.contains("trying the next one"), "logs: {text}");
    assert!(!text.contains("pass ended"), "logs: {text}");
}
