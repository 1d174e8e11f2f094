//! The harnesses every integration-test module shares (one copy in the one test binary). Each
//! file says what it starts; everything runs on loopback, on free ports, under deadlines.

pub mod broker;
pub mod bus_pki;
pub mod busy_fleet;
pub mod daemon;
pub mod demo;
pub mod dynamo;
pub mod etcd;
pub mod fake_kube;
pub mod kv_prep;
pub mod logs;
pub mod mid_stream;
pub mod otlp;
pub mod paused;
pub mod process;
pub mod replicas;
pub mod upstream;
pub mod zmq;
