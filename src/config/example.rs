//! `continuum-router config example`: a commented starter configuration.
//!
//! The text is compiled in from `example.yaml`; a unit test keeps it valid (with its two
//! `${VAR}` secrets set), so the printed starter never drifts from the schema.

/// The commented starter config, as printed by `continuum-router config example`.
pub const EXAMPLE_YAML: &str = include_str!("example.yaml");

/// The environment variables [`EXAMPLE_YAML`] reads its secrets from.
pub const EXAMPLE_ENV: &[&str] = &["ROUTER_ADMIN_TOKEN", "CLIENT_API_KEY"];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, ConfigError};

    #[test]
    fn the_example_is_valid_with_its_secrets_set() {
        let env = [
            ("ROUTER_ADMIN_TOKEN", "an-admin-token-of-32-characters!"),
            ("CLIENT_API_KEY", "client-key"),
        ];
        let loaded =
            Config::from_yaml_str_validated(EXAMPLE_YAML, &env).unwrap_or_else(|e| panic!("{e}"));
        assert!(loaded.config.admin.enabled);
        assert_eq!(
            loaded.config.admin.token.as_deref(),
            Some("an-admin-token-of-32-characters!")
        );
        assert!(loaded.config.dynamo.enabled);
        // A slim build adds its "compiled but inactive" warnings (config::features).
        let warnings: Vec<_> = loaded
            .diagnostics
            .iter()
            .filter(|d| !crate::config::features::is_inactive_warning(d))
            .collect();
        assert!(
            warnings.is_empty(),
            "a starter config raises no warnings: {warnings:?}"
        );
    }

    #[test]
    fn the_example_names_every_secret_variable_and_fails_without_them() {
        for name in EXAMPLE_ENV {
            assert!(EXAMPLE_YAML.contains(&format!("${{{name}}}")), "{name}");
        }
        let empty: [(&str, &str); 0] = [];
        let error = Config::from_yaml_str_validated(EXAMPLE_YAML, &empty)
            .expect_err("unset secrets are errors");
        assert!(matches!(error, ConfigError::Parse(_)), "{error}");
        assert!(error.to_string().contains("ROUTER_ADMIN_TOKEN"), "{error}");
    }
}
