"""What one data-plane call costs, by the way it is sent: calls per second, median round
trip and the caller's CPU per call.

    python -m loadtests.dataplane_calls [--rounds 4] [--calls 400] [--in-flight 1,4,16]
        [--out FILE]

A DataPlane deployment as the app deploys it (2 replicas, Serve's runtime settings), and
``get_block_refs`` of a 64-block prefix that nothing holds, with ``direct_l3`` (answered
"in Redis" without reading Redis): the call a worker makes before each L3 read, with as
little work in the replica as a call can have. Forms, in a different order each round:

* ``serve``: the Serve handle's call as Ray 2.60 sends it ("with rejection": a streaming
  actor call whose first message says whether the replica took it, then the result).
* ``serve_plain``: a handle of its own whose router sends Serve's plain form (one actor
  call; what Serve does under Ray Client), by setting its router's private
  ``_enable_strict_max_ongoing_requests`` to False.
* ``connector`` / ``connector_plain``: the same two through ``DataPlaneKVConnector._call``,
  the worker's code path (its timeout, its task).
* ``connector_logged``: ``connector`` to a second DataPlane app whose replicas write Ray
  Serve's access-log line for every call (``telemetry.access_log: all``, the form before
  2026-12-06's eighteenth session; the app's own replicas drop it, ``ingress``).
* ``actor``: the replicas' Ray actors called directly (``handle_request`` with Serve's
  request metadata, Serve's internal entry point for a non-streaming call), round robin:
  no Serve router in the caller at all. Not something the app does; the floor under the
  others.

``--in-flight`` calls at once from this process (one event loop; its handles' routers run
on a loop of their own unless ``RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0``, a worker's
setting, is in the environment). The caller's CPU per call
is this process's CPU time over the form's calls (all its threads: the router's loop,
Ray's core worker); the replicas' CPU per call is that of every DataPlane replica on the
machine (both apps': the idle app's background ticks count alike in every form). Ratios:
each form's calls per second over ``serve``'s, per round, the median over rounds; and
``connector`` over ``connector_logged``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import statistics
import sys
import time
import uuid

from loadtests.benchmark import CpuMeter, write_report

FORMS = ("serve", "serve_plain", "connector", "connector_plain", "connector_logged", "actor")


def _say(msg: str) -> None:
    print(f"[dp-calls] {msg}", file=sys.stderr, flush=True)


async def measure(call, n: int, in_flight: int) -> dict:
    """``n`` calls of ``call()`` (a coroutine factory), ``in_flight`` at once."""
    sem = asyncio.Semaphore(in_flight)
    latencies: list[float] = []

    async def one(i):
        async with sem:
            started = time.perf_counter()
            await call(i)
            latencies.append(time.perf_counter() - started)

    meter = CpuMeter().start()
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    replicas = meter.stop().get("data plane", 0.0)
    return {
        "calls_per_s": n / wall,
        "median_ms": 1000 * statistics.median(latencies),
        "caller_cpu_ms_per_call": 1000 * cpu / n,
        "replica_cpu_ms_per_call": 1000 * replicas / n,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.dataplane_calls")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--calls", type=int, default=400, help="calls per form, level and round")
    p.add_argument("--in-flight", default="1,4,16")
    p.add_argument("--out", default="loadtests/results/dataplane_calls.json")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.in_flight.split(",") if x]

    import ray
    from ray import serve
    from ray.serve._private.common import RequestMetadata
    from ray.serve.handle import DeploymentHandle

    from app.builder import with_serve_runtime
    from app.config import AppConfig
    from app.local_redis import LocalRedis
    from deployments.dataplane.connector import DataPlaneKVConnector
    from deployments.dataplane.deployment import dataplane_deployment

    app_name = "dpcalls"
    hashes = [f"calls-{i:026x}" for i in range(64)]
    rounds: list[dict] = []
    with LocalRedis() as redis:
        cfg = AppConfig.model_validate({"dataplane": {"num_replicas": 2, "redis": {"url": redis.url}}})
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": 0})
        handle = serve.run(
            with_serve_runtime(dataplane_deployment(cfg), cfg).bind(cfg.model_dump(mode="json")),
            name=app_name, route_prefix=None,
        )
        # The same with Serve's access-log line written for every call, as before.
        logged_cfg = cfg.model_copy(update={"telemetry": cfg.telemetry.model_copy(update={"access_log": "all"})})
        logged = serve.run(
            with_serve_runtime(dataplane_deployment(logged_cfg), logged_cfg).bind(logged_cfg.model_dump(mode="json")),
            name=f"{app_name}-logged", route_prefix=None,
        )
        actors = [
            ray.get_actor(a["name"], namespace=a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{app_name}#DataPlane#")
        ]
        _say(f"{len(actors)} DataPlane replicas")

        async def run() -> None:
            plain = DeploymentHandle("DataPlane", app_name)
            plain._init_router()._asyncio_router._enable_strict_max_ongoing_requests = False
            via = {"connector": DataPlaneKVConnector(handle, 16, timeout_s=60)}
            via["connector_plain"] = DataPlaneKVConnector(plain, 16, timeout_s=60)
            via["connector_logged"] = DataPlaneKVConnector(logged, 16, timeout_s=60)

            def by_handle(h):
                return lambda i: h.get_block_refs.remote("t", hashes, shard_key=uuid.uuid4().hex, direct_l3=True)

            def by_connector(c):
                return lambda i: c._call("get_block_refs", "t", hashes, shard_key=uuid.uuid4().hex, direct_l3=True)

            def by_actor(i):
                meta = RequestMetadata(
                    request_id=uuid.uuid4().hex, internal_request_id=uuid.uuid4().hex,
                    call_method="get_block_refs", app_name=app_name,
                )
                actor = actors[i % len(actors)]
                return actor.handle_request.remote(pickle.dumps(meta), "t", hashes, shard_key=hashes[0], direct_l3=True)

            calls = {
                "serve": by_handle(handle), "serve_plain": by_handle(plain),
                "connector": by_connector(via["connector"]),
                "connector_plain": by_connector(via["connector_plain"]),
                "connector_logged": by_connector(via["connector_logged"]), "actor": by_actor,
            }
            for name, call in calls.items():  # warm every path (routers, connections)
                await measure(call, 50, 4)
                segments = await call(0)
                assert segments and all(type(src).__name__ == "InRedis" for src, _ in segments), (name, segments)
            for rnd in range(args.rounds):
                order = FORMS if rnd % 2 == 0 else FORMS[::-1]
                result: dict = {}
                for level in levels:
                    for name in order:
                        result[f"{name}/{level}"] = r = await measure(calls[name], args.calls, level)
                        _say(f"round {rnd + 1}, {level} in flight, {name:16s} {r['calls_per_s']:6.0f} calls/s, "
                             f"median {r['median_ms']:6.2f} ms, caller CPU {r['caller_cpu_ms_per_call']:.2f} ms/call, "
                             f"replicas' {r['replica_cpu_ms_per_call']:.2f}")
                rounds.append(result)
            # Here, not after the loop closed: a router made on this loop (the worker's
            # setting, RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0) shuts down on it.
            await serve.shutdown_async()

        asyncio.run(run())
        ray.shutdown()

    ratios = {
        f"{name}_over_serve/{level}": statistics.median(
            r[f"{name}/{level}"]["calls_per_s"] / r[f"serve/{level}"]["calls_per_s"] for r in rounds
        )
        for level in levels for name in FORMS if name != "serve"
    } | {
        f"connector_over_connector_logged/{level}": statistics.median(
            r[f"connector/{level}"]["calls_per_s"] / r[f"connector_logged/{level}"]["calls_per_s"] for r in rounds
        )
        for level in levels
    }
    medians = {
        f"{name}/{level}": {k: statistics.median(r[f"{name}/{level}"][k] for r in rounds) for k in rounds[0][f"{name}/{level}"]}
        for level in levels for name in FORMS
    }
    for key, m in medians.items():
        print(f"{key:22s} {m['calls_per_s']:6.0f} calls/s  median {m['median_ms']:6.2f} ms  "
              f"caller CPU {m['caller_cpu_ms_per_call']:.2f} ms/call  replicas' {m['replica_cpu_ms_per_call']:.2f}")
    print(json.dumps(ratios, indent=2))
    _say(f"stored {write_report(args.out, {'args': vars(args), 'rounds': rounds, 'medians': medians, 'ratios': ratios})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
