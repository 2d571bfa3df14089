#!/usr/bin/env bash
# Start a worker node of one role and join it to the head. Token authentication is on.
#
#   cluster/start_worker.sh <compute|data> <head-ip:port> [more `ray start` flags]
#
#   compute  GPU (or CPU) machines for ComputeWorker replicas: advertises {"compute_node": 1};
#            GPUs are detected by Ray (pass --num-gpus=N to override).
#   data     memory-rich machines for DataPlane replicas (L2 host-memory KV tier):
#            advertises {"data_node": 1}. L2 lives in Ray's object store: pass
#            --object-store-memory=<replicas on the node x l2_capacity_bytes> and make
#            /dev/shm at least that large (Ray's default store is 30% of RAM).
#
# The token must be the head's: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token.
set -euo pipefail
source "$(dirname "$0")/_common.sh"

if [[ $# -lt 2 ]]; then
  echo "usage: $0 <compute|data> <head-ip:port> [ray start flags]" >&2
  exit 2
fi
role="$1"
address="$2"
shift 2
[[ "$role" == head ]] && { echo "[cluster] use start_head.sh for the head" >&2; exit 2; }
resources="$(role_resources "$role")"

if ! have_token; then
  echo "[cluster] no auth token: set RAY_AUTH_TOKEN (the head's \`ray get-auth-token\`)," \
    "RAY_AUTH_TOKEN_PATH, or copy the head's ~/.ray/auth_token here" >&2
  exit 2
fi

echo "[cluster] starting a '$role' worker node ($resources) joining $address" >&2
exec "$RAY_BIN" start \
  --address="$address" \
  --resources="$resources" \
  --disable-usage-stats \
  "$@"
