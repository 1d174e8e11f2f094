//! File-store source tests on a temporary directory written the way Dynamo 1.6.1 writes it:
//! `.tmp_` file then hard link, one percent-encoded file per key, liveness by mtime.

use std::collections::BTreeSet;
use std::fs;
use std::time::{Duration, SystemTime};

use continuum_protocol::discovery::SourceEvent;
use continuum_protocol::discovery::file_store::{TMP_PREFIX, encode_file_name};
use continuum_protocol::discovery::registration::{Registration, WorkerType};
use continuum_protocol::ids::{InstanceId, Namespace, PublisherId};
use tokio::sync::mpsc;

use super::*;

const NS: &str = "dyntest";
/// Generous: a scan runs on the blocking pool of a busy machine.
const WAIT: Duration = Duration::from_secs(20);

fn registration(id: u64) -> Registration {
    Registration {
        namespace: NS.into(),
        worker_type: WorkerType::Aggregated,
        instance_id: InstanceId(id),
        model: "tiny".into(),
        block_size: 16,
        total_kv_blocks: 1024,
        max_num_batched_tokens: 8192,
        data_parallel_size: 1,
        request_plane: "127.0.0.1:40000".into(),
        kv_metrics: (PublisherId(id + 1), "tcp://127.0.0.1:40001".into()),
    }
}

/// Writes `key` = `value` as Dynamo 1.6.1 does (seen with strace): the value goes to a fresh
/// `.tmp_<random hex>` file, which is hard-linked to the key's name (create-if-absent) and then
/// unlinked; its mtime is `age` ago. A key that already exists is replaced by a rename.
fn write(root: &Path, key: &str, value: &[u8], age: Duration) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0x7bb4_0ff8);
    let bucket = BUCKETS
        .iter()
        .find(|b| key.starts_with(&format!("{b}/")))
        .expect("key in a bucket");
    let dir = root.join(bucket);
    fs::create_dir_all(&dir).unwrap();
    let name = encode_file_name(&key[bucket.len() + 1..]);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!("{TMP_PREFIX}{n:x}"));
    fs::write(&tmp, value).unwrap();
    let file = fs::File::options().write(true).open(&tmp).unwrap();
    file.set_modified(SystemTime::now() - age).unwrap();
    let path = dir.join(name);
    if path.exists() {
        fs::rename(&tmp, &path).unwrap();
    } else {
        fs::hard_link(&tmp, &path).unwrap();
        fs::remove_file(&tmp).unwrap();
    }
    path
}

fn write_worker(root: &Path, id: u64, age: Duration) -> Vec<(String, PathBuf)> {
    registration(id)
        .records()
        .into_iter()
        .map(|(key, value)| {
            let path = write(root, &key, &value, age);
            (key, path)
        })
        .collect()
}

/// A TTL long enough that files written during a test stay live on a slow machine.
const TTL: Duration = Duration::from_secs(120);

fn config(root: &Path, rescan: Duration) -> FileSourceConfig {
    FileSourceConfig {
        root: root.to_owned(),
        namespace: Namespace::new(NS),
        rescan_interval: rescan,
        ttl: TTL,
    }
}

async fn next(rx: &mut mpsc::Receiver<FileUpdate>) -> FileUpdate {
    tokio::time::timeout(WAIT, rx.recv())
        .await
        .expect("a file-source update in time")
        .expect("the source is running")
}

/// The next batch of events, collecting counted kinds and connection changes seen before it.
async fn next_events(
    rx: &mut mpsc::Receiver<FileUpdate>,
    counted: &mut Vec<DiscoveryEventKind>,
    connected: &mut Vec<bool>,
) -> Vec<SourceEvent> {
    loop {
        match next(rx).await {
            FileUpdate::Events(events) => return events,
            FileUpdate::Counted(kind) => counted.push(kind),
            FileUpdate::Connected(up) => connected.push(up),
        }
    }
}

fn keys(events: &[SourceEvent]) -> BTreeSet<String> {
    events
        .iter()
        .filter_map(|e| match e {
            SourceEvent::InitApply { key, .. } | SourceEvent::Apply { key, .. } => {
                Some(key.clone())
            }
            _ => None,
        })
        .collect()
}

fn deleted(events: &[SourceEvent]) -> BTreeSet<String> {
    events
        .iter()
        .filter_map(|e| match e {
            SourceEvent::Delete { key } => Some(key.clone()),
            _ => None,
        })
        .collect()
}

