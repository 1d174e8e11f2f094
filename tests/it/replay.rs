//! `continuum-router replay`: a synthetic trace whose optimal placement is known gives the hit
//! rates derived below through the real pickers, index and load store; the binary writes
//! summary.json and the SVG plots; request logs are rendered and tokenized; router replicas
//! without shared ledgers herd onto one worker, with sharing they spread as one router does.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use continuum_replay::report::Summary;
use continuum_replay::{Policy, ReplayArgs, run};

/// Four disjoint prefix families of `FAMILY_IDS` Mooncake ids (512 tokens each); every request is
/// its family's prefix plus `UNIQUE_IDS` ids of its own. Request `r` belongs to family
/// `(r / 4) % 4`, and requests are 10 s apart, so each finishes (and its worker reports idle)
/// before the next arrives: no policy ever sees load.
const FAMILIES: u64 = 4;
const FAMILY_IDS: u64 = 4;
const UNIQUE_IDS: u64 = 2;
const REQUESTS: u64 = 64;
const OUTPUT: u64 = 10;

fn family_trace() -> String {
    let mut out = String::new();
    for r in 0..REQUESTS {
        let family = (r / 4) % FAMILIES;
        let ids: Vec<u64> = (0..FAMILY_IDS)
            .map(|k| 1_000 * (family + 1) + k)
            .chain((0..UNIQUE_IDS).map(|u| 100_000 + r * UNIQUE_IDS + u))
            .collect();
        let line = serde_json::json!({"timestamp": r * 10_000,
            "input_length": (FAMILY_IDS + UNIQUE_IDS) * 512, "output_length": OUTPUT,
            "hash_ids": ids});
        out.push_str(&line.to_string());
        out.push('\n');
    }
    out
}

fn args(trace: &Path, out: &Path, policies: &[Policy]) -> ReplayArgs {
    ReplayArgs {
        trace: trace.to_owned(),
        workers: 4,
        prefill_workers: 0,
        conditional_disagg: false,
        decode_busy_threshold: None,
        capacity: 100_000,
        policy: policies.to_vec(),
        speedup: 1.0,
        out: out.to_owned(),
        seed: 7,
        block_size: 16,
        overlap_score_weight: 1.0,
        prefill_load_scale: 1.0,
        temperature: 0.0,
        load_interval: std::time::Duration::from_millis(50),
        max_staleness: std::time::Duration::from_secs(3),
        prefill_overhead_ms: 5.0,
        prefill_ms_per_token: 0.1,
        decode_ms_per_token: 20.0,
        kv_transfer_ms_per_token: 0.01,
        replicas: 1,
        replica_spread: continuum_replay::sim::Spread::RoundRobin,
        load_lag: std::time::Duration::ZERO,
        replica_sharing: false,
        share_lag: std::time::Duration::from_millis(5),
        tie_break_window: 0.0,
        peer_slots: false,
        tokenizer: None,
        chat_template: None,
    }
}

fn policy<'a>(summary: &'a Summary, name: &str) -> &'a continuum_replay::report::PolicySummary {
    summary
        .policies
        .iter()
        .find(|p| p.policy == name)
        .unwrap_or_else(|| panic!("no {name} in the summary"))
}

