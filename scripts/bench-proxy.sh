#!/usr/bin/env bash
# Fullproxy throughput: wrk against loxilb (mode 4, sel 0 round-robin, 2 endpoints) and against
# nginx configured as the equivalent reverse proxy (round-robin upstream, HTTP/1.1 keep-alive to
# the backends, request bodies buffered in memory, responses not buffered), over the same two
# echo-backends, with the same number of worker threads. Each case prints requests/s and p99
# latency for both and the loxi/nginx ratios:
#   small  POST /v1/completions with a 66-byte JSON body, a ~70-byte JSON answer;
#   sse    the same with `"stream": true` and `x-sse: 200:0`: a text/event-stream answer of
#          200 events back to back (~30 bytes each) then `data: [DONE]`, chunked;
#   large  a 64 KiB prompt (a 65,536-byte JSON body), a ~70-byte JSON answer;
#   tls    `small` with both proxies terminating TLS (loxi `security: 1`, nginx `ssl`): one
#          ECDSA P-256 certificate (openssl), TLS 1.3 with TLS_AES_256_GCM_SHA384 and X25519 on
#          both, HTTP/1.1 keep-alive clients (wrk), plain HTTP to the backends.
# Within a run, every case measures loxilb, the hyper floor (below) and nginx back to back; RUNS
# repeats the whole set and the summary gives each case's median ratios. Besides requests/s and
# p99, each proxy's CPU per request (its processes' user + system time over the measurement,
# from /proc, divided by the requests served) is printed: on a shared machine it moves far less
# than requests/s.
# The hyper floor (`hyper-floor`, tests/src/bin) is the same forwarding done with nothing but
# tokio and hyper's HTTP/1.1 server and client (a client connection per backend per client
# connection, body read whole, response streamed), threaded as loxi's connection workers (one
# single-threaded runtime per worker): what the libraries loxi is built on cost, so loxi's CPU
# per request over the floor's is what loxi's own per-request work adds. Not measured in the
# tls case (it has no TLS).
#
#   DURATION=10   seconds per measurement   THREADS=2   wrk threads
#   CONNS=64      wrk connections           WORKERS=2   loxilb connection workers (and tokio
#                                                       workers) = floor workers = nginx
#                                                       worker_processes
#   PROXY_WORKERS=$WORKERS   loxilb's --proxy-workers alone (0: connections on the shared
#                            work-stealing runtime, loxi's model before the workers)
#   CASES="small sse large tls"             RUNS=1      repetitions of the whole set
#   TLS=0         drops the tls case (kept for older invocations)
#   BUILD_PROFILE=pgo    what loxilb, the floor and the echo-backends are built and run
#                 from: pgo (what the container image ships): loxilb from scripts/build-pgo.sh
#                 (the dist profile plus profile-guided optimization; ~18 min the first time,
#                 ~10 after a source change, reused while the sources are unchanged), the
#                 floor and the echo-backends from dist; dist (fat LTO, see Cargo.toml; ~6.5
#                 min to build the first time) for all three; or release (setup.sh's build)
#
#   NGINX_FORWARDED=1    nginx sets X-Forwarded-For ($proxy_add_x_forwarded_for) and
#                 X-Forwarded-Proto ($scheme) as loxi does on every request (README): the
#                 same work; 0 gives nginx's bare proxy_pass, without them (what
#                 this bench measured before 2026-12-07). The floor adds neither in both.
#
# Loopback only; every measurement is bounded by DURATION. Needs wrk and nginx (scripts/setup.sh).
set -euo pipefail
# CARGO_TARGET_DIR, LOXI_BIN_DIR, LOXI_SHARED made absolute; cargo_profile_dir.
# shellcheck source=lib/paths.sh
. "$(dirname "$0")/lib/paths.sh"
cd "$(dirname "$0")/.."
DURATION=${DURATION:-10}
THREADS=${THREADS:-2}
CONNS=${CONNS:-64}
WORKERS=${WORKERS:-2}
RUNS=${RUNS:-1}
BUILD_PROFILE=${BUILD_PROFILE:-pgo}
CASES=${CASES:-small sse large tls}
[ "${TLS:-1}" = 0 ] && CASES=${CASES//tls/}
export PATH="$HOME/.cargo/bin:/usr/sbin:$PATH"
NGINX_FORWARDED=${NGINX_FORWARDED:-1}
case "$NGINX_FORWARDED" in
  1) NGX_FWD='proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
      proxy_set_header X-Forwarded-Proto $scheme;' ;;
  0) NGX_FWD='' ;;
  *) echo "bench-proxy: NGINX_FORWARDED must be 1 or 0, not '$NGINX_FORWARDED'" >&2; exit 2 ;;
esac

TLS=0
case " $CASES " in *" tls "*) TLS=1 ;; esac
for cmd in wrk nginx curl openssl; do
  command -v "$cmd" >/dev/null || { echo "bench-proxy: $cmd missing (run scripts/setup.sh)" >&2; exit 1; }
