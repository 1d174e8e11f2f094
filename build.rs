//! Build script. `protoc-bin-vendored` is a build-dependency only so cargo unpacks a protoc before
//! etcd-client's build script runs (see `tools/protoc`). It generates one thing: the compiled
//! Cargo features of this package as `CONTINUUM_BUILD_FEATURES` (`src/build_info.rs`), so
//! `--version` and `continuum_router_build_info{features}` name every one without a match arm per
//! combination.
fn main() {
    // Without a rerun-if-changed line cargo reruns this script, and so rebuilds the library and
    // relinks every binary, whenever any file of the package changes (a test, a doc). A
    // different feature set is a different build of this script, so it needs no line of its own.
    println!("cargo::rerun-if-changed=build.rs");
    // Cargo sets CARGO_FEATURE_<NAME> (upper case, `-` as `_`) for every enabled feature;
    // `default` is a feature set, not a feature. Names are listed in a fixed (sorted) order.
    let mut features: Vec<String> = std::env::vars()
        .filter_map(|(key, _)| {
            key.strip_prefix("CARGO_FEATURE_")
                .map(|name| name.to_ascii_lowercase().replace('_', "-"))
        })
        .filter(|name| name != "default")
        .collect();
    features.sort();
    let list = if features.is_empty() {
        "none".to_string()
    } else {
        features.join(",")
    };
    println!("cargo::rustc-env=CONTINUUM_BUILD_FEATURES={list}");
}
