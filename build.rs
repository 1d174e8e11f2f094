//! Build script: nothing to generate. `protoc-bin-vendored` is a build-dependency only so cargo
//! unpacks a protoc before etcd-client's build script runs (see `tools/protoc`).
fn main() {
    // Without a rerun-if-changed line cargo reruns this script, and so rebuilds the library and
    // relinks every binary, whenever any file of the package changes (a test, a doc).
    println!("cargo::rerun-if-changed=build.rs");
}
