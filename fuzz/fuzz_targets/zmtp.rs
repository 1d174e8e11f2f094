//! Fuzz target `zmtp`: [`continuum_fuzz::protocol::zmtp`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| continuum_fuzz::protocol::zmtp(data));
