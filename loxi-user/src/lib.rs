//! loxi userspace: control plane, fullproxy and KV-aware routing.
//!
//! See `../shared/DESIGN.md` for the architecture. Module map: [`rules`] (model, validation,
//! store, persistence), [`routing`] (selectors and shared selection vocabulary), [`proxy`]
//! (mode-4 fullproxy), [`kv`] (KV-cache-aware tier 1.5).
pub mod kv;
pub mod l4;
pub mod netlink;
pub mod proxy;
pub mod routing;
pub mod rules;
