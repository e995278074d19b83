//! VIP addresses on the `--vip-iface` interface, managed over rtnetlink.
//!
//! Each rule's VIP (every mode, so mode-4 listeners can bind) is added as a /32 or /128. An
//! address that was already present is left alone and never duplicated; on deletion only the
//! addresses loxi itself added are removed. A missing interface is a start-up error.
use std::{collections::BTreeSet, net::IpAddr};

use futures::TryStreamExt as _;
use rtnetlink::{
    Handle,
    packet_route::address::{AddressAttribute, AddressMessage},
};
use thiserror::Error;

/// Netlink failures, naming the interface or address involved.
#[derive(Debug, Error)]
pub enum NetlinkError {
    /// Opening the rtnetlink socket failed.
    #[error("opening rtnetlink socket: {0}")]
    Socket(#[source] std::io::Error),
    /// The interface does not exist.
    #[error("VIP interface {0:?} does not exist (--vip-iface)")]
    NoInterface(String),
    /// A netlink request failed.
    #[error("netlink {action} on {iface}: {source}")]
    Request {
        /// What was asked (`add 10.0.0.1/32`, …).
        action: String,
        /// Interface name.
        iface: String,
        /// rtnetlink's error.
        #[source]
        source: rtnetlink::Error,
    },
}

/// Keeps the VIP set of one interface in step with the rules.
pub struct VipManager {
    handle: Handle,
    iface: String,
    index: u32,
    /// Addresses loxi added (and may therefore remove).
    added: BTreeSet<IpAddr>,
}

impl VipManager {
    /// Opens rtnetlink (spawning its connection task) and resolves `iface`.
    #[allow(
        clippy::disallowed_methods,
        reason = "rtnetlink's connection task ends when the handle it serves is dropped"
    )]
    pub async fn new(iface: &str) -> Result<Self, NetlinkError> {
        let (conn, handle, _) = rtnetlink::new_connection().map_err(NetlinkError::Socket)?;
        tokio::spawn(conn);
        let mut links = handle.link().get().match_name(iface.to_string()).execute();
        let index = match links.try_next().await {
            Ok(Some(l)) => l.header.index,
            Ok(None) | Err(_) => return Err(NetlinkError::NoInterface(iface.to_string())),
        };
        Ok(Self {
            handle,
            iface: iface.to_string(),
            index,
            added: BTreeSet::new(),
        })
    }

    /// Addresses loxi added so far.
    pub fn added(&self) -> &BTreeSet<IpAddr> {
        &self.added
    }

    /// Adds missing VIPs of `want`, removes VIPs loxi added that are no longer wanted. The
    /// unspecified addresses (`0.0.0.0`, `::`: a rule listening on every address) need no VIP
    /// and are skipped (the kernel took `0.0.0.0/32` and never listed it, so every sync added
    /// it again).
    pub async fn sync(&mut self, want: &BTreeSet<IpAddr>) -> Result<(), NetlinkError> {
        let present = self.present().await?;
        for ip in want.iter().filter(|ip| !ip.is_unspecified()) {
            if !present
                .iter()
                .any(|(a, m)| covers(*a, m.header.prefix_len, *ip))
            {
                self.add(*ip).await?;
            }
        }
        let stale: Vec<IpAddr> = self.added.difference(want).copied().collect();
        for ip in stale {
            self.remove(ip, &present).await?;
        }
        Ok(())
    }

    /// Removes every address loxi added (shutdown).
    pub async fn release_all(&mut self) -> Result<(), NetlinkError> {
        self.sync(&BTreeSet::new()).await
    }

    async fn present(&self) -> Result<Vec<(IpAddr, AddressMessage)>, NetlinkError> {
        let mut out = Vec::new();
        let mut s = self
            .handle
            .address()
            .get()
            .set_link_index_filter(self.index)
            .execute();
        loop {
            match s.try_next().await {
                Ok(Some(msg)) => {
                    if msg.header.index != self.index {
                        continue;
                    }
                    let addr = msg.attributes.iter().find_map(|a| match a {
                        AddressAttribute::Local(ip) => Some(*ip),
                        _ => None,
                    });
                    let addr = addr.or_else(|| {
                        msg.attributes.iter().find_map(|a| match a {
                            AddressAttribute::Address(ip) => Some(*ip),
                            _ => None,
                        })
                    });
                    if let Some(ip) = addr {
                        out.push((ip, msg));
                    }
                }
                Ok(None) => break,
                Err(e) => return Err(self.err("list addresses", e)),
            }
        }
        Ok(out)
    }

    async fn add(&mut self, ip: IpAddr) -> Result<(), NetlinkError> {
        let plen = if ip.is_ipv4() { 32 } else { 128 };
        self.handle
            .address()
            .add(self.index, ip, plen)
            .execute()
            .await
            .map_err(|e| self.err(&format!("add {ip}/{plen}"), e))?;
        tracing::info!(iface = %self.iface, vip = %ip, "VIP added");
        self.added.insert(ip);
        Ok(())
    }

    async fn remove(
        &mut self,
        ip: IpAddr,
        present: &[(IpAddr, AddressMessage)],
    ) -> Result<(), NetlinkError> {
        if let Some((_, msg)) = present.iter().find(|(a, _)| *a == ip) {
            self.handle
                .address()
                .del(msg.clone())
                .execute()
                .await
                .map_err(|e| self.err(&format!("delete {ip}"), e))?;
            tracing::info!(iface = %self.iface, vip = %ip, "VIP removed");
        }
        self.added.remove(&ip);
        Ok(())
    }

    fn err(&self, action: &str, source: rtnetlink::Error) -> NetlinkError {
        NetlinkError::Request {
            action: action.to_string(),
            iface: self.iface.clone(),
            source,
        }
    }
}

/// True when `ip` is inside `addr/prefix_len` (so already local: e.g. every 127.x address is
/// local through `lo`'s 127.0.0.1/8, and a VIP there needs no address of its own).
fn covers(addr: IpAddr, prefix_len: u8, ip: IpAddr) -> bool {
    let (a, b, bits) = match (addr, ip) {
        (IpAddr::V4(a), IpAddr::V4(b)) => (
            u128::from(u32::from(a)) << 96,
            u128::from(u32::from(b)) << 96,
            32,
        ),
        (IpAddr::V6(a), IpAddr::V6(b)) => (u128::from(a), u128::from(b), 128),
        _ => return false,
    };
    let len = u32::from(prefix_len.min(bits));
    let mask = if len == 0 {
        0
    } else {
        u128::MAX << (128 - len)
    };
    a & mask == b & mask
}

#[cfg(test)]
mod covers_tests {
    use super::covers;

    #[test]
    fn a_prefix_on_the_interface_covers_the_addresses_inside_it() {
        let ip = |s: &str| s.parse().expect("ip");
        assert!(covers(ip("127.0.0.1"), 8, ip("127.0.0.9")));
        assert!(covers(ip("10.1.2.3"), 32, ip("10.1.2.3")));
        assert!(!covers(ip("10.1.2.3"), 32, ip("10.1.2.4")));
        assert!(!covers(ip("127.0.0.1"), 8, ip("128.0.0.1")));
        assert!(covers(ip("fd00::1"), 64, ip("fd00::ab")));
        assert!(!covers(ip("fd00::1"), 128, ip("fd00::2")));
        assert!(!covers(ip("127.0.0.1"), 8, ip("::1")));
    }
}
