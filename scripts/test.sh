#!/usr/bin/env bash
# All of loxi's tests: unit, integration (real daemon, real backends, real ZeroMQ publishers,
# promtool) and, as root, the network-namespace XDP tests. Runs setup first.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
export LOXI_SHARED=${LOXI_SHARED:-$(cd .. && pwd)/shared}
# One release build serves the tests and the binaries the integration tests start.
cargo test --release --workspace -- --test-threads="${LOXI_TEST_THREADS:-2}"
