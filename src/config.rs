//! Typed daemon configuration: parse, interpolate, validate, mask, diff.
//!
//! | module | what it holds |
//! |---|---|
//! | [`schema`] | the typed tree (`Config` and every section) with defaults |
//! | [`interpolate`] | `${ENV_VAR}` expansion with an injectable environment |
//! | [`validate`] | every validation rule and warning, as path-addressed [`Diagnostic`]s |
//! | [`features`] | keys of a Cargo feature this build lacks: "compiled but inactive" warnings, the effective config |
//! | [`admission`] | `admission`: busy thresholds and the per-model wait queue's bounds, their rules |
//! | [`replica_sync`] | `replica_sync`: sharing in-flight dispatches with peer router replicas over NATS, its rules |
//! | [`rate_limits`] | `rate_limits`: per-key, unauthenticated and per-backend request and token limits, their rules |
//! | [`mask`] | `config show`: the effective config as YAML with secrets masked |
//! | [`diff`] | reload classification of an old/new config pair ([`ReloadPlan`]) |
//! | [`guard`] | the reload guard: refuses a file that removes every backend or the admin API |
//! | [`report`] | `config validate`: the human report and exit code |
//!
//! Parsing goes YAML text → `serde_json::Value` (serde-saphyr, duplicate keys rejected) →
//! interpolation → typed `Config` through `serde_ignored` (every unknown key, at every level,
//! with its path) and `serde_path_to_error` (the path of a type error).

use std::collections::BTreeSet;
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub mod admission;
pub mod diff;
pub mod example;
pub mod features;
pub mod guard;
pub mod interpolate;
pub mod mask;
pub mod rate_limits;
pub mod replica_sync;
pub mod report;
pub mod schema;
pub mod validate;

pub use diff::{DiscoveryAction, ReloadClass, ReloadPlan, RestartReason, diff};
pub use interpolate::{EnvLookup, ProcessEnv};
pub use mask::{restore_masked, show_effective};
pub use report::{log_diagnostics, render_validation_report, validate_file};
pub use schema::*;
pub use validate::validate;

/// Config files larger than this are refused before reading them whole.
pub const MAX_CONFIG_BYTES: u64 = 4 * 1024 * 1024;

/// The embedded configuration of `continuum-router demo`.
const DEMO_YAML: &str = include_str!("config/demo.yaml");

/// How bad a diagnostic is: errors refuse the config, warnings are reported and accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    Error,
    Warning,
}

impl fmt::Display for Severity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Error => "error",
            Self::Warning => "warning",
        })
    }
}

/// One finding about a config, addressed by YAML path (`dynamo.discovery.etcd.endpoints[1]`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Diagnostic {
    pub severity: Severity,
    pub path: String,
    pub message: String,
}

impl Diagnostic {
    pub fn error(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            severity: Severity::Error,
            path: path.into(),
            message: message.into(),
        }
    }

    pub fn warning(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            severity: Severity::Warning,
            path: path.into(),
            message: message.into(),
        }
    }

    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: {}", self.severity, self.path, self.message)
    }
}

/// Why a config could not be produced.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {} is larger than {limit} bytes", path.display())]
    TooLarge { path: PathBuf, limit: u64 },
    #[error("config is not valid YAML: {0}")]
    Yaml(String),
    /// Unset `${VAR}`s, unknown keys and type errors, each with its path.
    #[error("config could not be parsed:\n{}", list(.0))]
    Parse(Vec<Diagnostic>),
    /// Validation found at least one error; holds every error and warning.
    #[error("config is invalid:\n{}", list(.0))]
    Invalid(Vec<Diagnostic>),
}

impl ConfigError {
    /// The path-addressed findings behind this error (empty for IO and YAML syntax errors).
    pub fn diagnostics(&self) -> &[Diagnostic] {
        match self {
            Self::Parse(diagnostics) | Self::Invalid(diagnostics) => diagnostics,
            Self::Io { .. } | Self::TooLarge { .. } | Self::Yaml(_) => &[],
        }
    }
}

