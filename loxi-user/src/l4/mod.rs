//! L4 data path, userspace side: loads the XDP program built from `loxi-ebpf`, attaches it to
//! the `--xdp-iface` interfaces (native, falling back to generic), keeps its maps in step with
//! the rule store and exports its per-CPU counters as Prometheus metrics.
//!
//! Entry point: [`run`]. Rules in modes 0/1/2/3/5 are served in the kernel; mode 4 (fullproxy)
//! and everything else is passed to the kernel stack by the program.
mod args;
mod datapath;
mod error;
pub(crate) mod metrics;
mod object;
pub(crate) mod plan;
mod run;

#[cfg(test)]
mod testing;

pub use args::{L4Args, L4Config};
pub use datapath::{AttachMode, Datapath};
pub use error::L4Error;
pub use metrics::L4Metrics;
pub use object::object_bytes;
pub use plan::{Plan, PlannedService, SlotTable, plan, route_source};
pub use run::run;
