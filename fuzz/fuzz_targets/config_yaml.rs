//! Fuzz target `config_yaml`: [`continuum_fuzz::router::config_yaml`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| continuum_fuzz::router::config_yaml(data));