fn list(diagnostics: &[Diagnostic]) -> String {
    diagnostics
        .iter()
        .map(|diagnostic| format!("  {diagnostic}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A config that passed validation, with the warnings it raised.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadedConfig {
    pub config: Config,
    /// Warnings only (any error makes [`Config::load`] fail).
    pub diagnostics: Vec<Diagnostic>,
}

impl Config {
    /// Parses YAML text and interpolates `${VAR}`s from `env`. Does not validate: call
    /// [`validate`] (or use [`Config::load`] / [`Config::from_yaml_str_validated`]).
    pub fn from_yaml_str(text: &str, env: &dyn EnvLookup) -> Result<Config, ConfigError> {
        let mut value: Value = serde_saphyr::from_str_with_options(text, yaml_options())
            .map_err(|error| ConfigError::Yaml(yaml_error(text, &error)))?;
        if value.is_null() {
            // An empty document is the all-defaults config.
            value = Value::Object(serde_json::Map::new());
        }
        let mut problems = Vec::new();
        let whole = interpolate::interpolate(&mut value, env, &mut problems);
        if !problems.is_empty() {
            return Err(ConfigError::Parse(problems));
        }
        deserialize_typed(value, &whole)
    }

    /// [`Config::from_yaml_str`] followed by [`validate`]; errors make it fail.
    pub fn from_yaml_str_validated(
        text: &str,
        env: &dyn EnvLookup,
    ) -> Result<LoadedConfig, ConfigError> {
        let config = Self::from_yaml_str(text, env)?;
        let diagnostics = validate(&config);
        if diagnostics.iter().any(Diagnostic::is_error) {
            return Err(ConfigError::Invalid(diagnostics));
        }
        Ok(LoadedConfig {
            config,
            diagnostics,
        })
    }

    /// Reads, interpolates (process environment) and validates a config file.
    pub fn load(path: &Path) -> Result<LoadedConfig, ConfigError> {
        Self::load_with_env(path, &ProcessEnv)
    }

    /// [`Config::load`] that also returns the file's text (the reload guard reads which
    /// changes the file states explicitly).
    pub fn load_with_text(path: &Path) -> Result<(LoadedConfig, String), ConfigError> {
        let text = read_bounded(path)?;
        let loaded = Self::from_yaml_str_validated(&text, &ProcessEnv)?;
        Ok((loaded, text))
    }

    /// [`Config::load`] with an injected environment.
    pub fn load_with_env(path: &Path, env: &dyn EnvLookup) -> Result<LoadedConfig, ConfigError> {
        let text = read_bounded(path)?;
        Self::from_yaml_str_validated(&text, env)
    }

    /// The embedded default of `continuum-router demo` (loopback only, valid).
    pub fn demo() -> Config {
        // The demo YAML is compiled in and covered by a test, so parsing cannot fail at runtime;
        // falling back to defaults keeps this infallible without a panic path.
        Self::from_yaml_str(DEMO_YAML, &ProcessEnvFree).unwrap_or_default()
    }

    /// The embedded demo YAML text.
    pub fn demo_yaml() -> &'static str {
        DEMO_YAML
    }

    /// [`Config::demo`] with each shim pool's backends pointed at its namespace's simulated
    /// frontend (`continuum-router demo` starts them on free loopback ports).
    pub fn demo_with_frontends(
        frontends: &std::collections::BTreeMap<String, std::net::SocketAddr>,
    ) -> Result<Config, String> {
        let mut config = Config::demo();
        for pool in config.dynamo.shim.pools.clone() {
            let addr = frontends
                .get(&pool.namespace)
                .ok_or_else(|| format!("no simulated frontend for namespace {}", pool.namespace))?;
            for name in &pool.backends {
                let backend = config
                    .backends
                    .iter_mut()
                    .find(|b| &b.name == name)
                    .ok_or_else(|| format!("the demo config has no backend {name}"))?;
                backend.url = format!("http://{addr}");
            }
        }
        Ok(config)
    }
}

/// YAML 1.2 core reading of untyped scalars: `no`, `on`, `y` stay strings (a namespace called
/// `no` must not become `false`), as do `0755` and `1_000`. Duplicate keys are errors.
pub(crate) fn yaml_options() -> serde_saphyr::Options {
    let mut options = serde_saphyr::Options::default();
    options.strict_booleans = true;
    options.leading_zero_numbers_as_strings = true;
    options.underscored_numbers_as_strings = true;
    options.duplicate_keys = serde_saphyr::DuplicateKeyPolicy::Error;
    options
}

/// Syntax errors the parser notices only at the next token, so the line it names is past the
/// mistake (an unclosed `[`, `{` or quote, a key without `:` on an earlier line).
const DETECTED_LATE: [&str; 5] = [
    "did not find expected ',' or '}'",
    "expected ',' or ']'",
    "illegal placement of ':' indicator",
    "simple key expected ':'",
    "could not find expected ':'",
];

/// The parser's message (line, column and a snippet), plus, for [`DETECTED_LATE`] errors, the
/// previous non-blank line, where the mistake usually is.
fn yaml_error(text: &str, error: &serde_saphyr::Error) -> String {
    let mut out = error.to_string();
    let Some(location) = error.location() else {
        return out;
    };
    if !DETECTED_LATE.iter().any(|late| out.contains(late)) {
        return out;
    }
    let detected = usize::try_from(location.line()).unwrap_or(usize::MAX);
    let previous = text
        .lines()
        .enumerate()
        .take(detected.saturating_sub(1))
        .filter(|(_, line)| {
            let line = line.trim();
            !line.is_empty() && !line.starts_with('#')
        })
        .last();
    if let Some((index, line)) = previous {
        let line: String = line.trim_end().chars().take(MAX_ECHO_CHARS).collect();
        out.push_str(&format!(
            "\nhint: the parser notices this only at line {detected}; the mistake is likely at \
             the end of line {}: {line:?} (an unclosed bracket, brace or quote, or a missing ':')",
            index + 1
        ));
    }
    out
}

/// Most re-deserialisations spent turning scalars back into what their fields want.
const MAX_COERCIONS: usize = 1024;

/// An environment with no variables (the demo must not depend on the caller's environment).
struct ProcessEnvFree;

impl EnvLookup for ProcessEnvFree {
    fn var(&self, _name: &str) -> Option<String> {
        None
    }
}

fn read_bounded(path: &Path) -> Result<String, ConfigError> {
    let io = |source| ConfigError::Io {
        path: path.to_owned(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let mut text = String::new();
    file.take(MAX_CONFIG_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(io)?;
    if text.len() as u64 > MAX_CONFIG_BYTES {
        return Err(ConfigError::TooLarge {
            path: path.to_owned(),
            limit: MAX_CONFIG_BYTES,
        });
    }
    Ok(text)
}

/// One step of a YAML path.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum PathSeg {
    Key(String),
    Index(usize),
}

/// `a.b[1].c`; the root is written as `<root>`.
pub(crate) fn format_path(path: &[PathSeg]) -> String {
    let mut out = String::new();
    for seg in path {
        match seg {
            PathSeg::Key(key) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(key);
            }
            PathSeg::Index(index) => {
                out.push('[');
                out.push_str(&index.to_string());
                out.push(']');
            }
        }
    }
    if out.is_empty() {
        out.push_str("<root>");
    }
    out
}

fn ignored_path(path: &serde_ignored::Path<'_>, out: &mut Vec<PathSeg>) {
    match path {
        serde_ignored::Path::Root => {}
        serde_ignored::Path::Seq { parent, index } => {
            ignored_path(parent, out);
            out.push(PathSeg::Index(*index));
        }
        serde_ignored::Path::Map { parent, key } => {
            ignored_path(parent, out);
            out.push(PathSeg::Key(key.clone()));
        }
        serde_ignored::Path::Some { parent }
        | serde_ignored::Path::NewtypeStruct { parent }
        | serde_ignored::Path::NewtypeVariant { parent } => ignored_path(parent, out),
    }
}

fn error_path(path: &serde_path_to_error::Path) -> Vec<PathSeg> {
    path.iter()
        .filter_map(|segment| match segment {
            serde_path_to_error::Segment::Seq { index } => Some(PathSeg::Index(*index)),
            serde_path_to_error::Segment::Map { key } => Some(PathSeg::Key(key.clone())),
            serde_path_to_error::Segment::Enum { .. } | serde_path_to_error::Segment::Unknown => {
                None
            }
        })
        .collect()
}

fn node_mut<'a>(value: &'a mut Value, path: &[PathSeg]) -> Option<&'a mut Value> {
    path.iter().try_fold(value, |node, seg| match (seg, node) {
        (PathSeg::Key(key), Value::Object(map)) => map.get_mut(key),
        (PathSeg::Index(index), Value::Array(items)) => items.get_mut(*index),
        _ => None,
    })
}

