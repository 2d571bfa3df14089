"""Block put/get throughput of the data plane against redis-benchmark, same value size,
same machine; the bounds that limit it; and how long a worker waits for a prefix.

    python -m loadtests.dataplane_throughput [--block-kib 256] [--num-blocks 2048]
        [--batch 64] [--concurrency 4] [--rounds 3] [--warmup 1] [--no-bounds]
        [--worker-blocks 8,32,128] [--kv-redis cache|shared]
        [--prefault-object-store-bytes N] [--write-behind-yield-ms MS] [--out FILE]

Ours: a DataPlane deployment (2 replicas, with the app's Serve runtime settings) driven
through its Serve handle, as a compute worker drives it (blocks travel through Ray's
object store): ``DataPlaneKVConnector.put`` (the blocks put into the object store here,
then kept by reference in the data plane's host memory, written behind to Redis),
``get_block_refs`` plus mapping the referenced objects here, the worker's read, from
host memory (L2: once right after the puts, while the replicas write them behind to
Redis, and again once that finished); after ``flush_l2``, from Redis (L3) as a worker
reads it (``DataPlaneKVConnector.load`` with a ``BlockReader``: the blocks straight from
Redis and checked; the data plane promotes them into L2 a second later, which is not
timed; the median round trip of the data-plane call each load makes first is
reported as ``get_l3_call_ms_median``, and the same reads by the worker's reader alone,
without those calls, as ``get_l3_reader_alone``) and as the data plane reads it (its
MGET and copy into the object store, ``direct_l3_reads`` off); and ``get_blocks_packed`` from L2 (the bytes copied into the
reply) for comparison. The connector sends its calls straight to the owner replica's
actor (``dataplane.direct_calls``); the put and the L3 read are also measured with every
call through the Serve handle (``put_through_serve``, ``get_l3_through_serve``: the form
before 2026-12-06's sixteenth session), before ours in odd rounds and after them in even
ones; and the calls alone, both ways (``calls_per_s_*``: ``get_block_refs`` answered
without a Redis read, 4 and 16 in flight). The promotion a worker asks for after an L3
read of its own, of the same blocks, both ways (``measure_promotions``): with the
worker's bytes through the object store (``promote_from_worker``, the default since
2026-12-07) and read from Redis again by the data plane (``promote_reread``), with the
bytes Redis sent for each. On one
node the worker's read maps the data plane's copy without moving the bytes; across
nodes Ray would move them, which this single-machine figure does not include.
Peer: ``redis-benchmark -t set,get -d SIZE -c CONCURRENCY`` against the redis-server
holding the blocks, twice: on one key, its default (every SET replaces the one value,
every GET reads the same bytes, hot in the CPU's caches), and with ``-r NUM_BLOCKS``
(random keys among as many as ours; ratios ``*_keyspace``), which is the same work as
ours: many distinct values, each written once a round and read from memory. Our keys are
the same every round (new bytes), so from the second round on both sides replace values
they wrote before (``--kv-redis cache``, the default: their own cache server, no
persistence, as ``serve_config.yaml`` deploys them; ``shared``: the sessions' AOF server),
run right after ours in each round; the ratio is taken per round (the machine's speed
drifts by tens of percent between minutes), and the median over rounds is reported.

The put is timed until the data plane acknowledged every block (in L2; the replicas
write them behind to Redis after the burst, ``dataplane.write_behind_yield_ms``), and
again, under a tenant of its own at the end of each round, until every block is in Redis
(``put_until_written``: Redis counted the SETs of every payload and index entry, INFO
commandstats polled every 5 ms), which for one burst includes the write-behind's wait:
the put with the Redis writes of the same bytes, to set beside redis-benchmark's SET
too. ``--write-behind-yield-ms 0`` measures the write-behind running every
``sync_interval_ms`` during the burst, as before 2026-12-06's seventeenth session.

Where the CPU goes: on 2 cores shared by this process, Redis, the data plane and Ray,
each rate is bounded by the CPU a byte costs all of them together. Each of ours' phases
and each redis-benchmark test (then run one test at a time) reports the CPU seconds
per GB moved of every process on the machine, by part (``this process``, ``redis``,
``data plane``, ``ray``, ``other``; redis-benchmark itself is ``child``;
``loadtests.benchmark.CpuMeter``): ``cpu_s_per_gb`` per round and their medians.

A warm-up round (not counted) runs first: on this VM the first touch of fresh memory costs
~3 µs per 4 KiB page, so a cold first round measures page faults (redis-benchmark on one
key never pays them; with ``-r`` its first round does, as ours did in every round while
each round wrote new keys, until 2026-12-03).

Bounds (``--no-bounds`` skips them), same payload per call and concurrency: Ray's object
store alone (``ray.put`` + ``ray.get`` in one process; an actor returning an array; an
array passed to an actor), a Serve handle moving one array to and from a do-nothing
deployment, Redis alone through the data plane's raw client and through redis-py, and
the data plane's put into L2 with write-behind off (what the put costs without the
Redis writes that, on 2 cores, compete with it).

The data plane's replicas and this process (which does a worker's part) map the object
store's pages first, as the app's replicas do (``serve_runtime.prefault_object_store_bytes``;
``--prefault-object-store-bytes 0`` measures without it).

Worker wait: a ``DataPlaneKVConnector`` (the worker's client) saves prefixes of N blocks
of the ``small`` model's KV shape and loads them back, from L2 and from L3; the time of
``load()`` is what a worker's request waits before its suffix prefill starts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Optional

from loadtests.benchmark import (
    CpuMeter,
    add_kv_redis_option,
    add_write_behind_yield_option,
    restart_with_memory_env,
    start_kv_redis,
    write_report,
)

# The small model's KV block (app/model_builder.py "small", block_size 16, fp32):
# layers, kv, kv heads, tokens, head dim.
SMALL_BLOCK_SHAPE = (4, 2, 8, 16, 64)


def _say(msg: str) -> None:
    print(f"[dp-throughput] {msg}", file=sys.stderr, flush=True)


def redis_benchmark(port: int, size: int, n: int, clients: int, keyspace: int = 0, tests: str = "set,get",
                    *, cpu: Optional[dict] = None) -> dict:
    """GB/s of ``redis-benchmark -t set,get`` (or ``tests``): on one key (its default),
    or with ``keyspace`` on random keys among that many (``-r``). With ``cpu``, each test
    runs on its own and ``cpu[test]`` gets the CPU seconds per GB of the Redis servers
    (``redis``), of redis-benchmark (``child``) and of the rest of the machine
    (``CpuMeter``)."""
    rates = {}
    for run in (tests.split(",") if cpu is not None else [tests]):
        meter = CpuMeter().start() if cpu is not None else None
        out = subprocess.run(
            ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-t", run,
             "-d", str(size), "-n", str(n), "-c", str(clients), "-q"]
            + (["-r", str(keyspace)] if keyspace else []),
            capture_output=True, text=True, timeout=600, check=True,
        ).stdout
        if meter is not None:
            meter.stop()
            cpu[run] = meter.per_gb(n * size)
        for name, rps in re.findall(r"(SET|GET): ([\d.]+) requests per second", out.replace("\r", "\n")):
            rates[name.lower()] = float(rps) * size / 1e9
    return rates


async def _timed(calls, concurrency: int, total_bytes: int, *, cpu: Optional[dict] = None, name: str = ""):
    """Run the ``calls`` (coroutine factories) with ``concurrency`` in flight: GB/s and
    results. With ``cpu``, ``cpu[name]`` gets the CPU seconds per GB that each part of
    the machine spent meanwhile (``loadtests.benchmark.CpuMeter``)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(call):
        async with sem:
            return await call()

    meter = CpuMeter().start() if cpu is not None else None
    start = time.perf_counter()
    results = await asyncio.gather(*(one(c) for c in calls))
    seconds = time.perf_counter() - start
    if meter is not None:
        meter.stop()
        cpu[name] = meter.per_gb(total_bytes)
    return total_bytes / seconds / 1e9, results


