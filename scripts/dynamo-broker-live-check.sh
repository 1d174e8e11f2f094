#!/usr/bin/env bash
# Read-only live check of the event-bus tunnel: a router outside the cluster with
# dynamo.load.transport: broker, continuum-event-broker Pods in the workers' namespace.
#
# usage:
#   ROUTER_ADMIN_TOKEN=... scripts/dynamo-broker-live-check.sh \
#       --router-url https://<router host>:<port> \
#       [--context <kube context>] [--namespace <broker namespace>] \
#       [--window 300] [--max-staleness-ms 3000] \
#       [--probe-image curlimages/curl:8.11.1 --bus-url https://<bus host>:<bus port>] \
#       [--broker-metrics-url http://127.0.0.1:9464]
#
# Three steps, in order:
#   1. Pods reach the bus: every row of GET /admin/dynamo/workers `subscriptions` is
#      `connected` over transport `broker`; continuum_dynamo_event_bus_sessions from the router's
#      /metrics; each broker Pod's own /metrics (sessions, streams, refusals), read through the
#      API server's Pod proxy (`kubectl get --raw`), or --broker-metrics-url on loopback.
#   2. Load samples stay fresh: /metrics once per second over --window seconds: decoded
#      kv_metrics / kv-events frames, the longest gap between frame-count increases against
#      --max-staleness-ms, and the share of reason="load" (or "kv_aware") vs
#      reason="round_robin_stale" decode selections (send traffic while it runs).
#   3. Relay latency (only with --probe-image and --bus-url): a temporary non-root Pod in the
#      broker namespace times TCP+TLS handshakes to --bus-url; half the median connect time is
#      the one-way bus latency estimate. The Pod is deleted afterwards.
#
# Read-only: nothing is changed on the router or the cluster except the probe Pod of step 3.
# Without --context / --namespace the Kubernetes parts are skipped (loopback against the e2e
# stack: pass --broker-metrics-url instead). Needs curl, awk, python3; kubectl for the cluster parts.
set -euo pipefail

ROUTER_URL="" CONTEXT="" NAMESPACE="" WINDOW=300 MAX_STALENESS_MS=3000
PROBE_IMAGE="" BUS_URL="" BROKER_METRICS_URL=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --router-url) ROUTER_URL=$2; shift 2 ;;
    --context) CONTEXT=$2; shift 2 ;;
    --namespace) NAMESPACE=$2; shift 2 ;;
    --window) WINDOW=$2; shift 2 ;;
    --max-staleness-ms) MAX_STALENESS_MS=$2; shift 2 ;;
    --probe-image) PROBE_IMAGE=$2; shift 2 ;;
    --bus-url) BUS_URL=$2; shift 2 ;;
    --broker-metrics-url) BROKER_METRICS_URL=$2; shift 2 ;;
    -h | --help) sed -n '2,28p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ -n $ROUTER_URL ]] || { echo "--router-url is required" >&2; exit 2; }
[[ -n ${ROUTER_ADMIN_TOKEN:-} ]] || { echo "ROUTER_ADMIN_TOKEN is required" >&2; exit 2; }
[[ $WINDOW =~ ^[0-9]+$ && $WINDOW -ge 1 ]] || { echo "--window: seconds >= 1" >&2; exit 2; }
if [[ -n $PROBE_IMAGE && -z $BUS_URL ]]; then echo "--probe-image needs --bus-url" >&2; exit 2; fi
KUBE=()
[[ -n $CONTEXT ]] && KUBE+=(--context "$CONTEXT")
[[ -n $NAMESPACE ]] && KUBE+=(--namespace "$NAMESPACE")
FAILED=0
fail() { echo "FAIL: $*"; FAILED=1; }
ok() { echo "ok:   $*"; }

admin() { curl -fsS --max-time 10 -H "Authorization: Bearer $ROUTER_ADMIN_TOKEN" "$ROUTER_URL$1"; }
metrics() { curl -fsS --max-time 10 "$ROUTER_URL/metrics"; }
# Sum of a family's samples whose labels contain every given label="value".
sum_metric() {
  local text=$1 name=$2; shift 2
  awk -v name="$name" -v want="$*" '
    BEGIN { n = split(want, w, " ") }
    $1 ~ "^"name"({|$)" { keep = 1; for (i = 1; i <= n; i++) if (index($1, w[i]) == 0) keep = 0; if (keep) s += $NF }
    END { printf "%d\n", s + 0 }' <<<"$text"
}

echo "== 1. Pods reach the bus"
WORKERS=$(admin /admin/dynamo/workers) || { echo "FAIL: GET /admin/dynamo/workers"; exit 1; }
read -r TOTAL GOOD < <(python3 - "$WORKERS" <<'PY' 2>/dev/null || echo "0 0"
import json, sys
subs = json.loads(sys.argv[1]).get("subscriptions", [])
good = [s for s in subs if s.get("state") == "connected" and s.get("transport") == "broker"]
print(len(subs), len(good))
PY
)
if [[ $TOTAL -gt 0 && $TOTAL -eq $GOOD ]]; then
  ok "$GOOD/$TOTAL subscriptions connected over transport broker"
else
  fail "$GOOD/$TOTAL subscriptions connected over transport broker"
fi
M=$(metrics)
echo "      router: continuum_dynamo_event_bus_sessions{role=broker} = $(sum_metric "$M" continuum_dynamo_event_bus_sessions 'role="broker"')"
broker_summary() {
  local text=$1 who=$2
  echo "      $who: sessions=$(sum_metric "$text" continuum_event_broker_sessions)" \
    "streams=$(sum_metric "$text" continuum_event_broker_streams)" \
    "refusals=$(sum_metric "$text" continuum_event_broker_refusals_total)" \
    "target_not_advertised=$(sum_metric "$text" continuum_event_broker_refusals_total 'reason="target_not_advertised"')"
  [[ $(sum_metric "$text" continuum_event_broker_sessions) -ge 1 ]] || fail "$who has no welcomed session"
}
if [[ -n $BROKER_METRICS_URL ]]; then
  broker_summary "$(curl -fsS --max-time 10 "$BROKER_METRICS_URL/metrics")" "broker $BROKER_METRICS_URL"
