//! The `continuum-kv-listener` binary: the event bus's push agent (role `kv_listener`). Its code
//! is the `continuum-event-broker` crate (`broker/`, module `kv_listener`); it is a binary of this
//! package so the integration tests get it as `CARGO_BIN_EXE_continuum-kv-listener`.

fn main() -> std::process::ExitCode {
    continuum_event_broker::kv_listener_main()
}
