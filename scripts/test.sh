#!/usr/bin/env bash
# Set everything up (idempotent) and run the whole test suite: unit tests, then the
# integration tests against a real Serve application with the tiny model.
# Extra arguments go to pytest (e.g. -k batcher, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo "[test] running the test suite (integration tests start Ray and Serve: about a minute)"
exec .venv/bin/python -m pytest -ra "$@" tests
