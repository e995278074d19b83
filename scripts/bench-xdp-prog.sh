#!/usr/bin/env bash
# The XDP program's own cost per packet, measured with BPF_PROG_TEST_RUN (`bpftool prog run
# ... repeat N`: one clock read around N runs of the loaded program, so none of the two clock
# reads per run that BPF run-time statistics add, which inflate `scripts/bench-l4.sh`'s
# "program" column). Root only; network namespaces of its own, no traffic leaves them.
#
# Topology: client ns — LB ns (xtask l4-serve on l0/l1, the real loader and program) — backend
# ns, each veth peer with the pass program. Cases, each run R times per sample, 5 samples:
#   established  a DNAT flow on the conntrack fast path (live entry, cached next hop): counters,
#                rewrite, checksums, redirect through the device map. Test runs reuse one
#                buffer, so the rewritten frame is the next run's input: two rules map
#                20.0.0.1:80 to 20.0.0.2:80 and back (both routed via the backend; a rule
#                whose endpoint is its own VIP is refused as a loop), and every run after the
#                first two is a fast-path hit on one of the two flows.
#   no-service   a UDP frame to an address and port that are no service and no flow: what
#                every packet the LB does not handle pays before XDP_PASS.
#   pass         the pass-everything program (the test-run loop's own cost, the baseline).
# Prints each case's median ns per run and the program's own cost (case − pass).
#   BENCH_REPEAT (default 2000000) runs per sample.
set -euo pipefail
# CARGO_TARGET_DIR, LOXI_BIN_DIR, LOXI_SHARED made absolute; cargo_release_dir.
# shellcheck source=lib/paths.sh
. "$(dirname "$0")/lib/paths.sh"
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
[ "$(id -u)" = 0 ] || { echo "bench-xdp-prog: needs root (network namespaces, XDP)" >&2; exit 1; }
command -v bpftool >/dev/null || [ -x /usr/sbin/bpftool ] ||
  { echo "bench-xdp-prog: bpftool missing (scripts/setup.sh installs it)" >&2; exit 1; }
export PATH="$PATH:/usr/sbin"
R=${BENCH_REPEAT:-2000000}
cargo build --release -q -p xtask
X=$(cargo_release_dir)/xtask
TAG=bxp$$
C=${TAG}c; L=${TAG}l; B=${TAG}b
D=$(mktemp -d)
PIDS=()
# cleanup (trapped), the client — LB — backend namespaces.
# shellcheck source=lib/l4ns.sh
. scripts/lib/l4ns.sh
ip -n "$L" route add 20.0.0.1/32 via 10.100.1.2 dev l1
ip -n "$L" route add 20.0.0.2/32 via 10.100.1.2 dev l1
rule() { echo '{"serviceArguments":{"externalIP":"'"$1"'","port":80,"protocol":"udp","mode":0,"sel":0},"endpoints":[{"endpointIP":"'"$2"'","targetPort":80}]}'; }
echo "[$(rule 20.0.0.1 20.0.0.2),$(rule 20.0.0.2 20.0.0.1)]" >"$D/rules.json"
ip netns exec "$B" "$X" xdp-pass --iface b0 >"$D/pass-b.log" 2>&1 & PIDS+=($!)
ip netns exec "$C" "$X" xdp-pass --iface c0 >"$D/pass-c.log" 2>&1 & PIDS+=($!)
ip netns exec "$L" "$X" l4-serve --xdp-iface l0 --xdp-iface l1 --rules "$D/rules.json" >"$D/lb.log" 2>&1 & PIDS+=($!)
prog_id() { ip -n "$1" link show "$2" | sed -n 's/.*prog\/xdp id \([0-9]*\).*/\1/p'; }
for _ in $(seq 100); do
  [ -n "$(prog_id "$L" l0)" ] && [ -n "$(prog_id "$B" b0)" ] && break
  sleep 0.1
