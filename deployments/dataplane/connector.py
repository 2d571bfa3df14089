"""The engine side of the data plane: a :class:`KVConnector` over a DeploymentHandle.

``shard_key`` is the FIRST hash of a chain, so every block of one chain lives on one
DataPlane shard and a lookup is one call. Any failure of the data plane (replica gone,
timeout, Redis trouble surfacing as an error) is a miss, logged, never raised to the
engine; ``save`` returns at once and only logs its errors.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Optional

from deployments.compute.engines.kv import (
    TIER_L2,
    TIER_L3,
    CheckedBlocks,
    KVConnector,
    PrefixHit,
    Rate,
)
from deployments.dataplane.blocks import block_arrays

logger = logging.getLogger("ray.serve")

# Remembered tier of recent lookups, so load() can attribute its time to a tier.
_MAX_REMEMBERED = 4096
# Blocks that came with recent lookups (references into the data plane's object store),
# for the load() that follows; few, since each keeps its objects alive.
_MAX_STASHED = 16


def _remember(entries: OrderedDict, key, value, limit: int) -> None:
    """``entries[key] = value`` as the newest entry, dropping the oldest past ``limit``."""
    entries[key] = value
    entries.move_to_end(key)
    while len(entries) > limit:
        entries.popitem(last=False)


async def resolve_block_refs(segments) -> list[memoryview]:
    """The blocks of ``DataPlane.get_block_refs``'s answer, in order: each ObjectRef is
    fetched once (mapped from the node's object store without a copy when the data plane
    runs on this node), inline lists are used as they are."""
    import ray

    refs = [src for src, _ in segments if isinstance(src, ray.ObjectRef)]
    fetched = iter(await asyncio.gather(*refs)) if refs else iter(())
    blocks: list[memoryview] = []
    for src, indices in segments:
        arrays = next(fetched) if isinstance(src, ray.ObjectRef) else src
        blocks.extend(memoryview(arrays[i]) for i in indices)
    return blocks


class DataPlaneKVConnector(KVConnector):
    def __init__(
        self,
        handle,
        block_size: int,
        *,
        timeout_s: float = 5.0,
        session_id: Optional[str] = None,
        ewma_alpha: float = 0.3,
    ):
        self._handle = handle
        self.block_size = block_size
        self._timeout_s = timeout_s
        self._session_id = session_id
        # Per tier, the measured bandwidth (bytes per second of fetches). An average of
        # per-fetch ratios let small fetches drag it down, and then whole long prefixes
        # were recomputed instead of fetched: hence Rate's ratio of averages.
        self._bandwidth = {tier: Rate(ewma_alpha) for tier in (TIER_L2, TIER_L3)}
        self._tiers: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._stash: OrderedDict[tuple[str, str], list] = OrderedDict()
        self._pending: set[asyncio.Task] = set()
        # Router-started lookups awaited instead of a call of our own, and those that
        # failed (then asked again); the worker exports them as a metric.
        self.early_lookups = {"used": 0, "failed": 0}
        # The loop the connector was built on: ``save`` may be called from an engine's
        # own thread, which has no loop of its own.
        try:
            self._loop: Optional[asyncio.AbstractEventLoop] = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None

    async def _call(self, method: str, *args, shard_key: str, **kwargs):
        ref = getattr(self._handle, method).remote(*args, shard_key=shard_key, **kwargs)
        return await asyncio.wait_for(ref, self._timeout_s)

    async def lookup(self, tenant: str, hashes: list[str], *, started=None) -> PrefixHit:
        if not hashes:
            return PrefixHit(0)
        hit = None
        if started is not None:
            # The router's call for the same hashes (checked by the engine), under way
            # since the request arrived: usually answered by now.
            try:
                hit = await asyncio.wait_for(started, self._timeout_s)
                self.early_lookups["used"] += 1
            except Exception as e:  # noqa: BLE001 - ask again below
                self.early_lookups["failed"] += 1
                logger.info("router-started KV lookup failed, asking again: %r", e)
        if hit is None:
            try:
                hit = await self._call("lookup_prefix", tenant, hashes, shard_key=hashes[0], with_refs=True)
            except Exception as e:
                logger.warning("KV lookup failed, treating as a miss: %s", e)
                return PrefixHit(0)
        if hit.num_blocks:
            key = (tenant, hashes[hit.num_blocks - 1])
            _remember(self._tiers, key, hit.tier, _MAX_REMEMBERED)
            if hit.refs is not None:
                # What load() of exactly this run will use instead of a second call.
                _remember(self._stash, key, hit.refs, _MAX_STASHED)
                hit.refs = None
        return hit

    async def load(self, tenant: str, hashes: list[str]) -> Optional[list[bytes]]:
        if not hashes:
            return []
        started = time.perf_counter()
        try:
            segments = self._stash.pop((tenant, hashes[-1]), None)
            if segments is None:
                segments = await self._call("get_block_refs", tenant, hashes, shard_key=hashes[0])
            t_map = time.perf_counter()
            blocks = None if segments is None else await resolve_block_refs(segments)
            # The worker's part of a load: the call (the data plane's read) and mapping
            # what it referenced (the torch engine logs the whole as load_ms).
            logger.debug(
                "kv load: blocks=%d call_ms=%.1f map_ms=%.1f",
                len(hashes), 1000 * (t_map - started), 1000 * (time.perf_counter() - t_map),
            )
        except Exception as e:
            logger.warning("KV load failed, treating as a miss: %s", e)
            return None
        if blocks is None or len(blocks) != len(hashes):
            return None
        tier = self._tiers.pop((tenant, hashes[-1]), None)
        if tier in (TIER_L2, TIER_L3):
            self.record_fetch(tier, sum(len(b) for b in blocks), time.perf_counter() - started)
        # The data plane checked each on its way in (from a worker or from Redis) and
        # keeps it in read-only memory since.
        return CheckedBlocks(blocks)

    def save(
        self,
        tenant: str,
        hashes: list[str],
        blocks: list[bytes],
        session_id: Optional[str] = None,
        *,
        chain_root: Optional[str] = None,
    ) -> None:
        if not hashes:
            return
        coro = self._save(
            tenant, list(hashes), list(blocks), session_id or self._session_id, chain_root or hashes[0]
        )
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            task = loop.create_task(coro)
            # Held until done: the loop keeps only weak references to tasks.
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)
        elif self._loop is not None and not self._loop.is_closed():
            asyncio.run_coroutine_threadsafe(coro, self._loop)
        else:
            coro.close()
            logger.warning("KV save of %d blocks skipped: no event loop to run it on", len(hashes))

    async def _save(self, tenant: str, hashes: list[str], blocks: list[bytes], session_id, root: str) -> None:
        try:
            # One view per block (no copy, no thread): Ray copies them straight into
            # its object store, which is cheaper than packing them first.
            data, lengths = block_arrays(blocks)
            # The chain's shard (its first hash), where lookups of the chain go: a
            # continuation sharded by its own first block would land elsewhere.
            await self._call("put_blocks_packed", tenant, hashes, data, lengths, session_id, shard_key=root)
        except Exception as e:
            logger.warning("KV save of %d blocks failed (dropped): %s", len(hashes), e)

    @property
    def num_pending(self) -> int:
        """Saves handed to the data plane and not yet acknowledged by it."""
        return len(self._pending)

    async def drain(self) -> None:
        """Wait for pending saves (tests, shutdown)."""
        if self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    def record_fetch(self, tier: str, num_bytes: int, seconds: float) -> None:
        if tier in self._bandwidth:
            self._bandwidth[tier].update(num_bytes, seconds)

    def bandwidth_bytes_per_s(self, tier: str) -> Optional[float]:
        rate = self._bandwidth.get(tier)
        return None if rate is None else rate.value