async def run_ours(handle, blocks, hashes, batch: int, concurrency: int, tenant: str, *, reader, kv_url: str,
                   strict_first: bool = False) -> dict:
    import redis.asyncio as aioredis

    from deployments.dataplane.blocks import BlockChecks, block_arrays
    from deployments.dataplane.connector import DataPlaneKVConnector, resolve_block_refs

    groups = [
        (hashes[i : i + batch], blocks[i : i + batch]) for i in range(0, len(blocks), batch)
    ]
    total = sum(len(b) for b in blocks)
    # CPU seconds per GB of each phase, by part of the machine (returned as "cpu").
    cpu: dict = {}
    # The worker's connector: its calls go straight to the owner replica's actor
    # (dataplane.direct_calls). ``strict``: the same with every call through the Serve
    # handle (the form before 2026-12-06, sixteenth session), for the put and the L3 read
    # in the same round.
    connector = DataPlaneKVConnector(handle, 16, timeout_s=120, l3_reader=reader)
    strict = DataPlaneKVConnector(handle, 16, timeout_s=120, l3_reader=reader, direct_calls=False)

    # As the worker's connector sends them (``DataPlaneKVConnector.put``): one copy
    # into the object store here, then the data plane keeps that object by reference.
    def put(g, via=connector, tenant=tenant):
        return lambda: via.put(tenant, g[0], g[1], chain_root=g[0][0])

    # The form before 2026-12-06, for comparison in the same round: one uint8 view per
    # block in the call (Ray copies them into its store), which the data plane then copied
    # into an object of its own. Its own tenant, written behind and flushed before ours.
    def put_in_call(g):
        return lambda: handle.put_blocks_packed.remote(
            f"{tenant}-call", g[0], *block_arrays(g[1]), shard_key=g[0][0]
        )

    put_in_call_gbps, stored = await _timed([put_in_call(g) for g in groups], concurrency, total, cpu=cpu, name="put_in_call")
    assert sum(stored) == len(blocks), f"stored {sum(stored)} of {len(blocks)} blocks"
    await write_behind_done(handle)
    await flush_all(handle)

    # As the worker's connector reads them: references into the data plane's object-store
    # copy, then mapped here (on this node, without a copy; across nodes Ray moves them).
    async def get_refs(g):
        # As the worker's connector calls (straight to the replica).
        segments = await connector._call("get_block_refs", tenant, g[0], shard_key=g[0][0])
        return None if segments is None else await resolve_block_refs(segments)

    def get(g):
        return lambda: get_refs(g)

    # The bytes in the reply: packed into one array and copied into the object store.
    def get_packed(g):
        return lambda: handle.get_blocks_packed.remote(tenant, g[0], shard_key=g[0][0])

    # A worker's read of blocks only in L3 (dataplane.direct_l3_reads, the default): its
    # connector asks the data plane, reads the blocks from Redis itself and checks them,
    # then has the data plane promote them into L2 a second later (PROMOTE_DELAY_S; not
    # waited for by the worker, and mostly after the timed reads).

    def get_direct(g, via=connector):
        return lambda: via.load(tenant, g[0])

    async def put_strict():
        # Its own tenant, written behind and flushed before the next phase.
        gbps, stored = await _timed(
            [put(g, strict, f"{tenant}-strict") for g in groups], concurrency, total, cpu=cpu, name="put_through_serve"
        )
        assert sum(stored) == len(blocks), f"stored {sum(stored)} of {len(blocks)} blocks"
        await write_behind_done(handle)
        await flush_all(handle)
        return gbps

    put_strict_gbps = await put_strict() if strict_first else None
    put_gbps, stored = await _timed([put(g) for g in groups], concurrency, total, cpu=cpu, name="put")
    assert sum(stored) == len(blocks), f"stored {sum(stored)} of {len(blocks)} blocks"
    # Right after the puts the replicas are still writing them behind to Redis, which
    # takes CPU from the reads (2 cores); redis-benchmark's GET phase runs with no writes
    # going on, so the compared figure is the second read, after write-behind finished.
    get_busy_gbps, got = await _timed([get(g) for g in groups], concurrency, total)
    assert all(r is not None for r in got), "a block went missing from L2"
    await write_behind_done(handle)
    get_l2_gbps, got = await _timed([get(g) for g in groups], concurrency, total, cpu=cpu, name="get_l2")
    assert all(r is not None for r in got), "a block went missing from L2"
    get_l2_packed_gbps, got = await _timed([get_packed(g) for g in groups], concurrency, total)
    assert all(r is not None for r in got), "a block went missing from L2"
    await flush_all(handle)
    # Each load asks the data plane first (get_block_refs: the blocks are only in Redis),
    # then reads them itself: the calls' round trips are timed, and the same reads
    # without those calls (the worker's reader alone, each block checked as it arrives)
    # follow, to tell the two apart.
    call_seconds: list[float] = []
    timed_call = connector._call

    async def call(*args, **kwargs):
        started = time.perf_counter()
        try:
            return await timed_call(*args, **kwargs)
        finally:
            call_seconds.append(time.perf_counter() - started)

    connector._call = call

    async def get_l3_strict():
        gbps, got = await _timed([get_direct(g, strict) for g in groups], concurrency, total, cpu=cpu, name="get_l3_through_serve")
        assert all(r is not None for r in got), "a block went missing from L3"
        assert strict.direct_l3["fallbacks"] == 0, strict.direct_l3
        await strict.drain()
        await flush_all(handle)
        return gbps

    get_l3_strict_gbps = await get_l3_strict() if strict_first else None
    get_l3_gbps, got = await _timed([get_direct(g) for g in groups], concurrency, total, cpu=cpu, name="get_l3")
    connector._call = timed_call
    assert all(r is not None for r in got), "a block went missing from L3"
    assert connector.direct_l3["fallbacks"] == 0, connector.direct_l3
    assert connector.direct_calls["calls"] and not connector.direct_calls["fallbacks"], connector.direct_calls
    await connector.drain()  # the promotions they started (a second later), then none left
    await flush_all(handle)
    if not strict_first:
        get_l3_strict_gbps = await get_l3_strict()

    def read_alone(g):
        async def read():
            _, views = await reader.get_blocks_packed(tenant, g[0], on_value=BlockChecks())
            return views

        return read

    get_l3_reader_gbps, got = await _timed(
        [read_alone(g) for g in groups], concurrency, total, cpu=cpu, name="get_l3_reader_alone"
    )
    assert all(v is not None for r in got for v in r), "a block went missing from L3"
    await flush_all(handle)
    promotions = await measure_promotions(handle, groups, concurrency, total, tenant, kv_url, cpu, strict_first)
    # The data plane's own read from Redis: an MGET, its copy into the object store,
    # mapped here (as with direct_l3_reads off, and as a fallback).
    get_l3_dataplane_gbps, got = await _timed(
        [get(g) for g in groups], concurrency, total, cpu=cpu, name="get_l3_through_dataplane"
    )
    assert all(r is not None for r in got), "a block went missing from L3"
    del got
    await flush_all(handle)  # the next round starts from an empty L2
    # The calls alone: get_block_refs of a prefix nothing holds (direct_l3: the answer
    # is "in Redis", no Redis read), 4 and 16 in flight, straight and through Serve.
    calls = {}
    for in_flight in (concurrency, 4 * concurrency):
        for name, via in ((("direct", connector), ("through_serve", strict))[::-1] if strict_first
                          else (("direct", connector), ("through_serve", strict))):
            calls[f"calls_per_s_{name}_{in_flight}"] = await calls_per_s(via, tenant, in_flight)
    # The sustained rate: the same puts, timed until every block is in Redis (the
    # replicas' write-behind done), which is what redis-benchmark's SET does. For one
    # burst this includes the write-behind's wait (write_behind_yield_ms after the last
    # put, then the next sync_interval_ms tick) as well as its writes. Done when Redis
    # counted the SETs of every block (payload, then index entry; INFO commandstats,
    # polled every 5 ms): the keys are last round's, so their values are replaced as in
    # steady state (deleting them first made Redis fault fresh pages in for every write).
    durable = f"{tenant}-durable"

    async def sets_done(kv) -> int:
        return int((await kv.info("commandstats")).get("cmdstat_set", {}).get("calls", 0))

    kv = aioredis.Redis.from_url(kv_url)
    try:
        sets_before = await sets_done(kv)
        meter = CpuMeter().start()
        started = time.perf_counter()
        _, stored = await _timed([put(g, connector, durable) for g in groups], concurrency, total)
        assert sum(stored) == len(blocks), f"stored {sum(stored)} of {len(blocks)} blocks"
        while await sets_done(kv) - sets_before < 2 * len(blocks):
            await asyncio.sleep(0.005)
        put_until_written_gbps = total / (time.perf_counter() - started) / 1e9
        meter.stop()
        cpu["put_until_written"] = meter.per_gb(total)
    finally:
        await kv.aclose()
    await write_behind_done(handle)  # the replicas marked them written, before L2 is emptied
    await flush_all(handle)
    if not strict_first:  # the puts through Serve last in this round, first in the next
        put_strict_gbps = await put_strict()
    return {
        "cpu": cpu,
        **calls,
        "put": put_gbps,
        "put_in_call": put_in_call_gbps,
        "put_through_serve": put_strict_gbps,
        "put_until_written": put_until_written_gbps,
        "get_l2": get_l2_gbps,
        "get_l3": get_l3_gbps,
        "get_l3_through_serve": get_l3_strict_gbps,
        "get_l3_reader_alone": get_l3_reader_gbps,
        "get_l3_call_ms_median": 1000 * statistics.median(call_seconds),
        "get_l3_through_dataplane": get_l3_dataplane_gbps,
        "get_l2_during_write_behind": get_busy_gbps,
        "get_l2_packed": get_l2_packed_gbps,
        **promotions,
    }


