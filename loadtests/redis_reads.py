"""What Redis's allocator settings do to the data plane's L3 reads (no Ray, no app).

    python -m loadtests.redis_reads [--rounds 2] [--gap-s 4] [--block-kib 256]
        [--blocks 17,34,51,68,86,103,120] [--out FILE]

A redis-server as the project starts it (``app.local_redis.LocalRedis``, a cache with
``maxmemory``) holds 120 blocks; the data plane's raw client (``RawBlockClient.mget_packed``,
the L3 read) then reads the first N of them for each N in ``--blocks``, ``--gap-s`` apart,
as a session's turns read a growing prefix. Per read: the time and the page faults the
server took. Two settings alternate in each round, each on a fresh server: ``keep`` (the
project's ``REDIS_MALLOC_CONF``: jemalloc keeps the pages it frees) and ``default``
(jemalloc's defaults: freed pages go back to the kernel after seconds). This process
runs with a data-plane replica's glibc settings (``app.builder.MEMORY_ENV``; it re-executes
itself with them), so that its read buffers are reused as the replica's are. Loopback only.
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

from app.local_redis import REDIS_MALLOC_CONF, LocalRedis
from deployments.dataplane.resp import RawBlockClient
from loadtests.benchmark import write_report

SETTINGS = {"keep": REDIS_MALLOC_CONF, "default": ""}


def _say(msg: str) -> None:
    print(f"[redis-reads] {msg}", file=sys.stderr, flush=True)


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


async def one_server(setting: str, sizes: list[int], block_bytes: int, gap_s: float) -> list[dict]:
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

        payload = np.random.default_rng(0).integers(0, 256, block_bytes * max(sizes), dtype=np.uint8)
        with redis.Redis(port=server.port) as r:
            for i in range(max(sizes)):
                r.set(f"blk{i}", payload[i * block_bytes : (i + 1) * block_bytes].tobytes())
        pid = server._proc.pid
        reads = []
        for n in sizes:
            await asyncio.sleep(gap_s)
            faults = _minor_faults(pid)
            started = time.perf_counter()
            data, lengths = await client.mget_packed([f"blk{i}" for i in range(n)])
            ms = 1000 * (time.perf_counter() - started)
            if len(data) != n * block_bytes or None in lengths:
                raise RuntimeError(f"read {len(data)} bytes for {n} blocks")
            reads.append({"blocks": n, "ms": round(ms, 1), "server_faults": _minor_faults(pid) - faults})
        return reads
    finally:
        client.close()
        server.cleanup()


async def main_async(args) -> dict:
    sizes = [int(x) for x in args.blocks.split(",")]
    runs = []
    for rnd in range(1, args.rounds + 1):
        for setting in ("default", "keep") if rnd % 2 else ("keep", "default"):
            _say(f"round {rnd}/{args.rounds}: {setting} ({len(sizes)} reads, {args.gap_s:g} s apart)")
            reads = await one_server(setting, sizes, args.block_kib << 10, args.gap_s)
            runs.append({"round": rnd, "setting": setting, "reads": reads})
            print(f"r{rnd} {setting:8s} " + " ".join(f"{r['blocks']}:{r['ms']:.0f}ms/{r['server_faults']}f" for r in reads), flush=True)
    summary = {}
    for setting in SETTINGS:
        ms = [r["ms"] for run in runs if run["setting"] == setting for r in run["reads"]]
        faults = [r["server_faults"] for run in runs if run["setting"] == setting for r in run["reads"]]
        summary[setting] = {"median_ms": statistics.median(ms), "max_ms": max(ms), "median_server_faults": statistics.median(faults)}
    summary["median_ms_default_over_keep"] = round(summary["default"]["median_ms"] / summary["keep"]["median_ms"], 2)
    print(json.dumps(summary, indent=1))
    return {"args": vars(args), "runs": runs, "summary": summary}


def main(argv=None) -> int:
    from app.builder import MEMORY_ENV

    if any(os.environ.get(k) != v for k, v in MEMORY_ENV.items()):
        # glibc reads these at start: run again with them, as a replica runs.
        argv = sys.argv[1:] if argv is None else list(argv)
        os.execve(sys.executable, [sys.executable, "-m", "loadtests.redis_reads", *argv], {**os.environ, **MEMORY_ENV})
    p = argparse.ArgumentParser(prog="python -m loadtests.redis_reads")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--gap-s", type=float, default=4.0, help="pause before each read (a turn's think time)")
    p.add_argument("--block-kib", type=int, default=256, help="value size (the small model's block)")
    p.add_argument("--blocks", default="17,34,51,68,86,103,120", help="blocks per read, in order")
    p.add_argument("--out", default="loadtests/results/redis_reads.json")
    args = p.parse_args(argv)
    _say(f"stored {write_report(args.out, asyncio.run(main_async(args)))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
