#!/usr/bin/env bash
# Profile-guided build of loxilb and loxicmd: the `dist` profile (fat LTO, see Cargo.toml) plus
# LLVM profile-guided optimization trained on the fullproxy's own request path.
#   1. an instrumented `dist` build of loxilb (CARGO_TARGET_DIR/pgo-gen);
#   2. training: the instrumented loxilb (2 connection workers, mode 4, sel 0) proxies wrk's
#      small, streaming (200 SSE events) and 64 KiB requests to two echo-backends on loopback,
#      PGO_SECONDS each; its SIGTERM exit writes the profile;
#   3. `llvm-profdata merge` (rustup's llvm-tools component, added when missing: the profile
#      format is that of rustc's own LLVM);
#   4. the `dist` build of loxilb and loxicmd with the profile (CARGO_TARGET_DIR/pgo).
# The last line printed is the directory of the two optimized binaries. Loopback only; the
# training is bounded by 3 × PGO_SECONDS. Needs wrk, curl and python3 (scripts/setup.sh); ~18
# minutes on 2 cores the first time (three builds of the dependencies: instrumented, the
# echo-backends' release build, optimized; two when setup.sh's release build is there), ~10
# when the sources changed (the optimized build is redone for the new profile).
# Reuse: the build is keyed by a hash of its inputs (the sources, manifests and lock files of
# the crates loxilb and the training's echo-backend are built from, the cargo configuration
# and CARGO_PROFILE_* / CARGO_BUILD_* variables, this script and the training's helper,
# PGO_SECONDS, rustc's and bpf-linker's versions); when the key of the last build matches and
# its binaries are there, they are reused without training again. One build at a time (a lock
# in the target directory); the key is written only when the inputs did not change during the
# build.
#   PGO_SECONDS=6   seconds of load per request shape
#   PGO_FRESH=1     train and build again even when the key matches
set -euo pipefail
# CARGO_TARGET_DIR, LOXI_BIN_DIR, LOXI_SHARED made absolute; cargo_release_dir.
# shellcheck source=lib/paths.sh
. "$(dirname "$0")/lib/paths.sh"
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
SECS=${PGO_SECONDS:-6}
[[ "$SECS" =~ ^[1-9][0-9]*$ ]] || { echo "build-pgo: PGO_SECONDS must be a positive integer" >&2; exit 2; }
[[ "${PGO_FRESH:-0}" =~ ^[01]$ ]] || { echo "build-pgo: PGO_FRESH must be 0 or 1" >&2; exit 2; }
# The profile flags below go through RUSTFLAGS, which this variable would override.
unset CARGO_ENCODED_RUSTFLAGS
for cmd in wrk curl python3 rustup flock; do
  command -v "$cmd" >/dev/null || { echo "build-pgo: $cmd missing (run scripts/setup.sh)" >&2; exit 1; }
done
HOST=$(rustc -vV | sed -n 's/^host: //p')
PROFDATA="$(rustc --print sysroot)/lib/rustlib/$HOST/bin/llvm-profdata"
if [ ! -x "$PROFDATA" ]; then
  echo "build-pgo: rustup component add llvm-tools" >&2
  rustup component add llvm-tools >&2
