# shellcheck shell=bash
# The three-namespace topology of the L4 benchmarks (bench-xdp-prog.sh):
#   client ns $C (c0 10.100.0.2/24) — LB ns $L (l0 10.100.0.1/24, l1 10.100.1.1/24, IPv4
#   forwarding on) — backend ns $B (b0 10.100.1.2/24).
# Sourced after C, L, B, D (a temporary dir) and PIDS are set. Defines `cleanup` (kills PIDS
# and $LB if set, deletes the namespaces and D; trapped on EXIT) and creates the topology.
cleanup() {
  [ -n "${LB:-}" ] && kill "$LB" 2>/dev/null || true
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  sleep 0.5
  for n in "$C" "$L" "$B"; do ip netns del "$n" 2>/dev/null || true; done
  rm -rf "$D"
}
trap cleanup EXIT
for n in "$C" "$L" "$B"; do ip netns add "$n"; ip -n "$n" link set lo up; done
ip link add c0 netns "$C" type veth peer name l0 netns "$L"
ip link add b0 netns "$B" type veth peer name l1 netns "$L"
ip -n "$C" addr add 10.100.0.2/24 dev c0; ip -n "$C" link set c0 up
ip -n "$L" addr add 10.100.0.1/24 dev l0; ip -n "$L" link set l0 up
ip -n "$L" addr add 10.100.1.1/24 dev l1; ip -n "$L" link set l1 up
ip -n "$B" addr add 10.100.1.2/24 dev b0; ip -n "$B" link set b0 up
ip netns exec "$L" sysctl -qw net.ipv4.ip_forward=1
ip netns exec "$L" ping -c1 -W2 10.100.1.2 >/dev/null
ip netns exec "$C" ping -c1 -W2 10.100.0.1 >/dev/null
