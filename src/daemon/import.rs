//! The control loop's half of `GET`/`PUT /admin/config`: the running config for the readback,
//! and the import (parse, restore masked secrets, validate, write the file atomically, then the
//! normal reload path re-reads it; a refused reload puts the previous file back).

use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde_json::Value;
use tracing::warn;

use super::ControlLoop;
use crate::config::mask::MASK;
use crate::config::{self, Config, Diagnostic, ProcessEnv};
use crate::front_door::admin_config::{ImportError, ImportOutcome};

impl ControlLoop {
    /// The config the loop last applied.
    pub(super) fn running(&self) -> Box<Config> {
        Box::new(self.current.clone())
    }

    pub(super) async fn import(&mut self, text: String) -> Result<ImportOutcome, ImportError> {
        let Some(path) = self.path.clone() else {
            return Err(ImportError::Refused(
                "the daemon runs on an embedded config (demo); there is no config file to import into"
                    .into(),
            ));
        };
        let previous = std::fs::read(&path).map_err(|e| {
            ImportError::Write(format!("cannot read {} first: {e}", path.display()))
        })?;
        let (rendered, warnings) =
            prepare_import(&text, &self.current, std::str::from_utf8(&previous).ok())?;
        write_atomically(&path, rendered.as_bytes())
            .map_err(|e| ImportError::Write(format!("{}: {e}", path.display())))?;
        match self.reload("config import").await {
            Ok(summary) => Ok(ImportOutcome { summary, warnings }),
            Err(reason) => {
                if let Err(error) = write_atomically(&path, &previous) {
                    warn!(%error, path = %path.display(), "Could not put the previous config file back after a refused import.");
                }
                Err(ImportError::Refused(reason))
            }
        }
    }
}

/// Parses and validates an imported config against the running one: masked secrets take the
/// live values, secrets still masked afterwards are refused. Returns the YAML to write (the
/// effective config, `${` escaped so the file re-reads to the same values) and the warnings.
///
/// A secret that arrived masked and that the current file (`live_file`, its raw text) spells
/// as a `${VAR}` reference resolving to the live value is written back as that reference, so an
/// import never copies a secret from the environment into the file.
pub(crate) fn prepare_import(
    text: &str,
    live: &Config,
    live_file: Option<&str>,
) -> Result<(String, Vec<String>), ImportError> {
    if text.len() as u64 > config::MAX_CONFIG_BYTES {
        return Err(ImportError::Invalid(format!(
            "config is larger than {} bytes",
            config::MAX_CONFIG_BYTES
        )));
    }
    let mut imported = Config::from_yaml_str(text, &ProcessEnv)
        .map_err(|e| ImportError::Invalid(e.to_string()))?;
    let mut warnings = Vec::new();
    if let Some(note) = repointed_password(&imported, live) {
        warn!(%note, "Admin config import reuses the live etcd password.");
        warnings.push(note);
    }
    let restored = masked_secret_pointers(&imported, live);
    config::restore_masked(&mut imported, live);
    let unrestored = still_masked(&imported);
    if !unrestored.is_empty() {
        return Err(ImportError::Invalid(format!(
            "masked secrets with no live value to keep (give the real value): {}",
            unrestored.join(", ")
        )));
    }
    let diagnostics = config::validate(&imported);
    if diagnostics.iter().any(Diagnostic::is_error) {
        let list: Vec<String> = diagnostics.iter().map(ToString::to_string).collect();
        return Err(ImportError::Invalid(format!(
            "config is invalid: {}",
            list.join("; ")
        )));
    }
    warnings.extend(diagnostics.iter().map(ToString::to_string));
    let raw_live = live_file.and_then(|text| serde_saphyr::from_str::<Value>(text).ok());
    let rendered =
        render_for_file(&imported, &restored, raw_live.as_ref()).map_err(ImportError::Invalid)?;
    Ok((rendered, warnings))
}

