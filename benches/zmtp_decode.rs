//! ZMTP decode throughput over the captured Dynamo 1.6.1 `kv_metrics` frames.
//!
//! Three stages, each reported as messages per second on one core:
//! - `event_plane`: 4 frames → envelope → ActiveLoad (`decode_kv_metrics`);
//! - `wire`: ZMTP bytes → `ZmtpSub` (2 KiB reads) → `decode_kv_metrics`;
//! - `store`: `LoadStream::on_delivery` into a `LoadStore` (decode + dedup + apply).

use std::hint::black_box;
use std::path::Path;

use continuum_protocol::event_plane::decode_kv_metrics;
use continuum_protocol::ids::PublisherId;
use continuum_protocol::load_store::{LoadStore, LoadStream};
use continuum_protocol::time::Tick;
use continuum_protocol::zmtp::{Delivery, GREETING, ZmtpLimits, ZmtpMessage, ZmtpSub};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};

const FIXTURES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/dynamo-1.6.1/zmq"
);

fn captured() -> Vec<[Vec<u8>; 4]> {
    let mut out = Vec::new();
    for run in ["agg", "disagg"] {
        let dir = Path::new(FIXTURES).join(run);
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .expect("fixtures present")
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter_map(|n| n.strip_suffix("-kv_metrics.frame0.bin").map(str::to_owned))
            .collect();
        names.sort();
        for name in names {
            let read = |i: usize| {
                std::fs::read(dir.join(format!("{name}-kv_metrics.frame{i}.bin"))).expect("frame")
            };
            out.push([read(0), read(1), read(2), read(3)]);
        }
    }
    out
}

fn publisher(frames: &[Vec<u8>; 4]) -> PublisherId {
    PublisherId(u64::from_be_bytes(
        frames[1].as_slice().try_into().expect("8-byte id"),
    ))
}

fn wire(frames: &[Vec<u8>; 4]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, frame) in frames.iter().enumerate() {
        let more = u8::from(i + 1 < frames.len());
        if frame.len() > 255 {
            out.push(more | 0x02);
            out.extend_from_slice(&(frame.len() as u64).to_be_bytes());
        } else {
            out.push(more);
            out.push(frame.len() as u8);
        }
        out.extend_from_slice(frame);
    }
    out
}

fn bench(c: &mut Criterion) {
    let messages = captured();
    let deliveries: Vec<(PublisherId, Delivery)> = messages
        .iter()
        .map(|m| {
            let message = ZmtpMessage::from_frames(m).expect("4 frames");
            (publisher(m), Delivery::Message(message))
        })
        .collect();
    let n = deliveries.len() as u64;
    let mut group = c.benchmark_group("zmtp_decode");
    group.throughput(Throughput::Elements(n));

    group.bench_function("event_plane", |b| {
        b.iter(|| {
            for (publisher, delivery) in &deliveries {
                black_box(decode_kv_metrics(black_box(delivery), *publisher).is_ok());
            }
        })
    });

    // One publisher's stream on the wire, as a subscription sees it.
    let target = publisher(&messages[0]);
    let stream: Vec<&[Vec<u8>; 4]> = messages.iter().filter(|m| publisher(m) == target).collect();
    let mut handshake = GREETING.to_vec();
    handshake.extend_from_slice(b"\x04\x19\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB");
    let body: Vec<u8> = stream.iter().flat_map(|m| wire(m)).collect();
    group.throughput(Throughput::Elements(stream.len() as u64));
    group.bench_function("wire", |b| {
        b.iter(|| {
            let mut sub = ZmtpSub::new(b"kv_metrics", ZmtpLimits::KV_METRICS).expect("topic");
            sub.feed(&handshake, |_| {}).expect("handshake");
            let mut ok = 0u32;
            for chunk in body.chunks(2048) {
                sub.feed(chunk, |d| {
                    ok += u32::from(decode_kv_metrics(&d, target).is_ok())
                })
                .expect("valid stream");
            }
            black_box(ok)
        })
    });

    group.throughput(Throughput::Elements(n));
    let workers: Vec<_> = deliveries
        .iter()
        .filter_map(|(p, d)| decode_kv_metrics(d, *p).ok())
        .map(|e| e.load.worker_id)
        .collect();
    group.bench_function("store", |b| {
        b.iter(|| {
            let mut store = LoadStore::new();
            store.set_live_and_retain(workers.iter().copied());
            let mut streams: Vec<LoadStream> = Vec::new();
            for (publisher, delivery) in &deliveries {
                let index = match streams.iter().position(|s| s.publisher_id() == *publisher) {
                    Some(i) => i,
                    None => {
                        streams.push(LoadStream::new(*publisher));
                        streams.len() - 1
                    }
                };
                black_box(streams[index].on_delivery(delivery, &mut store, Tick::ZERO));
            }
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
