#!/usr/bin/env bash
# All of loxi's tests: unit, integration (real daemon, real backends, real ZeroMQ publishers,
# promtool) and, as root, the network-namespace XDP tests. Runs setup first.
set -euo pipefail
# CARGO_TARGET_DIR, LOXI_BIN_DIR, LOXI_SHARED made absolute (the test binaries run in their
# crates' directories); shared_dir.
# shellcheck source=lib/paths.sh
. "$(dirname "$0")/lib/paths.sh"
cd "$(dirname "$0")/.."
# The tests read shared/'s golden files: say so before the setup's build, not at the first test.
require_golden_tokenizer test.sh
scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
LOXI_SHARED=$(shared_dir)
export LOXI_SHARED
# One release build serves the tests and the binaries the integration tests start.
cargo test --release --workspace --no-fail-fast -- --test-threads="${LOXI_TEST_THREADS:-2}"
# The routing benchmark end to end (a vllm-sim fleet and one loxilb per policy, a timed hit-rate
# comparison): ignored by plain `cargo test`, run here as a step of its own, alone on the machine,
# with the binaries the step above built.
cargo test --release -p loxi-bench --test bench_routing --test bench_gateway -- --ignored
# House lints: formatting and clippy (warnings are errors) over every target of the workspace.
cargo fmt --all --check
cargo clippy --release --workspace --all-targets -q -- -D warnings
# The eBPF crate is linted with its pinned nightly for bpfel-unknown-none (clippy -D warnings).
cargo run --release -q -p xtask -- lint-ebpf
# Real-traffic XDP tests in network namespaces (root). Not root / no netns: skipped locally,
# a failure when CI is set.
if [ "$(id -u)" != 0 ] || ! ip netns list >/dev/null 2>&1; then
  if [ -n "${CI:-}" ]; then
    echo "netns-test: needs root and network namespaces, and CI is set" >&2
    exit 1
  fi
  echo "netns-test: SKIPPED (not root or no netns)" >&2
else
  # Same profile as the tests above, so nothing is rebuilt (`cargo xtask netns-test` is the dev alias).
  cargo run --release -q -p xtask -- netns-test
fi
# The container image end to end (build, run, stop, SIGKILL; root, podman): opt-in, since its
# first build compiles the workspace again inside the build stage (docs/deploy.md).
if [ "${LOXI_CONTAINER_TEST:-0}" = 1 ]; then
  scripts/container-test.sh
fi
