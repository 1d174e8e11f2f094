//! Fuzz target `msgpack_vs_rmpv`: [`continuum_fuzz::protocol::msgpack_vs_rmpv`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| continuum_fuzz::protocol::msgpack_vs_rmpv(data));
