//! The `continuum-event-broker` binary: the in-cluster agent of the event bus. Its code is the
//! `continuum-event-broker` crate (`broker/`); it is a binary of this package so the integration
//! tests get it as `CARGO_BIN_EXE_continuum-event-broker`.

fn main() -> std::process::ExitCode {
    continuum_event_broker::main()
}
