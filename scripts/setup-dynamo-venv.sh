#!/usr/bin/env bash
# Create (idempotently) a Python venv holding real NVIDIA Dynamo: ai-dynamo + ai-dynamo-runtime,
# pinned to DYNAMO_VERSION (default 1.6.1), for the end-to-end tests and scripts/e2e-dynamo-shim.sh.
#
# usage:  scripts/setup-dynamo-venv.sh          prints the venv's python path on stdout (last line)
# env:    CONTINUUM_DYNAMO_VENV   venv directory (default: target/dynamo-venv under the repo)
#         DYNAMO_VERSION          ai-dynamo version (default: the pin in
#                                 deploy/examples/dynamo-direct-shim/.env, 1.6.1, which the e2e tests assert)
#         PYTHON                  interpreter that creates the venv (default python3, needs >= 3.10)
#
# Why not a plain `pip install ai-dynamo==1.6.1`: on Python >= 3.11, ai-dynamo 1.5+ depends on
# `aisimulate`, an sdist stub that fetches its real wheel from NVIDIA's own index at build time,
# which fails where only PyPI is reachable. aisimulate is used only by the planner and
# `--ais-perf-model`, never by dynamo.mocker or dynamo.frontend, so we install ai-dynamo's other
# base requirements (read from its wheel METADATA) and then ai-dynamo itself with --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."

PINNED=$(sed -n 's/^DYNAMO_VERSION=//p' deploy/examples/dynamo-direct-shim/.env 2>/dev/null || true)
DYNAMO_VERSION=${DYNAMO_VERSION:-${PINNED:-1.6.1}}
VENV=${CONTINUUM_DYNAMO_VENV:-$PWD/target/dynamo-venv}
PYTHON=${PYTHON:-python3}
PY=$VENV/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

log() { printf '[setup-dynamo-venv] %s\n' "$*" >&2; }

installed_version() {
  "$PY" - <<'PYEOF' 2>/dev/null
import importlib.metadata as m
import dynamo.mocker, dynamo.frontend  # noqa: F401  (both must import)
print(m.version("ai-dynamo"), m.version("ai-dynamo-runtime"))
PYEOF
}

if [[ -x $PY ]] && [[ "$(installed_version)" == "$DYNAMO_VERSION $DYNAMO_VERSION" ]]; then
  log "ai-dynamo $DYNAMO_VERSION already in $VENV"
  echo "$PY"
  exit 0
fi

start=$(date +%s)
log "creating $VENV with ai-dynamo==$DYNAMO_VERSION (about 40 s, 700 MB)"
"$PYTHON" -m venv "$VENV"
dl=$(mktemp -d)
trap 'rm -rf "$dl"' EXIT
"$VENV/bin/pip" download -q --no-deps "ai-dynamo==$DYNAMO_VERSION" -d "$dl"
wheel=$(ls "$dl"/ai_dynamo-"$DYNAMO_VERSION"-*.whl)
mapfile -t reqs < <("$PY" - "$wheel" <<'PYEOF'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
for line in z.read(meta).decode().splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    name_and_spec, _, marker = req.partition(";")
    if "extra ==" in marker or name_and_spec.strip().startswith("aisimulate"):
        continue
    # Keep environment markers (python_version etc.) so pip evaluates them.
    print(req)
PYEOF
)
# ai-dynamo-runtime is pinned explicitly: the METADATA may allow a range.
filtered=()
for r in "${reqs[@]}"; do [[ $r == ai-dynamo-runtime* ]] || filtered+=("$r"); done
"$VENV/bin/pip" install -q --no-compile "ai-dynamo-runtime==$DYNAMO_VERSION" "${filtered[@]}"
"$VENV/bin/pip" install -q --no-compile --no-deps "$wheel"
got=$(installed_version || true)
if [[ $got != "$DYNAMO_VERSION $DYNAMO_VERSION" ]]; then
  log "install finished but dynamo.mocker/dynamo.frontend do not import (versions: '${got}')"
  exit 1
fi
log "installed ai-dynamo $DYNAMO_VERSION in $(( $(date +%s) - start )) s"
echo "$PY"
