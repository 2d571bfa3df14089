"""A session's DELETE erases its KV blocks from L2 and L3 even when they are moving:
written behind to Redis at that moment, or exported by the worker after the delete (a
turn's export runs after its reply, so a client's DELETE right after a turn can reach the
data plane first).

One DataPlane instance in this process on a real redis-server of the test's own; the
moments of the races are forced by wrapping the methods that run at those awaits.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import redis.asyncio as aioredis

from deployments.dataplane import keys
from deployments.dataplane.blocks import BlockHeader, encode_block
from deployments.dataplane.deployment import DataPlane
from tests.fixtures.dataplane import started_dataplane

pytestmark = pytest.mark.integration

TENANT = "del"
SID = "sess_" + "d" * 32


def _block(i: int) -> bytes:
    return encode_block(BlockHeader("float32", (1, 2, 1, 4, 8)), bytes([i]) * 256)


@contextlib.asynccontextmanager
async def dataplane():
    # Write-behind only when a test runs it.
    async with started_dataplane(l2_capacity_bytes=1 << 22, sync_interval_ms=600_000) as (dp, server):
        client = aioredis.Redis.from_url(server.url)
        try:
            yield dp, client
        finally:
            await client.aclose()


async def _in_l3(client, hashes) -> int:
    return await client.exists(*[keys.block_key(TENANT, h) for h in hashes])


async def _in_l2(dp: DataPlane, hashes) -> int:
    return (await dp.lookup_prefix(TENANT, hashes)).num_blocks


async def test_blocks_exported_after_their_sessions_delete_are_erased():
    async with dataplane() as (dp, client):
        await dp.create_session(TENANT, session_id=SID)
        assert await dp.delete_session(TENANT, SID) is True
        hashes = ["h0", "h1"]
        # The worker's export of the last turn arrives now.
        assert await dp.put_blocks(TENANT, hashes, [_block(0), _block(1)], SID, shard_key="h0") == 0
        assert await _in_l2(dp, hashes) == 0
        assert await client.exists(keys.session_blocks_key(TENANT, SID)) == 0  # not listed again
        assert await dp._write_dirty_blocks() == 0
        assert await _in_l3(client, hashes) == 0
        assert (await dp.stats())["blocks_of_deleted_sessions"] == 2
        # A live session's blocks are listed and kept as ever.
        await dp.create_session(TENANT, session_id="sess_" + "e" * 32)
        assert await dp.put_blocks(TENANT, ["g0"], [_block(2)], "sess_" + "e" * 32, shard_key="g0") == 1
        assert await dp._write_dirty_blocks() == 1 and await _in_l3(client, ["g0"]) == 1


async def test_a_delete_while_write_behind_runs_leaves_no_block_in_l3():
    async with dataplane() as (dp, client):
        await dp.create_session(TENANT, session_id=SID)
        hashes = ["w0", "w1"]
        assert await dp.put_blocks(TENANT, hashes, [_block(3), _block(4)], SID, shard_key="w0") == 2  # dirty in L2

        # (1) Write-behind runs at the delete's first await after it read the session's
        # blocks: L2 is dropped before L3 is erased, so nothing written then survives.
        real_drop = dp._drop_blocks_everywhere

        async def write_behind_then_drop(*args, **kwargs):
            await dp._write_dirty_blocks()
            return await real_drop(*args, **kwargs)

        dp._drop_blocks_everywhere = write_behind_then_drop
        assert await dp.delete_session(TENANT, SID) is True
        dp._drop_blocks_everywhere = real_drop
        assert await _in_l3(client, hashes) == 0 and await _in_l2(dp, hashes) == 0

        # (2) A write-behind already under way, whose SETs land after the delete erased
        # L3: it erases what L2 dropped meanwhile.
        sid = "sess_" + "f" * 32
        await dp.create_session(TENANT, session_id=sid)
        hashes = ["v0", "v1"]
        assert await dp.put_blocks(TENANT, hashes, [_block(5), _block(6)], sid, shard_key="v0") == 2
        gate = asyncio.Event()
        real_put = dp._store.put_blocks

        async def held_put(*args, **kwargs):
            await gate.wait()
            return await real_put(*args, **kwargs)

        dp._store.put_blocks = held_put
        writing = asyncio.create_task(dp._write_dirty_blocks())
        await asyncio.sleep(0.05)
        assert not writing.done()
        assert await dp.delete_session(TENANT, sid) is True
        gate.set()
        assert await writing == 2  # its SETs landed after the delete
        assert await _in_l3(client, hashes) == 0
        assert await client.exists(*[keys.block_index_key(TENANT, h) for h in hashes]) == 0
