//! Builds the XDP program (`../loxi-ebpf`) with the pinned nightly through aya-build and puts the
//! object at `$OUT_DIR/loxi`. Without the eBPF toolchain an empty object is written and a warning
//! printed (the L4 loader then reports a clear error); `LOXI_REQUIRE_EBPF=1` (CI) makes that a
//! build failure instead.
use std::{env, fs, path::PathBuf};

use anyhow::{Context as _, anyhow};

/// Nightly toolchain the eBPF crate is built with (see `../shared/scripts/setup-ebpf-toolchain.sh`).
const EBPF_TOOLCHAIN: &str = "nightly-2026-05-20";

/// Makes the nested cargo that aya-build runs quiet (`term.quiet`, through the environment it
/// inherits). aya-build 0.2.0 relays every stderr line of that cargo as a `cargo:warning`, and
/// cargo replays a build script's warnings on each later build, even a no-op one, so its
/// `Compiling ...` / `Finished ...` status lines showed on every `cargo build`. Quiet drops only
/// status lines: errors still reach stderr (relayed), compiler diagnostics come through the JSON
/// stream aya-build relays as well, and a failed build is still an error of this script.
/// `term.verbose` is set to false alongside (cargo refuses both set, e.g. `verbose = true` in a
/// user's config); an explicit `CARGO_TERM_VERBOSE` in the environment is left as it is and
/// keeps the output.
fn quiet_nested_cargo() {
    if env::var_os("CARGO_TERM_VERBOSE").is_some() {
        return;
    }
    // SAFETY: a build script is single-threaded until aya-build spawns its threads, after this;
    // nothing reads the environment concurrently.
    #[allow(
        unsafe_code,
        reason = "env::set_var before any thread exists; aya-build takes no arguments for the nested cargo"
    )]
    unsafe {
        env::set_var("CARGO_TERM_QUIET", "true");
        env::set_var("CARGO_TERM_VERBOSE", "false");
    }
}

fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-env-changed=LOXI_REQUIRE_EBPF");
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").context("CARGO_MANIFEST_DIR")?);
    let ebpf_dir = manifest
        .join("../loxi-ebpf")
        .canonicalize()
        .context("loxi-ebpf dir")?;
    let common_dir = manifest
        .join("../loxi-common")
        .canonicalize()
        .context("loxi-common dir")?;
    println!("cargo:rerun-if-changed={}", common_dir.display());
    let out = PathBuf::from(env::var("OUT_DIR").context("OUT_DIR")?).join("loxi");
    let require = env::var("LOXI_REQUIRE_EBPF").is_ok_and(|v| v == "1");
    // loxi-ebpf is its own workspace (excluded from ours): run its cargo from its directory.
    env::set_current_dir(&ebpf_dir).context("chdir loxi-ebpf")?;
    quiet_nested_cargo();
    let root = ebpf_dir.to_str().ok_or_else(|| anyhow!("non-UTF-8 path"))?;
    let pkg = aya_build::Package {
        name: "loxi-ebpf",
        root_dir: root,
        ..Default::default()
    };
    match aya_build::build_ebpf([pkg], aya_build::Toolchain::Custom(EBPF_TOOLCHAIN)) {
        Ok(()) => Ok(()),
        Err(e) if !require => {
            println!(
                "cargo:warning=eBPF program not built ({e:#}); writing an empty object. Run ../shared/scripts/setup-ebpf-toolchain.sh"
            );
            fs::write(&out, []).context("write empty object")?;
            Ok(())
        }
        Err(e) => Err(e.context("building loxi-ebpf (LOXI_REQUIRE_EBPF=1)")),
    }
}