fi
if [[ -n $NAMESPACE ]]; then
  PODS=$(kubectl "${KUBE[@]}" get pods -l app.kubernetes.io/name=continuum-event-broker -o name)
  [[ -n $PODS ]] || fail "no continuum-event-broker Pods in namespace $NAMESPACE"
  for pod in $PODS; do
    pod=${pod#pod/}
    text=$(kubectl "${KUBE[@]}" get --raw "/api/v1/namespaces/$NAMESPACE/pods/$pod:9464/proxy/metrics") ||
      { fail "cannot read $pod's metrics through the API server"; continue; }
    broker_summary "$text" "pod $pod"
  done
fi

echo "== 2. Load samples stay fresh (${WINDOW}s)"
frames() { sum_metric "$1" continuum_dynamo_load_events_total; }
LAST=$(frames "$M"); LAST_T=$(date +%s%N); MAX_GAP_MS=0
LOAD0=$(sum_metric "$M" continuum_dynamo_selection_total 'role="decode"' 'reason="load"')
KVA0=$(sum_metric "$M" continuum_dynamo_selection_total 'role="decode"' 'reason="kv_aware"')
STALE0=$(sum_metric "$M" continuum_dynamo_selection_total 'role="decode"' 'reason="round_robin_stale"')
KV0=$(sum_metric "$M" continuum_dynamo_kv_events_total)
for ((i = 0; i < WINDOW; i++)); do
  sleep 1
  M=$(metrics) || { fail "GET /metrics failed during the window"; break; }
  NOW=$(frames "$M"); T=$(date +%s%N)
  if [[ $NOW -gt $LAST ]]; then LAST=$NOW; LAST_T=$T; fi
  GAP=$(( (T - LAST_T) / 1000000 ))
  (( GAP > MAX_GAP_MS )) && MAX_GAP_MS=$GAP
done
LOAD=$(( $(sum_metric "$M" continuum_dynamo_selection_total 'role="decode"' 'reason="load"') - LOAD0 ))
KVA=$(( $(sum_metric "$M" continuum_dynamo_selection_total 'role="decode"' 'reason="kv_aware"') - KVA0 ))
STALE=$(( $(sum_metric "$M" continuum_dynamo_selection_total 'role="decode"' 'reason="round_robin_stale"') - STALE0 ))
KV=$(( $(sum_metric "$M" continuum_dynamo_kv_events_total) - KV0 ))
echo "      kv_metrics frames total=$LAST, kv-events counted in the window=$KV"
if (( MAX_GAP_MS <= MAX_STALENESS_MS )); then
  ok "longest gap between kv_metrics frames ${MAX_GAP_MS} ms <= ${MAX_STALENESS_MS} ms"
else
  fail "longest gap between kv_metrics frames ${MAX_GAP_MS} ms > ${MAX_STALENESS_MS} ms"
fi
# kv_aware picks (dynamo.kv.enabled) rank by prefix overlap and fresh load; ties without a fresh
# sample are counted as round_robin_stale, like the load-based picker's.
if (( LOAD + KVA + STALE > 0 )); then
  echo "      decode selections: load=$LOAD kv_aware=$KVA round_robin_stale=$STALE" \
    "($(( 100 * (LOAD + KVA) / (LOAD + KVA + STALE) ))% on fresh samples)"
  (( STALE == 0 )) || fail "$STALE decode selections fell back to round_robin_stale"
else
  echo "      no decode selections in the window (send traffic to measure the load share)"
fi

echo "== 3. Relay latency"
if [[ -n $PROBE_IMAGE ]]; then
  [[ -n $NAMESPACE ]] || { echo "--probe-image needs --namespace" >&2; exit 2; }
  POD=broker-live-check-$$
  trap 'kubectl "${KUBE[@]}" delete pod "$POD" --ignore-not-found --wait=false >/dev/null 2>&1 || true' EXIT
  kubectl "${KUBE[@]}" run "$POD" --image="$PROBE_IMAGE" --restart=Never --quiet \
    --overrides='{"spec":{"securityContext":{"runAsNonRoot":true,"runAsUser":65532,"seccompProfile":{"type":"RuntimeDefault"}},"containers":[{"name":"probe","image":"'"$PROBE_IMAGE"'","command":["sh","-c","for i in $(seq 1 20); do curl -ks -o /dev/null -w \"%{time_appconnect}\\n\" '"$BUS_URL"'/ || true; done"],"securityContext":{"allowPrivilegeEscalation":false,"capabilities":{"drop":["ALL"]}}}]}}' \
    >/dev/null
  kubectl "${KUBE[@]}" wait --for=jsonpath='{.status.phase}'=Succeeded "pod/$POD" --timeout=120s >/dev/null ||
    fail "the probe Pod did not finish"
  MEDIAN=$(kubectl "${KUBE[@]}" logs "$POD" | sort -n | awk '{a[NR]=$1} END {if (NR) print a[int((NR+1)/2)]; else print ""}')
  if [[ -n $MEDIAN ]]; then
    awk -v m="$MEDIAN" 'BEGIN { printf "ok:   median TCP+TLS connect %.1f ms; one-way bus latency ~%.1f ms\n", m*1000, m*500 }'
  else
    fail "no handshake timings from the probe Pod"
  fi
else
  echo "      skipped (no --probe-image)"
fi

exit $FAILED