async def measure_promotions(handle, groups, concurrency: int, total: int, tenant: str, kv_url: str, cpu: dict,
                             reread_first: bool) -> dict:
    """The promotion a worker asks for after reading blocks from L3 itself
    (``DataPlaneKVConnector.promote``), both ways, of blocks only in Redis: with the
    worker's bytes (``promote_from_worker``: one copy into the object store here, the
    data plane checks them and Redis only their index entries) and read from Redis again
    by the data plane (``promote_reread``: the form before 2026-12-07). GB/s, the CPU
    seconds per GB of each part of the machine (``cpu``), and the bytes Redis sent per
    byte promoted (``*_redis_bytes_per_byte``); in the order given, L2 emptied after each."""
    import redis.asyncio as aioredis

    from deployments.dataplane.connector import DataPlaneKVConnector

    promoter = DataPlaneKVConnector(handle, 16, timeout_s=120, promote_by_ref=True)
    kv = aioredis.Redis.from_url(kv_url)
    out = {}
    try:
        for name in ("promote_reread", "promote_from_worker")[:: 1 if reread_first else -1]:
            def promote(g, with_blocks=name == "promote_from_worker"):
                return lambda: promoter.promote(tenant, g[0], g[1] if with_blocks else None, chain_root=g[0][0])

            sent = int((await kv.info("stats"))["total_net_output_bytes"])
            out[name], in_l2 = await _timed([promote(g) for g in groups], concurrency, total, cpu=cpu, name=name)
            sent = int((await kv.info("stats"))["total_net_output_bytes"]) - sent
            assert in_l2 == [len(g[0]) for g in groups], f"{name}: {sum(in_l2)} of {sum(len(g[0]) for g in groups)} blocks in L2"
            out[f"{name}_redis_bytes_per_byte"] = sent / total
            await flush_all(handle)
    finally:
        await kv.aclose()
    assert promoter.promotions == {"by_ref": len(groups), "reread": len(groups)}, promoter.promotions
    return out


