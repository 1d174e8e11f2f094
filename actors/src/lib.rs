//! continuum-actors: thin ractor shells that own IO for continuum-router.

pub mod zmtp_conn;
