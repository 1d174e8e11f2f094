//! docs/ARCHITECTURE.md stays true to the running daemon: the supervision tree drawn there is the
//! tree `GET /admin/subsystems` lists. The demo (simulated discovery, ZMTP subscriptions, the
//! picker, the KV index, the idle event-bus listener) runs, and every node it lists must match a
//! node of the drawing (placeholders such as `<ns>` match one path segment), and every drawn node
//! without a placeholder must be running. And the code map names every module of every crate.

use std::collections::BTreeSet;

use serde_json::Value;

use crate::demo::{start_demo, wait_until_routable};

/// The nodes of the `text` block under "## Supervision tree", as paths from `root`.
fn drawn_tree(doc: &str) -> Vec<String> {
    let section = doc
        .split("## Supervision tree")
        .nth(1)
        .expect("ARCHITECTURE.md has a supervision tree section");
    let block = section
        .split("```text")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("the section draws the tree in a text block");
    let mut stack: Vec<(usize, String)> = Vec::new();
    let mut paths = Vec::new();
    for line in block.lines() {
        let (depth, rest) = if line.starts_with("root") {
            (0, line)
        } else if let Some(at) = line.find("├── ").or_else(|| line.find("└── ")) {
            // Each level indents by four columns of box drawing ("│   ").
            let column = line[..at].chars().count();
            (column / 4 + 1, &line[at + "├── ".len()..])
        } else {
            continue; // a description's continuation line
        };
        let name = rest
            .split_whitespace()
            .next()
            .expect("a node name")
            .to_string();
        while stack.last().is_some_and(|(d, _)| *d >= depth) {
            stack.pop();
        }
        let path = match stack.last() {
            Some((_, parent)) => format!("{parent}/{name}"),
            None => name,
        };
        stack.push((depth, path.clone()));
        paths.push(path);
    }
    paths
}

/// Whether `id` is the drawn `node`, a `<placeholder>` segment matching any one segment.
fn matches(node: &str, id: &str) -> bool {
    let (a, b): (Vec<&str>, Vec<&str>) = (node.split('/').collect(), id.split('/').collect());
    a.len() == b.len()
        && a.iter().zip(&b).all(|(want, got)| {
            if let (Some(start), Some(end)) = (want.find('<'), want.rfind('>')) {
                got.starts_with(&want[..start]) && got.ends_with(&want[end + 1..])
            } else {
                want == got
            }
        })
}

#[test]
fn the_tree_parser_reads_nesting_and_placeholders() {
    let doc = "## Supervision tree\n\n```text\nroot (Supervisor)\n├── registry   x\n│   more\n\
               ├── discovery  Supervisor\n│   └── <source>:<namespace> y\n└── event_bus\n    \
               └── session:<id> z\n```\n";
    assert_eq!(
        drawn_tree(doc),
        [
            "root",
            "root/registry",
            "root/discovery",
            "root/discovery/<source>:<namespace>",
            "root/event_bus",
            "root/event_bus/session:<id>",
        ]
    );
    assert!(matches(
        "root/discovery/<source>:<namespace>",
        "root/discovery/simulated:demo"
    ));
    assert!(!matches(
        "root/discovery/<source>:<namespace>",
        "root/discovery"
    ));
    assert!(matches(
        "root/event_bus/session:<id>",
        "root/event_bus/session:s-1"
    ));
    assert!(!matches(
        "root/event_bus/session:<id>",
        "root/event_bus/other"
    ));
}

#[tokio::test]
async fn the_supervision_tree_in_architecture_md_is_the_one_admin_subsystems_lists() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/ARCHITECTURE.md"))
        .expect("read docs/ARCHITECTURE.md");
    let drawn = drawn_tree(&doc);
    assert!(drawn.len() >= 8, "the drawing was read: {drawn:?}");

    let demo = start_demo().await;
    wait_until_routable(&demo).await;
    let listed: Value = reqwest::Client::new()
        .get(format!("{}/admin/subsystems", demo.url()))
        .bearer_auth("demo-admin-token")
        .send()
        .await
        .expect("GET /admin/subsystems")
        .json()
        .await
        .expect("a JSON body");
    let running: BTreeSet<String> = listed["subsystems"]
        .as_array()
        .expect("a list")
        .iter()
        .map(|s| s["id"].as_str().expect("an id").to_string())
        .collect();
    demo.shutdown().await;

    let undrawn: Vec<&String> = running
        .iter()
        .filter(|id| !drawn.iter().any(|node| matches(node, id)))
        .collect();
    assert!(
        undrawn.is_empty(),
        "running but not in docs/ARCHITECTURE.md's tree: {undrawn:?} (drawn: {drawn:?})"
    );
    let missing: Vec<&String> = drawn
        .iter()
        .filter(|node| !node.contains('<'))
        .filter(|node| !running.contains(*node))
        .collect();
    assert!(
        missing.is_empty(),
        "drawn in docs/ARCHITECTURE.md but not running: {missing:?} (running: {running:?})"
    );
    // The demo runs subscriptions, so the placeholders for them are exercised too.
    assert!(
        running
            .iter()
            .any(|id| id.starts_with("root/subscriptions/kv_metrics:")),
        "{running:?}"
    );
}

/// The top-level modules of a crate's `src/` (files and directories, without `lib`/`main`).
fn top_level_modules(dir: &std::path::Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .expect("read a src directory")
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let name = entry.file_name().into_string().ok()?;
            let module = match name.strip_suffix(".rs") {
                Some(stem) => stem.to_string(),
                None if entry.path().is_dir() => name,
                None => return None,
            };
            (!["lib", "main", "tests"].contains(&module.as_str())).then_some(module)
        })
        .collect()
}

#[test]
fn the_code_map_names_every_module_of_every_crate() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("docs/ARCHITECTURE.md")).expect("read the doc");
    let map = doc
        .split("## Code map")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("a code map section");
    let named = |module: &str| {
        map.match_indices(module).any(|(at, _)| {
            let before = map[..at].chars().next_back();
            let after = map[at + module.len()..].chars().next();
            let word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
            !word(before) && !word(after)
        })
    };
    let mut missing = Vec::new();
    for crate_src in [
        "src",
        "actors/src",
        "protocol/src",
        "demo/src",
        "broker/src",
        "prompt/src",
        "replay/src",
    ] {
        let modules = top_level_modules(&root.join(crate_src));
        assert!(!modules.is_empty(), "{crate_src} has modules");
        missing.extend(
            modules
                .into_iter()
                .filter(|m| !named(m))
                .map(|m| format!("{crate_src}/{m}")),
        );
    }
    assert!(
        missing.is_empty(),
        "docs/ARCHITECTURE.md's code map does not name: {missing:?}"
    );
}
