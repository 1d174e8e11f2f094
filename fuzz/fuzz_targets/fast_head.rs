//! Fuzz target `fast_head`: [`continuum_fuzz::router::fast_head`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| continuum_fuzz::router::fast_head(data));
