//! Tidy checks as ordinary tests (rust-analyzer's `tidy.rs`): habits a reviewer would otherwise
//! repeat. Every Rust file starts with `//!`, there is no `mod.rs`, tests never sleep (test files
//! and inline `#[cfg(test)]` modules alike), `protocol` stays sans-IO, nothing reads a path
//! outside the repository (a fresh clone must pass its own tests), the top-level modules of
//! `src/`, `actors/src/` and `protocol/src/` import each other without a cycle beyond the
//! allowlisted ones, and product functions and files stay under their size limits (`size`).

use std::path::{Path, PathBuf};

mod size;

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn rust_files() -> Vec<PathBuf> {
    let mut out = Vec::new();
    for top in [
        "src", "protocol", "actors", "demo", "prompt", "replay", "tests", "benches", "build.rs",
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
        "prompt",
        "replay",
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

/// Dynamo's msgpack-encoded events are decoded in `protocol` only: no other crate's manifest
/// depends on the msgpack crates and no other source file names them.
#[test]
fn only_protocol_decodes_dynamo_wire_formats() {
    let wire_crates = ["rmp-serde", "rmpv", "rmp"];
    for manifest in ["Cargo.toml", "actors/Cargo.toml", "demo/Cargo.toml"] {
        let text = std::fs::read_to_string(repo_root().join(manifest)).expect("manifest");
        // The root manifest's [workspace.dependencies] declares versions for protocol to use.
        let sections = text
            .split("\n[")
            .filter(|s| s.contains("dependencies]") && !s.starts_with("workspace.dependencies]"));
        for section in sections {
            for line in section.lines().skip(1) {
                let name = line.split(['=', '.', ' ']).next().unwrap_or("").trim();
                assert!(
                    !wire_crates.contains(&name),
                    "{manifest} depends on {name}: only protocol decodes Dynamo's wire formats"
                );
            }
        }
    }
    let mut files = Vec::new();
    for dir in ["src", "actors/src", "demo/src"] {
        collect(&repo_root().join(dir), &mut files);
    }
    assert!(files.len() > 20, "the scan found the sources");
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap_or_default();
        for needle in ["rmp_serde::", "rmpv::"] {
            assert!(
                !text.contains(needle),
                "{} uses {needle}: only protocol decodes Dynamo's wire formats",
                rel(&f)
            );
        }
    }
}

/// The top-level modules of `src/` a Rust source text names through `crate::` (plain paths and
/// `crate::{a, b::c}` groups); comment lines are skipped. `super::x` in a top-level file names
/// `x` too.
fn crate_modules_named(text: &str, top_level_file: bool) -> Vec<String> {
    fn ident(s: &str) -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    }
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim_start();
        if line.starts_with("//") {
            continue;
        }
        let mut heads: Vec<&str> = line.split("crate::").skip(1).collect();
        if top_level_file {
            heads.extend(line.split("super::").skip(1));
        }
        for head in heads {
            match head.strip_prefix('{') {
                // A group: the first segment of each item (nested groups are rare and only
                // repeat a module already named).
                Some(group) => out.extend(
                    group
                        .split(',')
                        .map(|item| ident(item.trim()))
                        .filter(|m| !m.is_empty()),
                ),
                None => out.push(ident(head)),
            }
        }
    }
    out.retain(|m| !m.is_empty() && m != "self");
    out
}

/// A crate's top-level modules and the ones each names (`<src>/M.rs` and everything under
/// `<src>/M/`, test code left out; `src` is relative to the repository root).
fn module_graph(
    src: &str,
) -> std::collections::BTreeMap<String, std::collections::BTreeSet<String>> {
    let src = repo_root().join(src);
    let mut graph = std::collections::BTreeMap::<String, std::collections::BTreeSet<String>>::new();
    let mut files = Vec::new();
    collect(&src, &mut files);
    for file in files {
        let relative = file.strip_prefix(&src).expect("under src");
        let mut parts = relative.components();
        let first = parts
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .unwrap_or("");
        let top_level_file = parts.next().is_none();
        let module = first.trim_end_matches(".rs").to_string();
        if module == "lib" || module == "main" {
            continue;
        }
        // Test code is left out: a test may import what the module itself does not.
        if file.file_name().is_some_and(|n| n == "tests.rs") {
            continue;
        }
        let text = size::product_code(&std::fs::read_to_string(&file).unwrap_or_default());
        let named = crate_modules_named(&text, top_level_file);
        let edges = graph.entry(module.clone()).or_default();
        edges.extend(named.into_iter().filter(|m| *m != module));
    }
    graph
}

