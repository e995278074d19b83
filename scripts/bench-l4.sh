#!/usr/bin/env bash
# L4 forwarding cost: XDP native DNAT vs XDP generic DNAT vs nftables DNAT in the netns topology
# of the XDP tests (client ns — LB ns — backend ns over veth), bounded UDP flood from the client
# ns pinned to CPU 0. Prints ns/packet per case, forwarding cost over the sender-only baseline
# (LB drops at ingress in XDP) and the native/nftables ratio. Root only.
#   BENCH_PACKETS (default 200000) packets per run, BENCH_RUNS (default 3) runs per case (median).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
[ "$(id -u)" = 0 ] || { echo "bench-l4: needs root (network namespaces, XDP)" >&2; exit 1; }
cargo build -q -p xtask
exec target/debug/xtask bench-l4 --packets "${BENCH_PACKETS:-200000}" --runs "${BENCH_RUNS:-3}"
