//! Black-box tests of the discovery reducer and fleet snapshot against captured Dynamo 1.6.1
//! dumps, the wire-spec vectors, one focused test per rule, and convergence properties.

pub mod admission;
pub mod golden;
pub mod props;
pub mod rules;
pub mod support;
pub mod vectors;
