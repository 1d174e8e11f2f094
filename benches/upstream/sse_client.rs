//! The stream client of `scripts/bench-proxy-nginx.sh`'s `streams` mode (issue #34): opens
//! STREAMS concurrent SSE chat completions (one connection each, started evenly over RAMP_MS)
//! against ADDR, each asking the upstream (`benches/upstream/server.rs`) for EVENTS events one
//! every INTERVAL_MS through the `x-bench-sse` header, and measures
//! - each event's latency: the time it was received less the time the upstream stamped in it
//!   (`system_fingerprint` `"fp_<ns>"`, the wall clock of the same machine). Against the
//!   upstream directly this is the rig's own latency; through a proxy, the difference is the
//!   proxy's added latency;
//! - each event's added gap: |gap received − gap sent| between consecutive events of a stream;
//! - the stream's set-up: from the connect's start to its first event (sent at once by the
//!   upstream) and to its `[DONE]`;
//! - the wall time from the first connect to the last `[DONE]`.
//!
//! One thread (the script pins it beside the upstream). The last line is `RESULT key=value ...`
//! for the script. Exits non-zero if any stream failed or lost an event.
//!
//! `cargo build --release --example bench_sse_client`, then
//! `target/release/examples/bench_sse_client ADDR STREAMS EVENTS [INTERVAL_MS] [RAMP_MS]`
//! (defaults: 50 ms between events, all streams at once).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{Buf, Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;

const BODY: &str = r#"{"model":"m","stream":true,"messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Tell me a long story, please."}],"max_tokens":512}"#;
/// Most bytes an unfinished event may hold before the stream is called broken.
const MAX_EVENT: usize = 64 * 1024;

fn now_ns() -> i128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as i128
}

#[derive(Default)]
struct Stream {
    /// Per event, received less sent (ns).
    latency: Vec<i64>,
    /// Per event after the first, |gap received − gap sent| (ns).
    gap: Vec<i64>,
    first_event: Option<Duration>,
    done: Option<Duration>,
    error: Option<String>,
}

/// Where `needle` first occurs in `hay`.
fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The `fp_<ns>` stamp of one event.
fn stamp(event: &[u8]) -> Option<i128> {
    let at = find(event, b"\"fp_")? + 4;
    let digits = event[at..]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .count();
    std::str::from_utf8(&event[at..at + digits])
        .ok()?
        .parse()
        .ok()
}

impl Stream {
    /// Takes the whole events at the start of `pending`, received at `now`.
    fn events(&mut self, pending: &mut BytesMut, now: i128, since: Instant) -> bool {
        while let Some(end) = find(pending, b"\n\n") {
            let event = pending.split_to(end + 2);
            if event.starts_with(b"data: [DONE]") {
                self.done = Some(since.elapsed());
                return true;
            }
            let Some(sent) = stamp(&event) else { continue };
            self.first_event.get_or_insert_with(|| since.elapsed());
            let latency = (now - sent) as i64;
            if let Some(last) = self.latency.last() {
                self.gap.push((latency - last).abs());
            }
            self.latency.push(latency);
        }
        false
    }
}

async fn one(addr: String, header: String, start: Instant) -> Stream {
    let mut out = Stream::default();
    tokio::time::sleep_until(start).await;
    let since = Instant::now();
    let result: Result<(), String> = async {
        let tcp = TcpStream::connect(&addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let _ = tcp.set_nodelay(true);
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        tokio::spawn(conn);
        let req = Request::post("/v1/chat/completions")
            .header("host", addr.as_str())
            .header("content-type", "application/json")
            .header("x-bench-sse", header.as_str())
            .body(Full::new(Bytes::from_static(BODY.as_bytes())))
            .map_err(|e| e.to_string())?;
        let resp = send
            .send_request(req)
            .await
            .map_err(|e| format!("request: {e}"))?;
        if !resp.status().is_success() {
            return Err(format!("status {}", resp.status()));
        }
        let mut body = resp.into_body();
        let mut pending = BytesMut::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| format!("body: {e}"))?;
            let now = now_ns();
            let Ok(mut data) = frame.into_data() else {
                continue;
            };
            if pending.len() + data.remaining() > MAX_EVENT {
                return Err("an event beyond 64 KiB".into());
            }
            pending.extend_from_slice(&data.copy_to_bytes(data.remaining()));
            if out.events(&mut pending, now, since) {
                return Ok(());
            }
        }
        Err("the body ended before [DONE]".into())
    }
    .await;
    out.error = result.err();
    out
}

