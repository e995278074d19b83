//! The routing-quality benchmark: run a workload through each policy against a `vllm-sim`
//! fleet, collect engine- and client-side numbers, compare with the oracle, report.

pub mod oracle;
pub mod stats;
