"""The chain-root index: which KV chains the data plane may hold, known to every router.

Every stored KV chain is keyed under its first block's hash, its root (``chain_root``,
engines/kv.py): a prompt can only hit a stored prefix if its own first block hash is the
root of a stored chain. The data plane publishes the roots it stores or serves to Redis
(``llm:<tenant>:kvroots``, a sorted set scored by the wall time of the last store or hit;
entries older than the L3 TTL are pruned, so the set stays the size of what L3 can hold),
and each router mirrors that set (:class:`RootIndex`). A request that does not continue a
session (stateless, or a session's first turn) whose root is not in the mirror would
miss for certain: the router tells the worker not to ask
(``GenerationRequest.kv_lookup_skip``), so a new prompt pays no data-plane call at all.
This is the part of Dynamo's KV-aware router index that decides "nothing to reuse",
at the granularity of whole chains.

What the mirror may get wrong, and what that costs:

* An entry whose blocks are gone (evicted, expired, erased with a session): the request
  looks up and misses, as it would without the index.
* A root stored moments ago through another ingress replica, not yet mirrored here (at
  most about two ``root_index_sync_ms`` periods): the request recomputes its prefix and
  exports it again. A router adds the roots of requests it served itself at once.
* A session's later turns never skip (``session_continues``): a turn follows the
  previous one's export by milliseconds, before any mirror could have caught up.
* While the mirror is stale (Redis unreachable, or no answer for a while) or has not
  yet synced a tenant, every request looks up, as without the index.

Cost: one ZRANGEBYSCORE per known tenant per period (a tenant with no request for 10
minutes is forgotten, and synced afresh when it returns), and a set of 32-character hex roots
per tenant in each router's memory (over a million, that tenant always looks up).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional

logger = logging.getLogger("ray.serve")

# A root's score is the wall time of the data-plane replica that stored it; replicas on
# other nodes may run a little ahead or behind. An incremental sync asks again from this
# much before the newest score it saw (re-reading a few entries costs nothing).
CLOCK_SKEW_S = 10.0
# Entries per ZRANGEBYSCORE page.
PAGE = 10_000

# fetch(tenant, since, limit) -> [(root, score)] with score >= since, ascending by score.
Fetch = Callable[[str, float, int], Awaitable[list[tuple[str, float]]]]


@dataclass(slots=True)
class _Tenant:
    roots: set[str] = field(default_factory=set)
    # The newest score seen (the next incremental sync starts a little before it).
    newest: float = float("-inf")
    # time.monotonic() of the last complete sync; None: never synced.
    synced_at: Optional[float] = None
    # time.monotonic() of the last full read (which drops pruned roots).
    full_at: float = float("-inf")
    # Roots added here lately (root -> clock time): a full read keeps those too young to
    # be published yet.
    added: dict[str, float] = field(default_factory=dict)
    overflow: bool = False
    # time.monotonic() of the last request of this tenant (an idle tenant is forgotten).
    used_at: float = 0.0


class RootIndex:
    """A router's mirror of the published chain roots, per tenant. Plain logic around an
    injected ``fetch``; :meth:`run` keeps it synced."""

    def __init__(
        self,
        fetch: Fetch,
        *,
        sync_interval_s: float,
        stale_after_s: Optional[float] = None,
        full_sync_interval_s: float = 300.0,
        forget_after_s: float = 600.0,
        max_roots: int = 1_000_000,
        clock: Callable[[], float] = time.monotonic,
        on_sync: Optional[Callable[["RootIndex", bool], None]] = None,
    ):
        self._fetch = fetch
        # Called after every sync attempt with whether it worked (metrics).
        self._on_sync = on_sync
        self.sync_interval_s = sync_interval_s
        # Past this since the last complete sync, the mirror is not trusted to say "no".
        self.stale_after_s = stale_after_s if stale_after_s is not None else max(2.0, 8 * sync_interval_s)
        self.full_sync_interval_s = full_sync_interval_s
        # A tenant with no request for this long is dropped: each known tenant costs one
        # Redis read per period.
        self.forget_after_s = forget_after_s
        self.max_roots = max_roots
        self._clock = clock
        self._tenants: dict[str, _Tenant] = {}
        self._task: Optional[asyncio.Task] = None
        self._healthy: Optional[bool] = None  # for one log line per change
        self.syncs = 0
        self.sync_failures = 0

    # -- queries ------------------------------------------------------------------------

    def may_hold(self, tenant: str, root: str) -> bool:
        """False only when the mirror is fresh and has no chain starting with ``root``:
        a lookup would miss for certain. A tenant seen for the first time is synced from
        now on (and looked up until then)."""
        t = self._tenants.get(tenant)
        if t is None:
            self._tenants[tenant] = _Tenant(used_at=self._clock())
            return True
        t.used_at = self._clock()
        if t.overflow or not self.fresh(tenant):
            return True
        return root in t.roots

    def holds(self, tenant: str, root: str) -> bool:
        """The mirror lists a chain starting with ``root`` (stored within ``kv_ttl_s``,
        fresh or not): its prefix is known, worth a prefetch."""
        t = self._tenants.get(tenant)
        return t is not None and root in t.roots

    def fresh(self, tenant: str) -> bool:
        t = self._tenants.get(tenant)
        return (
            t is not None
            and t.synced_at is not None
            and self._clock() - t.synced_at <= self.stale_after_s
        )

    def add(self, tenant: str, root: str) -> None:
        """A root this router just caused to be stored (a request it served exported its
        blocks): known here at once, not one sync later."""
        t = self._tenants.setdefault(tenant, _Tenant())
        t.used_at = self._clock()
        if not t.overflow:
            t.roots.add(root)
            t.added[root] = self._clock()

    @property
    def num_roots(self) -> int:
        return sum(len(t.roots) for t in self._tenants.values())

    # -- syncing --------------------------------------------------------------------------

    async def sync_once(self) -> None:
        """Bring every known tenant up to date: new entries since the last sync, or the
        whole set (which drops pruned roots) every ``full_sync_interval_s``. Raises what
        ``fetch`` raises; a tenant that failed keeps its previous state."""
        for tenant, t in list(self._tenants.items()):
            now = self._clock()
            if now - t.used_at > self.forget_after_s:
                del self._tenants[tenant]  # asked about again, it is synced afresh
                continue
            full = now - t.full_at >= self.full_sync_interval_s
            if t.overflow and not full:
                continue  # only a full read can tell whether it fits again
            since = float("-inf") if full else t.newest - CLOCK_SKEW_S
            # Added here this recently, a root may not be in Redis yet (the data plane
            # publishes every period); older local adds must be there to count.
            t.added = {r: at for r, at in t.added.items() if at >= now - self.stale_after_s}
            found: set[str] = set()
            newest = t.newest if not full else float("-inf")
            overflow = False
            while True:
                page = await self._fetch(tenant, since, PAGE)
                for root, score in page:
                    found.add(root)
                    newest = max(newest, score)
                if len(found) + (0 if full else len(t.roots)) > self.max_roots:
                    overflow = True
                    break
                if len(page) < PAGE:
                    break
                # Scores may repeat across a page boundary: the next page starts at the
                # last score (re-reading the entries that share it).
                next_since = page[-1][1]
                if next_since <= since:
                    overflow = True  # over PAGE entries share one score: give up safely
                    break
                since = next_since
            if overflow:
                if not t.overflow:
                    logger.warning(
                        "KV root index: tenant %r has over %d stored chains; its requests "
                        "always look up", tenant, self.max_roots,
                    )
                t.overflow, t.roots, t.full_at = True, set(), now
            elif full:
                t.overflow, t.roots, t.full_at = False, found | t.added.keys(), now
            else:
                t.roots |= found
            t.newest = newest
            t.synced_at = now

    async def run(self) -> None:
        """Sync every ``sync_interval_s`` until cancelled; failures leave the mirror to go
        stale (every request then looks up) and log once per change."""
        while True:
            try:
                await self.sync_once()
                ok = True
                self.syncs += 1
                self._set_healthy(True)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a stale mirror only costs lookups
                ok = False
                self.sync_failures += 1
                self._set_healthy(False, e)
            if self._on_sync is not None:
                self._on_sync(self, ok)
            await asyncio.sleep(self.sync_interval_s)

    def start(self) -> None:
        """Start :meth:`run` on the running loop (idempotent; restarts it if it died)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
            self._task = None

    def _set_healthy(self, healthy: bool, error: Optional[BaseException] = None) -> None:
        if healthy == self._healthy:
            return
        self._healthy = healthy
        if healthy:
            logger.info("KV root index: synced from Redis (%d roots)", self.num_roots)
        else:
            logger.warning(
                "KV root index: sync from Redis failed (%r); requests look up the data "
                "plane until it works again", error,
            )


def redis_fetcher(cfg) -> tuple[Fetch, Callable[[], Awaitable[None]]]:
    """``(fetch, close)`` over the KV blocks' Redis of ``cfg`` (a DataPlaneConfig):
    its ``kv_redis`` if set, else ``redis``."""
    import os

    from deployments.dataplane.keys import kv_roots_key
    from deployments.dataplane.redis_store import _client

    client = _client(cfg.kv_redis or cfg.redis, os.environ)

    async def fetch(tenant: str, since: float, limit: int) -> list[tuple[str, float]]:
        low = "-inf" if since == float("-inf") else repr(since)
        rows = await client.zrangebyscore(kv_roots_key(tenant), low, "+inf", start=0, num=limit, withscores=True)
        return [(r.decode() if isinstance(r, bytes) else r, float(s)) for r, s in rows]

    async def close() -> None:
        await client.aclose()

    return fetch, close
