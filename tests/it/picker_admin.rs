//! The PickerActor through the daemon's admin surface: it is a subsystem under root, an operator
//! can restart it, and the installed picker survives the restart. No real peers: Dynamo
//! discovery is off, the picker still runs (the shim path is installed regardless).

use crate::support;

use std::sync::Arc;

use continuum_protocol::picker::{DynamoWorkerPicker, NoCandidates, PickContext, PickOutcome};
use serde_json::Value;

const TOKEN: &str = "picker-admin-token";

/// A picker that only names itself, standing in for the KV-aware one.
struct Named;

impl DynamoWorkerPicker for Named {
    fn name(&self) -> &'static str {
        "named"
    }

    fn pick(&self, _ctx: &mut PickContext<'_>) -> PickOutcome {
        PickOutcome::NoCandidates(NoCandidates::NoWorkerForModel)
    }
}

async fn admin(client: &reqwest::Client, method: reqwest::Method, url: String) -> (u16, Value) {
    let resp = client
        .request(method, url)
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("admin request");
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn the_picker_is_a_restartable_subsystem_that_keeps_its_state() {
    let yaml = format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\ndynamo:\n  enabled: false\n\
         admin:\n  enabled: true\n  token: \"{TOKEN}\"\n"
    );
    let daemon = support::daemon::start(&yaml).await;
    let base = format!("http://{}", daemon.local_addr());
    let client = reqwest::Client::new();
    daemon.shim().expect("shim").set_picker(Arc::new(Named));

    let (status, body) = admin(
        &client,
        reqwest::Method::GET,
        format!("{base}/admin/subsystems"),
    )
    .await;
    assert_eq!(status, 200);
    let row = body["subsystems"]
        .as_array()
        .expect("rows")
        .iter()
        .find(|r| r["id"] == "root/picker")
        .cloned()
        .expect("root/picker is listed");
    assert_eq!(row["kind"], "picker");
    assert_eq!(row["restarts"], 0);

    let (status, body) = admin(
        &client,
        reqwest::Method::POST,
        format!("{base}/admin/subsystems/root/picker/restart"),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["subsystem"]["restarts"], 1);
    assert_eq!(daemon.tree().get("root/registry").expect("row").restarts, 0);
    assert_eq!(daemon.picker().picker().name(), "named");
    assert_eq!(daemon.picker().status().name, "named");

    daemon.shutdown().await;
}

/// 200 parallel operator restarts of one subsystem over real sockets: every caller gets the
/// outcome of the restart it joined (before the fix the supervisor kept only the last caller's
/// reply port, so the others answered 503 although the restart happened).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_restarts_of_one_subsystem_all_get_the_outcome() {
    const CALLERS: usize = 200;
    let yaml = format!(
        "server:\n  bind_address: \"127.0.0.1:0\"\ndynamo:\n  enabled: false\n\
         admin:\n  enabled: true\n  token: \"{TOKEN}\"\n"
    );
    let daemon = support::daemon::start(&yaml).await;
    let url = format!(
        "http://{}/admin/subsystems/root/picker/restart",
        daemon.local_addr()
    );
    let client = reqwest::Client::new();
    let calls = (0..CALLERS).map(|_| {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move { admin(&client, reqwest::Method::POST, url).await })
    });
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    for call in futures::future::join_all(calls).await {
        let (status, _) = call.expect("caller task");
        *statuses.entry(status).or_default() += 1;
    }
    eprintln!("statuses of {CALLERS} parallel restarts: {statuses:?}");
    assert_eq!(statuses.get(&200).copied(), Some(CALLERS), "{statuses:?}");
    let restarts = daemon.tree().get("root/picker").expect("row").restarts;
    assert!(
        (1..=CALLERS as u64).contains(&restarts),
        "{restarts} restarts"
    );
    assert_eq!(daemon.tree().get("root/registry").expect("row").restarts, 0);
    daemon.shutdown().await;
}
