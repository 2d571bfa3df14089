"""Command line: run the service from serve_config.yaml in the foreground.

    python -m app.cli run [--config serve_config.yaml] [--num-cpus N] [--ingress auto|haproxy|serve-proxy]

It does what ``serve run serve_config.yaml`` does, plus what a laptop needs: starts a local
Ray with enough logical CPUs for every deployment (Ray would see only the real cores),
prints progress, waits for /ready and prints the URL, and shuts down cleanly on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from app.config import AppConfig


def _say(msg: str) -> None:
    print(f"\033[1m[llm-serve]\033[0m {msg}", flush=True)


def load_serve_config(path: Path) -> dict:
    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    apps = doc.get("applications") or []
    if len(apps) != 1:
        raise SystemExit(f"{path}: expected exactly one application, found {len(apps)}")
    return doc


def wait_ready(url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/ready", timeout=5) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    return False


def start_embedded_redis(config: "AppConfig", state_dir: Path, kv_max_memory: str = "2gb") -> list:
    """Start a local redis-server for each of the data plane's Redis URLs (sessions, and
    KV blocks when ``dataplane.kv_redis`` names another) that is a loopback address
    nobody answers on. The sessions' server keeps its AOF in ``state_dir``, so sessions
    survive restarts; the KV blocks' server is a cache (no persistence, ``kv_max_memory``
    at most, least recently used blocks evicted). Returns the servers started."""
    from urllib.parse import urlparse

    from app.local_redis import LocalRedis, _ping

    if not config.dataplane.enabled:
        return []
    started = []
    wanted = [(config.dataplane.redis, None)]
    if config.dataplane.kv_redis is not None:
        wanted.append((config.dataplane.kv_redis, kv_max_memory))
    for cfg, cache_max_memory in wanted:
        url = urlparse(cfg.url)
        if url.hostname not in ("127.0.0.1", "localhost", "::1"):
            continue
        port = url.port or 6379
        if any(r.port == port for r in started):
            continue  # kv_redis names the same server
        if _ping(port):
            _say(f"using the Redis already listening on 127.0.0.1:{port}")
            continue
        data_dir = state_dir / f"redis-{port}"
        data_dir.mkdir(parents=True, exist_ok=True)
        if cache_max_memory:
            _say(f"starting redis-server on 127.0.0.1:{port} for KV blocks (a cache: no "
                 f"persistence, maxmemory {cache_max_memory}, allkeys-lru)")
        else:
            _say(f"starting redis-server on 127.0.0.1:{port} (AOF everysec in {data_dir})")
        started.append(LocalRedis(port, data_dir=data_dir, cache_max_memory=cache_max_memory).start())
    return started


def run(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from app.builder import build_app, port_taken, resolve_ingress, use_serve_process_env

    try:
        ingress, why = resolve_ingress(args.ingress)
    except ValueError as e:
        _say(str(e))
        return 2
    doc = load_serve_config(Path(args.config))
    app_doc = doc["applications"][0]
    http = doc.get("http_options") or {}
    host, port = http.get("host", "127.0.0.1"), int(http.get("port", 8000))
    # Taken ports fail here, not after minutes of start-up (a proxy or HAProxy that cannot
    # bind never gets ready; another server on the port could even answer /ready).
    ports = [("http_options.port", host, port)]
    if doc.get("grpc_options"):
        # HAProxy's gRPC frontend binds the HTTP host; Serve's gRPC proxy every interface.
        grpc_host = host if ingress == "haproxy" else ""
        ports.append(("grpc_options.port", grpc_host, int(doc["grpc_options"].get("port", 9000))))
    for key, bind_host, p in ports:
        if (taken := port_taken(p, bind_host)) is not None:
            _say(f"port {p} on {bind_host or 'every interface'} is taken ({taken}): stop what "
                 f"holds it, or set {key} in {args.config}")
            return 2

    _say(f"validating {args.config} and preparing the model")
    app_args = app_doc.get("args") or {}
    application = build_app(app_args)
    redis_servers = start_embedded_redis(
        AppConfig.model_validate(app_args), Path(args.state_dir), args.kv_redis_max_memory
    )

    _say(f"starting Ray (num_cpus={args.num_cpus}); ingress: {why}")
    try:
        use_serve_process_env(ingress)
        ray.init(
            num_cpus=args.num_cpus,
            include_dashboard=False,
            log_to_driver=args.verbose,
            runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}},
        )
        grpc_options = doc.get("grpc_options") or None
        serve.start(http_options={"host": host, "port": port}, grpc_options=grpc_options)
        layout = (
            "Server (ingress, router and ComputeWorker in one process)"
            if AppConfig.model_validate(app_args).ingress.with_worker
            else "Ingress (with its router) → ComputeWorker"
        )
        _say(f"deploying {layout} → DataPlane (loading weights, warm-up)")
        serve.run(
            application,
            name=app_doc.get("name", "llm"),
            route_prefix=app_doc.get("route_prefix", "/"),
            blocking=False,
        )
        url = f"http://{host}:{port}"
        if not wait_ready(url, timeout_s=args.ready_timeout_s):
            _say(f"the service did not become ready within {args.ready_timeout_s}s")
            serve.shutdown()
            return 1
        _say(f"ready at {url}  (OpenAI API at {url}/v1, metrics at {url}/metrics; Ctrl-C stops)")
        if grpc_options and grpc_options.get("grpc_servicer_functions"):
            where = "every interface" if ingress == "serve-proxy" else host
            _say(f"gRPC API (app/grpc_api/llm.proto) on port {grpc_options.get('port', 9000)}, {where}")

        stop = threading.Event()
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        while not stop.wait(1.0):
            pass
        _say("shutting down")
        serve.shutdown()
        ray.shutdown()
        return 0
    finally:
        for r in redis_servers:
            r.stop()


def main(argv: list[str] | None = None) -> int:
    from app.builder import INGRESS_CHOICES

    parser = argparse.ArgumentParser(prog="llm-serve")
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="run the service in the foreground")
    p_run.add_argument("--config", default="serve_config.yaml")
    p_run.add_argument(
        "--num-cpus",
        type=int,
        default=8,
        help="logical CPUs Ray schedules with (not cores): enough for every deployment",
    )
    p_run.add_argument("--ready-timeout-s", type=float, default=600)
    p_run.add_argument(
        "--state-dir", default=".state", help="where the embedded Redis keeps its data"
    )
    p_run.add_argument(
        "--kv-redis-max-memory",
        default="2gb",
        help="memory cap of the embedded KV-block Redis (dataplane.kv_redis), a cache",
    )
    p_run.add_argument("--verbose", action="store_true", help="stream replica logs here")
    p_run.add_argument(
        "--ingress",
        choices=INGRESS_CHOICES,
        default="auto",
        help="what takes the HTTP port: HAProxy forwarding to ingress replicas that serve "
        "HTTP themselves (its stats and metrics ports, 8404 and 9101, listen on every "
        "interface), or Serve's Python proxy (slower); auto: HAProxy where it can start "
        "here, else Serve's proxy",
    )
    args = parser.parse_args(argv)
    if args.command == "run":
        return run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
