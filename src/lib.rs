//! continuum-router: the daemon library, module declarations only. `main.rs` parses the command
//! line and calls [`daemon::run_until_signal`]; the demo and the tests start a
//! [`daemon::Daemon`] on a listener of their own. The `demo` and `replay` subcommands live in
//! other crates (`continuum-demo`, `continuum-replay`), which the binary composes.
//!
//! | module | what it holds |
//! |---|---|
//! | [`build_info`] | version and compiled features (`--version`, `continuum_router_build_info`) |
//! | [`config`] | the typed YAML schema, validation, masking and the reload diff |
//! | [`daemon`] | startup, the reload control loop (and the config readback/import) and bounded shutdown |
//! | [`front_door`] | the axum router: OpenAI surface, health, metrics, admin |
//! | [`http1`] | the one HTTP/1.1 codec, sans-IO: heads, framing, chunked coding (server and client roles) |
//! | [`dynamo_admin`] | `GET /admin/dynamo/workers` |
//! | [`event_bus`] | `dynamo.event_bus` → the listener's settings; re-exports the `EventBus` API |
//! | [`http_metrics`] | the front door's request counters and latency histograms |
//! | [`kv`] | prompt preparation for KV-aware selection (the hook; with `dynamo-kv`, the renderer) |
//! | [`proxy`] | the request path's transport: backend pool, health, breakers, dispatch, relay |
//! | [`readiness`] | first-pass tracking behind `GET /ready` |
//! | [`route`] | the request path's orchestrator: Dynamo pins first, unified fallback; [`route::dynamo`] picks and pins |
//! | [`telemetry`] | logs and OTLP trace export |
//! | [`wire`] | HTTP vocabulary below the request path: `ApiError`, pin headers, the body-read timeout |

// Test code is exempt from the 120-line limit; product code is linted in the non-test build.
#![cfg_attr(test, allow(clippy::too_many_lines, reason = "test code is exempt"))]

pub mod build_info;
pub mod config;
pub mod daemon;
pub mod dynamo_admin;
pub mod event_bus;
pub mod front_door;
pub mod http1;
pub mod http_metrics;
pub mod kv;
pub mod proxy;
pub mod readiness;
pub mod route;
pub mod telemetry;
pub mod wire;
