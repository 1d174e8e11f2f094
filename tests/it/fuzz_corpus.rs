//! The committed fuzz corpora replayed on stable: every file of `fuzz/corpus/<target>/` through
//! the root crate's fuzz-target bodies (`fuzz/src/router.rs`, included here by path, so the
//! replay runs exactly what `cargo fuzz` ran), and the regression inputs the campaigns found.
//! The campaigns themselves are `scripts/fuzz.sh` (nightly); see fuzz/README.md.

#[allow(dead_code)] // The protocol targets' replay (protocol/tests/it) uses the rest.
#[path = "../../fuzz/src/common.rs"]
mod common;
#[path = "../../fuzz/src/router.rs"]
mod router;

use std::path::PathBuf;

/// Runs `body` over every file of `fuzz/corpus/<target>/`; a panic names the file.
pub fn replay(corpus: PathBuf, target: &str, body: fn(&[u8])) {
    let dir = corpus.join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{} holds no corpus", dir.display());
    // On a thread with libFuzzer's main-thread stack and room for unoptimised frames: a
    // decoder may recurse to its nesting bound (rmp-serde's 1,024 levels take < 256 KiB in a
    // release build, several MiB in a debug one).
    let name = target.to_owned();
    let replay = move || {
        let target = name;
        for file in files {
            let data = std::fs::read(&file).expect("a corpus file");
            if std::panic::catch_unwind(|| body(&data)).is_err() {
                panic!("fuzz target {target} fails on {}", file.display());
            }
        }
    };
    let target = target.to_owned();
    std::thread::Builder::new()
        .name(target.clone())
        .stack_size(64 << 20)
        .spawn(replay)
        .expect("a replay thread")
        .join()
        .unwrap_or_else(|_| panic!("the replay of {target} failed"));
}

fn corpus() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus")
}

macro_rules! replays {
    ($($target:ident),* $(,)?) => {$(
        #[test]
        fn $target() {
            replay(corpus(), stringify!($target), router::$target);
        }
    )*};
}

replays!(
    fast_head,
    fast_head_vs_hyper,
    h1_response,
    h1_chunked_vs_reference,
    relay_sse_vs_reference,
    config_yaml,
);