done

proxy_bench_binaries bench-proxy "$BUILD_PROFILE"
# TMP, PIDS, cleanup on exit, free_port, wait_port.
# shellcheck source=lib/loopback.sh
. scripts/lib/loopback.sh
cleanup_extra() { [ -f "$TMP/nginx.pid" ] && kill "$(cat "$TMP/nginx.pid")" 2>/dev/null || true; }

API=$(free_port); LB=$(free_port); NGX=$(free_port); FLR=$(free_port)
LBS=$(free_port); NGXS=$(free_port)
echo_backends "$BIN"

TOKIO_WORKER_THREADS=$WORKERS "$LB_BIN_DIR/loxilb" --api-addr "127.0.0.1:$API" --state-dir "$TMP/state" \
  --tokenizer-dir "$TMP/tok" --proxy-workers "${PROXY_WORKERS:-$WORKERS}" --log warn \
  >"$TMP/loxilb.log" 2>&1 & PIDS+=($!)
LOXI_PID=$!
wait_port "$API"
sel0_rule "$API" "$LB" "$B1" "$B2"
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
      $NGX_FWD
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
  # Request bodies up to 128 KiB stay in memory (the default 16 KiB would write the 64 KiB
  # prompts of the large case to a temp file; loxi holds them in memory).
  client_body_buffer_size 128k;
  proxy_temp_path $TMP/nginx-proxy;
  upstream backends { server 127.0.0.1:$B1; server 127.0.0.1:$B2; keepalive 128; }
  server {
    listen 127.0.0.1:$NGX;
    location / {
      proxy_pass http://backends;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      $NGX_FWD
      proxy_buffering off;
    }
  }
  $NGX_TLS
}
NGINX
nginx -p "$TMP" -c "$TMP/nginx.conf"
wait_port "$NGX"
NGX_PIDS=$(pgrep -P "$(cat "$TMP/nginx.pid")" | tr '\n' ' ')
TOKIO_WORKER_THREADS=$WORKERS "$BIN/hyper-floor" "127.0.0.1:$FLR" "127.0.0.1:$B1" "127.0.0.1:$B2" \
  2>"$TMP/floor.log" & PIDS+=($!)
FLR_PID=$!
wait_port "$FLR"

write_wrk_loads
cp "$TMP/small.lua" "$TMP/tls.lua"

# Sanity: both proxies answer every case through the backends.
for port in "$LB" "$NGX" "$FLR"; do
  curl -sf -X POST "http://127.0.0.1:$port/v1/completions" -d '{}' | grep -q backend
  curl -sf -X POST "http://127.0.0.1:$port/v1/completions" -H 'x-sse: 200:0' -d '{"stream":true}' \
    | grep -c '^data: ' | grep -qx 201
  head -c 65536 /dev/zero | tr '\0' a | curl -sf -X POST "http://127.0.0.1:$port/v1/completions" \
    --data-binary @- | grep -q '"body_len":65536'
done

# CPU ticks (user + system) of the given pids so far.
ticks() { local t=0 p; for p in "$@"; do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done; echo "$t"; }
measure() { # name url lua pid... -> "rps p99_ms cpu_us_per_request"
  local name=$1 u=$2 lua=$3 out t0 t1
  shift 3
  t0=$(ticks "$@")
  out=$(wrk -t "$THREADS" -c "$CONNS" -d "${DURATION}s" --latency -s "$lua" "$u" 2>&1)
  t1=$(ticks "$@")
  echo "$out" >"$TMP/wrk-$name.txt"
  local rps p99 non2xx reqs
  rps=$(awk '/Requests\/sec:/ {print $2}' <<<"$out")
  reqs=$(awk '/requests in/ {print $1}' <<<"$out")
  p99=$(awk '$1=="99%" {v=$2; if (v ~ /us$/) {sub(/us$/,"",v); v=v/1000} else if (v ~ /ms$/) {sub(/ms$/,"",v)} else if (v ~ /s$/) {sub(/s$/,"",v); v=v*1000}; print v}' <<<"$out")
  non2xx=$(awk '/Non-2xx or 3xx responses:/ {print $5}' <<<"$out")
  [ -n "$non2xx" ] && echo "bench-proxy: $name had $non2xx non-2xx responses" >&2
  echo "$rps $p99 $(awk -v t=$((t1 - t0)) -v hz="$(getconf CLK_TCK)" -v n="$reqs" 'BEGIN { printf "%.1f", t * 1e6 / hz / n }')"
}

if [ "$TLS" = 1 ]; then
  curl -sfk -X POST "https://127.0.0.1:$LBS/v1/completions" -d '{}' | grep -q backend
  curl -sfk -X POST "https://127.0.0.1:$NGXS/v1/completions" -d '{}' | grep -q backend
  LC=$(echo | openssl s_client -connect "127.0.0.1:$LBS" 2>/dev/null | awk '/^New, /{print $NF}')
  NC=$(echo | openssl s_client -connect "127.0.0.1:$NGXS" 2>/dev/null | awk '/^New, /{print $NF}')
