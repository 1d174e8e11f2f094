//! Fuzz target `load_sample`: [`continuum_fuzz::protocol::load_sample`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| continuum_fuzz::protocol::load_sample(data));
