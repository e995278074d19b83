//! L4 data path, userspace side: loads the XDP program built from `loxi-ebpf`, attaches it to
//! the `--xdp-iface` interfaces (native, falling back to generic), keeps its maps in step with
//! the rule store and exports its per-CPU counters as Prometheus metrics.
//!
//! Entry point: [`run`]. Rules in modes 0/1/2/3/5 are served in the kernel; mode 4 (fullproxy)
//! and everything else is passed to the kernel stack by the program.
//!
//! Data-path semantics (see `loxi-ebpf/src/`):
//! - mode 0 DNAT: destination rewritten to the endpoint, replies un-NATed to the VIP by the
//!   same program on the interface they arrive on (no TC program needed);
//! - modes 1 one-arm, 2 full-NAT, 5 host one-arm: source also rewritten, to the LB's own
//!   address on the route towards the endpoint ([`route_source`]) and a source port from
//!   32768..60768 chosen by tuple hash with up to 4 probes; replies mapped back;
//! - mode 3 DSR: only MACs rewritten (endpoints own the VIP); replies that pass through are
//!   forwarded unchanged;
//! - selectors: 0 rr (per-CPU cursor), 1 hash (5-tuple), 2 wrr (weight table), 3 persist
//!   (client-address hash), 4 lc (of two candidates the one with fewer open connections);
//! - conntrack: LRU, one entry per direction; RST closes, FIN shortens the idle timeout to
//!   10 s; idle timeout = `inactiveTimeOut` or 300 s TCP / 60 s UDP; a DNAT flow inserts only
//!   its forward entry when its endpoint is listed for its VIP in `LOXI_REPLY_VIP`, and its
//!   reply entry at its first reply ([`reply`]);
//! - forwarding: `bpf_fib_lookup` + `bpf_redirect`/`XDP_TX` when the egress takes XDP frames,
//!   else the TC hand-off (metadata + `XDP_PASS`, then the TC ingress program on the same
//!   interface redirects the socket buffer): a veth whose peer runs no XDP program drops
//!   redirected XDP frames, so container backends get the TC path ([`egress`]); without a route
//!   or neighbour the rewritten frame goes to the kernel, which forwards it. TTL is not
//!   decremented.
//! - SCTP: ports are parsed, but the CRC32c is not rewritten, so SCTP works in DSR only.

mod args;
pub mod conntrack;
mod datapath;
pub mod egress;
mod error;
pub(crate) mod metrics;
mod neigh;
mod object;
pub(crate) mod plan;
mod reply;
mod run;

#[cfg(test)]
mod testing;

pub use args::{L4Args, L4Config};
pub use conntrack::{CT_LIST_CAP, ConntrackHandle, CtDump};
pub use datapath::{AttachMode, Datapath};
pub use error::L4Error;
pub use metrics::L4Metrics;
pub use object::object_bytes;
pub use plan::{Plan, PlannedService, SlotTable, plan, route_source};
pub use run::run;
