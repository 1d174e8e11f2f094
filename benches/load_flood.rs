//! Overload without collapse, measured: the demo fleet (`continuum-demo`, in process, on
//! loopback) behind the real daemon, tenant A at a steady rate well under the fleet's capacity and
//! tenant B flooding at ten times it, in three phases:
//!
//! 1. **solo**: A alone;
//! 2. **fairness off**: A + B, both keys in the same class, B without a rate limit;
//! 3. **fairness on**: A + B, B's key rate-limited to half the capacity
//!    (`rate_limits.api_keys`), A's key in class `high` (`admission.priority.api_keys`), deficit
//!    round robin between keys of a class as always.
//!
//! **Capacity.** The simulated workers sleep, so they have no capacity of their own: the fleet's
//! capacity is the admission rule's. Model `demo-agg` has two aggregated workers (one rank each,
//! 1,024 KV blocks); every request here books 2 blocks for `MAX_TOKENS × PER_TOKEN` (200 ms), and
//! `admission.busy_threshold.kv_usage` makes a rank busy at `PER_RANK` requests: capacity is
//! `2 × PER_RANK / 0.2 s` (40 requests/s at the defaults). Past it, requests wait in the model's
//! queue (`max_depth` 32, `max_wait` 2 s) or are refused `503 fleet_busy`.
//!
//! Each request is open loop (sent on its tick whatever the others do), with a 30 s client
//! timeout. Printed per phase and tenant: sent, answered, refused by status with and without
//! `Retry-After`, failed (transport errors, timeouts, other statuses: "lost"), A's latency
//! percentiles, and the load average. `scripts/load-flood.sh` runs it; env `FLOOD_SECS` (phase
//! length, default 30), `FLOOD_A_RPS` (default 8), `FLOOD_B_RPS` (default 400).
//! Results: docs/performance.md, "Overload: a flooding tenant".

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use continuum_demo::shim::Pace;
use continuum_demo::{DemoOptions, Simulation};
use continuum_router::config::Config;
use continuum_router::config::admission::Class;
use continuum_router::config::rate_limits::RateLimitConfig;
use continuum_router::config::schema::ApiKeyConfig;
use continuum_router::daemon::{Daemon, RunOptions};
use tokio::net::TcpListener;

const MODEL: &str = "demo-agg";
const MAX_TOKENS: u64 = 20;
const PER_TOKEN: Duration = Duration::from_millis(10);
/// Requests a rank holds before it is busy.
const PER_RANK: u64 = 4;
/// Blocks one request books: ("hi" chat messages ≈ 9 tokens + 20) / 16, rounded up.
const BLOCKS_PER_REQUEST: u64 = 2;
const TOTAL_KV_BLOCKS: u64 = 1024;
const KEY_A: &str = "sk-tenant-a";
const KEY_B: &str = "sk-tenant-b";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Solo,
    FairnessOff,
    FairnessOn,
}

impl Phase {
    const fn name(self) -> &'static str {
        match self {
            Phase::Solo => "solo",
            Phase::FairnessOff => "fairness off",
            Phase::FairnessOn => "fairness on",
        }
    }
}

/// The capacity in requests per second, from the constants above.
fn capacity() -> f64 {
    let seconds = (PER_TOKEN * u32::try_from(MAX_TOKENS).unwrap_or(u32::MAX)).as_secs_f64();
    2.0 * PER_RANK as f64 / seconds
}

fn env_f64(name: &str, default: f64) -> f64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The demo config with the two tenants, the admission rule, and per phase the fairness.
fn config(base: Config, phase: Phase) -> Config {
    let mut config = base;
    for (key, name) in [(KEY_A, "tenant-a"), (KEY_B, "tenant-b")] {
        config.api_keys.push(ApiKeyConfig {
            key: key.into(),
            name: name.into(),
            allowed_backends: None,
        });
    }
    let admission = &mut config.admission;
    admission.busy_threshold.kv_usage =
        Some((PER_RANK * BLOCKS_PER_REQUEST) as f64 / TOTAL_KV_BLOCKS as f64);
    admission.queue.max_depth = 32;
    admission.queue.max_wait = continuum_router::config::schema::HumanDuration::from_secs(2);
    if phase == Phase::FairnessOn {
        admission
            .priority
            .api_keys
            .insert("tenant-a".into(), Class::High);
        // Half the capacity, per minute; a burst of a quarter second's share.
        let per_minute = (capacity() * 30.0) as u64;
        config.rate_limits.api_keys.insert(
            "tenant-b".into(),
            RateLimitConfig {
                requests_per_minute: Some(per_minute),
                request_burst: Some((per_minute / 240).max(1)),
                ..RateLimitConfig::default()
            },
        );
    }
    config
}

