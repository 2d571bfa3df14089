#!/usr/bin/env bash
# Start the head node of the serving cluster: GCS, dashboard, Serve controller and HTTP
# proxy (Ingress/Router replicas may run here too). Token authentication is on.
#
#   cluster/start_head.sh [more `ray start` flags, e.g. --block, --num-cpus=8]
#
# Environment:
#   RAY_PORT           GCS port (default 6379); workers join with <head-ip>:$RAY_PORT
#   RAY_AUTH_TOKEN     the cluster token (or RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token);
#                      when none exists one is generated into ~/.ray/auth_token. Copy it to
#                      every worker node and client: `ray get-auth-token` prints it.
#
# Then deploy: `RAY_AUTH_MODE=token serve deploy cluster/serve_config.cluster.yaml`
# (or `serve run ...` from a machine that holds the token).
set -euo pipefail
source "$(dirname "$0")/_common.sh"

if ! have_token; then
  echo "[cluster] no auth token found: generating one in ~/.ray/auth_token" >&2
  "$RAY_BIN" get-auth-token --generate >/dev/null
fi

echo "[cluster] starting the head node on port ${RAY_PORT:-6379} (RAY_AUTH_MODE=token)" >&2
exec "$RAY_BIN" start --head \
  --port="${RAY_PORT:-6379}" \
  --resources="$(role_resources head)" \
  --disable-usage-stats \
  "$@"
