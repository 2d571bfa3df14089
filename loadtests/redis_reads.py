"""What keeping freed pages in Redis's allocator would do to the data plane's L3 reads (no
Ray, no app). The project starts redis-server with jemalloc's defaults; this is the
measurement behind that choice (loadtests/README.md, "Redis's reply buffers").

    python -m loadtests.redis_reads [--rounds 2] [--gap-s 4] [--block-kib 256]
        [--blocks 17,34,51,68,86,103,120] [--bulk-passes 8] [--out FILE]

A redis-server as the project starts it (``app.local_redis.LocalRedis``, a cache with
``maxmemory``), in two settings that alternate in each round, each on a fresh server:
``default`` (jemalloc's defaults: freed pages go back to the kernel after seconds) and
``keep`` (``MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1``: never). Two loads, through
the data plane's raw client (``RawBlockClient.mget_packed``, the L3 read):

* turns: the first N of 120 blocks for each N in ``--blocks``, ``--gap-s`` apart, as a
  session's turns read a growing prefix;
* bulk: ``--bulk-passes`` passes, 2 s apart, over 512 blocks in MGETs of 64, 4 at a time
  (as ``loadtests.dataplane_throughput`` reads L3).

Per read or pass: the time (GB/s for a pass), the page faults the server took and its
resident memory. This process runs with a data-plane replica's glibc settings
(``app.builder.MEMORY_ENV``; it re-executes itself with them), so that its read buffers
are reused as the replica's are. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import numpy as np

from app.local_redis import LocalRedis
from deployments.dataplane.resp import RawBlockClient
from loadtests.benchmark import restart_with_memory_env, write_report

SETTINGS = {"keep": "dirty_decay_ms:-1,muzzy_decay_ms:-1", "default": ""}
BULK_BLOCKS, BULK_BATCH, BULK_CONCURRENCY = 512, 64, 4


def _say(msg: str) -> None:
    print(f"[redis-reads] {msg}", file=sys.stderr, flush=True)


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def _rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20


async def one_server(setting: str, sizes: list[int], block_bytes: int, gap_s: float, bulk_passes: int) -> dict:
    saved = os.environ.get("MALLOC_CONF")
    os.environ["MALLOC_CONF"] = SETTINGS[setting]
    try:
        server = LocalRedis(cache_max_memory="2gb").start()
    finally:
        if saved is None:
            os.environ.pop("MALLOC_CONF", None)
        else:
            os.environ["MALLOC_CONF"] = saved
    client = RawBlockClient("127.0.0.1", server.port)
    try:
        import redis

        num = max(max(sizes), BULK_BLOCKS if bulk_passes else 0)
        payload = np.random.default_rng(0).integers(0, 256, block_bytes * num, dtype=np.uint8)
        with redis.Redis(port=server.port) as r:
            for i in range(num):
                r.set(f"blk{i}", payload[i * block_bytes : (i + 1) * block_bytes].tobytes())
        pid = server.pid
        turns = []
        for n in sizes:
            await asyncio.sleep(gap_s)
            faults = _minor_faults(pid)
            started = time.perf_counter()
            data, lengths = await client.mget_packed([f"blk{i}" for i in range(n)])
            ms = 1000 * (time.perf_counter() - started)
            if len(data) != n * block_bytes or None in lengths:
                raise RuntimeError(f"read {len(data)} bytes for {n} blocks")
            turns.append({"blocks": n, "ms": round(ms, 1), "server_faults": _minor_faults(pid) - faults, "server_rss_mib": _rss_mib(pid)})
        bulk = []
        groups = [[f"blk{i}" for i in range(g, g + BULK_BATCH)] for g in range(0, BULK_BLOCKS, BULK_BATCH)]
        slots = asyncio.Semaphore(BULK_CONCURRENCY)

        async def read(group):
            async with slots:
                data, _ = await client.mget_packed(group)
                return len(data)

        for _ in range(bulk_passes):
            await asyncio.sleep(2)
            faults = _minor_faults(pid)
            started = time.perf_counter()
            nbytes = sum(await asyncio.gather(*(read(g) for g in groups)))
            gbps = nbytes / (time.perf_counter() - started) / 1e9
            bulk.append({"gbps": round(gbps, 2), "server_faults": _minor_faults(pid) - faults, "server_rss_mib": _rss_mib(pid)})
        return {"turns": turns, "bulk": bulk}
    finally:
        client.close()
        server.cleanup()


async def main_async(args) -> dict:
    sizes = [int(x) for x in args.blocks.split(",")]
    runs = []
    for rnd in range(1, args.rounds + 1):
        for setting in ("default", "keep") if rnd % 2 else ("keep", "default"):
            _say(f"round {rnd}/{args.rounds}: {setting} ({len(sizes)} reads {args.gap_s:g} s apart, {args.bulk_passes} bulk passes)")
            got = await one_server(setting, sizes, args.block_kib << 10, args.gap_s, args.bulk_passes)
            runs.append({"round": rnd, "setting": setting, **got})
            print(f"r{rnd} {setting:8s} turns " + " ".join(
                f"{r['blocks']}:{r['ms']:.0f}ms/{r['server_faults']}f" for r in got["turns"]), flush=True)
            print(f"r{rnd} {setting:8s} bulk  " + " ".join(
                f"{r['gbps']:.2f}GB/s/{r['server_faults']}f/{r['server_rss_mib']}MiB" for r in got["bulk"]), flush=True)
    summary = {}
    for setting in SETTINGS:
        mine = [run for run in runs if run["setting"] == setting]
        ms = [r["ms"] for run in mine for r in run["turns"]]
        gbps = [r["gbps"] for run in mine for r in run["bulk"]]
        summary[setting] = {
            "turns_median_ms": statistics.median(ms),
            "turns_max_ms": max(ms),
            "bulk_median_gbps": statistics.median(gbps) if gbps else None,
            "bulk_last_rss_mib": [run["bulk"][-1]["server_rss_mib"] for run in mine if run["bulk"]],
        }
    print(json.dumps(summary, indent=1))
    return {"args": vars(args), "runs": runs, "summary": summary}


def main(argv=None) -> int:
    restart_with_memory_env("loadtests.redis_reads", argv)
    p = argparse.ArgumentParser(prog="python -m loadtests.redis_reads")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--gap-s", type=float, default=4.0, help="pause before each read (a turn's think time)")
    p.add_argument("--block-kib", type=int, default=256, help="value size (the small model's block)")
    p.add_argument("--blocks", default="17,34,51,68,86,103,120", help="blocks per read, in order")
    p.add_argument("--bulk-passes", type=int, default=8, help="passes of the bulk load (0: none)")
    p.add_argument("--out", default="loadtests/results/redis_reads.json")
    args = p.parse_args(argv)
    _say(f"stored {write_report(args.out, asyncio.run(main_async(args)))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
