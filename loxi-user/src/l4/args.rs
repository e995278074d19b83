//! Command-line flags of the L4 data path (flattened into the daemon's flags).
use std::time::Duration;

/// `--xdp-iface` / `--vip-iface`, as LoxiLB's daemon takes them.
#[derive(Debug, Clone, clap::Args)]
pub struct L4Args {
    /// Interface to attach the XDP data path to (repeatable). None: the L4 data path is off and
    /// modes other than 4 are not served.
    #[arg(long = "xdp-iface", value_name = "IFACE")]
    pub xdp_iface: Vec<String>,
    /// Interface that gets each rule's VIP as a /32 (/128) address.
    #[arg(long = "vip-iface", value_name = "IFACE", default_value = "lo")]
    pub vip_iface: String,
    /// Attach in generic (skb) mode even where native XDP is available (benchmarks, odd drivers).
    /// It applies to the `--xdp-iface` interfaces, so without one it is a usage error.
    #[arg(long = "xdp-generic", requires = "xdp_iface")]
    pub xdp_generic: bool,
}

/// Runtime configuration of [`crate::l4::run`].
#[derive(Debug, Clone)]
pub struct L4Config {
    /// Interfaces to attach to (may be empty: then only VIPs are managed).
    pub xdp_ifaces: Vec<String>,
    /// Interface for VIP addresses; `None` disables VIP management.
    pub vip_iface: Option<String>,
    /// How often per-CPU counters are folded into the metrics.
    pub stats_interval: Duration,
    /// Skip native mode and attach generic XDP.
    pub force_generic: bool,
}

impl From<&L4Args> for L4Config {
    fn from(a: &L4Args) -> Self {
        Self {
            xdp_ifaces: a.xdp_iface.clone(),
            vip_iface: Some(a.vip_iface.clone()),
            stats_interval: Duration::from_secs(1),
            force_generic: a.xdp_generic,
        }
    }
}
