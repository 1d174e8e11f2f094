//! Fuzz target `discovery`: [`continuum_fuzz::protocol::discovery`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| continuum_fuzz::protocol::discovery(data));