/// The seed's warning: an import that re-points etcd while leaving the password masked reuses
/// the live password on the new host.
fn repointed_password(imported: &Config, live: &Config) -> Option<String> {
    let etcd = &imported.dynamo.discovery.etcd;
    let live_etcd = &live.dynamo.discovery.etcd;
    let masked = etcd.auth.as_ref().is_some_and(|a| a.password == MASK);
    (masked && live_etcd.auth.is_some() && etcd.endpoints != live_etcd.endpoints).then(|| {
        "dynamo.discovery.etcd.auth.password: the import changes the etcd endpoints but leaves the \
         password masked, so the live password is sent to the new endpoints; only point it at a \
         trusted cluster over tls with a pinned ca_cert"
            .to_owned()
    })
}

/// YAML paths of secrets that still read as the mask.
fn still_masked(config: &Config) -> Vec<String> {
    let mut out = Vec::new();
    let mask_path = Path::new(MASK);
    if config.admin.token.as_deref() == Some(MASK) {
        out.push("admin.token".to_owned());
    }
    for (i, key) in config.api_keys.iter().enumerate() {
        if key.key == MASK {
            out.push(format!(
                "api_keys[{i}].key (no live key named {:?})",
                key.name
            ));
        }
    }
    let etcd = &config.dynamo.discovery.etcd;
    if etcd.auth.as_ref().is_some_and(|a| a.password == MASK) {
        out.push("dynamo.discovery.etcd.auth.password".to_owned());
    }
    if etcd.tls.as_ref().and_then(|t| t.client_key.as_deref()) == Some(mask_path) {
        out.push("dynamo.discovery.etcd.tls.client_key".to_owned());
    }
    let bus = &config.dynamo.event_bus;
    if bus.tls.as_ref().and_then(|t| t.key.as_deref()) == Some(mask_path) {
        out.push("dynamo.event_bus.tls.key".to_owned());
    }
    for (i, broker) in bus.brokers.iter().enumerate() {
        if broker.token_hash.as_deref() == Some(MASK) {
            out.push(format!(
                "dynamo.event_bus.brokers[{i}].token_hash (no live broker {:?})",
                broker.id
            ));
        }
    }
    out
}

/// JSON pointers `(in the import, in the live config)` of every secret that arrives masked and
/// has a live value to restore (API keys matched by name, brokers by id, as `restore_masked`).
fn masked_secret_pointers(imported: &Config, live: &Config) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mask_path = Path::new(MASK);
    let mut same = |pointer: &str| out.push((pointer.to_owned(), pointer.to_owned()));
    if imported.admin.token.as_deref() == Some(MASK) {
        same("/admin/token");
    }
    let etcd = &imported.dynamo.discovery.etcd;
    if etcd.auth.as_ref().is_some_and(|a| a.password == MASK) {
        same("/dynamo/discovery/etcd/auth/password");
    }
    if etcd.tls.as_ref().and_then(|t| t.client_key.as_deref()) == Some(mask_path) {
        same("/dynamo/discovery/etcd/tls/client_key");
    }
    let bus = &imported.dynamo.event_bus;
    if bus.tls.as_ref().and_then(|t| t.key.as_deref()) == Some(mask_path) {
        same("/dynamo/event_bus/tls/key");
    }
    for (i, key) in imported.api_keys.iter().enumerate() {
        if key.key == MASK
            && let Some(j) = live.api_keys.iter().position(|old| old.name == key.name)
        {
            out.push((format!("/api_keys/{i}/key"), format!("/api_keys/{j}/key")));
        }
    }
    for (i, broker) in bus.brokers.iter().enumerate() {
        if broker.token_hash.as_deref() == Some(MASK)
            && let Some(j) = live
                .dynamo
                .event_bus
                .brokers
                .iter()
                .position(|old| old.id == broker.id)
        {
            out.push((
                format!("/dynamo/event_bus/brokers/{i}/token_hash"),
                format!("/dynamo/event_bus/brokers/{j}/token_hash"),
            ));
        }
    }
    out
}

