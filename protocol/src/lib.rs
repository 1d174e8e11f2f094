//! continuum-protocol: the deterministic, sans-IO core of continuum-router.
//!
//! Everything here is a pure function of its inputs. No sockets, no files, no clocks, no
//! randomness of its own: `now` and random draws arrive as arguments, so every decision the
//! router makes can be replayed in a unit test from captured Dynamo 1.6.1 bytes.
//!
//! | module | what it holds |
//! |---|---|
//! | [`ids`] | identifier newtypes shared by every crate |
//! | [`time`] | caller-supplied monotonic ticks and wall-clock timestamps |
//! | [`backoff`] | reconnect backoff and supervisor restart budgets |
//! | [`breaker`] | backend circuit breaker and active-health thresholds |
//! | [`discovery`] | the discovery event vocabulary shared by every source |
//! | [`zmtp`] | bounded ZMTP 3.x SUB client state machine (greeting, READY, frames, PING) |
//! | [`event_bus`] | event-bus wire contract: NDJSON control messages, hello validation, credentials, rendezvous, byte bounds, session state machines of both ends |
//! | [`event_plane`] | 4-frame event-plane messages, EventEnvelope, ActiveLoad, drop results |
//! | [`load_store`] | latest ActiveLoad per (worker, dp_rank), staleness, missed-message rule |
//! | [`subscription_plan`] | which publishers to subscribe to (cap, order, diff) |
//! | [`kube`] | Kubernetes discovery: `hash_pod_name`, Pod membership, metadata ⋈ EndpointSlice |
//! | [`kv`] | kv-events decoding, the bounded radix index, block hashing, the KV cost function |
//! | [`ingress`] | Anthropic Messages API ⇄ OpenAI chat-completions converters (requests, responses, SSE streams, error objects) |
//! | [`picker`] | worker selection for direct-mode shim routing: costs, cursors, dispatch ledger |
//! | [`ratelimit`] | GCRA request and token buckets, the per-name LRU table, `RateLimit` fields |
//! | [`admission`] | the busy-fleet rule over load samples, the bounded per-model wait queue |
//! | [`replica_sync`] | router replicas sharing in-flight dispatches: the snapshot, its bounded decoding, the peer table merging peers into the ledger |

// Test code is exempt from the 120-line limit; product code is linted in the non-test build.
#![cfg_attr(test, allow(clippy::too_many_lines, reason = "test code is exempt"))]

pub mod admission;
pub mod backoff;
pub mod breaker;
pub mod change_log;
pub mod discovery;
pub mod event_bus;
pub mod event_plane;
pub mod id_hash;
pub mod ids;
pub mod ingress;
pub mod kube;
pub mod kv;
pub mod load_store;
// The two pickers' `pick` are over 120 lines (tests/it/tidy/long_functions.txt); the attribute
// sits here so the picker files stay untouched while they are being reworked (issue 30 item 2).
#[expect(
    clippy::too_many_lines,
    reason = "LoadBasedPicker::pick, KvAwarePicker::pick_with"
)]
pub mod picker;
pub mod ratelimit;
pub mod replica_sync;
pub mod subscription_plan;
pub mod time;
pub mod zmtp;
