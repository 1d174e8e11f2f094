//! The integration tests of `continuum-protocol`, as one test binary (`cargo test -p
//! continuum-protocol --test it`), one module per area; the shared fixtures helpers are
//! `discovery::support`. Add a test as `tests/it/NAME.rs` plus `mod NAME;` here (the rule of
//! tests/it/README.md at the repository root).

mod discovery;
mod fuzz_corpus;
mod kube_equivalence;