#[test]
fn known_placement_gives_the_derived_hit_rates_and_latencies() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("families.jsonl");
    std::fs::write(&trace, family_trace()).unwrap();
    let summary = run(&args(
        &trace,
        &dir.path().join("out"),
        &[Policy::Kv, Policy::RoundRobin, Policy::Load],
    ))
    .unwrap();
    assert_eq!(summary.requests, REQUESTS as usize);

    // 32 blocks of 16 tokens per id. Each request: 32·F family blocks and 32·U unique ones.
    let family_blocks = 32 * FAMILY_IDS;
    let prompt_blocks = REQUESTS * 32 * (FAMILY_IDS + UNIQUE_IDS);
    // kv: only a family's first request misses its prefix (no worker holds it); every later one
    // goes to the worker that does. round_robin: 4 consecutive requests of a family land on 4
    // different workers, so each worker misses each family once: 16 misses. load: every worker
    // is idle at every pick, the costs tie and the cursor rotates, exactly as round_robin.
    let kv_hits = (REQUESTS - FAMILIES) * family_blocks;
    let rr_hits = (REQUESTS - FAMILIES * 4) * family_blocks;
    let kv = policy(&summary, "kv");
    let rr = policy(&summary, "round_robin");
    let load = policy(&summary, "load");
    assert_eq!(kv.prefix_hit_rate, kv_hits as f64 / prompt_blocks as f64);
    assert_eq!(kv.prefix_hit_rate, 0.625);
    assert_eq!(kv.cached_tokens, kv_hits * 16);
    assert_eq!(rr.prefix_hit_rate, rr_hits as f64 / prompt_blocks as f64);
    assert_eq!(rr.prefix_hit_rate, 0.5);
    assert_eq!(load.prefix_hit_rate, rr.prefix_hit_rate);

    // Latency model: a miss prefills 3072 tokens (5 + 307.2 ms), a hit the 1024 unique ones
    // (5 + 102.4 ms); nothing queues.
    let (miss, hit) = (312.2, 107.4);
    assert_eq!(kv.ttft_ms.p50, hit);
    assert_eq!(kv.ttft_ms.p99, miss);
    let mean =
        |misses: u64| (misses as f64 * miss + (REQUESTS - misses) as f64 * hit) / REQUESTS as f64;
    assert!(
        (kv.ttft_ms.mean - mean(FAMILIES)).abs() < 1e-9,
        "{}",
        kv.ttft_ms.mean
    );
    assert!(
        (rr.ttft_ms.mean - mean(16)).abs() < 1e-9,
        "{}",
        rr.ttft_ms.mean
    );
    assert_eq!(kv.e2e_ms.p50, hit + OUTPUT as f64 * 20.0);

    // Selection reasons as the daemon's metrics would count them.
    assert_eq!(kv.selections.get("decode/kv_aware"), Some(&REQUESTS));
    assert_eq!(kv.kv_results.get("overlap"), Some(&(REQUESTS - FAMILIES)));
    assert_eq!(kv.kv_results.get("no_overlap"), Some(&FAMILIES));
    assert_eq!(rr.selections.get("decode/round_robin"), Some(&REQUESTS));
    assert_eq!(load.selections.get("decode/load"), Some(&REQUESTS));
    assert_eq!(rr.requests_per_worker, vec![REQUESTS / 4; 4]);
    for p in [kv, rr, load] {
        assert_eq!(p.events_not_applied, 0, "{}", p.policy);
        assert_eq!(p.index_disagreements, 0, "{}", p.policy);
    }
}

#[test]
fn a_small_cache_evicts_the_families_and_kv_loses_its_edge() {
    // Capacity for one request's blocks (192) plus a little: each new request evicts what the
    // previous family left, so a family's prefix only survives on a worker that served it last.
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("families.jsonl");
    std::fs::write(&trace, family_trace()).unwrap();
    let mut small = args(
        &trace,
        &dir.path().join("out"),
        &[Policy::Kv, Policy::RoundRobin],
    );
    small.capacity = 200;
    let summary = run(&small).unwrap();
    let kv = policy(&summary, "kv");
    let rr = policy(&summary, "round_robin");
    // kv still finds the family on the worker that served its previous request (4 in a row),
    // unless another family evicted it in between, which needs a request on that worker.
    assert!(kv.prefix_hit_rate >= rr.prefix_hit_rate, "{kv:?} vs {rr:?}");
    // round_robin: each worker sees family f for one request in each run of 4, then other
    // families' blocks evict it: every request misses its prefix.
    assert_eq!(rr.prefix_hit_rate, 0.0);
    assert_eq!(kv.index_disagreements, 0);
    assert_eq!(kv.events_not_applied, 0);
}

// Disaggregated fleets. The family trace again (requests 10 s apart, so every worker is idle and
// reports so at every pick); a request is 192 blocks (3072 tokens): its family's 128 and 64 of its
// own. Latency model defaults: prefill 5 ms + 0.1 ms per uncached token, KV transfer 0.01 ms per
// token the decode worker does not hold.
const FAMILY_BLOCKS: u64 = 32 * FAMILY_IDS;
const REQUEST_BLOCKS: u64 = 32 * (FAMILY_IDS + UNIQUE_IDS);

