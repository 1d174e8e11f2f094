//! `continuum-router demo` end to end, in process: the simulated fleet registers through the
//! in-memory discovery feed, its ZMQ PUB sockets are dialled by the router's own subscription
//! actors, and every request goes through the real shim path to a simulated direct-mode frontend
//! that answers as Dynamo 1.6.1 does. Waits are on registry generations and load-store changes,
//! each under a deadline; nothing sleeps.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use continuum_demo::DemoOptions;
use continuum_demo::shim::{Pace, Route, ServedRequest};
use continuum_protocol::discovery::registration::WorkerType;
use continuum_protocol::ids::{DpRank, InstanceId};
use futures::future::join_all;
use serde_json::{Value, json};
use support::demo::Demo;
use tokio::net::TcpListener;

const DEADLINE: Duration = Duration::from_secs(30);
const BUFFERED: usize = 50;
const STREAMING: usize = 10;

pub(crate) async fn start_demo() -> Demo {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    Demo::start(
        DemoOptions {
            publish_interval: Duration::from_millis(50),
            pace: Pace {
                prefill: Duration::from_millis(5),
                per_token: Duration::from_millis(10),
            },
            ..DemoOptions::default()
        },
        listener,
    )
    .await
    .expect("the demo starts")
}

/// Waits (on registry generations) until all six workers are discovered, then (on load-store
/// changes) until every kv_metrics subscription is connected and every rank has a sample.
pub(crate) async fn wait_until_routable(demo: &Demo) {
    let daemon = demo.daemon();
    let registry = daemon.registry();
    let mut generations = registry.subscribe();
    tokio::time::timeout(DEADLINE, async {
        while registry.snapshot().workers().len() < demo.fleet().workers().len() {
            generations.changed().await.expect("registry alive");
        }
    })
    .await
    .expect("the simulated fleet is discovered");
    let ranks: usize = demo
        .fleet()
        .workers()
        .iter()
        .map(|w| w.spec.data_parallel_size as usize)
        .sum();
    let load = daemon.load_store();
    let mut changes = load.subscribe();
    tokio::time::timeout(DEADLINE, async {
        loop {
            let subs = load.subscriptions();
            let connected = subs.iter().filter(|s| s.state == "connected").count();
            if connected == demo.fleet().workers().len() && load.len() == ranks {
                return;
            }
            changes.changed().await.expect("load store alive");
        }
    })
    .await
    .expect("every publisher is subscribed over ZMTP and every rank has a sample");
}

fn chat(model: &str, stream: bool, i: usize) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": format!("request {i}: {}", "tell me about routers ".repeat(i % 7 + 1))}],
        "max_tokens": 4 + (i % 5),
        "stream": stream,
    })
}

/// One request through the router; returns the response ids it carried.
async fn send(client: &reqwest::Client, url: &str, path: &str, body: Value) -> Vec<String> {
    let stream = body["stream"].as_bool().unwrap_or(false);
    let resp = client
        .post(format!("{url}{path}"))
        .json(&body)
        .send()
        .await
        .expect("the router answers");
    assert_eq!(resp.status(), 200, "{body}");
    let text = resp.text().await.expect("a body");
    if !stream {
        let value: Value = serde_json::from_str(&text).expect("JSON");
        return vec![value["id"].as_str().expect("an id").to_owned()];
    }
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    let ids: BTreeSet<String> = text
        .split("\n\n")
        .filter_map(|event| event.strip_prefix("data: "))
        .filter(|data| *data != "[DONE]")
        .map(|data| {
            let chunk: Value = serde_json::from_str(data).expect("a JSON chunk");
            chunk["id"].as_str().expect("an id").to_owned()
        })
        .collect();
    ids.into_iter().collect()
}

