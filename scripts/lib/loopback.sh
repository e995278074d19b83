# Helpers of the loopback benchmarks (scripts/bench-proxy*.sh), sourced after their build step:
# a scratch directory TMP and a list PIDS of processes the script starts, both cleaned up on
# exit (plus `cleanup_extra`, when the script defines one), free loopback ports, and waiting for
# a listener.
PIDS=()
TMP=$(mktemp -d)
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  if declare -F cleanup_extra >/dev/null; then cleanup_extra; fi
  wait 2>/dev/null || true
  rm -rf "$TMP"
}
trap cleanup EXIT

# A free TCP port on 127.0.0.1.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# wait_port PORT [SECONDS]: returns once 127.0.0.1:PORT accepts a connection; exits the script
# with a message after SECONDS (default 10).
wait_port() {
  local tries=$((${2:-10} * 20))
  for _ in $(seq 1 "$tries"); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.05
  done
  echo "$(basename "$0"): nothing listening on $1" >&2
  exit 1
}
