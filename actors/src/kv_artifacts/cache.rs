//! The content-addressed artifact cache: `<kv.artifact_cache_dir>/blobs/<64 hex>`, owner-only
//! (0700 directories, 0600 files), verified by blake3 on every read and evicted when the bytes
//! no longer match (modified on disk) or exceed the artifact bound.
//!
//! Blocking file IO: call it from the blocking pool.

use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use continuum_protocol::kv::artifacts::{Checksum, MAX_ARTIFACT_BYTES};

/// Why the cache could not be used.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("artifact cache directory {path}: {source}")]
    Dir { path: PathBuf, source: io::Error },
    #[error("artifact cache blob {path}: {source}")]
    Blob { path: PathBuf, source: io::Error },
}

/// What a read found.
#[derive(Debug, PartialEq, Eq)]
pub enum CacheRead {
    /// Present and verified.
    Hit(Vec<u8>),
    Miss,
    /// Present but modified or oversized on disk: removed.
    Evicted,
}

/// The blob directory. Cheap to clone.
#[derive(Clone, Debug)]
pub struct BlobCache {
    blobs: PathBuf,
}

impl BlobCache {
    /// Creates `<root>/blobs` owner-only (tightening existing directories to 0700).
    pub fn open(root: &Path) -> Result<Self, CacheError> {
        let blobs = root.join("blobs");
        for dir in [root, blobs.as_path()] {
            let err = |source| CacheError::Dir {
                path: dir.to_owned(),
                source,
            };
            DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(err)?;
            // `mode` applies only to directories it creates; an existing one may be wider.
            fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(err)?;
        }
        Ok(Self { blobs })
    }

    /// The blob path of `checksum`.
    pub fn path(&self, checksum: &Checksum) -> PathBuf {
        self.blobs.join(checksum.hex())
    }

    /// Reads and verifies the blob of `checksum`. The length is checked before allocating, and
    /// a blob that fails verification is removed so the next load fetches it again.
    pub fn read(&self, checksum: &Checksum) -> Result<CacheRead, CacheError> {
        let path = self.path(checksum);
        let err = |source| CacheError::Blob {
            path: path.clone(),
            source,
        };
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(CacheRead::Miss),
            Err(e) => return Err(err(e)),
        };
        let len = file.metadata().map_err(err)?.len();
        if len > MAX_ARTIFACT_BYTES {
            self.evict(checksum)?;
            return Ok(CacheRead::Evicted);
        }
        let bytes = read_bounded(file, len).map_err(err)?;
        if let Some(bytes) = bytes.filter(|b| checksum.matches(b)) {
            return Ok(CacheRead::Hit(bytes));
        }
        self.evict(checksum)?;
        Ok(CacheRead::Evicted)
    }

    /// Stores verified bytes: written owner-only to a temporary name, then renamed into place so
    /// a reader never sees a partial blob.
    pub fn write(&self, checksum: &Checksum, bytes: &[u8]) -> Result<(), CacheError> {
        let path = self.path(checksum);
        let tmp = self.blobs.join(format!(".{}.tmp", checksum.hex()));
        let err = |source| CacheError::Blob {
            path: path.clone(),
            source,
        };
        let _ = fs::remove_file(&tmp);
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(err)?;
        file.write_all(bytes).map_err(err)?;
        file.sync_all().map_err(err)?;
        drop(file);
        fs::rename(&tmp, &path).map_err(err)
    }

    /// Removes the blob of `checksum` (absent is fine).
    pub fn evict(&self, checksum: &Checksum) -> Result<(), CacheError> {
        let path = self.path(checksum);
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(CacheError::Blob { path, source }),
        }
    }
}

/// Reads at most [`MAX_ARTIFACT_BYTES`] from `file`, allocating `expected` up front. `None` when
/// the file grew past the bound while being read.
pub(crate) fn read_bounded(file: File, expected: u64) -> io::Result<Option<Vec<u8>>> {
    let capacity = usize::try_from(expected.min(MAX_ARTIFACT_BYTES)).unwrap_or(0);
    let mut bytes = Vec::with_capacity(capacity);
    file.take(MAX_ARTIFACT_BYTES + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_ARTIFACT_BYTES {
        return Ok(None);
    }
    Ok(Some(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(path: &Path) -> u32 {
        fs::metadata(path).expect("metadata").permissions().mode() & 0o777
    }

    #[test]
    fn blobs_are_owner_only_and_verified_on_every_read() {
        let root = tempfile::tempdir().expect("tempdir");
        let cache_root = root.path().join("kv");
        fs::create_dir(&cache_root).expect("pre-existing");
        fs::set_permissions(&cache_root, fs::Permissions::from_mode(0o755)).expect("chmod");
        let cache = BlobCache::open(&cache_root).expect("open");
        assert_eq!(
            mode(&cache_root),
            0o700,
            "an existing directory is tightened"
        );
        assert_eq!(mode(&cache_root.join("blobs")), 0o700);

        let bytes = b"{\"model\":{}}".to_vec();
        let checksum = Checksum::of(&bytes);
        assert_eq!(cache.read(&checksum).expect("read"), CacheRead::Miss);
        cache.write(&checksum, &bytes).expect("write");
        let path = cache.path(&checksum);
        assert_eq!(
            path.file_name().and_then(|n| n.to_str()),
            Some(checksum.hex().as_str())
        );
        assert_eq!(mode(&path), 0o600);
        assert_eq!(
            cache.read(&checksum).expect("read"),
            CacheRead::Hit(bytes.clone())
        );

        // Tampered on disk: evicted, and the next read is a miss.
        fs::write(&path, b"{\"model\":{\"evil\":1}}").expect("tamper");
        assert_eq!(cache.read(&checksum).expect("read"), CacheRead::Evicted);
        assert!(!path.exists());
        assert_eq!(cache.read(&checksum).expect("read"), CacheRead::Miss);
    }

    #[test]
    fn an_oversized_blob_is_evicted_without_being_read() {
        let root = tempfile::tempdir().expect("tempdir");
        let cache = BlobCache::open(root.path()).expect("open");
        let checksum = Checksum::of(b"x");
        let path = cache.path(&checksum);
        // A sparse file: its length passes the bound without writing 64 MiB.
        let file = File::create(&path).expect("create");
        file.set_len(MAX_ARTIFACT_BYTES + 1).expect("set_len");
        assert_eq!(cache.read(&checksum).expect("read"), CacheRead::Evicted);
        assert!(!path.exists());
    }
}
