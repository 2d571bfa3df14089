# Shared by start_head.sh and start_worker.sh (sourced, not run).
#
# Token authentication (Ray >= 2.52): every `ray start`, driver and CLI of the cluster runs
# with RAY_AUTH_MODE=token and the same token, taken (first found) from RAY_AUTH_TOKEN,
# from the file RAY_AUTH_TOKEN_PATH names, or from ~/.ray/auth_token.

export RAY_AUTH_MODE=token
# Read by Serve's HTTP proxy, which Ray starts (see app/builder.py:SERVE_PROCESS_ENV): the
# proxy streams from the ingress over Serve's gRPC transport, whose message cap is raised from
# 4 MiB (a larger response, e.g. /metrics of a big cluster, was a bare 500).
export RAY_SERVE_PROXY_USE_GRPC="${RAY_SERVE_PROXY_USE_GRPC:-1}"
export RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH="${RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH:-2147483647}"
# LLM_INGRESS=haproxy: Serve's HAProxy ingress takes the HTTP port instead of the Python
# proxy (what `llm-serve run` takes where it can; app/builder.py:INGRESS_CHOICES). Every
# node's `ray start` needs the same setting. Not the default here: several nodes on one
# machine (tests/integration/test_multinode.py) would collide on HAProxy's stats and
# metrics ports (RAY_SERVE_HAPROXY_STATS_PORT, RAY_SERVE_HAPROXY_METRICS_PORT move them).
case "${LLM_INGRESS:-serve-proxy}" in
  serve-proxy) ;;
  haproxy) export RAY_SERVE_ENABLE_HA_PROXY=1 ;;
  *) echo "[cluster] LLM_INGRESS must be serve-proxy or haproxy, not '$LLM_INGRESS'" >&2; exit 2 ;;
esac

RAY_BIN="${RAY_BIN:-ray}"
if ! command -v "$RAY_BIN" >/dev/null 2>&1; then
  here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  if [[ -x "$here/.venv/bin/ray" ]]; then
    RAY_BIN="$here/.venv/bin/ray"
  else
    echo "[cluster] no 'ray' command found (activate the project's venv or set RAY_BIN)" >&2
    exit 2
  fi
fi

have_token() {
  [[ -n "${RAY_AUTH_TOKEN:-}" ]] && return 0
  if [[ -n "${RAY_AUTH_TOKEN_PATH:-}" ]]; then
    [[ -s "$RAY_AUTH_TOKEN_PATH" ]] && return 0
    echo "[cluster] RAY_AUTH_TOKEN_PATH=$RAY_AUTH_TOKEN_PATH is missing or empty" >&2
    exit 2
  fi
  [[ -s "$HOME/.ray/auth_token" ]]
}

# Role resources: a node of role R advertises {"R_node": 1}; ComputeWorker and DataPlane
# replicas request a small fraction of theirs (compute.resources / dataplane.resources in
# the serve config), so they are placed only on nodes of that role.
role_resources() {
  case "$1" in
    head) echo '{"head_node": 1}' ;;
    compute) echo '{"compute_node": 1}' ;;
    data) echo '{"data_node": 1}' ;;
    *) echo "[cluster] unknown role '$1' (compute | data)" >&2; exit 2 ;;
  esac
}
