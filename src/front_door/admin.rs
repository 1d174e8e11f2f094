//! The admin API: bearer-token auth, one audit log line per call, the supervision tree, config
//! reload and the Dynamo fleet view.

use std::time::Duration;

use axum::Router;
use axum::extract::{Path, Request, State};
use axum::http::Method;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;
use tokio::sync::oneshot;

use super::error::ApiError;
use super::{AppState, ControlCommand, bearer, constant_time_eq};
use crate::build_info::Features;

/// How long an operator restart may take before the call answers 503.
const RESTART_TIMEOUT: Duration = Duration::from_secs(30);

/// The admin routes; the Dynamo ones (`/admin/dynamo/*`, `/admin/fleet/summary`) only with the
/// `dynamo` feature (without it they answer 404, before authentication, like any unknown path).
pub fn routes(state: AppState, features: Features) -> Router<AppState> {
    let routes = Router::new()
        .route("/admin/subsystems", get(list_subsystems))
        .route("/admin/subsystems/{*rest}", post(restart_subsystem))
        .route("/admin/config/reload", post(reload_config))
        .merge(super::admin_config::routes());
    let routes = if features.dynamo {
        routes
            .route("/admin/dynamo/workers", get(dynamo_workers))
            .route("/admin/fleet/summary", get(fleet_summary))
    } else {
        routes
    };
    routes.layer(middleware::from_fn_with_state(state, admin_auth))
}

/// Bearer auth for every `/admin/*` route, and the audit line.
async fn admin_auth(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let live = state.live.load();
    let verdict = match (&live.admin_token, bearer(req.headers())) {
        (None, _) => Err(ApiError::Forbidden(
            "the admin API is disabled: set admin.token".into(),
        )),
        (Some(_), None) => Err(ApiError::Unauthenticated),
        (Some(want), Some(got)) if constant_time_eq(want.as_bytes(), got.as_bytes()) => Ok(()),
        (Some(_), Some(_)) => Err(ApiError::Unauthenticated),
    };
    drop(live);
    let response = match verdict {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response(),
    };
    tracing::info!(
        target: "audit",
        method = %method,
        path = %path,
        status = response.status().as_u16(),
        authorized = response.status() != 401 && response.status() != 403,
        "Admin call."
    );
    response
}

async fn list_subsystems(State(state): State<AppState>) -> impl IntoResponse {
    axum::Json(json!({"subsystems": state.tree.list()}))
}

/// `POST /admin/subsystems/{id}/restart`, where `id` is a tree path such as
/// `root/discovery/etcd:dynamo` (slashes allowed, or percent-encoded).
async fn restart_subsystem(
    State(state): State<AppState>,
    method: Method,
    Path(rest): Path<String>,
) -> Result<Response, ApiError> {
    debug_assert_eq!(method, Method::POST);
    let id = rest
        .strip_suffix("/restart")
        .ok_or_else(|| ApiError::NotFound("use POST /admin/subsystems/{id}/restart".into()))?;
    if state.tree.get(id).is_none() {
        return Err(ApiError::NotFound(format!("no subsystem {id:?}")));
    }
    match state.tree.restart(id, RESTART_TIMEOUT).await {
        Ok(()) => {
            let row = state.tree.get(id);
            Ok(axum::Json(json!({"restarted": id, "subsystem": row})).into_response())
        }
        Err(continuum_actors::tree::RestartError::Root) => Err(ApiError::BadRequest(
            "the root supervisor cannot be restarted; restart the process".into(),
        )),
        Err(continuum_actors::tree::RestartError::Unknown(id)) => {
            Err(ApiError::NotFound(format!("no subsystem {id:?}")))
        }
        Err(e) => Err(ApiError::Unavailable(e.to_string())),
    }
}

async fn reload_config(State(state): State<AppState>) -> Result<Response, ApiError> {
    let (tx, rx) = oneshot::channel();
    state
        .control
        .send(ControlCommand::Reload(tx))
        .await
        .map_err(|_| ApiError::Unavailable("the control loop is not running".into()))?;
    match rx.await {
        Ok(Ok(summary)) => {
            Ok(axum::Json(json!({"reloaded": true, "summary": summary})).into_response())
        }
        Ok(Err(reason)) => Err(ApiError::Conflict(format!(
            "new configuration refused; the running configuration stays: {reason}"
        ))),
        Err(_) => Err(ApiError::Unavailable(
            "the control loop dropped the request".into(),
        )),
    }
}

async fn dynamo_workers(State(state): State<AppState>) -> impl IntoResponse {
    axum::Json((state.dynamo_workers)())
}

async fn fleet_summary(State(state): State<AppState>) -> impl IntoResponse {
    axum::Json((state.fleet_summary)())
}
