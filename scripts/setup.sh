#!/usr/bin/env bash
# Idempotent machine setup for loxi: apt and pip packages, the eBPF toolchain, release build.
# Safe to run repeatedly; each step is skipped when already satisfied.
#   LOXI_SETUP_BUILD=0   skip the cargo build at the end
#   LOXI_SHARED=DIR      where shared/ lives (default: ../shared beside the checkout): its eBPF
#                        toolchain script (without it the XDP programs are not built, warned);
#                        demo.sh and test.sh, which need its golden files, stop without them
#   CARGO_TARGET_DIR     honoured by the build (a relative one is taken from the directory this
#                        script was started in)
set -euo pipefail
# CARGO_TARGET_DIR, LOXI_BIN_DIR, LOXI_SHARED made absolute; shared_dir, require_golden_tokenizer.
# shellcheck source=lib/paths.sh
. "$(dirname "$0")/lib/paths.sh"
cd "$(dirname "$0")/.."
SHARED=$(shared_dir)
export PATH="$HOME/.cargo/bin:$PATH"
log() { printf '[setup] %s\n' "$*" >&2; }
[ -f "$SHARED/golden/tiny-model/tokenizer.json" ] ||
  log "WARNING: $SHARED/golden/tiny-model/tokenizer.json not found: demo.sh and test.sh need shared/ (../shared beside the checkout, or LOXI_SHARED=DIR)"

# --- apt: tools the tests and benchmarks call -------------------------------------------------
# command -> Debian package
declare -A APT=(
  [promtool]=prometheus [wrk]=wrk [nginx]=nginx [ip]=iproute2 [ethtool]=ethtool
  [nft]=nftables [curl]=curl [jq]=jq [ping]=iputils-ping
  # deploy/: systemd-analyze verifies the unit, setpriv runs the daemon with its capabilities;
  # the container image is built with podman (runc) on a debootstrap base (scripts/container-*.sh).
  [systemd-analyze]=systemd [setpriv]=util-linux [podman]=podman [buildah]=buildah
  [debootstrap]=debootstrap [runc]=runc
  # benchmarks' --cpu-hog mode (scripts/bench-routing.sh, scripts/bench-kv-bounds.sh)
  [stress-ng]=stress-ng
  # scripts/bench-proxy-instructions.sh: instructions per request under callgrind
  [valgrind]=valgrind [callgrind_control]=valgrind
  # scripts/bench-xdp-prog.sh: the XDP program's cost by BPF_PROG_TEST_RUN
  [bpftool]=bpftool
)
missing=()
for cmd in "${!APT[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || missing+=("${APT[$cmd]}")
done
# The system interpreter itself (a test runs it as `nobody`, who cannot read a user's pyenv).
[ -x /usr/bin/python3 ] || missing+=(python3)
# The benchmark chart's font (bench/src/chart.rs): DejaVu Sans, found through fontconfig.
command -v fc-match >/dev/null 2>&1 || missing+=(fontconfig)
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || missing+=(fonts-dejavu-core)
if [ ${#missing[@]} -gt 0 ]; then
  log "apt: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # Debian's nginx and prometheus packages may start daemons; tests start their own.
  (service nginx stop || pkill -x nginx || true) >/dev/null 2>&1
  (service prometheus stop || pkill -x prometheus || true) >/dev/null 2>&1
fi

# --- pip: a real ZeroMQ publisher (pyzmq, as vLLM uses) and msgpack for test publishers -------
if ! python3 -c 'import zmq, msgpack' 2>/dev/null; then
  log "pip: installing pyzmq msgpack"
  python3 -m pip install -q --disable-pip-version-check pyzmq msgpack
fi

# --- pip: kubernetes-validate (strict schema checks of deploy/kubernetes; brings PyYAML) -------
if ! python3 -c 'import kubernetes_validate, yaml' 2>/dev/null; then
  log "pip: installing kubernetes-validate"
  python3 -m pip install -q --disable-pip-version-check kubernetes-validate
fi

# --- stable lints (scripts/test.sh runs rustfmt and clippy) -----------------------------------
if ! cargo clippy --version >/dev/null 2>&1 || ! cargo fmt --version >/dev/null 2>&1; then
  log "rustup component add clippy rustfmt"
  rustup component add clippy rustfmt
fi

# --- eBPF toolchain (pinned nightly + bpf-linker), from shared/ ------------------------------
if [ -f "$SHARED/scripts/setup-ebpf-toolchain.sh" ]; then
  bash "$SHARED/scripts/setup-ebpf-toolchain.sh"
else
  log "WARNING: $SHARED/scripts/setup-ebpf-toolchain.sh not found; eBPF programs will not build"
fi

# --- build ------------------------------------------------------------------------------------
if [ "${LOXI_SETUP_BUILD:-1}" = 1 ]; then
  log "cargo build --release"
  cargo build --release --workspace --bins
fi
log "ready"
