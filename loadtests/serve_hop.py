"""What one Serve handle call costs on this machine, between two idle replicas with the
app's Serve settings (``THROUGHPUT_ENV``): the wait until the call is assigned (Serve's
router waits for the replica to accept it, ``_to_object_ref()``: how long the router waits
for a KV lookup it starts before it calls the worker) and a whole call with a no-op
answer. Every request's TTFT pays a few of these (proxy -> ingress, router -> data plane,
router -> worker), so this is the floor under the app's overhead per request.

    python -m loadtests.serve_hop [--calls 40] [--rounds 2]

Starts its own Ray; loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

from ray import serve

from app.builder import THROUGHPUT_ENV, use_serve_process_env

_OPTIONS = {"ray_actor_options": {"num_cpus": 0, "runtime_env": {"env_vars": dict(THROUGHPUT_ENV)}}}


@serve.deployment(**_OPTIONS)
class Callee:
    async def noop(self, payload=None) -> int:
        return 1


@serve.deployment(**_OPTIONS)
class Caller:
    def __init__(self, callee):
        self._callee = callee

    async def measure(self, calls: int, payload_items: int, pause_s: float) -> dict:
        # A lookup's arguments: a list of 32-hex-digit block hashes.
        payload = ["%032x" % i for i in range(payload_items)]
        assigned, whole = [], []
        for _ in range(calls):
            await asyncio.sleep(pause_s)
            t = time.perf_counter()
            await self._callee.noop.remote(payload)._to_object_ref()
            assigned.append(time.perf_counter() - t)
            await asyncio.sleep(pause_s)
            t = time.perf_counter()
            await self._callee.noop.remote(payload)
            whole.append(time.perf_counter() - t)

        def summary(v: list[float]) -> dict:
            v = sorted(v)
            return {"p50_ms": 1000 * statistics.median(v), "p90_ms": 1000 * v[int(0.9 * (len(v) - 1))]}

        return {"payload_items": payload_items, "assigned": summary(assigned), "whole_call": summary(whole)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.serve_hop")
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--payload-items", default="0,120", help="hashes per call, comma-separated")
    p.add_argument("--pause-s", type=float, default=0.05, help="idle time before each call")
    args = p.parse_args(argv)
    import ray

    use_serve_process_env()  # as app.cli does
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        caller = serve.run(Caller.bind(Callee.bind()), name="serve_hop", route_prefix=None)
        for rnd in range(1, args.rounds + 1):
            for items in (int(x) for x in args.payload_items.split(",")):
                r = caller.measure.remote(args.calls, items, args.pause_s).result()
                print(
                    f"[serve_hop] round {rnd}, {items} hashes: assigned p50 {r['assigned']['p50_ms']:.2f} ms "
                    f"(p90 {r['assigned']['p90_ms']:.2f}); whole call p50 {r['whole_call']['p50_ms']:.2f} ms "
                    f"(p90 {r['whole_call']['p90_ms']:.2f})",
                    flush=True,
                )
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
