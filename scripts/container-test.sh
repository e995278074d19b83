#!/usr/bin/env bash
# End-to-end test of the container image (root; podman, iproute2, curl):
#   1. builds it (scripts/container-build.sh; set LOXI_CONTAINER_SKIP_BUILD=1 to reuse the tag);
#   2. runs it with host networking and privileges, XDP on a veth this script creates (its peer
#      in a network namespace the script creates) and VIPs on that veth;
#   3. waits for the image's HEALTHCHECK, creates a fullproxy rule with the container's own
#      loxicmd and proxies a request through it to a backend on 127.0.0.1;
#   4. `podman stop -t 30`: checks the daemon exited 0, the XDP program is detached and the VIP
#      it added is gone;
#   5. SIGKILL: restarts it (the rule comes back from the state volume), `podman kill -s KILL`,
#      checks what is left behind (XDP: nothing, the link is fd-based; the VIP stays, listed in
#      the state volume's record vips-<iface>.json), then starts it again with nothing deleted
#      by hand (only the exited container is removed) and checks the adoption docs/deploy.md
#      describes: the log's adoption line for the VIP, exactly one copy of the address, no
#      second add, a request proxied again, and `podman stop -t 30` removing the adopted VIP
#      like one it added (exit 0, the record left empty).
# Prints one "N passed, N failed" line; exits non-zero on any failure.
#   LOXI_CONTAINER_TAG   image tag (default localhost/loxi:dev)
set -uo pipefail
cd "$(dirname "$0")/.."
TAG=${LOXI_CONTAINER_TAG:-localhost/loxi:dev}
# shellcheck source=scripts/container-env.sh
. scripts/container-env.sh
[ "$(id -u)" = 0 ] || { echo "container-test: needs root (XDP, netns, podman --privileged)" >&2; exit 1; }
for t in podman ip curl python3; do
  command -v "$t" >/dev/null || { echo "container-test: $t not found (scripts/setup.sh installs it)" >&2; exit 1; }
done
T0=$(date +%s)
if [ "${LOXI_CONTAINER_SKIP_BUILD:-0}" != 1 ]; then
  scripts/container-build.sh "$TAG" || { echo "container-test: image build failed" >&2; exit 1; }
fi
TB=$(date +%s)

pass=0; fail=0
ok()   { pass=$((pass + 1)); echo "ok   - $*"; }
bad()  { fail=$((fail + 1)); echo "FAIL - $*"; }
check() { local what=$1; shift; if "$@"; then ok "$what"; else bad "$what"; fi; }

ID=$$
NS=loxict$ID; HOSTIF=lxc${ID}a; PEERIF=lxc${ID}b; NAME=loxict-$ID
VIP=127.77.$((ID % 250)).$((ID / 250 % 250 + 1))
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
API=$(free_port); VPORT=$(free_port); BPORT=$(free_port)
STATE=$(mktemp -d); WORK=$(mktemp -d)
BACKEND_PID=
cleanup() {
  "${PODMAN[@]}" rm -f -t 0 "$NAME" >/dev/null 2>&1
  [ -n "$BACKEND_PID" ] && kill "$BACKEND_PID" 2>/dev/null
  ip link del "$HOSTIF" 2>/dev/null
  ip netns del "$NS" 2>/dev/null
  ip addr del "$VIP/32" dev lo 2>/dev/null
  rm -rf "$STATE" "$WORK"
}
trap cleanup EXIT

# Topology: veth HOSTIF (host, XDP + VIPs) <-> PEERIF (in NS, with a pass program so redirects
# into it would deliver; not used by this test's traffic, which stays on loopback).
ip netns add "$NS"
ip link add "$HOSTIF" type veth peer name "$PEERIF" netns "$NS"
ip link set "$HOSTIF" up; ip -n "$NS" link set "$PEERIF" up

# Backend on 127.0.0.1: answers every POST with the path and the Host header it saw.
cat > "$WORK/backend.py" <<'PY'
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        n = int(self.headers.get("content-length", 0)); body = self.rfile.read(n)
        out = json.dumps({"backend": "b0", "path": self.path, "bytes": len(body)}).encode()
        self.send_response(200); self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out))); self.end_headers(); self.wfile.write(out)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
PY
python3 "$WORK/backend.py" "$BPORT" & BACKEND_PID=$!

run_container() {
  "${PODMAN[@]}" run -d --name "$NAME" --net=host --privileged "${ULIMITS[@]}" \
    -e LOXI_API_ADDR="127.0.0.1:$API" -v "$STATE:/var/lib/loxilb" \
    "$TAG" --xdp-iface "$HOSTIF" --vip-iface "$HOSTIF" >/dev/null
}
xdp_on()  { ip link show dev "$HOSTIF" | grep -q 'prog/xdp'; }
vip_on()  { ip -4 addr show dev "$HOSTIF" | grep -q " $VIP/32 "; }
wait_for() { local n=$1; shift; for _ in $(seq "$n"); do "$@" && return 0; sleep 0.2; done; return 1; }
healthy() { "${PODMAN[@]}" healthcheck run "$NAME" >/dev/null 2>&1; }
not() { ! "$@"; }
# One POST through the rule (retried for 10 s while the listener comes up): body in $resp,
# headers in $WORK/h.
request() {
  resp=""; for _ in $(seq 50); do
    resp=$(curl -s -m 2 -D "$WORK/h" -H 'content-type: application/json' \
      -d '{"model":"m","prompt":"hello"}' "http://$VIP:$VPORT/v1/completions") && [ -n "$resp" ] && return 0
    sleep 0.2
  done
  return 1
}
# Copies of VIP/32 on the interface.
vip_count() { ip -4 addr show dev "$HOSTIF" | grep -c " $VIP/32 "; }
# Whether the container's log has a line with the message $1 and vip=$VIP.
VIP_RE="vip=${VIP//./\\.}( |\$)"
logged() { "${PODMAN[@]}" logs "$NAME" 2>&1 | grep -F -- "$1" | grep -E "$VIP_RE" >/dev/null; }
# Whether the state volume's VIP record lists exactly the addresses given.
RECORD=$STATE/vips-$HOSTIF.json
record_is() {
  python3 -c 'import json,sys; sys.exit(sorted(json.load(open(sys.argv[1]))) != sorted(sys.argv[2:]))' "$RECORD" "$@" 2>/dev/null
}

