"""The data plane's raw RESP client alone (``deployments/dataplane/resp.py``, no Ray, one
process) against ``redis-benchmark`` on the same local cache redis-server, alternated
round by round: what the client itself can move, apart from the Serve hops and copies
that ``loadtests.dataplane_throughput`` measures around it.

    python -m loadtests.raw_client [--num-blocks 2048] [--block-kib 256] [--batch 64]
        [--rounds 4] [--out FILE]

SET: pipelines of ``--batch`` blocks, two SETs each (payload and index entry, as
write-behind sends them), one at a time and four at once, against ``redis-benchmark -t
set -c 4 -r NUM_BLOCKS``. GET: MGETs of ``--batch`` values (``mget_packed``, as a worker's
L3 read), one and four at once, against ``redis-benchmark -t get -c 4 -r NUM_BLOCKS``
(its keys filled first). GB/s per round, and the median over rounds of each ratio to the
peer of the same round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import numpy as np

from app.local_redis import LocalRedis
from deployments.dataplane.resp import RawBlockClient
from loadtests.dataplane_throughput import redis_benchmark


def _say(msg: str) -> None:
    print(f"[raw-client] {msg}", file=sys.stderr, flush=True)


def _peer(port: int, test: str, size: int, keys: int) -> float:
    """redis-benchmark's GB/s for one test, 4 clients, on ``keys`` random keys."""
    return redis_benchmark(port, size, 2 * keys, 4, keyspace=keys, tests=test)[test]


async def _sets(client: RawBlockClient, blocks: list, batch: int, in_flight: int) -> float:
    sem = asyncio.Semaphore(in_flight)
    size = len(blocks[0])

    async def one(start: int) -> None:
        async with sem:
            cmds = []
            for i in range(start, min(start + batch, len(blocks))):
                cmds.append(("SET", f"key:{i:012d}", blocks[i], "EX", 3600))
                cmds.append(("SET", f"idx:{i:012d}", size, "EX", 3600))
            await client.pipeline(cmds)

    started = time.perf_counter()
    await asyncio.gather(*(one(s) for s in range(0, len(blocks), batch)))
    return len(blocks) * size / (time.perf_counter() - started) / 1e9


async def _mgets(client: RawBlockClient, num: int, size: int, batch: int, in_flight: int) -> float:
    sem = asyncio.Semaphore(in_flight)

    async def one(start: int) -> None:
        async with sem:
            _, lengths = await client.mget_packed([f"key:{i:012d}" for i in range(start, min(start + batch, num))])
            assert None not in lengths, "a value went missing"

    started = time.perf_counter()
    await asyncio.gather(*(one(s) for s in range(0, num, batch)))
    return num * size / (time.perf_counter() - started) / 1e9


async def run(args) -> dict:
    size = args.block_kib * 1024
    with LocalRedis(cache_max_memory="8gb") as server:
        client = RawBlockClient("127.0.0.1", server.port)
        rng = np.random.default_rng(0)
        blocks = [rng.integers(0, 255, size, dtype=np.uint8) for _ in range(args.num_blocks)]
        variants = {"set_1": ("set", 1), "set_4": ("set", 4), "mget_1": ("get", 1), "mget_4": ("get", 4)}
        rounds = []
        for r in range(args.rounds + 1):  # round 0 warms up (fresh memory on both sides)
            row = {"peer_set": _peer(server.port, "set", size, args.num_blocks)}
            row["set_1"] = await _sets(client, blocks, args.batch, 1)
            row["set_4"] = await _sets(client, blocks, args.batch, 4)
            row["peer_get"] = _peer(server.port, "get", size, args.num_blocks)
            row["mget_1"] = await _mgets(client, args.num_blocks, size, args.batch, 1)
            row["mget_4"] = await _mgets(client, args.num_blocks, size, args.batch, 4)
            _say(f"round {r}{' (warm-up)' if r == 0 else ''}: " + json.dumps({k: round(v, 2) for k, v in row.items()}))
            if r:
                rounds.append(row)
        client.close()
    ratios = {
        f"{name}_over_redis_benchmark": statistics.median(row[name] / row[f"peer_{kind}"] for row in rounds)
        for name, (kind, _) in variants.items()
    }
    return {"args": vars(args), "rounds_gbps": rounds, "ratios": ratios}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-blocks", type=int, default=2048)
    p.add_argument("--block-kib", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    report = asyncio.run(run(args))
    print(json.dumps(report["ratios"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        _say(f"stored {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
