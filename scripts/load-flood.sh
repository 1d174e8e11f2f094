#!/usr/bin/env bash
# Load scenario (not a test): overload without collapse (issue #32). The demo fleet and the real
# daemon in process on loopback (benches/load_flood.rs), tenant A steady at a fifth of the fleet's
# capacity, tenant B flooding at ten times it, in three phases: A solo; A + B with fairness off
# (one class, B unlimited); A + B with fairness on (B's key rate-limited to half the capacity,
# A's key in class high, deficit round robin between keys). Prints, per phase and tenant, the
# answers, the refusals by status and whether each carried Retry-After, the requests lost
# (transport errors, timeouts, other statuses: the goal is none), A's latency p50/p90/p99, the
# router's admission and rate-limit series, and the load average; then A's p99 with fairness on
# against its solo p99 (goal ≤ 1.5×) and A's refusals (goal 0).
#
#   scripts/load-flood.sh                      # 30 s per phase, A 8/s, B 400/s
#   FLOOD_SECS=60 FLOOD_B_RPS=800 scripts/load-flood.sh
#
# Built with the bench profile (release, fat LTO), run under `nice -n 5` (the machine is shared).
# docs/performance.md, "Overload: a flooding tenant", holds the figures.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "uptime before: $(uptime)"
nice -n 5 cargo bench --bench load_flood
echo "uptime after: $(uptime)"
