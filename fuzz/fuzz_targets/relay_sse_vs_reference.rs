//! Fuzz target `relay_sse_vs_reference`: [`continuum_fuzz::router::relay_sse_vs_reference`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| continuum_fuzz::router::relay_sse_vs_reference(data));
