//! `GET /admin/config` and `PUT`/`POST /admin/config` against the whole daemon started from a
//! config file: the readback is byte-for-byte what `continuum-router config show` prints for
//! the same file, and an import of that masked readback (edited) keeps the live secrets, goes
//! through the reload path, and rewrites the file atomically; refused imports change nothing.

use crate::support;

use std::path::Path;
use std::process::Command;

use continuum_router::config::Config;
use continuum_router::daemon::Daemon;
use serde_json::Value;

const TOKEN: &str = "admin-token-for-the-import-test";
const CONFIG: &str = r#"server:
  bind_address: "127.0.0.1:0"
admin:
  enabled: true
  token: "admin-token-for-the-import-test"
api_keys:
  - name: alice
    key: "alice-secret-key"
backends:
  - name: one
    url: "http://127.0.0.1:9"
    models: ["m1"]
    health_check:
      enabled: false
"#;

struct Fixture {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
    daemon: Daemon,
    client: reqwest::Client,
}

impl Fixture {
    async fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("router.yaml");
        std::fs::write(&path, CONFIG).expect("write config");
        let daemon = support::daemon::start_file(&path).await;
        Fixture {
            _dir: dir,
            path,
            daemon,
            client: reqwest::Client::new(),
        }
    }

    fn url(&self) -> String {
        format!("http://{}/admin/config", self.daemon.local_addr())
    }

    async fn get(&self) -> (u16, String) {
        let response = self
            .client
            .get(self.url())
            .bearer_auth(TOKEN)
            .send()
            .await
            .expect("GET /admin/config");
        let status = response.status().as_u16();
        (status, response.text().await.expect("body"))
    }

    async fn import(&self, put: bool, body: String) -> (u16, Value) {
        let request = if put {
            self.client.put(self.url())
        } else {
            self.client.post(self.url())
        };
        let response = request
            .bearer_auth(TOKEN)
            .header("content-type", "application/yaml")
            .body(body)
            .send()
            .await
            .expect("import");
        let status = response.status().as_u16();
        (status, response.json().await.expect("JSON body"))
    }
}

fn config_show(path: &Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_continuum-router"))
        .args(["config", "show", "--config"])
        .arg(path)
        .output()
        .expect("run config show");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8")
}

#[tokio::test]
async fn the_readback_is_config_show_and_needs_the_token() {
    let f = Fixture::start().await;
    let (status, body) = f.get().await;
    assert_eq!(status, 200);
    assert_eq!(body, config_show(&f.path));
    assert!(body.contains("********"));
    assert!(!body.contains("alice-secret-key") && !body.contains(TOKEN));
    let anonymous = f.client.get(f.url()).send().await.expect("GET");
    assert_eq!(anonymous.status().as_u16(), 401);
    f.daemon.shutdown().await;
}

#[tokio::test]
async fn an_edited_masked_readback_imports_keeps_secrets_and_rewrites_the_file() {
    let f = Fixture::start().await;
    let (_, shown) = f.get().await;
    // Edit the masked readback: the backend serves a second model.
    let mut doc: Value = serde_saphyr::from_str(&shown).expect("the readback is YAML");
    assert_eq!(
        doc["backends"][0]["models"],
        serde_json::json!(["m1"]),
        "{shown}"
    );
    doc["backends"][0]["models"] = serde_json::json!(["m1", "m2"]);
    let edited = serde_saphyr::to_string(&doc).expect("YAML");
    let (status, body) = f.import(true, edited).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["imported"], true);
    assert!(
        body["summary"]
            .as_str()
            .expect("summary")
            .contains("changed keys"),
        "{body}"
    );
    // The file holds the real secrets again (never the mask) and re-reads to the new config.
    let written = std::fs::read_to_string(&f.path).expect("read back");
    assert!(!written.contains("********"), "{written}");
    let reread = Config::load(&f.path)
        .expect("the written file is valid")
        .config;
    assert_eq!(reread.api_keys[0].key, "alice-secret-key");
    assert_eq!(reread.admin.token.as_deref(), Some(TOKEN));
    assert_eq!(reread.backends[0].models, ["m1", "m2"]);
    // The running config changed, and the live token still opens the admin API.
    let (status, now) = f.get().await;
    assert_eq!(status, 200);
    let now_doc: Value = serde_saphyr::from_str(&now).expect("YAML");
    assert_eq!(
        now_doc["backends"][0]["models"],
        serde_json::json!(["m1", "m2"])
    );
    // Importing the same readback again (POST this time) changes nothing.
    let (status, body) = f.import(false, now).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["summary"], "no changes");
    f.daemon.shutdown().await;
}

#[tokio::test]
async fn refused_imports_leave_the_file_and_the_running_config_alone() {
    let f = Fixture::start().await;
    let before = std::fs::read_to_string(&f.path).expect("read");
    let (_, shown_before) = f.get().await;
    let cases = [
        // Not the schema.
        ("server: {bind: x}\n".to_string(), "bind"),
        // Invalid: admin enabled without a token.
        ("admin: {enabled: true}\n".to_string(), "admin.token"),
        // A masked key with no live key of that name to restore.
        (
            shown_before.replace("name: alice", "name: bob"),
            "no live key named",
        ),
    ];
    for (text, needle) in cases {
        let (status, body) = f.import(true, text.clone()).await;
        assert_eq!(status, 400, "{text}: {body}");
        let message = body["error"]["message"].as_str().expect("message");
        assert!(message.contains(needle), "{needle}: {message}");
        assert_eq!(std::fs::read_to_string(&f.path).expect("read"), before);
    }
    let (_, shown_after) = f.get().await;
    assert_eq!(shown_after, shown_before);
    f.daemon.shutdown().await;
}

#[tokio::test]
async fn a_daemon_without_a_config_file_refuses_imports_with_409() {
    let daemon = support::daemon::start(CONFIG).await;
    let url = format!("http://{}/admin/config", daemon.local_addr());
    let client = reqwest::Client::new();
    let shown = client
        .get(&url)
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("GET")
        .text()
        .await
        .expect("body");
    let response = client
        .put(&url)
        .bearer_auth(TOKEN)
        .body(shown)
        .send()
        .await
        .expect("PUT");
    assert_eq!(response.status().as_u16(), 409);
    let body: Value = response.json().await.expect("JSON");
    assert!(
        body["error"]["message"]
            .as_str()
            .expect("message")
            .contains("no config file"),
        "{body}"
    );
    daemon.shutdown().await;
}

#[tokio::test]
async fn oversized_imports_are_413_before_buffering() {
    let f = Fixture::start().await;
    let big = "#".repeat(4 * 1024 * 1024 + 1);
    let response = f
        .client
        .put(f.url())
        .bearer_auth(TOKEN)
        .body(big)
        .send()
        .await
        .expect("PUT");
    assert_eq!(response.status().as_u16(), 413);
    f.daemon.shutdown().await;
}
