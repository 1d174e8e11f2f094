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

fn corpus() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus")
}

macro_rules! replays {
    ($($target:ident),* $(,)?) => {$(
        #[test]
        fn $target() {
            common::replay_corpus(&corpus(), stringify!($target), router::$target);
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
