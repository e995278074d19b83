//! Developer chores for loxi.
//!
//! - `cargo xtask netns-test`: real-traffic tests of the XDP data path in network namespaces
//!   (root; fails when not root and `CI` is set, skips with a warning otherwise).
//! - `cargo xtask lint-ebpf`: clippy on `loxi-ebpf` with the pinned nightly for bpfel-unknown-none.
//! - `bench-l4`, `bench-l4-ab`: the L4 benchmarks (`scripts/bench-l4.sh`, `scripts/bench-l4-ab.sh`).
//! - `l4-serve`, `backend`: helpers the netns test and `scripts/bench-l4.sh` start inside
//!   namespaces (the L4 data path fed from a rules file; a TCP/UDP backend naming itself).
mod backend;
mod bench;
mod bench_ab;
mod netns;
mod pass;
mod serve;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "loxi developer tasks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Namespace tests of the XDP data path (root).
    NetnsTest,
    /// Clippy for the eBPF crate with the pinned nightly.
    LintEbpf,
    /// Run the L4 data path, reloading rules (JSON array of LoxiLB rules) from a file.
    L4Serve(serve::ServeArgs),
    /// A backend: TCP and UDP servers answering with their name.
    Backend(backend::BackendArgs),
    /// XDP native / generic / nftables DNAT forwarding cost (root).
    BenchL4(bench::BenchArgs),
    /// New-flow forwarding cost of two builds' XDP programs, interleaved (root).
    BenchL4Ab(bench_ab::AbArgs),
    /// Attach the pass-everything XDP program (veth peers).
    XdpPass(pass::PassArgs),
    /// Bounded UDP flood (used by bench-l4 inside the client namespace).
    UdpFlood(bench::FloodArgs),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().cmd {
        Cmd::NetnsTest => netns::run(),
        Cmd::LintEbpf => lint_ebpf(),
        Cmd::L4Serve(a) => serve::run(a),
        Cmd::Backend(a) => backend::run(a),
        Cmd::BenchL4(a) => bench::run(a),
        Cmd::BenchL4Ab(a) => bench_ab::run(a),
        Cmd::UdpFlood(a) => bench::flood(a),
        Cmd::XdpPass(a) => pass::run(a),
    }
}

/// Nightly the eBPF crate is built with (keep in step with `loxi-user/build.rs`).
const EBPF_TOOLCHAIN: &str = "nightly-2026-05-20";

fn lint_ebpf() -> anyhow::Result<()> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../loxi-ebpf");
    // Idempotent; the toolchain script installs the nightly with rust-src only.
    let st = std::process::Command::new("rustup")
        .args(["component", "add", "--toolchain", EBPF_TOOLCHAIN, "clippy"])
        .status()?;
    anyhow::ensure!(st.success(), "rustup component add clippy failed");
    let st = std::process::Command::new("rustup")
        .args([
            "run",
            EBPF_TOOLCHAIN,
            "cargo",
            "clippy",
            "-Z",
            "build-std=core",
        ])
        .args([
            "--target",
            "bpfel-unknown-none",
            "--release",
            "--",
            "-D",
            "warnings",
        ])
        .current_dir(dir)
        .status()?;
    anyhow::ensure!(st.success(), "clippy on loxi-ebpf failed");
    Ok(())
}
