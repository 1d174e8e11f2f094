//! `GET /admin/dynamo/workers`: the discovered fleet as operators read it. Built from the
//! registry snapshot; never exposes transport addresses, Pod IPs or raw model cards.

use continuum_actors::load::DynamoLoadStore;
use continuum_actors::picker::DynamoPicker;
use continuum_actors::registry::DynamoRegistry;
use serde_json::{Value, json};

/// The response body; `enabled: false` (still 200) when discovery is off in the live config.
/// `picker` adds the PickerActor's state (installed picker, index generation, ledger size).
pub fn workers_view(
    registry: &DynamoRegistry,
    load: &DynamoLoadStore,
    picker: Option<&DynamoPicker>,
) -> Value {
    if !registry.is_enabled() {
        return json!({"enabled": false});
    }
    let snapshot = registry.snapshot();
    let namespaces: Vec<&str> = snapshot.namespaces().iter().map(|n| n.as_str()).collect();
    let workers: Vec<Value> = snapshot.workers().iter().map(|w| w.admin_json()).collect();
    let mut view = json!({
        "enabled": true,
        "connected": registry.connected(),
        "source": snapshot.source().as_str(),
        "signals": snapshot.signals(),
        "namespace": namespaces.first(),
        "namespaces": namespaces,
        "generation": registry.generation(),
        "workers": workers,
        "load_publishers": snapshot.load_publisher_count(),
        "kv_event_publishers": snapshot.kv_event_publisher_count(),
        "subscriptions": load.subscriptions(),
    });
    if let (Some(picker), Some(fields)) = (picker, view.as_object_mut()) {
        fields.insert("picker".into(), json!(picker.status()));
    }
    view
}
