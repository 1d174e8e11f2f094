//! Tidy checks as ordinary tests (rust-analyzer's `tidy.rs`): habits a reviewer would otherwise
//! repeat. Every Rust file starts with `//!`, there is no `mod.rs`, tests never sleep, and
//! `protocol` stays sans-IO.

use std::path::{Path, PathBuf};

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn rust_files() -> Vec<PathBuf> {
    let mut out = Vec::new();
    for top in ["src", "protocol", "actors", "tests", "benches", "build.rs"] {
        collect(&repo_root().join(top), &mut out);
    }
    out
}

fn collect(path: &Path, out: &mut Vec<PathBuf>) {
    if path.is_file() {
        if path.extension().is_some_and(|e| e == "rs") {
            out.push(path.to_path_buf());
        }
        return;
    }
    let Ok(entries) = std::fs::read_dir(path) else {
        return;
    };
    for entry in entries.flatten() {
        let p = entry.path();
        if p.file_name()
            .is_some_and(|n| n == "target" || n == "golden")
        {
            continue;
        }
        collect(&p, out);
    }
}

fn rel(p: &Path) -> String {
    p.strip_prefix(repo_root())
        .unwrap_or(p)
        .display()
        .to_string()
}

#[test]
fn every_rust_file_starts_with_a_module_doc() {
    let offenders: Vec<_> = rust_files()
        .into_iter()
        .filter(|p| {
            let text = std::fs::read_to_string(p).unwrap_or_default();
            !text.trim_start().starts_with("//!")
        })
        .map(|p| rel(&p))
        .collect();
    assert!(
        offenders.is_empty(),
        "files without a leading //! doc: {offenders:?}"
    );
}

#[test]
fn no_mod_rs() {
    let offenders: Vec<_> = rust_files()
        .into_iter()
        .filter(|p| p.file_name().is_some_and(|n| n == "mod.rs"))
        .map(|p| rel(&p))
        .collect();
    assert!(
        offenders.is_empty(),
        "use foo.rs + foo/ instead of mod.rs: {offenders:?}"
    );
}

#[test]
fn tests_never_sleep() {
    // Synchronise on replies, channels and snapshot generations instead.
    let needles = [
        concat!("thread::", "sleep("),
        concat!("time::", "sleep("),
        concat!("tokio::time::", "sleep("),
    ];
    let offenders: Vec<_> = rust_files()
        .into_iter()
        .filter(|p| {
            let r = rel(p);
            r.starts_with("tests/") || r.contains("/tests/") || r.ends_with("_tests.rs")
        })
        .filter(|p| {
            let text = std::fs::read_to_string(p).unwrap_or_default();
            needles.iter().any(|n| text.contains(n))
        })
        .map(|p| rel(&p))
        .collect();
    assert!(offenders.is_empty(), "tests that sleep: {offenders:?}");
}

#[test]
fn protocol_stays_sans_io() {
    let manifest =
        std::fs::read_to_string(repo_root().join("protocol/Cargo.toml")).expect("manifest");
    let deps = manifest.split("[dependencies]").nth(1).unwrap_or("");
    let deps = deps.split("\n[").next().unwrap_or("");
    for forbidden in [
        "tokio",
        "ractor",
        "etcd-client",
        "kube",
        "hyper",
        "axum",
        "reqwest",
        "zeromq",
    ] {
        let hit = deps.lines().any(|l| {
            let name = l.split(['=', '.', ' ']).next().unwrap_or("").trim();
            name == forbidden
        });
        assert!(!hit, "protocol must not depend on {forbidden}");
    }
    let mut files = Vec::new();
    collect(&repo_root().join("protocol/src"), &mut files);
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap_or_default();
        for needle in [
            "std::net::",
            "std::fs::",
            "TcpStream",
            "Instant::now",
            "SystemTime::now",
        ] {
            assert!(
                !text.contains(needle),
                "{} uses {needle}: protocol does no IO and reads no clock",
                rel(&f)
            );
        }
    }
}