fn worker_keys(id: u64) -> BTreeSet<String> {
    registration(id)
        .records()
        .into_iter()
        .map(|(k, _)| k)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scans_follow_writes_removals_and_expiry_without_touching_files() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    // Worker 0xa stopped touching its files almost a TTL ago: it expires two seconds in, late
    // enough that the first scan of a busy machine still finds it live.
    let dying = write_worker(root, 0xa, TTL - Duration::from_secs(2));
    write_worker(root, 0xb, Duration::ZERO);
    // Long dead: never admitted.
    write_worker(root, 0xd, 2 * TTL);
    // Noise: another namespace, a write in progress, a name that is no key, an oversized file.
    let other = Registration {
        namespace: "other".into(),
        ..registration(0xe)
    };
    for (key, value) in other.records() {
        write(root, &key, &value, Duration::ZERO);
    }
    let instances = root.join("v1/instances");
    fs::write(instances.join(format!("{TMP_PREFIX}partial")), b"{").unwrap();
    fs::write(instances.join("not-a-key.json"), b"{}").unwrap();
    let big = write(
        root,
        "v1/mdc/dyntest/backend/generate/f",
        b"{}",
        Duration::ZERO,
    );
    fs::File::options()
        .write(true)
        .open(&big)
        .unwrap()
        .set_len(MAX_FILE_BYTES + 1)
        .unwrap();

    // A rescan interval far beyond the test: expiry is a scheduled wake, changes come from
    // inotify.
    let (tx, mut rx) = mpsc::channel(64);
    let task = tokio::spawn(run_file_source(config(root, Duration::from_secs(3600)), tx));
    let (mut counted, mut connected) = (Vec::new(), Vec::new());
    let first = next_events(&mut rx, &mut counted, &mut connected).await;
    assert_eq!(first.first(), Some(&SourceEvent::Init));
    assert_eq!(first.last(), Some(&SourceEvent::InitDone));
    let mut want = worker_keys(0xa);
    want.extend(worker_keys(0xb));
    assert_eq!(keys(&first), want);
    // The values are the bytes on disk.
    let (key, value) = registration(0xb).endpoint_record();
    assert!(first.contains(&SourceEvent::InitApply { key, value }));
    counted.sort();
    assert_eq!(
        counted,
        [DiscoveryEventKind::Malformed, DiscoveryEventKind::Oversized]
    );

    // 0xa's files expire; they are reported gone and stay on disk. Each file's mtime was set
    // on its own, so on a slow machine they can expire in more than one wake.
    let mut gone = BTreeSet::new();
    while gone != worker_keys(0xa) {
        let events = next_events(&mut rx, &mut counted, &mut connected).await;
        assert!(keys(&events).is_empty(), "{events:?}");
        gone.extend(deleted(&events));
    }
    assert!(dying.iter().all(|(_, path)| path.exists()));

    // A new worker's files arrive through inotify.
    write_worker(root, 0xc, Duration::ZERO);
    let mut arrived = BTreeSet::new();
    while arrived != worker_keys(0xc) {
        let events = next_events(&mut rx, &mut counted, &mut connected).await;
        assert!(deleted(&events).is_empty(), "{events:?}");
        arrived.extend(keys(&events));
    }

    // A graceful stop removes the files: deletes.
    for (key, _) in registration(0xb).records() {
        let bucket = BUCKETS.iter().find(|b| key.starts_with(*b)).unwrap();
        fs::remove_file(
            root.join(bucket)
                .join(encode_file_name(&key[bucket.len() + 1..])),
        )
        .unwrap();
    }
    let mut removed = BTreeSet::new();
    while removed != worker_keys(0xb) {
        let events = next_events(&mut rx, &mut counted, &mut connected).await;
        removed.extend(deleted(&events));
    }

    // Problems are counted once, not once per scan; the root was there all along.
    counted.sort();
    assert_eq!(
        counted,
        [DiscoveryEventKind::Malformed, DiscoveryEventKind::Oversized]
    );
    assert_eq!(connected, [true]);
    drop(rx);
    tokio::time::timeout(WAIT, task)
        .await
        .expect("the source stops when its consumer is gone")
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_root_is_an_empty_fleet_until_a_worker_creates_it() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    let (tx, mut rx) = mpsc::channel(64);
    // No watch is possible on a missing root: the periodic rescan finds it.
    let task = tokio::spawn(run_file_source(
        config(&root, Duration::from_millis(50)),
        tx,
    ));
    let (mut counted, mut connected) = (Vec::new(), Vec::new());
    let first = next_events(&mut rx, &mut counted, &mut connected).await;
    assert_eq!(first, [SourceEvent::Init, SourceEvent::InitDone]);
    assert_eq!(connected, [false]);

    // A value rewritten in place (same key) is an Apply with the new bytes.
    write_worker(&root, 0xa, Duration::ZERO);
    let mut arrived = BTreeSet::new();
    while arrived != worker_keys(0xa) {
        arrived.extend(keys(
            &next_events(&mut rx, &mut counted, &mut connected).await,
        ));
    }
    assert_eq!(connected, [false, true]);
    let (key, _) = registration(0xa).endpoint_record();
    write(&root, &key, b"{\"changed\":true}", Duration::ZERO);
    loop {
        let events = next_events(&mut rx, &mut counted, &mut connected).await;
        if events.contains(&SourceEvent::Apply {
            key: key.clone(),
            value: b"{\"changed\":true}".to_vec(),
        }) {
            break;
        }
    }
    // The root goes away: every record goes with it.
    fs::remove_dir_all(&root).unwrap();
    let mut removed = BTreeSet::new();
    while removed != worker_keys(0xa) {
        removed.extend(deleted(
            &next_events(&mut rx, &mut counted, &mut connected).await,
        ));
    }
    assert_eq!(connected, [false, true, false]);
    assert!(counted.is_empty());
    task.abort();
}

#[test]
fn reads_are_bounded_before_allocation() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    fs::write(&path, b"{}").unwrap();
    assert_eq!(read_bounded(&path).unwrap(), Some(b"{}".to_vec()));
    fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(MAX_FILE_BYTES + 1)
        .unwrap();
    assert_eq!(read_bounded(&path).unwrap(), None);
}