/// Whether `raw` (a scalar of the current file) interpolates to `value` now.
fn resolves_to(raw: &str, value: &Value) -> bool {
    let mut resolved = Value::String(raw.to_owned());
    let mut problems = Vec::new();
    config::interpolate::interpolate(&mut resolved, &ProcessEnv, &mut problems);
    problems.is_empty() && resolved == *value
}

/// The config as the YAML file the reload path re-reads: every `${` in a value is written as
/// `$${` so interpolation gives back the same text, except restored secrets the current file
/// spells as `${VAR}` references (`restored`, `raw_live`), which keep the reference.
fn render_for_file(
    config: &Config,
    restored: &[(String, String)],
    raw_live: Option<&Value>,
) -> Result<String, String> {
    let resolved =
        serde_json::to_value(config).map_err(|e| format!("cannot render the config: {e}"))?;
    let mut value = resolved.clone();
    escape_interpolation(&mut value);
    for (imported, live) in restored {
        let reference = raw_live
            .and_then(|raw| raw.pointer(live))
            .and_then(Value::as_str)
            .filter(|raw| raw.contains("${"));
        if let (Some(reference), Some(now)) = (reference, resolved.pointer(imported))
            && resolves_to(reference, now)
            && let Some(slot) = value.pointer_mut(imported)
        {
            *slot = Value::String(reference.to_owned());
        }
    }
    let yaml =
        serde_saphyr::to_string(&value).map_err(|e| format!("cannot render the config: {e}"))?;
    Ok(format!(
        "# Written by continuum-router from an Admin config import (PUT /admin/config).\n{yaml}"
    ))
}

fn escape_interpolation(value: &mut Value) {
    match value {
        Value::String(text) if text.contains("${") => *text = text.replace("${", "$${"),
        Value::Array(items) => items.iter_mut().for_each(escape_interpolation),
        Value::Object(map) => map.values_mut().for_each(escape_interpolation),
        _ => {}
    }
}

