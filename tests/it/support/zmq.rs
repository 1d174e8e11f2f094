//! A real libzmq publisher for tests: a pyzmq process (tests/it/support/zmq_publisher.py) driven
//! over stdin/stdout, and builders for kv_metrics messages as Dynamo 1.6.1 frames them.
#![allow(dead_code)]

use std::process::Stdio;
use std::time::Duration;

use continuum_protocol::ids::{InstanceId, PublisherId};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::time::timeout;

const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/it/support/zmq_publisher.py"
);
/// Upper bound on any single wait; a hang fails the test instead of stalling CI.
const WAIT: Duration = Duration::from_secs(20);

/// A pyzmq publisher process driven over stdin/stdout.
pub struct Publisher {
    child: Child,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
}

impl Publisher {
    pub async fn spawn() -> Self {
        let python = std::env::var("CONTINUUM_PYTHON").unwrap_or_else(|_| "python3".into());
        let mut child = Command::new(&python)
            .arg(SCRIPT)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {python} (set CONTINUUM_PYTHON): {e}"));
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        Self {
            child,
            stdin,
            stdout,
        }
    }

    pub async fn cmd(&mut self, command: Value) -> Value {
        let mut line = command.to_string();
        line.push('\n');
        self.stdin.write_all(line.as_bytes()).await.unwrap();
        let reply = timeout(WAIT, self.stdout.next_line())
            .await
            .expect("publisher answered")
            .unwrap()
            .expect("publisher alive (is pyzmq installed?)");
        serde_json::from_str(&reply).unwrap()
    }

    pub async fn bind(&mut self, kind: &str, port: u16) -> u16 {
        let reply = self
            .cmd(json!({"op": "bind", "type": kind, "port": port}))
            .await;
        reply["port"].as_u64().unwrap() as u16
    }

    pub async fn await_subscriptions(&mut self, count: usize) -> Vec<String> {
        let reply = self
            .cmd(json!({"op": "await_subscriptions", "count": count}))
            .await;
        serde_json::from_value(reply["subscriptions"].clone()).unwrap()
    }

    pub async fn send(&mut self, messages: &[Frames]) {
        let hex: Vec<Vec<String>> = messages
            .iter()
            .map(|m| m.iter().map(|f| to_hex(f)).collect())
            .collect();
        self.cmd(json!({"op": "send", "messages": hex})).await;
    }

    /// SIGKILLs the publisher process: its sockets vanish without a goodbye, as a killed
    /// worker's do.
    pub async fn kill(&mut self) {
        self.child.kill().await.expect("SIGKILL the publisher");
    }

    pub async fn close(&mut self) {
        self.cmd(json!({"op": "close"})).await;
    }
}

pub type Frames = [Vec<u8>; 4];

pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Builds a kv_metrics message (fixed-width msgpack integers, as rmp-serde writes large ones).
pub fn make(publisher: PublisherId, sequence: u64, worker: InstanceId, used: u64) -> Frames {
    let mut load = vec![0x85];
    load.extend_from_slice(b"\xa9worker_id\xcf");
    load.extend_from_slice(&worker.0.to_be_bytes());
    load.extend_from_slice(b"\xa7dp_rank\x00");
    load.extend_from_slice(b"\xb4active_decode_blocks\xc0");
    load.extend_from_slice(b"\xb5active_prefill_tokens\xc0");
    load.extend_from_slice(b"\xaekv_used_blocks\xcf");
    load.extend_from_slice(&used.to_be_bytes());
    let mut envelope = vec![0x85];
    envelope.extend_from_slice(b"\xacpublisher_id\xcf");
    envelope.extend_from_slice(&publisher.0.to_be_bytes());
    envelope.extend_from_slice(b"\xa8sequence\xcf");
    envelope.extend_from_slice(&sequence.to_be_bytes());
    envelope.extend_from_slice(b"\xacpublished_at\xcf");
    envelope.extend_from_slice(&1_796_028_060_991u64.to_be_bytes());
    envelope.extend_from_slice(b"\xa5topic\xaakv_metrics");
    envelope.extend_from_slice(b"\xa7payload\xc4");
    envelope.push(load.len() as u8);
    envelope.extend(load);
    let mut frame = vec![1];
    frame.extend_from_slice(&(envelope.len() as u32).to_be_bytes());
    frame.extend(envelope);
    [
        b"kv_metrics".to_vec(),
        publisher.0.to_be_bytes().to_vec(),
        sequence.to_be_bytes().to_vec(),
        frame,
    ]
}
