#!/usr/bin/env bash
# Bench (not a test): the proxy side by side with nginx (issue #16 item 2). In one run, the same
# load generator (wrk) against
#   (a) the upstream directly,
#   (b) nginx (Debian nginx-light) as a keep-alive reverse proxy in front of it,
#   (c) continuum-router (release build) in front of it,
# buffered (a small JSON chat completion) and SSE (8 chunks + [DONE]). The proxy under test runs
# alone on one core (taskset -c PROXY_CPU); wrk and the upstream share the other (GEN_CPU).
# Reports throughput at CONNECTIONS connections and p50/p99 both at CONNECTIONS and at one
# connection (unloaded), and the added p50/p99 of (b) and (c) over (a).
#
#   scripts/bench-proxy-nginx.sh              # builds the release router and the upstream first
#   NO_BUILD=1 scripts/bench-proxy-nginx.sh   # uses what target/release holds
#
# Environment: DURATION (10s per measurement), CONNECTIONS (32), PROXY_CPU (1), GEN_CPU (0),
# PORT_BASE (18080: upstream, +1 nginx, +2 router), CARGO_PROFILE (release), ROUTER_BIN (another
# build of the router, e.g. to compare allocators or profiles), MODES ("buffered sse"), ROUNDS (1:
# with more, each point is measured ROUNDS times, nginx and the router in alternating order
# (ABBA), every round is printed and the table gives each column's median, and the router's added
# p50 less nginx's as the median of the rounds' differences; a shared machine's speed drifts by
# more than the difference measured).
# Needs: wrk, nginx (nginx-light), taskset (util-linux). Figures: docs/performance.md,
# "Proxy vs nginx".
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION="${DURATION:-10s}"
MODES="${MODES:-buffered sse}"
ROUNDS="${ROUNDS:-1}"
CONNECTIONS="${CONNECTIONS:-32}"
PROXY_CPU="${PROXY_CPU:-1}"
GEN_CPU="${GEN_CPU:-0}"
PORT_BASE="${PORT_BASE:-18080}"
PROFILE="${CARGO_PROFILE:-release}"
UP_PORT=$PORT_BASE
NGINX_PORT=$((PORT_BASE + 1))
ROUTER_PORT=$((PORT_BASE + 2))

for tool in wrk nginx taskset curl; do
  command -v "$tool" >/dev/null 2>&1 || { echo "needs $tool (Debian: wrk, nginx-light, util-linux, curl)" >&2; exit 1; }
done
if [ -z "${NO_BUILD:-}" ]; then
  cargo build --profile "$PROFILE" --bin continuum-router --example bench_upstream
fi
ROUTER_BIN="${ROUTER_BIN:-target/$PROFILE/continuum-router}"
UPSTREAM_BIN="target/$PROFILE/examples/bench_upstream"
[ -x "$ROUTER_BIN" ] && [ -x "$UPSTREAM_BIN" ] || { echo "build $ROUTER_BIN and $UPSTREAM_BIN first" >&2; exit 1; }

WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

wait_port() { # url: polls until it answers (10 s at most)
  for _ in $(seq 1 100); do
    curl -fsS -o /dev/null -X POST -H 'content-type: application/json' \
      --data '{"model":"m","messages":[{"role":"user","content":"hi"}]}' "$1" && return 0
    sleep 0.1
  done
  echo "nothing answers at $1" >&2
  exit 1
}

# --- (a) upstream ------------------------------------------------------------------------------
taskset -c "$GEN_CPU" "$UPSTREAM_BIN" "127.0.0.1:$UP_PORT" >"$WORK/upstream.log" 2>&1 &
PIDS+=($!)

# --- (b) nginx: one worker, keep-alive to the upstream, no buffering of streamed answers --------
mkdir -p "$WORK/nginx/logs" "$WORK/nginx/tmp"
cat >"$WORK/nginx/nginx.conf" <<EOF
worker_processes 1;
daemon off;
pid $WORK/nginx/nginx.pid;
error_log $WORK/nginx/logs/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $WORK/nginx/tmp/body;
  proxy_temp_path $WORK/nginx/tmp/proxy;
  fastcgi_temp_path $WORK/nginx/tmp/fastcgi;
  uwsgi_temp_path $WORK/nginx/tmp/uwsgi;
  scgi_temp_path $WORK/nginx/tmp/scgi;
  upstream inference { server 127.0.0.1:$UP_PORT; keepalive 256; }
  server {
    listen 127.0.0.1:$NGINX_PORT;
    keepalive_requests 1000000;
    location / {
      proxy_pass http://inference;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }
  }
}
EOF
taskset -c "$PROXY_CPU" nginx -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf" >"$WORK/nginx.log" 2>&1 &
PIDS+=($!)

