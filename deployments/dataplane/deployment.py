"""DataPlane: one shard of the data-plane pool (L2 host memory in front of L3 Redis).

Keys are sharded by :mod:`deployments.dataplane.routing`: every public method takes a
``shard_key`` keyword that only the request router reads (a session's id; a KV chain's
first block hash, so one chain lives on one shard).

Durability rules:

* Sessions: while Redis is up, every write goes to Redis first and is acknowledged only
  after Redis applied it (an append is one compare-and-set script), so a replica crash
  loses no acknowledged turn. The replica keeps a copy in memory for degraded mode.
* KV blocks: written into L2 as dirty and behind to Redis every ``sync_interval_ms``; an
  eviction hands a dirty block to Redis before it is dropped. Blocks are a cache: a block
  that cannot reach Redis (outage and memory full) is dropped, counted and logged.

Degraded mode: when Redis is unreachable no request fails because of it. Sessions and
blocks live in this replica's memory (appends compare-and-set on the in-memory version),
``status()["degraded"]`` is True, a gauge says so and one log line marks each change. A
background task retries every ``reconnect_interval_s``; when Redis answers, what was kept
(newer sessions, deletions, dirty blocks) is written back before the flag clears.

A replica that Serve stops (scale-down, redeploy, node drain) drains first
(:meth:`DataPlane.drain`): it writes back what Redis takes, and hands a sessions outage's
turns and deletes to the replica that owns each session once it is gone (:meth:`adopt`,
routed by the session's key with this replica excluded), which serves them from memory
and writes them back when Redis returns. A crash cannot drain: so during an outage each
session change is acknowledged only once that same next owner holds a copy
(:meth:`back_up`, within ``dataplane.outage_backup_timeout_s``); it writes the copy back
too, and Redis keeps the newer version (and a deleted session's tombstone refuses a stale
copy). Only a crash of both, a copy that did not arrive in time, or stopping the whole
pool during an outage loses such changes (the last names them in an ERROR line).

Where L2 lives: under Ray, in Ray's shared-memory object store. A worker on this node
puts the blocks of a save into one object itself (:meth:`put_block_refs`), which L2
keeps as it is (the worker owns it; L2's views stay valid after the worker exits); the
blocks of a put from another node, or of one read from Redis, are copied once into one
object this replica owns. Either is a ``_Resident``; L2 keeps read-only views of it. A
worker's read (:meth:`get_block_refs`) then returns references to those objects instead
of the bytes: on the same node the worker maps them without a copy, on another node Ray
moves them. Without Ray (tests, tools) L2 holds the blocks in this process's memory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import uuid
from collections import OrderedDict, defaultdict
from typing import Callable, Iterable, Optional, Sequence

import numpy as np
from redis.exceptions import ResponseError

from opentelemetry import trace

from app import telemetry
from app.config import AppConfig, DataPlaneConfig
from app.errors import ConflictError, InvalidRequestError, NotFoundError, ServiceUnavailableError
from app.host_memory import minor_faults
from app.object_store import Prefault
from app.serve_context import DrainsOnStop, cancel_call, named_actor_alive
from deployments.compute.engines.kv import TIER_L2, TIER_L3, TIER_NONE, PrefixHit
from deployments.dataplane import keys
from deployments.dataplane.blocks import BlockChecks, CorruptBlockError, check_block, pack_blocks, unpack_blocks
from deployments.dataplane.redis_store import RedisRefused, RedisStore, RedisUnavailable, UnreadableSessionRecord
from deployments.dataplane.tiers import Evicted, MemoryTier
from deployments.dataplane.types import InRedis, SessionRecord, new_session_id

logger = logging.getLogger("ray.serve")

# Sessions cached in memory while Redis is up (the degraded-mode fallback); unsynced
# ones are never dropped by this bound.
MAX_CACHED_SESSIONS = 100_000
# Blocks per Redis round trip in write-behind and resync.
WRITE_BATCH = 256
# How long a session delete waits for every replica to drop its blocks from L2, and
# every worker replica from its L1.
DROP_BROADCAST_TIMEOUT_S = 5.0
# Chain roots kept per tenant for publishing while Redis is unreachable.
MAX_PENDING_ROOTS = 100_000

SessionKey = tuple[str, str]  # (tenant, session id)

# The two Redis roles (``dataplane.redis``, ``dataplane.kv_redis``), each degraded apart.
SESSIONS = "sessions"
KV = "kv"

# How long put_block_refs waits for the caller's object to reach this replica's node.
PUT_REF_FETCH_TIMEOUT_S = 30.0


class _Resident:
    """Blocks held in one object of Ray's object store, which this replica owns or (a
    worker's put on this node) borrows: the reference (the object lives while this does),
    the read-only arrays of its blocks, mapped here, and which array a stored L2 value is.
    L2 accounts the object as one shared buffer (group)."""

    __slots__ = ("ref", "views", "nbytes", "_index")

    def __init__(self, ref, arrays: list):
        self.ref = ref
        self.views = [memoryview(a).toreadonly() for a in arrays]
        self.nbytes = sum(len(v) for v in self.views)
        self._index = {id(v): i for i, v in enumerate(self.views)}

    def index_of(self, view) -> Optional[int]:
        i = self._index.get(id(view))
        return i if i is not None and self.views[i] is view else None


def _block_views(blocks, lengths) -> list:
    """uint8 arrays viewing ``blocks`` (bytes-likes; no copy), one per length in
    ``lengths``: TypeError for one that is not bytes-like, ValueError for sizes that are
    not the lengths."""
    arrays = [np.frombuffer(b, dtype=np.uint8) for b in blocks]
    if [len(a) for a in arrays] != [int(n) for n in lengths]:
        raise ValueError("the arrays' sizes are not the lengths given")
    return arrays


def _own_blocks(blocks: list, object_store: bool) -> tuple[list, Optional[_Resident]]:
    """This replica's own copy of ``blocks`` (bytes-like), made once: one object in Ray's
    object store (views of it, and its ``_Resident``), else one array in this process's
    memory (views of it, shared by L2 as one buffer)."""
    import ray

    if not blocks:
        return [], None
    arrays = [np.frombuffer(b, dtype=np.uint8) for b in blocks]
    if object_store:
        # A list of arrays: Ray copies each straight into the one object (no packing
        # copy first), and ray.get maps them back without a copy.
        ref = ray.put(arrays)
        resident = _Resident(ref, ray.get(ref))
        return list(resident.views), resident
    owned = np.concatenate(arrays)
    return unpack_blocks(memoryview(owned).toreadonly(), [len(a) for a in arrays]), None


def _settle(pending: dict, key, done: set) -> None:
    """Take what one write carried (``done``) out of ``pending[key]``; members added while
    it was in flight stay for the next pass."""
    left = pending.get(key)
    if left is not None:
        left.difference_update(done)
        if not left:
            del pending[key]


def _copy(rec: SessionRecord) -> SessionRecord:
    return dataclasses.replace(rec, messages=list(rec.messages))


class _Metrics:
    """ray.util.metrics when running under Ray; no-ops otherwise (unit tests)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        if not enabled:
            return
        from ray.util import metrics as m

        self.hits = m.Counter("llm_dataplane_block_hits", "KV blocks found, by tier.", tag_keys=("tier",))
        self.misses = m.Counter("llm_dataplane_block_misses", "KV block lookups that found nothing.")
        self.corrupt = m.Counter("llm_dataplane_corrupt_blocks", "Blocks that failed their checksum, by tier.", tag_keys=("tier",))
        self.bytes_in = m.Counter("llm_dataplane_bytes_in", "Block bytes stored by clients.")
        self.bytes_out = m.Counter("llm_dataplane_bytes_out", "Block bytes returned to clients, by tier.", tag_keys=("tier",))
        self.handoff_bytes = m.Counter(
            "llm_dataplane_handoff_bytes",
            "Block bytes handed to workers, by mode: ref (a reference into this replica's "
            "object-store copy, no copy made) or inline (copied into the reply).",
            tag_keys=("mode",),
        )
        self.put_bytes = m.Counter(
            "llm_dataplane_put_bytes",
            "Block bytes workers put by reference (put_block_refs), by mode: ref (kept as "
            "the worker's object, no copy: a worker on this node) or copy (copied into an "
            "object of this replica: a worker on another node).",
            tag_keys=("mode",),
        )
        self.l2_used = m.Gauge("llm_dataplane_l2_used_bytes", "Bytes held in the L2 memory tier.")
        self.evictions = m.Counter("llm_dataplane_l2_evictions", "Blocks evicted from L2.")
        self.dropped = m.Counter("llm_dataplane_dropped_blocks", "Dirty blocks dropped because Redis was unreachable.")
        self.degraded = m.Gauge(
            "llm_dataplane_degraded",
            "1 while this replica cannot reach a Redis server, by server (sessions, kv).",
            tag_keys=("server",),
        )
        self.refusing_writes = m.Gauge(
            "llm_dataplane_redis_refusing_writes",
            "1 while a Redis server that this replica reaches refuses writes (full, a failed "
            "persistence write, a read-only replica), by server (sessions, kv).",
            tag_keys=("server",),
        )
        self.refused_writes = m.Counter(
            "llm_dataplane_redis_refused_writes",
            "Calls whose write a Redis server refused (nothing written; the reconnect "
            "loop's write probe, one a reconnect interval, included), by server.",
            tag_keys=("server",),
        )
        self.prefetched = m.Counter("llm_dataplane_prefetched_blocks", "Blocks brought from L3 to L2 ahead of use.")
        self.prefetch_used = m.Counter("llm_dataplane_prefetch_used_blocks", "Prefetched blocks later read by a worker.")
        self.handoff_direct_l3 = m.Counter(
            "llm_dataplane_handoff_direct_l3_blocks",
            "L3 blocks of a read left to the worker, which reads them from Redis itself (dataplane.direct_l3_reads).",
        )
        self.promoted = m.Counter(
            "llm_dataplane_promoted_blocks",
            "Blocks a worker read from Redis itself, then brought up to L2 on its word, by where L2's copy came "
            "from (worker: the bytes the worker read, handed over through the object store; redis: read again).",
            tag_keys=("source",),
        )
        self.written_behind = m.Counter("llm_dataplane_written_behind_blocks", "Blocks written from L2 to Redis.")
        self.write_behind_deferred = m.Counter(
            "llm_dataplane_write_behind_deferred",
            "Write-behind passes held back while blocks kept arriving (write_behind_yield_ms).",
        )
        self.roots_published = m.Counter(
            "llm_dataplane_roots_published",
            "Chain roots (first block hashes) published to Redis for the routers' root index.",
        )
        self.transfer_seconds = m.Histogram(
            "llm_dataplane_block_transfer_seconds",
            "Time a block get or put spends in the data plane (Redis included, Serve hop not), by op and tier.",
            boundaries=telemetry.LATENCY_BUCKETS_S,
            tag_keys=("op", "tier"),
        )
        self.l2_compactions = m.Counter(
            "llm_dataplane_l2_compactions", "Shared L2 buffers copied out because most of their blocks were gone."
        )
        self.drain_sessions = m.Counter(
            "llm_dataplane_drain_sessions",
            "Sessions with changes only a stopping replica's memory held (from a Redis outage), by "
            "outcome: written_back, handed_off (to the replica that owns them next), lost.",
            tag_keys=("outcome",),
        )
        self.adopted_sessions = m.Counter(
            "llm_dataplane_adopted_sessions", "Sessions' unsynced state taken over from a stopping replica."
        )
        self.outage_backups = m.Counter(
            "llm_dataplane_outage_backups",
            "Session changes made during a sessions-Redis outage, by whether a copy reached the "
            "session's next owner before the change was acknowledged: sent, failed.",
            tag_keys=("outcome",),
        )
        self.backup_sessions_taken = m.Counter(
            "llm_dataplane_backup_sessions_taken",
            "Copies of another replica's outage session changes this replica took (back_up).",
        )
        self.backup_claims = m.Counter(
            "llm_dataplane_backup_claims",
            "Changes asked of a session this replica holds only a copy of (back_up), by "
            "outcome: claimed (its owner gone: the copy is this replica's now) or refused (a "
            "503: the owner lives, and two replicas taking turns would fork the session).",
            tag_keys=("outcome",),
        )
        self.deleted_session_blocks = m.Counter(
            "llm_dataplane_deleted_session_blocks",
            "Blocks that arrived for a session after its delete (a worker's export that "
            "came after the client's DELETE), erased at once.",
        )
        self.append_replays = m.Counter(
            "llm_dataplane_session_append_replays",
            "Session appends made again after they had landed (same turn id), answered as their success.",
        )

    def inc(self, name: str, value: float = 1, tags: Optional[dict] = None) -> None:
        if self.enabled and value:
            getattr(self, name).inc(value, tags=tags)

    def set(self, name: str, value: float, tags: Optional[dict] = None) -> None:
        if self.enabled:
            getattr(self, name).set(value, tags=tags)

    def observe(self, name: str, value: float, tags: Optional[dict] = None) -> None:
        if self.enabled:
            getattr(self, name).observe(value, tags=tags)


