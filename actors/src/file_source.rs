//! The read-only Dynamo file-store discovery source: directory scans folded into `SourceEvent`s.
//!
//! Role: produce the event stream the discovery reducer consumes for one Dynamo namespace when
//! workers run with `--discovery-backend file` (dynamo-wire §16). Each *scan* lists the four
//! bucket directories under the root (`v1/instances`, `v1/mdc`, `v1/event_channels`,
//! `v1/event_sources`), keeps the files of this namespace whose mtime is within the TTL, reads
//! them (size checked before reading, bounded by `protocol`'s admission) and hands the complete
//! result to [`FileStoreDiff`], which turns it into the events an etcd watch would have sent:
//! the first scan is `Init` / `InitApply` … / `InitDone`, later ones `Apply` and `Delete`.
//!
//! When scans run: every `rescan_interval`, at the instant the next live file expires (so a
//! SIGKILLed worker leaves one TTL after its last touch, not one TTL plus an interval), and
//! shortly after inotify (`notify`, recursive on the root) reports a file created, removed,
//! renamed or written. Touches (Dynamo refreshes liveness by `open(O_WRONLY)` + `futimens` every
//! TTL/3) only change metadata and are left to the timers, so an idle fleet costs one scan per
//! interval. A file whose length and mtime did not change since the last scan is not re-read.
//!
//! A missing root (no worker has started yet) is an empty fleet: the first pass completes, and
//! `connected` stays false until the root exists. A scan that fails for another reason (the
//! root is unreadable) keeps the last records and clears `connected`.
//!
//! The read-only contract: this module lists directories, stats and reads files, and nothing
//! else. Expired files are treated as absent and left for Dynamo's own sweepers to delete.
//! `tests/it/tidy_readonly.rs` greps this file for calls that would break that promise.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use continuum_protocol::discovery::SourceEvent;
use continuum_protocol::discovery::file_store::{
    Admission, BUCKETS, DEFAULT_ROOT_DIR, DEFAULT_TTL, FileStoreDiff, FileVerdict, MAX_DIR_ENTRIES,
    MAX_FILE_BYTES, ROOT_ENV, Refusal, expires_at, file_verdict, is_live,
};
use continuum_protocol::ids::Namespace;
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use continuum_protocol::discovery::DiscoveryEventKind;

/// Default time between full scans.
pub const DEFAULT_RESCAN_INTERVAL: Duration = Duration::from_secs(1);
/// How long a burst of inotify events is gathered into one scan.
pub const COALESCE: Duration = Duration::from_millis(25);
/// Most problem files remembered (so each is counted once, not once per scan).
const MAX_REMEMBERED_PROBLEMS: usize = 4 * MAX_DIR_ENTRIES;

/// What one namespace's file source reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileSourceConfig {
    /// The store root (Dynamo's `DYN_FILE_KV`).
    pub root: PathBuf,
    pub namespace: Namespace,
    pub rescan_interval: Duration,
    /// A file not touched for longer than this belongs to a dead process.
    pub ttl: Duration,
}

impl FileSourceConfig {
    /// The root and timings Dynamo 1.6.1 uses by default.
    pub fn new(namespace: Namespace) -> Self {
        Self {
            root: default_root(),
            namespace,
            rescan_interval: DEFAULT_RESCAN_INTERVAL,
            ttl: DEFAULT_TTL,
        }
    }
}

/// Dynamo's default root: `$DYN_FILE_KV`, else `<temp dir>/dynamo_store_kv` (`$TMPDIR` or `/tmp`).
pub fn default_root() -> PathBuf {
    match std::env::var_os(ROOT_ENV) {
        Some(root) if !root.is_empty() => PathBuf::from(root),
        _ => std::env::temp_dir().join(DEFAULT_ROOT_DIR),
    }
}

/// What the source tells its consumer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FileUpdate {
    /// One scan's events, in order (a whole resync or a set of changes).
    Events(Vec<SourceEvent>),
    /// A file refused before reaching the reducer, counted once per appearance: `malformed`
    /// (not an encoded key, not a regular file, unreadable), `oversized`, `over_capacity`.
    Counted(DiscoveryEventKind),
    /// The root exists and the last scan succeeded (true), or not (false).
    Connected(bool),
}

/// The outcome of one scan.
#[derive(Debug, Default)]
struct Scan {
    /// Live, admitted records of the namespace.
    records: BTreeMap<String, Vec<u8>>,
    /// Problem files (path → kind), each counted once while it stays a problem.
    problems: BTreeMap<PathBuf, DiscoveryEventKind>,
    /// When the earliest live file expires (since the Unix epoch).
    next_expiry: Option<Duration>,
}

