//! Test support.

pub mod bench;
pub mod sim;
pub mod workload;