#[test]
fn prefill_decode_pairs_prefill_where_the_prefix_is_and_transfer_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("families.jsonl");
    std::fs::write(&trace, family_trace()).unwrap();
    let mut pairs = args(
        &trace,
        &dir.path().join("out"),
        &[Policy::Kv, Policy::RoundRobin, Policy::Load],
    );
    pairs.workers = 2;
    pairs.prefill_workers = 4;
    let summary = run(&pairs).unwrap();
    assert_eq!(summary.prefill_workers, 4);
    let kv = policy(&summary, "kv");
    let rr = policy(&summary, "round_robin");
    let load = policy(&summary, "load");

    // The hit rate is the prefilling rank's: the prefill worker of each pair. kv scores the 4
    // prefill workers with the formula, so only a family's first request misses (as the
    // aggregated fleet of 4 does); round_robin rotates the prefill cursor over the 4, so each
    // prefill worker misses each family once; load sees every prefill worker idle and rotates too.
    let prompt_blocks = REQUESTS * REQUEST_BLOCKS;
    assert_eq!(
        kv.prefix_hit_rate,
        ((REQUESTS - FAMILIES) * FAMILY_BLOCKS) as f64 / prompt_blocks as f64
    );
    assert_eq!(
        rr.prefix_hit_rate,
        ((REQUESTS - 4 * FAMILIES) * FAMILY_BLOCKS) as f64 / prompt_blocks as f64
    );
    assert_eq!(load.prefix_hit_rate, rr.prefix_hit_rate);
    assert_eq!(kv.selections.get("prefill/kv_aware"), Some(&REQUESTS));
    assert_eq!(rr.selections.get("prefill/round_robin"), Some(&REQUESTS));
    assert_eq!(kv.kv_results.get("overlap"), Some(&(REQUESTS - FAMILIES)));
    assert_eq!(kv.bypasses, 0);

    // Decode is the load-only rule (no conditional disaggregation) over idle decode workers: it
    // alternates between the 2. In a family's first run of 4, each decode worker meets the family
    // once without holding it (all 3072 tokens move) and once holding its prefix (the 1024 unique
    // tokens move); every later request moves 1024 tokens.
    let transferred = 2 * FAMILIES * 3072 + (REQUESTS - 2 * FAMILIES) * 1024;
    for p in [kv, rr, load] {
        assert_eq!(p.transferred_tokens, transferred, "{}", p.policy);
        assert_eq!(p.events_not_applied, 0, "{}", p.policy);
        assert_eq!(p.index_disagreements, 0, "{}", p.policy);
    }
    // Decode workers first, then prefill workers; a request counts on both of its pair.
    assert_eq!(rr.requests_per_worker, vec![32, 32, 16, 16, 16, 16]);
    assert_eq!(kv.requests_per_worker[..2], [32, 32]);
    assert_eq!(kv.requests_per_worker[2..].iter().sum::<u64>(), REQUESTS);

    // kv's TTFT: a family's first request misses on the prefill worker and moves everything
    // (312.2 + 30.72 ms); the second hits (107.4 ms) and moves everything to the other decode
    // worker (30.72 ms); every other request hits and moves 1024 tokens (107.4 + 10.24 ms).
    assert_eq!(kv.ttft_ms.p50, 117.64);
    assert_eq!(kv.ttft_ms.p99, 342.92);
    let mean = (FAMILIES as f64 * 342.92
        + FAMILIES as f64 * 138.12
        + (REQUESTS - 2 * FAMILIES) as f64 * 117.64)
        / REQUESTS as f64;
    assert!((kv.ttft_ms.mean - mean).abs() < 1e-9, "{}", kv.ttft_ms.mean);
}

fn conditional(dir: &Path, threshold: Option<f64>) -> continuum_replay::report::Summary {
    let trace = dir.join("families.jsonl");
    std::fs::write(&trace, family_trace()).unwrap();
    let mut a = args(&trace, &dir.join("out"), &[Policy::Kv]);
    a.workers = 1;
    a.prefill_workers = 1;
    // Room for every block of the trace (4 · 128 + 64 · 64 = 4608): nothing is evicted.
    a.capacity = 6_400;
    a.conditional_disagg = true;
    a.decode_busy_threshold = threshold;
    run(&a).unwrap()
}

