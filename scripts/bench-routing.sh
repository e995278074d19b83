#!/usr/bin/env bash
# Routing-quality benchmark (issue 4): the same seeded workload through round-robin, CHWBL and
# loxi's KV-aware routing (and, with --peers, vllm-router 0.1.17 / sglang-router 0.3.2 from PyPI)
# over N vllm-sim workers; writes summary.json, results.md, report.json and chart.png.
# `--policies rr,kv,pd,pd-kv,pd-trie` adds prefill/decode disaggregation: the same workers, half of them
# prefill and half decode (the fleet runs vllm-sim --kv-role both; pd-kv adds kvExactMode 1,
# pd-trie adds pd_cache_aware_mode: tier 1, the prefix trie).
#
#   scripts/bench-routing.sh [--out DIR] [--peers] [--workload a|b|c|burst[,..]] [--cpu-hog N]
#                            [bench-routing flags]
#
# --cpu-hog N keeps N CPUs busy with `stress-ng --cpu N` for the whole run (issue 9 §2: the KV
# tier's decision budget, LOXI_KV_DECISION_BUDGET_MS, must hold under CPU pressure; compare
# the kv policy's added p99 with rr's in the same run).
# --engines real-vllm runs REAL vLLM CPU 0.32 engines instead of vllm-sim (issue 13; opt-in, not
# in CI): ../shared/scripts/real-vllm-cpu.sh --install-only installs them first (idempotent; ~3 GB
# and minutes on first use). E.g. the issue's setup, loxi's laws and the peers at concurrency 4:
#   scripts/bench-routing.sh --engines real-vllm --workers 3 --block-size 32 --num-gpu-blocks 30 \
#     --workload a --groups 6 --system-tokens 320 --question-tokens 48 --qps 48 --duration 1 \
#     --arrival fixed --concurrency 4 --policies rr,kv --laws work,off --peers
# Every other flag goes to target/release/bench-routing (see `--help`): --policies, --laws,
# --qps, --duration, --time-scale, --workers, --num-gpu-blocks, --trace FILE, --replicas N, ...
# Builds the release binaries through the idempotent scripts/setup.sh first
# (LOXI_BENCH_SKIP_SETUP=1 skips it; LOXI_SETUP_BUILD=0 skips only its build).
# Binaries: LOXI_BIN_DIR, else CARGO_TARGET_DIR/release (target/release); the tiny model from
# shared/ (../shared beside the checkout, or LOXI_SHARED) unless --model-dir is given.
# Every process started is stopped on exit.
set -euo pipefail
# CARGO_TARGET_DIR, LOXI_BIN_DIR, LOXI_SHARED made absolute; bin_dir, shared_dir, need_value.
# shellcheck source=lib/paths.sh
. "$(dirname "$0")/lib/paths.sh"
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT="$ROOT/target/bench-routing/$(date +%Y%m%d-%H%M%S)"
ARGS=()
HOG=0
ENGINES=sim
MODEL_DIR=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) need_value bench-routing.sh "$1" $# "${2:-}"; OUT=$2; shift 2 ;;
    --out=*) OUT=${1#--out=}; shift ;;
    --cpu-hog) need_value bench-routing.sh "$1" $# "${2:-}"; HOG=$2; shift 2 ;;
    --cpu-hog=*) HOG=${1#--cpu-hog=}; shift ;;
    -h|--help) awk 'NR > 1 { if (!/^#/) exit; print }' "$0"; exit 0 ;; # the header comment
    --engines) need_value bench-routing.sh "$1" $# "${2:-}"; ENGINES=$2; ARGS+=("$1" "$2"); shift 2 ;;
    --engines=*) ENGINES=${1#--engines=}; ARGS+=("$1"); shift ;;
    --model-dir|--model-dir=*) MODEL_DIR=1; ARGS+=("$1"); shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
[ "$MODEL_DIR" = 1 ] || require_golden_tokenizer bench-routing.sh
# The benchmark binary reads shared/ from here too (its own default is the checkout it was
# built from).
LOXI_SHARED=$(shared_dir)
export LOXI_SHARED

if [ "${LOXI_BENCH_SKIP_SETUP:-0}" != 1 ]; then
  bash scripts/setup.sh
fi
BIN=$(bin_dir)   # LOXI_BIN_DIR (other builds, e.g. target/debug), else CARGO_TARGET_DIR/release
for b in bench-routing vllm-sim loxilb loxicmd; do
  [ -x "$BIN/$b" ] || { echo "bench-routing.sh: $BIN/$b missing (setup failed?)" >&2; exit 1; }
done
if [ "$ENGINES" = real-vllm ]; then
  bash "$LOXI_SHARED/scripts/real-vllm-cpu.sh" --install-only
fi
if [ "$HOG" != 0 ]; then
  command -v stress-ng >/dev/null || { echo "bench-routing.sh: --cpu-hog needs stress-ng (setup.sh installs it)" >&2; exit 1; }
fi
mkdir -p "$OUT/bin"
# Private copies: another build in this tree may replace target/release/* during the run.
cp "$BIN"/{bench-routing,vllm-sim,loxilb,loxicmd} "$OUT/bin/"

# The benchmark runs in its own process group; on any exit the whole group is stopped.
pid=""
hog=""
cleanup() {
  if [ -n "$hog" ]; then kill "$hog" 2>/dev/null || true; wait "$hog" 2>/dev/null || true; fi
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || true
    sleep 1
    kill -KILL -- "-$pid" 2>/dev/null || true
  fi
  # Real engines run in their own process groups (bench-routing stops them; this catches a
  # bench-routing that was killed outright).
  if [ -f "$OUT/logs/real-vllm-pgids" ]; then
    while read -r g; do
      [ -n "$g" ] && kill -KILL -- "-$g" 2>/dev/null || true
    done < "$OUT/logs/real-vllm-pgids"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
if [ "$HOG" != 0 ]; then
  echo "bench-routing.sh: stress-ng --cpu $HOG for the whole run" >&2
  stress-ng --cpu "$HOG" --timeout 3600s --quiet &
  hog=$!
fi
setsid "$OUT/bin/bench-routing" --bin-dir "$OUT/bin" --out "$OUT" "${ARGS[@]}" &
pid=$!
wait "$pid"
