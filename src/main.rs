//! The `continuum-router` binary.
fn main() {}
