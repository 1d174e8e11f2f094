#!/usr/bin/env bash
# Bench (not a test): the router's user-space instructions per proxied request, under
# `valgrind --tool=callgrind` (issue #16 item 2). Independent of the machine's load, so two builds
# compare on a busy machine where wall-clock figures do not.
#
# Starts the bench upstream (`benches/upstream/server.rs`) and the router (one `type: openai`
# backend, as in scripts/bench-proxy-nginx.sh) under callgrind, drives it with wrk for a warm-up,
# zeroes the counters (`callgrind_control -z`), drives it for DURATION, dumps
# (`callgrind_control -d`) and divides the dump's total instructions by the requests wrk counted.
#
#   scripts/callgrind-proxy.sh                      # buffered and SSE, target/release
#   MODES=buffered ROUTER_BIN=other/build scripts/callgrind-proxy.sh
#
# Environment: DURATION (8s), WARMUP (3s), CONNECTIONS (32), MODES ("buffered sse"), PORT_BASE
# (18180: upstream, +2 router), ROUTER_BIN, UPSTREAM_BIN, KEEP (a directory to keep the dumps in,
# for `callgrind_annotate`). Needs: valgrind, wrk, curl. Figures: docs/performance.md, "Proxy vs
# nginx".
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION="${DURATION:-8s}"
WARMUP="${WARMUP:-3s}"
CONNECTIONS="${CONNECTIONS:-32}"
MODES="${MODES:-buffered sse}"
PORT_BASE="${PORT_BASE:-18180}"
UP_PORT=$PORT_BASE
ROUTER_PORT=$((PORT_BASE + 2))
ROUTER_BIN="${ROUTER_BIN:-target/release/continuum-router}"
UPSTREAM_BIN="${UPSTREAM_BIN:-target/release/examples/bench_upstream}"

for tool in valgrind callgrind_control wrk curl; do
  command -v "$tool" >/dev/null 2>&1 || { echo "needs $tool" >&2; exit 1; }
done
[ -x "$ROUTER_BIN" ] && [ -x "$UPSTREAM_BIN" ] || { echo "build $ROUTER_BIN and $UPSTREAM_BIN first" >&2; exit 1; }
ROUTER_BIN=$(realpath "$ROUTER_BIN")

WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [ -n "${KEEP:-}" ]; then mkdir -p "$KEEP" && cp "$WORK"/callgrind.out.* "$KEEP"/ 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT

wait_port() { # url: polls until it answers (300 s at most: the router starts slowly under valgrind)
  for _ in $(seq 1 3000); do
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null || break 2; done
    curl -fs -o /dev/null -X POST -H 'content-type: application/json' \
      --data '{"model":"m","messages":[{"role":"user","content":"hi"}]}' "$1" && return 0
    sleep 0.1
  done
  echo "nothing answers at $1" >&2
  tail -20 "$WORK/router.log" >&2
  exit 1
}

"$UPSTREAM_BIN" "127.0.0.1:$UP_PORT" >"$WORK/upstream.log" 2>&1 &
PIDS+=($!)
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
(cd "$WORK" && RUST_LOG=warn exec valgrind --tool=callgrind --callgrind-out-file="$WORK/callgrind.out.%p" \
  "$ROUTER_BIN" --config "$WORK/router.yaml" >"$WORK/router.log" 2>&1) &
PIDS+=($!)
wait_port "http://127.0.0.1:$UP_PORT/v1/chat/completions"
wait_port "http://127.0.0.1:$ROUTER_PORT/v1/chat/completions"

cat >"$WORK/buffered.lua" <<'EOF'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"m","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Say hello in two words, please."}],"max_tokens":16}'
EOF
sed 's/{"model":"m",/{"model":"m","stream":true,/' "$WORK/buffered.lua" >"$WORK/sse.lua"

echo "router: $ROUTER_BIN; $CONNECTIONS connections, $DURATION measured after $WARMUP warm-up"
for mode in $MODES; do
  wrk -t1 -c"$CONNECTIONS" -d"$WARMUP" -s "$WORK/$mode.lua" "http://127.0.0.1:$ROUTER_PORT/v1/chat/completions" >/dev/null
  callgrind_control -z "$ROUTER_BIN" >/dev/null 2>&1 || callgrind_control -z >/dev/null
  wrk -t1 -c"$CONNECTIONS" -d"$DURATION" -s "$WORK/$mode.lua" \
    "http://127.0.0.1:$ROUTER_PORT/v1/chat/completions" >"$WORK/$mode.wrk"
  before=$(ls "$WORK"/callgrind.out.* 2>/dev/null | wc -l)
  callgrind_control -d "$ROUTER_BIN" >/dev/null 2>&1 || callgrind_control -d >/dev/null
  # The dump is written asynchronously: wait for a new file.
  for _ in $(seq 1 300); do
    [ "$(ls "$WORK"/callgrind.out.* 2>/dev/null | wc -l)" -gt "$before" ] && break
    sleep 0.1
  done
  sleep 1
  dump=$(ls -t "$WORK"/callgrind.out.* | head -1)
  cp "$dump" "$WORK/callgrind.out.$mode"
  requests=$(awk '/requests in/ {print $1}' "$WORK/$mode.wrk")
  errors=$(awk '/Non-2xx|Socket errors/ {e = e $0 "; "} END {print (e == "" ? "none" : e)}' "$WORK/$mode.wrk")
  total=$(awk '/^(summary|totals):/ {print $2; exit}' "$dump")
  awk -v t="$total" -v r="$requests" -v m="$mode" -v e="$errors" \
    'BEGIN {printf "%-9s %10d requests %15d instructions  %8.1f k instructions/request  errors: %s\n", m, r, t, t / r / 1000, e}'
done
