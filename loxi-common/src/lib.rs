//! Types shared between loxi's userspace and its kernel-side programs.
//!
//! `#![no_std]` so the eBPF crate can depend on it. Everything here is plain data with a fixed
//! layout; userspace-only conveniences sit behind the `user` feature.
#![no_std]

/// Load-balancer NAT/proxy modes, as the `mode` field of a LoxiLB rule (`serviceArguments.mode`).
pub mod mode {
    /// Destination NAT.
    pub const DNAT: u8 = 0;
    /// One-arm.
    pub const ONEARM: u8 = 1;
    /// Full NAT (source rewritten to the LB's address).
    pub const FULLNAT: u8 = 2;
    /// Direct server return.
    pub const DSR: u8 = 3;
    /// Userspace L7 full proxy (all AI features).
    pub const FULLPROXY: u8 = 4;
    /// Host one-arm.
    pub const HOSTONEARM: u8 = 5;
}

/// Endpoint selector numbers, as the `sel` field of a LoxiLB rule.
pub mod sel {
    /// Round-robin.
    pub const RR: u8 = 0;
    /// Static tuple hash.
    pub const HASH: u8 = 1;
    /// Weighted round-robin.
    pub const WRR: u8 = 2;
    /// Persist (session affinity).
    pub const PERSIST: u8 = 3;
    /// Least connections.
    pub const LC: u8 = 4;
    /// Userspace SCTP N2 selector (accepted, fullproxy only).
    pub const N2: u8 = 5;
    /// N3 selector (UDP only).
    pub const N3: u8 = 6;
    /// Consistent hash with bounded loads.
    pub const CHWBL: u8 = 8;
    /// GPU-aware (plain pool: prefix or session hash modulo healthy endpoints).
    pub const GPU_AWARE: u8 = 9;
    /// Weighted consistent hash.
    pub const WRR_HASH: u8 = 10;
}

pub mod maps;
