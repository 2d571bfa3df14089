"""What a KV-reuse miss costs, side by side in one Ray: time to first token of one-turn
requests (nothing to reuse) on three copies of the app, and the data-plane lookup call that
a miss pays, by each handle transport.

    python -m loadtests.miss_cost [--preset small] [--requests 30]

Apps (same model and config but for the data plane settings): ``reuse`` (KV reuse on,
``dataplane.prefetch: when_queued``, the chain-root index on), ``reuse_prefetch_always``,
``reuse_no_root_index`` (``root_index_sync_ms: 0``: every request looks up) and
``no_reuse``. Each request is a fresh 25-word chat turn, in a new session or stateless,
with 2 output tokens; the variants are alternated request by request. Neither a fresh
stateless prompt nor a session's first turn can hit: with the root index on, neither
pays a lookup (``reuse_no_root_index`` measures the stateless one without it). Then ``lookup_prefix`` of 5 unknown
hashes is timed through the DataPlane handle by reference (Ray actor call) and by value
(Serve's gRPC transport), alternated. Medians and quartiles go to stdout and to --out.
Starts its own Redis and Ray; loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx

from loadtests.benchmark import write_report
from loadtests.multiturn import WORDS, app_args

# name: (KV reuse, dataplane.prefetch, dataplane.root_index_sync_ms)
APPS = {
    "reuse": (True, "when_queued", 250),
    "reuse_prefetch_always": (True, "always", 250),
    "reuse_no_root_index": (True, "when_queued", 0),
    "no_reuse": (False, "when_queued", 250),
}
VARIANTS = [
    ("reuse", True), ("reuse_prefetch_always", True), ("no_reuse", True),
    ("reuse", False), ("reuse_no_root_index", False), ("no_reuse", False),
]


def _say(msg: str) -> None:
    print(f"[miss_cost] {msg}", file=sys.stderr, flush=True)


def chat_ttft(client: httpx.Client, app: str, text: str, headers: dict, max_tokens: int = 2) -> float:
    """Seconds to the first content of a streamed chat turn of ``text`` on ``app``."""
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    started, first = time.perf_counter(), None
    with client.stream("POST", f"/{app}/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{app}: {r.status_code} {r.read()[:200]!r}")
        for line in r.iter_lines():
            if first is None and '"content":"' in line and '"content":""' not in line:
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("no content in the stream")
    return first


def ttft(client: httpx.Client, app: str, session: bool, rng: random.Random) -> float:
    headers = {}
    if session:
        headers["X-Session-Id"] = client.post(f"/{app}/v1/sessions").json()["id"]
    return chat_ttft(client, app, " ".join(rng.choice(WORDS) for _ in range(25)), headers)


def deploy_side_by_side(apps: dict[str, dict], port: int, say) -> None:
    """Each of ``apps`` (name: the app's args) deployed at ``/<name>`` in this Ray's
    Serve, then waited for until every one is ready."""
    from ray import serve

    from app.builder import build_app
    from app.cli import wait_ready

    for name, a in apps.items():
        say(f"deploying {name}")
        serve.run(build_app(a), name=name, route_prefix=f"/{name}", blocking=False)
    for name in apps:
        if not wait_ready(f"http://127.0.0.1:{port}/{name}", 600):
            raise TimeoutError(f"{name} not ready")


def summary(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4)
    return {"median_ms": statistics.median(xs), "p25_ms": q[0], "p75_ms": q[2], "n": len(xs)}


async def time_lookups(handle, n: int) -> list[float]:
    out = []
    for _ in range(n):
        hashes = [uuid.uuid4().hex for _ in range(5)]
        started = time.perf_counter()
        await handle.lookup_prefix.remote("default", hashes, shard_key=hashes[0])
        out.append(1000 * (time.perf_counter() - started))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.miss_cost")
    p.add_argument("--preset", default="small", choices=["tiny", "small"])
    p.add_argument("--requests", type=int, default=30, help="measured requests per variant")
    p.add_argument("--lookups", type=int, default=200, help="timed lookup calls per transport and round")
    p.add_argument("--port", type=int, default=8125)
    p.add_argument("--out", default="loadtests/results/miss_cost.json")
    args = p.parse_args(argv)

    import ray
    from ray import serve

    from app.builder import use_serve_process_env
    from app.local_redis import LocalRedis
    from app.model_builder import ensure_model

    model_path = ensure_model(Path(f"models/{args.preset}"), args.preset)
    results: dict = {}
    with LocalRedis() as redis:
        use_serve_process_env()  # as app.cli does
        ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        apps = {}
        for name, (reuse, prefetch, root_index_ms) in APPS.items():
            a = apps[name] = app_args(model_path, redis.url, reuse, num_threads=2, l1=False)
            a["dataplane"]["prefetch"] = prefetch
            a["dataplane"]["root_index_sync_ms"] = root_index_ms
        deploy_side_by_side(apps, args.port, _say)
        rng = random.Random(1)
        times: dict[tuple[str, bool], list[float]] = {v: [] for v in VARIANTS}
        with httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=60) as client:
            for v in VARIANTS:  # warm every path first (connections, first calls)
                for _ in range(3):
                    ttft(client, *v, rng)
            for i in range(args.requests):
                for v in VARIANTS:
                    time.sleep(0.3)
                    times[v].append(1000 * ttft(client, *v, rng))
                if (i + 1) % 10 == 0:
                    _say(f"{i + 1}/{args.requests} requests per variant")
        for (app, session), xs in times.items():
            results[f"{app}/{'session' if session else 'stateless'}"] = summary(xs)
        # How many of each app's requests its worker looked up, and how many it did not
        # (the root index): the check that the variants ran as named.
        kv_counts = {}
        for name, (reuse, _, _) in APPS.items():
            if reuse:
                stats = serve.get_deployment_handle("ComputeWorker", app_name=name).kv_stats.remote().result()
                kv_counts[name] = {k: stats.get(k, 0) for k in ("lookups", "lookups_skipped", "early_lookups_used")}
                _say(f"{name}: worker KV counters {kv_counts[name]}")
        handle = serve.get_deployment_handle("DataPlane", app_name="reuse")
        kinds = {"by_reference": handle, "by_value": handle.options(_by_reference=False)}
        lookups: dict[str, list[float]] = {k: [] for k in kinds}
        for _ in range(2):
            for kind, h in kinds.items():
                lookups[kind] += asyncio.run(time_lookups(h, args.lookups))
        for kind, xs in lookups.items():
            results[f"lookup_call/{kind}"] = summary(xs)
        serve.shutdown()
        ray.shutdown()
    r = results
    ratios = {
        "session_turn1_reuse_over_no_reuse": r["reuse/session"]["median_ms"] / r["no_reuse/session"]["median_ms"],
        "stateless_reuse_over_no_reuse": r["reuse/stateless"]["median_ms"] / r["no_reuse/stateless"]["median_ms"],
        "stateless_reuse_without_root_index_over_no_reuse": r["reuse_no_root_index/stateless"]["median_ms"] / r["no_reuse/stateless"]["median_ms"],
        "prefetch_always_over_when_queued": r["reuse_prefetch_always/session"]["median_ms"] / r["reuse/session"]["median_ms"],
        "lookup_by_value_over_by_reference": r["lookup_call/by_value"]["median_ms"] / r["lookup_call/by_reference"]["median_ms"],
    }
    for key, s in results.items():
        print(f"{key:40s} median {s['median_ms']:7.1f} ms   p25 {s['p25_ms']:7.1f}   p75 {s['p75_ms']:7.1f}")
    print(json.dumps(ratios, indent=2))
    _say(f"stored {write_report(args.out, {'args': vars(args), 'results': results, 'ratios': ratios, 'worker_kv': kv_counts})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
