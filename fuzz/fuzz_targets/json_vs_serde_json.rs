//! Fuzz target `json_vs_serde_json`: [`continuum_fuzz::protocol::json_vs_serde_json`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| continuum_fuzz::protocol::json_vs_serde_json(data));
