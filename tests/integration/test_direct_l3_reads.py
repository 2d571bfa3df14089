"""A worker reads the L3 blocks of a prefix from Redis itself (``direct_l3_reads``): the
data plane hands them over as ``InRedis`` segments, the connector reads and checks them,
and the data plane promotes them into L2; a read that cannot be made that way falls back
to the data plane's own. Real Redis, a DataPlane without Serve (its methods called
in-process through a stand-in handle)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from deployments.dataplane import keys
from deployments.dataplane.blocks import pack_blocks
from deployments.dataplane.connector import DataPlaneKVConnector
from deployments.dataplane.redis_store import BlockReader
from deployments.dataplane.types import InRedis
from tests.fixtures.logs import messages_containing, serve_log_captured
from tests.integration.test_dataplane_block_io import block, dataplane

pytestmark = pytest.mark.integration


class _Method:
    def __init__(self, dp, name: str, calls: list):
        self._fn = getattr(dp, name)
        self._name = name
        self._calls = calls

    def remote(self, *args, **kwargs):
        self._calls.append((self._name, kwargs.get("direct_l3")))
        return self._fn(*args, **kwargs)


class InProcessHandle:
    """What the connector needs of a DeploymentHandle, over a DataPlane in this process."""

    def __init__(self, dp):
        self._dp = dp
        self.calls: list[tuple[str, object]] = []

    def __getattr__(self, name: str) -> _Method:
        return _Method(self._dp, name, self.calls)


async def _stored(dp, tenant: str, hashes: list[str], blocks: list[bytes], *, in_l2: list[str] = ()) -> None:
    """``blocks`` written to Redis, then only the hashes of ``in_l2`` left in L2."""
    assert await dp.put_blocks_packed(tenant, hashes, *pack_blocks(blocks)) == len(blocks)
    await dp.flush_l2()
    if in_l2:
        assert await dp.prefetch(tenant, list(in_l2)) == len(in_l2)


async def test_blocks_only_in_redis_are_handed_over_by_hash_in_order(redis_server):
    dp = dataplane(redis_server.url)
    try:
        hashes = [f"ho{i}" for i in range(5)]
        blocks = [block(4000, i) for i in range(5)]
        await _stored(dp, "t", hashes, blocks, in_l2=["ho0", "ho1", "ho3"])

        segments = await dp.get_block_refs("t", hashes, direct_l3=True)
        # Without Ray, L2's blocks go inline; L3's as hashes for the caller to read.
        assert [type(src) for src, _ in segments] == [list, InRedis, list, InRedis]
        assert segments[1][0].hashes == ["ho2"] and segments[3][0].hashes == ["ho4"]
        assert [bytes(segments[0][0][i]) for i in segments[0][1]] == blocks[:2]
        stats = await dp.stats()
        assert stats["handoff_blocks_direct_l3"] == 2
        assert stats.get("get_hits_L3", 0) == 0 and stats["l2_num_blocks"] == 3  # Redis not read

        # The lookup hands the same over with its hit, whatever the tiers.
        hit = await dp.lookup_prefix("t", hashes, with_refs=True, direct_l3=True)
        assert hit.num_blocks == 5 and hit.tier == "L3"
        assert [type(src) for src, _ in hit.refs] == [list, InRedis, list, InRedis]
        assert (await dp.lookup_prefix("t", hashes, with_refs=True)).refs is None

        # Off, the data plane reads them itself and promotes them.
        segments = await dp.get_block_refs("t", hashes)
        assert all(isinstance(src, list) for src, _ in segments)
        assert (await dp.stats())["get_hits_L3"] == 2
    finally:
        await dp.drain()


async def test_the_worker_reads_l3_itself_and_the_data_plane_promotes_it(redis_server):
    dp = dataplane(redis_server.url)
    reader = BlockReader.from_config(dp._cfg.redis)
    try:
        handle = InProcessHandle(dp)
        connector = DataPlaneKVConnector(handle, 16, l3_reader=reader, promote_delay_s=0.2)
        hashes = [f"wr{i}" for i in range(6)]
        blocks = [block(30_000, 10 + i) for i in range(6)]
        await _stored(dp, "t", hashes, blocks, in_l2=["wr0", "wr1"])

        hit = await connector.lookup("t", hashes)
        assert hit.num_blocks == 6 and hit.tier == "L3"
        got = await connector.load("t", hashes)
        assert [bytes(b) for b in got] == blocks
        assert type(got).__name__ == "CheckedBlocks"  # checked here: the engine skips it
        assert connector.direct_l3 == {
            "reads": 1, "blocks": 4, "bytes": sum(len(b) for b in blocks[2:]), "fallbacks": 0,
        }
        # The promotion waits (beside the prefill it would slow), then lands.
        await asyncio.sleep(0.05)
        assert [name for name, _ in handle.calls] == ["lookup_prefix"] and connector.num_pending == 1
        await connector.drain()
        # One call for the read (the lookup's, which asked for L3 by hash; the load used
        # its answer), then the promotion.
        assert handle.calls == [("lookup_prefix", True), ("promote", None)]
        stats = await dp.stats()
        assert stats["promoted"] == 4 and stats.get("get_hits_L3", 0) == 0 and stats["l2_num_blocks"] == 6
        assert stats["prefetched"] == 2  # _stored's, not the promotion's

        # Now all in L2: by reference (inline here), no Redis read, no promotion.
        got = await connector.load("t", hashes)
        assert [bytes(b) for b in got] == blocks
        assert connector.direct_l3["reads"] == 1
        assert [name for name, _ in handle.calls][-1] == "get_block_refs"
    finally:
        await reader.close()
        await dp.drain()


async def test_a_torch_workers_l3_read_lands_in_its_kv_arena(redis_server):
    """The worker's reader takes its reply buffers from the KV arena (pages touched once,
    engines/kv_arena.py), as ComputeWorker sets it up: the blocks are read into it intact,
    and its memory returns once the blocks are dropped."""
    import gc

    import numpy as np

    from deployments.compute.engines import kv_arena

    kv_arena.uninstall()
    kv_arena.install(8 << 20, background=False)
    arena = kv_arena.current()
    dp = dataplane(redis_server.url)
    reader = BlockReader.from_config(dp._cfg.redis, buffer=kv_arena.host_bytes)
    try:
        connector = DataPlaneKVConnector(InProcessHandle(dp), 16, l3_reader=reader, promote_delay_s=0.2)
        hashes = [f"ar{i}" for i in range(4)]
        blocks = [block(50_000, 40 + i) for i in range(4)]
        await _stored(dp, "t", hashes, blocks)
        assert (await connector.lookup("t", hashes)).tier == "L3"
        got = await connector.load("t", hashes)
        assert [bytes(b) for b in got] == blocks and connector.direct_l3["reads"] == 1
        lo, hi = arena.address_range()
        assert all(lo <= np.frombuffer(b, np.uint8).ctypes.data < hi for b in got)
        assert arena.stats()["used_bytes"] >= sum(len(b) for b in blocks)
        await connector.drain()
        del got
        gc.collect()
        assert arena.stats()["used_bytes"] == 0
    finally:
        kv_arena.uninstall()
        await reader.close()
        await dp.drain()


async def test_a_corrupt_or_missing_l3_block_falls_back_to_the_data_plane(redis_server, redis_client, caplog):
    dp = dataplane(redis_server.url)
    reader = BlockReader.from_config(dp._cfg.redis)
    try:
        connector = DataPlaneKVConnector(InProcessHandle(dp), 16, l3_reader=reader)
        hashes = [f"cf{i}" for i in range(3)]
        blocks = [block(5000, 20 + i) for i in range(3)]
        await _stored(dp, "t", hashes, blocks)
        key = keys.block_key("t", "cf1")
        damaged = bytearray(redis_client.get(key))
        damaged[-3] ^= 0x55
        redis_client.set(key, bytes(damaged))

        with serve_log_captured(caplog, logging.INFO):
            assert await connector.load("t", hashes) is None  # a miss, never bad blocks
        assert messages_containing(caplog, "block cf1 of t unusable")
        assert connector.direct_l3["fallbacks"] == 1 and connector.direct_l3["reads"] == 0
        # The data plane's own read found it, counted it and dropped it from Redis.
        assert (await dp.stats())["corrupt_blocks"] == 1
        assert redis_client.get(key) is None
        assert (await dp.lookup_prefix("t", hashes)).num_blocks == 1

        # A payload gone from Redis (a cache Redis evicts on its own): the same.
        redis_client.delete(keys.block_key("t", "cf0"))
        assert await connector.load("t", hashes[:1]) is None
        assert connector.direct_l3["fallbacks"] == 2
    finally:
        await reader.close()
        await dp.drain()


async def test_a_worker_that_cannot_reach_redis_reads_through_the_data_plane(redis_server, caplog):
    import socket

    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dp = dataplane(redis_server.url)
    unreachable = BlockReader.from_config(dp._cfg.redis.model_copy(update={"url": f"redis://127.0.0.1:{port}/0"}))
    try:
        connector = DataPlaneKVConnector(InProcessHandle(dp), 16, l3_reader=unreachable)
        hashes = [f"ur{i}" for i in range(4)]
        blocks = [block(8000, 30 + i) for i in range(4)]
        await _stored(dp, "t", hashes, blocks)
        with serve_log_captured(caplog, logging.INFO):
            got = await connector.load("t", hashes)
            assert [bytes(b) for b in got] == blocks  # served all the same
            assert not connector.direct_l3_reads  # paused for a while
            await dp.flush_l2()
            got = await connector.load("t", hashes)  # straight through the data plane
            assert [bytes(b) for b in got] == blocks
        assert len(messages_containing(caplog, "direct L3 read failed")) == 1
        assert connector.direct_l3["fallbacks"] == 1
        assert (await dp.stats())["get_hits_L3"] == 8
    finally:
        await unreachable.close()
        await dp.drain()
