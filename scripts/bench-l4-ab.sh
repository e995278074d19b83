#!/usr/bin/env bash
# New-flow cost of two builds of the XDP program, interleaved: an A/B that separates a change
# from this shared VM's drift (whole `bench-l4.sh` runs minutes apart do not). The method and
# the report are documented in xtask/src/bench_ab.rs (`xtask bench-l4-ab`).
#
#   scripts/bench-l4-ab.sh XTASK_A XTASK_B   (two `xtask` binaries, e.g. `target/release/xtask`
#                                           copied before and after a change: each embeds its
#                                           build's program and loader)
#   BENCH_AB_ROUNDS (default 6)  rounds; each runs both builds (A then B in odd rounds, B then
#                  A in even ones), two floods each
#   BENCH_AB_FLOWS (default 25000) new flows per flood (1..30768: below the conntrack map's
#                  capacity for both floods)
#
# Root only; network namespaces of its own, bounded by the flood sizes.
set -euo pipefail
# shellcheck source=lib/paths.sh
. "$(dirname "$0")/lib/paths.sh"
[ "$(id -u)" = 0 ] || { echo "bench-l4-ab: needs root (network namespaces, XDP)" >&2; exit 1; }
[ $# = 2 ] || { echo "usage: bench-l4-ab.sh XTASK_A XTASK_B" >&2; exit 2; }
XA=$(realpath "$1"); XB=$(realpath "$2")
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
cargo build --release -q -p xtask
exec "$(cargo_release_dir)/xtask" bench-l4-ab "$XA" "$XB" --rounds "${BENCH_AB_ROUNDS:-6}" \
  --flows "${BENCH_AB_FLOWS:-25000}"
