"""The data plane's write-behind holding back while a burst of puts arrives
(``dataplane.write_behind_yield_ms``), bounded by ``write_behind_max_delay_ms`` and by
L2's low watermark, against a real redis-server (no Ray)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from deployments.dataplane import keys
from deployments.dataplane.blocks import BlockHeader, encode_block, pack_blocks
from tests.fixtures.dataplane import started_dataplane
from tests.fixtures.polling import eventually

pytestmark = pytest.mark.integration

BLOCK = 16_000


def blocks(n: int, first: int = 0) -> list[bytes]:
    return [encode_block(BlockHeader("uint8", (BLOCK,)), bytes([(first + i) % 256]) * BLOCK) for i in range(n)]


async def put(dp, names: list[str], values: list[bytes]) -> None:
    assert await dp.put_blocks_packed("wb", names, *pack_blocks(values)) == len(names)


async def test_write_behind_holds_back_while_puts_arrive_then_writes_everything():
    """The decision of each write-behind pass, on the replica's own clock: held back
    (and counted) right after a put; due once puts stopped for the yield window, once
    the oldest unwritten block waited the maximum delay, once L2 is past its low
    watermark, and always with the yield off. The pass then writes every block."""
    # No pass runs on its own here (600 s period): the test asks _write_behind_due.
    async with started_dataplane(
        sync_interval_ms=600_000, write_behind_yield_ms=10_000, write_behind_max_delay_ms=60_000,
        l2_capacity_bytes=1 << 20, low_watermark=0.5, high_watermark=0.9,
    ) as (dp, server):
        assert dp._write_behind_due() is False  # nothing to write
        await put(dp, ["a0", "a1"], blocks(2))
        assert dp._write_behind_due() is False  # a put just now: held back
        assert dp._write_behind_due() is False
        assert (await dp.stats())["write_behind_deferred"] == 2
        dp._last_put_at -= 11  # puts stopped longer ago than the yield window
        assert dp._write_behind_due() is True
        dp._last_put_at += 11
        dp._dirty_since -= 61  # the oldest unwritten block waited the maximum
        assert dp._write_behind_due() is True
        dp._dirty_since += 61
        assert dp._write_behind_due() is False
        dp._cfg = dp._cfg.model_copy(update={"write_behind_yield_ms": 0})
        assert dp._write_behind_due() is True
        dp._cfg = dp._cfg.model_copy(update={"write_behind_yield_ms": 10_000})
        # Past the low watermark (half of 1 MiB) a dirty block evicted would be
        # written on a put's path: write behind now.
        await put(dp, [f"b{i}" for i in range(32)], blocks(32, 2))
        assert dp._l2.used_bytes >= 0.5 * (1 << 20)
        assert dp._write_behind_due() is True

        assert await dp._write_dirty_blocks() == 34
        assert dp._write_behind_due() is False and dp._dirty_since is None
        client = aioredis.Redis.from_url(server.url)
        try:
            stored = await client.exists(*[keys.block_key("wb", h) for h in ["a0", "a1", *(f"b{i}" for i in range(32))]])
            assert stored == 34
        finally:
            await client.aclose()


async def test_a_burst_longer_than_the_maximum_delay_is_written_during_it_and_all_of_it_after():
    """The running loop (20 ms period): puts every 10 ms for 1.5 s, yield 100 ms,
    maximum delay 300 ms. Blocks reach Redis while the burst still goes on (the
    maximum delay), and every block once it ended."""
    async with started_dataplane(
        sync_interval_ms=20, write_behind_yield_ms=100, write_behind_max_delay_ms=300, l2_capacity_bytes=1 << 26,
    ) as (dp, server):
        names: list[str] = []
        written_during_burst = 0
        end = time.monotonic() + 1.5
        i = 0
        while time.monotonic() < end:
            names.append(f"c{i}")
            await put(dp, [names[-1]], blocks(1, i))
            i += 1
            written_during_burst = (await dp.stats()).get("written_behind", 0)
            await asyncio.sleep(0.01)
        assert written_during_burst > 0, "the maximum delay did not bound the hold-back"

        async def all_written() -> bool:
            return (await dp.status())["unsynced_blocks"] == 0

        await eventually(all_written)
        client = aioredis.Redis.from_url(server.url)
        try:
            assert await client.exists(*[keys.block_key("wb", h) for h in names]) == len(names)
        finally:
            await client.aclose()
