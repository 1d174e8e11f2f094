//! continuum-router: the daemon library.
pub mod config;