#[derive(Debug, thiserror::Error)]
enum ScanError {
    #[error("the store root {0} does not exist")]
    Missing(PathBuf),
    #[error("the store root {0} is not a directory")]
    NotDirectory(PathBuf),
    #[error("could not list {path}: {source}")]
    List {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// A record read by an earlier scan, reused while its length and mtime stay the same.
#[derive(Debug)]
struct Cached {
    len: u64,
    modified: Duration,
    value: Vec<u8>,
}

/// Everything one source keeps between scans.
#[derive(Debug, Default)]
struct ScanState {
    cache: BTreeMap<PathBuf, Cached>,
    problems: BTreeMap<PathBuf, DiscoveryEventKind>,
}

/// Runs scans until the `updates` receiver is dropped.
pub async fn run_file_source(cfg: FileSourceConfig, updates: mpsc::Sender<FileUpdate>) {
    let (wake_tx, mut wake_rx) = mpsc::channel::<()>(1);
    let mut watcher: Option<notify::RecommendedWatcher> = None;
    let mut diff = FileStoreDiff::new();
    let mut state = ScanState::default();
    let mut connected: Option<bool> = None;
    let rescan = cfg.rescan_interval.max(Duration::from_millis(1));
    info!(root = %cfg.root.display(), namespace = %cfg.namespace, "File-store discovery started.");
    loop {
        if watcher.is_none() && cfg.root.is_dir() {
            watcher = watch_root(&cfg.root, wake_tx.clone());
        }
        let job_cfg = cfg.clone();
        let job = tokio::task::spawn_blocking(move || {
            let now = unix_now();
            let result = scan(&job_cfg, &mut state, now);
            (state, result, now)
        });
        let Ok((returned, result, now)) = job.await else {
            warn!("A file-store scan panicked; the source stops.");
            return;
        };
        state = returned;
        let mut out = Vec::new();
        let (up, next_expiry) = match result {
            Ok(scan) => {
                out.extend(newly_counted(&mut state.problems, scan.problems));
                out.push(FileUpdate::Events(diff.next(scan.records)));
                (true, scan.next_expiry)
            }
            Err(ScanError::Missing(root)) => {
                // No worker has created the store yet: an empty fleet.
                watcher = None;
                if connected != Some(false) {
                    warn!(root = %root.display(), "The file-store root does not exist yet; no workers.");
                }
                out.push(FileUpdate::Events(diff.next(BTreeMap::new())));
                (false, None)
            }
            Err(error) => {
                watcher = None;
                if connected != Some(false) {
                    warn!(%error, "File-store scan failed; keeping the last records.");
                }
                (false, None)
            }
        };
        if connected != Some(up) {
            connected = Some(up);
            out.insert(0, FileUpdate::Connected(up));
        }
        for update in out {
            if matches!(&update, FileUpdate::Events(events) if events.is_empty()) {
                continue;
            }
            if updates.send(update).await.is_err() {
                return;
            }
        }
        // Next scan: the interval, the next expiry, or a filesystem change, whichever is first.
        let until_expiry = next_expiry.map(|at| at.saturating_sub(now));
        let delay = until_expiry.map_or(rescan, |d| d.min(rescan));
        tokio::select! {
            biased;
            () = updates.closed() => return,
            Some(()) = wake_rx.recv() => {
                // Gather the rest of a burst (a worker writes its files back to back).
                tokio::select! {
                    () = updates.closed() => return,
                    () = tokio::time::sleep(COALESCE) => {}
                }
                while wake_rx.try_recv().is_ok() {}
            }
            () = tokio::time::sleep(delay) => {}
        }
    }
}

/// Counts problems not seen in the previous scan; forgets the ones that went away.
fn newly_counted(
    known: &mut BTreeMap<PathBuf, DiscoveryEventKind>,
    current: BTreeMap<PathBuf, DiscoveryEventKind>,
) -> Vec<FileUpdate> {
    let mut out = Vec::new();
    for (path, kind) in &current {
        if known.get(path) != Some(kind) {
            warn!(path = %path.display(), kind = kind.as_label(), "File-store discovery refused a file.");
            out.push(FileUpdate::Counted(*kind));
        }
    }
    *known = current;
    out
}

/// Watches the root recursively; every change other than a metadata touch wakes a scan.
fn watch_root(root: &Path, wake: mpsc::Sender<()>) -> Option<notify::RecommendedWatcher> {
    use notify::event::{EventKind, ModifyKind};
    use notify::{RecursiveMode, Watcher as _};
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let wakes = match event {
            Ok(event) => !matches!(
                event.kind,
                EventKind::Access(_) | EventKind::Modify(ModifyKind::Metadata(_))
            ),
            // A lost event (queue overflow) may hide anything: scan.
            Err(_) => true,
        };
        if wakes {
            // Full means a scan is already pending.
            let _ = wake.try_send(());
        }
    })
    .map_err(|error| warn!(%error, "Cannot watch the file store; relying on periodic rescans."))
    .ok()?;
    watcher
        .watch(root, RecursiveMode::Recursive)
        .map_err(|error| {
            warn!(%error, root = %root.display(), "Cannot watch the file store; relying on periodic rescans.");
        })
        .ok()?;
    debug!(root = %root.display(), "Watching the file store.");
    Some(watcher)
}

