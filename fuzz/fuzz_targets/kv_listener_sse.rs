//! Fuzz target `kv_listener_sse`: [`continuum_fuzz::protocol::kv_listener_sse`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| continuum_fuzz::protocol::kv_listener_sse(data));
