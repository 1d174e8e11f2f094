//! `GET /admin/config` (the effective config, secrets masked exactly like `config show`) and
//! `PUT`/`POST /admin/config` (import a YAML config; masked secrets keep their live values).
//!
//! Both go through the daemon's control loop, the one owner of the running config: the readback
//! is the config the loop last applied, and an import is validated, written to the config file
//! atomically and applied through the normal reload path there (`src/daemon/import.rs`). The
//! admin middleware writes the audit line of every call; an import adds one with its outcome.

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::json;
use tokio::sync::oneshot;

use super::error::ApiError;
use super::{AppState, ControlCommand};
use crate::config::{self, Config, MAX_CONFIG_BYTES};

/// What a successful import did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImportOutcome {
    /// The reload's summary (`"3 changed keys; discovery replaced (connection)"`, `"no changes"`).
    pub summary: String,
    /// Validation warnings of the imported config and import notes (a masked etcd password
    /// reused on re-pointed endpoints).
    pub warnings: Vec<String>,
}

/// Why an import was refused; the running config and the file are unchanged in every case.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ImportError {
    /// Not YAML, unknown keys, unset `${VAR}`s, validation errors, or a masked secret with no
    /// live value to restore.
    #[error("{0}")]
    Invalid(String),
    /// The reload path refused it, or the daemon runs without a config file (the demo).
    #[error("{0}")]
    Refused(String),
    /// The config file could not be written.
    #[error("{0}")]
    Write(String),
}

pub type ImportReply = oneshot::Sender<Result<ImportOutcome, ImportError>>;

pub fn routes() -> Router<AppState> {
    Router::new().route(
        "/admin/config",
        get(read_config)
            .put(import_config)
            .post(import_config)
            // The same bound as a config file; larger bodies are 413 before they are buffered.
            .layer(DefaultBodyLimit::max(MAX_CONFIG_BYTES as usize)),
    )
}

/// The running config as `config show` prints it (YAML, secrets masked).
async fn read_config(State(state): State<AppState>) -> Result<Response, ApiError> {
    let (tx, rx) = oneshot::channel();
    send(&state, ControlCommand::Config(tx)).await?;
    let running: Box<Config> = rx
        .await
        .map_err(|_| ApiError::Unavailable("the control loop dropped the request".into()))?;
    Ok((
        [(header::CONTENT_TYPE, "application/yaml")],
        config::show_effective(&running),
    )
        .into_response())
}

async fn import_config(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let text = String::from_utf8(body.to_vec())
        .map_err(|_| ApiError::BadRequest("the config must be UTF-8 YAML".into()))?;
    let (tx, rx) = oneshot::channel();
    send(&state, ControlCommand::Import(text, tx)).await?;
    let outcome = rx
        .await
        .map_err(|_| ApiError::Unavailable("the control loop dropped the request".into()))?;
    match outcome {
        Ok(outcome) => {
            tracing::info!(
                target: "audit",
                action = "config_import",
                applied = true,
                summary = %outcome.summary,
                warnings = outcome.warnings.len(),
                "Admin config import applied and written."
            );
            Ok(axum::Json(json!({
                "imported": true,
                "summary": outcome.summary,
                "warnings": outcome.warnings,
            }))
            .into_response())
        }
        Err(error) => {
            tracing::info!(
                target: "audit",
                action = "config_import",
                applied = false,
                reason = %error,
                "Admin config import refused; the running config stays."
            );
            Err(match error {
                ImportError::Invalid(reason) => {
                    ApiError::BadRequest(format!("imported config refused: {reason}"))
                }
                ImportError::Refused(reason) => ApiError::Conflict(format!(
                    "imported config refused; the running configuration stays: {reason}"
                )),
                ImportError::Write(reason) => ApiError::Internal(format!(
                    "imported config not applied; the config file could not be written: {reason}"
                )),
            })
        }
    }
}

async fn send(state: &AppState, command: ControlCommand) -> Result<(), ApiError> {
    state
        .control
        .send(command)
        .await
        .map_err(|_| ApiError::Unavailable("the control loop is not running".into()))
}