# --- (c) continuum-router: one unified openai backend, health checks off ------------------------
cat >"$WORK/router.yaml" <<EOF
server:
  bind_address: "127.0.0.1:$ROUTER_PORT"
backends:
  - name: upstream
    type: openai
    url: "http://127.0.0.1:$UP_PORT"
    role: unified
    models: ["m"]
    health_check: {enabled: false}
EOF
RUST_LOG=warn taskset -c "$PROXY_CPU" "$ROUTER_BIN" --config "$WORK/router.yaml" >"$WORK/router.log" 2>&1 &
PIDS+=($!)

wait_port "http://127.0.0.1:$UP_PORT/v1/chat/completions"
wait_port "http://127.0.0.1:$NGINX_PORT/v1/chat/completions"
wait_port "http://127.0.0.1:$ROUTER_PORT/v1/chat/completions"

cat >"$WORK/buffered.lua" <<'EOF'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"m","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Say hello in two words, please."}],"max_tokens":16}'
EOF
cat >"$WORK/sse.lua" <<'EOF'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"m","stream":true,"messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Say hello in two words, please."}],"max_tokens":16}'
EOF

# wrk's latency figure in microseconds ("123.45us", "1.23ms", "1.02s").
to_us() {
  awk -v v="$1" 'BEGIN {
    if (v ~ /us$/) { sub(/us$/, "", v); printf "%.1f", v }
    else if (v ~ /ms$/) { sub(/ms$/, "", v); printf "%.1f", v * 1000 }
    else if (v ~ /s$/) { sub(/s$/, "", v); printf "%.1f", v * 1000000 }
    else printf "nan" }'
}

# measure NAME MODE PORT CONNS -> "rps p50_us p99_us errors"
measure() {
  local out="$WORK/$1-$2-$4.txt"
  taskset -c "$GEN_CPU" wrk -t1 -c"$4" -d"$DURATION" --latency -s "$WORK/$2.lua" \
    "http://127.0.0.1:$3/v1/chat/completions" >"$out"
  local rps p50 p99 errors
  rps=$(awk '/^Requests\/sec:/ {print $2}' "$out")
  p50=$(to_us "$(awk '$1 == "50%" {print $2}' "$out")")
  p99=$(to_us "$(awk '$1 == "99%" {print $2}' "$out")")
  errors=$(awk '/Non-2xx|Socket errors/ {e = e $0 "; "} END {print (e == "" ? "none" : e)}' "$out")
  echo "$rps $p50 $p99 $errors"
}

# median of the arguments
median() { printf '%s\n' "$@" | sort -g | awk '{v[NR] = $1} END {print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2)}'; }

# added GOT BASE: the median over the rounds of GOT[i] - BASE[i] (each round's added latency
# against that round's direct figure); GOT and BASE name arrays.
added() { local -n got=$1 base=$2; local out=() i; for i in "${!got[@]}"; do out+=("$(awk -v a="${got[$i]}" -v b="${base[$i]}" 'BEGIN {print a - b}')"); done; median "${out[@]}"; }

