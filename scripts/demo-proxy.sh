#!/usr/bin/env bash
# loxi demo: loxilb in front of two local HTTP backends, configured with loxicmd exactly as a
# LoxiLB user would, then a few requests showing which endpoint served each one
# (x-loxilb-endpoint) and the matching metrics. Everything runs on 127.0.0.1 and is cleaned up
# on exit.
#   scripts/demo-proxy.sh [--out DIR]    (DIR keeps the transcript, daemon log and metrics)
#   LOXI_SETUP_BUILD=0 LOXI_BIN_DIR=target/debug scripts/demo-proxy.sh   (skip the release build)
set -euo pipefail
# CARGO_TARGET_DIR, LOXI_BIN_DIR, LOXI_SHARED made absolute; bin_dir.
# shellcheck source=lib/paths.sh
. "$(dirname "$0")/lib/paths.sh"
cd "$(dirname "$0")/.."
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) need_value demo-proxy.sh "$1" $# "${2:-}"; OUT=$2; shift 2 ;;
    --out=*) OUT=${1#--out=}; shift ;;
    -h|--help) awk 'NR > 1 { if (!/^#/) exit; print }' "$0"; exit 0 ;; # the header comment
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
BIN=$(bin_dir)   # LOXI_BIN_DIR (other builds, e.g. target/debug), else CARGO_TARGET_DIR/release
for b in loxilb loxicmd echo-backend; do
  [ -x "$BIN/$b" ] || { echo "missing $BIN/$b (setup.sh builds it)" >&2; exit 1; }
done

WORK=$(mktemp -d)
OUT=${OUT:-$WORK/out}
mkdir -p "$OUT"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  [ -f "$WORK/loxilb.log" ] && cp "$WORK/loxilb.log" "$OUT/" 2>/dev/null || true
  rm -rf "$WORK/state"
}
trap cleanup EXIT INT TERM

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
API=$(free_port); VIPPORT=$(free_port); BPORT=$(free_port)
say() { printf '\n== %s\n' "$*" | tee -a "$OUT/transcript.txt"; }
run() { printf '$ %s\n' "$*" | tee -a "$OUT/transcript.txt"; "$@" 2>&1 | tee -a "$OUT/transcript.txt"; }

say "two backends: 127.0.0.2:$BPORT (backend-a) and 127.0.0.3:$BPORT (backend-b)"
"$BIN/echo-backend" --host 127.0.0.2 --port "$BPORT" --name backend-a 2>>"$WORK/backends.log" & PIDS+=($!)
"$BIN/echo-backend" --host 127.0.0.3 --port "$BPORT" --name backend-b 2>>"$WORK/backends.log" & PIDS+=($!)

say "loxilb with its REST API on 127.0.0.1:$API (state in a temp dir)"
"$BIN/loxilb" --api-addr "127.0.0.1:$API" --state-dir "$WORK/state" \
  --tokenizer-dir "$WORK/tokenizers" --log info >"$WORK/loxilb.log" 2>&1 & PIDS+=($!)
for _ in $(seq 100); do
  curl -sf "http://127.0.0.1:$API/netlox/v1/config/loadbalancer/all" >/dev/null && break
  sleep 0.1
done

LOXICMD=("$BIN/loxicmd" --apiserver 127.0.0.1 --port "$API")
say "a fullproxy round-robin rule, created with loxicmd"
run "${LOXICMD[@]}" create lb 127.0.0.1 --tcp="$VIPPORT:$BPORT" \
  --endpoints=127.0.0.2:1,127.0.0.3:1 --mode=fullproxy --select=rr
run "${LOXICMD[@]}" get lb

say "six requests through the VIP 127.0.0.1:$VIPPORT: the endpoint alternates"
for i in 1 2 3 4 5 6; do
  line=$(curl -s -D - -o "$WORK/body" -X POST "http://127.0.0.1:$VIPPORT/v1/completions" \
    -H 'Content-Type: application/json' -d '{"model":"demo","prompt":"hello"}' \
    | tr -d '\r' | grep -i '^x-loxilb-endpoint:' || true)
  backend=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("backend","?"))' "$WORK/body" 2>/dev/null || echo '?')
  printf 'request %d: %s  (answered by %s)\n' "$i" "${line:-x-loxilb-endpoint: missing}" "$backend" | tee -a "$OUT/transcript.txt"
done

say "a misspelled field is rejected (LoxiLB would silently drop it)"
run curl -s -X POST "http://127.0.0.1:$API/netlox/v1/config/loadbalancer" \
  -H 'Content-Type: application/json' \
  -d "{\"serviceArguments\": {\"externalIP\": \"127.0.0.1\", \"port\": $VIPPORT, \"mode\": 4, \"kv_block_size\": 16}, \"endpoints\": []}"
echo | tee -a "$OUT/transcript.txt"

say "metrics (GET /netlox/v1/metrics)"
curl -s "http://127.0.0.1:$API/netlox/v1/metrics" >"$OUT/metrics.txt"
grep -E '^loxilb_(lb_rules|proxy_requests_total|proxy_selections_total)' "$OUT/metrics.txt" | tee -a "$OUT/transcript.txt"
if command -v promtool >/dev/null; then
  run sh -c "promtool check metrics < '$OUT/metrics.txt' && echo 'promtool: metrics OK'"
fi

say "done; transcript, metrics and daemon log in $OUT"
