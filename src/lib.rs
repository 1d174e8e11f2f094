//! continuum-router: the daemon library. `main.rs` parses the command line and calls in here.

pub mod config;
pub mod front_door;
pub mod readiness;
pub mod telemetry;
