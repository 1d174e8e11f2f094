//! Build script: nothing to generate. `protoc-bin-vendored` is a build-dependency only so cargo
//! unpacks a protoc before etcd-client's build script runs (see `tools/protoc`).
fn main() {}
