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
    /// Ports to serve on all addresses (TCP and UDP each).
    #[arg(long = "port")]
    ports: Vec<u16>,
    /// Extra TCP-only ports on all addresses (a TCP reply leaves from the address it reached).
    #[arg(long = "tcp-port")]
    tcp_ports: Vec<u16>,
    /// Extra UDP sockets bound to `addr:port`, e.g. a DSR VIP, so replies leave from that
    /// address.
    #[arg(long = "udp-bind")]
    udp_binds: Vec<std::net::SocketAddr>,
}

/// Serves forever.
pub fn run(a: BackendArgs) -> anyhow::Result<()> {
    let mut handles = Vec::new();
    let mut udps = Vec::new();
    let mut tcps = Vec::new();
    for port in &a.ports {
        tcps.push(TcpListener::bind(("0.0.0.0", *port))?);
        udps.push(UdpSocket::bind(("0.0.0.0", *port))?);
    }
    for port in &a.tcp_ports {
        tcps.push(TcpListener::bind(("0.0.0.0", *port))?);
    }
    for addr in &a.udp_binds {
        udps.push(UdpSocket::bind(addr)?);
    }
    for tcp in tcps {
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
    }
    for udp in udps {
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
