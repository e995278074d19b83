//! Test support.

pub mod bench;
pub mod workload;
