//! Dynamo's file discovery store (dynamo-wire §16), the pure part: file names to etcd-style keys,
//! the mtime liveness rule, bounded admission, and the diff of one directory scan against the
//! previous one as [`SourceEvent`]s.
//!
//! Layout, as Dynamo 1.6.1 writes it (checked against a live `--discovery-backend file` mocker):
//! the root (`DYN_FILE_KV`, else `$TMPDIR/dynamo_store_kv`) holds one directory per bucket
//! (`v1/instances`, `v1/mdc`, `v1/event_channels`, `v1/event_sources`); each key is one file
//! whose name is the key relative to its bucket with every byte that is not ASCII alphanumeric
//! written as `%XX` (uppercase hex; `/`, `-`, `_` and `.` included), and whose content is the
//! same JSON value etcd would hold. So `v1/instances/dyntest/backend/generate/2fb7a12752f64e86`
//! lives in `<root>/v1/instances/dyntest%2Fbackend%2Fgenerate%2F2fb7a12752f64e86`. A writer
//! fills `.tmp_<random hex>`, hard-links it to the key's name and unlinks it, so files whose
//! name starts with `.tmp_` are writes in progress and are ignored.
//!
//! Liveness: a live owner touches every one of its files every TTL/3 (≈ 3.3 s for the 10 s TTL);
//! a file not touched within the TTL belongs to a dead process. Live Dynamo processes delete such
//! files when they sweep; the router never deletes anything, it treats an expired file as absent.
//!
//! Everything here is pure: the caller walks the directories, reads the clock and the files.

use std::collections::BTreeMap;
use std::time::Duration;

use super::SourceEvent;
use super::keys::{KeyError, classify, percent_decode, percent_encode};
use super::records::{MAX_RECORD_BYTES, MAX_RECORDS_PER_KEYSPACE, clip};

/// The environment variable naming the store's root (Dynamo's `DYN_FILE_KV`).
pub const ROOT_ENV: &str = "DYN_FILE_KV";
/// The root's directory name under the temp dir when `DYN_FILE_KV` is unset.
pub const DEFAULT_ROOT_DIR: &str = "dynamo_store_kv";
/// The TTL Dynamo 1.6.1 gives every file-store key.
pub const DEFAULT_TTL: Duration = Duration::from_secs(10);
/// Prefix of the temporary files a writer links into place.
pub const TMP_PREFIX: &str = ".tmp_";
/// The bucket directories under the root, in scan order (keys are `<bucket>/<decoded name>`).
pub const BUCKETS: [&str; 4] = [
    "v1/instances",
    "v1/mdc",
    "v1/event_channels",
    "v1/event_sources",
];
/// Most directory entries looked at per bucket and scan; the rest are not even stat'ed.
pub const MAX_DIR_ENTRIES: usize = 4 * MAX_RECORDS_PER_KEYSPACE;
/// Largest file read (the etcd path's record bound); larger files are counted, never read.
pub const MAX_FILE_BYTES: u64 = MAX_RECORD_BYTES as u64;
/// Most bytes read in one scan; files past it are refused as oversized until the next scan.
pub const MAX_SCAN_BYTES: u64 = 256 * 1024 * 1024;

/// Why a directory entry is not a record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FileNameError {
    #[error("file name {0:?} is not valid UTF-8")]
    NotUtf8(String),
    #[error("file name {0:?} is not a percent-encoded key: {1}")]
    Key(String, KeyError),
    #[error("file name decodes to an empty key")]
    Empty,
}

/// Dynamo's file-name encoding of a key relative to its bucket: ASCII alphanumerics pass, every
/// other byte becomes `%` and two uppercase hex digits.
pub fn encode_file_name(relative_key: &str) -> String {
    percent_encode(relative_key, |b| b.is_ascii_alphanumeric())
}

/// Reverses [`encode_file_name`]: escapes must be complete (either hex case), the result UTF-8,
/// and no byte the encoder escapes may appear raw, so one key has exactly one file name.
pub fn decode_file_name(name: &str) -> Result<String, FileNameError> {
    let key = percent_decode(name, |b| b.is_ascii_alphanumeric())
        .map_err(|e| FileNameError::Key(clip(name), e))?;
    if key.is_empty() {
        return Err(FileNameError::Empty);
    }
    Ok(key)
}