/// Replaces `path`'s target with `bytes`: a temporary file in the same directory, synced, given
/// the old file's permissions, renamed over the target, then the directory synced. A reader sees
/// the old or the new file, never a mix.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let target = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_owned());
    let dir = target
        .parent()
        .map(Path::to_owned)
        .unwrap_or_else(|| PathBuf::from("."));
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "config".into());
    let temp = dir.join(format!(".{name}.import-{}.tmp", std::process::id()));
    let result = (|| {
        let mut file = std::fs::File::create(&temp)?;
        if let Ok(meta) = std::fs::metadata(&target) {
            file.set_permissions(meta.permissions())?;
        }
        file.write_all(bytes)?;
        file.sync_all()?;
        drop(file);
        std::fs::rename(&temp, &target)?;
        if let Ok(dir) = std::fs::File::open(&dir) {
            let _ = dir.sync_all();
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Config {
        Config::from_yaml_str(text, &ProcessEnv).expect("valid")
    }

    const LIVE: &str = r#"
admin: {enabled: true, token: "live-admin-token-0123456789"}
api_keys:
  - {name: alice, key: "alice-key"}
"#;

    #[test]
    fn masked_secrets_keep_their_live_values_and_the_file_rereads_the_same() {
        let live = parse(LIVE);
        let shown = config::show_effective(&live);
        assert!(shown.contains(MASK) && !shown.contains("alice-key"));
        let (rendered, warnings) = prepare_import(&shown, &live, None).expect("import");
        assert_eq!(parse(&rendered), live);
        // Only the live config's own warnings (none for a loopback front door with keys).
        assert!(
            warnings.iter().all(|w| !w.contains("trusted cluster")),
            "{warnings:?}"
        );
    }

    #[test]
    fn a_mask_with_no_live_value_is_refused_with_its_path() {
        let live = parse(LIVE);
        let text = r#"
admin: {enabled: true, token: "live-admin-token-0123456789"}
api_keys:
  - {name: bob, key: "********"}
"#;
        let error = prepare_import(text, &live, None).expect_err("refused");
        assert!(
            matches!(&error, ImportError::Invalid(m) if m.contains("api_keys[0].key") && m.contains("bob")),
            "{error:?}"
        );
    }

    #[test]
    fn dollar_braces_in_values_survive_the_file_round_trip() {
        let live = parse(LIVE);
        let text = r#"
admin: {enabled: true, token: "tok-$${NOT_A_VAR}-0123456789"}
"#;
        let (rendered, _) = prepare_import(text, &live, None).expect("import");
        assert_eq!(
            parse(&rendered).admin.token.as_deref(),
            Some("tok-${NOT_A_VAR}-0123456789")
        );
    }

    #[test]
    fn repointed_etcd_with_a_masked_password_warns() {
        let live = parse(
            r#"
dynamo:
  enabled: true
  discovery: {etcd: {endpoints: ["https://etcd-a:2379"], auth: {username: u, password: "pw-live"}}}
"#,
        );
        let text = r#"
dynamo:
  enabled: true
  discovery: {etcd: {endpoints: ["https://etcd-b:2379"], auth: {username: u, password: "********"}}}
"#;
        let (rendered, warnings) = prepare_import(text, &live, None).expect("import");
        assert!(
            warnings.iter().any(|w| w.contains("trusted cluster")),
            "{warnings:?}"
        );
        let written = parse(&rendered);
        let auth = written.dynamo.discovery.etcd.auth.expect("auth");
        assert_eq!(auth.password, "pw-live");
    }

    #[test]
    fn invalid_imports_name_the_problem() {
        let live = parse(LIVE);
        for (text, needle) in [
            ("server: {bind: x}", "bind"),
            ("admin: {enabled: true}", "admin.token"),
            ("a: [unclosed", "YAML"),
        ] {
            let error = prepare_import(text, &live, None).expect_err(text);
            assert!(
                matches!(&error, ImportError::Invalid(m) if m.contains(needle)),
                "{text}: {error:?}"
            );
        }
    }

    #[test]
    fn restored_secrets_keep_the_files_env_references() {
        let file = r#"
admin: {enabled: true, token: "${CONTINUUM_IMPORT_TEST_TOKEN}"}
api_keys:
  - {name: alice, key: "${CONTINUUM_IMPORT_TEST_KEY}-suffix"}
  - {name: bob, key: "bob-literal-key"}
"#;
        let env = [
            ("CONTINUUM_IMPORT_TEST_TOKEN", "token-from-env-0123456789"),
            ("CONTINUUM_IMPORT_TEST_KEY", "key-from-env"),
        ];
        let live = Config::from_yaml_str(file, &env).expect("valid");
        let mut raw: Value = serde_saphyr::from_str(file).expect("raw");
        let restored = masked_secret_pointers(&config::mask::masked(&live), &live);
        assert_eq!(restored.len(), 3, "{restored:?}");
        // The environment of this process does not hold the variables: nothing resolves, so
        // the values are written (resolution is checked, never assumed).
        let rendered = render_for_file(&live, &restored, Some(&raw)).expect("render");
        assert!(rendered.contains("token-from-env-0123456789"), "{rendered}");
        // A raw file whose reference resolves here is kept as the reference.
        raw["admin"]["token"] = Value::String("${PATH}".into());
        let mut from_path = live.clone();
        from_path.admin.token = Some(std::env::var("PATH").expect("PATH is set"));
        let rendered = render_for_file(&from_path, &restored, Some(&raw)).expect("render");
        assert!(
            rendered.contains("${PATH}") && !rendered.contains("$${PATH}"),
            "{rendered}"
        );
        assert!(rendered.contains("bob-literal-key"), "{rendered}");
    }

    #[test]
    fn atomic_write_replaces_the_file_and_leaves_no_temp() {
        let dir = std::env::temp_dir().join(format!("continuum-import-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("router.yaml");
        std::fs::write(&path, "old").expect("write");
        write_atomically(&path, b"new").expect("atomic write");
        assert_eq!(std::fs::read_to_string(&path).expect("read"), "new");
        let left: Vec<_> = std::fs::read_dir(&dir).expect("dir").flatten().collect();
        assert_eq!(left.len(), 1, "{left:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