async def calls_per_s(connector, tenant: str, in_flight: int, n: int = 400) -> float:
    """Data-plane calls per second through ``connector`` (``get_block_refs`` of 64
    hashes nothing holds, answered "in Redis" without reading it), ``in_flight`` at once
    (``loadtests.dataplane_calls.measure``)."""
    from loadtests.dataplane_calls import measure

    hashes = [f"calls-{i:026x}" for i in range(64)]

    def call(i):
        return connector._call("get_block_refs", tenant, hashes, shard_key=f"calls-{i}", direct_l3=True)

    return (await measure(call, n, in_flight))["calls_per_s"]


async def flush_all(handle) -> None:
    for i in range(64):  # reach every replica of the ring
        await handle.flush_l2.remote(shard_key=f"flush-{i}")


async def write_behind_done(handle, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = [await handle.status.remote(shard_key=f"flush-{i}") for i in range(64)]
        if all(s["unsynced_blocks"] == 0 for s in states):
            return
        await asyncio.sleep(0.05)
    raise TimeoutError("write-behind did not finish")


async def measure_bounds(payload_bytes: int, calls: int, concurrency: int, rounds: int, redis_url: str, runtime_env: dict, quiet_dataplane=None) -> dict:
    """The transfer stages alone, same payload per call and concurrency (GB/s, median
    of ``rounds``). ``quiet_dataplane``: a DataPlane handle whose write-behind is off,
    for the put into L2 alone."""
    import numpy as np
    import ray
    import redis.asyncio as aioredis
    from ray import serve

    from deployments.dataplane.resp import RawBlockClient

    arr = np.frombuffer(os.urandom(payload_bytes), dtype=np.uint8)
    total = payload_bytes * calls
    out: dict[str, list[float]] = {}

    def record(name, gbps):
        out.setdefault(name, []).append(gbps)

    @ray.remote(num_cpus=0)
    class Holder:
        def __init__(self, n):
            self.a = np.frombuffer(os.urandom(n), dtype=np.uint8)

        def get(self):
            return self.a

        def put(self, a):
            return len(a)

    @serve.deployment(max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0, "runtime_env": runtime_env})
    class Echo:
        def __init__(self, n):
            self.a = np.frombuffer(os.urandom(n), dtype=np.uint8)

        async def get(self):
            return self.a

        async def put(self, a):
            return len(a)

    holder = Holder.remote(payload_bytes)
    await holder.get.remote()
    echo = serve.run(Echo.bind(payload_bytes), name="dpbench-bounds", route_prefix=None)
    await echo.get.remote()
    client = aioredis.Redis.from_url(redis_url)
    raw = RawBlockClient.from_redis(client)
    block = 256 * 1024
    nblocks = payload_bytes // block
    names = [f"bounds:{i}" for i in range(nblocks * calls)]
    value = memoryview(os.urandom(block))
    groups = [names[i : i + nblocks] for i in range(0, len(names), nblocks)]
    for _ in range(rounds + 1):  # the first pass warms up, not counted
        s = time.perf_counter()
        for _ in range(calls):
            ray.get(ray.put(arr))
        record("ray_put_get_one_process", total / (time.perf_counter() - s) / 1e9)
        record("actor_to_driver", (await _timed([holder.get.remote] * calls, concurrency, total))[0])
        record("driver_to_actor", (await _timed([lambda: holder.put.remote(arr)] * calls, concurrency, total))[0])
        record("serve_handle_get", (await _timed([echo.get.remote] * calls, concurrency, total))[0])
        record("serve_handle_put", (await _timed([lambda: echo.put.remote(arr)] * calls, concurrency, total))[0])
        if quiet_dataplane is not None:
            from deployments.dataplane.blocks import BlockHeader, encode_block
            from deployments.dataplane.connector import DataPlaneKVConnector

            qblocks = [encode_block(BlockHeader("uint8", (block - 128,)), os.urandom(block - 128)) for _ in range(nblocks)]
            quiet = DataPlaneKVConnector(quiet_dataplane, 16, timeout_s=120)

            def quiet_put(i, blocks=qblocks):
                hashes = [f"q{len(out.get('dataplane_put_no_write_behind', []))}-{i}-{j}" for j in range(nblocks)]
                return lambda: quiet.put("quiet", hashes, blocks)

            record("dataplane_put_no_write_behind", (await _timed([quiet_put(i) for i in range(calls)], concurrency, total))[0])

        def setter(g):
            return lambda: raw.pipeline([("SET", k, value) for k in g])

        record("redis_raw_pipeline_set", (await _timed([setter(g) for g in groups], concurrency, nblocks * calls * block))[0])

        def getter(g):
            return lambda: raw.mget_packed(g)

        record("redis_raw_mget", (await _timed([getter(g) for g in groups], concurrency, nblocks * calls * block))[0])

        def pyget(g):
            return lambda: client.mget(g)

        record("redis_py_mget", (await _timed([pyget(g) for g in groups], concurrency, nblocks * calls * block))[0])
    await client.delete(*names)
    raw.close()
    await client.aclose()
    serve.delete("dpbench-bounds")
    ray.kill(holder)
    return {k: statistics.median(v[1:]) for k, v in out.items()}


