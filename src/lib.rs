//! continuum-router: the daemon library. `main.rs` parses the command line and calls in here.
//!
//! | module | what it holds |
//! |---|---|
//! | [`build_info`] | version and compiled features (`--version`, `continuum_router_build_info`) |
//! | [`config`] | the typed YAML schema, validation, masking and the reload diff |
//! | [`daemon`] | startup, the reload control loop (and the config readback/import) and bounded shutdown |
//! | [`demo`] | `continuum-router demo`: a simulated Dynamo fleet and the router in one process |
//! | [`front_door`] | the axum router: OpenAI surface, health, metrics, admin |
//! | [`dynamo_admin`] | `GET /admin/dynamo/workers` |
//! | [`proxy`] | the OpenAI-wire serving path: backend pool, health, breakers, relay |
//! | [`readiness`] | first-pass tracking behind `GET /ready` |
//! | [`replay`] | `continuum-router replay`: offline policy replay of traces through the real pickers |
//! | [`shim`] | Dynamo direct-mode shim routing: picks and pins per request |
//! | [`telemetry`] | logs and OTLP trace export |

pub mod build_info;
pub mod config;
pub mod daemon;
pub mod demo;
pub mod dynamo_admin;
pub mod event_bus;
pub mod front_door;
pub mod kv;
pub mod proxy;
pub mod readiness;
pub mod replay;
pub mod shim;
pub mod telemetry;
