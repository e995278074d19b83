//! `loxi-bench`: the routing-quality benchmark. Runs a seeded workload through each policy
//! against a `vllm-sim` fleet, collects engine- and client-side numbers, compares with the
//! oracle and reports. The `bench-routing` binary (`src/main.rs`) is its command line.
//!
//! - [`workload`]: the seeded workloads (shared prefix, multi-turn, trace replay).
//! - [`plan`]: orchestration (fleet, per-policy router, run, counters).
//! - [`fleet`], [`gateway`], [`peers`], [`procs`]: the processes; [`real_vllm`]: the fleet of
//!   real vLLM CPU engines (`--engines real-vllm`).
//! - [`runner`], [`client`]: concurrent replay and per-request timing.
//! - [`scrape`]: Prometheus text. [`stats`]: percentiles. [`oracle`]: the offline bound.
//! - [`report`], [`chart`]: Markdown, `summary.json`, verdicts, PNG.
//! - [`gateway_load`]: the `bench-gateway` binary's pieces (KV-routed requests per loxilb core).

pub mod chart;
pub mod cli;
pub mod client;
pub mod fleet;
pub mod gateway;
pub mod gateway_load;
pub mod oracle;
pub mod peers;
pub mod plan;
pub mod procs;
pub mod real_vllm;
pub mod report;
pub mod runner;
pub mod scrape;
pub mod stats;
pub mod workload;

/// The `shared/` directory beside the checkout, whose `golden/tiny-model` is the default model:
/// `$LOXI_SHARED` if set, else `<repo>/../shared` (the checkout this binary was built from).
pub fn shared_dir() -> std::path::PathBuf {
    std::env::var_os("LOXI_SHARED")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared"))
}