#[test]
fn decode_busy_threshold_decides_when_the_decode_worker_prefills_itself() {
    // One decode and one prefill worker, conditional disaggregation on. A family's first request
    // finds its prefix nowhere: the prefill worker prefills, the decode worker receives all of it.
    // Every later request of the family finds the prefix on both (128 blocks each), so the decode
    // worker qualifies to prefill locally; with a threshold it also needs its projected decode
    // blocks — idle (0) + the request's blocks it lacks (192 - 128 = 64) — at or below
    // threshold × 6400 total_kv_blocks: 0.01 allows 64, 0.005 (32) does not.
    let later = REQUESTS - FAMILIES;
    let dir = tempfile::tempdir().unwrap();
    for threshold in [None, Some(0.01)] {
        let summary = conditional(dir.path(), threshold);
        let kv = policy(&summary, "kv");
        assert_eq!(kv.bypasses, later, "{threshold:?}");
        assert_eq!(kv.kv_results.get("bypass"), Some(&later));
        assert_eq!(kv.kv_results.get("no_overlap"), Some(&FAMILIES));
        assert_eq!(
            kv.selections.get("prefill/conditional_bypass"),
            Some(&later)
        );
        assert_eq!(kv.selections.get("decode/kv_aware"), Some(&REQUESTS));
        // The prefill worker sees only the families' first requests.
        assert_eq!(kv.requests_per_worker, vec![REQUESTS, FAMILIES]);
        // Only the first requests move KV (3072 tokens each); a bypass prefills the 1024 unique
        // tokens on the decode worker: 107.4 ms, no transfer.
        assert_eq!(kv.transferred_tokens, FAMILIES * 3072);
        assert_eq!(kv.ttft_ms.p50, 107.4);
        assert_eq!(kv.prefix_hit_rate, 0.625);
    }
    let busy = conditional(dir.path(), Some(0.005));
    let kv = policy(&busy, "kv");
    assert_eq!(kv.bypasses, 0);
    assert_eq!(kv.kv_results.get("bypass"), None);
    assert_eq!(kv.kv_results.get("overlap"), Some(&later));
    assert_eq!(kv.requests_per_worker, vec![REQUESTS, REQUESTS]);
    // Every later request is prefilled remotely (a hit, 107.4 ms) and its 1024 unique tokens move
    // (10.24 ms); the hit rate is the same, the latency and the transfers are not.
    assert_eq!(kv.transferred_tokens, FAMILIES * 3072 + later * 1024);
    assert_eq!(kv.ttft_ms.p50, 117.64);
    assert_eq!(kv.prefix_hit_rate, 0.625);
}

#[test]
fn disaggregation_flags_are_validated() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("families.jsonl");
    std::fs::write(&trace, family_trace()).unwrap();
    let base = args(&trace, &dir.path().join("out"), &[Policy::Kv]);
    let mut no_pairs = base.clone();
    no_pairs.conditional_disagg = true;
    let error = run(&no_pairs).unwrap_err().to_string();
    assert!(error.contains("needs --prefill-workers"), "{error}");
    let mut no_flag = base.clone();
    no_flag.prefill_workers = 1;
    no_flag.decode_busy_threshold = Some(0.5);
    let error = run(&no_flag).unwrap_err().to_string();
    assert!(error.contains("needs --conditional-disagg"), "{error}");
    let mut out_of_range = no_flag.clone();
    out_of_range.conditional_disagg = true;
    out_of_range.decode_busy_threshold = Some(1.5);
    let error = run(&out_of_range).unwrap_err().to_string();
    assert!(error.contains("0.0..=1.0"), "{error}");
    let mut too_many = base;
    too_many.prefill_workers = 4093;
    let error = run(&too_many).unwrap_err().to_string();
    assert!(error.contains("at most 4096"), "{error}");
}

fn gzip(path: &Path, text: &str) {
    let file = std::fs::File::create(path).unwrap();
    let mut gz = flate2::write::GzEncoder::new(file, flate2::Compression::fast());
    gz.write_all(text.as_bytes()).unwrap();
    gz.finish().unwrap();
}