echo "cores: $(nproc); proxy on cpu $PROXY_CPU, wrk + upstream on cpu $GEN_CPU; $DURATION per point; $ROUNDS round(s)"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
for mode in $MODES; do
  for conns in "$CONNECTIONS" 1; do
    # A short warm-up of each path (connections, caches), then the measured runs.
    for port in $UP_PORT $NGINX_PORT $ROUTER_PORT; do
      taskset -c "$GEN_CPU" wrk -t1 -c"$conns" -d2s -s "$WORK/$mode.lua" \
        "http://127.0.0.1:$port/v1/chat/completions" >/dev/null
    done
    D_RPS=() D_P50=() D_P99=() N_RPS=() N_P50=() N_P99=() R_RPS=() R_P50=() R_P99=() RATIO=()
    d_err=none n_err=none r_err=none
    for round in $(seq 1 "$ROUNDS"); do
      read -r d_rps d_p50 d_p99 e <<<"$(measure direct "$mode" "$UP_PORT" "$conns")"
      [ "$e" = none ] || d_err="$e"
      if [ $((round % 2)) = 1 ]; then
        read -r n_rps n_p50 n_p99 e <<<"$(measure nginx "$mode" "$NGINX_PORT" "$conns")"
        [ "$e" = none ] || n_err="$e"
        read -r r_rps r_p50 r_p99 e <<<"$(measure router "$mode" "$ROUTER_PORT" "$conns")"
        [ "$e" = none ] || r_err="$e"
      else
        read -r r_rps r_p50 r_p99 e <<<"$(measure router "$mode" "$ROUTER_PORT" "$conns")"
        [ "$e" = none ] || r_err="$e"
        read -r n_rps n_p50 n_p99 e <<<"$(measure nginx "$mode" "$NGINX_PORT" "$conns")"
        [ "$e" = none ] || n_err="$e"
      fi
      D_RPS+=("$d_rps") D_P50+=("$d_p50") D_P99+=("$d_p99")
      N_RPS+=("$n_rps") N_P50+=("$n_p50") N_P99+=("$n_p99")
      R_RPS+=("$r_rps") R_P50+=("$r_p50") R_P99+=("$r_p99")
      RATIO+=("$(awk -v r="$r_rps" -v n="$n_rps" 'BEGIN {printf "%.3f", r / n}')")
      if [ "$ROUNDS" -gt 1 ]; then
        printf 'round %d (%s): req/s direct / nginx / router %.0f / %.0f / %.0f (router / nginx %.2f); added p50 nginx / router %.0f / %.0f µs\n' \
          "$round" "$([ $((round % 2)) = 1 ] && echo "nginx first" || echo "router first")" \
          "$d_rps" "$n_rps" "$r_rps" "${RATIO[-1]}" \
          "$(awk -v a="$n_p50" -v b="$d_p50" 'BEGIN {print a - b}')" \
          "$(awk -v a="$r_p50" -v b="$d_p50" 'BEGIN {print a - b}')"
      fi
    done
    d_rps=$(median "${D_RPS[@]}") d_p50=$(median "${D_P50[@]}") d_p99=$(median "${D_P99[@]}")
    echo
    echo "== $mode, $conns connection(s); load average $(cut -d' ' -f1-3 /proc/loadavg)$([ "$ROUNDS" -gt 1 ] && echo "; medians of $ROUNDS rounds")"
    printf '%-16s %12s %12s %12s %14s %14s  %s\n' target "req/s" "p50 µs" "p99 µs" "added p50 µs" "added p99 µs" errors
    printf '%-16s %12.0f %12.1f %12.1f %14s %14s  %s\n' direct "$d_rps" "$d_p50" "$d_p99" - - "$d_err"
    printf '%-16s %12.0f %12.1f %12.1f %14.1f %14.1f  %s\n' nginx "$(median "${N_RPS[@]}")" \
      "$(median "${N_P50[@]}")" "$(median "${N_P99[@]}")" "$(added N_P50 D_P50)" "$(added N_P99 D_P99)" "$n_err"
    printf '%-16s %12.0f %12.1f %12.1f %14.1f %14.1f  %s\n' continuum-router "$(median "${R_RPS[@]}")" \
      "$(median "${R_P50[@]}")" "$(median "${R_P99[@]}")" "$(added R_P50 D_P50)" "$(added R_P99 D_P99)" "$r_err"
    echo "continuum-router / nginx throughput: $(median "${RATIO[@]}" | awk '{printf "%.2f", $1}')$([ "$ROUNDS" -gt 1 ] && echo " (median of the rounds' ratios)")"
    # The goal's comparison, paired within each round (both proxies measured minutes apart
    # against the same upstream): the columns' medians above may come from different rounds.
    echo "continuum-router added p50 - nginx added p50: $(added R_P50 N_P50 | awk '{printf "%.0f", $1}') µs$([ "$ROUNDS" -gt 1 ] && echo " (median of the rounds' differences)")"
  done
done
echo
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
