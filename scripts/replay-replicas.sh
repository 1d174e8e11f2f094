#!/usr/bin/env bash
# Bench (not a test): the herd effect of several router replicas, in replay (issue #33, item 1).
# Runs `continuum-router replay --policy kv` on the Mooncake conversation trace for 1/2/4/8
# replicas, without and with `--replica-sharing`, at light load (the trace's own rate) and at
# >= 80 % fleet utilisation (`--speedup`), for two load cadences: the replay's default (a sample
# every 50 ms, received at once) and Dynamo 1.6.1's mocker (`kv_metrics` on change, debounced
# 1 ms; received LOAD_LAG later). Prints a markdown table, writes OUT/replicas.tsv and draws
# OUT/replicas.svg (TTFT p99 and KV hit rate against replicas; python3, no packages).
#
#   scripts/replay-replicas.sh            # builds target/release/continuum-router first
#   NO_BUILD=1 scripts/replay-replicas.sh # uses the binary already built
#
# Environment: TRACE, OUT (target/replay-replicas), WORKERS (16), CAPACITY (16384), SEED (1),
# HEAVY (speedup of the loaded runs, 3.6), LOAD_LAG (5ms), SHARE_LAG (20ms: the live
# replica_sync.publish_interval), TIE (--tie-break-window of every replica: 2, the setting
# docs/configuration.md recommends for several replicas; 0 = off), PEER_SLOTS (1: --peer-slots,
# `dynamo.load.peer_slots`, on every replica; it acts with sharing on), SPREAD (round_robin),
# LOADS ("light heavy"), CADENCES ("50ms dynamo"), BIN (target/release/continuum-router; with
# NO_BUILD=1 any build of the binary, e.g. target/debug/continuum-router). Several instances with
# their own OUT can run parts of the matrix in parallel; PLOT_ONLY=1 with TSV=merged.tsv redraws.
# docs/replay.md ("Several router replicas") holds the figures.
set -euo pipefail
cd "$(dirname "$0")/.."

TRACE="${TRACE:-benches/fixtures/mooncake/conversation_trace.jsonl.gz}"
OUT="${OUT:-target/replay-replicas}"
WORKERS="${WORKERS:-16}"
CAPACITY="${CAPACITY:-16384}"
SEED="${SEED:-1}"
HEAVY="${HEAVY:-3.6}"
LOAD_LAG="${LOAD_LAG:-5ms}"
SHARE_LAG="${SHARE_LAG:-20ms}"
TIE="${TIE:-2}"
PEER_SLOTS="${PEER_SLOTS:-}"
SPREAD="${SPREAD:-round_robin}"
BIN="${BIN:-target/release/continuum-router}"
LOADS="${LOADS:-light heavy}"
CADENCES="${CADENCES:-50ms dynamo}"

if [ -z "${NO_BUILD:-}" ] && [ -z "${PLOT_ONLY:-}" ]; then
  cargo build --release --bin continuum-router
fi
[ -x "$BIN" ] || { echo "no $BIN: build it or unset NO_BUILD" >&2; exit 1; }
[ -f "$TRACE" ] || { echo "no trace at $TRACE" >&2; exit 1; }
command -v jq >/dev/null || { echo "needs jq" >&2; exit 1; }
mkdir -p "$OUT"
TSV="${TSV:-$OUT/replicas.tsv}"
if [ -z "${PLOT_ONLY:-}" ]; then
printf 'load\tcadence\treplicas\tsharing\tutilisation\tttft_p50_ms\tttft_p99_ms\thit_rate\timbalance\tload_cv\n' >"$TSV"
slots=()
[ -n "$PEER_SLOTS" ] && slots=(--peer-slots)
echo "cores: $(nproc); load average: $(cut -d' ' -f1-3 /proc/loadavg); share lag $SHARE_LAG; tie-break window $TIE; peer slots ${PEER_SLOTS:-off}"

for load in $LOADS; do
  speedup=1
  [ "$load" = heavy ] && speedup="$HEAVY"
  for cadence in $CADENCES; do
    if [ "$cadence" = 50ms ]; then
      timing=(--load-interval 50ms --load-lag 0s)
    else
      timing=(--load-interval 1ms --load-lag "$LOAD_LAG")
    fi
    for replicas in 1 2 4 8; do
      for sharing in off on; do
        [ "$replicas" = 1 ] && [ "$sharing" = on ] && continue
        share=()
        [ "$sharing" = on ] && share=(--replica-sharing --share-lag "$SHARE_LAG")
        dir="$OUT/$load-$cadence-$replicas-$sharing"
        nice -n 19 "$BIN" replay --trace "$TRACE" --workers "$WORKERS" --capacity "$CAPACITY" \
          --policy kv --seed "$SEED" --speedup "$speedup" "${timing[@]}" \
          --replicas "$replicas" --replica-spread "$SPREAD" "${share[@]}" \
          --tie-break-window "$TIE" "${slots[@]}" --out "$dir" >/dev/null
        jq -r --arg load "$load" --arg cadence "$cadence" --arg sharing "$sharing" \
          '.policies[0] as $p | [$load, $cadence, (.replicas.count|tostring), $sharing,
            ($p.utilisation*100|round|tostring), ($p.ttft_ms.p50|round|tostring),
            ($p.ttft_ms.p99|round|tostring), ($p.prefix_hit_rate*1000|round/10|tostring),
            ($p.load_imbalance*100|round/100|tostring), ($p.load_cv*100|round/100|tostring)]
            | @tsv' "$dir/summary.json" >>"$TSV"
      done
    done
  done
