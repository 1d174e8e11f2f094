//! Fuzz target `fast_head_vs_hyper`: [`continuum_fuzz::router::fast_head_vs_hyper`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| continuum_fuzz::router::fast_head_vs_hyper(data));
