//! Keys of a product feature this build does not have ("compiled but inactive"): they parse and
//! validate as in a full build, and each one that would switch something on gets a warning
//! ([`inactive`]); the daemon then runs the [`effective`] config, in which they are off. The
//! file, `config show` and `GET /admin/config` keep them as written.

use crate::build_info::Features;

use super::schema::{Config, LoadTransport};
use super::{Diagnostic, Severity};

/// The words every warning of this module starts with (logs, `config validate`).
pub const COMPILED_BUT_INACTIVE: &str = "compiled but inactive";

/// One warning per key that asks for a feature `features` lacks.
pub fn inactive(config: &Config, features: Features) -> Vec<Diagnostic> {
    let dynamo = &config.dynamo;
    let mut out = Vec::new();
    let mut warn = |path: &str, feature: &str, consequence: &str| {
        out.push(Diagnostic::warning(
            path,
            format!(
                "{COMPILED_BUT_INACTIVE}: this build has no `{feature}` Cargo feature; {consequence}"
            ),
        ));
    };
    if dynamo.enabled && !features.dynamo {
        warn(
            "dynamo.enabled",
            "dynamo",
            "no discovery, load subscriptions or shim routing start, /admin/dynamo/* answers 404, \
             and requests route normally (unified)",
        );
    }
    if dynamo.kv.enabled && !features.dynamo_kv {
        warn(
            "dynamo.kv.enabled",
            "dynamo-kv",
            "no kv-events subscriptions, KV index or tokenizer artifacts start, and selection \
             stays load-based",
        );
    }
    if dynamo.event_bus.enabled && !features.dynamo_event_bus {
        warn(
            "dynamo.event_bus.enabled",
            "dynamo-event-bus",
            "the event-bus listener does not start",
        );
    }
    if config.replica_sync.enabled && !cfg!(feature = "replica-sync") {
        warn(
            "replica_sync.enabled",
            "replica-sync",
            "this replica neither publishes its in-flight dispatches nor reads its peers'",
        );
    }
    if config.replica_sync.enabled && !features.dynamo {
        warn(
            "replica_sync.enabled",
            "dynamo",
            "there is no Dynamo routing whose dispatches could be shared",
        );
    }
    if dynamo.enabled
        && features.dynamo
        && dynamo.load.transport == LoadTransport::Broker
        && !features.dynamo_event_bus
    {
        warn(
            "dynamo.load.transport",
            "dynamo-event-bus",
            "broker subscriptions stay pending and never fall back to direct dialing",
        );
    }
    out
}

/// The config the daemon runs under `features`: `config` with every section whose feature is
/// missing switched off (`dynamo.enabled`, `dynamo.kv.enabled`, `dynamo.event_bus.enabled`).
/// Everything downstream (child specs, dial policy, the request path) reads only this.
pub fn effective(config: &Config, features: Features) -> Config {
    let mut effective = config.clone();
    let dynamo = &mut effective.dynamo;
    dynamo.enabled &= features.dynamo;
    dynamo.kv.enabled &= features.dynamo_kv;
    dynamo.event_bus.enabled &= features.dynamo_event_bus;
    effective.replica_sync.enabled &= cfg!(feature = "replica-sync") && features.dynamo;
    effective
}

/// Whether `diagnostic` is one of [`inactive`]'s.
pub fn is_inactive_warning(diagnostic: &Diagnostic) -> bool {
    diagnostic.severity == Severity::Warning
        && diagnostic.message.starts_with(COMPILED_BUT_INACTIVE)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn everything_on() -> Config {
        let text = r#"
backends:
  - name: a
    url: "http://127.0.0.1:9"
    models: ["m"]
dynamo:
  enabled: true
  load:
    transport: broker
  kv:
    enabled: true
  event_bus:
    enabled: true
"#;
        Config::from_yaml_str(text, &std::collections::HashMap::<String, String>::new())
            .expect("parses")
    }

    fn paths(diagnostics: &[Diagnostic]) -> Vec<&str> {
        diagnostics.iter().map(|d| d.path.as_str()).collect()
    }

    #[test]
    fn a_full_build_warns_about_nothing() {
        let all = Features {
            dynamo: true,
            dynamo_kv: true,
            dynamo_event_bus: true,
        };
        assert!(inactive(&everything_on(), all).is_empty());
        assert_eq!(effective(&everything_on(), all), everything_on());
    }

    #[test]
    fn without_dynamo_every_enabled_section_is_compiled_but_inactive() {
        let found = inactive(&everything_on(), Features::NONE);
        assert_eq!(
            paths(&found),
            [
                "dynamo.enabled",
                "dynamo.kv.enabled",
                "dynamo.event_bus.enabled"
            ]
        );
        assert!(found.iter().all(is_inactive_warning), "{found:?}");
        let running = effective(&everything_on(), Features::NONE);
        assert!(!running.dynamo.enabled && !running.dynamo.kv.enabled);
        assert!(!running.dynamo.event_bus.enabled);
        // Everything else stays as written.
        assert_eq!(running.dynamo.load, everything_on().dynamo.load);
    }

    #[test]
    fn without_the_event_bus_broker_subscriptions_are_said_to_stay_pending() {
        let features = Features {
            dynamo: true,
            dynamo_kv: true,
            dynamo_event_bus: false,
        };
        let found = inactive(&everything_on(), features);
        assert_eq!(
            paths(&found),
            ["dynamo.event_bus.enabled", "dynamo.load.transport"]
        );
        assert!(found[1].message.contains("pending"), "{found:?}");
        let running = effective(&everything_on(), features);
        assert!(running.dynamo.enabled && running.dynamo.kv.enabled);
        assert!(!running.dynamo.event_bus.enabled);
    }

    #[test]
    fn without_kv_only_the_kv_section_is_inactive() {
        let features = Features {
            dynamo: true,
            dynamo_kv: false,
            dynamo_event_bus: true,
        };
        let found = inactive(&everything_on(), features);
        assert_eq!(paths(&found), ["dynamo.kv.enabled"]);
        assert!(found[0].message.contains("`dynamo-kv`"), "{found:?}");
    }

    /// `validate` (so `config validate`, startup and reload) flags exactly the keys this build
    /// lacks: nothing in a full build; under `cargo test --no-default-features` every section.
    #[test]
    fn validation_flags_the_keys_of_the_features_this_build_lacks() {
        let found = crate::config::validate(&everything_on());
        let flagged = |path: &str| {
            found
                .iter()
                .any(|d| d.path == path && is_inactive_warning(d))
        };
        assert_eq!(flagged("dynamo.enabled"), !Features::COMPILED.dynamo);
        assert_eq!(flagged("dynamo.kv.enabled"), !Features::COMPILED.dynamo_kv);
        assert_eq!(
            flagged("dynamo.event_bus.enabled"),
            !Features::COMPILED.dynamo_event_bus
        );
    }

    #[test]
    fn disabled_sections_need_no_feature() {
        let config = Config::default();
        assert!(inactive(&config, Features::NONE).is_empty());
    }
}
