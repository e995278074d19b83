//! `xtask backend`: answers every TCP connection with `NAME\n` and then one `NAME\n` per line
//! received, and every UDP datagram with `NAME`. Runs until killed.
use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{TcpListener, UdpSocket},
    thread,
};

/// Flags of `backend`.
#[derive(clap::Args)]
pub struct BackendArgs {
    /// Name sent back.
    #[arg(long)]
    name: String,
    /// Ports to serve (TCP and UDP each).
    #[arg(long = "port")]
    ports: Vec<u16>,
}

/// Serves forever.
pub fn run(a: BackendArgs) -> anyhow::Result<()> {
    let mut handles = Vec::new();
    for port in a.ports {
        let tcp = TcpListener::bind(("0.0.0.0", port))?;
        let udp = UdpSocket::bind(("0.0.0.0", port))?;
        let name = a.name.clone();
        handles.push(thread::spawn(move || {
            for s in tcp.incoming().flatten() {
                let name = name.clone();
                thread::spawn(move || {
                    let mut w = match s.try_clone() {
                        Ok(w) => w,
                        Err(_) => return,
                    };
                    let _ = writeln!(w, "{name}");
                    for line in BufReader::new(s).lines() {
                        if line.is_err() || writeln!(w, "{name}").is_err() {
                            break;
                        }
                    }
                });
            }
        }));
        let name = a.name.clone();
        handles.push(thread::spawn(move || {
            let mut buf = [0u8; 2048];
            while let Ok((_, from)) = udp.recv_from(&mut buf) {
                let _ = udp.send_to(name.as_bytes(), from);
            }
        }));
    }
    for h in handles {
        let _ = h.join();
    }
    Ok(())
}
