//! The integration tests of `continuum-actors`, as one test binary (`cargo test -p
//! continuum-actors --test it`), one module per area. Add a test as `tests/it/NAME.rs` plus
//! `mod NAME;` here (the rule of tests/it/README.md at the repository root).

mod picker_actor;
mod subscription_messages;
mod supervision;
