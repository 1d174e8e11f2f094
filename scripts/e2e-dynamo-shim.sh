#!/usr/bin/env bash
# Bring up a real NVIDIA Dynamo 1.6.1 stack on loopback with Continuum Router in front, check the
# router discovered exactly the real workers, then tear everything down.
#
#   etcd (free ports) + the tiny offline model + dynamo.mocker workers
#   + dynamo.frontend --router-mode direct + continuum-router (deploy/examples/dynamo-direct-shim)
#
# usage:  scripts/e2e-dynamo-shim.sh [--keep]
#   --keep   after the check, keep the stack up and print its URLs until Ctrl-C
# env:    TOPOLOGY=disagg|agg      disagg: 1 prefill + 1 decode worker; agg: 2 aggregated workers
#         CONTINUUM_DYNAMO_PYTHON  venv python with ai-dynamo (default: scripts/setup-dynamo-venv.sh)
#         RUN                      scratch dir for logs, model, config (default: a fresh mktemp -d)
#         NS                       Dynamo namespace (default: e2e<pid>)
# Needs: etcd + etcdctl (Debian etcd-server etcd-client), curl, cargo. Loopback only; only the
# processes this script started are stopped (by PID).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

KEEP=0
[[ ${1:-} == --keep ]] && KEEP=1
TOPOLOGY=${TOPOLOGY:-disagg}
case $TOPOLOGY in disagg | agg) ;; *) echo "TOPOLOGY must be disagg or agg" >&2; exit 2 ;; esac
NS=${NS:-e2e$$}
MODEL=tiny
RUN=${RUN:-$(mktemp -d -t dynamo-shim-XXXXXX)}
mkdir -p "$RUN"
t0=$(date +%s%N)
log() { local ms=$(( ($(date +%s%N) - t0) / 1000000 )); printf '[e2e %3d.%03ds] %s\n' $((ms/1000)) $((ms%1000)) "$*"; }

PY=${CONTINUUM_DYNAMO_PYTHON:-}
if [[ -z $PY ]]; then PY=$(scripts/setup-dynamo-venv.sh | tail -n 1); fi
command -v etcd >/dev/null && command -v etcdctl >/dev/null ||
  { echo "need etcd and etcdctl: apt-get install -y etcd-server etcd-client" >&2; exit 2; }

