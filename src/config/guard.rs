//! The reload guard: a new config file that would leave the router without any backend or
//! without its admin API is refused unless the file says so explicitly.
//!
//! Why: a file caught half-written (an editor that truncates then writes, `cat > config.yaml`)
//! parses and validates as a smaller config. The first lines of a config have no `backends`, and
//! an empty file is the all-defaults config, whose admin API is off, so the reload API could not
//! recover it. The explicit forms are:
//!
//! - `backends: []` written in the file removes every backend (a missing `backends` key does not);
//! - `admin.enabled: false` written in the file turns the admin API off, dropping its token (a
//!   missing `admin` section or `admin.enabled` key does not).
//!
//! Every reload path (file watch, SIGHUP, `POST /admin/config/reload`) runs this check; a
//! refusal keeps the running config, logs the reason, counts
//! `continuum_config_reload_refusals_total{reason}` and answers 409 on the API.

use serde_json::Value;

use super::Config;

/// Why a reload was refused: the `reason` label of `continuum_config_reload_refusals_total`
/// (`invalid` is counted by the caller for files that fail to load).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuardRefusal {
    /// The running config has backends and the new one has none, without `backends: []`.
    RemovesAllBackends,
    /// The running config serves the admin API and the new one does not, without
    /// `admin.enabled: false`.
    DisablesAdmin,
}

impl GuardRefusal {
    /// A sentence for the log line and the 409 body.
    pub fn explain(self) -> &'static str {
        match self {
            GuardRefusal::RemovesAllBackends => {
                "the new file removes every backend; write `backends: []` to mean it"
            }
            GuardRefusal::DisablesAdmin => {
                "the new file disables the admin API (or drops its token); write \
                 `admin: {enabled: false}` to mean it"
            }
        }
    }
}

/// Which of the guarded changes the file's text states explicitly.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Explicit {
    /// `backends:` is present and a sequence (`backends: []`).
    pub backends: bool,
    /// `admin.enabled: false` is written.
    pub admin_disabled: bool,
}

impl Explicit {
    /// Reads the explicit forms from the file's YAML text (already validated by the caller; a
    /// text that does not parse states nothing).
    pub fn of(text: &str) -> Explicit {
        let value: Value = match serde_saphyr::from_str_with_options(text, super::yaml_options()) {
            Ok(value) => value,
            Err(_) => return Explicit::default(),
        };
        Explicit {
            backends: matches!(value.get("backends"), Some(Value::Array(_))),
            admin_disabled: matches!(
                value.get("admin").and_then(|a| a.get("enabled")),
                Some(Value::Bool(false))
            ),
        }
    }
}

/// Whether the admin API answers under `config` (enabled with a token).
fn admin_served(config: &Config) -> bool {
    config.admin.enabled && config.admin.token.is_some()
}

/// Checks a validated new config against the running one; `Err` keeps the running config.
pub fn check_reload(
    current: &Config,
    new: &Config,
    explicit: Explicit,
) -> Result<(), GuardRefusal> {
    if !current.backends.is_empty() && new.backends.is_empty() && !explicit.backends {
        return Err(GuardRefusal::RemovesAllBackends);
    }
    if admin_served(current) && !admin_served(new) && !explicit.admin_disabled {
        return Err(GuardRefusal::DisablesAdmin);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ProcessEnv;

    const RUNNING: &str = "
admin: {enabled: true, token: an-admin-token-of-length}
backends:
  - {name: a, url: 'http://127.0.0.1:9', models: [m]}
";

    fn config(text: &str) -> Config {
        Config::from_yaml_str_validated(text, &ProcessEnv)
            .expect("valid")
            .config
    }

    fn check(text: &str) -> Result<(), GuardRefusal> {
        check_reload(&config(RUNNING), &config(text), Explicit::of(text))
    }

    #[test]
    fn partial_and_empty_files_are_refused() {
        // The first two lines of the running file.
        assert_eq!(
            check("\nadmin: {enabled: true, token: an-admin-token-of-length}\n"),
            Err(GuardRefusal::RemovesAllBackends)
        );
        assert_eq!(check(""), Err(GuardRefusal::RemovesAllBackends));
        assert_eq!(
            check("backends: []\n"),
            Err(GuardRefusal::DisablesAdmin),
            "an explicit empty backend list still may not silently disable admin"
        );
        assert_eq!(
            check("backends:\n  - {name: a, url: 'http://127.0.0.1:9', models: [m]}\n"),
            Err(GuardRefusal::DisablesAdmin)
        );
    }

    #[test]
    fn explicit_forms_are_accepted() {
        assert_eq!(
            check("admin: {enabled: true, token: an-admin-token-of-length}\nbackends: []\n"),
            Ok(())
        );
        assert_eq!(check("admin: {enabled: false}\nbackends: []\n"), Ok(()));
        assert_eq!(
            check(
                "admin:\n  enabled: false\nbackends:\n  - {name: b, url: 'http://127.0.0.1:9'}\n"
            ),
            Ok(())
        );
        // A rotated token keeps admin served: nothing to say explicitly.
        assert_eq!(
            check(
                "admin: {enabled: true, token: another-admin-token-here}\nbackends:\n  - {name: a, url: 'http://127.0.0.1:9'}\n"
            ),
            Ok(())
        );
        // Nothing guarded is lost when nothing was there.
        let bare = config("");
        assert_eq!(check_reload(&bare, &bare, Explicit::default()), Ok(()));
    }

    #[test]
    fn explicit_reads_only_the_written_forms() {
        assert_eq!(Explicit::of(""), Explicit::default());
        assert_eq!(Explicit::of("backends:\n"), Explicit::default());
        assert_eq!(Explicit::of("admin: {}\n"), Explicit::default());
        assert_eq!(
            Explicit::of("admin: {enabled: true}\n"),
            Explicit::default()
        );
        assert_eq!(
            Explicit::of("backends: []\nadmin: {enabled: false}\n"),
            Explicit {
                backends: true,
                admin_disabled: true
            }
        );
    }
}
