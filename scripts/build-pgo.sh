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
# minutes on 2 cores the first time (two builds of the dependencies), ~10 when the sources
# changed (the optimized build is redone for the new profile).
# Reuse: the build is keyed by a hash of its inputs (the workspace's sources, manifests and
# lock file, this script and its helpers, PGO_SECONDS, rustc's version); when the key of the
# last build matches and its binaries are there, they are reused without training again.
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
for cmd in wrk curl python3 rustup; do
  command -v "$cmd" >/dev/null || { echo "build-pgo: $cmd missing (run scripts/setup.sh)" >&2; exit 1; }
done
HOST=$(rustc -vV | sed -n 's/^host: //p')
PROFDATA="$(rustc --print sysroot)/lib/rustlib/$HOST/bin/llvm-profdata"
if [ ! -x "$PROFDATA" ]; then
  echo "build-pgo: rustup component add llvm-tools" >&2
  rustup component add llvm-tools >&2
fi
[[ "${PGO_FRESH:-0}" =~ ^[01]$ ]] || { echo "build-pgo: PGO_FRESH must be 0 or 1" >&2; exit 2; }
TARGET=${CARGO_TARGET_DIR:-$LOXI_ROOT/target}
DATA="$TARGET/pgo-data"
OUT="$TARGET/pgo/$HOST/dist"
# The inputs' key: every file of the workspace's crates (loxi-ebpf's too: build.rs embeds it),
# the manifests and lock file, this script, its helpers, PGO_SECONDS and the compiler.
key=$( {
  find loxi-common loxi-user loxi-ebpf tests -type f -not -path '*/target/*' -print0 \
    | sort -z | xargs -0 sha256sum
  sha256sum Cargo.toml Cargo.lock scripts/build-pgo.sh scripts/lib/loopback.sh scripts/lib/paths.sh
  echo "seconds=$SECS"
  rustc -vV
} | sha256sum | cut -c1-16)
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
echo "$key" >"$OUT/pgo.key"
echo "$OUT"