class DataPlane(DrainsOnStop):
    """Serve deployment class (bound by ``dataplane_deployment``)."""

    def __init__(
        self,
        config: dict,
        *,
        store_factory: Optional[Callable[[DataPlaneConfig], RedisStore]] = None,
        enable_metrics: bool = True,
        object_store: Optional[bool] = None,
        worker_deployment: Optional[str] = None,
    ):
        """``worker_deployment``: the deployment of this application whose replicas run
        engines with their own L1 (``app.builder.l1_worker_deployment``), which a
        session's delete reaches too; None: no such L1 (or none to reach)."""
        app_config = AppConfig.model_validate(config)
        telemetry.setup(app_config.telemetry, "dataplane")
        self._cfg: DataPlaneConfig = app_config.dataplane
        self._l2 = MemoryTier(
            self._cfg.l2_capacity_bytes,
            high_watermark=self._cfg.high_watermark,
            low_watermark=self._cfg.low_watermark,
            policy=self._cfg.eviction_policy,
        )
        self._store = (store_factory or self._default_store)(self._cfg)
        # L2 in Ray's object store (None: whenever Ray is running, as in a replica).
        if object_store is None:
            import ray

            object_store = ray.is_initialized()
        self._object_store = object_store
        self._node: Optional[str] = None  # this replica's Ray node (_node_id)
        # L2 lives in the object store: map its pages now, not a fault per 4 KiB per put.
        self._prefault = (
            Prefault(app_config.serve_runtime.prefault_object_store_bytes, who="DataPlane")
            if object_store
            else None
        )
        self._sessions: OrderedDict[SessionKey, SessionRecord] = OrderedDict()
        self._dirty_sessions: set[SessionKey] = set()  # newer in memory than in Redis
        self._deleted_sessions: set[SessionKey] = set()  # deleted while Redis was down
        # Copies of sessions another replica changed during an outage (back_up), with
        # that replica's ring name: written back like this replica's own, then dropped
        # from memory (not ours to cache); changed here only once that replica is gone.
        self._backups: dict[SessionKey, Optional[str]] = {}
        # Ring name -> when it was last found alive (_replica_alive), for a second.
        self._alive_seen: dict[str, float] = {}
        self._backup_warned_at = 0.0
        self._side_tasks: set[asyncio.Task] = set()
        self._pending_session_blocks: dict[SessionKey, set[str]] = defaultdict(set)
        # Writes of L2 blocks to the KV server under way, each with the keys that L2
        # dropped meanwhile (_write_blocks erases those again).
        self._writes_in_flight: dict[int, set[str]] = {}
        self._write_tokens = itertools.count()
        # Per Redis server (SESSIONS: the durable one; KV: the blocks' one, the same
        # server unless dataplane.kv_redis is set): unreachable since when. A KV outage
        # keeps sessions durable in theirs, and the reverse.
        self._degraded_since: dict[str, Optional[float]] = {SESSIONS: None, KV: None}
        # Per server: refusing writes (reachable, but full or read-only) since when;
        # cleared when the reconnect loop's write probe is taken again (_check_writes).
        self._refusing_since: dict[str, Optional[float]] = {SESSIONS: None, KV: None}
        self._probe_key = keys.probe_key(uuid.uuid4().hex[:16])
        self._probe_writes = True
        # Session block-list members whose blocks a session delete could not erase from
        # the KV server while it was down, by tenant.
        self._blocks_to_delete: dict[str, set[str]] = defaultdict(set)
        self._m = _Metrics(enable_metrics)
        self._tracer = telemetry.tracer(__name__)
        self._counts: dict[str, int] = defaultdict(int)
        # When blocks were last put, and when the oldest block not yet written behind was
        # (about): the write-behind's yield to a burst of puts (_write_behind_due).
        self._last_put_at = 0.0
        self._dirty_since: Optional[float] = None
        # L2 keys brought up by prefetch() and not yet read (bounded by L2's own size:
        # entries of evicted keys are dropped on eviction).
        self._prefetched: set[str] = set()
        # Chain roots stored or hit since the last publish, by tenant (root_index.py);
        # kept while Redis is down and published once it is back.
        self._roots: dict[str, set[str]] = defaultdict(set)
        self._tasks: list[asyncio.Task] = []
        self._peers = None
        # The workers whose L1 a session's delete reaches; the handle is made at the
        # first delete.
        self._worker_deployment = worker_deployment
        self._workers = None
        self._started = False
        self._drain_started = False

    @staticmethod
    def _default_store(cfg: DataPlaneConfig) -> RedisStore:
        return RedisStore.from_config(cfg.redis, kv_ttl_s=cfg.kv_ttl_s, kv_cfg=cfg.kv_redis)

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Check Redis and start the write-behind and reconnect loops (idempotent).
        Called lazily by every method, so the class works without Serve too."""
        if self._started:
            return
        self._started = True
        if self._object_store:
            self._check_object_store_size()
        for server in self._servers():
            try:
                await self._store.ping(server)
                for name in self._linked(server):
                    self._m.set("degraded", 0, tags={"server": name})
            except RedisUnavailable as e:
                self._set_degraded(server, True, str(e))
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._write_behind_loop()),
            loop.create_task(self._reconnect_loop()),
        ]
        if self._cfg.root_index_sync_ms:
            self._tasks.append(loop.create_task(self._publish_roots_loop()))
        # The handle to the other replicas (for deleting a session's blocks on their
        # shard) is made now and used once, so its request router already knows every
        # replica when a delete needs the hash ring; a fresh one may not yet.
        self._peers = self._app_handle()
        if self._peers is not None:
            self._tasks.append(loop.create_task(self._warm_peers()))

    def _check_object_store_size(self) -> None:
        """One warning if L2 cannot fit in this node's object store (it still works:
        Ray spills what does not fit to disk, and reads of those blocks get slower)."""
        try:
            import ray

            node_id = ray.get_runtime_context().get_node_id()
            store = next(
                (n.get("ObjectStoreMemory") or n.get("Resources", {}).get("object_store_memory")
                 for n in ray.nodes() if n.get("NodeID") == node_id),
                None,
            )
        except Exception:  # noqa: BLE001 - a sizing hint only
            return
        if store and self._cfg.l2_capacity_bytes > store:
            logger.warning(
                "DataPlane: L2 capacity %d bytes exceeds this node's object store (%d bytes), "
                "where L2 lives: blocks past it spill to disk. Raise `ray start "
                "--object-store-memory` on data nodes (replicas on the node x l2_capacity_bytes).",
                self._cfg.l2_capacity_bytes, int(store),
            )

    async def drain(self) -> dict:
        """What Serve's stop of the replica (scale-down, redeploy, node drain) runs, after
        the calls in flight finished (``DrainsOnStop.__del__``). Leave nothing that only
        this replica's memory holds, within
        ``dataplane.drain_timeout_s``. First write it back: blocks not yet written
        behind, and what a Redis outage kept in memory (turns, creates and deletes of
        sessions, their block lists, blocks a delete could not erase), if the server
        answers now. What it cannot take yet is handed, session by session, to the
        replica that owns the session once this one is gone (:meth:`adopt`), which
        writes it back when the server returns. An acknowledged turn is lost only if
        neither works (no other replica: the whole pool is stopping during an outage);
        then an ERROR line names the sessions. Returns what happened, by kind."""
        self._drain_started = True
        for t in self._tasks:
            t.cancel()
        self._tasks = []
        outcome = {"written_back": 0, "handed_off": 0, "lost_sessions": 0, "lost_blocks": 0}
        if not self._started:
            await self._store.close()
            return outcome
        deadline = time.monotonic() + self._cfg.drain_timeout_s
        before = self._unsynced_session_keys()
        for server in self._servers():
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    if self._down(server):
                        await self._store.ping(server)
                        await self._resync(server)
                    elif KV in self._linked(server):
                        await self._redis(KV, self._write_dirty_blocks)
            except (RedisUnavailable, RedisRefused, TimeoutError) as e:
                logger.warning("DataPlane drain: the %s Redis could not take this replica's writes (%s)", server, getattr(e, "reply", "") or str(e) or type(e).__name__)
        left = self._unsynced_session_keys()
        outcome["written_back"] = len(before - left)
        if left or self._blocks_to_delete:
            handed, lost = await self._hand_over_unsynced(left, deadline)
            outcome["handed_off"] = len(handed)
            outcome["lost_sessions"] = len(lost)
            self._m.inc("drain_sessions", len(handed), tags={"outcome": "handed_off"})
            self._m.inc("drain_sessions", len(lost), tags={"outcome": "lost"})
            if lost:
                logger.error(
                    "DataPlane drain: %d sessions' changes made during the Redis outage "
                    "(acknowledged turns, creates or deletes) could neither be written "
                    "back nor handed to another replica and are lost: %s",
                    len(lost), ", ".join(f"{t}/{sid}" for t, sid in sorted(lost)[:20]),
                )
        outcome["lost_blocks"] = self._l2.num_dirty
        if outcome["lost_blocks"]:
            # A cache: a later miss recomputes them.
            self._m.inc("dropped", outcome["lost_blocks"])
        self._m.inc("drain_sessions", outcome["written_back"], tags={"outcome": "written_back"})
        logger.info(
            "DataPlane drain: sessions written back %d, handed to other replicas %d, lost %d; "
            "KV blocks never written behind (dropped) %d",
            outcome["written_back"], outcome["handed_off"], outcome["lost_sessions"], outcome["lost_blocks"],
        )
        await self._store.close()
        return outcome

    def _unsynced_session_keys(self) -> set[SessionKey]:
        return set(self._dirty_sessions) | set(self._deleted_sessions) | set(self._pending_session_blocks)

    def _replica_key(self) -> Optional[str]:
        try:
            from ray import serve

            from deployments.dataplane.routing import replica_key

            return replica_key(serve.get_replica_context().replica_id)
        except Exception:
            return None

    async def _hand_over_unsynced(self, unsynced: set[SessionKey], deadline: float) -> tuple[set[SessionKey], set[SessionKey]]:
        """Give each unsynced session's state to its next owner (and the blocks that
        deletes could not erase to any other replica). Returns (handed, lost)."""
        handle = self._peers
        me = self._replica_key()
        if handle is None or me is None:
            return set(), set(unsynced)
        now = time.time()
        limit = asyncio.Semaphore(16)

        async def give(key: SessionKey) -> bool:
            tenant, session_id = key
            rec = self._sessions.get(key) if key in self._dirty_sessions else None
            if rec is not None and rec.expired(now):
                rec = None
            deleted = key in self._deleted_sessions
            members = sorted(self._pending_session_blocks.get(key, ()))
            if rec is None and not deleted and not members:
                return True  # expired meanwhile: nothing to keep
            async with limit:
                try:
                    async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                        await handle.adopt.remote(
                            tenant, session_id, record=rec, deleted=deleted, block_members=members,
                            shard_key=session_id, exclude_replica=me,
                        )
                    return True
                except Exception as e:  # noqa: BLE001 - counted and logged as lost
                    logger.warning("DataPlane drain: could not hand session %s to another replica: %s", session_id, str(e) or type(e).__name__)
                    return False

        keys_ = sorted(unsynced)
        results = await asyncio.gather(*(give(k) for k in keys_))
        for tenant, members in list(self._blocks_to_delete.items()):
            try:
                async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                    await handle.adopt.remote(tenant, blocks_to_delete=sorted(members), exclude_replica=me)
            except Exception as e:  # noqa: BLE001 - a cache: they expire by kv_ttl_s
                logger.warning(
                    "DataPlane drain: %d blocks of deleted sessions stay in the KV Redis until they "
                    "expire (no other replica took them: %s)", len(members), str(e) or type(e).__name__,
                )
        handed = {k for k, ok in zip(keys_, results) if ok}
        return handed, set(keys_) - handed

    async def adopt(
        self,
        tenant: str,
        session_id: Optional[str] = None,
        *,
        record: Optional[SessionRecord] = None,
        deleted: bool = False,
        block_members: Sequence[str] = (),
        blocks_to_delete: Sequence[str] = (),
        shard_key: Optional[str] = None,
        exclude_replica: Optional[str] = None,
    ) -> None:
        """Take over what a stopping replica kept of one session in memory only: its
        record (newer than Redis's), its delete, the blocks not yet in its block list;
        or (no session) blocks whose erasure from the KV Redis is still due. Written back
        at once if the server answers, else kept like this replica's own until it does.
        ``exclude_replica`` is for the request router (never the sender itself)."""
        await self.start()
        if blocks_to_delete:
            self._blocks_to_delete[tenant].update(blocks_to_delete)
        if session_id is not None:
            key = (tenant, session_id)
            self._take(key, record, deleted)
            if block_members and key not in self._deleted_sessions:
                self._pending_session_blocks[key].update(block_members)
            self._backups.pop(key, None)  # ours now: the sender is gone
            self._m.inc("adopted_sessions")
        # Written back now where the server is up. Where it is down (or goes down
        # meanwhile, which marks it so) the reconnect loop's resync writes it once it
        # answers, as this replica's own.
        try:
            if session_id is not None and not self._down(SESSIONS):
                await self._redis(SESSIONS, self._resync_sessions)
            if blocks_to_delete and not self._down(KV):
                await self._redis(KV, self._delete_due_blocks)
        except (RedisUnavailable, RedisRefused):
            pass  # marked degraded or refusing by _redis: the reconnect loop takes over

    def _take(self, key: SessionKey, record: Optional[SessionRecord], deleted: bool) -> None:
        """Merge another replica's unsynced state of one session into this one's: a delete
        wins over any record (ids are never used twice), else the newer version."""
        if deleted:
            self._sessions.pop(key, None)
            self._dirty_sessions.discard(key)
            self._deleted_sessions.add(key)
        elif record is not None and key not in self._deleted_sessions:
            mine = self._sessions.get(key)
            if mine is None or mine.version < record.version:
                self._sessions[key] = _copy(record)
                self._sessions.move_to_end(key)
                self._dirty_sessions.add(key)

    async def back_up(
        self,
        tenant: str,
        session_id: str,
        *,
        record: Optional[SessionRecord] = None,
        deleted: bool = False,
        shard_key: Optional[str] = None,
        exclude_replica: Optional[str] = None,
    ) -> None:
        """Keep a copy of a session change that the replica owning the session made
        during a sessions outage (:meth:`_back_up`), routed here because this replica
        owns the session once that one is gone. The copy is written back like this
        replica's own changes (Redis keeps the newer version; a tombstone refuses a
        deleted session), and serves the session if its owner crashes meanwhile
        (:meth:`_claim_backup`); ``exclude_replica`` names that owner."""
        await self.start()
        key = (tenant, session_id)
        self._take(key, record, deleted)
        self._backups[key] = exclude_replica
        self._m.inc("backup_sessions_taken")
        if not self._down(SESSIONS):
            # The sender found Redis down and this replica has not (yet): try now, off
            # the sender's wait; a failure marks it down and the reconnect loop retries.
            task = asyncio.get_running_loop().create_task(self._write_back_now())
            self._side_tasks.add(task)
            task.add_done_callback(self._side_tasks.discard)

    async def _write_back_now(self) -> None:
        try:
            await self._redis(SESSIONS, self._resync_sessions)
        except (RedisUnavailable, RedisRefused):
            pass
        except Exception:  # noqa: BLE001 - the reconnect loop writes it later
            logger.exception("DataPlane: writing back a session copy failed")

    async def _claim_backup(self, key: SessionKey, what: str) -> None:
        """Before a change of a session this replica holds only a copy of (``back_up``):
        where the sessions Redis answers, the copy is written back first and Redis
        decides, as for any session. Else the copy is changed here only once the replica
        that sent it is gone; while it lives (this replica was reached because that one
        was full, or a router had not yet seen it) the change is a 503 to retry, since
        two replicas taking turns on one session would fork it, and the write-back would
        then keep one side and drop the other's acknowledged turns."""
        if key not in self._backups:
            return
        if not self._down(SESSIONS):
            try:
                await self._redis(SESSIONS, self._resync_sessions)
            except (RedisUnavailable, RedisRefused):
                pass
            if key not in self._backups:
                return
        owner = self._backups[key]
        if owner is not None and await self._replica_alive(owner):
            self._m.inc("backup_claims", tags={"outcome": "refused"})
            raise ServiceUnavailableError(
                f"session {key[1]!r} cannot be {what} on this server now: the session store is "
                "unreachable and the server that owns the session is busy; retry shortly",
                headers={"Retry-After": "1"},
            )
        if self._backups.pop(key, False) is not False:
            self._m.inc("backup_claims", tags={"outcome": "claimed"})
            logger.warning(
                "DataPlane: session %s is served from the copy held here: the replica that "
                "owned it during the sessions outage (%s) is gone", key[1], owner,
            )

    async def _replica_alive(self, replica: str) -> bool:
        """Whether this deployment's replica ``replica`` (its ring name) is alive: its
        actor is still registered with Ray (Serve never restarts a replica's actor; a
        dead one's name is released). Unsure (outside Serve, a GCS error) is alive. A
        live answer is kept for a second: refused callers retry, and each lookup is a
        GCS call."""
        seen = self._alive_seen.get(replica)
        if seen is not None and time.monotonic() - seen < 1.0:
            return True
        try:
            import ray

            from deployments.dataplane.routing import replica_actor_name

            name = replica_actor_name(ray.get_runtime_context().get_actor_name() or "", replica)
        except Exception:  # noqa: BLE001 - not in a Serve replica
            return True
        alive = await asyncio.to_thread(named_actor_alive, name)
        if alive:
            if len(self._alive_seen) > 64:
                self._alive_seen.clear()
            self._alive_seen[replica] = time.monotonic()
        return alive

    async def _back_up(self, tenant: str, session_id: str, *, record: Optional[SessionRecord] = None, deleted: bool = False) -> None:
        """Before a change that only this replica's memory holds (a sessions outage) is
        acknowledged: a copy on the replica that owns the session once this one is gone
        (:meth:`back_up`), so that this replica's crash loses no acknowledged turn.
        Best effort within ``dataplane.outage_backup_timeout_s``: with one replica, or
        none answering in time, the change is acknowledged anyway (counted, logged)."""
        timeout = self._cfg.outage_backup_timeout_s
        if timeout <= 0 or self._cfg.num_replicas < 2:
            return
        handle, me = self._peers, self._replica_key()
        if handle is None or me is None:
            return
        call = None
        with self._tracer.start_as_current_span(
            "dataplane.outage_backup", attributes={"llm.session.deleted": deleted}
        ) as span:
            try:
                async with asyncio.timeout(timeout):
                    call = handle.back_up.remote(
                        tenant, session_id, record=record, deleted=deleted,
                        shard_key=session_id, exclude_replica=me,
                    )
                    await call
            except Exception as e:  # noqa: BLE001 - acknowledged anyway: counted and logged
                cancel_call(call)
                span.set_status(trace.Status(trace.StatusCode.ERROR, type(e).__name__))
                self._m.inc("outage_backups", tags={"outcome": "failed"})
                now = time.monotonic()
                if now - self._backup_warned_at >= 10:
                    self._backup_warned_at = now
                    logger.warning(
                        "DataPlane: no other replica took a copy of session %s's change within "
                        "%.1fs (%s); it is acknowledged with this replica's memory as its only "
                        "copy until Redis is back (further failures within 10 s are only counted)",
                        session_id, timeout, str(e) or type(e).__name__,
                    )
                return
        self._m.inc("outage_backups", tags={"outcome": "sent"})

    # -- degraded mode ----------------------------------------------------------------

    def _servers(self) -> tuple[str, ...]:
        """The Redis servers to watch: one when sessions and blocks share it."""
        return (SESSIONS,) if self._store.shared else (SESSIONS, KV)

    def _linked(self, server: str) -> tuple[str, ...]:
        """The roles that go down and up with ``server`` (both when shared)."""
        return (SESSIONS, KV) if self._store.shared else (server,)

    @property
    def degraded(self) -> bool:
        """Some Redis server is unreachable (what /ready reports)."""
        return any(t is not None for t in self._degraded_since.values())

    def _down(self, server: str) -> bool:
        return self._degraded_since[server] is not None

    def _refusing(self, server: str) -> bool:
        return self._refusing_since[server] is not None

    def _mark(self, since: dict[str, Optional[float]], gauge: str, server: str, on: bool) -> Optional[float]:
        """Set (``on``) or clear a per-server state kept as "since when" (``since``), for
        ``server`` and the roles it shares, with its gauge. When it changed, when it had
        begun (now, if it begins now); None when nothing changed."""
        names = self._linked(server)
        if all((since[n] is not None) == on for n in names):
            return None
        began = min((since[n] or time.time()) for n in names)
        for n in names:
            since[n] = time.time() if on else None
            self._m.set(gauge, 1 if on else 0, tags={"server": n})
        return began

    def _set_degraded(self, server: str, degraded: bool, reason: str = "") -> None:
        since = self._mark(self._degraded_since, "degraded", server, degraded)
        if since is None:
            return
        names = self._linked(server)
        what = "Redis" if len(names) > 1 else f"the {server} Redis"
        if degraded:
            kept = "sessions and KV blocks" if len(names) > 1 else (
                "sessions (KV blocks still go to theirs)" if server == SESSIONS
                else "KV blocks (sessions still go to theirs)"
            )
            logger.warning(
                "DataPlane: %s unreachable (%s); keeping %s in memory only (degraded), "
                "retrying every %.1fs",
                what,
                reason,
                kept,
                self._cfg.redis.reconnect_interval_s,
            )
        else:
            logger.info(
                "DataPlane: %s reachable again after %.1fs; resynchronised, degraded mode off",
                what,
                time.time() - since,
            )

    async def _redis(self, server: str, coro_fn, /, *args, **kwargs):
        """Run one call of the store on ``server`` (SESSIONS or KV). Raises
        RedisUnavailable at once while that server is down, and marks it down when the
        call finds it gone."""
        if self._down(server):
            raise RedisUnavailable("degraded")
        try:
            return await coro_fn(*args, **kwargs)
        except RedisUnavailable as e:
            self._set_degraded(server, True, str(e))
            raise
        except RedisRefused as e:
            trace.get_current_span().set_attribute("llm.redis.refused", server)
            for name in self._linked(server):
                self._m.inc("refused_writes", tags={"server": name})
            self._set_refusing(server, e.reply)
            raise

    def _set_refusing(self, server: str, reply: Optional[str]) -> None:
        """Mark ``server`` (and the roles it shares) as refusing writes (``reply``: what
        it said) or, with None, as taking them again; logged once per change."""
        refusing = reply is not None
        since = self._mark(self._refusing_since, "refusing_writes", server, refusing)
        if since is None:
            return
        names = self._linked(server)
        what = "Redis" if len(names) > 1 else f"the {server} Redis"
        if refusing:
            waits = " and ".join(
                ({SESSIONS: "session changes get a 503", KV: "KV blocks stay in L2"})[n] for n in sorted(names, reverse=True)
            )
            logger.warning(
                "DataPlane: %s refuses writes (%s): %s until it takes a write again (probed "
                "every %.1fs); reads go on", what, reply, waits, self._cfg.redis.reconnect_interval_s,
            )
        else:
            logger.info("DataPlane: %s takes writes again after %.1fs", what, time.time() - since)

    async def _reconnect_loop(self) -> None:
        # Probes while up too (_check_writes), so a replica with no traffic still
        # reports an outage, or a server that refuses writes.
        while True:
            await asyncio.sleep(self._cfg.redis.reconnect_interval_s)
            for server in self._servers():
                if not self._down(server):
                    try:
                        await self._check_writes(server)
                    except (RedisUnavailable, RedisRefused):
                        pass
                    except Exception:  # a bug here must not end the loop
                        logger.exception("DataPlane: checking the %s Redis, or catching up after its refusal, failed", server)
                    continue
                try:
                    await self._store.ping(server)
                    await self._resync(server)
                except RedisUnavailable:
                    continue
                except Exception:  # a bug here must not end the loop
                    logger.exception("DataPlane: resync failed")

    async def _check_writes(self, server: str) -> None:
        """The up server still answers, and takes writes: a write probe (so every
        replica, not only one whose write was refused, reports a refusal, in /ready and
        its metric). Once it takes writes again after a refusal, what waited for them is
        written (``_resync``). Where an ACL forbids the probe's key, a PING instead, and
        a refusal is then assumed over at each interval (the next refused write marks
        it again)."""
        if not self._probe_writes:
            await self._redis(server, self._store.ping, server)
        else:
            try:
                await self._redis(server, self._store.probe_write, server, self._probe_key)
            except ResponseError as e:  # e.g. an ACL without SET on this key: ping instead
                self._probe_writes = False
                logger.warning(
                    "DataPlane: the %s Redis refuses the write probe (%s); a refusal of writes is "
                    "noticed at the first refused write instead", server, e,
                )
                return
        if self._refusing(server):
            self._set_refusing(server, None)
            # What waited for writes: blocks to write behind or erase, session block
            # lists to link.
            await self._redis(server, self._resync, server)

    async def _resync(self, server: str) -> None:
        """Write back to ``server`` what was kept in memory while it was down, then mark
        it up. Loops until nothing is left, then flips the flag with no await in between:
        a request that changed memory during an await is written by the next pass."""
        roles = self._linked(server)
        while True:
            if SESSIONS in roles:
                await self._resync_sessions()
            if KV in roles:
                await self._delete_due_blocks()
                await self._write_dirty_blocks()
            left = (SESSIONS in roles and (self._deleted_sessions or self._dirty_sessions or self._pending_session_blocks)) or (
                KV in roles and (self._blocks_to_delete or self._l2.num_dirty)
            )
            if not left:
                self._set_degraded(server, False)
                return

    async def _delete_due_blocks(self) -> None:
        """Erase from the KV server the blocks of deleted sessions that it missed."""
        for tenant, members in list(self._blocks_to_delete.items()):
            done = set(members)
            await self._store.delete_member_blocks(tenant, sorted(done))
            _settle(self._blocks_to_delete, tenant, done)

    async def _resync_sessions(self) -> None:
        # Requests keep changing memory during each await here (the flag is still up):
        # what is marked done after a write is only what that write carried.
        for key in list(self._deleted_sessions):
            # A tombstone even where Redis has no record (created during the outage): a
            # copy on another replica (back_up) must not bring the session back.
            await self._delete_stored_session(*key, set(), tombstone_s=self._cfg.sessions.cache_ttl_s)
            self._deleted_sessions.discard(key)  # a repeat meanwhile is done by this one
        for key in list(self._dirty_sessions):
            rec = self._sessions.get(key)
            if rec is None or rec.expired(time.time()):
                self._dirty_sessions.discard(key)
                continue
            written = _copy(rec)
            await self._store.put_session_if_newer(written)
            if self._sessions.get(key) is rec and rec.version == written.version:
                self._dirty_sessions.discard(key)  # else a turn came meanwhile: next pass
        for key, members in list(self._pending_session_blocks.items()):
            done = set(members)
            await self._link_session_blocks(key[0], key[1], sorted(done))
            _settle(self._pending_session_blocks, key, done)
        for key in list(self._backups):
            if key not in self._dirty_sessions and key not in self._deleted_sessions:
                # Written back: the owner serves it from Redis; a copy kept here would be
                # stale by its next turn.
                self._backups.pop(key, None)
                self._sessions.pop(key, None)

    async def _delete_stored_session(self, tenant: str, session_id: str, members: set[str], *, tombstone_s: int = 0) -> bool:
        """Delete a session from the sessions server: its record (a tombstone in its
        place; ``tombstone_s``: see ``RedisStore.delete_session``), then its blocks (those
        listed there, added to ``members``, and those already in it) from the L2 of the
        replicas holding them and then from the KV server, then the list (the blocks
        before their list: the list is what finds them). L2 goes first: a dirty block
        that stayed there would be written behind to the KV server after its erasure (a
        write already under way when L2 drops it erases it again, ``_write_blocks``);
        and the tombstone first, so that a block exported after this finds its session
        deleted (``_link_session_blocks``). True if the record existed. Raises
        RedisUnavailable when the sessions server fails."""
        existed = await self._store.delete_session(tenant, session_id, tombstone_s=tombstone_s)
        members.update(await self._store.session_block_members(tenant, session_id))
        await self._drop_blocks_everywhere(tenant, members)
        await self._erase_member_blocks(tenant, members)
        await self._store.forget_session_blocks(tenant, session_id)
        return existed

    async def _erase_member_blocks(self, tenant: str, members: Iterable[str]) -> None:
        """Delete the blocks of session block-list ``members`` from the KV server, or,
        while it is down, remember them for when it is back."""
        members = list(members)
        if not members:
            return
        try:
            await self._redis(KV, self._store.delete_member_blocks, tenant, members)
        except (RedisUnavailable, RedisRefused):
            self._blocks_to_delete[tenant].update(members)

    # -- KV blocks: write-behind ---------------------------------------------------------

    async def _kv_loop(self, period_ms: int, pending: Callable[[], object], work, what: str) -> None:
        """Every ``period_ms``: ``work`` against the KV Redis when there is ``pending``
        work and that server is up and takes writes (an outage or a refusal leaves the
        work for later: the reconnect loop's resync does it once the server is back)."""
        while True:
            await asyncio.sleep(period_ms / 1000)
            if self._down(KV) or self._refusing(KV) or not pending():
                continue
            try:
                await self._redis(KV, work)
            except (RedisUnavailable, RedisRefused):
                pass
            except Exception:
                logger.exception("DataPlane: %s failed", what)

    def _write_behind_loop(self):
        return self._kv_loop(self._cfg.sync_interval_ms, self._write_behind_due, self._write_dirty_blocks, "write-behind")

    def _write_behind_due(self) -> bool:
        """Whether the write-behind pass runs now: blocks are waiting and no burst of
        puts holds it back (``write_behind_yield_ms``): on 2 cores the Redis writes of a
        burst's blocks (this replica's sends and the server's work) took the CPU that the
        burst's own puts and the reads beside them were waiting for."""
        if not self._l2.num_dirty:
            self._dirty_since = None
            return False
        cfg, now = self._cfg, time.monotonic()
        if (
            cfg.write_behind_yield_ms > 0
            and now - self._last_put_at < cfg.write_behind_yield_ms / 1000
            and now - (self._dirty_since if self._dirty_since is not None else now) < cfg.write_behind_max_delay_ms / 1000
            and self._l2.used_bytes < cfg.low_watermark * cfg.l2_capacity_bytes
        ):
            self._counts["write_behind_deferred"] += 1
            self._m.inc("write_behind_deferred")
            return False
        return True

    async def _write_blocks(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Write L2 blocks to the KV server. Those that L2 dropped while the write was
        under way (``drop_l2_blocks``: their session was deleted) are erased from it
        again once it is done."""
        by_tenant: dict[str, list[tuple[str, bytes]]] = defaultdict(list)
        for key, value in items:
            tenant, block_hash = keys.split_block_key(key)
            by_tenant[tenant].append((block_hash, value))
        token = next(self._write_tokens)
        dropped = self._writes_in_flight[token] = set()
        try:
            for tenant, blocks in by_tenant.items():
                for start in range(0, len(blocks), WRITE_BATCH):
                    chunk = blocks[start : start + WRITE_BATCH]
                    await self._store.put_blocks(tenant, [h for h, _ in chunk], [v for _, v in chunk])
        finally:
            del self._writes_in_flight[token]
            if dropped:
                for tenant, blocks in by_tenant.items():
                    gone = [h for h, _ in blocks if keys.block_key(tenant, h) in dropped]
                    if gone:
                        await self._erase_member_blocks(tenant, [keys.session_block_member(h, h) for h in gone])

    async def _write_dirty_blocks(self) -> int:
        items = self._l2.dirty_items()
        if not items:
            return 0
        await self._write_blocks(items)
        for key, value in items:
            self._l2.mark_clean(key, value)  # unless re-put meanwhile
        self._m.inc("written_behind", len(items))
        self._counts["written_behind"] += len(items)
        # Blocks put while this pass wrote are now the oldest unwritten (about).
        self._dirty_since = time.monotonic() if self._l2.num_dirty else None
        return len(items)

    def _note_root(self, tenant: str, root: str) -> None:
        """A chain root to publish (bounded while Redis is down: past the bound a root
        stays unpublished, and a request that does not continue a session recomputes
        that chain)."""
        pending = self._roots[tenant]
        if self._cfg.root_index_sync_ms and len(pending) < MAX_PENDING_ROOTS:
            pending.add(root)

    def _publish_roots_loop(self):
        return self._kv_loop(
            self._cfg.root_index_sync_ms, lambda: self._roots, self._publish_roots, "publishing chain roots"
        )

    async def _publish_roots(self) -> int:
        """Publish the pending chain roots (a failed tenant's stay pending)."""
        published = 0
        for tenant in list(self._roots):
            roots = self._roots.pop(tenant)
            try:
                # Scored by the store's clock (wall time), as its TTL pruning is.
                await self._store.add_kv_roots(tenant, sorted(roots))
            except BaseException:
                self._roots[tenant] |= roots
                raise
            published += len(roots)
        self._m.inc("roots_published", published)
        self._counts["roots_published"] += published
        return published

    async def _handle_evicted(self, evicted: list[Evicted]) -> None:
        """Hand dirty evictions to Redis before they are gone; count the rest."""
        if self._l2.num_compactions != self._counts["l2_compactions"]:
            self._m.inc("l2_compactions", self._l2.num_compactions - self._counts["l2_compactions"])
            self._counts["l2_compactions"] = self._l2.num_compactions
        if not evicted:
            return
        self._prefetched.difference_update(e.key for e in evicted)
        self._counts["evictions"] += len(evicted)
        self._m.inc("evictions", len(evicted))
        dirty = [(e.key, e.value) for e in evicted if e.dirty]
        if dirty:
            try:
                await self._redis(KV, self._write_blocks, dirty)
            except (RedisUnavailable, RedisRefused) as e:
                self._counts["dropped_blocks"] += len(dirty)
                self._m.inc("dropped", len(dirty))
                logger.warning(
                    "DataPlane: dropped %d unsynced KV blocks evicted from L2 while Redis %s",
                    len(dirty), "refuses writes" if isinstance(e, RedisRefused) else "is unreachable",
                )
        self._m.set("l2_used", self._l2.used_bytes)

    async def _put_l2(self, key: str, value: bytes, *, dirty: bool, group: object = None) -> None:
        await self._handle_evicted(self._l2.put(key, value, dirty=dirty, group=group))

    # -- KV blocks: public API ----------------------------------------------------------

    async def put_blocks(
        self,
        tenant: str,
        hashes: list[str],
        blocks: list[bytes],
        session_id: Optional[str] = None,
        *,
        shard_key: Optional[str] = None,
        exclude_replica: Optional[str] = None,
    ) -> int:
        """Store encoded blocks in L2 (written behind to Redis). Returns how many: each
        block is checked (header, checksum) on its way in, and a corrupt one is left out
        and counted (``corrupt_blocks``, metric tier ``put``); none if the session was
        deleted meanwhile (``_link_session_blocks``). ``exclude_replica`` is for the
        request router (the put then lands where it would with that replica full)."""
        await self.start()
        if len(hashes) != len(blocks):
            raise InvalidRequestError(
                f"{len(hashes)} hashes but {len(blocks)} blocks", param="blocks"
            )
        return await self._store_blocks(tenant, hashes, list(blocks), session_id, shard_key)

    async def _store_blocks(
        self,
        tenant: str,
        hashes: list[str],
        blocks: list,
        session_id: Optional[str],
        shard_key: Optional[str],
        group: Optional[_Resident] = None,
        mode: str = "call",
    ) -> int:
        # Every block is checked once, here or when read from Redis: L2 holds only
        # checked blocks, so neither L2 reads nor the worker's decode (CheckedBlocks)
        # check the checksum again.
        started = time.perf_counter()
        nbytes = sum(len(b) for b in blocks)
        with self._tracer.start_as_current_span(
            "dataplane.put_blocks",
            # mode: how the blocks came (call: in the call's arguments; ref: a worker's
            # object kept as it is; copy: a worker's object copied, from another node).
            attributes={"llm.kv.blocks": len(hashes), "llm.kv.bytes": nbytes, "llm.kv.put_mode": mode},
        ):
            stored = 0
            for h, b in zip(hashes, blocks):
                if not self._verify(b, "put"):
                    continue
                await self._put_l2(keys.block_key(tenant, h), b, dirty=True, group=group)
                stored += 1
            if stored:
                # ``shard_key`` is the chain's root (connector.py), hashes[0] for a chain
                # stored from its start.
                self._note_root(tenant, shard_key or hashes[0])
                # What the write-behind's yield goes by (_write_behind_due).
                self._last_put_at = time.monotonic()
                if self._dirty_since is None:
                    self._dirty_since = self._last_put_at
        self._m.observe("transfer_seconds", time.perf_counter() - started, tags={"op": "put", "tier": TIER_L2})
        self._counts["bytes_in"] += nbytes
        self._m.inc("bytes_in", nbytes)
        self._m.set("l2_used", self._l2.used_bytes)
        if session_id and hashes:
            members = [keys.session_block_member(shard_key or hashes[0], h) for h in hashes]
            try:
                if not await self._redis(SESSIONS, self._link_session_blocks, tenant, session_id, members):
                    return 0
            except (RedisUnavailable, RedisRefused):
                # Linked when the server is back or takes writes again (_resync); a
                # delete meanwhile finds them here.
                self._pending_session_blocks[(tenant, session_id)].update(members)
        return stored

    async def _link_session_blocks(self, tenant: str, session_id: str, members: Sequence[str]) -> bool:
        """List blocks under their session, which its delete erases. A session deleted
        meanwhile refuses them (its tombstone), and they are erased here (L2, then the
        KV server): a turn's blocks that its worker exported after the session's DELETE
        (exports run after the reply) must not outlive that delete. False then."""
        if await self._store.add_session_blocks(tenant, session_id, members, self._cfg.sessions.cache_ttl_s):
            return True
        self._counts["blocks_of_deleted_sessions"] += len(members)
        self._m.inc("deleted_session_blocks", len(members))
        logger.info(
            "DataPlane: %d blocks arrived for session %s after its delete; erased", len(members), session_id
        )
        await self._drop_blocks_everywhere(tenant, members)
        await self._erase_member_blocks(tenant, members)
        return False

    async def lookup_prefix(
        self,
        tenant: str,
        hashes: list[str],
        *,
        shard_key: Optional[str] = None,
        with_refs: bool = False,
        direct_l3: bool = False,
    ) -> PrefixHit:
        """The longest leading run of ``hashes`` held in L2 or L3; ``tier`` is the
        slowest tier among them. A Redis outage makes L3 look empty. ``with_refs``: when
        the whole run is in L2, or with ``direct_l3`` whatever tiers it is in, ``refs``
        carries the blocks as :meth:`get_block_refs` would (the worker's lookup and read
        in one call; handing out references copies nothing, so a worker that then
        recomputes instead has cost nothing here)."""
        await self.start()
        sizes: list[Optional[int]] = [self._l2.size_of(keys.block_key(tenant, h)) for h in hashes]
        tiers = [TIER_L2 if s is not None else TIER_NONE for s in sizes]
        missing = [i for i, s in enumerate(sizes) if s is None]
        if missing:
            try:
                l3 = await self._redis(KV, self._store.block_sizes, tenant, [hashes[i] for i in missing])
            except RedisUnavailable:
                l3 = [None] * len(missing)
            for i, size in zip(missing, l3):
                if size is not None:
                    sizes[i], tiers[i] = size, TIER_L3
        hit = PrefixHit(num_blocks=0)
        for size, tier in zip(sizes, tiers):
            if size is None:
                break
            hit.num_blocks += 1
            hit.num_bytes += size
            if tier == TIER_L3 or hit.tier == TIER_NONE:
                hit.tier = tier
        for tier in (TIER_L2, TIER_L3):
            n = tiers[: hit.num_blocks].count(tier)
            self._counts[f"lookup_hits_{tier}"] += n
            self._m.inc("hits", n, tags={"tier": tier})
        if hit.num_blocks < len(hashes):
            self._counts["lookup_misses"] += 1
            self._m.inc("misses")
        if hit.num_blocks:
            self._note_root(tenant, hashes[0])  # still in use: refreshed in the index
        if with_refs and hit.num_blocks and (hit.tier == TIER_L2 or direct_l3):
            run = hashes[: hit.num_blocks]
            # In L2 (unless evicted meanwhile), or in L3 for a caller that reads it.
            blocks = await self._read_blocks(tenant, run, read_l3=not direct_l3)
            if blocks is not None:
                hit.refs = self._hand_off(tenant, run, blocks)
        return hit

    async def _drop_from_l3(self, tenant: str, block_hash: str) -> None:
        """Delete a block (index entry and payload) from Redis; an outage or a refusal
        leaves it (its next read fails the check again)."""
        try:
            await self._redis(KV, self._store.delete_blocks, tenant, [block_hash])
        except (RedisUnavailable, RedisRefused):
            pass

    def _verify(self, data, tier: str, checks: Optional[BlockChecks] = None, index: int = 0) -> bool:
        """Whether ``data`` is a valid block (else counted and logged). ``checks``: the
        checks made as a read from Redis arrived, ``index`` this block's in that read."""
        try:
            if checks is None:
                check_block(data)
            elif (error := checks.error(index, data)) is not None:
                raise error
            return True
        except CorruptBlockError as e:
            self._counts["corrupt_blocks"] += 1
            self._m.inc("corrupt", tags={"tier": tier})
            logger.warning("DataPlane: corrupt KV block in %s treated as a miss: %s", tier, e)
            return False

    async def _read_blocks(self, tenant: str, hashes: list[str], *, read_l3: bool = True) -> Optional[list]:
        """Every block of ``hashes`` in order (L2, else L3 in one MGET, promoting into
        L2), or None if any is missing or corrupt (a corrupt block is deleted from
        Redis). Values are ``bytes`` or read-only memoryviews; blocks read from Redis
        together are copied once into one object (``_own_blocks``), which L2 keeps.
        ``read_l3=False``: blocks not in L2 are None, for a caller that reads them from
        Redis itself (nothing here checks that Redis has them)."""
        await self.start()
        started = time.perf_counter()
        with self._tracer.start_as_current_span(
            "dataplane.get_blocks", attributes={"llm.kv.blocks": len(hashes)}
        ) as span:
            out, tier = await self._read_blocks_traced(tenant, hashes, read_l3)
            span.set_attribute("llm.kv.tier", tier)
        self._m.observe("transfer_seconds", time.perf_counter() - started, tags={"op": "get", "tier": tier})
        return out

    async def _read_blocks_traced(self, tenant: str, hashes: list[str], read_l3: bool) -> tuple[Optional[list], str]:
        l2_keys = [keys.block_key(tenant, h) for h in hashes]
        out: list = [None] * len(hashes)
        for i, key in enumerate(l2_keys):
            data = self._l2.get(key)
            if data is None:
                continue
            if key in self._prefetched:
                # The prefetch brought this block up before the worker asked: it paid off.
                self._prefetched.discard(key)
                self._counts["prefetch_used"] += 1
                self._m.inc("prefetch_used")
            out[i] = data
        missing = [i for i, d in enumerate(out) if d is None]
        n_l2 = len(hashes) - len(missing)
        if missing and read_l3:
            debug = logger.isEnabledFor(logging.DEBUG)
            if debug:
                t_read, faults_read = time.perf_counter(), minor_faults()
            checks = BlockChecks()  # each block checked as it arrives (resp.py)
            try:
                _, fetched = await self._redis(
                    KV, self._store.get_blocks_packed, tenant, [hashes[i] for i in missing], on_value=checks
                )
            except RedisUnavailable:
                fetched = [None] * len(missing)
            if debug:
                t_check, faults_check = time.perf_counter(), minor_faults()
            for k, (i, data) in enumerate(zip(missing, fetched)):
                if data is None:
                    self._counts["get_misses"] += 1
                    self._m.inc("misses")
                if data is None or not self._verify(data, TIER_L3, checks, k):
                    # Gone (a lookup found its index entry, but a cache Redis evicts a
                    # payload on its own: every later lookup would offer it again) or
                    # corrupt: a miss either way, and dropped from Redis.
                    await self._drop_from_l3(tenant, hashes[i])
                    return None, TIER_NONE
                out[i] = data
            if debug:
                t_copy, faults_copy = time.perf_counter(), minor_faults()
            owned, group = _own_blocks([out[i] for i in missing], self._object_store)
            if debug:
                # Where an L3 read's time goes (the worker logs its whole wait, load_ms):
                # the MGET, the blocks' checks and the copy into the object store, with
                # the page faults this thread took in the MGET and the copy (fresh memory
                # is slow to touch on some VMs).
                logger.debug(
                    "kv blocks read from L3: blocks=%d bytes=%d redis_ms=%.1f redis_faults=%d "
                    "check_ms=%.1f copy_ms=%.1f copy_faults=%d",
                    len(missing), sum(len(out[i]) for i in missing),
                    1000 * (t_check - t_read), faults_check - faults_read, 1000 * (t_copy - t_check),
                    1000 * (time.perf_counter() - t_copy), minor_faults() - faults_copy,
                )
            for i, view in zip(missing, owned):
                out[i] = view
                await self._put_l2(l2_keys[i], view, dirty=False, group=group)
        read = missing if read_l3 else []  # what came from Redis here
        l3_bytes = sum(len(out[i]) for i in read)
        l2_bytes = sum(len(b) for b in out if b is not None) - l3_bytes
        self._counts["bytes_out"] += l2_bytes + l3_bytes
        self._m.inc("bytes_out", l2_bytes, tags={"tier": TIER_L2})
        self._m.inc("bytes_out", l3_bytes, tags={"tier": TIER_L3})
        self._m.inc("hits", n_l2, tags={"tier": TIER_L2})
        self._m.inc("hits", len(read), tags={"tier": TIER_L3})
        self._counts["get_hits_L2"] += n_l2
        self._counts["get_hits_L3"] += len(read)
        span = trace.get_current_span()
        span.set_attribute("llm.kv.bytes", l2_bytes + l3_bytes)
        span.set_attribute("llm.kv.l3_blocks", len(read))
        if missing and not read_l3:
            # Left (None) for the caller to read from Redis: handed off, not hits (the
            # caller reads them, or falls back to get_block_refs if it cannot).
            self._counts["handoff_blocks_direct_l3"] += len(missing)
            self._m.inc("handoff_direct_l3", len(missing))
            span.set_attribute("llm.kv.direct_l3_blocks", len(missing))
            # Its own label in the transfer time and span: Redis was not read here.
            return out, "L3_direct"
        return out, TIER_L3 if missing else TIER_L2

    async def get_blocks(
        self, tenant: str, hashes: list[str], *, shard_key: Optional[str] = None
    ) -> Optional[list[bytes]]:
        """Every block of ``hashes`` in order as ``bytes`` (L2, else L3, promoting into
        L2), or None if any is missing or corrupt (a corrupt block is deleted where it
        was found). Workers use :meth:`get_blocks_packed`."""
        blocks = await self._read_blocks(tenant, hashes)
        return None if blocks is None else [b if isinstance(b, bytes) else bytes(b) for b in blocks]

    async def get_blocks_packed(
        self, tenant: str, hashes: list[str], *, shard_key: Optional[str] = None
    ):
        """:meth:`get_blocks` as ``(uint8 array, lengths)`` (see ``blocks.pack_blocks``):
        one array per prefix, for callers that want the bytes in the reply (workers use
        :meth:`get_block_refs`). Blocks that lie back to back in one buffer go out as a
        view of it (without Ray: blocks put or read from Redis together), others are
        copied once into a new array."""
        blocks = await self._read_blocks(tenant, hashes)
        return None if blocks is None else pack_blocks(blocks)

    async def get_block_refs(
        self, tenant: str, hashes: list[str], *, shard_key: Optional[str] = None, direct_l3: bool = False
    ) -> Optional[list[tuple[object, list[int]]]]:
        """:meth:`get_blocks` as references, the form compute workers use (see
        ``DataPlaneKVConnector.load``): a list of ``(source, indices)``, in block order,
        where ``source`` is an ObjectRef of one of this replica's object-store copies (a
        list of block arrays) or such a list inline, and ``indices`` pick the blocks from
        it. Blocks in L2 (and those just read from Redis, which are copied into L2 once)
        go by reference, without a copy here; a block L2 had to copy out of its shared
        object goes inline. None if any block is missing or corrupt. ``direct_l3``: blocks
        not in L2 are not read here but go as ``InRedis`` segments, for a caller that
        reads them from Redis itself (one transfer instead of two and a copy); whether
        Redis has them is then the caller's to find out."""
        blocks = await self._read_blocks(tenant, hashes, read_l3=not direct_l3)
        return None if blocks is None else self._hand_off(tenant, hashes, blocks)

    def _hand_off(self, tenant: str, hashes: list[str], blocks: list) -> list[tuple[object, list[int]]]:
        """``blocks`` (of ``hashes``, just read; None: left in Redis for the caller) as
        ``get_block_refs`` segments."""
        segments: list[tuple[object, list[int]]] = []
        inline: Optional[list] = None  # the last segment's list, when it is inline
        last: Optional[_Resident] = None  # the last segment's object, when by reference
        in_redis: Optional[InRedis] = None  # the last segment's source, when in Redis
        by_ref = inline_bytes = 0
        for h, value in zip(hashes, blocks):
            if value is None:
                if in_redis is None:
                    in_redis, inline, last = InRedis([]), None, None
                    segments.append((in_redis, []))
                segments[-1][1].append(len(in_redis.hashes))
                in_redis.hashes.append(h)
                continue
            in_redis = None
            group = self._l2.group_of(keys.block_key(tenant, h))
            index = group.index_of(value) if isinstance(group, _Resident) else None
            if index is None:
                if inline is None:
                    inline, last = [], None
                    segments.append((inline, []))
                segments[-1][1].append(len(inline))
                inline.append(np.frombuffer(value, dtype=np.uint8))
                inline_bytes += len(value)
            else:
                if group is not last:
                    inline, last = None, group
                    segments.append((group.ref, []))
                segments[-1][1].append(index)
                by_ref += len(value)
        self._counts["handoff_bytes_ref"] += by_ref
        self._counts["handoff_bytes_inline"] += inline_bytes
        self._m.inc("handoff_bytes", by_ref, tags={"mode": "ref"})
        self._m.inc("handoff_bytes", inline_bytes, tags={"mode": "inline"})
        return segments

    async def put_blocks_packed(
        self,
        tenant: str,
        hashes: list[str],
        data,
        lengths: list[int],
        session_id: Optional[str] = None,
        *,
        shard_key: Optional[str] = None,
    ) -> int:
        """:meth:`put_blocks` of blocks sent as one uint8 array (``blocks.pack_blocks``)
        or as a list of uint8 arrays (``blocks.block_arrays``: the sender skips the
        packing copy, Ray's serializer copies each block straight into its object
        store); ``lengths`` gives each block's size."""
        await self.start()
        if len(hashes) != len(lengths):
            raise InvalidRequestError(
                f"{len(hashes)} hashes but {len(lengths)} lengths", param="lengths"
            )
        try:
            # ``data`` is the caller's: read-only views of the object Ray made for this
            # call. They are checked against ``lengths``, then copied once into an
            # object this replica owns (``_own_blocks``); L2 keeps views of that copy.
            if isinstance(data, (list, tuple)):
                arrays = _block_views(data, lengths)
            else:
                arrays = unpack_blocks(data, lengths)
        except (CorruptBlockError, TypeError, ValueError) as e:
            raise InvalidRequestError(f"packed blocks do not match their lengths: {e}", param="lengths") from None
        blocks, group = _own_blocks(arrays, self._object_store)
        return await self._store_blocks(tenant, hashes, blocks, session_id, shard_key, group)

    async def put_block_refs(
        self,
        tenant: str,
        hashes: list[str],
        refs: list,
        lengths: list[int],
        session_id: Optional[str] = None,
        *,
        node_id: Optional[str] = None,
        shard_key: Optional[str] = None,
    ) -> int:
        """:meth:`put_blocks` of blocks the caller put into Ray's object store itself:
        ``refs`` is ``[ObjectRef]`` of a list of uint8 arrays (``blocks.block_arrays``;
        in a list so that Ray passes the reference, not the value), ``lengths`` each
        block's size, ``node_id`` the caller's node. From a caller on this replica's node
        L2 keeps that object by reference, mapped here without a copy (the caller owns it;
        it lives while L2 holds it). From another node Ray brings it here and it is copied
        once into an object this replica owns, so that L2 does not pin memory on the
        caller's node. Returns how many blocks were stored."""
        self._check_ref_args(hashes, refs, lengths)
        await self.start()
        arrays = await self._map_caller_object(refs, lengths)
        if self._kept_by_reference(node_id):
            group, mode = _Resident(refs[0], arrays), "ref"
            blocks = list(group.views)
        else:
            (blocks, group), mode = _own_blocks(arrays, self._object_store), "copy"
        del arrays
        nbytes = sum(int(n) for n in lengths)
        self._counts[f"put_bytes_{mode}"] += nbytes
        self._m.inc("put_bytes", nbytes, tags={"mode": mode})
        return await self._store_blocks(tenant, hashes, blocks, session_id, shard_key, group, mode)

    async def _map_caller_object(self, refs, lengths) -> list:
        """The blocks of a caller's object (``refs``: ``[ObjectRef]`` of a list of uint8
        arrays, ``blocks.block_arrays``; its form checked by the caller,
        ``_check_ref_args``), mapped here as read-only arrays and checked against
        ``lengths``; InvalidRequestError for an object that is not such a list. Mapped
        from this node's object store (brought here first if it lies elsewhere); a caller
        that died before this, its object with it, fails the call."""
        async with asyncio.timeout(PUT_REF_FETCH_TIMEOUT_S):
            value = await refs[0]
        try:
            return _block_views(value, lengths)
        except TypeError as e:
            raise InvalidRequestError(f"refs must hold a list of byte arrays: {e}", param="refs") from None
        except ValueError as e:
            raise InvalidRequestError(str(e), param="lengths") from None

    @staticmethod
    def _check_ref_args(hashes: list[str], refs, lengths) -> None:
        """InvalidRequestError unless ``refs`` is ``[ObjectRef]`` and ``lengths`` one per hash."""
        import ray

        if not (isinstance(refs, (list, tuple)) and len(refs) == 1 and isinstance(refs[0], ray.ObjectRef)):
            raise InvalidRequestError("refs must be a list of one ObjectRef", param="refs")
        if not isinstance(lengths, (list, tuple)) or len(hashes) != len(lengths):
            raise InvalidRequestError(f"{len(hashes)} hashes but lengths {lengths!r:.40}", param="lengths")

    def _kept_by_reference(self, node_id: Optional[str]) -> bool:
        """Whether L2 keeps a caller's object as it is: it lies in this node's object
        store. One from another node is copied once into an object this replica owns, so
        that L2 does not pin memory on the caller's node."""
        return self._object_store and node_id is not None and node_id == self._node_id()

    def _node_id(self) -> Optional[str]:
        if self._node is None:
            import ray

            self._node = ray.get_runtime_context().get_node_id()
        return self._node

    async def prefetch(
        self, tenant: str, hashes: list[str], *, shard_key: Optional[str] = None
    ) -> int:
        """Bring blocks of ``hashes`` from L3 into L2; returns how many are now in L2."""
        return await self._bring_up(tenant, hashes, "prefetched")

    async def promote(
        self,
        tenant: str,
        hashes: list[str],
        *,
        shard_key: Optional[str] = None,
        refs: Optional[list] = None,
        lengths: Optional[list[int]] = None,
        node_id: Optional[str] = None,
    ) -> int:
        """Blocks a worker has just read from Redis itself (``direct_l3``) brought up to
        L2: in use, so they come up as blocks this replica read would (counted as
        ``promoted``, not as prefetches). How many are now in L2.

        With ``refs`` (``[ObjectRef]`` of the blocks the worker read, as
        :meth:`put_block_refs` takes them, with ``lengths`` and ``node_id``) L2 takes the
        worker's bytes instead of reading Redis again: only blocks whose index entry
        Redis still has at their length (a delete since the worker's read erased it
        first), each checked here as every block L2 takes. Without, this replica reads
        them from Redis (:meth:`prefetch`'s read)."""
        if refs is None:
            return await self._bring_up(tenant, hashes, "promoted")
        self._check_ref_args(hashes, refs, lengths)
        await self.start()
        l2_keys = [keys.block_key(tenant, h) for h in hashes]
        missing = [i for i, k in enumerate(l2_keys) if k not in self._l2]
        if missing:
            with self._tracer.start_as_current_span(
                "dataplane.promote", attributes={"llm.kv.blocks": len(missing), "llm.kv.promote_source": "worker"}
            ) as span:
                promoted = await self._promote_given(tenant, hashes, l2_keys, missing, refs, lengths, node_id)
                span.set_attribute("llm.kv.promoted_blocks", promoted)
        return sum(k in self._l2 for k in l2_keys)

    async def _promote_given(
        self, tenant: str, hashes: list[str], l2_keys: list[str], missing: list[int], refs, lengths, node_id
    ) -> int:
        arrays = await self._map_caller_object(refs, lengths)
        # Checked against Redis after the mapping's wait, just before L2 takes them: a
        # session's delete erases index entries before payloads, and L2 after both.
        try:
            sizes = await self._redis(KV, self._store.block_sizes, tenant, [hashes[i] for i in missing])
        except RedisUnavailable:
            sizes = [None] * len(missing)  # not known to be in L3: left where they are
        wanted = [
            i for i, size in zip(missing, sizes)
            if size is not None and size == len(arrays[i]) and l2_keys[i] not in self._l2  # not put meanwhile
        ]
        good = [i for i in wanted if self._verify(arrays[i], TIER_L3)]
        if len(good) < len(missing):
            logger.debug(
                "DataPlane: promotion of %d blocks of %s with the worker's bytes: %d taken, %d no longer in Redis "
                "(or of another length) or put meanwhile, %d corrupt",
                len(missing), tenant, len(good), len(missing) - len(wanted), len(wanted) - len(good),
            )
        if not good:
            return 0
        if len(good) == len(arrays) and self._kept_by_reference(node_id):
            group = _Resident(refs[0], arrays)
            views = list(group.views)
        else:
            # Part of the object (or one from another node): a copy of that part, so
            # that L2 does not keep the rest alive.
            views, group = _own_blocks([arrays[i] for i in good], self._object_store)
        del arrays
        await self._take_clean([l2_keys[i] for i in good], views, group, "promoted", "worker")
        self._counts["promoted_from_worker"] += len(good)
        return len(good)

    async def _take_clean(self, l2_keys: list[str], views: list, group, why: str, source: str) -> None:
        """Blocks that Redis holds too (``views``, of one ``group``) into L2 as clean,
        counted as ``why`` ("prefetched", "promoted") from ``source`` ("redis": read
        here; "worker": a worker's read handed over)."""
        for key, view in zip(l2_keys, views):
            await self._put_l2(key, view, dirty=False, group=group)
            if why == "prefetched":
                self._prefetched.add(key)
        self._counts[why] += len(l2_keys)
        self._m.inc(why, len(l2_keys), tags={"source": source} if why == "promoted" else None)
        self._m.set("l2_used", self._l2.used_bytes)

    async def _bring_up(self, tenant: str, hashes: list[str], why: str) -> int:
        await self.start()
        l2_keys = [keys.block_key(tenant, h) for h in hashes]
        missing = [i for i, k in enumerate(l2_keys) if k not in self._l2]
        if missing:
            checks = BlockChecks()
            try:
                # One MGET read straight into one array (resp.py), each block checked as
                # it arrives, then copied once into this replica's object (redis-py's
                # MGET moved each value through three to four copies of its own: 0.28
                # against 0.77 GB/s in one run here).
                _, fetched = await self._redis(
                    KV, self._store.get_blocks_packed, tenant, [hashes[i] for i in missing], on_value=checks
                )
            except RedisUnavailable:
                fetched = []
            good: list[tuple[int, memoryview]] = []
            for k, (i, data) in enumerate(zip(missing, fetched)):
                if data is None:
                    continue
                if not self._verify(data, TIER_L3, checks, k):
                    await self._drop_from_l3(tenant, hashes[i])
                    continue
                good.append((i, data))
            owned, group = _own_blocks([data for _, data in good], self._object_store)
            await self._take_clean([l2_keys[i] for i, _ in good], owned, group, why, "redis")
        return sum(k in self._l2 for k in l2_keys)

    async def drop_l2_blocks(
        self, tenant: str, hashes: list[str], *, shard_key: Optional[str] = None
    ) -> int:
        """Remove blocks from this replica's L2 only (dirty or not); a write of them to
        the KV server under way erases them again when done. A session's delete calls
        it on every replica (``_drop_blocks_everywhere``)."""
        dropped = [keys.block_key(tenant, h) for h in hashes]
        for under_way in self._writes_in_flight.values():
            under_way.update(dropped)
        n = self._l2.delete_many(dropped)
        self._m.set("l2_used", self._l2.used_bytes)
        return n

    async def flush_l2(self, shard_key: Optional[str] = None) -> dict:
        """Write dirty blocks to Redis, then empty L2 (benchmarks and tests). While
        Redis is down, unsynced blocks stay (they exist nowhere else)."""
        await self.start()
        written = 0
        try:
            written = await self._redis(KV, self._write_dirty_blocks)
        except RedisUnavailable:
            pass
        self._prefetched.clear()
        kept = [e for e in self._l2.clear() if e.dirty]
        for e in kept:
            self._l2.put(e.key, e.value, dirty=True, group=e.group)
        self._m.set("l2_used", self._l2.used_bytes)
        return {"written": written, "kept_dirty": len(kept)}

    # -- sessions ----------------------------------------------------------------------

    def _cache_session(self, rec: SessionRecord) -> None:
        key = (rec.tenant, rec.id)
        self._sessions[key] = _copy(rec)
        self._sessions.move_to_end(key)
        while len(self._sessions) > MAX_CACHED_SESSIONS:
            for old in self._sessions:
                if old not in self._dirty_sessions:
                    del self._sessions[old]
                    break
            else:
                break

    def _memory_session(self, tenant: str, session_id: str) -> Optional[SessionRecord]:
        key = (tenant, session_id)
        rec = self._sessions.get(key)
        if rec is None:
            return None
        if rec.expired(time.time()):
            self._dirty_sessions.discard(key)
            if not self._down(SESSIONS):
                del self._sessions[key]
            # Else kept, clean, while the server is down: a session this replica knows
            # expired stays a 404, not one it holds nothing of (a 503); the cache's bound
            # drops it in time, and Redis answers for it once back.
            return None
        return rec

    async def create_session(
        self,
        tenant: str,
        ttl_s: Optional[int] = None,
        session_id: Optional[str] = None,
        *,
        shard_key: Optional[str] = None,
    ) -> SessionRecord:
        """A new empty session (version 0). Pass ``session_id`` (see
        ``types.new_session_id``) equal to ``shard_key`` so later calls on it reach this
        shard; without one, ``shard_key`` or a fresh id is used."""
        await self.start()
        ttl = int(ttl_s or self._cfg.sessions.cache_ttl_s)
        if ttl < 1:
            raise InvalidRequestError(f"ttl_s must be >= 1, got {ttl_s}", param="ttl_s")
        now = time.time()
        rec = SessionRecord(
            id=session_id or shard_key or new_session_id(),
            tenant=tenant,
            created=now,
            expires_at=now + ttl,
            ttl_s=ttl,
        )
        key = (tenant, rec.id)
        in_memory_only = False
        try:
            created = await self._redis(SESSIONS, self._store.create_session, rec)
        except RedisUnavailable:
            # A deleted id stays taken, as its tombstone keeps it in Redis.
            created = self._memory_session(tenant, rec.id) is None and key not in self._deleted_sessions
            if created:
                in_memory_only = True
                self._dirty_sessions.add(key)
        if not created:
            raise ConflictError(f"session {rec.id!r} already exists", param="session_id")
        self._cache_session(rec)
        if in_memory_only:
            await self._back_up(tenant, rec.id, record=rec)
        return _copy(rec)

    async def get_session(
        self, tenant: str, session_id: str, *, shard_key: Optional[str] = None
    ) -> Optional[SessionRecord]:
        """The session (its expiry refreshed), or None if absent, expired or another
        tenant's."""
        await self.start()
        key = (tenant, session_id)
        try:
            # The read refreshes the expiry, a write; refused (full, read-only), the
            # record is read without it and marked: a turn on it would be refused too.
            # Tried even while a refusal is known (one round trip more), so that a turn
            # read just after the server took writes again is not refused on an old
            # state before the write probe notices.
            refused = False
            try:
                rec = await self._redis(SESSIONS, self._store.get_session, tenant, session_id, touch=True)
            except RedisRefused:
                refused = True
                rec = await self._redis(SESSIONS, self._store.get_session, tenant, session_id, touch=False)
        except UnreadableSessionRecord as e:
            logger.error("DataPlane: tenant %s: %s", tenant, e.message)
            raise
        except RedisUnavailable:
            known = key in self._sessions or key in self._deleted_sessions
            rec = self._memory_session(tenant, session_id)
            if rec is None:
                if not known:
                    raise self._unknown_in_outage(session_id, "read") from None
                return None
            rec.expires_at = time.time() + rec.ttl_s
            return _copy(rec)
        if rec is None:
            self._sessions.pop(key, None)
            return None
        self._cache_session(rec)
        if refused:  # the server refuses writes: so would this session's next append
            return dataclasses.replace(rec, messages=list(rec.messages), writes_refused=True)
        return rec

    async def append_turn(
        self,
        tenant: str,
        session_id: str,
        expected_version: int,
        messages: list[dict],
        num_tokens: int,
        *,
        turn_id: str = "",
        shard_key: Optional[str] = None,
    ) -> SessionRecord:
        """Append ``messages`` if the session is at ``expected_version``; ``num_tokens``
        is what they add to the session's token count. Returns the updated record
        (version + 1). 409 on a version mismatch, 404 if absent or expired. The turn is
        in Redis when this returns (unless degraded: then in memory, synced later).

        ``turn_id`` makes the call safe to repeat: made again after it landed (its
        answer lost with a dying replica or connection, the caller or Ray Serve's router
        sends it again), it returns the record that turn made instead of a 409."""
        await self.start()
        key = (tenant, session_id)
        await self._claim_backup(key, "changed")
        max_messages = self._cfg.sessions.max_messages
        try:
            result = await self._redis(
                SESSIONS,
                self._store.append,
                tenant,
                session_id,
                expected_version,
                messages,
                num_tokens,
                max_messages=max_messages,
                turn_id=turn_id,
            )
        except RedisUnavailable:
            rec = self._append_in_memory(tenant, session_id, expected_version, messages, num_tokens, turn_id)
            await self._back_up(tenant, session_id, record=rec)
            return rec
        if result.status == "missing":
            self._sessions.pop(key, None)
            raise self._missing(session_id)
        if result.status == "conflict":
            raise self._conflict(session_id, expected_version, result.version)
        if result.status == "too_many_messages":
            raise InvalidRequestError(
                f"session {session_id!r} would hold {result.version} messages, more than "
                f"the limit of {max_messages}",
                param="messages",
            )
        if result.replayed:
            self._m.inc("append_replays")
            logger.info(
                "DataPlane: session %s turn %s was already applied at version %d; answering "
                "its success again", session_id, turn_id, result.version,
            )
        cached = self._sessions.get(key)
        if cached is not None and cached.version == expected_version and not result.replayed:
            cached.messages.extend(messages)
            cached.num_tokens += num_tokens
            cached.version = result.version
            cached.last_turn_id = turn_id
            cached.expires_at = time.time() + cached.ttl_s
            self._sessions.move_to_end(key)
            return _copy(cached)
        rec = await self.get_session(tenant, session_id)
        if rec is None:  # expired between the two calls
            raise self._missing(session_id)
        return rec

    @staticmethod
    def _unknown_in_outage(session_id: str, what: str) -> ServiceUnavailableError:
        """The sessions Redis is down and this replica holds nothing of the session: it
        may well exist (in Redis, or on its way here from a replica being stopped, see
        ``drain``), so not a 404, which would tell the client its conversation is gone."""
        return ServiceUnavailableError(
            f"session {session_id!r} cannot be {what} now: the session store is unreachable "
            "and this server holds no copy of it; retry shortly",
            headers={"Retry-After": "1"},
        )

    @staticmethod
    def _missing(session_id: str) -> NotFoundError:
        return NotFoundError(
            f"session {session_id!r} not found or expired", param="session_id", code="session_not_found"
        )

    @staticmethod
    def _conflict(session_id: str, expected: int, current: int) -> ConflictError:
        return ConflictError(
            f"session {session_id!r} is at version {current}, not {expected}: another "
            "turn was appended first; reload the session and retry",
            param="expected_version",
            code="session_version_conflict",
        )

    def _append_in_memory(
        self,
        tenant: str,
        session_id: str,
        expected_version: int,
        messages: list[dict],
        num_tokens: int,
        turn_id: str,
    ) -> SessionRecord:
        # No await in here: the check and the write are atomic on this replica's loop.
        key = (tenant, session_id)
        known = key in self._sessions or key in self._deleted_sessions
        rec = self._memory_session(tenant, session_id)
        if rec is None:
            if not known:
                raise self._unknown_in_outage(session_id, "changed")
            raise self._missing(session_id)
        if rec.version != expected_version:
            if turn_id and rec.version == expected_version + 1 and rec.last_turn_id == turn_id:
                self._m.inc("append_replays")
                return _copy(rec)
            raise self._conflict(session_id, expected_version, rec.version)
        if len(rec.messages) + len(messages) > self._cfg.sessions.max_messages:
            raise InvalidRequestError(
                f"session {session_id!r} would hold {len(rec.messages) + len(messages)} "
                f"messages, more than the limit of {self._cfg.sessions.max_messages}",
                param="messages",
            )
        rec.messages.extend(messages)
        rec.num_tokens += num_tokens
        rec.version += 1
        rec.last_turn_id = turn_id
        rec.expires_at = time.time() + rec.ttl_s
        self._dirty_sessions.add((tenant, session_id))
        return _copy(rec)

    async def delete_session(
        self, tenant: str, session_id: str, *, shard_key: Optional[str] = None
    ) -> bool:
        """Erase the session and its KV blocks from L2 (on every shard holding them)
        and L3. True if it existed."""
        await self.start()
        key = (tenant, session_id)
        await self._claim_backup(key, "deleted")
        known = key in self._sessions or key in self._deleted_sessions
        existed = self._memory_session(tenant, session_id) is not None
        self._sessions.pop(key, None)
        self._dirty_sessions.discard(key)
        members = set(self._pending_session_blocks.pop(key, set()))
        try:
            existed = await self._redis(SESSIONS, self._delete_stored_session, tenant, session_id, members) or existed
        except RedisUnavailable:
            if not known:
                # Whether it exists is Redis's to say: no 404, and nothing recorded.
                if members:
                    self._pending_session_blocks[key].update(members)
                raise self._unknown_in_outage(session_id, "deleted") from None
            first = key not in self._deleted_sessions
            self._deleted_sessions.add(key)  # the rest once the server is back
            # The blocks known now (those not yet listed in Redis included) go at once,
            # from L2 first (see _delete_stored_session).
            await self._drop_blocks_everywhere(tenant, members)
            await self._erase_member_blocks(tenant, members)
            if first:
                await self._back_up(tenant, session_id, deleted=True)
        return existed

    async def _drop_blocks_everywhere(self, tenant: str, members: Iterable[str]) -> None:
        """Drop blocks (session block-list members) from the L2 of every replica: here
        first (cheap), then on each replica of the pool at once (Serve's broadcast). Not
        only the chain's owner: a put that found the owner full went to a fallback, and
        an owner before the ring last changed may still hold them. The workers' own L1
        (the torch engine's prefix cache) drops them at the same time, on every worker
        replica. A replica that does not answer in ``DROP_BROADCAST_TIMEOUT_S`` is logged
        (its blocks then leave L2 or L1 by eviction, and are gone from L3)."""
        hashes = sorted({keys.split_session_block_member(m)[1] for m in members})
        if not hashes:
            return
        await self.drop_l2_blocks(tenant, hashes)
        await asyncio.gather(
            self._broadcast_drop(self._peers, "the other replicas' L2", "drop_l2_blocks", tenant, hashes),
            self._broadcast_drop(self._worker_handle(), "the workers' L1", "drop_kv_blocks", hashes),
        )

    @staticmethod
    async def _broadcast_drop(handle, where: str, method: str, *args) -> None:
        """``method(*args)`` on every replica of ``handle``'s deployment (none: nothing to
        reach); a failure is logged, never raised (a delete does not fail on it)."""
        if handle is None:
            return
        num_blocks = len(args[-1])
        try:
            results = await handle.broadcast(method, *args).results_async(
                timeout_s=DROP_BROADCAST_TIMEOUT_S, return_exceptions=True
            )
        except Exception as e:  # noqa: BLE001 - the deployment unreachable as a whole
            logger.warning("DataPlane: could not drop %d blocks of a deleted session from %s: %s", num_blocks, where, e)
            return
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            logger.warning(
                "DataPlane: %d of %d replicas did not drop %d blocks of a deleted session from "
                "%s: %s", len(failed), len(results), num_blocks, where, failed[0],
            )

    def _worker_handle(self):
        """The handle to the worker replicas whose L1 a delete reaches (None: no such L1,
        or not running under Serve)."""
        if self._workers is None and self._worker_deployment is not None:
            self._workers = self._app_handle(self._worker_deployment)
            if self._workers is None:
                self._worker_deployment = None  # outside Serve (tests): no workers to reach
        return self._workers

    async def _warm_peers(self) -> None:
        try:
            await self._peers.status.remote()
        except Exception as e:  # noqa: BLE001 - only a warm-up
            logger.debug("DataPlane: peer handle warm-up failed: %s", e)

    @staticmethod
    def _app_handle(deployment: Optional[str] = None):
        """A handle to ``deployment`` of this replica's application (this replica's own
        deployment when None); None outside a Serve replica."""
        try:
            from ray import serve

            ctx = serve.get_replica_context()
            return serve.get_deployment_handle(deployment or ctx.deployment, ctx.app_name)
        except Exception:  # noqa: BLE001 - not in a replica (tests): no handle
            return None

    # -- status ------------------------------------------------------------------------

    async def status(self, shard_key: Optional[str] = None) -> dict:
        await self.start()
        down = sorted(n for n, t in self._degraded_since.items() if t is not None)
        return {
            "degraded": bool(down),
            # Which Redis roles are unreachable: "sessions" (turns are kept in memory
            # until it is back), "kv" (blocks are), both when they share a server.
            "degraded_servers": down,
            "degraded_since": min((self._degraded_since[n] for n in down), default=None),
            # Reachable but refusing writes (full, read-only): session changes get a 503,
            # reads go on, KV blocks wait in L2.
            "refusing_writes": sorted(n for n, t in self._refusing_since.items() if t is not None),
            "unsynced_sessions": len(self._dirty_sessions) + len(self._deleted_sessions),
            # Of those, copies of another replica's outage changes (back_up).
            "backup_sessions": len(self._backups),
            "unsynced_blocks": self._l2.num_dirty + sum(len(m) for m in self._blocks_to_delete.values()),
        }

    async def stats(self, shard_key: Optional[str] = None, exclude_replica: Optional[str] = None) -> dict:
        await self.start()
        return {
            **self._counts,
            **self._identity(),
            "degraded": self.degraded,
            "l2_used_bytes": self._l2.used_bytes,
            "l2_capacity_bytes": self._l2.capacity_bytes,
            "l2_num_blocks": len(self._l2),
            "l2_dirty_blocks": self._l2.num_dirty,
            "l2_evictions": self._l2.num_evictions,
            "l2_held_bytes": self._l2.held_bytes,
            "object_store_prefaulted_bytes": self._prefault.bytes_done if self._prefault else 0,
            "sessions_in_memory": len(self._sessions),
        }

    @staticmethod
    def _identity() -> dict:
        """Which replica answered (tests use the actor name to kill it)."""
        try:
            import ray
            from ray import serve

            return {
                "replica": serve.get_replica_context().replica_id.unique_id,
                "actor_name": ray.get_runtime_context().get_actor_name(),
            }
        except Exception:
            return {}

    async def check_health(self) -> None:
        # Degraded is not unhealthy: a replacement replica would not reach Redis either,
        # and would lose what this one keeps in memory.
        return None


def dataplane_deployment(config: AppConfig):
    """The DataPlane deployment with the options the config asks for."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    dp = config.dataplane
    return serve.deployment(DataPlane).options(
        name="DataPlane",
        num_replicas=dp.num_replicas,
        # Calls are short and mostly wait on Redis; Serve's default of 5 would queue them.
        max_ongoing_requests=1000,
        # A stopping replica's drain (DataPlane.drain) must not be cut short by Serve.
        graceful_shutdown_timeout_s=dp.drain_timeout_s + 5,
        # dp.resources: the node role (e.g. {data_node: 0.01}) that places it on memory nodes.
        ray_actor_options={"num_cpus": dp.num_cpus} | ({"resources": dict(dp.resources)} if dp.resources else {}),
        request_router_config=RequestRouterConfig(
            request_router_class="deployments.dataplane.routing:KeyAffinityRequestRouter",
        ),
    )
