#!/usr/bin/env bash
# Builds the loxi container image (./Containerfile) with podman, without any image registry:
#   1. a Debian bookworm `minbase` root filesystem made with debootstrap from Debian's package
#      mirror, cached as a tarball under $LOXI_CACHE (default ~/.cache/loxi) keyed by a hash of
#      its inputs, and imported once as localhost/loxi-base:<hash> (tagged :bookworm);
#   2. `podman build` of the Containerfile on that base. The build stage runs as a non-root user
#      with this machine's Rust toolchains lent read-only at their own paths (rustup home, cargo's
#      bin dir with bpf-linker, the eBPF LLVM dir: see scripts/setup.sh); its cargo registry and
#      target dir are build cache mounts, so a rebuild compiles only what changed.
# Usage: scripts/container-build.sh [TAG]      (TAG default localhost/loxi:dev)
#   LOXI_CACHE=DIR   where the rootfs tarball is kept
#   LOXI_DEBIAN_MIRROR=URL   (default http://deb.debian.org/debian)
#   PGO_SECONDS=6    training seconds per request shape of the image's profile-guided build
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=${1:-localhost/loxi:dev}
CACHE=${LOXI_CACHE:-$HOME/.cache/loxi}
MIRROR=${LOXI_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
log() { printf '[container-build] %s\n' "$*" >&2; }
# The profile-guided build's training seconds per request shape (scripts/build-pgo.sh).
PGO_SECS=${PGO_SECONDS:-6}
[[ "$PGO_SECS" =~ ^[1-9][0-9]*$ ]] || { log "PGO_SECONDS must be a positive integer"; exit 2; }
# shellcheck source=scripts/container-env.sh
. "$(dirname "$0")/container-env.sh"
for t in podman debootstrap; do
  command -v "$t" >/dev/null || { log "$t not found (scripts/setup.sh installs it)"; exit 1; }
done

# --- 1. base image from debootstrap (cached) ---------------------------------------------------
# Hash of everything that shapes the rootfs; a change makes a new tarball and image tag.
rootfs_inputs="suite=$SUITE variant=minbase mirror=$MIRROR include=ca-certificates v=1"
key=$(printf '%s' "$rootfs_inputs" | sha256sum | cut -c1-16)
base="localhost/loxi-base:$key"
if ! "${PODMAN[@]}" image exists "$base"; then
  tarball="$CACHE/rootfs-$SUITE-$key.tar"
  if [ ! -s "$tarball" ]; then
    mkdir -p "$CACHE"
    dir=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    trap 'rm -rf "$dir"' EXIT
    log "debootstrap $SUITE (minbase) from $MIRROR (one time; cached in $tarball)"
    t0=$(date +%s)
    debootstrap --variant=minbase --include=ca-certificates "$SUITE" "$dir" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
      || { log "debootstrap failed; see $CACHE/debootstrap.log"; tail -20 "$CACHE/debootstrap.log" >&2; exit 1; }
    # Smaller image: no apt lists, caches, docs or man pages.
    rm -rf "$dir"/var/lib/apt/lists/* "$dir"/var/cache/apt/*.bin "$dir"/var/cache/apt/archives/*.deb \
      "$dir"/usr/share/doc/* "$dir"/usr/share/man/* "$dir"/usr/share/info/*
    tar -C "$dir" --numeric-owner -cf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
    rm -rf "$dir"; trap - EXIT
    log "rootfs ready in $(( $(date +%s) - t0 )) s ($(du -h "$tarball" | cut -f1))"
  fi
  log "podman import $tarball -> $base"
  "${PODMAN[@]}" import --change 'CMD ["/bin/bash"]' "$tarball" "$base" >/dev/null
fi
"${PODMAN[@]}" tag "$base" "localhost/loxi-base:$SUITE"

# --- 2. the image ----------------------------------------------------------------------------
RUSTUP_HOME_DIR=${RUSTUP_HOME:-$HOME/.rustup}
CARGO_BIN_DIR=${CARGO_HOME:-$HOME/.cargo}/bin
EBPF_DIR=${EBPF_TOOLS_DIR:-$HOME/.local/share/ebpf-toolchain}
for d in "$RUSTUP_HOME_DIR" "$CARGO_BIN_DIR" "$EBPF_DIR"; do
  [ -d "$d" ] || { log "$d missing: run scripts/setup.sh first (it installs the toolchains)"; exit 1; }
done
# The image's profile-guided build (scripts/build-pgo.sh) merges its profile with llvm-profdata
# from the toolchain the build stage runs (rustup's default: no override there), which it sees
# read-only: add the llvm-tools component to that toolchain here.
toolchain=$(env -u RUSTUP_TOOLCHAIN "$CARGO_BIN_DIR/rustup" default | awk '{print $1}')
if ! "$CARGO_BIN_DIR/rustup" component list --installed --toolchain "$toolchain" 2>/dev/null | grep -q '^llvm-tools'; then
  log "rustup component add llvm-tools --toolchain $toolchain (llvm-profdata for the profile-guided build)"
  "$CARGO_BIN_DIR/rustup" component add llvm-tools --toolchain "$toolchain" >&2
fi
# The build downloads crates: trust the same CAs as this machine (a TLS-inspecting proxy's CA
# lives in the host bundle, not in the fresh Debian one).
CA=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}
ca_args=()
[ -f "$CA" ] && ca_args=(-v "$CA:/run/host-ca.crt:ro" --build-arg HOST_CA=/run/host-ca.crt)
log "podman build -t $TAG (base $base)"
t0=$(date +%s)
"${PODMAN[@]}" build --format docker --network host "${ULIMITS[@]}" \
  --build-arg BASE_IMAGE="$base" \
  --build-arg RUSTUP_HOME="$RUSTUP_HOME_DIR" --build-arg RUST_BIN="$CARGO_BIN_DIR" \
  --build-arg PGO_SECONDS="$PGO_SECS" \
  -v "$RUSTUP_HOME_DIR:$RUSTUP_HOME_DIR:ro" -v "$CARGO_BIN_DIR:$CARGO_BIN_DIR:ro" \
  -v "$EBPF_DIR:$EBPF_DIR:ro" "${ca_args[@]}" \
  -f Containerfile -t "$TAG" .
log "built $TAG in $(( $(date +%s) - t0 )) s"
