#!/usr/bin/env bash
# The README's main job: how much TTFT does KV-aware routing win over round robin and CHWBL
# at a load where round robin queues?
#
#   scripts/demo.sh [--out DIR] [--no-peers]
#
# Runs the idempotent setup (apt/pip packages, toolchains, release build), then starts four
# vllm-sim workers (8B-on-H200 timing profile, the tiny model's real tokenizer, each caching
# about half of the working set) and, per policy, loxilb with a temporary state directory and one
# rule created with loxicmd (rr, chwbl, and kvExactMode 3 = KV-aware). It replays the same
# shared-prefix workload (8 system prompts x 3,072 tokens, 128-token questions, 32 output
# tokens, Poisson arrivals at 30/s for 40 simulated s: 1,200 requests; round robin's prefill
# queues build up at this rate, the affinity policies' do not), time-scaled 0.5 (about 20 s per
# policy). When the peer routers (vllm-router, sglang-router) are installed in the benchmark's
# venv (scripts/bench-routing.sh --peers installs them), they run too; otherwise a line says
# they are skipped. Prints the table and one verdict line per policy (TTFT p99 against round
# robin, hit rate against the oracle bound) and writes DIR/summary.json, DIR/chart.png,
# DIR/results.md and the metrics scraped after each policy. Every process started is stopped.
# (LOXI_SETUP_BUILD=0 LOXI_BIN_DIR=target/debug: skip the release build and use other binaries.)
# Needs the shared/ directory (the tiny model's tokenizer in golden/): ../shared beside the
# checkout, or LOXI_SHARED=DIR; a missing one is reported before anything else runs.
set -euo pipefail
# CARGO_TARGET_DIR, LOXI_BIN_DIR, LOXI_SHARED made absolute; shared_dir, require_golden_tokenizer.
# shellcheck source=lib/paths.sh
. "$(dirname "$0")/lib/paths.sh"
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT="$ROOT/target/demo"
PEERS=1
while [ $# -gt 0 ]; do
  case "$1" in
    --out) need_value demo.sh "$1" $# "${2:-}"; OUT=$2; shift 2 ;;
    --out=*) OUT=${1#--out=}; shift ;;
    --no-peers) PEERS=0; shift ;;
    -h|--help) awk 'NR > 1 { if (!/^#/) exit; print }' "$0"; exit 0 ;; # the header comment
    *) echo "demo.sh: unknown flag $1 (only --out DIR, --no-peers)" >&2; exit 2 ;;
  esac
done

require_golden_tokenizer demo.sh
# The benchmark reads the tokenizer from the same directory (its own default is the checkout
# it was built from).
LOXI_SHARED=$(shared_dir)
export LOXI_SHARED
echo "[demo] setup (idempotent; the first run builds the release binaries)" >&2
bash scripts/setup.sh

# The peers are included only when already installed: installing them takes minutes.
VENV="${XDG_CACHE_HOME:-$HOME/.cache}/loxi-bench/venv"
PEER_ARGS=()
if [ "$PEERS" = 0 ]; then
  echo "[demo] peers skipped (--no-peers)" >&2
elif [ -x "$VENV/bin/vllm-router" ] && [ -x "$VENV/bin/sglang-router" ]; then
  PEER_ARGS=(--peers --venv "$VENV")
  echo "[demo] peers included: vllm-router and sglang-router from $VENV" >&2
else
  echo "[demo] peers skipped: vllm-router/sglang-router not installed in $VENV (scripts/bench-routing.sh --peers installs them)" >&2
fi

echo "[demo] running rr, chwbl and kv over 4 vllm-sim workers at 30 requests/s; output in $OUT" >&2
LOXI_BENCH_SKIP_SETUP=1 exec bash scripts/bench-routing.sh --out "$OUT" \
  --workload a --policies rr,chwbl,kv --workers 4 \
  --groups 8 --system-tokens 3072 --question-tokens 128 --output-tokens 32 \
  --qps 30 --duration 40 --time-scale 0.5 --seed 1 "${PEER_ARGS[@]}"
