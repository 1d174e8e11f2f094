//! `continuum-router config validate --config FILE`: the human report and its exit code.

use std::fmt::Write as _;
use std::path::Path;

use super::{Config, ConfigError, Diagnostic, LoadedConfig, Severity};

/// Renders the outcome of [`Config::load`] for `file`: every error and warning with its YAML
/// path, then a summary line. Exit code 0 when the config is valid (warnings allowed), 1 when
/// it is not.
pub fn render_validation_report(
    file: &Path,
    outcome: &Result<LoadedConfig, ConfigError>,
) -> (String, i32) {
    let mut out = String::new();
    let name = file.display();
    match outcome {
        Ok(loaded) => {
            write_diagnostics(&mut out, &loaded.diagnostics);
            let warnings = loaded.diagnostics.len();
            let _ = writeln!(
                out,
                "{name}: valid ({warnings} warning{})",
                if warnings == 1 { "" } else { "s" }
            );
            (out, 0)
        }
        Err(error) => {
            let diagnostics = error.diagnostics();
            if diagnostics.is_empty() {
                let _ = writeln!(out, "error: {error}");
                let _ = writeln!(out, "{name}: invalid");
            } else {
                write_diagnostics(&mut out, diagnostics);
                let errors = diagnostics.iter().filter(|d| d.is_error()).count();
                let warnings = diagnostics.len() - errors;
                let _ = writeln!(
                    out,
                    "{name}: invalid ({errors} error{}, {warnings} warning{})",
                    if errors == 1 { "" } else { "s" },
                    if warnings == 1 { "" } else { "s" }
                );
            }
            (out, 1)
        }
    }
}

/// [`Config::load`] + [`render_validation_report`] in one call, for the CLI.
pub fn validate_file(file: &Path) -> (String, i32) {
    render_validation_report(file, &Config::load(file))
}

/// Logs each diagnostic as a structured event (startup and reload use this; the CLI prints the
/// report instead).
pub fn log_diagnostics(diagnostics: &[Diagnostic]) {
    for diagnostic in diagnostics {
        match diagnostic.severity {
            Severity::Error => tracing::error!(
                path = %diagnostic.path,
                message = %diagnostic.message,
                "Config validation found an error."
            ),
            Severity::Warning => tracing::warn!(
                path = %diagnostic.path,
                message = %diagnostic.message,
                "Config validation found a warning."
            ),
        }
    }
}

fn write_diagnostics(out: &mut String, diagnostics: &[Diagnostic]) {
    for severity in [Severity::Error, Severity::Warning] {
        for diagnostic in diagnostics.iter().filter(|d| d.severity == severity) {
            let _ = writeln!(out, "{diagnostic}");
        }
    }
}
