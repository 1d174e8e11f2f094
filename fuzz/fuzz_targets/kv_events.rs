//! Fuzz target `kv_events`: [`continuum_fuzz::protocol::kv_events`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| continuum_fuzz::protocol::kv_events(data));
