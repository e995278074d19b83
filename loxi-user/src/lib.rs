//! loxi userspace: control plane, fullproxy and KV-aware routing.
//!
//! See `../shared/DESIGN.md` for the architecture. Module map: [`rules`] (model, validation,
//! store, persistence), [`routing`] (selectors and shared selection vocabulary), [`proxy`]
//! (mode-4 fullproxy), [`kv`] (KV-cache-aware tier 1.5), [`config`] (flags and environment),
//! [`api`] (REST), [`metrics`] (registry), [`app`] (the daemon), [`cli`] (`loxicmd`),
//! [`l4`] (the XDP data path's loader and map reconciliation), [`netlink`] (VIP addresses),
//! [`telemetry`] (log format and OpenTelemetry traces).
pub mod api;
pub mod app;
pub mod cli;
pub mod config;
pub mod health;
pub mod kv;
pub mod l4;
pub mod listen;
pub mod metrics;
pub mod netlink;
pub mod proxy;
pub mod routing;
pub mod rules;
pub mod telemetry;
