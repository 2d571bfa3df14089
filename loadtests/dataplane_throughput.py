"""Block put/get throughput of the data plane against redis-benchmark, same value size,
same machine, one run.

    python -m loadtests.dataplane_throughput [--block-kib 256] [--num-blocks 512]
        [--batch 16] [--concurrency 4] [--out FILE]

Ours: a DataPlane deployment (2 replicas) driven through its Serve handle, as a compute
worker drives it (blocks travel through Ray's object store): ``put_blocks`` (into host
memory, written behind to Redis), ``get_blocks`` from host memory (L2), and, after
``flush_l2``, ``get_blocks`` from Redis (L3). Peer: ``redis-benchmark -t set,get -d SIZE``
against the same redis-server with the same parallelism.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path


def _say(msg: str) -> None:
    print(f"[dp-throughput] {msg}", file=sys.stderr, flush=True)


def redis_benchmark(port: int, size: int, n: int, clients: int) -> dict:
    out = subprocess.run(
        ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-t", "set,get",
         "-d", str(size), "-n", str(n), "-c", str(clients), "-q"],
        capture_output=True, text=True, timeout=600, check=True,
    ).stdout
    rates = {}
    for name, rps in re.findall(r"(SET|GET): ([\d.]+) requests per second", out.replace("\r", "\n")):
        rates[name.lower()] = float(rps) * size / 1e9
    return rates


async def run_ours(handle, blocks, hashes, batch: int, concurrency: int) -> dict:
    from deployments.dataplane.blocks import pack_blocks

    groups = [
        (hashes[i : i + batch], blocks[i : i + batch]) for i in range(0, len(blocks), batch)
    ]
    total = sum(len(b) for b in blocks)
    sem = asyncio.Semaphore(concurrency)

    async def each(fn):
        async def one(g):
            async with sem:
                return await fn(g)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(g) for g in groups))
        return total / (time.perf_counter() - start) / 1e9, results

    # The packed forms are what compute workers use (one numpy array per call).
    put_gbps, _ = await each(
        lambda g: handle.put_blocks_packed.remote("bench", g[0], *pack_blocks(g[1]), shard_key=g[0][0])
    )
    get_l2_gbps, got = await each(
        lambda g: handle.get_blocks_packed.remote("bench", g[0], shard_key=g[0][0])
    )
    assert all(r is not None for r in got), "a block went missing from L2"
    for i in range(64):  # reach every replica of the ring
        await handle.flush_l2.remote(shard_key=f"flush-{i}")
    get_l3_gbps, got = await each(
        lambda g: handle.get_blocks_packed.remote("bench", g[0], shard_key=g[0][0])
    )
    assert all(r is not None for r in got), "a block went missing from L3"
    return {"put": put_gbps, "get_l2": get_l2_gbps, "get_l3": get_l3_gbps}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.dataplane_throughput")
    p.add_argument("--block-kib", type=int, default=256)
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--batch", type=int, default=64, help="blocks per call (a prefix)")
    p.add_argument("--concurrency", type=int, default=4, help="calls in flight")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="loadtests/results/dataplane_throughput.json")
    args = p.parse_args(argv)

    import ray
    from ray import serve

    from app.config import AppConfig
    from app.local_redis import LocalRedis
    from deployments.dataplane.blocks import BlockHeader, encode_block
    from deployments.dataplane.deployment import dataplane_deployment

    size = args.block_kib * 1024
    results = []
    with LocalRedis() as redis:
        cfg = AppConfig.model_validate(
            {"dataplane": {"num_replicas": 2, "redis": {"url": redis.url},
                           "l2_capacity_bytes": 4 * size * args.num_blocks}}
        )
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": 0})
        handle = serve.run(
            dataplane_deployment(cfg).bind(cfg.model_dump(mode="json")), name="dpbench", route_prefix=None
        )
        for rnd in range(args.rounds):
            payloads = [os.urandom(size - 128) for _ in range(args.num_blocks)]
            blocks = [encode_block(BlockHeader("uint8", (len(b),)), b) for b in payloads]
            hashes = [f"{rnd:02d}{i:030x}" for i in range(args.num_blocks)]
            value_size = len(blocks[0])
            _say(f"round {rnd + 1}: data plane, {args.num_blocks} blocks of {value_size} bytes")
            ours = asyncio.run(run_ours(handle, blocks, hashes, args.batch, args.concurrency))
            _say(f"round {rnd + 1}: redis-benchmark, same value size")
            peer = redis_benchmark(redis.port, value_size, args.num_blocks * 2, args.concurrency)
            results.append({"ours_gbps": ours, "redis_benchmark_gbps": peer})
        serve.shutdown()
        ray.shutdown()

    def med(path):
        vals = sorted(r[path[0]][path[1]] for r in results)
        return vals[len(vals) // 2]

    ratios = {
        "put_over_redis_set": med(("ours_gbps", "put")) / med(("redis_benchmark_gbps", "set")),
        "get_l3_over_redis_get": med(("ours_gbps", "get_l3")) / med(("redis_benchmark_gbps", "get")),
        "get_l2_over_redis_get": med(("ours_gbps", "get_l2")) / med(("redis_benchmark_gbps", "get")),
    }
    print(json.dumps({"rounds": results, "ratios": ratios}, indent=2))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rounds": results, "ratios": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
