//! The committed fuzz corpora replayed on stable: every file of `fuzz/corpus/<target>/` through
//! the protocol crate's fuzz-target bodies (`fuzz/src/protocol.rs`, included here by path, so
//! the replay runs exactly what `cargo fuzz` ran), and the regression inputs the campaigns found.
//! The campaigns themselves are `scripts/fuzz.sh` (nightly); see fuzz/README.md at the root.

#[allow(dead_code)] // The root crate's replay (tests/it/fuzz_corpus.rs) uses the rest.
#[path = "../../../fuzz/src/common.rs"]
mod common;
#[path = "../../../fuzz/src/protocol.rs"]
mod protocol;

use std::path::PathBuf;

fn corpus() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus")
}

macro_rules! replays {
    ($($target:ident),* $(,)?) => {$(
        #[test]
        fn $target() {
            common::replay_corpus(&corpus(), stringify!($target), protocol::$target);
        }
    )*};
}

replays!(
    zmtp,
    load_sample,
    msgpack_vs_rmpv,
    kv_events,
    kv_listener_sse,
    event_bus_ndjson_hello,
    anthropic,
    responses,
    json_vs_serde_json,
    discovery,
    kube_metadata,
);
