//! Every validation rule and warning, collected (never stopping at the first) as
//! path-addressed [`Diagnostic`]s.
//!
//! Rules follow the product reference (docs "Dynamo Worker Discovery"); the ones the reference
//! leaves open (front door, backends, telemetry) are the checks an operator would expect. Each
//! rule has one unit test in `validate/tests.rs` named after it.
//!
//! | module | rules of |
//! |---|---|
//! | `front` | admin token, API keys, `server`, `backends[]`, `telemetry` |
//! | `discovery` | `dynamo.discovery` (etcd, Kubernetes, file sources; namespaces, backoff) |
//! | `dynamo` | `dynamo.load`, `dynamo.shim`, `dynamo.kv` |
//! | `event_bus` | `dynamo.event_bus` |
//! | `values` | single values: endpoints, URLs, namespaces, names, ids, addresses |

use std::time::Duration;

use super::schema::*;
use super::{Diagnostic, Severity};

mod discovery;
mod dynamo;
mod event_bus;
mod front;
mod mid_stream;
mod values;

pub use values::{
    EtcdEndpoint, check_endpoint, check_namespace, is_dns1123_label, is_label_value,
    is_prefixed_hex, normalize_endpoint,
};

/// Most etcd endpoints accepted.
pub const MAX_ETCD_ENDPOINTS: usize = 16;
/// Shortest `dynamo.discovery.file.rescan_interval` accepted.
pub const MIN_FILE_RESCAN: Duration = Duration::from_millis(10);
/// Most Dynamo namespaces one router watches (`MAX_DYNAMO_NAMESPACES`).
pub const MAX_DYNAMO_NAMESPACES: usize = 16;
/// Most shim replicas in `shim.backends` (and in one pool).
pub const MAX_SHIM_BACKENDS: usize = 64;
/// Most `backends[].global_prompts` entries.
pub const MAX_GLOBAL_PROMPTS: usize = 64;
/// Largest `backends[].global_prompts` entry.
pub const MAX_GLOBAL_PROMPT_BYTES: usize = 64 * 1024;
/// Most `shim.model_map` pairs.
pub const MAX_MODEL_MAP_ENTRIES: usize = 1024;
/// Most `load.direct_allow_cidrs` entries.
pub const MAX_DIRECT_ALLOW_CIDRS: usize = 64;
/// Most `kubernetes.models` entries.
pub const MAX_COMPONENT_MODELS: usize = 256;
/// Most `event_bus.brokers` entries (it bounds a metric label set).
pub const MAX_BROKERS: usize = 256;
/// Per-stream floor of the event-bus session buffer (4 reservations of 16 KiB).
pub const MIN_STREAM_BUFFER_BYTES: u64 = 64 * 1024;
/// Most event-bus sessions and streams per session.
pub const MAX_EVENT_BUS_SESSIONS: u32 = 4096;
pub const MAX_STREAMS_PER_SESSION: u32 = 65_536;
/// `load.max_staleness` bounds.
pub const MIN_MAX_STALENESS: Duration = Duration::from_millis(100);
/// Largest `dynamo.load.tie_break_window`.
pub const MAX_TIE_BREAK_WINDOW: f64 = continuum_protocol::picker::tie_break::MAX_WINDOW;
pub const MAX_MAX_STALENESS: Duration = Duration::from_secs(300);

/// Validates a parsed config; returns every error and warning (errors first, then warnings,
/// each group in document order).
pub fn validate(config: &Config) -> Vec<Diagnostic> {
    let mut v = Validator::default();
    v.server_and_auth(config);
    v.backends(config);
    v.telemetry(&config.telemetry);
    v.discovery(config);
    v.load(config);
    v.shim(config);
    v.kv(config);
    v.event_bus(config);
    v.kv_cache_index(config);
    let mut out = v.out;
    out.extend(mid_stream::validate(
        &config.disaggregated_serving.mid_stream_fallback,
    ));
    out.extend(super::rate_limits::validate(config));
    out.extend(super::admission::validate(config));
    out.extend(super::replica_sync::validate(config));
    // Keys of a feature this build lacks are validated like the others, then flagged.
    out.extend(super::features::inactive(
        config,
        crate::build_info::Features::COMPILED,
    ));
    out.sort_by_key(|diagnostic| diagnostic.severity == Severity::Warning);
    out
}

#[derive(Default)]
struct Validator {
    out: Vec<Diagnostic>,
}

impl Validator {
    fn err(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.out.push(Diagnostic::error(path, message));
    }

    fn warn(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.out.push(Diagnostic::warning(path, message));
    }
}

#[cfg(test)]
mod tests;
