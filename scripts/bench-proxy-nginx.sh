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
#
# MODES=streams (issue #34): many concurrent timed SSE streams instead of wrk. For each count in
# STREAMS ("200 1000 2000"), the stream client (`benches/upstream/sse_client.rs`, pinned beside
# the upstream) opens that many streams at once (over STREAM_RAMP_MS, 0), each of STREAM_EVENTS
# (120) `chat.completion.chunk` events one every STREAM_INTERVAL_MS (50: 20 events/s), directly,
# through nginx and through the router (ROUNDS times, nginx and the router in alternating order).
# Per proxy and run: CPU time (/proc/<pid>/stat utime + stime, nginx's master and worker) per
# relayed event, RSS before, with every stream open (mid-run) and after (VmRSS, VmHWM), hence the
# memory per open stream; from the client: event latency p50/p99 (received less the upstream's
# stamp; "added" is the proxy's less the direct run's), the added gap between events, the time to
# a stream's first event and the wall time to the last [DONE]; the SYNs the kernel resent during
# the run (nstat, iproute2: each is a stream's lost second). PERF_OUT=/tmp/p records each
# proxy's profile over each run (`perf record -g`, files /tmp/p.<proxy>.<streams>).
#
# Needs: wrk (not for MODES=streams), nginx (nginx-light), taskset (util-linux). Figures:
# docs/performance.md, "Proxy vs nginx" and "Many concurrent streams".
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

STREAMS="${STREAMS:-200 1000 2000}"
STREAM_EVENTS="${STREAM_EVENTS:-120}"
STREAM_INTERVAL_MS="${STREAM_INTERVAL_MS:-50}"
STREAM_RAMP_MS="${STREAM_RAMP_MS:-0}"

tools="nginx taskset curl"
[ "$MODES" = streams ] || tools="wrk $tools"
for tool in $tools; do
  command -v "$tool" >/dev/null 2>&1 || { echo "needs $tool (Debian: wrk, nginx-light, util-linux, curl)" >&2; exit 1; }
done
if [ -z "${NO_BUILD:-}" ]; then
  cargo build --profile "$PROFILE" --bin continuum-router --example bench_upstream --example bench_sse_client
fi
ROUTER_BIN="${ROUTER_BIN:-target/$PROFILE/continuum-router}"
UPSTREAM_BIN="target/$PROFILE/examples/bench_upstream"
CLIENT_BIN="target/$PROFILE/examples/bench_sse_client"
[ -x "$ROUTER_BIN" ] && [ -x "$UPSTREAM_BIN" ] || { echo "build $ROUTER_BIN and $UPSTREAM_BIN first" >&2; exit 1; }
[ "$MODES" != streams ] || [ -x "$CLIENT_BIN" ] || { echo "build $CLIENT_BIN first" >&2; exit 1; }

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
worker_rlimit_nofile 16384;
daemon off;
pid $WORK/nginx/nginx.pid;
error_log $WORK/nginx/logs/error.log warn;
events { worker_connections 8192; }
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
ROUTER_PID=$!
NGINX_PID=${PIDS[1]}

wait_port "http://127.0.0.1:$UP_PORT/v1/chat/completions"
wait_port "http://127.0.0.1:$NGINX_PORT/v1/chat/completions"
wait_port "http://127.0.0.1:$ROUTER_PORT/v1/chat/completions"

