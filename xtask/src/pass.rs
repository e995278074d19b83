//! `xtask xdp-pass --iface IF`: attaches the object's pass-everything program (native, else
//! generic) until SIGTERM/SIGINT. Veth peers need an XDP program to receive redirected frames;
//! this one costs the least, so benchmarks measure the LB, not the peer. `--drop` attaches the
//! program that drops every IP frame instead (the benchmark's packet sink; ARP passes).
use aya::{
    Ebpf,
    programs::{Xdp, XdpMode},
};
use loxi_common::maps::{DROP_PROG_NAME, PASS_PROG_NAME};

/// Flags of `xdp-pass`.
#[derive(clap::Args)]
pub struct PassArgs {
    /// Interfaces to attach to.
    #[arg(long = "iface")]
    ifaces: Vec<String>,
    /// Attach the drop-every-IP-frame program instead of the pass-everything one.
    #[arg(long)]
    drop: bool,
}

/// Attaches and waits for a signal; the links go with the process.
pub fn run(a: PassArgs) -> anyhow::Result<()> {
    let bytes = loxi_user::l4::object_bytes();
    anyhow::ensure!(
        !bytes.is_empty(),
        "XDP object is empty (built without the eBPF toolchain)"
    );
    let mut ebpf = Ebpf::load(bytes)?;
    let name = if a.drop {
        DROP_PROG_NAME
    } else {
        PASS_PROG_NAME
    };
    let prog: &mut Xdp = ebpf
        .program_mut(name)
        .ok_or_else(|| anyhow::anyhow!("{name} not in the object"))?
        .try_into()?;
    prog.load()?;
    for i in &a.ifaces {
        if prog.attach(i, XdpMode::Driver).is_err() {
            prog.attach(i, XdpMode::Skb)?;
        }
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        anyhow::Ok(())
    })?;
    drop(ebpf);
    Ok(())
}
