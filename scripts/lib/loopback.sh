# Helpers of the loopback benchmarks (scripts/bench-proxy*.sh, scripts/build-pgo.sh), sourced
# after their build step: a scratch directory TMP and a list PIDS of processes the script starts,
# both cleaned up on exit (plus `cleanup_extra`, when the script defines one), free loopback
# ports, waiting for a listener, the sel-0 fullproxy rule and the wrk request shapes.
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

# sel0_rule API LB B1 B2: creates on the loxilb whose API is 127.0.0.1:API a fullproxy rule
# (mode 4, sel 0 round robin) 127.0.0.1:LB → the two backends 127.0.0.1:B1 and :B2.
sel0_rule() {
  curl -sf -X POST "http://127.0.0.1:$1/netlox/v1/config/loadbalancer" -H 'content-type: application/json' -d "{
  \"serviceArguments\": {\"externalIP\": \"127.0.0.1\", \"port\": $2, \"protocol\": \"tcp\", \"mode\": 4, \"sel\": 0},
  \"endpoints\": [{\"endpointIP\": \"127.0.0.1\", \"targetPort\": $3, \"weight\": 1},
                  {\"endpointIP\": \"127.0.0.1\", \"targetPort\": $4, \"weight\": 1}]}" >/dev/null
}

# echo_backends DIR: starts DIR/echo-backend twice (names 0 and 1, one thread each) on free
# ports B1 and B2 (set here) and waits for both.
echo_backends() {
  B1=$(free_port); B2=$(free_port)
  "$1/echo-backend" --port "$B1" --name 0 --threads 1 2>"$TMP/b1.log" & PIDS+=($!)
  "$1/echo-backend" --port "$B2" --name 1 --threads 1 2>"$TMP/b2.log" & PIDS+=($!)
  wait_port "$B1"; wait_port "$B2"
}

# wrk_post NAME: the wrk script TMP/NAME.lua, a POST of /v1/completions with a JSON body, its
# further lines (the body, extra headers) read from stdin.
wrk_post() {
  {
    printf '%s\n' 'wrk.method = "POST"' 'wrk.path = "/v1/completions"' \
      'wrk.headers["Content-Type"] = "application/json"'
    cat
  } >"$TMP/$1.lua"
}

# write_wrk_loads: the request shapes as wrk scripts in TMP: small.lua (a 66-byte JSON
# completion), sse.lua (the same streamed: the echo-backend's `x-sse: 200:0` answers 200 events)
# and large.lua (a 65,536-byte JSON body).
write_wrk_loads() {
  wrk_post small <<'LUA'
wrk.body = '{"model":"m","prompt":"Say hello to the benchmark.","max_tokens":8}'
LUA
  wrk_post sse <<'LUA'
wrk.headers["x-sse"] = "200:0"
wrk.body = '{"model":"m","prompt":"Say hello to the benchmark.","max_tokens":200,"stream":true}'
LUA
  wrk_post large <<'LUA'
local head, tail = '{"model":"m","prompt":"', '","max_tokens":8}'
local words = string.rep("hello world ", 6000)
wrk.body = head .. string.sub(words, 1, 65536 - #head - #tail) .. tail
LUA
}