done
fi

echo "| load | cadence | replicas | sharing | utilisation | TTFT p50 ms | TTFT p99 ms | KV hit rate | max/mean | CV |"
echo "|---|---|---:|---|---:|---:|---:|---:|---:|---:|"
tail -n +2 "$TSV" | awk -F'\t' '{printf "| %s | %s | %s | %s | %s%% | %s | %s | %s%% | %s | %s |\n", $1, $2, $3, $4, $5, $6, $7, $8, $9, $10}'
python3 - "$TSV" "$OUT/replicas.svg" <<'EOF'
"""Draws TTFT p99 and KV hit rate against the replica count, relative to one router's, one line per
(load, cadence, sharing)."""
import csv
import sys

rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
one = {(r["load"], r["cadence"]): r for r in rows if r["replicas"] == "1"}
series = {}
for r in rows:
    base = (r["load"], r["cadence"])
    for sharing in (["off", "on"] if r["replicas"] == "1" else [r["sharing"]]):
        ref = one[base]
        series.setdefault(base + (sharing,), []).append(
            (int(r["replicas"]), float(r["ttft_p99_ms"]) / max(float(ref["ttft_p99_ms"]), 1e-9),
             float(r["hit_rate"]) / max(float(ref["hit_rate"]), 1e-9)))
W, H, PAD = 460, 300, 50
xs = [1, 2, 4, 8]
colors = {("light", "50ms"): "#1f77b4", ("light", "dynamo"): "#2ca02c",
          ("heavy", "50ms"): "#d62728", ("heavy", "dynamo"): "#ff7f0e"}
out = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="11">' % (2 * W, H + 90)]
for panel, (title, idx) in enumerate([("TTFT p99 / one router's", 1), ("KV hit rate / one router's", 2)]):
    x0 = panel * W
    vals = [p[idx] for pts in series.values() for p in pts]
    lo, hi = min(vals + [1.0]), max(vals + [1.0])
    lo, hi = lo - 0.05 * (hi - lo) - 0.01, hi + 0.05 * (hi - lo) + 0.01
    px = lambda n: x0 + PAD + xs.index(n) * (W - 2 * PAD) / 3
    py = lambda v: H - PAD - (v - lo) / (hi - lo or 1) * (H - 2 * PAD)
    out.append('<text x="%d" y="20">%s vs router replicas</text>' % (x0 + PAD, title))
    out.append('<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>' % (x0 + PAD, H - PAD, x0 + W - PAD, H - PAD))
    out.append('<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>' % (x0 + PAD, PAD, x0 + PAD, H - PAD))
    for n in xs:
        out.append('<text x="%.0f" y="%d" text-anchor="middle">%d</text>' % (px(n), H - PAD + 15, n))
    for k in range(5):
        v = lo + (hi - lo) * k / 4
        out.append('<text x="%d" y="%.0f" text-anchor="end">%.2f</text>' % (x0 + PAD - 4, py(v) + 4, v))
    for (load, cadence, sharing), pts in sorted(series.items()):
        pts = sorted(pts)
        line = " ".join("%.1f,%.1f" % (px(n), py(t if idx == 1 else h)) for n, t, h in pts)
        dash = "" if sharing == "on" else ' stroke-dasharray="5,3"'
        out.append('<polyline fill="none" stroke="%s" stroke-width="2"%s points="%s"/>' % (colors[(load, cadence)], dash, line))
present = {(k[0], k[1]) for k in series}
for i, ((load, cadence), color) in enumerate(c for c in colors.items() if c[0] in present):
    y = H + 20 + 15 * i
    out.append('<line x1="20" y1="%d" x2="50" y2="%d" stroke="%s" stroke-width="2"/><text x="55" y="%d">%s load, %s cadence</text>' % (y, y, color, y + 4, load, cadence))
out.append('<text x="320" y="%d">solid: --replica-sharing; dashed: without</text>' % (H + 24))
out.append("</svg>")
open(sys.argv[2], "w").write("\n".join(out) + "\n")
EOF
echo "wrote $TSV and $OUT/replicas.svg; load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
