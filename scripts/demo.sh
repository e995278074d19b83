#!/usr/bin/env bash
# The README's main job: how much TTFT does KV-aware routing win over round-robin and CHWBL?
#
#   scripts/demo.sh [--out DIR]
#
# Runs the idempotent setup (apt/pip packages, toolchains, release build), then starts four
# vllm-sim workers (8B-on-H200 timing profile, the tiny model's real tokenizer) and, per policy,
# loxilb with a temporary state directory and one rule created with loxicmd (rr, chwbl, and
# kvExactMode 3 = KV-aware). It replays the same two-minute shared-prefix workload (8 system
# prompts x 3,072 tokens, 128-token questions, Poisson arrivals at 20/s), time-scaled 0.125
# (15 s per policy, under a minute for all three), through each,
# prints the comparison table and writes DIR/summary.json, DIR/chart.png, DIR/results.md and the
# metrics scraped after each policy. Every process started is stopped on exit.
# (LOXI_SETUP_BUILD=0 LOXI_BIN_DIR=target/debug: skip the release build and use other binaries.)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT="$ROOT/target/demo"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --out=*) OUT=${1#--out=}; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "demo.sh: unknown flag $1 (only --out DIR)" >&2; exit 2 ;;
  esac
done

echo "[demo] setup (idempotent; the first run builds the release binaries)" >&2
bash scripts/setup.sh
echo "[demo] running rr, chwbl and kv over 4 vllm-sim workers; output in $OUT" >&2
LOXI_BENCH_SKIP_SETUP=1 exec bash scripts/bench-routing.sh --out "$OUT" \
  --workload a --policies rr,chwbl,kv --workers 4 \
  --groups 8 --system-tokens 3072 --question-tokens 128 --output-tokens 32 \
  --qps 20 --duration 120 --time-scale 0.125 --seed 1
