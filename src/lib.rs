//! continuum-router: the daemon library.
