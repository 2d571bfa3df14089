#!/usr/bin/env bash
# Set everything up (idempotent) and run the service in the foreground on the embedded
# default: the offline tiny model, a local Ray. Ctrl-C stops it.
# Extra arguments go to `python -m app.cli run` (e.g. --config my.yaml --num-cpus 16).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m app.cli run "$@"