#[test]
fn the_binary_writes_summary_plots_and_a_table() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("families.jsonl.gz");
    gzip(&trace, &(family_trace() + "not json\n"));
    let out: PathBuf = dir.path().join("report");
    let output = Command::new(env!("CARGO_BIN_EXE_continuum-router"))
        .arg("replay")
        .args(["--trace".as_ref(), trace.as_os_str()])
        .args(["--workers", "4", "--capacity", "100000"])
        .args(["--policy", "load,kv,round_robin", "--seed", "3"])
        .args(["--out".as_ref(), out.as_os_str()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    for row in ["policy", "load ", "kv ", "round_robin ", "62.5%", "50.0%"] {
        assert!(stdout.contains(row), "{row} missing from:\n{stdout}");
    }
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["requests"], 64);
    assert_eq!(summary["skipped_lines"], 1);
    let names: Vec<&str> = summary["policies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["policy"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["load", "kv", "round_robin"]);
    for plot in ["hit_rate.svg", "ttft_cdf.svg", "worker_load.svg"] {
        let svg = std::fs::read_to_string(out.join(plot)).unwrap();
        assert!(svg.starts_with("<svg"), "{plot}");
        assert!(svg.contains("<polyline"), "{plot} draws no line");
    }
    let legend = std::fs::read_to_string(out.join("hit_rate.svg")).unwrap();
    assert!(legend.contains("round_robin"));

    // A bad policy name is refused before anything runs.
    let refused = Command::new(env!("CARGO_BIN_EXE_continuum-router"))
        .arg("replay")
        .args(["--trace".as_ref(), trace.as_os_str()])
        .args(["--workers", "4", "--capacity", "10", "--policy", "random"])
        .args(["--out".as_ref(), out.as_os_str()])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("unknown policy"));

    // A disaggregated fleet from the command line.
    let pairs = Command::new(env!("CARGO_BIN_EXE_continuum-router"))
        .arg("replay")
        .args(["--trace".as_ref(), trace.as_os_str()])
        .args([
            "--workers",
            "1",
            "--prefill-workers",
            "1",
            "--capacity",
            "6400",
        ])
        .args(["--policy", "kv", "--conditional-disagg"])
        .args(["--decode-busy-threshold", "0.01"])
        .args(["--out".as_ref(), out.as_os_str()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&pairs.stdout);
    assert!(pairs.status.success(), "{stdout}");
    assert!(stdout.contains("1 workers + 1 prefill workers"), "{stdout}");
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["prefill_workers"], 1);
    assert_eq!(summary["kv"]["decode_busy_threshold"], 0.01);
    assert_eq!(summary["policies"][0]["bypasses"], 60);
}

fn model_file(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models/TinyLlama_v1.1")
        .join(name)
}

#[test]
fn request_logs_are_rendered_tokenized_and_share_conversation_prefixes() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("log.jsonl");
    let system = "You are a careful assistant for the continuum router team. ".repeat(30);
    let mut lines = String::new();
    // Two conversations of three turns each, interleaved; each turn resends the history.
    for turn in 0..3u64 {
        for conv in 0..2u64 {
            let mut messages = vec![serde_json::json!({"role": "system",
                "content": format!("{conv}: {system}")})];
            for t in 0..=turn {
                messages.push(serde_json::json!({"role": "user",
                    "content": format!("question {t} of conversation {conv}, please explain")}));
                if t < turn {
                    messages.push(serde_json::json!({"role": "assistant",
                        "content": format!("answer {t} of conversation {conv}")}));
                }
            }
            let line = serde_json::json!({"timestamp": (turn * 2 + conv) * 5_000,
                "messages": messages, "output_length": 20});
            lines.push_str(&line.to_string());
            lines.push('\n');
        }
    }
    std::fs::write(&trace, lines).unwrap();
    let mut with_files = args(&trace, &dir.path().join("out"), &[Policy::Kv]);
    with_files.workers = 2;
    with_files.tokenizer = Some(model_file("tokenizer.json"));
    with_files.chat_template = Some(model_file("tokenizer_config.json"));
    let summary = run(&with_files).unwrap();
    assert_eq!(summary.requests, 6);
    assert_eq!(summary.skipped_lines, 0);
    let kv = policy(&summary, "kv");
    // Turns 2 and 3 of each conversation find the earlier turns' blocks on the same worker.
    assert_eq!(kv.kv_results.get("overlap"), Some(&4));
    assert!(kv.cached_token_share > 0.5, "{kv:?}");
    assert_eq!(kv.index_disagreements, 0);

    // Without a tokenizer the lines are skipped and the replay refuses an empty trace.
    let mut without = args(&trace, &dir.path().join("out2"), &[Policy::Kv]);
    without.workers = 2;
    let error = run(&without).unwrap_err().to_string();
    assert!(error.contains("needs --tokenizer"), "{error}");
}