async def measure_worker_wait(handle, sizes: list[int], *, reader, repeats: int = 5) -> dict:
    """``DataPlaneKVConnector.load`` of a prefix of N small-model blocks, from L2, from L3
    (read by the worker itself, the default) and from L3 through the data plane (without
    a reader): median milliseconds and GB/s."""
    from deployments.dataplane.blocks import BlockHeader, encode_block
    from deployments.dataplane.connector import DataPlaneKVConnector

    nbytes = 4
    for d in SMALL_BLOCK_SHAPE:
        nbytes *= d
    connector = DataPlaneKVConnector(handle, SMALL_BLOCK_SHAPE[3], timeout_s=60, l3_reader=reader)
    through_dataplane = DataPlaneKVConnector(handle, SMALL_BLOCK_SHAPE[3], timeout_s=60)
    results = {}
    for n in sizes:
        hashes = [f"w{n:04d}{i:026x}" for i in range(n)]
        blocks = [encode_block(BlockHeader("float32", SMALL_BLOCK_SHAPE), os.urandom(nbytes)) for _ in range(n)]
        connector.save("bench-worker", hashes, blocks)
        await connector.drain()
        size = sum(len(b) for b in blocks)
        times = {"L2": [], "L3": [], "L3_through_dataplane": []}
        for _ in range(repeats):
            s = time.perf_counter()
            got = await connector.load("bench-worker", hashes)
            times["L2"].append(time.perf_counter() - s)
            assert got is not None and len(got) == n, "worker load from L2 missed"
        for tier, reading in (("L3", connector), ("L3_through_dataplane", through_dataplane)):
            for _ in range(repeats):
                await connector.drain()  # the last read's promotion, before L2 is emptied
                await flush_all(handle)
                s = time.perf_counter()
                got = await reading.load("bench-worker", hashes)
                times[tier].append(time.perf_counter() - s)
                assert got is not None and len(got) == n, f"worker load from {tier} missed"
        await connector.drain()
        assert connector.direct_l3["fallbacks"] == 0, connector.direct_l3
        del got
        results[str(n)] = {
            "bytes": size,
            **{
                f"{tier}_ms": statistics.median(t) * 1000 for tier, t in times.items()
            },
            **{
                f"{tier}_gbps": size / statistics.median(t) / 1e9 for tier, t in times.items()
            },
        }
        _say(f"worker wait, {n} blocks ({size / 2**20:.0f} MiB): " + ", ".join(
            f"{tier} {statistics.median(t) * 1000:.1f} ms" for tier, t in times.items()))
        await flush_all(handle)
    return results


