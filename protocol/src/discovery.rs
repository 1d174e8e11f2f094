//! The discovery event vocabulary every source speaks (kube-runtime `watcher::Event` style).
//!
//! etcd passes, Kubernetes metadata relists and the scripted test sources all reduce to this
//! stream of keyed raw values. A resync is the startup path: `Init`, then `InitApply` for every
//! record of the fresh range gets, then `InitDone`, at which the reducer swaps its held set
//! atomically. `Apply` and `Delete` are the watch events that follow.

/// One event from a discovery source. Keys are full etcd-style keys (`v1/instances/<ns>/...`);
/// values are raw, untrusted bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceEvent {
    /// A full resync starts; records until `InitDone` replace everything held.
    Init,
    /// One record of the resync.
    InitApply { key: String, value: Vec<u8> },
    /// The resync is complete: swap.
    InitDone,
    /// A watch put.
    Apply { key: String, value: Vec<u8> },
    /// A watch delete (including lease expiry).
    Delete { key: String },
}
