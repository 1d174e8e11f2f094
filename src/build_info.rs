//! What the running binary is: its version and compiled Cargo features, for
//! `continuum-router --version` and the `continuum_router_build_info{version, features}` gauge.

/// The crate version (`Cargo.toml`).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The compiled Cargo features of the `continuum-router` crate, comma-separated, or `none`.
pub const FEATURES: &str = match (cfg!(feature = "real-peers"), cfg!(feature = "dynamo-e2e")) {
    (false, false) => "none",
    (true, false) => "real-peers",
    (false, true) => "dynamo-e2e",
    (true, true) => "real-peers,dynamo-e2e",
};

/// The `--version` text after the binary name: `0.1.0 (features: none)`.
pub const LONG_VERSION: &str = match (cfg!(feature = "real-peers"), cfg!(feature = "dynamo-e2e")) {
    (false, false) => concat!(env!("CARGO_PKG_VERSION"), " (features: none)"),
    (true, false) => concat!(env!("CARGO_PKG_VERSION"), " (features: real-peers)"),
    (false, true) => concat!(env!("CARGO_PKG_VERSION"), " (features: dynamo-e2e)"),
    (true, true) => concat!(
        env!("CARGO_PKG_VERSION"),
        " (features: real-peers,dynamo-e2e)"
    ),
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_long_version_names_the_version_and_the_features() {
        assert_eq!(LONG_VERSION, format!("{VERSION} (features: {FEATURES})"));
        assert!(!FEATURES.is_empty());
    }
}
