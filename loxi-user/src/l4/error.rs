//! Errors of the L4 layer.
use thiserror::Error;

/// Everything that can go wrong loading, attaching or programming the XDP data path.
#[derive(Debug, Error)]
pub enum L4Error {
    /// `loxi-user` was built without the eBPF toolchain, so the embedded object is empty.
    #[error(
        "the XDP object is empty: loxi was built without the eBPF toolchain (run ../shared/scripts/setup-ebpf-toolchain.sh and rebuild)"
    )]
    NoObject,
    /// The kernel or aya refused the object (verifier, map creation, BTF).
    #[error("loading the XDP object: {0}")]
    Load(#[source] Box<aya::EbpfError>),
    /// A program-level failure (load, attach, detach, test run).
    #[error("XDP program {action}: {source}")]
    Program {
        /// What was being done (e.g. `attach to eth0`).
        action: String,
        /// aya's error.
        #[source]
        source: Box<aya::programs::ProgramError>,
    },
    /// A map is missing from the object or an update failed.
    #[error("map {map}: {source}")]
    Map {
        /// Map name (`loxi_common::maps::MAP_*`).
        map: &'static str,
        /// aya's error (a device map's insert has its own error type, which wraps the others).
        #[source]
        source: Box<aya::maps::xdp::XdpMapError>,
    },
    /// A map named in `loxi_common::maps` is not in the object.
    #[error("map {0} not found in the XDP object")]
    MissingMap(&'static str),
    /// The program is not in the object.
    #[error("program {0} not found in the XDP object")]
    MissingProgram(&'static str),
    /// An interface named by `--xdp-iface` or `--tc-iface` does not exist.
    #[error("interface {0:?} does not exist (--xdp-iface / --tc-iface)")]
    NoInterface(String),
    /// `--tc-iface` names an interface that already carries loxi's TC data path from another
    /// process (another loxilb).
    #[error(
        "interface {iface:?} already carries loxi's TC data path (program id {prog_id}): another \
         loxilb serves it; stop that one first (two would both run, and the first one's rules \
         would win)"
    )]
    TcTaken {
        /// The interface.
        iface: String,
        /// The kernel's id of the program already attached.
        prog_id: u32,
    },
    /// VIP management over netlink failed.
    #[error(transparent)]
    Netlink(#[from] crate::netlink::NetlinkError),
    /// More rules or endpoints than the data path holds.
    #[error("{what}: {value} exceeds the data path limit {limit}")]
    Capacity {
        /// Which limit (`rules`, `endpoints of rule N`).
        what: String,
        /// Requested.
        value: usize,
        /// Allowed (`loxi_common::maps::MAX_RULES` / `MAX_EPS`).
        limit: u32,
    },
}

impl L4Error {
    pub(crate) fn map(map: &'static str, e: impl Into<aya::maps::xdp::XdpMapError>) -> Self {
        Self::Map {
            map,
            source: Box::new(e.into()),
        }
    }
    pub(crate) fn program(action: impl Into<String>, e: aya::programs::ProgramError) -> Self {
        Self::Program {
            action: action.into(),
            source: Box::new(e),
        }
    }
}
