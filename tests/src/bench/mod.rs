//! The routing-quality benchmark: run a workload through each policy against a `vllm-sim`
//! fleet, collect engine- and client-side numbers, compare with the oracle, report.
//!
//! - [`plan`]: orchestration (fleet, per-policy router, run, counters).
//! - [`fleet`], [`gateway`], [`peers`], [`procs`]: the processes.
//! - [`runner`], [`client`]: concurrent replay and per-request timing.
//! - [`scrape`]: Prometheus text. [`stats`]: percentiles. [`oracle`]: the offline bound.
//! - [`report`], [`chart`], [`glyphs`]: Markdown, `summary.json`, PNG.

pub mod chart;
pub mod client;
pub mod fleet;
pub mod gateway;
pub mod glyphs;
pub mod oracle;
pub mod peers;
pub mod plan;
pub mod procs;
pub mod report;
pub mod runner;
pub mod scrape;
pub mod stats;