/// `REPLICAS` requests at the same instant, none finishing during the trace: one router's ledger
/// spreads them one per worker; replicas without sharing each see an idle fleet and pick the same
/// worker; with sharing (no lag) each sees its peers' dispatches and they spread again.
#[test]
fn replicas_herd_without_sharing_and_spread_with_it() {
    const REPLICAS: u32 = 4;
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("burst.jsonl");
    let lines: Vec<String> = (0..u64::from(REPLICAS))
        .map(|r| {
            serde_json::json!({"timestamp": 0, "input_length": 1024, "output_length": 500,
                "hash_ids": [10 * r, 10 * r + 1]})
            .to_string()
        })
        .collect();
    std::fs::write(&trace, lines.join("\n") + "\n").unwrap();
    let replay = |replicas: u32, sharing: bool, name: &str| {
        let mut a = args(&trace, &dir.path().join(name), &[Policy::Load]);
        a.replicas = replicas;
        a.replica_sharing = sharing;
        a.share_lag = std::time::Duration::ZERO;
        run(&a).unwrap()
    };
    let one = replay(1, false, "one");
    let herd = replay(REPLICAS, false, "herd");
    let shared = replay(REPLICAS, true, "shared");
    assert_eq!(policy(&one, "load").requests_per_worker, [1, 1, 1, 1]);
    assert_eq!(policy(&herd, "load").requests_per_worker, [4, 0, 0, 0]);
    assert_eq!(policy(&shared, "load").requests_per_worker, [1, 1, 1, 1]);
    // The new fields: the replica settings and the load spread.
    assert_eq!(herd.replicas.count, REPLICAS);
    assert!(!herd.replicas.sharing && shared.replicas.sharing);
    // Seen by arrivals 2-4: all on one of four is a CV of sqrt(3) each time; spread, it falls.
    let cv = |s: &Summary| policy(s, "load").load_cv;
    assert!((cv(&herd) - 3f64.sqrt()).abs() < 1e-9, "{}", cv(&herd));
    assert!(
        cv(&one) < 1.2 && cv(&shared) < 1.2,
        "{} {}",
        cv(&one),
        cv(&shared)
    );
    assert!(policy(&herd, "load").ttft_ms.p99 > policy(&shared, "load").ttft_ms.p99);
}

/// The herd of `replicas_herd_without_sharing_and_spread_with_it` at eight replicas on eight
/// workers, without sharing: each replica's seeded tie-break draws among the tied idle workers,
/// so they spread (not all on one worker, as without it), under both pickers; a seed replays.
#[test]
fn the_tie_break_spreads_replicas_that_share_nothing() {
    const REPLICAS: u32 = 8;
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("burst.jsonl");
    let lines: Vec<String> = (0..u64::from(REPLICAS))
        .map(|r| {
            serde_json::json!({"timestamp": 0, "input_length": 1024, "output_length": 500,
                "hash_ids": [10 * r, 10 * r + 1]})
            .to_string()
        })
        .collect();
    std::fs::write(&trace, lines.join("\n") + "\n").unwrap();
    let replay = |window: f64, name: &str| {
        let mut a = args(&trace, &dir.path().join(name), &[Policy::Load, Policy::Kv]);
        a.workers = REPLICAS;
        a.replicas = REPLICAS;
        a.tie_break_window = window;
        run(&a).unwrap()
    };
    let herd = replay(0.0, "herd");
    let spread = replay(2.0, "spread");
    assert_eq!(spread.replicas.tie_break_window, 2.0);
    for name in ["load", "kv"] {
        let herd = &policy(&herd, name).requests_per_worker;
        assert_eq!(
            herd.iter().max(),
            Some(&u64::from(REPLICAS)),
            "{name}: {herd:?}"
        );
        let per = &policy(&spread, name).requests_per_worker;
        assert_eq!(per.iter().sum::<u64>(), u64::from(REPLICAS));
        let used = per.iter().filter(|&&n| n > 0).count();
        assert!(used >= 4, "{name}: {per:?}");
    }
    let again = replay(2.0, "again");
    assert_eq!(
        policy(&again, "kv").requests_per_worker,
        policy(&spread, "kv").requests_per_worker
    );
}

