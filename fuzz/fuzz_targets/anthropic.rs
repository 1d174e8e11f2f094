//! Fuzz target `anthropic`: [`continuum_fuzz::protocol::anthropic`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| continuum_fuzz::protocol::anthropic(data));