/// Longest offending value echoed back in a type error.
const MAX_ECHO_CHARS: usize = 80;

/// The offending scalar as an error may quote it: never under a secret-looking key (tokens,
/// passwords, keys), never a whole map or list, and truncated to [`MAX_ECHO_CHARS`].
fn echo_value(path: &[PathSeg], node: &Value) -> Option<String> {
    let secret = path.iter().any(|seg| match seg {
        PathSeg::Key(key) => {
            let key = key.to_ascii_lowercase();
            ["token", "password", "secret", "key", "credential"]
                .iter()
                .any(|word| key.contains(word))
        }
        PathSeg::Index(_) => false,
    });
    if secret {
        return None;
    }
    match node {
        Value::String(text) if text.chars().count() > MAX_ECHO_CHARS => {
            let head: String = text.chars().take(MAX_ECHO_CHARS).collect();
            Some(format!("{head:?}…"))
        }
        Value::String(text) => Some(format!("{text:?}")),
        Value::Number(_) | Value::Bool(_) => Some(node.to_string()),
        Value::Null | Value::Array(_) | Value::Object(_) => None,
    }
}

fn scalar_text(node: &Value) -> Option<String> {
    match node {
        Value::String(text) => Some(text.clone()),
        Value::Number(_) | Value::Bool(_) => Some(node.to_string()),
        Value::Null | Value::Array(_) | Value::Object(_) => None,
    }
}