/// `--peer-slots` (`dynamo.load.peer_slots`): a burst of sixteen requests on eight idle workers
/// reaches four replicas in turns, and sharing is too slow to help (a 1 s share lag). Knowing
/// their places, the replicas take distinct slots of the tie set and count their peers' slots,
/// so every worker gets exactly two, as one router spreads them; the seeded draw alone collides.
/// Without sharing the place is unknown: each replica decides as without the tie-break, and the
/// herd is back.
#[test]
fn peer_slots_spread_a_burst_as_one_router() {
    const REQUESTS: u64 = 16;
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("burst.jsonl");
    let lines: Vec<String> = (0..REQUESTS)
        .map(|r| {
            serde_json::json!({"timestamp": 0, "input_length": 1024, "output_length": 500,
                "hash_ids": [10 * r, 10 * r + 1]})
            .to_string()
        })
        .collect();
    std::fs::write(&trace, lines.join("\n") + "\n").unwrap();
    let replay = |sharing: bool, peer_slots: bool, name: &str| {
        let mut a = args(&trace, &dir.path().join(name), &[Policy::Load, Policy::Kv]);
        a.workers = 8;
        a.replicas = 4;
        a.replica_sharing = sharing;
        a.share_lag = std::time::Duration::from_secs(1);
        a.tie_break_window = 2.0;
        a.peer_slots = peer_slots;
        run(&a).unwrap()
    };
    let slots = replay(true, true, "slots");
    let drawn = replay(true, false, "drawn");
    let unknown = replay(false, true, "unknown");
    assert!(slots.replicas.peer_slots && !drawn.replicas.peer_slots);
    for name in ["load", "kv"] {
        assert_eq!(policy(&slots, name).requests_per_worker, [2; 8], "{name}");
        let drawn = &policy(&drawn, name).requests_per_worker;
        assert!(drawn.iter().max() > Some(&2), "{name}: {drawn:?}");
        // The four replicas make the same four picks: every worker takes 0 or 4 of them.
        let herd = &policy(&unknown, name).requests_per_worker;
        assert!(herd.iter().all(|n| n % 4 == 0), "{name}: {herd:?}");
    }
}

/// One replica is the replay as it was: spreading and sharing change nothing, on the families
/// trace under every policy.
#[test]
fn one_replica_replays_exactly_as_before() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("families.jsonl");
    std::fs::write(&trace, family_trace()).unwrap();
    let all = [Policy::Load, Policy::Kv, Policy::RoundRobin];
    let plain = run(&args(&trace, &dir.path().join("plain"), &all)).unwrap();
    let mut a = args(&trace, &dir.path().join("spread"), &all);
    a.replica_spread = continuum_replay::sim::Spread::Random;
    a.replica_sharing = true;
    let spread = run(&a).unwrap();
    let json = |s: &Summary| serde_json::to_string(&s.policies).unwrap();
    assert_eq!(json(&plain), json(&spread));
}

#[test]
fn the_binary_runs_two_replicas_and_reports_them() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("families.jsonl");
    std::fs::write(&trace, family_trace()).unwrap();
    let out: PathBuf = dir.path().join("report");
    let output = Command::new(env!("CARGO_BIN_EXE_continuum-router"))
        .arg("replay")
        .args(["--trace".as_ref(), trace.as_os_str()])
        .args(["--workers", "4", "--capacity", "100000", "--policy", "kv"])
        .args(["--replicas", "2", "--replica-spread", "random"])
        .args([
            "--load-lag",
            "2ms",
            "--replica-sharing",
            "--share-lag",
            "3ms",
        ])
        .args(["--out".as_ref(), out.as_os_str()])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    let replicas = &summary["replicas"];
    assert_eq!(replicas["count"], 2);
    assert_eq!(replicas["spread"], "random");
    assert_eq!(replicas["load_lag_ms"], 2.0);
    assert_eq!(replicas["sharing"], true);
    assert_eq!(replicas["share_lag_ms"], 3.0);
    let kv = &summary["policies"][0];
    assert_eq!(kv["requests"], 64);
    assert!(kv["load_cv"].is_number());
    assert!(kv["ttft_ms"]["p99"].is_number() && kv["prefix_hit_rate"].is_number());

    let refused = Command::new(env!("CARGO_BIN_EXE_continuum-router"))
        .arg("replay")
        .args(["--trace".as_ref(), trace.as_os_str()])
        .args(["--workers", "4", "--capacity", "10", "--replicas", "0"])
        .args(["--out".as_ref(), out.as_os_str()])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--replicas"));
}
