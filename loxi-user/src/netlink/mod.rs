//! VIP addresses on the `--vip-iface` interface, managed over rtnetlink.
//!
//! Each rule's VIP (every mode, so mode-4 listeners can bind) is added as a /32 or /128. An
//! address that was already present is left alone and never duplicated; on deletion only the
//! addresses loxi itself added are removed. A missing interface is a start-up error.
//!
//! loxi knows its own addresses across restarts, so a daemon that was killed (SIGKILL, a crash:
//! no clean-up ran) does not leak them. Each address it adds carries the address protocol
//! [`ADDR_PROTO`] (`IFA_PROTO`, Linux 6.3+; iproute2 6.3+ shows it as the address's `proto`), and is listed in the
//! record file `<state-dir>/vips-<iface>.json` before it is added. At start, an address on the
//! interface that carries the marker *and* is in the record is adopted as loxi's own: kept while
//! a restored rule needs it, removed when none does. An address added by hand carries no marker
//! (and is in no record), so it is never removed; the record, kept in the daemon's locked state
//! dir, keeps one daemon from adopting another's addresses on the same interface.
use std::{
    collections::BTreeSet,
    net::IpAddr,
    path::{Path, PathBuf},
};

use futures::TryStreamExt as _;
use rtnetlink::{
    Handle,
    packet_route::address::{AddressAttribute, AddressFlags, AddressHeaderFlags, AddressMessage},
    packet_utils::nla::{DefaultNla, Nla as _},
};
use thiserror::Error;

/// The address protocol (`IFA_PROTO`) loxi marks its VIP addresses with: `0x4c`, `L`. The
/// kernel's own values are 0 to 3 (unspecified, loopback, router advertisement, link-local).
pub const ADDR_PROTO: u8 = 0x4c;

/// The `IFA_PROTO` attribute (`linux/if_addr.h`; not named by `netlink-packet-route` 0.24).
const IFA_PROTO: u16 = 11;

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
    /// The record of [`Self::added`] kept across restarts (`None`: not kept).
    record: Option<PathBuf>,
}

impl VipManager {
    /// The record file of the VIPs loxi adds to `iface`, in `state_dir`.
    pub fn record_file(state_dir: &Path, iface: &str) -> PathBuf {
        state_dir.join(format!("vips-{iface}.json"))
    }

    /// Opens rtnetlink (spawning its connection task) and resolves `iface`. With `record`
    /// (see [`Self::record_file`]), the addresses loxi adds are recorded there, and those an
    /// earlier run recorded that are still on `iface` with loxi's marker ([`ADDR_PROTO`]) are
    /// adopted: the next [`Self::sync`] keeps them when wanted and removes them otherwise.
    #[allow(
        clippy::disallowed_methods,
        reason = "rtnetlink's connection task ends when the handle it serves is dropped"
    )]
    pub async fn new(iface: &str, record: Option<PathBuf>) -> Result<Self, NetlinkError> {
        let (conn, handle, _) = rtnetlink::new_connection().map_err(NetlinkError::Socket)?;
        tokio::spawn(conn);
        let mut links = handle.link().get().match_name(iface.to_string()).execute();
        let index = match links.try_next().await {
            Ok(Some(l)) => l.header.index,
            Ok(None) | Err(_) => return Err(NetlinkError::NoInterface(iface.to_string())),
        };
        let mut me = Self {
            handle,
            iface: iface.to_string(),
            index,
            added: BTreeSet::new(),
            record,
        };
        me.adopt().await?;
        Ok(me)
    }

    /// Adopts the addresses an earlier run recorded that are still on the interface with
    /// loxi's marker, and rewrites the record to hold just those.
    async fn adopt(&mut self) -> Result<(), NetlinkError> {
        let Some(file) = self.record.clone() else {
            return Ok(());
        };
        let recorded = read_record(&file);
        if recorded.is_empty() {
            return Ok(());
        }
        let present = self.present().await?;
        for ip in &recorded {
            match present.iter().find(|(a, _)| a == ip) {
                Some((_, msg)) if marked(msg) => {
                    tracing::info!(iface = %self.iface, vip = %ip,
                        "VIP left on the interface by an earlier run adopted (removed when no rule needs it)");
                    self.added.insert(*ip);
                }
                Some(_) => tracing::warn!(iface = %self.iface, vip = %ip,
                    "recorded VIP is on the interface without loxi's marker (added by hand since?): left alone"),
                None => {}
            }
        }
        if self.added != recorded {
            self.write_record();
        }
        Ok(())
    }

    /// Writes [`Self::added`] to the record file (a failure is logged: the VIPs still work,
    /// but a crash now may leave some behind).
    fn write_record(&self) {
        let Some(file) = &self.record else { return };
        let body = match serde_json::to_vec(&self.added) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(file = %file.display(), error = %e, "encoding the VIP record");
                return;
            }
        };
        if let Err(e) = crate::rules::persist::write_atomic(file, &body) {
            tracing::warn!(file = %file.display(), error = %e,
                "writing the VIP record failed: after a crash, VIPs added since may stay on the interface");
        }
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
        // Recorded before it exists, so a crash right after the add cannot leave it unrecorded.
        self.added.insert(ip);
        self.write_record();
        let mut req = self.handle.address().add(self.index, ip, plen);
        let msg = req.message_mut();
        msg.attributes.push(AddressAttribute::Other(DefaultNla::new(
            IFA_PROTO,
            vec![ADDR_PROTO],
        )));
        if ip.is_ipv6() {
            // No duplicate address detection: a VIP is ours by configuration, and with DAD an
            // IPv6 address stays `tentative` (unusable: connects to it fail) for a second or more
            // after the add, on any interface but `lo`, while the API has already answered that
            // the rule is live. `ip addr add ... nodad`.
            msg.header.flags |= AddressHeaderFlags::Nodad;
            msg.attributes
                .push(AddressAttribute::Flags(AddressFlags::Nodad));
        }
        if let Err(e) = req.execute().await {
            self.added.remove(&ip);
            self.write_record();
            return Err(self.err(&format!("add {ip}/{plen}"), e));
        }
        tracing::info!(iface = %self.iface, vip = %ip, "VIP added");
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
        self.write_record();
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

/// Whether the address carries loxi's marker (`IFA_PROTO` = [`ADDR_PROTO`]).
fn marked(msg: &AddressMessage) -> bool {
    msg.attributes.iter().any(|a| match a {
        AddressAttribute::Other(nla) if nla.kind() == IFA_PROTO && nla.value_len() == 1 => {
            let mut v = [0u8; 1];
            nla.emit_value(&mut v);
            v[0] == ADDR_PROTO
        }
        _ => false,
    })
}

/// The addresses in the record file `file`; none when it is missing or unreadable (logged).
fn read_record(file: &Path) -> BTreeSet<IpAddr> {
    let bytes = match std::fs::read(file) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return BTreeSet::new(),
        Err(e) => {
            tracing::warn!(file = %file.display(), error = %e,
                "reading the VIP record failed: VIPs an earlier run left on the interface stay there");
            return BTreeSet::new();
        }
    };
    serde_json::from_slice(&bytes).unwrap_or_else(|e| {
        tracing::warn!(file = %file.display(), error = %e,
            "the VIP record is not a JSON list of addresses: VIPs an earlier run left on the interface stay there");
        BTreeSet::new()
    })
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
