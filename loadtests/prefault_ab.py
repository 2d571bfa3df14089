"""What prefaulting the object store (``serve_runtime.prefault_object_store_bytes``,
app/object_store.py) saves inside a data-plane replica: a DataPlane in one process with
Ray running (L2 in the object store, as in a replica), its put of a prefix and its read
of that prefix back from Redis (L3), with and without the prefault, alternated.

    python -m loadtests.prefault_ab [--rounds 2] [--blocks 64] [--block-kib 256]
        [--calls 10] [--prefault-bytes 2147483648] [--out FILE]

A process prefaults once and cannot undo it, so every variant of every round runs in a
fresh child process (``--child BYTES``); each reports the median time of ``--calls``
puts and L3 reads (the first two of each are not counted). The children run with the
glibc settings of a replica (``serve_runtime.keep_freed_memory``). Needs redis-server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

from loadtests.benchmark import write_report


def _say(msg: str) -> None:
    print(f"[prefault-ab] {msg}", file=sys.stderr, flush=True)


async def _measure(dp, blocks: int, block_bytes: int, calls: int) -> dict:
    from deployments.dataplane.blocks import BlockHeader, block_arrays, encode_block

    await dp.start()
    while dp._prefault is not None and not dp._prefault.finished.is_set():
        await asyncio.sleep(0.05)
    puts, gets = [], []
    for call in range(calls):
        payloads = [os.urandom(block_bytes - 128) for _ in range(blocks)]
        arrays, lengths = block_arrays([encode_block(BlockHeader("uint8", (len(p),)), p) for p in payloads])
        hashes = [f"{call:04d}{i:028x}" for i in range(blocks)]
        started = time.perf_counter()
        stored = await dp.put_blocks_packed("ab", hashes, arrays, lengths, shard_key=hashes[0])
        puts.append(time.perf_counter() - started)
        assert stored == blocks, f"stored {stored} of {blocks}"
        while (await dp.status())["unsynced_blocks"]:  # written behind to Redis
            await asyncio.sleep(0.02)
        await dp.flush_l2()
        started = time.perf_counter()
        segments = await dp.get_block_refs("ab", hashes, shard_key=hashes[0])
        gets.append(time.perf_counter() - started)
        assert segments is not None, "a block went missing from L3"
    return {
        "put_ms": 1000 * statistics.median(puts[2:]),
        "get_l3_ms": 1000 * statistics.median(gets[2:]),
        "prefaulted_bytes": dp._prefault.bytes_done if dp._prefault else 0,
    }


def child(prefault_bytes: int, args) -> dict:
    import ray

    from app.config import AppConfig
    from app.local_redis import LocalRedis
    from deployments.dataplane.deployment import DataPlane

    with LocalRedis() as redis:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
        try:
            cfg = AppConfig.model_validate({
                "dataplane": {"redis": {"url": redis.url}, "sync_interval_ms": 20,
                              "l2_capacity_bytes": 4 * args.calls * args.blocks * args.block_kib * 1024},
                "serve_runtime": {"prefault_object_store_bytes": prefault_bytes},
            })
            dp = DataPlane(cfg.model_dump(mode="json"), enable_metrics=False, object_store=True)
            return asyncio.run(_measure(dp, args.blocks, args.block_kib * 1024, args.calls))
        finally:
            ray.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.prefault_ab")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--blocks", type=int, default=64, help="blocks per put and read (a prefix)")
    p.add_argument("--block-kib", type=int, default=256)
    p.add_argument("--calls", type=int, default=10, help="puts and reads per variant and round")
    p.add_argument("--prefault-bytes", type=int, default=2 << 30)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default="loadtests/results/prefault_ab.json")
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, args)))
        return 0

    from app.builder import MEMORY_ENV

    env = {**os.environ, **MEMORY_ENV}
    results: dict[str, list[dict]] = {"without": [], "with": []}
    for rnd in range(args.rounds):
        for name, nbytes in (("without", 0), ("with", args.prefault_bytes)):
            _say(f"round {rnd + 1}/{args.rounds}: {name} prefault ({nbytes >> 20} MiB)")
            out = subprocess.run(
                [sys.executable, "-m", "loadtests.prefault_ab", "--child", str(nbytes),
                 "--blocks", str(args.blocks), "--block-kib", str(args.block_kib), "--calls", str(args.calls)],
                capture_output=True, text=True, env=env, timeout=600, check=True,
            ).stdout
            results[name].append(json.loads(out.strip().splitlines()[-1]))
            _say(f"  {json.dumps(results[name][-1])}")
    summary = {
        key: {
            "without_ms": statistics.median(r[key] for r in results["without"]),
            "with_ms": statistics.median(r[key] for r in results["with"]),
        }
        for key in ("put_ms", "get_l3_ms")
    }
    for row in summary.values():
        row["without_over_with"] = row["without_ms"] / row["with_ms"]
    print(json.dumps(summary, indent=2))
    _say(f"stored {write_report(args.out, {'args': vars(args), 'runs': results, 'summary': summary})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
