//! Test support for loxi's integration tests: the daemon harness ([`harness`]), a loopback HTTP client ([`http`]), real test
//! backends ([`backend`]), real pyzmq KV-event publishers ([`kv_pub`]), the KV tests' shared
//! steps ([`kv`]), `vllm-sim` engine processes ([`sim`]), LoxiLB client fixtures replayed over raw sockets ([`loxilb_clients`]), the real-vLLM tests' helpers ([`real_engine`]) and
//! test certificates ([`tls`]). The `vllm-sim` and
//! `loxi-bench` crates use it for their own tests too.

pub mod backend;
pub mod harness;
pub mod http;
pub mod kv;
pub mod kv_pub;
pub mod loxilb_clients;
pub mod real_engine;
pub mod sim;
pub mod tls;

/// The `shared/` directory beside the checkout (golden files, spec, scripts): `$LOXI_SHARED`
/// if set, else `<repo>/../shared`, where CI puts it.
pub fn shared_dir() -> std::path::PathBuf {
    std::env::var_os("LOXI_SHARED")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared"))
}
