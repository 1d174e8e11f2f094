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
//! | [`discovery`] | the discovery event vocabulary shared by every source |
//! | [`picker`] | worker selection for direct-mode shim routing: costs, cursors, dispatch ledger |

pub mod backoff;
pub mod discovery;
pub mod ids;
pub mod picker;
pub mod time;
