//! Fuzz target `h1_response`: [`continuum_fuzz::router::h1_response`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| continuum_fuzz::router::h1_response(data));
