//! The XDP object embedded at build time (`loxi-user/build.rs` → `$OUT_DIR/loxi`).

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/loxi"));

/// The ELF object of the XDP program; empty if the build had no eBPF toolchain.
pub fn object_bytes() -> &'static [u8] {
    OBJECT
}
