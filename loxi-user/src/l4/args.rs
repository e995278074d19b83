//! Command-line flags of the L4 data path (flattened into the daemon's flags).
use std::time::Duration;

/// `--xdp-iface` / `--vip-iface`, as LoxiLB's daemon takes them, and `--tc-iface`.
#[derive(Debug, Clone, clap::Args)]
pub struct L4Args {
    /// Interface to attach the XDP data path to (repeatable). None here and in `--tc-iface`:
    /// the L4 data path is off and modes other than 4 are not served.
    #[arg(long = "xdp-iface", value_name = "IFACE")]
    pub xdp_iface: Vec<String>,
    /// Interface to run the whole L4 data path on in TC ingress instead of XDP (repeatable): the
    /// same services, conntrack and NAT on the socket buffer, sent with `bpf_redirect`. For
    /// interfaces whose traffic would reach TC anyway: a veth of a container or pod, where XDP
    /// costs a NAPI poll and a copy, and egresses without XDP receive where XDP only hands off.
    /// An interface is named in `--xdp-iface` or here, not both.
    #[arg(long = "tc-iface", value_name = "IFACE")]
    pub tc_iface: Vec<String>,
    /// Interface that gets each rule's VIP as a /32 (/128) address.
    #[arg(long = "vip-iface", value_name = "IFACE", default_value = "lo")]
    pub vip_iface: String,
    /// Attach in generic (skb) mode even where native XDP is available (benchmarks, odd drivers).
    /// It applies to the `--xdp-iface` interfaces, so without one it is a usage error.
    #[arg(long = "xdp-generic", requires = "xdp_iface")]
    pub xdp_generic: bool,
}

/// Why `lo` is refused as an `--xdp-iface` or `--tc-iface`, and what to use instead. Either
/// hook attaches to it, but a client on the LB host then hangs on a VIP whose endpoints are
/// elsewhere: its packets come in on `lo` (from the VIP's own address), and the one the data
/// path rewrites for the endpoint is not forwarded from there (the FIB lookup passes it to the
/// kernel, which drops it).
pub const LOOPBACK_REFUSED: &str = "the loopback interface cannot carry the L4 data path: a \
    client on this host reaches a VIP over lo, and a packet rewritten there for an endpoint \
    elsewhere is not forwarded, so the connection hangs. Name the interfaces remote clients and \
    endpoints arrive on, and serve clients on this host with a mode-4 (fullproxy) rule";

/// Runtime configuration of [`crate::l4::run`].
#[derive(Debug, Clone)]
pub struct L4Config {
    /// Interfaces to attach XDP to (may be empty, with `tc_ifaces`: then only VIPs are
    /// managed).
    pub xdp_ifaces: Vec<String>,
    /// Interfaces that run the whole data path in TC ingress ([`L4Args::tc_iface`]).
    pub tc_ifaces: Vec<String>,
    /// Interface for VIP addresses; `None` disables VIP management.
    pub vip_iface: Option<String>,
    /// The state dir, where the VIPs loxi adds are recorded so a restart after a crash adopts
    /// them (`crate::netlink::VipManager::record_file`); `None`: not recorded, and VIPs left
    /// by a killed daemon stay on the interface.
    pub vip_state_dir: Option<std::path::PathBuf>,
    /// How often per-CPU counters are folded into the metrics.
    pub stats_interval: Duration,
    /// Skip native mode and attach generic XDP.
    pub force_generic: bool,
}

impl L4Args {
    /// Whether any interface carries the data path (`--xdp-iface` or `--tc-iface`).
    pub fn datapath_on(&self) -> bool {
        !self.xdp_iface.is_empty() || !self.tc_iface.is_empty()
    }

    /// The usage error for an interface named in both `--xdp-iface` and `--tc-iface` (its
    /// frames would run the data path twice: XDP first, then TC on the rewritten frame).
    /// An interface named twice in one of the lists is one too (the second attach would fail
    /// with the kernel's "File exists"), and so is the loopback interface `lo` in either list
    /// ([`LOOPBACK_REFUSED`]).
    pub fn check(&self) -> Result<(), String> {
        for (flag, list) in [
            ("--xdp-iface", &self.xdp_iface),
            ("--tc-iface", &self.tc_iface),
        ] {
            if list.iter().any(|i| i == "lo") {
                return Err(format!("{flag} lo: {LOOPBACK_REFUSED}"));
            }
            if let Some((_, i)) = list
                .iter()
                .enumerate()
                .find(|(n, i)| list[..*n].contains(i))
            {
                return Err(format!(
                    "interface {i} is named twice in {flag}; name it once"
                ));
            }
        }
        match self.tc_iface.iter().find(|i| self.xdp_iface.contains(i)) {
            Some(i) => Err(format!(
                "interface {i} is named in both --xdp-iface and --tc-iface; \
                 the data path runs on one hook per interface: keep one of the two"
            )),
            None => Ok(()),
        }
    }
}

impl From<&L4Args> for L4Config {
    fn from(a: &L4Args) -> Self {
        Self {
            xdp_ifaces: a.xdp_iface.clone(),
            tc_ifaces: a.tc_iface.clone(),
            vip_iface: Some(a.vip_iface.clone()),
            vip_state_dir: None,
            stats_interval: Duration::from_secs(1),
            force_generic: a.xdp_generic,
        }
    }
}
