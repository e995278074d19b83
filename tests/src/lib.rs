//! Test support for loxi's integration tests: the daemon harness ([`harness`]), real test
//! backends ([`backend`]), the `vllm-sim` engine emulator ([`sim`]), the benchmark workloads
//! ([`workload`]) and runner ([`bench`]).

pub mod backend;
pub mod bench;
pub mod harness;
pub mod sim;
pub mod workload;
