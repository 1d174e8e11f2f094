//! `${ENV_VAR}` interpolation over the parsed YAML tree, before typed deserialisation.
//!
//! Interpolation runs on string scalars only (never on keys), so a value can never inject new
//! structure. `$${` writes a literal `${`. A value that is exactly one `${VAR}` may stand for a
//! boolean or number (`enabled: ${DYNAMO_ENABLED}`): the parser coerces it only when the target
//! field rejects a string, so a password like `"${PW}"` stays a string even when it is `1234`.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde_json::Value;

use super::{Diagnostic, PathSeg, format_path};

/// Where `${VAR}` values come from. Injected so tests never touch the process environment.
pub trait EnvLookup {
    fn var(&self, name: &str) -> Option<String>;
}

/// The real process environment.
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcessEnv;

impl EnvLookup for ProcessEnv {
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }
}

impl EnvLookup for HashMap<String, String> {
    fn var(&self, name: &str) -> Option<String> {
        self.get(name).cloned()
    }
}

impl EnvLookup for BTreeMap<String, String> {
    fn var(&self, name: &str) -> Option<String> {
        self.get(name).cloned()
    }
}

impl EnvLookup for [(&str, &str)] {
    fn var(&self, name: &str) -> Option<String> {
        self.iter()
            .find(|(key, _)| *key == name)
            .map(|(_, value)| (*value).to_owned())
    }
}

impl<const N: usize> EnvLookup for [(&str, &str); N] {
    fn var(&self, name: &str) -> Option<String> {
        self.as_slice().var(name)
    }
}

/// Replaces every `${VAR}` in string scalars of `value`. Problems (unset or malformed
/// references) are pushed to `problems`, all of them, each with its YAML path. Returns the paths
/// of scalars that were exactly one reference (candidates for bool/number coercion).
pub(crate) fn interpolate(
    value: &mut Value,
    env: &dyn EnvLookup,
    problems: &mut Vec<Diagnostic>,
) -> BTreeSet<Vec<PathSeg>> {
    let mut whole = BTreeSet::new();
    let mut path = Vec::new();
    walk(value, env, &mut path, problems, &mut whole);
    whole
}

fn walk(
    value: &mut Value,
    env: &dyn EnvLookup,
    path: &mut Vec<PathSeg>,
    problems: &mut Vec<Diagnostic>,
    whole: &mut BTreeSet<Vec<PathSeg>>,
) {
    match value {
        Value::String(text) => {
            if !text.contains('$') {
                return;
            }
            match expand(text, env) {
                Ok(expanded) => {
                    if is_single_reference(text) {
                        whole.insert(path.clone());
                    }
                    *text = expanded;
                }
                Err(errors) => {
                    let at = format_path(path);
                    problems.extend(
                        errors
                            .into_iter()
                            .map(|message| Diagnostic::error(&at, message)),
                    );
                }
            }
        }
        Value::Array(items) => {
            for (index, item) in items.iter_mut().enumerate() {
                path.push(PathSeg::Index(index));
                walk(item, env, path, problems, whole);
                path.pop();
            }
        }
        Value::Object(map) => {
            for (key, item) in map.iter_mut() {
                path.push(PathSeg::Key(key.clone()));
                walk(item, env, path, problems, whole);
                path.pop();
            }
        }
        Value::Null | Value::Bool(_) | Value::Number(_) => {}
    }
}

fn is_single_reference(text: &str) -> bool {
    text.strip_prefix("${")
        .and_then(|rest| rest.strip_suffix('}'))
        .is_some_and(is_var_name)
}

fn is_var_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|first| first == '_' || first.is_ascii_alphabetic())
        && chars.all(|c| c == '_' || c.is_ascii_alphanumeric())
}

/// Expands one string; returns every problem in it rather than the first.
pub(crate) fn expand(text: &str, env: &dyn EnvLookup) -> Result<String, Vec<String>> {
    let mut out = String::with_capacity(text.len());
    let mut errors = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        if let Some(after) = tail.strip_prefix("$${") {
            out.push_str("${");
            rest = after;
        } else if let Some(after) = tail.strip_prefix("${") {
            let Some(end) = after.find('}') else {
                errors.push(format!(
                    "unterminated `${{` in {text:?} (write `$${{` for a literal `${{`)"
                ));
                return Err(errors);
            };
            let name = &after[..end];
            if !is_var_name(name) {
                errors.push(format!(
                    "`${{{name}}}` is not a valid environment variable reference \
                     (names match [A-Za-z_][A-Za-z0-9_]*)"
                ));
            } else {
                match env.var(name) {
                    Some(value) => out.push_str(&value),
                    None => errors.push(format!("environment variable `{name}` is not set")),
                }
            }
            rest = &after[end + 1..];
        } else {
            out.push('$');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(errors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expands_references_escapes_and_plain_dollars() {
        let env = [("A", "x"), ("B_2", "y")];
        assert_eq!(expand("${A}-${B_2}", &env).unwrap(), "x-y");
        assert_eq!(expand("$${A}", &env).unwrap(), "${A}");
        assert_eq!(expand("cost $5", &env).unwrap(), "cost $5");
        assert_eq!(expand("trailing $", &env).unwrap(), "trailing $");
    }

    #[test]
    fn reports_every_unset_variable_in_one_string() {
        let env = [("A", "x")];
        let errors = expand("${MISSING_1}/${A}/${MISSING_2}", &env).unwrap_err();
        assert_eq!(errors.len(), 2);
        assert!(errors[0].contains("MISSING_1"));
        assert!(errors[1].contains("MISSING_2"));
    }

    #[test]
    fn rejects_unterminated_and_invalid_references() {
        let env = [("A", "x")];
        assert!(expand("${A", &env).unwrap_err()[0].contains("unterminated"));
        assert!(expand("${1A}", &env).unwrap_err()[0].contains("not a valid"));
        assert!(expand("${}", &env).unwrap_err()[0].contains("not a valid"));
    }

    #[test]
    fn single_reference_detection() {
        assert!(is_single_reference("${A}"));
        assert!(!is_single_reference("x${A}"));
        assert!(!is_single_reference("${A}${B}"));
    }
}