# --- MODES=streams: many concurrent timed SSE streams (issue #34) -------------------------------
# CPU ticks (utime + stime) of the processes PIDS... and their children (nginx's worker).
cpu_ticks() {
  local total=0 pid child
  for pid in "$@"; do
    for child in $pid $(cat /proc/"$pid"/task/*/children 2>/dev/null); do
      total=$((total + $(awk '{print $14 + $15}' /proc/"$child"/stat)))
    done
  done
  echo "$total"
}
# The kB of FIELD (VmRSS, VmHWM) summed over PID and its children.
mem_kb() {
  local field=$1 pid=$2 total=0 child
  for child in $pid $(cat /proc/"$pid"/task/*/children 2>/dev/null); do
    total=$((total + $(awk -v f="$field:" '$1 == f {print $2}' /proc/"$child"/status)))
  done
  echo "$total"
}
# run_streams NAME PORT PID N -> the client's RESULT line plus cpu_us_per_event, rss before/mid/
# after (kB), hwm (kB); PID empty for the direct run.
run_streams() {
  local name=$1 port=$2 pid=$3 n=$4 out="$WORK/streams-$1-$4.txt"
  local hz ticks0 ticks1 rss0=0 rss_mid=0 rss1=0 hwm=0 half_s
  hz=$(getconf CLK_TCK)
  half_s=$(awk -v r="$STREAM_RAMP_MS" -v e="$STREAM_EVENTS" -v i="$STREAM_INTERVAL_MS" 'BEGIN {printf "%.2f", (r + e * i / 2) / 1000}')
  [ -z "$pid" ] || { ticks0=$(cpu_ticks "$pid"); rss0=$(mem_kb VmRSS "$pid"); }
  # SYNs resent during the run (a full accept queue, or a port still in TIME_WAIT): each costs
  # its stream a second. nstat (iproute2) keeps its own history; without it, "nan".
  local syn0=nan syn1=nan
  syn0=$(syn_retrans)
  taskset -c "$GEN_CPU" "$CLIENT_BIN" "127.0.0.1:$port" "$n" "$STREAM_EVENTS" "$STREAM_INTERVAL_MS" \
    "$STREAM_RAMP_MS" >"$out" 2>&1 &
  local client=$!
  local perf=
  if [ -n "${PERF_OUT:-}" ] && [ -n "$pid" ]; then
    # A profile of the proxy over the client's run (perf record -g; PERF_OUT.<name>.<n>).
    perf record -g -o "$PERF_OUT.$name.$n" -p "$(echo $pid $(cat /proc/"$pid"/task/*/children) | tr ' ' ,)" -- sleep "$(awk -v h="$half_s" 'BEGIN {print 2 * h}')" >/dev/null 2>&1 &
    perf=$!
  fi
  sleep "$half_s"
  [ -z "$pid" ] || rss_mid=$(mem_kb VmRSS "$pid")
  [ -z "$perf" ] || wait "$perf" || true
  wait "$client" || echo "($name, $n streams: the client reported failures: $(grep -v RESULT "$out" | head -1))" >&2
  syn1=$(syn_retrans)
  [ -z "$pid" ] || { ticks1=$(cpu_ticks "$pid"); rss1=$(mem_kb VmRSS "$pid"); hwm=$(mem_kb VmHWM "$pid"); }
  local received
  received=$(awk '/^RESULT/ {for (i = 2; i <= NF; i++) if ($i ~ /^received=/) {sub(/received=/, "", $i); print $i}}' "$out")
  local cpu=nan
  [ -z "$pid" ] || cpu=$(awk -v t="$((ticks1 - ticks0))" -v hz="$hz" -v n="${received:-0}" 'BEGIN {printf "%.2f", n ? t * 1e6 / hz / n : 0}')
  echo "$(grep '^RESULT' "$out" | cut -d' ' -f2-) cpu_us_per_event=$cpu cpu_s=$([ -z "$pid" ] && echo nan || awk -v t="$((ticks1 - ticks0))" -v hz="$hz" 'BEGIN {printf "%.2f", t / hz}') syn_retrans=$(awk -v a="$syn0" -v b="$syn1" 'BEGIN {print (a == "nan" || b == "nan") ? "nan" : b - a}') rss0_kb=$rss0 rss_mid_kb=$rss_mid rss1_kb=$rss1 hwm_kb=$hwm"
}
# The kernel's count of resent SYNs (TcpExtTCPSynRetrans), or nan without nstat.
syn_retrans() {
  command -v nstat >/dev/null 2>&1 || { echo nan; return; }
  nstat -asz TcpExtTCPSynRetrans 2>/dev/null | awk '$1 == "TcpExtTCPSynRetrans" {print $2; f = 1} END {if (!f) print "nan"}'
}
# field KEY LINE
field() { awk -v k="$2" '{for (i = 1; i <= NF; i++) {split($i, kv, "="); if (kv[1] == k) print kv[2]}}' <<<"$1"; }