async def with_reader(cfg, fn, *args, **kwargs):
    """``fn(*args, **kwargs, reader=...)`` with a worker's reader of the blocks' Redis."""
    from deployments.dataplane.redis_store import BlockReader

    dc = cfg.dataplane
    reader = BlockReader.from_config(dc.kv_redis or dc.redis)
    try:
        return await fn(*args, **kwargs, reader=reader)
    finally:
        await reader.close()


def _cpu_medians(rounds: list[dict]) -> dict:
    """The median over rounds of each phase's CPU seconds per GB, by part of the machine
    (a part absent from a round counts as 0 there)."""
    out: dict = {}
    for side in rounds[0]:
        out[side] = {}
        for phase in rounds[0][side]:
            roles = sorted({role for r in rounds for role in r[side].get(phase, {})})
            out[side][phase] = {role: statistics.median(r[side].get(phase, {}).get(role, 0.0) for r in rounds) for role in roles}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.dataplane_throughput")
    p.add_argument("--block-kib", type=int, default=256)
    # 2048 blocks of 256 KiB: each of ours' phases moves 512 MiB and redis-benchmark's
    # 1 GiB, ~0.2-1 s each. With 512 blocks (the default until 2026-12-03) a phase took
    # ~0.1 s, and one slow tenth of a second on either side moved the ratio threefold:
    # put / SET 0.84 in one such run, 0.27 with 2048 blocks minutes later.
    p.add_argument("--num-blocks", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64, help="blocks per call (a prefix)")
    p.add_argument("--concurrency", type=int, default=4, help="calls in flight")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted")
    p.add_argument("--no-bounds", action="store_true", help="skip the stage bounds")
    p.add_argument("--worker-blocks", default="8,32,128", help="prefix sizes for the worker-wait measure ('' skips it)")
    p.add_argument(
        "--prefault-object-store-bytes", type=int, default=None,
        help="serve_runtime.prefault_object_store_bytes of the data plane and this process, "
        "which stands in for a worker (default: the config's; 0 measures without it)",
    )
    add_write_behind_yield_option(p)
    add_kv_redis_option(p)
    p.add_argument("--out", default="loadtests/results/dataplane_throughput.json")
    args = p.parse_args(argv)

    import ray
    from ray import serve

    from app.builder import THROUGHPUT_ENV, with_serve_runtime
    from app.config import AppConfig
    from app.local_redis import LocalRedis
    from app.object_store import prefault_object_store
    from deployments.dataplane.blocks import BlockHeader, encode_block
    from deployments.dataplane.deployment import dataplane_deployment

    # This process does a worker's part, so it runs with a worker's malloc settings
    # (serve_runtime.keep_freed_memory, on by default). Without them every 16-32 MiB read
    # buffer here faulted in fresh pages; a worker's reuses what malloc kept.
    restart_with_memory_env("loadtests.dataplane_throughput", argv, say=_say)
    size = args.block_kib * 1024
    results = []
    bounds = worker = None
    with LocalRedis() as sessions_redis, contextlib.ExitStack() as stack:
        # ``redis``: where the blocks go, which redis-benchmark measures too.
        redis = start_kv_redis(args.kv_redis, stack) or sessions_redis
        dataplane = {"num_replicas": 2, "redis": {"url": sessions_redis.url},
                     "l2_capacity_bytes": 4 * size * args.num_blocks}
        if redis is not sessions_redis:
            dataplane["kv_redis"] = {"url": redis.url}
        if args.write_behind_yield_ms is not None:
            dataplane["write_behind_yield_ms"] = args.write_behind_yield_ms
        _say(f"KV blocks on {'a cache' if args.kv_redis == 'cache' else 'the sessions AOF'} "
             f"redis-server ({redis.url})")
        runtime = {}
        if args.prefault_object_store_bytes is not None:
            runtime["prefault_object_store_bytes"] = args.prefault_object_store_bytes
        cfg = AppConfig.model_validate({"dataplane": dataplane, "serve_runtime": runtime})
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
        # This process does a worker's part (its blocks go in and come out here), so it
        # maps the object store's pages as a worker does.
        prefault_object_store(cfg.serve_runtime.prefault_object_store_bytes, who="the benchmark (a worker's part)")
        serve.start(http_options={"host": "127.0.0.1", "port": 0})
        # As the app deploys it (build_app): Serve's throughput settings in the replicas.
        app = with_serve_runtime(dataplane_deployment(cfg), cfg).bind(cfg.model_dump(mode="json"))
        handle = serve.run(app, name="dpbench", route_prefix=None)
        for rnd in range(args.warmup + args.rounds):
            payloads = [os.urandom(size - 128) for _ in range(args.num_blocks)]
            blocks = [encode_block(BlockHeader("uint8", (len(b),)), b) for b in payloads]
            # The same keys every round (new bytes): from the second round on, the puts'
            # writes replace the last round's values in Redis, as a cache's writes do in
            # steady state and as redis-benchmark's do on its own keys.
            hashes = [f"{i:032x}" for i in range(args.num_blocks)]
            value_size = len(blocks[0])
            warm = rnd < args.warmup
            label = "warm-up" if warm else f"round {rnd - args.warmup + 1}"
            _say(f"{label}: data plane, {args.num_blocks} blocks of {value_size} bytes")
            ours = asyncio.run(with_reader(
                cfg, run_ours, handle, blocks, hashes, args.batch, args.concurrency, "bench", kv_url=redis.url,
                strict_first=rnd % 2 == 1,
            ))
            cpu = {"ours": ours.pop("cpu"), "redis_benchmark": {}, "redis_benchmark_keyspace": {}}
            _say(f"{label}: redis-benchmark, same value size, one key and {args.num_blocks} keys")
            peer = redis_benchmark(redis.port, value_size, args.num_blocks * 2, args.concurrency,
                                   cpu=cpu["redis_benchmark"])
            peer_keys = redis_benchmark(redis.port, value_size, args.num_blocks * 2, args.concurrency, args.num_blocks,
                                        cpu=cpu["redis_benchmark_keyspace"])
            _say(f"{label}: CPU seconds per GB, " + "; ".join(
                f"{phase} " + " ".join(f"{role} {v:.2f}" for role, v in roles.items())
                for phase, roles in [*cpu["ours"].items(), *(("redis-benchmark " + t, r) for t, r in cpu["redis_benchmark_keyspace"].items())]
            ))
            _say(f"{label}: ours {json.dumps({k: round(v, 3) for k, v in ours.items()})} "
                 f"redis-benchmark {json.dumps({k: round(v, 3) for k, v in peer.items()})}, "
                 f"-r {args.num_blocks} {json.dumps({k: round(v, 3) for k, v in peer_keys.items()})}")
            if not warm:
                ratios = {}
                for suffix, ref in (("", peer), ("_keyspace", peer_keys)):
                    ratios.update({
                        f"put_over_redis_set{suffix}": ours["put"] / ref["set"],
                        f"put_until_written_over_redis_set{suffix}": ours["put_until_written"] / ref["set"],
                        f"put_in_call_over_redis_set{suffix}": ours["put_in_call"] / ref["set"],
                        f"put_through_serve_over_redis_set{suffix}": ours["put_through_serve"] / ref["set"],
                        f"get_l3_through_serve_over_redis_get{suffix}": ours["get_l3_through_serve"] / ref["get"],
                        f"get_l3_over_redis_get{suffix}": ours["get_l3"] / ref["get"],
                        f"get_l3_reader_alone_over_redis_get{suffix}": ours["get_l3_reader_alone"] / ref["get"],
                        f"get_l3_through_dataplane_over_redis_get{suffix}": ours["get_l3_through_dataplane"] / ref["get"],
                        f"get_l2_over_redis_get{suffix}": ours["get_l2"] / ref["get"],
                        f"get_l2_during_write_behind_over_redis_get{suffix}": ours["get_l2_during_write_behind"] / ref["get"],
                        f"get_l2_packed_over_redis_get{suffix}": ours["get_l2_packed"] / ref["get"],
                    })
                # The same data plane's calls straight to replicas and through Serve, side by side.
                ratios["put_over_put_through_serve"] = ours["put"] / ours["put_through_serve"]
                ratios["get_l3_over_get_l3_through_serve"] = ours["get_l3"] / ours["get_l3_through_serve"]
                ratios["promote_from_worker_over_reread"] = ours["promote_from_worker"] / ours["promote_reread"]
                for in_flight in (args.concurrency, 4 * args.concurrency):
                    ratios[f"calls_per_s_direct_over_through_serve_{in_flight}"] = (
                        ours[f"calls_per_s_direct_{in_flight}"] / ours[f"calls_per_s_through_serve_{in_flight}"]
                    )
                results.append({
                    "cpu_s_per_gb": cpu,
                    "ours_gbps": ours,
                    "redis_benchmark_gbps": peer,
                    "redis_benchmark_keyspace_gbps": peer_keys,
                    "ratios": ratios,
                })
        if args.worker_blocks:
            sizes = [int(x) for x in args.worker_blocks.split(",") if x]
            worker = asyncio.run(with_reader(cfg, measure_worker_wait, handle, sizes))
        serve.delete("dpbench")
        if not args.no_bounds:
            _say("bounds: Ray object store, Serve handle, Redis alone, put with no write-behind")
            quiet_cfg = cfg.model_copy(update={"dataplane": cfg.dataplane.model_copy(update={
                "sync_interval_ms": 600_000, "l2_capacity_bytes": 1 << 33})})
            quiet = serve.run(
                with_serve_runtime(dataplane_deployment(quiet_cfg), quiet_cfg).bind(quiet_cfg.model_dump(mode="json")),
                name="dpbench-quiet", route_prefix=None,
            )
            bounds = asyncio.run(measure_bounds(
                args.batch * size, max(8, args.num_blocks // args.batch), args.concurrency,
                args.rounds, redis.url, {"env_vars": dict(THROUGHPUT_ENV)}, quiet,
            ))
            serve.delete("dpbench-quiet")
        serve.shutdown()
        ray.shutdown()

    ratios = {k: statistics.median(r["ratios"][k] for r in results) for k in results[0]["ratios"]}
    cpu = _cpu_medians([r["cpu_s_per_gb"] for r in results])
    report = {"rounds": results, "ratios": ratios, "cpu_s_per_gb": cpu, "bounds_gbps": bounds, "worker_wait": worker}
    print(json.dumps(report, indent=2))
    _say(f"stored {write_report(args.out, {'args': vars(args), **report})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
