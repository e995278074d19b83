#!/usr/bin/env bash
# KV tier work bounds (issue 9 §1, §2): a real loxilb with one kvExactMode-3 round-robin rule
# over two nginx backends (200, bodies discarded) and the golden tiny model's real tokenizer (shared/golden/tiny-model,
# served as "tiny"), then
#   1. flood: ordinary ~2 KB prompts are probed alone, then while N clients each loop 30 MB
#      single-word prompts and N clients loop 400,000-message chats; prints loxilb's peak RSS
#      (sampled from /proc every 20 ms, and VmHWM), the probes' latency alone and under the
#      flood, the flood's statuses and the KV miss reasons counted. The same flood is run
#      against the peer, the same rule without the KV tier (kvExactMode 0, plain round-robin),
#      and the ratio of the probes' added latency (KV / peer) is printed;
#   2. linear: a second loxilb without the token bound and with a 60 s budget tokenizes
#      ordinary prompts of 32 KB … 1000 KB; prints tokenization seconds per byte per size
#      (from loxilb_kv_routing_stage_seconds{stage="Tokenize"}).
#
#   scripts/bench-kv-bounds.sh [--out DIR] [--seconds S] [--conc N] [--cpu-hog N]
#
# --cpu-hog N runs `stress-ng --cpu N` during both phases (the decision budget then shows as
# `budget` misses instead of queueing). Extra daemon environment can be passed as usual
# (e.g. LOXI_KV_DECISION_BUDGET_MS=20 scripts/bench-kv-bounds.sh). Every process started is
# stopped on exit; everything runs on 127.0.0.1 and is bounded in time (~2×S + linear phase).
# LOXI_BENCH_SKIP_SETUP=1 skips scripts/setup.sh (LOXI_BIN_DIR: other builds).
set -euo pipefail
# CARGO_TARGET_DIR, LOXI_BIN_DIR, LOXI_SHARED made absolute; bin_dir, shared_dir, need_value.
# shellcheck source=lib/paths.sh
. "$(dirname "$0")/lib/paths.sh"
cd "$(dirname "$0")/.."
ROOT=$(pwd)
SHARED=$(shared_dir)
OUT="$ROOT/target/bench-kv-bounds/$(date +%Y%m%d-%H%M%S)"
SECONDS_PER_PHASE=15
CONC=8
HOG=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out|--seconds|--conc|--cpu-hog) need_value bench-kv-bounds.sh "$1" $# "${2:-}" ;;&
    --out) OUT=$2; shift 2 ;;
    --seconds) SECONDS_PER_PHASE=$2; shift 2 ;;
    --conc) CONC=$2; shift 2 ;;
    --cpu-hog) HOG=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 { if (!/^#/) exit; print }' "$0"; exit 0 ;; # the header comment
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
if [ "${LOXI_BENCH_SKIP_SETUP:-0}" != 1 ]; then
  bash scripts/setup.sh
fi
BIN=$(bin_dir)
command -v nginx >/dev/null || { echo "bench-kv-bounds.sh: needs nginx (setup.sh installs it)" >&2; exit 1; }
for b in loxilb; do
  [ -x "$BIN/$b" ] || { echo "bench-kv-bounds.sh: $BIN/$b missing (setup.sh builds it)" >&2; exit 1; }
done
if [ "$HOG" != 0 ]; then
  command -v stress-ng >/dev/null || { echo "bench-kv-bounds.sh: --cpu-hog needs stress-ng (setup.sh installs it)" >&2; exit 1; }
fi
mkdir -p "$OUT"
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  cp "$WORK"/*.log "$OUT/" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
mkdir -p "$WORK/tok"
ln -s "$SHARED/golden/tiny-model" "$WORK/tok/tiny"
# Backends: one nginx answering 200 on two ports and discarding bodies, so the flood's 30 MB
# bodies cost the backends nothing and the probes measure loxilb.
B0=$(free_port); B1=$(free_port)
mkdir -p "$WORK/nginx/logs"
cat >"$WORK/nginx/nginx.conf" <<EOF
worker_processes 1;
pid $WORK/nginx/nginx.pid;
error_log $WORK/nginx-error.log warn;
events { worker_connections 1024; }
http {
  access_log off;
  client_max_body_size 64m;
  client_body_temp_path $WORK/nginx/body;
  server {
    listen 127.0.0.1:$B0;
    listen 127.0.0.1:$B1;
    location / { default_type application/json; return 200 '{"ok":true}'; }
  }
}
EOF
nginx -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf" -g 'daemon off;' & PIDS+=($!)

if [ "$HOG" != 0 ]; then
  stress-ng --cpu "$HOG" --timeout 1800s --quiet & PIDS+=($!)
fi

# start_daemon NAME KVMODE [ENV=VALUE...]: sets API, VIP, LPID (a fresh daemon, so its VmHWM is
# its own run's peak).
start_daemon() {
  local name=$1 kvmode=$2 kvargs="" ep0="" ep1=""; shift 2
  if [ "$kvmode" != 0 ]; then
    kvargs=", \"kvExactMode\": $kvmode, \"kvBlockSize\": 16, \"kvHashAlgo\": \"sha256_cbor\""
    # Two engines on one host: each its own KV-event port (nothing publishes there).
    ep0=", \"kvZmqPort\": $(free_port)"; ep1=", \"kvZmqPort\": $(free_port)"
  fi
  API=$(free_port); VIP=$(free_port)
  env "$@" "$BIN/loxilb" --api-addr "127.0.0.1:$API" --state-dir "$WORK/state-$name" \
    --tokenizer-dir "$WORK/tok" --log warn >"$WORK/loxilb-$name.log" 2>&1 & LPID=$!
  PIDS+=("$LPID")
  for _ in $(seq 200); do
    curl -sf "http://127.0.0.1:$API/netlox/v1/config/loadbalancer/all" >/dev/null && break
    sleep 0.1
  done
  curl -sf -X POST "http://127.0.0.1:$API/netlox/v1/config/loadbalancer" \
    -H 'Content-Type: application/json' -d "{
    \"serviceArguments\": {\"externalIP\": \"127.0.0.1\", \"port\": $VIP, \"protocol\": \"tcp\",
      \"mode\": 4, \"sel\": 0 $kvargs},
    \"endpoints\": [{\"endpointIP\": \"127.0.0.1\", \"targetPort\": $B0 $ep0},
                    {\"endpointIP\": \"127.0.0.1\", \"targetPort\": $B1 $ep1}]}" >/dev/null
  for _ in $(seq 200); do
    curl -sf -o /dev/null -X POST "http://127.0.0.1:$VIP/v1/completions" \
      -H 'Content-Type: application/json' -d '{"model":"tiny","prompt":"warm up the tokenizer"}' && return 0
    sleep 0.1
  done
  echo "bench-kv-bounds.sh: $name VIP never answered" >&2; exit 1
}

for kv in 3 0; do
  echo "== flood, kvExactMode $kv: $CONC x 30 MB single-word prompts + $CONC x 400k-message chats, ${SECONDS_PER_PHASE}s (cpu hog: $HOG)" >&2
  start_daemon "flood-kv$kv" "$kv"
  python3 scripts/bench-kv-bounds.py flood --vip "$VIP" --api "$API" --pid "$LPID" \
    --seconds "$SECONDS_PER_PHASE" --conc "$CONC" | tee "$OUT/flood-kv$kv.json"
  kill "$LPID"; wait "$LPID" 2>/dev/null || true
done
python3 - "$OUT" <<'EOF'
import json, sys
kv, peer = (json.load(open(f"{sys.argv[1]}/flood-kv{k}.json")) for k in (3, 0))
def added(r, q):
    return r["probe_under_flood"][q] - r["probe_baseline"][q]
print(f"peak RSS: kvExactMode 3 {kv['vm_hwm_mb']} MB, plain rr (same flood) {peer['vm_hwm_mb']} MB")
for q in ("p50_ms", "p99_ms"):
    a, b = added(kv, q), added(peer, q)
    print(f"probe {q} added by the flood: kvExactMode 3 {a:.1f} ms, plain rr {b:.1f} ms, ratio {a / b if b else float('nan'):.2f}")
EOF

echo "== linear: tokenization seconds per byte (no token bound, 60 s budget)" >&2
start_daemon linear 3 LOXI_KV_MAX_PROMPT_TOKENS=16777216 LOXI_KV_DECISION_BUDGET_MS=60000
python3 scripts/bench-kv-bounds.py linear --vip "$VIP" --api "$API" --pid "$LPID" \
  | tee "$OUT/linear.json"
echo "results in $OUT" >&2
