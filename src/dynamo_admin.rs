//! `GET /admin/dynamo/workers`: the discovered fleet as operators read it. Built from the
//! registry snapshot; never exposes transport addresses, Pod IPs or raw model cards.

use continuum_actors::kv_index::SharedKvIndex;
use continuum_actors::load::SharedLoadStore;
use continuum_actors::picker::SharedPicker;
use continuum_actors::registry::RegistryReader;
use serde_json::{Value, json};

/// The response body; `enabled: false` (still 200) when discovery is off in the live config.
/// `picker` adds the PickerActor's state (installed picker, index generation, ledger size).
pub fn workers_view(
    registry: &RegistryReader,
    load: &SharedLoadStore,
    kv: &SharedKvIndex,
    picker: Option<&SharedPicker>,
) -> Value {
    if !registry.is_enabled() {
        return json!({"enabled": false});
    }
    let snapshot = registry.snapshot();
    let namespaces: Vec<&str> = snapshot.namespaces().iter().map(|n| n.as_str()).collect();
    let now = continuum_actors::clock::now_tick();
    let workers: Vec<Value> = snapshot
        .workers()
        .iter()
        .map(|w| {
            let mut view = w.admin_json();
            // Reachability from the load plane: a SIGKILLed worker stays registered until its
            // lease expires, but its load publisher is gone at once.
            if let Some(fields) = view.as_object_mut() {
                let mark = load.unreachable(w.key.instance_id);
                fields.insert("reachable".into(), Value::Bool(mark.is_none()));
                if let Some(mark) = mark {
                    let ms = u64::try_from(now.since(mark.since).as_millis()).unwrap_or(u64::MAX);
                    fields.insert("unreachable_for_ms".into(), Value::from(ms));
                }
            }
            view
        })
        .collect();
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
        "kv_hash_parity": kv_hash_parity(kv),
        "load": load_samples(load),
    });
    if let (Some(picker), Some(fields)) = (picker, view.as_object_mut()) {
        fields.insert("picker".into(), json!(picker.status()));
    }
    view
}

/// The latest ActiveLoad sample per (worker, dp_rank), with its age: what the picker reads.
fn load_samples(load: &SharedLoadStore) -> Vec<Value> {
    let now = continuum_actors::clock::now_tick();
    let mut samples: Vec<Value> = load.with(|store| {
        store
            .iter()
            .map(|(key, sample)| {
                json!({
                    "worker_id": key.worker_id.decimal(),
                    "instance_id": key.worker_id.hex(),
                    "dp_rank": key.dp_rank.0,
                    "active_decode_blocks": sample.load.active_decode_blocks,
                    "active_prefill_tokens": sample.load.active_prefill_tokens,
                    "kv_used_blocks": sample.load.kv_used_blocks,
                    "age_ms": u64::try_from(sample.age(now).as_millis()).unwrap_or(u64::MAX),
                })
            })
            .collect()
    });
    samples.sort_by(|a, b| {
        (a["instance_id"].as_str(), a["dp_rank"].as_u64())
            .cmp(&(b["instance_id"].as_str(), b["dp_rank"].as_u64()))
    });
    samples
}

/// Per model: predictions decided, matched, and the match ratio over the last 100 (`null`
/// before the first). Models appear after their first KV-aware pick and leave with the fleet.
fn kv_hash_parity(kv: &SharedKvIndex) -> Value {
    let models: serde_json::Map<String, Value> = kv
        .parity_all()
        .into_iter()
        .map(|(model, stats)| {
            let value = json!({
                "checked": stats.checked,
                "matched": stats.matched,
                "last_100_match_ratio": stats.last_100_match_ratio(),
            });
            (model, value)
        })
        .collect();
    Value::Object(models)
}

/// `GET /admin/fleet/summary`: the numbers the fleet page turns into bars and sparklines.
/// Counters are cumulative since start (the page plots their per-second deltas); KV blocks are
/// per rank, read from the index in O(ranks). Built from the metrics registry's families, so it
/// always agrees with `/metrics`.
pub fn fleet_summary(kv: &SharedKvIndex, metrics: &continuum_actors::metrics::Metrics) -> Value {
    let families = metrics.registry().gather();
    // Per counter family, its series as (labels, value).
    let series = |name: &str| -> Vec<(Vec<(String, String)>, f64)> {
        families
            .iter()
            .filter(|mf| mf.name() == name)
            .flat_map(|mf| mf.get_metric().iter())
            .map(|m| {
                let labels = m
                    .get_label()
                    .iter()
                    .map(|p| (p.name().to_owned(), p.value().to_owned()))
                    .collect();
                (labels, m.get_counter().get_value())
            })
            .collect()
    };
    let label = |labels: &[(String, String)], name: &str| -> String {
        labels
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    // {role: {reason: n}}
    let mut selections = serde_json::Map::new();
    for (labels, value) in series("continuum_dynamo_selection_total") {
        let role = selections
            .entry(label(&labels, "role"))
            .or_insert_with(|| json!({}));
        if let Some(role) = role.as_object_mut() {
            role.insert(label(&labels, "reason"), json!(value as u64));
        }
    }
    let mut kv_selection = serde_json::Map::new();
    for (labels, value) in series("continuum_dynamo_kv_selection_total") {
        kv_selection.insert(label(&labels, "result"), json!(value as u64));
    }
    // {model: {match: n, mismatch: n}}
    let mut parity = serde_json::Map::new();
    for (labels, value) in series("continuum_dynamo_kv_hash_parity_total") {
        let model = parity
            .entry(label(&labels, "model"))
            .or_insert_with(|| json!({"match": 0, "mismatch": 0}));
        if let Some(model) = model.as_object_mut() {
            model.insert(label(&labels, "result"), json!(value as u64));
        }
    }
    // {model: requests waiting in its admission queue} (a gauge, so its value, not a delta).
    let mut queue_depth = serde_json::Map::new();
    for m in families
        .iter()
        .filter(|mf| mf.name() == "continuum_admission_queue_depth")
        .flat_map(|mf| mf.get_metric().iter())
    {
        let labels: Vec<(String, String)> = m
            .get_label()
            .iter()
            .map(|p| (p.name().to_owned(), p.value().to_owned()))
            .collect();
        queue_depth.insert(
            label(&labels, "model"),
            json!(m.get_gauge().get_value() as i64),
        );
    }
    let kv_blocks: Vec<Value> = kv
        .rank_blocks()
        .into_iter()
        .map(|(worker, rank, blocks)| {
            json!({"instance_id": worker.hex(), "dp_rank": rank.0, "blocks": blocks})
        })
        .collect();
    json!({
        "selections": selections,
        "kv_selection": kv_selection,
        "kv_hash_parity": parity,
        "kv_blocks": kv_blocks,
        "queue_depth": queue_depth,
        "mid_stream_fallback": mid_stream_summary(&series("continuum_mid_stream_fallback_total")),
    })
}

/// `continuum_mid_stream_fallback_total` summed over ingress and reason: every cut counted
/// (`attempts`), those continued, and the rest (`failed`: refused, no fallback, budget, ...).
fn mid_stream_summary(series: &[(Vec<(String, String)>, f64)]) -> Value {
    let (mut attempts, mut continued) = (0_u64, 0_u64);
    for (labels, value) in series {
        attempts += *value as u64;
        if labels
            .iter()
            .any(|(name, v)| name == "result" && v == "continued")
        {
            continued += *value as u64;
        }
    }
    json!({"attempts": attempts, "continued": continued, "failed": attempts - continued})
}