/// Reads an interpolated scalar the way YAML would have read it unquoted.
fn coerce_scalar(text: &str) -> Option<Value> {
    match text.trim() {
        "true" | "True" | "TRUE" => return Some(Value::Bool(true)),
        "false" | "False" | "FALSE" => return Some(Value::Bool(false)),
        _ => {}
    }
    if let Ok(int) = text.trim().parse::<u64>() {
        return Some(Value::from(int));
    }
    if let Ok(int) = text.trim().parse::<i64>() {
        return Some(Value::from(int));
    }
    text.trim()
        .parse::<f64>()
        .ok()
        .filter(|float| float.is_finite())
        .and_then(|float| serde_json::Number::from_f64(float).map(Value::Number))
}

fn deserialize_typed(
    mut value: Value,
    whole: &BTreeSet<Vec<PathSeg>>,
) -> Result<Config, ConfigError> {
    let mut unknown: BTreeSet<Vec<PathSeg>> = BTreeSet::new();
    let mut type_errors: Vec<Diagnostic> = Vec::new();
    let mut removed: Vec<Vec<PathSeg>> = Vec::new();
    let mut exhausted = true;
    // Each pass either returns, stops, or changes one node (retypes or removes it), so the loop
    // is bounded by the document and by MAX_COERCIONS.
    for _ in 0..MAX_COERCIONS {
        let mut seen: Vec<Vec<PathSeg>> = Vec::new();
        let result: Result<Config, _> = {
            let mut on_ignored = |path: serde_ignored::Path<'_>| {
                let mut segs = Vec::new();
                ignored_path(&path, &mut segs);
                seen.push(segs);
            };
            let ignored = serde_ignored::Deserializer::new(&value, &mut on_ignored);
            serde_path_to_error::deserialize(ignored)
        };
        unknown.extend(seen);
        let error = match result {
            Ok(config) if unknown.is_empty() && type_errors.is_empty() => return Ok(config),
            Ok(_) => {
                exhausted = false;
                break;
            }
            Err(error) => error,
        };
        let segs = error_path(error.path());
        let message = error.into_inner().to_string();
        // Serde's own messages quote some values (`unknown variant `consul``); echo the rest.
        let got = node_mut(&mut value, &segs)
            .filter(|node| {
                !scalar_text(node).is_some_and(|text| !text.is_empty() && message.contains(&text))
            })
            .and_then(|node| echo_value(&segs, node));
        // The YAML went through an untyped tree, so a plain scalar was typed by its spelling
        // alone: `model: 2024` is a number there, `enabled: "${ON}"` a string. When a field
        // rejects such a scalar, retype that one node and retry.
        if let Some(node) = node_mut(&mut value, &segs) {
            let retyped = match node {
                Value::String(text) if whole.contains(&segs) => coerce_scalar(text),
                // Only where the field wanted text: a negative number for a count must keep
                // its own error message.
                Value::Number(number) if message.contains("string") => {
                    Some(Value::String(number.to_string()))
                }
                Value::Bool(flag) if message.contains("string") => {
                    Some(Value::String(flag.to_string()))
                }
                _ => None,
            };
            if let Some(retyped) = retyped {
                *node = retyped;
                continue;
            }
        }
        // A required field we removed ourselves below is not a second problem.
        let caused_by_removal = message.starts_with("missing field")
            && removed
                .iter()
                .any(|gone| gone.len() == segs.len() + 1 && gone.starts_with(&segs));
        if !caused_by_removal {
            let message = match got {
                Some(got) => format!("{message} (got {got})"),
                None => message,
            };
            type_errors.push(Diagnostic::error(format_path(&segs), message));
        }
        // Drop the nearest key holding the problem (the key itself, or the whole list for a bad
        // list element) so the rest of the document is still checked; its field falls back to
        // its default, or reports a missing required field that the check above skips.
        let target: Option<Vec<PathSeg>> = segs
            .iter()
            .rposition(|seg| matches!(seg, PathSeg::Key(_)))
            .map(|at| segs[..=at].to_vec());
        let dropped = match target.as_deref().and_then(|target| target.split_last()) {
            Some((PathSeg::Key(key), parent)) => match node_mut(&mut value, parent) {
                Some(Value::Object(map)) => map.remove(key).is_some(),
                _ => false,
            },
            _ => false,
        };
        let Some(segs) = target.filter(|_| dropped) else {
            exhausted = false;
            break;
        };
        removed.push(segs);
    }
    let mut problems: Vec<Diagnostic> = unknown
        .iter()
        .map(|segs| Diagnostic::error(format_path(segs), "unknown key"))
        .collect();
    problems.extend(type_errors);
    if exhausted {
        problems.push(Diagnostic::error(
            "<root>",
            "too many values needed retyping; quote string values that look like numbers",
        ));
    }
    Err(ConfigError::Parse(problems))
}

#[cfg(test)]
mod tests;
