//! Replays one raw HTTP/1.1 request: reads the request bytes from stdin, sends them over a
//! fresh TCP connection to `ADDR`, writes the response bytes to stdout. Used to reach a daemon
//! inside a network namespace (`ip netns exec NS raw-replay 127.0.0.1:11111`) with the exact
//! bytes of a fixture.
//!
//! Usage: `raw-replay ADDR < request > response`.

use std::io::{Read, Write};
use std::net::SocketAddr;

fn main() -> anyhow::Result<()> {
    let addr: SocketAddr = std::env::args()
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("usage: raw-replay ADDR < request"))?
        .parse()?;
    let mut raw = Vec::new();
    std::io::stdin().take(8 << 20).read_to_end(&mut raw)?;
    let resp = loxi_tests::loxilb_clients::exchange(addr, &raw).map_err(anyhow::Error::msg)?;
    std::io::stdout().write_all(&resp)?;
    Ok(())
}
