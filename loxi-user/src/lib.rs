//! loxi userspace: control plane, fullproxy and KV-aware routing.
//!
//! See `docs/architecture.md` for the layers and what may import what. Module map:
//! [`request`] (the request vocabulary: metadata, prompt, API kind, session key), [`rules`]
//! (model, validation, typed spec, store, persistence), [`routing`] (selectors, the selection
//! ladder and shared selection vocabulary), [`health`] (probes, breaker), [`proxy`]
//! (mode-4 fullproxy), [`kv`] (KV-cache-aware tier 1.5), [`pd`] (prefill/decode
//! disaggregation: the P/D ladder and handoff), [`config`] (flags and environment),
//! [`api`] (REST), [`metrics`] (registry), [`app`] (the daemon), [`cli`] (`loxicmd`),
//! [`l4`] (the XDP data path's loader and map reconciliation), [`netlink`] (VIP addresses),
//! [`telemetry`] (log format and OpenTelemetry traces).
#![cfg_attr(
    test,
    allow(
        clippy::disallowed_methods,
        reason = "unit tests spawn their own servers and tasks and end them themselves"
    )
)]

pub mod api;
pub mod app;
pub mod certs;
pub mod cli;
pub mod config;
pub mod health;
pub mod kv;
pub mod l4;
pub mod listen;
pub mod metrics;
pub mod netlink;
pub mod pd;
pub mod proxy;
pub mod request;
pub mod routing;
pub mod rules;
pub mod telemetry;
