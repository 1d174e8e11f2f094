#!/usr/bin/env bash
# Bench (not a test): times `continuum-router replay` on the 12k-request Mooncake conversation
# trace (benches/fixtures/mooncake) for three policies, with the release binary, and prints the
# wall / CPU time, the peak RSS and the machine's load average. A second run times a disaggregated
# fleet (prefill/decode pairs, conditional disaggregation) on the same trace.
#
#   scripts/bench-replay.sh            # builds target/release/continuum-router first
#   NO_BUILD=1 scripts/bench-replay.sh # uses the binary already built
#
# Environment: TRACE (default: the conversation trace), OUT (default: target/bench-replay),
# WORKERS (16), CAPACITY (16384 blocks), SEED (1). The goal (issue #17): the three policies in
# under a minute on 2 cores. docs/replay.md and docs/performance.md ("Replay") hold the figures.
set -euo pipefail
cd "$(dirname "$0")/.."

TRACE="${TRACE:-benches/fixtures/mooncake/conversation_trace.jsonl.gz}"
OUT="${OUT:-target/bench-replay}"
WORKERS="${WORKERS:-16}"
CAPACITY="${CAPACITY:-16384}"
SEED="${SEED:-1}"
BIN=target/release/continuum-router

if [ -z "${NO_BUILD:-}" ]; then
  cargo build --release --bin continuum-router
fi
[ -x "$BIN" ] || { echo "no $BIN: build it or unset NO_BUILD" >&2; exit 1; }
[ -f "$TRACE" ] || { echo "no trace at $TRACE" >&2; exit 1; }
command -v /usr/bin/time >/dev/null 2>&1 || { echo "needs /usr/bin/time (Debian: time)" >&2; exit 1; }
mkdir -p "$OUT"

# One timed replay: prints the label, load average before, wall, user, sys, max RSS.
timed() {
  local label=$1
  shift
  local load
  load=$(cut -d' ' -f1-3 /proc/loadavg)
  /usr/bin/time -f "%e %U %S %M" -o "$OUT/$label.time" "$BIN" replay "$@" >"$OUT/$label.table"
  read -r wall user sys rss <"$OUT/$label.time"
  printf '%-28s load avg %-16s wall %6.1f s  user %6.1f s  sys %4.1f s  peak RSS %4d MB\n' \
    "$label" "$load" "$wall" "$user" "$sys" "$((rss / 1024))"
}

echo "cores: $(nproc); trace: $TRACE; $WORKERS workers x $CAPACITY blocks; seed $SEED"
timed three-policies --trace "$TRACE" --workers "$WORKERS" --capacity "$CAPACITY" \
  --policy load,kv,round_robin --seed "$SEED" --out "$OUT/three-policies"
cat "$OUT/three-policies.table"
# The same fleet size split into prefill/decode pairs: 3/4 decode, 1/4 prefill workers.
PREFILL=$((WORKERS / 4))
DECODE=$((WORKERS - PREFILL))
timed pairs-three-policies --trace "$TRACE" --workers "$DECODE" --prefill-workers "$PREFILL" \
  --capacity "$CAPACITY" --policy load,kv,round_robin --seed "$SEED" \
  --out "$OUT/pairs-three-policies"
cat "$OUT/pairs-three-policies.table"
timed pairs-kv-conditional --trace "$TRACE" --workers "$DECODE" --prefill-workers "$PREFILL" \
  --capacity "$CAPACITY" --policy kv --conditional-disagg --decode-busy-threshold 0.5 \
  --seed "$SEED" --out "$OUT/pairs-kv-conditional"
cat "$OUT/pairs-kv-conditional.table"
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
