//! Test support for loxi's integration tests: the daemon harness ([`harness`]), the `vllm-sim`
//! engine emulator ([`sim`]), the benchmark workloads ([`workload`]) and runner ([`bench`]).

pub mod bench;
pub mod harness;
pub mod sim;
pub mod workload;