done
LB_ID=$(prog_id "$L" l0); PASS_ID=$(prog_id "$B" b0)
[ -n "$LB_ID" ] && [ -n "$PASS_ID" ] || { echo "bench-xdp-prog: programs not attached" >&2; cat "$D"/*.log >&2; exit 1; }
sleep 1 # the loader writes the rule after attaching
LMAC=$(ip -n "$L" link show l0 | awk '/link\/ether/{print $2}')
CMAC=$(ip -n "$C" link show c0 | awk '/link\/ether/{print $2}')
IFX=$(ip -n "$L" link show l0 | head -1 | cut -d: -f1)
python3 - "$LMAC" "$CMAC" "$IFX" "$D" <<'PY'
import struct, sys
lmac, cmac, ifx, d = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
mac = lambda s: bytes(int(x, 16) for x in s.split(':'))
def frame(dst, dport):
    payload = b'x' * 18
    ulen = 8 + len(payload)
    ip = struct.pack('!BBHHHBBH4s4s', 0x45, 0, 20 + ulen, 1, 0, 64, 17, 0, bytes([10, 100, 0, 2]), bytes(dst))
    s = sum(struct.unpack('!10H', ip)); s = (s & 0xffff) + (s >> 16); s = (s & 0xffff) + (s >> 16)
    ip = ip[:10] + struct.pack('!H', ~s & 0xffff) + ip[12:]
    return mac(lmac) + mac(cmac) + b'\x08\x00' + ip + struct.pack('!HHHH', 40000, dport, ulen, 0) + payload
open(d + '/est.bin', 'wb').write(frame([20, 0, 0, 1], 80))
open(d + '/none.bin', 'wb').write(frame([10, 100, 1, 2], 9999))
# struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index, egress_ifindex
open(d + '/ctx.bin', 'wb').write(struct.pack('<IIIIII', 0, 60, 0, ifx, 0, 0))
PY
# run NS ID FRAME REPEAT → "ret ns"
run() {
  ip netns exec "$1" bpftool prog run id "$2" data_in "$D/$3" ctx_in "$D/ctx.bin" repeat "$4" 2>&1 |
    sed -n 's/.*Return value: \([0-9]*\), duration[^:]*: \([0-9]*\)ns.*/\1 \2/p'
}
# The first run creates flow 1 and caches its next hop; the second sample's second run, flow 2.
run "$L" "$LB_ID" est.bin 1 >/dev/null
run "$L" "$LB_ID" est.bin 1000 >/dev/null
ret=$(run "$L" "$LB_ID" est.bin 1 | cut -d' ' -f1)
[ "$ret" = 4 ] || { echo "bench-xdp-prog: established frame gave action $ret, not XDP_REDIRECT (4)" >&2; exit 1; }
ret=$(run "$L" "$LB_ID" none.bin 1 | cut -d' ' -f1)
[ "$ret" = 2 ] || { echo "bench-xdp-prog: no-service frame gave action $ret, not XDP_PASS (2)" >&2; exit 1; }
median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
declare -A M
for i in 1 2 3 4 5; do
  echo "$(run "$L" "$LB_ID" est.bin "$R" | cut -d' ' -f2)" >>"$D/est"
  echo "$(run "$L" "$LB_ID" none.bin "$R" | cut -d' ' -f2)" >>"$D/none"
  echo "$(run "$B" "$PASS_ID" est.bin "$R" | cut -d' ' -f2)" >>"$D/pass"
done
for c in est none pass; do M[$c]=$(median <"$D/$c"); done
printf 'XDP program per packet, BPF_PROG_TEST_RUN, %s runs x 5 samples (median ns, all samples)\n' "$R"
printf '  established (fast path)  %4s ns  [%s]  own cost %s ns\n' "${M[est]}" "$(paste -sd' ' "$D/est")" "$((M[est] - M[pass]))"
printf '  no-service (XDP_PASS)    %4s ns  [%s]  own cost %s ns\n' "${M[none]}" "$(paste -sd' ' "$D/none")" "$((M[none] - M[pass]))"
printf '  pass program (baseline)  %4s ns  [%s]\n' "${M[pass]}" "$(paste -sd' ' "$D/pass")"
