#!/usr/bin/env bash
# Fullproxy throughput: wrk against loxilb (mode 4, sel 0 round-robin, 2 endpoints) and against
# nginx configured as the equivalent reverse proxy (round-robin upstream, HTTP/1.1 keep-alive to
# the backends), over the same two echo-backends, with the same number of worker threads.
# Prints requests/s and p99 latency for both and the loxi/nginx ratio. A second case does the
# same with both proxies terminating TLS (loxi `security: 1`, nginx `ssl`): one ECDSA P-256
# certificate (openssl), TLS 1.3 with TLS_AES_256_GCM_SHA384 and X25519 on both, HTTP/1.1
# keep-alive clients (wrk), plain HTTP to the backends. TLS=0 skips it.
#
#   DURATION=10   seconds per run        THREADS=2   wrk threads
#   CONNS=64      wrk connections        WORKERS=2   loxilb tokio workers = nginx worker_processes
#
# Loopback only; both runs are bounded by DURATION. Needs wrk and nginx (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-10}
THREADS=${THREADS:-2}
CONNS=${CONNS:-64}
WORKERS=${WORKERS:-2}
export PATH="$HOME/.cargo/bin:/usr/sbin:$PATH"

TLS=${TLS:-1}
for cmd in wrk nginx curl openssl; do
  command -v "$cmd" >/dev/null || { echo "bench-proxy: $cmd missing (run scripts/setup.sh)" >&2; exit 1; }
done

cargo build --release -q -p loxi-user --bin loxilb -p loxi-tests --bin echo-backend
BIN=target/release
TMP=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -f "$TMP/nginx.pid" ] && kill "$(cat "$TMP/nginx.pid")" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$TMP"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() {
  for _ in $(seq 1 200); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.05
  done
  echo "bench-proxy: nothing listening on $1" >&2; exit 1
}

B1=$(free_port); B2=$(free_port); API=$(free_port); LB=$(free_port); NGX=$(free_port)
LBS=$(free_port); NGXS=$(free_port)
"$BIN/echo-backend" --port "$B1" --name 0 --threads 1 2>"$TMP/b1.log" & PIDS+=($!)
"$BIN/echo-backend" --port "$B2" --name 1 --threads 1 2>"$TMP/b2.log" & PIDS+=($!)
wait_port "$B1"; wait_port "$B2"

TOKIO_WORKER_THREADS=$WORKERS "$BIN/loxilb" --api-addr "127.0.0.1:$API" --state-dir "$TMP/state" \
  --tokenizer-dir "$TMP/tok" --log warn >"$TMP/loxilb.log" 2>&1 & PIDS+=($!)
