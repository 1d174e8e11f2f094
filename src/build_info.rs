//! What the running binary is: its version and compiled Cargo features, for
//! `continuum-router --version` and the `continuum_router_build_info{version, features}` gauge,
//! and [`Features`], the product features (`dynamo`, `dynamo-kv`, `dynamo-event-bus`) a daemon
//! runs with.

/// The crate version (`Cargo.toml`).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The compiled Cargo features of the `continuum-router` crate, sorted and comma-separated
/// (`dynamo,dynamo-event-bus,dynamo-kv`), or `none` (written by `build.rs`).
pub const FEATURES: &str = env!("CONTINUUM_BUILD_FEATURES");

/// The `--version` text after the binary name: `0.1.0 (features: dynamo,dynamo-event-bus,dynamo-kv)`.
pub const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (features: ",
    env!("CONTINUUM_BUILD_FEATURES"),
    ")"
);

/// The product features a daemon runs with. [`Features::COMPILED`] in the binary; a test may run
/// a daemon with fewer ([`Features::within_compiled`]) to show a slim build's behaviour — never
/// with more than what is compiled in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Features {
    /// Dynamo discovery, load subscriptions, direct-mode shim routing, `/admin/dynamo/*`.
    pub dynamo: bool,
    /// KV-overlap-aware selection: kv-events, the KV index, tokenizer artifacts.
    pub dynamo_kv: bool,
    /// The inbound event-bus listener.
    pub dynamo_event_bus: bool,
}

impl Features {
    /// What this binary was built with.
    pub const COMPILED: Features = Features {
        dynamo: cfg!(feature = "dynamo"),
        dynamo_kv: cfg!(feature = "dynamo-kv"),
        dynamo_event_bus: cfg!(feature = "dynamo-event-bus"),
    };

    /// The slimmest build: no product feature.
    pub const NONE: Features = Features {
        dynamo: false,
        dynamo_kv: false,
        dynamo_event_bus: false,
    };

    /// `self`, limited to what is compiled in, with the manifest's implications (`dynamo-kv` and
    /// `dynamo-event-bus` need `dynamo`).
    pub const fn within_compiled(self) -> Features {
        let dynamo = self.dynamo && Self::COMPILED.dynamo;
        Features {
            dynamo,
            dynamo_kv: dynamo && self.dynamo_kv && Self::COMPILED.dynamo_kv,
            dynamo_event_bus: dynamo && self.dynamo_event_bus && Self::COMPILED.dynamo_event_bus,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_long_version_names_the_version_and_the_features() {
        assert_eq!(LONG_VERSION, format!("{VERSION} (features: {FEATURES})"));
        assert!(!FEATURES.is_empty());
    }

    /// The feature list and [`Features::COMPILED`] say the same thing.
    #[test]
    fn the_feature_list_names_every_compiled_product_feature() {
        let listed: Vec<&str> = FEATURES.split(',').collect();
        for (name, compiled) in [
            ("dynamo", Features::COMPILED.dynamo),
            ("dynamo-kv", Features::COMPILED.dynamo_kv),
            ("dynamo-event-bus", Features::COMPILED.dynamo_event_bus),
        ] {
            assert_eq!(listed.contains(&name), compiled, "{name} in {FEATURES}");
        }
        let mut sorted = listed.clone();
        sorted.sort_unstable();
        assert_eq!(listed, sorted);
    }

    #[test]
    fn a_daemon_never_runs_more_than_is_compiled() {
        let all = Features {
            dynamo: true,
            dynamo_kv: true,
            dynamo_event_bus: true,
        };
        assert_eq!(all.within_compiled(), Features::COMPILED);
        assert_eq!(Features::NONE.within_compiled(), Features::NONE);
        // The sub-features need `dynamo`.
        let orphans = Features {
            dynamo: false,
            ..all
        };
        assert_eq!(orphans.within_compiled(), Features::NONE);
    }
}
