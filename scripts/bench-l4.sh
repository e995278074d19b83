#!/usr/bin/env bash
# L4 forwarding cost: XDP native DNAT vs XDP generic DNAT vs nftables DNAT in the netns topology
# of the XDP tests (client ns — LB ns — backend ns over veth), bounded UDP flood from the client
# ns pinned to CPU 0 (frames through a qdisc-bypassing packet socket, 64 per sendmmsg), for one
# long flow (established: the conntrack fast path) and for a new 5-tuple on every packet (new
# flows). Rounds run every case once (order rotated), so each forwarding cost is taken against
# its own round's sender-only baseline (the LB's ingress drops in XDP); prints per shape the
# medians, every round's forwarding cost, the XDP program's own time per packet and the
# native/nftables ratio (median and spread over rounds), and the program's time net of the BPF
# statistics' own floor (the drop program's time) with the ratio the path would have without
# the program (how much of the cost is loxi's program at all). New flows run below both conntrack
# tables' capacity (each XDP run on a fresh map), plus one case for XDP native with its map
# full (evicting). Root only.
#   BENCH_PACKETS (default 200000) packets per established-flow run, BENCH_NEW_PACKETS (default
#   25000, at most 30768: below the XDP map's 32 K flows) packets per new-flow run, BENCH_RUNS
#   (default 7) rounds, BENCH_SENDER (packet or raw: one datagram per sendto on a raw IP
#   socket, the method of the figures before 2026-12-03 afternoon), BENCH_NAPI (softirq, the
#   default: the LB's receive work runs in the sender's softirq, one frame per NAPI poll, and
#   the sender's CPU time is measured; threaded: the LB ingress's NAPI runs as a thread pinned
#   to CPU 1, polling batches of up to 64 frames as a NIC's poll does, and that thread's CPU
#   time is measured, without the sender's), BENCH_PEERS (xdp, the default: the peers of the LB's
#   veths run pass-through XDP, so XDP forwards with bpf_redirect; plain: no XDP and GRO off on
#   the peers, as containers' veths, so XDP takes the TC hand-off: XDP_PASS, then the TC
#   program's redirect).
set -euo pipefail
# CARGO_TARGET_DIR, LOXI_BIN_DIR, LOXI_SHARED made absolute; cargo_release_dir.
# shellcheck source=lib/paths.sh
. "$(dirname "$0")/lib/paths.sh"
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
[ "$(id -u)" = 0 ] || { echo "bench-l4: needs root (network namespaces, XDP)" >&2; exit 1; }
# Release, like the tests: the profile CI and the daemon build, so nothing else is compiled.
cargo build --release -q -p xtask
exec "$(cargo_release_dir)/xtask" bench-l4 --packets "${BENCH_PACKETS:-200000}" \
  --new-packets "${BENCH_NEW_PACKETS:-25000}" --runs "${BENCH_RUNS:-7}" \
  --sender "${BENCH_SENDER:-packet}" --napi "${BENCH_NAPI:-softirq}" --peers "${BENCH_PEERS:-xdp}"