/// What one directory entry of `bucket` means to a reducer watching `namespace`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileVerdict {
    /// A write in progress (`.tmp_…`), or a key of another namespace or outside the buckets.
    Ignore,
    /// A key of this namespace: the full etcd-style key.
    Key(String),
    /// Not a key at all (counted as malformed once).
    Malformed(FileNameError),
}

/// Maps a file `name` in `bucket` (one of [`BUCKETS`]) to the etcd key it stands for.
///
/// Keys whose shape is wrong inside this namespace's keyspace are still returned: the reducer
/// counts them as malformed exactly as it does for etcd keys.
pub fn file_verdict(namespace: &str, bucket: &str, name: &str) -> FileVerdict {
    if name.starts_with(TMP_PREFIX) {
        return FileVerdict::Ignore;
    }
    let relative = match decode_file_name(name) {
        Ok(relative) => relative,
        Err(e) => return FileVerdict::Malformed(e),
    };
    let key = format!("{bucket}/{relative}");
    match classify(namespace, &key) {
        Some(_) => FileVerdict::Key(key),
        None => FileVerdict::Ignore,
    }
}

/// Whether a file last modified at `modified` is still owned by a live process at `now`, both
/// as durations since the Unix epoch. A file exactly `ttl` old is still live; a modification
/// time in the future (clock skew) counts as just touched.
pub fn is_live(modified: Duration, now: Duration, ttl: Duration) -> bool {
    now.saturating_sub(modified) <= ttl
}

/// When a file last modified at `modified` stops being live (the first instant past the TTL).
pub fn expires_at(modified: Duration, ttl: Duration) -> Duration {
    modified
        .saturating_add(ttl)
        .saturating_add(Duration::from_nanos(1))
}

/// Why a key of a scan was not admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The file is above [`MAX_FILE_BYTES`], or the scan's byte budget is spent.
    Oversized,
    /// Its keyspace already admitted [`MAX_RECORDS_PER_KEYSPACE`] keys in this scan.
    OverCapacity,
}

/// Bounded admission of one scan: per-keyspace key counts and a total byte budget, decided in
/// the order the caller offers keys (sorted key order per bucket, so the same files win every
/// scan).
#[derive(Debug, Default)]
pub struct Admission {
    per_bucket: BTreeMap<usize, usize>,
    bytes: u64,
}

impl Admission {
    pub fn new() -> Self {
        Self::default()
    }

    /// Admits a live file of `len` bytes in bucket number `bucket`, or says why not. Call it
    /// before reading the file: a refused file is never read.
    pub fn admit(&mut self, bucket: usize, len: u64) -> Result<(), Refusal> {
        if len > MAX_FILE_BYTES || self.bytes.saturating_add(len) > MAX_SCAN_BYTES {
            return Err(Refusal::Oversized);
        }
        let count = self.per_bucket.entry(bucket).or_default();
        if *count >= MAX_RECORDS_PER_KEYSPACE {
            return Err(Refusal::OverCapacity);
        }
        *count += 1;
        self.bytes += len;
        Ok(())
    }
}

/// The records of the previous scan; turns each complete scan into the events a watch would
/// have produced. The first scan (and the first after [`FileStoreDiff::resync`]) is a full
/// `Init` … `InitDone` pass, later ones are `Apply` for new or changed values and `Delete` for
/// keys that vanished or expired.
#[derive(Debug, Default)]
pub struct FileStoreDiff {
    held: BTreeMap<String, Vec<u8>>,
    synced: bool,
}

impl FileStoreDiff {
    pub fn new() -> Self {
        Self::default()
    }

    /// The next scan becomes a full resync.
    pub fn resync(&mut self) {
        self.synced = false;
    }

    /// The records currently held (the last scan's live keys).
    pub fn held(&self) -> &BTreeMap<String, Vec<u8>> {
        &self.held
    }