fn percentile(sorted: &[i64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let at = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[at] as f64
}

fn arg<T: std::str::FromStr>(args: &[String], i: usize, default: Option<T>) -> T {
    match args.get(i).map(|a| a.parse::<T>()) {
        Some(Ok(v)) => v,
        _ => default.unwrap_or_else(|| {
            eprintln!("usage: bench_sse_client ADDR STREAMS EVENTS [INTERVAL_MS] [RAMP_MS]");
            std::process::exit(2)
        }),
    }
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let addr: String = arg(&args, 1, None);
    let streams: u32 = arg(&args, 2, None);
    let events: u32 = arg(&args, 3, None);
    let interval: u64 = arg(&args, 4, Some(50));
    let ramp: u64 = arg(&args, 5, Some(0));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let header = format!("{events},{interval}");
    let bound = Duration::from_millis(interval * u64::from(events) + ramp + 60_000);
    let results = runtime.block_on(async move {
        let start = Instant::now();
        let tasks: Vec<_> = (0..streams)
            .map(|i| {
                let at = start + Duration::from_millis(ramp) * i / streams.max(1);
                let task = one(addr.clone(), header.clone(), at);
                tokio::spawn(async move {
                    tokio::time::timeout(bound, task)
                        .await
                        .unwrap_or_else(|_| Stream {
                            error: Some("timed out".into()),
                            ..Stream::default()
                        })
                })
            })
            .collect();
        let mut results = Vec::with_capacity(tasks.len());
        for task in tasks {
            results.push(task.await.unwrap_or_default());
        }
        (results, start.elapsed())
    });
    report(&results.0, results.1, streams, events);
    let failed = results.0.iter().filter(|s| s.error.is_some()).count();
    let received: usize = results.0.iter().map(|s| s.latency.len()).sum();
    if failed > 0 || received != streams as usize * events as usize {
        std::process::exit(1);
    }
    Ok(())
}

fn report(results: &[Stream], wall: Duration, streams: u32, events: u32) {
    let mut latency: Vec<i64> = results
        .iter()
        .flat_map(|s| s.latency.iter().copied())
        .collect();
    let mut gap: Vec<i64> = results.iter().flat_map(|s| s.gap.iter().copied()).collect();
    let ms = |d: &Option<Duration>| d.map_or(i64::MAX, |d| d.as_micros() as i64);
    let mut first: Vec<i64> = results.iter().map(|s| ms(&s.first_event)).collect();
    let mut done: Vec<i64> = results.iter().map(|s| ms(&s.done)).collect();
    latency.sort_unstable();
    gap.sort_unstable();
    first.sort_unstable();
    done.sort_unstable();
    let failed: Vec<&str> = results.iter().filter_map(|s| s.error.as_deref()).collect();
    if let Some(error) = failed.first() {
        eprintln!("{} stream(s) failed; the first: {error}", failed.len());
    }
    let us = |v: f64| v / 1000.0;
    let ms = |v: f64| v / 1000.0;
    println!(
        "{streams} streams x {events} events: {} received, {} failed, wall {:.3} s",
        latency.len(),
        failed.len(),
        wall.as_secs_f64()
    );
    println!(
        "event latency µs p50 {:.0} p99 {:.0} p99.9 {:.0} max {:.0}; added gap µs p50 {:.0} p99 {:.0}",
        us(percentile(&latency, 0.5)),
        us(percentile(&latency, 0.99)),
        us(percentile(&latency, 0.999)),
        us(percentile(&latency, 1.0)),
        us(percentile(&gap, 0.5)),
        us(percentile(&gap, 0.99)),
    );
    println!(
        "first event ms p50 {:.1} p99 {:.1} max {:.1}; stream ms p50 {:.1} p99 {:.1} max {:.1}",
        ms(percentile(&first, 0.5)),
        ms(percentile(&first, 0.99)),
        ms(percentile(&first, 1.0)),
        ms(percentile(&done, 0.5)),
        ms(percentile(&done, 0.99)),
        ms(percentile(&done, 1.0)),
    );
    println!(
        "RESULT received={} failed={} wall_s={:.3} lat_p50_us={:.0} lat_p99_us={:.0} gap_p50_us={:.0} gap_p99_us={:.0} first_p50_ms={:.1} first_p99_ms={:.1} first_max_ms={:.1} stream_max_ms={:.1}",
        latency.len(),
        failed.len(),
        wall.as_secs_f64(),
        us(percentile(&latency, 0.5)),
        us(percentile(&latency, 0.99)),
        us(percentile(&gap, 0.5)),
        us(percentile(&gap, 0.99)),
        ms(percentile(&first, 0.5)),
        ms(percentile(&first, 0.99)),
        ms(percentile(&first, 1.0)),
        ms(percentile(&done, 1.0)),
    );
}
