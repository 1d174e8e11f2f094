//! Discovery reducer throughput: watch-event apply rate (events/s) and full resyncs of 16,384
//! instances + 16,384 cards (cold, and idempotent on a warm reducer).

use std::hint::black_box;
use std::time::Duration;

use continuum_protocol::discovery::{DiscoveryReducer, SourceEvent};
use continuum_protocol::ids::Namespace;
use continuum_protocol::time::UnixMillis;
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use serde_json::json;

const FLEET: u64 = 16_384;
const NS: &str = "bench";

fn endpoint(id: u64) -> (String, Vec<u8>) {
    let component = if id.is_multiple_of(2) {
        "prefill"
    } else {
        "decode"
    };
    let key = format!("v1/instances/{NS}/{component}/generate/{id:x}");
    let value = json!({
        "type": "Endpoint", "component": component, "endpoint": "generate", "namespace": NS,
        "instance_id": id,
        "transport": {"tcp": format!("10.0.{}.{}:31000/{id:x}/{NS}/{component}/generate", id / 256 % 256, id % 256)},
        "device_type": "cuda", "request_plane_codec": "msgpack"
    });
    (key, serde_json::to_vec(&value).expect("json"))
}

/// A card shaped like the 1.6.1 mocker's (about 2.5 KB).
fn card(id: u64, max_num_seqs: u64) -> (String, Vec<u8>) {
    let component = if id.is_multiple_of(2) {
        "prefill"
    } else {
        "decode"
    };
    let worker_type = component;
    let file = |name: &str| {
        json!({"path": format!("hf://Qwen/Qwen3-32B/{name}"),
        "checksum": "blake3:be5d00bb40cff7daca254c6c672b60cea0c40a225a0ee586b4f8ff1819948e0f", "size": 410})
    };
    let key = format!("v1/mdc/{NS}/{component}/generate/{id:x}");
    let value = json!({
        "type": "Model", "namespace": NS, "component": component, "endpoint": "generate", "instance_id": id,
        "card_json": {
            "display_name": "Qwen/Qwen3-32B", "slug": "qwen_qwen3-32b", "source_path": "Qwen/Qwen3-32B",
            "model_info": {"hf_config_json": file("config.json")},
            "tokenizer": {"hf_tokenizer_json": file("tokenizer.json")},
            "prompt_formatter": {"hf_tokenizer_config_json": file("tokenizer_config.json")},
            "gen_config": {"hf_generation_config_json": file("generation_config.json")},
            "context_length": 32768, "kv_cache_block_size": 64, "migration_limit": 0,
            "model_type": "Chat | Completions", "model_input": "Tokens", "worker_type": worker_type,
            "needs": [["decode"]],
            "runtime_config": {
                "context_length": 32768, "total_kv_blocks": 12000, "max_num_seqs": max_num_seqs,
                "max_num_batched_tokens": 8192, "tool_call_parser": null, "reasoning_parser": null,
                "tool_call_arguments_format": "json_string", "structural_tag_mode": "off",
                "structural_tag_scope": "auto", "structural_tag_schema": "auto",
                "exclude_tools_when_tool_choice_none": true, "data_parallel_start_rank": 0,
                "data_parallel_size": 1, "enable_local_indexer": true,
                "kv_event_publishing_enabled": true, "runtime_data": {"output_replay_consumer": true},
                "enable_eagle": false
            },
            "media_decoder": null, "media_fetcher": null
        }
    });
    (key, serde_json::to_vec(&value).expect("json"))
}

fn resync_events(n: u64) -> Vec<SourceEvent> {
    let mut events = vec![SourceEvent::Init];
    for id in 1..=n {
        let (key, value) = endpoint(id);
        events.push(SourceEvent::InitApply { key, value });
        let (key, value) = card(id, 256);
        events.push(SourceEvent::InitApply { key, value });
    }
    events.push(SourceEvent::InitDone);
    events
}

fn run(reducer: &mut DiscoveryReducer, events: Vec<SourceEvent>) {
    for e in events {
        black_box(reducer.apply(e, UnixMillis(1)));
    }
}

fn warm_reducer(n: u64) -> DiscoveryReducer {
    let mut r = DiscoveryReducer::new(Namespace::new(NS));
    run(&mut r, resync_events(n));
    r
}

fn bench_apply(c: &mut Criterion) {
    let mut group = c.benchmark_group("apply");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));

    // Workers registering: endpoint then card, into an empty reducer.
    let joins: Vec<SourceEvent> = (1..=2048u64)
        .flat_map(|id| {
            let (ek, ev) = endpoint(id);
            let (ck, cv) = card(id, 256);
            [
                SourceEvent::Apply { key: ek, value: ev },
                SourceEvent::Apply { key: ck, value: cv },
            ]
        })
        .collect();
    group.throughput(Throughput::Elements(joins.len() as u64));
    group.bench_function("register_2048_workers", |b| {
        b.iter_batched(
            || (DiscoveryReducer::new(Namespace::new(NS)), joins.clone()),
            |(mut r, events)| run(&mut r, events),
            BatchSize::LargeInput,
        )
    });

    // Watch traffic on a full fleet: a card update, an identical endpoint heartbeat, a delete
    // and a re-register per worker touched. Two event sets alternate so card updates always
    // change something; the fleet keeps its size.
    let watch_set = |seqs: u64| {
        let mut events = Vec::new();
        for i in 0..1024u64 {
            let id = (i * 7919) % FLEET + 1;
            let (key, value) = card(id, seqs);
            events.push(SourceEvent::Apply { key, value });
            let (key, value) = endpoint(id);
            events.push(SourceEvent::Apply {
                key: key.clone(),
                value: value.clone(),
            });
            events.push(SourceEvent::Delete { key: key.clone() });
            events.push(SourceEvent::Apply { key, value });
        }
        events
    };
    let sets = [watch_set(128), watch_set(129)];
    let mut turn = 0usize;
    let mut warm = warm_reducer(FLEET);
    group.throughput(Throughput::Elements(sets[0].len() as u64));
    group.bench_function("watch_events_on_16384_fleet", |b| {
        b.iter_batched(
            || {
                turn += 1;
                sets[turn % 2].clone()
            },
            |events| run(&mut warm, events),
            BatchSize::LargeInput,
        )
    });
    group.finish();
}

fn bench_resync(c: &mut Criterion) {
    let mut group = c.benchmark_group("resync_16384_instances_16384_cards");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(8));
    let events = resync_events(FLEET);
    group.bench_function("cold", |b| {
        b.iter_batched(
            || (DiscoveryReducer::new(Namespace::new(NS)), events.clone()),
            |(mut r, events)| run(&mut r, events),
            BatchSize::PerIteration,
        )
    });
    let mut warm = warm_reducer(FLEET);
    group.bench_function("idempotent", |b| {
        b.iter_batched(
            || events.clone(),
            |events| run(&mut warm, events),
            BatchSize::PerIteration,
        )
    });
    group.finish();
}

criterion_group!(benches, bench_apply, bench_resync);
criterion_main!(benches);
