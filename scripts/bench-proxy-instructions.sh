#!/usr/bin/env bash
# User-space instructions per proxied request, counted by valgrind's callgrind (exact and
# repeatable on a shared machine, where requests/s and CPU time swing by ±15 % between runs):
# loxilb (mode 4, sel 0 round-robin, 2 endpoints) and the hyper floor (`hyper-floor`, the same
# forwarding with nothing but tokio and hyper; see scripts/bench-proxy.sh) in the same run, over
# the same two echo-backends, each with 2 workers (loxilb's connection workers, the floor's
# threads). A Python client sends the `small` case of bench-proxy (a 66-byte JSON POST) on 4
# keep-alive connections: WARM requests first
# (connections, pools, metric handles), then N with instrumentation on; prints instructions
# per request for both and the loxi/floor ratio. Kernel work (the syscalls) is not counted:
# this measures what the proxy's own code costs, not the machine.
#   N=2000 WARM=200   requests measured / warm-up
#   KEEP=DIR      also copy both callgrind profiles there (loxilb.cg, floor.cg), for
#                 `callgrind_annotate --inclusive=yes DIR/loxilb.cg`
#   BUILD_PROFILE=pgo    the binaries, as bench-proxy.sh: pgo (what the container image ships):
#                 loxilb from scripts/build-pgo.sh, the floor and the echo-backends from dist;
#                 or a cargo profile for all three (dist, release)
# Loopback only; bounded by N. Needs valgrind (scripts/setup.sh).
set -euo pipefail
# CARGO_TARGET_DIR, LOXI_BIN_DIR, LOXI_SHARED made absolute; cargo_profile_dir.
# shellcheck source=lib/paths.sh
. "$(dirname "$0")/lib/paths.sh"
cd "$(dirname "$0")/.."
N=${N:-2000}
WARM=${WARM:-200}
BUILD_PROFILE=${BUILD_PROFILE:-pgo}
export PATH="$HOME/.cargo/bin:$PATH"
for cmd in valgrind callgrind_control curl python3; do
  command -v "$cmd" >/dev/null || { echo "bench-proxy-instructions: $cmd missing (run scripts/setup.sh)" >&2; exit 1; }
done
proxy_bench_binaries bench-proxy-instructions "$BUILD_PROFILE"
# TMP, PIDS, cleanup on exit, free_port, wait_port.
# shellcheck source=lib/loopback.sh
. scripts/lib/loopback.sh
cat >"$TMP/load.py" <<'PY'
import http.client, sys, threading
port, n, conns = int(sys.argv[1]), int(sys.argv[2]), 4
body = b'{"model":"tiny","prompt":"hello","max_tokens":16,"temperature":0}'
errors = []
def run(k):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    for _ in range(k):
        c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        if r.status != 200:
            errors.append(r.status)
ts = [threading.Thread(target=run, args=(n // conns,)) for _ in range(conns)]
[t.start() for t in ts]
[t.join() for t in ts]
if errors:
    sys.exit(f"{len(errors)} non-200 answers, first {errors[0]}")
PY

echo_backends "$BIN"

# count NAME PORT PID: warm up, count N requests, print instructions per request.
count() {
  local name=$1 port=$2 pid=$3 f ir
  python3 "$TMP/load.py" "$port" "$WARM"
  callgrind_control -i on "$pid" >/dev/null 2>&1
  python3 "$TMP/load.py" "$port" "$N"
  callgrind_control -d "$pid" >/dev/null 2>&1
  sleep 1
  f=$(ls -t "$TMP/$name".cg* | head -1)
  ir=$(awk '/^(summary|totals):/ {print $2; exit}' "$f")
  if [ -n "${KEEP:-}" ]; then mkdir -p "$KEEP" && cp "$f" "$KEEP/$name.cg"; fi
  [ -n "$ir" ] || { echo "bench-proxy-instructions: no totals in $f" >&2; exit 1; }
  echo $((ir / N))
}

API=$(free_port); LB=$(free_port)
(cd "$TMP" && TOKIO_WORKER_THREADS=2 exec valgrind --tool=callgrind --instr-atstart=no \
  --callgrind-out-file="$TMP/loxilb.cg" "$LB_BIN_DIR/loxilb" --api-addr "127.0.0.1:$API" \
  --state-dir "$TMP/state" --tokenizer-dir "$TMP/tok" --log warn) >"$TMP/loxilb.log" 2>&1 & PIDS+=($!)
LOXI_PID=$!
wait_port "$API" 60
sel0_rule "$API" "$LB" "$B1" "$B2"
wait_port "$LB" 60
L=$(count loxilb "$LB" "$LOXI_PID")

FLR=$(free_port)
(cd "$TMP" && TOKIO_WORKER_THREADS=2 exec valgrind --tool=callgrind --instr-atstart=no \
  --callgrind-out-file="$TMP/floor.cg" "$BIN/hyper-floor" "127.0.0.1:$FLR" "127.0.0.1:$B1" \
  "127.0.0.1:$B2") >"$TMP/floor.log" 2>&1 & PIDS+=($!)
FLOOR_PID=$!
wait_port "$FLR" 60
F=$(count floor "$FLR" "$FLOOR_PID")

printf 'user-space instructions per request (callgrind, %s requests after %s warm-up, small case)\n' "$N" "$WARM"
printf 'binaries: loxilb %s, floor and echo-backends %s\n' "$LB_BIN_DIR" "$BIN"
printf 'loxilb %s   hyper-floor %s   loxi/floor %s\n' "$L" "$F" "$(awk -v a="$L" -v b="$F" 'BEGIN {printf "%.2f", a/b}')"
