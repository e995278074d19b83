#!/usr/bin/env bash
# KV-routed requests per loxilb core (issue 17 §2): one loxilb pinned to one CPU (taskset,
# TOKIO_WORKER_THREADS=1, LOXI_KV_TOKENIZE_WORKERS=1, a kvExactMode 3 rule) in front of fast
# vllm-sim engines; a closed-loop client with never-repeated prompts for two mixes (chat: 8
# system prompts x 2,048 tokens + distinct 128-token questions through the chat template;
# distinct: fresh 1,024-token prompts) at rising concurrency. Prints per level req/s, the
# daemon's CPU per request (all its threads, /proc schedstat), requests per core-second, the KV
# stages' time and the added-latency p50/p99, and the ratio to Dynamo's 150 req/s per core.
#
#   scripts/bench-gateway.sh [--out DIR] [bench-gateway flags: --mix, --concurrency,
#                            --level-secs, --p99-ms, --core, --workers, ...]
#
# The client and the engines run on every CPU but the daemon's (taskset), so on a 2-core
# machine the load generator may saturate before the daemon's core does: the per-core figure is
# then read from CPU per request, which does not depend on it. Loopback only; each level is
# bounded by --warmup-secs + --level-secs. Builds through scripts/setup.sh first
# (LOXI_BENCH_SKIP_SETUP=1 skips it). Every process started is stopped on exit.
set -euo pipefail
# CARGO_TARGET_DIR, LOXI_BIN_DIR, LOXI_SHARED made absolute; bin_dir, cargo_release_dir, need_value.
# shellcheck source=lib/paths.sh
. "$(dirname "$0")/lib/paths.sh"
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT="$ROOT/target/bench-gateway/$(date +%Y%m%d-%H%M%S)"
ARGS=()
CORE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) need_value bench-gateway.sh "$1" $# "${2:-}"; OUT=$2; shift 2 ;;
    --out=*) OUT=${1#--out=}; shift ;;
    --core) need_value bench-gateway.sh "$1" $# "${2:-}"; CORE=$2; shift 2 ;;
    --core=*) CORE=${1#--core=}; shift ;;
    -h|--help) awk 'NR > 1 { if (!/^#/) exit; print }' "$0"; exit 0 ;; # the header comment
    *) ARGS+=("$1"); shift ;;
  esac
done
if [ "${LOXI_BENCH_SKIP_SETUP:-0}" != 1 ]; then
  bash scripts/setup.sh
fi
command -v taskset >/dev/null || { echo "bench-gateway.sh: taskset missing (util-linux)" >&2; exit 1; }
BIN=$(bin_dir)
for b in bench-gateway vllm-sim loxilb loxicmd; do
  [ -x "$BIN/$b" ] || { echo "bench-gateway.sh: $BIN/$b missing (setup failed?)" >&2; exit 1; }
done
NCPU=$(nproc --all)
[ -n "$CORE" ] || CORE=$((NCPU - 1))
OTHERS=$(python3 -c "import sys; n,c=int(sys.argv[1]),int(sys.argv[2]); print(','.join(str(i) for i in range(n) if i!=c) or str(c))" "$NCPU" "$CORE")
mkdir -p "$OUT/bin"
cp "$BIN"/{bench-gateway,vllm-sim,loxilb,loxicmd} "$OUT/bin/"
pid=""
cleanup() {
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || true
    sleep 1
    kill -KILL -- "-$pid" 2>/dev/null || true
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
echo "bench-gateway.sh: loxilb on CPU $CORE, client and engines on CPU(s) $OTHERS; output in $OUT" >&2
setsid taskset -c "$OTHERS" "$OUT/bin/bench-gateway" --bin-dir "$OUT/bin" --out "$OUT" --core "$CORE" "${ARGS[@]}" &
pid=$!
wait "$pid"