#[test]
fn module_scan_reads_paths_groups_and_super() {
    let text = "use crate::proxy::Dispatch;\nuse crate::{config, kv::PreparedPrompt};\n\
                // crate::front_door in a comment\nlet x = super::route::serve();\n";
    assert_eq!(
        crate_modules_named(text, true),
        vec!["proxy", "config", "kv", "route"]
    );
    assert_eq!(
        crate_modules_named(text, false),
        vec!["proxy", "config", "kv"]
    );
}

/// The strongly connected components of `graph` with more than one module (each a set of modules
/// that import each other in a circle), each sorted; edges to names that are not modules are
/// ignored.
fn import_cycles(
    graph: &std::collections::BTreeMap<String, std::collections::BTreeSet<String>>,
) -> Vec<Vec<String>> {
    // Tarjan's algorithm; the graphs have a few dozen nodes, so recursion is fine.
    struct Scan<'g> {
        graph: &'g std::collections::BTreeMap<String, std::collections::BTreeSet<String>>,
        index: std::collections::BTreeMap<&'g str, (usize, usize)>,
        stack: Vec<&'g str>,
        on_stack: std::collections::BTreeSet<&'g str>,
        out: Vec<Vec<String>>,
    }
    impl<'g> Scan<'g> {
        fn visit(&mut self, node: &'g str) {
            let n = self.index.len();
            self.index.insert(node, (n, n));
            self.stack.push(node);
            self.on_stack.insert(node);
            let graph = self.graph;
            let edges = graph[node].iter().filter(|m| graph.contains_key(*m));
            for next in edges {
                let next = next.as_str();
                if !self.index.contains_key(next) {
                    self.visit(next);
                    let low = self.index[next].1.min(self.index[node].1);
                    self.index.get_mut(node).expect("visited").1 = low;
                } else if self.on_stack.contains(next) {
                    let low = self.index[next].0.min(self.index[node].1);
                    self.index.get_mut(node).expect("visited").1 = low;
                }
            }
            if self.index[node].0 == self.index[node].1 {
                let mut component = Vec::new();
                while let Some(member) = self.stack.pop() {
                    self.on_stack.remove(member);
                    component.push(member.to_owned());
                    if member == node {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.out.push(component);
                }
            }
        }
    }
    let mut scan = Scan {
        graph,
        index: Default::default(),
        stack: Vec::new(),
        on_stack: Default::default(),
        out: Vec::new(),
    };
    for node in graph.keys() {
        if !scan.index.contains_key(node.as_str()) {
            scan.visit(node);
        }
    }
    scan.out.sort();
    scan.out
}

#[test]
fn import_cycles_are_the_strongly_connected_modules() {
    let graph = |edges: &[(&str, &str)]| {
        let mut g = std::collections::BTreeMap::<String, std::collections::BTreeSet<String>>::new();
        for (a, b) in edges {
            g.entry(a.to_string()).or_default().insert(b.to_string());
            g.entry(b.to_string()).or_default();
        }
        g
    };
    assert!(import_cycles(&graph(&[("a", "b"), ("b", "c")])).is_empty());
    assert_eq!(
        import_cycles(&graph(&[
            ("c", "a"),
            ("a", "b"),
            ("b", "c"),
            ("c", "d"),
            ("d", "e"),
            ("e", "d")
        ])),
        [vec!["a", "b", "c"], vec!["d", "e"]]
    );
}

/// The request path reads top-down (front_door → route → proxy, protocol below), and so do the
/// actors and the sans-IO core: no top-level module of `src/`, `actors/src/` or `protocol/src/`
/// reaches back up to one that names it, except the circles on tests/it/tidy/import_cycles.txt
/// (`<crate src>: <module> <module> ...`, the members sorted), which only shrinks: a listed
/// circle that changed or is gone fails too.
#[test]
fn src_modules_import_without_a_cycle() {
    let mut found = std::collections::BTreeSet::new();
    for src in ["src", "actors/src", "protocol/src"] {
        let graph = module_graph(src);
        assert!(graph.len() > 5, "the scan found {src}'s modules");
        for component in import_cycles(&graph) {
            found.insert(format!("{src}: {}", component.join(" ")));
        }
    }
    let path = repo_root().join("tests/it/tidy/import_cycles.txt");
    let listed: std::collections::BTreeSet<String> = std::fs::read_to_string(&path)
        .expect("read tests/it/tidy/import_cycles.txt")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect();
    let new: Vec<&String> = found.difference(&listed).collect();
    let gone: Vec<&String> = listed.difference(&found).collect();
    assert!(
        new.is_empty(),
        "modules import each other in a circle, not on tests/it/tidy/import_cycles.txt: {new:#?}"
    );
    assert!(
        gone.is_empty(),
        "on tests/it/tidy/import_cycles.txt but no longer a circle (strike or update them): {gone:#?}"
    );
}
