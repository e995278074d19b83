//! `vllm-sim`: emulator of a vLLM OpenAI server (see the `vllm_sim` library).
//!
//! Prints one readiness line on stdout once every socket is bound:
//! `VLLM_SIM_READY http=HOST:PORT pub=ENDPOINT|- replay=ENDPOINT|-`.

use clap::Parser;
use vllm_sim::{config::SimArgs, server};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = SimArgs::parse();
    let sim = server::start(args).await?;
    println!("{}", sim.ready_line());
    tokio::select! {
        r = sim.task => r?,
        _ = tokio::signal::ctrl_c() => {}
    }
    Ok(())
}