/// How one request ended.
#[derive(Clone, Debug)]
enum Outcome {
    Answered(Duration),
    Refused { status: u16, retry_after: bool },
    Failed(String),
}

#[derive(Default)]
struct Tally {
    outcomes: Vec<Outcome>,
}

async fn one(client: reqwest::Client, url: String, key: &'static str) -> Outcome {
    let body = serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": MAX_TOKENS,
    });
    let start = Instant::now();
    let sent = client
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&body)
        .timeout(Duration::from_secs(30))
        .send()
        .await;
    let resp = match sent {
        Ok(resp) => resp,
        Err(e) => return Outcome::Failed(format!("send: {e}")),
    };
    let status = resp.status().as_u16();
    let retry_after = resp.headers().contains_key("retry-after");
    match resp.bytes().await {
        Err(e) => Outcome::Failed(format!("body: {e}")),
        Ok(_) if status == 200 => Outcome::Answered(start.elapsed()),
        Ok(_) if status == 429 || status == 503 => Outcome::Refused {
            status,
            retry_after,
        },
        Ok(_) => Outcome::Failed(format!("status {status}")),
    }
}

/// Sends `rate` requests per second for `length`, open loop; returns every outcome.
async fn tenant(url: String, key: &'static str, rate: f64, length: Duration) -> Tally {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .build()
        .expect("client");
    let tally = Arc::new(Mutex::new(Tally::default()));
    let mut ticks = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let end = Instant::now() + length;
    let mut tasks = tokio::task::JoinSet::new();
    while Instant::now() < end {
        ticks.tick().await;
        let (client, url, tally) = (client.clone(), url.clone(), tally.clone());
        tasks.spawn(async move {
            let outcome = one(client, url, key).await;
            tally.lock().expect("tally").outcomes.push(outcome);
        });
    }
    while tasks.join_next().await.is_some() {}
    let mut tally = tally.lock().expect("tally");
    Tally {
        outcomes: std::mem::take(&mut tally.outcomes),
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let at = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[at]
}

/// One line per tenant; returns A's (p99, refusals) when `who` is A.
fn report(phase: Phase, who: &str, tally: &Tally, length: Duration) -> (Duration, usize) {
    let mut latencies: Vec<Duration> = Vec::new();
    let mut refused: BTreeMap<(u16, bool), usize> = BTreeMap::new();
    let mut failed: BTreeMap<String, usize> = BTreeMap::new();
    for outcome in &tally.outcomes {
        match outcome {
            Outcome::Answered(d) => latencies.push(*d),
            Outcome::Refused {
                status,
                retry_after,
            } => *refused.entry((*status, *retry_after)).or_default() += 1,
            Outcome::Failed(why) => *failed.entry(why.clone()).or_default() += 1,
        }
    }
    latencies.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let refusals: usize = refused.values().sum();
    let refused_text: Vec<String> = refused
        .iter()
        .map(|((status, ra), n)| {
            let with = if *ra { "with" } else { "WITHOUT" };
            format!("{n}× {status} {with} Retry-After")
        })
        .collect();
    let lost: usize = failed.values().sum();
    println!(
        "[flood] {:<12} {who}: sent {}, answered {} ({:.1}/s), refused {refusals} [{}], lost {lost} {:?}; \
         latency p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        phase.name(),
        tally.outcomes.len(),
        latencies.len(),
        latencies.len() as f64 / length.as_secs_f64(),
        refused_text.join(", "),
        failed,
        ms(percentile(&latencies, 0.50)),
        ms(percentile(&latencies, 0.90)),
        ms(percentile(&latencies, 0.99)),
        ms(latencies.last().copied().unwrap_or_default()),
    );
    (percentile(&latencies, 0.99), refusals)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// Starts the demo for `phase` and waits until every simulated worker is discovered.
async fn start(phase: Phase) -> (Daemon, Simulation) {
    let simulation = Simulation::start(DemoOptions {
        publish_interval: Duration::from_millis(20),
        pace: Pace {
            prefill: Duration::from_millis(20),
            per_token: PER_TOKEN,
        },
        ..DemoOptions::default()
    })
    .await
    .expect("the simulation starts");
    let base = Config::demo_with_frontends(&simulation.frontend_addrs()).expect("demo config");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let daemon = Daemon::start_with_feed(
        RunOptions {
            config: config(base, phase),
            config_path: None,
            demo: true,
        },
        listener,
        simulation.feed(),
    )
    .await
    .expect("the router starts");
    let registry = daemon.registry();
    let mut generations = registry.subscribe();
    let all = simulation.fleet().workers().len();
    tokio::time::timeout(Duration::from_secs(30), async {
        while registry.snapshot().workers().len() < all {
            generations.changed().await.expect("registry");
        }
    })
    .await
    .expect("the fleet is discovered");
    (daemon, simulation)
}

/// The rates and the length of a phase.
#[derive(Clone, Copy)]
struct Load {
    a_rps: f64,
    b_rps: f64,
    length: Duration,
}

/// One phase: the router and the simulation on `fleet`, the tenants on `generator` (their own
/// thread, so the generator's work does not delay the router's tasks on a runtime they share).
/// Returns A's (p99, refusals).
fn phase(
    phase: Phase,
    load: Load,
    fleet: &tokio::runtime::Runtime,
    generator: &tokio::runtime::Runtime,
) -> (Duration, usize) {
    let (daemon, simulation) = fleet.block_on(start(phase));
    let url = format!("http://{}", daemon.local_addr());
    let result = generator.block_on(async {
        // A few requests first, so connections and samples are warm.
        for _ in 0..4 {
            let _ = one(reqwest::Client::new(), url.clone(), KEY_A).await;
        }
        let before = loadavg();
        let a = tokio::spawn(tenant(url.clone(), KEY_A, load.a_rps, load.length));
        let b = (phase != Phase::Solo)
            .then(|| tokio::spawn(tenant(url.clone(), KEY_B, load.b_rps, load.length)));
        let a = a.await.expect("tenant A");
        let result = report(phase, "A", &a, load.length);
        if let Some(b) = b {
            report(phase, "B", &b.await.expect("tenant B"), load.length);
        }
        print_metrics(phase, &url).await;
        println!(
            "[flood] {:<12} load average {before} -> {}",
            phase.name(),
            loadavg()
        );
        result
    });
    fleet.block_on(async {
        daemon.shutdown().await;
        simulation.shutdown();
    });
    result
}

/// The router's admission and rate-limit series after a phase (buckets left out).
async fn print_metrics(phase: Phase, url: &str) {
    let Ok(resp) = reqwest::get(format!("{url}/metrics")).await else {
        return;
    };
    let text = resp.text().await.unwrap_or_default();
    for line in text.lines().filter(|l| {
        (l.starts_with("continuum_admission_") || l.starts_with("continuum_rate_limited_total"))
            && !l.contains("_bucket")
            && !l.contains("queue_depth")
    }) {
        println!("[flood] {:<12} {line}", phase.name());
    }
}

fn runtime(name: &str, threads: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name(name)
        .enable_all()
        .build()
        .expect("runtime")
}

fn main() {
    let load = Load {
        length: Duration::from_secs_f64(env_f64("FLOOD_SECS", 30.0)),
        a_rps: env_f64("FLOOD_A_RPS", 8.0),
        b_rps: env_f64("FLOOD_B_RPS", 400.0),
    };
    let _ = rustls::crypto::ring::default_provider().install_default();
    let fleet = runtime("fleet", 2);
    let generator = runtime("generator", 1);
    println!(
        "[flood] capacity {:.0} requests/s (model {MODEL}: 2 ranks × {PER_RANK} requests × {} ms); \
         A {}/s, B {}/s ({:.1}× capacity), {:.0} s per phase",
        capacity(),
        (PER_TOKEN * u32::try_from(MAX_TOKENS).unwrap_or(u32::MAX)).as_millis(),
        load.a_rps,
        load.b_rps,
        load.b_rps / capacity(),
        load.length.as_secs_f64(),
    );
    let (solo, _) = phase(Phase::Solo, load, &fleet, &generator);
    phase(Phase::FairnessOff, load, &fleet, &generator);
    let (on, refused) = phase(Phase::FairnessOn, load, &fleet, &generator);
    let ratio = on.as_secs_f64() / solo.as_secs_f64().max(f64::MIN_POSITIVE);
    println!(
        "[flood] goal (fairness on): A's p99 {:.1} ms = {ratio:.2}× solo {:.1} ms (goal ≤ 1.5×: {}), \
         A refused {refused} (goal 0: {})",
        on.as_secs_f64() * 1e3,
        solo.as_secs_f64() * 1e3,
        if ratio <= 1.5 { "met" } else { "MISSED" },
        if refused == 0 { "met" } else { "MISSED" },
    );
}
