//! A standalone test backend for demos and benchmarks: answers every request with
//! `{"backend": NAME, ...}` and header `x-backend: NAME`, streams SSE on request (see
//! `loxi_tests::backend`).
//!
//! Usage: `echo-backend --port P --name N [--host 127.0.0.1]`.

use std::net::{IpAddr, SocketAddr};

use clap::Parser;

/// Flags.
#[derive(Parser, Debug)]
struct Args {
    /// TCP port to listen on.
    #[arg(long)]
    port: u16,
    /// Name reported in every response.
    #[arg(long)]
    name: String,
    /// Address to bind (loopback by default).
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Worker threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()?;
    rt.block_on(async {
        let b =
            loxi_tests::backend::Backend::bind(&args.name, SocketAddr::new(args.host, args.port))
                .await?;
        b.set_recording(false);
        eprintln!("echo-backend {} listening on {}", args.name, b.addr);
        b.serve_forever().await;
        Ok(())
    })
}