# Build first, so no Dynamo process idles (or its lease ticks) through a cold compile.
log "building continuum-router"
cargo build -q --bin continuum-router
BIN=$(cargo metadata --format-version 1 --no-deps | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/debug/continuum-router

# --------------------------------------------------------------- processes and teardown
PIDS=() NAMES=()
teardown() {
  local status=$?
  trap - EXIT INT TERM
  # Reverse start order: router, frontend, workers, etcd. Only our own PIDs.
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
    local pid=${PIDS[i]}
    kill -0 "$pid" 2>/dev/null || continue
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  log "stopped ${#PIDS[@]} processes; logs in $RUN"
  exit "$status"
}
trap teardown EXIT
trap 'exit 130' INT TERM

start() { # name cmd... : background with its log in $RUN/<name>.log
  local name=$1; shift
  "$@" >"$RUN/$name.log" 2>&1 </dev/null &
  PIDS+=($!) NAMES+=("$name")
  log "started $name pid=$! log=$RUN/$name.log"
}
wait_for() { # desc timeout_s cmd...
  local desc=$1 to=$2; shift 2
  local end=$(( $(date +%s) + to ))
  until "$@" >/dev/null 2>&1; do
    for i in "${!PIDS[@]}"; do
      kill -0 "${PIDS[i]}" 2>/dev/null ||
        { echo "${NAMES[i]} exited while waiting for $desc; tail of its log:" >&2; tail -n 30 "$RUN/${NAMES[i]}.log" >&2; exit 1; }
    done
    (( $(date +%s) <= end )) || { echo "timeout waiting for $desc" >&2; exit 1; }
    sleep 0.2
  done
  log "ready: $desc"
}
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

ETCD_PORT=$(free_port) ETCD_PEER_PORT=$(free_port) HTTP_PORT=$(free_port) ROUTER_PORT=$(free_port)
export ETCD_ENDPOINTS=http://127.0.0.1:$ETCD_PORT ETCDCTL_API=3
# Loopback-only Dynamo: without the *_HOST variables 1.6.1 advertises the first non-loopback address.
export DYN_DISCOVERY_BACKEND=etcd DYN_EVENT_PLANE=zmq DYN_REQUEST_PLANE=tcp
export DYN_TCP_RPC_HOST=127.0.0.1 DYN_TCP_RESPONSE_STREAM_HOST=127.0.0.1
export DYN_EVENT_PLANE_HOST=127.0.0.1 DYN_SYSTEM_HOST=127.0.0.1 DYN_HTTP_RPC_HOST=127.0.0.1
export DYN_SELF_HOST_METADATA=0 DYN_LOG=${DYN_LOG:-info} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 NO_COLOR=1
etcd_keys() { etcdctl --endpoints "$ETCD_ENDPOINTS" get --prefix "$1" --keys-only | grep -c . || true; }
n_keys() { [[ $(etcd_keys "$1") -ge $2 ]]; }

# --------------------------------------------------------------- etcd, model, workers, frontend
start etcd etcd --name e2e --data-dir "$RUN/etcd-data" \
  --listen-client-urls "$ETCD_ENDPOINTS" --advertise-client-urls "$ETCD_ENDPOINTS" \
  --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-cluster "e2e=http://127.0.0.1:$ETCD_PEER_PORT" --listen-metrics-urls "http://127.0.0.1:0"
wait_for "etcd at $ETCD_ENDPOINTS" 30 etcdctl --endpoints "$ETCD_ENDPOINTS" endpoint health

"$PY" scripts/make_tiny_model.py "$RUN/tiny-model" >/dev/null
mock() { # name component mode
  start "$1" "$PY" -m dynamo.mocker --model-path "$RUN/tiny-model" --model-name "$MODEL" \
    --endpoint "dyn://$NS.$2.generate" --disaggregation-mode "$3" --discovery-backend etcd \
    --event-plane zmq --request-plane tcp --speedup-ratio 10 --num-gpu-blocks-override 1024 --block-size 16
}
if [[ $TOPOLOGY == disagg ]]; then
  mock prefill prefill prefill
  mock decode backend decode
  WANT=2
else
  mock agg1 backend agg
  mock agg2 backend agg
  WANT=2
fi
wait_for "$WANT worker instances in etcd" 90 n_keys "v1/instances/$NS/" "$WANT"
wait_for "$WANT model cards in etcd" 90 n_keys "v1/mdc/$NS/" "$WANT"

start frontend "$PY" -m dynamo.frontend --router-mode direct --http-host 127.0.0.1 --http-port "$HTTP_PORT" \
  --namespace "$NS" --discovery-backend etcd --event-plane zmq --request-plane tcp
wait_for "frontend lists model $MODEL" 90 bash -c "curl -sf http://127.0.0.1:$HTTP_PORT/v1/models | grep -q '\"$MODEL\"'"

# --------------------------------------------------------------- the router
export ROUTER_BIND=127.0.0.1:$ROUTER_PORT ETCD_ENDPOINT=$ETCD_ENDPOINTS DYNAMO_NAMESPACE=$NS
export DYNAMO_FRONTEND_URL=http://127.0.0.1:$HTTP_PORT
export ROUTER_ADMIN_TOKEN=${ROUTER_ADMIN_TOKEN:-e2e-admin-$$-$RANDOM}
export CLIENT_API_KEY=${CLIENT_API_KEY:-e2e-client-$$-$RANDOM}
cp deploy/examples/dynamo-direct-shim/router.yaml "$RUN/router.yaml"
start router "$BIN" --config "$RUN/router.yaml"
ROUTER_URL=http://127.0.0.1:$ROUTER_PORT
wait_for "router /ready" 60 curl -sf "$ROUTER_URL/ready"

# --------------------------------------------------------------- the check
# The real workers: decimal instance_id and component of every v1/instances/$NS/*/generate/ key.
etcdctl --endpoints "$ETCD_ENDPOINTS" get --prefix "v1/instances/$NS/" --print-value-only >"$RUN/instances.jsonl"
check() {
  curl -sf -H "authorization: Bearer $ROUTER_ADMIN_TOKEN" "$ROUTER_URL/admin/dynamo/workers" >"$RUN/workers.json" &&
    "$PY" - "$RUN/instances.jsonl" "$RUN/workers.json" "$TOPOLOGY" <<'EOF'
import json, sys
instances, view, topology = sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3]
real = {}
for line in open(instances):
    if line.strip():
        rec = json.loads(line)
        if rec.get("endpoint") == "generate":
            real[str(rec["instance_id"])] = rec["component"]
want_roles = {"prefill": "prefill", "backend": "decode"} if topology == "disagg" else {"backend": "aggregated"}
want = {(i, want_roles[c]) for i, c in real.items()}
got = {(w["worker_id"], w["role"]) for w in view.get("workers", [])}
if got != want:
    print(f"router lists {sorted(got)}, real workers are {sorted(want)}", file=sys.stderr)
    sys.exit(1)
bad = [w for w in view["workers"] if w.get("model") != "tiny" or w.get("block_size") != 16]
if bad:
    print(f"unexpected model/block_size: {bad}", file=sys.stderr)
    sys.exit(1)
EOF
}
wait_for "router lists exactly the $WANT real workers" 30 check
"$PY" - "$RUN/workers.json" <<'EOF'
import json, sys
view = json.load(open(sys.argv[1]))
for w in view["workers"]:
    print(f"  {w['role']:<10} worker_id={w['worker_id']} model={w['model']} block_size={w['block_size']} "
          f"total_kv_blocks={w['capacity'].get('total_kv_blocks')}")
print(f"  load_publishers={view.get('load_publishers')} kv_event_publishers={view.get('kv_event_publishers')}")
EOF
log "PASS: the router discovered exactly the real $TOPOLOGY workers"

if [[ $KEEP == 1 ]]; then
  cat <<EOF

Stack is up (Ctrl-C tears it down):
  router          $ROUTER_URL     admin token: $ROUTER_ADMIN_TOKEN   client key: $CLIENT_API_KEY
  dynamo.frontend $DYNAMO_FRONTEND_URL   (direct mode: needs x-dynamo-worker-instance-id, decimal)
  etcd            $ETCD_ENDPOINTS   namespace: $NS
  logs            $RUN
EOF
  while :; do sleep 3600; done
fi