if [ "$MODES" = streams ]; then
  echo "cores: $(nproc); proxy on cpu $PROXY_CPU, client + upstream on cpu $GEN_CPU; $STREAM_EVENTS events per stream every $STREAM_INTERVAL_MS ms, ramp $STREAM_RAMP_MS ms; $ROUNDS round(s)"
  echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
  for n in $STREAMS; do
    # Warm-up: a few streams through each path (pools, caches).
    for port in $UP_PORT $NGINX_PORT $ROUTER_PORT; do
      taskset -c "$GEN_CPU" "$CLIENT_BIN" "127.0.0.1:$port" 16 4 "$STREAM_INTERVAL_MS" >/dev/null 2>&1 || true
    done
    echo
    echo "== $n streams; load average $(cut -d' ' -f1-3 /proc/loadavg)"
    printf '%-7s %-6s %8s %7s %7s %8s %8s %8s %8s %6s %9s %8s %8s %8s %9s\n' round target wall_s "lat50" "lat99" "+lat99" "gap99" "first50" "first99" "synrt" "cpu_s" "µs/event" "rss_MB" "hwm_MB" "KiB/strm"
    for round in $(seq 1 "$ROUNDS"); do
      direct=$(run_streams direct "$UP_PORT" "" "$n")
      d99=$(field "$direct" lat_p99_us)
      if [ $((round % 2)) = 1 ]; then order="nginx router"; else order="router nginx"; fi
      lines=("direct $direct")
      for who in $order; do
        if [ "$who" = nginx ]; then lines+=("nginx $(run_streams nginx "$NGINX_PORT" "$NGINX_PID" "$n")")
        else lines+=("router $(run_streams router "$ROUTER_PORT" "$ROUTER_PID" "$n")"); fi
      done
      for line in "${lines[@]}"; do
        who=${line%% *}
        printf '%-7s %-6s %8s %7s %7s %8s %8s %8s %8s %6s %9s %8s %8s %8s %9s\n' "$round" "$who" \
          "$(field "$line" wall_s)" "$(field "$line" lat_p50_us)" "$(field "$line" lat_p99_us)" \
          "$(awk -v a="$(field "$line" lat_p99_us)" -v b="$d99" 'BEGIN {print a - b}')" \
          "$(field "$line" gap_p99_us)" "$(field "$line" first_p50_ms)" "$(field "$line" first_p99_ms)" "$(field "$line" syn_retrans)" \
          "$(field "$line" cpu_s)" "$(field "$line" cpu_us_per_event)" \
          "$(awk -v k="$(field "$line" rss_mid_kb)" 'BEGIN {printf "%.1f", k / 1024}')" \
          "$(awk -v k="$(field "$line" hwm_kb)" 'BEGIN {printf "%.1f", k / 1024}')" \
          "$(awk -v m="$(field "$line" rss_mid_kb)" -v b="$(field "$line" rss0_kb)" -v n="$n" 'BEGIN {printf "%.1f", (m - b) / n}')"
        [ "$(field "$line" failed)" = 0 ] || echo "        ^ $(field "$line" failed) stream(s) failed"
      done
    done
  done
  echo
  echo "columns: wall_s first connect to last [DONE]; lat50/lat99 event latency µs (received less"
  echo "sent); +lat99 less the direct run's; gap99 p99 of |gap received - gap sent| µs; first50/99"
  echo "ms to a stream's first event; synrt SYNs the kernel resent during the run (each a stream's"
  echo "second lost); cpu_s the proxy's CPU over the run; rss_MB with every stream"
  echo "open; KiB/strm (RSS open - RSS before) / streams"
  echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
  exit 0
fi

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
