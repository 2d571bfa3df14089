"""The L3 read of KV blocks alone (no Ray, no app): the data plane's raw client reading
blocks of the small model's shape from a redis-server as the project starts it for KV
blocks, and checking each (header, XXH3), in three forms alternated in each round:

* ``after``: one MGET piece outstanding at a time, each block checked once the whole
  read is in (how the reads went before ``resp.MGET_AHEAD`` and ``on_value``);
* ``inline``: one piece at a time, each block checked as it arrives (``on_value``):
  what the worker's direct read, the data plane's read and its promotions do since
  2026-12-06's twentieth session (``resp.MGET_AHEAD`` 1);
* ``ahead``: two pieces outstanding (``resp.MGET_AHEAD`` 2, the default before), each
  block checked as it arrives.

The client reads up to ``resp.MGET_CALLS_AT_ONCE`` (4) calls at once, each on its own
connection, in every form (``LLM_RAW_MGET_CALLS_AT_ONCE`` sets it).

    python -m loadtests.l3_read [--rounds 5] [--blocks 8,32,128] [--out FILE]

Two loads per form and round: a worker's read of one prefix of N blocks for each N in
``--blocks`` (ms; a different prefix each time, so no read finds its bytes in the CPU's
cache), and the throughput load of ``loadtests.dataplane_throughput`` (512 blocks in
reads of 64, 4 at once; GB/s), with ``redis-benchmark`` GET of the same value size and 4
clients right after, as the peer. This process runs with a replica's glibc settings
(``app.builder.MEMORY_ENV``; it re-executes itself with them). Loopback only.
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
from deployments.dataplane import resp
from deployments.dataplane.blocks import BlockChecks, BlockHeader, check_block, encode_block
from deployments.dataplane.resp import RawBlockClient
from loadtests.benchmark import restart_with_memory_env, write_report
from loadtests.dataplane_throughput import SMALL_BLOCK_SHAPE, redis_benchmark

FORMS = ("after", "inline", "ahead")
NUM_STORED = 1024
BULK_BLOCKS, BULK_BATCH, BULK_CONCURRENCY = 512, 64, 4


def _say(msg: str) -> None:
    print(f"[l3-read] {msg}", file=sys.stderr, flush=True)


async def read_checked(client: RawBlockClient, names: list[str], form: str) -> int:
    """One read of ``names`` in ``form``, every block checked; its bytes."""
    resp.MGET_AHEAD = 2 if form == "ahead" else 1
    checks = BlockChecks() if form != "after" else None
    data, lengths = await client.mget_packed(names, on_value=checks)
    if None in lengths:
        raise RuntimeError("a block is missing from Redis")
    view, offset = memoryview(data), 0
    for i, n in enumerate(lengths):
        block = view[offset : offset + n]
        if checks is None:
            check_block(block)
        elif checks.error(i, block) is not None:
            raise RuntimeError(f"block {i} failed its check")
        offset += n
    return offset


async def run(args) -> dict:
    sizes = [int(x) for x in args.blocks.split(",")]
    payload_bytes = int(np.prod(SMALL_BLOCK_SHAPE)) * 4
    header = BlockHeader("float32", SMALL_BLOCK_SHAPE)
    rng = np.random.default_rng(0)
    server = LocalRedis(cache_max_memory="2gb").start()
    client = RawBlockClient("127.0.0.1", server.port)
    ahead_default = resp.MGET_AHEAD
    try:
        _say(f"storing {NUM_STORED} blocks of {payload_bytes >> 10} KiB")
        block_bytes = 0
        for start in range(0, NUM_STORED, 64):
            blocks = [encode_block(header, rng.integers(0, 256, payload_bytes, dtype=np.uint8).tobytes()) for _ in range(64)]
            block_bytes = len(blocks[0])
            await client.pipeline([("SET", f"blk{start + i}", b) for i, b in enumerate(blocks)])
        await read_checked(client, [f"blk{i}" for i in range(64)], "ahead")  # connections
        rounds, cursor = [], 0
        for rnd in range(1, args.rounds + 1):
            order = FORMS if rnd % 2 else tuple(reversed(FORMS))
            row: dict = {"round": rnd, "read_ms": {}, "bulk_gbps": {}}
            for form in order:
                row["read_ms"][form] = {}
                for n in sizes:
                    names = [f"blk{(cursor + i) % NUM_STORED}" for i in range(n)]
                    cursor += n
                    started = time.perf_counter()
                    await read_checked(client, names, form)
                    row["read_ms"][form][n] = 1000 * (time.perf_counter() - started)
                groups = [
                    [f"blk{(cursor + g + i) % NUM_STORED}" for i in range(BULK_BATCH)]
                    for g in range(0, BULK_BLOCKS, BULK_BATCH)
                ]
                cursor += BULK_BLOCKS
                slots = asyncio.Semaphore(BULK_CONCURRENCY)

                async def one(names):
                    async with slots:
                        return await read_checked(client, names, form)

                started = time.perf_counter()
                nbytes = sum(await asyncio.gather(*(one(g) for g in groups)))
                row["bulk_gbps"][form] = nbytes / (time.perf_counter() - started) / 1e9
            row["redis_benchmark_get_gbps"] = redis_benchmark(server.port, block_bytes, 2000, BULK_CONCURRENCY)["get"]
            rounds.append(row)
            print(f"round {rnd}: " + "; ".join(
                f"{f} " + " ".join(f"{n}:{row['read_ms'][f][n]:.1f}ms" for n in sizes) + f" bulk {row['bulk_gbps'][f]:.2f} GB/s"
                for f in FORMS) + f"; redis-benchmark GET {row['redis_benchmark_get_gbps']:.2f} GB/s", flush=True)
    finally:
        resp.MGET_AHEAD = ahead_default
        client.close()
        server.cleanup()
    summary = {
        form: {
            "read_ms_median": {n: statistics.median(r["read_ms"][form][n] for r in rounds) for n in sizes},
            "bulk_gbps_median": statistics.median(r["bulk_gbps"][form] for r in rounds),
            "bulk_over_redis_get_median": statistics.median(r["bulk_gbps"][form] / r["redis_benchmark_get_gbps"] for r in rounds),
        }
        for form in FORMS
    }
    print(json.dumps(summary, indent=1))
    return {"args": vars(args), "rounds": rounds, "summary": summary}


def main(argv=None) -> int:
    restart_with_memory_env("loadtests.l3_read", argv)
    p = argparse.ArgumentParser(prog="python -m loadtests.l3_read")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--blocks", default="8,32,128", help="blocks per single read")
    p.add_argument("--out", default="loadtests/results/l3_read.json")
    args = p.parse_args(argv)
    _say(f"stored {write_report(args.out, asyncio.run(run(args)))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