# --- run, health, rule, request ----------------------------------------------------------------
run_container
check "container starts and its HEALTHCHECK passes" wait_for 100 healthy
check "XDP attached to $HOSTIF" wait_for 50 xdp_on
out=$("${PODMAN[@]}" exec "$NAME" loxicmd --port "$API" create lb "$VIP" --tcp="$VPORT:$BPORT" \
  --endpoints=127.0.0.1:1 --mode=fullproxy --select=rr 2>&1)
check "loxicmd in the container creates a fullproxy rule ($out)" test $? -eq 0
check "VIP $VIP/32 added to $HOSTIF" wait_for 50 vip_on
request
check "request proxied to the backend (body: $resp)" grep -q '"path": "/v1/completions"' <<<"$resp"
check "response names endpoint 0" grep -qi '^x-loxilb-endpoint: 0' "$WORK/h"
listed=$("${PODMAN[@]}" exec "$NAME" loxicmd --port "$API" get lb -o json 2>&1)
check "loxicmd get lb lists the rule" grep -q "\"$VIP\"" <<<"$listed"

# --- graceful stop -----------------------------------------------------------------------------
t=$(date +%s%N)
"${PODMAN[@]}" stop -t 30 "$NAME" >/dev/null
STOP_MS=$(( ($(date +%s%N) - t) / 1000000 ))
code=$("${PODMAN[@]}" inspect -f '{{.State.ExitCode}}' "$NAME")
check "podman stop -t 30: loxilb exited 0 on SIGTERM (exit $code, ${STOP_MS} ms)" test "$code" = 0
check "podman stop: XDP detached from $HOSTIF" not xdp_on
check "podman stop: VIP $VIP removed from $HOSTIF" not vip_on
"${PODMAN[@]}" logs "$NAME" > "$WORK/stop.log" 2>&1
check "podman stop: the log says the data path was detached" grep -q 'XDP data path detached' "$WORK/stop.log"
"${PODMAN[@]}" rm "$NAME" >/dev/null

# --- SIGKILL, then a restart that adopts the VIP -----------------------------------------------
run_container
check "restart: the rule is restored from the state volume and its VIP re-added" wait_for 100 vip_on
check "restart: XDP attached again" wait_for 50 xdp_on
"${PODMAN[@]}" kill -s KILL "$NAME" >/dev/null
"${PODMAN[@]}" wait "$NAME" >/dev/null 2>&1
check "SIGKILL: XDP detached by the kernel (fd-based link closed with the process)" wait_for 25 not xdp_on
if vip_on; then KILL_VIP=left; else KILL_VIP=removed; fi
check "SIGKILL: the VIP is left behind (nothing ran to remove it)" test "$KILL_VIP" = left
check "SIGKILL: the VIP is in the state volume's record $(basename "$RECORD") ($(cat "$RECORD" 2>&1))" record_is "$VIP"
# No recovery by hand: the next start adopts the address (marked IFA_PROTO 0x4c and recorded).
"${PODMAN[@]}" rm "$NAME" >/dev/null
run_container
check "after SIGKILL: the restarted container passes its HEALTHCHECK" wait_for 100 healthy
check "after SIGKILL: the log says the VIP was adopted" \
  wait_for 50 logged 'VIP left on the interface by an earlier run adopted (removed when no rule needs it)'
check "after SIGKILL: VIP $VIP/32 present on $HOSTIF" vip_on
n=$(vip_count)
check "after SIGKILL: exactly one copy of $VIP/32 on $HOSTIF (found $n)" test "$n" = 1
check "after SIGKILL: the VIP was not added a second time (no 'VIP added' line)" not logged 'VIP added'
check "after SIGKILL: XDP attached again" wait_for 50 xdp_on
request
check "after SIGKILL: the rule proxies a request again (body: $resp)" grep -q '"path": "/v1/completions"' <<<"$resp"
t=$(date +%s%N)
"${PODMAN[@]}" stop -t 30 "$NAME" >/dev/null
STOP2_MS=$(( ($(date +%s%N) - t) / 1000000 ))
code=$("${PODMAN[@]}" inspect -f '{{.State.ExitCode}}' "$NAME")
check "after SIGKILL: podman stop -t 30: loxilb exited 0 (exit $code, ${STOP2_MS} ms)" test "$code" = 0
check "after SIGKILL: podman stop removes the adopted VIP $VIP from $HOSTIF" not vip_on
check "after SIGKILL: the log says the VIP was removed" logged 'VIP removed'
check "after SIGKILL: the record is left empty ($(cat "$RECORD" 2>&1))" record_is
check "after SIGKILL: podman stop: XDP detached" not xdp_on
"${PODMAN[@]}" rm "$NAME" >/dev/null

echo "container-test: image build $((TB - T0)) s, test $(( $(date +%s) - TB )) s"
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
