//! Tidy checks as ordinary tests (rust-analyzer's `tidy.rs`): habits a reviewer would otherwise
//! repeat. Every Rust file starts with `//!`, there is no `mod.rs`, tests never sleep (test files
//! and inline `#[cfg(test)]` modules alike), `protocol` stays sans-IO, and nothing reads a path
//! outside the repository (a fresh clone must pass its own tests).

use std::path::{Path, PathBuf};

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn rust_files() -> Vec<PathBuf> {
    let mut out = Vec::new();
    for top in [
        "src", "protocol", "actors", "demo", "tests", "benches", "build.rs",
    ] {
        collect(&repo_root().join(top), &mut out);
    }
    out
}

fn collect(path: &Path, out: &mut Vec<PathBuf>) {
    collect_ext(path, &["rs"], out);
}

fn collect_ext(path: &Path, exts: &[&str], out: &mut Vec<PathBuf>) {
    if path.is_file() {
        if path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| exts.contains(&e))
        {
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
        collect_ext(&p, exts, out);
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

/// With `autotests = false` cargo no longer builds a `tests/NAME.rs` on its own: a test file
/// dropped there, or a module file under `tests/it/` that `main.rs` does not declare, would
/// silently never run. Every crate's integration tests are modules of its one `tests/it/main.rs`
/// (docs/ARCHITECTURE.md, "Test layout").
#[test]
fn every_integration_test_file_is_a_module_of_the_one_test_binary() {
    let mut offenders = Vec::new();
    for krate in [".", "protocol", "actors", "demo"] {
        let tests = repo_root().join(krate).join("tests");
        let entries = std::fs::read_dir(&tests).into_iter().flatten().flatten();
        for entry in entries {
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "rs") {
                offenders.push(format!("{} (move it to tests/it/)", rel(&path)));
            }
        }
        // main.rs declares the files of it/, X.rs those of it/X/ (support.rs, discovery.rs).
        let it = tests.join("it");
        let mut parents = vec![(it.join("main.rs"), it.clone())];
        for entry in std::fs::read_dir(&it).into_iter().flatten().flatten() {
            if entry.path().is_dir() {
                parents.push((entry.path().with_extension("rs"), entry.path()));
            }
        }
        for (root, dir) in parents {
            let Ok(declared) = std::fs::read_to_string(&root) else {
                continue;
            };
            let files = std::fs::read_dir(&dir).into_iter().flatten().flatten();
            for path in files.map(|e| e.path()) {
                let Some(name) = path.file_stem().and_then(|n| n.to_str()) else {
                    continue;
                };
                let is_module = path.extension().is_some_and(|e| e == "rs") && name != "main";
                let listed = declared.lines().any(|l| {
                    let l = l.trim_start().trim_start_matches("pub ");
                    l == format!("mod {name};")
                });
                if is_module && !listed {
                    offenders.push(format!(
                        "{} (no `mod {name};` in {})",
                        rel(&path),
                        rel(&root)
                    ));
                }
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "integration-test files outside the one test binary: {offenders:?}"
    );
}

/// The inline `#[cfg(test)] mod name { ... }` modules of a source file, as text (braces counted
/// naively, which is enough for this codebase: a miscount only widens or narrows the scan).
fn inline_test_modules(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("#[cfg(test)]") {
        rest = &rest[at + "#[cfg(test)]".len()..];
        let item = rest.trim_start();
        let Some(header_end) = item.find(['{', ';']) else {
            break;
        };
        let header = &item[..header_end];
        if !(header.starts_with("mod ") || header.starts_with("pub mod "))
            || item.as_bytes()[header_end] == b';'
        {
            continue;
        }
        let body = &item[header_end..];
        let mut depth = 0usize;
        let mut end = body.len();
        for (i, c) in body.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        out.push(&body[..end]);
        rest = &body[end..];
    }
    out
}

#[test]
fn tests_never_sleep() {
    // Synchronise on replies, channels and snapshot generations instead.
    let needles = [
        concat!("thread::", "sleep("),
        concat!("time::", "sleep("),
        concat!("tokio::time::", "sleep("),
    ];
    let sleeps = |text: &str| needles.iter().any(|n| text.contains(n));
    let is_test_file = |p: &Path| {
        let r = rel(p);
        r.starts_with("tests/") || r.contains("/tests/") || r.ends_with("_tests.rs")
    };
    let mut offenders: Vec<_> = rust_files()
        .into_iter()
        .filter(|p| is_test_file(p))
        .filter(|p| sleeps(&std::fs::read_to_string(p).unwrap_or_default()))
        .map(|p| rel(&p))
        .collect();
    // Inline test modules of the library crates. A module on tokio's paused clock
    // (`start_paused = true`) sleeps in virtual time: that is scripted, not waited.
    let mut sources = Vec::new();
    for top in ["src", "actors/src", "protocol/src", "demo/src"] {
        collect(&repo_root().join(top), &mut sources);
    }
    let virtual_clock = |module: &str| {
        module.contains("start_paused = true") || module.contains(concat!("time::", "pause()"))
    };
    for p in sources.into_iter().filter(|p| !is_test_file(p)) {
        let text = std::fs::read_to_string(&p).unwrap_or_default();
        if inline_test_modules(&text)
            .into_iter()
            .any(|module| sleeps(module) && !virtual_clock(module))
        {
            offenders.push(format!("{} (inline #[cfg(test)] module)", rel(&p)));
        }
    }
    assert!(offenders.is_empty(), "tests that sleep: {offenders:?}");
}

#[test]
fn inline_test_module_scan_finds_the_module_body() {
    let text = concat!(
        "fn a() { b() }\n#[cfg(test)]\nfn helper() {}\n#[cfg(test)]\nmod tests;\n",
        "#[cfg(test)]\nmod tests {\n    fn x() { if y { z() } }\n}\nfn after() {}\n"
    );
    let modules = inline_test_modules(text);
    assert_eq!(modules, ["{\n    fn x() { if y { z() } }\n}"]);
}

/// The reference material beside the repository, however it is spelled. Built with `concat!`
/// so this file does not match itself.
const SHARED_DIR_SPELLINGS: [&str; 3] = [
    concat!("../", "shared"),
    concat!("pwd)/", "shared"),
    concat!("CONTINUUM_", "SHARED_DIR"),
];

/// Absolute directories that exist only on one machine (workspace, homes). They count only at
/// the start of a path (after a quote, a space, `=`, ...), not inside a URL path of an endpoint.
const ABSOLUTE_DIRS: [&str; 4] = [
    concat!("/wo", "rk/"),
    concat!("/ho", "me/"),
    concat!("/ro", "ot/"),
    concat!("/Us", "ers/"),
];

/// The first foreign path `line` names, if any.
fn foreign_path(line: &str) -> Option<&'static str> {
    if let Some(spelling) = SHARED_DIR_SPELLINGS.iter().find(|s| line.contains(*s)) {
        return Some(spelling);
    }
    ABSOLUTE_DIRS.into_iter().find(|dir| {
        line.match_indices(dir).any(|(at, _)| {
            line[..at]
                .chars()
                .next_back()
                .is_none_or(|c| c.is_whitespace() || "\"'`=(:,[{".contains(c))
        })
    })
}

#[test]
fn foreign_path_spots_paths_outside_the_repository_only() {
    let home = concat!("/ro", "ot/");
    let work = concat!("/wo", "rk/");
    assert!(foreign_path(&format!("let p = \"{work}shared/x.jsonl\";")).is_some());
    assert!(foreign_path(&format!("cd {home}repo")).is_some());
    assert!(foreign_path(&format!("X=$(cd .. && {})", concat!("pwd)/", "shared"))).is_some());
    assert!(foreign_path(&format!("\"/admin/subsystems{home}discovery/restart\"")).is_none());
    assert!(foreign_path("join(\"tests/fixtures/vectors\")").is_none());
}

#[test]
fn nothing_reads_a_path_outside_the_repository() {
    // Every fixture a test or bench reads lives under tests/fixtures, benches/fixtures or next to
    // its test; see their READMEs.
    let mut files = Vec::new();
    for top in [
        "src",
        "actors",
        "protocol",
        "demo",
        "tests",
        "benches",
        "scripts",
        "build.rs",
        "Cargo.toml",
    ] {
        collect_ext(
            &repo_root().join(top),
            &["rs", "sh", "py", "toml"],
            &mut files,
        );
    }
    assert!(
        files.len() > 50,
        "scan found only {} files: wrong root?",
        files.len()
    );
    let mut offenders = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap_or_default();
        for (n, line) in text.lines().enumerate() {
            if let Some(needle) = foreign_path(line) {
                offenders.push(format!("{}:{}: {needle}", rel(f), n + 1));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "paths outside the repository (copy the fixture into the repo instead): {offenders:#?}"
    );
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
    // Test modules may read fixtures from disk; the code under test may not.
    let is_test = |p: &Path| {
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        name == "tests.rs"
            || name.ends_with("_tests.rs")
            || p.components().any(|c| c.as_os_str() == "tests")
    };
    for f in files.into_iter().filter(|f| !is_test(f)) {
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