fi

url() { # proxy case
  case "$1/$2" in
    loxilb/tls) echo "https://127.0.0.1:$LBS/" ;;
    nginx/tls) echo "https://127.0.0.1:$NGXS/" ;;
    loxilb/*) echo "http://127.0.0.1:$LB/" ;;
    nginx/*) echo "http://127.0.0.1:$NGX/" ;;
    floor/*) echo "http://127.0.0.1:$FLR/" ;;
  esac
}

# Warm both (connection pools, page cache) in every case, then measure.
for c in $CASES; do
  for p in loxilb nginx floor; do
    [ "$p/$c" = floor/tls ] && continue
    wrk -t 1 -c 8 -d 1s -s "$TMP/$c.lua" "$(url "$p" "$c")" >/dev/null
  done
done

printf '\nfullproxy benchmark: wrk -t%s -c%s -d%ss, 2 echo-backends, %s workers each (loxilb --proxy-workers %s), %s run(s); load before: %s\n' \
  "$THREADS" "$CONNS" "$DURATION" "$WORKERS" "${PROXY_WORKERS:-$WORKERS}" "$RUNS" "$(cut -d' ' -f1-3 /proc/loadavg)"
printf 'binaries: loxilb %s, floor and echo-backends %s\n' "$LB_BIN_DIR" "$BIN"
printf 'nginx forwarding headers (X-Forwarded-For/-Proto, as loxi): %s\n' \
  "$([ "$NGINX_FORWARDED" = 1 ] && echo on || echo 'off (NGINX_FORWARDED=0)')"
[ "$TLS" = 1 ] && printf 'tls cipher: loxilb %s, nginx %s\n' "$LC" "$NC"
printf '%-4s %-6s %11s %8s %7s | %11s %8s %7s | %11s %8s %7s | %9s %8s %8s %8s\n' run case \
  'loxi req/s' 'p99 ms' 'cpu us' 'floor req/s' 'p99 ms' 'cpu us' 'nginx req/s' 'p99 ms' 'cpu us' \
  'req/s l/n' 'p99 l/n' 'cpu l/n' 'cpu f/n'
: >"$TMP/ratios"
for run in $(seq 1 "$RUNS"); do
  for c in $CASES; do
    read -r L_RPS L_P99 L_CPU <<<"$(measure "loxilb-$c-$run" "$(url loxilb "$c")" "$TMP/$c.lua" "$LOXI_PID")"
    if [ "$c" = tls ]; then
      F_RPS=0 F_P99=0 F_CPU=0
    else
      read -r F_RPS F_P99 F_CPU <<<"$(measure "floor-$c-$run" "$(url floor "$c")" "$TMP/$c.lua" "$FLR_PID")"
    fi
    # shellcheck disable=SC2086
    read -r N_RPS N_P99 N_CPU <<<"$(measure "nginx-$c-$run" "$(url nginx "$c")" "$TMP/$c.lua" $NGX_PIDS)"
    awk -v r="$run" -v c="$c" -v a="$L_RPS" -v b="$L_P99" -v l="$L_CPU" -v fa="$F_RPS" -v fb="$F_P99" \
      -v f="$F_CPU" -v x="$N_RPS" -v y="$N_P99" -v n="$N_CPU" \
      'BEGIN { printf "%-4s %-6s %11.0f %8.2f %7.1f | %11.0f %8.2f %7.1f | %11.0f %8.2f %7.1f | %9.3f %8.3f %8.3f %8.3f\n",
               r, c, a, b, l, fa, fb, f, x, y, n, a/x, b/y, l/n, f/n }'
    awk -v c="$c" -v a="$L_RPS" -v b="$L_P99" -v x="$N_RPS" -v y="$N_P99" -v l="$L_CPU" -v f="$F_CPU" -v n="$N_CPU" \
      'BEGIN { printf "%s %.3f %.3f %.3f %.3f\n", c, a/x, b/y, l/n, f/n }' >>"$TMP/ratios"
  done
done
median() { sort -n | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
if [ "$RUNS" -gt 1 ]; then
  printf '\nmedian over %s runs (load after: %s)\n' "$RUNS" "$(cut -d' ' -f1-3 /proc/loadavg)"
  for c in $CASES; do
    rq=$(awk -v c="$c" '$1==c {print $2}' "$TMP/ratios" | median)
    pq=$(awk -v c="$c" '$1==c {print $3}' "$TMP/ratios" | median)
    lc=$(awk -v c="$c" '$1==c {print $4}' "$TMP/ratios" | median)
    fc=$(awk -v c="$c" '$1==c {print $5}' "$TMP/ratios" | median)
    printf '%-6s loxi/nginx requests/s = %.3f   p99 loxi/nginx = %.3f   CPU per request loxi/nginx = %.3f, floor/nginx = %.3f\n' \
      "$c" "$rq" "$pq" "$lc" "$fc"
  done
fi
