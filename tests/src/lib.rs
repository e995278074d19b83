//! Test support for loxi's integration tests: the daemon harness ([`harness`]), real test
//! backends ([`backend`]), real pyzmq KV-event publishers ([`kv_pub`]), the `vllm-sim` engine
//! emulator ([`sim`]), the benchmark workloads ([`workload`]) and runner ([`bench`]).

pub mod backend;
pub mod bench;
pub mod harness;
pub mod kv_pub;
pub mod sim;
pub mod workload;