fi
TARGET=${CARGO_TARGET_DIR:-$LOXI_ROOT/target}
DATA="$TARGET/pgo-data"
OUT="$TARGET/pgo/$HOST/dist"
mkdir -p "$TARGET"
exec 9>"$TARGET/pgo.lock"
flock 9
# The inputs' key (see the header): loxi-ebpf is built and embedded by loxi-user's build.rs;
# tests/ holds the training's echo-backend.
inputs_key() {
  {
    find loxi-common/src loxi-user/src loxi-ebpf/src tests/src -type f -print0 | sort -z | xargs -0 sha256sum
    sha256sum Cargo.toml Cargo.lock loxi-common/Cargo.toml loxi-user/Cargo.toml loxi-user/build.rs \
      loxi-ebpf/Cargo.toml loxi-ebpf/Cargo.lock tests/Cargo.toml scripts/build-pgo.sh scripts/lib/loopback.sh
    cat .cargo/config.toml "${CARGO_HOME:-$HOME/.cargo}/config.toml" 2>/dev/null || true
    env | grep -E '^CARGO_(PROFILE|BUILD)_' | sort || true
    echo "seconds=$SECS"
    rustc -vV
    bpf-linker --version 2>/dev/null || echo "no bpf-linker"
  } | sha256sum | cut -c1-16
}
key=$(inputs_key)
if [ "${PGO_FRESH:-0}" = 0 ] && [ "$(cat "$OUT/pgo.key" 2>/dev/null)" = "$key" ] \
  && [ -x "$OUT/loxilb" ] && [ -x "$OUT/loxicmd" ]; then
  echo "build-pgo: up to date (inputs' key $key): reusing the last build" >&2
  echo "$OUT"
  exit 0
fi
rm -f "$OUT/pgo.key"
rm -rf "$DATA"
mkdir -p "$DATA"

# --target: RUSTFLAGS then reach the target's crates only, not build scripts and proc macros
# (nor loxi-user/build.rs's nested eBPF build).
echo "build-pgo: instrumented build" >&2
CARGO_TARGET_DIR="$TARGET/pgo-gen" RUSTFLAGS="-Cprofile-generate=$DATA" \
  cargo build --profile dist --target "$HOST" --locked -q -p loxi-user --bin loxilb
cargo build --release -q -p loxi-tests --bin echo-backend

# TMP, PIDS, cleanup on exit, free_port, wait_port.
# shellcheck source=lib/loopback.sh
. scripts/lib/loopback.sh
BIN=$(cargo_release_dir)
echo_backends "$BIN"
API=$(free_port); LB=$(free_port)
TOKIO_WORKER_THREADS=2 "$TARGET/pgo-gen/$HOST/dist/loxilb" --api-addr "127.0.0.1:$API" \
  --state-dir "$TMP/state" --tokenizer-dir "$TMP/tok" --proxy-workers 2 --log warn \
  >"$TMP/loxilb.log" 2>&1 & PIDS+=($!)
LOXI_PID=$!
wait_port "$API" 30
sel0_rule "$API" "$LB" "$B1" "$B2"
wait_port "$LB"
write_wrk_loads
for shape in small sse large; do
  out=$(wrk -t2 -c64 -d"${SECS}s" -s "$TMP/$shape.lua" "http://127.0.0.1:$LB/")
  echo "build-pgo: trained on $shape: $(awk '/requests in/ {print $1}' <<<"$out") requests" >&2
  if grep -q "Non-2xx" <<<"$out"; then
    echo "build-pgo: the $shape training load got errors: $out" >&2
    exit 1
  fi
done
kill -TERM "$LOXI_PID"
wait "$LOXI_PID" || { echo "build-pgo: the instrumented loxilb did not exit cleanly ($TMP/loxilb.log)" >&2; exit 1; }
compgen -G "$DATA/*.profraw" >/dev/null || { echo "build-pgo: no profile written to $DATA" >&2; exit 1; }
"$PROFDATA" merge -o "$DATA/merged.profdata" "$DATA"/*.profraw

echo "build-pgo: optimized build" >&2
CARGO_TARGET_DIR="$TARGET/pgo" RUSTFLAGS="-Cprofile-use=$DATA/merged.profdata" \
  cargo build --profile dist --target "$HOST" --locked -q -p loxi-user --bin loxilb --bin loxicmd
if [ "$(inputs_key)" = "$key" ]; then
  echo "$key" >"$OUT/pgo.key"
else
  echo "build-pgo: the inputs changed during the build: not recorded for reuse" >&2
fi
echo "$OUT"