    /// Folds a complete scan (every live, admitted key of the namespace and its value).
    pub fn next(&mut self, scan: BTreeMap<String, Vec<u8>>) -> Vec<SourceEvent> {
        let mut events = Vec::new();
        if !self.synced {
            events.push(SourceEvent::Init);
            events.extend(scan.iter().map(|(key, value)| SourceEvent::InitApply {
                key: key.clone(),
                value: value.clone(),
            }));
            events.push(SourceEvent::InitDone);
            self.synced = true;
        } else {
            for key in self.held.keys() {
                if !scan.contains_key(key) {
                    events.push(SourceEvent::Delete { key: key.clone() });
                }
            }
            for (key, value) in &scan {
                if self.held.get(key) != Some(value) {
                    events.push(SourceEvent::Apply {
                        key: key.clone(),
                        value: value.clone(),
                    });
                }
            }
        }
        self.held = scan;
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // File names and keys a live 1.6.1 aggregated mocker wrote (DYN_FILE_KV, namespace dyntest).
    const OBSERVED: [(&str, &str, &str); 5] = [
        (
            "v1/instances",
            "dyntest%2Fbackend%2Fgenerate%2F2fb7a12752f64e86",
            "v1/instances/dyntest/backend/generate/2fb7a12752f64e86",
        ),
        (
            "v1/instances",
            "dyntest%2Fbackend%2Fworker%5Fkv%5Fquery%5Fsource%5F1c2c804870527f%2F2fb7a12752f64e86",
            "v1/instances/dyntest/backend/worker_kv_query_source_1c2c804870527f/2fb7a12752f64e86",
        ),
        (
            "v1/mdc",
            "dyntest%2Fbackend%2Fgenerate%2F2fb7a12752f64e86",
            "v1/mdc/dyntest/backend/generate/2fb7a12752f64e86",
        ),
        (
            "v1/event_channels",
            "namespace%2Fdyntest%2Fcomponent%2Fbackend%2Fendpoint%2Fgenerate%2Ftopic%2Fkv%2Devents%2F1c2c804870527f",
            "v1/event_channels/namespace/dyntest/component/backend/endpoint/generate/topic/kv-events/1c2c804870527f",
        ),
        (
            "v1/event_sources",
            "namespace%2Fdyntest%2Fcomponent%2Fbackend%2Fendpoint%2Fgenerate%2Ftopic%2Fkv%2Devents%2F1c2c804870527f",
            "v1/event_sources/namespace/dyntest/component/backend/endpoint/generate/topic/kv-events/1c2c804870527f",
        ),
    ];

    #[test]
    fn observed_file_names_map_to_the_etcd_keys() {
        for (bucket, name, key) in OBSERVED {
            assert_eq!(
                file_verdict("dyntest", bucket, name),
                FileVerdict::Key(key.to_owned()),
                "{name}"
            );
            let relative = key.strip_prefix(&format!("{bucket}/")).unwrap();
            assert_eq!(encode_file_name(relative), name);
        }
    }

    #[test]
    fn event_keys_keep_their_inner_segment_encoding() {
        // `my.ns` is `my%2Ens` inside an event key, so its file name escapes that `%` again.
        let key = "namespace/my%2Ens/topic/kv_metrics/ab";
        let name = encode_file_name(key);
        assert_eq!(name, "namespace%2Fmy%252Ens%2Ftopic%2Fkv%5Fmetrics%2Fab");
        assert_eq!(
            file_verdict("my.ns", "v1/event_channels", &name),
            FileVerdict::Key(format!("v1/event_channels/{key}"))
        );
    }

    #[test]
    fn other_namespaces_and_temporaries_are_ignored() {
        let (bucket, name, _) = OBSERVED[0];
        assert_eq!(file_verdict("other", bucket, name), FileVerdict::Ignore);
        assert_eq!(
            file_verdict("dyntest", bucket, &format!("{TMP_PREFIX}{name}")),
            FileVerdict::Ignore
        );
        // A prefix of the namespace is another namespace.
        assert_eq!(file_verdict("dyntes", bucket, name), FileVerdict::Ignore);
    }

    #[test]
    fn names_that_are_not_encoded_keys_are_malformed() {
        for name in [
            "dyntest/backend",        // raw separator
            "dyntest%2Fbackend.json", // raw dot
            "dyntest%2",              // truncated escape
            "dyntest%zz",             // not hex
            "%FF%FE",                 // not UTF-8
            "editor-backup~",         // raw punctuation
            "v1%2Finstances%2F%44yn", // `D` escaped: its only file name is raw (fuzzing finding)
        ] {
            assert!(
                matches!(
                    file_verdict("dyntest", "v1/instances", name),
                    FileVerdict::Malformed(_)
                ),
                "{name}"
            );
        }
        assert_eq!(decode_file_name(""), Err(FileNameError::Empty));
        // Lowercase escapes decode too (one spelling is written, both are read).
        assert_eq!(decode_file_name("a%2fb").unwrap(), "a/b");
    }

    #[test]
    fn badly_shaped_keys_in_the_namespace_reach_the_reducer() {
        // Too few segments: still this namespace's keyspace, so the reducer counts it.
        let name = encode_file_name("dyntest/backend/2fb7");
        assert_eq!(
            file_verdict("dyntest", "v1/instances", &name),
            FileVerdict::Key("v1/instances/dyntest/backend/2fb7".into())
        );
    }

    #[test]
    fn liveness_is_mtime_within_the_ttl() {
        let s = Duration::from_secs;
        let ttl = DEFAULT_TTL;
        assert!(is_live(s(100), s(100), ttl));
        assert!(is_live(s(100), s(110), ttl));
        assert!(!is_live(s(100), s(110) + Duration::from_nanos(1), ttl));
        assert!(!is_live(s(100), s(200), ttl));
        // Modified "in the future": live.
        assert!(is_live(s(200), s(100), ttl));
        assert_eq!(expires_at(s(100), ttl), s(110) + Duration::from_nanos(1));
        assert!(!is_live(s(100), expires_at(s(100), ttl), ttl));
        assert!(is_live(s(0), s(u64::MAX), Duration::MAX));
    }

    #[test]
    fn admission_bounds_sizes_counts_and_the_scan_budget() {
        let mut admission = Admission::new();
        assert_eq!(
            admission.admit(0, MAX_FILE_BYTES + 1),
            Err(Refusal::Oversized)
        );
        assert_eq!(admission.admit(0, MAX_FILE_BYTES), Ok(()));
        for _ in 1..MAX_RECORDS_PER_KEYSPACE {
            assert_eq!(admission.admit(0, 1), Ok(()));
        }
        assert_eq!(admission.admit(0, 1), Err(Refusal::OverCapacity));
        // Another bucket has its own count.
        assert_eq!(admission.admit(1, 1), Ok(()));
        // The byte budget is shared.
        let mut budget = Admission::new();
        let per = MAX_FILE_BYTES;
        let fit = usize::try_from(MAX_SCAN_BYTES / per).unwrap();
        for _ in 0..fit {
            assert_eq!(budget.admit(2, per), Ok(()));
        }
        assert_eq!(budget.admit(3, per), Err(Refusal::Oversized));
    }

    fn scan(entries: &[(&str, &str)]) -> BTreeMap<String, Vec<u8>> {
        entries
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec()))
            .collect()
    }

    #[test]
    fn scans_diff_into_a_resync_then_watch_events() {
        let mut diff = FileStoreDiff::new();
        let first = diff.next(scan(&[("k1", "a"), ("k2", "b")]));
        assert_eq!(
            first,
            vec![
                SourceEvent::Init,
                SourceEvent::InitApply {
                    key: "k1".into(),
                    value: b"a".to_vec()
                },
                SourceEvent::InitApply {
                    key: "k2".into(),
                    value: b"b".to_vec()
                },
                SourceEvent::InitDone,
            ]
        );
        // Unchanged: nothing (a touch changes only the mtime).
        assert!(diff.next(scan(&[("k1", "a"), ("k2", "b")])).is_empty());
        // k1 changed, k2 gone (deleted or expired), k3 new.
        assert_eq!(
            diff.next(scan(&[("k1", "A"), ("k3", "c")])),
            vec![
                SourceEvent::Delete { key: "k2".into() },
                SourceEvent::Apply {
                    key: "k1".into(),
                    value: b"A".to_vec()
                },
                SourceEvent::Apply {
                    key: "k3".into(),
                    value: b"c".to_vec()
                },
            ]
        );
        diff.resync();
        let again = diff.next(scan(&[("k3", "c")]));
        assert_eq!(again.first(), Some(&SourceEvent::Init));
        assert_eq!(again.last(), Some(&SourceEvent::InitDone));
        assert_eq!(diff.held().len(), 1);
    }
}
