//! Tidy check for the read-only contract: the etcd discovery source never writes, deletes,
//! compacts or touches a lease, and the file-store source never writes, touches or deletes a
//! file. A failing line here is a broken promise, not a style nit.

use std::path::{Path, PathBuf};

/// Client calls that would write, delete, compact, run a transaction or hold a lease.
const FORBIDDEN: &[&str] = &[
    "put(",
    "delete(",
    "txn(",
    "Txn",
    "TxnOp",
    ".compact(",
    "lease_grant",
    "lease_keep_alive",
    "lease_revoke",
    "lease_client",
    "LeaseClient",
    "LockOptions",
    "lock_client",
    "campaign(",
    "proclaim(",
    "election_client",
    "auth_client",
    "maintenance_client",
    "cluster_client",
    "PutOptions",
    "DeleteOptions",
    "LeaseGrantOptions",
];

fn source_files() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("actors/src");
    let mut files = vec![root.join("etcd_source.rs")];
    let dir = root.join("etcd_source");
    let mut stack = vec![dir];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read actors/src/etcd_source") {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files
}

#[test]
fn the_etcd_source_only_reads() {
    let files = source_files();
    assert!(
        files.len() >= 2,
        "expected etcd_source.rs and its submodules"
    );
    let mut violations = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("read a source file");
        for (number, line) in text.lines().enumerate() {
            for pattern in FORBIDDEN {
                if line.contains(pattern) {
                    violations.push(format!(
                        "{}:{}: `{pattern}` in `{}`",
                        file.display(),
                        number + 1,
                        line.trim()
                    ));
                }
            }
        }
    }
    assert!(
        violations.is_empty(),
        "the etcd source must only range-get and watch:\n{}",
        violations.join("\n")
    );
}

/// Filesystem calls that would write, touch, rename or delete (the file-store source only lists,
/// stats and reads; its tests, which play the workers, live in `file_source/tests.rs`).
const FORBIDDEN_FS: &[&str] = &[
    "fs::write",
    "remove_file",
    "remove_dir",
    "rename(",
    "create_dir",
    "File::create",
    "OpenOptions",
    "File::options",
    "set_modified",
    "set_times",
    "set_len",
    "set_permissions",
    ".write(true)",
    ".append(true)",
];

#[test]
fn the_file_store_source_only_reads() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("actors/src/file_source.rs");
    let text = std::fs::read_to_string(&path).expect("read actors/src/file_source.rs");
    let violations: Vec<String> = text
        .lines()
        .enumerate()
        .flat_map(|(number, line)| {
            FORBIDDEN_FS
                .iter()
                .filter(|pattern| line.contains(*pattern))
                .map(move |pattern| format!("{}: `{pattern}` in `{}`", number + 1, line.trim()))
        })
        .collect();
    assert!(
        violations.is_empty(),
        "the file-store source must only list, stat and read:\n{}",
        violations.join("\n")
    );
    // Guard against a pattern list that can never match.
    assert!(
        FORBIDDEN_FS
            .iter()
            .any(|p| "std::fs::remove_file(&path)?;".contains(p))
    );
}

#[test]
fn the_tidy_check_catches_a_write() {
    // Guard against a pattern list that can never match.
    let line = "        kv.put(key, value, None).await?;";
    assert!(FORBIDDEN.iter().any(|p| line.contains(p)));
    let line = "client.lease_keep_alive(id).await";
    assert!(FORBIDDEN.iter().any(|p| line.contains(p)));
}
