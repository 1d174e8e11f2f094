//! The whole daemon on `dynamo.discovery.source: file`: records written into a Dynamo file store
//! (one percent-encoded file per key, as 1.6.1 writes them) appear in the registry snapshot,
//! `/ready` answers after the first scan, a file whose mtime falls out of the TTL removes its
//! worker (the file stays: the router never deletes), and removed files are followed through
//! inotify. No external process is needed.

use crate::support;

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use continuum_protocol::discovery::file_store::{BUCKETS, encode_file_name};
use continuum_protocol::discovery::registration::{Registration, WorkerType};
use continuum_protocol::discovery::snapshot::SourceKind;
use continuum_protocol::ids::{InstanceId, PublisherId};

const NS: &str = "filens";
const WAIT: Duration = Duration::from_secs(30);

fn registration(id: u64, worker_type: WorkerType) -> Registration {
    Registration {
        namespace: NS.into(),
        worker_type,
        instance_id: InstanceId(id),
        model: "tiny".into(),
        block_size: 16,
        total_kv_blocks: 1024,
        max_num_batched_tokens: 8192,
        data_parallel_size: 1,
        request_plane: "127.0.0.1:1".into(),
        kv_metrics: (PublisherId(id + 1), "tcp://127.0.0.1:1".into()),
    }
}

/// Writes every record of `worker` under `root`; returns the file paths.
fn write_worker(root: &Path, worker: &Registration) -> Vec<PathBuf> {
    worker
        .records()
        .into_iter()
        .map(|(key, value)| {
            let bucket = BUCKETS
                .iter()
                .find(|b| key.starts_with(&format!("{b}/")))
                .expect("key in a bucket");
            let dir = root.join(bucket);
            std::fs::create_dir_all(&dir).expect("bucket dir");
            let path = dir.join(encode_file_name(&key[bucket.len() + 1..]));
            std::fs::write(&path, value).expect("write a record file");
            path
        })
        .collect()
}

fn yaml(root: &Path) -> String {
    format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\n\
         dynamo:\n  enabled: true\n  discovery:\n    source: file\n    file:\n      \
         root: \"{}\"\n      namespace: \"{NS}\"\n      rescan_interval: 100ms\n      ttl: 60s\n",
        root.display()
    )
}

fn ids(daemon: &continuum_router::daemon::Daemon) -> Vec<u64> {
    daemon
        .registry()
        .snapshot()
        .workers()
        .iter()
        .map(|w| w.instance_id().0)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_store_records_expire_by_mtime_and_follow_removals() {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path().join("dynamo_store_kv");
    let decode = registration(0xd1, WorkerType::Decode);
    let prefill = registration(0xa1, WorkerType::Prefill);
    let decode_files = write_worker(&root, &decode);
    let prefill_files = write_worker(&root, &prefill);

    let daemon = support::daemon::start(&yaml(&root)).await;
    support::daemon::wait_for(daemon.registry(), WAIT, "both workers", |s| {
        s.workers().len() == 2
    })
    .await;
    assert_eq!(daemon.registry().snapshot().source(), SourceKind::File);
    let ready = reqwest::get(format!("http://{}/ready", daemon.local_addr()))
        .await
        .expect("GET /ready");
    assert_eq!(ready.status(), 200);

    // The decode worker stops touching its files: once their mtime is older than the TTL the
    // worker leaves, and the files are left where they are.
    let stale = SystemTime::now() - Duration::from_secs(120);
    for path in &decode_files {
        std::fs::File::options()
            .write(true)
            .open(path)
            .expect("open a record file")
            .set_modified(stale)
            .expect("age a record file");
    }
    support::daemon::wait_for(daemon.registry(), WAIT, "the stale worker gone", |s| {
        s.workers().len() == 1
    })
    .await;
    assert_eq!(ids(&daemon), [0xa1]);
    assert!(
        decode_files.iter().all(|p| p.exists()),
        "the router deletes nothing"
    );

    // Touched again (a worker that was only late): back in the view.
    for path in &decode_files {
        std::fs::File::options()
            .write(true)
            .open(path)
            .expect("open a record file")
            .set_modified(SystemTime::now())
            .expect("touch a record file");
    }
    support::daemon::wait_for(daemon.registry(), WAIT, "the touched worker back", |s| {
        s.workers().len() == 2
    })
    .await;

    // A graceful stop removes the files.
    for path in &prefill_files {
        std::fs::remove_file(path).expect("remove a record file");
    }
    support::daemon::wait_for(daemon.registry(), WAIT, "the removed worker gone", |s| {
        s.workers().len() == 1
    })
    .await;
    assert_eq!(ids(&daemon), [0xd1]);
    daemon.shutdown().await;
}
