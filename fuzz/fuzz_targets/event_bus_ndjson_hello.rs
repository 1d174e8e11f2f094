//! Fuzz target `event_bus_ndjson_hello`: [`continuum_fuzz::protocol::event_bus_ndjson_hello`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| continuum_fuzz::protocol::event_bus_ndjson_hello(data));
