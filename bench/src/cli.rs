//! Flags both benchmark binaries (`bench-routing`, `bench-gateway`) share.

use std::path::PathBuf;

use anyhow::{Context, Result};

/// Where the binaries and the model are, the served model name and the engine count
/// (`#[command(flatten)]` into each binary's flags).
#[derive(Debug, Clone, clap::Args)]
pub struct FleetArgs {
    /// Directory holding vllm-sim, loxilb and loxicmd (default: this binary's directory).
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    /// Model directory with tokenizer.json + tokenizer_config.json (default: shared tiny model).
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    /// Served model name.
    #[arg(long, default_value = "tiny")]
    pub model: String,
    /// Number of engines (workers).
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
}

impl FleetArgs {
    /// `--bin-dir`, else the directory of the running binary.
    ///
    /// # Errors
    /// The running binary's path cannot be read.
    pub fn bin_dir(&self) -> Result<PathBuf> {
        if let Some(d) = &self.bin_dir {
            return Ok(d.clone());
        }
        let exe = std::env::current_exe().context("current_exe")?;
        Ok(exe
            .parent()
            .context("binary has no directory")?
            .to_path_buf())
    }
}
