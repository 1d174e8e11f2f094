//! The integration tests of `continuum-router`, as one test binary (`cargo test --test it`):
//! one module per area, and one shared [`support`] module of harnesses (real etcd, pyzmq
//! publishers, real Dynamo 1.6.1, the fake Kubernetes API, the OTLP receiver, fake upstreams,
//! the in-process demo). One binary links once, where a binary per file linked the daemon and
//! every harness again for each file.
//!
//! Adding a test (see tests/it/README.md): put `tests/it/NAME.rs` (starting with `//!`), add
//! `mod NAME;` below, gate it with `#![cfg(feature = "real-peers")]` (or `"dynamo-e2e"`) at the
//! top of the file when it needs real peers, and reach the harnesses as `crate::support::...`
//! (`use crate::support;`). A test that installs process-global state (the global tracing
//! subscriber, the OpenTelemetry tracer provider) runs in its own process:
//! `if !support::process::own_process(module_path!(), "test_fn_name") { return; }`.
//! Run one module with `cargo test --test it NAME::`.

#![allow(clippy::too_many_lines, reason = "test code is exempt")]

mod support;

mod admin_config;
mod admission;
mod admission_sdk;
mod anthropic_sdk;
mod architecture;
mod cli;
mod config_reload;
mod daemon_etcd;
mod daemon_file;
mod daemon_load;
mod demo;
mod deploy_kubernetes;
mod dynamo_broker_e2e;
mod dynamo_broker_tunnel;
mod dynamo_e2e;
mod dynamo_failover_e2e;
mod dynamo_file_e2e;
mod dynamo_kv_e2e;
mod dynamo_shim_e2e;
mod etcd_source;
mod event_bus;
mod event_bus_transport;
mod features;
mod front_door;
mod front_door_hardening;
mod front_door_probe;
mod fuzz_corpus;
mod ingress_dynamo_e2e;
mod ingress_kv_parity;
mod ingress_sdk;
mod kube_discovery;
mod kube_metadata;
mod kube_pods;
mod kv_listener;
mod kv_render;
mod kv_shim_dispatch;
mod mid_stream;
mod mid_stream_dynamo_e2e;
mod mid_stream_responses;
mod observability_assets;
mod observability_prometheus;
mod otlp_actor_starts;
mod otlp_export;
mod otlp_metrics;
mod otlp_supervision;
mod picker_admin;
mod proxy;
mod proxy_tls;
mod rate_limits;
mod replay;
mod replica_sync;
mod replica_sync_dynamo_e2e;
mod shim_dispatch;
mod tidy;
mod tidy_readonly;
mod ui_browser;
mod zmq_subscription;
