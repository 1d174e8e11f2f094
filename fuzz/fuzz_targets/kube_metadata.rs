//! Fuzz target `kube_metadata`: [`continuum_fuzz::protocol::kube_metadata`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| continuum_fuzz::protocol::kube_metadata(data));