fn unix_now() -> Duration {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
}

/// One full, bounded scan of the root at wall-clock `now` (blocking IO).
fn scan(cfg: &FileSourceConfig, state: &mut ScanState, now: Duration) -> Result<Scan, ScanError> {
    match std::fs::metadata(&cfg.root) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => return Err(ScanError::NotDirectory(cfg.root.clone())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(ScanError::Missing(cfg.root.clone()));
        }
        Err(source) => {
            return Err(ScanError::List {
                path: cfg.root.clone(),
                source,
            });
        }
    }
    let namespace = cfg.namespace.as_str();
    let mut out = Scan::default();
    let mut admission = Admission::new();
    let mut cache = BTreeMap::new();
    for (index, bucket) in BUCKETS.iter().enumerate() {
        let dir = cfg.root.join(bucket);
        let names = match list(&dir) {
            Ok(names) => names,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(source) => return Err(ScanError::List { path: dir, source }),
        };
        for name in names {
            let path = dir.join(&name);
            let mut problem = |kind: DiscoveryEventKind| {
                if out.problems.len() < MAX_REMEMBERED_PROBLEMS {
                    out.problems.insert(path.clone(), kind);
                }
            };
            let Some(text) = name.to_str() else {
                problem(DiscoveryEventKind::Malformed);
                continue;
            };
            let key = match file_verdict(namespace, bucket, text) {
                FileVerdict::Ignore => continue,
                FileVerdict::Malformed(_) => {
                    problem(DiscoveryEventKind::Malformed);
                    continue;
                }
                FileVerdict::Key(key) => key,
            };
            let meta = match std::fs::symlink_metadata(&path) {
                Ok(meta) => meta,
                // Removed between the listing and now.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(_) => {
                    problem(DiscoveryEventKind::Malformed);
                    continue;
                }
            };
            if !meta.is_file() {
                problem(DiscoveryEventKind::Malformed);
                continue;
            }
            let modified = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
                .unwrap_or_default();
            if !is_live(modified, now, cfg.ttl) {
                continue;
            }
            if let Err(refusal) = admission.admit(index, meta.len()) {
                problem(match refusal {
                    Refusal::Oversized => DiscoveryEventKind::Oversized,
                    Refusal::OverCapacity => DiscoveryEventKind::OverCapacity,
                });
                continue;
            }
            let value = match state.cache.remove(&path) {
                Some(hit) if hit.len == meta.len() && hit.modified == modified => hit.value,
                _ => match read_bounded(&path) {
                    Ok(Some(value)) => value,
                    Ok(None) => {
                        problem(DiscoveryEventKind::Oversized);
                        continue;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(_) => {
                        problem(DiscoveryEventKind::Malformed);
                        continue;
                    }
                },
            };
            let expiry = expires_at(modified, cfg.ttl);
            out.next_expiry = Some(out.next_expiry.map_or(expiry, |e| e.min(expiry)));
            cache.insert(
                path,
                Cached {
                    len: meta.len(),
                    modified,
                    value: value.clone(),
                },
            );
            out.records.insert(key, value);
        }
    }
    state.cache = cache;
    Ok(out)
}

/// The first [`MAX_DIR_ENTRIES`] names of `dir`, sorted (so the same files are admitted first
/// on every scan).
fn list(dir: &Path) -> std::io::Result<Vec<std::ffi::OsString>> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        if names.len() >= MAX_DIR_ENTRIES {
            warn!(dir = %dir.display(), limit = MAX_DIR_ENTRIES, "File-store bucket has too many entries; the rest are ignored.");
            break;
        }
        names.push(entry?.file_name());
    }
    names.sort();
    Ok(names)
}

/// Reads a regular file of at most [`MAX_FILE_BYTES`]; `None` when it is (or grew) larger.
fn read_bounded(path: &Path) -> std::io::Result<Option<Vec<u8>>> {
    let file = std::fs::File::open(path)?;
    let len = file.metadata()?.len();
    if len > MAX_FILE_BYTES {
        return Ok(None);
    }
    let mut value = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    file.take(MAX_FILE_BYTES + 1).read_to_end(&mut value)?;
    if value.len() as u64 > MAX_FILE_BYTES {
        return Ok(None);
    }
    Ok(Some(value))
}

#[cfg(test)]
mod tests;
