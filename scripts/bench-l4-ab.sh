#!/usr/bin/env bash
# New-flow cost of two builds of the XDP program, interleaved: an A/B that separates a change
# from this shared VM's drift (whole `bench-l4.sh` runs minutes apart do not).
#
#   scripts/bench-l4-ab.sh XTASK_A XTASK_B   (two `xtask` binaries, e.g. `target/release/xtask`
#                                           copied before and after a change: each embeds its
#                                           build's program and loader)
#   BENCH_AB_ROUNDS (default 6)  rounds; each runs both builds (A then B in odd rounds, B then
#                  A in even ones, so drift within a round biases neither), two floods each
#   BENCH_AB_FLOWS (default 25000) new flows per flood (at most 30768: a build that defers the
#                  reply entry holds one entry per unanswered flow, so its two floods stay below
#                  the conntrack map's 64 K entries and no insert evicts; a build inserting both
#                  entries at creation evicts in its second flood above 16,384)
#
# Topology as `bench-l4.sh --napi threaded`: client ns — LB ns (`xtask l4-serve` of the build
# under test on l0/l1, one DNAT UDP rule) — backend ns dropping what arrives; the LB ingress's
# NAPI runs as a thread pinned to CPU 1 and the sender (a qdisc-bypassing packet socket) is
# pinned to CPU 0. Each build starts with a fresh loader (empty conntrack); a flood sends one
# datagram per new 5-tuple, tuples never repeating within the run. Printed per build and flood
# (first into the empty map, second into the map holding the first's flows): the CPU time per
# packet of the NAPI thread and of CPU 1's softirq thread (where the backend veth's receive may
# run) in every round (from /proc/PID/schedstat: the receive, the program, the redirect and the
# transmit), and the median over rounds. Root only; loopback namespaces of its
# own, bounded by the flood sizes.
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "bench-l4-ab: needs root (network namespaces, XDP)" >&2; exit 1; }
[ $# = 2 ] || { echo "usage: bench-l4-ab.sh XTASK_A XTASK_B" >&2; exit 2; }
XA=$(realpath "$1"); XB=$(realpath "$2")
for x in "$XA" "$XB"; do [ -x "$x" ] || { echo "bench-l4-ab: $x is not an executable" >&2; exit 2; }; done
cd "$(dirname "$0")/.."
ROUNDS=${BENCH_AB_ROUNDS:-6}
FLOWS=${BENCH_AB_FLOWS:-25000}
case "$FLOWS$ROUNDS" in *[!0-9]*|'') echo "bench-l4-ab: BENCH_AB_FLOWS and BENCH_AB_ROUNDS are positive integers" >&2; exit 2 ;; esac
[ "$FLOWS" -ge 1 ] && [ "$FLOWS" -le 30768 ] || { echo "bench-l4-ab: BENCH_AB_FLOWS is 1..30768" >&2; exit 2; }
[ "$ROUNDS" -ge 1 ] || { echo "bench-l4-ab: BENCH_AB_ROUNDS is at least 1" >&2; exit 2; }
SOFTIRQ=$(pgrep -x ksoftirqd/1 || true)
[ -n "$SOFTIRQ" ] || { echo "bench-l4-ab: no ksoftirqd/1 (needs 2 CPUs)" >&2; exit 1; }
TAG=bab$$
C=${TAG}c; L=${TAG}l; B=${TAG}b
D=$(mktemp -d)
PIDS=()
LB=
# cleanup (trapped), the client — LB — backend namespaces.
# shellcheck source=lib/l4ns.sh
. scripts/lib/l4ns.sh
echo '[{"serviceArguments":{"externalIP":"20.0.0.1","port":80,"protocol":"udp","mode":0,"sel":0},"endpoints":[{"endpointIP":"10.100.1.2","targetPort":8080}]}]' >"$D/rules.json"
ip netns exec "$B" "$XA" xdp-pass --drop --iface b0 >"$D/pass-b.log" 2>&1 & PIDS+=($!)
ip netns exec "$C" "$XA" xdp-pass --iface c0 >"$D/pass-c.log" 2>&1 & PIDS+=($!)
ip netns exec "$L" ethtool -K l0 gro on >/dev/null
ip netns exec "$C" ethtool -K c0 tso off >/dev/null
ip netns exec "$L" sh -c 'echo 1 > /sys/class/net/l0/threaded'
MAC=$(ip -n "$L" link show l0 | awk '/link\/ether/{print $2}')
# The ingress NAPI thread (attaching XDP recreates it: looked up after each start).
napi_pid() {
  local p
  p=$(pgrep -x "napi/l0-[0-9]*" || true)
  [ "$(echo "$p" | wc -w)" = 1 ] || { echo "bench-l4-ab: expected one napi/l0 thread, found '$p'" >&2; exit 1; }
  echo "$p"
}
flood() { ip netns exec "$C" taskset -c 0 "$1" udp-flood --dst 20.0.0.1:80 --iface c0 --dst-mac "$MAC" "${@:2}" >/dev/null; }
# CPU ns of the NAPI thread $1 and CPU 1's softirq thread.
cpu_ns() { echo $(( $(awk '{print $1}' "/proc/$1/schedstat") + $(awk '{print $1}' "/proc/$SOFTIRQ/schedstat") )); }
first=0
for r in $(seq "$ROUNDS"); do
  order="A B"; [ $((r % 2)) = 0 ] && order="B A"
  for side in $order; do
    X=$XA; [ "$side" = B ] && X=$XB
    ip netns exec "$L" "$X" l4-serve --xdp-iface l0 --xdp-iface l1 --rules "$D/rules.json" >"$D/lb.log" 2>&1 &
    LB=$!
    for _ in $(seq 100); do ip -n "$L" link show l0 | grep -q 'prog/xdp' && break; sleep 0.1; done
    sleep 1 # the loader writes the rule after attaching
    P=$(napi_pid); taskset -pc 1 "$P" >/dev/null
    rx0=$(ip netns exec "$B" cat /sys/class/net/b0/statistics/rx_packets)
    flood "$X" --count 2000
    sleep 0.2
    rx1=$(ip netns exec "$B" cat /sys/class/net/b0/statistics/rx_packets)
    [ $((rx1 - rx0)) -ge 1900 ] || { echo "bench-l4-ab: build $side forwarded $((rx1 - rx0)) of 2000 warm-up packets" >&2; cat "$D/lb.log" >&2; exit 1; }
    for k in 1 2; do
      n0=$(cpu_ns "$P")
      flood "$X" --count "$FLOWS" --new-flows --first "$first"
      first=$((first + FLOWS))
      sleep 0.2
      n1=$(cpu_ns "$P")
      echo "$side $k $(( (n1 - n0) / FLOWS ))" >>"$D/res"
    done
    kill "$LB"; wait "$LB" 2>/dev/null || true; LB=
    sleep 0.5
  done
done
median() { sort -n | awk '{a[NR]=$1} END {if (NR % 2) print a[(NR+1)/2]; else print int((a[NR/2]+a[NR/2+1])/2)}'; }
printf 'bench-l4-ab: CPU ns per new-flow packet (NAPI thread + CPU 1 softirq thread), %s rounds x %s flows (A: %s, B: %s)\n' "$ROUNDS" "$FLOWS" "$1" "$2"
for k in 1 2; do
  for side in A B; do
    vals=$(awk -v s="$side" -v k="$k" '$1 == s && $2 == k {print $3}' "$D/res")
    printf '  %s flood %s (%s)  median %5s ns  rounds: %s\n' "$side" "$k" \
      "$([ "$k" = 1 ] && echo 'empty map' || echo "map holding $FLOWS flows")" \
      "$(echo "$vals" | median)" "$(echo "$vals" | paste -sd' ')"
  done
done