wait_port "$API"
curl -sf -X POST "http://127.0.0.1:$API/netlox/v1/config/loadbalancer" -H 'content-type: application/json' -d "{
  \"serviceArguments\": {\"externalIP\": \"127.0.0.1\", \"port\": $LB, \"protocol\": \"tcp\", \"mode\": 4, \"sel\": 0},
  \"endpoints\": [{\"endpointIP\": \"127.0.0.1\", \"targetPort\": $B1, \"weight\": 1},
                  {\"endpointIP\": \"127.0.0.1\", \"targetPort\": $B2, \"weight\": 1}]}" >/dev/null
wait_port "$LB"

if [ "$TLS" = 1 ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
    -subj /CN=bench.test -addext subjectAltName=DNS:bench.test \
    -keyout "$TMP/tls.key" -out "$TMP/tls.crt" 2>/dev/null
  # The `default` certificate: wrk connects to 127.0.0.1 and sends no SNI.
  python3 - "$TMP" "$API" <<'PY'
import json, sys, urllib.request
tmp, api = sys.argv[1], sys.argv[2]
body = json.dumps({"certId": "default", "certPem": open(f"{tmp}/tls.crt").read(),
                   "keyPem": open(f"{tmp}/tls.key").read()}).encode()
req = urllib.request.Request(f"http://127.0.0.1:{api}/netlox/v1/config/cert", body,
                             {"Content-Type": "application/json"})
urllib.request.urlopen(req).read()
PY
  curl -sf -X POST "http://127.0.0.1:$API/netlox/v1/config/loadbalancer" -H 'content-type: application/json' -d "{
    \"serviceArguments\": {\"externalIP\": \"127.0.0.1\", \"port\": $LBS, \"protocol\": \"tcp\", \"mode\": 4, \"sel\": 0, \"security\": 1},
    \"endpoints\": [{\"endpointIP\": \"127.0.0.1\", \"targetPort\": $B1, \"weight\": 1},
                    {\"endpointIP\": \"127.0.0.1\", \"targetPort\": $B2, \"weight\": 1}]}" >/dev/null
  wait_port "$LBS"
  NGX_TLS="server {
    listen 127.0.0.1:$NGXS ssl;
    ssl_certificate $TMP/tls.crt;
    ssl_certificate_key $TMP/tls.key;
    ssl_protocols TLSv1.3;
    ssl_conf_command Ciphersuites TLS_AES_256_GCM_SHA384;
    ssl_ecdh_curve X25519;
    ssl_session_cache shared:SSL:10m;
    location / {
      proxy_pass http://backends;
      proxy_http_version 1.1;
      proxy_set_header Connection \"\";
      proxy_buffering off;
    }
  }"
else
  NGX_TLS=""
fi

cat >"$TMP/nginx.conf" <<NGINX
worker_processes $WORKERS;
daemon on;
pid $TMP/nginx.pid;
error_log $TMP/nginx-error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $TMP/nginx-body;
  proxy_temp_path $TMP/nginx-proxy;
  upstream backends { server 127.0.0.1:$B1; server 127.0.0.1:$B2; keepalive 128; }
  server {
    listen 127.0.0.1:$NGX;
    location / {
      proxy_pass http://backends;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }
  }
  $NGX_TLS
}
NGINX
nginx -p "$TMP" -c "$TMP/nginx.conf"
wait_port "$NGX"

cat >"$TMP/post.lua" <<'LUA'
wrk.method = "POST"
wrk.path = "/v1/completions"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"m","prompt":"Say hello to the benchmark.","max_tokens":8}'
LUA

# Sanity: both proxies answer through the backends.
curl -sf -X POST "http://127.0.0.1:$LB/v1/completions" -d '{}' | grep -q backend
curl -sf -X POST "http://127.0.0.1:$NGX/v1/completions" -d '{}' | grep -q backend

run() { # name port [scheme] -> "rps p99_ms"
  local out
  out=$(wrk -t "$THREADS" -c "$CONNS" -d "${DURATION}s" --latency -s "$TMP/post.lua" "${3:-http}://127.0.0.1:$2/" 2>&1)
  echo "$out" >"$TMP/wrk-$1.txt"
  local rps p99 non2xx
  rps=$(awk '/Requests\/sec:/ {print $2}' <<<"$out")
  p99=$(awk '$1=="99%" {v=$2; if (v ~ /us$/) {sub(/us$/,"",v); v=v/1000} else if (v ~ /ms$/) {sub(/ms$/,"",v)} else if (v ~ /s$/) {sub(/s$/,"",v); v=v*1000}; print v}' <<<"$out")
  non2xx=$(awk '/Non-2xx or 3xx responses:/ {print $5}' <<<"$out")
  [ -n "$non2xx" ] && echo "bench-proxy: $1 had $non2xx non-2xx responses" >&2
  echo "$rps $p99"
}

# Warm both (connection pools, page cache), then measure.
wrk -t 1 -c 8 -d 1s -s "$TMP/post.lua" "http://127.0.0.1:$LB/" >/dev/null
wrk -t 1 -c 8 -d 1s -s "$TMP/post.lua" "http://127.0.0.1:$NGX/" >/dev/null
read -r L_RPS L_P99 <<<"$(run loxilb "$LB")"
read -r N_RPS N_P99 <<<"$(run nginx "$NGX")"

printf '\nfullproxy benchmark: wrk -t%s -c%s -d%ss, POST /v1/completions, 2 echo-backends, %s workers each\n' \
  "$THREADS" "$CONNS" "$DURATION" "$WORKERS"
printf '%-8s %12s %10s\n' proxy 'requests/s' 'p99 ms'
printf '%-8s %12.0f %10.2f\n' loxilb "$L_RPS" "$L_P99"
printf '%-8s %12.0f %10.2f\n' nginx "$N_RPS" "$N_P99"
awk -v a="$L_RPS" -v b="$N_RPS" -v c="$L_P99" -v d="$N_P99" \
  'BEGIN { printf "ratio    loxi/nginx requests/s = %.3f   p99 loxi/nginx = %.3f\n", a/b, c/d }'

if [ "$TLS" = 1 ]; then
  curl -sfk -X POST "https://127.0.0.1:$LBS/v1/completions" -d '{}' | grep -q backend
  curl -sfk -X POST "https://127.0.0.1:$NGXS/v1/completions" -d '{}' | grep -q backend
  LC=$(echo | openssl s_client -connect "127.0.0.1:$LBS" 2>/dev/null | awk '/^New, /{print $NF}')
  NC=$(echo | openssl s_client -connect "127.0.0.1:$NGXS" 2>/dev/null | awk '/^New, /{print $NF}')
  wrk -t 1 -c 8 -d 1s -s "$TMP/post.lua" "https://127.0.0.1:$LBS/" >/dev/null
  wrk -t 1 -c 8 -d 1s -s "$TMP/post.lua" "https://127.0.0.1:$NGXS/" >/dev/null
  read -r LS_RPS LS_P99 <<<"$(run loxilb-tls "$LBS" https)"
  read -r NS_RPS NS_P99 <<<"$(run nginx-tls "$NGXS" https)"
  printf '\nTLS termination (cipher: loxilb %s, nginx %s; keep-alive clients)\n' "$LC" "$NC"
  printf '%-10s %12s %10s\n' proxy 'requests/s' 'p99 ms'
  printf '%-10s %12.0f %10.2f\n' loxilb-tls "$LS_RPS" "$LS_P99"
  printf '%-10s %12.0f %10.2f\n' nginx-tls "$NS_RPS" "$NS_P99"
  awk -v a="$LS_RPS" -v b="$NS_RPS" -v c="$LS_P99" -v d="$NS_P99" \
    'BEGIN { printf "ratio      loxi/nginx requests/s = %.3f   p99 loxi/nginx = %.3f\n", a/b, c/d }'
fi