fn metric(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter(|l| labels.iter().all(|label| l.contains(label)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_routes_by_load_through_the_simulated_fleet() {
    let demo = start_demo().await;
    wait_until_routable(&demo).await;
    // Every simulated PUB socket has a subscriber that completed the ZMTP handshake and
    // subscribed: the router's own SUB client.
    for worker in demo.fleet().workers() {
        assert!(*worker.subscribed().borrow() >= 1, "{worker:?}");
    }

    let url = demo.url();
    let client = reqwest::Client::new();
    let mut requests = Vec::new();
    for i in 0..BUFFERED {
        let (path, body) = match i % 5 {
            0 | 1 => ("/v1/chat/completions", chat("demo-disagg", false, i)),
            2 => (
                "/v1/completions",
                json!({"model": "demo-disagg", "prompt": format!("complete {i}"), "max_tokens": 3}),
            ),
            _ => ("/v1/chat/completions", chat("demo-agg", false, i)),
        };
        requests.push((path, body));
    }
    for i in 0..STREAMING {
        let model = if i % 2 == 0 {
            "demo-disagg"
        } else {
            "demo-agg"
        };
        requests.push(("/v1/chat/completions", chat(model, true, i)));
    }
    let answers = join_all(
        requests
            .iter()
            .map(|(path, body)| send(&client, &url, path, body.clone())),
    )
    .await;

    // Every answer came from a simulated frontend, which recorded the pins it served.
    let served: BTreeMap<String, ServedRequest> = demo
        .served()
        .into_iter()
        .filter(|s| s.status == 200)
        .map(|s| (s.response_id.clone(), s))
        .collect();
    assert_eq!(served.len(), BUFFERED + STREAMING);
    let kind = |id: InstanceId| {
        demo.fleet()
            .worker(id)
            .map(|w| (w.spec.namespace.clone(), w.worker_type()))
    };
    let mut prefill_workers = BTreeSet::new();
    let mut decode_ranks: BTreeSet<(InstanceId, DpRank)> = BTreeSet::new();
    let mut agg_workers = BTreeSet::new();
    for ((_, body), ids) in requests.iter().zip(&answers) {
        assert_eq!(ids.len(), 1, "one response id per request");
        let record = served.get(&ids[0]).expect("the frontend served it");
        assert_eq!(record.stream, body["stream"].as_bool().unwrap_or(false));
        let (decode, rank) = record.decode.expect("a decode pin");
        if body["model"] == "demo-disagg" {
            assert_eq!(record.namespace, "demo");
            let (prefill, _) = record.prefill.expect("a prefill pin");
            assert_eq!(kind(prefill), Some(("demo".into(), WorkerType::Prefill)));
            assert_eq!(kind(decode), Some(("demo".into(), WorkerType::Decode)));
            prefill_workers.insert(prefill);
            decode_ranks.insert((decode, rank));
        } else {
            assert_eq!(record.namespace, "demo-agg");
            assert_eq!(record.prefill, None);
            assert_eq!(
                kind(decode),
                Some(("demo-agg".into(), WorkerType::Aggregated))
            );
            agg_workers.insert(decode);
        }
    }
    assert!(served.values().any(|s| s.route == Route::Completions));
    assert_eq!(prefill_workers.len(), 2, "both prefill workers served");
    assert_eq!(agg_workers.len(), 2, "both aggregated workers served");
    assert!(
        decode_ranks.len() >= 2,
        "decode work spread over ranks: {decode_ranks:?}"
    );

    // The picker chose by load (fresh samples), and says so in its metrics.
    let metrics = reqwest::get(format!("{url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let name = "continuum_dynamo_selection_total";
    assert!(metric(&metrics, name, &[r#"role="decode""#, r#"reason="load""#]) >= 1.0);
    assert!(metric(&metrics, name, &[r#"role="prefill""#, r#"reason="load""#]) >= 1.0);
    assert!(
        metric(
            &metrics,
            name,
            &[r#"role="prefill""#, r#"reason="no_prefill_pool""#]
        ) >= 1.0,
        "aggregated picks count under no_prefill_pool"
    );
    assert!(
        metric(
            &metrics,
            "continuum_dynamo_load_events_total",
            &[r#"result="applied""#]
        ) >= 1.0
    );

    // The admin view shows the fleet, connected subscriptions and the load samples.
    let view: Value = client
        .get(format!("{url}/admin/dynamo/workers"))
        .bearer_auth("demo-admin-token")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        view["source"], "simulated",
        "the admin label matches /admin/subsystems"
    );
    assert_eq!(view["workers"].as_array().unwrap().len(), 6);
    assert_eq!(view["load_publishers"], 6);
    assert!(
        view["subscriptions"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["state"] == "connected" && s["transport"] == "direct")
    );
    assert_eq!(view["load"].as_array().unwrap().len(), 7);
    demo.shutdown().await;
}

/// A request in flight raises its pinned worker's published load, as the router sees it, and
/// the load falls back when the request ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_rises_and_falls_with_a_request_in_flight() {
    use futures::StreamExt;

    let demo = start_demo().await;
    wait_until_routable(&demo).await;
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", demo.url()))
        .json(&json!({
            "model": "demo-agg",
            "messages": [{"role": "user", "content": "a long answer please"}],
            "max_tokens": 64,
            "stream": true,
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.bytes_stream();
    let first = body.next().await.expect("a first chunk").unwrap();
    let first = String::from_utf8_lossy(&first).into_owned();
    let chunk: Value = serde_json::from_str(
        first
            .strip_prefix("data: ")
            .and_then(|d| d.split("\n\n").next())
            .expect("an SSE event"),
    )
    .unwrap();
    let id = chunk["id"].as_str().unwrap().to_owned();
    let record = demo
        .served()
        .into_iter()
        .find(|s| s.response_id == id)
        .expect("the frontend recorded the request");
    let (worker, rank) = record.decode.expect("a pinned worker");
    let load = demo.daemon().load_store();
    let blocks = |load: &continuum_actors::load::SharedLoadStore| {
        load.latest(worker, rank)
            .and_then(|s| s.load.active_decode_blocks)
            .unwrap_or(0)
    };
    let mut changes = load.subscribe();
    tokio::time::timeout(DEADLINE, async {
        while blocks(load) == 0 {
            changes.changed().await.unwrap();
        }
    })
    .await
    .expect("the router sees the booked blocks");
    while let Some(chunk) = body.next().await {
        chunk.unwrap();
    }
    tokio::time::timeout(DEADLINE, async {
        while blocks(load) != 0 {
            changes.changed().await.unwrap();
        }
    })
    .await
    .expect("the load falls back to zero once the request ended");
    demo.shutdown().await;
}

/// The simulated frontend answers pins (and their absence) as Dynamo 1.6.1's direct mode does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_simulated_frontend_refuses_like_1_6_1() {
    let demo = start_demo().await;
    let client = reqwest::Client::new();
    let disagg = format!(
        "http://{}/v1/chat/completions",
        demo.frontend("demo").unwrap().local_addr()
    );
    let agg = format!(
        "http://{}/v1/chat/completions",
        demo.frontend("demo-agg").unwrap().local_addr()
    );
    let of = |ns: &str, t: WorkerType| {
        demo.fleet()
            .in_namespace(ns)
            .find(|w| w.worker_type() == t)
            .unwrap()
            .instance_id
            .0
    };
    let (prefill, decode, aggregated) = (
        of("demo", WorkerType::Prefill),
        of("demo", WorkerType::Decode),
        of("demo-agg", WorkerType::Aggregated),
    );
    let status = |url: String, model: &str, headers: Vec<(&'static str, String)>| {
        let mut req = client.post(url).json(&chat(model, false, 1));
        for (name, value) in headers {
            req = req.header(name, value);
        }
        async move { req.send().await.unwrap().status().as_u16() }
    };
    let w = "x-dynamo-worker-instance-id";
    let p = "x-dynamo-prefill-instance-id";
    assert_eq!(status(disagg.clone(), "demo-disagg", vec![]).await, 500);
    assert_eq!(
        status(disagg.clone(), "demo-disagg", vec![(w, decode.to_string())]).await,
        500
    );
    assert_eq!(
        status(
            disagg.clone(),
            "demo-disagg",
            vec![(p, prefill.to_string())]
        )
        .await,
        400
    );
    assert_eq!(
        status(
            disagg.clone(),
            "demo-disagg",
            vec![(w, format!("{decode:x}")), (p, format!("{prefill:x}"))]
        )
        .await,
        500,
        "hex ids count as absent"
    );
    assert_eq!(
        status(
            disagg.clone(),
            "demo-disagg",
            vec![(w, "12345".into()), (p, prefill.to_string())]
        )
        .await,
        400
    );
    assert_eq!(
        status(
            disagg.clone(),
            "demo-disagg",
            vec![(w, prefill.to_string()), (p, decode.to_string())]
        )
        .await,
        400,
        "swapped ids"
    );
    assert_eq!(
        status(
            disagg.clone(),
            "demo-disagg",
            vec![(w, format!(" {decode} ")), (p, prefill.to_string())]
        )
        .await,
        200
    );
    assert_eq!(status(disagg.clone(), "other-model", vec![]).await, 404);
    assert_eq!(status(agg.clone(), "demo-agg", vec![]).await, 400);
    assert_eq!(
        status(
            agg.clone(),
            "demo-agg",
            vec![(w, aggregated.to_string()), (p, prefill.to_string())]
        )
        .await,
        200,
        "the prefill header is ignored without prefill workers"
    );
    let refused: Vec<_> = demo
        .served()
        .into_iter()
        .filter(|s| s.status != 200)
        .collect();
    assert_eq!(refused.len(), 7);
    demo.shutdown().await;
}

/// A real libzmq SUB (pyzmq) subscribes to a simulated worker's PUB socket and receives its
/// kv_metrics message frame for frame.
#[cfg(feature = "real-peers")]
#[tokio::test]
async fn a_pyzmq_sub_receives_the_simulated_publishers_messages() {
    use continuum_demo::zmq_pub::PubSocket;
    use continuum_protocol::event_plane::ActiveLoad;
    use continuum_protocol::event_plane::encode::encode_kv_metrics;
    use continuum_protocol::ids::PublisherId;
    use continuum_protocol::time::UnixMillis;
    use tokio::io::{AsyncBufReadExt, BufReader};

    const SUB: &str = "import sys, zmq\n\
        ctx = zmq.Context()\n\
        s = ctx.socket(zmq.SUB)\n\
        s.setsockopt(zmq.SUBSCRIBE, b'kv_metrics')\n\
        s.setsockopt(zmq.RCVTIMEO, 20000)\n\
        s.connect(sys.argv[1])\n\
        print(' '.join(f.hex() for f in s.recv_multipart()), flush=True)\n";
    let socket = PubSocket::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let python = std::env::var("CONTINUUM_PYTHON").unwrap_or_else(|_| "python3".into());
    let mut child = tokio::process::Command::new(&python)
        .arg("-c")
        .arg(SUB)
        .arg(format!("tcp://{}", socket.local_addr()))
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start python (set CONTINUUM_PYTHON to an interpreter with pyzmq)");
    let mut subscribed = socket.subscribed();
    tokio::time::timeout(DEADLINE, subscribed.wait_for(|n| *n == 1))
        .await
        .expect("pyzmq subscribes within the deadline")
        .unwrap();
    let load = ActiveLoad {
        worker_id: InstanceId(7_668_682_573_600_862_486),
        dp_rank: DpRank(0),
        active_decode_blocks: Some(5),
        active_prefill_tokens: Some(120),
        kv_used_blocks: Some(5),
    };
    let frames = encode_kv_metrics(PublisherId(42), 3, UnixMillis(1_796_028_060_991), &load);
    socket.send(&frames);
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(DEADLINE, lines.next_line())
        .await
        .expect("pyzmq receives within the deadline")
        .unwrap()
        .expect("a line");
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let expected: Vec<String> = frames.iter().map(|f| hex(f)).collect();
    assert_eq!(line.split(' ').collect::<Vec<_>>(), expected);
}
