//! Fuzz target `responses`: [`continuum_fuzz::protocol::responses`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| continuum_fuzz::protocol::responses(data));
