//! The fuzz targets' bodies (see `fuzz/README.md`): `router` over the root crate's parsers,
//! `protocol` over `continuum-protocol`'s, `common` what they share. Each file of
//! `fuzz_targets/` calls one body; the repository's stable tests include these same files by path
//! and replay the committed corpora (`fuzz/corpus/<target>/`) through them.

pub mod common;
pub mod protocol;
pub mod router;
