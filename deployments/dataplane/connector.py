"""The engine side of the data plane: a :class:`KVConnector` over a DeploymentHandle.

``shard_key`` is the FIRST hash of a chain, so every block of one chain lives on one
DataPlane shard and a lookup is one call. Any failure of the data plane (replica gone,
timeout, Redis trouble surfacing as an error) is a miss, logged, never raised to the
engine; ``save`` returns at once and only logs its errors.

A save puts its blocks into one object of Ray's object store here and hands the data
plane the reference, which L2 keeps (on this node without a copy; see
``DataPlane.put_block_refs``). Blocks in L2 come as references into the data plane's
objects; those of an object that cannot be fetched from here (its owner, the worker that
saved it, is gone) come inline instead. Blocks only in L3 are read from Redis by the
worker itself when it has a ``BlockReader`` (``dataplane.direct_l3_reads``): one
transfer, checked here, instead of the data plane's MGET, its copy into the object store
and the worker's mapping of it; the data plane is then asked to ``promote`` them into L2, off the request's path. A direct read that fails
(Redis unreachable from here, a block gone or corrupt) falls back to the data plane's own
read, which checks, counts and drops what is wrong; after a connection failure direct
reads pause for ``DIRECT_L3_RETRY_S``. A promotion waits ``PROMOTE_DELAY_S`` first: it
reads the blocks from Redis again and copies them, which beside the decode and prefill
they were read for made both slower on a 2-core machine (the longest prefixes' decodes
19-47 ms against 12-17).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Optional

from app import telemetry
from app.config import DataPlaneConfig
from app.host_memory import minor_faults
from deployments.compute.engines.kv import (
    TIER_L2,
    TIER_L3,
    CheckedBlocks,
    KVConnector,
    PrefixHit,
    Rate,
)
from deployments.dataplane.blocks import BlockChecks, CorruptBlockError, block_arrays, unpack_blocks
from deployments.dataplane.redis_store import RedisUnavailable
from deployments.dataplane.routing import DirectCalls
from deployments.dataplane.types import InRedis

logger = logging.getLogger("ray.serve")
_tracer = telemetry.tracer(__name__)

# Remembered tier of recent lookups, so load() can attribute its time to a tier.
_MAX_REMEMBERED = 4096
# Blocks that came with recent lookups (references into the data plane's object store),
# for the load() that follows; few, since each keeps its objects alive.
_MAX_STASHED = 16
# After a direct L3 read could not reach Redis, reads go through the data plane this long.
DIRECT_L3_RETRY_S = 10.0
# How long after a direct L3 read its blocks are promoted into L2: after the request's
# prefill, before the session's next turn (which a person types).
PROMOTE_DELAY_S = 1.0
# The bytes of direct L3 reads a connector keeps for their promotions at most, by
# default (``dataplane.promote_hold_bytes``): the data plane then takes the worker's copy
# (through the object store) instead of reading Redis again. A read past it is promoted
# by the data plane's own read, as before. The blocks' buffers (in a torch worker, from
# its KV arena) stay in use until the promotion (PROMOTE_DELAY_S): this bounds them.
PROMOTE_HOLD_BYTES = DataPlaneConfig.model_fields["promote_hold_bytes"].default


def _remember(entries: OrderedDict, key, value, limit: int) -> None:
    """``entries[key] = value`` as the newest entry, dropping the oldest past ``limit``."""
    entries[key] = value
    entries.move_to_end(key)
    while len(entries) > limit:
        entries.popitem(last=False)


async def _none():
    return None


def _object_lost(e: BaseException) -> bool:
    """Whether ``e`` is Ray's error for an object that can no longer be had (its owner
    died, its node went away)."""
    import ray

    return isinstance(e, ray.exceptions.ObjectLostError)


async def resolve_block_refs(segments, read_l3=None) -> Optional[list[memoryview]]:
    """The blocks of ``DataPlane.get_block_refs``'s answer, in order: each ObjectRef is
    fetched once (mapped from the node's object store without a copy when the data plane
    runs on this node), inline lists are used as they are, and the hashes of ``InRedis``
    segments go to ``read_l3(hashes)`` (a list of blocks in that order, or None), at the
    same time as the references. None if there are such segments and no ``read_l3``, or
    it returned None."""
    import ray

    refs = [src for src, _ in segments if isinstance(src, ray.ObjectRef)]
    wanted = [src.hashes[i] for src, indices in segments if isinstance(src, InRedis) for i in indices]
    if wanted and read_l3 is None:
        return None
    fetched, from_redis = await asyncio.gather(
        asyncio.gather(*refs), read_l3(wanted) if wanted else _none()
    )
    if wanted and from_redis is None:
        return None
    by_hash = dict(zip(wanted, from_redis)) if wanted else {}
    fetched = iter(fetched)
    blocks: list[memoryview] = []
    for src, indices in segments:
        if isinstance(src, InRedis):
            blocks.extend(by_hash[src.hashes[i]] for i in indices)
            continue
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
        l3_reader=None,
        promote_delay_s: float = PROMOTE_DELAY_S,
        puts_by_ref: Optional[bool] = None,
        direct_calls: Optional[bool] = None,
        promote_by_ref: Optional[bool] = None,
        promote_hold_bytes: int = PROMOTE_HOLD_BYTES,
    ):
        self._handle = handle
        from ray.serve.handle import DeploymentHandle

        # Calls go straight to the owner replica's actor (see _call) once this process's
        # request router has seen the replicas. None: over a Serve handle.
        self._direct = DirectCalls(
            handle, isinstance(handle, DeploymentHandle) if direct_calls is None else direct_calls, "KV connector"
        )
        # Calls sent straight to a replica, and those that went through Serve after the
        # replica did not answer (died, unreachable).
        self.direct_calls = {"calls": 0, "fallbacks": 0}
        # Saves put the blocks into Ray's object store here and hand the data plane the
        # reference (put_block_refs), which it keeps without a copy on this node; else
        # the blocks go as the call's arrays (put_blocks_packed). None: for a Serve
        # handle (not for an in-process stand-in, as in tests and tools).
        if puts_by_ref is None:
            puts_by_ref = isinstance(handle, DeploymentHandle)
        self._puts_by_ref = puts_by_ref
        # Promotions hand the data plane the blocks this worker read from Redis (one copy
        # into the object store here) instead of having it read them again: Redis sends
        # each L3 hit's bytes once, not twice. None: as puts go (puts_by_ref). Within
        # ``promote_hold_bytes`` of reads waiting for their promotion.
        self._promote_by_ref = puts_by_ref if promote_by_ref is None else promote_by_ref
        self._promote_hold_bytes = promote_hold_bytes
        self._promote_held = 0
        # Promotions sent with this worker's bytes, and those the data plane read from
        # Redis (no by-reference promotions here, or over the bytes allowed to wait).
        self.promotions = {"by_ref": 0, "reread": 0}
        self._node: Optional[str] = None
        # ``redis_store.BlockReader`` of the blocks' Redis (None: the data plane reads L3).
        self._reader = l3_reader
        self._direct_paused_until = 0.0  # monotonic time; see DIRECT_L3_RETRY_S
        self._promote_delay_s = promote_delay_s
        # Direct L3 reads (the worker exports them as metrics): reads, blocks and bytes
        # read, and reads that fell back to the data plane.
        self.direct_l3 = {"reads": 0, "blocks": 0, "bytes": 0, "fallbacks": 0}
        self.block_size = block_size
        self._timeout_s = timeout_s
        self._session_id = session_id
        # Per tier, the measured bandwidth (bytes per second of fetches). An average of
        # per-fetch ratios let small fetches drag it down, and then whole long prefixes
        # were recomputed instead of fetched: hence Rate's ratio of averages. Made (fresh)
        # by forget_bandwidth, as ``_bandwidth``.
        self._ewma_alpha = ewma_alpha
        self.forget_bandwidth()
        self._tiers: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._stash: OrderedDict[tuple[str, str], list] = OrderedDict()
        self._pending: set[asyncio.Task] = set()
        # Router-started lookups awaited instead of a call of our own, and those that
        # failed (then asked again); the worker exports them as a metric.
        self.early_lookups = {"used": 0, "failed": 0}
        # Loads that found an L2 object's owner gone and read the bytes inline instead.
        self.lost_refs = 0
        # The loop the connector was built on: ``save`` may be called from an engine's
        # own thread, which has no loop of its own.
        try:
            self._loop: Optional[asyncio.AbstractEventLoop] = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None

    async def _call(self, method: str, *args, shard_key: str, **kwargs):
        """``method`` of the data plane, straight to the replica that owns ``shard_key``
        (``routing.send_direct``) where this process knows it, else through the Serve
        handle; a direct call whose replica died or cannot be reached goes through Serve
        (which finds another replica, and the ring without it, on its own)."""
        direct = self._direct.send(method, args, {**kwargs, "shard_key": shard_key})
        if direct is not None:
            try:
                result = await asyncio.wait_for(direct, self._timeout_s)
                self.direct_calls["calls"] += 1
                return result
            except Exception as e:
                import ray

                if not isinstance(e, ray.exceptions.RayActorError):
                    raise
                self.direct_calls["fallbacks"] += 1
                logger.info("data-plane %s straight to a replica failed (%s); through Serve", method, type(e).__name__)
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
                hit = await self._call(
                    "lookup_prefix", tenant, hashes, shard_key=hashes[0], with_refs=True, direct_l3=self.direct_l3_reads
                )
            except Exception as e:
                logger.warning("KV lookup failed, treating as a miss: %r", e)
                return PrefixHit(0)
        if hit.num_blocks:
            key = (tenant, hashes[hit.num_blocks - 1])
            _remember(self._tiers, key, hit.tier, _MAX_REMEMBERED)
            if hit.refs is not None:
                # What load() of exactly this run will use instead of a second call.
                _remember(self._stash, key, hit.refs, _MAX_STASHED)
                hit.refs = None
            else:
                # No references this time (the run is in L3 and this worker does not
                # read it): an earlier lookup's, for the same run, must not stand in for
                # them; the replica holding their objects may be gone since.
                self._stash.pop(key, None)
        return hit

    async def load(self, tenant: str, hashes: list[str]) -> Optional[list[bytes]]:
        if not hashes:
            return []
        started = time.perf_counter()
        try:
            segments = self._stash.pop((tenant, hashes[-1]), None)
            if segments is None:
                segments = await self._call(
                    "get_block_refs", tenant, hashes, shard_key=hashes[0], direct_l3=self.direct_l3_reads
                )
            debug = logger.isEnabledFor(logging.DEBUG)
            t_map, faults = time.perf_counter(), minor_faults() if debug else 0
            read_l3 = (lambda wanted: self._read_l3(tenant, wanted, hashes[0])) if self.direct_l3_reads else None
            try:
                blocks = None if segments is None else await self._resolve(segments, read_l3)
            except Exception as e:  # noqa: BLE001 - sorted below
                if not _object_lost(e):
                    raise
                # An object L2 keeps by reference whose owner, the worker that put it, is
                # gone (Ray cannot then reach it from another node): the data plane still
                # has it mapped, so the bytes come in its reply.
                self.lost_refs += 1
                logger.info("KV load: an L2 object's owner is gone (%s); reading the bytes inline", type(e).__name__)
                packed = await self._call("get_blocks_packed", tenant, hashes, shard_key=hashes[0])
                blocks = None if packed is None else unpack_blocks(*packed)
                segments = None
            if blocks is None and segments is not None:
                # Blocks left in Redis that this worker could not read (or may not now):
                # the data plane reads them, and checks, counts and drops what is wrong.
                self.direct_l3["fallbacks"] += 1
                segments = await self._call("get_block_refs", tenant, hashes, shard_key=hashes[0])
                blocks = None if segments is None else await self._resolve(segments)
            if debug:
                # The worker's part of a load: the call (the data plane's read) and mapping
                # what it referenced, with reading L3 blocks from Redis (the torch engine
                # logs the whole as load_ms), and the page faults this thread took meanwhile.
                logger.debug(
                    "kv load: blocks=%d call_ms=%.1f map_ms=%.1f map_faults=%d",
                    len(hashes), 1000 * (t_map - started), 1000 * (time.perf_counter() - t_map),
                    minor_faults() - faults,
                )
        except Exception as e:
            logger.warning("KV load of %d blocks failed, treating as a miss: %r", len(hashes), e)
            return None
        if blocks is None or len(blocks) != len(hashes):
            return None
        tier = self._tiers.pop((tenant, hashes[-1]), None)
        if tier in (TIER_L2, TIER_L3):
            self.record_fetch(tier, sum(len(b) for b in blocks), time.perf_counter() - started)
        # The data plane checked each on its way in (from a worker or from Redis) and
        # keeps it in read-only memory since; _read_l3 checked those it read.
        return CheckedBlocks(blocks)

    async def _resolve(self, segments, read_l3=None) -> Optional[list[memoryview]]:
        """:func:`resolve_block_refs` within the call timeout: an object that cannot be
        had (its holder gone, a fetch that never ends) is a miss, never a request held."""
        async with asyncio.timeout(self._timeout_s):  # no extra task, unlike wait_for
            return await resolve_block_refs(segments, read_l3)

    @property
    def direct_l3_reads(self) -> bool:
        """Whether L3 blocks are read here now (a reader, and no recent connection failure)."""
        return self._reader is not None and time.monotonic() >= self._direct_paused_until

    async def _read_l3(self, tenant: str, hashes: list[str], root: str) -> Optional[list]:
        """``hashes`` read from Redis and checked, then promoted into L2 (not awaited,
        after ``promote_delay_s``; with the bytes read, kept until then within
        ``promote_hold_bytes``); None if any is missing or corrupt, or Redis cannot be
        reached."""
        with _tracer.start_as_current_span("kv.direct_l3_read", attributes={"llm.kv.blocks": len(hashes)}) as span:
            views = await self._read_checked(tenant, hashes)
            span.set_attribute("llm.kv.result", "fallback" if views is None else "read")
        if views is None:
            return None
        self.direct_l3["reads"] += 1
        self.direct_l3["blocks"] += len(views)
        nbytes = sum(len(v) for v in views)
        self.direct_l3["bytes"] += nbytes
        keep = self._promote_by_ref and self._promote_held + nbytes <= self._promote_hold_bytes
        if keep:
            self._promote_held += nbytes
        self._spawn(self._promote(tenant, hashes, root, views if keep else None, nbytes if keep else 0))
        return views

    async def _read_checked(self, tenant: str, hashes: list[str]) -> Optional[list]:
        debug = logger.isEnabledFor(logging.DEBUG)
        started, faults = time.perf_counter(), minor_faults() if debug else 0
        checks = BlockChecks()  # each block checked as it arrives (resp.py)
        try:
            _, views = await self._reader.get_blocks_packed(tenant, hashes, on_value=checks)
        except RedisUnavailable as e:
            self._direct_paused_until = time.monotonic() + DIRECT_L3_RETRY_S
            logger.warning(
                "direct L3 read failed, reading L3 through the data plane for %.0fs: %s", DIRECT_L3_RETRY_S, e
            )
            return None
        t_read, faults_read = time.perf_counter(), minor_faults() if debug else 0
        for i, (h, view) in enumerate(zip(hashes, views)):
            error = CorruptBlockError("payload missing") if view is None else checks.error(i, view)
            if error is not None:
                logger.info("direct L3 read: block %s of %s unusable (%s); asking the data plane", h, tenant, error)
                return None
        if debug:
            # As the data plane's "kv blocks read from L3" line: the MGET with the
            # blocks' checks (each as it arrived), and the page faults this thread took.
            logger.debug(
                "direct L3 read: blocks=%d bytes=%d redis_ms=%.1f redis_faults=%d",
                len(views), sum(len(v) for v in views), 1000 * (t_read - started), faults_read - faults,
            )
        return views

    async def _promote(
        self, tenant: str, hashes: list[str], root: str, views: Optional[list] = None, held: int = 0
    ) -> None:
        """:meth:`promote`, ``promote_delay_s`` from now; ``views`` (the blocks read) are
        held until then within ``promote_hold_bytes``, ``held`` bytes of it reserved by
        the caller and given back here."""
        try:
            await asyncio.sleep(self._promote_delay_s)
            await self.promote(tenant, hashes, views, chain_root=root)
        except Exception as e:
            logger.info("KV promote of %d blocks failed (they stay in L3): %s", len(hashes), e)
        finally:
            self._promote_held -= held

    async def promote(self, tenant: str, hashes: list[str], blocks: Optional[list] = None, *, chain_root: str) -> int:
        """Ask the data plane to bring ``hashes``, just read from Redis here, up to L2 (how
        many are in L2 now). With ``blocks`` (what was read) and promotions by reference,
        it takes them through the object store, one copy here (in a thread; the loop
        keeps serving), instead of reading Redis again. Without, it reads them."""
        if blocks is None or not self._promote_by_ref:
            self.promotions["reread"] += 1
            return await self._call("promote", tenant, hashes, shard_key=chain_root)
        data, lengths = block_arrays(blocks)
        ref = await self._object_of(data)
        del data
        self.promotions["by_ref"] += 1
        return await self._call(
            "promote", tenant, hashes, shard_key=chain_root, refs=[ref], lengths=lengths, node_id=self._node
        )

    async def _object_of(self, data: list):
        """The ObjectRef of one object in this node's object store holding ``data`` (the
        blocks' arrays, ``block_arrays``), copied in a thread (the copy releases the GIL;
        the loop keeps serving); ``self._node`` names this node for the data plane."""
        import ray

        if self._node is None:
            self._node = ray.get_runtime_context().get_node_id()
        return await asyncio.to_thread(ray.put, data)

    def _spawn(self, coro) -> None:
        """Run ``coro`` on the current loop, held in ``_pending`` until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        # Held until done: the loop keeps only weak references to tasks.
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

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
            self._spawn(coro)
        elif self._loop is not None and not self._loop.is_closed():
            asyncio.run_coroutine_threadsafe(coro, self._loop)
        else:
            coro.close()
            logger.warning("KV save of %d blocks skipped: no event loop to run it on", len(hashes))

    async def _save(self, tenant: str, hashes: list[str], blocks: list[bytes], session_id, root: str) -> None:
        try:
            await self.put(tenant, hashes, blocks, session_id, chain_root=root)
        except Exception as e:
            logger.warning("KV save of %d blocks failed (dropped): %s", len(hashes), e)

    async def put(
        self,
        tenant: str,
        hashes: list[str],
        blocks: list,
        session_id: Optional[str] = None,
        *,
        chain_root: Optional[str] = None,
    ) -> int:
        """What :meth:`save` sends, awaited: how many blocks the data plane stored.

        By reference (through a Serve handle): the blocks are copied once, in a thread (the copy
        releases the GIL; the loop keeps serving), into one object of this node's object
        store, and the data plane keeps that object (``put_block_refs``): one copy where
        the call's arguments and the data plane's own object made two. Otherwise one
        uint8 view per block goes in the call, which Ray copies straight into its store
        (cheaper than packing them first)."""
        # The chain's shard (its first hash), where lookups of the chain go: a
        # continuation sharded by its own first block would land elsewhere.
        root = chain_root or hashes[0]
        data, lengths = block_arrays(blocks)
        if not self._puts_by_ref:
            return await self._call("put_blocks_packed", tenant, hashes, data, lengths, session_id, shard_key=root)
        ref = await self._object_of(data)
        return await self._call(
            "put_block_refs", tenant, hashes, [ref], lengths, session_id, node_id=self._node, shard_key=root
        )

    @property
    def num_pending(self) -> int:
        """Saves (and promotions) handed to the data plane and not yet acknowledged by it."""
        return len(self._pending)

    async def drain(self) -> None:
        """Wait for pending saves and promotions (tests, shutdown)."""
        if self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    async def close(self) -> None:
        """Close the Redis connections of direct L3 reads (after :meth:`drain`)."""
        reader, self._reader = self._reader, None
        if reader is not None:
            try:
                await reader.close()
            except Exception as e:  # noqa: BLE001 - the process is stopping
                logger.info("closing the direct L3 reader failed: %r", e)

    def record_fetch(self, tier: str, num_bytes: int, seconds: float) -> None:
        if tier in self._bandwidth:
            self._bandwidth[tier].update(num_bytes, seconds)

    def bandwidth_bytes_per_s(self, tier: str) -> Optional[float]:
        rate = self._bandwidth.get(tier)
        return None if rate is None else rate.value

    def forget_bandwidth(self) -> None:
        self._bandwidth = {tier: Rate(self._ewma_alpha) for tier in (TIER_L2, TIER_L3)}
